"""Worker CPU per step (issue 17: goal ≤ 0.75 ms at 16 runs per worker, ≥ 2x steps/s).

    python -m benchmarks.cpu_bench [--runs 16] [--turns 10] [--rounds 5] [--json FILE]

One worker's RunExecutor in this process, ``--runs`` runs claimed together and advanced
concurrently on one event loop, as ``agentrun worker`` does with 16 slots, against the scripted
model at zero delay in a process of its own and PostgreSQL in its own: this process's CPU time
(``time.process_time``, every thread of it) is the worker's. Logging is set up as the worker's
(JSON at INFO) into /dev/null, so a line per step costs what it costs in a pod.

The variants, interleaved round by round so that all see the same machine:

* ``sdk`` (the baseline): the SDK's default transport (httpx), the stream read through the SDK's
  events (``RAW_STREAM`` off) and the per-turn log line emitted (its logger at DEBUG), every
  object walked by the collector's full passes (``gc.unfreeze``): the worker before issue 17's
  CPU work;
* ``sdk_quiet``: the same, the per-turn line at DEBUG (the log lever alone);
* ``raw_httpx``: the stream read straight into the stored dicts (the history's JSON kept from
  turn to turn, model_call.BodyTexts), no per-turn line, the start-up objects frozen as the
  worker freezes them (providers.freeze_startup_objects), over httpx (the transport lever left
  out);
* ``raw``: the worker as shipped: the same over the SDK's aiohttp transport (worker/client.py).

A step is a committed step of the log (a model turn or a tool result). Figures: the median over
rounds of CPU ms per step and steps per second, min and max, and the ratios to ``sdk``.

Importable: :func:`cpu_bench` returns a dict.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agentrun.logs import setup_logging
from agentrun.store import Store
from agentrun.worker import model_call
from agentrun.worker.client import AsyncAnthropic, client_options
from agentrun.worker.executor import RunExecutor, RunHandle
from agentrun.worker.health import Health, WorkerMetrics
from agentrun.worker.providers import Providers, freeze_startup_objects
from agentrun.worker.settings import MODEL_TRANSPORTS, RetryPolicy
from benchmarks.scratch import scratch_dir
from benchmarks.worker_bench import (
    AGENT,
    REGISTRY,
    Progress,
    _quiet,
    fake_server,
    scenario,
    scenario_file,
)

VARIANTS = ("sdk", "sdk_quiet", "raw_httpx", "raw")
TURN_LOGGER = "agentrun.worker.run"  # the executor's, which logs "seq %d: model turn committed"


def _transport(variant: str) -> str:
    return "aiohttp" if variant == "raw" else "httpx"


def _configure(variant: str) -> None:
    model_call.RAW_STREAM = variant.startswith("raw")
    # The start-up objects out of the collector's passes, as `agentrun worker` leaves them once
    # the SDK is in (worker/providers.py), for the raw variants; back in for the SDK's.
    if variant.startswith("raw"):
        freeze_startup_objects()
    else:
        gc.unfreeze()
    # The baseline emits the per-turn line it had at INFO: the same record, one level lower.
    logging.getLogger(TURN_LOGGER).setLevel(logging.DEBUG if variant == "sdk" else logging.NOTSET)


async def _round(store: Store, executor: RunExecutor, runs: int, pool: str) -> tuple[int, float,
                                                                                      float]:
    """Steps committed, CPU seconds and wall seconds of ``runs`` runs advanced together."""
    for i in range(runs):
        await store.create_run(f"cpu bench {i}", AGENT, pool=pool)
    claimed = (await store.with_lease_ttl(120).claim(pool, "cpu-bench", runs)).claimed
    assert len(claimed) == runs, len(claimed)
    handles = [RunHandle(run, lease, lease_ttl=120) for run, lease in claimed]
    cpu0, wall0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(executor.advance(h) for h in handles))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    steps = 0
    for h in handles:
        got = await store.get_run(h.run.id)
        assert got.status == "succeeded", (got.status, got.error)
        steps += len(await store.steps(h.run.id))
    return steps, cpu, wall


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


async def run_bench(url: str, base_url: str, runs: int, rounds: int,
                    progress: Progress = _quiet) -> dict[str, Any]:
    # The worker's own client (anthropic_client's, less the key from the environment).
    clients = {t: AsyncAnthropic(base_url=base_url, api_key="bench", transport=t,
                                 **client_options(traced=False))
               for t in MODEL_TRANSPORTS}
    store = await Store.open(url, max_size=max(4, runs))
    metrics = WorkerMetrics()
    executors = {t: RunExecutor(store, Providers(default=c), REGISTRY, metrics,
                                Health(60, metrics), RetryPolicy(), is_draining=lambda: False)
                 for t, c in clients.items()}
    per: dict[str, dict[str, list[float]]] = {v: {"cpu_ms": [], "sps": []} for v in VARIANTS}
    try:
        for variant in VARIANTS:  # warm up: imports, connections, caches
            _configure(variant)
            await _round(store, executors[_transport(variant)], runs, "cpu-warm")
        for r in range(rounds):
            order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
            for variant in order:
                _configure(variant)
                pool = "cpu-" + variant.replace("_", "-")  # a pool name is a DNS label
                steps, cpu, wall = await _round(store, executors[_transport(variant)], runs, pool)
                per[variant]["cpu_ms"].append(cpu * 1000 / steps)
                per[variant]["sps"].append(steps / wall)
                progress(f"round {r + 1} {variant}: {cpu * 1000 / steps:.3f} ms CPU/step, "
                         f"{steps / wall:.0f} steps/s")
    finally:
        _configure("raw")
        gc.unfreeze()  # this process is no worker (the report goes on in it)
        await store.close()
        for c in clients.values():
            await c.close()
    out: dict[str, Any] = {"runs": runs, "rounds": rounds}
    for v in VARIANTS:
        out[v] = {"cpu_ms_per_step": _stats(per[v]["cpu_ms"]),
                  "steps_per_s": _stats(per[v]["sps"])}
    base = out["sdk"]
    for v in VARIANTS[1:]:
        out[v]["cpu_ratio"] = (out[v]["cpu_ms_per_step"]["median"]
                               / base["cpu_ms_per_step"]["median"])
        out[v]["steps_per_s_ratio"] = (out[v]["steps_per_s"]["median"]
                                       / base["steps_per_s"]["median"])
    return out


@contextlib.contextmanager
def _worker_logging() -> Iterator[None]:
    """The worker's logging (JSON at INFO) into /dev/null, and the caller's back after (the
    report runs other sections in this process)."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    with open(os.devnull, "w") as sink:
        setup_logging("json", "INFO")
        for handler in root.handlers:
            if isinstance(handler, logging.StreamHandler):
                handler.setStream(sink)
        try:
            yield
        finally:
            root.handlers[:], root.level = saved[0], saved[1]


