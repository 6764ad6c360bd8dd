"""Claim and heartbeat benchmark (issue 17): the claim with many held runs, the heartbeat's load.

    python -m benchmarks.claim_bench [--held 10000] [--rounds 200] [--admin-url URL] [--json FILE]

1. Claim latency: the claim statement (queries.sql claim_runs) taking one pending run of a pool
   that also holds ``held`` running runs with live leases of other workers (each holding as many
   as a worker of the default concurrency does), all older than the pending ones (the worst case
   for a claim that walks created_at order), next to the same claim in a pool that holds none
   (the baseline), and the statement before migration 0015 (:data:`OLD_CLAIM_RUNS`, over the
   index it had, :data:`OLD_INDEX`) in both pools. Each claim runs in a transaction rolled back
   after it, so every round sees the same rows; each statement's two pools are interleaved round
   by round, on one connection, each statement prepared once and executed from then on, as the
   store sends them (prepared on first use; a claim commits, so it stays prepared). The new
   statement's rounds come first and the old one's after them, not interleaved with them: the old
   statement's scans (387 buffers, 3-5 ms) between the new one's rounds cooled the caches the new
   one ran in, a bench artifact no worker meets (0.84 against 0.62 ms p50 with 10,000 held, 6
   alternations of the two orders in one process, 2026-12-08). Also how PostgreSQL
   planned each: a generic plan kept, or a custom plan made each time. Also the shared buffers
   each variant touches (EXPLAIN (ANALYZE, BUFFERS)): the new claim's must not grow with the held
   runs.
2. Heartbeat statements: one in-process worker holding ``held_runs`` runs, each inside a model
   call (progress, no commit), its heartbeat counted for a few intervals: statements per minute
   (one renewal statement per interval whatever the number of runs; before, one per run).

Importable: :func:`claim_latency` and :func:`heartbeat_load` return dicts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any
from uuid import UUID

import psycopg
from psycopg import pq
from psycopg.types.json import Jsonb

from agentrun.manifests import DEFAULT_MAX_ATTEMPTS, DEFAULT_MAX_STEPS
from agentrun.sql import queries
from agentrun.store import Lease, Store
from agentrun.worker.settings import WorkerSettings
from benchmarks.throwaway_db import throwaway_database

#: queries.sql claim_runs before migration 0015 (kept as the baseline): one scan of pending and
#: running runs in created_at order over agent_run_claimable_idx, skipping unexpired leases.
OLD_CLAIM_RUNS = """
WITH candidate AS (
    SELECT id, k8s_namespace, status, max_attempts, created_at,
           CASE WHEN next_seq > claim_seq THEN 0 ELSE stalled_attempts END AS stalled
      FROM agent_run r
     WHERE pool = %(pool)s
       AND status IN ('pending', 'running')
       AND (lease_until IS NULL OR lease_until < now())
       AND NOT (status = 'pending' AND EXISTS (
               SELECT 1 FROM namespace_quota q
                WHERE q.namespace = r.k8s_namespace AND q.running >= q.max_running))
     ORDER BY created_at, id
     LIMIT %(limit)s
     FOR UPDATE SKIP LOCKED
), starting AS (
    SELECT id, k8s_namespace,
           row_number() OVER (PARTITION BY k8s_namespace ORDER BY created_at, id) AS rank
      FROM candidate
     WHERE status = 'pending' AND stalled < max_attempts AND k8s_namespace IS NOT NULL
), wanted AS (
    SELECT k8s_namespace AS namespace, count(*)::integer AS n FROM starting GROUP BY 1
), locked AS (
    SELECT q.namespace FROM namespace_quota q
     WHERE q.namespace IN (SELECT namespace FROM wanted)
     ORDER BY q.namespace
       FOR UPDATE
), granted AS (
    UPDATE namespace_quota q
       SET running    = q.running + least(w.n, greatest(q.max_running - q.running, 0)),
           last_grant = least(w.n, greatest(q.max_running - q.running, 0))
      FROM wanted w
     WHERE q.namespace = w.namespace AND q.namespace IN (SELECT namespace FROM locked)
    RETURNING q.namespace, q.last_grant
), refused AS (
    SELECT s.id FROM starting s JOIN granted g ON g.namespace = s.k8s_namespace
     WHERE s.rank > g.last_grant
)
UPDATE agent_run r
   SET status      = CASE WHEN c.stalled >= r.max_attempts THEN 'dead_letter' ELSE 'running' END,
       lease_owner = CASE WHEN c.stalled >= r.max_attempts THEN NULL ELSE %(worker)s END,
       lease_until = CASE WHEN c.stalled >= r.max_attempts THEN NULL
                          ELSE now() + make_interval(secs => %(ttl)s) END,
       lease_epoch = r.lease_epoch + 1,
       attempt     = CASE WHEN c.stalled >= r.max_attempts THEN r.attempt ELSE r.attempt + 1 END,
       stalled_attempts = CASE WHEN c.stalled >= r.max_attempts THEN c.stalled
                               ELSE c.stalled + 1 END,
       claim_seq   = r.next_seq,
       error       = CASE WHEN c.stalled >= r.max_attempts
                          THEN format('dead-lettered: claimed %%s times in a row without '
                                      'committing a step (maxAttempts %%s; %%s claims in all); '
                                      'last error: %%s',
                                      c.stalled, r.max_attempts, r.attempt,
                                      coalesce(r.error, 'none'))
                          ELSE r.error END,
       started_at  = coalesce(r.started_at, now()),
       finished_at = CASE WHEN c.stalled >= r.max_attempts THEN now() ELSE NULL END
  FROM candidate c
 WHERE r.id = c.id
   AND r.id NOT IN (SELECT id FROM refused)
