"""The words a run is described by: its status (the AgentRun's phase), its step kinds, why a
worker stops a run's task, and what a rollback ends as. One definition each; the store's
queries, the CRD's phase enum and the operator's terminal reasons are built from these.

Literal types, not enums: the values are the very strings PostgreSQL stores (text + CHECK),
JSON carries and users type (``agentrun list --status failed``, ``client.list_runs(status=
"failed")``), so nothing converts at any boundary, a call with a plain string keeps
type-checking (mypy rejects a misspelt one wherever the parameter is typed), and messages that
show a value (``{status!r}``) read as they always did. The tuples beside each type are the same
values at run time, for enums, CHECKs and loops (``typing.get_args`` of the Literal).
"""

from __future__ import annotations

from typing import Final, Literal, get_args

#: A run's status in the store, and the AgentRun's ``.status.phase`` (the same strings).
RunStatus = Literal[
    "pending", "running", "waiting_approval", "succeeded", "failed", "cancelled", "dead_letter"
]
#: A run that ended: it never changes again (but for a retry, which makes it live again).
TerminalStatus = Literal["succeeded", "failed", "cancelled", "dead_letter"]
#: A run that has not ended.
LiveStatus = Literal["pending", "running", "waiting_approval"]

RUN_STATUSES: Final[tuple[RunStatus, ...]] = get_args(RunStatus)
TERMINAL: Final[tuple[TerminalStatus, ...]] = get_args(TerminalStatus)
TERMINAL_STATUSES: Final[frozenset[str]] = frozenset(TERMINAL)
LIVE_STATUSES: Final[frozenset[str]] = frozenset(get_args(LiveStatus))

#: The AgentRun's phase is the run's status.
Phase = RunStatus
PHASES: Final[tuple[Phase, ...]] = RUN_STATUSES

#: A step of a run's log (``agent_step.kind``): a model turn, the results of its tool calls, a
#: user message, a note, and the compensation of an effect during a rollback.
StepKind = Literal["model_turn", "tool_result", "user", "note", "compensation"]
STEP_KINDS: Final[tuple[StepKind, ...]] = get_args(StepKind)

#: How a run changed hands (``run_handover.kind``): its holder released it, or the holder's
#: lease ran out and another claim took it.
HandoverKind = Literal["handed_over", "lease_expired"]

#: An irreversible call's recorded effect: its intent (before the call) or its outcome.
EffectState = Literal["intent", "done"]

#: Why a worker stops a run's task at once (``RunHandle.abort``): the run was cancelled, the
#: lease is no longer this worker's, the worker drains (hands the run over), or the heartbeat
#: found the run stalled (and gave the claim up).
AbortReason = Literal["cancelled", "lease lost", "drain", "stalled"]
ABORT_REASONS: Final[tuple[AbortReason, ...]] = get_args(AbortReason)

#: What a human decides about a call waiting for approval, as an AgentRunApproval's
#: ``spec.decision`` and the CLI's verbs spell it, and as the store records it.
ApprovalDecision = Literal["approve", "reject"]
Verdict = Literal["approved", "rejected"]
VERDICTS: Final[dict[ApprovalDecision, Verdict]] = {"approve": "approved", "reject": "rejected"}

#: What a rollback ends as: a cancel that asked for one ends cancelled; every other (a rejection
#: with abort, a tier-3 failure) ends failed.
RollbackEnd = Literal["cancelled", "failed"]

# The stored rollback reason (agent_run.rollback_reason): words for a human, as they always read.
# What the rollback ends as is stored beside it (agent_run.rollback_end, migration 0016), never
# read back from these words; the "failed: " mark on a failure that starts like a cancel's stays
# so that the words do not mislead a reader either.
_CANCELLED = "cancelled"
_FAILED = "failed: "


def rollback_reason(end: RollbackEnd, why: str | None = None) -> str:
    """The stored rollback reason of a rollback that ends as ``end``, for ``why``."""
    if end == "cancelled":
        return _CANCELLED + (f": {why}" if why else " with rollback")
    why = why or "rolled back"
    # A failure whose own text starts like a cancel's is marked, so it cannot read as one.
    return _FAILED + why if why.startswith(_CANCELLED) else why
