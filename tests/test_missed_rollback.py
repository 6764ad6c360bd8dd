"""A rollback asked for while the holder was not listening is still carried out.

Found by an adversarial review on 2026-12-06: a holder hears of ``cancel --rollback`` and
``reject --abort`` by notification only (a rollback leaves the run running under the same lease,
so no fenced write fails). One sent while its LISTEN connection was down never arrived: the run
went on and ended ``succeeded``, its effects in place, the rollback's reason still on the row and
the CLI's "ends cancelled" a lie. Two fixes, each tested here: ``finish_run`` refuses
``succeeded`` once a rollback was asked for (the holder rolls back instead), and the worker reads
what its held runs missed (rollback included) once LISTEN is back.

In process: the worker's RunExecutor (which listens to nothing) against a real store and the
scripted model server; the tool asks for the rollback itself, mid-run, through the store's API.
"""

from __future__ import annotations

import anthropic
import pytest

from agentrun.errors import RollbackRequested
from agentrun.manifests import AgentSpec
from agentrun.store import Run, Store
from agentrun.tools import ToolContext, ToolRegistry, tool
from agentrun.worker.executor import RunHandle
from agentrun.worker.process import Worker, WorkerSettings
from tests.workerkit import FakeFactory, held_run, in_process_executor

TOOLS = ToolRegistry()
STORES: list[Store] = []  # the test's store, for the tool that asks for the rollback
UNDONE: list[str] = []

AGENT = AgentSpec(model="claude-sonnet-4-5", system="book", tools=["hold"])


@tool(kind="non_idempotent", registry=TOOLS, compensate="unhold")
async def hold(ctx: ToolContext, item: str) -> str:
    """Hold an item; meanwhile a human cancels the run with --rollback."""
    await STORES[0].request_rollback(ctx.run_id, "cancelled", "plans changed")
    return f"held {item}"


HANDLES: list[RunHandle] = []  # the run's handle, for the tool that plays the listener
SHIPPED: list[str] = []


@tool(kind="non_idempotent", registry=TOOLS, compensate="unhold")
async def hold_heard(ctx: ToolContext, item: str) -> str:
    """Hold an item; meanwhile a human cancels the run with --rollback, and the worker hears it
    (as its listener would, between this call and the next)."""
    await STORES[0].request_rollback(ctx.run_id, "cancelled", "plans changed")
    if HANDLES:
        HANDLES[0].rollback_requested = True
    return f"held {item}"


@tool(kind="irreversible", registry=TOOLS)
def ship(ctx: ToolContext, item: str) -> str:
    """Ship an item (irreversible: with requireApproval it waits for a human first)."""
    SHIPPED.append(item)
    return f"shipped {item}"


@tool(kind="idempotent", registry=TOOLS)
def unhold(ctx: ToolContext, item: str) -> str:
    """Release a held item (hold's compensation)."""
    UNDONE.append(item)
    return f"released {item}"


async def hold_run(store: Store) -> RunHandle:
    return await held_run(store, AGENT, task="hold a seat")


async def test_a_rollback_the_holder_did_not_hear_is_carried_out_instead_of_success(
    store: Store, fake: FakeFactory
) -> None:
    srv = fake({"name": "hold", "scripts": [{"name": "hold", "turns": [
        {"content": [{"tool_use": {"name": "hold", "input": {"item": "seat"}}}]},
        {"content": [{"text": "Your seat is held."}]},
    ]}]})
    STORES[:] = [store]
    UNDONE.clear()
    h = await hold_run(store)
    async with in_process_executor(store, srv.base_url, TOOLS, max_retries=0) as ex:
        await ex.advance(h)
    assert not h.rollback_requested  # never heard: nothing listens here
    done = await store.get_run(h.run.id)
    assert done.status == "cancelled", (done.status, done.error)
    assert done.error is not None and "plans changed" in done.error
    assert "compensated: unhold for hold (step 0)" in done.error
    assert UNDONE == ["seat"]
    kinds = [s.kind for s in await store.steps(h.run.id)]
    assert kinds == ["model_turn", "tool_result", "model_turn", "compensation"]


async def test_finish_refuses_success_once_a_rollback_was_asked_for(store: Store) -> None:
    h = await hold_run(store)
    await store.request_rollback(h.run.id, "cancelled", "plans changed")
    with pytest.raises(RollbackRequested):
        await store.finish(h.lease, "succeeded", result="done")
    run = await store.get_run(h.run.id)
    assert (run.status, run.lease_owner, run.result) == ("running", "w", None)
    # Any other end is still the holder's to write (a rollback ends the run so).
    await store.finish(h.lease, "cancelled", error="cancelled: plans changed")
    assert (await store.get_run(h.run.id)).status == "cancelled"


