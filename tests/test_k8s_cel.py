"""The CRDs' rules on a real API server (v1.36): CEL ``x-kubernetes-validations``, length bounds,
patterns and the status conditions' map list, each shown refusing a bad object with an error that
names the field, beside a valid neighbour that is accepted. ``agentrun submit -f`` enforces the
same rules through the pydantic models (tests/test_crds.py); this is where the API server's half
is seen working, since JSON schema tools do not run CEL and kmock runs no validation at all.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from agentrun.manifests import inline_fields
from tests.kubekit import agent_manifest, agentrun_manifest
from tests.realkube import AGENTRUNS, Kube

# One valid value per inline-agent field (camelCase, as in a manifest). The test is parametrized
# from the model, so a field added to AgentSpec without a value here fails (KeyError) instead of
# going untested.
INLINE_VALUES: dict[str, Any] = {
    "model": "claude-sonnet-4-5",
    "system": "You echo.",
    "tools": ["echo"],
    "maxTokens": 4096,
    "thinking": {"budgetTokens": 1024},
    "pool": "gpu",
    "requireApproval": False,
    "promptCaching": True,
    "budget": {"maxTokens": 100000, "maxCostUSD": 2.5},
    "provider": "bedrock",
}


def _url(kube: Kube, plural: str, name: str = "") -> str:
    return f"{AGENTRUNS}/namespaces/{kube.namespace}/{plural}" + (f"/{name}" if name else "")


def accepted(kube: Kube, manifest: dict[str, Any]) -> dict[str, Any]:
    plural = "agents" if manifest["kind"] == "Agent" else "agentruns"
    code, out = kube.request("POST", _url(kube, plural), manifest)
    assert code == 201, f"expected the API server to accept it, got {code}: {out}"
    return dict(out)


def refused(kube: Kube, manifest: dict[str, Any], field: str, at: str | None = None) -> str:
    """Create ``manifest``; assert the API server refuses it (422) with a message naming
    ``field``, and with a cause at ``at`` (default ``field``: a CEL rule's cause is the object the
    rule sits on, since the CRDs set no fieldPath). Returns the message."""
    plural = "agents" if manifest["kind"] == "Agent" else "agentruns"
    code, out = kube.request("POST", _url(kube, plural), manifest)
    assert code == 422, f"expected a refusal naming {field}, got {code}: {out}"
    message = str(out["message"])
    causes = [c.get("field") for c in out.get("details", {}).get("causes", [])]
    assert (at or field) in causes, (field, causes, message)
    assert field in message, message
    assert kube.get(_url(kube, plural, manifest["metadata"]["name"])) is None
    return message


def inline_agent(**fields: Any) -> dict[str, Any]:
    return {"model": "claude-sonnet-4-5", **fields}


# -- spec.agent: a reference or an inline agent, never both ------------------------------------


@pytest.mark.parametrize("field", inline_fields())
def test_a_reference_carrying_an_inline_field_is_refused(kube: Kube, field: str) -> None:
    agent = {"name": "echoer", field: INLINE_VALUES[field]}
    message = refused(kube, agentrun_manifest("both", agent=agent), "spec.agent")
    assert "a reference (name) takes no inline agent fields" in message
    # The valid neighbours: the bare reference, and the inline agent carrying that field.
    accepted(kube, agentrun_manifest("ref", agent={"name": "echoer"}))
    inline = {**inline_agent(), field: INLINE_VALUES[field]}
    accepted(kube, agentrun_manifest("inline", agent=inline))


def test_an_agent_with_neither_name_nor_model_is_refused(kube: Kube) -> None:
    message = refused(kube, agentrun_manifest("none", agent={"system": "s"}), "spec.agent")
    assert "give name" in message
    accepted(kube, agentrun_manifest("inline", agent=inline_agent(system="s")))


# -- thinking.budgetTokens < maxTokens (the Messages API's budget_tokens < max_tokens) ---------

BUDGET = "spec.agent.thinking.budgetTokens must be less than maxTokens"


def test_inline_agent_budget_at_the_default_max_tokens_is_refused(kube: Kube) -> None:
    # maxTokens absent: the API server applies no default inside the union, so the rule must
    # compare with AgentSpec's default (8192) itself.
    agent = inline_agent(thinking={"budgetTokens": 8192})
    refused(kube, agentrun_manifest("r1", agent=agent), BUDGET, at="spec.agent")
    accepted(kube, agentrun_manifest("r2", agent=inline_agent(thinking={"budgetTokens": 8191})))


def test_inline_agent_budget_at_or_over_its_max_tokens_is_refused(kube: Kube) -> None:
    for budget in (4096, 5000):
        agent = inline_agent(maxTokens=4096, thinking={"budgetTokens": budget})
        refused(kube, agentrun_manifest("r1", agent=agent), BUDGET, at="spec.agent")
    agent = inline_agent(maxTokens=4096, thinking={"budgetTokens": 4095})
    accepted(kube, agentrun_manifest("r2", agent=agent))
    # A bigger maxTokens lifts the ceiling over the default's.
    agent = inline_agent(maxTokens=16000, thinking={"budgetTokens": 10000})
    accepted(kube, agentrun_manifest("r3", agent=agent))


def test_agent_budget_at_or_over_max_tokens_is_refused(kube: Kube) -> None:
    field = "spec.thinking.budgetTokens must be less than maxTokens"
    refused(kube, agent_manifest("a1", thinking={"budgetTokens": 8192}), field, at="spec")
    refused(kube, agent_manifest("a2", maxTokens=2048, thinking={"budgetTokens": 2048}), field,
            at="spec")
    accepted(kube, agent_manifest("a3", maxTokens=2048, thinking={"budgetTokens": 2047}))
    accepted(kube, agent_manifest("a4", thinking={"budgetTokens": 8191}))


def test_spending_limits_out_of_range_are_refused(kube: Kube) -> None:
    # OpenAPI's exclusive bound (maxCostUSD > 0): a boolean beside minimum, as the server wants.
    refused(kube, agentrun_manifest("r1", budget={"maxCostUSD": 0}), "spec.budget.maxCostUSD")
    refused(kube, agentrun_manifest("r2", budget={"maxTokens": 0}), "spec.budget.maxTokens")
    refused(kube, agent_manifest("a1", budget={"maxCostUSD": -1}), "spec.budget.maxCostUSD")
    accepted(kube, agentrun_manifest("r4", budget={"maxCostUSD": 0.01, "maxTokens": 1}))
    accepted(kube, agent_manifest("a2", budget={"maxCostUSD": 1e6}))


def test_a_provider_outside_the_enum_is_refused(kube: Kube) -> None:
    refused(kube, agent_manifest("a1", provider="openai"), "spec.provider")
    refused(kube, agentrun_manifest("r1", agent=inline_agent(provider="azure")),
            "spec.agent.provider")
    accepted(kube, agent_manifest("a2", provider="vertex", model="claude-sonnet-4-5@20250929"))


# -- pools: DNS labels of 1 to 63 characters ---------------------------------------------------


def test_an_empty_or_malformed_run_pool_is_refused(kube: Kube) -> None:
    refused(kube, agentrun_manifest("r1", pool=""), "spec.pool")
    refused(kube, agentrun_manifest("r2", pool="GPU_pool"), "spec.pool")
    refused(kube, agentrun_manifest("r3", pool="p" * 64), "spec.pool")
    accepted(kube, agentrun_manifest("r4", pool="gpu-2"))


def test_a_malformed_agent_pool_is_refused(kube: Kube) -> None:
    refused(kube, agent_manifest("a1", pool="GPU_pool"), "spec.pool")
    refused(kube, agentrun_manifest("r1", agent=inline_agent(pool="-gpu")), "spec.agent.pool")
    accepted(kube, agent_manifest("a2", pool="gpu-2"))


# -- every free string and list is bounded -----------------------------------------------------

TOO_LONG: list[tuple[str, dict[str, Any], str]] = [
    ("task", agentrun_manifest("r", task="t" * 65537), "spec.task"),
    ("reference name", agentrun_manifest("r", agent={"name": "n" * 254}), "spec.agent.name"),
    ("inline model", agentrun_manifest("r", agent={"model": "m" * 254}), "spec.agent.model"),
    ("inline system", agentrun_manifest("r", agent=inline_agent(system="s" * 65537)),
     "spec.agent.system"),
    ("inline tools", agentrun_manifest("r", agent=inline_agent(tools=["t"] * 129)),
     "spec.agent.tools"),
    ("inline tool name", agentrun_manifest("r", agent=inline_agent(tools=["t" * 65])),
     "spec.agent.tools[0]"),
    ("agent model", agent_manifest("a", model="m" * 254), "spec.model"),
    ("agent system", agent_manifest("a", system="s" * 65537), "spec.system"),
    ("agent tools", agent_manifest("a", tools=[f"t{i}" for i in range(129)]), "spec.tools"),
    ("agent tool name", agent_manifest("a", tools=["echo", "t" * 65]), "spec.tools[1]"),
]


@pytest.mark.parametrize(("label", "manifest", "field"), TOO_LONG, ids=[t[0] for t in TOO_LONG])
def test_free_strings_and_lists_are_bounded(
    kube: Kube, label: str, manifest: dict[str, Any], field: str
) -> None:
    refused(kube, manifest, field)


def test_strings_and_lists_at_their_bounds_are_accepted(kube: Kube) -> None:
    accepted(kube, agent_manifest("a1", model="m" * 253, system="s" * 65536,
                                  tools=[f"t{i}" for i in range(127)] + ["t" * 64]))
    accepted(kube, agentrun_manifest("r1", agent={"name": "n" * 253}, task="t" * 65536))


def test_a_300k_task_applied_server_side_is_refused_naming_spec_task(kube: Kube) -> None:
    # Over kopf's 256 KiB annotation limit: admitted, it wedged the operator and its delete hung.
    manifest = agentrun_manifest("big", task="x" * 300_000)
    proc = kube.kubectl("apply", "--server-side", "-f", "-", stdin=yaml.safe_dump(manifest),
                        check=False)
    assert proc.returncode != 0, proc.stdout
    assert "spec.task: Too long" in proc.stderr, proc.stderr[-2000:]
    assert kube.agentrun("big") is None


def test_a_65536_character_multibyte_task_is_accepted(kube: Kube) -> None:
    # maxLength counts characters, as pydantic's max_length does: 65,536 '€' are 196,608 bytes.
    task = "€" * 65536
    manifest = agentrun_manifest("euro", task=task)
    kube.kubectl("apply", "--server-side", "-f", "-", stdin=yaml.safe_dump(manifest))
    got = kube.agentrun("euro")
    assert got is not None and got["spec"]["task"] == task
    refused(kube, agentrun_manifest("euro2", task=task + "€"), "spec.task")


# -- spec is immutable; metadata is not --------------------------------------------------------


def _changed(manifest: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(manifest)
    out["spec"]["task"] = "something else"
    return out


def _assert_unchanged(kube: Kube, name: str, task: str) -> None:
    got = kube.agentrun(name)
    assert got is not None and got["spec"]["task"] == task
    assert got["metadata"]["generation"] == 1


def test_a_spec_change_by_merge_patch_is_refused(kube: Kube) -> None:
    accepted(kube, agentrun_manifest("r1", task="one"))
    code, out = kube.request("PATCH", _url(kube, "agentruns", "r1"), {"spec": {"task": "two"}},
                             "application/merge-patch+json")
    assert code == 422 and "spec: Invalid value" in out["message"], (code, out)
    assert "spec is immutable" in out["message"]
    _assert_unchanged(kube, "r1", "one")


def test_a_spec_change_by_json_patch_is_refused(kube: Kube) -> None:
    accepted(kube, agentrun_manifest("r1", task="one"))
    code, out = kube.request("PATCH", _url(kube, "agentruns", "r1"),
                             [{"op": "replace", "path": "/spec/maxSteps", "value": 7}],
                             "application/json-patch+json")
    assert code == 422 and "spec: Invalid value" in out["message"], (code, out)
    assert "spec is immutable" in out["message"]
    _assert_unchanged(kube, "r1", "one")


def test_a_spec_change_by_client_side_apply_is_refused(kube: Kube) -> None:
    manifest = agentrun_manifest("r1", task="one")
    kube.apply_yaml(manifest)
    proc = kube.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(_changed(manifest)),
                        check=False)
    assert proc.returncode != 0, proc.stdout
    assert "spec: Invalid value" in proc.stderr and "spec is immutable" in proc.stderr, (
        proc.stderr)
    _assert_unchanged(kube, "r1", "one")


def test_a_spec_change_by_server_side_apply_is_refused_even_forced(kube: Kube) -> None:
    manifest = agentrun_manifest("r1", task="one")
    kube.kubectl("apply", "--server-side", "-f", "-", stdin=yaml.safe_dump(manifest))
    proc = kube.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                        stdin=yaml.safe_dump(_changed(manifest)), check=False)
    assert proc.returncode != 0, proc.stdout
    assert "spec: Invalid value" in proc.stderr and "spec is immutable" in proc.stderr, (
        proc.stderr)
    _assert_unchanged(kube, "r1", "one")


def test_labels_and_annotations_can_be_added(kube: Kube) -> None:
    manifest = agentrun_manifest("r1", task="one")
    kube.apply_yaml(manifest)
    kube.patch(_url(kube, "agentruns", "r1"),
               {"metadata": {"labels": {"team": "db"}, "annotations": {"example.com/a": "1"}}})
    kube.kubectl("label", "agentrun", "r1", "tier=gold")
    kube.kubectl("annotate", "agentrun", "r1", "example.com/b=2")
    # Re-applying the same spec with more metadata is no change of spec.
    labelled = copy.deepcopy(manifest)
    labelled["metadata"]["labels"] = {"team": "db", "tier": "gold", "stage": "prod"}
    kube.apply_yaml(labelled)
    got = kube.agentrun("r1")
    assert got is not None
    assert got["metadata"]["labels"] == {"team": "db", "tier": "gold", "stage": "prod"}
    assert {"example.com/a": "1", "example.com/b": "2"}.items() <= (
        got["metadata"]["annotations"].items())
    _assert_unchanged(kube, "r1", "one")
    # The same through server-side apply (its own object: kubectl's server-side apply takes over
    # the fields a client-side apply managed, and drops those its manifest leaves out).
    other = agentrun_manifest("r2", task="two")
    kube.kubectl("apply", "--server-side", "-f", "-", stdin=yaml.safe_dump(other))
    other["metadata"]["labels"] = {"team": "db"}
    other["metadata"]["annotations"] = {"example.com/c": "3"}
    kube.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                 stdin=yaml.safe_dump(other))
    got = kube.agentrun("r2")
    assert got is not None
    assert got["metadata"]["labels"] == {"team": "db"}
    assert got["metadata"]["annotations"] == {"example.com/c": "3"}
    _assert_unchanged(kube, "r2", "two")


# -- status.conditions: a map list keyed by type (metav1.Condition) ----------------------------


def _condition(type_: str, status: str = "True") -> dict[str, Any]:
    return {"type": type_, "status": status, "reason": "RunCreated", "message": "",
            "lastTransitionTime": "2026-01-01T00:00:00Z", "observedGeneration": 1}


def test_status_conditions_are_a_map_keyed_by_type(kube: Kube) -> None:
    accepted(kube, agentrun_manifest("r1"))
    status_url = _url(kube, "agentruns", "r1") + "/status"
    code, out = kube.request("PATCH", status_url, {"status": {"conditions": [
        _condition("Accepted"), _condition("Accepted", "False")]}},
        "application/merge-patch+json")
    assert code == 422 and "status.conditions[1]: Duplicate value" in out["message"], (code, out)
    code, out = kube.request("PATCH", status_url, {"status": {"conditions": [
        {k: v for k, v in _condition("Accepted").items() if k != "type"}]}},
        "application/merge-patch+json")
    assert code == 422 and "status.conditions[0].type: Required value" in out["message"], (
        code, out)
    code, out = kube.request("PATCH", status_url, {"status": {"observedGeneration": 1,
        "conditions": [_condition("Accepted"), _condition("Completed", "False")]}},
        "application/merge-patch+json")
    assert code == 200, (code, out)
    assert [c["type"] for c in out["status"]["conditions"]] == ["Accepted", "Completed"]
    assert out["status"]["observedGeneration"] == 1
