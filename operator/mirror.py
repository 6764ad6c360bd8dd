"""Run progress -> AgentRun ``.status``: driven by notifications, coalesced, rate limited.

No per-object polling (it must stay cheap at 10,000 runs):

* ``agentrun_run_changed`` notifications (status, claim, holder) mark a run dirty; every
  ``flush_interval`` the dirty runs are read in ONE query and the objects whose status changed are
  patched. Ten notifications for one run inside a window cost one read and one patch.
* Step counts and token usage are not notified (a NOTIFY per step halves the store's throughput,
  see docs/store.md), so a resync reads all live runs of AgentRun objects (one query, a partial
  index) and patches only what changed; the operator's tick calls it only when its probe's
  fingerprint of those runs (every id and updated_at) and the quotas moved. It also repairs
  anything a dropped listener connection missed.
* Every patch takes a token from one bucket (``max_patches_per_second``): a burst of 10,000 runs
  finishing together is spread out rather than thrown at the API server. Notified changes go
  before resync changes.
* Every patch is guarded by the object's uid: an AgentRun deleted and re-created under the same
  name is another object with another run, and never shows the old run's status. An object found
  gone (deleted while the operator was away, or replaced) is reported to ``on_gone`` once, which
  cancels its run if it is still live, and is never patched again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from kubernetes.client.exceptions import ApiException

from agentrun.operator.kube import Gone, KubeApi
from agentrun.operator.metrics import OperatorMetrics
from agentrun.operator.status import (
    Cond,
    Event,
    Snapshot,
    db_condition,
    normalised,
    same_status,
    set_condition,
    status_for,
    transitions,
)
from agentrun.store import Quota, Run, Store
from agentrun.supervise import describe, watch
from agentrun.vocabulary import TERMINAL_STATUSES

log = logging.getLogger(__name__)


@dataclass
class Tracked:
    """An AgentRun object the operator knows, and what its status shows."""

    namespace: str
    name: str
    uid: str
    status: dict[str, Any] | None = None
    snapshot: Snapshot | None = None
    #: False for an object first met through the store: its history is unknown, so the first
    #: change seen posts no Event (an operator restart must not repeat "Claimed" for every run).
    known: bool = True
    #: metadata.generation, echoed as status.observedGeneration (None: not seen yet).
    generation: int | None = None

    @property
    def run_id(self) -> UUID | None:
        rid = (self.status or {}).get("runId")
        return UUID(rid) if rid else None

    @property
    def live(self) -> bool:
        return (self.status or {}).get("phase") not in TERMINAL_STATUSES

    def body(self) -> dict[str, Any]:
        """Enough of the object for kopf.event() to reference it."""
        return {
            "apiVersion": "agentrun.dev/v1alpha1",
            "kind": "AgentRun",
            "metadata": {"name": self.name, "namespace": self.namespace, "uid": self.uid},
        }


class TokenBucket:
    def __init__(self, rate: float, burst: float | None = None) -> None:
        self.rate = rate
        self.capacity = burst if burst is not None else max(1.0, rate)
        self.tokens = self.capacity
        self.stamp = time.monotonic()

    async def take(self) -> None:
        while True:
            now = time.monotonic()
            self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            if self.tokens >= 1:
                self.tokens -= 1
                return
            await asyncio.sleep((1 - self.tokens) / self.rate)


#: Statuses a resync found behind, applied after each batch of changes (the rest once the
#: changes stop).
STALE_PER_BATCH = 16


class StatusMirror:
    def __init__(
        self,
        kube: KubeApi,
        metrics: OperatorMetrics,
        post_event: Callable[[Tracked, Event], Awaitable[None]],
        *,
        max_patches_per_second: float,
        on_gone: Callable[[Tracked, Run | None], Awaitable[None]] | None = None,
        namespaces: list[str] | None = None,
        unseen_grace: float = 0.0,
    ) -> None:
        self.kube = kube
        self.metrics = metrics
        self.post_event = post_event
        self.on_gone = on_gone
        #: The watched namespaces (empty: all). Runs of other namespaces belong to another
        #: operator, or to none: never patched, never cancelled from here.
        self.namespaces = frozenset(namespaces or ())
        self.objects: dict[str, Tracked] = {}
        #: uids of objects found deleted or replaced: never tracked again.
        self.gone: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.db_up = True
        #: namespace -> its quota (re-read with every flush that reads runs, and every resync).
        self.quotas: dict[str, Quota] = {}
        self._dirty: set[UUID] = set()
        self._stale: dict[UUID, Run] = {}
        self._wake = asyncio.Event()
        self._bucket = TokenBucket(max_patches_per_second)
        #: A run whose object the watch has not listed yet (an operator just started: its first
        #: resync may come before kopf's listing) waits this long for it, from when the mirror
        #: first met it. Met through the watch, the object comes with its status, from which the
        #: Events of what happened while no operator watched are told (a hand-over, a finish);
        #: met through the store alone it gets none. After the grace the object is handled
        #: anyway (one deleted while the operator was away is never listed: its patch finds it
        #: gone).
        self.unseen_grace = unseen_grace
        self._unseen: dict[str, float] = {}

    # -- what handlers and the listener call ----------------------------------------------------

    def watched(self, namespace: str | None) -> bool:
        return not self.namespaces or namespace in self.namespaces

    def track(
        self,
        namespace: str,
        name: str,
        uid: str,
        status: dict[str, Any] | None,
        generation: int | None = None,
    ) -> None:
        if uid in self.gone:
            return
        self._unseen.pop(uid, None)
        t = self.objects.get(uid)
        if t is None:
            t = Tracked(namespace, name, uid, dict(status or {}), Snapshot.from_status(status),
                        generation=generation)
            self.objects[uid] = t
        else:
            if status and not t.status:
                t.status = dict(status)
            t.generation = generation or t.generation
        if t.run_id is not None:
            self.notify(t.run_id)
        if not self.db_up and t.live:
            # Met during an outage (an operator started while the database is down): say so on
            # the object now; set_db_condition ran before this object was known.
            self._spawn(self._set_db_condition_on(t, db_condition(False)))

    def forget(self, uid: str, gone: bool = False) -> None:
        self.objects.pop(uid, None)
        if gone:
            self.gone.add(uid)

    def _spawn(self, coro: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        # A condition patch is informative: one that fails is said, and the next resync puts
        # the condition right; never an unretrieved exception.
        watch(task, lambda exc: log.warning("could not patch a condition: %s", describe(exc)))

    def notify(self, run_id: UUID) -> None:
        self._dirty.add(run_id)
        self._wake.set()

    def waiting(self) -> bool:
        """Whether a run waits for its object to be listed: the next resync must read it again
        (a tick that saw no change would not)."""
        return bool(self._unseen)

    def pending(self) -> int:
        return len(self._dirty) + len(self._stale)

    # -- the loops ----------------------------------------------------------------------------

    async def wait(self, flush_interval: float) -> None:
        """Until there is something to flush; then one more window to gather more of it."""
        if not self._dirty and not self._stale:
            self._wake.clear()
            await self._wake.wait()
        await asyncio.sleep(flush_interval)

    async def flush(self, store: Store) -> bool:
        """Patch what changed: notified runs first, then what the resync found stale.
        Returns whether the database was read."""
        read = bool(self._dirty)
        if read:
            await self._read_quotas(store)
        while self._dirty:
            ids, self._dirty = self._dirty, set()
            for run in await store.k8s_runs(sorted(ids)):
                self._stale.pop(run.id, None)
                await self.apply(run)
            # Some of a resync's corrections beside each batch of changes: under churn (runs
            # finishing every moment) they waited for a quiet moment that never came, and a
            # pending run of a full namespace never said QuotaExceeded (found by CI).
            await self._apply_stale(STALE_PER_BATCH)
        await self._apply_stale(None)
        return read

    async def _apply_stale(self, limit: int | None) -> None:
        """Apply up to ``limit`` of the statuses a resync found behind (None: as long as no
        change waits)."""
        done = 0
        while self._stale and (not self._dirty if limit is None else done < limit):
            _, run = next(iter(self._stale.items()))
            del self._stale[run.id]
            await self.apply(run)
            done += 1

    async def resync(self, store: Store) -> None:
        """Read every live run of an AgentRun object; queue the ones whose status is behind."""
        await self._read_quotas(store)
        runs = await store.k8s_live_runs()
        seen: set[UUID] = set()
        for run in runs:
            if not self.watched(run.k8s_namespace) or (run.k8s_uid or "") in self.gone:
                continue
            seen.add(run.id)
            t = self.objects.get(run.k8s_uid or "")
            previous = t.status if t else None
            generation = t.generation if t else None
            fresh = status_for(run, db_up=True, previous=previous, generation=generation,
                               quota=self._quota(run))
            if not same_status(previous, fresh):
                self._stale[run.id] = run
        # A live object whose run is no longer live finished while a notification was lost.
        for t in list(self.objects.values()):
            rid = t.run_id
            if rid is not None and t.live and rid not in seen:
                self._dirty.add(rid)
        if self._dirty or self._stale:
            self._wake.set()

    async def _read_quotas(self, store: Store) -> None:
        """The namespaces' quotas (a handful of rows): a pending run of a full namespace says
        so in its status. Not notified: a change shows at the next flush or resync."""
        self.quotas = {q.namespace: q for q in await store.quotas()}

    def _quota(self, run: Run) -> Quota | None:
        return self.quotas.get(run.k8s_namespace or "")

    async def apply(self, run: Run) -> None:
        uid = run.k8s_uid or ""
        if uid in self.gone or not self.watched(run.k8s_namespace):
            return
        t = self.objects.get(uid)
        if t is None:
            if not (run.k8s_namespace and run.k8s_name):
                return
            first = self._unseen.setdefault(uid, time.monotonic())
            if time.monotonic() - first < self.unseen_grace:
                return  # the watch lists it in a moment; the next resync brings it back if not
            self._unseen.pop(uid, None)
            t = Tracked(run.k8s_namespace, run.k8s_name, uid, known=False)
            self.objects[uid] = t
        new = status_for(run, db_up=self.db_up, previous=t.status, generation=t.generation,
                         quota=self._quota(run))
        events = transitions(t.snapshot, run) if t.known else []
        if not same_status(t.status, new):
            if not await self._patch(t, new, run):
                return
            t.status = new
        t.snapshot = Snapshot.of(run)
        t.known = True
        for e in events:
            await self.post_event(t, e)

    async def set_db_condition(self, up: bool) -> None:
        """A database outage (or its end) is a condition on every unfinished object."""
        self.db_up = up
        cond = db_condition(up)
        for t in list(self.objects.values()):
            if not t.live:
                continue
            await self._set_db_condition_on(t, cond)
            if up and t.run_id is not None:
                self._dirty.add(t.run_id)
        self._wake.set()

    async def _set_db_condition_on(self, t: Tracked, cond: Cond) -> None:
        conditions = set_condition((t.status or {}).get("conditions"), cond, t.generation)
        status = normalised({**(t.status or {}), "conditions": conditions})
        if same_status(t.status, status):
            return
        if await self._patch(t, status, None):
            t.status = status

    async def _patch(self, t: Tracked, status: dict[str, Any], run: Run | None) -> bool:
        await self._bucket.take()
        try:
            await self.kube.patch_agentrun_status(t.namespace, t.name, t.uid, status)
        except Gone as exc:
            log.info("%s; no longer mirrored", exc,
                     extra={"run_id": str(run.id if run else t.run_id)})
            self.forget(t.uid)
            if self.on_gone is not None:
                await self.on_gone(t, run)  # a database error here: found gone again later
            self.gone.add(t.uid)
            return False
        except ApiException as exc:
            if exc.status is None or exc.status >= 500 or exc.status == 429:
                raise  # the API server's trouble: the loop backs off
            # One object's refusal (a policy, a quota on status writes) must not hold up the
            # others queued behind it; the next resync finds this status behind again.
            log.warning("AgentRun %s/%s: status not written: %s %s; again at the next resync",
                        t.namespace, t.name, exc.status, exc.reason,
                        extra={"run_id": str(run.id if run else t.run_id)})
            return False
        self.metrics.status_patches.inc()
        return True
