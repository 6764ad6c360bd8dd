"""The CRDs: generated from the manifest models, checked in, structural, and strict."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from agentrun.errors import ConfigError
from agentrun.manifests import AgentSpec, inline_fields, load_manifests
from agentrun.operator.crds import (
    agent_crd,
    agent_union_rules,
    agentrun_crd,
    approval_crd,
    rendered,
)

CRDS = Path(__file__).resolve().parent.parent / "crds"
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "migrate-orders.yaml"


def schema_of(crd: dict[str, Any]) -> dict[str, Any]:
    """The CRD's schema as JSON Schema, for jsonschema: OpenAPI 3.0's boolean exclusive bounds
    (``minimum: 0, exclusiveMinimum: true``, what the API server takes) become JSON Schema's
    numeric ones."""

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(n) for n in node]
        if not isinstance(node, dict):
            return node
        out = {k: walk(v) for k, v in node.items()}
        for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
            if out.get(exclusive) is True:
                out[exclusive] = out.pop(bound)
        return out

    return walk(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])  # type: ignore[no-any-return]


def test_checked_in_crds_match_the_models() -> None:
    for name, text in rendered().items():
        path = CRDS / name
        assert path.exists(), f"{path} is missing: run python -m agentrun.operator.crds crds/"
        assert path.read_text() == text, (
            f"{path} drifted from agentrun.manifests: run python -m agentrun.operator.crds crds/"
        )


def _walk(node: Any, path: str = "") -> list[str]:
    """Kubernetes' structural-schema rules that JSON schema tools do not check."""
    problems = []
    if isinstance(node, dict):
        for banned in ("$ref", "anyOf", "oneOf", "allOf", "$defs", "title"):
            if banned in node:
                problems.append(f"{path}: {banned}")
        if node.get("additionalProperties") is False:
            problems.append(f"{path}: additionalProperties false")
        if "properties" in node or "items" in node:
            if "type" not in node:
                problems.append(f"{path}: no type")
        for key, value in node.get("properties", {}).items():
            if "type" not in value and not value.get("x-kubernetes-preserve-unknown-fields"):
                problems.append(f"{path}.{key}: no type")
            problems += _walk(value, f"{path}.{key}")
        if "items" in node:
            problems += _walk(node["items"], f"{path}[]")
    return problems


def test_schemas_are_structural() -> None:
    for crd in (agentrun_crd(), agent_crd(), approval_crd()):
        assert _walk(schema_of(crd)) == []


def test_printer_columns_status_subresource_and_cel_rules() -> None:
    crd = agentrun_crd()
    version = crd["spec"]["versions"][0]
    assert crd["spec"]["names"]["shortNames"] == ["ar"]
    assert version["subresources"] == {"status": {}}
    names = [c["name"] for c in version["additionalPrinterColumns"]]
    assert names[:4] == ["Phase", "Step", "Attempt", "Agent"] and "Age" in names
    spec = schema_of(crd)["properties"]["spec"]
    assert spec["x-kubernetes-validations"][0]["rule"] == "self == oldSelf"
    agent = spec["properties"]["agent"]
    assert agent["x-kubernetes-validations"] == agent_union_rules()
    rules = [r["rule"] for r in agent["x-kubernetes-validations"]]
    assert rules[0] == "has(self.name) || has(self.model)"
    # A reference carries no inline field: every field of AgentSpec, taken from the model.
    assert inline_fields() == [f.alias or n for n, f in AgentSpec.model_fields.items()]
    assert all(f"has(self.{f})" in rules[1] for f in inline_fields()), rules[1]
    assert rules[1].startswith("!has(self.name) || !(")
    # No defaults inside the reference-or-inline union: the API server would fill them into a
    # plain {name: ...} reference, which would then be neither kind. So the budget rule falls
    # back to maxTokens' default itself.
    assert all("default" not in prop for prop in agent["properties"].values())
    budget = "!has(self.thinking) || self.thinking.budgetTokens < " \
        "(has(self.maxTokens) ? self.maxTokens : 8192)"
    assert rules[2] == budget
    assert "spec.agent.thinking.budgetTokens" in agent["x-kubernetes-validations"][2]["message"]
    # fieldPath and reason are Kubernetes 1.28+; the chart supports 1.25 (tests/test_chart.py).
    assert all(set(r) == {"rule", "message"} for r in agent["x-kubernetes-validations"])
    agent_spec = schema_of(agent_crd())["properties"]["spec"]
    assert [r["rule"] for r in agent_spec["x-kubernetes-validations"]] == [budget]
    assert "spec.thinking.budgetTokens" in agent_spec["x-kubernetes-validations"][0]["message"]


