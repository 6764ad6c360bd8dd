"""The AgentRun, Agent and AgentRunApproval CRDs, generated from the pydantic models in
agentrun.manifests (the specs) and agentrun.operator.api (the statuses).

The models are the one definition of the fields: ``agentrun submit -f`` validates with them, and
the CRDs' OpenAPI schemas are generated from them here, then checked in under ``crds/`` (a test
fails when the two drift). Regenerate with::

    python -m agentrun.operator.crds crds/

Kubernetes wants *structural* schemas: no ``$ref``, a ``type`` on every node, no ``anyOf`` over
types, no ``additionalProperties: false``. :func:`structural` turns pydantic's JSON schema into
that. What JSON schema cannot say is written as CEL rules (``x-kubernetes-validations``): an
AgentRun's agent is either a reference or an inline agent (a reference carries no inline field),
thinking's budget stays under maxTokens, and an AgentRun's spec is immutable, since it pins the
run. The pydantic models enforce the same rules with the same messages, for ``submit -f``.

Every string and list is bounded (``maxLength`` / ``maxItems``): the API server estimates a CEL
rule's cost from the largest value a field may hold, and an object must stay small enough for
etcd and for kopf's and kubectl's copies of it in annotations.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import yaml

from agentrun.manifests import (
    BUDGET_MESSAGE,
    NEITHER_MESSAGE,
    REFERENCE_MESSAGE,
    AgentRunApprovalSpec,
    AgentRunSpec,
    AgentSpec,
    inline_fields,
)
from agentrun.operator.api import (
    AGENTRUNS_PLURAL,
    AGENTS_PLURAL,
    APPROVALS_PLURAL,
    GROUP,
    VERSION,
    AgentRunApprovalStatus,
    AgentRunStatus,
)

#: `kubectl get agentrun-all` lists both kinds.
CATEGORY = "agentrun-all"

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
        union = "anyOf" if "anyOf" in node else "oneOf" if "oneOf" in node else None
        if union is not None:
            options = [o for o in node[union] if o.get("type") != "null"]
            rest = {k: v for k, v in node.items() if k != union}
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
        # JSON Schema's numeric bound (gt=0 -> exclusiveMinimum: 0) is OpenAPI 3.0's boolean
        # beside minimum in Kubernetes' schemas; the API server refuses a number there.
        for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
            if isinstance(out.get(exclusive), int | float) and not isinstance(
                out[exclusive], bool
            ):
                out[bound], out[exclusive] = out[exclusive], True
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


def _budget_rule(where: str) -> dict[str, Any]:
    """thinking.budgetTokens < maxTokens, on an agent object (``where``: its path, for the
    message). maxTokens may be absent: the API server applies no default inside AgentRun's agent
    union (see :func:`structural`), so the rule falls back to AgentSpec's default itself.

    The message names the field; ``fieldPath`` would too, but it is Kubernetes 1.28+ and the
    chart supports 1.25, where a strict apply refuses the CRD for the unknown key."""
    default = AgentSpec.model_fields["max_tokens"].default
    return {
        "rule": "!has(self.thinking) || self.thinking.budgetTokens < "
        f"(has(self.maxTokens) ? self.maxTokens : {default})",
        "message": f"{where}thinking.budgetTokens "
        + BUDGET_MESSAGE.format(max_tokens=f"default {default}"),
    }


def agent_union_rules() -> list[dict[str, Any]]:
    """The rules on AgentRun's ``spec.agent``: a reference (name) alone, or an inline agent
    (model and whatever else of AgentSpec). The inline fields come from AgentSpec, so a field
    added there is forbidden beside name without anyone remembering to list it here."""
    inline = inline_fields()
    carries_inline = " || ".join(f"has(self.{f})" for f in inline)
    return [
        {
            "rule": "has(self.name) || has(self.model)",
            "message": f"spec.agent: {NEITHER_MESSAGE}",
        },
        {
            "rule": f"!has(self.name) || !({carries_inline})",
            "message": "spec.agent: " + REFERENCE_MESSAGE.format(fields=", ".join(inline)),
        },
        _budget_rule("spec.agent."),
    ]


def agentrun_crd() -> dict[str, Any]:
    spec = structural(AgentRunSpec.model_json_schema(by_alias=True))
    spec["description"] = "What the run does. Pinned when the run is created: immutable."
    spec["x-kubernetes-validations"] = [
        {
            "rule": "self == oldSelf",
            "message": "spec is immutable: it pins the run; create a new AgentRun instead",
        }
    ]
    spec["properties"]["agent"]["x-kubernetes-validations"] = agent_union_rules()
    status = structural(AgentRunStatus.model_json_schema(by_alias=True))
    columns = [
        ("Phase", "string", ".status.phase", 0),
        ("Step", "integer", ".status.step", 0),
        ("Attempt", "integer", ".status.attempt", 0),
        ("Agent", "string", ".spec.agent.name", 0),
        ("Model", "string", ".status.model", 1),
        ("Provider", "string", ".status.provider", 1),
        ("Age", "date", ".metadata.creationTimestamp", 0),
        ("Message", "string", ".status.message", 0),
        ("Worker", "string", ".status.worker", 1),
        ("Cost", "number", ".status.costUSD", 1),
    ]
    return _crd("AgentRun", AGENTRUNS_PLURAL, ["ar"], _object_schema(spec, status), columns, True)


def agent_crd() -> dict[str, Any]:
    spec = structural(AgentSpec.model_json_schema(by_alias=True))
    spec["description"] = "Model, system prompt and tools, pinned into every run created from it."
    spec["x-kubernetes-validations"] = [_budget_rule("spec.")]
    columns = [
        ("Model", "string", ".spec.model", 0),
        ("Provider", "string", ".spec.provider", 0),
        ("Pool", "string", ".spec.pool", 0),
        ("Age", "date", ".metadata.creationTimestamp", 0),
    ]
    return _crd("Agent", AGENTS_PLURAL, [], _object_schema(spec, None), columns, False)


def approval_crd() -> dict[str, Any]:
    spec = structural(AgentRunApprovalSpec.model_json_schema(by_alias=True))
    spec["description"] = (
        "A decision on the call an AgentRun waits on. Immutable: a decision is not edited, a "
        "new one is created."
    )
    spec["x-kubernetes-validations"] = [
        {
            "rule": "self == oldSelf",
            "message": "spec is immutable: a decision is recorded once; create a new "
            "AgentRunApproval instead",
        },
        {
            "rule": "!has(self.attempt) || has(self.call)",
            "message": "attempt names an attempt of a call: set call too",
        },
    ]
    status = structural(AgentRunApprovalStatus.model_json_schema(by_alias=True))
    columns = [
        ("AgentRun", "string", ".spec.agentRun", 0),
        ("Seq", "integer", ".spec.seq", 0),
        ("Call", "integer", ".spec.call", 0),
        ("Decision", "string", ".spec.decision", 0),
        ("Approver", "string", ".spec.approver", 0),
        ("Phase", "string", ".status.phase", 0),
        ("Age", "date", ".metadata.creationTimestamp", 0),
        ("Message", "string", ".status.message", 1),
    ]
    return _crd("AgentRunApproval", APPROVALS_PLURAL, ["arapproval", "ara"],
                _object_schema(spec, status), columns, True)


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
    for crd in (agentrun_crd(), agent_crd(), approval_crd()):
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
