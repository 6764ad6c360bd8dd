"""Pipelined pure turns: a turn whose calls are all pure starts them once its append (carrying the
first call's mark) is sent, not once it is committed; the results are committed only after the
turn, and a turn whose append fails drops what its pure calls did (issue 17).

In process: a RunExecutor against a real store and the scripted model server. The test holds
the turn's append up with a real lock (the run's row, FOR UPDATE: the statement is parsed and
sent, its fenced UPDATE waits), so "before the commit" is a state, not a race.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest

from agentrun.errors import LeaseLost
from agentrun.sql import queries
from agentrun.store import Store
from agentrun.tools import ToolContext, ToolRegistry, tool
from agentrun.vocabulary import rollback_reason
from agentrun.worker.executor import RunHandle
from tests.workerkit import AGENT, FakeFactory, held_run, in_process_executor

TOOLS = ToolRegistry()
RAN: list[str] = []
STARTED = threading.Event()


@tool(kind="pure", registry=TOOLS)
def look(ctx: ToolContext, what: str) -> str:
    """Look something up."""
    RAN.append(f"look {what}")
    STARTED.set()
    return what.upper()


@tool(kind="idempotent", registry=TOOLS)
def set_flag(ctx: ToolContext, value: str) -> str:
    """Set a flag (idempotent: it takes effect, so it waits for its turn's commit)."""
    RAN.append(f"set_flag {value}")
    STARTED.set()
    return value


GO = threading.Event()


@tool(kind="pure", registry=TOOLS)
def look_slowly(ctx: ToolContext, what: str) -> str:
    """Look something up, once the test says so."""
    RAN.append(f"look_slowly {what}")
    STARTED.set()
    assert GO.wait(30)
    return what.upper()


def scenario(*calls: tuple[str, dict[str, Any]]) -> dict[str, Any]:
    """One turn making ``calls``, then the answer."""
    return {"name": "pipe", "scripts": [{"name": "pipe", "turns": [
        {"content": [{"text": "Calling."}, *({"tool_use": {"name": n, "input": a}}
                                             for n, a in calls)]},
        {"content": [{"text": "Done."}]},
    ]}]}


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[Store]:
    RAN.clear()
    STARTED.clear()
    GO.clear()
    s = await Store.open(database_url, max_size=4)
    try:
        yield s
    finally:
        await s.close()


async def waiting_for_a_lock(url: str) -> None:
    """Until some backend waits for a lock (the held append)."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as probe:
        for _ in range(1500):
            cur = await probe.execute("SELECT count(*) FROM pg_locks WHERE NOT granted")
            row = await cur.fetchone()
            if row is not None and row[0] > 0:
                return
            await asyncio.sleep(0.02)
    raise AssertionError("no statement ever waited for the test's lock")


@contextlib.asynccontextmanager
async def advancing_held(
    store: Store, url: str, fake: FakeFactory, *calls: tuple[str, dict[str, Any]]
) -> AsyncIterator[tuple[RunHandle, asyncio.Task[str | None], psycopg.AsyncConnection[Any]]]:
    """A run of one turn making ``calls`` (then the answer), advanced by an executor while a
    transaction of the test holds the run's row, once its prompt is pinned (the pin writes the
    row too): the turn's append waits for that transaction's end."""
    agent = AGENT.model_copy(update={"tools": sorted({n for n, _ in calls}), "thinking": None})
    h = await held_run(store, agent, pool="pipe")
    srv = fake(scenario(*calls))
    async with in_process_executor(store, srv.base_url, TOOLS) as ex:
        await ex.pinned_prompt(h)
        h.run = await store.get_run(h.run.id)  # pinned: advance writes nothing before the turn
        locker = await psycopg.AsyncConnection.connect(url)
        try:
            await locker.execute("SELECT 1 FROM agent_run WHERE id = %s FOR UPDATE",
                                 (h.run.id,))
            yield h, asyncio.create_task(ex.advance(h)), locker
        finally:
            await locker.close()


async def kinds(store: Store, run_id: Any) -> list[str]:
    return [s.kind for s in await store.steps(run_id)]


@pytest.mark.parametrize("calls", [1, 2], ids=["one_call", "two_calls"])
async def test_a_pure_turns_calls_run_while_its_append_is_held_and_the_log_ends_right(
    store: Store, database_url: str, fake: FakeFactory, calls: int
) -> None:
    looks = [("look", {"what": f"w{i}"}) for i in range(calls)]
    async with advancing_held(store, database_url, fake, *looks) as (h, advancing, locker):
        # The first call starts while the turn's append waits for the lock: not committed.
        assert await asyncio.to_thread(STARTED.wait, 30), "the pure call did not start"
        assert await kinds(store, h.run.id) == []
        assert RAN[:1] == ["look w0"]
        assert not advancing.done()
        await locker.commit()
        assert await advancing is None
    assert RAN == [f"look w{i}" for i in range(calls)]  # each call once
    assert await kinds(store, h.run.id) == ["model_turn", "tool_result", "model_turn"]
    steps = await store.steps(h.run.id)
    assert [b["content"] for b in steps[1].payload["content"]] == [
        f"W{i}" for i in range(calls)]
    assert (await store.get_run(h.run.id)).status == "succeeded"


async def test_a_turn_with_a_call_that_takes_effect_waits_for_its_commit(
    store: Store, database_url: str, fake: FakeFactory
) -> None:
    calls = [("look", {"what": "a"}), ("set_flag", {"value": "on"})]
    async with advancing_held(store, database_url, fake, *calls) as (h, advancing, locker):
        await waiting_for_a_lock(database_url)  # the turn's append, held
        assert RAN == []  # nothing of the turn started, the pure call neither
        await locker.commit()
        assert await advancing is None
    assert RAN == ["look a", "set_flag on"]
    assert await kinds(store, h.run.id) == ["model_turn", "tool_result", "model_turn"]


async def test_a_pipelined_turn_fenced_off_drops_what_its_pure_call_did(
    store: Store, database_url: str, fake: FakeFactory
) -> None:
    async with advancing_held(store, database_url, fake, ("look", {"what": "a"})) as (
            h, advancing, locker):
        assert await asyncio.to_thread(STARTED.wait, 30), "the pure call did not start"
        # Another worker's claim takes the run while the append waits (a newer epoch).
        await locker.execute(
            "UPDATE agent_run SET lease_owner = 'w2', lease_epoch = lease_epoch + 1 "
            "WHERE id = %s", (h.run.id,))
        await locker.commit()
        with pytest.raises(LeaseLost):
            await advancing
    assert RAN == ["look a"]  # it ran; nothing of it was committed
    assert await kinds(store, h.run.id) == []


async def test_a_rollback_heard_while_a_pipelined_turn_runs_waits_for_the_turn_to_land(
    store: Store, database_url: str, fake: FakeFactory
) -> None:
    # Heard between the turn's two calls, while the turn's append still waits: the rollback
    # starts only once the turn has landed (its compensations and its finish after it, their
    # seqs after the turn's), and the second call never runs.
    calls = [("look_slowly", {"what": "a"}), ("look", {"what": "b"})]
    async with advancing_held(store, database_url, fake, *calls) as (h, advancing, locker):
        assert await asyncio.to_thread(STARTED.wait, 30), "the pure call did not start"
        # A human's cancel --rollback (in the transaction that holds the row), and the
        # worker's listener hearing it.
        await locker.execute(queries["request_rollback"], {
            "run_id": h.run.id, "reason": rollback_reason("cancelled", "plans changed"),
            "end": "cancelled", "rollback_due": False})
        h.rollback_requested = True
        GO.set()
        await waiting_for_a_lock(database_url)  # the turn's append, still held
        assert not advancing.done()
        await locker.commit()
        assert await advancing is None
    assert RAN == ["look_slowly a"]
    assert await kinds(store, h.run.id) == ["model_turn"]
    done = await store.get_run(h.run.id)
    assert done.status == "cancelled", done.error
