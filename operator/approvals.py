"""AgentRunApproval objects: a decision on the call an AgentRun waits on, by a user the API
server authenticated.

RBAC decides who may decide (``create`` on agentrunapprovals: the chart's ``-approver``
ClusterRole, not its ``-editor`` one), and the chart's ValidatingAdmissionPolicy admits an
approval only when ``spec.approver`` is the name the request was authenticated as. So the name
this module records as ``decided_by`` (the approval row, hence the step log and ``agentrun get``)
and puts in the Events is the authenticated user's, not a claim.

What happens to one approval, once:

* the AgentRun ``spec.agentRun`` of the approval's namespace is read (its uid names its run);
* the call the run waits on is written into ``.status.call`` (still Pending), then
  ``store.decide(run, spec.seq, ...)`` records the decision, ``decided_by=spec.approver``,
  ``reason=spec.reason``. It locks the run's row and checks the run waits on that step: of two
  approvals of one step made at once, the first decides and the second is refused (the run no
  longer waits), whatever their decisions;
* ``.status`` becomes ``Applied`` (runId, decidedAt, condition Applied=True) or ``Refused``
  (the one-line reason: no such AgentRun, the run waits on another step or on none...), with an
  Event on the approval and one on the AgentRun (``Approved`` / ``Rejected``, or a Warning
  ``ActionRefused``).

A raw watch-event handler, not kopf's create handler: kopf's create handler keeps its progress in
annotations of the object, which would need ``patch`` on approvals; the operator may only patch
their status. The status is the record of what was done: an approval whose phase is Applied or
Refused is never acted on again (an operator restart lists every approval, and passes these
by). One task per approval does the work, retrying while the database or the API server does
not answer (phase Pending meanwhile); deleting the approval stops it. An operator killed after
the decision, before the status said so, finds the decision by ``.status.call`` when it comes
back: its own (approver, decision and reason alike) makes the approval Applied, another's
Refused ("decided first"), none and a run still waiting lets it decide.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from uuid import UUID

import kopf
from pydantic import ValidationError

from agentrun.errors import AgentrunError, DatabaseUnavailable
from agentrun.faults import crash_point
from agentrun.logs import current_run_id
from agentrun.manifests import AgentRunApprovalSpec
from agentrun.operator.api import (
    APPROVALS,
    GROUP,
    VERSION,
    AgentRunApprovalStatus,
    ApprovalPhase,
    CondType,
    Reason,
)
from agentrun.operator.app import APP, OUTAGES, OperatorApp, backoff, memo_get
from agentrun.operator.kube import Gone, NotFound
from agentrun.operator.status import Cond, Event, now_iso, one_line, set_condition
from agentrun.store import Approval, Store
from agentrun.supervise import describe, watch
from agentrun.vocabulary import VERDICTS

log = logging.getLogger(__name__)

#: Phases after which the operator leaves an approval alone.
DONE_PHASES = (ApprovalPhase.APPLIED, ApprovalPhase.REFUSED)


def _ref(kind: str, namespace: str, name: str, uid: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": kind,
        "metadata": {"name": name, "namespace": namespace, "uid": uid},
    }


def _same_object(agent_run: str, approval_made: str, agent_run_made: str) -> None:
    """Refuse an approval made before the AgentRun it names was: that object was deleted and
    created again under its name since (kubectl delete and apply, a GitOps sync), and its run's
    wait is not the one the approver looked at. An approval that stayed Pending through a
    database outage decided the new run's identical wait (found by a review on 2026-12-07).
    Timestamps are whole seconds: one made in the same second as the object is let through."""
    if not (approval_made and agent_run_made):
        return
    try:
        before = datetime.fromisoformat(approval_made) < datetime.fromisoformat(agent_run_made)
    except ValueError:
        return
    if before:
        raise _Refused(f"AgentRun {agent_run} was created at {agent_run_made}, after this "
                       f"approval ({approval_made}): it was deleted and created again since, "
                       "and its wait is not the one this approval was made for; create a new "
                       "approval for it")


class _Refused(Exception):
    """The approval is not applied, for good (the message says why, on one line)."""

    def __init__(self, message: str, run_id: str | None = None) -> None:
        super().__init__(message)
        self.run_id = run_id


#: Where the approval handler's bookkeeping is kept in kopf's memo (put there at startup).
WORKING = "agentrun_approvals"


@dataclass
class Working:
    """The approvals being applied, one task each; and the approvals this process finished:
    the watch may still deliver an older version of one (its Pending status, queued before the
    Applied patch), which must not start it again."""

    tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)

    def done(self, uid: str) -> None:
        self.tasks.pop(uid, None)
        self.finished.add(uid)


def register(registry: kopf.OperatorRegistry) -> None:
    """Add the AgentRunApproval handler to ``registry`` (the running OperatorApp and a
    :class:`Working` are in kopf's memo by the time it runs)."""
    kopf.on.event(*APPROVALS, registry=registry, id="approval")(approval)


async def approval(
    event: kopf.RawEvent, body: kopf.Body, status: kopf.Status, namespace: str | None,
    name: str, uid: str, memo: kopf.Memo, **_: Any,
) -> None:
    working = memo_get(memo, WORKING, Working)
    if event.get("type") == "DELETED":
        working.finished.discard(uid)
        task = working.tasks.pop(uid, None)
        if task is not None:
            task.cancel()
        return
    if status.get("phase") in DONE_PHASES or uid in working.tasks or uid in working.finished:
        return
    app = memo_get(memo, APP, OperatorApp)
    created = str((body.get("metadata") or {}).get("creationTimestamp") or "")
    working.tasks[uid] = watch(asyncio.create_task(
        _apply(app, namespace or "", name, uid, dict(body.get("spec") or {}),
               dict(status), lambda: working.done(uid), created),
        name=f"approval-{uid}"),
        lambda exc: log.error("AgentRunApproval %s/%s: failed: %s", namespace, name,
                              describe(exc)))


async def _apply(
    app: OperatorApp, namespace: str, name: str, uid: str, raw: dict[str, Any],
    status: dict[str, Any], done: Callable[[], object], created: str = "",
) -> None:
    """Act on one approval, retrying until it is Applied or Refused (or deleted).
    ``created``: the approval's creationTimestamp."""
    me = _ref("AgentRunApproval", namespace, name, uid)
    waiting_said = False
    attempt = 0
    # Every line of this task about the run carries its id: the one an earlier try wrote in the
    # status, until _decide reads it from the store (it sets this task's current_run_id).
    if status.get("runId"):
        current_run_id.set(str(status["runId"]))
    try:
        while True:
            try:
                await _decide(app, namespace, name, uid, raw, status, created)
                return
            except asyncio.CancelledError:
                raise
            except Gone:
                return  # deleted meanwhile: nothing to report on
            except OUTAGES as exc:  # the approval stays Pending meanwhile
                why = one_line(str(exc) or type(exc).__name__, 300)
                if not waiting_said:  # once per approval, not once per retry
                    waiting_said = True
                    log.warning("AgentRunApproval %s/%s: not applied yet (%s); retrying",
                                namespace, name, why)
                    pending = _status(
                        status, ApprovalPhase.PENDING, f"not applied yet: {why}", None,
                        Cond(CondType.APPLIED, False, Reason.APPROVAL_PENDING, why))
                    try:
                        await app.kube.patch_approval_status(namespace, name, uid, pending)
                        status = pending
                    except Exception as patch_exc:  # the API server may be what is down
                        log.warning("AgentRunApproval %s/%s: could not set Pending: %s",
                                    namespace, name, patch_exc)
            await asyncio.sleep(backoff(attempt))
            attempt += 1
    except Exception:
        log.exception("AgentRunApproval %s/%s: failed; the next operator start retries it",
                      namespace, name)
        await _post(app, me, Event("Warning", Reason.APPROVAL_REFUSED,
                                     "the operator failed on this approval; see its log"), None)
    finally:
        done()


async def _decide(
    app: OperatorApp, namespace: str, name: str, uid: str, raw: dict[str, Any],
    status: dict[str, Any], created: str = "",
) -> None:
    me = _ref("AgentRunApproval", namespace, name, uid)
    run_ref: dict[str, Any] | None = None
    run_id: str | None = None
    try:
        try:
            spec = AgentRunApprovalSpec.model_validate(raw)
        except ValidationError as exc:  # the CRD's schema admits no such object; be safe
            raise _Refused("invalid spec: " + "; ".join(
                f"spec.{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in exc.errors())
            ) from None
        store = await app.ready_store()
        if store is None:
            raise ConnectionError("the database is unavailable")
        try:
            obj = await app.kube.get_agentrun(namespace, spec.agent_run)
        except NotFound:
            raise _Refused(f"no AgentRun {spec.agent_run!r} in namespace {namespace}") from None
        run_ref = _ref("AgentRun", namespace, spec.agent_run, obj["metadata"]["uid"])
        _same_object(spec.agent_run, created, str(obj["metadata"].get("creationTimestamp") or ""))
        run = await store.get_run_by_k8s_uid(obj["metadata"]["uid"])
        if run is None:
            pruned = (obj.get("status") or {}).get("runId")
            if pruned:  # the annotations' words (handlers.actions): not "not accepted yet"
                raise _Refused(f"run {pruned} was pruned from the store; there is nothing to "
                               "act on", str(pruned))
            raise _Refused(f"AgentRun {spec.agent_run} has no run yet (the operator has not "
                           "accepted it); it cannot be waiting for a decision")
        run_id = str(run.id)
        if status.get("runId") not in (None, run_id):  # read on an earlier try of this approval
            raise _Refused(f"AgentRun {spec.agent_run} was deleted and created again since this "
                           f"approval was first read (run {status['runId']} then, {run_id} "
                           "now); a decision is about the wait its approver looked at: create a "
                           "new approval for this one", run_id)
        current_run_id.set(run_id)  # for this task's lines after this try too (_apply's)
        decision = VERDICTS[spec.decision]
        call = status.get("call") if status.get("runId") == run_id else None
        prior = await _recorded(store, run.id, spec.seq, call)
        if prior is None:
            # The attempt as the store will record it, also for a wait that does not name it.
            pending = await store.waited_on(run.id)
            if pending is not None and spec.wait.answers(pending):
                # Which call this decides, written down before deciding: an operator killed
                # right after the decision finds it in the store by these, and does not call
                # its own recorded decision a refusal.
                call = {"tool": str(pending.get("tool")), "index": int(pending["call_index"]),
                        "stage": str(pending["stage"]), "attempt": int(pending["attempt"])}
                status = _status(
                    status, ApprovalPhase.PENDING, "recording the decision", run_id,
                    Cond(CondType.APPLIED, False, Reason.APPROVAL_PENDING, "recording"), call=call)
                await app.kube.patch_approval_status(namespace, name, uid, status)
            try:
                await store.decide(run.id, spec.wait, decision, decided_by=spec.approver,
                                   reason=spec.reason)
            except DatabaseUnavailable:
                raise
            except AgentrunError as exc:  # not waiting, waiting on another step, no such run
                # Without the call (this approval read the run after the first decision), the
                # step's latest decision is the one that came first.
                first = (await _recorded(store, run.id, spec.seq, call)
                         or await store.last_approval_on_step(run.id, spec.seq))
                raise _Refused(str(exc) + (
                    f": step {spec.seq} was decided first, {first.decision} by "
                    f"{first.decided_by}" if first is not None else ""), run_id) from None
            crash_point("operator_after_decide", spec.seq)
        elif (prior.decided_by, prior.decision, prior.reason) != (
                spec.approver, decision, spec.reason):
            raise _Refused(f"step {spec.seq} was decided first, {prior.decision} by "
                           f"{prior.decided_by}", run_id)
        # else: this approval's own decision, recorded before an operator restart.
    except _Refused as refused:
        why = one_line(str(refused), 900)
        new = _status(status, ApprovalPhase.REFUSED, why, refused.run_id,
                      Cond(CondType.APPLIED, False, Reason.APPROVAL_REFUSED, why))
        await app.kube.patch_approval_status(namespace, name, uid, new)
        log.warning("AgentRunApproval %s/%s by %s refused: %s", namespace, name,
                    raw.get("approver"), why, extra={"run_id": str(refused.run_id)})
        await _post(app, me, Event("Warning", Reason.APPROVAL_REFUSED, why), refused.run_id)
        if run_ref is not None:
            await _post(app, run_ref, Event(
                "Warning", Reason.ACTION_REFUSED,
                one_line(f"AgentRunApproval {name} ({raw.get('decision')} step "
                         f"{raw.get('seq')} by {raw.get('approver')}): {why}", 1000)),
                refused.run_id)
        return
    tool = (call or {}).get("tool") or "?"
    said = one_line(f"step {spec.seq} ({tool}) {decision} by {spec.approver}"
                    + (f": {spec.reason}" if spec.reason else ""), 1000)
    new = _status(status, ApprovalPhase.APPLIED, said, run_id,
                  Cond(CondType.APPLIED, True, Reason.APPROVAL_APPLIED, said), decided=True,
                  call=call)
    await app.kube.patch_approval_status(namespace, name, uid, new)
    reason = Reason.APPROVED if decision == "approved" else Reason.REJECTED
    log.info("AgentRunApproval %s/%s applied: %s", namespace, name, said,
             extra={"run_id": run_id})
    app.mirror.notify(run.id)
    await _post(app, run_ref, Event("Normal", reason, said), run_id)
    await _post(app, me, Event("Normal", reason, said), run_id)


async def _recorded(
    store: Store, run_id: UUID, seq: int, call: dict[str, Any] | None
) -> Approval | None:
    """The decision the store holds on ``call`` of step ``seq`` (None: none, or no call)."""
    if not call:
        return None
    return await store.get_approval(run_id, seq, int(call["index"]), str(call["stage"]),
                                    int(call["attempt"]))


def _status(
    previous: dict[str, Any], phase: str, message: str, run_id: str | None, cond: Cond,
    *, decided: bool = False, call: dict[str, Any] | None = None,
) -> dict[str, Any]:
    status = AgentRunApprovalStatus.model_validate({
        "phase": phase,
        "message": message,
        "runId": run_id,
        "decidedAt": now_iso() if decided else None,
        "call": call,
        "conditions": set_condition(previous.get("conditions"), cond),
    })
    return status.model_dump(mode="json", by_alias=True, exclude_none=True)


async def _post(app: OperatorApp, involved: dict[str, Any], e: Event, run_id: str | None) -> None:
    """An Event about an approval or its AgentRun. Informative: a failure is logged only."""
    meta = involved["metadata"]
    app.metrics.events.labels(e.reason).inc()
    try:
        await app.kube.post_event(involved, e.type, e.reason, e.message)
    except Exception as exc:
        log.warning("%s %s/%s: could not post the %s event: %s", involved["kind"],
                    meta["namespace"], meta["name"], e.reason, exc,
                    extra={"run_id": str(run_id)})
