"""A small Python client: submit runs, wait for them, read their results, decide their approvals.

Two faces over one implementation (see docs/client.md):

* :class:`AsyncClient`, an async context manager over :class:`agentrun.store.Store`, for code that
  runs in an event loop;
* :class:`Client`, its synchronous facade, for plain scripts and notebooks. It runs its own event
  loop in a background thread (one per client) and hands each call to it: ``asyncio.run`` per call
  would fail where a loop already runs in the calling thread (Jupyter, an async web app), and would
  open a new connection pool for every call.

The database is found as the CLI finds it: the ``database_url`` argument, else
``AGENTRUN_DATABASE_URL``, else the embedded PostgreSQL (whose schema is then migrated, as the CLI
does). Runs and steps are the store's own :class:`~agentrun.store.Run` and
:class:`~agentrun.store.Step`; errors are those of :mod:`agentrun.errors`.

``wait`` LISTENs on the store's ``agentrun_run_changed`` channel (a run's every status change is
notified) and re-reads the run when a notification about it arrives, each time its LISTEN
connection is (re)established (so a change made while it was disconnected is not missed), and
every :data:`RECHECK_INTERVAL` seconds in any case.
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import contextlib
import json
import logging
import os
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, Literal, Self, TypeVar, get_args
from uuid import UUID

from pydantic import ValidationError

from agentrun.config import DATABASE_URL_ENV, validate_database_url
from agentrun.embedded import database_url as default_database_url
from agentrun.errors import AgentrunError, ConfigError, RunUnsuccessful, WaitTimeout
from agentrun.manifests import (
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_MAX_STEPS,
    AgentRunSpec,
    AgentSpec,
    BudgetSpec,
    ResolvedRun,
    load_manifest_texts,
    load_manifests,
    one_run_per_key,
)
from agentrun.schema import open_store
from agentrun.store import (
    CHANNEL_RUN_CHANGED,
    DB_ERRORS,
    MAX_LIST,
    ManifestName,
    Run,
    Step,
    Store,
    parse_run_id,
)
from agentrun.vocabulary import RUN_STATUSES, RunStatus
from agentrun.waits import WaitRef

__all__ = ["RECHECK_INTERVAL", "AsyncClient", "Client", "WaitFor"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: What :meth:`AsyncClient.wait` waits for: any terminal status, or success (anything else raises).
WaitFor = Literal["finished", "succeeded"]

#: Seconds between the re-reads a wait makes whatever it hears (a safety net under LISTEN).
RECHECK_INTERVAL = 30.0
#: How long a wait's LISTEN connection waits before reconnecting, at most (it backs off to this).
MAX_RECONNECT_DELAY = 5.0


def _decided_by(by: str | None) -> str:
    return by or os.environ.get("USER") or "client"


def _is_about(payload: str, run_id: UUID) -> bool:
    """Whether a run-changed notification is about ``run_id`` (payload: JSON with "id")."""
    try:
        data = json.loads(payload)
    except ValueError:
        return False
    return isinstance(data, dict) and data.get("id") == str(run_id)


#: What a URL error names when the URL was the client's argument, not the environment's.
DATABASE_URL_ARG = "the database_url argument"

class AsyncClient:
    """Runs in the agentrun store, from async code::

        async with AsyncClient() as client:
            run = await client.submit("Add a region column", agent)
            done = await client.wait(run.id, timeout=600)

    ``database_url``: the PostgreSQL URL; None finds it as the CLI does (AGENTRUN_DATABASE_URL,
    else the embedded server). ``max_connections``: the size of its connection pool (a wait holds
    one more connection, its own, for LISTEN).
    """

    def __init__(self, database_url: str | None = None, *, max_connections: int = 4) -> None:
        if max_connections < 1:
            raise ConfigError(f"max_connections={max_connections}: must be at least 1")
        self._url = database_url
        self._max_connections = max_connections
        self._store: Store | None = None

    # -- opening and closing -------------------------------------------------------------------

    async def open(self) -> Self:
        """Connect (``async with`` does this). Raises :class:`DatabaseUnavailable` when the
        database cannot be reached, :class:`ConfigError` for a bad URL or an old schema."""
        if self._store is not None:
            return self
        if self._url is not None:
            source = DATABASE_URL_ARG
            url, embedded = validate_database_url(self._url, source), False
        else:
            source = DATABASE_URL_ENV
            url, embedded = default_database_url(quiet=True)
        self._store = await open_store(
            url, embedded=embedded, max_size=self._max_connections, source=source
        )
        return self

    async def close(self) -> None:
        if self._store is not None:
            store, self._store = self._store, None
            await store.close()

    async def __aenter__(self) -> Self:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def store(self) -> Store:
        """The underlying store (open)."""
        if self._store is None:
            raise AgentrunError(
                "the client is not open: use `async with AsyncClient() as client` "
                "(or await client.open())"
            )
        return self._store

    # -- submitting ----------------------------------------------------------------------------

    async def submit(
        self,
        task: str,
        agent: AgentSpec,
        *,
        pool: str | None = None,
        max_steps: int = DEFAULT_MAX_STEPS,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        budget: BudgetSpec | None = None,
        idempotency_key: str | None = None,
    ) -> Run:
        """Create a run of ``agent`` on ``task`` (checked as an AgentRun manifest's spec is).
        ``pool`` overrides the agent's, ``budget``'s limits the agent's; with
        ``idempotency_key`` a second submit with the same key returns the first run instead of
        creating another."""
        try:
            spec = AgentRunSpec(
                agent=agent, task=task, max_steps=max_steps, max_attempts=max_attempts, pool=pool,
                budget=budget,
            )
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in exc.errors()
            )
            raise ConfigError(f"submit: {problems}") from None
        resolved = ResolvedRun(
            name="",
            task=spec.task,
            agent=spec.resolved_agent(agent),
            pool=spec.pool or agent.pool,
            max_steps=spec.max_steps,
            max_attempts=spec.max_attempts,
        )
        return await self._create(resolved, idempotency_key)

    async def submit_manifest(
        self, manifest: str | Path, *, idempotency_key: str | None = None
    ) -> builtins.list[Run]:
        """Create the runs of a manifest's AgentRun documents (with the Agent documents they
        refer to), as ``agentrun submit -f`` does. ``manifest``: a :class:`~pathlib.Path` or a
        path string, or YAML text (a string with a newline in it). Returns the runs in the
        order of their documents."""
        if isinstance(manifest, str) and "\n" in manifest:
            resolved = load_manifest_texts([("manifest text", manifest)])
        else:
            resolved = load_manifests([str(manifest)])
        one_run_per_key(resolved, idempotency_key, "idempotency_key")
        return [await self._create(r, idempotency_key) for r in resolved]

    async def _create(self, r: ResolvedRun, idempotency_key: str | None) -> Run:
        run, _ = await self.store.create_run(
            r.task,
            r.agent,
            pool=r.pool,
            max_steps=r.max_steps,
            max_attempts=r.max_attempts,
            external_key=idempotency_key,
            name=ManifestName.of(r.namespace, r.name) if r.name else None,
        )
        return run

    # -- reading -------------------------------------------------------------------------------

    async def get(self, run_id: str | UUID) -> Run:
        """The run as it is now. :class:`RunNotFound` for an unknown id, :class:`ConfigError`
        for a string that is no run id."""
        return await self.store.get_run(run_id)

    async def steps(self, run_id: str | UUID) -> builtins.list[Step]:
        """The run's step log, in order (:class:`RunNotFound` for an unknown id)."""
        run = await self.store.get_run(run_id)
        return await self.store.steps(run.id)

    # A timeout argument, not asyncio.timeout around the call: the same signature as Client's,
    # and the WaitTimeout it raises names the status the run was still in.
    async def wait(
        self,
        run_id: str | UUID,
        *,
        until: WaitFor = "finished",
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> Run:
        """Wait until the run has finished and return it as it ended.

        ``until="finished"`` returns the run whatever it ended as (succeeded, failed, cancelled,
        dead_letter: see ``run.status`` and ``run.error``). ``until="succeeded"`` returns it only
        if it succeeded and raises :class:`~agentrun.errors.RunUnsuccessful` (with ``.run``) if it
        ended otherwise. ``timeout`` (seconds; None: no limit): after it
        :class:`~agentrun.errors.WaitTimeout` is raised, a :class:`TimeoutError`; the run itself
        goes on. A run waiting for approval has not finished: the wait goes on through it.
        """
        if until not in get_args(WaitFor):
            raise ConfigError(f"until={until!r}: expected one of {', '.join(get_args(WaitFor))}")
        if timeout is not None and not timeout >= 0:  # nan too: it timed out at once
            raise ConfigError(f"timeout={timeout:g}: must be >= 0 seconds (None: no limit)")
        seen = [await self.store.get_run(run_id)]  # RunNotFound before any waiting
        try:
            async with asyncio.timeout(timeout):
                run = await self._until_finished(seen)
        except TimeoutError:
            if timeout is None:  # not ours: no limit was set
                raise
            raise WaitTimeout(str(seen[0].id), seen[0].status, timeout) from None
        if until == "succeeded" and run.status != "succeeded":
            raise RunUnsuccessful(run)
        return run

    async def result(
        self, run_id: str | UUID, *, timeout: float | None = None  # noqa: ASYNC109
    ) -> str:
        """The final text of the run, once it has succeeded (waits as ``wait(run_id,
        until="succeeded", timeout=timeout)`` does, with its exceptions)."""
        run = await self.wait(run_id, until="succeeded", timeout=timeout)
        return run.result or ""

    async def _until_finished(self, seen: builtins.list[Run]) -> Run:
        """Re-read the run on each notification about it, on each (re)connection of the
        LISTEN and every RECHECK_INTERVAL; ``seen[0]`` is the latest read."""
        if seen[0].finished:
            return seen[0]
        rid = seen[0].id
        wake: asyncio.Queue[None] = asyncio.Queue()
        listener = asyncio.create_task(self._listen(rid, wake), name=f"agentrun-wait-{rid}")
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.get(), RECHECK_INTERVAL)
                try:
                    seen[0] = await self.store.get_run(rid)
                except DB_ERRORS as exc:
                    # An outage: the LISTEN reconnects and wakes us when the database is back.
                    log.warning("run %s: cannot read the run (%s); the wait goes on", rid, exc,
                                extra={"run_id": str(rid)})
                    continue
                if seen[0].finished:
                    return seen[0]
        finally:
            listener.cancel()
            await asyncio.gather(listener, return_exceptions=True)

    async def _listen(self, rid: UUID, wake: asyncio.Queue[None]) -> None:
        delay = 0.2
        while True:
            try:
                async for n in self.store.listen(
                    (CHANNEL_RUN_CHANGED,), on_listening=lambda: wake.put_nowait(None)
                ):
                    delay = 0.2
                    if _is_about(n.payload, rid):
                        wake.put_nowait(None)
            except DB_ERRORS as exc:
                log.info("run %s: the wait's LISTEN connection failed (%s); reconnecting in "
                         "%.1f s", rid, exc, delay, extra={"run_id": str(rid)})
            await asyncio.sleep(delay)
            delay = min(delay * 2, MAX_RECONNECT_DELAY)

    # -- acting on runs ------------------------------------------------------------------------

    async def cancel(
        self, run_id: str | UUID, *, reason: str | None = None, rollback: bool = False
    ) -> tuple[Run, bool]:
        """Cancel a run that has not finished; returns the run as it now is and whether this call
        cancelled it (False: it had finished, or it is rolling back, ``run.rolling_back``: a
        rollback runs to its end). ``rollback``: run the compensations of what it did first; the
        run then ends cancelled once they have run."""
        if rollback:
            return await self.store.request_rollback(run_id, "cancelled", reason)
        return await self.store.cancel(run_id, reason=reason)

    async def approve(
        self,
        run_id: str | UUID,
        seq: int | str | WaitRef | None = None,
        *,
        by: str | None = None,
        reason: str | None = None,
    ) -> dict[str, Any]:
        """Approve the call the run waits on (``seq``: the wait, "<seq>.<call>" as ``agentrun
        get`` shows it, or a bare step number, refused once the step had a decision (see
        agentrun/waits.py); None: whatever it waits on now). The run resumes on its next claim.
        Returns the call decided (tool, input, seq, call_index, stage). ``by`` defaults to
        $USER."""
        rid, step = await self._wait(run_id, seq)
        return await self.store.decide(
            rid, step, "approved", decided_by=_decided_by(by), reason=reason
        )

    async def reject(
        self,
        run_id: str | UUID,
        seq: int | str | WaitRef | None = None,
        *,
        by: str | None = None,
        reason: str | None = None,
        abort: bool = False,
    ) -> dict[str, Any]:
        """Reject the call the run waits on: the model is told it was rejected (and why) and the
        run goes on; with ``abort`` the run rolls its compensable effects back and fails.
        ``seq`` as for :meth:`approve`."""
        rid, step = await self._wait(run_id, seq)
        return await self.store.decide(
            rid, step, "rejected", decided_by=_decided_by(by), reason=reason, abort=abort
        )

    async def _wait(
        self, run_id: str | UUID, seq: int | str | WaitRef | None
    ) -> tuple[UUID, WaitRef]:
        rid = parse_run_id(run_id)
        if seq is not None:
            return rid, WaitRef.named_by(seq, "seq")
        # Whatever it waits on now, named whole: a bare step number read here would be refused
        # on a step's second wait, and must not decide one nobody read.
        pending = await self.store.waited_on(rid)
        if pending is None:
            run = await self.store.get_run(rid)
            raise ConfigError(f"run {rid} is not waiting for approval (it is {run.status})")
        return rid, WaitRef.of(pending)

    async def list(
        self, *, pool: str | None = None, status: RunStatus | None = None, limit: int = 100
    ) -> builtins.list[Run]:
        """Runs, newest first, optionally of one pool and/or one status."""
        if status is not None and status not in RUN_STATUSES:
            raise ConfigError(
                f"status={status!r}: expected one of {', '.join(RUN_STATUSES)}"
            )
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIST:
            raise ConfigError(f"limit={limit!r}: must be a number from 1 to {MAX_LIST}")
        return await self.store.list_runs(pool=pool, status=status, limit=limit)


