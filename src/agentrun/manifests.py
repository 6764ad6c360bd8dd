"""The manifests users write: ``Agent`` and ``AgentRun`` (group agentrun.dev, version v1alpha1).

The same YAML works with ``kubectl apply`` and with ``agentrun submit -f``. These pydantic models
are the one definition of their fields: the CLI validates with them, the operator resolves with
them, and the CRDs' schemas are generated from them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agentrun.errors import ConfigError

API_VERSION = "agentrun.dev/v1alpha1"


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, protected_namespaces=())


class ThinkingSpec(_Spec):
    budget_tokens: int = Field(
        alias="budgetTokens",
        ge=1024,
        description="Extended thinking budget in tokens (at least 1024).",
    )


class AgentSpec(_Spec):
    """What an agent sends besides its conversation. Pinned into every run created from it."""

    model: str = Field(min_length=1, description="Model id, pinned into every run.")
    system: str = Field("", description="System prompt, pinned into every run.")
    tools: list[str] = Field(
        default_factory=list, description="Names of tools the worker registry provides."
    )
    max_tokens: int = Field(
        8192, alias="maxTokens", ge=1, le=128000, description="max_tokens of each model call."
    )
    thinking: ThinkingSpec | None = Field(None, description="Extended thinking, optional.")
    pool: str = Field(
        "default",
        min_length=1,
        max_length=63,
        description="Worker pool that runs this agent's runs.",
    )
    require_approval: bool = Field(
        False,
        alias="requireApproval",
        description="Every irreversible tool call waits for agentrun approve (or the "
        "agentrun.dev/approve annotation) before it runs.",
    )

    def pinned(self) -> dict[str, Any]:
        """The JSON stored on the run row (camelCase, as in the manifest)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class AgentRef(_Spec):
    name: str = Field(min_length=1, description="Name of an Agent in the same namespace.")


class AgentRunSpec(_Spec):
    agent: AgentRef | AgentSpec = Field(
        description="A reference {name: ...} to an Agent, or an inline agent spec."
    )
    task: str = Field(min_length=1, description="The task: the first user message.")
    max_steps: int = Field(
        50,
        alias="maxSteps",
        ge=1,
        le=10000,
        description="Model turns allowed before the run fails.",
    )
    max_attempts: int = Field(
        8,
        alias="maxAttempts",
        ge=1,
        le=100,
        description="Claims allowed before the run is dead-lettered.",
    )
    pool: str | None = Field(None, description="Overrides the agent's pool.")


class Metadata(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    namespace: str | None = None


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
        agent=agent,
        pool=spec.pool or agent.pool,
        max_steps=spec.max_steps,
        max_attempts=spec.max_attempts,
    )


def load_manifests(paths: list[str]) -> list[ResolvedRun]:
    """Read Agent and AgentRun documents from YAML files; resolve each AgentRun's agent."""
    agents: dict[str, AgentSpec] = {}
    runs: list[AgentRunManifest] = []
    for path in paths:
        try:
            text = Path(path).read_text(encoding="utf-8")
            docs = [d for d in yaml.safe_load_all(text) if d is not None]
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
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
        raise ConfigError(f"{', '.join(paths)}: no AgentRun document found")
    return [resolve(r, agents) for r in runs]
