"""The AgentRun and Agent CRDs, generated from the pydantic models in agentrun.manifests.

The models are the one definition of the fields: ``agentrun submit -f`` validates with them, and
the CRDs' OpenAPI schemas are generated from them here, then checked in under ``crds/`` (a test
fails when the two drift). Regenerate with::

    python -m agentrun.operator.crds crds/

Kubernetes wants *structural* schemas: no ``$ref``, a ``type`` on every node, no ``anyOf`` over
types, no ``additionalProperties: false``. :func:`structural` turns pydantic's JSON schema into
that. What JSON schema cannot say is written as CEL rules (``x-kubernetes-validations``): an
AgentRun's agent is either a reference or an inline agent, and its spec is immutable, since it pins
the run.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field

from agentrun.manifests import AgentRunSpec, AgentSpec

GROUP = "agentrun.dev"
VERSION = "v1alpha1"
#: `kubectl get agentrun-all` lists both kinds.
CATEGORY = "agentrun-all"


class PendingApproval(BaseModel):
    seq: int = Field(description="Step of the tool call waiting for a decision.")
    tool: str = Field(description="The tool it would call.")
    arguments: str = Field(description="Its arguments, summarised.")
    reason: str = Field(description="Why it waits (approval required, or outcome unknown).")


class Condition(BaseModel):
    """A standard Kubernetes condition (metav1.Condition)."""

    model_config = ConfigDict(populate_by_name=True)
    type: str
    status: str = Field(json_schema_extra={"enum": ["True", "False", "Unknown"]})
    reason: str
    message: str = ""
    last_transition_time: str = Field(alias="lastTransitionTime")
    observed_generation: int | None = Field(None, alias="observedGeneration")


class TokenUsage(BaseModel):
    input: int = 0
    output: int = 0


class AgentRunStatus(BaseModel):
    """Mirrored from the run store by the operator; never written by users."""

    model_config = ConfigDict(populate_by_name=True)
    run_id: str | None = Field(None, alias="runId", description="The run's id in the store.")
    phase: str | None = Field(
        None,
        description="pending, running, waiting_approval, succeeded, failed, cancelled, "
        "dead_letter.",
        json_schema_extra={
            "enum": [
                "pending",
                "running",
                "waiting_approval",
                "succeeded",
                "failed",
                "cancelled",
                "dead_letter",
            ]
        },
    )
    step: int | None = Field(None, description="Steps committed so far.")
    attempt: int | None = Field(None, description="Claims so far.")
    worker: str | None = Field(None, description="The worker holding the run.")
    model: str | None = Field(None, description="The pinned model.")
    prompt_version: str | None = Field(None, alias="promptVersion")
    tokens: TokenUsage | None = None
    result: str | None = Field(None, description="The final answer, truncated.")
    error: str | None = None
    message: str | None = Field(None, description="One line for kubectl get.")
    pending_approval: PendingApproval | None = Field(None, alias="pendingApproval")
    started_at: str | None = Field(None, alias="startedAt")
    finished_at: str | None = Field(None, alias="finishedAt")
    observed_generation: int | None = Field(None, alias="observedGeneration")
    conditions: list[Condition] = Field(default_factory=list)


_DROP = {"title", "additionalProperties", "$defs"}


def structural(schema: dict[str, Any]) -> dict[str, Any]:
    """Pydantic's JSON schema -> a Kubernetes structural OpenAPI v3 schema."""
    defs = schema.get("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(n) for n in node]
        if not isinstance(node, dict):
            return node
        if "$ref" in node:
            target = copy.deepcopy(defs[node["$ref"].split("/")[-1]])
            extra = {k: v for k, v in node.items() if k != "$ref"}
            return walk({**target, **extra})
        if "anyOf" in node:
            options = [o for o in node["anyOf"] if o.get("type") != "null"]
            rest = {k: v for k, v in node.items() if k != "anyOf"}
            if len(options) == 1:
                return walk({**options[0], **rest})
            # A union of objects (AgentRef | AgentSpec): one object with every property; the
            # rule that tells them apart is a CEL validation added by the caller.
            # No defaults inside it either: the API server would fill them into a plain
            # reference ({name: ...}), which then is neither kind; pydantic applies the inline
            # agent's defaults when the operator parses it.
            merged: dict[str, Any] = {"type": "object", "properties": {}}
            for option in (walk(o) for o in options):
                for key, prop in option.get("properties", {}).items():
                    merged["properties"][key] = {k: v for k, v in prop.items() if k != "default"}
            return {**merged, **{k: v for k, v in walk(rest).items() if k != "default"}}
        out = {k: walk(v) for k, v in node.items() if k not in _DROP}
        if node.get("default") is None:
            out.pop("default", None)
        if out.get("type") == "object" and "properties" not in out:
            out["x-kubernetes-preserve-unknown-fields"] = True
        return out

    return walk(schema)  # type: ignore[no-any-return]


def _object_schema(spec: dict[str, Any], status: dict[str, Any] | None) -> dict[str, Any]:
    properties: dict[str, Any] = {
        "apiVersion": {"type": "string"},
        "kind": {"type": "string"},
        "metadata": {"type": "object"},
        "spec": spec,
    }
    if status is not None:
        properties["status"] = status
    return {"type": "object", "required": ["spec"], "properties": properties}


def agentrun_crd() -> dict[str, Any]:
    spec = structural(AgentRunSpec.model_json_schema(by_alias=True))
    spec["description"] = "What the run does. Pinned when the run is created: immutable."
    spec["x-kubernetes-validations"] = [
        {
            "rule": "self == oldSelf",
            "message": "spec is immutable: it pins the run; create a new AgentRun instead",
        }
    ]
    spec["properties"]["agent"]["x-kubernetes-validations"] = [
        {
            "rule": "has(self.name) != has(self.model)",
            "message": "spec.agent: give either name (an Agent in this namespace) or an inline "
            "agent with model, not both",
        }
    ]
    status = structural(AgentRunStatus.model_json_schema(by_alias=True))
    columns = [
        ("Phase", "string", ".status.phase", 0),
        ("Step", "integer", ".status.step", 0),
        ("Attempt", "integer", ".status.attempt", 0),
        ("Agent", "string", ".spec.agent.name", 0),
        ("Model", "string", ".status.model", 1),
        ("Age", "date", ".metadata.creationTimestamp", 0),
        ("Message", "string", ".status.message", 0),
        ("Worker", "string", ".status.worker", 1),
    ]
    return _crd("AgentRun", "agentruns", ["ar"], _object_schema(spec, status), columns, True)


def agent_crd() -> dict[str, Any]:
    spec = structural(AgentSpec.model_json_schema(by_alias=True))
    spec["description"] = "Model, system prompt and tools, pinned into every run created from it."
    columns = [
        ("Model", "string", ".spec.model", 0),
        ("Pool", "string", ".spec.pool", 0),
        ("Age", "date", ".metadata.creationTimestamp", 0),
    ]
    return _crd("Agent", "agents", [], _object_schema(spec, None), columns, False)


def _crd(
    kind: str,
    plural: str,
    short: list[str],
    schema: dict[str, Any],
    columns: list[tuple[str, str, str, int]],
    status: bool,
) -> dict[str, Any]:
    version: dict[str, Any] = {
        "name": VERSION,
        "served": True,
        "storage": True,
        "schema": {"openAPIV3Schema": schema},
        "additionalPrinterColumns": [
            {"name": n, "type": t, "jsonPath": p, **({"priority": pr} if pr else {})}
            for n, t, p, pr in columns
        ],
    }
    if status:
        version["subresources"] = {"status": {}}
    names: dict[str, Any] = {
        "kind": kind,
        "listKind": f"{kind}List",
        "plural": plural,
        "singular": kind.lower(),
        # Not "agentrun": kubectl expands a category before it resolves a singular name, so a
        # category spelt like AgentRun's singular made `kubectl get agentrun NAME` fail.
        "categories": [CATEGORY],
    }
    if short:
        names["shortNames"] = short
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}"},
        "spec": {"group": GROUP, "names": names, "scope": "Namespaced", "versions": [version]},
    }


def rendered() -> dict[str, str]:
    """File name -> YAML text, as checked in under crds/."""
    header = "# Generated by `python -m agentrun.operator.crds crds/` from agentrun.manifests.\n"
    out = {}
    for crd in (agentrun_crd(), agent_crd()):
        name = f"{crd['metadata']['name']}.yaml"
        out[name] = header + yaml.safe_dump(crd, sort_keys=False, width=100)
    return out


def main(argv: list[str]) -> int:
    target = Path(argv[0] if argv else "crds")
    target.mkdir(parents=True, exist_ok=True)
    for name, text in rendered().items():
        (target / name).write_text(text)
        print(f"wrote {target / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
