"""The worker process: claim runs, hold them, drain on SIGTERM.

Before anything else the worker waits for the database schema it needs, alive and not ready
(``_until_schema``): on a fresh install its pods may start before the operator migrates.

Beside the main claim loop run three kinds of side tasks (procrastinate's shape):

* one listener on LISTEN/NOTIFY: a cancel of a held run aborts its task at once (an in-flight
  model call included), a newly claimable run wakes the claim loop; it reconnects by itself. The
  worker is ready, and makes its first claim, only once LISTEN is in place (and claims once more
  after every reconnection), so no run waits a poll interval for want of a notification. While
  it listens, an idle worker's claim loop makes one query per wake-up: a notification, the next
  lease of another worker running out (the claim itself says when), or the idle interval (60 s)
  as a safety net; while it reconnects, the loop polls every poll interval (5 s);
* one heartbeat for all held runs: every third of the TTL it renews, in ONE fenced statement,
  each held run no commit renewed within the last half of that, so a long model call or tool
  never lets a lease lapse, but only while the run makes progress (worker/liveness.py): a
  stalled run is abandoned with an error saying why and its task is stopped, never held; a run
  the renewal finds gone (claimed again, cancelled) is aborted, the others go on;
* the health server (/healthz, /readyz, /metrics) and, on 127.0.0.1 only, the control listener
  (/drain, for the pod's preStop hook).

SIGTERM drains: claiming stops, in-flight model calls are aborted at once (a half-streamed turn
has no side effects, and the next worker should not wait for it), tools run on to their commit,
every lease is released so another worker resumes immediately rather than after the TTL, and the
process exits 0. Whatever is still running after the grace period is aborted and released;
threads still stuck in a tool call do not keep the process alive (exit_past_lingering_threads). A
second signal exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar
from uuid import UUID

import psycopg
from opentelemetry.trace import TracerProvider
from psycopg_pool import PoolTimeout

from agentrun.errors import (
    AgentrunError,
    ConfigError,
    DatabaseUnavailable,
    LeaseLost,
    RollbackRequested,
    RunCancelled,
)
from agentrun.logs import current_run_id
from agentrun.migrations import latest_version, schema_version
from agentrun.store import CHANNEL_RUN_CHANGED, CHANNEL_RUN_READY, DB_ERRORS, Store
from agentrun.supervise import describe, watch
from agentrun.tools import ToolRegistry
from agentrun.worker.executor import RunExecutor, RunFailed, RunHandle, WaitForApproval
from agentrun.worker.health import Health, WorkerMetrics, make_app, make_control_app
from agentrun.worker.providers import (
    ModelClient,
    PermanentModelError,
    Providers,
    TransientExhausted,
    import_in_turn,
)
from agentrun.worker.settings import WorkerSettings, check_settings
from agentrun.worker.tracing import RunTracer

if TYPE_CHECKING:
    from aiohttp import web

log = logging.getLogger("agentrun.worker")

#: Where the control listener (/drain) binds: only the pod itself can reach it.
CONTROL_HOST = "127.0.0.1"

#: A worker waiting for its schema checks again after 0.5 s, then twice as long each time up to
#: this (and within a quarter of its liveness threshold, which each successful check stamps): a
#: migration is picked up within seconds, at one tiny query per check.
SCHEMA_RECHECK_MAX = 5.0
#: While it waits, the waiting line is said again this often, so that `kubectl logs --since=...`
#: still shows why a pod is not ready.
SCHEMA_WAIT_REMINDER = 600.0

#: Failures of a store update that must not take a run's task down (Worker._quietly).
_NOT_WORTH_THE_RUN: tuple[type[BaseException], ...] = (LeaseLost, *DB_ERRORS)


class SideTaskFailed(AgentrunError):
    """A side task the worker cannot work without died: the worker drained and stopped."""


#: Ends of a hold that are no failure of the attempt: its trace's status stays unset.
NOT_FAILURES = (RunCancelled, WaitForApproval)

T = TypeVar("T")


@contextlib.contextmanager
def about(h: RunHandle) -> Iterator[None]:
    """Log lines in this block are about ``h``'s run (they carry its id): for a side task that
    acts on several runs, the heartbeat."""
    token = current_run_id.set(h.run_id)
    try:
        yield
    finally:
        current_run_id.reset(token)


def run_ids(handles: Iterable[RunHandle]) -> str:
    """The ids of several runs, for a log line about all of them."""
    return ", ".join(h.run_id for h in handles)


@dataclass(frozen=True)
class Again:
    """What a try of :func:`until_done` returns when it is not done: try again after
    ``delay`` seconds."""

    delay: float


def backoff(failures: int, base: float, doublings: int) -> float:
    """``base`` doubled at each failure in a row, ``doublings`` times at most, up to
    :data:`SCHEMA_RECHECK_MAX` seconds."""
    return min(SCHEMA_RECHECK_MAX, base * 2.0 ** min(failures, doublings))


class Reminder:
    """Says a waiting line at once and then again every :data:`SCHEMA_WAIT_REMINDER` seconds,
    not at every try, so that `kubectl logs --since=...` still shows why a pod waits."""

    def __init__(self) -> None:
        self.said_at: float | None = None

    def due(self) -> bool:
        now = time.monotonic()
        if self.said_at is not None and now - self.said_at < SCHEMA_WAIT_REMINDER:
            return False
        self.said_at = now
        return True


async def until_done(attempt: Callable[[], Awaitable[T | Again]], stop: asyncio.Event) -> T | None:
    """Try ``attempt`` until it returns something else than :class:`Again` (returned), waiting
    the delay it asks for between tries; None once ``stop`` is set (a signal, a drain). The one
    loop of the worker's start-up waits: for the database (:func:`until_store`) and for its
    schema (:meth:`Worker._until_schema`); each try says what it logs and how long to wait."""
    while not stop.is_set():
        outcome = await attempt()
        if not isinstance(outcome, Again):
            return outcome
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=outcome.delay)
    return None


async def until_store(open_store: Callable[[], Awaitable[Store]]) -> Store | None:
    """The store once the database accepts a connection (``open_store`` is
    :meth:`Store.open`, whose first step is the one connection check of the start-up); None if
    SIGTERM or SIGINT came first. Before the worker serves.

    On a fresh install with the chart's own PostgreSQL the worker pods start with the database;
    exiting at the first refused connection made the kubelet restart them (issue 19). Waiting
    keeps the pod's restart count for real failures. No liveness is served meanwhile: a
    database that stays away past the kubelet's patience is an outage (invariant 8), reported
    by restarts as before. A refused login is configuration and still raises at once."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    failures = 0
    waiting = Reminder()

    async def attempt() -> Store | Again:
        nonlocal failures
        try:
            store = await open_store()
        except DatabaseUnavailable as exc:
            failures += 1
            if waiting.due():
                log.warning("waiting for the database: %s; retrying until it answers", exc)
            return Again(backoff(failures, 0.25, 5))
        if waiting.said_at is not None:
            log.info("the database answers: no longer waiting")
        return store

    try:
        store = await until_done(attempt, stop)
        if store is None:
            log.info("stopped while waiting for the database")
        return store
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


