"""Prune benchmark: ``agentrun prune``'s batches on a big table of finished runs while live runs
keep appending.

    python -m benchmarks.prune_bench [--steps 1000000] [--steps-per-run 1000] [--live 8]
                                     [--batch 100] [--baseline 10] [--admin-url URL] [--json F]

On a throwaway database (``throwaway_db``: --admin-url, else AGENTRUN_TEST_ADMIN_URL, else
127.0.0.1:5432, else an embedded server) it

1. fills ``--steps`` steps of finished runs (``--steps-per-run`` each, finished days ago) with
   ``INSERT ... SELECT generate_series``, plus a few runs that finished just now (younger than
   the cutoff: a prune must keep them), then VACUUM ANALYZE, as autovacuum would;
2. starts ``--live`` live runs, claimed through the real store (half of them created as long ago
   as the finished ones: age alone never makes a run a candidate), gives each 20 steps, and a
   pending run nobody holds with 5 steps; hashes every live step (md5 of the ordered rows);
3. runs one asyncio writer per live run appending steps through ``Store.append_step`` (the
   fenced append a worker uses), paced as an agent is (``--pace-ms`` between appends), for
   ``--baseline`` seconds before the prune (the baseline), then during it;
4. prunes with ``Store.prune_batch`` (what ``agentrun prune`` runs) in batches of ``--batch``
   runs until none is left, while a sampler polls, every 20 ms, ``pg_locks`` for any writer
   waiting on a lock (how long: since its statement began) and, with the ``pgrowlocks``
   extension, which ``agent_run`` rows the prune's backend holds a lock on;
5. checks: the live steps hash the same, every appended step is there, no live step row was ever
   locked or deleted (``xmax = 0``: a lock or a delete would have set it), no prune lock was seen
   on a live run's row, every old finished run is gone, the young ones are kept.

It prints the figures and the checks; importable: :func:`prune_bench` (on an empty migrated
database) returns them in a dict, and ``problems`` lists every check that failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

import psycopg
from psycopg.types.json import Jsonb

from agentrun.manifests import AgentSpec
from agentrun.store import TERMINAL_STATUSES, Lease, Store
from benchmarks.throwaway_db import throwaway_database

AGENT = AgentSpec(model="bench", system="bench")
#: A small model-turn-like payload (about 200 bytes of JSON): the table's size, not its content,
#: is what the prune pays for.
FILL_PAYLOAD = {
    "content": [
        {"type": "text", "text": "Reading the orders table before the migration."},
        {"type": "tool_use", "id": "toolu_01", "name": "read_schema", "input": {"t": "orders"}},
    ],
    "stop_reason": "tool_use",
}
LIVE_INITIAL_STEPS = 20
#: Runs that finished just now (younger than the cutoff): a prune keeps them.
YOUNG_FINISHED = 5
SAMPLE_INTERVAL = 0.02

FILL_RUNS = """
INSERT INTO agent_run (pool, task, model, agent_spec, max_steps, max_attempts, status, attempt,
                       next_seq, result, error, created_at, started_at, finished_at)
SELECT %(pool)s, 'finished run ' || g, t.model, t.agent_spec, t.max_steps, t.max_attempts,
       CASE WHEN g %% 10 = 0 THEN 'failed' ELSE 'succeeded' END, 1, %(per_run)s,
       CASE WHEN g %% 10 = 0 THEN NULL ELSE 'done' END,
       CASE WHEN g %% 10 = 0 THEN 'failed' END,
       t.created - g * interval '1 second', t.created - g * interval '1 second',
       t.finished - g * interval '1 second'
  FROM generate_series(1, %(runs)s) g,
       (SELECT model, agent_spec, max_steps, max_attempts, now() - %(age)s::interval AS created,
               now() - %(age)s::interval + interval '1 hour' AS finished
          FROM agent_run WHERE id = %(template)s) t
