"""The operator, for real: ``agentrun operator`` processes (kopf) against a real kube-apiserver
1.36 (tests/realkube.py), authenticated with the token of the chart's own operator ServiceAccount
(the chart is ``helm install``-ed into the test's namespace, so RBAC is the chart's), and a real
PostgreSQL. Runs advance through store calls (deterministic) or a real worker.

Each test has its own namespace, release, database and operator; every process is stopped by its
pid, and no operator may log a Forbidden (the chart's RBAC must be enough).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import kopf
import psycopg
import pytest
import yaml
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from agentrun.migrations import latest_version, schema_version
from agentrun.operator import handlers
from agentrun.operator.api import APPROVE, RETRY, Reason
from agentrun.operator.app import APP, OperatorApp
from agentrun.operator.kube import KubeApi
from agentrun.sql import queries
from agentrun.store import K8sRef, Run, Store
from tests.conftest import run_cli
from tests.kubekit import Operators, agent_manifest, agentrun_manifest, eventually
from tests.proxykit import TcpProxy
from tests.realkube import AGENTRUNS, Kube, Release, install_chart, new_namespace
from tests.workerkit import AGENT, FakeFactory, Workers, echo_scenario, free_port, wait_run

ROOT = Path(__file__).resolve().parent.parent

#: Chart values of the release each test installs: the default pool autoscaled with small
#: numbers, so scaling is seen within seconds.
CHART_VALUES = (
    "workers.poolDefaults.autoscaling.runsPerWorker=2",
    "workers.poolDefaults.autoscaling.maxReplicas=3",
    "workers.poolDefaults.autoscaling.scaleDownDelaySeconds=3",
)


@dataclass
class _Kubeconfig:
    """What kubekit.Operators asks of a cluster: a kubeconfig (here the operator SA's)."""

    path: Path

    def kubeconfig(self, directory: Path) -> Path:
        return self.path


@dataclass
class NsOperators(Operators):
    """Operators watching the test's namespace only (the chart's ClusterRole would let them
    see every namespace; other tests' objects are not theirs)."""

    namespace: str = ""

    def start(self, *, env: dict[str, str] | None = None, **kwargs: Any) -> Any:
        return super().start(
            env={"AGENTRUN_WATCH_NAMESPACES": self.namespace, **(env or {})}, **kwargs
        )


@pytest.fixture
def release(kube: Kube) -> Iterator[Release]:
    # Installed the way the operator runs here: watching this namespace only (a cluster-wide
    # operator would take other tests' objects); tests/test_k8s_helm.py covers cluster-wide.
    rel = install_chart(kube, kube.namespace, *CHART_VALUES,
                        f"operator.watchNamespaces={{{kube.namespace}}}")
    try:
        yield rel
    finally:
        kube.helm("uninstall", rel.name, "-n", kube.namespace, "--wait=false", check=False)


@pytest.fixture
def cluster(kube: Kube) -> Kube:
    return kube


@pytest.fixture
def operators(
    kube: Kube, release: Release, database_url: str, tmp_path: Path
) -> Iterator[NsOperators]:
    kubeconfig = release.kubeconfig_for(release.operator_sa, tmp_path)
    ops = NsOperators(_Kubeconfig(kubeconfig), database_url, tmp_path,  # type: ignore[arg-type]
                      namespace=kube.namespace)
    try:
        yield ops
    finally:
        ops.stop_all()
    for p in ops.procs:
        out = p.output()
        # Every refusal by RBAC says forbidden (kopf: APIForbiddenError; the client: 403
        # Forbidden); a bare "403" would also match a timestamp's milliseconds.
        refused = [ln for ln in out.splitlines() if "forbidden" in ln.lower()]
        assert not refused, "the operator was refused by the chart's RBAC:\n" + "\n".join(
            refused[:5])


def status(cluster: Kube, name: str) -> dict[str, Any]:
    return dict((cluster.agentrun(name) or {}).get("status") or {})


def condition(cluster: Kube, name: str, ctype: str) -> dict[str, Any] | None:
    for c in status(cluster, name).get("conditions") or []:
        if c["type"] == ctype:
            return dict(c)
    return None


async def run_of(store: Store, cluster: Kube, name: str) -> Run:
    rid = await eventually(lambda: status(cluster, name).get("runId"), 30, f"{name} to get a run")
    return await store.get_run(rid)


def kopf_retries(cluster: Kube, name: str) -> int:
    """How often kopf has retried the create handler (its progress annotation)."""
    annotations = ((cluster.agentrun(name) or {}).get("metadata") or {}).get("annotations") or {}
    progress = annotations.get("operator.agentrun.dev/run")
    return int(json.loads(progress).get("retries") or 0) if progress else 0


async def count_runs(store: Store, uid: str) -> int:
    async with store.pool.connection() as conn:
        cur = await conn.execute("SELECT count(*) FROM agent_run WHERE k8s_uid = %s", (uid,))
        row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def test_apply_creates_one_run_even_when_the_create_handler_runs_twice(
    cluster: Kube, operators: NsOperators, store: Store
) -> None:
    # The first operator dies (SIGKILL) right after the insert, before kopf records that the
    # handler succeeded; the next one runs the create handler again and must find the same row.
    first = operators.start(env={"AGENTRUN_TEST_FAULTS": "operator_after_create_run@0"})
    cluster.apply_agent(agent_manifest())
    obj = cluster.apply_agentrun(agentrun_manifest("once"))
    uid = obj["metadata"]["uid"]
    await asyncio.to_thread(first.popen.wait, 30)
    assert first.popen.returncode == -9
    assert await count_runs(store, uid) == 1
    assert "runId" not in status(cluster, "once")  # kopf never finished the handler

    operators.start()
    run = await run_of(store, cluster, "once")
    assert run.k8s_uid == uid and run.k8s_name == "once" and run.k8s_namespace == cluster.namespace
    assert run.agent_spec["system"] == "You echo carefully."  # the Agent was resolved and pinned
    assert await count_runs(store, uid) == 1
    assert status(cluster, "once")["phase"] == "pending"
    # Read once: the mirror may patch the status between two reads (observedGeneration).
    accepted = condition(cluster, "once", "Accepted") or {}
    assert (accepted.get("status"), accepted.get("reason")) == ("True", "RunCreated"), accepted


async def test_status_follows_the_run_and_events_mark_its_transitions(
    cluster: Kube, operators: NsOperators, store: Store
) -> None:
    op = operators.start()
    cluster.apply_agentrun(agentrun_manifest(
        "follow", agent={"model": "claude-sonnet-4-5", "tools": ["echo"]}, maxAttempts=2))
    run = await run_of(store, cluster, "follow")
    assert status(cluster, "follow")["model"] == "claude-sonnet-4-5"

    # Claimed by a, two steps, then a goes silent: its lease runs out, b resumes.
    [(_, lease_a)] = (await store.with_lease_ttl(0.5).claim("default", "worker-a")).claimed
    await eventually(lambda: status(cluster, "follow").get("phase") == "running", 10, "running")
    assert status(cluster, "follow")["worker"] == "worker-a"
    turn = {"role": "assistant", "content": [{"type": "text", "text": "hi"}]}
    await store.with_lease_ttl(0.5).append_step(
        lease_a, 0, "model_turn", turn, input_tokens=120, output_tokens=7,
        cache_read_tokens=900, cache_write_tokens=60, cost_usd=0.001234567,
    )
    await store.with_lease_ttl(0.5).append_step(lease_a, 1, "tool_result", {"content": []})
    # Steps are not notified; the resync (1 s in tests) brings them.
    await eventually(lambda: status(cluster, "follow").get("step") == 2, 10, "step 2")
    assert status(cluster, "follow")["tokens"] == {
        "input": 120, "output": 7, "cacheRead": 900, "cacheWrite": 60
    }
    assert status(cluster, "follow")["costUSD"] == 0.001235  # micro-dollars
    await asyncio.sleep(0.6)
    [(_, lease_b)] = (await store.with_lease_ttl(30).claim("default", "worker-b")).claimed
    await eventually(lambda: status(cluster, "follow").get("worker") == "worker-b", 10, "worker b")
    assert status(cluster, "follow")["attempt"] == 2
    await store.append_step(lease_b, 2, "model_turn", turn)
    await store.finish(lease_b, "succeeded", result="All done: the region column exists.")
    await eventually(lambda: status(cluster, "follow").get("phase") == "succeeded", 10, "done")
    s = status(cluster, "follow")
    assert (s["step"], s["attempt"], s["result"]) == (3, 2, "All done: the region column exists.")
    assert s["finishedAt"] and s["startedAt"] and s.get("worker") is None
    assert condition(cluster, "follow", "Completed")["reason"] == "Succeeded"  # type: ignore[index]

    await eventually(lambda: "Finished" in cluster.reasons("follow"), 10, "the Finished event")
    # A real API server lists Events by name, not in order: compare them as a set.
    listed = cluster.events("follow")
    events = {e["reason"]: e for e in listed}
    assert sorted(e["reason"] for e in listed) == [
        "Claimed", "Created", "Finished", "LeaseExpired"]
    # B15: one source for every Event of the object, the operator's (none from kopf).
    assert {(e["source"].get("component"), e.get("reportingComponent")) for e in listed} == {
        ("agentrun-operator", "agentrun-operator")}
    assert events["LeaseExpired"]["type"] == "Warning"
    resumed = events["LeaseExpired"]["message"]
    assert resumed == "worker-a stopped renewing its lease; resumed by worker-b at step 2 " \
        "(attempt 2)"

    # Metrics: the finished run's steps and attempts, runs by status.
    await eventually(
        lambda: op.metric("agentrun_runs", pool="default", status="succeeded") == 1, 10, "gauge"
    )
    assert op.metric("agentrun_run_steps_count", pool="default") == 1
    assert op.metric("agentrun_run_attempts_sum", pool="default") == 2
    # Its estimated cost, from the notification (the appended turn's cost_usd above).
    assert op.metric("agentrun_run_cost_usd_sum", pool="default") == pytest.approx(0.001234567)
    assert (op.metric("agentrun_status_patches_total") or 0) >= 4
    assert run.id == (await store.get_run(run.id)).id


def events_of(cluster: Kube, name: str, reason: str) -> list[dict[str, Any]]:
    return [e for e in cluster.events(name) if e["reason"] == reason]


async def steps(store: Store, lease: Any, seqs: range) -> None:
    turn = {"role": "assistant", "content": [{"type": "text", "text": "hi"}]}
    for seq in seqs:
        await store.with_lease_ttl(30).append_step(lease, seq, "model_turn", turn)


async def test_a_graceful_hand_over_is_a_normal_event_and_only_an_expired_lease_a_warning(
    cluster: Kube, operators: NsOperators, store: Store
) -> None:
    # Issue 19: a release and the next claim come milliseconds apart, so the operator saw one
    # change of worker and reported a lease that "stopped renewing" (11 of 14 hand-overs on a
    # real node). After an operator restart, the step named was where the run was when the
    # operator read it, not where it changed hands.
    op = operators.start()
    cluster.apply_agent(agent_manifest())
    cluster.apply_agentrun(agentrun_manifest("hands"))
    run = await run_of(store, cluster, "hands")
    [(_, a)] = (await store.with_lease_ttl(30).claim("default", "worker-a")).claimed
    await steps(store, a, range(2))
    await eventually(lambda: status(cluster, "hands").get("step") == 2, 15, "step 2 mirrored")

    # A drain: a releases, b claims at once (inside one flush window).
    assert await store.release(a)
    [(_, b)] = (await store.with_lease_ttl(0.5).claim("default", "worker-b")).claimed
    [handed] = await eventually(lambda: events_of(cluster, "hands", "HandedOver"), 15,
                                "the HandedOver event")
    assert handed["type"] == "Normal"
    assert handed["message"] == "worker-a handed the run over at step 2; resumed by worker-b " \
        "(attempt 1)"

    # b goes silent: its lease runs out, c takes the run over.
    await store.with_lease_ttl(0.5).append_step(
        b, 2, "model_turn", {"role": "assistant", "content": []})
    await wait_run(store, run.id, lambda r: r.lease_until is not None and
                   r.lease_until.timestamp() < time.time() - 0.1, 10)
    [(_, c)] = (await store.with_lease_ttl(30).claim("default", "worker-c")).claimed
    [expired] = await eventually(lambda: events_of(cluster, "hands", "LeaseExpired"), 15,
                                 "the LeaseExpired event")
    assert expired["type"] == "Warning"
    assert expired["message"] == "worker-b stopped renewing its lease; resumed by worker-c at " \
        "step 3 (attempt 2)"
    await eventually(lambda: status(cluster, "hands").get("worker") == "worker-c", 15, "c shown")

    # The operator is down while c hands the run over at step 5 and d moves it on to step 9.
    op.stop()
    await steps(store, c, range(3, 5))
    assert await store.release(c)
    [(_, d)] = (await store.with_lease_ttl(30).claim("default", "worker-d")).claimed
    await steps(store, d, range(5, 9))
    operators.start()
    later = await eventually(
        lambda: [e for e in events_of(cluster, "hands", "HandedOver") if "worker-c" in
                 e["message"]], 30, "the hand-over while the operator was down")
    assert [e["message"] for e in later] == [
        "worker-c handed the run over at step 5; resumed by worker-d (attempt 2)"]
    await eventually(lambda: status(cluster, "hands").get("step") == 9, 15, "step 9 mirrored")
    assert [e["type"] for e in cluster.events("hands") if e["type"] == "Warning"] == ["Warning"]
    # The store keeps every change of hands, with its kind and times.
    kinds = [(h.kind, h.from_worker, h.to_worker, h.step) for h in await store.handovers(run.id)]
    assert kinds == [("handed_over", "worker-a", "worker-b", 2),
                     ("lease_expired", "worker-b", "worker-c", 3),
                     ("handed_over", "worker-c", "worker-d", 5)]
    assert d


async def test_a_real_worker_runs_an_applied_agentrun_to_its_result(
    cluster: Kube, operators: NsOperators, store: Store, workers: Workers, fake: FakeFactory
) -> None:
    srv = fake(echo_scenario(3))
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    operators.start()
    cluster.apply_agent(agent_manifest(thinking={"budgetTokens": 1024}))
    cluster.apply_agentrun(agentrun_manifest("real"))
    run = await run_of(store, cluster, "real")
    w = workers.start("w1", lease_ttl=5)
    await wait_run(store, run.id, lambda r: r.finished, 60)
    await eventually(lambda: status(cluster, "real").get("phase") == "succeeded", 15, "mirrored")
    s = status(cluster, "real")
    assert s["result"] == "All 3 turns done." and s["step"] == 5 and s["attempt"] == 1
    # With prompt caching on, the API counts most input as cache writes and reads.
    tokens = s["tokens"]
    assert tokens["input"] + tokens["cacheRead"] + tokens["cacheWrite"] > 0
    assert tokens["output"] > 0 and s["costUSD"] > 0
    assert s["promptVersion"] == (await store.get_run(run.id)).prompt_version
    await eventually(lambda: "Finished" in cluster.reasons("real"), 10, "Finished event")
    # Claimed may be coalesced away when the run finished within one flush window.
    assert sorted(cluster.reasons("real")) in (
        ["Claimed", "Created", "Finished"], ["Created", "Finished"])
    w.popen.terminate()
    assert w.wait() == 0


async def test_an_agentrun_budget_over_its_agents_stops_the_run_with_a_warning_event(
    cluster: Kube, operators: NsOperators, store: Store, workers: Workers, fake: FakeFactory
) -> None:
    srv = fake(echo_scenario(6))
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    operators.start()
    cluster.apply_agent(agent_manifest(
        thinking={"budgetTokens": 1024}, budget={"maxTokens": 1, "maxCostUSD": 3}))
    cluster.apply_agentrun(agentrun_manifest("capped", budget={"maxCostUSD": 0.5}))
    run = await run_of(store, cluster, "capped")
    # The run is pinned to the AgentRun's limit over the Agent's, the Agent's other limit kept.
    assert run.agent_spec["budget"] == {"maxTokens": 1, "maxCostUSD": 0.5}
    w = workers.start("w-budget", lease_ttl=5)
    done = await wait_run(store, run.id, lambda r: r.finished, 60)
    assert done.status == "failed" and [s.kind for s in await store.steps(run.id)] == [
        "model_turn", "tool_result"]  # one turn always runs; maxTokens 1 stops the second
    await eventually(lambda: status(cluster, "capped").get("phase") == "failed", 15, "mirrored")
    assert status(cluster, "capped")["error"].startswith("budget: spec.budget.maxTokens 1 ")
    await eventually(lambda: bool(events_of(cluster, "capped", "Failed")), 10, "Failed event")
    (event,) = events_of(cluster, "capped", "Failed")
    assert event["type"] == "Warning" and "spec.budget.maxTokens" in event["message"]
    w.popen.terminate()
    assert w.wait() == 0


async def test_an_agent_asking_for_a_tool_its_pool_does_not_serve_is_warned_at_apply(
    cluster: Kube, operators: NsOperators, store: Store
) -> None:
    # What the pool's workers registered at their start (tests/test_toolsets.py shows a worker
    # doing it): echo only.
    await store.register_toolset("default", "worker-a", ["echo"])
    operators.start()
    cluster.apply_agent(agent_manifest("served", tools=["echo"]))
    cluster.apply_agent(agent_manifest("unserved", tools=["echo", "drop_table"]))
    cluster.apply_agentrun(agentrun_manifest("fine", agent={"name": "served"}))
    cluster.apply_agentrun(agentrun_manifest("warned", agent={"name": "unserved"}))
    await run_of(store, cluster, "fine")
    await run_of(store, cluster, "warned")  # a warning, not a refusal: the run exists
    await eventually(lambda: bool(events_of(cluster, "warned", "UnknownTool")), 10, "warning")
    (event,) = events_of(cluster, "warned", "UnknownTool")
    assert event["type"] == "Warning"
    assert "serve the tools echo; the Agent asks for drop_table" in event["message"]
    assert not events_of(cluster, "fine", "UnknownTool")


async def test_cancel_annotation_cancels_the_run(
    cluster: Kube, operators: NsOperators, store: Store
) -> None:
    operators.start()
    cluster.apply_agent(agent_manifest())
    cluster.apply_agentrun(agentrun_manifest("stop-me"))
    run = await run_of(store, cluster, "stop-me")
    cluster.annotate("stop-me", {"agentrun.dev/cancel": "true"})
    await eventually(lambda: status(cluster, "stop-me").get("phase") == "cancelled", 15, "cancel")
    assert (await store.get_run(run.id)).status == "cancelled"
    annotations = (cluster.agentrun("stop-me") or {})["metadata"].get("annotations") or {}
    assert "agentrun.dev/cancel" not in annotations  # consumed
    await eventually(lambda: "Cancelled" in cluster.reasons("stop-me"), 10, "Cancelled event")


async def test_cancel_annotation_never_interrupts_a_rollback(
    cluster: Kube, operators: NsOperators, store: Store
) -> None:
    operators.start()
    cluster.apply_agent(agent_manifest())
    cluster.apply_agentrun(agentrun_manifest("undo-me"))
    run = await run_of(store, cluster, "undo-me")
    ((_, lease),) = (await store.with_lease_ttl(60).claim("default", "holder")).claimed
    await store.begin_rollback(lease, "tool charge failed: card declined")  # compensating now
    cluster.annotate("undo-me", {"agentrun.dev/cancel": "true"})

    def ignored() -> list[str]:
        return [e["message"] for e in cluster.events("undo-me") if e["reason"] == "CancelIgnored"]

    await eventually(lambda: bool(ignored()), 15, "CancelIgnored event")
    assert ignored() == [
        "the run is rolling back (tool charge failed: card declined): a cancel does not "
        "interrupt a rollback; it ends once its compensations ran"
    ]
    still = await store.get_run(run.id)
    assert still.status == "running" and still.lease_owner == "holder"


async def test_approve_and_reject_annotations_unblock_a_waiting_run(
    cluster: Kube, operators: NsOperators, store: Store
) -> None:
    operators.start()
    cluster.apply_agent(agent_manifest(requireApproval=True))
    for name in ("approve-me", "reject-me"):
        cluster.apply_agentrun(agentrun_manifest(name))
    runs = {name: await run_of(store, cluster, name) for name in ("approve-me", "reject-me")}
    # The operator creates the two runs in whichever order kopf handles the objects: claim both,
    # then match each lease to its object.
    leases = {lease.run_id: lease for _, lease in (
        await store.with_lease_ttl(30).claim("default", "w", limit=2)).claimed}
    for run in runs.values():
        lease = leases[run.id]
        call = {"seq": 0, "call_index": 0, "tool": "drop_table", "input": {"table": "orders"},
                "stage": "before_call"}
        await store.wait_for_approval(lease, "approval required before drop_table (step 0)", call)
    for name in runs:
        await eventually(
            lambda n=name: status(cluster, n).get("phase") == "waiting_approval", 10, "waiting")
        pending = status(cluster, name)["pendingApproval"]
        assert pending == {"seq": 0, "tool": "drop_table", "arguments": '{"table": "orders"}',
                           "reason": "approval required before drop_table (step 0)",
                           "call": 0, "decide": "0.0"}
        assert condition(cluster, name, "WaitingForApproval")["status"] == "True"  # type: ignore[index]
    await eventually(lambda: "WaitingForApproval" in cluster.reasons("approve-me"), 10, "event")

    # A step the run does not wait on is refused, with an Event; the run still waits.
    cluster.annotate("approve-me", {"agentrun.dev/approve": "3"})
    await eventually(lambda: "ActionRefused" in cluster.reasons("approve-me"), 10, "refusal")
    assert (await store.get_run(runs["approve-me"].id)).status == "waiting_approval"

    cluster.annotate("approve-me", {"agentrun.dev/approve": "0"})
    cluster.annotate("reject-me", {"agentrun.dev/reject": "0"})
    for name, decision in (("approve-me", "approved"), ("reject-me", "rejected")):
        run = await wait_run(store, runs[name].id, lambda r: r.status == "pending", 15)
        approval = await store.get_approval(run.id, 0, 0, "before_call")
        assert approval is not None and approval.decision == decision
        assert approval.decided_by == f"annotation on AgentRun {cluster.namespace}/{name}"
        await eventually(lambda n=name: status(cluster, n).get("phase") == "pending", 10, "mirror")
        assert status(cluster, name).get("pendingApproval") is None
    assert "Approved" in cluster.reasons("approve-me")
    assert "Rejected" in cluster.reasons("reject-me")


class _HandlerApp(OperatorApp):
    """The operator's app as the actions handler asks it: the store, the real API server's client
    (annotations are consumed on the API server), settings; Events recorded."""

    def __init__(self, store: Store, kube: KubeApi) -> None:  # none of the app's own start-up
        self.store = store
        self.kube = kube
        self.settings = SimpleNamespace(  # type: ignore[assignment]
            approval_annotations=True, agent_retry_delay=15.0)
        self.events: list[str] = []

    async def ready_store(self, *_: Any, **__: Any) -> Store:  # type: ignore[override]
        return self.store

    async def event(self, ref: Any, event: Any, run_id: Any) -> None:  # type: ignore[override]
        self.events.append(event.reason)


async def test_a_decision_set_on_seeing_the_last_ones_event_is_never_erased(
    cluster: Kube, store: Store
) -> None:
    """Found by CI: "approve=3" refused, the human sets "approve=0" on seeing the refusal, then
    the handler's own patch (kopf applies it after the handler returned) erased "0": no Event, and
    the run waited for ever. The handler is driven here as kopf drives it, its patch applied the
    way kopf applies it, with the human's annotation landing in between, every time."""
    obj = cluster.apply_agentrun(agentrun_manifest("late"))
    uid, path = obj["metadata"]["uid"], f"{AGENTRUNS}/namespaces/{cluster.namespace}/agentruns/late"
    run, _ = await store.create_run("t", AGENT, k8s=K8sRef(cluster.namespace, "late", uid))
    [(_, lease)] = (await store.with_lease_ttl(30).claim("default", "w")).claimed
    await store.wait_for_approval(lease, "approval required", {
        "seq": 0, "call_index": 0, "tool": "drop_table", "input": {}, "stage": "before_call"})
    app = _HandlerApp(store, KubeApi(cluster.api))

    async def handle_then(human: dict[str, str | None]) -> None:
        annotations = (cluster.agentrun("late") or {})["metadata"]["annotations"]
        patch = kopf.Patch()
        await handlers.actions(annotations=annotations, namespace=cluster.namespace,
                               name="late", uid=uid, status={}, patch=patch, memo={APP: app})
        cluster.annotate("late", human)  # the human reads the Event and acts
        if patch:
            cluster.patch(path, dict(patch))  # kopf's patch, after the handler returned

    def annotation() -> str | None:
        return ((cluster.agentrun("late") or {})["metadata"].get("annotations") or {}).get(APPROVE)

    cluster.annotate("late", {APPROVE: "3"})
    await handle_then({APPROVE: "0"})
    assert app.events == [Reason.ACTION_REFUSED]
    assert annotation() == "0", "the decision set after the refusal was erased"
    await handle_then({APPROVE: "0.1"})  # approved; the human answers the step's next call
    assert app.events == [Reason.ACTION_REFUSED, Reason.APPROVED]
    assert (await store.get_run(run.id)).status == "pending"
    assert annotation() == "0.1", "the decision set after the approval was erased"


def annotations_of(cluster: Kube, name: str) -> dict[str, str]:
    return dict(((cluster.agentrun(name) or {}).get("metadata") or {}).get("annotations") or {})


def refusals(cluster: Kube, name: str) -> list[str]:
    return [e["message"] for e in events_of(cluster, name, "ActionRefused")]


async def waiting_on_step_0(cluster: Kube, store: Store, name: str) -> Run:
    """An applied AgentRun (its Agent requires approval) whose run waits on step 0's call 0."""
    cluster.apply_agent(agent_manifest(requireApproval=True))
    cluster.apply_agentrun(agentrun_manifest(name))
    run = await run_of(store, cluster, name)
    [(_, lease)] = (await store.with_lease_ttl(60).claim("default", "w")).claimed
    await store.wait_for_approval(lease, "approval required (step 0)", {
        "seq": 0, "call_index": 0, "tool": "drop_table", "input": {}, "stage": "before_call"})
    return run


@contextlib.contextmanager
def row_held(database_url: str, run_id: Any) -> Iterator[None]:
    """The run's row locked for a moment: the operator's store call on it waits there, after it
    consumed the annotation. Only to make a window repeatable; the lock is not the bug."""
    with psycopg.connect(database_url) as lock:
        lock.execute("SELECT id FROM agent_run WHERE id = %s FOR UPDATE", (run_id,))
        yield
        lock.rollback()


async def test_the_same_decision_set_again_after_it_was_consumed_is_answered(
    cluster: Kube, operators: NsOperators, store: Store, database_url: str
) -> None:
    """Found by an adversarial review (2026-12-07): kopf called the handler only when the object
    differed from the last body it handled, which held approve=0.0; a second human's approve=0.0
    set right after the first one's was consumed looked like no change: no Event, left on the
    object. A retry=true left so was applied when some other change came, after the run had
    failed again, with nobody asking. Every event is acted on now."""
    operators.start()
    run = await waiting_on_step_0(cluster, store, "again")
    await eventually(lambda: status(cluster, "again").get("phase") == "waiting_approval", 15,
                     "waiting")
    cluster.annotate("again", {APPROVE: "0.0"})
    await wait_run(store, run.id, lambda r: r.status == "pending", 15)
    await eventually(lambda: APPROVE not in annotations_of(cluster, "again"), 15, "consumed")
    cluster.annotate("again", {APPROVE: "0.0"})  # the second approver, a moment late
    await eventually(lambda: refusals(cluster, "again"), 15, "the second one answered")
    assert "wait 0.0 was decided before (approved by annotation on AgentRun" in refusals(
        cluster, "again")[0]
    await eventually(lambda: APPROVE not in annotations_of(cluster, "again"), 15, "consumed")
    assert len(events_of(cluster, "again", "Approved")) == 1

    # The same with retry, consumed before it is acted on (the row held keeps the operator
    # inside store.retry while bob sets his): refused (the run is live), not left for later.
    [(_, lease)] = (await store.with_lease_ttl(60).claim("default", "w")).claimed
    await store.finish(lease, "failed", error="tool crashed")
    await eventually(lambda: status(cluster, "again").get("phase") == "failed", 15, "failed")
    with row_held(database_url, run.id):
        cluster.annotate("again", {RETRY: "true"})  # alice
        await eventually(lambda: RETRY not in annotations_of(cluster, "again"), 15, "consumed")
        cluster.annotate("again", {RETRY: "true"})  # bob, a moment later
    await eventually(lambda: any(f"retry='true': run {run.id} is still pending" in m
                                 for m in refusals(cluster, "again")), 15, "bob's retry answered")
    assert RETRY not in annotations_of(cluster, "again")
    assert (await store.get_run(run.id)).retries == 1


async def test_a_decision_the_operator_died_acting_on_is_applied_once_it_is_back(
    cluster: Kube, operators: NsOperators, store: Store, database_url: str
) -> None:
    """Found by the same review: the annotation was consumed before the decision was recorded,
    so an operator killed in between lost it: gone from the object, no Event, the run waiting
    on. It is consumed after now; the operator back acts on it."""
    first = operators.start()
    run = await waiting_on_step_0(cluster, store, "killed")
    with row_held(database_url, run.id):  # the operator is inside store.decide
        cluster.annotate("killed", {APPROVE: "0.0"})
        await eventually(lambda: any(
            "SELECT" in q for q in pg_waiting(database_url)), 15, "decide waiting")
        first.popen.kill()
        first.popen.wait()
    operators.start()
    await wait_run(store, run.id, lambda r: r.status == "pending", 30)
    await eventually(lambda: "Approved" in cluster.reasons("killed"), 15, "Approved")
    assert APPROVE not in annotations_of(cluster, "killed")


def pg_waiting(database_url: str) -> list[str]:
    """The statements waiting on a lock in the test's database (pg_stat_activity)."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT query FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND datname = current_database()").fetchall()
    return [r[0] for r in rows]


async def test_a_retry_racing_a_prune_is_refused_with_an_event(
    cluster: Kube, operators: NsOperators, store: Store, database_url: str
) -> None:
    """Found by the same review: the run pruned between the operator's lookup and its retry
    (agentrun prune beside it) raised RunNotFound through the handler: a traceback, the
    annotation consumed, and never an Event."""
    op = operators.start()
    run = await failed_run(cluster, store, "pruned")
    with psycopg.connect(database_url) as prune:  # a prune's batch, its transaction still open
        prune.execute(queries["prune_set_flag"])
        batch = prune.execute(queries["prune_batch"], {
            "cutoff": datetime.now(UTC) + timedelta(hours=1), "statuses": ["failed"],
            "batch": 10}).fetchone()
        assert batch is not None and batch[0] == 1
        cluster.annotate("pruned", {RETRY: "true"})
        await eventually(lambda: RETRY not in annotations_of(cluster, "pruned"), 15, "consumed")
        prune.commit()
    await eventually(lambda: refusals(cluster, "pruned"), 15, "a refusal")
    assert f"run {run.id} was pruned from the store" in refusals(cluster, "pruned")[0]
    assert "Traceback" not in op.output()


async def test_a_huge_action_value_is_refused_and_leaves_the_object_working(
    cluster: Kube, operators: NsOperators, store: Store
) -> None:
    """Found by the same review: kopf copied the action annotation into its own bookkeeping
    annotation, and a 180 KB value (the API server takes it) made kopf's patch fail, with a
    traceback and throttling. kopf keeps none of the action annotations now."""
    op = operators.start()
    run = await waiting_on_step_0(cluster, store, "huge")
    cluster.annotate("huge", {APPROVE: "0.0 " + "é&<" * 45000})
    await eventually(lambda: refusals(cluster, "huge"), 15, "a refusal")
    await eventually(lambda: APPROVE not in annotations_of(cluster, "huge"), 15, "consumed")
    cluster.annotate("huge", {APPROVE: "0.0"})
    await wait_run(store, run.id, lambda r: r.status == "pending", 15)
    assert "Traceback" not in op.output()
    kept = "".join(annotations_of(cluster, "huge").values())
    assert "é&<" not in kept and "\\u00e9&<" not in kept  # in no bookkeeping of kopf's


async def test_delete_lets_the_object_go_at_once_cancels_the_run_and_keeps_the_history(
    cluster: Kube, operators: NsOperators, store: Store
) -> None:
    operators.start()
    cluster.apply_agent(agent_manifest())
    cluster.apply_agentrun(agentrun_manifest("gone"))
    run = await run_of(store, cluster, "gone")
    [(_, lease)] = (await store.with_lease_ttl(30).claim("default", "w")).claimed
    await store.append_step(lease, 0, "model_turn", {"role": "assistant", "content": []})
    obj = cluster.agentrun("gone") or {}
    assert not obj["metadata"].get("finalizers"), "no finalizer: a delete never waits for us"
    assert cluster.delete_agentrun("gone") == 200
    assert cluster.agentrun("gone") is None
    after = await wait_run(store, run.id, lambda r: r.status == "cancelled", 15)
    assert f"AgentRun {cluster.namespace}/gone deleted" in (after.error or "")
    assert [s.seq for s in await store.steps(run.id)] == [0]  # the history stays


async def test_finished_agentruns_carry_no_finalizer_and_their_namespace_goes_with_no_operator(
    cluster: Kube, operators: NsOperators, store: Store, release: Release
) -> None:
    # Issue 19: after `helm uninstall`, deleting the namespace hung on every finished AgentRun's
    # finalizer (92 on a real node), with no operator left to remove them. A finished run's
    # object needs nothing from the operator (its rows stay in the store); a live one's deletion
    # cancels its run from the watch's DELETED event, or at the next resync when the operator
    # was away (test_a_run_whose_object_vanished_unseen_is_cancelled_once): no object waits.
    op = operators.start()
    cluster.apply_agent(agent_manifest())
    names = ["done-0", "done-1", "done-2", "live"]
    for name in names:
        cluster.apply_agentrun(agentrun_manifest(name))
    runs = {name: await run_of(store, cluster, name) for name in names}
    leases = {lease.run_id: lease for _, lease in (
        await store.with_lease_ttl(60).claim("default", "w", limit=4)).claimed}
    for name, end in zip(names[:3], ("succeeded", "failed", "cancelled"), strict=True):
        await store.finish(leases[runs[name].id], end,  # type: ignore[arg-type]
                           result="done" if end == "succeeded" else None,
                           error=None if end == "succeeded" else f"{end} here")
    for name in names[:3]:
        await eventually(lambda n=name: status(cluster, n).get("finishedAt"), 15, "mirrored")
    await eventually(lambda: status(cluster, "live").get("phase") == "running", 15, "live")
    for name in names:
        meta = (cluster.agentrun(name) or {})["metadata"]
        assert not meta.get("finalizers"), (name, meta.get("finalizers"))

    # The operator stopped and uninstalled, as a user tears down: deletes complete at once.
    op.stop()
    cluster.helm("uninstall", release.name, "-n", cluster.namespace, "--wait")
    assert cluster.delete_agentrun("done-0") == 200
    assert cluster.agentrun("done-0") is None
    assert cluster.request("DELETE", f"/api/v1/namespaces/{cluster.namespace}")[0] == 200
    await eventually(lambda: cluster.get(f"/api/v1/namespaces/{cluster.namespace}") is None, 60,
                     "the namespace gone with its finished (and live) AgentRuns")
    # The store keeps the history: the finished rows are as they were.
    assert (await store.get_run(runs["done-1"].id)).status == "failed"


async def test_unknown_agent_is_a_condition_until_the_agent_exists(
    cluster: Kube, operators: NsOperators, store: Store
) -> None:
    op = operators.start(env={"AGENTRUN_AGENT_RETRY_DELAY": "1"})
    cluster.apply_agentrun(agentrun_manifest("orphan", agent={"name": "missing"}))
    cond = await eventually(lambda: condition(cluster, "orphan", "Accepted"), 15, "condition")
    assert cond["status"] == "False" and cond["reason"] == "AgentNotFound"
    assert f"spec.agent.name: no Agent 'missing' in namespace {cluster.namespace}" in (
        cond["message"])
    assert "AgentNotFound" in cluster.reasons("orphan")
    # B11: retried every second, but said once: one Event, one WARNING line, no ERROR lines.
    await eventually(lambda: kopf_retries(cluster, "orphan") >= 3, 30, "three retries")
    assert cluster.reasons("orphan").count("AgentNotFound") == 1
    lines = [ln for ln in op.output().splitlines() if "missing" in ln]
    assert len(lines) == 1 and "WARNING" in lines[0], lines
    assert "ERROR" not in op.output()
    cluster.apply_agent(agent_manifest("missing"))
    run = await run_of(store, cluster, "orphan")
    assert run.agent_spec["model"] == "claude-sonnet-4-5"
    accepted = condition(cluster, "orphan", "Accepted") or {}
    assert accepted.get("status") == "True"


async def test_dead_lettered_run_gets_a_warning_event(
    cluster: Kube, operators: NsOperators, store: Store
) -> None:
    operators.start()
    cluster.apply_agent(agent_manifest())
    cluster.apply_agentrun(agentrun_manifest("poison", maxAttempts=1))
    await run_of(store, cluster, "poison")
    await store.with_lease_ttl(0.3).claim("default", "w1")
    await asyncio.sleep(0.5)
    result = await store.with_lease_ttl(30).claim("default", "w2")
    assert [r.k8s_name for r in result.dead_lettered] == ["poison"]
    await eventually(lambda: status(cluster, "poison").get("phase") == "dead_letter", 10, "dl")
    await eventually(lambda: "DeadLettered" in cluster.reasons("poison"), 10, "event")
    assert status(cluster, "poison")["message"].startswith("gave up after 1 attempts")


async def test_database_outage_is_a_condition_and_the_operator_recovers_without_restart(
    cluster: Kube, operators: NsOperators, store: Store, database_url: str
) -> None:
    parts = conninfo_to_dict(database_url)
    proxy = TcpProxy((str(parts.get("host", "127.0.0.1")), int(parts.get("port", 5432)))).start()
    try:
        operators.database_url = make_conninfo(database_url, host="127.0.0.1", port=proxy.port)
        op = operators.start()
        cluster.apply_agent(agent_manifest())
        cluster.apply_agentrun(agentrun_manifest("steady"))
        run = await run_of(store, cluster, "steady")
        await eventually(lambda: op.metric("agentrun_operator_db_up") == 1, 10, "db up")

        proxy.cut()
        cond = await eventually(
            lambda: (c := condition(cluster, "steady", "DatabaseAvailable")) and
            c["status"] == "False" and c, 20, "the DatabaseAvailable=False condition")
        assert cond["reason"] == "DatabaseUnavailable"
        await eventually(lambda: op.metric("agentrun_operator_db_up") == 0, 10, "db_up 0")
        # The run moves on meanwhile (workers reach the database; the operator does not).
        [(_, lease)] = (await store.with_lease_ttl(30).claim("default", "w")).claimed
        await store.finish(lease, "succeeded", result="done while the operator was blind")

        proxy.restore()
        await eventually(lambda: status(cluster, "steady").get("phase") == "succeeded", 30,
                         "the run's end mirrored after the outage")
        await eventually(
            lambda: (condition(cluster, "steady", "DatabaseAvailable") or {}).get("status")
            == "True", 10, "DatabaseAvailable=True")
        assert op.metric("agentrun_operator_db_up") == 1
        assert op.popen.poll() is None  # no restart
        assert run.id
    finally:
        proxy.stop()


# -- scaling ------------------------------------------------------------------------------------


def replicas(cluster: Kube, name: str) -> int | None:
    d = cluster.deployment(name) or {}
    value = d.get("spec", {}).get("replicas")
    return int(value) if value is not None else None


def pool(release: Release, **overrides: Any) -> dict[str, Any]:
    """The chart's own pools.yaml entry for the default pool (from its ConfigMap)."""
    chart_pools = yaml.safe_load(release.pools_file(release.kube.cache_dir).read_text())["pools"]
    [default] = [p for p in chart_pools if p["name"] == "default"]
    return {**default, **overrides}


async def test_the_chart_installs_its_pools_at_min_replicas_not_the_api_default(
    cluster: Kube, release: Release, operators: NsOperators
) -> None:
    # B7: an autoscaled pool's Deployment carries no replicas (so Helm never fights the
    # operator), and the API server defaults it to 1. The operator sets minReplicas at once
    # instead of holding the API's 1 for the scale-down delay (300 s by default).
    workers = release.worker_deployment()
    assert replicas(cluster, workers) == 1  # the API's default
    default = pool(release)
    assert default["scaleDownDelaySeconds"] == 3 and default["minReplicas"] == 0
    op = operators.start(pools=[pool(release, scaleDownDelaySeconds=300)])
    await eventually(lambda: replicas(cluster, workers) == 0, 30, "minReplicas at once")
    # Counted once the patch returns to the operator: a moment after the API server shows it.
    await eventually(lambda: op.metric("agentrun_scaling_decisions_total", pool="default",
                                       direction="down") is not None, 10, "the decision counted")
    assert op.metric("agentrun_scaling_decisions_total", pool="default", direction="down") == 1
    # From now on the count is a decision (the scale bumped the generation): delays apply.
    assert (cluster.deployment(workers) or {})["metadata"]["generation"] == 2


async def test_scaling_from_zero_up_with_depth_capped_and_down_after_the_delay(
    cluster: Kube, release: Release, operators: NsOperators, store: Store
) -> None:
    workers = release.worker_deployment()
    cluster.create_deployment("fixed", replicas=5, pool="fixed")  # no pool: never touched
    op = operators.start(pools=[pool(release)])
    cluster.apply_agent(agent_manifest())
    await eventually(lambda: replicas(cluster, workers) == 0, 30, "the pool at minReplicas")
    await eventually(lambda: op.metric("agentrun_operator_db_up") == 1, 15, "operator ready")

    t0 = time.monotonic()
    cluster.apply_agentrun(agentrun_manifest("s1"))
    await eventually(lambda: replicas(cluster, workers) == 1, 10, "scale from zero", every=0.01)
    print(f"new AgentRun -> Deployment scaled from zero: {(time.monotonic() - t0) * 1000:.0f} ms")
    t1 = time.monotonic()
    for i in range(2, 5):
        cluster.apply_agentrun(agentrun_manifest(f"s{i}"))
    await eventually(lambda: replicas(cluster, workers) == 2, 10,
                     "up with depth (4 runs / 2 per worker)")
    print(f"3 more runs -> 2 replicas: {(time.monotonic() - t1) * 1000:.0f} ms")
    for i in range(5, 9):
        cluster.apply_agentrun(agentrun_manifest(f"s{i}"))
    await eventually(lambda: replicas(cluster, workers) == 3, 10, "capped at maxReplicas")
    # The real ReplicaSet controller follows the scale: three Pods (Pending: no node here).
    await eventually(lambda: len(cluster.pods({"agentrun.dev/pool": "default"})) == 3, 30,
                     "three worker Pods from the ReplicaSet")
    for i in range(1, 9):
        run = await run_of(store, cluster, f"s{i}")
        await store.cancel(run.id)
    t2 = time.monotonic()
    await eventually(lambda: replicas(cluster, workers) == 0, 15, "scale down after the delay")
    waited = time.monotonic() - t2
    assert waited >= 3.0, waited  # the pool's scaleDownDelaySeconds
    assert replicas(cluster, "fixed") == 5
    # The last decision is counted once its patch returns: a moment after the API server shows it.
    await eventually(lambda: op.metric("agentrun_scaling_decisions_total", pool="default",
                                       direction="down") == 2, 10, "the last decision counted")
    assert op.metric("agentrun_scaling_decisions_total", pool="default", direction="up") == 3
    # One down at start (the API default 1 -> minReplicas 0), one after the delay.
    assert op.metric("agentrun_scaling_decisions_total", pool="default", direction="down") == 2


async def test_busy_worker_pods_get_a_higher_deletion_cost_and_helm_counts_win(
    cluster: Kube, release: Release, operators: NsOperators, store: Store
) -> None:
    workers = release.worker_deployment()
    pinned = cluster.create_deployment("pinned", replicas=4, pool="batch")
    cluster.patch(f"/apis/apps/v1/namespaces/{cluster.namespace}/deployments/pinned",
                  {"metadata": {"annotations": {"agentrun.dev/autoscale": "false"}}})
    assert pinned
    op = operators.start(pools=[pool(release), pool(release, name="batch", deployment="pinned")])
    cluster.apply_agent(agent_manifest())
    for name in ("b1", "b2", "b3", "b4"):
        cluster.apply_agentrun(agentrun_manifest(name))
        await run_of(store, cluster, name)
    await eventually(lambda: replicas(cluster, workers) == 2, 15, "two workers for four runs")
    # The Pods the real ReplicaSet controller made for the chart's Deployment.
    pods = await eventually(
        lambda: (p := cluster.pods({"agentrun.dev/pool": "default"})) and len(p) == 2 and p,
        30, "the ReplicaSet's two Pods")
    busy, idle = sorted(p["metadata"]["name"] for p in pods)
    # Worker ids are "<pod name>-<pid>-<random>"; the busy pod holds two runs.
    claimed = (await store.with_lease_ttl(60).claim("default", f"{busy}-7-beef", limit=2)).claimed
    assert len(claimed) == 2

    def cost(pod: str) -> str | None:
        meta = (cluster.pod(pod) or {}).get("metadata", {})
        return (meta.get("annotations") or {}).get("controller.kubernetes.io/pod-deletion-cost")

    await eventually(lambda: cost(busy) == "2", 15, "cost of the busy pod")
    await eventually(lambda: cost(idle) == "0", 15, "cost of the idle pod")
    batch = cluster.pods({"agentrun.dev/pool": "batch"})
    assert len(batch) == 4 and all(
        "controller.kubernetes.io/pod-deletion-cost" not in (
            p["metadata"].get("annotations") or {}) for p in batch)  # opted out: left alone
    assert replicas(cluster, "pinned") == 4  # agentrun.dev/autoscale: "false" wins
    assert op.metric("agentrun_scaling_decisions_total", pool="batch", direction="down") is None


async def test_the_operator_may_patch_a_pods_deletion_cost_and_nothing_else(
    cluster: Kube, release: Release, tmp_path: Path
) -> None:
    """RBAC cannot narrow "patch pods" to one annotation, and a patched image runs with the
    worker's Secrets in its environment: the chart's ValidatingAdmissionPolicy lets the operator's
    ServiceAccount change a pod's deletion cost and nothing else (found by a security review on
    2026-12-06). With its own token, on the real API server."""
    ns = cluster.namespace
    code, out = cluster.request("POST", f"/api/v1/namespaces/{ns}/pods", {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "w", "labels": {"agentrun.dev/pool": "default"},
                     "annotations": {"team": "a"}},
        "spec": {"containers": [{"name": "worker", "image": "agentrun"}]}})
    assert code == 201, out
    operator = Kube(release.kubeconfig_for(release.operator_sa, tmp_path), ns)
    path = f"/api/v1/namespaces/{ns}/pods/w"
    evil = {"spec": {"containers": [{"name": "worker", "image": "evil"}]}}

    def patch(body: dict[str, Any], dry: bool = False) -> tuple[int, Any]:
        return operator.request("PATCH", path + ("?dryRun=All" if dry else ""), body,
                                "application/strategic-merge-patch+json")

    try:
        # A new policy takes a moment to reach the admission plugin: probed by dry runs.
        await eventually(lambda: patch(evil, dry=True)[0] == 403, 60, "the policy enforced")
        cost = {"metadata": {"annotations": {"controller.kubernetes.io/pod-deletion-cost": "3"}}}
        assert patch(cost)[0] == 200
        for body in (evil, {"metadata": {"labels": {"agentrun.dev/pool": "other"}}},
                     {"metadata": {"annotations": {"team": "b"}}},
                     {"metadata": {"finalizers": ["example.com/hold"]}}):
            code, out = patch(body)
            assert code == 403, (body, out)
            assert "may change only a pod's controller.kubernetes.io/pod-deletion-cost" in (
                out["message"]), out
        pod = cluster.pod("w") or {}
        assert pod["spec"]["containers"][0]["image"] == "agentrun"
        assert pod["metadata"]["annotations"] == {
            "team": "a", "controller.kubernetes.io/pod-deletion-cost": "3"}
        # Anyone else is not matched: the admin may change the image (a dry run).
        code, out = cluster.request("PATCH", path + "?dryRun=All", evil,
                                    "application/strategic-merge-patch+json")
        assert code == 200, out
    finally:
        operator.close()
        cluster.request("DELETE", path)


