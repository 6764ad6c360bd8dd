"""Group commit (issue 17): the concurrent appends of one worker's runs go to PostgreSQL in one
fenced statement, each row fenced on its own run, and each caller gets exactly what a lone append
would have given it (agentrun/group_commit.py, queries.sql append_steps).

The statements are counted at the driver: a wrapper around psycopg.AsyncCursor.execute records
each one (as tests/test_operator_idle.py does)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence
from datetime import datetime
from typing import Any
from unittest.mock import ANY
from uuid import UUID

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from agentrun.errors import DuplicateStep, LeaseLost, RunCancelled
from agentrun.group_commit import AppendStats, GroupCommit
from agentrun.manifests import AgentSpec
from agentrun.sql import queries
from agentrun.store import CHANNEL_RUN_STEPS, Lease, Store
from agentrun.worker.health import WorkerMetrics
from tests.proxykit import TcpProxy
from tests.test_store import expire_lease

AGENT = AgentSpec(model="claude-sonnet-4-5", system="s")

SINGLE, BATCH = queries["append_step"], queries["append_steps"]


class Sent:
    """The append statements sent, in order: "one" (append_step) or "batch" (append_steps),
    with the task that sent each."""

    def __init__(self) -> None:
        self.kinds: list[str] = []
        self.tasks: list[asyncio.Task[Any] | None] = []
        #: Set by a test: run before append_steps is sent, with the cursor.
        self.before_batch: Any = None

    @property
    def batches(self) -> int:
        return self.kinds.count("batch")


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> Iterator[Sent]:
    record = Sent()
    real = psycopg.AsyncCursor.execute

    async def execute(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        if query is SINGLE or query == SINGLE:
            record.kinds.append("one")
            record.tasks.append(asyncio.current_task())
        elif query is BATCH or query == BATCH:
            record.kinds.append("batch")
            record.tasks.append(asyncio.current_task())
            if record.before_batch is not None:
                await record.before_batch(self)
        return await real(self, query, *args, **kwargs)

    monkeypatch.setattr(psycopg.AsyncCursor, "execute", execute)
    yield record


async def held_runs(store: Store, n: int, worker: str = "w1") -> list[Lease]:
    pool = f"gc-{worker}-{n}"
    for i in range(n):
        await store.create_run(f"task {i}", AGENT, pool=pool)
    # A TTL below the appends' own.
    claimed = (await store.with_lease_ttl(10).claim(pool, worker, limit=n)).claimed
    assert len(claimed) == n
    return [lease for _, lease in claimed]


async def append_all(
    store: Store, leases: list[Lease], seqs: list[int] | None = None, **kw: Any
) -> list[Any]:
    """One concurrent append per lease; each one's result or exception."""
    seqs = seqs if seqs is not None else [0] * len(leases)
    return await asyncio.gather(
        *(store.append_step(lease, seq, "model_turn", {"n": i}, input_tokens=10 + i, **kw)
          for i, (lease, seq) in enumerate(zip(leases, seqs, strict=True))),
        return_exceptions=True,
    )


