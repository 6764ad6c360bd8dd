"""agent_run's row triggers and a run's size: database CPU per append, schema 24 vs now (issue 17).

    python -m benchmarks.trigger_bench [--appends 300] [--rounds 6] [--admin-url URL] [--json FILE]

Before migration 0025 every update of a run evaluated the WHEN clause of each of agent_run's row
triggers, and the pin trigger's compared the run's task and whole agent spec, old against new:
read from TOAST and decompressed twice when they are stored out of line, as a real spec is. Two
databases on one server, one migrated to version 24 (:data:`BEFORE`, the baseline) and one to
the latest: in each, one writer appends steps to a run it holds through ``Store.append_step``
(what a worker of one run sends), for a run of the bench's small spec and one of production size
(:func:`big_spec`: an 8.1 KB spec, a 3.1 KB task, as stored). The four cells take turns round
by round (the order reversed every other round); database CPU is the CPU time of each
database's backends (``group_bench.BackendCpu``, from /proc/<pid>/schedstat), per append. Needs
a server on this machine (else the CPU is not readable, and the bench says so).

Importable: :func:`trigger_bench` returns a dict.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg import sql

from agentrun.manifests import AgentSpec
from agentrun.sql import migrations
from agentrun.store import Lease, Store
from benchmarks.group_bench import BackendCpu, _delta
from benchmarks.store_bench import PAYLOAD
from benchmarks.throwaway_db import db_url, pick_admin_url, throwaway_database

#: The schema before migration 0025 (agent_run's triggers not yet by column).
BEFORE = 24
SMALL = AgentSpec(model="bench", system="bench")


def big_spec() -> tuple[str, AgentSpec]:
    """A task and a spec of production size that do not compress away (random words): both
    stored out of line, in agent_run's TOAST table."""
    words = random.Random(7)
    system = " ".join(f"w{words.randrange(10**6)}" for _ in range(1500))
    task = " ".join(f"t{words.randrange(10**6)}" for _ in range(400))
    tools = [f"tool_{i}" for i in range(10)]
    return task, AgentSpec(model="bench", system=system, tools=tools)


@contextlib.contextmanager
def database_at(admin_url: str | None, version: int) -> Iterator[str]:
    """A new database with the migrations up to ``version`` applied; dropped afterwards."""
    admin, server = pick_admin_url(admin_url)
    name = f"agentrun_trig_{uuid.uuid4().hex[:8]}"
    try:
        with psycopg.connect(db_url(admin, "postgres"), autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        url = db_url(admin, name)
        try:
            with psycopg.connect(url) as conn:  # one transaction, as agentrun migrate does
                for mig in migrations():
                    if mig.version <= version:
                        conn.execute(mig.sql)
            yield url
        finally:
            with psycopg.connect(db_url(admin, "postgres"), autocommit=True) as conn:
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)")
                             .format(sql.Identifier(name)))
    finally:
        if server is not None:
            server.cleanup()


class Writer:
    """One writer appending to one run it holds, in one database."""

    def __init__(self, store: Store, lease: Lease, cpu: BackendCpu) -> None:
        self.store, self.lease, self.cpu, self.seq = store, lease, cpu, 0

    @classmethod
    async def open(cls, url: str, task: str, spec: AgentSpec, pool: str) -> Writer:
        store = (await Store.open(url, min_size=1, max_size=1)).with_lease_ttl(3600)
        await store.create_run(task, spec, pool=pool)
        ((_, lease),) = (await store.claim(pool, "bench", limit=1)).claimed
        return cls(store, lease, BackendCpu(url))

    async def round(self, n: int) -> float | None:
        """``n`` appends: the database's CPU per append, ms (None if not readable here)."""
        before = await self.cpu.sample()
        for _ in range(n):
            await self.store.append_step(self.lease, self.seq, "model_turn", PAYLOAD,
                                         request_id="req")
            self.seq += 1
        spent = _delta(before, await self.cpu.sample())
        return None if spent is None else spent / n * 1000


async def _measure(urls: dict[str, str], appends: int, rounds: int) -> dict[str, list[float]]:
    task, big = big_spec()
    writers: dict[str, Writer] = {}
    try:
        for schema, url in urls.items():
            writers[f"{schema}, small spec"] = await Writer.open(url, "bench", SMALL, "small")
            writers[f"{schema}, big spec"] = await Writer.open(url, task, big, "big")
        for w in writers.values():
            await w.round(20)  # warm up: the connection, the prepared statement
        got: dict[str, list[float]] = {name: [] for name in writers}
        names = list(writers)
        for r in range(rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                ms = await writers[name].round(appends)
                if ms is None:
                    raise RuntimeError("the database's backends are not readable here "
                                       "(/proc/<pid>/schedstat): the server is not on this machine")
                got[name].append(ms)
        return got
    finally:
        for w in writers.values():
            await w.store.close()


def trigger_bench(admin_url: str | None = None, appends: int = 300,
                  rounds: int = 6) -> dict[str, Any]:
    """Database CPU per append at schema :data:`BEFORE` and now, for a small and a big spec."""
    with database_at(admin_url, BEFORE) as before, throwaway_database("agentrun_trig",
                                                                       admin_url) as now:
        with psycopg.connect(now) as conn:
            row = conn.execute("SELECT max(version) FROM agentrun_migration").fetchone()
        got = asyncio.run(_measure({"before": before, "now": now}, appends, rounds))
        with psycopg.connect(now) as conn:
            sizes = conn.execute(
                "SELECT pg_column_size(agent_spec), pg_column_size(task) FROM agent_run"
                " WHERE pool = 'big'").fetchone()
    assert sizes is not None
    out: dict[str, Any] = {"appends": appends, "rounds": rounds, "before_version": BEFORE,
                           "now_version": row[0] if row else None,
                           "big_spec_bytes": sizes[0], "big_task_bytes": sizes[1]}
    for size in ("small", "big"):
        b, n = got[f"before, {size} spec"], got[f"now, {size} spec"]
        out[size] = {
            "before_ms": statistics.median(b), "now_ms": statistics.median(n),
            "ratio": statistics.median(b) / statistics.median(n),
            # The two schemas' cells of a round ran back to back: the spread of the ratio itself.
            "ratio_min": min(x / y for x, y in zip(b, n, strict=True)),
            "ratio_max": max(x / y for x, y in zip(b, n, strict=True)),
            "all": {"before": b, "now": n},
        }
    return out


def describe(res: dict[str, Any]) -> str:
    parts = []
    for size, label in (("big", f"a {res['big_spec_bytes'] / 1024:.1f} KB spec and a "
                                f"{res['big_task_bytes'] / 1024:.1f} KB task"),
                        ("small", "the bench's small spec")):
        c = res[size]
        parts.append(f"{label}: {c['now_ms']:.3f} vs {c['before_ms']:.3f} ms, "
                     f"{c['ratio']:.2f}x less ({c['ratio_min']:.2f}-{c['ratio_max']:.2f})")
    return (f"database CPU per append, schema {res['now_version']} vs {res['before_version']}; "
            + "; ".join(parts))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--appends", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--admin-url")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    res = trigger_bench(args.admin_url, args.appends, args.rounds)
    print(describe(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
