"""The worker process: claim runs, hold them, drain on SIGTERM.

Before anything else the worker waits for the database schema it needs, alive and not ready
(``_until_schema``): on a fresh install its pods may start before the operator migrates.

Beside the main claim loop run three kinds of side tasks (procrastinate's shape):

* one listener on LISTEN/NOTIFY: a cancel of a held run aborts its task at once (an in-flight
  model call included), a newly claimable run wakes the claim loop; it reconnects by itself. The
  worker is ready, and makes its first claim, only once LISTEN is in place (and claims once more
  after every reconnection), so no run waits a poll interval for want of a notification;
* one heartbeat per held run: renews the lease when no commit did for a third of the TTL, so a
  long model call or tool never lets the lease lapse, but only while the run makes progress
  (worker/liveness.py): a stalled run is abandoned with an error saying why and its task is
  stopped, never held; a renewal that finds the lease gone aborts the run;
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
import math
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass, field
from uuid import UUID

import psycopg
from aiohttp import web
from opentelemetry.trace import TracerProvider
from psycopg_pool import PoolTimeout

from agentrun.config import DEFAULT_MODEL_DEADLINE
from agentrun.errors import ConfigError, DatabaseUnavailable, LeaseLost, RunCancelled
from agentrun.logs import current_run_id
from agentrun.manifests import pool_problem
from agentrun.migrations import latest_version, schema_version
from agentrun.pricing import BUILT_IN, PriceTable
from agentrun.store import CHANNEL_RUN_CHANGED, CHANNEL_RUN_READY, Store, check_connect
from agentrun.tools import DEFAULT_TOOL_TIMEOUT, ToolRegistry
from agentrun.worker.client import ModelClient, Providers
from agentrun.worker.executor import RunExecutor, RunFailed, RunHandle, WaitForApproval
from agentrun.worker.health import Health, WorkerMetrics, make_app, make_control_app
from agentrun.worker.liveness import DEFAULT_PROGRESS_BUDGET
from agentrun.worker.model_call import PermanentModelError, RetryPolicy, TransientExhausted
from agentrun.worker.tracing import RunTracer

log = logging.getLogger("agentrun.worker")

#: Where the control listener (/drain) binds: only the pod itself can reach it.
CONTROL_HOST = "127.0.0.1"

DB_ERRORS = (psycopg.OperationalError, PoolTimeout, OSError)

#: A worker waiting for its schema checks again after 0.5 s, then twice as long each time up to
#: this (and within a quarter of its liveness threshold, which each successful check stamps): a
#: migration is picked up within seconds, at one tiny query per check.
SCHEMA_RECHECK_MAX = 5.0
#: While it waits, the waiting line is said again this often, so that `kubectl logs --since=...`
#: still shows why a pod is not ready.
SCHEMA_WAIT_REMINDER = 600.0

#: Ends of a hold that are no failure of the attempt: its trace's status stays unset.
NOT_FAILURES = (RunCancelled, WaitForApproval)


async def until_database(url: str) -> bool:
    """Return True once the database accepts a connection; False if SIGTERM or SIGINT came
    first. Before the worker opens its pool and serves.

    On a fresh install with the chart's own PostgreSQL the worker pods start with the database;
    exiting at the first refused connection made the kubelet restart them (issue 19). Waiting
    keeps the pod's restart count for real failures. No liveness is served meanwhile: a
    database that stays away past the kubelet's patience is an outage (invariant 8), reported
    by restarts as before. A refused login is configuration and still raises at once."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        failures = 0
        said_at: float | None = None
        while not stop.is_set():
            try:
                await check_connect(url)
            except DatabaseUnavailable as exc:
                failures += 1
                now = time.monotonic()
                if said_at is None or now - said_at >= SCHEMA_WAIT_REMINDER:
                    log.warning("waiting for the database: %s; retrying until it answers", exc)
                    said_at = now
                delay = min(SCHEMA_RECHECK_MAX, 0.25 * 2 ** min(failures, 5))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=delay)
            else:
                if said_at is not None:
                    log.info("the database answers: no longer waiting")
                return True
        log.info("stopped while waiting for the database")
        return False
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


