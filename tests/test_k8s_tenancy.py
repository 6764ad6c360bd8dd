"""Pools bound to namespaces and per-namespace quotas on the real API server (v1.36), with the
chart's own tenancy file and RBAC: the operator runs with its ServiceAccount's token.

* An AgentRun whose pool does not admit its namespace gets ``Accepted=False, PoolNotAllowed``
  naming the pool and the rule, one Warning Event, and no run row; a namespace labelled to match
  a pool's selector is admitted at the next retry.
* Quotas hold under 100 pending runs from three namespaces worked by three real worker processes:
  a namespace never has more running runs than its quota, the namespace without one runs past it,
  and a pending run of a full namespace says why in its status.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml

from agentrun.store import Store
from tests.kubekit import Operators, agent_manifest, agentrun_manifest, eventually
from tests.realkube import Kube, Release, install_chart, new_namespace
from tests.workerkit import FakeFactory, Workers, echo_scenario

TENANT_LABEL = "agentrun-test-tenant"


def tenancy_file(release: Release, directory: Path) -> Path:
    """The chart's rendered tenancy file, as the operator pod would mount it."""
    cm = release.kube.get(
        f"/api/v1/namespaces/{release.namespace}/configmaps/{release.fullname}-pools")
    assert cm is not None
    path = directory / "tenancy.yaml"
    path.write_text(cm["data"]["tenancy.yaml"])
    return path


@dataclass
class TenantOperators(Operators):
    """Operators with the chart's operator token, watching ``watch``, reading the chart's
    tenancy file."""

    env: dict[str, str] = field(default_factory=dict)

    def start(self, **kwargs: Any) -> Any:
        return super().start(env=self.env, **kwargs)


def operators_for(
    release: Release, database_url: str, tmp: Path, watch: list[str]
) -> TenantOperators:
    kubeconfig = release.kubeconfig_for(release.operator_sa, tmp)
    return TenantOperators(None, database_url, tmp, kubeconfig=kubeconfig, env={
        "AGENTRUN_WATCH_NAMESPACES": ",".join(watch),
        "AGENTRUN_TENANCY_FILE": str(tenancy_file(release, tmp)),
        "AGENTRUN_AGENT_RETRY_DELAY": "1",
    })


def assert_never_forbidden(ops: Operators) -> None:
    for p in ops.procs:
        refused = [ln for ln in p.output().splitlines() if "forbidden" in ln.lower()]
        assert not refused, "refused by the chart's RBAC:\n" + "\n".join(refused[:5])


def condition(kube: Kube, name: str, ctype: str, ns: str | None = None) -> dict[str, Any]:
    status = (kube.agentrun(name, ns) or {}).get("status") or {}
    for c in status.get("conditions") or []:
        if c["type"] == ctype:
            return dict(c)
    return {}


@pytest.fixture
def bound(
    kube: Kube, database_url: str, tmp_path: Path
) -> Iterator[tuple[Release, TenantOperators]]:
    ns = kube.namespace
    release = install_chart(
        kube, ns,
        f"operator.watchNamespaces={{{ns}}}",
        "workers.pools[0].name=default",
        f"workers.pools[0].namespaces={{{ns}}}",
        "workers.pools[1].name=locked",
        "workers.pools[1].namespaces={elsewhere}",
        "workers.pools[2].name=labelled",
        f"workers.pools[2].namespaceSelector.matchLabels.{TENANT_LABEL}=yes",
    )
    ops = operators_for(release, database_url, tmp_path, [ns])
    try:
        yield release, ops
    finally:
        ops.stop_all()
        kube.helm("uninstall", release.name, "-n", ns, "--wait=false", check=False)
    assert_never_forbidden(ops)


