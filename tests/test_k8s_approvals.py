"""Approvals as objects, on a real API server (tests/realkube.py): who may decide is RBAC's
call, and the approver recorded is the user the API server authenticated.

The chart is ``helm install``-ed into the test's namespace, so the AgentRunApproval CRD, the
ValidatingAdmissionPolicy and the ``-approver`` / ``-editor`` ClusterRoles are the chart's own
objects, as a user gets them. The users are ServiceAccounts of the test namespace, each bound (a
RoleBinding there) to one of those ClusterRoles and speaking with its own token; the operator
runs with the operator ServiceAccount's token and the environment the chart's Deployment gives
it. Runs are brought to ``waiting_approval`` through the store, as the operator tests do.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from agentrun.kubeapprovals import ApprovalRefused, AsyncKubeApprovals
from agentrun.store import K8sRef, Run, Store
from tests.conftest import run_cli
from tests.kubekit import OperatorProc, Operators, agent_manifest, agentrun_manifest, eventually
from tests.realkube import (
    AGENTRUNS,
    CHART,
    Kube,
    Release,
    install_chart,
    wait_until,
    write_token_kubeconfig,
)
from tests.workerkit import AGENT, wait_run

APPROVALS = "agentrunapprovals"


@dataclass
class User:
    """A ServiceAccount of the test namespace speaking with its own token."""

    name: str
    username: str  # what the API server authenticates it as
    kubeconfig: Path
    kube: Kube

    def create_approval(self, manifest: dict[str, Any]) -> tuple[int, Any]:
        return self.kube.request(
            "POST", f"{AGENTRUNS}/namespaces/{self.kube.namespace}/{APPROVALS}", manifest)


def approval(agent_run: str, seq: int, decision: str, approver: str,
             name: str | None = None, reason: str | None = None, call: int | None = None,
             attempt: int | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"agentRun": agent_run, "seq": seq, "decision": decision,
                            "approver": approver}
    for field, value in (("reason", reason), ("call", call), ("attempt", attempt)):
        if value is not None:
            spec[field] = value
    return {"apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRunApproval",
            "metadata": {"name": name or f"{agent_run}-{decision}-{seq}"}, "spec": spec}


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture
def release(kube: Kube) -> Iterator[Release]:
    rel = install_chart(kube, kube.namespace, f"operator.watchNamespaces={{{kube.namespace}}}")
    try:
        yield rel
    finally:
        kube.helm("uninstall", rel.name, "-n", kube.namespace, "--wait=false", check=False)


@pytest.fixture
def users(kube: Kube, release: Release, tmp_path: Path) -> Iterator[Callable[[str, str], User]]:
    """``users(name, role)``: a ServiceAccount bound in the test namespace to the chart's
    ``<fullname>-<role>`` ClusterRole (approver or editor)."""
    made: list[User] = []

    def make(name: str, role: str) -> User:
        kube.kubectl("create", "serviceaccount", name)
        kube.kubectl("create", "rolebinding", f"{name}-{role}",
                     f"--clusterrole={release.fullname}-{role}",
                     f"--serviceaccount={kube.namespace}:{name}")
        token = kube.kubectl("create", "token", name, "--duration=1h").stdout.strip()
        path = write_token_kubeconfig(kube.kubeconfig, token, tmp_path / f"kubeconfig-{name}",
                                      kube.namespace)
        user = User(name, f"system:serviceaccount:{kube.namespace}:{name}", path,
                    Kube(path, kube.namespace))
        made.append(user)
        return user

    try:
        yield make
    finally:
        for u in made:
            u.kube.close()


class _Kubeconfig:
    def __init__(self, path: Path) -> None:
        self.path = path

    def kubeconfig(self, directory: Path) -> Path:
        return self.path


@pytest.fixture
def operator(
    kube: Kube, release: Release, database_url: str, tmp_path: Path
) -> Iterator[Callable[..., OperatorProc]]:
    """Starts ``agentrun operator`` with the operator ServiceAccount's token, watching the test
    namespace, with the chart Deployment's AGENTRUN_APPROVAL_ANNOTATIONS; no line it logs may
    be a refusal by RBAC."""
    ops = Operators(_Kubeconfig(release.kubeconfig_for(release.operator_sa, tmp_path)),  # type: ignore[arg-type]
                    database_url, tmp_path)

    def start(faults: str = "") -> OperatorProc:
        # Read at each start: a test may `helm upgrade` the release first.
        dep = kube.deployment(f"{release.fullname}-operator")
        assert dep is not None
        env = {e["name"]: e.get("value", "")
               for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
        return ops.start(env={
            "AGENTRUN_WATCH_NAMESPACES": kube.namespace,
            "AGENTRUN_APPROVAL_ANNOTATIONS": env["AGENTRUN_APPROVAL_ANNOTATIONS"],
            "AGENTRUN_TEST_FAULTS": faults,
        })

    try:
        yield start
    finally:
        ops.stop_all()
    for p in ops.procs:
        refused = [ln for ln in p.output().splitlines() if "forbidden" in ln.lower()]
        assert not refused, "the operator was refused by the chart's RBAC:\n" + "\n".join(
            refused[:5])


def policy_active(kube: Kube, user: User) -> None:
    """Wait until the API server enforces the chart's admission policy (a new policy takes a
    moment to reach the admission plugin): a dry-run create with a forged approver is refused."""
    def refused() -> bool:
        code, _ = user.kube.request(
            "POST", f"{AGENTRUNS}/namespaces/{kube.namespace}/{APPROVALS}?dryRun=All",
            approval("probe", 0, "approve", "somebody-else", name="probe"))
        return code == 403

    wait_until(refused, 60, "the chart's ValidatingAdmissionPolicy to be enforced")


async def waiting_run(kube: Kube, store: Store, name: str, seq: int = 0) -> Run:
    """An AgentRun whose run waits for a decision on step ``seq`` (a drop_table call)."""
    kube.apply_agentrun(agentrun_manifest(name))
    rid = await eventually(
        lambda: ((kube.agentrun(name) or {}).get("status") or {}).get("runId"), 30,
        f"{name} to get a run")
    claimed = (await store.with_lease_ttl(60).claim("default", "w", limit=10)).claimed
    [lease] = [lease for _, lease in claimed if str(lease.run_id) == rid]
    call = {"seq": seq, "call_index": 0, "tool": "drop_table", "input": {"table": "orders"},
            "stage": "before_call"}
    await store.wait_for_approval(lease, f"approval required before drop_table (step {seq})", call)
    await eventually(lambda: ((kube.agentrun(name) or {}).get("status") or {}).get("phase")
                     == "waiting_approval", 15, f"{name} to show waiting_approval")
    return await store.get_run(rid)


async def decided_then_killed(
    kube: Kube, user: User, op: OperatorProc, manifest: dict[str, Any]
) -> None:
    """``user`` creates the approval once the policy is enforced; ``op``, started with the
    operator_after_decide fault, is SIGKILLed right after recording the decision."""
    policy_active(kube, user)
    code, out = user.create_approval(manifest)
    assert code == 201, out
    await asyncio.to_thread(op.popen.wait, 30)
    assert op.popen.returncode == -9, op.output()[-3000:]


def approvals_of(kube: Kube) -> list[dict[str, Any]]:
    obj = kube.get(f"{AGENTRUNS}/namespaces/{kube.namespace}/{APPROVALS}") or {}
    return list(obj.get("items") or [])


def approval_status(kube: Kube, name: str) -> dict[str, Any]:
    obj = kube.get(f"{AGENTRUNS}/namespaces/{kube.namespace}/{APPROVALS}/{name}") or {}
    return dict(obj.get("status") or {})


async def settled(kube: Kube, name: str) -> dict[str, Any]:
    """The approval's status once the operator marked it Applied or Refused."""
    await eventually(lambda: approval_status(kube, name).get("phase") in ("Applied", "Refused"),
                     30, f"AgentRunApproval {name} to be Applied or Refused")
    return approval_status(kube, name)


