"""The operator's Kubernetes API, in one place (as CloudNativePG's ``api/v1``): the group and
version, the resources' plurals, the annotations users act through, the status models (the CRD
generator, :mod:`agentrun.operator.crds`, makes the schemas from these, and the status mirror
builds every status through them), and the condition types, reasons and phases as constants.
Conditions, Events and the mirror name these, never a string of their own (a test scans the
operator's code for one).

The run's own words (its status, which is the AgentRun's phase) live in
:mod:`agentrun.vocabulary`; the phase enum and the terminal reasons are built from them.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from agentrun.manifests import API_VERSION
from agentrun.vocabulary import PHASES

#: The API group and version of every kind (apiVersion agentrun.dev/v1alpha1, as manifests
#: are validated against).
GROUP, _, VERSION = API_VERSION.partition("/")

AGENTRUNS_PLURAL = "agentruns"
AGENTS_PLURAL = "agents"
APPROVALS_PLURAL = "agentrunapprovals"
#: (group, version, plural), as kopf's handlers name a resource.
AGENTRUNS = (GROUP, VERSION, AGENTRUNS_PLURAL)
AGENTS = (GROUP, VERSION, AGENTS_PLURAL)
APPROVALS = (GROUP, VERSION, APPROVALS_PLURAL)

#: Annotations on an AgentRun that act on its run (operator/handlers.py); consumed once done.
CANCEL = "agentrun.dev/cancel"
APPROVE = "agentrun.dev/approve"
REJECT = "agentrun.dev/reject"
RETRY = "agentrun.dev/retry"
ACTIONS = (CANCEL, APPROVE, REJECT, RETRY)


class CondType(StrEnum):
    """The condition types an AgentRun and an AgentRunApproval carry (metav1.Condition
    ``type``)."""

    ACCEPTED = "Accepted"
    WAITING_FOR_APPROVAL = "WaitingForApproval"
    COMPLETED = "Completed"
    DATABASE_AVAILABLE = "DatabaseAvailable"
    #: kstatus and Argo CD read ``Ready``: True once the run has succeeded.
    READY = "Ready"
    #: AgentRunApproval: True once its decision is recorded.
    APPLIED = "Applied"


class Reason(StrEnum):
    """Condition reasons and Event reasons (CamelCase, as Kubernetes spells them)."""

    RUN_CREATED = "RunCreated"
    AGENT_NOT_FOUND = "AgentNotFound"
    #: The run's pool does not admit the AgentRun's namespace (agentrun.operator.tenancy).
    POOL_NOT_ALLOWED = "PoolNotAllowed"
    #: Pending while its namespace has its quota of running runs (the claim passes it over).
    QUOTA_EXCEEDED = "QuotaExceeded"
    #: Warning at apply time: the Agent asks for tools its pool's workers did not register.
    UNKNOWN_TOOL = "UnknownTool"
    INVALID_SPEC = "InvalidSpec"
    APPROVAL_REQUIRED = "ApprovalRequired"
    NOT_WAITING = "NotWaiting"
    IN_PROGRESS = "InProgress"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    CANCELLED = "Cancelled"
    DEAD_LETTERED = "DeadLettered"
    CONNECTED = "Connected"
    DATABASE_UNAVAILABLE = "DatabaseUnavailable"
    WAITING_FOR_APPROVAL = "WaitingForApproval"
    # Events only
    CREATED = "Created"
    CLAIMED = "Claimed"
    RESUMED = "Resumed"
    HANDED_OVER = "HandedOver"
    FINISHED = "Finished"
    APPROVED = "Approved"
    REJECTED = "Rejected"
    ACTION_REFUSED = "ActionRefused"
    CANCEL_IGNORED = "CancelIgnored"
    RETRIED = "Retried"
    EXPIRED = "Expired"
    #: AgentRunApproval: the decision was recorded (condition Applied=True) or not (Warning
    #: Event, condition Applied=False); Pending while the database does not answer.
    APPROVAL_APPLIED = "Applied"
    APPROVAL_REFUSED = "ApprovalRefused"
    APPROVAL_PENDING = "Pending"
    #: Warning: the holder's lease ran out (SIGKILL, OOM kill, node loss); another worker took
    #: the run over. A graceful release is HANDED_OVER (Normal).
    LEASE_EXPIRED = "LeaseExpired"


class ApprovalPhase(StrEnum):
    """An AgentRunApproval's phase: Pending until the operator acted on it, then Applied (the
    decision is recorded in the store) or Refused (it was not: .status.message says why)."""

    PENDING = "Pending"
    APPLIED = "Applied"
    REFUSED = "Refused"


#: The reason a finished run's conditions carry, by its status (every terminal status of
#: agentrun.vocabulary: tests/test_operator_status.py checks it).
TERMINAL_REASONS: dict[str, Reason] = {
    "succeeded": Reason.SUCCEEDED,
    "failed": Reason.FAILED,
    "cancelled": Reason.CANCELLED,
    "dead_letter": Reason.DEAD_LETTERED,
}


#: Status strings: the operator truncates what it writes (operator/status.py: 1 KiB for result and
#: error, 80 to 300 characters for one-line texts); these bounds sit well above that, and above
#: any id or name it copies (a worker id is a hostname plus a pid), so a status never fails on
#: them, while a hand-written status cannot grow without end.
STATUS_TEXT = 4096
STATUS_LINE = 1024


def _text(limit: int, description: str | None = None, alias: str | None = None) -> Any:
    return Field(None, alias=alias, max_length=limit, description=description)


class PendingApproval(BaseModel):
    seq: int = Field(description="Step of the tool call waiting for a decision.")
    tool: str = Field(max_length=STATUS_LINE, description="The tool it would call.")
    arguments: str = Field(max_length=STATUS_LINE, description="Its arguments, summarised.")
    reason: str = Field(
        max_length=STATUS_LINE,
        description="Why it waits (approval required, or outcome unknown).",
    )
    attempt: int | None = Field(
        None,
        description="For an outcome-unknown wait, the execution attempt the decision is about: "
        "one decision buys one more attempt, so a call whose approved re-run also died waits "
        "again on the same seq with the next attempt.",
    )
    call: int | None = Field(
        None, description="Which call of the step (a step may hold several that wait)."
    )
    decide: str | None = Field(
        None,
        max_length=64,
        description="The value that decides this wait and no other: <seq>.<call>, or "
        "<seq>.<call>.<attempt> after an unknown outcome (agentrun.dev/approve=<decide>).",
    )


class Condition(BaseModel):
    """A standard Kubernetes condition: metav1.Condition's fields, bounds and patterns."""

    model_config = ConfigDict(populate_by_name=True)
    type: str = Field(
        max_length=316,
        pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
        r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$",
        description="Type of condition in CamelCase.",
    )
    status: str = Field(json_schema_extra={"enum": ["True", "False", "Unknown"]})
    observed_generation: int | None = Field(
        None,
        alias="observedGeneration",
        ge=0,
        description="The .metadata.generation the condition was set for.",
    )
    last_transition_time: str = Field(
        alias="lastTransitionTime",
        json_schema_extra={"format": "date-time"},
        description="When the condition last changed from one status to another.",
    )
    reason: str = Field(
        min_length=1,
        max_length=1024,
        pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
        description="Why, in CamelCase, for machines.",
    )
    message: str = Field(max_length=32768, description="Why, for humans; may be empty.")


