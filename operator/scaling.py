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
interval); down to the highest demand of the last ``scale_down_delay`` seconds, as the
HorizontalPodAutoscaler's scale-down stabilization window does: a burst that finishes does not
thrash the Deployment, and runs that came within the window keep the pods they need. (A new run
once restarted the whole delay: a run every few minutes then kept a burst's pods for ever.) The
operator feeds it the store's per-pool depth (from NOTIFY and its resync) and patches the
Deployment's scale subresource when the answer changes.
"""

from __future__ import annotations

import math
from collections import deque
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
    #: (when, replicas wanted) at each change of demand within the delay, and the last one
    #: before it, still in effect when the window began.
    _seen: deque[tuple[float, int]] = field(default_factory=deque, init=False)

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
        delay = self.settings.scale_down_delay
        seen = self._seen
        if not seen or seen[-1][1] != wanted:  # changes only: a decision per notification
            seen.append((now, wanted))
        while len(seen) > 1 and seen[1][0] <= now - delay:
            seen.popleft()  # the second is in effect from the window's start on
        if pristine and wanted != current:
            return Decision(wanted, f"first decision: {need} need {wanted} (the "
                                    f"Deployment still has the {current} it was created with)")
        if wanted >= current:
            if wanted > current:
                return Decision(wanted, f"scale up: {need} need {wanted}")
            return Decision(current, "steady")
        watched = now - seen[0][0]
        if watched < delay:  # demand not seen for a whole window yet (the operator started)
            return Decision(current, f"hold: {wanted} would do; demand seen for {watched:.0f}s "
                                     f"of {delay:.0f}s")
        peak = max(w for _, w in seen)
        if peak >= current:
            return Decision(current, f"hold: {wanted} would do; {peak} were needed within the "
                                     f"last {delay:.0f}s")
        return Decision(peak, f"scale down: {need} need {wanted}, at most {peak} within the "
                              f"last {delay:.0f}s")