# -- tests ---------------------------------------------------------------------------------------


async def test_an_approver_approves_and_the_recorded_approver_is_its_token_user(
    kube: Kube, users: Callable[[str, str], User], operator: Callable[..., OperatorProc],
    store: Store,
) -> None:
    alice = users("alice", "approver")
    op = operator()
    kube.apply_agent(agent_manifest(requireApproval=True))
    run = await waiting_run(kube, store, "migrate")
    policy_active(kube, alice)

    # The CLI: the AgentRun by name, the approver found by a SelfSubjectReview, the outcome
    # awaited. Alice's kubeconfig is all it has: no database URL.
    proc = await asyncio.to_thread(
        run_cli, "approve", "migrate", "0", "--kubeconfig", str(alice.kubeconfig),
        "--reason", "reviewed the migration", env={"AGENTRUN_DATABASE_URL": "postgresql://x@/"})
    assert proc.returncode == 0, proc.stderr
    assert f"Applied: step 0 (drop_table) approved by {alice.username}: reviewed the " \
        "migration" in proc.stdout, proc.stdout
    [obj] = approvals_of(kube)
    assert obj["spec"]["approver"] == alice.username
    assert obj["status"]["runId"] == str(run.id) and obj["status"]["decidedAt"]

    resumed = await wait_run(store, run.id, lambda r: r.status == "pending", 15)
    decided = await store.get_approval(resumed.id, 0, 0, "before_call")
    assert decided is not None
    assert (decided.decision, decided.decided_by, decided.reason) == (
        "approved", alice.username, "reviewed the migration")
    await eventually(lambda: "Approved" in kube.reasons("migrate"), 10, "the Approved event")
    [event] = [e for e in kube.events("migrate") if e["reason"] == "Approved"]
    assert alice.username in event["message"], event["message"]
    assert "Approved" in kube.reasons(obj["metadata"]["name"])

    # A restart lists every approval again: the Applied one is left alone (applying it again
    # would be refused, the run no longer waiting). An approval made after the restart is
    # handled after that listing, so once it is settled the restarted operator has seen both.
    assert op.stop() == 0, op.output()[-3000:]
    operator()
    code, out = alice.create_approval(approval("migrate", 7, "approve", alice.username))
    assert code == 201, out
    assert (await settled(kube, "migrate-approve-7"))["phase"] == "Refused"
    after = approval_status(kube, obj["metadata"]["name"])
    assert after == obj["status"], "an Applied approval was acted on again"
    assert kube.reasons(obj["metadata"]["name"]).count("Approved") == 1


