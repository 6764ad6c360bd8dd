"""Group commit: the concurrent appends of one worker's runs, sent to PostgreSQL together.

A worker with many runs appends many steps at once, each today one statement and one commit of
its own: per step the database parses, plans, starts an executor, writes a commit record and
wakes a backend. :class:`GroupCommit` sends them as one statement (queries.sql ``append_steps``)
instead, without waiting for anyone: an append that finds nothing in flight is sent at once, by
its own caller, alone (no timer, no added latency for a worker with one run). The appends that
arrive while a statement is in flight are queued, and sent together as the next statement when it
returns: the busier the database, the bigger the batch ("natural" group commit, as PostgreSQL
groups the WAL flushes of concurrent commits without a commit_delay).

The batcher knows nothing of SQL: the Store gives it the function that sends a batch on a
connection and returns each item's outcome (a value, or the exception for that item's caller
alone); an exception the function raises is every caller's of that batch (a connection lost
mid-statement: one statement is one transaction, so none of it was applied). Items whose ``key``
says they cannot share a statement (another worker's, or a second item for a run already in the
batch) wait for a later one. Batches that follow each other go out on one connection (``session``),
taken once for the lot and given back when the queue is empty or a batch failed: the pool hands
its connections out in turn, and a statement on a backend that just ran it is cheaper (its plan
cached, its caches warm).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")
S = TypeVar("S")

#: Rows in one statement at most. The statement matches its rows to the runs by a nested loop
#: (queries.sql append_steps), n x n comparisons: negligible at 128, not at thousands. A worker
#: rarely holds more runs; more wait for the next statement.
MAX_BATCH = 128


#: How long a batch whose callers all stopped waiting is given to end once stopped (psycopg
#: sends the server a cancel request, and closes a connection that does not answer it).
ABANDON_GRACE = 10.0


async def _until_done_or_abandoned(
    sending: asyncio.Future[Any], callers: list[asyncio.Future[R]]
) -> None:
    """Until ``sending`` is done, or every one of ``callers`` is (cancelled: nobody waits)."""
    while not sending.done():
        waiting = [f for f in callers if not f.done()]
        if not waiting:
            return
        await asyncio.wait([sending, *waiting], return_when=asyncio.FIRST_COMPLETED)


@dataclass
class AppendStats:
    """What the appends cost in statements: ``statements`` sent for ``rows`` appends (equal
    without group commit), the ``largest`` batch, and the ``fallbacks``: batches the database
    refused whole (a value a column refuses, a duplicate that raced the check), sent again one
    append per statement so each caller gets its own answer."""

    statements: int = 0
    rows: int = 0
    largest: int = 0
    fallbacks: int = 0

    def count(self, rows: int) -> None:
        self.statements += 1
        self.rows += rows
        self.largest = max(self.largest, rows)


class GroupCommit(Generic[T, R, S]):
    """Sends items through ``send`` one batch at a time (see the module docstring).

    ``send(items, session)`` returns one outcome per item, in order: its result, or the exception
    its caller gets; ``session()`` opens what it sends on (a pooled connection), which the next
    batch reuses while ``alive(session)``. ``key(item)`` is ``(group, slot)``: a batch holds items
    of one group, at most one per slot."""

    def __init__(
        self,
        send: Callable[[Sequence[T], S], Awaitable[Sequence[R | Exception]]],
        session: Callable[[], AbstractAsyncContextManager[S]],
        key: Callable[[T], tuple[Hashable, Hashable]],
        *,
        alive: Callable[[S], bool] = lambda session: True,
        max_batch: int = MAX_BATCH,
    ) -> None:
        self._send = send
        self._session = session
        self._alive = alive
        self._key = key
        self._max_batch = max_batch
        self._busy = False
        self._queue: list[tuple[T, asyncio.Future[R]]] = []
        self._drainer: asyncio.Task[None] | None = None

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def submit(self, item: T) -> R:
        """Send ``item`` (now if nothing is in flight, else with the next batch); its outcome."""
        if not self._busy:
            # Nothing in flight: this caller sends its own item at once, on its own task.
            self._busy = True
            try:
                async with self._session() as session:
                    outcome = (await self._send([item], session))[0]
            finally:
                self._hand_over()
            if isinstance(outcome, Exception):
                raise outcome
            return outcome
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._queue.append((item, future))
        return await future

    def _hand_over(self) -> None:
        """After a batch: the queued items go out next, on a task of their own (the caller whose
        batch just returned does not wait for theirs)."""
        if any(not f.done() for _, f in self._queue):
            self._drainer = asyncio.get_running_loop().create_task(self._drain())
        else:
            self._queue.clear()
            self._busy = False

    def _take(self) -> list[tuple[T, asyncio.Future[R]]]:
        """The next batch, in arrival order: the first waiting item's group, one item per slot;
        the others stay queued (a caller cancelled while waiting is dropped)."""
        batch: list[tuple[T, asyncio.Future[R]]] = []
        rest: list[tuple[T, asyncio.Future[R]]] = []
        group: Hashable = None
        slots: set[Hashable] = set()
        for entry in self._queue:
            item, future = entry
            if future.done():
                continue
            g, slot = self._key(item)
            if not batch:
                group = g
            if g == group and slot not in slots and len(batch) < self._max_batch:
                batch.append(entry)
                slots.add(slot)
            else:
                rest.append(entry)
        self._queue = rest
        return batch

    async def _drain(self) -> None:
        try:
            while batch := self._take():
                try:
                    async with self._session() as session:
                        while (batch and await self._one_batch(batch, session)
                               and self._alive(session)):
                            # One pass of the event loop (not a timer) before the next batch:
                            # the callers just answered run first, and one that appends again at
                            # once (a run whose next step is ready) joins the next batch instead
                            # of waiting for it to return. Without it, runs that append back to
                            # back split into two cohorts that take turns, each batch half the
                            # runs and every commit flushed alone.
                            await asyncio.sleep(0)
                            batch = self._take()
                except Exception as exc:
                    # No session to send on (the pool timed out: the database is down) or one
                    # that failed as it was given back: the batch in hand gets what a lone append
                    # would have raised, and the next batch tries again. Before, the drainer died
                    # of it with the taken batch's callers waiting for ever, its exception never
                    # retrieved.
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
        finally:
            # Cancelled (the loop is closing): nobody will send the rest.
            for _, future in self._queue:
                future.cancel()
            self._queue.clear()
            self._drainer = None
            self._busy = False

    async def _one_batch(self, batch: list[tuple[T, asyncio.Future[R]]], session: S) -> bool:
        """Send one batch and answer its callers; False if it failed whole (the session may be
        broken: the next batch gets another).

        The statement is sent on a task of its own, stopped once every caller of the batch has
        stopped waiting for it (their runs stalled, their leases lost: their tasks cancelled).
        A batch on a connection that stopped answering without a reset held the drainer, and
        every later append of every run of the worker queued behind it, for as long as the
        kernel kept the connection (for ever behind a peer that acknowledges and never answers);
        a lone append is on its caller's task, and stops with it."""
        items = [item for item, _ in batch]

        async def send() -> Sequence[R | Exception]:
            return await self._send(items, session)

        sending = asyncio.get_running_loop().create_task(send(), name="group commit")
        try:
            await _until_done_or_abandoned(sending, [f for _, f in batch])
        except BaseException:  # the drainer cancelled (the loop is closing): nobody answers
            sending.cancel()
            for _, future in batch:
                future.cancel()
            raise
        if not sending.done():
            sending.cancel()
            # Bounded: a driver that cannot interrupt its wait is left behind; the session it
            # holds is given back in use, and the pool closes it.
            await asyncio.wait({sending}, timeout=ABANDON_GRACE)
            if sending.done() and not sending.cancelled():
                sending.exception()  # retrieved: nobody waits for it any more
            return False
        try:
            outcomes = sending.result()
        except Exception as exc:
            # Nothing of the statement was applied: each caller gets what a lone append would
            # have raised.
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return False
        except BaseException:
            for _, future in batch:
                future.cancel()
            raise
        for (_, future), outcome in zip(batch, outcomes, strict=True):
            if future.done():
                continue
            if isinstance(outcome, Exception):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)
        return True
