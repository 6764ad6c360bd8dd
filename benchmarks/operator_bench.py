"""The operator's figures: scale-from-zero latency, cost while many runs progress, idle load.

    python -m benchmarks.operator_bench [--runs 1000] [--admin-url URL]
                                        [--only scale,real,many,idle]

Runs ``agentrun operator`` (a real process, kopf) against the kmock API emulator (in this
process, the one the tests use) and a throwaway database:

* scale from zero: a Deployment at 0 replicas; a pending run is inserted (the store's NOTIFY path,
  as when an AgentRun's create handler commits it) and the clock stops when the emulator holds
  the Deployment's new replica count. Also measured from ``kubectl apply`` of an AgentRun (kopf's
  create handler first). Goal: < 2 s (KEDA polls every 30 s by default).
* scale from zero on a real API server (``scale_from_zero_real``): kube-apiserver,
  kube-controller-manager and etcd v1.36 (tests/realkube.py: shared/k8s/control-plane.sh, or
  AGENTRUN_TEST_KUBECONFIG), the chart ``helm install``-ed, the operator authenticated with the
  chart's own operator ServiceAccount token. Clock from the AgentRun's create through the API (what
  ``kubectl apply`` sends; a few trials with the real ``kubectl apply -f -`` binary too) or from a
  pending run's insert, until a GET of the Deployment (every 2 ms) shows ``spec.replicas >= 1``.
  The emulator version runs in the same process, its trials interleaved with the real ones, as
  the baseline: the figure is the ratio real/emulator. Without an API server it says why.
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
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import yaml
from tests.helmtools import kubectl
from tests.kubekit import KubeCluster, Operators, agent_manifest, agentrun_manifest

from agentrun.manifests import AgentSpec
from agentrun.store import Store
from benchmarks.throwaway_db import throwaway_database

ROOT = Path(__file__).resolve().parent.parent

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
#: The operator's settings in every benchmark here (the emulator's and the real API server's).
SCALE_ENV = {"AGENTRUN_RESYNC_INTERVAL": "10", "AGENTRUN_SCALE_INTERVAL": "10"}


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
        what
        for what, agent, _ in cluster.emulator.calls[since:]
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
            op = ops.start(pools=[POOL], env={**SCALE_ENV, **env})
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


# -- scale from zero on a real API server --------------------------------------------------------

#: The trials of ``scale_from_zero_real`` by preset: through the API, with the kubectl binary,
#: by a pending run's insert (the emulator baseline repeats the API and insert trials).
REAL_TRIALS = {"small": (10, 3, 10), "large": (20, 5, 20)}
INLINE_AGENT = {"model": "claude-sonnet-4-5"}
POLL_EVERY = 0.002


@dataclass
class _Target:
    """One server the trials run against: how to read the worker Deployment's replicas, how to
    create an AgentRun through the API, and the store of its operator's database."""

    name: str
    replicas: Callable[[], int]
    create: Callable[[dict[str, Any]], Any]
    store: Store | None = None
    kubectl: list[str] | None = None  # argv of ``kubectl apply -f -`` (real server only)
    url: str = ""


@dataclass
class _SaKubeconfig:
    """What kubekit.Operators asks of a cluster: a kubeconfig (here the operator SA's)."""

    path: Path

    def kubeconfig(self, directory: Path) -> Path:
        return self.path


async def _cancel_pending(store: Store) -> None:
    async with store.pool.connection() as conn:
        cur = await conn.execute("SELECT id FROM agent_run WHERE status = 'pending'")
        ids = [r[0] for r in await cur.fetchall()]
    for rid in ids:
        await store.cancel(rid)


def _apply_and_wait(t: _Target, name: str, via_kubectl: bool) -> tuple[float, float | None]:
    """Create AgentRun ``name`` (through the API, or with the kubectl binary) and poll until the
    Deployment has a replica: (seconds to the scale, seconds kubectl took until it exited)."""
    manifest = agentrun_manifest(name, agent=INLINE_AGENT)
    if not via_kubectl:
        t0 = time.perf_counter()
        t.create(manifest)
        wait(lambda: t.replicas() >= 1, 15, f"{t.name}: scale up", POLL_EVERY)
        return time.perf_counter() - t0, None
    assert t.kubectl is not None
    # kubectl reads the manifest from its stdin (``-f -``), a file written before the clock starts.
    with tempfile.TemporaryFile("w+") as stdin:
        stdin.write(yaml.safe_dump(manifest))
        stdin.seek(0)
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            t.kubectl, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    exited: float | None = None
    try:

        def scaled() -> bool:
            nonlocal exited
            if exited is None and proc.poll() is not None:
                exited = time.perf_counter() - t0
            return t.replicas() >= 1

        wait(scaled, 15, f"{t.name}: scale up", POLL_EVERY)
        took = time.perf_counter() - t0
    finally:
        _, err = proc.communicate(timeout=60)
    if exited is None:
        exited = time.perf_counter() - t0  # it exited after the scale was seen
    if proc.returncode != 0:
        raise RuntimeError(f"kubectl apply failed ({proc.returncode}): {err.strip()}")
    return took, exited


