"""When a statement has left for the database, not only when it is answered (issue 17).

A statement whose bytes the kernel has taken reaches PostgreSQL whatever then becomes of the
process that wrote them: a worker SIGKILLed, or taken down by one of its tools (``os._exit``, a
segfault), after that moment closes its socket behind those bytes, and the server reads, executes
and commits the statement before it notices the client is gone (it looks only when it answers).
So a model turn's append, which carries its first tool call's mark (migration 0005: the mark
blames the run whose tool takes its worker down), may let a *pure* tool start once the append is
sent rather than once it is committed: the mark lands either way, and a pure tool's work, if the
append then fails, is simply dropped (worker/executor.py, "pipelined pure turns").

psycopg tells when a statement is answered. :class:`StoreConnection` tells when it is sent: it
watches the generator psycopg drives for a statement, and once the cursor has queued the
statement's last message (``StoreCursor``: a statement's first use on a connection sends and
waits for a Parse of its own before it), the first wait for READ means libpq's output buffer was
flushed: every byte is written. That needs two of psycopg's private cursor methods; if a release
renamed them, the callback would simply never fire, and its callers wait for the answer, as
before (tests/test_sent.py checks it fires first).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import psycopg
from psycopg.abc import PQGen
from psycopg.waiting import Wait

RV = TypeVar("RV")


class StoreConnection(psycopg.AsyncConnection[Any]):
    """Every store connection: :meth:`on_sent` calls back once a statement is written."""

    _sent_callback: Callable[[], None] | None = None
    _last_queued = False

    @contextmanager
    def on_sent(self, callback: Callable[[], None] | None) -> Iterator[None]:
        """Call ``callback`` once the statement executed inside the block has been written to
        the socket whole (at most once; never if it was not, e.g. the connection broke first)."""
        self._sent_callback, self._last_queued = callback, False
        try:
            yield
        finally:
            self._sent_callback, self._last_queued = None, False

    def last_message_queued(self) -> None:
        """The cursor has handed libpq the statement's last message (it is not flushed yet)."""
        self._last_queued = True

    async def wait(self, gen: PQGen[RV], *args: Any, **kwargs: Any) -> RV:
        if self._sent_callback is None:
            return await super().wait(gen, *args, **kwargs)
        return await super().wait(self._watched(gen), *args, **kwargs)

    def _watched(self, gen: PQGen[RV]) -> PQGen[RV]:
        """``gen`` as it is, but the callback fires at its first wait for READ once the last
        message is queued: psycopg's send loop yields READ only after libpq's flush returned 0."""
        ready: Any = None
        while True:
            try:
                wait = gen.send(ready)
            except StopIteration as stop:
                result: RV = stop.value
                return result
            if wait == Wait.R and self._last_queued and self._sent_callback is not None:
                callback, self._sent_callback = self._sent_callback, None
                callback()
            ready = yield wait


def last_message_queued(conn: psycopg.AsyncConnection[Any]) -> None:
    """Tell ``conn`` (a :class:`StoreConnection`; any other is left alone) that its cursor has
    queued a statement's last message."""
    if isinstance(conn, StoreConnection):
        conn.last_message_queued()
