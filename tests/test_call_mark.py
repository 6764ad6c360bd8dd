"""The mark of a tool call rides on the model turn's append when nothing comes between them.

Before a call starts, the run records it (agent_run.tool_call, migration 0005): if the worker dies
inside the call, the next claim blames that run and hands its co-located runs over without an
attempt. The mark used to be a fenced round trip of its own before every call (1.0 ms a turn of
the durable loop's overhead, docs/benchmarks.md). Now the model turn's append carries its first
call's mark when only the call follows the commit (issue 17); the other calls, a retried call and
a call resumed from the log still send theirs, and an irreversible call's intent (and its human)
still come before its mark.

In process: a RunExecutor against a real store and the scripted model server; the tools read the
run's row from their own connection while they run, so each sees the mark its call stands under.
"""

from __future__ import annotations

from typing import Any

import psycopg

from agentrun.store import Lease, Store
from agentrun.tools import ToolContext, ToolRegistry, tool
from tests.workerkit import AGENT, FakeFactory, held_run, in_process_executor

TOOLS = ToolRegistry()
#: (tool, seq, call_index, attempt) -> the run's tool_call as the tool saw it from the database.
SEEN: dict[tuple[str, int, int, int], dict[str, Any] | None] = {}
DB: dict[str, str] = {}


def _seen(ctx: ToolContext) -> None:
    with psycopg.connect(DB["url"]) as conn:
        row = conn.execute(
            "SELECT tool_call FROM agent_run WHERE id = %s", (ctx.run_id,)).fetchone()
    assert row is not None
    SEEN[(ctx.tool_name, ctx.seq, ctx.call_index, ctx.attempt)] = row[0]


@tool(kind="pure", registry=TOOLS)
def look(ctx: ToolContext, what: str) -> str:
    """Look something up."""
    _seen(ctx)
    return what.upper()


class Flaky(Exception):
    """A transient failure: the tool declares it retryable."""


@tool(kind="idempotent", registry=TOOLS, retryable=Flaky)
def flaky(ctx: ToolContext, what: str) -> str:
    """Fails its first attempt, transiently."""
    _seen(ctx)
    if ctx.attempt == 1:
        raise Flaky("try again")
    return what


@tool(kind="irreversible", registry=TOOLS)
def drop(ctx: ToolContext, table: str) -> str:
    """Drop a table (irreversible: its intent is written before the call)."""
    _seen(ctx)
    return f"dropped {table}"


class CountingStore(Store):
    """The real store, recording each mark sent on its own and each append's carried mark."""

    own: list[tuple[int, int]]
    carried: list[tuple[int, int]]

    async def begin_tool_call(self, lease: Lease, call: dict[str, Any]) -> None:
        self.own.append((call["seq"], call["call_index"]))
        await super().begin_tool_call(lease, call)

    async def append_step(self, lease: Lease, seq: int, *args: Any, **kwargs: Any) -> Any:
        mark = kwargs.get("tool_call")
        if mark is not None:
            self.carried.append((mark["seq"], mark["call_index"]))
        return await super().append_step(lease, seq, *args, **kwargs)