async def terminate_backend(url: str, pid: int) -> None:
    """Kill a session's backend, as a restart does, and wait until it is gone."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as c:
        await c.execute("SELECT pg_terminate_backend(%s)", (pid,))
        # On the state, not the clock: until the backend has gone.
        gone = "SELECT 1 FROM pg_stat_activity WHERE pid = %s"
        for _ in range(3000):  # the bound only stops a hang (30 s)
            if await (await c.execute(gone, (pid,))).fetchone() is None:
                return
            await asyncio.sleep(0.01)
    raise AssertionError(f"backend {pid} still there after pg_terminate_backend")


async def run_row(url: str, run_id: UUID) -> dict[str, Any]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = conn.cursor(row_factory=psycopg.rows.dict_row)
        await cur.execute(
            "SELECT next_seq, input_tokens, lease_until, updated_at FROM agent_run WHERE id = %s",
            (run_id,),
        )
        row = await cur.fetchone()
    assert row is not None
    return row


async def test_concurrent_appends_of_many_runs_become_two_statements(
    store: Store, sent: Sent, database_url: str
) -> None:
    leases = await held_runs(store, 16)
    before = [await run_row(database_url, lease.run_id) for lease in leases]
    results = await append_all(store, leases)
    assert not [r for r in results if isinstance(r, BaseException)]
    # The first is sent at once, alone; the 15 that arrived while it was in flight go together.
    assert sent.kinds == ["one", "batch"]
    assert (store.append_stats.statements, store.append_stats.rows) == (2, 16)
    assert store.append_stats.largest == 15
    for i, (lease, old) in enumerate(zip(leases, before, strict=True)):
        [step] = await store.steps(lease.run_id)
        assert (step.seq, step.payload, step.worker, step.lease_epoch) == (
            0, {"n": i}, "w1", lease.epoch)
        new = await run_row(database_url, lease.run_id)
        # Every side effect of the single append: the counter, the tokens, the lease, updated_at.
        assert new["next_seq"] == 1 and new["input_tokens"] == 10 + i
        assert new["lease_until"] > old["lease_until"]
        assert new["updated_at"] > old["updated_at"]
    # A later round with the seqs that follow: again one statement for those that waited.
    results = await append_all(store, leases, [1] * 16)
    assert not [r for r in results if isinstance(r, BaseException)]
    assert sent.kinds == ["one", "batch", "one", "batch"]


async def test_a_batch_carries_each_rows_tool_call_mark_and_leaves_the_others_marks(
    store: Store, sent: Sent, database_url: str
) -> None:
    # The model turn's append carries its first call's mark (issue 17): in a batch too, on its
    # own row only; a row carrying none keeps the mark it had.
    leases = await held_runs(store, 4)
    await store.begin_tool_call(leases[3], {"tool": "old", "seq": -1})
    results = await asyncio.gather(*(
        store.append_step(lease, 0, "model_turn", {"n": i},
                          tool_call={"tool": "look", "seq": 0, "call_index": 0, "n": i}
                          if i % 2 == 0 else None)
        for i, lease in enumerate(leases)))
    assert all(isinstance(r, datetime) for r in results)
    assert sent.kinds == ["one", "batch"]  # runs 1 to 3 in one statement
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        cur = await conn.execute(
            "SELECT id, tool_call FROM agent_run WHERE id = ANY(%s)",
            ([lease.run_id for lease in leases],))
        marks: dict[UUID, Any] = dict(await cur.fetchall())
    for i, lease in enumerate(leases):
        mark = marks[lease.run_id]
        if i % 2 == 0:  # carried, stamped by the database as begin_tool_call stamps it
            assert mark is not None and mark["n"] == i and "started_at" in mark
        else:
            assert mark == (None if i == 1 else {"tool": "old", "seq": -1, "started_at": ANY})


async def test_a_lone_append_is_one_statement_sent_at_once_by_its_caller(
    store: Store, sent: Sent
) -> None:
    [lease] = await held_runs(store, 1)
    await store.append_step(lease, 0, "model_turn", {"n": 0})
    assert sent.kinds == ["one"]
    assert sent.tasks == [asyncio.current_task()]  # no task, no timer, no queue in between
    assert (store.append_stats.statements, store.append_stats.rows) == (1, 1)
    await store.append_step(lease, 1, "model_turn", {"n": 1})
    assert sent.kinds == ["one", "one"]


async def test_a_zombie_row_gets_lease_lost_while_the_others_commit(
    store: Store, sent: Sent, database_url: str
) -> None:
    leases = await held_runs(store, 6)
    zombie = leases[3]
    await expire_lease(database_url, zombie.run_id)
    [(_, taken)] = (await store.claim(f"gc-w1-{len(leases)}", "w2", limit=1)).claimed
    assert taken.run_id == zombie.run_id and taken.epoch > zombie.epoch
    results = await append_all(store, leases)
    assert sent.kinds == ["one", "batch"]
    assert isinstance(results[3], LeaseLost)
    assert "claimed again" in str(results[3])
    for i, lease in enumerate(leases):
        steps = await store.steps(lease.run_id)
        assert len(steps) == (0 if i == 3 else 1)
    # The zombie's row changed nothing on the run now held by w2.
    assert (await run_row(database_url, zombie.run_id))["input_tokens"] == 0


async def test_a_bumped_epoch_and_a_cancelled_run_each_get_their_own_error(
    store: Store, sent: Sent
) -> None:
    leases = await held_runs(store, 5)
    cancelled, stale = leases[1], leases[4]
    await store.cancel(cancelled.run_id, "no longer needed")
    # The same worker, an older epoch (it lost the run and claimed it again since).
    old = Lease(stale.run_id, stale.worker, stale.epoch - 1)
    results = await append_all(store, [*leases[:4], old])
    assert sent.kinds == ["one", "batch"]
    assert isinstance(results[1], RunCancelled)
    assert isinstance(results[4], LeaseLost)
    assert [isinstance(r, BaseException) for r in results] == [False, True, False, False, True]


async def test_a_duplicate_row_fails_alone_and_changes_nothing(
    store: Store, sent: Sent, database_url: str
) -> None:
    leases = await held_runs(store, 4)
    dup, gap = leases[2], leases[3]
    await store.append_step(dup, 0, "model_turn", {"first": True})
    # A seq below next_seq that is not there (a gap) is no duplicate.
    await store.append_step(gap, 5, "model_turn", {"n": 5})
    before = await run_row(database_url, dup.run_id)
    results = await append_all(store, leases, [0, 0, 0, 1])
    assert sent.kinds == ["one", "one", "one", "batch"]
    assert isinstance(results[2], DuplicateStep)
    assert [isinstance(r, BaseException) for r in results] == [False, False, True, False]
    assert [s.payload for s in await store.steps(dup.run_id)] == [{"first": True}]
    assert [s.seq for s in await store.steps(gap.run_id)] == [1, 5]
    after = await run_row(database_url, dup.run_id)
    # Like the single append's duplicate (rolled back): no tokens, no renewal.
    assert after["input_tokens"] == before["input_tokens"] == 0
    assert after["lease_until"] == before["lease_until"]
    assert store.append_stats.fallbacks == 0


async def test_a_row_the_database_refuses_fails_only_its_own_caller(
    store: Store, sent: Sent
) -> None:
    leases = await held_runs(store, 4)
    # What the single path raises for the same row.
    with pytest.raises(psycopg.errors.CheckViolation):
        await store.append_step(leases[0], 7, "bogus", {})  # type: ignore[arg-type]
    sent.kinds.clear()

    async def one(i: int, lease: Lease) -> Any:
        kind: Any = "bogus" if i == 2 else "note"
        return await store.append_step(lease, 0, kind, {"n": i})

    results = await asyncio.gather(*(one(i, lease) for i, lease in enumerate(leases)),
                                   return_exceptions=True)
    assert sent.kinds[:2] == ["one", "batch"]
    assert isinstance(results[2], psycopg.errors.CheckViolation)
    assert [isinstance(r, BaseException) for r in results] == [False, False, True, False]
    assert store.append_stats.fallbacks == 1
    for i, lease in enumerate(leases):
        assert len(await store.steps(lease.run_id)) == (0 if i == 2 else 1)


async def test_odd_strings_in_a_batch_round_trip(store: Store, sent: Sent) -> None:
    leases = await held_runs(store, 4)
    odd = ["x\x00y", "\ud800", "\uffff0", "plain"]

    async def one(i: int, lease: Lease) -> Any:
        return await store.append_step(lease, 0, "tool_result", {odd[i]: [odd[i]]},
                                       request_id=odd[i] if i % 2 else None)

    results = await asyncio.gather(*(one(i, lease) for i, lease in enumerate(leases)),
                                   return_exceptions=True)
    assert not [r for r in results if isinstance(r, BaseException)]
    assert sent.kinds == ["one", "batch"]
    for i, lease in enumerate(leases):
        [step] = await store.steps(lease.run_id)
        assert step.payload == {odd[i]: [odd[i]]}
        assert step.request_id == (odd[i] if i % 2 else None)


async def test_a_connection_lost_mid_batch_fails_every_caller_and_applies_nothing(
    store: Store, sent: Sent, database_url: str
) -> None:
    leases = await held_runs(store, 5)

    async def kill(cur: Any) -> None:
        await terminate_backend(database_url, cur.connection.info.backend_pid)

    sent.before_batch = kill
    results = await append_all(store, leases)
    assert sent.kinds == ["one", "batch"]
    assert not isinstance(results[0], BaseException)
    errors = results[1:]
    assert all(isinstance(e, psycopg.OperationalError) for e in errors), errors
    assert len({type(e) for e in errors}) == 1
    for lease in leases[1:]:
        assert await store.steps(lease.run_id) == []
        assert (await run_row(database_url, lease.run_id))["input_tokens"] == 0

    # The single path's error for the same loss.
    async def kill_one(cur: Any) -> None:
        await kill(cur)

    real_execute = psycopg.AsyncCursor.execute

    async def execute(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        if query == SINGLE:
            await kill_one(self)
        return await real_execute(self, query, *args, **kwargs)

    single = Store(store.pool, store.url, group_commit=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(psycopg.AsyncCursor, "execute", execute)
        with pytest.raises(psycopg.OperationalError) as lone:
            await single.append_step(leases[1], 0, "model_turn", {})
    assert type(lone.value) is type(errors[0])
    # The callers retry (the worker does) on a fresh connection: it works.
    sent.before_batch = None
    assert not [r for r in await append_all(store, leases[1:]) if isinstance(r, BaseException)]


async def test_without_group_commit_each_append_is_its_own_statement(
    store: Store, sent: Sent
) -> None:
    single = Store(store.pool, store.url, group_commit=False)
    leases = await held_runs(single, 8)
    results = await append_all(single, leases)
    assert not [r for r in results if isinstance(r, BaseException)]
    assert sent.kinds == ["one"] * 8
    assert (single.append_stats.statements, single.append_stats.rows) == (8, 8)


async def test_appends_of_two_runs_of_one_caller_and_two_workers_never_share_a_row(
    store: Store, sent: Sent
) -> None:
    """Two appends of one run (seq 0 and 1) and another worker's runs in one burst: each lands,
    the same run's in separate statements, each worker's under its own fence."""
    mine = await held_runs(store, 3, "w1")
    theirs = await held_runs(store, 3, "w2")
    results = await asyncio.gather(
        store.append_step(mine[0], 0, "note", {}),
        *(store.append_step(lease, 0, "note", {}) for lease in [*mine, *theirs][1:]),
        store.append_step(mine[1], 1, "note", {}),
        return_exceptions=True,
    )
    assert not [r for r in results if isinstance(r, BaseException)], results
    assert sent.batches >= 2
    for lease in [*mine, *theirs]:
        want = 2 if lease is mine[1] else 1
        assert len(await store.steps(lease.run_id)) == want


async def test_a_followed_run_in_a_batch_is_notified_and_the_others_are_not(
    store: Store, sent: Sent, database_url: str
) -> None:
    leases = await held_runs(store, 4)
    followed = leases[2]
    await store.follow_run(followed.run_id, "t")
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(f"LISTEN {CHANNEL_RUN_STEPS}")
        results = await append_all(store, leases)
        assert not [r for r in results if isinstance(r, BaseException)]
        assert sent.kinds == ["one", "batch"]
        heard = [n.payload async for n in conn.notifies(timeout=1.0)]
    assert heard == [str(followed.run_id)]


async def test_a_caller_cancelled_while_queued_is_not_sent(store: Store, sent: Sent) -> None:
    leases = await held_runs(store, 4)
    tasks = [asyncio.create_task(store.append_step(lease, 0, "note", {})) for lease in leases]
    await asyncio.sleep(0)  # all four submitted: the first in flight, three queued
    tasks[2].cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(results[2], asyncio.CancelledError)
    assert [isinstance(r, BaseException) for r in results] == [False, False, True, False]
    assert sent.kinds == ["one", "batch"] and store.append_stats.rows == 3
    assert await store.steps(leases[2].run_id) == []


async def test_the_batcher_caps_a_batch_and_keeps_arrival_order() -> None:
    """The batcher alone, with a fake statement: at most max_batch items, one per slot, the
    first waiting item's group first; the others keep their turn."""
    sent_batches: list[list[tuple[str, int]]] = []
    sessions: list[int] = []

    @contextlib.asynccontextmanager
    async def session() -> AsyncIterator[int]:
        sessions.append(len(sessions))
        yield sessions[-1]

    async def send(items: Sequence[tuple[str, int]], session: int) -> list[int | Exception]:
        sent_batches.append(list(items))
        await asyncio.sleep(0.01)
        return [n for _, n in items]

    batcher: GroupCommit[tuple[str, int], int, int] = GroupCommit(
        send, session, lambda item: (item[0], item[1] % 5), max_batch=3)
    items = [("a", n) for n in range(8)] + [("b", 8), ("a", 10)]
    got = await asyncio.gather(*(batcher.submit(item) for item in items))
    assert got == [n for _, n in items]
    assert sent_batches == [
        [("a", 0)],
        [("a", 1), ("a", 2), ("a", 3)],
        [("a", 4), ("a", 5), ("a", 6)],  # ("a", 5) is slot 0 again, but ("a", 0) went already
        [("a", 7), ("a", 10)],  # ("a", 10): slot 0, its own run's earlier item is long gone
        [("b", 8)],
    ]
    assert batcher.queued == 0
    # The lone first on a session of its own; the four batches that followed it on one.
    assert sessions == [0, 1]


