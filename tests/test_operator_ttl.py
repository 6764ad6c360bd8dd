"""The TTL task (operator/handlers.py expire) says each outage once, and backs off from the start
of each outage: a run retried and finished again between two outages gets the second one said
too, with its first retry as soon as the first outage's was.

In process: expire() against a stand-in for the operator's app whose store answers in the order
the test scripts (an outage, a later expiry, an outage, an expiry that is due), recording the
deletion and the Event it is asked for; the waits between tries are the task's own backoff with
its jitter taken out.
"""

from __future__ import annotations

import logging
import uuid
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest

from agentrun.operator import handlers
from agentrun.operator.api import Reason
from agentrun.store import K8sRef, Store
from tests.workerkit import AGENT


class Scripted:
    """What expire() asks of the app: ready_store(), kube.delete_agentrun(), event()."""

    def __init__(self, answers: list[str]) -> None:
        self.answers = answers
        self.deleted: list[tuple[str, str, str]] = []
        self.events: list[tuple[str, str | None]] = []
        self.kube = SimpleNamespace(delete_agentrun=self.delete_agentrun)

    async def ready_store(self) -> Any:
        answer = self.answers.pop(0)
        if answer == "outage":
            return None  # the database is down: DatabaseUnavailable
        now = datetime.now(UTC)
        # "later": finished again a moment ago, so its TTL (1 s) runs out 0.05 s from now.
        finished = now - timedelta(seconds=0.95 if answer == "later" else 5)
        run = SimpleNamespace(finished=True, finished_at=finished)

        async def get_run_by_k8s_uid(uid: str) -> Any:
            return run

        return SimpleNamespace(get_run_by_k8s_uid=get_run_by_k8s_uid)

    async def delete_agentrun(self, namespace: str, name: str, uid: str) -> bool:
        self.deleted.append((namespace, name, uid))
        return True

    async def event(self, ref: Any, event: Any, run_id: str | None) -> None:
        self.events.append((event.reason, run_id))


async def test_each_outage_is_said_once_and_backed_off_from_its_start(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    waits: list[int] = []

    def backoff(attempt: int, cap: float = 30.0) -> float:
        waits.append(attempt)
        return 0.0

    monkeypatch.setattr(handlers, "backoff", backoff)
    app = Scripted(["outage", "outage", "later", "outage", "due"])
    expiries = handlers.Expiries()
    with caplog.at_level(logging.WARNING, logger=handlers.log.name):
        await handlers.expire(app, expiries, "ns", "ar", "uid-1",  # type: ignore[arg-type]
                              datetime.now(UTC), 1, "run-1")
    assert app.answers == []  # every answer asked for
    assert app.deleted == [("ns", "ar", "uid-1")]
    assert [reason for reason, _ in app.events] == [Reason.EXPIRED]
    said = [r for r in caplog.records if "not deleted after its TTL yet" in r.getMessage()]
    # One line per outage, each with the run's id; the second outage's backoff starts over.
    assert len(said) == 2 and all(getattr(r, "run_id", None) == "run-1" for r in said)
    assert waits == [0, 1, 0]


async def test_an_object_whose_run_was_pruned_still_expires(store: Store) -> None:
    """A prune with a shorter cutoff than the object's TTL takes its run out of the store first;
    the object still expires when its status says (found by an adversarial review on
    2026-12-06: it stayed for ever, the task ending on the run it could not find)."""
    uid = str(uuid.uuid4())
    run, _ = await store.create_run("t", AGENT, k8s=K8sRef("ns", "ar", uid))
    ended, _ = await store.cancel(run.id, "bye")
    assert ended.finished_at is not None
    pruned = await store.prune_batch(datetime.now(UTC) + timedelta(seconds=1), ["cancelled"], 10)
    assert pruned.runs == 1 and await store.get_run_by_k8s_uid(uid) is None

    async def ready_store() -> Store:
        return store

    app = Scripted([])
    app.ready_store = ready_store  # type: ignore[method-assign,assignment]
    await handlers.expire(app, handlers.Expiries(), "ns", "ar", uid,  # type: ignore[arg-type]
                          ended.finished_at, 0, str(run.id))
    assert app.deleted == [("ns", "ar", uid)]
    assert app.events == [(Reason.EXPIRED, str(run.id))]