@dataclass
class WorkerSettings:
    pool: str = "default"
    concurrency: int = 4
    # 15 s: a SIGKILLed worker's runs resume 15 s later, while a GC pause, a slow commit or a
    # database fail-over shorter than that costs nothing. Renewals (every 5 s, only when no commit
    # renewed) cost 0.2 queries/s per held run. The seed's 60 s makes every crash cost a minute.
    lease_ttl: float = 15.0
    poll_interval: float = 5.0  # safety net only: NOTIFY wakes the loop for new runs
    drain_grace: float = 25.0  # under Kubernetes' default terminationGracePeriodSeconds of 30
    liveness_threshold: float = 60.0
    progress_budget: float = DEFAULT_PROGRESS_BUDGET  # see worker/liveness.py
    tool_timeout: float = DEFAULT_TOOL_TIMEOUT  # for tools that declare no timeout of their own
    health_host: str = "0.0.0.0"
    health_port: int | None = 8080  # None: no health server; 0: any free port
    # Loopback only, whatever the health host: /drain stops the worker.
    # None (in-process workers, tests): no control listener; `agentrun worker` passes
    # --control-port, default DEFAULT_CONTROL_PORT. 0: any free port.
    control_port: int | None = None
    worker_id: str = field(default_factory=default_worker_id)
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    prices: PriceTable = BUILT_IN  # --prices FILE (agentrun.pricing.load_prices)


