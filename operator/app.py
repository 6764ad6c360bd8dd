"""The operator's background machinery, started by kopf's startup handler.

One connection pool and ONE listener connection for the whole cluster (not one per object):

* connect to PostgreSQL, retrying with backoff, and run the migrations (advisory-locked, so
  several replicas or a worker starting at the same time are safe) unless told not to;
* listen: ``agentrun_run_changed`` marks runs dirty for the status mirror and, for finished runs,
  feeds the steps/attempts histograms; ``agentrun_run_ready`` pokes the pool's autoscaler;
* the status mirror's flush loop, the autoscaler's notified checks, and ONE tick loop: every
  ``tick`` (the shorter of ``scale_interval`` and ``resync_interval``) one probe query reads
  every pool's depth (the autoscaler's timer check, the oldest-pending gauges) and a fingerprint
  of the live runs and quotas; the full resync reads the runs only when the fingerprint moved,
  and the agentrun_runs recount runs only after a change (or every ``metrics_interval``). An
  idle operator sends one query per tick (6 a minute by default; issue 17).

A database outage is seen by whichever loop fails first: the operator logs it once, sets the
``DatabaseAvailable=False`` condition on every unfinished AgentRun, keeps retrying with backoff,
and when a query succeeds again clears the condition and resyncs everything (notifications sent
during the outage were lost). No restart needed.

Readiness (``/readyz`` on the health port, :mod:`agentrun.operator.health`): a loop checks the
API server (a one-object list with the operator's credentials) and the database (``SELECT 1``)
every ``health_interval``; the pod is Ready only while both passed recently. The database check
sends no query while another loop's query answered within a tick + ``db_timeout``: that query
proved the database as well (the tick's probe answers every tick).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import random
import signal
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, TypeVar
from uuid import UUID

import kopf
import psycopg
from aiohttp import web
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError as TransportError

from agentrun.config import redact_message, redact_url
from agentrun.errors import ConfigError, DatabaseUnavailable
from agentrun.logs import unsecret
from agentrun.migrations import latest_version, migrate, schema_version
from agentrun.operator.api import Reason
from agentrun.operator.autoscaler import Autoscaler
from agentrun.operator.health import Readiness, serve
from agentrun.operator.kube import KubeApi
from agentrun.operator.metrics import OperatorMetrics
from agentrun.operator.mirror import StatusMirror, Tracked
from agentrun.operator.settings import OperatorSettings
from agentrun.operator.status import Event, one_line
from agentrun.store import (
    CHANNEL_RUN_CHANGED,
    CHANNEL_RUN_READY,
    DB_ERRORS,
    ConnectOptions,
    Run,
    Store,
    connect,
)
from agentrun.supervise import describe, watch
from agentrun.vocabulary import TERMINAL_STATUSES

log = logging.getLogger(__name__)


#: What a per-object task (an approval's, a TTL's, an annotation's) retries with
#: :func:`backoff`: an outage of the database or the API server, not a refusal. An API server
#: that cannot be reached is urllib3's error (MaxRetryError, ProtocolError), not ApiException:
#: uncaught, it ended the task, and what it was doing waited for the object's next event.
OUTAGES: tuple[type[BaseException], ...] = (*DB_ERRORS, ApiException, TransportError)


def backoff(attempt: int, cap: float = 30.0) -> float:
    """Exponential with full jitter: 0.5, 1, 2, 4 ... up to ``cap`` seconds."""
    return float(random.uniform(0.5, 1.0) * min(cap, 0.5 * 2 ** min(attempt, 10)))


class OperatorApp:
    def __init__(
        self,
        settings: OperatorSettings,
        kube: KubeApi,
        metrics: OperatorMetrics,
    ) -> None:
        self.settings = settings
        self.kube = kube
        self.metrics = metrics
        self.store: Store | None = None
        self.db_up = False
        #: The DatabaseAvailable condition last put on the objects (None: never).
        self._reported: bool | None = None
        self._connected = asyncio.Event()
        self.mirror = StatusMirror(
            kube,
            metrics,
            self._event,
            max_patches_per_second=settings.max_patches_per_second,
            on_gone=self._object_gone,
            namespaces=settings.namespaces,
            unseen_grace=max(settings.resync_interval, 5.0),
        )
        self.autoscaler = Autoscaler(kube, settings.pools, metrics)
        self._tasks: list[asyncio.Task[None]] = []
        self._outage_task: asyncio.Task[None] | None = None
        #: The tick loop's period: its probe is the only query of an idle operator.
        self.tick = min(settings.resync_interval,
                        settings.scale_interval if settings.pools else settings.resync_interval)
        #: The probe's fingerprint when the mirror last resynced (None: resync at the next tick).
        self._fingerprint: tuple[int, int, int] | None = None
        #: Whether agentrun_runs needs a recount (a notification, a moved fingerprint), and when
        #: it was last recounted (monotonic).
        self._recount = True
        self._recounted = 0.0
        #: Pools the agentrun_runs gauge knows (their oldest-pending gauge reads 0 when idle).
        self._pools: set[str] = set()
        #: When a query last answered (monotonic): the database check's proof.
        self._proved = -float("inf")
        self.readiness = Readiness(stale_after=max(2 * settings.health_interval,
                                                   self.tick + settings.health_interval)
                                   + settings.db_timeout)
        self.readiness.database.error = "not connected yet"
        self._health_server: web.AppRunner | None = None
        self._api_down = False

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        s = self.settings
        if s.health_port is not None:
            try:
                self._health_server = await serve(self.readiness, s.health_host, s.health_port)
            except OSError as exc:
                # `agentrun operator` checked the port before kopf started: taken since. One
                # line and exit 2 (PermanentError stops kopf; the CLI finds the ConfigError).
                reason = os.strerror(exc.errno).lower() if exc.errno else str(exc)
                raise kopf.PermanentError(str(exc)) from ConfigError(
                    f"--health-port {s.health_port} (AGENTRUN_HEALTH_PORT): cannot listen on "
                    f"{s.health_host} ({reason}); free it or choose another port (-1 turns it "
                    "off)")
        for coro, name in ((self._main(), "agentrun-operator"),
                           (self._health_loop(), "agentrun-health")):
            task = asyncio.create_task(coro, name=name)
            self._tasks.append(watch(task, functools.partial(self._task_died, name),
                                     forever=True))

    def _task_died(self, name: str, exc: BaseException) -> None:
        """A background task ended though it runs until stop(): the operator would go on with
        no status mirror, autoscaler or readiness. (Its loops restart after an error by design,
        _forever; what ends a task is what they do not retry.) It stops, with a line saying
        why, and the Deployment starts it again; kopf stops on SIGTERM as on a pod's."""
        log.critical("%s task failed (%s); stopping the operator", name, describe(exc))
        os.kill(os.getpid(), signal.SIGTERM)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._health_server is not None:
            await self._health_server.cleanup()
        if self.store is not None:
            await self.store.close()
        self.kube.close()

    async def ready_store(self, within: float = 2.0) -> Store | None:
        """The store once connected (handlers wait a little, then retry later)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._connected.wait(), within)
        return self.store if self.db_up else None

    async def _main(self) -> None:
        store = await self._connect()
        loops: list[tuple[str, Callable[[Store], Awaitable[None]]]] = [
            ("listener", self._listen),
            ("status-flush", self._flush_loop),
            ("tick", self._tick_loop),
            ("autoscaler", self._scale_loop),
        ]
        await asyncio.gather(*(self._forever(name, fn, store) for name, fn in loops))

    async def _connect(self) -> Store:
        s = self.settings
        attempt = 0
        while True:
            try:
                await self._schema()
                store = await Store.open(s.database_url, max_size=8, pool_timeout=s.db_timeout)
                break
            except DB_ERRORS as exc:
                self._failed(exc)
                delay = backoff(attempt)
                attempt += 1
                log.warning("database %s: retrying in %.1fs", redact_url(s.database_url), delay)
                await asyncio.sleep(delay)
        self.store = store
        self._ok()
        # Before any handler may create a run: a run created first could start outside its
        # namespace's quota.
        await self._sync_quotas(store)
        self._connected.set()
        log.info("connected to %s", redact_url(s.database_url))
        return store

    async def _sync_quotas(self, store: Store) -> None:
        """Make the store's quota rows the tenancy file's (the claim enforces them). Without a
        tenancy file the rows are left as they are (set with agentrun's Python API, say)."""
        wanted = self.settings.tenancy.quotas
        if wanted is None:
            return
        attempt = 0
        while True:
            try:
                for namespace, most in sorted(wanted.items()):
                    await store.set_quota(namespace, most)
                for q in await store.quotas():
                    if q.namespace not in wanted:
                        await store.delete_quota(q.namespace)
                break
            except DB_ERRORS as exc:
                self._failed(exc)
                await asyncio.sleep(backoff(attempt))
                attempt += 1
        if wanted:
            log.info("quotas: %s", ", ".join(f"{ns} {n}" for ns, n in sorted(wanted.items())))

    async def _schema(self) -> None:
        """Migrate (advisory-locked: replicas wait their turn) or, told not to, check that
        someone has, saying what to do. On a plain connection: migrations are multi-statement
        scripts, which the pool's prepared statements cannot carry."""
        s = self.settings
        # No statement timeout: a migration may rewrite a big table (it holds an advisory lock).
        options = replace(ConnectOptions.from_env(), connect_timeout=s.db_timeout)
        async with await connect(s.database_url, options=options, statement_timeout=0) as conn:
            if s.migrate:
                result = await migrate(conn)
                if result.applied:
                    log.info("migrated the schema to version %d", result.version)
                return
            have = await schema_version(conn)
        if have < latest_version():
            raise DatabaseUnavailable(
                f"the schema is at version {have}, this operator needs {latest_version()}: run "
                "`agentrun migrate` (or start the operator without --no-migrate)"
            )

    async def _forever(
        self, name: str, fn: Callable[[Store], Awaitable[None]], store: Store
    ) -> None:
        """Run one loop; a database error is an outage (backoff, then again), not a crash."""
        attempt = 0
        while True:
            try:
                await fn(store)
                attempt = 0
            except asyncio.CancelledError:
                raise
            except DB_ERRORS as exc:
                self._failed(exc)
                await asyncio.sleep(backoff(attempt))
                attempt += 1
            except (ApiException, TransportError) as exc:
                # The API server down or refusing: an outage (the readiness check says it once
                # as well), one line at each try, backing off; not a traceback every 30 s.
                log.warning("%s loop: the API server did not answer (%s); retrying", name,
                            describe(exc))
                await asyncio.sleep(backoff(attempt))
                attempt += 1
            except Exception:
                log.exception("%s loop failed; restarting it", name)
                await asyncio.sleep(backoff(attempt))
                attempt += 1

    # -- database health ----------------------------------------------------------------------

    def _failed(self, exc: BaseException) -> None:
        self.metrics.db_up.set(0)
        reason = " ".join(redact_message(str(exc), self.settings.database_url).split())
        self.readiness.database.failed(reason or type(exc).__name__)
        if self.db_up or self._reported is None:
            log.error("database unavailable: %s", reason or type(exc).__name__)
        self.db_up = False
        if self._reported is not False:
            self._reported = False
            self._set_condition(False)

    def _ok(self) -> None:
        self._proved = asyncio.get_running_loop().time()
        self.metrics.db_up.set(1)
        self.readiness.database.ok()
        if self.db_up:
            return
        self.db_up = True
        log.info("database available")
        if self._reported is False:
            self._set_condition(True)
        self._reported = True
        self.autoscaler.poke()

    def _set_condition(self, up: bool) -> None:
        previous = self._outage_task
        if previous is not None and not previous.done():
            previous.cancel()
        self._outage_task = watch(
            asyncio.create_task(self.mirror.set_db_condition(up)),
            lambda exc: log.warning("could not set the DatabaseAvailable condition: %s",
                                    describe(exc)))

    # -- readiness ----------------------------------------------------------------------------

    async def _health_loop(self) -> None:
        """Check the API server and the database every ``health_interval``, for /readyz."""
        while True:
            await asyncio.gather(self._check_api(), self._check_db())
            await asyncio.sleep(self.settings.health_interval)

    async def _check_api(self) -> None:
        check, timeout = self.readiness.api, self.settings.db_timeout
        try:
            # The request has its own timeout; this one also covers waiting for a free slot
            # among the client's concurrent calls (all of them stuck is not Ready either).
            await asyncio.wait_for(self.kube.probe(self.settings.namespaces, timeout), timeout + 1)
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            check.failed(f"no answer within {timeout:g}s")
        except ApiException as exc:
            check.failed(f"{exc.status} {exc.reason}")
        except Exception as exc:
            check.failed(_one_line_error(exc))
        else:
            check.ok()
            if self._api_down:
                self._api_down = False
                log.info("API server check passed again")
            return
        if not self._api_down:  # said once per outage
            self._api_down = True
            log.warning("API server check failed (the operator is not ready): %s", check.error)

    async def _check_db(self) -> None:
        store, timeout = self.store, self.settings.db_timeout
        if store is None:
            return  # connecting: _connect's attempts report into the check
        if self.db_up and (asyncio.get_running_loop().time() - self._proved
                           < self.tick + timeout):
            # Another loop's query answered since (the tick's probe does every tick): it proved
            # the database, and _ok() told readiness. A hung database stops those answers, and
            # then this check queries (and times out) on its own.
            return
        try:
            await asyncio.wait_for(store.ping(), timeout)
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            # Only readiness: a slow answer is not proof of an outage for the runs' conditions.
            self.readiness.database.failed(f"no answer within {timeout:g}s")
        except DB_ERRORS as exc:
            self._failed(exc)
        else:
            self._ok()

    # -- loops --------------------------------------------------------------------------------

    async def _listen(self, store: Store) -> None:
        # Reconnecting means notifications may have been lost: resync at once.
        await self.mirror.resync(store)
        self._ok()
        async for n in store.listen((CHANNEL_RUN_CHANGED, CHANNEL_RUN_READY)):
            self.metrics.notifications.inc()
            self._recount = True  # a status changed (or a run came): agentrun_runs is behind
            if n.channel == CHANNEL_RUN_READY:
                self.autoscaler.poke(n.payload)
                continue
            event = n.json()
            self.mirror.notify(UUID(event["id"]))
            if event.get("status") in TERMINAL_STATUSES:
                pool = str(event.get("pool"))
                self.metrics.run_steps.labels(pool).observe(int(event.get("step") or 0))
                self.metrics.run_attempts.labels(pool).observe(int(event.get("attempt") or 0))
                self.metrics.run_cost.labels(pool).observe(float(event.get("cost_usd") or 0))
                self.autoscaler.poke(pool)  # the scale-down clock starts now
        raise psycopg.OperationalError("the notification connection closed")

    async def _flush_loop(self, store: Store) -> None:
        while True:
            await self.mirror.wait(self.settings.flush_interval)
            try:
                read = await self.mirror.flush(store)
            except BaseException:
                # What the failed flush held is no longer queued: the next tick resyncs all,
                # whatever its fingerprint says.
                self._fingerprint = None
                raise
            if read:  # only a query that answered says the db is up
                self._ok()

    async def _tick_loop(self, store: Store) -> None:
        while True:
            await self.tick_once(store)
            await asyncio.sleep(self.tick)

    async def tick_once(self, store: Store) -> None:
        """One tick: the probe (one query), then only what it found changed."""
        probe = await store.operator_probe()
        self._ok()
        self.metrics.ticks.inc()
        if probe.fingerprint != self._fingerprint or self.mirror.waiting():
            # Set before the read: a change between probe and read moves the next probe.
            self._fingerprint = probe.fingerprint
            await self.mirror.resync(store)
            self.metrics.resyncs.inc()
            self._recount = True
        if self.autoscaler.scalers:
            await self.autoscaler.check(store, tick=True, depths=probe.depths)
        now = asyncio.get_running_loop().time()
        if self._recount or now - self._recounted >= self.settings.metrics_interval:
            self._recount, self._recounted = False, now
            counts = await store.runs_by_status()
            self.metrics.runs.clear()
            for (pool, status), n in counts.items():
                self.metrics.runs.labels(pool, status).set(n)
            self._pools = {pool for pool, _ in counts}
        # The probe lists only pools with live runs: a pool whose last pending run went must
        # read 0, not keep its old age (which would fire the "oldest pending" alert).
        self._pools |= set(probe.depths)
        self.metrics.observe_depths({pool: probe.depths.get(pool) for pool in self._pools})

    async def _scale_loop(self, store: Store) -> None:
        """The notified checks (the timer's are the tick's)."""
        if not self.autoscaler.scalers:
            await asyncio.Event().wait()  # nothing to scale
        while True:
            if await self.autoscaler.wait(self.settings.scale_interval) and \
                    await self.autoscaler.check(store, tick=False):
                self._ok()

    # -- objects that vanished ------------------------------------------------------------------

    async def cancel_for_deleted(
        self, store: Store, namespace: str, name: str, uid: str, run: Run | None = None
    ) -> None:
        """The AgentRun ``uid`` is gone: its run, if still live, is cancelled (its history
        stays in the store). Called on the watch's DELETED event, and by the mirror for an
        object that vanished while the operator was away."""
        if run is None:
            run = await store.get_run_by_k8s_uid(uid)
        if run is None or run.finished:
            return
        now, changed = await store.cancel(run.id, f"AgentRun {namespace}/{name} deleted")
        if changed:
            log.info("AgentRun %s/%s deleted: run cancelled; its history stays in the store",
                     namespace, name, extra={"run_id": str(run.id)})
        elif now.rolling_back:
            log.warning("AgentRun %s/%s deleted while its run rolls back: the rollback runs to "
                        "its end", namespace, name, extra={"run_id": str(run.id)})

    async def _object_gone(self, t: Tracked, run: Run | None) -> None:
        if self.store is not None:
            await self.cancel_for_deleted(self.store, t.namespace, t.name, t.uid, run)

    # -- events -------------------------------------------------------------------------------

    async def _event(self, t: Tracked, e: Event) -> None:
        if e.reason == Reason.DEAD_LETTERED and t.run_id is not None:
            note = await self._why_workers_died(t.run_id)
            if note:
                e = Event(e.type, e.reason, one_line(e.message + note, 1000))
        await self.event(t.body(), e, run_id=t.run_id)

    async def _why_workers_died(self, run_id: UUID) -> str:
        """For a dead-lettered run: did the pod of the worker that held it last end OOMKilled?
        Then say so on the run (its error, so status and `agentrun get` show it) and in the
        Event: the fix is the pool's memory limit, not more attempts."""
        ns, store = self.settings.worker_namespace, self.store
        if not ns or store is None:
            return ""
        try:
            worker = await store.last_writer(run_id)
            if not worker:
                return ""
            pods = await self.kube.list_pods(ns, {})
            # A worker's id is "<pod name>-<pid>-<random>".
            pod = next((p for p in pods if worker.startswith(p.name + "-")), None)
            if pod is None or pod.last_termination != "OOMKilled":
                return ""
            note = (f"; its worker pod {pod.name} was OOMKilled ({pod.restarts} restarts): "
                    f"the run needs more memory than the pool's limit; raise "
                    f"workers.pools[].resources.limits.memory")
            await store.note_dead_letter(run_id, note)
            self.mirror.notify(run_id)
            return note
        except Exception as exc:  # an explanation is a courtesy: never fail the Event for it
            log.warning("could not look up why the run's workers died: %s", exc,
                        extra={"run_id": str(run_id)})
            return ""

    async def event(self, body: dict[str, Any], e: Event, run_id: UUID | str | None) -> None:
        """Post an Event about an AgentRun. The operator's only Event source: kopf's own
        posting of its log lines is off, so one object never gets Events from two sources."""
        meta = body["metadata"]
        # A refusal may quote a database error, which may quote the connection string.
        e = replace(e, message=unsecret(e.message))
        self.metrics.events.labels(e.reason).inc()
        log.log(logging.WARNING if e.type == "Warning" else logging.INFO,
                "AgentRun %s/%s: %s: %s", meta["namespace"], meta["name"], e.reason, e.message,
                extra={"run_id": str(run_id)})
        try:
            await self.kube.post_event(body, e.type, e.reason, e.message)
        except Exception as exc:  # an Event is informative: never worth failing a flush for
            log.warning("AgentRun %s/%s: could not post the %s event: %s",
                        meta["namespace"], meta["name"], e.reason, exc,
                        extra={"run_id": str(run_id)})


def _one_line_error(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


#: Where the running :class:`OperatorApp` is kept in kopf's memo (operator/handlers.py: the
#: startup handler puts it there, and kopf hands the memo to every handler).
APP = "agentrun_app"


_T = TypeVar("_T")


def memo_get(memo: kopf.Memo, key: str, kind: type[_T]) -> _T:
    """What the startup handler kept in kopf's ``memo`` under ``key``, as a ``kind`` (kopf's
    memo holds anything: this is where its values get their type back)."""
    value = memo.get(key)
    if not isinstance(value, kind):  # only before the startup handler ran, which kopf prevents
        raise LookupError(f"kopf's memo has no {kind.__name__} under {key!r}")
    return value
