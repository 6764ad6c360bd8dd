"""Budgets and cost: ``spec.budget`` (maxTokens, maxCostUSD) stops a run before the model turn
that would pass it, never inside a tool; every turn is priced by the worker's price table
(``--prices``), summed on the run and counted in ``agentrun_cost_usd_total{model}`` (the scrape
adds the pool).

Real worker processes against the scripted server, whose token accounting is deterministic: a
first run without a budget measures each turn, and the budget of a second run is set from it.
"""

from __future__ import annotations

import json
import signal
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from agentrun.errors import ConfigError
from agentrun.manifests import BudgetSpec, load_manifest_texts
from agentrun.pricing import BUILT_IN, load_prices, parse_prices
from agentrun.store import Run, Store
from agentrun.worker.budget import Spend, over_budget, turn_tokens
from tests.conftest import run_cli
from tests.workerkit import AGENT, FakeFactory, Workers, echo_scenario, wait_run

MODEL = AGENT.model


def metrics(port: int | None) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return str(r.read().decode())


def sample(body: str, series: str) -> float:
    for line in body.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[1])
    raise AssertionError(f"{series} not in /metrics")


async def turn_usage(store: Store, run: Run) -> list[dict[str, Any]]:
    return [s.payload["usage"] for s in await store.steps(run.id) if s.kind == "model_turn"]


def usage_kinds(u: dict[str, Any]) -> dict[str, int]:
    return {
        "input": u["input_tokens"],
        "output": u["output_tokens"],
        "cache_read": u["cache_read_input_tokens"],
        "cache_write": u["cache_creation_input_tokens"],
    }


async def measured_turns(
    store: Store, workers: Workers, fake: FakeFactory, turns: int
) -> list[dict[str, Any]]:
    """Each turn's usage in a run of ``turns`` turns with no budget."""
    srv = fake(echo_scenario(turns))
    run, _ = await store.create_run("measure", AGENT)
    w = workers.start("w-measure", env={"ANTHROPIC_BASE_URL": srv.base_url})
    done = await wait_run(store, run.id, lambda r: r.finished, 60)
    assert done.status == "succeeded", done.error
    w.signal(signal.SIGTERM)  # the measured run's worker must not take the next run
    assert w.wait() == 0
    return await turn_usage(store, done)


async def test_max_tokens_stops_before_the_turn_that_would_pass_it(
    store: Store, workers: Workers, fake: FakeFactory
) -> None:
    usage = await measured_turns(store, workers, fake, 8)
    tokens = [turn_tokens(u) for u in usage]
    budget = sum(tokens[:3])  # three turns fit exactly; the fourth re-sends more than is left

    srv = fake(echo_scenario(8))
    agent = AGENT.model_copy(update={"budget": BudgetSpec(maxTokens=budget)})
    run, _ = await store.create_run("measure", agent)
    w = workers.start("w-budget", env={"ANTHROPIC_BASE_URL": srv.base_url}, health=True)
    done = await wait_run(store, run.id, lambda r: r.finished, 60)

    assert done.status == "failed"
    assert done.error is not None
    assert done.error.startswith(f"budget: spec.budget.maxTokens {budget} would be passed")
    steps = await store.steps(run.id)
    # Three turns and their three tool results, all committed: it stopped at a commit boundary,
    # before the model call, with no tool cut off.
    assert [s.kind for s in steps] == ["model_turn", "tool_result"] * 3
    assert len([e for e in srv.requests() if e.get("status") == 200]) == 3  # no fourth call
    assert done.total_tokens == budget
    body = metrics(w.health_port)
    assert sample(body, 'agentrun_budget_stops_total{limit="maxTokens"}') == 1
    # The run's log line says why, with its run id.
    lines = [x for x in w.json_lines() if x.get("run_id") == str(run.id)]
    assert any("spec.budget.maxTokens" in x["msg"] for x in lines), lines[-5:]


async def test_an_agentrun_budget_overrides_its_agent_and_max_cost_stops_the_run(
    store: Store, workers: Workers, fake: FakeFactory
) -> None:
    usage = await measured_turns(store, workers, fake, 8)
    costs = [BUILT_IN.cost_usd(MODEL, usage_kinds(u)) for u in usage]
    limit = sum(costs[:2])
    manifest = f"""
apiVersion: agentrun.dev/v1alpha1
kind: Agent
metadata: {{name: echo}}
spec:
  model: {MODEL}
  system: {json.dumps(AGENT.system)}
  tools: [echo]
  thinking: {{budgetTokens: 1024}}
  budget: {{maxTokens: 1000000, maxCostUSD: 50}}
---
apiVersion: agentrun.dev/v1alpha1
kind: AgentRun
metadata: {{name: capped}}
spec:
  agent: {{name: echo}}
  task: measure
  budget: {{maxCostUSD: {limit!r}}}
"""
    (resolved,) = load_manifest_texts([("capped.yaml", manifest)])
    # The run's limit replaces the Agent's; the Agent's other limit stays.
    assert resolved.agent.pinned()["budget"] == {"maxTokens": 1000000, "maxCostUSD": limit}
    srv = fake(echo_scenario(8))
    run, _ = await store.create_run(resolved.task, resolved.agent)
    workers.start("w-cost", env={"ANTHROPIC_BASE_URL": srv.base_url})
    done = await wait_run(store, run.id, lambda r: r.finished, 60)

    assert done.status == "failed"
    assert done.error is not None and done.error.startswith(
        f"budget: spec.budget.maxCostUSD {limit:g} would be passed"
    )
    assert [s.kind for s in await store.steps(run.id)] == ["model_turn", "tool_result"] * 2
    assert done.cost_usd == pytest.approx(limit)
    assert done.cost_usd <= limit * (1 + 1e-9)