async def test_the_same_yaml_runs_through_kubectl_apply_and_agentrun_submit(
    cluster: Kube, operators: NsOperators, store: Store, database_url: str
) -> None:
    # Local parity: examples/migrate-orders.yaml, applied to the cluster and submitted with
    # `agentrun submit -f` (no cluster), pins the same run.
    example = ROOT / "examples" / "migrate-orders.yaml"
    docs = [d for d in yaml.safe_load_all(example.read_text()) if d]
    operators.start()
    cluster.apply_agent(docs[0])
    cluster.apply_agentrun(docs[1])
    applied = await run_of(store, cluster, "migrate-orders")
    out = run_cli("submit", "-f", str(example), env={"AGENTRUN_DATABASE_URL": database_url})
    assert out.returncode == 0, out.stderr
    submitted = await store.get_run(out.stdout.strip())
    assert submitted.id != applied.id
    for field in ("task", "model", "agent_spec", "pool", "max_steps", "max_attempts"):
        assert getattr(submitted, field) == getattr(applied, field), field


async def test_operator_migrates_at_startup_unless_told_not_to(
    cluster: Kube, release: Release, tmp_path: Path, empty_database_url: str
) -> None:
    kubeconfig = release.kubeconfig_for(release.operator_sa, tmp_path)
    ops = NsOperators(_Kubeconfig(kubeconfig), empty_database_url, tmp_path,  # type: ignore[arg-type]
                      namespace=cluster.namespace)
    try:
        told_not_to = ops.start(extra=["--no-migrate"])
        await eventually(
            lambda: "run `agentrun migrate`" in told_not_to.output(), 30, "the advice to migrate"
        )
        assert told_not_to.metric("agentrun_operator_db_up") == 0
        told_not_to.stop()
        op = ops.start()
        await eventually(lambda: op.metric("agentrun_operator_db_up") == 1, 30, "migrated")
        async with await psycopg.AsyncConnection.connect(empty_database_url) as conn:
            assert await schema_version(conn) == latest_version()
    finally:
        ops.stop_all()