async def cpu_bench(url: str, runs: int = 16, turns: int = 10, rounds: int = 5,
                    progress: Progress = _quiet) -> dict[str, Any]:
    with scratch_dir("agentrun-cpu-") as tmp:
        with _worker_logging(), fake_server(scenario_file(tmp, "cpu", scenario(turns))) as base_url:
            out = await run_bench(url, base_url, runs, rounds, progress)
        out["turns"] = turns
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--runs", type=int, default=16)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--admin-url", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from benchmarks.throwaway_db import throwaway_database

    with throwaway_database("agentrun_cpu_bench", args.admin_url) as url:
        out = asyncio.run(cpu_bench(url, args.runs, args.turns, args.rounds,
                                    lambda m: print(m, file=sys.stderr)))
    for v in VARIANTS:
        c, s = out[v]["cpu_ms_per_step"], out[v]["steps_per_s"]
        extra = (f"  x{out[v]['cpu_ratio']:.2f} CPU, x{out[v]['steps_per_s_ratio']:.2f} steps/s"
                 if v != "sdk" else "")
        print(f"{v:10s} {c['median']:.3f} ms CPU/step [{c['min']:.3f}-{c['max']:.3f}]  "
              f"{s['median']:.0f} steps/s [{s['min']:.0f}-{s['max']:.0f}]{extra}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