class Worker:
    def __init__(
        self,
        store: Store,
        client: ModelClient | Providers,
        registry: ToolRegistry,
        settings: WorkerSettings,
        *,
        tracer_provider: TracerProvider | None = None,  # agentrun.worker.tracing.setup_tracing
    ) -> None:
        """``client``: the clients by provider, or one client for every run (its provider
        whatever it is: an in-process worker's, a test's)."""
        check_settings(settings)
        # The store owns the lease TTL (the claim's, every fenced write's and renewal's); a
        # store opened with another (an in-process worker's, a test's) is viewed with this one.
        self.store = store.with_lease_ttl(settings.lease_ttl)
        self.settings = settings
        self.metrics = WorkerMetrics()
        self.metrics.watch_appends(self.store.append_stats)
        self.health = Health(
            settings.liveness_threshold,
            self.metrics,
            progress_budget=settings.progress_budget,
            held_runs_idle=self._held_runs_idle,
        )
        self.health.drain = self.drain_and_wait
        self.executor = RunExecutor(
            self.store,  # the view: every fenced write renews by this worker's TTL
            client if isinstance(client, Providers) else Providers(factories={}, default=client),
            registry,
            self.metrics,
            self.health,
            settings.retry,
            is_draining=lambda: self.draining,
            tool_timeout=settings.tool_timeout,
            prices=settings.prices,
            tracing=RunTracer(tracer_provider, pool=settings.pool, worker=settings.worker_id,
                              not_failures=NOT_FAILURES),
        )
        self.active: dict[UUID, RunHandle] = {}
        self.draining = False
        self._wake = asyncio.Event()
        self._signals = 0
        self._drained = asyncio.Event()
        self._signalled = asyncio.Event()
        self._drain_requested_over_http = False
        self._listening = asyncio.Event()
        #: LISTEN is in place now (False while the listener reconnects): the claim loop may
        #: sleep up to the idle interval rather than the poll interval.
        self._listener_up = False
        #: The recheck of the held runs once LISTEN is back after a lost connection (a task kept
        #: here so that it is not collected while it runs).
        self._recheck: asyncio.Task[None] | None = None
        #: While a claim is in flight: what was heard of runs this worker does not hold yet (a
        #: run the claim takes may be cancelled before its answer is back); None otherwise.
        self._heard_while_claiming: dict[UUID, dict[str, object]] | None = None
        self._heart: asyncio.Task[None] | None = None
        #: _end_lease's tasks, kept until done (the loop holds tasks only weakly).
        self._ending: set[asyncio.Task[None]] = set()
        self._draining = asyncio.Event()
        self.health_port: int | None = None
        self.control_port: int | None = None
        #: Why a side task the worker cannot do without died (it then drains and stops).
        self._side_failure: str | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    async def serve(self) -> None:
        s = self.settings
        log.info(
            "worker %s: pool %s, concurrency %d, lease TTL %.0fs",
            s.worker_id,
            s.pool,
            s.concurrency,
            s.lease_ttl,
        )
        # The health and control servers start beside the way to the first claim (issue 17:
        # start-up). The worker is ready once they serve and it listens; a port taken since
        # `agentrun worker` checked it drains the worker and exits 2 (ConfigError).
        starting = asyncio.create_task(self._start_servers(), name="servers")
        runners: list[web.AppRunner] = []
        listener: asyncio.Task[None] | None = None
        try:
            await self._until_schema(starting)
            await self._register_tools()
            listener = watch(asyncio.create_task(self._listen(), name="listener"),
                             self._listener_died, forever=True)
            await self._until_listening()
            self._start_heartbeat()
            claiming = asyncio.create_task(self._claim_loop(), name="claims")
            try:
                runners = await starting
            except BaseException:
                self.request_drain()
                await claiming
                await self._drain()
                raise
            self.health.ready = True
            await claiming
            await self._drain()
            log.info("drained: no run held")
            self._drained.set()
            if self._side_failure is not None:
                raise SideTaskFailed(
                    f"the worker stopped: its {self._side_failure}; every run was handed back"
                )
            if self._drain_requested_over_http:
                # The preStop hook drained us; Kubernetes sends SIGTERM once it returns. Exiting
                # before that would look like a crash and restart the container.
                await self._signalled.wait()
        finally:
            # Every step of the shutdown is bounded: once the runs are released nothing may keep
            # the process from exiting (an intermittent hang after release was seen once, and
            # not reproduced since; kill -USR1 dumps the stacks if it ever recurs).
            if not starting.done():  # a drain (or a failure) before the servers came up
                starting.cancel()
            with contextlib.suppress(BaseException):
                runners = runners or await starting
            for side in (listener, self._heart):
                if side is not None:
                    side.cancel()
                    await asyncio.wait({side}, timeout=5)
            for runner in runners:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(runner.cleanup(), 5)
        log.info("worker %s stopped", s.worker_id)

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        self._signals += 1
        self._signalled.set()
        if self._signals > 1:
            log.warning("second %s: exiting at once", sig.name)
            os._exit(1)
        log.info("%s: draining %d run(s)", sig.name, len(self.active))
        self.request_drain()

    async def _register_tools(self) -> None:
        """Tell the store which tools this pool's workers serve, so the operator can check an
        Agent's tools when its AgentRun is applied. Advisory: a failure is a warning, and the
        run's own check at its claim stays."""
        s = self.settings
        try:
            await self.store.register_toolset(s.pool, s.worker_id, self.executor.registry.names())
        except (psycopg.Error, OSError, PoolTimeout) as exc:
            log.warning("could not register this worker's tools: %s", " ".join(str(exc).split()))

    async def _until_schema(self, servers: asyncio.Task[list[web.AppRunner]] | None = None
                            ) -> None:
        """Return once the database schema is at the version this worker needs; until then, not
        ready but alive; on a schema newer than it knows, warn and go on. A drain
        ends the wait.

        On a fresh install the worker pods may start before the operator has migrated (or before
        anyone ran `agentrun migrate`). Exiting then made the kubelet restart them (issue 19);
        waiting costs nothing, and readiness says why the pod is not serving. The wait has no
        bound: a worker is useless without its schema, restarting it would not bring the schema
        any sooner, and a pod that stays unready is what Kubernetes shows and alerts on. A
        worker does not migrate by itself: the schema is the operator's (or the person's who
        runs `agentrun migrate`), and a worker's database role need not own the tables.

        A schema newer than the worker knows (an old image after an upgrade migrated, during the
        rollout or after a rollback of the image only) is said once as a warning and the worker
        works on, as it did before issue 19: a release's migrations are written so the previous
        release keeps working through its rollout. Exiting instead would crash-loop every worker
        of a rolled-back image and stop all runs, the worst answer to a rollback.

        ``servers``: the health server's start, awaited before the worker says it waits, so that
        a waiting worker is seen alive (its /healthz) and not ready."""
        s = self.settings
        need = latest_version()
        waiting = Reminder()
        failures = checks = 0

        async def attempt() -> bool | Again:
            nonlocal failures, checks
            try:
                async with self.store.pool.connection() as conn:
                    have = await schema_version(conn)
            except DB_ERRORS as exc:
                # No liveness stamp: a database that stays away is an outage (invariant 8).
                failures += 1
                delay = backoff(failures, 0.5, 4)
                log.warning(
                    "schema check failed (%s); database unreachable? retry in %.1fs",
                    " ".join(str(exc).split())[:200],
                    delay,
                )
                return Again(delay)
            failures = 0
            self.health.progress()  # waiting for the schema is not being wedged
            if have == need:
                self.health.waiting_for = None
                if waiting.said_at is not None:
                    log.info("database schema at version %d: no longer waiting", have)
                return True
            if have > need:
                log.warning(
                    "the database schema is at version %d, newer than this worker knows "
                    "(%d); working on, but upgrade the worker to the "
                    "agentrun release that migrated it",
                    have,
                    need,
                )
                self.health.waiting_for = None
                return True
            self.health.waiting_for = (
                f"database schema version {need} (it is at {have}): run `agentrun migrate`, "
                "or let the operator migrate it"
            )
            if servers is not None:
                await asyncio.shield(servers)
            if waiting.due():
                log.warning(
                    "waiting for the database schema: it is at version %d, this worker "
                    "needs version %d; run `agentrun migrate` (the operator does at "
                    "start-up unless --no-migrate). Not ready until then",
                    have,
                    need,
                )
            # Quick at first (the operator usually migrates within seconds of the install),
            # then every few seconds.
            checks += 1
            return Again(min(backoff(checks, 0.25, checks), s.liveness_threshold / 4))

        await until_done(attempt, self._draining)

    async def _until_listening(self) -> None:
        """Ready, and the first claim, only once LISTEN is open: a run created from then on
        wakes the loop, one created before is found by that first claim. (Ready before it, a run
        created in between waited a whole poll interval.) A drain ends the wait."""
        if self._listening.is_set():
            return
        waits = {
            asyncio.create_task(self._listening.wait()),
            asyncio.create_task(self._draining.wait()),
        }
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in waits:
                t.cancel()

    def request_drain(self) -> None:
        self.draining = True
        self._draining.set()
        self.health.draining = True
        self._wake.set()
        for h in self.active.values():
            if h.in_model_call:
                h.abort("drain")

    async def drain_and_wait(self) -> int:
        """/drain (the pod's preStop hook): drain, and return once no run is held.

        A SIGTERM that follows is then the first signal, not the "second signal exits at once".
        """
        held = len(self.active)
        if not self.draining:
            log.info("drain requested over HTTP: releasing %d run(s)", held)
            self._drain_requested_over_http = True
            self.request_drain()
        await self._drained.wait()
        return held

    async def _drain(self) -> None:
        tasks = [h.task for h in self.active.values() if h.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self.settings.drain_grace)
            if pending:
                log.warning("drain grace over: aborting %d run(s)", len(pending))
                for h in list(self.active.values()):
                    h.abort("drain")
                await asyncio.wait(pending, timeout=5)

    async def _start_servers(self) -> list[web.AppRunner]:
        s = self.settings
        runners: list[web.AppRunner] = []
        if s.health_port is None and s.control_port is None:
            return runners
        # aiohttp costs about 0.2 s to import: in a thread, beside the first claim (serve), in
        # turn with the SDK's import thread (which imports aiohttp too).
        await asyncio.to_thread(import_in_turn, "aiohttp.web")
        try:
            if s.health_port is not None:
                runner, self.health_port = await self._serve(
                    make_app(self.health), s.health_host, s.health_port,
                    "--health-port", "AGENTRUN_HEALTH_PORT",
                )
                runners.append(runner)
                log.info("health and metrics on :%s", self.health_port)
            if s.control_port is not None:
                runner, self.control_port = await self._serve(
                    make_control_app(self.health), CONTROL_HOST, s.control_port,
                    "--control-port", "AGENTRUN_CONTROL_PORT",
                )
                runners.append(runner)
                log.info("drain endpoint on %s:%s", CONTROL_HOST, self.control_port)
        except BaseException:
            for r in runners:
                await r.cleanup()
            raise
        return runners

    async def _serve(
        self, app: web.Application, host: str, port: int, option: str, env: str
    ) -> tuple[web.AppRunner, int]:
        from aiohttp import web

        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as exc:
            # `agentrun worker` checked the port at start-up; this is it being taken since (or a
            # Worker built in-process). One line and exit 2, not a traceback; nothing was
            # claimed yet.
            await runner.cleanup()
            reason = os.strerror(exc.errno).lower() if exc.errno else str(exc)
            raise ConfigError(
                f"{option} {port} ({env}): cannot listen on {host} "
                f"({reason}); free it or choose another port (-1 turns it off)"
            ) from None
        bound = port
        server = site._server
        if server is not None and getattr(server, "sockets", None):
            bound = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        return runner, bound

    # -- claiming ------------------------------------------------------------------------------

    async def _claim_loop(self) -> None:
        s = self.settings
        failures = 0
        while not self.draining:
            # Clear before claiming, never after: a wake-up (SIGTERM, a NOTIFY, a finished run)
            # that lands while the claim query runs must not be erased. Clearing after the claim
            # once left a draining worker asleep for a whole poll interval.
            self._wake.clear()
            # Listening, a new run or a finished one wakes the loop, so it sleeps long; not
            # listening (reconnecting), it polls: no notification would come.
            wait = s.idle_interval if self._listener_up else s.poll_interval
            free = s.concurrency - len(self.active)
            resting = True  # a sleep by choice; not the backoff after a failed claim
            if free > 0:
                self._heard_while_claiming = {}
                try:
                    result = await self.store.claim(s.pool, s.worker_id, free)
                    # Another worker's lease that runs out is no notification: wake for it, so a
                    # dead worker's run resumes within moments of its TTL (the claim said when,
                    # in the same statement).
                    if result.next_expiry is not None:
                        wait = min(wait, max(result.next_expiry + 0.02, 0.02))
                    failures = 0
                    self.health.progress()
                except DB_ERRORS as exc:
                    failures += 1
                    resting = False
                    wait = min(s.poll_interval, 0.5 * 2 ** min(failures, 4))
                    log.warning(
                        "claim failed (%s); database unreachable? retry in %.1fs",
                        " ".join(str(exc).split())[:200],
                        wait,
                    )
                else:
                    self.metrics.dead_letters.inc(len(result.dead_lettered))
                    for run, lease in result.claimed:
                        self._start_run(RunHandle(run, lease, last_renewed=result.sent,
                                                  lease_ttl=s.lease_ttl))
                    # A cancel that came while the claim's answer was on its way was heard of a
                    # run not held yet: acted on now, not at the next heartbeat (seconds later,
                    # a model call paid for meanwhile). The epoch check drops what was older.
                    # Soon, not at once: after the run's task has started, so that an abort
                    # finds it inside _hold (a task cancelled before its first step would skip
                    # _hold's cleanup and keep its slot).
                    heard = self._heard_while_claiming or {}  # reset by the finally below
                    loop = asyncio.get_running_loop()
                    for run, _ in result.claimed:
                        if run.id in heard:
                            loop.call_soon(self._on_run_changed, heard[run.id])
                    if result.claimed and len(result.claimed) < free:
                        continue  # there may be more right away
                finally:
                    self._heard_while_claiming = None
            if self.draining:
                break
            if resting and len(self.active) < s.concurrency:
                # Counted as progress while it lasts. Not a backoff: stamped after each failed
                # claim, it kept /healthz at 200 through a whole outage (a claim fails within the
                # pool's 30 s, under the 60 s threshold), the seed's nine-hour incident.
                self.health.resting_until(time.monotonic() + wait)
            else:
                # Nor the wait of a full worker, which claims nothing: its runs' renewals and
                # commits say whether it reaches the database. Its rest, stamped when it took
                # its last run, kept /healthz at 200 through an outage (found by a review).
                self.health.resting_until(0.0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=wait)

    def _start_run(self, h: RunHandle) -> None:
        self.metrics.claims.inc()
        self.active[h.run.id] = h
        self.metrics.active_runs.set(len(self.active))
        # _hold handles every end of the run; what escapes it (a failure while giving the run
        # up) is logged, never left unretrieved.
        h.task = watch(asyncio.create_task(self._hold(h), name=f"run-{h.run.id}"),
                       lambda exc: log.error("run task failed: %s", describe(exc),
                                             extra={"run_id": h.run_id}))

    async def _hold(self, h: RunHandle) -> None:
        """Own one run from claim to release: its executor, its heartbeat, its outcome."""
        current_run_id.set(h.run_id)
        # The claim's trace, current in this task until the finally below.
        attempt = self.executor.tracing.attempt(h)
        try:
            try:
                outcome = await self.executor.advance(h)
            except Exception as exc:
                if not isinstance(exc, NOT_FAILURES):
                    attempt.failed(exc)
                raise
            if outcome == "drain":
                await self._release(h)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            if h.abort_reason is None:
                raise
            await self._aborted(h)
        except RunCancelled:
            log.info("run cancelled; stopped")
        except LeaseLost as exc:
            self.metrics.lease_losses.inc()
            log.warning("%s; dropping the run", exc)
            self._end_lease(h)
        except WaitForApproval as wait:
            await self._wait_for_human(h, wait)
        except RunFailed as exc:
            await self._fail(h, str(exc))
        except PermanentModelError as exc:
            await self._fail(h, f"model call failed: {exc}")
        except TransientExhausted as exc:
            log.warning("%s; giving the claim up", exc)
            await self._quietly(self.store.abandon(h.lease, str(exc)))
        except DB_ERRORS as exc:
            # The lease runs out by itself and another worker (or this one) resumes the run.
            log.warning(
                "database error: %s; the run will be resumed after its lease",
                " ".join(str(exc).split())[:200],
            )
        except Exception as exc:
            log.exception("unexpected error; giving the claim up")
            await self._quietly(self.store.abandon(h.lease, f"{type(exc).__name__}: {exc}"))
        finally:
            self.active.pop(h.run.id, None)
            self.metrics.active_runs.set(len(self.active))
            self._wake.set()
            attempt.end(h.abort_reason)

    async def _aborted(self, h: RunHandle) -> None:
        if h.abort_reason == "drain":
            await self._release(h)
        elif h.abort_reason == "stalled":
            log.info("stalled run's task stopped")  # the heartbeat abandoned it already
        elif h.abort_reason == "cancelled":
            log.info("run cancelled; in-flight work aborted")
        else:
            self.metrics.lease_losses.inc()
            log.warning("lease lost; in-flight work aborted")

    def _end_lease(self, h: RunHandle) -> None:
        """A run let go for a lease lost, maybe by this worker's clock alone: its lease, if the
        database still has it ours, ends now (queries.sql expire_lease), and the claim loop is
        woken to take it again. Beside the run's task, which ends at once: awaited there, it
        held the run's slot for as long as the database did not answer."""

        async def end() -> None:
            try:
                async with asyncio.timeout(self.settings.lease_ttl):
                    if await self._quietly(self.store.expire_lease(h.lease)):
                        self._wake.set()
            except TimeoutError:
                log.warning("could not end the lease in time; it runs out by itself")

        task = watch(asyncio.create_task(end(), name=f"lease-end-{h.run.id}"),
                     lambda exc: log.warning("could not end the lease: %s", describe(exc)))
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)

    async def _release(self, h: RunHandle) -> None:
        if await self._quietly(self.store.release(h.lease)):
            log.info("released for another worker")

    async def _wait_for_human(self, h: RunHandle, wait: WaitForApproval) -> None:
        try:
            await self.store.wait_for_approval(h.lease, wait.reason, wait.pending_call)
        except RollbackRequested:
            # Asked for while the turn's calls ran (or while this worker was not listening):
            # parked, the rollback waited for a decision on a call it would never make.
            log.warning("a rollback was requested: rolling back, not waiting for a human")
            await self._fail(h, None)
        except _NOT_WORTH_THE_RUN as exc:
            log.warning("could not update the run: %s", exc)
        else:
            log.warning("waiting for a human: %s", wait.reason)

    async def _fail(self, h: RunHandle, error: str | None) -> None:
        """Roll the run back and end it: failed with ``error``, or as its requested rollback
        said (None)."""
        try:
            await self.executor.abort(h, error)
        except LeaseLost as exc:
            log.warning("%s; not marking it failed", exc)
        except DB_ERRORS as exc:  # the rollback reason is pinned: the next claim goes on with it
            log.warning("database error while aborting: %s", " ".join(str(exc).split())[:200])

    async def _quietly(self, update: Awaitable[object]) -> bool:
        """Run a store update whose failure must not take the run's task down."""
        try:
            return bool(await update)
        except _NOT_WORTH_THE_RUN as exc:
            log.warning("could not update the run: %s", exc)
            return False

    # -- side tasks ----------------------------------------------------------------------------

    def _held_runs_idle(self) -> list[float]:
        now = time.monotonic()
        return [h.progress.idle_for(now) for h in self.active.values()]

    def _start_heartbeat(self) -> None:
        self._heart = watch(asyncio.create_task(self._heartbeat(), name="heartbeat"),
                            self._heartbeat_died, forever=True)

    async def _heartbeat(self) -> None:
        """Every third of the TTL, renew the held runs that need it in one statement (see
        :meth:`_beat`); a second later after a failed renewal. Runs until cancelled. A third of
        the liveness threshold if that is shorter: a full worker claims nothing, so its
        renewals are what shows /healthz that it reaches the database."""
        interval = min(self.settings.lease_ttl, self.settings.liveness_threshold) / 3
        while True:
            delay = interval if await self._beat(interval) else 1.0
            await asyncio.sleep(delay)

    async def _beat(self, interval: float) -> bool:
        """One heartbeat: renew, in ONE fenced statement, every held run that no commit renewed
        within half an ``interval`` (so each is renewed before its lease is half gone: the next
        beat is one interval away) and that makes progress; let a stalled one go; abort one the
        renewal finds no longer ours (claimed again after its lease ran out, or cancelled), the
        others going on. False when the renewal failed (the caller retries sooner)."""
        s = self.settings
        now = time.monotonic()
        due: list[RunHandle] = []
        for h in list(self.active.values()):
            if h.abort_reason is not None or now - h.last_renewed < interval / 2:
                continue  # being stopped, or a commit renewed it lately
            # A lease is renewed for a run that moves, not for a process that breathes: a run
            # whose task is wedged (a connection that died without a RST) must not be held.
            stalled = h.progress.stalled(s.progress_budget, h.task)
            if stalled is not None:
                with about(h):
                    await self._let_go(h, stalled)
            else:
                due.append(h)
        if not due:
            return True
        sent = time.monotonic()
        try:
            # A renewal slower than the TTL is worthless (the leases ran out meanwhile), and on
            # a silently dead connection it would never return.
            async with asyncio.timeout(s.lease_ttl):
                lost = await self.store.renew_all([h.lease for h in due])
        except TimeoutError:
            log.warning("lease renewal got no answer within %gs (runs %s)", s.lease_ttl,
                        run_ids(due))
            return False
        except DB_ERRORS as exc:
            log.warning("lease renewal failed: %s (runs %s)", " ".join(str(exc).split())[:200],
                        run_ids(due))
            return False
        for h in due:
            why = lost.get(h.run.id)
            if why is None:
                # The database's expiry is counted from after this; a commit may have renewed
                # it later meanwhile.
                h.last_renewed = max(h.last_renewed, sent)
            elif self.active.get(h.run.id) is h:  # not a run that ended meanwhile
                h.abort("cancelled" if isinstance(why, RunCancelled) else "lease lost")
        self.health.progress()
        return True

    def _heartbeat_died(self, exc: BaseException) -> None:
        """A heartbeat that failed unexpectedly renews no more: each held run is let go at once,
        as if its lease were lost (it runs out, and the run resumes on the next claim), rather
        than run on towards a lease that lapses under it. A new heartbeat renews the runs
        claimed from then on."""
        for h in list(self.active.values()):
            log.error("heartbeat failed (%s); letting the run go as if its lease were lost",
                      describe(exc), extra={"run_id": h.run_id})
            h.abort("lease lost")
        if not self.draining:
            self._start_heartbeat()

    def _listener_died(self, exc: BaseException) -> None:
        """The listener reconnects by itself after any error; one that dies all the same
        leaves a worker deaf to cancels and new runs: it drains and stops (non-zero exit)."""
        log.error("listener failed (%s); stopping the worker: it would hear of no cancel and "
                  "no new run", describe(exc))
        self._side_failure = f"listener failed ({describe(exc)})"
        self.request_drain()

    async def _let_go(self, h: RunHandle, why: str) -> None:
        """A stalled run is not held: no more renewals; abandon it (the attempt stays spent, so a
        run that wedges every time reaches the dead letter) with an error saying why, then stop
        its task. Abandoned first: a task stuck on a dead connection may take seconds to stop."""
        self.metrics.runs_stalled.inc()
        log.error("%s; abandoning the run (its lease is no longer renewed)", why)
        error = f"stalled on worker {self.settings.worker_id}: {why}"
        try:
            async with asyncio.timeout(self.settings.lease_ttl):
                await self._quietly(self.store.abandon(h.lease, error))
        except TimeoutError:
            log.warning("could not record the stall in time; the lease runs out by itself")
        h.abort("stalled")

    def _on_listening(self) -> None:
        if not self._listening.is_set():
            log.info("listening for notifications")
        elif self.active:
            # LISTEN is back after a lost connection: what changed meanwhile on a held run (a
            # cancel, a rollback asked for) was notified to nobody. Read once now that nothing
            # more can be missed; read before the LISTEN, a change between the two was lost.
            self._recheck = asyncio.get_running_loop().create_task(self._recheck_held_runs())
        self._listening.set()
        self._listener_up = True
        self._wake.set()  # claim once now: a run may have become claimable while not listening

    async def _listen(self) -> None:
        backoff = 0.5
        while True:
            try:
                listening = self.store.listen(
                    [CHANNEL_RUN_CHANGED, CHANNEL_RUN_READY], on_listening=self._on_listening
                )
                reconnected = True
                async for n in listening:
                    if reconnected:
                        reconnected, backoff = False, 0.5
                    if n.channel == CHANNEL_RUN_READY:
                        if n.payload == self.settings.pool:
                            self._wake.set()
                        continue
                    self._on_run_changed(n.json())
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning(
                    "listener lost its connection (%s); reconnecting in %.1fs",
                    " ".join(str(exc).split())[:120],
                    backoff,
                )
            # Deaf until LISTEN is back: the claim loop polls meanwhile (claiming once now).
            self._listener_up = False
            self._wake.set()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 10)

    def _on_run_changed(self, event: dict[str, object]) -> None:
        """A held run's row changed (payload: migration 0002's agentrun_notify_run_v2).

        The epoch says which claim the notification is about; only the claim bumps it, so it
        orders them. A newer one: another worker claimed the run (its lease lapsed), abort. An
        older one was sent before this claim and heard after it (the run's insert notification
        commonly is): it tells nothing about this hold, whatever its status or rollback flag
        says, and is ignored. Aborting on it dropped a run just claimed without releasing it, so
        the run stalled for the whole lease and spent an attempt (issue 19). Only a notification
        about this very claim can cancel the run or ask it to roll back."""
        rid = UUID(str(event["id"]))
        h = self.active.get(rid)
        if h is None:
            if self._heard_while_claiming is not None:
                self._heard_while_claiming[rid] = event  # the last word on it counts
            return
        epoch = event.get("epoch")
        if not isinstance(epoch, int) or isinstance(epoch, bool):
            log.warning("notification without an epoch ignored: %s", event,
                        extra={"run_id": str(rid)})
            return
        if epoch < h.lease.epoch:
            log.debug("stale notification ignored: epoch %d is before this claim's %d (%s)",
                      epoch, h.lease.epoch, event.get("status"), extra={"run_id": str(rid)})
        elif epoch > h.lease.epoch:
            h.abort("lease lost")
        elif event.get("status") == "cancelled":
            h.abort("cancelled")
        elif event.get("rollback"):
            h.rollback_requested = True

    async def _recheck_held_runs(self) -> None:
        if not self.active:
            return
        with contextlib.suppress(*DB_ERRORS):
            statuses = await self.store.run_statuses(list(self.active))
            for rid, (status, epoch, rollback) in statuses.items():
                self._on_run_changed(
                    {"id": rid, "status": status, "epoch": epoch, "rollback": rollback})


async def exit_past_lingering_threads(code: int) -> None:
    """Exit now if threads would keep the process alive after the worker stopped.

    Tools run in daemon threads, but a tool may start threads of its own, or an async tool may
    use asyncio.to_thread (the event loop's default executor, whose threads asyncio.run joins
    before returning, without a timeout). A call stuck in one of those must not keep a drained
    worker alive past Kubernetes' grace period and into a SIGKILL: every run was released
    already, so nothing is lost by leaving them behind. Idle executor threads are shut down
    first (quickly), so only stuck threads count.
    """
    loop = asyncio.get_running_loop()
    shutdown = asyncio.ensure_future(loop.shutdown_default_executor())
    # Shielded: cancelling it would join the stuck thread and block the loop.
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(shutdown), 2)
    stuck = [
        t.name
        for t in threading.enumerate()
        if t is not threading.main_thread() and t.is_alive() and not t.daemon
    ]
    if not stuck:
        return
    log.warning("exiting past %d thread(s) still running: %s", len(stuck), ", ".join(stuck))
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
