"""Store benchmark: the store's fenced append and claim next to hand-written raw psycopg.

    python -m benchmarks.store_bench [--steps 2000] [--runs 1000] [--admin-url URL] [--json FILE]

It creates a throwaway database on the server (AGENTRUN_TEST_ADMIN_URL, else the machine's own
127.0.0.1:5432, else the embedded one), migrates it, measures, prints a table and drops it.

Baselines, run in the same process on the same database:
  * raw-1stmt: the very SQL the store runs (queries.sql "append_step"), sent on a plain autocommit
    psycopg connection with no pool, no dataclasses, no error mapping. The ratio store/raw is the
    cost of the store's Python layer; the goal is <= 1.3x.
  * raw-4stmt: the textbook transaction BEGIN; UPDATE agent_run; INSERT agent_step; COMMIT, for
    scale: what the single-statement fence saves.

Followers (``follower_bench``): the append notifies agentrun_run_steps only for a run with a
follower (``agentrun logs -f``, migration 0008). 16 writers on raw connections, interleaved and
repeated: the append as it was before that (``before``: no follower check, the SQL below), the
append with no follower anywhere, with a follower on one of the 16 runs, and on all 16.

It also counts the transactions an append costs: the ``xact_commit`` + ``xact_rollback`` delta of
the benchmark database in ``pg_stat_database`` over a few hundred appends (read from another
database, so the reading is not counted). Goal: one.

Importable: :func:`store_bench` returns a dict with the rows and the headline figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.types.json import Jsonb

from agentrun.manifests import AgentSpec
from agentrun.sql import queries
from agentrun.store import Lease, Store
from benchmarks.throwaway_db import throwaway_database

PAYLOAD = {
    "content": [
        {
            "type": "thinking",
            "thinking": "Check the schema before writing. " * 8,
            "signature": "c2lnbmF0dXJl" * 20,
        },
        {"type": "text", "text": "I will now read the orders table.", "citations": None},
        {
            "type": "tool_use",
            "id": "toolu_0123456789abcdef",
            "name": "read_schema",
            "input": {"table": "orders"},
        },
    ],
    "stop_reason": "tool_use",
    "usage": {"input_tokens": 1200, "output_tokens": 180},
}
AGENT = AgentSpec(model="bench", system="bench")

RAW_4STMT_UPDATE = (
    "UPDATE agent_run SET next_seq = greatest(next_seq, %(seq)s + 1), "
    "lease_until = now() + make_interval(secs => %(ttl)s) "
    "WHERE id = %(run_id)s AND lease_owner = %(worker)s AND lease_epoch = %(epoch)s "
    "AND status = 'running' RETURNING id"
)
RAW_4STMT_INSERT = (
    "INSERT INTO agent_step (run_id, seq, kind, payload, request_id, lease_epoch, worker) "
    "VALUES (%(run_id)s, %(seq)s, %(kind)s, %(payload)s, %(request_id)s, %(epoch)s, %(worker)s)"
)


#: queries.sql append_step before migration 0008 (no follower check, no notification): the
#: baseline of :func:`follower_bench`.
APPEND_BEFORE_FOLLOWERS = """
WITH fence AS (
    UPDATE agent_run
       SET next_seq      = greatest(next_seq, %(seq)s + 1),
           lease_until   = now() + make_interval(secs => %(ttl)s),
           input_tokens  = input_tokens + %(input_tokens)s,
           output_tokens = output_tokens + %(output_tokens)s
     WHERE id = %(run_id)s
       AND lease_owner = %(worker)s
       AND lease_epoch = %(epoch)s
       AND status = 'running'
    RETURNING id
)
INSERT INTO agent_step (run_id, seq, kind, payload, request_id, lease_epoch, worker)
SELECT fence.id, %(seq)s, %(kind)s, %(payload)s, %(request_id)s, %(epoch)s, %(worker)s
  FROM fence