async def test_the_operator_logs_a_database_error_without_the_password(
    operators: NsOperators, database_url: str
) -> None:
    """Found by a review: the operator logged "database unavailable" with psycopg's message as
    it was, which quotes what the server echoes (here a database name holding a URI with its
    password), while its readiness masked the same message."""
    secret_db = "postgresql://u:pw-alpha/pw-bravo@127.0.0.1:1/d"
    url = make_conninfo(database_url, dbname=secret_db)
    op = operators.start(env={"AGENTRUN_DATABASE_URL": url})
    await eventually(lambda: "database unavailable" in op.output(), 30, "the outage said")
    said = op.output()
    assert "pw-alpha" not in said and "pw-bravo" not in said, said


async def test_oldest_pending_age_returns_to_zero_when_the_pool_empties(
    cluster: Kube, operators: NsOperators, store: Store
) -> None:
    # A pool the operator does not scale: only the metrics recount reports its oldest pending.
    op = operators.start()
    run, _ = await store.create_run("wait", AGENT, pool="batch")
    await eventually(
        lambda: (op.metric("agentrun_oldest_pending_seconds", pool="batch") or 0) > 0, 15, "age")
    await store.cancel(run.id)
    await eventually(
        lambda: op.metric("agentrun_oldest_pending_seconds", pool="batch") == 0, 15, "back to 0")