def test_approval_crd_columns_immutable_spec_and_required_fields() -> None:
    crd = approval_crd()
    version = crd["spec"]["versions"][0]
    assert crd["spec"]["names"]["kind"] == "AgentRunApproval"
    assert crd["spec"]["names"]["shortNames"] == ["arapproval", "ara"]
    assert crd["spec"]["scope"] == "Namespaced"
    # The operator writes the status through its subresource, which the admission policy on
    # approvals (matching their creation) does not see.
    assert version["subresources"] == {"status": {}}
    names = [c["name"] for c in version["additionalPrinterColumns"]]
    assert names[:7] == ["AgentRun", "Seq", "Call", "Decision", "Approver", "Phase", "Age"]
    schema = schema_of(crd)
    spec = schema["properties"]["spec"]
    assert spec["x-kubernetes-validations"][0]["rule"] == "self == oldSelf"
    # An attempt is of a call: the API server refuses one without the other (agentrun/waits.py).
    assert spec["x-kubernetes-validations"][1]["rule"] == "!has(self.attempt) || has(self.call)"
    assert spec["properties"]["call"]["minimum"] == 0
    assert spec["properties"]["attempt"]["minimum"] == 1
    assert set(spec["required"]) == {"agentRun", "seq", "decision", "approver"}
    assert spec["properties"]["decision"]["enum"] == ["approve", "reject"]
    assert spec["properties"]["seq"]["minimum"] == 0
    status = schema["properties"]["status"]["properties"]
    assert status["phase"]["enum"] == ["Pending", "Applied", "Refused"]
    assert {"message", "runId", "decidedAt", "call", "conditions"} <= set(status)
    good = {"apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRunApproval",
            "metadata": {"name": "a"},
            "spec": {"agentRun": "r", "seq": 0, "decision": "approve", "approver": "alice"}}
    jsonschema.validate(good, schema)
    for bad in ({"decision": "maybe"}, {"seq": -1}, {"approver": ""}, {"reason": "x" * 1025}):
        doc = copy.deepcopy(good)
        doc["spec"].update(bad)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(doc, schema)


def test_status_conditions_are_a_map_list_of_metav1_conditions() -> None:
    status = schema_of(agentrun_crd())["properties"]["status"]
    assert "observedGeneration" in status["properties"]
    conditions = status["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    item = conditions["items"]
    assert set(item["required"]) == {"type", "status", "lastTransitionTime", "reason", "message"}
    assert set(item["properties"]) == set(item["required"]) | {"observedGeneration"}


def _strings(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    if not isinstance(node, dict):
        return out
    if node.get("type") in ("string", "array"):
        out.append((path, node))
    for key, value in node.get("properties", {}).items():
        out += _strings(value, f"{path}.{key}")
    if "items" in node:
        out += _strings(node["items"], f"{path}[]")
    return out


def test_every_string_and_list_is_bounded() -> None:
    # Unbounded, a 300 KB task was admitted and wedged the operator; and the API server estimates
    # CEL costs from these bounds.
    for crd in (agentrun_crd(), agent_crd(), approval_crd()):
        for path, node in _strings(schema_of(crd)["properties"]["spec"], "spec"):
            bounded = "enum" in node or "maxLength" in node or "maxItems" in node
            assert bounded, f"{crd['metadata']['name']}: {path} has no maxLength/maxItems"
    spec = schema_of(agentrun_crd())["properties"]["spec"]
    assert spec["properties"]["task"]["maxLength"] == 65536
    assert spec["properties"]["agent"]["properties"]["system"]["maxLength"] == 65536
    assert spec["properties"]["pool"]["minLength"] == 1


def _docs() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]


def test_the_example_manifests_are_accepted() -> None:
    agent, run = _docs()
    jsonschema.validate(agent, schema_of(agent_crd()))
    jsonschema.validate(run, schema_of(agentrun_crd()))


BAD: list[tuple[str, Any, str]] = [
    ("no task", lambda s: s.pop("task"), "'task' is a required property"),
    ("empty task", lambda s: s.update(task=""), "spec.task"),
    ("maxSteps 0", lambda s: s.update(maxSteps=0), "spec.maxSteps"),
    ("maxAttempts text", lambda s: s.update(maxAttempts="many"), "spec.maxAttempts"),
    (
        "thinking too small",
        lambda s: s.update(agent={"model": "m", "thinking": {"budgetTokens": 10}}),
        "spec.agent.thinking.budgetTokens",
    ),
    (
        "pool too long",
        lambda s: s.update(agent={"model": "m", "pool": "p" * 70}),
        "spec.agent.pool",
    ),
    ("task too long", lambda s: s.update(task="t" * 65537), "spec.task"),
    ("empty pool", lambda s: s.update(pool=""), "spec.pool"),
    ("pool not a DNS label", lambda s: s.update(pool="GPU_pool"), "spec.pool"),
    (
        "reference name too long",
        lambda s: s.update(agent={"name": "n" * 254}),
        "spec.agent.name",
    ),
    (
        "system too long",
        lambda s: s.update(agent={"model": "m", "system": "s" * 65537}),
        "spec.agent.system",
    ),
    ("model too long", lambda s: s.update(agent={"model": "m" * 254}), "spec.agent.model"),
    (
        "too many tools",
        lambda s: s.update(agent={"model": "m", "tools": ["t"] * 129}),
        "spec.agent.tools",
    ),
    (
        "tool name not the registry's",
        lambda s: s.update(agent={"model": "m", "tools": ["a.b"]}),
        "spec.agent.tools.0",
    ),
]


@pytest.mark.parametrize(("label", "mutate", "expect"), BAD, ids=[b[0] for b in BAD])
def test_bad_manifests_are_rejected_by_the_generated_schema_and_by_submit(
    label: str, mutate: Any, expect: str, tmp_path: Path
) -> None:
    run = copy.deepcopy(_docs()[1])
    mutate(run["spec"])
    with pytest.raises(jsonschema.ValidationError) as err:
        jsonschema.validate(run, schema_of(agentrun_crd()))
    where = ".".join(str(p) for p in err.value.absolute_path)
    assert expect in f"{where}: {err.value.message}", (where, err.value.message)
    # The same manifest fails `agentrun submit -f` too: one definition, two enforcers.
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump_all([_docs()[0], run]))
    with pytest.raises(ConfigError):
        load_manifests([str(path)])