RETURNING r.*
"""
#: The index the old claim scanned (migration 0001; dropped by 0015), made again for it here.
OLD_INDEX = (
    "CREATE INDEX IF NOT EXISTS agent_run_claimable_idx ON agent_run (pool, created_at, id) "
    "WHERE status IN ('pending', 'running')"
)

HELD_POOL, EMPTY_POOL = "held", "empty"
SPEC = Jsonb({"model": "bench", "system": "bench"})


def add_runs(conn: psycopg.Connection[Any], pool: str, n: int, *, held_by: str | None,
             age_s: float, per_holder: int | None = None) -> None:
    """``n`` runs of ``pool`` created ``age_s`` seconds ago (a millisecond apart): running under
    an hour's lease of ``held_by``, or pending if None. With ``per_holder``, the leases are held
    by workers ``held_by-0``, ``held_by-1``, ... of that many runs each."""
    conn.execute(
        "INSERT INTO agent_run (pool, task, model, agent_spec, max_steps, max_attempts, status,"
        " lease_owner, lease_until, lease_epoch, attempt, created_at)"
        " SELECT %(pool)s, 'bench', 'bench', %(spec)s, %(max_steps)s, %(max_attempts)s,"
        " CASE WHEN %(owner)s::text IS NULL THEN 'pending' ELSE 'running' END,"
        " CASE WHEN %(per)s::integer IS NULL THEN %(owner)s"
        "      ELSE %(owner)s || '-' || ((i - 1) / %(per)s::integer) END,"
        " CASE WHEN %(owner)s::text IS NULL THEN NULL ELSE now() + interval '1 hour' END,"
        " CASE WHEN %(owner)s::text IS NULL THEN 0 ELSE 1 END,"
        " CASE WHEN %(owner)s::text IS NULL THEN 0 ELSE 1 END,"
        " now() - make_interval(secs => %(age)s) + i * interval '1 millisecond'"
        " FROM generate_series(1, %(n)s) AS i",
        {"pool": pool, "spec": SPEC, "owner": held_by, "age": age_s, "n": n, "per": per_holder,
         "max_steps": DEFAULT_MAX_STEPS, "max_attempts": DEFAULT_MAX_ATTEMPTS},
    )


def explain_claim(conn: psycopg.Connection[Any], statement: str, pool: str) -> dict[str, float]:
    """One claim of ``pool`` under EXPLAIN (ANALYZE, BUFFERS), rolled back: the shared buffers
    (hit + read) it touched, its planning and execution times."""
    params = {"pool": pool, "worker": "bench", "limit": 1, "ttl": 60.0}
    with conn.transaction(force_rollback=True):
        row = conn.execute(  # type: ignore[call-overload]
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + statement, params
        ).fetchone()
    top = row[0][0]
    plan = top["Plan"]
    return {
        "buffers": int(plan.get("Shared Hit Blocks", 0)) + int(plan.get("Shared Read Blocks", 0)),
        "planning_ms": float(top.get("Planning Time", 0.0)),
        "execution_ms": float(top.get("Execution Time", 0.0)),
    }


def _stats(samples: Sequence[float]) -> dict[str, float]:
    s = sorted(samples)
    return {
        "p50_ms": statistics.median(s) * 1000,
        "p10_ms": s[len(s) // 10] * 1000,
        "p90_ms": s[(len(s) * 9) // 10] * 1000,
    }


def _raw(conn: psycopg.Connection[Any], command: bytes) -> None:
    """BEGIN or ROLLBACK sent on the libpq connection itself. psycopg forgets every prepared
    statement at a rollback it sees (it cannot know what the rollback undid), so each round
    would prepare and plan the claim anew; the store's claims commit, and never pay that."""
    res = conn.pgconn.exec_(command)
    if res.status != pq.ExecStatus.COMMAND_OK:
        raise RuntimeError(f"{command.decode()}: {res.error_message.decode(errors='replace')}")