async def _trial(t: _Target, how: str, n: int) -> tuple[float, float | None]:
    """One scale from zero of ``t`` (``how``: api, kubectl or insert), then the run cancelled."""
    assert t.store is not None
    await asyncio.to_thread(wait, lambda: t.replicas() == 0, 60, f"{t.name}: scaled to zero", 0.02)
    await asyncio.sleep(0.3)
    if how == "insert":
        t0 = time.perf_counter()
        await t.store.create_run("bench", AGENT, pool="default")
        await asyncio.to_thread(
            wait, lambda: t.replicas() >= 1, 15, f"{t.name}: scale up", POLL_EVERY
        )
        took: tuple[float, float | None] = (time.perf_counter() - t0, None)
    else:
        took = await asyncio.to_thread(_apply_and_wait, t, f"zero-{how}-{n}", how == "kubectl")
    await _cancel_pending(t.store)
    return took


def _stats(prefix: str, secs: list[float]) -> dict[str, Any]:
    ms = [s * 1000 for s in secs]
    return {
        f"{prefix}_ms_p50": round(statistics.median(ms), 1),
        f"{prefix}_ms_max": round(max(ms), 1),
        f"{prefix}_ms_trials": [round(x, 1) for x in ms],
    }


async def _real_vs_emulator(
    real: _Target, emu: _Target, api_n: int, kubectl_n: int, insert_n: int
) -> dict[str, Any]:
    stores = []
    try:
        for t in (real, emu):
            t.store = await Store.open(t.url)
            stores.append(t.store)
        # Not counted: the first AgentRun of each server (kopf's watch, connections, caches).
        for t in (real, emu):
            await _trial(t, "api", 0)
        secs: dict[str, list[float]] = {}
        kubectl_exit: list[float] = []
        for how, n, targets in (
            ("api", api_n, (real, emu)),
            ("insert", insert_n, (real, emu)),
            ("kubectl", kubectl_n, (real,)),
        ):
            for i in range(1, n + 1):
                shown = []
                for t in targets:  # interleaved: the two servers share the machine's noise
                    took, exited = await _trial(t, how, i)
                    secs.setdefault(f"{t.name}_{how}", []).append(took)
                    shown.append(f"{t.name} {took * 1000:.0f} ms")
                    if exited is not None:
                        kubectl_exit.append(exited)
                        shown.append(f"kubectl exited after {exited * 1000:.0f} ms")
                print(f"  scale from zero via {how}, trial {i}/{n}: {', '.join(shown)}", flush=True)
    finally:
        for s in stores:
            await s.close()
    out: dict[str, Any] = {}
    for key, prefix in (
        ("real_api", "scale_from_zero_real_apply"),
        ("real_kubectl", "scale_from_zero_real_kubectl"),
        ("real_insert", "scale_from_zero_real_insert"),
        ("emulator_api", "scale_from_zero_emulator_apply"),
        ("emulator_insert", "scale_from_zero_emulator_insert"),
    ):
        if secs.get(key):
            out.update(_stats(prefix, secs[key]))
    if kubectl_exit:
        out["kubectl_exit_ms_trials"] = [round(x * 1000, 1) for x in kubectl_exit]
    for key, how in (("ratio_vs_emulator", "apply"), ("ratio_vs_emulator_insert", "insert")):
        real_ms = out.get(f"scale_from_zero_real_{how}_ms_p50")
        emu_ms = out.get(f"scale_from_zero_emulator_{how}_ms_p50")
        if real_ms and emu_ms:
            out[key] = round(real_ms / emu_ms, 2)
    out["trials"] = {"api": api_n, "kubectl": kubectl_n, "insert": insert_n}
    return out


