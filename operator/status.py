"""What an AgentRun's ``.status`` says, and which Kubernetes Events a change deserves. Pure.

The status is a function of the run row (and of whether the database answers), so a restarted
operator computes the same status again and patches nothing; only ``lastTransitionTime`` of a
condition carries over from what the object already shows. It is built through the
:class:`~agentrun.operator.api.AgentRunStatus` model, the same one the CRD's schema is generated
from, and holds no ``None``: an absent field and a null one must compare equal, or every restart
re-patches every object.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from agentrun.cli_format import printable
from agentrun.operator.api import TERMINAL_REASONS, AgentRunStatus, CondType, Reason
from agentrun.store import Quota, Run
from agentrun.waits import WaitRef

#: ``.status.result`` and ``.status.error`` are truncated to this: objects live in etcd, the full
#: text in the store (``agentrun steps RUN``).
MAX_TEXT = 1024
MAX_MESSAGE = 80



def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _iso(value: datetime | None) -> str | None:
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ") if value else None


def truncate(text: str | None, limit: int) -> str | None:
    if text is None:
        return None
    return text if len(text) <= limit else text[: limit - 1] + "…"


def one_line(text: str, limit: int = MAX_MESSAGE) -> str:
    """``text`` on one line for a status message or an Event, with what a terminal would act
    on escaped: ``kubectl get`` and ``describe`` print them as they are, and a run's error or
    a rollback's reason carries a tool's or a person's text."""
    return truncate(printable(" ".join(text.split())), limit) or ""


def summarise_arguments(args: Any, limit: int = 200) -> str:
    # JSON escapes C0 controls but not C1 (U+009B is a terminal's CSI) nor DEL.
    return truncate(printable(json.dumps(args, sort_keys=True, ensure_ascii=False)), limit) or ""


def shown(text: str | None, limit: int) -> str | None:
    """A run's result or error as ``kubectl describe`` prints it, as it is: lines and tabs
    kept, what a terminal would act on escaped (the store keeps the text itself)."""
    return None if text is None else truncate(printable(text), limit)


def message(run: Run, quota: Quota | None = None) -> str:
    """One line for ``kubectl get agentruns`` (``quota``: the run's namespace's, when it is
    full)."""
    if run.status == "pending" and quota is not None:
        return (
            f"waiting: namespace {quota.namespace} has {quota.running} running runs, its quota "
            f"is {quota.max_running}"
        )
    if run.status == "pending":
        return f"waiting for a worker in pool {run.pool}"
    if run.status == "running":
        return one_line(f"step {run.next_seq} on {run.lease_owner or '?'}")
    if run.status == "waiting_approval":
        call = run.pending_call or {}
        return one_line(f"step {call.get('seq')}: {call.get('tool')} waits for approval")
    if run.status == "succeeded":
        return one_line(run.result or "succeeded")
    if run.status == "dead_letter":
        return one_line(f"gave up after {run.attempt} attempts: {run.error or ''}")
    return one_line(run.error or run.status)


@dataclass(frozen=True)
class Cond:
    type: CondType
    status: bool
    reason: Reason
    message: str = ""


def conditions_for(run: Run, db_up: bool, quota: Quota | None = None) -> list[Cond]:
    finished = run.finished
    waiting = run.status == "waiting_approval"
    return [
        Cond(CondType.ACCEPTED, True, Reason.RUN_CREATED, f"run {run.id} in pool {run.pool}"),
        Cond(
            CondType.WAITING_FOR_APPROVAL,
            waiting,
            Reason.APPROVAL_REQUIRED if waiting else Reason.NOT_WAITING,
            one_line(run.wait_reason or "", 300) if waiting else "",
        ),
        Cond(
            CondType.COMPLETED,
            finished,
            TERMINAL_REASONS.get(run.status, Reason.IN_PROGRESS),
            message(run) if finished else "",
        ),
        db_condition(db_up),
        ready_condition(run, quota),
    ]


def ready_condition(run: Run, quota: Quota | None = None) -> Cond:
    """Ready=True once the run succeeded (``kubectl wait --for=condition=Ready`` waits for
    success); False with the reason why not yet or never."""
    if run.status == "pending" and quota is not None:
        return Cond(CondType.READY, False, Reason.QUOTA_EXCEEDED, message(run, quota))
    if run.status == "succeeded":
        return Cond(CondType.READY, True, Reason.SUCCEEDED, message(run))
    if run.status == "waiting_approval":
        return Cond(CondType.READY, False, Reason.WAITING_FOR_APPROVAL, message(run))
    return Cond(
        CondType.READY, False, TERMINAL_REASONS.get(run.status, Reason.IN_PROGRESS), message(run)
    )


def not_ready(reason: Reason, why: str) -> Cond:
    """Ready=False before a run exists (unknown Agent, invalid spec)."""
    return Cond(CondType.READY, False, reason, one_line(why, 300))