async def test_a_batch_with_no_session_gets_the_error_and_the_next_batch_tries_again() -> None:
    """The pool cannot give the drainer a connection (the database is down): the callers of the
    batch in hand get the error a lone append would have had (PoolTimeout here), none waits for
    ever, and the batch after it is sent once a session opens again."""
    from psycopg_pool import PoolTimeout

    release, trying, gate = asyncio.Event(), asyncio.Event(), asyncio.Event()
    opened: list[str] = []
    refuse = [False, True, False]  # the lone item's session, the first batch's, the next's

    @contextlib.asynccontextmanager
    async def session() -> AsyncIterator[int]:
        if refuse[len(opened)]:
            trying.set()
            await gate.wait()  # the pool trying, until the test has queued one more
            opened.append("refused")
            raise PoolTimeout("couldn't get a connection after 30.00 sec")
        opened.append("opened")
        yield len(opened)

    async def send(items: Sequence[str], session: int) -> list[str | Exception]:
        if items == ["lone"]:
            await release.wait()  # in flight while the others queue
        return [f"sent {item}" for item in items]

    batcher: GroupCommit[str, str, int] = GroupCommit(send, session, lambda item: ("g", item))
    lone = asyncio.create_task(batcher.submit("lone"))
    await asyncio.sleep(0)  # the lone item is in flight (its own session, send waiting)
    first = [asyncio.create_task(batcher.submit(name)) for name in ("b", "c")]
    await asyncio.sleep(0)  # queued behind it
    release.set()
    assert await lone == "sent lone"
    await trying.wait()  # the drainer took b and c, and waits for a session
    assert batcher.queued == 0
    second = asyncio.create_task(batcher.submit("d"))  # queued behind the refused batch
    await asyncio.sleep(0)
    gate.set()
    # Sent once a session opens again (before the fix: cancelled, the drainer dead).
    assert await second == "sent d"
    for task in first:
        assert task.done() and isinstance(task.exception(), PoolTimeout), task
    assert opened == ["opened", "refused", "opened"]
    assert batcher.queued == 0


