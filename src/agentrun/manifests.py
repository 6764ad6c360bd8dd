"""The manifests users write: ``Agent``, ``AgentRun`` and ``AgentRunApproval`` (group agentrun.dev,
version v1alpha1).

The same YAML works with ``kubectl apply`` and with ``agentrun submit -f``. These pydantic models
are the one definition of their fields: the CLI validates with them, the operator resolves with
them, and the CRDs' schemas are generated from them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from agentrun.errors import ConfigError
from agentrun.vocabulary import ApprovalDecision
from agentrun.waits import MAX_SEQ, WaitRef

API_VERSION = "agentrun.dev/v1alpha1"


#: Bounds of the free strings. They keep an object well inside what etcd, kubectl's
#: last-applied annotation and the operator's bookkeeping can hold (a 300 KB task was admitted
#: and wedged the operator), and they bound the cost the API server estimates for the CRDs' CEL
#: rules (``self == oldSelf`` compares every string). Counted in characters, as Kubernetes'
#: maxLength and pydantic's max_length both count them.
MAX_TEXT = 65536  # task, system prompt
MAX_NAME = 253  # a Kubernetes object name (DNS subdomain); also a model id
#: An object name another object refers to (a DNS subdomain, RFC 1123), checked where the name
#: goes into an API path: "." named the namespace's list, "a/status" a subresource.
OBJECT_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
MAX_TOOLS = 128
#: The worker registry's tool names (agentrun.tools._TOOL_NAME_RE): no other name can be served.
TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_-]+$"
MAX_TOOL_NAME = 64
#: A pool names a worker Deployment and a label value: a DNS label.
POOL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
MAX_POOL = 63

_POOL_RE = re.compile(POOL_PATTERN)


def pool_problem(pool: str) -> str | None:
    """What is wrong with a pool name (None: nothing). A pool names a Deployment and rides in
    every run-ready notification, whose payload PostgreSQL caps at 8000 bytes."""
    if len(pool) > MAX_POOL or not _POOL_RE.match(pool):
        return (
            f"must be a DNS label of at most {MAX_POOL} characters (lower-case letters, digits "
            "and '-', starting and ending with a letter or digit), as spec.pool"
        )
    return None


#: The rules JSON schema cannot say; the CRDs state them as CEL (agentrun.operator.crds) with
#: these messages, so ``kubectl apply`` and ``agentrun submit -f`` word a refusal alike.
NEITHER_MESSAGE = "give name (an Agent in this namespace) or an inline agent with model"
REFERENCE_MESSAGE = (
    "a reference (name) takes no inline agent fields ({fields}): set them on the Agent, or drop "
    "name to run an inline agent; spec.pool overrides the Agent's pool"
)
BUDGET_MESSAGE = (
    "must be less than maxTokens ({max_tokens}): the Messages API requires "
    "budget_tokens < max_tokens"
)


#: A run's limits when its manifest (or the caller) gives none: one definition for the CRD, the
#: store and the client.
DEFAULT_MAX_STEPS = 50
DEFAULT_MAX_ATTEMPTS = 8
#: max_tokens of each model call when the agent gives none.
DEFAULT_MAX_TOKENS = 8192

#: Where the Messages API is served: Anthropic's own API, Amazon Bedrock or Google Vertex AI,
#: each through the SDK's own client. The worker takes the provider's settings and credentials
#: from its own environment and pod identity (docs/worker.md, "Providers"), never from a spec.
Provider = Literal["anthropic", "bedrock", "vertex"]
PROVIDERS: tuple[Provider, ...] = ("anthropic", "bedrock", "vertex")
DEFAULT_PROVIDER: Provider = "anthropic"


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, protected_namespaces=())


class ThinkingSpec(_Spec):
    budget_tokens: int = Field(
        alias="budgetTokens",
        ge=1024,
        description="Extended thinking budget in tokens (at least 1024, less than maxTokens).",
    )


#: The largest budget a manifest may state: far above any run, well inside int64 and a float.
MAX_BUDGET_TOKENS = 10**12
MAX_BUDGET_USD = 1e6


class BudgetSpec(_Spec):
    """What a run may spend in all. Checked by the worker before each model turn: a run that has
    reached its budget, or whose next turn would pass it, fails there, never in a tool."""

    max_tokens: int | None = Field(
        None,
        alias="maxTokens",
        ge=1,
        le=MAX_BUDGET_TOKENS,
        description="Tokens the run may use in all: input, output, prompt-cache reads and "
        "writes of every model turn. Unset: no limit.",
    )
    max_cost_usd: float | None = Field(
        None,
        alias="maxCostUSD",
        gt=0,
        le=MAX_BUDGET_USD,
        description="Estimated US dollars the run may spend (the worker's price table). "
        "Unset: no limit.",
    )

    def over(self, base: BudgetSpec | None) -> BudgetSpec:
        """This budget with ``base``'s limits where this one sets none (a run over its Agent)."""
        if base is None:
            return self
        return BudgetSpec(
            max_tokens=self.max_tokens if self.max_tokens is not None else base.max_tokens,
            max_cost_usd=self.max_cost_usd if self.max_cost_usd is not None else base.max_cost_usd,
        )


