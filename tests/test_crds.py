"""The CRDs: generated from the manifest models, checked in, structural, and strict."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from agentrun.errors import ConfigError
from agentrun.manifests import load_manifests
from agentrun.operator.crds import agent_crd, agentrun_crd, rendered

CRDS = Path(__file__).resolve().parent.parent / "crds"
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "migrate-orders.yaml"


def schema_of(crd: dict[str, Any]) -> dict[str, Any]:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]  # type: ignore[no-any-return]


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
    for crd in (agentrun_crd(), agent_crd()):
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
    assert "has(self.name) != has(self.model)" in str(agent)
    # No defaults inside the reference-or-inline union: the API server would fill them into a
    # plain {name: ...} reference, which would then be neither kind.
    assert all("default" not in prop for prop in agent["properties"].values())


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
