"""The status mirror applies a resync's corrections beside a stream of changes, not after it.

Found by CI on 2026-12-07 (tests/test_k8s_tenancy.py, under load): the flush patched the
notified runs as long as notifications kept coming, and only then the statuses a resync had
found behind. Under churn (runs finishing every moment) that moment never came, and a pending
run of a full namespace never said QuotaExceeded. In process: the mirror against the real store;
the API server's side is a recorder whose every patch brings the next change, as churn would.
"""

from __future__ import annotations

import uuid
from typing import Any

from agentrun.operator.metrics import OperatorMetrics
from agentrun.operator.mirror import StatusMirror, Tracked
from agentrun.operator.status import Event
from agentrun.store import K8sRef, Run, Store
from tests.workerkit import AGENT


class Churn:
    """Records each status patch; each patch of a changed run brings the next change."""

    def __init__(self) -> None:
        self.patched: list[str] = []
        self.mirror: StatusMirror | None = None
        self.next: list[Run] = []

    async def patch_agentrun_status(
        self, namespace: str, name: str, uid: str, status: dict[str, Any]
    ) -> None:
        self.patched.append(name)
        if self.next and self.mirror is not None and name.startswith("changed"):
            self.mirror.notify(self.next.pop(0).id)


async def no_event(t: Tracked, e: Event) -> None:
    return None


async def test_a_resyncs_corrections_are_applied_beside_a_stream_of_changes(
    store: Store,
) -> None:
    async def run_of(name: str) -> Run:
        run, _ = await store.create_run("t", AGENT, k8s=K8sRef("team", name, str(uuid.uuid4())))
        return run

    behind = await run_of("behind")
    changed = [await run_of(f"changed-{i}") for i in range(40)]
    kube = Churn()
    mirror = StatusMirror(kube, OperatorMetrics(), no_event,  # type: ignore[arg-type]
                          max_patches_per_second=1e6)
    kube.mirror = mirror
    for run in (behind, *changed):
        assert run.k8s_namespace and run.k8s_name and run.k8s_uid
        mirror.track(run.k8s_namespace, run.k8s_name, run.k8s_uid, None)
    mirror._stale[behind.id] = behind  # what a resync found behind
    kube.next = changed[1:]
    mirror.notify(changed[0].id)
    await mirror.flush(store)
    assert len(kube.patched) == 41 and "behind" in kube.patched
    assert kube.patched.index("behind") <= 1, kube.patched  # after the first batch, not the 40th