def test_the_worker_exports_the_append_counters() -> None:
    stats = AppendStats()
    metrics = WorkerMetrics()
    metrics.watch_appends(stats)
    stats.count(1)
    stats.count(15)
    sample = metrics.registry.get_sample_value
    assert sample("agentrun_append_statements_total") == 2
    assert sample("agentrun_append_rows_total") == 16


class Deadlock:
    """A real deadlock with the next statement sent on ``cur`` (:meth:`close_on`): another
    transaction holds the last of ``leases`` in lock order, and once that statement waits for
    it, asks for the first, which the statement holds. The statement's session, at the default
    deadlock_timeout, is the one PostgreSQL fails; then the other transaction rolls back."""

    def __init__(self, url: str, leases: list[Lease]) -> None:
        self.url = url
        self.order = sorted(leases, key=lambda lease: lease.run_id)  # the lock order
        self.task: asyncio.Task[None] | None = None
        self.blocker: psycopg.AsyncConnection[Any] | None = None

    TOUCH = "UPDATE agent_run SET updated_at = now() WHERE id = %s"

    async def __aenter__(self) -> Deadlock:
        self.blocker = await psycopg.AsyncConnection.connect(self.url)
        await self.blocker.execute("SET deadlock_timeout = '60s'")
        await self.blocker.execute(self.TOUCH, (self.order[-1].run_id,))
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            if self.task is not None:
                await asyncio.wait_for(self.task, 30)
        finally:
            assert self.blocker is not None
            await self.blocker.close()

    async def close_on(self, cur: Any) -> None:
        pid = cur.connection.info.backend_pid
        blocker = self.blocker
        assert blocker is not None

        async def take_the_first() -> None:
            async with await psycopg.AsyncConnection.connect(self.url, autocommit=True) as c:
                waiting = ("SELECT 1 FROM pg_stat_activity WHERE pid = %s "
                           "AND wait_event_type = 'Lock'")
                for _ in range(3000):  # the bound only stops a hang (30 s)
                    if await (await c.execute(waiting, (pid,))).fetchone() is not None:
                        break
                    await asyncio.sleep(0.01)
            await blocker.execute(self.TOUCH, (self.order[0].run_id,))  # the statement holds it
            await blocker.rollback()  # the statement was failed; what comes after goes on

        self.task = asyncio.create_task(take_the_first())


