"""The worker's own failures on a tool's path are never reported as the tool's.

What a tool raises is classified by the tool's rules (reported to the model, retried, aborting).
A failure of the worker around the call is not the tool's: a lease lost by the worker's own clock
just before the call, or the fenced mark's database error. Reported to the model and committed,
it stood for a call that was never made: in a 150-second soak (seed 7), a PostgreSQL restart
made a worker's lease run out by its clock while the database still held it, the send_email it
was about to make became a tool_result "LeaseLost: ...", the run succeeded, and the email was
never sent. Now the run's work is dropped and the next claim makes the call.

In process: a RunExecutor against a real store and the scripted model server, the fenced mark
given the fault, by both of its routes: on its own (begin_tool_call, a turn's second call) and
carried by the model turn's append (a turn's first call, issue 17).
"""

from __future__ import annotations

from typing import Any

import anthropic
import psycopg
import pytest

from agentrun.errors import LeaseLost
from agentrun.store import Lease, Store
from agentrun.tools import ToolContext, ToolRegistry, tool
from agentrun.worker.executor import RunExecutor, RunHandle
from agentrun.worker.health import Health, WorkerMetrics
from agentrun.worker.providers import Providers
from agentrun.worker.settings import RetryPolicy
from tests.workerkit import AGENT, FakeFactory, echo_scenario

TOOLS = ToolRegistry()
CALLS: list[str] = []


@tool(kind="pure", registry=TOOLS)
def echo(ctx: ToolContext, text: str) -> str:
    """Echo the text back in capitals."""
    CALLS.append(text)
    return text.upper()


class FaultyMarkStore(Store):
    """A real store whose fenced mark of a call fails in the way the test says."""

    fault: str
    handle: RunHandle | None = None

    async def begin_tool_call(self, lease: Lease, marker: dict[str, Any]) -> None:
        if self.fault == "db_error":
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        await super().begin_tool_call(lease, marker)
        self._clock_runs_out()

    async def append_step(self, lease: Lease, seq: int, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("tool_call") is None:
            return await super().append_step(lease, seq, *args, **kwargs)
        if self.fault == "db_error":
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        done = await super().append_step(lease, seq, *args, **kwargs)
        self._clock_runs_out()
        return done

    def _clock_runs_out(self) -> None:
        # From here on the lease has run out by the worker's own clock, as after a SIGSTOP longer
        # than the TTL during the write (the worker counts from when the write was sent, which
        # it sets after this returns); the database still holds it (nobody else claimed the run).
        if self.fault == "local_clock":
            assert self.handle is not None
            self.handle.lease_ttl = -1.0


def executor(store: Store, base_url: str, *, pipeline: bool = False) -> RunExecutor:
    """Pure turns not pipelined unless ``pipeline``: pipelined, a pure call starts once its
    turn's append is sent, before the worker's clock is looked at again (a pure call is harmless
    to start; every commit after it is fenced by the database)."""
    client = anthropic.AsyncAnthropic(base_url=base_url, api_key="test", max_retries=0)
    metrics = WorkerMetrics()
    return RunExecutor(store, Providers(default=client), TOOLS, metrics, Health(60, metrics),
                       RetryPolicy(max_retries=0), is_draining=lambda: False, pipeline=pipeline)


#: A turn whose first call is refused (not one of the run's tools), so the mark of its second
#: call, echo, is sent on its own.
SECOND_CALL = {"name": "second", "scripts": [{"name": "second", "turns": [
    {"content": [{"tool_use": {"name": "drop_table", "input": {}}},
                 {"tool_use": {"name": "echo", "input": {"text": "t0"}}}]},
    {"content": [{"text": "done"}]},
]}]}


@pytest.mark.parametrize(
    ("route", "fault", "raised"),
    [(route, "local_clock", LeaseLost) for route in ("own", "carried")]
    # Pipelined, a pure call does not wait for its turn's answer, nor then for the clock.
    + [(route, "db_error", psycopg.OperationalError) for route in ("own", "carried", "pipelined")],
)
async def test_a_failure_of_the_worker_before_the_call_drops_the_work_and_commits_nothing(
    database_url: str, fake: FakeFactory, fault: str, raised: type[Exception], route: str
) -> None:
    srv = fake(SECOND_CALL if route == "own" else echo_scenario(2))  # a tool turn, the answer
    store = await FaultyMarkStore.open(database_url, max_size=4)
    store.fault = fault
    CALLS.clear()
    try:
        await store.create_run("echo once, then answer", AGENT, pool="origin")
        ((run, lease),) = (await store.with_lease_ttl(60).claim("origin", "w", 1)).claimed
        h = store.handle = RunHandle(run, lease, lease_ttl=60)
        with pytest.raises(raised):
            await executor(store, srv.base_url, pipeline=route == "pipelined").advance(h)
        assert CALLS == []  # the tool was never called (pipelined: the append never left)
        # No tool_result stands for the call not made: only the model's turn is in the log, or
        # nothing when the turn's own append was the mark that failed.
        assert [s.kind for s in await store.steps(run.id)] == (
            [] if route != "own" and fault == "db_error" else ["model_turn"])
        after = await store.get_run(run.id)
        assert after.status == "running" and after.lease_epoch == lease.epoch
    finally:
        await store.close()
