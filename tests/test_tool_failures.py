"""A tool's failure stays the tool's: reported to the model at once, bounded by its timeout, never
turned into the worker's own error (found by an adversarial review on 2026-12-07).

* A sync tool that raised ``StopIteration`` (``next()`` on an empty iterator: a common bug) hung
  until its timeout and was then reported as one: asyncio refuses a StopIteration in a future,
  so the call's future was never settled. An irreversible tool's call then waited for a human
  ("outcome unknown") though it had failed at once.
* A sync tool's return value was rendered on the event loop, outside its thread and its timeout:
  a lazy generator (lines of a socket) did its blocking I/O there, stalling every run of the
  worker and its heartbeat, and a call past its timeout was reported as a success.
* An exception whose ``__str__`` raises escaped the executor: the claim was given up with nothing
  recorded, and every claim after it called a non-idempotent tool again until the run was
  dead-lettered.
* A ``tool_use`` whose input was ``[]``, ``""``, ``0``, ``false`` or ``null`` ran the tool as if it
  were ``{}``.

In process: a RunExecutor against a real store and the scripted model server, as
tests/test_call_mark.py.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from agentrun.store import Store
from agentrun.tools import ToolContext, ToolRegistry, tool
from agentrun.worker.executor import RunExecutor, RunHandle
from tests.workerkit import AGENT, FakeFactory, held_run, in_process_executor

TOOLS = ToolRegistry()
CALLS: list[str] = []
#: The threads the generator of read_log ran in, and what lets it go on.
PRODUCED_IN: list[threading.Thread] = []
RELEASE = threading.Event()


@tool(kind="pure", registry=TOOLS, timeout=3)
def find_first(ctx: ToolContext, prefix: str) -> str:
    """The first known name with this prefix."""
    CALLS.append("find_first")
    return next(n for n in ["alice", "bob"] if n.startswith(prefix))  # none: StopIteration


@tool(kind="irreversible", registry=TOOLS, timeout=3)
def deploy(ctx: ToolContext, service: str) -> str:
    """Deploy a service (irreversible)."""
    CALLS.append("deploy")
    target = next(s for s in ["api", "web"] if s == service)  # unknown service: StopIteration
    return f"deployed {target}"


def _lines(n: int, wait: bool) -> Iterator[str]:
    for i in range(n):
        PRODUCED_IN.append(threading.current_thread())
        if wait:
            RELEASE.wait(10)  # a socket that does not answer, until the test lets it go
        yield f"line {i}"


@tool(kind="pure", registry=TOOLS)
def read_log(ctx: ToolContext, lines: int) -> Any:
    """Read log lines (returned lazily, as a generator)."""
    CALLS.append("read_log")
    return _lines(lines, wait=False)


@tool(kind="pure", registry=TOOLS, timeout=0.5)
def read_stuck_log(ctx: ToolContext, lines: int) -> Any:
    """Read log lines from a source that does not answer (a generator that blocks)."""
    CALLS.append("read_stuck_log")
    return _lines(lines, wait=True)


@tool(kind="pure", registry=TOOLS)
def status(ctx: ToolContext, verbose: bool = False) -> str:
    """Report the status."""
    CALLS.append("status")
    return "ok"


class Unprintable(Exception):
    def __str__(self) -> str:
        raise AttributeError("detail")  # a library error whose __str__ reads a missing attribute


@tool(kind="non_idempotent", registry=TOOLS)
def send(ctx: ToolContext, to: str) -> str:
    """Send a message."""
    CALLS.append("send")
    raise Unprintable()


def scenario(calls: list[dict[str, Any]]) -> dict[str, Any]:
    return {"name": "review", "scripts": [{"name": "review", "turns": [
        {"content": [{"text": "Calling."}, *({"tool_use": c} for c in calls)]},
        {"content": [{"text": "Done."}]},
    ]}]}


@contextlib.asynccontextmanager
async def started(
    store: Store, fake: FakeFactory, calls: list[dict[str, Any]], tools: list[str]
) -> AsyncIterator[tuple[RunExecutor, RunHandle]]:
    """An executor and a claimed run of an agent with ``tools``, whose model asks for
    ``calls`` in one turn, then answers."""
    srv = fake(scenario(calls))
    agent = AGENT.model_copy(update={"tools": tools, "thinking": None})
    async with in_process_executor(store, srv.base_url, TOOLS) as ex:
        yield ex, await held_run(store, agent, pool="review")


async def result_of(store: Store, h: RunHandle) -> dict[str, Any]:
    """The first tool_result block of the run's turn of calls."""
    block: dict[str, Any] = (await store.steps(h.run.id))[1].payload["content"][0]
    return block