# -- found on a real API server (issue 11) ------------------------------------------------------


async def test_a_recreated_object_never_shows_the_old_runs_status(
    cluster: Kube, operators: NsOperators, store: Store
) -> None:
    # B2: an AgentRun deleted and created again under the same name is another object (another
    # uid) with another run. Deleted and re-created while no operator ran, the old run is still
    # live: the next operator met it through the store and patched its status by NAME, onto the
    # new object. Patches are now guarded by uid: the old run's object is gone, so it is
    # cancelled, and the new object shows only its own run.
    op = operators.start()
    cluster.apply_agent(agent_manifest())
    cluster.apply_agentrun(agentrun_manifest("again"))
    old = await run_of(store, cluster, "again")
    op.stop()
    assert cluster.delete_agentrun("again") == 200
    new_obj = cluster.apply_agentrun(agentrun_manifest("again"))
    again = operators.start()
    new = await eventually(
        lambda: (rid := status(cluster, "again").get("runId")) and rid != str(old.id) and rid,
        30, "the new object's own run")
    assert (await store.get_run(new)).k8s_uid == new_obj["metadata"]["uid"]
    cancelled = await wait_run(store, old.id, lambda r: r.status == "cancelled", 30)
    assert f"AgentRun {cluster.namespace}/again deleted" in (cancelled.error or "")
    # Two more ticks (each resyncs if it sees the live runs change): still the new run's status.
    seen = again.metric("agentrun_operator_ticks_total") or 0
    await eventually(lambda: (again.metric("agentrun_operator_ticks_total") or 0) >= seen + 2,
                     30, "two more ticks")
    s = status(cluster, "again")
    assert (s["runId"], s["phase"]) == (new, "pending"), s