# What JSON schema cannot say, the CRDs say in CEL (run by the API server: tests/test_k8s_cel.py)
# and the models in validators: submit refuses these too, in one line naming the field.
CEL_ONLY: list[tuple[str, int, Any, str]] = [
    (
        "reference with an inline field",
        1,
        lambda s: s.update(agent={"name": "db-migrator", "system": "x", "maxTokens": 10}),
        "spec.agent: a reference (name) takes no inline agent fields (system, maxTokens)",
    ),
    (
        "neither reference nor inline",
        1,
        lambda s: s.update(agent={"system": "x"}),
        "spec.agent: give name (an Agent in this namespace) or an inline agent with model",
    ),
    (
        "inline budget at the default maxTokens",
        1,
        lambda s: s.update(agent={"model": "m", "thinking": {"budgetTokens": 8192}}),
        "spec.agent.thinking.budgetTokens: must be less than maxTokens (8192)",
    ),
    (
        "inline budget over maxTokens",
        1,
        lambda s: s.update(
            agent={"model": "m", "maxTokens": 2048, "thinking": {"budgetTokens": 4096}}
        ),
        "spec.agent.thinking.budgetTokens: must be less than maxTokens (2048)",
    ),
    (
        "agent budget at maxTokens",
        0,
        lambda s: s.update(maxTokens=2048),  # the example's budget is 2048
        "spec.thinking.budgetTokens: must be less than maxTokens (2048)",
    ),
]


@pytest.mark.parametrize(
    ("label", "doc", "mutate", "expect"), CEL_ONLY, ids=[c[0] for c in CEL_ONLY]
)
def test_cel_rules_are_enforced_by_submit_too(
    label: str, doc: int, mutate: Any, expect: str, tmp_path: Path
) -> None:
    docs = copy.deepcopy(_docs())
    mutate(docs[doc]["spec"])
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    with pytest.raises(ConfigError) as err:
        load_manifests([str(path)])
    message = str(err.value)
    assert expect in message, message
    assert "\n" not in message and message.count(": spec.") == 1, message


def test_lengths_count_characters_in_submit_and_in_the_schema(tmp_path: Path) -> None:
    # 65,536 '€' are 196,608 bytes: within the bound, as the API server counts it too.
    agent, run = _docs()
    for task, ok in (("€" * 65536, True), ("€" * 65537, False)):
        run["spec"]["task"] = task
        path = tmp_path / "run.yaml"
        path.write_text(yaml.safe_dump_all([agent, run], allow_unicode=True), encoding="utf-8")
        if ok:
            jsonschema.validate(run, schema_of(agentrun_crd()))
            (resolved,) = load_manifests([str(path)])
            assert resolved.task == task
        else:
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(run, schema_of(agentrun_crd()))
            with pytest.raises(ConfigError, match=r"spec\.task: String should have at most"):
                load_manifests([str(path)])
