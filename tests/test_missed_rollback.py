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
from agentrun.store import Store
from agentrun.tools import ToolContext, ToolRegistry, tool
from agentrun.worker.executor import RunExecutor, RunHandle
from agentrun.worker.health import Health, WorkerMetrics
from agentrun.worker.process import Worker, WorkerSettings
from agentrun.worker.providers import Providers
from agentrun.worker.settings import RetryPolicy
from tests.workerkit import FakeFactory

TOOLS = ToolRegistry()
STORES: list[Store] = []  # the test's store, for the tool that asks for the rollback
UNDONE: list[str] = []

AGENT = AgentSpec(model="claude-sonnet-4-5", system="book", tools=["hold"])


@tool(kind="non_idempotent", registry=TOOLS, compensate="unhold")
async def hold(ctx: ToolContext, item: str) -> str:
    """Hold an item; meanwhile a human cancels the run with --rollback."""
    await STORES[0].request_rollback(ctx.run_id, "cancelled", "plans changed")
    return f"held {item}"


@tool(kind="idempotent", registry=TOOLS)
def unhold(ctx: ToolContext, item: str) -> str:
    """Release a held item (hold's compensation)."""
    UNDONE.append(item)
    return f"released {item}"


async def held_run(store: Store) -> RunHandle:
    await store.create_run("hold a seat", AGENT)
    ((run, lease),) = (await store.with_lease_ttl(60).claim("default", "w", 1)).claimed
    return RunHandle(run, lease, lease_ttl=60)


async def test_a_rollback_the_holder_did_not_hear_is_carried_out_instead_of_success(
    store: Store, fake: FakeFactory
) -> None:
    srv = fake({"name": "hold", "scripts": [{"name": "hold", "turns": [
        {"content": [{"tool_use": {"name": "hold", "input": {"item": "seat"}}}]},
        {"content": [{"text": "Your seat is held."}]},
    ]}]})
    STORES[:] = [store]
    UNDONE.clear()
    client = anthropic.AsyncAnthropic(base_url=srv.base_url, api_key="test", max_retries=0)
    metrics = WorkerMetrics()
    ex = RunExecutor(store, Providers(default=client), TOOLS, metrics, Health(60, metrics),
                     RetryPolicy(max_retries=0), is_draining=lambda: False)
    h = await held_run(store)
    try:
        await ex.advance(h)
    finally:
        await client.close()
    assert not h.rollback_requested  # never heard: nothing listens here
    done = await store.get_run(h.run.id)
    assert done.status == "cancelled", (done.status, done.error)
    assert done.error is not None and "plans changed" in done.error
    assert "compensated: unhold for hold (step 0)" in done.error
    assert UNDONE == ["seat"]
    kinds = [s.kind for s in await store.steps(h.run.id)]
    assert kinds == ["model_turn", "tool_result", "model_turn", "compensation"]


async def test_finish_refuses_success_once_a_rollback_was_asked_for(store: Store) -> None:
    h = await held_run(store)
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
    h = await held_run(store)
    worker.active[h.run.id] = h
    worker._on_listening()  # the first LISTEN: nothing held was missed
    assert worker._recheck is None
    # The connection was lost and is back: a rollback asked for meanwhile was heard by nobody.
    await store.request_rollback(h.run.id, "cancelled", "plans changed")
    worker._on_listening()
    assert worker._recheck is not None
    await worker._recheck
    assert h.rollback_requested