async def test_a_sync_tool_raising_stopiteration_is_reported_as_its_error(
    store: Store, fake: FakeFactory
) -> None:
    calls = [{"name": "find_first", "input": {"prefix": "z"}}]
    async with started(store, fake, calls, ["find_first"]) as (ex, h):
        assert await ex.advance(h) is None
    result = await result_of(store, h)
    assert result["is_error"] and "StopIteration" in result["content"], result
    assert "Timeout" not in result["content"], result


async def test_an_irreversible_tool_raising_stopiteration_does_not_wait_for_a_human(
    store: Store, fake: FakeFactory
) -> None:
    """Its call failed at once: its outcome is known, nobody is paged about it."""
    calls = [{"name": "deploy", "input": {"service": "db"}}]
    async with started(store, fake, calls, ["deploy"]) as (ex, h):
        assert await ex.advance(h) is None  # WaitForApproval ("outcome unknown") before the fix
    run = await store.get_run(h.run.id)
    assert run.status == "succeeded", (run.status, run.wait_reason)
    assert "StopIteration" in (await result_of(store, h))["content"]


async def test_a_sync_tools_return_value_is_rendered_in_its_thread(
    store: Store, fake: FakeFactory
) -> None:
    PRODUCED_IN.clear()
    calls = [{"name": "read_log", "input": {"lines": 3}}]
    async with started(store, fake, calls, ["read_log"]) as (ex, h):
        assert await ex.advance(h) is None
    assert (await result_of(store, h))["content"] == '["line 0","line 1","line 2"]'
    assert len(PRODUCED_IN) == 3
    assert threading.main_thread() not in PRODUCED_IN, "consumed on the event loop's thread"


async def test_a_return_value_that_blocks_is_cut_off_by_the_tools_timeout(
    store: Store, fake: FakeFactory
) -> None:
    RELEASE.clear()
    calls = [{"name": "read_stuck_log", "input": {"lines": 2}}]
    async with started(store, fake, calls, ["read_stuck_log"]) as (ex, h):
        try:
            assert await ex.advance(h) is None
        finally:
            RELEASE.set()  # the abandoned thread ends too
    result = await result_of(store, h)
    assert result["is_error"] and "ToolTimeout" in result["content"], result


async def advance_from(ex: RunExecutor, store: Store, h: RunHandle, block: dict[str, Any]) -> None:
    """Advance the run from a first turn that asks for ``block`` (what no model server sends)."""
    turn = {"role": "assistant", "stop_reason": "tool_use", "content": [
        {"type": "tool_use", "id": "toolu_x", **block}]}
    await ex.pinned_prompt(h)
    await store.append_step(h.lease, 0, "model_turn", turn)
    assert await ex.advance(RunHandle(await store.get_run(h.run.id), h.lease, lease_ttl=60)) is None


@pytest.mark.parametrize("bad_input", [[], "", 0, False, None])
async def test_a_tool_use_whose_input_is_not_an_object_is_refused(
    store: Store, fake: FakeFactory, bad_input: Any
) -> None:
    CALLS.clear()
    async with started(store, fake, [], ["status"]) as (ex, h):
        await advance_from(ex, store, h, {"name": "status", "input": bad_input})
    assert CALLS == [], f"status ran on input {bad_input!r}"
    result = await result_of(store, h)
    assert result["is_error"] and "expected a JSON object" in result["content"], result


async def test_a_tool_name_that_is_not_a_string_is_refused(
    store: Store, fake: FakeFactory
) -> None:
    async with started(store, fake, [], ["status", "send"]) as (ex, h):  # send records effects
        # A TypeError (unhashable) gave the claim up before the fix.
        await advance_from(ex, store, h, {"name": ["status"], "input": {}})
    assert "not available to this agent" in (await result_of(store, h))["content"]


async def test_an_exception_whose_str_raises_is_a_failed_call_not_a_lost_claim(
    store: Store, fake: FakeFactory
) -> None:
    CALLS.clear()
    async with started(store, fake, [{"name": "send", "input": {"to": "a@b.c"}}], ["send"]) as (
        ex, h
    ):
        assert await ex.advance(h) is None  # AttributeError out of the executor before the fix
    assert CALLS == ["send"]
    result = await result_of(store, h)
    assert result["is_error"], result
    assert result["content"] == "Unprintable: <its message cannot be read: AttributeError>"
