"""Overlap: a turn's tool results are committed while the next model call is already on its way,
and that next turn is committed only once the results have landed.

In process (a RunExecutor against a real store and the scripted model server), with a store whose
tool_result commit the test holds open; and one real SIGKILL at after_tool_result_commit.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import anthropic
import pytest

from agentrun.errors import LeaseLost
from agentrun.store import Lease, Store
from agentrun.tools import ToolContext, ToolRegistry, tool
from agentrun.worker.executor import RunExecutor, RunHandle
from agentrun.worker.health import Health, WorkerMetrics
from agentrun.worker.providers import Providers
from agentrun.worker.settings import RetryPolicy
from tests.workerkit import AGENT, FakeFactory, Workers, echo_scenario, wait_for, wait_run

TOOLS = ToolRegistry()


@tool(kind="pure", registry=TOOLS)
def echo(ctx: ToolContext, text: str) -> str:
    """Echo the text back in capitals."""
    return text.upper()


class HeldCommitStore(Store):
    """A real store whose tool_result commits wait for the test before they are sent; with
    ``lose`` set, the commit finds the lease gone (released under it: a real fence)."""

    held: asyncio.Event
    proceed: asyncio.Event
    lose: bool
    held_in: asyncio.Task[Any] | None = None  # the task the held commit runs in

    async def append_step(self, lease: Lease, seq: int, kind: Any, payload: Any,
                          **kw: Any) -> Any:
        if kind == "tool_result":
            self.held_in = asyncio.current_task()
            self.held.set()
            await self.proceed.wait()
            if self.lose:
                await self.release(lease)
        return await super().append_step(lease, seq, kind, payload, **kw)


async def held_store(url: str, *, lose: bool = False) -> HeldCommitStore:
    store = await HeldCommitStore.open(url, max_size=4)
    store.held, store.proceed, store.lose = asyncio.Event(), asyncio.Event(), lose
    return store


def executor(store: Store, base_url: str, *, overlap: bool = True,
             draining: list[bool] | None = None) -> RunExecutor:
    client = anthropic.AsyncAnthropic(base_url=base_url, api_key="test", max_retries=0)
    metrics = WorkerMetrics()
    flag = draining if draining is not None else [False]
    return RunExecutor(store, Providers(default=client), TOOLS, metrics, Health(60, metrics),
                       RetryPolicy(max_retries=0), is_draining=lambda: flag[0], overlap=overlap)


async def claim(store: Store, task: str) -> RunHandle:
    await store.create_run(task, AGENT, pool="overlap")
    ((claimed, lease),) = (await store.with_lease_ttl(60).claim("overlap", "w", 1)).claimed
    return RunHandle(claimed, lease, lease_ttl=60)


def awaiting(task: asyncio.Task[Any]) -> list[str]:
    """The coroutines ``task`` is suspended in, outermost first (its await chain)."""
    names, coro = [], task.get_coro()
    while coro is not None and hasattr(coro, "cr_code"):
        names.append(coro.cr_code.co_qualname)
        coro = coro.cr_await
    return names


def turns_asked(srv: Any) -> list[int]:
    return [int(e["turn"]) for e in srv.requests() if "turn" in e]


async def test_the_next_model_request_is_sent_before_the_results_commit_returns(
    database_url: str, fake: FakeFactory
) -> None:
    srv = fake(echo_scenario(3))
    store = await held_store(database_url)
    try:
        h = await claim(store, "echo three times")
        advancing = asyncio.create_task(executor(store, srv.base_url).advance(h))
        await asyncio.wait_for(store.held.wait(), 10)
        # The results of turn 0 are not committed, and turn 1 is already asked.
        await wait_for(lambda: 1 in turns_asked(srv), 10, "turn 1 asked during the commit")
        assert [s.seq for s in await store.steps(h.run.id)] == [0]
        assert not advancing.done()
        store.proceed.set()
        assert await asyncio.wait_for(advancing, 20) is None
        steps = await store.steps(h.run.id)
        assert [s.kind for s in steps] == ["model_turn", "tool_result"] * 2 + ["model_turn"]
        assert (await store.get_run(h.run.id)).status == "succeeded"
        assert turns_asked(srv) == [0, 1, 2]  # each turn asked once
    finally:
        await store.close()


async def test_overlap_off_asks_only_after_the_results_are_committed(
    database_url: str, fake: FakeFactory
) -> None:
    srv = fake(echo_scenario(3))
    store = await held_store(database_url)
    try:
        h = await claim(store, "echo three times")
        ex = executor(store, srv.base_url, overlap=False)
        advancing = asyncio.create_task(ex.advance(h))
        await store.held.wait()  # in this task, no helper task (the test timeout bounds it)
        # As before overlap: the commit first, then the call. The held commit runs in the
        # advancing task itself, which is suspended inside it, so that task cannot be calling the
        # model meanwhile (with overlap the commit is a task of its own and the advancing task
        # goes on to the call); said by state, not by waiting to see that no request came.
        assert store.held_in is advancing
        assert "HeldCommitStore.append_step" in awaiting(advancing), awaiting(advancing)
        assert turns_asked(srv) == [0]
        store.proceed.set()
        assert await asyncio.wait_for(advancing, 20) is None
        steps = await store.steps(h.run.id)
        assert [s.kind for s in steps] == ["model_turn", "tool_result"] * 2 + ["model_turn"]
        assert turns_asked(srv) == [0, 1, 2]
    finally:
        await store.close()


async def test_a_results_commit_that_loses_the_lease_cancels_the_call_and_commits_no_turn(
    database_url: str, fake: FakeFactory
) -> None:
    # Turn 1 streams slowly (about 2 s): it is in flight when the commit fails.
    srv = fake(echo_scenario(3, slow={1: 100}, long_text={1: 20}))
    store = await held_store(database_url, lose=True)
    try:
        h = await claim(store, "echo three times")
        advancing = asyncio.create_task(executor(store, srv.base_url).advance(h))
        await asyncio.wait_for(store.held.wait(), 10)
        await wait_for(lambda: 1 in turns_asked(srv), 10, "turn 1 asked during the commit")
        store.proceed.set()
        with pytest.raises(LeaseLost):
            await asyncio.wait_for(advancing, 10)
        # The call was dropped (the server sees the client go), and nothing past seq 0 landed.
        await wait_for(lambda: any(e.get("disconnected") for e in srv.requests()), 10,
                       "the in-flight call dropped")
        assert [s.seq for s in await store.steps(h.run.id)] == [0]
        assert not [t for t in asyncio.all_tasks() if "commit seq" in t.get_name()]
    finally:
        await store.close()


async def test_a_drain_heard_during_the_commit_hands_over_at_the_commit_boundary(
    database_url: str, fake: FakeFactory
) -> None:
    srv = fake(echo_scenario(3, slow={1: 100}, long_text={1: 20}))
    store = await held_store(database_url)
    draining = [False]
    try:
        h = await claim(store, "echo three times")
        advancing = asyncio.create_task(
            executor(store, srv.base_url, draining=draining).advance(h))
        await asyncio.wait_for(store.held.wait(), 10)
        await wait_for(lambda: 1 in turns_asked(srv), 10, "turn 1 asked during the commit")
        draining[0] = True  # SIGTERM while the results are on their way
        assert not h.in_model_call  # so the worker's drain does not abort the commit
        store.proceed.set()
        assert await asyncio.wait_for(advancing, 10) == "drain"
        # The results landed, the call was dropped unheard, no turn committed past them.
        assert [s.kind for s in await store.steps(h.run.id)] == ["model_turn", "tool_result"]
        await wait_for(lambda: any(e.get("disconnected") for e in srv.requests()), 10,
                       "the in-flight call dropped")
    finally:
        await store.close()


async def test_sigkill_after_the_results_commit_resumes_byte_exact(
    store: Store, workers: Workers, fake: FakeFactory
) -> None:
    scenario = echo_scenario(4)
    scenario["record_bodies"] = True
    srv = fake(scenario)
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    run, _ = await store.create_run("echo four times", AGENT)
    # seq 3 is turn 1's results: w1 dies once they landed, turn 2 maybe on its way already.
    w1 = workers.start("w1", faults="after_tool_result_commit@3")
    assert w1.wait() == -signal.SIGKILL
    at_crash = await store.steps(run.id)
    assert [s.seq for s in at_crash] == [0, 1, 2, 3]  # at most the results, never the turn
    workers.start("w2")
    done = await wait_run(store, run.id, lambda r: r.finished, 30)
    assert done.status == "succeeded", done.error
    steps = await store.steps(run.id)
    assert [s.kind for s in steps] == ["model_turn", "tool_result"] * 3 + ["model_turn"]
    assert [s.worker for s in steps] == ["w1"] * 4 + ["w2"] * 3
    assert {e["status"] for e in srv.requests() if "status" in e} == {200}  # signatures held
    # Turn 2 is asked again by w2, with the bytes w1 sent if w1's request got out before it died.
    bodies = [e["body"] for e in srv.requests() if e.get("turn") == 2]
    assert 1 <= len(bodies) <= 2 and len(set(bodies)) == 1