def _control_plane(workdir: Path) -> Any:
    """tests/realkube.start_control_plane, with its pytest skip/fail turned into an exception."""
    import pytest
    from tests.realkube import start_control_plane

    try:
        return start_control_plane(workdir)
    except (pytest.skip.Exception, pytest.fail.Exception) as exc:  # BaseException subclasses
        raise RealApiUnavailable(str(exc.msg or exc)) from None


class RealApiUnavailable(Exception):
    pass


def scale_from_zero_real(preset: str = "small", admin_url: str | None = None) -> dict[str, Any]:
    """Scale from zero on a real API server, with the emulator as the baseline in this process.

    A dict with ``scale_from_zero_real_apply_ms_p50``/``_max`` (from the AgentRun's create),
    ``..._kubectl_...`` (the kubectl binary), ``..._insert_...`` (a pending run inserted), the
    emulator's ``scale_from_zero_emulator_*`` and ``ratio_vs_emulator`` (real/emulator p50, AgentRun
    created through the API; ``ratio_vs_emulator_insert`` for the insert); or ``skipped`` with the
    reason when no API server can be had."""
    from tests.realkube import Kube, apply_crds, install_chart, new_namespace

    api_n, kubectl_n, insert_n = REAL_TRIALS.get(preset, REAL_TRIALS["small"])
    with contextlib.ExitStack() as stack:
        d = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="opbench-real-")))
        t0 = time.monotonic()
        try:
            cp = _control_plane(d / "k8s")
        except RealApiUnavailable as exc:
            print(f"  real API server unavailable: {exc}", flush=True)
            return {"skipped": f"no real API server: {exc}"}
        if cp.stop is not None:
            stack.callback(cp.stop)  # stops etcd, kube-apiserver, kube-controller-manager by pid
        admin = Kube(cp.kubeconfig)
        stack.callback(admin.close)
        version = (admin.get("/version") or {}).get("gitVersion", "?")
        print(f"  control plane {version} up in {time.monotonic() - t0:.0f} s", flush=True)
        apply_crds(admin)
        ns = new_namespace(admin)
        kube = Kube(cp.kubeconfig, ns)
        stack.callback(kube.close)
        if cp.stop is None:  # a cluster of the user's: remove what we made in it
            stack.callback(admin.request, "DELETE", f"/api/v1/namespaces/{ns}")
        release = install_chart(kube, ns, f"operator.watchNamespaces={{{ns}}}")
        if cp.stop is None:
            stack.callback(
                kube.helm, "uninstall", release.name, "-n", ns, "--wait=false", check=False
            )
        workers = release.worker_deployment()
        chart_pools = yaml.safe_load(release.pools_file(d).read_text())["pools"]
        pools = [{**p, "scaleDownDelaySeconds": 0} for p in chart_pools]
        sa_kubeconfig = release.kubeconfig_for(release.operator_sa, d)
        url = stack.enter_context(throwaway_database("opbench_real", admin_url))
        opdir = d / "operator"
        opdir.mkdir()
        ops = Operators(_SaKubeconfig(sa_kubeconfig), url, opdir)  # type: ignore[arg-type]
        stack.callback(ops.stop_all)  # by pid
        op = ops.start(pools=pools, env={**SCALE_ENV, "AGENTRUN_WATCH_NAMESPACES": ns})
        wait(lambda: op.metric("agentrun_operator_db_up") == 1, 60, "operator ready", 0.05)

        def real_replicas() -> int:
            dep = kube.deployment(workers) or {}
            return int(dep.get("spec", {}).get("replicas") or 0)

        real = _Target(
            "real",
            real_replicas,
            kube.apply_agentrun,
            url=url,
            kubectl=[
                str(kubectl()),
                "--kubeconfig",
                str(kube.kubeconfig),
                "--cache-dir",
                str(kube.cache_dir),
                "-n",
                ns,
                "apply",
                "-f",
                "-",
            ],
        )
        kube.kubectl("get", "agentruns")  # kubectl's discovery cache warm, as a user's would be
        cluster, emu_url, _ = stack.enter_context(operator_on_emulator("opbench", admin_url))
        emu = _Target("emulator", lambda: replicas(cluster), cluster.apply_agentrun, url=emu_url)
        print(
            f"  operator on {version} (namespace {ns}, Deployment {workers}) and on the "
            "emulator ready",
            flush=True,
        )
        out = asyncio.run(_real_vs_emulator(real, emu, api_n, kubectl_n, insert_n))
        log = op.output()
        if "Forbidden" in log or " 403" in log:
            out["warning"] = "the operator logged a Forbidden (the chart's RBAC)"
        out["api_server"] = version
        return out