async def test_a_batch_failed_to_break_a_deadlock_is_appended_run_by_run(
    store: Store, sent: Sent, database_url: str
) -> None:
    """A batch and another multi-row statement on the same runs (the worker's own heartbeat)
    deadlocked, and PostgreSQL failed the batch: every run in it was dropped as if the database
    were down, though nothing was applied (found by an adversarial review on 2026-12-06). Rows
    are now locked in one order (the heartbeat's too), and a batch failed so is sent again run
    by run."""
    leases = await held_runs(store, 4)
    async with Deadlock(database_url, leases[1:]) as deadlock:
        sent.before_batch = deadlock.close_on
        results = await append_all(store, leases)
    assert sent.kinds[:2] == ["one", "batch"]
    assert not [r for r in results if isinstance(r, BaseException)], results
    assert store.append_stats.fallbacks == 1
    for lease in leases:
        assert len(await store.steps(lease.run_id)) == 1


async def test_a_heartbeat_failed_to_break_a_deadlock_renews_once_more(
    store: Store, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The heartbeat's side of the same deadlock: its renewal, failed whole, is sent once more
    instead of counting every lease as lost for that interval."""
    leases = await held_runs(store, 3)
    real = psycopg.AsyncConnection.execute
    renewals = 0

    async with Deadlock(database_url, leases) as deadlock:
        async def execute(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
            nonlocal renewals
            if query == queries["renew_leases"]:
                renewals += 1
                if renewals == 1:
                    await deadlock.close_on(self.cursor())
            return await real(self, query, *args, **kwargs)

        monkeypatch.setattr(psycopg.AsyncConnection, "execute", execute)
        assert await store.renew_all(leases) == {}
    assert renewals == 2


async def test_a_batch_that_committed_stands_when_the_explanation_of_its_misses_fails(
    store: Store, sent: Sent, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch with a run it could not write (cancelled here) asks why in a second query. The
    connection lost between the two failed every caller, also those whose step had committed
    (found by an adversarial review on 2026-12-06): only the missed run gets the error now."""
    leases = await held_runs(store, 4)
    await store.cancel(leases[3].run_id, "changed plans")
    real = psycopg.AsyncCursor.execute

    async def execute(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        if query == queries["fence_states"]:
            await terminate_backend(database_url, self.connection.info.backend_pid)
        return await real(self, query, *args, **kwargs)

    monkeypatch.setattr(psycopg.AsyncCursor, "execute", execute)
    results = await append_all(store, leases)
    assert sent.kinds[:2] == ["one", "batch"]
    assert [isinstance(r, BaseException) for r in results] == [False, False, False, True]
    assert isinstance(results[3], psycopg.OperationalError)
    for lease in leases[:3]:
        assert len(await store.steps(lease.run_id)) == 1
    assert await store.steps(leases[3].run_id) == []


# -- found by a review on 2026-12-07 -----------------------------------------------------------


@pytest.mark.parametrize("bad", [{"x": {1, 2}}, {"x": 10**5000}], ids=["set", "huge-int"])
async def test_a_payload_json_cannot_encode_fails_only_its_own_caller(
    store: Store, sent: Sent, bad: Any
) -> None:
    """The encoder refuses it before anything is sent: every run of its batch got its error."""
    leases = await held_runs(store, 4)
    with pytest.raises((TypeError, ValueError)):  # what a lone append raises for it
        await store.append_step(leases[0], 5, "note", bad)
    sent.kinds.clear()

    async def one(i: int, lease: Lease) -> Any:
        return await store.append_step(lease, 0, "note", bad if i == 2 else {"n": i})

    results = await asyncio.gather(*(one(i, lease) for i, lease in enumerate(leases)),
                                   return_exceptions=True)
    assert sent.kinds[:2] == ["one", "batch"]  # leases[0] alone; 1, 2 and 3 as one batch
    assert isinstance(results[2], (TypeError, ValueError))
    assert [isinstance(r, BaseException) for r in results] == [False, False, True, False], results
    for i, lease in enumerate(leases):
        assert len(await store.steps(lease.run_id)) == (0 if i == 2 else 1)


async def test_a_batch_on_a_connection_that_stopped_answering_holds_up_no_later_append(
    database_url: str,
) -> None:
    """A batch black-holed in flight (no reset: a peer that acknowledges and never answers).
    The worker's stall handling cancels the runs' tasks, which stopped their futures but not
    the drainer sending the batch: every later append of every run of the worker queued behind
    it, for good. Now the batch is stopped once nobody waits for it."""
    parts = conninfo_to_dict(database_url)
    proxy = TcpProxy((str(parts.get("host") or "127.0.0.1"), int(parts.get("port") or 5432)))
    proxy.start()
    try:
        parts.update(host="127.0.0.1", port=str(proxy.port))
        async with await Store.open(make_conninfo(**parts), max_size=10) as store:
            leases = await held_runs(store, 5)
            marker = "black-hole-7f3a"
            trap = proxy.trap(marker.encode())
            # leases[0]'s append goes alone; 1 to 3 queue and go out as one batch, which the
            # proxy black-holes (the marker is in it).
            tasks = [asyncio.create_task(store.append_step(
                lease, 0, "note", {"m": marker if i == 2 else i}))
                for i, lease in enumerate(leases[:4])]
            await tasks[0]
            await asyncio.to_thread(trap.sprung.wait)
            for t in tasks[1:]:  # what the stall handling does to the stuck runs
                t.cancel()
            await asyncio.gather(*tasks[1:], return_exceptions=True)
            # Another run of the worker appends; the pool has healthy connections.
            await asyncio.wait_for(store.append_step(leases[4], 0, "note", {"n": 4}), 120)
            assert len(await store.steps(leases[4].run_id)) == 1
    finally:
        proxy.stop()
