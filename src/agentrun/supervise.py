"""Side tasks that are watched (procrastinate's worker): none may die unnoticed.

A task that raises and is never awaited dies in silence (asyncio says only "Task exception was
never retrieved", at garbage collection, if ever), and what it did stops: a heartbeat's run loses
its lease while it still runs, a listener's worker hears of no cancel. :func:`watch` retrieves
the outcome of such a task when it ends and hands an unexpected end to the owner, who decides:
the worker aborts the run of a dead heartbeat, and stops for a dead listener; the operator stops
for a dead background loop and logs a dead condition patch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class TaskEnded(Exception):
    """A task meant to run until cancelled returned."""


def watch(
    task: asyncio.Task[T],
    on_failure: Callable[[BaseException], object],
    *,
    forever: bool = False,
) -> asyncio.Task[T]:
    """Call ``on_failure(exc)`` when ``task`` ends by an exception (retrieved here, so it is
    never "never retrieved"), or, with ``forever``, by returning (a :class:`TaskEnded`). A task
    cancelled, or one that returns without ``forever``, ends quietly. Returns ``task``."""

    def ended(t: asyncio.Task[T]) -> None:
        if t.cancelled():
            return
        exc = t.exception()
        if exc is not None:
            on_failure(exc)
        elif forever:
            on_failure(TaskEnded(f"task {t.get_name()} returned"))

    task.add_done_callback(ended)
    return task


def describe(exc: BaseException) -> str:
    """An exception as one short line for a log: its type and its first 200 characters."""
    text = " ".join(str(exc).split())[:200]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