async def test_an_operator_restart_patches_nothing(
    cluster: Kube, operators: NsOperators, store: Store
) -> None:
    # B5: the status read back from the API server lacks the null fields the operator computed;
    # compared naively, every restart patched every object once (minutes at 10,000 objects).
    op = operators.start()
    cluster.apply_agent(agent_manifest())
    for i in range(4):
        cluster.apply_agentrun(agentrun_manifest(f"r{i}"))
    runs = [await run_of(store, cluster, f"r{i}") for i in range(4)]
    [(_, lease)] = (await store.with_lease_ttl(60).claim("default", "w")).claimed
    await store.finish(lease, "succeeded", result="done")
    await eventually(lambda: sorted(status(cluster, f"r{i}").get("phase") or "" for i in range(4))
                     == ["pending", "pending", "pending", "succeeded"], 15, "mirrored")
    assert runs
    op.stop()

    def versions() -> dict[str, str]:
        out = cluster.get(f"/apis/agentrun.dev/v1alpha1/namespaces/{cluster.namespace}/agentruns")
        return {o["metadata"]["name"]: o["metadata"]["resourceVersion"]
                for o in (out or {})["items"]}

    before = versions()
    again = operators.start()
    # Three ticks (1 s apart here; the first resyncs, and any that sees a change) have compared
    # every live run with its object.
    await eventually(lambda: (again.metric("agentrun_operator_ticks_total") or 0) >= 3, 30,
                     "three ticks")
    assert versions() == before, "an operator restart patched objects that had not changed"
    assert (again.metric("agentrun_status_patches_total") or 0) == 0


async def test_a_new_approval_wait_right_after_a_decision_gets_its_own_event(
    cluster: Kube, operators: NsOperators, store: Store
) -> None:
    # B6: approve -> claim -> the next irreversible call waits, all inside one flush window:
    # the mirror sees waiting_approval twice; the second wait must get its own Event.
    operators.start(env={"AGENTRUN_STATUS_FLUSH_INTERVAL": "3"})
    cluster.apply_agent(agent_manifest(requireApproval=True))
    cluster.apply_agentrun(agentrun_manifest("twice"))
    run = await run_of(store, cluster, "twice")
    [(_, lease)] = (await store.with_lease_ttl(30).claim("default", "w")).claimed
    call = {"seq": 0, "call_index": 0, "tool": "drop_table", "input": {"table": "a"},
            "stage": "before_call"}
    await store.wait_for_approval(lease, "approval required before drop_table (step 0)", call)
    await eventually(lambda: "WaitingForApproval" in cluster.reasons("twice"), 15, "first wait")
    cluster.annotate("twice", {"agentrun.dev/approve": "0"})
    await wait_run(store, run.id, lambda r: r.status == "pending", 15)
    [(_, lease)] = (await store.with_lease_ttl(30).claim("default", "w")).claimed
    await store.append_step(lease, 0, "model_turn", {"role": "assistant", "content": []})
    await store.append_step(lease, 1, "tool_result", {"content": []})
    call2 = {**call, "seq": 2, "input": {"table": "b"}}
    await store.wait_for_approval(lease, "approval required before drop_table (step 2)", call2)
    await eventually(lambda: cluster.reasons("twice").count("WaitingForApproval") == 2, 20,
                     "an Event for the second wait")
    [second] = [e for e in cluster.events("twice") if "approve=2.0 " in e["message"]]
    assert f"kubectl annotate agentrun twice -n {cluster.namespace} agentrun.dev/approve=2.0 " in (
        second["message"])


async def test_a_run_whose_object_vanished_unseen_is_cancelled_once(
    cluster: Kube, operators: NsOperators, store: Store
) -> None:
    # B8: the object is deleted while no operator runs (no finalizer holds it). The next
    # operator finds the live run's object gone: it cancels the run, and stops patching it.
    op = operators.start()
    cluster.apply_agent(agent_manifest())
    cluster.apply_agentrun(agentrun_manifest("vanish"))
    cluster.apply_agentrun(agentrun_manifest("stays"))
    run = await run_of(store, cluster, "vanish")
    await run_of(store, cluster, "stays")
    op.stop()
    assert cluster.delete_agentrun("vanish") == 200
    again = operators.start()
    cancelled = await wait_run(store, run.id, lambda r: r.status == "cancelled", 30)
    assert f"AgentRun {cluster.namespace}/vanish deleted" in (cancelled.error or "")
    assert (await store.get_run((await run_of(store, cluster, "stays")).id)).status == "pending"
    patches = again.metric("agentrun_kube_api_calls_total", verb="patch_status") or 0
    seen = again.metric("agentrun_operator_ticks_total") or 0
    await eventually(lambda: (again.metric("agentrun_operator_ticks_total") or 0) >= seen + 3,
                     30, "three more ticks")
    assert (again.metric("agentrun_kube_api_calls_total", verb="patch_status") or 0) == patches
    assert again.output().count("vanish was deleted; no longer mirrored") == 1