"""
FILL_STEPS = """
INSERT INTO agent_step (run_id, seq, kind, payload, request_id, lease_epoch, worker, created_at)
SELECT r.id, s, CASE WHEN s %% 2 = 0 THEN 'model_turn' ELSE 'tool_result' END, %(payload)s,
       'req_fill', 1, 'filler', r.started_at + s * interval '10 ms'
  FROM agent_run r CROSS JOIN generate_series(0, %(per_run)s - 1) s
 WHERE r.pool = %(pool)s
"""
LIVE_HASH = """
SELECT run_id, count(*), md5(string_agg(
           concat_ws('|', seq, kind, payload::text, request_id, lease_epoch, worker,
                     created_at), E'\\n' ORDER BY seq))
  FROM agent_step WHERE run_id = ANY(%(ids)s) AND seq < %(below)s
 GROUP BY run_id
"""
LOCK_WAITS = """
SELECT l.pid, extract(epoch FROM now() - a.query_start)
  FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
 WHERE NOT l.granted AND a.datname = current_database() AND l.pid <> %(prune_pid)s
"""
PRUNE_ROW_LOCKS = """
SELECT r.id FROM pgrowlocks('agent_run') p JOIN agent_run r ON r.ctid = p.locked_row
 WHERE %(prune_pid)s = ANY(p.pids) AND r.id = ANY(%(live)s)