def db_condition(up: bool) -> Cond:
    return Cond(
        CondType.DATABASE_AVAILABLE,
        up,
        Reason.CONNECTED if up else Reason.DATABASE_UNAVAILABLE,
        "" if up else "the operator cannot reach PostgreSQL; retrying with backoff",
    )


def merge_conditions(
    previous: list[dict[str, Any]] | None, wanted: list[Cond], generation: int | None = None
) -> list[dict[str, Any]]:
    """metav1.Conditions: keep ``lastTransitionTime`` while a condition's status holds."""
    before = {c.get("type"): c for c in previous or []}
    out = []
    for c in wanted:
        status = "True" if c.status else "False"
        old = before.get(c.type)
        since = (
            old["lastTransitionTime"]
            if old and old.get("status") == status and old.get("lastTransitionTime")
            else now_iso()
        )
        cond: dict[str, Any] = {
            "type": c.type,
            "status": status,
            "reason": c.reason,
            "message": c.message,
            "lastTransitionTime": since,
        }
        if generation is not None:
            cond["observedGeneration"] = generation
        out.append(cond)
    return out


def set_condition(
    previous: list[dict[str, Any]] | None, cond: Cond, generation: int | None = None
) -> list[dict[str, Any]]:
    """``previous`` with one condition set (the others kept as they are)."""
    kept = [c for c in previous or [] if c.get("type") != cond.type]
    old = [c for c in previous or [] if c.get("type") == cond.type]
    return kept + merge_conditions(old, [cond], generation)


def status_for(
    run: Run,
    *,
    db_up: bool,
    previous: dict[str, Any] | None,
    generation: int | None = None,
    quota: Quota | None = None,
) -> dict[str, Any]:
    """The whole ``.status`` for ``run`` (``previous``: what the object shows now;
    ``generation``: the object's metadata.generation, echoed as observedGeneration; ``quota``:
    the run's namespace's quota when it is full, which keeps a pending run waiting)."""
    if quota is not None and quota.running < quota.max_running:
        quota = None
    call = run.pending_call if run.status == "waiting_approval" else None
    return normalised({
        "observedGeneration": generation,
        "runId": str(run.id),
        "phase": run.status,
        "step": run.next_seq,
        "attempt": run.attempt,
        "worker": run.lease_owner if run.status == "running" else None,
        "model": run.model,
        "provider": run.provider,
        "promptVersion": run.prompt_version,
        "tokens": {
            "input": run.input_tokens,
            "output": run.output_tokens,
            "cacheRead": run.cache_read_tokens,
            "cacheWrite": run.cache_write_tokens,
        },
        # Micro-dollars: enough for a one-token turn, and a float that reads back the same.
        "costUSD": round(run.cost_usd, 6),
        "result": shown(run.result, MAX_TEXT),
        "error": shown(run.error, MAX_TEXT),
        "message": message(run, quota),
        "pendingApproval": {
            "seq": int(call["seq"]),
            "tool": str(call.get("tool")),
            "arguments": summarise_arguments(call.get("input")),
            "reason": one_line(run.wait_reason or "", 300),
            "attempt": int(call["attempt"]) if call.get("attempt") is not None else None,
            "call": int(call.get("call_index") or 0),
            "decide": str(WaitRef.of(call)),
        }
        if call
        else None,
        "startedAt": _iso(run.started_at),
        "finishedAt": _iso(run.finished_at),
        "conditions": merge_conditions(
            (previous or {}).get("conditions"), conditions_for(run, db_up, quota), generation
        ),
    })


def normalised(status: dict[str, Any]) -> dict[str, Any]:
    """``status`` through the CRD's model: known fields only, no ``None`` anywhere."""
    model = AgentRunStatus.model_validate(status)
    return model.model_dump(mode="json", by_alias=True, exclude_none=True)


def same_status(a: dict[str, Any] | None, b: dict[str, Any]) -> bool:
    """Equal but for condition timestamps (which merge_conditions carries over anyway) and for
    absent vs ``None`` fields (the API server drops nulls; a restart must not re-patch)."""
    if a is None:
        return False
    a, b = normalised(a), normalised(b)

    def strip(s: dict[str, Any]) -> dict[str, Any]:
        conds = [{k: v for k, v in c.items() if k != "lastTransitionTime"}
                 for c in s.get("conditions") or []]
        return {**{k: v for k, v in s.items() if k != "conditions"}, "conditions": conds}

    return strip(a) == strip(b)


