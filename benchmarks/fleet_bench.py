"""Fleet benchmark: real ``agentrun worker`` processes, measured from the outside.

    python -m benchmarks.fleet_bench [--preset small|large] [--json FILE]

1. Throughput: steps committed per second with 1, 4 and 16 concurrent runs per worker and with
   1 and 2 worker processes, against the scripted model server (``agentrun fake-anthropic`` in a
   process of its own) with zero latency. A batch of runs is submitted to workers that are
   already serving; the rate is the batch's ``agent_step`` rows divided by the span between the
   first and the last commit (``created_at``, the database's clock).
2. Idle database load: queries per minute from one idle worker (default settings, no runs), on a
   PostgreSQL server of our own with ``pg_stat_statements`` preloaded (sum of ``calls`` for the
   worker's database after a reset); where that cannot run, the ``xact_commit`` + ``xact_rollback``
   delta of ``pg_stat_database`` for the worker's database (every statement the worker sends is
   its own transaction: the store runs in autocommit), read from another database.
3. Memory: the worker process's resident set (``VmRSS`` in ``/proc/PID/status``) idle, with 1 and
   with 100 held runs (``--concurrency 100``, each run waiting on a model call that takes minutes).
   100 held runs need over 100 connections, more than a shared server may spare, so this too
   runs on a server of our own.

Importable: :func:`throughput`, :func:`idle_worker_load` and :func:`memory` return dicts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import psycopg
import yaml
from psycopg.conninfo import conninfo_to_dict

from agentrun.store import Store
from benchmarks.own_pg import OwnPostgres
from benchmarks.scratch import scratch_dir
from benchmarks.throwaway_db import db_url, fresh_database, throwaway_database
from benchmarks.worker_bench import (
    AGENT,
    Progress,
    _quiet,
    fake_server,
    free_port,
    scenario,
    spawn_worker,
    stop_processes,
    wait_ready,
)

PRESETS: dict[str, dict[str, Any]] = {
    # turns per run; runs per batch = max(min_runs, per_slot * concurrency * workers)
    "small": {"turns": 5, "min_runs": 6, "per_slot": 2, "idle_s": 30, "held": 100},
    "large": {"turns": 10, "min_runs": 16, "per_slot": 4, "idle_s": 120, "held": 100},
}


def _env(url: str, base_url: str) -> dict[str, str]:
    return {
        "AGENTRUN_DATABASE_URL": url,
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": "bench",
    }


# -- 1. throughput ---------------------------------------------------------------------------------


async def _batch(store: Store, url: str, n: int, label: str, within: float = 600) -> dict[str, Any]:
    """Submit ``n`` runs, wait until all finished; rate from the step log's commit times."""
    t0 = time.monotonic()
    ids = [(await store.create_run(f"{label} #{i}", AGENT))[0].id for i in range(n)]
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        while True:
            cur = await conn.execute(
                "SELECT count(*) FILTER (WHERE status IN ('succeeded','failed','cancelled',"
                "'dead_letter')), count(*) FILTER (WHERE status <> 'succeeded'"
                " AND finished_at IS NOT NULL) FROM agent_run WHERE id = ANY(%s)",
                (ids,),
            )
            done, bad = (await cur.fetchone()) or (0, 0)
            if done == n:
                break
            if time.monotonic() - t0 > within:
                raise TimeoutError(f"{label}: {done}/{n} runs finished after {within:.0f} s")
            await asyncio.sleep(0.05)
        wall = time.monotonic() - t0
        cur = await conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE kind = 'model_turn'),"
            " extract(epoch FROM max(created_at) - min(created_at))"
            " FROM agent_step WHERE run_id = ANY(%s)",
            (ids,),
        )
        steps, turns, span = (await cur.fetchone()) or (0, 0, 0)
    if bad:
        raise RuntimeError(f"{label}: {bad} of {n} runs did not succeed")
    span = float(span or 0) or wall
    return {
        "runs": n,
        "steps": int(steps),
        "model_turns": int(turns),
        "span_s": span,
        "wall_s": wall,
        "steps_per_s": steps / span,
        "turns_per_s": turns / span,
    }