def plan_kinds(conn: psycopg.Connection[Any]) -> dict[str, dict[str, int]]:
    """Generic and custom plans PostgreSQL made for the new and the old claim statement on
    ``conn`` (pg_prepared_statements): a kept generic plan is planned once."""
    kinds: dict[str, dict[str, int]] = {}
    for statement, generic, custom in conn.execute(
        "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements"
    ):
        name = "new" if "WITH pending AS" in statement else (
            "old" if "WITH candidate AS" in statement else None)
        if name is not None:
            kinds[name] = {"generic": int(generic), "custom": int(custom)}
    return kinds


def _timed_claim(conn: psycopg.Connection[Any], name: str, statement: str, pool: str) -> float:
    """One claim of ``pool`` by ``statement`` in a transaction rolled back after it: seconds."""
    params = {"pool": pool, "worker": "bench", "limit": 1, "ttl": 60.0}
    _raw(conn, b"BEGIN")
    try:
        t0 = time.perf_counter()
        cur = conn.execute(statement, params, prepare=True)  # type: ignore[call-overload]
        got = cur.fetchall()
        elapsed = time.perf_counter() - t0
    finally:
        _raw(conn, b"ROLLBACK")
    if not any(r[0] is not None for r in got):
        raise RuntimeError(f"{name}: the claim took no run")
    return elapsed


def claim_latency(url: str, held: int = 10_000, rounds: int = 200) -> dict[str, Any]:
    """Claim latency with ``held`` held runs in the pool vs none, new and old statement."""
    variants = {
        "new, held": (queries["claim_runs"], HELD_POOL),
        "new, none held": (queries["claim_runs"], EMPTY_POOL),
        "old, held": (OLD_CLAIM_RUNS, HELD_POOL),
        "old, none held": (OLD_CLAIM_RUNS, EMPTY_POOL),
    }
    with psycopg.connect(url, autocommit=True) as conn:
        add_runs(conn, HELD_POOL, held, held_by="other-worker", age_s=7200,
                 per_holder=WorkerSettings().concurrency)
        for pool in (HELD_POOL, EMPTY_POOL):
            add_runs(conn, pool, 20, held_by=None, age_s=60)
        conn.execute(OLD_INDEX)
        conn.execute("ANALYZE agent_run")
        times: dict[str, list[float]] = {name: [] for name in variants}
        order: list[str] = []
        for block in (("new, held", "new, none held"), ("old, held", "old, none held")):
            for _ in range(rounds):
                for name in block:
                    statement, pool = variants[name]
                    times[name].append(_timed_claim(conn, name, statement, pool))
                    order.append(name)
        plans = plan_kinds(conn)
        explained = {name: explain_claim(conn, s, p) for name, (s, p) in variants.items()}
    stats = {name: _stats(t) for name, t in times.items()}
    return {
        "held": held,
        "rounds": rounds,
        "variants": stats,
        "explained": explained,
        "plans": plans,
        "new_held_p50_ms": stats["new, held"]["p50_ms"],
        "ratio_new": stats["new, held"]["p50_ms"] / stats["new, none held"]["p50_ms"],
        "ratio_old": stats["old, held"]["p50_ms"] / stats["old, none held"]["p50_ms"],
        "old_held_p50_ms": stats["old, held"]["p50_ms"],
        "order": order,
    }