async def test_a_forged_approver_is_refused_by_the_api_server(
    kube: Kube, users: Callable[[str, str], User], store: Store,
) -> None:
    alice = users("alice", "approver")
    kube.apply_agent(agent_manifest(requireApproval=True))
    kube.apply_agentrun(agentrun_manifest("migrate"))
    policy_active(kube, alice)
    code, out = alice.create_approval(approval("migrate", 0, "approve", "the-cto"))
    assert code == 403, out
    message = out["message"]
    assert "spec.approver" in message and '"the-cto"' in message, message
    assert f'authenticated as "{alice.username}"' in message, message
    assert approvals_of(kube) == []
    # Her own name is admitted (the same request otherwise).
    code, out = alice.create_approval(approval("migrate", 0, "approve", alice.username))
    assert code == 201, out


async def test_an_editor_cannot_approve_by_object_only_by_the_unauthenticated_annotation(
    kube: Kube, users: Callable[[str, str], User], operator: Callable[..., OperatorProc],
    store: Store,
) -> None:
    bob = users("bob", "editor")
    operator()
    # The editor runs agents: creates the Agent and the AgentRun itself.
    bob.kube.apply_agent(agent_manifest(requireApproval=True))
    run = await waiting_run(bob.kube, store, "migrate")
    code, out = bob.create_approval(approval("migrate", 0, "approve", bob.username))
    assert code == 403, out
    assert "cannot create resource \"agentrunapprovals\"" in out["message"], out["message"]
    proc = await asyncio.to_thread(
        run_cli, "approve", "migrate", "0", "--kubeconfig", str(bob.kubeconfig))
    assert proc.returncode == 1 and "403" in proc.stderr, proc.stderr
    assert (await store.get_run(run.id)).status == "waiting_approval"

    # The annotation path is open to whoever may patch the AgentRun, and records no user.
    bob.kube.annotate("migrate", {"agentrun.dev/approve": "0"})
    resumed = await wait_run(store, run.id, lambda r: r.status == "pending", 15)
    decided = await store.get_approval(resumed.id, 0, 0, "before_call")
    assert decided is not None
    assert decided.decided_by == f"annotation on AgentRun {kube.namespace}/migrate"


async def test_approval_annotations_false_refuses_the_annotation(
    kube: Kube, release: Release, users: Callable[[str, str], User],
    operator: Callable[..., OperatorProc], store: Store,
) -> None:
    kube.helm("upgrade", release.name, str(CHART), "-n", kube.namespace, "--reuse-values",
              "--set", "operator.approvalAnnotations=false")
    bob = users("bob", "editor")
    operator()  # with the upgraded Deployment's environment
    bob.kube.apply_agent(agent_manifest(requireApproval=True))
    run = await waiting_run(bob.kube, store, "migrate")
    bob.kube.annotate("migrate", {"agentrun.dev/approve": "0"})
    await eventually(lambda: "ActionRefused" in kube.reasons("migrate"), 15, "the refusal")
    [event] = [e for e in kube.events("migrate") if e["reason"] == "ActionRefused"]
    assert event["type"] == "Warning"
    assert "approve by annotation is disabled; create an AgentRunApproval" in event["message"]
    # Consumed, and the run still waits: no decision was recorded.
    await eventually(lambda: "agentrun.dev/approve" not in (
        (kube.agentrun("migrate") or {})["metadata"].get("annotations") or {}), 10, "consumed")
    assert (await store.get_run(run.id)).status == "waiting_approval"
    assert await store.get_approval(run.id, 0, 0, "before_call") is None