class Client:
    """The synchronous facade of :class:`AsyncClient`, for scripts and notebooks::

        with Client() as client:
            run = client.submit("Add a region column", agent)
            print(client.result(run.id, timeout=600))

    Each client runs an event loop of its own in a daemon thread; every method hands its call to
    that loop and blocks until it is done (so it works whether or not a loop already runs in the
    calling thread; called from a coroutine it blocks that loop meanwhile: use
    :class:`AsyncClient` there). Methods may be called from several threads at once. Ctrl-C in a
    blocking call cancels it. Close the client (``with``, or :meth:`close`) to close its
    connections and stop its thread.
    """

    def __init__(self, database_url: str | None = None, *, max_connections: int = 4) -> None:
        self._async = AsyncClient(database_url, max_connections=max_connections)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="agentrun-client", daemon=True
        )
        self._thread.start()
        self._closed = False
        try:
            self._call(self._async.open())
        except BaseException:
            self._stop_loop()
            raise

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._closed or threading.current_thread() is self._thread:
            coro.close()
            raise AgentrunError(
                "this Client is closed" if self._closed
                else "a Client's method was called from inside its own event loop"
            )
        future: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # Ctrl-C (or any interruption) of a blocking call stops the call too
            raise

    def _stop_loop(self) -> None:
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def close(self) -> None:
        if self._closed:
            return
        try:
            self._call(self._async.close())
        finally:
            self._stop_loop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(
        self,
        task: str,
        agent: AgentSpec,
        *,
        pool: str | None = None,
        max_steps: int = DEFAULT_MAX_STEPS,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        budget: BudgetSpec | None = None,
        idempotency_key: str | None = None,
    ) -> Run:
        """See :meth:`AsyncClient.submit`."""
        return self._call(self._async.submit(
            task, agent, pool=pool, max_steps=max_steps, max_attempts=max_attempts,
            budget=budget, idempotency_key=idempotency_key,
        ))

    def submit_manifest(
        self, manifest: str | Path, *, idempotency_key: str | None = None
    ) -> builtins.list[Run]:
        """See :meth:`AsyncClient.submit_manifest`."""
        return self._call(self._async.submit_manifest(manifest, idempotency_key=idempotency_key))

    def get(self, run_id: str | UUID) -> Run:
        """See :meth:`AsyncClient.get`."""
        return self._call(self._async.get(run_id))

    def steps(self, run_id: str | UUID) -> builtins.list[Step]:
        """See :meth:`AsyncClient.steps`."""
        return self._call(self._async.steps(run_id))

    def wait(
        self, run_id: str | UUID, *, until: WaitFor = "finished", timeout: float | None = None
    ) -> Run:
        """See :meth:`AsyncClient.wait`."""
        return self._call(self._async.wait(run_id, until=until, timeout=timeout))

    def result(self, run_id: str | UUID, *, timeout: float | None = None) -> str:
        """See :meth:`AsyncClient.result`."""
        return self._call(self._async.result(run_id, timeout=timeout))

    def cancel(
        self, run_id: str | UUID, *, reason: str | None = None, rollback: bool = False
    ) -> tuple[Run, bool]:
        """See :meth:`AsyncClient.cancel`."""
        return self._call(self._async.cancel(run_id, reason=reason, rollback=rollback))

    def approve(
        self,
        run_id: str | UUID,
        seq: int | None = None,
        *,
        by: str | None = None,
        reason: str | None = None,
    ) -> dict[str, Any]:
        """See :meth:`AsyncClient.approve`."""
        return self._call(self._async.approve(run_id, seq, by=by, reason=reason))

    def reject(
        self,
        run_id: str | UUID,
        seq: int | None = None,
        *,
        by: str | None = None,
        reason: str | None = None,
        abort: bool = False,
    ) -> dict[str, Any]:
        """See :meth:`AsyncClient.reject`."""
        return self._call(self._async.reject(run_id, seq, by=by, reason=reason, abort=abort))

    def list(
        self, *, pool: str | None = None, status: RunStatus | None = None, limit: int = 100
    ) -> builtins.list[Run]:
        """See :meth:`AsyncClient.list`."""
        return self._call(self._async.list(pool=pool, status=status, limit=limit))
