"""The approval task's lines about a run carry the run's id (operator/approvals.py _apply): the
line that says an approval is not applied yet (the database is down) and the one that says it was
applied, whether the run's id comes from the store on this try or from the status an earlier
try (or operator) wrote. Before, only the applied and refused lines had it.

In process: _apply against a stand-in for the operator's app whose store refuses the decision
once (DatabaseUnavailable) or is unreachable once (no store), then decides; the wait between the
tries is the task's own backoff with its jitter taken out.
"""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any
from uuid import UUID, uuid4

import pytest

from agentrun.errors import DatabaseUnavailable
from agentrun.logs import RunIdFilter
from agentrun.operator import approvals
from agentrun.waits import WaitRef

RUN_ID = uuid4()
PENDING = {"seq": 3, "call_index": 0, "tool": "drop_table", "stage": "outcome_unknown",
           "attempt": 1}


class Scripted:
    """What _apply asks of the app: ready_store(), kube, metrics, mirror."""

    def __init__(self, answers: list[str]) -> None:
        self.answers = answers  # per try: "no store", "refuse", "decide"
        self.decided: list[tuple[UUID, int, str]] = []
        self.patched: list[dict[str, Any]] = []
        self.kube = SimpleNamespace(
            get_agentrun=self.get_agentrun, patch_approval_status=self.patch, post_event=self.post
        )
        self.metrics = SimpleNamespace(events=SimpleNamespace(labels=lambda _r: SimpleNamespace(
            inc=lambda: None)))
        self.mirror = SimpleNamespace(notify=lambda _id: None)
        self.store = SimpleNamespace(
            get_run_by_k8s_uid=self.get_run, decide=self.decide, get_approval=self.no_approval,
            waited_on=self.waited_on,
        )
        self.answer = ""

    async def ready_store(self) -> Any:
        self.answer = self.answers.pop(0)
        return None if self.answer == "no store" else self.store

    async def get_agentrun(self, namespace: str, name: str) -> dict[str, Any]:
        return {"metadata": {"uid": "ar-uid", "name": name, "namespace": namespace}}

    async def get_run(self, uid: str) -> Any:
        return SimpleNamespace(id=RUN_ID, status="waiting_approval", pending_call=PENDING)

    async def waited_on(self, run_id: UUID) -> dict[str, Any]:
        return PENDING

    async def no_approval(self, *args: Any) -> None:
        return None

    async def decide(self, run_id: UUID, wait: WaitRef, decision: str, **_: Any) -> None:
        if self.answer == "refuse":
            raise DatabaseUnavailable("the database is unavailable")
        self.decided.append((run_id, wait, decision))

    async def patch(self, namespace: str, name: str, uid: str, status: dict[str, Any]) -> None:
        self.patched.append(status)

    async def post(self, *args: Any) -> None:
        return None


@pytest.mark.parametrize(
    ("answers", "status"),
    [
        (["refuse", "decide"], {}),  # the id read on the first try
        (["no store", "decide"], {"runId": str(RUN_ID)}),  # the id an earlier try wrote
    ],
    ids=["read-this-try", "from-the-status"],
)
async def test_the_approval_tasks_lines_about_a_run_carry_its_id(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    answers: list[str], status: dict[str, Any],
) -> None:
    monkeypatch.setattr(approvals, "backoff", lambda attempt, cap=30.0: 0.0)
    app = Scripted(answers)
    spec = {"agentRun": "ar", "seq": 3, "decision": "approve", "approver": "alice"}
    caplog.handler.addFilter(RunIdFilter())  # as the operator's handler has it (logs.py)
    with caplog.at_level(logging.INFO, logger=approvals.log.name):
        # In a task of its own, as the handler starts it (its run id stays in that task).
        await asyncio.create_task(approvals._apply(
            app, "ns", "ap", "ap-uid", spec, status, lambda: None))  # type: ignore[arg-type]
    assert app.answers == [] and app.decided == [(RUN_ID, WaitRef(3), "approved")]
    waiting = [r for r in caplog.records if "not applied yet" in r.getMessage()]
    applied = [r for r in caplog.records if "applied:" in r.getMessage()]
    assert len(waiting) == 1 and len(applied) == 1, caplog.text
    assert [getattr(r, "run_id", None) for r in waiting + applied] == [str(RUN_ID)] * 2