async def test_two_decisions_on_one_step_at_once_one_applies_the_other_is_refused(
    kube: Kube, users: Callable[[str, str], User], operator: Callable[..., OperatorProc],
    store: Store,
) -> None:
    alice = users("alice", "approver")
    carol = users("carol", "approver")
    operator()
    kube.apply_agent(agent_manifest(requireApproval=True))
    run = await waiting_run(kube, store, "migrate")
    policy_active(kube, alice)
    results: dict[str, tuple[int, Any]] = {}
    go = threading.Barrier(2)

    def create(user: User, decision: str) -> None:
        go.wait()
        results[user.name] = user.create_approval(
            approval("migrate", 0, decision, user.username, name=f"by-{user.name}"))

    threads = [threading.Thread(target=create, args=(alice, "approve")),
               threading.Thread(target=create, args=(carol, "reject"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(code == 201 for code, _ in results.values()), results
    statuses = {u: await settled(kube, f"by-{u}") for u in ("alice", "carol")}
    phases = sorted(s["phase"] for s in statuses.values())
    assert phases == ["Applied", "Refused"], json.dumps(statuses, indent=1)
    [winner] = [u for u, s in statuses.items() if s["phase"] == "Applied"]
    [loser] = [u for u, s in statuses.items() if s["phase"] == "Refused"]
    assert "not waiting for approval" in statuses[loser]["message"], statuses[loser]
    winner_name = f"system:serviceaccount:{kube.namespace}:{winner}"
    assert f"step 0 was decided first, {'approved' if winner == 'alice' else 'rejected'} by " \
        f"{winner_name}" in statuses[loser]["message"], statuses[loser]
    decided = await store.get_approval(run.id, 0, 0, "before_call")
    assert decided is not None
    assert decided.decided_by == f"system:serviceaccount:{kube.namespace}:{winner}"
    assert decided.decision == ("approved" if winner == "alice" else "rejected")
    await eventually(lambda: "ApprovalRefused" in kube.reasons(f"by-{loser}"), 10,
                     "the refused approval's Warning")


async def test_a_second_decision_made_after_the_first_applied_names_the_first(
    kube: Kube, users: Callable[[str, str], User], operator: Callable[..., OperatorProc],
    store: Store,
) -> None:
    """The loser of the race above, made deterministic: carol's approval is read after alice's
    decision, when the run no longer waits and carol's object never learnt which call it was
    about. Her refusal still says who decided first (it once said only "not waiting")."""
    alice = users("alice", "approver")
    carol = users("carol", "approver")
    operator()
    kube.apply_agent(agent_manifest(requireApproval=True))
    await waiting_run(kube, store, "migrate")
    policy_active(kube, alice)
    code, _ = alice.create_approval(approval("migrate", 0, "approve", alice.username,
                                             name="by-alice"))
    assert code == 201
    assert (await settled(kube, "by-alice"))["phase"] == "Applied"
    code, _ = carol.create_approval(approval("migrate", 0, "reject", carol.username,
                                             name="by-carol"))
    assert code == 201
    refused = await settled(kube, "by-carol")
    assert refused["phase"] == "Refused", refused
    assert "not waiting for approval" in refused["message"], refused
    assert f"step 0 was decided first, approved by {alice.username}" in refused["message"], refused


async def test_a_late_decision_never_lands_on_the_steps_next_wait(
    kube: Kube, users: Callable[[str, str], User], operator: Callable[..., OperatorProc],
    store: Store,
) -> None:
    """Two humans look at call 0 of step 0. The first one's ``approve=0`` is applied and the
    run goes on to the step's second irreversible call. The second human's ``approve=0``, meant
    for call 0 as well, then decided call 1, which nobody had looked at (found by a review on
    2026-12-06). A decision names its wait now (``<seq>.<call>``, the status's
    ``pendingApproval.decide``): a bare step number after the step's first decision is refused,
    and so is a named wait the run is not on, by annotation and by object alike."""
    alice = users("alice", "approver")
    operator()
    kube.apply_agent(agent_manifest(requireApproval=True))
    run = await waiting_run(kube, store, "migrate")

    def status() -> dict[str, Any]:
        return dict((kube.agentrun("migrate") or {}).get("status") or {})

    def refusals() -> list[str]:
        return [e["message"] for e in kube.events("migrate") if e["reason"] == "ActionRefused"]

    first = status()["pendingApproval"]
    assert (first["decide"], first["call"]) == ("0.0", 0), first
    kube.annotate("migrate", {"agentrun.dev/approve": "0"})  # the step's first decision
    await wait_run(store, run.id, lambda r: r.status == "pending", 15)
    ((_, lease),) = (await store.with_lease_ttl(60).claim("default", "w2", 1)).claimed
    second = {"seq": 0, "call_index": 1, "tool": "drop_table", "input": {"table": "orders_old"},
              "stage": "before_call"}
    await store.wait_for_approval(lease, "approval required before drop_table (step 0)", second)
    await eventually(lambda: (status().get("pendingApproval") or {}).get("decide") == "0.1", 30,
                     "the second wait mirrored")
    await eventually(lambda: any("agentrun.dev/approve=0.1 " in e["message"]
                                 for e in kube.events("migrate")), 10,
                     "the waiting Event naming the second wait")

    # The late bare decision, a stale named one, and the wrong stage of the right call.
    late = {"0": "name that wait to decide it (0.1)",
            "0.0": "waits on 0.1 (drop_table, before call), not 0.0",
            "0.1.1": "waits on 0.1 (drop_table, before call), not 0.1.1"}
    for value, why in late.items():
        kube.annotate("migrate", {"agentrun.dev/approve": value})
        await eventually(lambda w=why: any(w in m for m in refusals()), 15,
                         f"approve={value} refused")
    # Both decisions in one patch: neither is taken (approve won, silently, before).
    kube.annotate("migrate", {"agentrun.dev/approve": "0.1", "agentrun.dev/reject": "0.1"})
    for key, other in (("approve", "reject"), ("reject", "approve")):
        await eventually(lambda k=key, o=other: any(
            f"agentrun.dev/{k}='0.1': set together with agentrun.dev/{o}='0.1': nothing was "
            "decided" in m for m in refusals()), 15, f"{key} refused beside {other}")
    assert await store.get_approval(run.id, 0, 1, "before_call") is None
    assert (await store.get_run(run.id)).status == "waiting_approval"

    # By object: a bare seq is refused as well; one naming the call is applied.
    policy_active(kube, alice)
    code, out = alice.create_approval(approval("migrate", 0, "approve", alice.username,
                                               name="late"))
    assert code == 201, out
    refused = await settled(kube, "late")
    assert refused["phase"] == "Refused", refused
    assert "name that wait to decide it (0.1)" in refused["message"], refused
    # An attempt without its call is refused by the API server itself (the CRD's CEL rule).
    code, out = alice.create_approval(approval("migrate", 0, "approve", alice.username,
                                               name="no-call", attempt=1))
    assert code == 422 and "attempt names an attempt of a call: set call too" in str(out), out
    code, out = alice.create_approval(approval("migrate", 0, "reject", alice.username,
                                               name="named", call=1, reason="keep it"))
    assert code == 201, out
    applied = await settled(kube, "named")
    assert applied["phase"] == "Applied", applied
    assert applied["call"] == {"tool": "drop_table", "index": 1, "stage": "before_call",
                               "attempt": 1}
    decided = await store.get_approval(run.id, 0, 1, "before_call")
    assert decided is not None
    assert (decided.decision, decided.decided_by) == ("rejected", alice.username)
    first_call = await store.get_approval(run.id, 0, 0, "before_call")
    assert first_call is not None and first_call.decision == "approved"  # untouched


async def test_the_python_client_rejects_through_an_object_and_raises_when_refused(
    kube: Kube, users: Callable[[str, str], User], operator: Callable[..., OperatorProc],
    store: Store,
) -> None:
    alice = users("alice", "approver")
    operator()
    kube.apply_agent(agent_manifest(requireApproval=True))
    run = await waiting_run(kube, store, "migrate", seq=2)
    policy_active(kube, alice)
    async with AsyncKubeApprovals(kubeconfig=str(alice.kubeconfig)) as k:
        assert await k.whoami() == alice.username
        # seq None: the step the AgentRun's status says it waits on.
        outcome = await k.reject("migrate", reason="not on a Friday")
        assert (outcome.phase, outcome.seq, outcome.decision, outcome.approver) == (
            "Applied", 2, "reject", alice.username)
        assert outcome.run_id == str(run.id)
        decided = await store.get_approval(run.id, 2, 0, "before_call")
        assert decided is not None
        assert (decided.decision, decided.decided_by, decided.reason) == (
            "rejected", alice.username, "not on a Friday")
        # The run waits no more: a second decision on that step is refused by the operator.
        with pytest.raises(ApprovalRefused) as refused:
            await k.approve("migrate", 2)
        assert refused.value.outcome.phase == "Refused"
        assert "not waiting for approval" in str(refused.value)
    # The CLI says the same on one line and exits 2 (the run was not in the state asked for).
    proc = await asyncio.to_thread(
        run_cli, "reject", "migrate", "2", "--kubeconfig", str(alice.kubeconfig))
    assert proc.returncode == 2, proc.stderr
    assert "refused" in proc.stderr and "not waiting for approval" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize("form", ["agentrunapproval", "agentrunapprovals", "arapproval", "ara",
                                  "agentrunapprovals.agentrun.dev"])
def test_every_name_of_the_kind_reaches_it_with_its_columns(kube: Kube, form: str) -> None:
    me = json.loads(kube.kubectl("auth", "whoami", "-o", "json", namespaced=False).stdout)
    username = me["status"]["userInfo"]["username"]  # the policy of any release admits it
    kube.apply_yaml(approval("one", 4, "reject", username, name="ok", reason="no", call=1))
    assert kube.kubectl("get", form, "-o", "name").stdout.split() == [
        "agentrunapproval.agentrun.dev/ok"]
    header, row = kube.kubectl("get", form, "ok").stdout.splitlines()
    assert header.split() == ["NAME", "AGENTRUN", "SEQ", "CALL", "DECISION", "APPROVER", "PHASE",
                              "AGE"]
    assert row.split()[:6] == ["ok", "one", "4", "1", "reject", username]
    assert "agentrunapproval.agentrun.dev/ok" in kube.kubectl(
        "get", "agentrun-all", "-o", "name").stdout.split()
    # Immutable: a decision is not edited.
    proc = kube.kubectl("patch", form, "ok", "--type=merge", "-p", '{"spec":{"seq":5}}',
                        check=False)
    assert proc.returncode != 0 and "spec is immutable" in proc.stderr, proc.stderr


@pytest.mark.parametrize("args, message", [
    (["--kube", "--by", "bob"], "--by: with --kube the approver is the user the API server "
     "authenticates"),
    (["-n", "team-a", "--abort"], "--abort is not available with --kube"),
    (["--kubeconfig", "/nonexistent/kubeconfig"], "kubeconfig:"),
], ids=["by", "abort", "kubeconfig"])
def test_kube_decisions_refuse_what_they_cannot_honour_in_one_line(
    tmp_path: Path, args: list[str], message: str
) -> None:
    command = "reject" if "--abort" in args else "approve"
    proc = run_cli(command, "migrate", "0", *args, env={"KUBECONFIG": str(tmp_path / "none")})
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


async def test_an_operator_killed_right_after_the_decision_marks_it_applied_when_back(
    kube: Kube, users: Callable[[str, str], User], operator: Callable[..., OperatorProc],
    store: Store,
) -> None:
    alice = users("alice", "approver")
    first = operator(faults="operator_after_decide@0")
    kube.apply_agent(agent_manifest(requireApproval=True))
    run = await waiting_run(kube, store, "migrate")
    # SIGKILLed between recording the decision and saying so in the approval's status.
    await decided_then_killed(kube, alice, first, approval("migrate", 0, "approve",
                                                          alice.username, name="go", reason="ok"))
    assert (await store.get_run(run.id)).status == "pending"
    assert approval_status(kube, "go")["phase"] == "Pending"
    operator()
    status = await settled(kube, "go")
    assert status["phase"] == "Applied", status
    assert status["call"] == {"tool": "drop_table", "index": 0, "stage": "before_call",
                              "attempt": 1}
    decided = await store.get_approval(run.id, 0, 0, "before_call")
    assert decided is not None and decided.decided_by == alice.username


async def test_a_wait_that_does_not_name_its_attempt_is_shown_as_the_attempt_decided(
    kube: Kube, users: Callable[[str, str], User], operator: Callable[..., OperatorProc],
    store: Store,
) -> None:
    """A timeout's wait written by a worker from before it named its attempt (a rolling
    upgrade), on an approved re-run: the store decides attempt 2, the one the intent counts.
    The approval's status said attempt 1, so an operator killed right after the decision found
    attempt 1's earlier decision in the store when back, and marked its own approval Refused
    ("decided first ... by carol") although it had been recorded."""
    alice = users("alice", "approver")
    first = operator(faults="operator_after_decide@0")
    kube.apply_agent(agent_manifest(requireApproval=True))
    kube.apply_agentrun(agentrun_manifest("pay"))
    rid = await eventually(
        lambda: ((kube.agentrun("pay") or {}).get("status") or {}).get("runId"), 30,
        "pay to get a run")
    held = store.with_lease_ttl(60)
    ((_, lease),) = (await held.claim("default", "w1", 1)).claimed
    assert str(lease.run_id) == rid
    await store.record_effect(lease, 0, 0, key="k", tool="drop_table",
                              tool_kind="irreversible", state="intent")
    call = {"seq": 0, "call_index": 0, "tool": "drop_table", "input": {"table": "orders"},
            "stage": "outcome_unknown"}
    await store.wait_for_approval(lease, "outcome unknown", {**call, "attempt": 1})
    await store.decide(rid, 0, "approved", decided_by="carol")  # attempt 1: run it once more
    ((_, lease),) = (await held.claim("default", "w2", 1)).claimed
    assert await store.retry_intent(lease, 0, 0, 1) == 2
    await store.wait_for_approval(lease, "outcome unknown: drop_table timed out", call)
    await eventually(lambda: ((kube.agentrun("pay") or {}).get("status") or {}).get("phase")
                     == "waiting_approval", 15, "pay to show waiting_approval")
    # The step had carol's decision: this one names its wait (a bare seq could be a late one).
    await decided_then_killed(kube, alice, first, approval("pay", 0, "reject", alice.username,
                                                          name="stop", reason="it went out",
                                                          call=0, attempt=2))
    assert approval_status(kube, "stop")["call"]["attempt"] == 2
    operator()
    status = await settled(kube, "stop")
    assert status["phase"] == "Applied", status
    assert status["call"] == {"tool": "drop_table", "index": 0, "stage": "outcome_unknown",
                              "attempt": 2}
    decided = await store.get_approval((await store.get_run(rid)).id, 0, 0, "outcome_unknown", 2)
    assert decided is not None and decided.decided_by == alice.username
    assert decided.decision == "rejected"


async def test_an_operator_killed_after_an_annotations_decision_never_applies_it_again(
    kube: Kube, operator: Callable[..., OperatorProc], store: Store,
) -> None:
    """kopf removed an annotation only after its handler returned: an operator killed between
    the decision and that patch ran the handler again once back, and the same ``approve=0``
    decided whatever the run waited on by then, here the step's second irreversible call, with
    no human looking (found by an adversarial review on 2026-12-06). Consumed before the
    decision, a death in between lost it without a word (a review on 2026-12-07). Now it is
    decided, then consumed: the operator killed in between acts on it again once back, and the
    store refuses it (the step was decided), saying so in an Event, and consumes it."""
    first = operator(faults="operator_after_annotation_decide@0")
    kube.apply_agent(agent_manifest(requireApproval=True))
    run = await waiting_run(kube, store, "migrate")
    kube.annotate("migrate", {"agentrun.dev/approve": "0"})
    await asyncio.to_thread(first.popen.wait, 30)
    assert first.popen.returncode == -9, first.output()[-3000:]
    assert (await store.get_run(run.id)).status == "pending"  # the first call was approved
    # The run goes on to the step's second irreversible call, which waits for its own decision.
    ((_, lease),) = (await store.with_lease_ttl(60).claim("default", "w2", 1)).claimed
    second = {"seq": 0, "call_index": 1, "tool": "drop_table", "input": {"table": "orders_old"},
              "stage": "before_call"}
    await store.wait_for_approval(lease, "approval required before drop_table (step 0)", second)
    operator()

    def refused() -> list[str]:
        code, out = kube.request("GET", f"/api/v1/namespaces/{kube.namespace}/events")
        return [e["message"] for e in (out.get("items", []) if code == 200 else [])
                if e["involvedObject"].get("name") == "migrate"
                and e["reason"] == "ActionRefused"]

    # Back, the operator acts on the annotation again: refused, naming the first decision.
    await eventually(refused, 30, "the replay refused")
    assert "step 0 was decided before (approved by annotation on AgentRun" in refused()[0]
    await eventually(lambda: "agentrun.dev/approve" not in (
        (kube.agentrun("migrate") or {})["metadata"].get("annotations") or {}), 30, "consumed")
    waiting = await store.get_run(run.id)
    assert waiting.status == "waiting_approval" and waiting.pending_call == second
    assert await store.get_approval(run.id, 0, 1, "before_call") is None


async def test_an_operator_killed_after_an_annotations_retry_never_retries_again(
    kube: Kube, operator: Callable[..., OperatorProc], store: Store,
) -> None:
    """The retry annotation is consumed before the retry, as approve/reject are: an operator
    killed after retrying, before kopf's removal, retried once back whatever the run had done
    meanwhile, here failed again, with nobody asking (found on 2026-12-06)."""
    first = operator(faults="operator_after_annotation_retry@1")
    kube.apply_agent(agent_manifest())
    kube.apply_agentrun(agentrun_manifest("flaky"))
    rid = await eventually(
        lambda: ((kube.agentrun("flaky") or {}).get("status") or {}).get("runId"), 30,
        "flaky to get a run")
    held = store.with_lease_ttl(60)

    async def fail_it() -> None:
        ((_, lease),) = (await held.claim("default", "w", 1)).claimed
        await store.finish(lease, "failed", error="the tool was broken")

    await fail_it()
    kube.annotate("flaky", {"agentrun.dev/retry": "tool fixed"})
    await asyncio.to_thread(first.popen.wait, 30)
    assert first.popen.returncode == -9, first.output()[-3000:]
    retried = await store.get_run(rid)
    assert (retried.status, retried.retries) == ("pending", 1)
    await fail_it()  # it fails again before anyone looks
    operator()
    await eventually(lambda: ((kube.agentrun("flaky") or {}).get("status") or {}).get("phase")
                     == "failed", 30, "the second failure mirrored")
    assert "agentrun.dev/retry" not in (
        (kube.agentrun("flaky") or {})["metadata"].get("annotations") or {})
    again = await store.get_run(rid)
    assert (again.status, again.retries) == ("failed", 1)


async def test_an_approval_never_decides_for_an_agentrun_created_again_after_it(
    kube: Kube, users: Callable[[str, str], User], operator: Callable[..., OperatorProc],
    store: Store,
) -> None:
    """alice approves migrate's wait; before the operator acts on it (it is down, or the
    database is), migrate is deleted and created again under its name, and its new run reaches
    the same wait. The approval decided that run, which alice never saw, in her name (found by
    a review on 2026-12-07). It is refused: the AgentRun is younger than the approval."""
    alice = users("alice", "approver")
    first = operator()
    kube.apply_agent(agent_manifest(requireApproval=True))
    old = await waiting_run(kube, store, "migrate")
    first.stop()
    policy_active(kube, alice)
    code, out = alice.create_approval(approval("migrate", 0, "approve", alice.username,
                                               name="alice-0"))
    assert code == 201, out
    made = datetime.fromisoformat(
        kube.get(f"{AGENTRUNS}/namespaces/{kube.namespace}/{APPROVALS}/alice-0")
        ["metadata"]["creationTimestamp"])
    assert kube.delete_agentrun("migrate") == 200
    await eventually(lambda: kube.agentrun("migrate") is None, 15, "migrate deleted")
    # Timestamps are whole seconds: the new object is made in a later one than the approval.
    await eventually(lambda: datetime.now(UTC).replace(microsecond=0) > made, 5, "a new second")
    obj = kube.apply_agentrun(agentrun_manifest("migrate"))
    # Its run, waiting on the same step, as the operator would make it (it is down).
    new, _ = await store.create_run(
        "again", AGENT.model_copy(update={"require_approval": True}),
        k8s=K8sRef(kube.namespace, "migrate", obj["metadata"]["uid"]))
    claimed = (await store.with_lease_ttl(60).claim("default", "w", limit=10)).claimed
    [lease] = [lease for _, lease in claimed if lease.run_id == new.id]
    await store.wait_for_approval(lease, "approval required before drop_table (step 0)", {
        "seq": 0, "call_index": 0, "tool": "drop_table", "input": {"table": "orders"},
        "stage": "before_call"})
    operator()
    refused = await settled(kube, "alice-0")
    assert refused["phase"] == "Refused", refused
    assert "deleted and created again" in refused["message"], refused
    now = await store.get_run(new.id)
    assert (now.status, now.pending_call is not None) == ("waiting_approval", True)
    assert old.id != new.id


async def test_an_approval_names_an_agentrun_by_an_object_name_and_a_pruned_run_says_so(
    kube: Kube, users: Callable[[str, str], User], operator: Callable[..., OperatorProc],
    store: Store,
) -> None:
    """spec.agentRun went into the operator's GET path as it was: "." read the namespace's list
    (a traceback, no status), ".." and "a/b" a 403 retried for ever as an outage, and
    "migrate/status" decided migrate through its status subresource. The API server now refuses
    anything but an object name. And an approval of an AgentRun whose run was pruned said the
    operator had not accepted it yet (found by a review on 2026-12-07)."""
    alice = users("alice", "approver")
    operator()
    kube.apply_agent(agent_manifest(requireApproval=True))
    run = await waiting_run(kube, store, "migrate")
    policy_active(kube, alice)
    for target in (".", "..", "migrate/x", "migrate/status", "Migrate"):
        code, out = alice.create_approval(approval(target, 0, "approve", alice.username,
                                                   name="odd", call=0))
        assert code == 422 and "spec.agentRun" in str(out), (target, code, out)
    assert (await store.get_run(run.id)).status == "waiting_approval"
    await store.cancel(run.id, "done with it")
    await eventually(lambda: ((kube.agentrun("migrate") or {}).get("status") or {}).get("phase")
                     == "cancelled", 15, "the cancel mirrored")
    assert (await store.prune_batch(datetime.now(UTC) + timedelta(hours=1), ["cancelled"],
                                    10)).runs == 1
    code, out = alice.create_approval(approval("migrate", 0, "approve", alice.username,
                                               name="late", call=0))
    assert code == 201, out
    refused = await settled(kube, "late")
    assert refused["phase"] == "Refused", refused
    assert refused["message"] == (f"run {run.id} was pruned from the store; there is nothing to "
                                  "act on"), refused