async def _progress(url: str, n: int, steps: int) -> None:
    store = await Store.open(url, max_size=16, lease_ttl=600)
    try:
        claimed = []
        while len(claimed) < n:
            got = (await store.claim("default", "bench-worker", limit=100)).claimed
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
    """Statements per minute an idle operator sends to its (otherwise unused) database:
    ``pg_stat_statements`` calls where the server preloads it (the report's own server), with
    each statement's share; else committed transactions (pg_stat_database, flushed lazily)."""
    from benchmarks.fleet_bench import _has_pg_stat_statements, _statements

    # The default metrics interval (the kubekit's 1 s is for tests): an idle operator as deployed.
    with operator_on_emulator("opidle", url, AGENTRUN_METRICS_INTERVAL="300") as (_, db, _op):
        time.sleep(2)  # past the startup's resync and first tick
        name = psycopg.conninfo.conninfo_to_dict(db)["dbname"]
        admin = psycopg.conninfo.make_conninfo(db, dbname="postgres")
        if _has_pg_stat_statements(admin):
            before = _statements(admin, name)
            # Between the first and the last change seen: a 10 s window holds one tick or two
            # by its phase alone, so a short one measured end to end reads 6 or 12 a minute.
            seen: list[tuple[float, int]] = []
            start = time.monotonic()
            while time.monotonic() - start < seconds:
                n = sum(_statements(admin, name).values())
                if not seen or n != seen[-1][1]:
                    seen.append((time.monotonic(), n))
                time.sleep(0.25)
            after = _statements(admin, name)
            calls = {q: n - before.get(q, 0) for q, n in after.items() if n > before.get(q, 0)}
            by = {" ".join(q.split())[:70]: n for q, n in calls.items()}
            (t0, c0), (t1, c1) = seen[1] if len(seen) > 2 else seen[0], seen[-1]
            per_min = ((c1 - c0) / (t1 - t0) * 60 if t1 - t0 >= 5
                       else sum(calls.values()) / seconds * 60)
            return {"queries_per_minute": per_min, "seconds": seconds,
                    "method": "pg_stat_statements", "statements": by}

        def commits() -> int:
            with psycopg.connect(db, autocommit=True) as c:
                c.execute("SELECT pg_stat_clear_snapshot()")
                row = c.execute(
                    "SELECT xact_commit FROM pg_stat_database WHERE datname = %s", (name,)
                ).fetchone()
            return int(row[0]) if row else 0

        before_x = commits()
        time.sleep(seconds)
        after_x = commits()
        # Our own two probes commit one transaction each.
        per_min = max(0, after_x - before_x - 1) / seconds * 60
        return {"operator_idle_xact_per_min": per_min, "seconds": seconds}


PARTS = ("scale", "real", "many", "idle")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--preset", choices=["small", "large"], default="small")
    ap.add_argument("--idle-seconds", type=float, default=30)
    ap.add_argument("--admin-url")
    ap.add_argument(
        "--only",
        help=f"comma-separated parts (default: all): {', '.join(PARTS)} "
        "(real: scale from zero on a real API server, the emulator as baseline)",
    )
    ap.add_argument("--json", help="also write the results to this JSON file")
    args = ap.parse_args()
    only = set(args.only.split(",")) if args.only else set(PARTS)
    if only - set(PARTS):
        ap.error(f"unknown part(s): {', '.join(sorted(only - set(PARTS)))}")
    results: dict[str, Any] = {}
    if "scale" in only:
        print("scale from zero ...", flush=True)
        results["scale"] = scale_from_zero(args.preset, args.admin_url)
        print(json.dumps(results["scale"], indent=1), flush=True)
    if "real" in only:
        print("scale from zero on a real API server (the emulator as baseline) ...", flush=True)
        results["real"] = scale_from_zero_real(args.preset, args.admin_url)
        print(json.dumps(results["real"], indent=1), flush=True)
    if "many" in only:
        print(f"{args.runs} runs progressing ...", flush=True)
        results["many"] = many_runs(args.runs, args.admin_url)
        print(json.dumps(results["many"], indent=1), flush=True)
    if "idle" in only:
        print("idle ...", flush=True)
        results["idle"] = idle_queries(args.admin_url, args.idle_seconds)
        print(json.dumps(results["idle"], indent=1), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