ToolName = Annotated[str, Field(min_length=1, max_length=MAX_TOOL_NAME, pattern=TOOL_NAME_PATTERN)]


class AgentSpec(_Spec):
    """What an agent sends besides its conversation. Pinned into every run created from it."""

    model: str = Field(
        min_length=1,
        max_length=MAX_NAME,
        description="Model id, pinned into every run, in the provider's form: "
        "claude-sonnet-4-5 (anthropic), anthropic.claude-sonnet-4-5-20250929-v1:0 or an "
        "inference profile such as us.anthropic.claude-sonnet-4-5-20250929-v1:0 (bedrock), "
        "claude-sonnet-4-5@20250929 (vertex).",
    )
    provider: Provider = Field(
        DEFAULT_PROVIDER,
        description="Where the model is called: anthropic (the Anthropic API, key from the "
        "worker's ANTHROPIC_API_KEY), bedrock (Amazon Bedrock: AWS_REGION and the pod's AWS "
        "identity) or vertex (Google Vertex AI: CLOUD_ML_REGION, ANTHROPIC_VERTEX_PROJECT_ID "
        "and the pod's Google identity). Settings and credentials come from the worker pool's "
        "environment, never from this spec. Pinned into every run.",
    )
    system: str = Field(
        "", max_length=MAX_TEXT, description="System prompt, pinned into every run."
    )
    tools: list[ToolName] = Field(
        default_factory=list,
        max_length=MAX_TOOLS,
        description="Names of tools the worker registry provides.",
    )
    max_tokens: int = Field(
        DEFAULT_MAX_TOKENS, alias="maxTokens", ge=1, le=128000,
        description="max_tokens of each model call.",
    )
    thinking: ThinkingSpec | None = Field(None, description="Extended thinking, optional.")
    pool: str = Field(
        "default",
        min_length=1,
        max_length=MAX_POOL,
        pattern=POOL_PATTERN,
        description="Worker pool that runs this agent's runs (a DNS label).",
    )
    require_approval: bool = Field(
        False,
        alias="requireApproval",
        description="Every irreversible tool call waits for agentrun approve (or the "
        "agentrun.dev/approve annotation) before it runs.",
    )

    prompt_caching: bool = Field(
        True,
        alias="promptCaching",
        description="Mark the tools, the system prompt and the history as cacheable "
        "(cache_control breakpoints), so each turn reads the previous turn's prefix from the "
        "provider's prompt cache, also after a resume.",
    )

    budget: BudgetSpec | None = Field(
        None,
        description="Default spending limits of every run of this agent (an AgentRun's "
        "spec.budget overrides each limit it sets).",
    )

    @field_validator("thinking")
    @classmethod
    def _budget_below_max_tokens(
        cls, thinking: ThinkingSpec | None, info: ValidationInfo
    ) -> ThinkingSpec | None:
        max_tokens = info.data.get("max_tokens")  # absent when maxTokens itself was invalid
        if thinking is not None and max_tokens is not None and thinking.budget_tokens >= max_tokens:
            # Raised as a ValidationError so the error's location is the field itself
            # (…thinking.budgetTokens), as the API server's fieldPath names it.
            raise ValidationError.from_exception_data(
                "ThinkingSpec",
                [
                    InitErrorDetails(
                        type=PydanticCustomError(
                            "budget_tokens", BUDGET_MESSAGE, {"max_tokens": max_tokens}
                        ),
                        loc=("budgetTokens",),
                        input=thinking.budget_tokens,
                    )
                ],
            )
        return thinking

    def pinned(self) -> dict[str, Any]:
        """The JSON stored on the run row (camelCase, as in the manifest)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class PinnedAgentSpec(AgentSpec):
    """An agent spec as pinned on a run (:meth:`AgentSpec.pinned`), read back by the worker.

    A run keeps the spec it was created with, by whichever release: a key an older release did
    not pin takes its default (runs pinned before providers, prompt caching or budgets), and a
    key this release does not know (pinned by a newer one, read during a rollout or after a
    rollback of the image) is ignored, as the worker ignored it when it read the raw keys."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True, protected_namespaces=())


