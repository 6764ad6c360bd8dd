"""Group commit benchmark: database CPU per append with and without group commit (issue 17).

    python -m benchmarks.group_bench [--steps 2000] [--rounds 5] [--admin-url URL] [--json FILE]

N concurrent writers (1, 16, 64), each holding its own run as a worker's runs do, append steps
through ``Store.append_step``: once through a store with group commit (the default, what workers
run) and once through one with ``group_commit=False`` (one statement per append), both on ONE
pool of ``writers + 3`` connections (the worker's own sizing), in interleaved rounds in one
process, so both variants share the machine's noise.

Database CPU: the CPU time of every backend connected to the benchmark database, read from
``/proc/<pid>/schedstat`` (nanoseconds on CPU; ``/proc/<pid>/stat``'s 10 ms ticks are too coarse
for a round) before and after each round, the pids from ``pg_stat_activity`` (read on a connection
to another database, so the reading is not counted). That is the work the statements cost the
server: parse/bind, plan, execute, commit, the WAL flush; the background processes (WAL writer,
checkpointer) are not in it. It needs a server on this machine; elsewhere the figure is skipped and
only appends/s and latencies are reported.

Importable: :func:`group_bench` returns a dict (per writers: each variant's median CPU per
append, its spread over the rounds, appends/s, latency p50/p99; the ratios).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from agentrun.manifests import AgentSpec
from agentrun.store import Lease, Store
from benchmarks.store_bench import PAYLOAD, pct
from benchmarks.throwaway_db import throwaway_database

AGENT = AgentSpec(model="bench", system="bench")
WRITERS = (1, 16, 64)
VARIANTS = ("group commit", "one statement each")


def _cpu_ns(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


class BackendCpu:
    """CPU time of the backends of one database (see the module docstring)."""

    def __init__(self, url: str) -> None:
        params = conninfo_to_dict(url)
        self.dbname = str(params["dbname"])
        self.other = make_conninfo(**{**params, "dbname": "postgres"})  # type: ignore[arg-type]

    async def pids(self) -> list[int]:
        async with await psycopg.AsyncConnection.connect(self.other, autocommit=True) as conn:
            cur = await conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = %s", (self.dbname,))
            return [int(r[0]) for r in await cur.fetchall()]

    async def free_connections(self) -> int:
        """Connections the server can still take (max_connections less those open), less a few
        for the superuser and the readings."""
        async with await psycopg.AsyncConnection.connect(self.other, autocommit=True) as conn:
            cur = await conn.execute(
                "SELECT current_setting('max_connections')::int - count(*)::int "
                "FROM pg_stat_activity WHERE backend_type = 'client backend'")
            row = await cur.fetchone()
        return (int(row[0]) if row else 0) - 8

    async def sample(self) -> dict[int, int] | None:
        """CPU ns by backend pid; None when the backends are not readable here."""
        out = {pid: ns for pid in await self.pids() if (ns := _cpu_ns(pid)) is not None}
        return out or None


def _delta(before: dict[int, int] | None, after: dict[int, int] | None) -> float | None:
    """Seconds of backend CPU between two samples (a backend that came in between counts whole;
    one that left is not seen: the pool keeps its connections through a round)."""
    if before is None or after is None:
        return None
    return sum(ns - before.get(pid, 0) for pid, ns in after.items()) / 1e9


async def _rounds(
    url: str, cpu: BackendCpu, writers: int, per: int, rounds: int
) -> dict[str, dict[str, list[float]]]:
    """Each variant's figures, one per round, for ``writers`` writers of ``per`` appends."""
    # A worker's pool (writers + 3), unless the server (shared) cannot take that many.
    size = max(2, min(writers + 3, await cpu.free_connections()))
    grouped = await Store.open(url, min_size=size, max_size=size, connect_timeout=60)
    single = Store(grouped.pool, grouped.url, group_commit=False)
    stores = {"group commit": grouped, "one statement each": single}
    got: dict[str, dict[str, list[float]]] = {
        v: {"cpu_ms": [], "per_s": [], "p50_ms": [], "p99_ms": [], "rows_per_stmt": []}
        for v in VARIANTS}
    got["pool"] = {"size": [float(size)]}
    try:
        pool = f"group{writers}"
        for _ in range(writers):
            await grouped.create_run("bench", AGENT, pool=pool)
        leases: list[Lease] = [
            lease for _, lease in
            (await grouped.with_lease_ttl(3600).claim(pool, "bench", limit=writers)).claimed]
        seqs = [0] * writers

        async def round_of(store: Store, n: int) -> tuple[list[float], float]:
            lat: list[float] = []

            long = store.with_lease_ttl(3600)  # outside the timed loop: a view is a copy

            async def loop(i: int) -> None:
                lease = leases[i]
                for _ in range(n):
                    seq, seqs[i] = seqs[i], seqs[i] + 1
                    t0 = time.perf_counter()
                    await long.append_step(lease, seq, "model_turn", PAYLOAD, request_id="req")
                    lat.append((time.perf_counter() - t0) * 1000)

            t0 = time.perf_counter()
            await asyncio.gather(*(loop(i) for i in range(writers)))
            return lat, time.perf_counter() - t0

        for store in stores.values():
            await round_of(store, 5)  # warm up: connections, prepared statements
        for r in range(rounds):
            # Alternate which variant goes first: neither always gets the warmer cache.
            order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
            for variant in order:
                store = stores[variant]
                stmts, rows = store.append_stats.statements, store.append_stats.rows
                before = await cpu.sample()
                lat, wall = await round_of(store, per)
                spent = _delta(before, await cpu.sample())
                g = got[variant]
                if spent is not None:
                    g["cpu_ms"].append(spent / len(lat) * 1000)
                g["per_s"].append(len(lat) / wall)
                g["p50_ms"].append(statistics.median(lat))
                g["p99_ms"].append(pct(lat, 99))
                sent = store.append_stats.statements - stmts
                g["rows_per_stmt"].append((store.append_stats.rows - rows) / max(1, sent))
    finally:
        await grouped.close()
    return got