def scenario(*turns: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """One model turn per list of (tool, input) calls, then the answer."""
    script: list[dict[str, Any]] = [
        {"content": [{"text": f"Turn {i}."}, *({"tool_use": {"name": n, "input": a}}
                                              for n, a in calls)]}
        for i, calls in enumerate(turns)
    ]
    script.append({"content": [{"text": "Done."}]})
    return {"name": "marks", "scripts": [{"name": "marks", "turns": script}]}


async def run_to_the_end(
    database_url: str, srv: Any, tools: list[str], *, pipeline: bool = False
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Run the scenario's run to its end on one executor: the (seq, call_index) of the marks
    the appends carried, and of those sent on their own. Pure turns are not pipelined unless
    ``pipeline`` (tests/test_pipeline.py): a pipelined pure call may start before its turn's
    append, and so its mark, has landed."""
    DB["url"] = database_url
    SEEN.clear()
    store = await CountingStore.open(database_url, max_size=4)
    store.own, store.carried = [], []
    try:
        agent = AGENT.model_copy(update={"tools": tools, "thinking": None})
        h = await held_run(store, agent, pool="marks", task="mark the calls")
        async with in_process_executor(store, srv.base_url, TOOLS, pipeline=pipeline) as ex:
            assert await ex.advance(h) is None
        done = await store.get_run(h.run.id)
        assert done.status == "succeeded", done.error
    finally:
        await store.close()
    return store.carried, store.own


def assert_ran_marked(*calls: tuple[str, int, int, int]) -> None:
    """Each (tool, seq, call_index, attempt) ran with its own mark on the run, from the
    database's point of view: this worker's, this epoch's, stamped when it was written."""
    for tool_name, seq, index, attempt in calls:
        seen = SEEN.get((tool_name, seq, index, attempt))
        assert seen is not None, f"{tool_name} (seq {seq}, call {index}) ran with no mark"
        assert {k: seen[k] for k in ("worker", "tool", "seq", "call_index", "step")} == {
            "worker": "w", "tool": tool_name, "seq": seq, "call_index": index, "step": seq + 1}
        assert "started_at" in seen and seen["epoch"] == 1


async def test_a_turns_first_call_runs_under_the_mark_its_turns_append_carried(
    database_url: str, fake: FakeFactory
) -> None:
    srv = fake(scenario([("look", {"what": "a"})],
                        [("look", {"what": "b"}), ("look", {"what": "c"})]))
    carried, own = await run_to_the_end(database_url, srv, ["look"])
    # Each turn's first call: carried by the turn's append, no round trip of its own; the second
    # call of turn 2 (seq 2) marks itself, as before.
    assert carried == [(0, 0), (2, 0)]
    assert own == [(2, 1)]
    assert_ran_marked(("look", 0, 0, 1), ("look", 2, 0, 1), ("look", 2, 1, 1))


async def test_a_retried_call_marks_its_retry_and_an_irreversible_call_marks_after_its_intent(
    database_url: str, fake: FakeFactory
) -> None:
    srv = fake(scenario([("flaky", {"what": "x"})], [("drop", {"table": "t"})]))
    carried, own = await run_to_the_end(database_url, srv, ["flaky", "drop"])
    assert carried == [(0, 0)]  # not the irreversible one: its intent comes first
    assert own == [(0, 0), (2, 0)]  # flaky's retry; drop's mark after its intent
    assert_ran_marked(("flaky", 0, 0, 1), ("flaky", 0, 0, 2), ("drop", 2, 0, 1))


async def test_no_mark_is_carried_for_a_call_that_will_not_run(
    database_url: str, fake: FakeFactory
) -> None:
    # A tool the run may not call runs nothing: no mark for it; the call after it marks itself.
    srv = fake(scenario([("drop", {"table": "t"}), ("look", {"what": "y"})]))
    carried, own = await run_to_the_end(database_url, srv, ["look"])
    assert carried == []
    assert own == [(0, 1)]
    assert ("drop", 0, 0, 1) not in SEEN
    assert_ran_marked(("look", 0, 1, 1))


async def test_a_pipelined_turns_later_calls_wait_for_the_turn_and_run_under_their_own_marks(
    database_url: str, fake: FakeFactory
) -> None:
    # Pipelined, the turn's first call may start while the append carrying its mark is in
    # flight (what the tool read of the row then is a race, not checked here); the second call
    # marks itself only once that append has landed, so its own mark is the one on the row,
    # never overwritten by the turn's older one.
    srv = fake(scenario([("look", {"what": "a"})],
                        [("look", {"what": "b"}), ("look", {"what": "c"})]))
    carried, own = await run_to_the_end(database_url, srv, ["look"], pipeline=True)
    assert carried == [(0, 0), (2, 0)]
    assert own == [(2, 1)]
    assert_ran_marked(("look", 2, 1, 1))