async def test_objects_with_the_old_finalizer_are_released(
    cluster: Kube, operators: NsOperators, store: Store
) -> None:
    # B4: versions before this one put agentrun.dev/finalizer on every AgentRun; with no
    # operator left, deleting them (or their namespace, or the CRD) hung forever. The operator
    # now removes it; and none is added.
    cluster.apply_agent(agent_manifest())
    obj = agentrun_manifest("legacy")
    obj["metadata"]["finalizers"] = ["agentrun.dev/finalizer"]
    cluster.apply_agentrun(obj)
    operators.start()
    await run_of(store, cluster, "legacy")
    await eventually(lambda: not (cluster.agentrun("legacy") or {})["metadata"].get("finalizers"),
                     15, "the old finalizer removed")
    assert cluster.delete_agentrun("legacy") == 200
    assert cluster.agentrun("legacy") is None


async def test_existing_objects_get_database_unavailable_when_the_operator_starts_blind(
    cluster: Kube, operators: NsOperators, store: Store, database_url: str
) -> None:
    # B14: the database is down when the operator starts: its live AgentRuns must say so.
    op = operators.start()
    cluster.apply_agent(agent_manifest())
    cluster.apply_agentrun(agentrun_manifest("blind"))
    await run_of(store, cluster, "blind")
    op.stop()
    parts = conninfo_to_dict(database_url)
    proxy = TcpProxy((str(parts.get("host", "127.0.0.1")), int(parts.get("port", 5432)))).start()
    try:
        proxy.cut()
        operators.database_url = make_conninfo(database_url, host="127.0.0.1", port=proxy.port)
        operators.start()
        cond = await eventually(
            lambda: (c := condition(cluster, "blind", "DatabaseAvailable")) and
            c["status"] == "False" and c, 30, "DatabaseAvailable=False on an existing object")
        assert cond["reason"] == "DatabaseUnavailable"
        proxy.restore()
        await eventually(
            lambda: (condition(cluster, "blind", "DatabaseAvailable") or {}).get("status")
            == "True", 30, "DatabaseAvailable=True after the outage")
    finally:
        proxy.stop()


async def test_the_largest_task_the_schema_admits_is_handled_and_deleted(
    cluster: Kube, operators: NsOperators, store: Store
) -> None:
    # B10: kopf copied the spec into an annotation (256 KiB at most); a large task wedged the
    # object and its delete. 65,536 three-byte characters: ~192 KiB of task, ~390 KiB escaped.
    operators.start()
    cluster.apply_agent(agent_manifest())
    task = "€" * 65536
    cluster.apply_yaml([agentrun_manifest("big", task=task)], "--server-side")
    run = await run_of(store, cluster, "big")
    assert run.task == task
    annotations = (cluster.agentrun("big") or {})["metadata"].get("annotations") or {}
    assert sum(len(k) + len(v) for k, v in annotations.items()) < 4096
    assert cluster.delete_agentrun("big") == 200
    await wait_run(store, run.id, lambda r: r.status == "cancelled", 15)


async def test_status_carries_observed_generation_and_a_ready_condition(
    cluster: Kube, operators: NsOperators, store: Store
) -> None:
    operators.start()
    cluster.apply_agent(agent_manifest())
    obj = cluster.apply_agentrun(agentrun_manifest("ready"))
    run = await run_of(store, cluster, "ready")
    ready = await eventually(lambda: condition(cluster, "ready", "Ready"), 15, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "InProgress")
    generation = obj["metadata"]["generation"]
    assert status(cluster, "ready")["observedGeneration"] == generation
    assert ready["observedGeneration"] == generation
    [(_, lease)] = (await store.with_lease_ttl(30).claim("default", "w")).claimed
    await store.finish(lease, "succeeded", result="ok")
    # kstatus / Argo CD / kubectl wait read Ready.
    cluster.kubectl("wait", "--for=condition=Ready", "agentrun/ready", "--timeout=30s")
    assert condition(cluster, "ready", "Ready")["reason"] == "Succeeded"  # type: ignore[index]
    assert run.id


async def test_a_run_dead_lettered_by_oom_kills_says_so(
    cluster: Kube, release: Release, operators: NsOperators, store: Store
) -> None:
    # The kernel OOM-kills the worker every time the run's tool runs: the run is dead-lettered
    # after its attempts, and the operator finds its last worker's pod OOMKilled (the kubelet's
    # container status; written here through the pods/status subresource, as the kubelet does)
    # and says so on the run and in the Event: the fix is memory, not more attempts.
    operators.start(env={"AGENTRUN_WORKER_NAMESPACE": cluster.namespace})
    cluster.apply_agent(agent_manifest())
    cluster.apply_agentrun(agentrun_manifest("hungry", maxAttempts=1))
    run = await run_of(store, cluster, "hungry")
    pod = "hungry-worker-abc12"
    cluster.create(f"/api/v1/namespaces/{cluster.namespace}/pods", {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": pod, "labels": {"agentrun.dev/pool": "default"}},
        "spec": {"containers": [{"name": "worker", "image": "agentrun"}]}})
    cluster.patch(f"/api/v1/namespaces/{cluster.namespace}/pods/{pod}/status", {"status": {
        "containerStatuses": [{
            "name": "worker", "image": "agentrun", "imageID": "", "ready": False,
            "restartCount": 3, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
            "lastState": {"terminated": {"reason": "OOMKilled", "exitCode": 137}}}]}},
        "application/strategic-merge-patch+json")
    [(_, lease)] = (await store.with_lease_ttl(0.3).claim("default", f"{pod}-7-beef")).claimed
    await store.with_lease_ttl(0.3).append_step(
        lease, 0, "model_turn", {"role": "assistant", "content": []})
    # The worker "dies" in the tool (its lease, 0.3 s, runs out); the restarted one re-runs the
    # tool and dies again, committing nothing; the next claim finds the attempts spent (a claim
    # that committed a step, like the first, does not count against maxAttempts).
    resumed: list[Run] = []
    for _ in range(200):
        claim = await store.with_lease_ttl(0.3).claim("default", f"{pod}-8-cafe")
        resumed = [r for r, _ in claim.claimed]
        if resumed:
            break
        await asyncio.sleep(0.05)
    assert [r.k8s_name for r in resumed] == ["hungry"]
    dead: list[Run] = []
    for _ in range(200):
        dead = (await store.with_lease_ttl(30).claim("default", "other-worker-1-x")).dead_lettered
        if dead:
            break
        await asyncio.sleep(0.05)
    assert [r.k8s_name for r in dead] == ["hungry"]
    error = (await wait_run(store, run.id, lambda r: "OOMKilled" in (r.error or ""), 30)).error
    assert f"its worker pod {pod} was OOMKilled (3 restarts)" in (error or "")
    await eventually(lambda: "DeadLettered" in cluster.reasons("hungry"), 15, "the Event")
    [event] = [e for e in cluster.events("hungry") if e["reason"] == "DeadLettered"]
    assert "OOMKilled" in event["message"] and "limits.memory" in event["message"]
    await eventually(lambda: "OOMKilled" in (status(cluster, "hungry").get("error") or ""), 30,
                     "the reason mirrored into .status.error")


async def test_retry_annotation_makes_a_dead_lettered_run_pending_again_with_its_reason(
    cluster: Kube, operators: NsOperators, store: Store
) -> None:
    operators.start()
    cluster.apply_agent(agent_manifest())
    cluster.apply_agentrun(agentrun_manifest("again", maxAttempts=1))
    run = await run_of(store, cluster, "again")
    [(_, lease)] = (await store.with_lease_ttl(0.3).claim("default", "w1")).claimed
    await store.with_lease_ttl(0.3).append_step(
        lease, 0, "model_turn", {"role": "assistant", "content": []})
    # Claims once w1's lease is out: the first resumes (a step was committed), the next one
    # committed nothing and maxAttempts 1 dead-letters the run.
    deadline = time.monotonic() + 15
    while not (await store.with_lease_ttl(0.3).claim("default", "w2")).dead_lettered:
        assert time.monotonic() < deadline, "the run was never dead-lettered"
        await asyncio.sleep(0.1)
    await eventually(lambda: status(cluster, "again").get("phase") == "dead_letter", 15, "dl")

    cluster.annotate("again", {"agentrun.dev/retry": "tool fixed"})
    await eventually(lambda: status(cluster, "again").get("phase") == "pending", 15, "pending")
    retried = await store.get_run(run.id)
    assert retried.retries == 1 and retried.next_seq == 1
    assert retried.retry_reason == (
        f"tool fixed (annotation on AgentRun {cluster.namespace}/again)")
    assert retried.retried_error is not None and retried.retried_error.startswith("dead-lettered")
    await eventually(lambda: "Retried" in cluster.reasons("again"), 10, "Retried event")
    annotations = (cluster.agentrun("again") or {})["metadata"].get("annotations") or {}
    assert "agentrun.dev/retry" not in annotations  # consumed

    # A live run is not retried: a Warning Event, one line, and the run is untouched.
    cluster.annotate("again", {"agentrun.dev/retry": "true"})

    def refused() -> list[dict[str, Any]]:
        return [e for e in cluster.events("again") if e["reason"] == "ActionRefused"]

    await eventually(lambda: bool(refused()), 15, "ActionRefused event")
    assert refused()[0]["type"] == "Warning"
    assert "still pending" in refused()[0]["message"] and "\n" not in refused()[0]["message"]
    assert (await store.get_run(run.id)).retries == 1


async def test_action_annotations_of_anyones_text_are_refused_escaped_or_acted_on(
    cluster: Kube, operators: NsOperators, store: Store
) -> None:
    """Found by an adversarial review on 2026-12-06 against this API server: a retry reason with
    "&", "<", ">" or any non-ASCII character was never acted on (the consuming patch's `test`
    compared JSON bytes, which Go and the client escape differently), silently and for good;
    "false" retried the run; and a refused value reached its Event raw, where a newline forged
    rows of `kubectl describe`'s Events table."""
    operators.start()
    run = await failed_run(cluster, store, "texts")

    def refused() -> list[str]:
        return [e["message"] for e in cluster.events("texts") if e["reason"] == "ActionRefused"]

    cluster.annotate("texts", {"agentrun.dev/retry": "false"})
    await eventually(lambda: bool(refused()), 15, "ActionRefused event")
    assert refused() == [
        "agentrun.dev/retry='false': agentrun.dev/retry must be \"true\" or the reason for the "
        "retry, not 'false'"]
    forged = "yes\n  Normal  Retried  1s  agentrun-operator  retry 1 by alice\x1b[2J"
    cluster.annotate("texts", {"agentrun.dev/cancel": forged})
    await eventually(lambda: len(refused()) == 2, 15, "a second ActionRefused event")
    shown = "'yes\\n Normal Retried 1s agentrun-operator retry 1 by alice\\x1b[2J'"  # one line
    assert sorted(refused())[0] == (
        f'agentrun.dev/cancel={shown}: agentrun.dev/cancel must be "true", not {shown}'
    ), refused()
    assert (await store.get_run(run.id)).retries == 0

    reason = "R&D fixed <the tool> — café"
    cluster.annotate("texts", {"agentrun.dev/retry": reason})
    await eventually(lambda: status(cluster, "texts").get("phase") == "pending", 15, "pending")
    retried = await store.get_run(run.id)
    assert retried.retry_reason == f"{reason} (annotation on AgentRun {cluster.namespace}/texts)"
    annotations = (cluster.agentrun("texts") or {})["metadata"].get("annotations") or {}
    assert "agentrun.dev/retry" not in annotations  # consumed