async def group_bench(
    url: str, steps: int = 2000, rounds: int = 5, writers_list: tuple[int, ...] = WRITERS,
) -> dict[str, Any]:
    cpu = BackendCpu(url)
    out: dict[str, Any] = {"steps": steps, "rounds": rounds, "by_writers": {}}
    for writers in writers_list:
        per = max(10, steps // writers)
        got = await _rounds(url, cpu, writers, per, rounds)
        pool = got.pop("pool")
        cell: dict[str, Any] = {"appends_per_round": writers * per,
                                "pool_size": int(pool["size"][0])}
        for variant, g in got.items():
            cell[variant] = {
                "cpu_ms_per_append": statistics.median(g["cpu_ms"]) if g["cpu_ms"] else None,
                "cpu_ms_min": min(g["cpu_ms"], default=None),
                "cpu_ms_max": max(g["cpu_ms"], default=None),
                "per_s": statistics.median(g["per_s"]),
                "p50_ms": statistics.median(g["p50_ms"]),
                "p99_ms": statistics.median(g["p99_ms"]),
                "rows_per_statement": statistics.median(g["rows_per_stmt"]),
                "all": g,
            }
        b, s = cell["group commit"], cell["one statement each"]
        cell["cpu_ratio"] = (
            s["cpu_ms_per_append"] / b["cpu_ms_per_append"]
            if b["cpu_ms_per_append"] and s["cpu_ms_per_append"] else None)
        # Per round (the variants of a round ran back to back): the spread of the ratio itself.
        pairs = [x / y for x, y in zip(s["all"]["cpu_ms"], b["all"]["cpu_ms"], strict=True) if y]
        cell["cpu_ratio_min"] = min(pairs, default=None)
        cell["cpu_ratio_max"] = max(pairs, default=None)
        cell["p50_ratio"] = b["p50_ms"] / s["p50_ms"]
        # The same per round: the two variants of a round ran back to back, in the same weather.
        cell["p50_ratio_paired"] = statistics.median(
            x / y for x, y in zip(b["all"]["p50_ms"], s["all"]["p50_ms"], strict=True))
        cell["rate_ratio"] = b["per_s"] / s["per_s"]
        out["by_writers"][str(writers)] = cell
    out["cpu_measured"] = all(
        c["cpu_ratio"] is not None for c in out["by_writers"].values())
    return out


def print_group(res: dict[str, Any]) -> None:
    print(f"group commit, {res['rounds']} interleaved rounds (median, [min-max] over rounds):")
    for writers, c in res["by_writers"].items():
        print(f"  {writers:>3} writer(s), {c['appends_per_round']} appends per round, a pool of "
              f"{c['pool_size']}:")
        for v in VARIANTS:
            d = c[v]
            cpu = (f"{d['cpu_ms_per_append']:.3f} ms [{d['cpu_ms_min']:.3f}-{d['cpu_ms_max']:.3f}]"
                   if d["cpu_ms_per_append"] is not None else "not measured")
            print(f"    {v:20} db cpu/append {cpu}  {d['per_s']:7.0f}/s  p50 {d['p50_ms']:.2f} ms"
                  f"  p99 {d['p99_ms']:.2f} ms  {d['rows_per_statement']:.1f} rows/statement")
        if c["cpu_ratio"] is not None:
            print(f"    cpu ratio {c['cpu_ratio']:.2f}x [{c['cpu_ratio_min']:.2f}-"
                  f"{c['cpu_ratio_max']:.2f}], rate {c['rate_ratio']:.2f}x, "
                  f"p50 {c['p50_ratio']:.2f}x")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000, help="appends per round and variant")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--writers", default=",".join(map(str, WRITERS)))
    ap.add_argument("--admin-url")
    ap.add_argument("--json", help="also write the results to this JSON file")
    args = ap.parse_args()
    writers = tuple(int(w) for w in args.writers.split(","))
    with throwaway_database("agentrun_gc", args.admin_url) as url:
        print(f"group commit benchmark: {os.cpu_count()} cores, python {sys.version.split()[0]}")
        res = asyncio.run(group_bench(url, args.steps, args.rounds, writers))
        print_group(res)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
