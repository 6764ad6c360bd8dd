"""The chart's worker settings start from the worker's own defaults (one default per setting): a
pool that sets nothing runs as `agentrun worker` with no flags would. The chart always renders
these variables, so a default changed in the code alone would never reach a Helm install."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from agentrun.tools import MAX_TOOL_TIMEOUT
from agentrun.worker.settings import MAX_LEASE_TTL, WorkerSettings

VALUES = Path(__file__).resolve().parent.parent / "charts" / "agentrun" / "values.yaml"

# values.yaml's workers.poolDefaults key -> WorkerSettings field (the variable between them is
# AGENTRUN_<FIELD>, rendered by templates/worker-deployments.yaml).
MAPPED = {
    "concurrency": "concurrency",
    "drainGraceSeconds": "drain_grace",
    "leaseTtlSeconds": "lease_ttl",
    "toolTimeoutSeconds": "tool_timeout",
    "progressBudgetSeconds": "progress_budget",
}


def pool_defaults() -> dict[str, Any]:
    values = yaml.safe_load(VALUES.read_text())
    defaults: dict[str, Any] = values["workers"]["poolDefaults"]
    return defaults


@pytest.mark.parametrize(("key", "field"), MAPPED.items())
def test_the_chart_default_is_the_workers_default(key: str, field: str) -> None:
    assert pool_defaults()[key] == getattr(WorkerSettings(), field), (
        f"values.yaml workers.poolDefaults.{key} differs from WorkerSettings.{field}'s default"
    )


def test_the_chart_model_deadline_is_the_workers_default() -> None:
    assert pool_defaults()["modelDeadlineSeconds"] == WorkerSettings().retry.deadline


def test_the_chart_bounds_the_lease_ttl_as_the_worker_does() -> None:
    schema = json.loads((VALUES.parent / "values.schema.json").read_text())
    bounds = [node["maximum"] for node in _walk(schema) if isinstance(node, dict)
              and node.get("description", "").startswith("Lease time-to-live")]
    assert bounds and set(bounds) == {MAX_LEASE_TTL}


def test_the_chart_bounds_the_tool_timeout_as_the_worker_does() -> None:
    schema = json.loads((VALUES.parent / "values.schema.json").read_text())
    tool = schema["properties"]["workers"]["properties"]["poolDefaults"]["properties"][
        "toolTimeoutSeconds"]
    assert tool["maximum"] == MAX_TOOL_TIMEOUT


def _walk(node: Any) -> Iterator[Any]:
    yield node
    children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
    for child in children:
        yield from _walk(child)
