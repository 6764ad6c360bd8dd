"""Supervised side tasks (issue 18): a heartbeat or a listener that dies unexpectedly is seen.

In process, on a real store whose one method fails on purpose: a heartbeat whose renewal raises
what it does not handle lets its run go as if the lease were lost, with a line naming the run; a
listener that dies of what it does not retry stops the worker, with a line saying why. Neither
leaves asyncio's "Task exception was never retrieved" behind.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any
from uuid import UUID

import anthropic
import pytest

from agentrun.logs import RunIdFilter
from agentrun.store import Lease, Notification, Store
from agentrun.tools import ToolRegistry
from agentrun.worker.process import SideTaskFailed, Worker, WorkerSettings
from tests.workerkit import AGENT, wait_for


class Injected(RuntimeError):
    """A failure no side task handles (a bug, say)."""


class RenewFails(Store):
    async def renew_all(
        self, leases: Sequence[Lease], *, ttl: float | None = None
    ) -> dict[UUID, Exception]:
        raise Injected("renewal blew up")


class ListenerBug(BaseException):
    """What the listener's own retry (``except Exception``) does not catch."""


class ListenFails(Store):
    async def listen(  # type: ignore[override]
        self, channels: Sequence[str] = (), on_listening: Callable[[], None] | None = None
    ) -> AsyncIterator[Notification]:
        raise ListenerBug("listener blew up")
        yield  # an async generator, as Store.listen is


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.addFilter(RunIdFilter())

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def find(self, text: str) -> list[logging.LogRecord]:
        return [r for r in self.records if text in r.getMessage()]


@pytest.fixture
def lines() -> Iterator[Lines]:
    handler = Lines()
    logger = logging.getLogger("agentrun")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


@pytest.fixture
async def unretrieved() -> AsyncIterator[list[str]]:
    """What the loop's exception handler is told (a "never retrieved" task among it)."""
    seen: list[str] = []
    loop = asyncio.get_running_loop()
    old = loop.get_exception_handler()

    def handler(_: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        seen.append(str(context.get("message")))

    loop.set_exception_handler(handler)
    try:
        yield seen
    finally:
        loop.set_exception_handler(old)


def no_unretrieved(seen: list[str]) -> None:
    gc.collect()  # a task's unretrieved exception is reported when the task is collected
    assert not [m for m in seen if "never retrieved" in m], seen


async def test_a_heartbeat_that_dies_lets_its_run_go_as_if_the_lease_were_lost(
    database_url: str, lines: Lines, unretrieved: list[str]
) -> None:
    # The model is unreachable: the run retries its call (progress within its deadline), so
    # only the heartbeat renews its lease, and the renewal raises what the heartbeat does not
    # handle. Before, the heartbeat died in silence and the run went on holding a lease that
    # lapsed under it.
    store = await RenewFails.open(database_url)
    client = anthropic.AsyncAnthropic(base_url="http://127.0.0.1:9", api_key="unused")
    worker = Worker(store, client, ToolRegistry(),
                    WorkerSettings(lease_ttl=1, poll_interval=60, health_port=None,
                                   worker_id="w"))
    serving = asyncio.create_task(worker.serve())
    try:
        run, _ = await store.create_run("hold on", AGENT.model_copy(update={"tools": []}))
        await wait_for(lambda: bool(lines.find("in-flight work aborted")), 30, "the abort")
        (died,) = lines.find("heartbeat failed")
        assert died.getMessage() == (
            "heartbeat failed (Injected: renewal blew up); letting the run go as if its lease "
            "were lost"
        )
        assert getattr(died, "run_id", None) == str(run.id)
        (lost,) = lines.find("lease lost; in-flight work aborted")
        assert getattr(lost, "run_id", None) == str(run.id)
        await wait_for(lambda: not worker.active, 10, "the run to be let go")
        assert worker.metrics.lease_losses._value.get() == 1
        worker.request_drain()
        await asyncio.wait_for(serving, 30)
    finally:
        serving.cancel()
        await asyncio.wait({serving}, timeout=10)
        await store.close()
        await client.close()
    no_unretrieved(unretrieved)


async def test_a_listener_that_dies_stops_the_worker_with_a_line(
    database_url: str, lines: Lines, unretrieved: list[str]
) -> None:
    store = await ListenFails.open(database_url)
    client = anthropic.AsyncAnthropic(base_url="http://127.0.0.1:9", api_key="unused")
    worker = Worker(store, client, ToolRegistry(),
                    WorkerSettings(poll_interval=60, health_port=None, worker_id="w"))
    try:
        with pytest.raises(SideTaskFailed) as failed:
            await asyncio.wait_for(worker.serve(), 30)  # not a worker that hears nothing
        assert str(failed.value) == (
            "the worker stopped: its listener failed (ListenerBug: listener blew up); every "
            "run was handed back"
        )
        (died,) = lines.find("listener failed")
        assert died.levelno == logging.ERROR
        assert died.getMessage().startswith(
            "listener failed (ListenerBug: listener blew up); stopping the worker")
    finally:
        await store.close()
        await client.close()
    no_unretrieved(unretrieved)


async def test_watch_hands_over_a_failure_or_an_unexpected_return_and_nothing_else(
    unretrieved: list[str],
) -> None:
    # The helper the operator's background tasks and the mirror's patches are watched with.
    from agentrun.supervise import TaskEnded, watch

    failures: list[BaseException] = []

    async def fails() -> None:
        raise Injected("boom")

    async def returns() -> None:
        return None

    tasks = [
        watch(asyncio.create_task(fails()), failures.append),
        watch(asyncio.create_task(returns()), failures.append, forever=True),
        watch(asyncio.create_task(returns()), failures.append),  # may return: quiet
        watch(asyncio.create_task(asyncio.Event().wait()), failures.append),
    ]
    tasks[3].cancel()  # cancelled: quiet
    await asyncio.wait(tasks)
    await asyncio.sleep(0)  # the done callbacks run on the next turn of the loop
    assert [type(f) for f in failures] == [Injected, TaskEnded], failures
    del tasks
    no_unretrieved(unretrieved)