async def test_ttl_seconds_after_finished_deletes_the_object_and_keeps_the_runs_rows(
    cluster: Kube, operators: NsOperators, store: Store
) -> None:
    op = operators.start()
    cluster.apply_agent(agent_manifest())
    cluster.apply_agentrun(agentrun_manifest("short", ttlSecondsAfterFinished=1))
    cluster.apply_agentrun(agentrun_manifest("kept"))
    short, kept = await run_of(store, cluster, "short"), await run_of(store, cluster, "kept")
    await eventually(lambda: status(cluster, "short").get("phase") == "pending", 15, "mirrored")
    assert cluster.agentrun("short") is not None  # a live run's object is never expired
    await store.cancel(kept.id)
    await eventually(lambda: status(cluster, "kept").get("phase") == "cancelled", 15, "kept")
    await store.cancel(short.id)
    try:
        await eventually(lambda: cluster.agentrun("short") is None, 30, "the object to expire")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{op.output()[-3000:]}") from None
    assert (await store.get_run(short.id)).status == "cancelled"  # the run's rows stay
    await eventually(lambda: "Expired" in cluster.reasons("short"), 10, "Expired event")
    assert cluster.agentrun("kept") is not None  # no TTL: kept


async def test_a_ttl_that_falls_in_a_database_outage_deletes_the_object_once_it_is_back(
    cluster: Kube, operators: NsOperators, store: Store, database_url: str
) -> None:
    """A TTL task (one of the operator's per-object side tasks) whose expiry comes while the
    database is down: it says so once, with the run's id, retries, and deletes the object once
    the database answers. The operator runs on; no exception goes unretrieved."""
    ttl = 4
    parts = conninfo_to_dict(database_url)
    proxy = TcpProxy((str(parts.get("host", "127.0.0.1")), int(parts.get("port", 5432)))).start()
    try:
        operators.database_url = make_conninfo(database_url, host="127.0.0.1", port=proxy.port)
        op = operators.start(extra=["--log-format", "json"])
        cluster.apply_agent(agent_manifest())
        cluster.apply_agentrun(agentrun_manifest("brief", ttlSecondsAfterFinished=ttl))
        run = await run_of(store, cluster, "brief")
        await store.cancel(run.id)
        await eventually(lambda: status(cluster, "brief").get("phase") == "cancelled", 15,
                         "the cancel mirrored (the TTL task waits from here)")
        proxy.cut()

        def waiting() -> list[dict[str, Any]]:
            lines = [json.loads(ln) for ln in op.output().splitlines() if ln.startswith("{")]
            return [x for x in lines if "not deleted after its TTL yet" in x["msg"]]

        [line] = await eventually(waiting, ttl + 30, "the TTL task's line about the outage")
        assert line["run_id"] == str(run.id), line
        assert cluster.agentrun("brief") is not None  # not deleted blind
        proxy.restore()
        try:
            await eventually(lambda: cluster.agentrun("brief") is None, 60,
                             "the object deleted once the database answers")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{op.output()[-3000:]}") from None
        await eventually(lambda: "Expired" in cluster.reasons("brief"), 10, "Expired event")
        assert len(waiting()) == 1, waiting()  # said once per outage, not once per retry
        assert op.popen.poll() is None
        assert "never retrieved" not in op.output()
    finally:
        proxy.stop()


# -- readiness (issue 19) -----------------------------------------------------------------------


