"""The operator's cleanup stops its per-object tasks before it closes the store.

Found by an adversarial review (2026-12-07): kopf waits 5 s at exit for tasks it did not start;
a task acting on an object's annotations, asleep in a retry, woke after the store was closed and
logged that the database was down (and the exit took 5 s more). In process: handlers.cleanup
with the bookkeeping it reads, and a stand-in for the app that records what it found at stop().
"""

from __future__ import annotations

import asyncio

from agentrun.operator import handlers
from agentrun.operator.app import APP, OperatorApp


class App(OperatorApp):
    """The app as cleanup asks it: stop(), noting whether every per-object task was over."""

    def __init__(self, tasks: list[asyncio.Task[None]]) -> None:  # none of the app's start-up
        self.tasks = tasks
        self.over_at_stop: list[bool] = []

    async def stop(self) -> None:  # type: ignore[override]
        self.over_at_stop = [t.done() for t in self.tasks]


async def test_cleanup_stops_the_per_object_tasks_before_the_store_closes() -> None:
    acting, expiries = handlers.Acting(), handlers.Expiries()
    acting.tasks["a"] = asyncio.create_task(asyncio.sleep(3600))  # a retry's wait
    expiries.expiring["b"] = asyncio.create_task(asyncio.sleep(3600))  # a TTL's wait
    app = App([acting.tasks["a"], expiries.expiring["b"]])
    await handlers.cleanup(memo={handlers.ACTING: acting, handlers.EXPIRIES: expiries,
                                 APP: app})
    assert app.over_at_stop == [True, True]
    assert all(t.cancelled() for t in app.tasks)


async def test_cleanup_after_a_failed_start_up_has_nothing_to_stop() -> None:
    await handlers.cleanup(memo={})  # the start-up failed before it kept anything