def inline_fields() -> list[str]:
    """The inline agent's fields as a manifest spells them (camelCase)."""
    return [f.alias or name for name, f in AgentSpec.model_fields.items()]


class AgentRef(_Spec):
    name: str = Field(
        min_length=1, max_length=MAX_NAME, description="Name of an Agent in the same namespace."
    )


def _agent_kind(value: Any) -> str:
    """Which member of the agent union validates ``value``: only its errors are reported, not
    both members' (an inline agent's bad budget is not also "name: Field required")."""
    if isinstance(value, AgentRef) or (isinstance(value, dict) and "name" in value):
        return "AgentRef"
    return "AgentSpec"


class AgentRunSpec(_Spec):
    # The tags are the class names: error locations drop them (see _fmt_errors).
    agent: Annotated[
        Annotated[AgentRef, Tag("AgentRef")] | Annotated[AgentSpec, Tag("AgentSpec")],
        Discriminator(_agent_kind),
    ] = Field(description="A reference {name: ...} to an Agent, or an inline agent spec.")
    task: str = Field(
        min_length=1, max_length=MAX_TEXT, description="The task: the first user message."
    )
    max_steps: int = Field(
        DEFAULT_MAX_STEPS,
        alias="maxSteps",
        ge=1,
        le=10000,
        description="Model turns allowed before the run fails.",
    )
    max_attempts: int = Field(
        DEFAULT_MAX_ATTEMPTS,
        alias="maxAttempts",
        ge=1,
        le=100,
        description="Claims allowed before the run is dead-lettered.",
    )
    pool: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_POOL,
        pattern=POOL_PATTERN,
        description="Overrides the agent's pool (a DNS label).",
    )
    budget: BudgetSpec | None = Field(
        None,
        description="Spending limits of this run; each limit set here overrides the Agent's.",
    )
    ttl_seconds_after_finished: int | None = Field(
        None,
        alias="ttlSecondsAfterFinished",
        ge=0,
        le=10 * 365 * 86400,
        description="Delete the AgentRun object this long after its run finished (the "
        "operator does; the run's rows stay in the store until agentrun prune). "
        "Unset: kept.",
    )

    def resolved_agent(self, agent: AgentSpec) -> AgentSpec:
        """``agent`` with this run's budget over its own: the spec the run is pinned to, which
        the worker reads its limits from."""
        if self.budget is None:
            return agent
        return agent.model_copy(update={"budget": self.budget.over(agent.budget)})

    @field_validator("agent", mode="before")
    @classmethod
    def _reference_or_inline(cls, value: Any) -> Any:
        # Before the union: a reference with inline fields would otherwise fail as AgentRef with
        # "extra inputs", one field at a time, without saying why.
        if not isinstance(value, dict):
            return value
        if "name" not in value and "model" not in value:
            raise PydanticCustomError("agent_kind", NEITHER_MESSAGE)
        if "name" in value:
            # Either spelling: the models populate by field name too.
            inline = [
                f.alias or name
                for name, f in AgentSpec.model_fields.items()
                if name in value or f.alias in value
            ]
            if inline:
                raise PydanticCustomError(
                    "agent_kind", REFERENCE_MESSAGE, {"fields": ", ".join(inline)}
                )
        return value


