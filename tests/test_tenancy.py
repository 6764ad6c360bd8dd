"""The tenancy file (agentrun.operator.tenancy): which namespaces a pool admits, its errors, and
the status of a pending run held back by its namespace's quota."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from agentrun.errors import ConfigError
from agentrun.operator.status import status_for
from agentrun.operator.tenancy import load_tenancy
from agentrun.store import Quota
from tests.test_operator_status import run


def tenancy(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "tenancy.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_pool_admits_its_listed_and_labelled_namespaces_and_unlisted_pools_admit_all(
    tmp_path: Path,
) -> None:
    t = load_tenancy(tenancy(tmp_path, {"pools": [
        {"name": "pay", "namespaces": ["pay"], "namespaceSelector": {
            "matchLabels": {"tier": "prod"},
            "matchExpressions": [{"key": "team", "operator": "In", "values": ["a", "b"]},
                                 {"key": "frozen", "operator": "DoesNotExist"}]}},
        {"name": "open"},
    ]}))
    assert t.quotas == {}
    assert t.refusal("pay", "pay") is None and not t.needs_labels("pay", "pay")
    assert t.needs_labels("pay", "other")
    assert t.refusal("pay", "other", {"tier": "prod", "team": "b"}) is None
    for labels in ({"tier": "prod"}, {"tier": "dev", "team": "a"},
                   {"tier": "prod", "team": "a", "frozen": "1"}):
        why = t.refusal("pay", "other", labels)
        assert why is not None and why.startswith(
            "pool pay admits only namespaces pay or namespaces labelled tier=prod, team In (a, b), "
            "frozen DoesNotExist; namespace other is not one of them"), why
    assert t.refusal("open", "x") is None and t.refusal("not-listed", "x") is None


@pytest.mark.parametrize(("data", "says"), [
    ({"pools": [{"name": "a"}, {"name": "a"}]}, "pool 'a' is listed twice"),
    ({"pools": [{"name": "a", "namespaceSelector": {"matchExpressions": [
        {"key": "k", "operator": "Near"}]}}]},
     "pools.0.namespaceSelector.matchExpressions.0.operator"),
    ({"quotas": {"team-a": {"maxRunningRuns": -1}}}, "quotas.team-a.maxRunningRuns"),
    ({"quota": {}}, "quota: Extra inputs are not permitted"),
])
def test_a_bad_tenancy_file_is_one_line_naming_the_field(
    tmp_path: Path, data: object, says: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_tenancy(tenancy(tmp_path, data))
    assert says in str(info.value) and "\n" not in str(info.value)


def test_a_pending_run_of_a_full_namespace_says_why_and_a_free_one_does_not() -> None:
    pending = run(k8s_namespace="team-a")
    full = status_for(pending, db_up=True, previous=None, quota=Quota("team-a", 2, 2))
    assert full["message"] == "waiting: namespace team-a has 2 running runs, its quota is 2"
    (ready,) = [c for c in full["conditions"] if c["type"] == "Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "QuotaExceeded")
    free = status_for(pending, db_up=True, previous=None, quota=Quota("team-a", 2, 1))
    assert free["message"] == "waiting for a worker in pool default"
    running = status_for(run(k8s_namespace="team-a", status="running", lease_owner="w"),
                         db_up=True, previous=None, quota=Quota("team-a", 2, 2))
    assert "quota" not in running["message"]
