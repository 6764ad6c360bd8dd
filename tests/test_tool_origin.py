"""The worker's own failures on a tool's path are never reported as the tool's.

What a tool raises is classified by the tool's rules (reported to the model, retried, aborting).
A failure of the worker around the call is not the tool's: a lease lost by the worker's own clock
just before the call, or the fenced mark's database error. Reported to the model and committed,
it stood for a call that was never made: in a 150-second soak (seed 7), a PostgreSQL restart
made a worker's lease run out by its clock while the database still held it, the send_email it
was about to make became a tool_result "LeaseLost: ...", the run succeeded, and the email was
never sent. Now the run's work is dropped and the next claim makes the call.

In process: a RunExecutor against a real store and the scripted model server, the store's
begin_tool_call (the fenced mark) given the fault.
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
        # From here on the lease has run out by the worker's own clock, as after a SIGSTOP longer
        # than the TTL during the write (the worker counts from when the write was sent, which
        # it sets after this returns); the database still holds it (nobody else claimed the run).
        assert self.handle is not None
        self.handle.lease_ttl = -1.0


def executor(store: Store, base_url: str) -> RunExecutor:
    client = anthropic.AsyncAnthropic(base_url=base_url, api_key="test", max_retries=0)
    metrics = WorkerMetrics()
    return RunExecutor(store, Providers(default=client), TOOLS, metrics, Health(60, metrics),
                       RetryPolicy(max_retries=0), is_draining=lambda: False)


@pytest.mark.parametrize(
    ("fault", "raised"),
    [("local_clock", LeaseLost), ("db_error", psycopg.OperationalError)],
)
async def test_a_failure_of_the_worker_before_the_call_drops_the_work_and_commits_nothing(
    database_url: str, fake: FakeFactory, fault: str, raised: type[Exception]
) -> None:
    srv = fake(echo_scenario(2))  # one tool turn, then the answer
    store = await FaultyMarkStore.open(database_url, max_size=4)
    store.fault = fault
    CALLS.clear()
    try:
        await store.create_run("echo once, then answer", AGENT, pool="origin")
        ((run, lease),) = (await store.with_lease_ttl(60).claim("origin", "w", 1)).claimed
        h = store.handle = RunHandle(run, lease, lease_ttl=60)
        with pytest.raises(raised):
            await executor(store, srv.base_url).advance(h)
        assert CALLS == []  # the tool was never called
        # Only the model's turn is in the log: no tool_result stands for the call not made.
        assert [s.kind for s in await store.steps(run.id)] == ["model_turn"]
        after = await store.get_run(run.id)
        assert after.status == "running" and after.lease_epoch == lease.epoch
    finally:
        await store.close()
