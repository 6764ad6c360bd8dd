"""agentrun submit -f and agentrun demo, as a user runs them."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import run_cli

AGENT = """\
apiVersion: agentrun.dev/v1alpha1
kind: Agent
metadata: {name: db-migrator}
spec:
  model: claude-sonnet-4-5
  system: "You migrate databases carefully."
  tools: [read_schema, write_production]
  maxTokens: 4096
  thinking: {budgetTokens: 2048}
  pool: migrations
"""
RUN = """\
apiVersion: agentrun.dev/v1alpha1
kind: AgentRun
metadata: {name: migrate-orders}
spec:
  agent: {name: db-migrator}
  task: "Add a region column to orders and backfill it."
  maxSteps: 30
"""


def test_submit_resolves_the_agent_and_pins_it_on_the_run(
    tmp_path: Path, database_url: str
) -> None:
    (tmp_path / "agent.yaml").write_text(AGENT)
    (tmp_path / "run.yaml").write_text(RUN)
    env = {"AGENTRUN_DATABASE_URL": database_url}
    res = run_cli(
        "submit",
        "-f",
        str(tmp_path / "agent.yaml"),
        "-f",
        str(tmp_path / "run.yaml"),
        "-o",
        "json",
        env=env,
    )
    assert res.returncode == 0, res.stderr
    created = json.loads(res.stdout)
    assert created["name"] == "migrate-orders" and created["pool"] == "migrations"
    res = run_cli("runs", "-o", "json", env=env)
    (row,) = json.loads(res.stdout)
    assert row["id"] == created["id"] and row["max_steps"] == 30
    assert row["agent_spec"] == {
        "model": "claude-sonnet-4-5",
        "system": "You migrate databases carefully.",
        "tools": ["read_schema", "write_production"],
        "maxTokens": 4096,
        "thinking": {"budgetTokens": 2048},
        "pool": "migrations",
        "requireApproval": False,
        "promptCaching": True,
        "provider": "anthropic",
    }
    res = run_cli("steps", created["id"], env=env)
    assert res.returncode == 0 and "pending, 0 steps" in res.stdout


def test_submit_rejects_bad_manifests_naming_the_field(tmp_path: Path, database_url: str) -> None:
    env = {"AGENTRUN_DATABASE_URL": database_url}
    cases = {
        "unknown agent": (RUN, "spec.agent.name: no Agent named 'db-migrator'"),
        "bad limit": (RUN.replace("maxSteps: 30", "maxSteps: 0"), "spec.maxSteps"),
        "typo": (RUN.replace("maxSteps: 30", "maxStep: 30"), "spec.maxStep"),
        "no task": (
            RUN.replace('  task: "Add a region column to orders and backfill it."\n', ""),
            "spec.task: Field required",
        ),
        "wrong api": (RUN.replace("agentrun.dev/v1alpha1", "agentrun.dev/v1"), "apiVersion"),
    }
    for label, (text, expect) in cases.items():
        path = tmp_path / f"{label.replace(' ', '_')}.yaml"
        path.write_text(text)
        res = run_cli("submit", "-f", str(path), env=env)
        assert res.returncode == 2, (label, res.stderr)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and expect in lines[0], (label, lines)
    assert json.loads(run_cli("runs", "-o", "json", env=env).stdout) == []  # nothing created


def test_demo_survives_a_sigkill_and_writes_production_exactly_once(database_url: str) -> None:
    res = run_cli("demo", env={"AGENTRUN_DATABASE_URL": database_url}, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "SIGKILL worker-1" in out and "during step 7" in out
    assert "each production write happened exactly once: yes" in out
    assert "run succeeded: 12 model turns, 23 steps (contiguous: yes)" in out
    ledger = [
        line for line in out.splitlines() if line.strip().startswith("seq ") and "rows" in line
    ]
    assert len(ledger) == 2


def test_the_shipped_example_manifest_is_valid() -> None:
    from agentrun.manifests import load_manifests

    example = Path(__file__).parent.parent / "examples" / "migrate-orders.yaml"
    (run,) = load_manifests([str(example)])
    assert run.name == "migrate-orders" and run.agent.model == "claude-sonnet-4-5"
    assert run.agent.tools == ["read_schema", "count_rows", "write_production", "check_migration"]
