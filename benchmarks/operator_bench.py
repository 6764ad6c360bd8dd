"""The operator's figures: scale-from-zero latency, cost while many runs progress, idle load.

    python -m benchmarks.operator_bench [--runs 1000] [--trials 10] [--admin-url URL]

Runs ``agentrun operator`` (a real process, kopf) against the kmock API emulator (in this
process, the one the tests use) and a throwaway database:

* scale from zero: a Deployment at 0 replicas; a pending run is inserted (the store's NOTIFY path,
  as when an AgentRun's create handler commits it) and the clock stops when the emulator holds
  the Deployment's new replica count. Also measured from ``kubectl apply`` of an AgentRun (kopf's
  create handler first). Goal: < 2 s (KEDA polls every 30 s by default).
* N runs progressing: N AgentRuns applied, then each run claimed, given 5 steps and finished
  through store calls (as workers would); the operator's CPU time (/proc/PID/stat) and the API
  calls it made (counted by the emulator, by verb) are reported for the whole episode.
* idle load: transactions per minute the operator commits on its database while nothing happens
  (pg_stat_database.xact_commit; only the operator uses that database meanwhile).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from kubekit import KubeCluster, Operators, agent_manifest, agentrun_manifest  # noqa: E402

from agentrun.manifests import AgentSpec  # noqa: E402
from agentrun.store import Store  # noqa: E402
from benchmarks.throwaway_db import throwaway_database  # noqa: E402

AGENT = AgentSpec(model="claude-sonnet-4-5", system="bench", tools=[])
POOL = {
    "name": "default",
    "namespace": "default",
    "deployment": "workers",
    "runsPerWorker": 1000,
    "minReplicas": 0,
    "maxReplicas": 10,
    "scaleDownDelaySeconds": 0,
}
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


def replicas(cluster: KubeCluster) -> int:
    d = cluster.deployment("workers") or {}
    return int(d.get("spec", {}).get("replicas") or 0)


def wait(pred: Any, within: float, what: str, every: float = 0.002) -> None:
    deadline = time.monotonic() + within
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(every)


def api_calls(cluster: KubeCluster, since: int) -> Counter[str]:
    """The operator's API calls since call ``since``, by verb and resource (the benchmark's own
    requests, sent with urllib, are left out by their User-Agent)."""
    assert cluster.emulator is not None
    return Counter(
        what for what, agent, _ in cluster.emulator.calls[since:]
        if not agent.startswith("Python-urllib")
    )


@contextlib.contextmanager
def operator_on_emulator(
    prefix: str, admin_url: str | None, **env: str
) -> Iterator[tuple[KubeCluster, str, Any]]:
    """A throwaway database, the emulator with a worker Deployment at 0 replicas, and a ready
    ``agentrun operator`` scaling it; all stopped (by pid) and dropped afterwards."""
    with throwaway_database(prefix, admin_url) as url, tempfile.TemporaryDirectory() as d:
        cluster = KubeCluster().start()
        ops = Operators(cluster, url, Path(d))
        try:
            cluster.create_deployment("workers", replicas=0)
            op = ops.start(pools=[POOL], env={
                "AGENTRUN_RESYNC_INTERVAL": "10", "AGENTRUN_SCALE_INTERVAL": "5", **env})
            wait(lambda: op.metric("agentrun_operator_db_up") == 1, 60, "operator ready", 0.05)
            yield cluster, url, op
        finally:
            ops.stop_all()
            cluster.stop()


async def _scale_trials(url: str, cluster: KubeCluster, trials: int) -> dict[str, Any]:
    store = await Store.open(url)
    out: list[float] = []
    via_apply: list[float] = []
    try:
        for i in range(trials):
            await asyncio.to_thread(wait, lambda: replicas(cluster) == 0, 30, "scaled to zero")
            await asyncio.sleep(0.3)
            t0 = time.perf_counter()
            run, _ = await store.create_run("bench", AGENT, pool="default")
            await asyncio.to_thread(wait, lambda: replicas(cluster) >= 1, 10, "scale up")
            out.append(time.perf_counter() - t0)
            await store.cancel(run.id)
            print(f"  scale from zero, trial {i + 1}/{trials}: {out[-1] * 1000:.0f} ms", flush=True)
        for i in range(min(3, trials)):
            await asyncio.to_thread(wait, lambda: replicas(cluster) == 0, 30, "scaled to zero")
            await asyncio.sleep(0.3)
            t0 = time.perf_counter()
            cluster.apply_agentrun(agentrun_manifest(f"zero-{i}", agent={"model": "m"}))
            await asyncio.to_thread(wait, lambda: replicas(cluster) >= 1, 10, "scale up")
            via_apply.append(time.perf_counter() - t0)
            async with store.pool.connection() as conn:
                await conn.execute(
                    "UPDATE agent_run SET status = 'cancelled' WHERE status = 'pending'"
                )
    finally:
        await store.close()
    return {
        "scale_from_zero_ms_p50": statistics.median(out) * 1000,
        "scale_from_zero_ms_max": max(out) * 1000,
        "scale_from_zero_via_apply_ms_p50": statistics.median(via_apply) * 1000,
        "trials": trials,
    }


def scale_from_zero(preset: str = "small", admin_url: str | None = None) -> dict[str, Any]:
    trials = 5 if preset == "small" else 20
    with operator_on_emulator("opbench", admin_url) as (cluster, url, _):
        return asyncio.run(_scale_trials(url, cluster, trials))


async def _progress(url: str, n: int, steps: int) -> None:
    store = await Store.open(url, max_size=16)
    try:
        claimed = []
        while len(claimed) < n:
            got = (await store.claim("default", "bench-worker", limit=100, ttl=600)).claimed
            if not got:
                await asyncio.sleep(0.05)
                continue
            claimed += got

        async def advance(lease: Any) -> None:
            for seq in range(steps):
                await store.append_step(
                    lease,
                    seq,
                    "model_turn",
                    {"content": []},
                    input_tokens=10,
                    output_tokens=2,
                    ttl=600,
                )
            await store.finish(lease, "succeeded", result="ok")

        sem = asyncio.Semaphore(16)

        async def one(lease: Any) -> None:
            async with sem:
                await advance(lease)

        await asyncio.gather(*(one(lease) for _, lease in claimed))
    finally:
        await store.close()


def many_runs(n: int = 1000, admin_url: str | None = None, steps: int = 5) -> dict[str, Any]:
    with operator_on_emulator("opbench", admin_url) as (cluster, url, op):
        pid = op.popen.pid
        cluster.apply_agent(agent_manifest())
        cpu0, t0 = cpu_seconds(pid), time.monotonic()
        assert cluster.emulator is not None
        calls0 = len(cluster.emulator.calls)
        for i in range(n):
            cluster.apply_agentrun(agentrun_manifest(f"r{i:05d}"))
        print(f"  applied {n} AgentRuns", flush=True)

        def created() -> bool:
            with psycopg.connect(url) as c:
                row = c.execute("SELECT count(*) FROM agent_run").fetchone()
            return bool(row and row[0] >= n)

        wait(created, 600, "runs created", 0.2)
        created_at = time.monotonic()
        print(f"  {n} runs created by the operator in {created_at - t0:.1f} s", flush=True)
        asyncio.run(_progress(url, n, steps))
        print(f"  {n} runs x {steps} steps committed and finished", flush=True)

        def mirrored() -> bool:
            return all(
                ((cluster.agentrun(f"r{i:05d}") or {}).get("status") or {}).get("phase")
                == "succeeded"
                for i in range(0, n, max(1, n // 50))
            )

        wait(mirrored, 600, "statuses mirrored", 0.5)
        wait(lambda: replicas(cluster) == 0, 60, "scaled back to zero", 0.2)
        elapsed = time.monotonic() - t0
        cpu = cpu_seconds(pid) - cpu0
        by = api_calls(cluster, calls0)
        total = sum(by.values())
        return {
            "runs": n,
            "steps_per_run": steps,
            "elapsed_s": elapsed,
            "operator_cpu_s": cpu,
            "operator_cpu_ms_per_run": cpu / n * 1000,
            "api_calls_by_operator": total,
            "api_calls_per_run": total / n,
            "api_calls_breakdown": dict(by.most_common(12)),
            "status_patches": op.metric("agentrun_status_patches_total"),
        }


def idle_queries(url: str | None = None, seconds: float = 30.0) -> dict[str, Any]:
    """Transactions per minute an idle operator commits on its (otherwise unused) database."""
    with operator_on_emulator("opidle", url, AGENTRUN_METRICS_INTERVAL="30") as (_, db, _op):
        time.sleep(2)
        name = psycopg.conninfo.conninfo_to_dict(db)["dbname"]

        def commits() -> int:
            with psycopg.connect(db, autocommit=True) as c:
                c.execute("SELECT pg_stat_clear_snapshot()")
                row = c.execute(
                    "SELECT xact_commit FROM pg_stat_database WHERE datname = %s", (name,)
                ).fetchone()
            return int(row[0]) if row else 0

        before = commits()
        time.sleep(seconds)
        after = commits()
        # Our own two probes commit one transaction each.
        per_min = max(0, after - before - 1) / seconds * 60
        return {"operator_idle_xact_per_min": per_min, "seconds": seconds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--preset", choices=["small", "large"], default="small")
    ap.add_argument("--idle-seconds", type=float, default=30)
    ap.add_argument("--admin-url")
    ap.add_argument("--json", help="also write the results to this JSON file")
    args = ap.parse_args()
    results: dict[str, Any] = {}
    print("scale from zero ...", flush=True)
    results["scale"] = scale_from_zero(args.preset, args.admin_url)
    print(json.dumps(results["scale"], indent=1), flush=True)
    print(f"{args.runs} runs progressing ...", flush=True)
    results["many"] = many_runs(args.runs, args.admin_url)
    print(json.dumps(results["many"], indent=1), flush=True)
    print("idle ...", flush=True)
    results["idle"] = idle_queries(args.admin_url, args.idle_seconds)
    print(json.dumps(results["idle"], indent=1), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
