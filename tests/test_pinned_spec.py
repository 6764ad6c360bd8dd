"""The worker reads a run's pinned agent spec back into its model (issue 18), including a spec
pinned by an older release (keys it did not pin take their defaults) or a newer one (keys this
release does not know are ignored)."""

from __future__ import annotations

import dataclasses

import pytest

from agentrun.manifests import DEFAULT_MAX_TOKENS, PinnedAgentSpec
from agentrun.tools import ToolRegistry
from agentrun.worker.executor import prompt_for


def test_a_spec_pinned_by_an_older_release_validates_with_defaults() -> None:
    # The shape runs were pinned with before providers, prompt caching and budgets.
    old = PinnedAgentSpec.model_validate(
        {"model": "claude-sonnet-4-5", "system": "be brief", "tools": [], "pool": "default"})
    assert (old.provider, old.prompt_caching, old.budget, old.max_tokens, old.thinking) == (
        "anthropic", True, None, DEFAULT_MAX_TOKENS, None)


def test_a_key_this_release_does_not_know_is_ignored() -> None:
    spec = PinnedAgentSpec.model_validate(
        {"model": "m", "maxTokens": 2048, "someLaterField": {"x": 1}})
    assert spec.max_tokens == 2048 and "someLaterField" not in spec.pinned()


def test_the_prompt_is_built_from_the_validated_spec() -> None:
    from datetime import UTC, datetime
    from uuid import uuid4

    from agentrun.store import Run

    now = datetime.now(UTC)
    run = Run(
        id=uuid4(), external_key=None, k8s_namespace=None, k8s_name=None, k8s_uid=None,
        pool="default", status="running", task="t", model="m",
        agent_spec={"model": "m", "system": "s", "maxTokens": 4096, "promptCaching": False,
                    "thinking": {"budgetTokens": 1024}},
        prompt_version=None, max_steps=1, max_attempts=1, lease_owner=None, lease_until=None,
        lease_epoch=1, attempt=1, next_seq=0, result=None, error=None, created_at=now,
        updated_at=now, started_at=None, finished_at=None,
    )
    pv = prompt_for(run, ToolRegistry())
    assert pv.system == "s"
    assert pv.params == {"max_tokens": 4096, "thinking": {"budget_tokens": 1024}}


def test_a_runs_pinned_spec_is_validated_once_per_read(monkeypatch: pytest.MonkeyPatch) -> None:
    # The worker asks for run.agent at every tool call and every turn's first call's mark: one
    # validation per Run read, not one per question (issue 17's CPU per step).
    from datetime import UTC, datetime
    from uuid import uuid4

    from agentrun.cli_format import run_to_json
    from agentrun.store import Run

    now = datetime.now(UTC)
    run = Run(
        id=uuid4(), external_key=None, k8s_namespace=None, k8s_name=None, k8s_uid=None,
        pool="default", status="running", task="t", model="m",
        agent_spec={"model": "m", "tools": ["echo"]},
        prompt_version=None, max_steps=1, max_attempts=1, lease_owner=None, lease_until=None,
        lease_epoch=1, attempt=1, next_seq=0, result=None, error=None, created_at=now,
        updated_at=now, started_at=None, finished_at=None,
    )
    calls = []
    validate = PinnedAgentSpec.model_validate

    def counted(value: object) -> PinnedAgentSpec:
        calls.append(value)
        return validate(value)

    monkeypatch.setattr(PinnedAgentSpec, "model_validate", counted)
    assert [run.agent.tools for _ in range(5)] == [["echo"]] * 5
    assert len(calls) == 1
    bad = dataclasses.replace(run, agent_spec={"model": 7})
    for _ in range(2):  # a spec that does not validate says so at every ask, as before
        with pytest.raises(ValueError):
            _ = bad.agent
    assert "agent" not in run_to_json(run)  # a column list, not the cache beside it