async def throughput(
    url: str,
    *,
    concurrencies: Sequence[int] = (1, 4, 16),
    worker_counts: Sequence[int] = (1, 2),
    turns: int = 5,
    min_runs: int = 6,
    per_slot: int = 2,
    progress: Progress = _quiet,
) -> dict[str, Any]:
    """Steps per second for each (workers, concurrency); real worker processes."""
    with scratch_dir("agentrun-bench-fleet-") as tmp:
        path = tmp / "zero.yaml"
        # No thinking blocks: the scripted server then checks no signatures, so less of the two
        # cores goes to the stand-in for the model provider.
        path.write_text(yaml.safe_dump(scenario(turns, thinking=False)))
        cells: list[dict[str, Any]] = []
        store = await Store.open(url, max_size=2)
        try:
            with fake_server(path) as base_url:
                for c in concurrencies:
                    procs: list[subprocess.Popen[bytes]] = []
                    try:
                        for w in range(1, max(worker_counts) + 1):
                            port = free_port()
                            p = spawn_worker(
                                f"tput-c{c}-w{w}",
                                _env(url, base_url),
                                tmp,
                                concurrency=c,
                                health_port=port,
                            )
                            procs.append(p)
                            await wait_ready(p, port)
                            if w not in worker_counts:
                                continue
                            await asyncio.sleep(0.5)  # listeners connected
                            n = max(min_runs, per_slot * c * w)
                            cell = await _batch(store, url, n, f"c{c} w{w}")
                            cell.update(workers=w, concurrency=c)
                            cells.append(cell)
                            progress(
                                f"throughput: {w} worker(s) x {c} concurrent runs: "
                                f"{cell['steps_per_s']:.0f} steps/s "
                                f"({n} runs, {cell['steps']} steps)"
                            )
                    finally:
                        stop_processes(procs)
        finally:
            await store.close()
        return {"turns_per_run": turns, "cells": cells}


# -- 2. idle load ----------------------------------------------------------------------------------


def _has_pg_stat_statements(admin: str) -> bool:
    with psycopg.connect(admin, autocommit=True) as conn:
        row = conn.execute("SHOW shared_preload_libraries").fetchone()
        if not row or "pg_stat_statements" not in row[0]:
            return False
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    return True


def _xacts(admin: str, dbname: str) -> int:
    with psycopg.connect(admin, autocommit=True) as conn:
        row = conn.execute(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s",
            (dbname,),
        ).fetchone()
    return int(row[0]) if row else 0


def _statements(admin: str, dbname: str) -> dict[str, int]:
    with psycopg.connect(admin, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT s.query, sum(s.calls)::bigint FROM pg_stat_statements s"
            " JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = %s GROUP BY s.query",
            (dbname,),
        ).fetchall()
    return {q: int(n) for q, n in rows}


def _reset_statements(admin: str) -> None:
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_statements_reset()")


async def idle_load(url: str, seconds: float, settle: float = 11.0) -> dict[str, Any]:
    """Queries per minute that the database of ``url`` receives over ``seconds``, by every client
    but this function (which reads from the ``postgres`` database). See the module docstring."""
    dbname = str(conninfo_to_dict(url)["dbname"])
    admin = db_url(url, "postgres")
    statements = await asyncio.to_thread(_has_pg_stat_statements, admin)
    # Idle backends flush pending statistics every 10 s or so: the start-up is then counted.
    await asyncio.sleep(settle)
    x0 = await asyncio.to_thread(_xacts, admin, dbname)
    if statements:
        await asyncio.to_thread(_reset_statements, admin)
    t0 = time.monotonic()
    await asyncio.sleep(seconds)
    await asyncio.sleep(1.5)  # let idle backends flush what they did in the window
    elapsed = time.monotonic() - t0 - 1.5
    x1 = await asyncio.to_thread(_xacts, admin, dbname)
    out: dict[str, Any] = {
        "seconds": elapsed,
        "transactions_per_minute": (x1 - x0) * 60 / elapsed,
    }
    if statements:
        by_query = await asyncio.to_thread(_statements, admin, dbname)
        total = sum(by_query.values())
        out.update(
            method="pg_stat_statements",
            queries_per_minute=total * 60 / elapsed,
            by_query={" ".join(q.split())[:120]: n for q, n in by_query.items()},
        )
    else:
        out.update(
            method="pg_stat_database xact_commit + xact_rollback",
            queries_per_minute=out["transactions_per_minute"],
        )
    return out