async def test_a_pool_refuses_a_namespace_it_does_not_admit_and_no_run_is_created(
    kube: Kube, admin_kube: Kube, bound: tuple[Release, TenantOperators], store: Store
) -> None:
    _, ops = bound
    ops.start()
    kube.apply_agent(agent_manifest())
    kube.apply_agentrun(agentrun_manifest("ok"))
    kube.apply_agentrun(agentrun_manifest("refused", pool="locked"))
    kube.apply_agentrun(agentrun_manifest("bylabel", pool="labelled"))

    ok = await eventually(lambda: condition(kube, "ok", "Accepted").get("status") == "True",
                          30, "ok accepted")
    assert ok
    for name, pool, rule in (("refused", "locked", "namespaces elsewhere"),
                             ("bylabel", "labelled", f"namespaces labelled {TENANT_LABEL}=yes")):
        await eventually(
            lambda n=name: condition(kube, n, "Accepted").get("reason") == "PoolNotAllowed", 30,
            f"{name} refused")
        accepted = condition(kube, name, "Accepted")
        assert accepted["status"] == "False"
        assert f"pool {pool} admits only {rule}" in accepted["message"]
        assert f"namespace {kube.namespace} is not one of them" in accepted["message"]
        status = (kube.agentrun(name) or {})["status"]
        assert "runId" not in status
        assert status["message"] == f"pool {pool} does not admit namespace {kube.namespace}"
    runs = await store.list_runs(namespace=kube.namespace)
    assert [r.k8s_name for r in runs] == ["ok"]  # no row for either refused AgentRun

    # Labelled to match the selector, the namespace is admitted at the next retry.
    admin_kube.patch(f"/api/v1/namespaces/{kube.namespace}",
                     {"metadata": {"labels": {TENANT_LABEL: "yes"}}})
    await eventually(lambda: condition(kube, "bylabel", "Accepted").get("status") == "True", 30,
                     "bylabel admitted once labelled")
    # One Warning, though kopf retried it every second meanwhile.
    warnings = [e for e in kube.events("refused") if e["reason"] == "PoolNotAllowed"]
    assert len(warnings) == 1 and warnings[0]["type"] == "Warning"
    assert condition(kube, "refused", "Accepted").get("reason") == "PoolNotAllowed"
    assert sorted(r.k8s_name or "" for r in await store.list_runs(namespace=kube.namespace)) == [
        "bylabel", "ok"]


async def running_by_namespace(url: str) -> Counter[str]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT k8s_namespace, count(*) FROM agent_run WHERE status = 'running' GROUP BY 1")
        return Counter({ns: n for ns, n in await cur.fetchall()})


async def test_quotas_hold_under_100_pending_runs_from_three_namespaces(
    kube: Kube, admin_kube: Kube, database_url: str, store: Store, tmp_path: Path,
    workers: Workers, fake: FakeFactory,
) -> None:
    extra = [new_namespace(admin_kube), new_namespace(admin_kube)]
    spaces = [kube.namespace, *extra]
    quota = {spaces[0]: 2, spaces[1]: 4}  # spaces[2]: none
    try:
        release = install_chart(
            kube, kube.namespace,
            "operator.watchNamespaces={" + ",".join(spaces) + "}",
            *(f"quotas.{ns}.maxRunningRuns={n}" for ns, n in quota.items()),
        )
        ops = operators_for(release, database_url, tmp_path, spaces)
        try:
            ops.start()
            srv = fake(echo_scenario(2, delay_ms=150))  # runs overlap: slots are contended
            workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
            names: dict[str, list[str]] = {}
            for i, ns in enumerate(spaces):
                kube.for_namespace(ns).apply_agent(agent_manifest(), ns)
                count = 34 if i == 0 else 33
                names[ns] = [f"q{k}" for k in range(count)]
                docs = [agentrun_manifest(n) for n in names[ns]]
                kube.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump_all(docs))
            for k in range(3):
                workers.start(f"w{k}", lease_ttl=5, extra=["--concurrency", "6"])
            worst: Counter[str] = Counter()
            saw_reason = False
            while True:
                now = await running_by_namespace(database_url)
                for ns, n in now.items():
                    worst[ns] = max(worst[ns], n)
                for ns, cap in quota.items():
                    assert now[ns] <= cap, (ns, now)
                if not saw_reason:
                    saw_reason = any(
                        condition(kube, n, "Ready", spaces[0]).get("reason") == "QuotaExceeded"
                        for n in names[spaces[0]][-5:]
                    )
                runs = await store.list_runs(limit=1000)
                done = [r for r in runs if r.finished]
                if len(runs) == 100 and len(done) == 100:
                    break
                await asyncio.sleep(0.05)  # sampling cadence of a checker, not a wait for state
            assert all(r.status == "succeeded" for r in runs), [r.error for r in runs][:3]
            assert worst[spaces[0]] == 2 and worst[spaces[1]] == 4  # reached, never passed
            assert worst[spaces[2]] > 4  # the namespace without a quota ran past them
            assert saw_reason, "no pending run of the full namespace said QuotaExceeded"
            assert {q.namespace: (q.max_running, q.running) for q in await store.quotas()} == {
                spaces[0]: (2, 0), spaces[1]: (4, 0)}
        finally:
            ops.stop_all()
            kube.helm("uninstall", release.name, "-n", kube.namespace, "--wait=false",
                      check=False)
        assert_never_forbidden(ops)
    finally:
        for ns in extra:
            admin_kube.request("DELETE", f"/api/v1/namespaces/{ns}")