# -- events ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Snapshot:
    """What the operator last saw of a run: enough to tell which transition happened."""

    status: str
    epoch: int
    worker: str | None
    attempt: int
    #: The wait a waiting run is stopped on (agentrun/waits.py's token: step, call and the
    #: attempt of an outcome-unknown wait): a new wait (approve, claim, the step's next
    #: irreversible call, or the same call's approved re-run dying again, inside one flush
    #: window) shows only as a different token.
    pending: str | None = None

    @classmethod
    def of(cls, run: Run) -> Snapshot:
        call = run.pending_call if run.status == "waiting_approval" else None
        pending = str(WaitRef.of(call)) if call and call.get("seq") is not None else None
        return cls(run.status, run.lease_epoch, run.lease_owner, run.attempt, pending)

    @classmethod
    def from_status(cls, status: dict[str, Any] | None) -> Snapshot | None:
        """From an object's ``.status`` (an operator restart): no event is repeated."""
        if not status or not status.get("phase"):
            return None
        pending = status.get("pendingApproval") or {}
        return cls(
            str(status["phase"]),
            -1,  # unknown: a claim seen later is told by the worker, not the epoch
            status.get("worker"),
            int(status.get("attempt") or 0),
            # A status written before the token existed: its wait is told again, once.
            str(pending["decide"]) if pending.get("decide") is not None else None,
        )


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: Reason
    message: str


def transitions(old: Snapshot | None, run: Run) -> list[Event]:
    """The Kubernetes Events for the change from ``old`` to ``run`` (coalesced: intermediate
    states may have been skipped, so this reasons on epochs and workers, not single steps)."""
    new = Snapshot.of(run)
    if old == new:
        return []
    out: list[Event] = []
    claimed_again = new.status == "running" and (
        (old is None and new.epoch >= 1)
        or (old is not None and old.epoch >= 0 and new.epoch > old.epoch)
        or (
            old is not None
            and old.epoch < 0
            and (old.status, old.worker) != ("running", new.worker)
        )
    )
    # A hand-over whose claim the operator never saw running: the new holder finished the run
    # (or it waits for a human) before the operator looked. The store's record of the claim
    # still tells it, and a drained pod's runs must each say they were handed over (seen on a
    # real node under load: the drain's runs ended before the operator's next look).
    handed_unseen = (
        not claimed_again
        and old is not None
        and 0 <= old.epoch < new.epoch
        and new.status != "running"
        and (run.handover or {}).get("epoch") == run.lease_epoch
        and (run.handover or {}).get("kind") in ("handed_over", "lease_expired")
    )
    if claimed_again or handed_unseen:
        out.append(_claim_event(run))
    waits_anew = new.status == "waiting_approval" and (
        old is None or old.status != new.status or old.pending != new.pending
    )
    if waits_anew:
        wait = WaitRef.of(run.pending_call or {})  # the call named: see agentrun/waits.py
        out.append(Event(
            "Warning", Reason.WAITING_FOR_APPROVAL,
            one_line(f"{run.wait_reason or 'approval required'}; decide with: kubectl annotate "
                     f"agentrun {run.k8s_name} -n {run.k8s_namespace} "
                     f"agentrun.dev/approve={wait} (or agentrun.dev/reject={wait})", 1000),
        ))
    elif new.status != (old.status if old else None):
        if new.status == "dead_letter":
            out.append(Event(
                "Warning", Reason.DEAD_LETTERED,
                one_line(f"gave up after {run.attempt} attempts: {run.error or ''}", 1000),
            ))
        elif new.status == "succeeded":
            out.append(Event("Normal", Reason.FINISHED, one_line(
                f"succeeded after {run.next_seq} steps: {run.result or ''}", 1000)))
        elif new.status == "failed":
            out.append(Event("Warning", Reason.FAILED, one_line(run.error or "failed", 1000)))
        elif new.status == "cancelled":
            out.append(Event("Normal", Reason.CANCELLED, one_line(run.error or "cancelled", 1000)))
    return out


def _claim_event(run: Run) -> Event:
    """The Event of the claim ``run`` is under now. What happened before it is read from the
    store's record of that claim (migration 0009), never from what the operator remembers: the
    operator sees changes coalesced (a release and the next claim 10 ms apart look like one
    change of worker) and forgets everything when it restarts. The step named is where the claim
    resumed, not where the run is when the operator gets to it."""
    h = run.handover or {}
    if h.get("epoch") != run.lease_epoch:
        h = {}  # a record of an earlier claim: this one followed no holder (abandon, approval)
    taker = h.get("to") or run.lease_owner  # the record's: a finished run has no holder
    if h.get("kind") == "handed_over":
        return Event(
            "Normal", Reason.HANDED_OVER,
            one_line(f"{h.get('from')} handed the run over at step {h.get('step')}; resumed by "
                     f"{taker} (attempt {run.attempt})", 1000),
        )
    if h.get("kind") == "lease_expired":
        return Event(
            "Warning", Reason.LEASE_EXPIRED,
            one_line(f"{h.get('from')} stopped renewing its lease; resumed by {taker} "
                     f"at step {h.get('step')} (attempt {run.attempt})", 1000),
        )
    if run.lease_epoch > 1:  # every claim bumps the epoch
        return Event(
            "Normal", Reason.RESUMED,
            f"resumed by {run.lease_owner} at step {run.claim_seq} (attempt {run.attempt})",
        )
    return Event("Normal", Reason.CLAIMED, f"claimed by {run.lease_owner}")