class CountingStore(Store):
    """The store, counting the renewal statements the heartbeat sends (in a dict, which the
    worker's view of the store with its own TTL shares)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.counts = {"renewals": 0, "statements": 0}

    async def renew_all(self, leases: Sequence[Lease]) -> dict[UUID, Exception]:
        lost = await super().renew_all(leases)
        self.counts["renewals"] += 1
        # renew_leases, and fence_states when some were lost
        self.counts["statements"] += 1 + bool(lost)
        return lost

    async def renew(self, lease: Lease) -> Any:
        self.counts["statements"] += 1
        return await super().renew(lease)


async def heartbeat_load(url: str, held_runs: int = 100, lease_ttl: float = 3.0,
                         intervals: int = 4) -> dict[str, Any]:
    """Renewal statements per minute of one worker holding ``held_runs`` runs that progress
    without committing (each inside a model call), over ``intervals`` heartbeat intervals."""
    import anthropic

    from agentrun.manifests import AgentSpec
    from agentrun.tools import ToolRegistry
    from agentrun.worker.executor import RunHandle
    from agentrun.worker.process import Worker, WorkerSettings

    store = await CountingStore.open(url, max_size=4)
    client = anthropic.AsyncAnthropic(base_url="http://127.0.0.1:9", api_key="unused")
    try:
        settings = WorkerSettings(lease_ttl=lease_ttl, health_port=None, worker_id="bench-w",
                                  concurrency=held_runs)
        worker = Worker(store, client, ToolRegistry(), settings)
        spec = AgentSpec(model="bench", system="bench")
        for i in range(held_runs):
            await store.create_run(f"held #{i}", spec)
        held = store.with_lease_ttl(lease_ttl)
        claimed = (await held.claim("default", "bench-w", held_runs)).claimed
        if len(claimed) != held_runs:
            raise RuntimeError(f"claimed {len(claimed)} of {held_runs} runs")
        idle = asyncio.Event()
        handles = []
        for run, lease in claimed:
            h = RunHandle(run, lease, lease_ttl=lease_ttl)
            h.task = asyncio.create_task(idle.wait())
            h.progress.begin("model call")  # working, no commit: only the heartbeat renews
            handles.append(h)
        worker.active = {h.run.id: h for h in handles}
        beat = asyncio.create_task(worker._heartbeat())
        t0 = time.monotonic()
        await asyncio.sleep(intervals * lease_ttl / 3)
        elapsed = time.monotonic() - t0
        beat.cancel()
        await asyncio.wait({beat}, timeout=5)
        lost = [h.run_id for h in handles if h.abort_reason is not None]
        for h in handles:
            assert h.task is not None
            h.task.cancel()
        if lost:
            raise RuntimeError(f"the heartbeat lost {len(lost)} of {held_runs} leases")
        per_min = store.counts["statements"] * 60 / elapsed
        return {
            "held_runs": held_runs,
            "lease_ttl_s": lease_ttl,
            "seconds": elapsed,
            "statements": store.counts["statements"],
            "statements_per_minute": per_min,
            # Before: one renewal per held run every third of the TTL.
            "before_statements_per_minute": held_runs * 60 / (lease_ttl / 3),
            # At the default TTL (15 s): one statement per 5 s per worker.
            "per_minute_at_default_ttl": per_min * lease_ttl / 15.0,
        }
    finally:
        await store.close()
        await client.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--held", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--admin-url")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    with throwaway_database("agentrun_claim", args.admin_url) as url:
        out = {"claim": claim_latency(url, args.held, args.rounds)}
    with throwaway_database("agentrun_beat", args.admin_url) as url:
        out["heartbeat"] = asyncio.run(heartbeat_load(url))
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
