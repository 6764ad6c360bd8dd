"""The chart's worker settings start from the worker's own defaults (one default per setting): a
pool that sets nothing runs as `agentrun worker` with no flags would. The chart always renders
these variables, so a default changed in the code alone would never reach a Helm install."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from agentrun.worker.settings import WorkerSettings

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