#: An approval's free-text reason: one or two sentences for the step log and the Event.
MAX_REASON = 1024
#: A Kubernetes user name as the API server reports it (``system:serviceaccount:NS:NAME`` is at
#: most 16 + 63 + 1 + 253 characters; an OIDC or certificate name is shorter in practice).
MAX_USERNAME = 512


class AgentRunApprovalSpec(_Spec):
    """A human decision on the call an AgentRun waits on. Created by an approver (RBAC grants
    ``create`` on agentrunapprovals to approvers only); the chart's ValidatingAdmissionPolicy
    admits it only when ``approver`` is the name the API server authenticated the request as."""

    agent_run: str = Field(
        alias="agentRun",
        min_length=1,
        max_length=MAX_NAME,
        pattern=OBJECT_NAME_PATTERN,
        description="Name of the AgentRun (in the same namespace) whose call is decided.",
    )
    seq: int = Field(
        ge=0,
        le=MAX_SEQ,
        description="The step the run waits on (its .status.pendingApproval.seq).",
    )
    call: int | None = Field(
        None,
        ge=0,
        le=MAX_SEQ,
        description="The call of that step the run waits on (.status.pendingApproval.call). "
        "Without it the decision is refused once the step has had one: it could be meant for "
        "an earlier call of the step.",
    )
    attempt: int | None = Field(
        None,
        ge=1,
        le=MAX_SEQ,
        description="For an outcome-unknown wait (.status.pendingApproval.attempt), the attempt "
        "decided; with call only.",
    )
    decision: ApprovalDecision = Field(
        description="approve: the call runs; reject: the model is told it was rejected."
    )
    reason: str | None = Field(
        None, max_length=MAX_REASON, description="Why, recorded with the decision."
    )
    approver: str = Field(
        min_length=1,
        max_length=MAX_USERNAME,
        description="Who decides: must be the user creating the object, as the API server "
        "authenticated them (the chart's admission policy refuses any other name).",
    )

    @model_validator(mode="after")
    def _attempt_with_call(self) -> AgentRunApprovalSpec:
        if self.attempt is not None and self.call is None:
            raise ValueError("attempt names an attempt of a call: set call too")
        return self

    @property
    def wait(self) -> WaitRef:
        """The wait this decision answers."""
        return WaitRef(self.seq, self.call, self.attempt)


class Metadata(BaseModel):
    model_config = ConfigDict(extra="allow")
    # Kubernetes' own bounds: an object name is a DNS subdomain, a namespace a DNS label.
    name: str = Field(min_length=1, max_length=MAX_NAME)
    namespace: str | None = Field(None, max_length=MAX_POOL)