async def test_a_price_file_prices_every_turn_and_the_pool_metric_sums_them(
    store: Store, workers: Workers, fake: FakeFactory, tmp_path: Path
) -> None:
    prices = {
        "models": {"claude-sonnet": {"input": 1, "output": 2, "cacheWrite": 4, "cacheRead": 8}},
    }
    path = tmp_path / "prices.json"
    path.write_text(json.dumps(prices))
    table = load_prices(str(path))
    srv = fake(echo_scenario(3))
    run, _ = await store.create_run("priced", AGENT.model_copy(update={"pool": "gpu"}))
    w = workers.start(
        "w-prices",
        env={"ANTHROPIC_BASE_URL": srv.base_url},
        extra=["--prices", str(path), "--pool", "gpu"],
        health=True,
    )
    done = await wait_run(store, run.id, lambda r: r.finished, 60)
    assert done.status == "succeeded", done.error
    usage = await turn_usage(store, done)
    expected = sum(
        u["input_tokens"] * 1 + u["output_tokens"] * 2 + u["cache_creation_input_tokens"] * 4
        + u["cache_read_input_tokens"] * 8
        for u in usage
    ) / 1e6
    assert done.cost_usd == pytest.approx(expected)
    assert table.cost_usd(MODEL, usage_kinds(usage[0])) != BUILT_IN.cost_usd(
        MODEL, usage_kinds(usage[0])
    )
    body = metrics(w.health_port)
    # No pool label of its own: the chart's scrape config adds the pod's (charts: monitors.yaml).
    series = f'agentrun_cost_usd_total{{model="{MODEL}"}}'
    assert sample(body, series) == pytest.approx(expected)


def test_a_bad_price_file_stops_the_worker_with_one_line(
    tmp_path: Path, database_url: str
) -> None:
    path = tmp_path / "prices.json"
    path.write_text(json.dumps({"models": {"m": {"input": 1, "output": "x", "cacheWrite": 1,
                                                  "cacheRead": 1}}}))
    proc = run_cli("worker", "--prices", str(path), env={"AGENTRUN_DATABASE_URL": database_url})
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "models.m.output" in lines[0] and "'x' is not a price" in lines[0]


@pytest.mark.parametrize(
    ("data", "says"),
    [
        ([], "(top level)"),
        ({"models": {}}, "models: must be a non-empty object"),
        ({"models": {"m": {"input": 1, "output": 1, "cacheWrite": 1}}}, "models.m.cacheRead"),
        ({"models": {"m": {"input": -1, "output": 1, "cacheWrite": 1, "cacheRead": 1}}},
         "models.m.input"),
        ({"models": {"m": {"input": 1, "output": 1, "cacheWrite": 1, "cacheRead": 1,
                           "batch": 1}}}, "models.m.batch: unknown token kind"),
        ({"models": {"m": {"input": 1, "output": 1, "cacheWrite": 1, "cacheRead": 1}},
          "default": "n"}, "default: 'n' is not one of the models"),
        ({"prices": {}}, "prices: unknown key"),
    ],
)
def test_price_file_errors_name_the_field(data: Any, says: str) -> None:
    with pytest.raises(ConfigError, match=r"^f: ") as info:
        parse_prices(data, "f")
    assert says in str(info.value)


def test_a_model_is_priced_by_the_longest_entry_its_id_contains() -> None:
    table = parse_prices(
        {
            "models": {
                "claude-sonnet-4": {"input": 1, "output": 1, "cacheWrite": 1, "cacheRead": 1},
                "claude-sonnet-4-5": {"input": 2, "output": 2, "cacheWrite": 2, "cacheRead": 2},
            },
            "default": "claude-sonnet-4",
        },
        "f",
    )
    for model in ("claude-sonnet-4-5-20250929", "anthropic.claude-sonnet-4-5-20250929-v1:0",
                  "claude-sonnet-4-5@20250929"):
        assert table.prices_for(model)["input"] == 2, model
    assert table.prices_for("claude-sonnet-4-20250514")["input"] == 1
    assert table.prices_for("some-other-model")["input"] == 1  # the default
    assert not table.known("some-other-model") and table.known("claude-sonnet-4-5@x")


def test_the_first_turn_always_runs_and_no_budget_never_stops() -> None:
    assert over_budget(None, Spend(10**9, 10**6, 10**9), MODEL, BUILT_IN, True) is None
    tiny = BudgetSpec(maxTokens=1, maxCostUSD=1e-9)
    assert over_budget(tiny, Spend(0, 0.0, 0), MODEL, BUILT_IN, True) is None
    stop = over_budget(tiny, Spend(5, 0.0, 5), MODEL, BUILT_IN, True)
    assert stop is not None and stop[0] == "maxTokens"


def test_budget_values_are_checked_with_one_line_naming_the_field() -> None:
    manifest = """
apiVersion: agentrun.dev/v1alpha1
kind: AgentRun
metadata: {name: bad}
spec:
  agent: {model: claude-sonnet-4-5}
  task: t
  budget: {maxCostUSD: 0}
"""
    with pytest.raises(ConfigError) as info:
        load_manifest_texts([("bad.yaml", manifest)])
    assert "spec.budget.maxCostUSD: Input should be greater than 0" in str(info.value)
    assert "\n" not in str(info.value)
