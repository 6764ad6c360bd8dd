"""Issue 17, the worker's side: the claim does not read held runs, an empty claim says when the
next foreign lease runs out (one query), an idle worker sleeps until then, and one heartbeat
statement renews every held run that is due, dropping only the ones fenced off."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import anthropic
import psycopg
import pytest
from benchmarks.claim_bench import add_runs, claim_latency, explain_claim

from agentrun.errors import LeaseLost, RunCancelled
from agentrun.sql import queries
from agentrun.store import ClaimResult, Store
from agentrun.tools import ToolRegistry
from agentrun.worker.executor import RunHandle
from agentrun.worker.process import Worker, WorkerSettings
from tests.workerkit import AGENT, wait_for

HELD = 2000


def test_the_claim_takes_a_pending_run_past_held_runs_without_reading_them(
    database_url: str,
) -> None:
    # Before migration 0015 the claim walked every run held longer than the oldest pending one
    # (96 buffers with 2,000 held runs here, against 23 with none).
    with psycopg.connect(database_url, autocommit=True) as conn:
        add_runs(conn, "held", HELD, held_by="another-worker", age_s=7200)
        for pool in ("held", "empty"):
            add_runs(conn, pool, 3, held_by=None, age_s=60)
        conn.execute("VACUUM (ANALYZE) agent_run")  # as autovacuum leaves a table: hint bits set
        for pool in ("held", "empty"):
            explain_claim(conn, queries["claim_runs"], pool)  # the catalog caches warm
        held = explain_claim(conn, queries["claim_runs"], "held")
        empty = explain_claim(conn, queries["claim_runs"], "empty")
        assert held["buffers"] <= empty["buffers"] + 8, (held, empty)
        rows = conn.execute(queries["claim_runs"], {
            "pool": "held", "worker": "w", "limit": 2, "ttl": 60.0}).fetchall()
    claimed = [r for r in rows if r[0] is not None]
    assert len(claimed) == 2  # the two oldest pending runs, past the held ones
    next_expiry = rows[0][-1]
    assert 3500 < next_expiry <= 3600  # the held runs' hour-long leases


async def test_the_store_plans_its_claim_once_while_other_workers_hold_runs(
    database_url: str,
) -> None:
    # A claim planned anew each time costs about 1 ms of planning on top of its 0.3 ms of
    # execution. The store prepares it on its connection's first claim, and PostgreSQL keeps the
    # generic plan once it costs no more than the custom ones: planned once, as the claim
    # benchmark (below) times it.
    with psycopg.connect(database_url, autocommit=True) as conn:
        add_runs(conn, "held", HELD, held_by="other", age_s=7200,
                 per_holder=WorkerSettings().concurrency)
        add_runs(conn, "held", 12, held_by=None, age_s=60)
        conn.execute("ANALYZE agent_run")
    store = await Store.open(database_url, min_size=1, max_size=1)
    try:
        for _ in range(12):
            assert len((await store.claim("held", "w", 1)).claimed) == 1
        async with store.pool.connection() as conn:
            cur = await conn.execute(
                "SELECT generic_plans, custom_plans FROM pg_prepared_statements"
                " WHERE statement LIKE %s", ("%WITH pending AS%",))
            plans = await cur.fetchall()
    finally:
        await store.close()
    assert len(plans) == 1, plans
    generic, custom = plans[0]
    # The first five executions are planned for their values; PostgreSQL compares after them.
    assert custom <= 5 and generic == 12 - custom, plans[0]


def test_the_claim_bench_times_a_claim_prepared_once_as_the_store_sends_it(
    database_url: str,
) -> None:
    # Before, each round's rollback made psycopg forget the prepared claim: every round prepared
    # and planned it anew (2.5 ms with 10,000 held, against 0.6-0.7 ms as the store sends it).
    res = claim_latency(database_url, held=200, rounds=10)
    assert res["plans"]["new"]["custom"] <= 5, res["plans"]  # planned for its values 5 times
    assert sum(res["plans"]["new"].values()) == 2 * 10  # held and none held: one statement
    with psycopg.connect(database_url) as conn:
        holders = conn.execute("SELECT count(DISTINCT lease_owner) FROM agent_run"
                               " WHERE pool = 'held' AND status = 'running'").fetchone()
    assert holders == (200 // WorkerSettings().concurrency,)  # held as a pool of workers holds
    # The old statement's rounds come after the new one's, not between them: its scans cooled the
    # caches the new claim ran in (0.84 against 0.62 ms p50 with 10,000 held, same process).
    new = {"new, held", "new, none held"}
    last_new = max(i for i, name in enumerate(res["order"]) if name in new)
    assert set(res["order"][: last_new + 1]) == new, res["order"]
    assert len(res["order"]) == 4 * 10  # every variant timed each round


async def test_an_empty_claim_says_when_another_workers_lease_runs_out(store: Store) -> None:
    await store.create_run("held elsewhere", AGENT)
    assert (await store.with_lease_ttl(30).claim("default", "other", 1)).claimed
    empty = await store.claim("default", "w", 1)
    assert empty.claimed == [] and empty.next_expiry is not None
    assert 25 < empty.next_expiry <= 30
    # Its own leases are not waited for: it renews them.
    mine = await store.claim("default", "other", 1)
    assert mine.claimed == [] and mine.next_expiry is None
    # Nothing held in the pool: nothing to wait for.
    assert (await store.claim("nobody-here", "w", 1)).next_expiry is None


async def test_one_statement_renews_the_held_runs_and_drops_a_zombie(
    store: Store, database_url: str
) -> None:
    for i in range(4):
        await store.create_run(f"held #{i}", AGENT)
    claimed = (await store.with_lease_ttl(5).claim("default", "w", 4)).claimed
    leases = {run.task: lease for run, lease in claimed}
    zombie, cancelled = leases["held #0"], leases["held #1"]
    # held #0's lease runs out and another worker claims it (its epoch is bumped): w is a zombie.
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute("UPDATE agent_run SET lease_until = now() - interval '1 second'"
                           " WHERE id = %s", (zombie.run_id,))
    taken = await store.claim("default", "z", 1)
    assert [lease.run_id for _, lease in taken.claimed] == [zombie.run_id]
    await store.cancel(cancelled.run_id)

    settings = WorkerSettings(lease_ttl=60, health_port=None, worker_id="w")
    client = anthropic.AsyncAnthropic(base_url="http://127.0.0.1:9", api_key="unused")
    renewals: list[int] = []
    original = store.renew_all

    async def counted(ls: Sequence[Any]) -> Any:
        renewals.append(len(ls))
        return await original(ls)

    store.renew_all = counted  # type: ignore[method-assign]
    worker = Worker(store, client, ToolRegistry(), settings)
    worker.store.renew_all = counted  # type: ignore[method-assign]
    idle = asyncio.Event()
    handles = []
    for run, lease in claimed:
        h = RunHandle(run, lease, lease_ttl=5, last_renewed=time.monotonic() - 30)
        h.task = asyncio.create_task(idle.wait())
        h.progress.begin("model call")
        handles.append(h)
    worker.active = {h.run.id: h for h in handles}
    try:
        before = {h.run.id: (await store.get_run(h.run.id)).lease_until for h in handles}
        assert await worker._beat(settings.lease_ttl / 3)
        assert renewals == [4]  # one statement for the four runs
        by_task = {h.run.task: h for h in handles}
        assert by_task["held #0"].abort_reason == "lease lost"
        assert by_task["held #1"].abort_reason == "cancelled"
        for task in ("held #2", "held #3"):
            h = by_task[task]
            assert h.abort_reason is None
            after = (await store.get_run(h.run.id)).lease_until
            assert after is not None and before[h.run.id] is not None
            assert after > before[h.run.id]
        # The zombie's run stays the other worker's.
        assert (await store.get_run(zombie.run_id)).lease_owner == "z"
    finally:
        for h in handles:
            assert h.task is not None
            h.task.cancel()
        await client.close()


async def test_renew_all_says_why_each_run_was_not_renewed(store: Store) -> None:
    for i in range(2):
        await store.create_run(f"r{i}", AGENT)
    (_, la), (b, lb) = (await store.claim("default", "w", 2)).claimed
    await store.cancel(b.id)
    lost = await store.renew_all([la, lb])
    assert set(lost) == {lb.run_id} and isinstance(lost[lb.run_id], RunCancelled)
    with pytest.raises(ValueError):
        await store.renew_all([la, type(la)(la.run_id, "someone-else", la.epoch)])
    assert isinstance(LeaseLost("x", "y"), LeaseLost)


class CountingClaims(Store):
    async def claim(self, *args: Any, **kwargs: Any) -> ClaimResult:
        result = await super().claim(*args, **kwargs)
        self.claims.append(time.monotonic())  # type: ignore[attr-defined]
        return result


async def test_an_idle_listening_worker_claims_once_per_idle_interval(database_url: str) -> None:
    # poll_interval 0.1 s: before, an idle worker claimed (and checked the next lease expiry)
    # ten times a second here; listening, it now waits for a notification, the next foreign
    # lease expiry (none: no run anywhere) or the idle interval.
    store = await CountingClaims.open(database_url)
    store.claims = []  # type: ignore[attr-defined]
    client = anthropic.AsyncAnthropic(base_url="http://127.0.0.1:9", api_key="unused")
    worker = Worker(store, client, ToolRegistry(), WorkerSettings(
        poll_interval=0.1, idle_interval=60, health_port=None, worker_id="idle"))
    serving = asyncio.create_task(worker.serve())
    try:
        await wait_for(lambda: bool(store.claims), 30, "the first claim")  # type: ignore[attr-defined]
        # The loop sleeps for the idle interval, and it stays alive meanwhile.
        await wait_for(lambda: worker.health.resting > time.monotonic() + 30, 10, "a long sleep")
        first = len(store.claims)  # type: ignore[attr-defined]
        await asyncio.sleep(1.0)  # a window, not a wait: ten polls before
        assert len(store.claims) - first == 0  # type: ignore[attr-defined]
        assert worker.health.alive()
        # A new run is still claimed at once: its NOTIFY wakes the loop.
        run, _ = await store.create_run("wake up", AGENT.model_copy(update={"tools": []}))
        await wait_for(lambda: run.id in worker.active or len(store.claims) > first,  # type: ignore[attr-defined]
                       10, "the claim the notification brings")
    finally:
        worker.request_drain()
        await asyncio.wait({serving}, timeout=30)
        serving.cancel()
        await store.close()
        await client.close()