class AgentManifest(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    api_version: str = Field(alias="apiVersion")
    kind: str
    metadata: Metadata
    spec: AgentSpec


class AgentRunManifest(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    api_version: str = Field(alias="apiVersion")
    kind: str
    metadata: Metadata
    spec: AgentRunSpec


@dataclass(frozen=True)
class ResolvedRun:
    """An AgentRun with its agent resolved: what the store needs to create the run."""

    name: str
    task: str
    agent: AgentSpec
    pool: str
    max_steps: int
    max_attempts: int
    #: metadata.namespace (None: not given; ``agentrun submit`` then uses "default", as
    #: ``kubectl apply`` does in a context without a namespace).
    namespace: str | None = None


def _fmt_errors(where: str, err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"] if not str(x).startswith(("AgentRef", "AgentSpec")))
        parts.append(f"{loc}: {e['msg']}")
    return f"{where}: " + "; ".join(parts)


def resolve(run: AgentRunManifest, agents: dict[str, AgentSpec]) -> ResolvedRun:
    spec = run.spec
    if isinstance(spec.agent, AgentRef):
        agent = agents.get(spec.agent.name)
        if agent is None:
            known = ", ".join(sorted(agents)) or "none given"
            raise ConfigError(
                f"AgentRun {run.metadata.name}: spec.agent.name: no Agent named "
                f"{spec.agent.name!r} (Agents given: {known}); pass its manifest with another -f"
            )
    else:
        agent = spec.agent
    return ResolvedRun(
        name=run.metadata.name,
        task=spec.task,
        agent=spec.resolved_agent(agent),
        pool=spec.pool or agent.pool,
        max_steps=spec.max_steps,
        max_attempts=spec.max_attempts,
        namespace=run.metadata.namespace,
    )


#: The most a manifest file may hold: far more than any Agent and AgentRun documents (the API
#: server takes objects up to about 1.5 MB), and read no further, so `-f /dev/zero` or a log file
#: given by mistake is refused instead of filling the memory.
MAX_MANIFEST_BYTES = 16 * 1024 * 1024


def load_manifests(paths: list[str]) -> list[ResolvedRun]:
    """Read Agent and AgentRun documents from YAML files; resolve each AgentRun's agent."""
    texts: list[tuple[str, str]] = []
    for path in paths:
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_MANIFEST_BYTES + 1)
            if len(raw) > MAX_MANIFEST_BYTES:
                raise ConfigError(f"{path}: larger than {MAX_MANIFEST_BYTES // 2**20} MiB; a "
                                  "manifest holds Agent and AgentRun documents")
            texts.append((path, raw.decode("utf-8")))
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            # A lone surrogate written out (CESU-8, ED A0 80) lands here too: no UTF-8 text.
            raise ConfigError(
                f"{path}: not UTF-8 text (byte {exc.start}: {exc.object[exc.start:exc.end]!r}); "
                "save it as UTF-8"
            ) from None
    return load_manifest_texts(texts)


def one_run_per_key(resolved: list[ResolvedRun], key: str | None, field: str) -> None:
    """Refuse an idempotency key (``field``) for a manifest of several AgentRuns: a key names one
    run, so every AgentRun after the first was "created" as the first one's run and never made."""
    if key is not None and len(resolved) > 1:
        raise ConfigError(f"{field}: the manifest has {len(resolved)} AgentRuns and a key names "
                          "one run; submit them one at a time")


def load_manifest_texts(texts: list[tuple[str, str]]) -> list[ResolvedRun]:
    """:func:`load_manifests` of YAML texts already read: (where it came from, its text)."""
    agents: dict[str, AgentSpec] = {}
    runs: list[AgentRunManifest] = []
    for path, text in texts:
        try:
            docs = [d for d in yaml.safe_load_all(text) if d is not None]
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
        for i, doc in enumerate(docs):
            where = f"{path} (document {i + 1})"
            if not isinstance(doc, dict):
                raise ConfigError(f"{where}: expected a mapping with apiVersion, kind, metadata")
            kind = doc.get("kind")
            if doc.get("apiVersion") != API_VERSION:
                raise ConfigError(
                    f"{where}: apiVersion is {doc.get('apiVersion')!r}; expected {API_VERSION!r}"
                )
            try:
                if kind == "Agent":
                    agent = AgentManifest.model_validate(doc)
                    agents[agent.metadata.name] = agent.spec
                elif kind == "AgentRun":
                    runs.append(AgentRunManifest.model_validate(doc))
                else:
                    raise ConfigError(f"{where}: kind is {kind!r}; expected Agent or AgentRun")
            except ValidationError as exc:
                name = (doc.get("metadata") or {}).get("name", "?")
                raise ConfigError(_fmt_errors(f"{where}: {kind} {name}", exc)) from None
    if not runs:
        raise ConfigError(f"{', '.join(p for p, _ in texts)}: no AgentRun document found")
    return [resolve(r, agents) for r in runs]