RETURNING seq, created_at
"""
#: The append's usage and mark parameters for a step that used no tokens and carries no tool
#: call's mark (a tool result's).
NO_USAGE = {
    "input_tokens": 0, "output_tokens": 0, "cache_read_tokens": 0, "cache_write_tokens": 0,
    "cost_usd": 0.0,
    "tool_call": None,
}
FOLLOWER_VARIANTS = ("before", "no follower", "1 of 16 followed", "16 of 16 followed")


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))]


async def timed_writers(
    writers: int,
    per_writer: int,
    make_write: Callable[[int], Awaitable[Callable[[int], Awaitable[None]]]],
) -> tuple[list[float], float]:
    """Run ``writers`` concurrent loops of ``per_writer`` writes; latencies in ms, total wall s."""
    fns = [await make_write(i) for i in range(writers)]
    lat: list[float] = []

    async def loop(fn: Callable[[int], Awaitable[None]]) -> None:
        for seq in range(per_writer):
            t0 = time.perf_counter()
            await fn(seq)
            lat.append((time.perf_counter() - t0) * 1000)

    t0 = time.perf_counter()
    await asyncio.gather(*(loop(fn) for fn in fns))
    return lat, time.perf_counter() - t0


async def bench(url: str, steps: int, runs: int) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    store = await Store.open(url, max_size=16)
    raw_conns = [await psycopg.AsyncConnection.connect(url, autocommit=True) for _ in range(16)]
    try:
        for writers in (1, 16):
            per = max(50, steps // writers)
            # Each writer holds its own run, as a worker does.
            leases: list[Lease] = []
            for _ in range(writers * 3):
                await store.create_run("bench", AGENT, pool=f"append{writers}")
            claimed = await store.with_lease_ttl(600).claim(
                f"append{writers}", "bench", limit=writers * 3)
            leases = [lease for _, lease in claimed.claimed]
            store_leases, raw1_leases, raw4_leases = (
                leases[:writers],
                leases[writers : 2 * writers],
                leases[2 * writers :],
            )

            async def make_store(
                i: int, ls: list[Lease] = store_leases
            ) -> Callable[[int], Awaitable[None]]:
                async def w(seq: int) -> None:
                    await store.append_step(ls[i], seq, "model_turn", PAYLOAD, request_id="req")

                return w

            async def make_raw1(
                i: int, ls: list[Lease] = raw1_leases
            ) -> Callable[[int], Awaitable[None]]:
                conn = raw_conns[i]

                async def w(seq: int) -> None:
                    lease = ls[i]
                    cur = await conn.execute(
                        queries["append_step"],
                        {
                            "run_id": lease.run_id,
                            "worker": lease.worker,
                            "epoch": lease.epoch,
                            "ttl": 600,
                            "seq": seq,
                            "kind": "model_turn",
                            "payload": Jsonb(PAYLOAD),
                            "request_id": "req",
                            **NO_USAGE,
                        },
                    )
                    assert await cur.fetchone() is not None

                return w

            async def make_raw4(
                i: int, ls: list[Lease] = raw4_leases
            ) -> Callable[[int], Awaitable[None]]:
                conn = raw_conns[i]

                async def w(seq: int) -> None:
                    lease = ls[i]
                    params = {
                        "run_id": lease.run_id,
                        "worker": lease.worker,
                        "epoch": lease.epoch,
                        "ttl": 600,
                        "seq": seq,
                        "kind": "model_turn",
                        "payload": Jsonb(PAYLOAD),
                        "request_id": "req",
                    }
                    async with conn.transaction():
                        cur = await conn.execute(RAW_4STMT_UPDATE, params)
                        assert await cur.fetchone() is not None
                        await conn.execute(RAW_4STMT_INSERT, params)

                return w

            # Warm up (prepared statements, pool) then measure, interleaving to share noise.
            await timed_writers(writers, 10, make_store)
            measured: dict[str, tuple[list[float], float]] = {}
            for name, maker, offset in (
                ("store", make_store, 10),
                ("raw-1stmt", make_raw1, 0),
                ("raw-4stmt", make_raw4, 0),
            ):

                async def shifted(i: int, maker: Any = maker, offset: int = offset) -> Any:
                    fn = await maker(i)

                    async def w(seq: int) -> None:
                        await fn(seq + offset)

                    return w

                measured[name] = await timed_writers(writers, per, shifted)
            base = measured["raw-1stmt"]
            for name, (lat, wall) in measured.items():
                results.append(
                    {
                        "bench": f"append, {writers} writer{'s' if writers > 1 else ''}",
                        "variant": name,
                        "p50_ms": statistics.median(lat),
                        "p99_ms": pct(lat, 99),
                        "per_s": len(lat) / wall,
                        "ratio_p50_vs_raw": statistics.median(lat) / statistics.median(base[0]),
                        "ratio_rate_vs_raw": (len(base[0]) / base[1]) / (len(lat) / wall),
                    }
                )

        # Claims per second: one claimer, one run per claim.
        for variant in ("store", "raw-1stmt"):
            pool = f"claim-{variant}"
            for _ in range(runs):
                await store.create_run("bench", AGENT, pool=pool)
            conn = raw_conns[0]
            t0 = time.perf_counter()
            n = 0
            while True:
                if variant == "store":
                    got = len((await store.claim(pool, "bench", limit=1)).claimed)
                else:
                    cur = await conn.execute(
                        queries["claim_runs"],
                        {"pool": pool, "worker": "bench", "limit": 1, "ttl": 15},
                    )
                    # An empty claim still answers one row, with no run: the next expiry.
                    ids = [c.name for c in cur.description or ()].index("id")
                    got = sum(1 for r in await cur.fetchall() if r[ids] is not None)
                if not got:
                    break
                n += got
            wall = time.perf_counter() - t0
            results.append(
                {
                    "bench": "claim, 1 claimer, 1 run per claim",
                    "variant": variant,
                    "p50_ms": wall / n * 1000,
                    "p99_ms": None,
                    "per_s": n / wall,
                }
            )
        store_rate, raw_rate = results[-2]["per_s"], results[-1]["per_s"]
        results[-2]["ratio_rate_vs_raw"] = raw_rate / store_rate
        results[-1]["ratio_rate_vs_raw"] = 1.0
    finally:
        for c in raw_conns:
            await c.close()
        await store.close()
    return results


async def transactions_per_append(url: str, appends: int = 300) -> float:
    """Transactions the database commits per ``Store.append_step`` (see the module docstring)."""
    params = conninfo_to_dict(url)
    dbname = params["dbname"]
    other = make_conninfo(**{**params, "dbname": "postgres"})  # type: ignore[arg-type]

    async def xacts() -> int:
        async with await psycopg.AsyncConnection.connect(other, autocommit=True) as conn:
            cur = await conn.execute(
                "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s",
                (dbname,),
            )
            row = await cur.fetchone()
        return int(row[0]) if row else 0

    async with await Store.open(url, max_size=1) as setup:
        await setup.create_run("bench", AGENT, pool="xacts")
        ((_, lease),) = (await setup.with_lease_ttl(600).claim("xacts", "bench", limit=1)).claimed
    # A backend flushes its statistics when it exits (when idle, only every 10 s or so): every
    # connection to the database is closed before each reading. What opening the store costs
    # (a connection check) is counted against the appends: a few in a few hundred.
    await asyncio.sleep(0.5)
    before = await xacts()
    async with await Store.open(url, min_size=1, max_size=1) as store:
        for seq in range(appends):
            await store.append_step(lease, seq, "model_turn", PAYLOAD, request_id="req")
    await asyncio.sleep(0.5)
    after = await xacts()
    return (after - before) / appends


async def follower_bench(url: str, steps: int = 2000, repeat: int = 3) -> dict[str, Any]:
    """Appends/s of 16 writers for each of :data:`FOLLOWER_VARIANTS` (see the module docstring),
    the median of ``repeat`` interleaved rounds, and each one's ratio to ``before``."""
    writers = 16
    per = max(20, steps // writers)
    async with await Store.open(url, max_size=2) as store:
        for _ in range(writers):
            await store.create_run("bench", AGENT, pool="followers")
        claimed = await store.with_lease_ttl(3600).claim("followers", "bench", limit=writers)
        leases = [lease for _, lease in claimed.claimed]
        conns = [
            await psycopg.AsyncConnection.connect(url, autocommit=True, prepare_threshold=0)
            for _ in range(writers)
        ]
        seqs = [0] * writers
        try:

            async def round_of(variant: str, n: int) -> float:
                query = APPEND_BEFORE_FOLLOWERS if variant == "before" else queries["append_step"]
                followed = {"1 of 16 followed": 1, "16 of 16 followed": writers}.get(variant, 0)
                for lease in leases[:followed]:
                    await store.follow_run(lease.run_id, "bench", lease=3600)

                async def loop(i: int) -> None:
                    lease = leases[i]
                    for _ in range(n):
                        seq, seqs[i] = seqs[i], seqs[i] + 1
                        cur = await conns[i].execute(
                            query,
                            {"run_id": lease.run_id, "worker": lease.worker,
                             "epoch": lease.epoch, "ttl": 3600, "seq": seq,
                             "kind": "model_turn", "payload": Jsonb(PAYLOAD),
                             "request_id": "req", **NO_USAGE},
                        )
                        assert await cur.fetchone() is not None

                t0 = time.perf_counter()
                await asyncio.gather(*(loop(i) for i in range(writers)))
                rate = writers * n / (time.perf_counter() - t0)
                for lease in leases[:followed]:
                    await store.unfollow_run(lease.run_id, "bench")
                return rate

            rates: dict[str, list[float]] = {v: [] for v in FOLLOWER_VARIANTS}
            for variant in FOLLOWER_VARIANTS:
                await round_of(variant, 10)  # warm up: prepared statements
            for _ in range(repeat):
                for variant in FOLLOWER_VARIANTS:
                    rates[variant].append(await round_of(variant, per))
        finally:
            for c in conns:
                await c.close()
    before = statistics.median(rates["before"])
    return {
        "writers": writers,
        "appends_per_round": writers * per,
        "rounds": repeat,
        "per_s": {v: statistics.median(r) for v, r in rates.items()},
        "all_per_s": rates,
        "ratio_vs_before": {v: statistics.median(r) / before for v, r in rates.items()},
    }


def print_followers(f: dict[str, Any]) -> None:
    print(
        f"append, {f['writers']} writers, by followers ({f['rounds']} interleaved rounds of "
        f"{f['appends_per_round']} appends, median):"
    )
    for v, rate in f["per_s"].items():
        print(f"  {v:20} {rate:9.0f}/s  {f['ratio_vs_before'][v]:.2f}x the rate before")


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The headline figures of :func:`bench`'s rows."""

    def row(bench: str, variant: str) -> dict[str, Any]:
        return next(r for r in rows if r["bench"] == bench and r["variant"] == variant)

    claim = "claim, 1 claimer, 1 run per claim"
    out: dict[str, Any] = {}
    for writers, bench in ((1, "append, 1 writer"), (16, "append, 16 writers")):
        store, raw, raw4 = row(bench, "store"), row(bench, "raw-1stmt"), row(bench, "raw-4stmt")
        out[f"append_{writers}_store_p50_ms"] = store["p50_ms"]
        out[f"append_{writers}_store_per_s"] = store["per_s"]
        out[f"append_{writers}_raw_p50_ms"] = raw["p50_ms"]
        out[f"append_{writers}_raw_per_s"] = raw["per_s"]
        out[f"append_{writers}_ratio"] = store["ratio_rate_vs_raw"]
        out[f"append_{writers}_raw4_ratio"] = raw4["ratio_rate_vs_raw"]
    out["claims_per_s"] = row(claim, "store")["per_s"]
    out["raw_claims_per_s"] = row(claim, "raw-1stmt")["per_s"]
    out["claim_ratio"] = row(claim, "store")["ratio_rate_vs_raw"]
    return out


async def store_bench(url: str, steps: int = 2000, runs: int = 1000) -> dict[str, Any]:
    """Every store figure: the rows of :func:`bench`, their summary, transactions per append."""
    rows = await bench(url, steps, runs)
    out = summarize(rows)
    out["transactions_per_append"] = await transactions_per_append(url)
    out["followers"] = await follower_bench(url, steps)
    out.update(rows=rows, steps=steps, runs=runs)
    return out


def print_table(results: list[dict[str, Any]]) -> None:
    print(
        f"{'benchmark':36} {'variant':10} {'p50 ms':>8} {'p99 ms':>8} {'per s':>9} "
        f"{'time ratio vs raw-1stmt':>24}"
    )
    for r in results:
        p99 = f"{r['p99_ms']:.3f}" if r.get("p99_ms") is not None else "-"
        ratio = r.get("ratio_rate_vs_raw")
        print(
            f"{r['bench']:36} {r['variant']:10} {r['p50_ms']:8.3f} {p99:>8} "
            f"{r['per_s']:9.0f} {(f'{ratio:.2f}x' if ratio else '-'):>24}"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000, help="appends per variant and concurrency")
    ap.add_argument("--runs", type=int, default=1000, help="runs to claim per variant")
    ap.add_argument("--admin-url")
    ap.add_argument("--json", help="also write the results to this JSON file")
    args = ap.parse_args()
    with throwaway_database("agentrun_bench", args.admin_url) as url:
        with psycopg.connect(url) as c:
            server_version = c.execute("SHOW server_version").fetchone()
        print(
            f"store benchmark: PostgreSQL {server_version[0] if server_version else '?'}, "
            f"{os.cpu_count()} cores, python {sys.version.split()[0]}"
        )
        results = asyncio.run(store_bench(url, args.steps, args.runs))
        print_table(results["rows"])
        print(f"transactions per append: {results['transactions_per_append']:.2f} (goal: 1)")
        print_followers(results["followers"])
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
