"""Scale each worker pool's Deployment by its pending + running runs.

Event-driven up: a new pending run's ``agentrun_run_ready`` notification pokes the pool's
autoscaler, which reads the pool depth (one indexed query), reads the Deployment and patches its
scale subresource at once, so a pool scaled to zero gets its first worker in well under the 2 s
goal instead of a polling interval (KEDA's default is 30 s). Down only after the pool's
scale-down delay (the decision is :mod:`agentrun.operator.scaling`). A timer re-checks every
``scale_interval`` (the scale-down clock, missed notifications) and keeps the
``controller.kubernetes.io/pod-deletion-cost`` of each worker pod equal to the runs it holds, so
a scale-down removes idle pods first and a busy pod's runs are not handed over for nothing.

Only pools listed in the pools file are touched; a Deployment annotated
``agentrun.dev/autoscale: "false"`` is left alone too (a fixed count written by hand or by Helm
wins).
"""

from __future__ import annotations

import asyncio
import logging
import time

from agentrun.operator.kube import KubeApi, NotFound
from agentrun.operator.metrics import OperatorMetrics
from agentrun.operator.scaling import PoolScaling, Scaler
from agentrun.store import PoolDepth, Store

log = logging.getLogger(__name__)

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
POOL_LABEL = "agentrun.dev/pool"
OPT_OUT = "agentrun.dev/autoscale"


class Autoscaler:
    def __init__(self, kube: KubeApi, pools: list[PoolScaling], metrics: OperatorMetrics) -> None:
        self.kube = kube
        self.metrics = metrics
        self.scalers = {p.pool: Scaler(p) for p in pools}
        self._poked: set[str] = set()
        self._wake = asyncio.Event()
        self._missing: set[str] = set()
        self._opted_out: set[str] = set()
        #: Each pool's replica count as last read or set.
        self._replicas: dict[str, int] = {}
        self._lock = asyncio.Lock()
        #: (pool, monotonic time of the poke) -> when the scale patch went out; for the benchmark.
        self.last_poke: dict[str, float] = {}

    def poke(self, pool: str | None = None) -> None:
        """Re-check ``pool`` now (all pools when None)."""
        pools = self.scalers.keys() if pool is None else [pool] if pool in self.scalers else []
        for p in pools:
            self._poked.add(p)
            self.last_poke.setdefault(p, time.monotonic())
        if pools:
            self._wake.set()

    async def wait(self, interval: float) -> bool:
        """Until poked (True) or the interval passes (False)."""
        if self._poked:
            return True
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), interval)
            return True
        except TimeoutError:
            return False

    async def check(
        self, store: Store, *, tick: bool, depths: dict[str, PoolDepth] | None = None
    ) -> bool:
        """Scale the poked pools (all of them on a tick), by ``depths`` (every pool's, read by
        the caller's query) or else one pool-depth query. Returns whether the db was read."""
        async with self._lock:  # the tick and the notified checks: one pool is not scaled twice
            pools = list(self.scalers) if tick else sorted(self._poked)
            self._poked.clear()
            if not pools:
                return False
            depth = depths if depths is not None else await store.pool_depth()
            for pool in pools:
                await self._scale(store, pool, depth.get(pool), fresh=tick)
                if tick:
                    await self._deletion_costs(store, pool, depth.get(pool))
            return depths is None

    async def _scale(
        self, store: Store, pool: str, depth: PoolDepth | None, *, fresh: bool
    ) -> None:
        scaler = self.scalers[pool]
        s = scaler.settings
        self.metrics.observe_depths({pool: depth})
        known = self._replicas.get(pool)
        if not fresh and known is not None and scaler.demand(depth) == known:
            # A notification that changes nothing costs no API call: the Deployment is read on
            # the timer, and before any patch.
            scaler.decide(depth, known, time.monotonic())
            self.last_poke.pop(pool, None)
            return
        try:
            dep = await self.kube.get_deployment(s.namespace, s.deployment)
        except NotFound:
            if pool not in self._missing:
                log.warning(
                    "pool %s: Deployment %s/%s not found; not scaling it until it exists",
                    pool, s.namespace, s.deployment,
                )
                self._missing.add(pool)
            return
        self._missing.discard(pool)
        self._replicas[pool] = dep.replicas
        if dep.annotations.get(OPT_OUT, "").lower() == "false":
            if pool not in self._opted_out:
                log.info("pool %s: %s/%s is annotated %s=false; not scaling it",
                         pool, s.namespace, s.deployment, OPT_OUT)
            self._opted_out.add(pool)
            return
        self._opted_out.discard(pool)
        decision = scaler.decide(
            depth, dep.replicas, time.monotonic(), pristine=dep.pristine
        )
        self.metrics.desired_replicas.labels(pool).set(scaler.demand(depth))
        if decision.replicas == dep.replicas:
            self.last_poke.pop(pool, None)
            return
        if decision.replicas < dep.replicas:
            # The ReplicaSet controller deletes the pods with the lowest deletion cost: make the
            # costs current first, or a pod whose runs ended since the last tick still looks
            # busy, and a pod holding a run can be picked before an idle one (found on a node).
            await self._deletion_costs(store, pool, depth)
        await self.kube.scale_deployment(s.namespace, s.deployment, decision.replicas)
        self._replicas[pool] = decision.replicas
        direction = "up" if decision.replicas > dep.replicas else "down"
        self.metrics.scaling_decisions.labels(pool, direction).inc()
        poked = self.last_poke.pop(pool, None)
        took = f" ({(time.monotonic() - poked) * 1000:.0f} ms after the trigger)" if poked else ""
        log.info(
            "pool %s: %s/%s %d -> %d replicas: %s%s",
            pool, s.namespace, s.deployment, dep.replicas, decision.replicas, decision.reason,
            took,
        )

    async def _deletion_costs(self, store: Store, pool: str, depth: PoolDepth | None) -> None:
        s = self.scalers[pool].settings
        if pool in self._missing or pool in self._opted_out:
            return
        pods = await self.kube.list_pods(s.namespace, {POOL_LABEL: pool})
        if not pods:
            return
        # No running run in the pool: no holder, and no query to learn it (an idle pool's tick).
        holders = await store.lease_holders(pool) if depth and depth.running else {}
        for pod in pods:
            # A worker's id is "<hostname>-<pid>-<random>" and a pod's hostname is its name.
            held = sum(
                n for w, n in holders.items() if w == pod.name or w.startswith(pod.name + "-")
            )
            want = str(held)
            if pod.annotations.get(DELETION_COST) != want:
                try:
                    await self.kube.annotate_pod(s.namespace, pod.name, {DELETION_COST: want})
                except NotFound:
                    continue