"""


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))]


def latency(values: list[float]) -> dict[str, float]:
    """p50, p99 and max of ``values`` (ms), and how many."""
    return {
        "n": len(values),
        "p50_ms": statistics.median(values) if values else float("nan"),
        "p99_ms": pct(values, 99),
        "max_ms": max(values) if values else float("nan"),
    }


@dataclass
class Writers:
    """One asyncio task per live run appending steps until told to stop; each append's latency
    is filed under the phase it started in."""

    store: Store
    leases: list[Lease]
    pace: float
    phase: str = "baseline"
    latencies: dict[str, list[float]] = field(default_factory=lambda: {"baseline": [], "prune": []})
    appended: dict[UUID, int] = field(default_factory=dict)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self, lease: Lease) -> None:
        seq = LIVE_INITIAL_STEPS
        while not self.stop.is_set():
            phase = self.phase
            t0 = time.perf_counter()
            await self.store.append_step(lease, seq, "note", {"live": seq})
            self.latencies[phase].append((time.perf_counter() - t0) * 1000)
            seq += 1
            self.appended[lease.run_id] = seq
            await asyncio.sleep(self.pace)


async def fill(url: str, store: Store, steps: int, per_run: int) -> dict[str, Any]:
    """The finished runs, old and young; what it made and how long it took."""
    runs = max(1, steps // per_run)
    template, _ = await store.create_run("template", AGENT, pool="template")
    t0 = time.perf_counter()
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        for pool, n, age, per in (
            ("old", runs, "3 days", per_run),
            ("young", YOUNG_FINISHED, "2 hours", 10),  # finished an hour ago: kept
        ):
            await conn.execute(
                FILL_RUNS,
                {"pool": pool, "runs": n, "age": age, "per_run": per, "template": template.id},
            )
            await conn.execute(
                FILL_STEPS, {"pool": pool, "per_run": per, "payload": Jsonb(FILL_PAYLOAD)}
            )
        await conn.execute("DELETE FROM agent_run WHERE id = %s", (template.id,))
        await conn.execute("VACUUM ANALYZE agent_run, agent_step")
        cur = await conn.execute("SELECT pg_total_relation_size('agent_step')")
        size = await cur.fetchone()
    return {
        "finished_runs": runs,
        "finished_steps": runs * per_run,
        "young_runs": YOUNG_FINISHED,
        "fill_s": time.perf_counter() - t0,
        "agent_step_bytes": int(size[0]) if size else 0,
    }


async def live_runs(url: str, store: Store, n: int) -> tuple[list[Lease], UUID]:
    """``n`` claimed live runs with their first steps (half created days ago), and a pending
    run with 5 steps that nobody holds."""
    ids = [(await store.create_run(f"live {i}", AGENT, pool="live"))[0].id for i in range(n)]
    claimed = await store.with_lease_ttl(3600).claim("live", "writer", limit=n)
    leases = [lease for _, lease in claimed.claimed]
    assert len(leases) == n, f"claimed {len(leases)} of {n} live runs"
    for lease in leases:
        for seq in range(LIVE_INITIAL_STEPS):
            await store.append_step(lease, seq, "note", {"live": seq})
    parked, _ = await store.create_run("parked", AGENT, pool="parked")
    ((_, p),) = (await store.with_lease_ttl(3600).claim("parked", "writer", limit=1)).claimed
    for seq in range(5):
        await store.append_step(p, seq, "note", {"parked": seq})
    await store.release(p)  # pending again: live, held by nobody
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute(
            "UPDATE agent_run SET created_at = now() - interval '4 days' WHERE id = ANY(%s)",
            ([*ids[: n // 2], parked.id],),
        )
    return leases, parked.id


async def live_hash(url: str, ids: list[UUID], below: int) -> dict[str, tuple[int, str]]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute(LIVE_HASH, {"ids": ids, "below": below})
        return {str(r): (int(n), str(h)) for r, n, h in await cur.fetchall()}


async def prune_bench(
    url: str,
    *,
    steps: int = 1_000_000,
    per_run: int = 1000,
    live: int = 8,
    batch: int = 100,
    baseline: float = 10.0,
    pace_ms: float = 5.0,
    log: Any = print,
) -> dict[str, Any]:
    """Every figure and check of the module docstring, on ``url`` (an empty migrated database)."""
    out: dict[str, Any] = {"steps": steps, "per_run": per_run, "live": live, "batch": batch}
    problems: list[str] = []
    async with await Store.open(url, max_size=live + 2) as store, await Store.open(
        url, min_size=1, max_size=1
    ) as pruner:
        log(f"filling {steps:,} steps of finished runs ({per_run} a run)")
        out["fill"] = await fill(url, store, steps, per_run)
        log(f"filled in {out['fill']['fill_s']:.1f} s "
            f"({out['fill']['agent_step_bytes'] / 2**20:.0f} MiB of agent_step)")
        leases, parked = await live_runs(url, store, live)
        live_ids = [lease.run_id for lease in leases] + [parked]
        before = await live_hash(url, live_ids, LIVE_INITIAL_STEPS)

        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as admin:
            try:
                await admin.execute("CREATE EXTENSION IF NOT EXISTS pgrowlocks")
                rowlocks = True
            except psycopg.Error as exc:
                rowlocks = False
                log(f"pgrowlocks not available ({' '.join(str(exc).split())[:120]}): "
                    "no sampling of the prune's row locks")
            async with pruner.pool.connection() as conn:
                cur = await conn.execute("SELECT pg_backend_pid()")
                row = await cur.fetchone()
                assert row is not None
                prune_pid = int(row[0])

            writers = Writers(store, leases, pace_ms / 1000)
            tasks = [asyncio.create_task(writers.run(lease)) for lease in leases]
            sampling = asyncio.Event()
            waits: list[float] = []
            lock_samples = 0
            prune_locked_live: set[str] = set()
            sampler: asyncio.Task[None] | None = None

            async def sample() -> None:
                nonlocal lock_samples
                while not sampling.is_set():
                    cur = await admin.execute(LOCK_WAITS, {"prune_pid": prune_pid})
                    for _pid, waited in await cur.fetchall():
                        waits.append(float(waited) * 1000)
                    if rowlocks:
                        cur = await admin.execute(
                            PRUNE_ROW_LOCKS, {"prune_pid": prune_pid, "live": live_ids}
                        )
                        prune_locked_live.update(str(r[0]) for r in await cur.fetchall())
                    lock_samples += 1
                    await asyncio.sleep(SAMPLE_INTERVAL)

            try:
                log(f"{live} live runs appending; baseline for {baseline:g} s")
                await asyncio.sleep(baseline)
                sampler = asyncio.create_task(sample())
                writers.phase = "prune"
                cutoff = await _db_now(admin) - _days(1)
                batches: list[dict[str, Any]] = []
                t0 = time.perf_counter()
                while True:
                    b0 = time.perf_counter()
                    done = await pruner.prune_batch(cutoff, sorted(TERMINAL_STATUSES), batch)
                    if done.runs == 0:
                        break
                    batches.append(
                        {"runs": done.runs, "steps": done.steps,
                         "s": time.perf_counter() - b0}
                    )
                    if len(batches) % 5 == 0:
                        log(f"  batch {len(batches)}: {sum(b['runs'] for b in batches)} runs")
                wall = time.perf_counter() - t0
            finally:
                writers.stop.set()
                sampling.set()
                await asyncio.gather(*tasks, return_exceptions=True)
                if sampler is not None:
                    await sampler
            for t in tasks:  # an append that failed is a finding, not noise
                if t.exception() is not None:
                    problems.append(f"a live writer failed: {t.exception()!r}")

            deleted_runs = sum(b["runs"] for b in batches)
            deleted_steps = sum(b["steps"] for b in batches)
            base, during = (latency(writers.latencies[p]) for p in ("baseline", "prune"))
            out["prune"] = {
                "wall_s": wall,
                "batches": len(batches),
                "runs_deleted": deleted_runs,
                "steps_deleted": deleted_steps,
                "runs_per_s": deleted_runs / wall if wall else 0.0,
                "steps_per_s": deleted_steps / wall if wall else 0.0,
                "batch_p50_s": statistics.median([b["s"] for b in batches]) if batches else 0.0,
                "batch_max_s": max((b["s"] for b in batches), default=0.0),
            }
            out["live_appends"] = {
                "baseline": base,
                "during_prune": during,
                "ratio_p50": during["p50_ms"] / base["p50_ms"],
                "ratio_p99": during["p99_ms"] / base["p99_ms"],
                "ratio_max": during["max_ms"] / base["max_ms"],
            }
            out["locks"] = {
                "samples": lock_samples,
                "writer_lock_waits_seen": len(waits),
                "longest_writer_lock_wait_ms": max(waits, default=0.0),
                "rowlocks_sampled": rowlocks,
                "prune_locks_on_live_rows": sorted(prune_locked_live),
            }

            # -- the checks ---------------------------------------------------------------
            after = await live_hash(url, live_ids, LIVE_INITIAL_STEPS)
            if after != before:
                problems.append("live steps changed during the prune")
            cur = await admin.execute(
                "SELECT run_id, count(*), max(seq), count(*) FILTER (WHERE xmax <> 0) "
                "FROM agent_step WHERE run_id = ANY(%s) GROUP BY run_id",
                (live_ids,),
            )
            counts = {r: (int(n), int(m), int(x)) for r, n, m, x in await cur.fetchall()}
            for lease in leases:
                want = writers.appended.get(lease.run_id, LIVE_INITIAL_STEPS)
                n, top, _ = counts.get(lease.run_id, (0, -1, 0))
                if (n, top) != (want, want - 1):
                    problems.append(
                        f"live run {lease.run_id}: {n} steps up to {top}, {want} appended"
                    )
            if counts.get(parked, (0, -1, 0))[:2] != (5, 4):
                problems.append(f"the pending run {parked} lost steps")
            touched = sum(x for _, _, x in counts.values())
            if touched:
                problems.append(f"{touched} live step rows were locked or deleted (xmax set)")
            if prune_locked_live:
                problems.append(f"the prune held locks on live runs {sorted(prune_locked_live)}")
            cur = await admin.execute(
                "SELECT pool, count(*), (SELECT count(*) FROM agent_step s JOIN agent_run r2 "
                "ON r2.id = s.run_id WHERE r2.pool = r.pool) FROM agent_run r GROUP BY pool"
            )
            left = {p: (int(n), int(s)) for p, n, s in await cur.fetchall()}
            out["left"] = left
            if left.get("old", (0, 0)) != (0, 0):
                problems.append(f"old finished runs left: {left['old']}")
            if left.get("young") != (YOUNG_FINISHED, YOUNG_FINISHED * 10):
                problems.append(f"young finished runs not all kept: {left.get('young')}")
            if deleted_runs != out["fill"]["finished_runs"] or deleted_steps != (
                out["fill"]["finished_steps"]
            ):
                problems.append(
                    f"deleted {deleted_runs} runs and {deleted_steps} steps, filled "
                    f"{out['fill']['finished_runs']} and {out['fill']['finished_steps']}"
                )
            for lease in leases:
                run = await store.get_run(lease.run_id)
                if run.status != "running":
                    problems.append(f"live run {lease.run_id} is {run.status}")
    out["problems"] = problems
    return out


async def _db_now(conn: psycopg.AsyncConnection[Any]) -> Any:
    cur = await conn.execute("SELECT now()")
    row = await cur.fetchone()
    assert row is not None
    return row[0]


def _days(n: int) -> Any:
    from datetime import timedelta

    return timedelta(days=n)


def print_report(r: dict[str, Any]) -> None:
    f, p, la, lk = r["fill"], r["prune"], r["live_appends"], r["locks"]
    print(f"filled: {f['finished_runs']:,} finished runs, {f['finished_steps']:,} steps "
          f"({f['agent_step_bytes'] / 2**20:.0f} MiB) in {f['fill_s']:.1f} s; "
          f"{r['live']} live runs appending, {f['young_runs']} young finished runs")
    print(f"prune: {p['runs_deleted']:,} runs, {p['steps_deleted']:,} steps in {p['batches']} "
          f"batches of {r['batch']} runs, {p['wall_s']:.1f} s: {p['runs_per_s']:,.0f} runs/s, "
          f"{p['steps_per_s']:,.0f} steps/s; a batch p50 {p['batch_p50_s']:.2f} s, "
          f"max {p['batch_max_s']:.2f} s")
    print(f"{'live appends':14} {'n':>7} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for name, d in (("baseline", la["baseline"]), ("during prune", la["during_prune"])):
        print(f"{name:14} {d['n']:7} {d['p50_ms']:8.2f} {d['p99_ms']:8.2f} {d['max_ms']:8.2f}")
    print(f"{'ratio':14} {'':7} {la['ratio_p50']:7.2f}x {la['ratio_p99']:7.2f}x "
          f"{la['ratio_max']:7.2f}x")
    print(f"locks ({lk['samples']} samples every {SAMPLE_INTERVAL * 1000:.0f} ms): "
          f"{lk['writer_lock_waits_seen']} writer lock waits seen, the longest "
          f"{lk['longest_writer_lock_wait_ms']:.1f} ms; prune row locks on live runs: "
          + (str(len(lk["prune_locks_on_live_rows"])) if lk["rowlocks_sampled"]
             else "not sampled (no pgrowlocks)"))
    print("checks: " + ("all passed (live steps unchanged and all present, no live step row "
                        "ever locked, old finished runs gone, young ones kept)"
                        if not r["problems"] else "FAILED: " + "; ".join(r["problems"])))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=1_000_000, help="steps of finished runs")
    ap.add_argument("--steps-per-run", type=int, default=1000, help="steps per finished run")
    ap.add_argument("--live", type=int, default=8, help="live runs appending during the prune")
    ap.add_argument("--batch", type=int, default=100, help="runs per prune batch")
    ap.add_argument("--baseline", type=float, default=10.0, help="seconds of appends before")
    ap.add_argument("--pace-ms", type=float, default=5.0, help="each writer's pause per append")
    ap.add_argument("--admin-url")
    ap.add_argument("--json", help="also write the results to this JSON file")
    args = ap.parse_args()
    with throwaway_database("agentrun_prune", args.admin_url) as url:
        with psycopg.connect(url) as c:
            version = c.execute("SHOW server_version").fetchone()
        print(f"prune benchmark: PostgreSQL {version[0] if version else '?'}")
        r = asyncio.run(prune_bench(
            url, steps=args.steps, per_run=args.steps_per_run, live=args.live, batch=args.batch,
            baseline=args.baseline, pace_ms=args.pace_ms,
        ))
    print_report(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2, default=str)
    return 1 if r["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