async def test_the_runs_held_are_read_again_once_listen_is_back(store: Store) -> None:
    worker = Worker(store, None, TOOLS,  # type: ignore[arg-type]  # no model call here
                    WorkerSettings(health_port=None, worker_id="w"))
    h = await hold_run(store)
    worker.active[h.run.id] = h
    worker._on_listening()  # the first LISTEN: nothing held was missed
    assert worker._recheck is None
    # The connection was lost and is back: a rollback asked for meanwhile was heard by nobody.
    await store.request_rollback(h.run.id, "cancelled", "plans changed")
    worker._on_listening()
    assert worker._recheck is not None
    await worker._recheck
    assert h.rollback_requested


# -- a rollback parked behind an approval (found by a review on 2026-12-07) --------------------
# cancel --rollback while a turn's calls ran, a later call of that turn needing approval: the
# worker asked for a human, the store took the wait, and the run sat in waiting_approval
# "(rolling back)" until someone decided a call the rollback would never make.

GATED = AgentSpec(model="claude-sonnet-4-5", system="book", tools=["hold", "hold_heard", "ship"],
                  require_approval=True)


def hold_then_ship(fake: FakeFactory, hold_tool: str) -> str:
    srv = fake({"name": "trip", "scripts": [{"name": "trip", "turns": [
        {"content": [{"tool_use": {"name": hold_tool, "input": {"item": "seat"}}},
                     {"tool_use": {"name": "ship", "input": {"item": "seat"}}}]},
        {"content": [{"text": "Booked."}]},
    ]}]})
    return str(srv.base_url)


async def gated_run(store: Store) -> RunHandle:
    return await held_run(store, GATED, task="book a trip")


def assert_rolled_back(done: Run) -> None:
    assert done.status == "cancelled", (done.status, done.wait_reason, done.rollback_reason)
    assert done.error is not None and "compensated: unhold for" in done.error, done.error
    assert UNDONE == ["seat"] and SHIPPED == []


async def test_a_wait_for_approval_is_refused_once_a_rollback_was_asked_for(store: Store) -> None:
    h = await gated_run(store)
    await store.request_rollback(h.run.id, "cancelled", "plans changed")
    with pytest.raises(RollbackRequested):
        await store.wait_for_approval(h.lease, "approval required before ship (step 0)",
                                      {"seq": 0, "call_index": 1, "tool": "ship",
                                       "input": {"item": "seat"}, "stage": "before_call",
                                       "attempt": 1})
    run = await store.get_run(h.run.id)
    assert (run.status, run.lease_owner, run.pending_call) == ("running", "w", None)


async def test_a_rollback_heard_between_two_calls_starts_before_the_next(
    store: Store, fake: FakeFactory
) -> None:
    base_url = hold_then_ship(fake, "hold_heard")
    STORES[:] = [store]
    UNDONE.clear()
    SHIPPED.clear()
    h = await gated_run(store)
    HANDLES[:] = [h]
    try:
        async with in_process_executor(store, base_url, TOOLS, max_retries=0) as ex:
            assert await ex.advance(h) is None  # no WaitForApproval: the rollback went first
    finally:
        HANDLES.clear()
    assert_rolled_back(await store.get_run(h.run.id))


async def test_a_rollback_not_heard_before_the_wait_is_carried_out_instead_of_the_wait(
    store: Store, fake: FakeFactory
) -> None:
    base_url = hold_then_ship(fake, "hold")  # asks for the rollback; nobody hears it
    STORES[:] = [store]
    UNDONE.clear()
    SHIPPED.clear()
    client = anthropic.AsyncAnthropic(base_url=base_url, api_key="test", max_retries=0)
    worker = Worker(store, client, TOOLS, WorkerSettings(health_port=None, worker_id="w"))
    h = await gated_run(store)
    try:
        await worker._hold(h)  # the run's task, as the claim loop starts it
    finally:
        await client.close()
    assert_rolled_back(await store.get_run(h.run.id))


async def park_while_rolling_back(store: Store) -> RunHandle:
    """A run rolling back that an older worker parked in waiting_approval (what
    wait_for_approval wrote before its guard)."""
    h = await gated_run(store)
    await store.request_rollback(h.run.id, "failed", "rejected by bob")
    async with store.pool.connection() as conn:
        await conn.execute(
            "UPDATE agent_run SET status = 'waiting_approval', wait_reason = 'approval required',"
            " pending_call = '{\"seq\": 0, \"call_index\": 1}', lease_owner = NULL,"
            " lease_until = NULL WHERE id = %s", (h.run.id,))
    return h


async def test_a_second_rollback_request_resumes_one_an_older_worker_parked(
    store: Store,
) -> None:
    """A second request resumes such a run, and says it changed it (it said "not recorded"
    while it moved the run). Any other second request changes nothing."""
    h = await park_while_rolling_back(store)
    run, changed = await store.request_rollback(h.run.id, "cancelled", "plans changed")
    assert changed
    assert (run.status, run.pending_call, run.rollback_reason, run.rollback_end) == (
        "pending", None, "rejected by bob", "failed")
    again, changed = await store.request_rollback(h.run.id, "cancelled", "again")
    assert not changed and again.updated_at == run.updated_at
