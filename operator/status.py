"""What an AgentRun's ``.status`` says, and which Kubernetes Events a change deserves. Pure.

The status is a function of the run row (and of whether the database answers), so a restarted
operator computes the same status again and patches nothing; only ``lastTransitionTime`` of a
condition carries over from what the object already shows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from agentrun.store import Run

#: ``.status.result`` and ``.status.error`` are truncated to this: objects live in etcd, the full
#: text in the store (``agentrun steps RUN``).
MAX_TEXT = 1024
MAX_MESSAGE = 80

TERMINAL_REASONS = {
    "succeeded": "Succeeded",
    "failed": "Failed",
    "cancelled": "Cancelled",
    "dead_letter": "DeadLettered",
}


def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _iso(value: datetime | None) -> str | None:
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ") if value else None


def truncate(text: str | None, limit: int) -> str | None:
    if text is None:
        return None
    return text if len(text) <= limit else text[: limit - 1] + "…"


def one_line(text: str, limit: int = MAX_MESSAGE) -> str:
    return truncate(" ".join(text.split()), limit) or ""


def summarise_arguments(args: Any, limit: int = 200) -> str:
    return truncate(json.dumps(args, sort_keys=True, ensure_ascii=False), limit) or ""


def message(run: Run) -> str:
    """One line for ``kubectl get agentruns``."""
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
    type: str
    status: bool
    reason: str
    message: str = ""


def conditions_for(run: Run, db_up: bool) -> list[Cond]:
    finished = run.finished
    waiting = run.status == "waiting_approval"
    return [
        Cond("Accepted", True, "RunCreated", f"run {run.id} in pool {run.pool}"),
        Cond(
            "WaitingForApproval",
            waiting,
            "ApprovalRequired" if waiting else "NotWaiting",
            one_line(run.wait_reason or "", 300) if waiting else "",
        ),
        Cond(
            "Completed",
            finished,
            TERMINAL_REASONS.get(run.status, "InProgress"),
            message(run) if finished else "",
        ),
        db_condition(db_up),
    ]


def db_condition(up: bool) -> Cond:
    return Cond(
        "DatabaseAvailable",
        up,
        "Connected" if up else "DatabaseUnavailable",
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
    previous: list[dict[str, Any]] | None, cond: Cond
) -> list[dict[str, Any]]:
    """``previous`` with one condition set (the others kept as they are)."""
    kept = [c for c in previous or [] if c.get("type") != cond.type]
    old = [c for c in previous or [] if c.get("type") == cond.type]
    return kept + merge_conditions(old, [cond])


def status_for(run: Run, *, db_up: bool, previous: dict[str, Any] | None) -> dict[str, Any]:
    """The whole ``.status`` for ``run`` (``previous``: what the object shows now)."""
    call = run.pending_call if run.status == "waiting_approval" else None
    return {
        "runId": str(run.id),
        "phase": run.status,
        "step": run.next_seq,
        "attempt": run.attempt,
        "worker": run.lease_owner if run.status == "running" else None,
        "model": run.model,
        "promptVersion": run.prompt_version,
        "tokens": {"input": run.input_tokens, "output": run.output_tokens},
        "result": truncate(run.result, MAX_TEXT),
        "error": truncate(run.error, MAX_TEXT),
        "message": message(run),
        "pendingApproval": {
            "seq": int(call["seq"]),
            "tool": str(call.get("tool")),
            "arguments": summarise_arguments(call.get("input")),
            "reason": one_line(run.wait_reason or "", 300),
        }
        if call
        else None,
        "startedAt": _iso(run.started_at),
        "finishedAt": _iso(run.finished_at),
        "conditions": merge_conditions(
            (previous or {}).get("conditions"), conditions_for(run, db_up)
        ),
    }


def same_status(a: dict[str, Any] | None, b: dict[str, Any]) -> bool:
    """Equal but for condition timestamps (which merge_conditions carries over anyway)."""
    if a is None:
        return False

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

    @classmethod
    def of(cls, run: Run) -> Snapshot:
        return cls(run.status, run.lease_epoch, run.lease_owner, run.attempt)

    @classmethod
    def from_status(cls, status: dict[str, Any] | None) -> Snapshot | None:
        """From an object's ``.status`` (an operator restart): no event is repeated."""
        if not status or not status.get("phase"):
            return None
        return cls(
            str(status["phase"]),
            -1,  # unknown: a claim seen later is told by the worker, not the epoch
            status.get("worker"),
            int(status.get("attempt") or 0),
        )


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
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
    if claimed_again:
        if old is not None and old.status == "running" and old.worker and old.worker != new.worker:
            out.append(Event(
                "Warning", "Resumed",
                f"{old.worker} stopped renewing its lease; resumed by {new.worker} at step "
                f"{run.next_seq} (attempt {run.attempt})",
            ))
        elif run.lease_epoch > 1:  # every claim bumps the epoch; a release keeps the attempt
            out.append(Event(
                "Normal", "Resumed", f"resumed by {new.worker} at step {run.next_seq}"
                f" (attempt {run.attempt})",
            ))
        else:
            out.append(Event("Normal", "Claimed", f"claimed by {new.worker}"))
    if new.status != (old.status if old else None):
        if new.status == "waiting_approval":
            call = run.pending_call or {}
            out.append(Event(
                "Warning", "WaitingForApproval",
                one_line(f"{run.wait_reason or 'approval required'}; decide with: kubectl annotate "
                         f"agentrun {run.k8s_name} agentrun.dev/approve={call.get('seq')} "
                         f"(or agentrun.dev/reject={call.get('seq')})", 1000),
            ))
        elif new.status == "dead_letter":
            out.append(Event(
                "Warning", "DeadLettered",
                one_line(f"gave up after {run.attempt} attempts: {run.error or ''}", 1000),
            ))
        elif new.status == "succeeded":
            out.append(Event("Normal", "Finished", one_line(
                f"succeeded after {run.next_seq} steps: {run.result or ''}", 1000)))
        elif new.status == "failed":
            out.append(Event("Warning", "Failed", one_line(run.error or "failed", 1000)))
        elif new.status == "cancelled":
            out.append(Event("Normal", "Cancelled", one_line(run.error or "cancelled", 1000)))
    return out
