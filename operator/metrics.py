"""The operator's Prometheus metrics (served on AGENTRUN_METRICS_PORT at /metrics)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import UTC, datetime

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from agentrun.errors import ConfigError
from agentrun.metrics import register_standard_collectors
from agentrun.store import PoolDepth


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        register_standard_collectors(r)
        self.runs = Gauge(
            "agentrun_runs", "Runs by status and pool (recounted on a timer)",
            ["pool", "status"], registry=r,
        )
        self.oldest_pending = Gauge(
            "agentrun_oldest_pending_seconds",
            "Age of the oldest pending run per pool (0: none pending); alert when it grows",
            ["pool"], registry=r,
        )
        self.run_steps = Histogram(
            "agentrun_run_steps", "Steps of finished runs", ["pool"], registry=r,
            buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000),
        )
        self.run_attempts = Histogram(
            "agentrun_run_attempts", "Claims of finished runs (1: never resumed)", ["pool"],
            registry=r, buckets=(1, 2, 3, 4, 5, 6, 8, 10, 20, 50),
        )
        self.run_cost = Histogram(
            "agentrun_run_cost_usd",
            "Estimated US dollars of finished runs (each turn priced by its worker's table)",
            ["pool"], registry=r,
            buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100),
        )
        self.scaling_decisions = Counter(
            "agentrun_scaling_decisions", "Deployment scale patches", ["pool", "direction"],
            registry=r,
        )
        self.desired_replicas = Gauge(
            "agentrun_pool_desired_replicas", "Replicas the autoscaler wants per pool", ["pool"],
            registry=r,
        )
        self.status_patches = Counter(
            "agentrun_status_patches", "AgentRun .status patches sent", registry=r
        )
        self.kube_calls = Counter(
            "agentrun_kube_api_calls", "Kubernetes API calls made outside kopf", ["verb"],
            registry=r,
        )
        self.events = Counter(
            "agentrun_events", "Kubernetes Events posted", ["reason"], registry=r
        )
        self.db_up = Gauge(
            "agentrun_operator_db_up", "1 while the operator reaches PostgreSQL", registry=r
        )
        self.notifications = Counter(
            "agentrun_operator_notifications", "Run notifications received", registry=r
        )
        self.ticks = Counter(
            "agentrun_operator_ticks",
            "Ticks done: one probe query each, a resync only when it saw the live runs change",
            registry=r,
        )
        self.resyncs = Counter(
            "agentrun_operator_resyncs",
            "Resyncs done: every live run compared with its object (and queued if behind)",
            registry=r,
        )

    def observe_depths(self, depths: Mapping[str, PoolDepth | None]) -> None:
        """agentrun_oldest_pending_seconds for these pools (0: nothing pending)."""
        now = datetime.now(UTC)
        for pool, d in depths.items():
            age = (now - d.oldest_pending).total_seconds() if d and d.oldest_pending else 0.0
            self.oldest_pending.labels(pool).set(max(0.0, age))

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        try:
            start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            # `agentrun operator` checked the port before kopf started; this is it being taken
            # since. One line for the log, not an OSError's errno and traceback.
            reason = os.strerror(exc.errno).lower() if exc.errno else str(exc)
            raise ConfigError(
                f"--metrics-port {port} (AGENTRUN_METRICS_PORT): cannot listen on {host} "
                f"({reason}); free it or choose another port (-1 turns it off)"
            ) from None