class TokenUsage(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    input: int = 0
    output: int = 0
    cache_read: int = Field(0, alias="cacheRead", description="Prompt-cache tokens read.")
    cache_write: int = Field(0, alias="cacheWrite", description="Prompt-cache tokens written.")


class AgentRunStatus(BaseModel):
    """Mirrored from the run store by the operator; never written by users."""

    model_config = ConfigDict(populate_by_name=True)
    run_id: str | None = _text(STATUS_LINE, "The run's id in the store.", alias="runId")
    phase: str | None = Field(
        None,
        description=", ".join(PHASES) + ".",
        json_schema_extra={"enum": list(PHASES)},
    )
    step: int | None = Field(None, description="Steps committed so far.")
    attempt: int | None = Field(None, description="Claims so far.")
    worker: str | None = _text(STATUS_LINE, "The worker holding the run.")
    model: str | None = _text(STATUS_LINE, "The pinned model.")
    provider: str | None = _text(
        STATUS_LINE, "Where the model is called: anthropic, bedrock or vertex (pinned)."
    )
    prompt_version: str | None = _text(STATUS_LINE, alias="promptVersion")
    tokens: TokenUsage | None = None
    cost_usd: float | None = Field(
        None,
        alias="costUSD",
        description="Estimated US dollars spent, each model turn priced by the worker that ran "
        "it.",
    )
    result: str | None = _text(STATUS_TEXT, "The final answer, truncated.")
    error: str | None = _text(STATUS_TEXT)
    message: str | None = _text(STATUS_LINE, "One line for kubectl get.")
    pending_approval: PendingApproval | None = Field(None, alias="pendingApproval")
    started_at: str | None = _text(64, alias="startedAt")
    finished_at: str | None = _text(64, alias="finishedAt")
    observed_generation: int | None = Field(None, alias="observedGeneration")
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=32,
        # A map keyed by type, as metav1.Conditions are: one condition per type, and a
        # server-side apply merges conditions by type instead of replacing the list.
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
        },
    )


#: The approval's phase enum in the CRD.
APPROVAL_PHASES: list[JsonValue] = list(ApprovalPhase)


class ApprovalCall(BaseModel):
    """Which call of the step the decision is about, as the run's pending call named it."""

    model_config = ConfigDict(populate_by_name=True)
    tool: str = Field(max_length=STATUS_LINE, description="The tool it would call.")
    index: int = Field(ge=0, description="Its index among the step's tool calls.")
    stage: str = Field(
        description="before_call, or outcome_unknown (its worker died mid-call).",
        json_schema_extra={"enum": ["before_call", "outcome_unknown"]},
    )
    attempt: int = Field(ge=1, description="The execution attempt the decision authorises.")


class AgentRunApprovalStatus(BaseModel):
    """Written by the operator once it acted on the approval; never written by users."""

    model_config = ConfigDict(populate_by_name=True)
    phase: str | None = Field(
        None,
        description="Pending (not acted on yet), Applied (the decision is recorded and the run "
        "resumes), Refused (not recorded: message says why).",
        json_schema_extra={"enum": APPROVAL_PHASES},
    )
    message: str | None = _text(STATUS_LINE, "One line: what was done, or why not.")
    run_id: str | None = _text(STATUS_LINE, "The run decided on (its id in the store).",
                               alias="runId")
    decided_at: str | None = _text(64, "When the decision was recorded.", alias="decidedAt")
    call: ApprovalCall | None = Field(
        None,
        description="The call decided. Written before the decision is recorded, so an operator "
        "restarted in between can tell whether it was.",
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=8,
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
        },
    )
