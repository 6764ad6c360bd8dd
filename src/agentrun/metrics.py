"""Prometheus helpers the worker and the operator share (core, so neither imports the other)."""

from __future__ import annotations

from prometheus_client import GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry
from prometheus_client.registry import Collector

#: prometheus_client's standard process_*, python_info and python_gc_* collectors. They read
#: the process's own /proc and gc stats, so the default registry's instances are shared: a
#: custom registry (one per worker, for tests running several in one process) registers them too.
STANDARD_COLLECTORS: tuple[Collector, ...] = (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR)


def register_standard_collectors(registry: CollectorRegistry) -> None:
    """process_cpu_seconds_total, process_resident_memory_bytes, ... on this registry."""
    for collector in STANDARD_COLLECTORS:
        registry.register(collector)
