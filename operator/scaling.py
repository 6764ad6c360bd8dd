"""How many workers a pool should have: the operator's scaling decision, kept pure.

    desired = ceil((pending + running + spareSlots) / runsPerWorker), clamped to
              [minReplicas, maxReplicas]; spareSlots only while the pool has live runs;
              pending leaves out the runs held back by their namespace's quota

``spareSlots`` is headroom: free run slots kept on running workers, so the runs a deleted or
drained pod hands back are claimed at once by the survivors instead of waiting for its
replacement pod to be scheduled and started (seconds to minutes). It costs idle capacity, and
only while there is work: an idle pool still scales to ``minReplicas`` (zero by default), which
is what a warm pool is for. docs/operator.md has the trade-off.

Up at once (a new pending run must reach a pool scaled to zero within seconds, not a polling
interval); down only after the lower demand has lasted ``scale_down_delay`` (so a burst that
finishes does not thrash the Deployment, and a pod holding leases is not removed while another
run is about to arrive). The operator feeds it the store's per-pool depth (from NOTIFY and its
resync) and patches the Deployment's scale subresource when the answer changes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from agentrun.store import PoolDepth


@dataclass(frozen=True)
class PoolScaling:
    """A worker pool's scaling settings (Helm values: workers.pools[].autoscaling)."""

    pool: str
    deployment: str
    namespace: str = "default"
    runs_per_worker: int = 4
    min_replicas: int = 0
    max_replicas: int = 10
    scale_down_delay: float = 300.0
    #: Free run slots kept beyond the live runs while there are any (headroom for hand-overs).
    spare_slots: int = 0

    def __post_init__(self) -> None:
        if self.runs_per_worker < 1:
            raise ValueError(f"pool {self.pool}: runsPerWorker must be at least 1")
        if self.spare_slots < 0:
            raise ValueError(f"pool {self.pool}: spareSlots must be 0 or more")
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(
                f"pool {self.pool}: need 0 <= minReplicas ({self.min_replicas}) <= maxReplicas "
                f"({self.max_replicas})"
            )


@dataclass(frozen=True)
class Decision:
    replicas: int
    reason: str


@dataclass
class Scaler:
    settings: PoolScaling
    _lower_since: float | None = field(default=None, init=False)
    #: The live runs when the lower demand was last seen: more since is a new run.
    _lower_live: int = field(default=0, init=False)

    def slots(self, depth: PoolDepth | None) -> int:
        """Run slots the pool should have: its live runs, plus the spare ones while any. A run
        held back by its namespace's quota is not live: no worker could claim it."""
        live = depth.live if depth else 0
        return live + self.settings.spare_slots if live else 0

    def demand(self, depth: PoolDepth | None) -> int:
        wanted = math.ceil(self.slots(depth) / self.settings.runs_per_worker)
        return max(self.settings.min_replicas, min(self.settings.max_replicas, wanted))

    def _need(self, depth: PoolDepth | None) -> str:
        live = depth.live if depth else 0
        spare = self.settings.spare_slots
        return f"{live} live runs + {spare} spare slots" if spare and live else f"{live} live runs"

    def decide(
        self, depth: PoolDepth | None, current: int, now: float, *, pristine: bool = False
    ) -> Decision:
        """The replica count to set now (``current`` when nothing should change).
        ``pristine``: the Deployment was never scaled since its creation. The delay guards
        scaling decisions against thrash; a count nobody decided (the API's default of 1 for a
        Deployment installed without replicas) is corrected at once."""
        wanted = self.demand(depth)
        need = self._need(depth)
        if pristine and wanted != current:
            self._lower_since = None
            return Decision(wanted, f"first decision: {need} need {wanted} (the "
                                    f"Deployment still has the {current} it was created with)")
        if wanted >= current:
            self._lower_since = None
            if wanted > current:
                return Decision(wanted, f"scale up: {need} need {wanted}")
            return Decision(current, "steady")
        live = depth.live if depth else 0
        # A new run restarts the clock even when demand stays below the current count: it is
        # claimed by one of the pods the scale-down would remove (5 pods, idle for 295 s of 300,
        # then 8 new runs: 2 pods would do, and 6 s later 3 pods went, draining fresh runs).
        if self._lower_since is None or live > self._lower_live:
            self._lower_since = now
        self._lower_live = live
        waited = now - self._lower_since
        delay = self.settings.scale_down_delay
        if waited < delay:
            return Decision(current, f"hold: {wanted} would do for {waited:.0f}s of {delay:.0f}s")
        self._lower_since = None
        return Decision(wanted, f"scale down: {need} need {wanted}")