def check_settings(s: WorkerSettings) -> None:
    """Refuse settings a worker cannot work with, naming the flag, its variable and the fix.

    Each of these used to start a worker that did harm or nothing: a negative lease TTL
    dead-lettered every run it claimed (each claim expired at once and was claimed again),
    concurrency 0 never claimed, a negative one failed deep in the connection pool."""
    def bad(flag: str, value: object, fix: str) -> ConfigError:
        env = "AGENTRUN_" + flag.removeprefix("--").replace("-", "_").upper()
        return ConfigError(f"{flag} {value} ({env}): {fix}")

    finite = math.isfinite
    if (problem := pool_problem(s.pool)) is not None:
        shown = repr(s.pool) if len(s.pool) <= 80 else f"{s.pool[:40]!r}... ({len(s.pool)} chars)"
        raise bad("--pool", shown, problem)
    if s.concurrency < 1:
        raise bad("--concurrency", s.concurrency, "must be at least 1 (runs held at once)")
    if not (finite(s.lease_ttl) and s.lease_ttl >= 1):
        raise bad("--lease-ttl", s.lease_ttl, "must be at least 1 (seconds; default 15)")
    if not (finite(s.poll_interval) and s.poll_interval > 0):
        raise bad("--poll-interval", s.poll_interval, "must be more than 0 (seconds; default 5)")
    if not (finite(s.drain_grace) and s.drain_grace >= 0):
        raise bad("--drain-grace", s.drain_grace, "must be 0 or more (seconds; default 25)")
    if not (finite(s.liveness_threshold) and s.liveness_threshold > 0):
        raise bad("--liveness-threshold", s.liveness_threshold,
                  "must be more than 0 (seconds; default 60)")
    if s.health_port is not None and not 0 <= s.health_port <= 65535:
        raise bad("--health-port", s.health_port, "choose 1-65535, 0 for any, -1 to turn it off")
    if s.retry.max_retries < 0:
        raise bad("--model-retries", s.retry.max_retries, "must be 0 or more (default 8)")
    if not (finite(s.retry.deadline) and s.retry.deadline > 0):
        raise bad("--model-deadline", s.retry.deadline,
                  f"must be more than 0 (seconds one model call may take; default "
                  f"{DEFAULT_MODEL_DEADLINE:g})")
    if not (finite(s.tool_timeout) and s.tool_timeout > 0):
        raise bad("--tool-timeout", s.tool_timeout,
                  f"must be more than 0 (seconds a tool call may take unless it declares "
                  f"@tool(timeout=...); default {DEFAULT_TOOL_TIMEOUT:g})")
    if not (finite(s.progress_budget) and s.progress_budget > 0):
        raise bad("--progress-budget", s.progress_budget,
                  f"must be more than 0 (seconds; default {DEFAULT_PROGRESS_BUDGET:g})")


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
        self.store = store
        self.settings = settings
        self.metrics = WorkerMetrics()
        self.health = Health(
            settings.liveness_threshold,
            self.metrics,
            progress_budget=settings.progress_budget,
            held_runs_idle=self._held_runs_idle,
        )
        self.health.drain = self.drain_and_wait
        self.executor = RunExecutor(
            store,
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
        self._draining = asyncio.Event()
        self.health_port: int | None = None
        self.control_port: int | None = None

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
        runners = await self._start_servers()
        listener: asyncio.Task[None] | None = None
        try:
            await self._until_schema()
            await self._register_tools()
            listener = asyncio.create_task(self._listen(), name="listener")
            await self._until_listening()
            self.health.ready = True
            await self._claim_loop()
            await self._drain()
            log.info("drained: no run held")
            self._drained.set()
            if self._drain_requested_over_http:
                # The preStop hook drained us; Kubernetes sends SIGTERM once it returns. Exiting
                # before that would look like a crash and restart the container.
                await self._signalled.wait()
        finally:
            # Every step of the shutdown is bounded: once the runs are released nothing may keep
            # the process from exiting (an intermittent hang after release was seen once, and
            # not reproduced since; kill -USR1 dumps the stacks if it ever recurs).
            if listener is not None:
                listener.cancel()
                await asyncio.wait({listener}, timeout=5)
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

    async def _until_schema(self) -> None:
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
        of a rolled-back image and stop all runs, the worst answer to a rollback."""
        s = self.settings
        need = latest_version()
        said_at: float | None = None
        failures = checks = 0
        while not self.draining:
            try:
                async with self.store.pool.connection() as conn:
                    have = await schema_version(conn)
            except DB_ERRORS as exc:
                # No liveness stamp: a database that stays away is an outage (invariant 8).
                failures += 1
                delay = min(SCHEMA_RECHECK_MAX, 0.5 * 2 ** min(failures, 4))
                log.warning(
                    "schema check failed (%s); database unreachable? retry in %.1fs",
                    " ".join(str(exc).split())[:200],
                    delay,
                )
            else:
                failures = 0
                self.health.progress()  # waiting for the schema is not being wedged
                if have == need:
                    self.health.waiting_for = None
                    if said_at is not None:
                        log.info("database schema at version %d: no longer waiting", have)
                    return
                if have > need:
                    log.warning(
                        "the database schema is at version %d, newer than this worker knows "
                        "(%d); working on, but upgrade the worker to the "
                        "agentrun release that migrated it",
                        have,
                        need,
                    )
                    self.health.waiting_for = None
                    return
                self.health.waiting_for = (
                    f"database schema version {need} (it is at {have}): run `agentrun migrate`, "
                    "or let the operator migrate it"
                )
                now = time.monotonic()
                if said_at is None or now - said_at >= SCHEMA_WAIT_REMINDER:
                    log.warning(
                        "waiting for the database schema: it is at version %d, this worker "
                        "needs version %d; run `agentrun migrate` (the operator does at "
                        "start-up unless --no-migrate). Not ready until then",
                        have,
                        need,
                    )
                    said_at = now
                # Quick at first (the operator usually migrates within seconds of the install),
                # then every few seconds.
                checks += 1
                delay = min(SCHEMA_RECHECK_MAX, s.liveness_threshold / 4, 0.25 * 2**checks)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._draining.wait(), timeout=delay)

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
            wait = s.poll_interval
            free = s.concurrency - len(self.active)
            if free > 0:
                try:
                    sent = time.monotonic()  # the leases run from no earlier than this
                    result = await self.store.claim(s.pool, s.worker_id, free, ttl=s.lease_ttl)
                    if not result.claimed:
                        expiry = await self.store.next_lease_expiry(s.pool, s.worker_id)
                        if expiry is not None:
                            wait = min(wait, max(expiry + 0.02, 0.02))
                    failures = 0
                    self.health.progress()
                except DB_ERRORS as exc:
                    failures += 1
                    wait = min(s.poll_interval, 0.5 * 2 ** min(failures, 4))
                    log.warning(
                        "claim failed (%s); database unreachable? retry in %.1fs",
                        " ".join(str(exc).split())[:200],
                        wait,
                    )
                else:
                    self.metrics.dead_letters.inc(len(result.dead_lettered))
                    for run, lease in result.claimed:
                        self._start_run(RunHandle(run, lease, last_renewed=sent,
                                                  lease_ttl=s.lease_ttl))
                    if result.claimed and len(result.claimed) < free:
                        continue  # there may be more right away
            if self.draining:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=wait)

    def _start_run(self, h: RunHandle) -> None:
        self.metrics.claims.inc()
        self.active[h.run.id] = h
        self.metrics.active_runs.set(len(self.active))
        h.task = asyncio.create_task(self._hold(h), name=f"run-{h.run.id}")

    async def _hold(self, h: RunHandle) -> None:
        """Own one run from claim to release: its executor, its heartbeat, its outcome."""
        current_run_id.set(h.run_id)
        # The claim's trace, current in this task (and the heartbeat's) until the finally below.
        attempt = self.executor.tracing.attempt(h)
        heartbeat = asyncio.create_task(self._heartbeat(h), name=f"heartbeat-{h.run.id}")
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
        except WaitForApproval as wait:
            log.warning("waiting for a human: %s", wait.reason)
            await self._quietly(self.store.wait_for_approval(h.lease, wait.reason,
                                                             wait.pending_call))
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
            heartbeat.cancel()
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

    async def _release(self, h: RunHandle) -> None:
        if await self._quietly(self.store.release(h.lease)):
            log.info("released for another worker")

    async def _fail(self, h: RunHandle, error: str) -> None:
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
        except (LeaseLost, *DB_ERRORS) as exc:
            log.warning("could not update the run: %s", exc)
            return False

    # -- side tasks ----------------------------------------------------------------------------

    def _held_runs_idle(self) -> list[float]:
        now = time.monotonic()
        return [h.progress.idle_for(now) for h in self.active.values()]

    async def _heartbeat(self, h: RunHandle) -> None:
        current_run_id.set(h.run_id)
        s = self.settings
        interval = s.lease_ttl / 3
        while True:
            await asyncio.sleep(max(0.05, h.last_renewed + interval - time.monotonic()))
            if time.monotonic() - h.last_renewed < interval:
                continue
            # A lease is renewed for a run that moves, not for a process that breathes: a run
            # whose task is wedged (a connection that died without a RST) must not be held.
            stalled = h.progress.stalled(s.progress_budget, h.task)
            if stalled is not None:
                await self._let_go(h, stalled)
                return
            sent = time.monotonic()
            try:
                # A renewal slower than the TTL is worthless (the lease ran out meanwhile), and
                # on a silently dead connection it would never return.
                async with asyncio.timeout(s.lease_ttl):
                    await self.store.renew(h.lease, ttl=s.lease_ttl)
            except RunCancelled:
                h.abort("cancelled")
                return
            except LeaseLost:
                h.abort("lease lost")
                return
            except TimeoutError:
                log.warning("lease renewal got no answer within %gs", s.lease_ttl)
                continue
            except DB_ERRORS as exc:
                log.warning("lease renewal failed: %s", " ".join(str(exc).split())[:200])
                await asyncio.sleep(1)
                continue
            h.last_renewed = sent  # the database's expiry is counted from after this
            self.health.progress()

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
        self._listening.set()
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
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 10)
            await self._recheck_held_runs()

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
            for rid, (status, epoch) in (await self.store.run_statuses(list(self.active))).items():
                self._on_run_changed({"id": rid, "status": status, "epoch": epoch})


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
