"""An action annotation on an AgentRun whose run was pruned from the store is refused once and
consumed.

The handler took "no run" for "not created yet" and retried every second for ever: a query and
an ERROR line a second, no Warning, the annotation never consumed, and all of it again after
every operator restart (found by an adversarial review on 2026-12-06). An object whose run was
pruned keeps showing its last status (docs/store.md), so a user may well annotate it.

In process: operator/handlers.py actions() against a real store, with a stand-in for the
operator's app that records the Events it is asked for and the annotations it consumes; kopf's
patch is kopf's own object.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import kopf
import pytest

from agentrun.operator import handlers
from agentrun.operator.api import Reason
from agentrun.operator.app import APP, OperatorApp
from agentrun.store import K8sRef, Store
from tests.workerkit import AGENT


class App(OperatorApp):
    """The operator's app as far as actions() asks it: the store, its settings, Events."""

    def __init__(self, store: Store) -> None:  # none of the app's own start-up
        self.store = store
        self.settings = SimpleNamespace(  # type: ignore[assignment]
            approval_annotations=True, agent_retry_delay=15.0)
        self.events: list[tuple[str, str, str | None]] = []
        self.kube = self  # type: ignore[assignment]  # consume_annotation below
        self.consumed: list[tuple[str, str]] = []

    async def consume_annotation(self, namespace: str, name: str, uid: str, key: str,
                                 value: str) -> bool:
        self.consumed.append((key, value))
        return True

    async def ready_store(self, *_: Any, **__: Any) -> Store:  # type: ignore[override]
        return self.store

    async def event(self, ref: Any, event: Any, run_id: Any) -> None:  # type: ignore[override]
        self.events.append((event.reason, event.message, None if run_id is None else str(run_id)))


async def test_an_action_on_an_object_whose_run_was_pruned_is_refused_once(
    store: Store,
) -> None:
    uid = str(uuid.uuid4())
    run, _ = await store.create_run("t", AGENT, k8s=K8sRef("ns", "ar", uid))
    await store.cancel(run.id, "done with it")
    pruned = await store.prune_batch(datetime.now(UTC) + timedelta(seconds=1), ["cancelled"], 10)
    assert pruned.runs == 1
    app = App(store)
    patch = kopf.Patch()
    annotations = {"agentrun.dev/retry": "true", "agentrun.dev/cancel": "true"}
    await handlers.actions(annotations=annotations, namespace="ns", name="ar", uid=uid,
                           status={"phase": "Cancelled", "runId": str(run.id)}, patch=patch,
                           memo={APP: app})
    assert [(reason, rid) for reason, _, rid in app.events] == [
        (Reason.ACTION_REFUSED, str(run.id))]
    assert f"run {run.id} was pruned from the store" in app.events[0][1]
    assert sorted(app.consumed) == sorted(annotations.items())  # consumed, each as it read
    assert not patch  # never by kopf's patch, which erases whatever the annotation reads by then


async def test_an_action_before_the_run_exists_waits_for_it_backing_off(store: Store) -> None:
    app = App(store)
    delays = []
    for retry in range(6):
        with pytest.raises(kopf.TemporaryError, match=handlers.RUN_NOT_CREATED) as raised:
            await handlers.actions(annotations={"agentrun.dev/cancel": "true"}, namespace="ns",
                                   name="ar", uid=str(uuid.uuid4()), status={},
                                   patch=kopf.Patch(), memo={APP: app}, retry=retry)
        delays.append(raised.value.delay)
    assert delays == [1, 2, 4, 8, 15, 15]
    assert app.events == []