def readyz(port: int) -> tuple[int, dict[str, Any]]:
    """GET the operator's /readyz: (status, body); (0, {}) while nothing listens."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")
    except OSError:
        return 0, {}


def proxied_kubeconfig(kubeconfig: Path, proxy: TcpProxy, target: Path) -> Path:
    """The same credentials, with the API server reached through ``proxy`` (TLS passes through
    it untouched; the server's certificate names 127.0.0.1, whatever the port)."""
    cfg = yaml.safe_load(kubeconfig.read_text())
    for c in cfg["clusters"]:
        c["cluster"]["server"] = f"https://127.0.0.1:{proxy.port}"
    target.write_text(yaml.safe_dump(cfg))
    return target


def api_address(kubeconfig: Path) -> tuple[str, int]:
    server = yaml.safe_load(kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
    parts = urllib.parse.urlsplit(server)
    return str(parts.hostname), int(parts.port or 443)


async def test_an_annotation_is_acted_on_after_the_api_server_and_the_database_came_back(
    cluster: Kube, operators: NsOperators, store: Store, database_url: str, tmp_path: Path
) -> None:
    """Found by an adversarial review (2026-12-07): an API server that could not be reached
    (urllib3's MaxRetryError, not an ApiException) ended the task acting on an object's
    annotations; the retry waited on the object for its next event, and an unrelated label
    change applied it, much later, with nobody asking. Said once per kind, tried again."""
    with proxied(operators, database_url, tmp_path) as (api, db):
        op = operators.start()
        run = await failed_run(cluster, store, "blip")

        def said(kind: str) -> bool:
            return any("its annotations are not acted on yet" in ln and kind in ln
                       for ln in op.output().splitlines())

        db.cut()
        await eventually(lambda: op.metric("agentrun_operator_db_up") == 0, 30, "db down")
        cluster.annotate("blip", {RETRY: "true"})
        await eventually(lambda: said("database"), 30, "the wait for the database said")
        api.cut()  # while the task waits to try again
        await eventually(lambda: said("MaxRetryError") or said("ProtocolError"), 60,
                         "the API server's outage said, and tried again")
        api.restore()
        db.restore()
        await wait_run(store, run.id, lambda r: r.retries == 1, 60)
        await eventually(lambda: "Retried" in cluster.reasons("blip"), 30, "Retried")
        assert RETRY not in annotations_of(cluster, "blip")
        assert "acting on its annotations failed" not in op.output()


async def test_the_status_mirror_waits_out_an_api_outage_without_a_traceback(
    cluster: Kube, operators: NsOperators, store: Store, database_url: str, tmp_path: Path
) -> None:
    """Found by a review (2026-12-07): while the API server could not be reached, the status
    mirror's flush loop logged "loop failed; restarting it" with a traceback at each try. An
    outage is one line a try, backing off; the status is mirrored once the server is back."""
    with proxied(operators, database_url, tmp_path) as (api, _):
        op = operators.start()
        run, lease = await claimed_run(cluster, store, "dark")
        await eventually(lambda: status(cluster, "dark").get("phase") == "running", 30,
                         "running mirrored")
        api.cut()
        await store.finish(lease, "failed", error="tool crashed")  # flushed into the outage

        def flush_failed() -> bool:
            out = op.output()
            return ("status-flush loop: the API server did not answer" in out
                    or "status-flush loop failed" in out)

        await eventually(flush_failed, 60, "the flush to meet the outage")
        api.restore()
        await eventually(lambda: status(cluster, "dark").get("phase") == "failed", 60,
                         "the failure mirrored once the API server answers")
        assert "status-flush loop failed" not in op.output()
        assert (await store.get_run(run.id)).status == "failed"


async def claimed_run(cluster: Kube, store: Store, name: str) -> tuple[Run, Any]:
    """An applied AgentRun (a plain Agent) whose run this test holds: the run and its lease."""
    cluster.apply_agent(agent_manifest())
    cluster.apply_agentrun(agentrun_manifest(name))
    run = await run_of(store, cluster, name)
    [(_, lease)] = (await store.with_lease_ttl(30).claim("default", "w")).claimed
    return run, lease


async def failed_run(cluster: Kube, store: Store, name: str) -> Run:
    """claimed_run's run, failed, and mirrored so."""
    run, lease = await claimed_run(cluster, store, name)
    await store.finish(lease, "failed", error="tool crashed")
    await eventually(lambda: status(cluster, name).get("phase") == "failed", 15, "failed")
    return run


@contextlib.contextmanager
def proxied(operators: NsOperators, database_url: str,
            tmp_path: Path) -> Iterator[tuple[TcpProxy, TcpProxy]]:
    """The operators started from here reach the API server (the operator SA's kubeconfig) and
    PostgreSQL through proxies the test cuts and restores: (api, db), stopped at the end."""
    sa_kubeconfig = operators.cluster.path  # type: ignore[attr-defined]
    api = TcpProxy(api_address(sa_kubeconfig)).start()
    parts = conninfo_to_dict(database_url)
    db = TcpProxy((str(parts.get("host", "127.0.0.1")), int(parts.get("port", 5432)))).start()
    try:
        operators.cluster = _Kubeconfig(  # type: ignore[assignment]
            proxied_kubeconfig(sa_kubeconfig, api, tmp_path / "kubeconfig-proxied"))
        operators.database_url = make_conninfo(database_url, host="127.0.0.1", port=db.port)
        yield api, db
    finally:
        api.stop()
        db.stop()


def helm_test_command(release: Release, name: str) -> list[str]:
    """The command of one of the release's `helm test` pods, as installed (its hooks)."""
    out = release.kube.helm("get", "hooks", release.name, "-n", release.namespace).stdout
    [pod] = [d for d in yaml.safe_load_all(out) if d and d["metadata"]["name"] == name]
    [c] = pod["spec"]["containers"]
    return list(c["command"])


async def test_readyz_follows_the_api_server_and_the_database_and_helm_test_says_why(
    cluster: Kube, release: Release, operators: NsOperators, database_url: str, tmp_path: Path
) -> None:
    # Issue 19: the operator pod was Ready while every API call failed, and `helm test` passed.
    # Here the operator (the chart's SA token) reaches the API server and PostgreSQL through
    # proxies this test cuts and restores; /readyz must follow both, and the chart's own helm
    # test command (run here: this tier has no kubelet) must fail with the reason, then pass.
    with proxied(operators, database_url, tmp_path) as (api, db):
        port = free_port()
        op = operators.start(env={"AGENTRUN_HEALTH_INTERVAL": "0.5"},
                             extra=["--health-port", str(port)])

        def ready() -> bool:
            assert op.popen.poll() is None, op.output()[-3000:]
            return readyz(port)[0] == 200

        def not_ready(what: str) -> str | None:
            assert op.popen.poll() is None, op.output()[-3000:]
            code, body = readyz(port)
            return str(body["reason"]) if code == 503 and what in body.get("reason", "") else None

        command = helm_test_command(release, f"{release.fullname}-test-operator")
        url = f"http://{release.fullname}-operator-health:8080/readyz"
        assert command == ["python", "-m", "agentrun.operator.health", "--wait", "60", url]
        local = [sys.executable, *command[1:-1], f"http://127.0.0.1:{port}/readyz"]

        def helm_test(wait: str = "60") -> subprocess.CompletedProcess[str]:
            args = [wait if a == "60" else a for a in local]
            return subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)

        await eventually(ready, 60, "the operator to be ready")
        passed = helm_test()
        assert passed.returncode == 0, passed.stderr
        assert passed.stdout.strip() == f"operator ready (http://127.0.0.1:{port}/readyz)"

        api.cut()
        reason = await eventually(lambda: not_ready("API server"), 30, "not ready: API server")
        assert "database" not in reason, reason
        failed = helm_test(wait="0")
        assert failed.returncode == 1
        assert failed.stderr.startswith("operator not ready: API server: "), failed.stderr
        assert len(failed.stderr.strip().splitlines()) == 1, failed.stderr
        api.restore()
        await eventually(ready, 30, "ready again once the API server answers")

        db.cut()
        reason = await eventually(lambda: not_ready("database"), 30, "not ready: database")
        assert "API server" not in reason, reason
        failed = helm_test(wait="0")
        assert failed.returncode == 1 and "operator not ready: database: " in failed.stderr
        db.restore()
        await eventually(ready, 30, "ready again once the database answers")
        assert helm_test().returncode == 0
        assert op.popen.poll() is None  # no restart: readiness, not liveness
        assert op.output().count("API server check failed") == 1  # said once per outage


# -- spare slots (issue 19) ---------------------------------------------------------------------


async def test_spare_slots_from_the_chart_scale_the_deployment_with_headroom(
    cluster: Kube, release: Release, operators: NsOperators, store: Store
) -> None:
    # Issue 19: after a plain pod delete, the runs beyond the survivors' free slots waited for
    # the replacement pod. A pool's autoscaling.spareSlots keeps free slots while there is work.
    # Set through the chart (helm upgrade), read from its pools file, applied by the operator
    # to the real Deployment: runsPerWorker 2, spareSlots 2, maxReplicas 3.
    cluster.helm("upgrade", release.name, str(ROOT / "charts" / "agentrun"), "-n",
                 cluster.namespace, "--reuse-values",
                 "--set", "workers.poolDefaults.autoscaling.spareSlots=2")
    chart_pool = pool(release)
    assert chart_pool["spareSlots"] == 2 and chart_pool["runsPerWorker"] == 2
    workers = release.worker_deployment()
    op = operators.start(pools=[chart_pool])
    cluster.apply_agent(agent_manifest())
    # Idle: no headroom (the pool still scales to minReplicas, 0).
    await eventually(lambda: replicas(cluster, workers) == 0, 30, "the idle pool at 0")
    cluster.apply_agentrun(agentrun_manifest("h1"))
    # ceil((1 + 2) / 2) = 2, where the run alone needs 1.
    await eventually(lambda: replicas(cluster, workers) == 2, 15, "one run + 2 spare slots")
    cluster.apply_agentrun(agentrun_manifest("h2"))
    cluster.apply_agentrun(agentrun_manifest("h3"))
    await eventually(lambda: replicas(cluster, workers) == 3, 15, "ceil((3 + 2) / 2) = 3")
    assert "scale up: 1 live runs + 2 spare slots need 2" in op.output()
    assert op.metric("agentrun_pool_desired_replicas", pool="default") == 3
    for name in ("h1", "h2", "h3"):
        await store.cancel((await run_of(store, cluster, name)).id)
    await eventually(lambda: replicas(cluster, workers) == 0, 30, "no work: no headroom")


async def test_the_readiness_api_check_takes_namespace_patterns(
    kube: Kube, release: Release, tmp_path: Path
) -> None:
    # kopf watches glob patterns too ("team-*"); no Role can grant a list there, so the check
    # asks the server's /version for those instead of failing for ever (never Ready). With the
    # chart's operator token (a Role in the watched namespace only).
    import kubernetes
    from kubernetes.client.exceptions import ApiException

    from agentrun.operator.kube import KubeApi

    config = release.kubeconfig_for(release.operator_sa, tmp_path)
    api = KubeApi(kubernetes.config.new_client_from_config(config_file=str(config)))
    try:
        await api.probe([kube.namespace], 5)
        await api.probe(["agentrun-t-*"], 5)
        with pytest.raises(ApiException) as forbidden:  # the control: the pattern as a name
            await asyncio.to_thread(api.custom.list_namespaced_custom_object,
                                    "agentrun.dev", "v1alpha1", "agentrun-t-*", "agentruns")
        assert forbidden.value.status == 403
    finally:
        api.close()


async def test_operator_json_lines_name_the_object_and_metrics_have_the_process_series(
    cluster: Kube, operators: NsOperators, store: Store
) -> None:
    # kopf's per-object lines (its handlers' outcomes) keep the object they are about (issue 15).
    op = operators.start(extra=["--log-format", "json"])
    cluster.apply_agent(agent_manifest())
    obj = cluster.apply_agentrun(agentrun_manifest("logged"))
    await run_of(store, cluster, "logged")

    def object_lines() -> list[dict[str, Any]]:
        lines = [json.loads(ln) for ln in op.output().splitlines() if ln.startswith("{")]
        return [x for x in lines if x["logger"] == "kopf.objects" and "object" in x]

    lines = await eventually(object_lines, 30, "a kopf.objects line about the AgentRun")
    assert {
        "kind": "AgentRun", "namespace": cluster.namespace, "name": "logged",
        "uid": obj["metadata"]["uid"],
    } in [x["object"] for x in lines], lines[:3]
    assert (op.metric("process_resident_memory_bytes") or 0) > 0
    assert "process_cpu_seconds_total" in op.metrics()


async def test_a_background_task_that_dies_stops_the_operator_with_a_line_saying_why(
    operators: NsOperators, store: Store
) -> None:
    """The supervision path (agentrun.supervise.watch in OperatorApp.start): a background task
    that ends by what its loop does not retry stops the process, saying which task and why,
    instead of an operator that runs on with no mirror, autoscaler or readiness. The trigger is
    a real one: an operator older than the schema (rolled back after a newer migration ran)."""
    async with store.pool.connection() as conn:
        await conn.execute(
            "INSERT INTO agentrun_migration (version, name) VALUES (9999, 'from a newer agentrun')"
        )
    op = operators.start()
    op.popen.wait(120)  # the process's own exit is the event; the bound only stops a hang
    out = op.output()
    assert ("agentrun-operator task failed (AgentrunError: the database schema is at version "
            "9999, newer than this agentrun knows") in out, out[-3000:]
    assert "; upgrade agentrun); stopping the operator" in out, out[-3000:]
    assert "Task exception was never retrieved" not in out


async def test_a_watched_namespace_deleted_while_the_operator_was_down_cancels_its_runs(
    kube: Kube, admin_kube: Kube, store: Store, database_url: str, tmp_path: Path
) -> None:
    """With operator.watchNamespaces, a deleted namespace takes the chart's Role in it along:
    the API server answers 403 there, not 404. A run whose object went with a namespace deleted
    while the operator was down was never cancelled (its status patch's 403 was no Gone), and
    the readiness check's 403 kept the operator not Ready for good while it served the other
    namespace (found by a review on 2026-12-07)."""
    team_a, team_b = new_namespace(admin_kube), new_namespace(admin_kube)
    rel = install_chart(kube, kube.namespace, *CHART_VALUES,
                        f"operator.watchNamespaces={{{team_a},{team_b}}}")
    a, b = kube.for_namespace(team_a), kube.for_namespace(team_b)
    ops = NsOperators(_Kubeconfig(rel.kubeconfig_for(rel.operator_sa, tmp_path)),  # type: ignore[arg-type]
                      database_url, tmp_path, namespace=f"{team_a},{team_b}")
    try:
        first = ops.start()
        for team in (a, b):
            team.apply_agent(agent_manifest())
        a.apply_agentrun(agentrun_manifest("kept"))
        b.apply_agentrun(agentrun_manifest("doomed"))
        kept, doomed = await run_of(store, a, "kept"), await run_of(store, b, "doomed")
        first.stop()
        assert admin_kube.request("DELETE", f"/api/v1/namespaces/{team_b}")[0] == 200
        await eventually(lambda: admin_kube.get(f"/api/v1/namespaces/{team_b}") is None, 120,
                         f"namespace {team_b} gone")
        port = free_port()
        again = ops.start(env={"AGENTRUN_HEALTH_INTERVAL": "0.5"},
                          extra=["--health-port", str(port)])
        await wait_run(store, doomed.id, lambda r: r.status == "cancelled", 60)
        await eventually(lambda: readyz(port)[0] == 200, 60, "Ready, serving the namespace left")
        assert (await store.get_run(kept.id)).status == "pending"
        assert again.popen.poll() is None
        said = again.output()
        assert f"namespace {team_b} was deleted" in said, said[-3000:]
        assert "forbidden" not in said.lower(), said[-3000:]
        # The control: a namespace that exists and refuses still fails the check.
        config = rel.kubeconfig_for(rel.operator_sa, tmp_path)
        import kubernetes
        from kubernetes.client.exceptions import ApiException
        api = KubeApi(kubernetes.config.new_client_from_config(config_file=str(config)))
        try:
            await api.probe([team_a, team_b], 5)
            with pytest.raises(ApiException) as refused:
                await api.probe([team_a, kube.namespace], 5)  # no Role there: not watched
            assert refused.value.status == 403
        finally:
            api.close()
    finally:
        ops.stop_all()
        kube.helm("uninstall", rel.name, "-n", kube.namespace, "--wait=false", check=False)
        for ns in (team_a, team_b):
            admin_kube.request("DELETE", f"/api/v1/namespaces/{ns}")


async def test_a_status_patch_refused_for_one_object_holds_up_none_of_the_others(
    cluster: Kube, admin_kube: Kube, operators: NsOperators, store: Store
) -> None:
    """One object whose status patches the API server refuses (an admission policy here): the
    flush of a batch of changed runs stopped at it, and the objects sorted after it were patched
    only at a resync, which stopped at it again (found by a review on 2026-12-07)."""
    ns = cluster.namespace
    vap = f"refuse-status-{ns}"
    policies = "/apis/admissionregistration.k8s.io/v1"
    admin_kube.create(f"{policies}/validatingadmissionpolicies", {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": vap},
        "spec": {"failurePolicy": "Fail", "matchConstraints": {"resourceRules": [{
            "apiGroups": ["agentrun.dev"], "apiVersions": ["*"], "operations": ["UPDATE"],
            "resources": ["agentruns/status"]}]},
            "validations": [{
                "expression": "!has(object.metadata.labels) || "
                              "!('refuse-status' in object.metadata.labels)",
                "message": "status refused for this test", "reason": "Invalid"}]}})
    admin_kube.create(f"{policies}/validatingadmissionpolicybindings", {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding", "metadata": {"name": vap},
        "spec": {"policyName": vap, "validationActions": ["Deny"], "matchResources": {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}}}})
    try:
        operators.start(env={"AGENTRUN_RESYNC_INTERVAL": "3600"})
        cluster.apply_agent(agent_manifest())
        names = [f"r{i}" for i in range(6)]
        for name in names:
            cluster.apply_agentrun(agentrun_manifest(name))
        runs = {name: await run_of(store, cluster, name) for name in names}
        # The first of a flush's batch (sorted by run id) is the one refused.
        first = min(names, key=lambda n: runs[n].id)
        cluster.patch(f"{AGENTRUNS}/namespaces/{ns}/agentruns/{first}",
                      {"metadata": {"labels": {"refuse-status": "yes"}}})

        def enforced() -> bool:  # a new policy takes a moment to reach the admission plugin
            code, _ = admin_kube.request(
                "PATCH", f"{AGENTRUNS}/namespaces/{ns}/agentruns/{first}/status?dryRun=All",
                {"status": {"message": "probe"}}, "application/merge-patch+json")
            return code == 422

        await eventually(enforced, 60, "the test's admission policy to be enforced")
        async with store.pool.connection() as conn:  # one commit: one batch of notifications
            await conn.execute(
                "UPDATE agent_run SET status = 'cancelled', error = 'cancelled: test',"
                " finished_at = now() WHERE id = ANY(%s)", ([r.id for r in runs.values()],))
        for name in names:
            if name != first:
                await eventually(lambda n=name: status(cluster, n).get("phase") == "cancelled",
                                 30, f"{name}'s status to say cancelled")
        assert status(cluster, first).get("phase") == "pending"
    finally:
        admin_kube.delete(f"{policies}/validatingadmissionpolicybindings/{vap}")
        admin_kube.delete(f"{policies}/validatingadmissionpolicies/{vap}")