async def idle_worker_load(url: str, seconds: float, progress: Progress = _quiet) -> dict[str, Any]:
    """One idle ``agentrun worker`` (default settings: 5 s poll, 15 s lease) and no runs."""
    with scratch_dir("agentrun-bench-idle-") as tmp:
        port = free_port()
        env = {"AGENTRUN_DATABASE_URL": url, "ANTHROPIC_API_KEY": "bench"}
        proc = spawn_worker("idle", env, tmp, health_port=port)
        try:
            await wait_ready(proc, port)
            progress(f"idle worker: measuring database load for {seconds:.0f} s")
            out = await idle_load(url, seconds)
            if proc.poll() is not None:
                raise RuntimeError("the idle worker died")
        finally:
            stop_processes([proc])
        progress(f"idle worker: {out['queries_per_minute']:.1f} queries/min ({out['method']})")
        return out


# -- 3. memory -------------------------------------------------------------------------------------


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


async def _held(url: str, owner: str) -> int:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT count(*) FROM agent_run WHERE lease_owner = %s AND status = 'running'",
            (owner,),
        )
        row = await cur.fetchone()
    return int(row[0]) if row else 0


async def memory(url: str, held: int = 100, progress: Progress = _quiet) -> dict[str, Any]:
    """RSS of one worker process idle, with 1 and with ``held`` runs, each on a model call."""
    with scratch_dir("agentrun-bench-mem-") as tmp:
        path = tmp / "slow.yaml"
        # Every call hangs for minutes.
        path.write_text(yaml.safe_dump(scenario(3, delay_ms=600_000)))
        out: dict[str, Any] = {}
        store = await Store.open(url, max_size=2)
        proc: subprocess.Popen[bytes] | None = None
        try:
            with fake_server(path) as base_url:
                port = free_port()
                proc = spawn_worker(
                    "mem", _env(url, base_url), tmp, concurrency=held, health_port=port, ttl=60
                )
                await wait_ready(proc, port)
                await asyncio.sleep(2)
                out["idle_rss_mib"] = rss_kib(proc.pid) / 1024
                submitted = 0
                for n in (1, held):
                    for i in range(submitted, n):
                        await store.create_run(f"held #{i}", AGENT)
                    submitted = n
                    deadline = time.monotonic() + 120
                    while await _held(url, "mem") < n:
                        if time.monotonic() > deadline or proc.poll() is not None:
                            raise TimeoutError(f"the worker never held {n} runs")
                        await asyncio.sleep(0.1)
                    await asyncio.sleep(3)  # every model call is open and waiting
                    out[f"rss_{n}_held_mib"] = rss_kib(proc.pid) / 1024
                    progress(f"memory: {out[f'rss_{n}_held_mib']:.1f} MiB with {n} held run(s)")
                out["held"] = held
                out["per_extra_run_kib"] = (
                    (out[f"rss_{held}_held_mib"] - out["rss_1_held_mib"]) * 1024 / (held - 1)
                )
                stop_processes([proc], grace=30)  # drains: aborts the calls, releases the leases
        finally:
            if proc is not None:
                stop_processes([proc])
            await store.close()
        return out


# -- together --------------------------------------------------------------------------------------


def own_server() -> OwnPostgres:
    """A server of our own for the idle-load and memory figures (see the module docstring)."""
    return OwnPostgres(
        preload=["pg_stat_statements"],
        settings={"max_connections": "300", "pg_stat_statements.track": "all"},
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="small")
    ap.add_argument("--admin-url", help="server for the throughput figures")
    ap.add_argument("--json", help="also write the results to this JSON file")
    args = ap.parse_args()
    p = PRESETS[args.preset]
    out: dict[str, Any] = {}
    with throwaway_database("agentrun_fbench", args.admin_url) as url:
        out["throughput"] = asyncio.run(
            throughput(
                url,
                turns=p["turns"],
                min_runs=p["min_runs"],
                per_slot=p["per_slot"],
                progress=print,
            )
        )
    with own_server() as pg:
        with fresh_database(pg.url(), "agentrun_idle") as url:
            out["idle_worker"] = asyncio.run(idle_worker_load(url, p["idle_s"], print))
        with fresh_database(pg.url(), "agentrun_mem") as url:
            out["memory"] = asyncio.run(memory(url, p["held"], print))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
