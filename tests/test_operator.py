"""The operator, for real: ``agentrun operator`` processes (kopf) against the kmock API emulator
and a real PostgreSQL. Runs advance through store calls (deterministic) or a real worker.

Each test starts its own emulator and operator; every process is stopped by its pid.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml
from conftest import run_cli
from kubekit import (
    KubeCluster,
    Operators,
    agent_manifest,
    agentrun_manifest,
    eventually,
)
from proxykit import TcpProxy
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from workerkit import AGENT, FakeFactory, Workers, echo_scenario, wait_run

from agentrun.migrations import latest_version, schema_version
from agentrun.store import Run, Store

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def cluster() -> Iterator[KubeCluster]:
    c = KubeCluster().start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def operators(cluster: KubeCluster, database_url: str, tmp_path: Path) -> Iterator[Operators]:
    ops = Operators(cluster, database_url, tmp_path)
    try:
        yield ops
    finally:
        ops.stop_all()


def status(cluster: KubeCluster, name: str) -> dict[str, Any]:
    return dict((cluster.agentrun(name) or {}).get("status") or {})


def condition(cluster: KubeCluster, name: str, ctype: str) -> dict[str, Any] | None:
    for c in status(cluster, name).get("conditions") or []:
        if c["type"] == ctype:
            return dict(c)
    return None


async def run_of(store: Store, cluster: KubeCluster, name: str) -> Run:
    rid = await eventually(lambda: status(cluster, name).get("runId"), 30, f"{name} to get a run")
    return await store.get_run(rid)


async def count_runs(store: Store, uid: str) -> int:
    async with store.pool.connection() as conn:
        cur = await conn.execute("SELECT count(*) FROM agent_run WHERE k8s_uid = %s", (uid,))
        row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def test_apply_creates_one_run_even_when_the_create_handler_runs_twice(
    cluster: KubeCluster, operators: Operators, store: Store
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
    assert run.k8s_uid == uid and run.k8s_name == "once" and run.k8s_namespace == "default"
    assert run.agent_spec["system"] == "You echo carefully."  # the Agent was resolved and pinned
    assert await count_runs(store, uid) == 1
    assert status(cluster, "once")["phase"] == "pending"
    assert condition(cluster, "once", "Accepted") == {
        **(condition(cluster, "once", "Accepted") or {}),
        "status": "True",
        "reason": "RunCreated",
    }


async def test_status_follows_the_run_and_events_mark_its_transitions(
    cluster: KubeCluster, operators: Operators, store: Store
) -> None:
    op = operators.start()
    cluster.apply_agentrun(agentrun_manifest(
        "follow", agent={"model": "claude-sonnet-4-5", "tools": ["echo"]}, maxAttempts=2))
    run = await run_of(store, cluster, "follow")
    assert status(cluster, "follow")["model"] == "claude-sonnet-4-5"

    # Claimed by a, two steps, then a goes silent: its lease runs out, b resumes.
    [(_, lease_a)] = (await store.claim("default", "worker-a", ttl=0.5)).claimed
    await eventually(lambda: status(cluster, "follow").get("phase") == "running", 10, "running")
    assert status(cluster, "follow")["worker"] == "worker-a"
    turn = {"role": "assistant", "content": [{"type": "text", "text": "hi"}]}
    await store.append_step(
        lease_a, 0, "model_turn", turn, input_tokens=120, output_tokens=7, ttl=0.5
    )
    await store.append_step(lease_a, 1, "tool_result", {"content": []}, ttl=0.5)
    # Steps are not notified; the resync (1 s in tests) brings them.
    await eventually(lambda: status(cluster, "follow").get("step") == 2, 10, "step 2")
    assert status(cluster, "follow")["tokens"] == {"input": 120, "output": 7}
    await asyncio.sleep(0.6)
    [(_, lease_b)] = (await store.claim("default", "worker-b", ttl=30)).claimed
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
    events = {e["reason"]: e for e in cluster.events("follow")}
    assert list(events) == ["Created", "Claimed", "Resumed", "Finished"]
    assert events["Resumed"]["type"] == "Warning"
    resumed = events["Resumed"]["message"]
    assert "worker-a stopped renewing its lease; resumed by worker-b" in resumed

    # Metrics: the finished run's steps and attempts, runs by status.
    await eventually(
        lambda: op.metric("agentrun_runs", pool="default", status="succeeded") == 1, 10, "gauge"
    )
    assert op.metric("agentrun_run_steps_count", pool="default") == 1
    assert op.metric("agentrun_run_attempts_sum", pool="default") == 2
    assert (op.metric("agentrun_status_patches_total") or 0) >= 4
    assert run.id == (await store.get_run(run.id)).id


async def test_a_real_worker_runs_an_applied_agentrun_to_its_result(
    cluster: KubeCluster, operators: Operators, store: Store, workers: Workers, fake: FakeFactory
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
    assert s["tokens"]["input"] > 0 and s["tokens"]["output"] > 0
    assert s["promptVersion"] == (await store.get_run(run.id)).prompt_version
    await eventually(lambda: "Finished" in cluster.reasons("real"), 10, "Finished event")
    # Claimed may be coalesced away when the run finished within one flush window.
    assert cluster.reasons("real") in (["Created", "Claimed", "Finished"], ["Created", "Finished"])
    w.popen.terminate()
    assert w.wait() == 0


async def test_cancel_annotation_cancels_the_run(
    cluster: KubeCluster, operators: Operators, store: Store
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


async def test_approve_and_reject_annotations_unblock_a_waiting_run(
    cluster: KubeCluster, operators: Operators, store: Store
) -> None:
    operators.start()
    cluster.apply_agent(agent_manifest(requireApproval=True))
    for name in ("approve-me", "reject-me"):
        cluster.apply_agentrun(agentrun_manifest(name))
    runs = {name: await run_of(store, cluster, name) for name in ("approve-me", "reject-me")}
    # The operator creates the two runs in whichever order kopf handles the objects: claim both,
    # then match each lease to its object.
    leases = {lease.run_id: lease for _, lease in (
        await store.claim("default", "w", limit=2, ttl=30)).claimed}
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
                           "reason": "approval required before drop_table (step 0)"}
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
        assert approval.decided_by == f"annotation on AgentRun default/{name}"
        await eventually(lambda n=name: status(cluster, n).get("phase") == "pending", 10, "mirror")
        assert status(cluster, name).get("pendingApproval") is None
    assert "Approved" in cluster.reasons("approve-me")
    assert "Rejected" in cluster.reasons("reject-me")


async def test_delete_cancels_the_run_then_lets_the_object_go_and_keeps_the_history(
    cluster: KubeCluster, operators: Operators, store: Store
) -> None:
    operators.start()
    cluster.apply_agent(agent_manifest())
    cluster.apply_agentrun(agentrun_manifest("gone"))
    run = await run_of(store, cluster, "gone")
    [(_, lease)] = (await store.claim("default", "w", ttl=30)).claimed
    await store.append_step(lease, 0, "model_turn", {"role": "assistant", "content": []})
    obj = cluster.agentrun("gone") or {}
    assert "agentrun.dev/finalizer" in obj["metadata"]["finalizers"]
    assert cluster.delete("/apis/agentrun.dev/v1alpha1/namespaces/default/agentruns/gone") == 200
    await eventually(lambda: cluster.agentrun("gone") is None, 15, "the object to go")
    after = await store.get_run(run.id)
    assert after.status == "cancelled" and "AgentRun default/gone deleted" in (after.error or "")
    assert [s.seq for s in await store.steps(run.id)] == [0]  # the history stays


async def test_unknown_agent_is_a_condition_until_the_agent_exists(
    cluster: KubeCluster, operators: Operators, store: Store
) -> None:
    operators.start(env={"AGENTRUN_AGENT_RETRY_DELAY": "1"})
    cluster.apply_agentrun(agentrun_manifest("orphan", agent={"name": "missing"}))
    cond = await eventually(lambda: condition(cluster, "orphan", "Accepted"), 15, "condition")
    assert cond["status"] == "False" and cond["reason"] == "AgentNotFound"
    assert "spec.agent.name: no Agent 'missing' in namespace default" in cond["message"]
    assert "AgentNotFound" in cluster.reasons("orphan")
    cluster.apply_agent(agent_manifest("missing"))
    run = await run_of(store, cluster, "orphan")
    assert run.agent_spec["model"] == "claude-sonnet-4-5"
    accepted = condition(cluster, "orphan", "Accepted") or {}
    assert accepted.get("status") == "True"


async def test_dead_lettered_run_gets_a_warning_event(
    cluster: KubeCluster, operators: Operators, store: Store
) -> None:
    operators.start()
    cluster.apply_agent(agent_manifest())
    cluster.apply_agentrun(agentrun_manifest("poison", maxAttempts=1))
    await run_of(store, cluster, "poison")
    await store.claim("default", "w1", ttl=0.3)
    await asyncio.sleep(0.5)
    result = await store.claim("default", "w2", ttl=30)
    assert [r.k8s_name for r in result.dead_lettered] == ["poison"]
    await eventually(lambda: status(cluster, "poison").get("phase") == "dead_letter", 10, "dl")
    await eventually(lambda: "DeadLettered" in cluster.reasons("poison"), 10, "event")
    assert status(cluster, "poison")["message"].startswith("gave up after 1 attempts")


async def test_database_outage_is_a_condition_and_the_operator_recovers_without_restart(
    cluster: KubeCluster, operators: Operators, store: Store, database_url: str
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
        [(_, lease)] = (await store.claim("default", "w", ttl=30)).claimed
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

POOL = {
    "name": "default",
    "namespace": "default",
    "deployment": "workers",
    "runsPerWorker": 2,
    "minReplicas": 0,
    "maxReplicas": 3,
    "scaleDownDelaySeconds": 3,
}


def replicas(cluster: KubeCluster, name: str = "workers") -> int | None:
    d = cluster.deployment(name) or {}
    value = d.get("spec", {}).get("replicas")
    return int(value) if value is not None else None


async def test_scaling_from_zero_up_with_depth_capped_and_down_after_the_delay(
    cluster: KubeCluster, operators: Operators, store: Store
) -> None:
    cluster.create_deployment("workers", replicas=0)
    cluster.create_deployment("fixed", replicas=5)  # not in the pools file: never touched
    op = operators.start(pools=[POOL])
    cluster.apply_agent(agent_manifest())
    await eventually(lambda: op.metric("agentrun_operator_db_up") == 1, 15, "operator ready")
    await asyncio.sleep(1.5)  # a scale tick or two, nothing pending: stays at zero
    assert replicas(cluster) == 0

    t0 = time.monotonic()
    cluster.apply_agentrun(agentrun_manifest("s1"))
    await eventually(lambda: replicas(cluster) == 1, 10, "scale from zero", every=0.01)
    print(f"new AgentRun -> Deployment scaled from zero: {(time.monotonic() - t0) * 1000:.0f} ms")
    # Store-level figure: new pending run (insert) -> scale patch, without kopf's create path.
    t1 = time.monotonic()
    for i in range(2, 5):
        cluster.apply_agentrun(agentrun_manifest(f"s{i}"))
    await eventually(lambda: replicas(cluster) == 2, 10, "up with depth (4 runs / 2 per worker)")
    print(f"3 more runs -> 2 replicas: {(time.monotonic() - t1) * 1000:.0f} ms")
    for i in range(5, 9):
        cluster.apply_agentrun(agentrun_manifest(f"s{i}"))
    await eventually(lambda: replicas(cluster) == 3, 10, "capped at maxReplicas")
    await asyncio.sleep(1.5)
    assert replicas(cluster) == 3  # 8 runs would want 4: capped

    for i in range(1, 9):
        run = await run_of(store, cluster, f"s{i}")
        await store.cancel(run.id)
    t2 = time.monotonic()
    await asyncio.sleep(2.0)
    assert replicas(cluster) == 3, "scaled down before the delay"
    await eventually(lambda: replicas(cluster) == 0, 10, "scale down after the delay")
    waited = time.monotonic() - t2
    assert waited >= 3.0, waited
    assert replicas(cluster, "fixed") == 5
    assert op.metric("agentrun_scaling_decisions_total", pool="default", direction="up") == 3
    assert op.metric("agentrun_scaling_decisions_total", pool="default", direction="down") == 1


async def test_busy_worker_pods_get_a_higher_deletion_cost_and_helm_counts_win(
    cluster: KubeCluster, operators: Operators, store: Store
) -> None:
    cluster.create_deployment("workers", replicas=2)
    pinned = cluster.create_deployment("pinned", replicas=4, pool="batch")
    cluster.patch("/apis/apps/v1/namespaces/default/deployments/pinned",
                  {"metadata": {"annotations": {"agentrun.dev/autoscale": "false"}}})
    assert pinned
    for pod in ("workers-abc12", "workers-def34"):
        cluster.create_pod(pod, "default")
    cluster.create_pod("other-xyz", "batch")
    pools = [POOL, {**POOL, "name": "batch", "deployment": "pinned"}]
    operators.start(pools=pools)
    cluster.apply_agent(agent_manifest())
    for name in ("b1", "b2"):
        cluster.apply_agentrun(agentrun_manifest(name))
        await run_of(store, cluster, name)
    # Worker ids are "<pod name>-<pid>-<random>"; this pod holds both runs.
    claimed = (await store.claim("default", "workers-abc12-7-beef", limit=2, ttl=60)).claimed
    assert len(claimed) == 2

    def cost(pod: str) -> str | None:
        meta = (cluster.pod(pod) or {}).get("metadata", {})
        return (meta.get("annotations") or {}).get("controller.kubernetes.io/pod-deletion-cost")

    await eventually(lambda: cost("workers-abc12") == "2", 15, "cost of the busy pod")
    await eventually(lambda: cost("workers-def34") == "0", 15, "cost of the idle pod")
    assert cost("other-xyz") is None  # an opted-out pool's pods are left alone
    await asyncio.sleep(1.5)
    assert replicas(cluster, "pinned") == 4  # agentrun.dev/autoscale: "false" wins
    assert replicas(cluster) == 2  # 2 running runs / 2 per worker = 1, but held by the delay


async def test_the_same_yaml_runs_through_kubectl_apply_and_agentrun_submit(
    cluster: KubeCluster, operators: Operators, store: Store, database_url: str
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
    cluster: KubeCluster, tmp_path: Path, empty_database_url: str
) -> None:
    ops = Operators(cluster, empty_database_url, tmp_path)
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


async def test_oldest_pending_age_returns_to_zero_when_the_pool_empties(
    cluster: KubeCluster, operators: Operators, store: Store
) -> None:
    # A pool the operator does not scale: only the metrics recount reports its oldest pending.
    op = operators.start()
    run, _ = await store.create_run("wait", AGENT, pool="batch")
    await eventually(
        lambda: (op.metric("agentrun_oldest_pending_seconds", pool="batch") or 0) > 0, 15, "age")
    await store.cancel(run.id)
    await eventually(
        lambda: op.metric("agentrun_oldest_pending_seconds", pool="batch") == 0, 15, "back to 0")
