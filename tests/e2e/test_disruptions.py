"""Deploys, evictions and kills on a real Kubernetes node cost nothing: the end-to-end tier.

agentrun is installed as README.md says (image built from the Dockerfile, ``helm install`` of
charts/agentrun, Secrets for the database and the API key), AgentRuns are ``kubectl apply``-ed,
and each scenario breaks something while runs are mid-flight. Every scenario then asserts that
every run succeeded, its steps are contiguous (none lost), and no effect was repeated (the
non-idempotent ``send_email`` wrote exactly one effect per call, keyed by its idempotency key),
and records how long each run took from the disruption to its next committed step.

Run it on its own (root, ~4 minutes of image build on a fresh machine):

    .venv/bin/pytest -m e2e -n 0 tests/e2e

Figures go to ``$AGENTRUN_E2E_FIGURES`` (default e2e-figures.json in the pytest temp dir);
``python -m benchmarks.e2e_report FILE`` turns them into docs/e2e.md.
"""

from __future__ import annotations

import asyncio
import os
import socket
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml
from benchmarks.own_pg import OwnPostgres

from agentrun.migrations import migrate
from tests.e2e.nodekit import (
    NAMESPACE,
    NODE_IP,
    NODE_NAME,
    RELEASE,
    TOOLS_IMAGE,
    TOOLS_PATH,
    Figures,
    Node,
    Process,
    check_host,
    start_model_server,
    wait_for,
)
from tests.helmtools import helm, kubectl
from tests.proxykit import TcpProxy

# Building the image (~2.5 min on a fresh machine) is part of the first test's setup.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

TURNS = [
    ("look", {"what": "orders"}),
    ("set_flag", {"value": "a"}),
    ("send_email", {"to": "ops@example.com"}),
    ("look", {"what": "logs"}),
    ("send_email", {"to": "cto@example.com"}),
    ("set_flag", {"value": "b"}),
    ("drop_table", {"table": "orders_old"}),
    ("look", {"what": "the result"}),
]
STEPS = 2 * len(TURNS) + 1  # a model turn and a tool result per call, then the answer
EMAILS = sum(1 for name, _ in TURNS if name == "send_email")
DROPS = sum(1 for name, _ in TURNS if name == "drop_table")
TURN_DELAY_MS = 700  # keeps runs mid-flight long enough to break things under them
OOM_MB = 400  # what the hog tool holds; the "oom" pool's workers may use 200Mi
LEASE_TTL = 5


def scenario() -> dict[str, Any]:
    turns: list[dict[str, Any]] = [
        {"content": [{"text": f"Step {i}."}, {"tool_use": {"name": name, "input": args}}]}
        for i, (name, args) in enumerate(TURNS)
    ]
    turns.append({"content": [{"text": "All done: every step once."}]})
    # The same steps, slower: a run that outlives its neighbours (the scale-down scenario).
    slow = [{**t, "delay_ms": 4 * TURN_DELAY_MS} for t in turns]
    # Slower still: a run that outlives a whole rolling upgrade (new pods started and Ready,
    # then the old ones drained), so the old pods are replaced while they hold it.
    crawl = [{**t, "delay_ms": 8 * TURN_DELAY_MS} for t in turns]
    def hog(every_attempt: bool) -> list[dict[str, Any]]:
        return [
            {"content": [{"text": "Looking first."},
                         {"tool_use": {"name": "look", "input": {"what": "the heap"}}}]},
            {"content": [{"text": "Loading the whole table into memory."},
                         {"tool_use": {"name": "hog", "input": {
                             "megabytes": OOM_MB, "every_attempt": every_attempt}}}]},
            {"content": [{"text": "Checking."},
                         {"tool_use": {"name": "look", "input": {"what": "the result"}}}]},
            {"content": [{"text": "Done."}]},
        ]

    return {"name": "e2e", "delay_ms": TURN_DELAY_MS,
            "scripts": [{"name": "crawl", "match": "CRAWL", "turns": crawl},
                        {"name": "slow", "match": "SLOW", "turns": slow},
                        {"name": "oom-once", "match": "OOM-ONCE", "turns": hog(False)},
                        {"name": "oom-always", "match": "OOM-ALWAYS", "turns": hog(True)},
                        {"name": "ledger", "turns": turns}]}


def spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    v = sorted(values)
    return {"min": v[0], "median": v[len(v) // 2], "max": v[-1]}


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class Installed:
    node: Node
    pg: OwnPostgres  # the tier's own server, which the restart scenario restarts
    db: str  # the test's URL of the run store (127.0.0.1)
    proxy: TcpProxy  # what pods use to reach it (on the bridge), which the cut scenario cuts
    model: Process
    figures: Figures
    #: Worker pod -> container restarts, read right after `helm install --wait`.
    install_restarts: dict[str, int] = field(default_factory=dict)

    # -- the store, read directly -------------------------------------------------------------

    def query(self, q: str, *args: Any) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.db, autocommit=True) as conn:
            return list(conn.execute(q, args).fetchall())

    def runs(self, prefix: str) -> dict[str, dict[str, Any]]:
        rows = self.query(
            "SELECT k8s_name, id, status, attempt, next_seq, lease_owner, error FROM agent_run "
            "WHERE k8s_namespace = %s AND k8s_name LIKE %s", NAMESPACE, f"{prefix}-%")
        return {r[0]: {"id": r[1], "status": r[2], "attempt": r[3], "step": r[4],
                       "owner": r[5], "error": r[6]} for r in rows}

    def now(self) -> Any:
        return self.query("SELECT clock_timestamp()")[0][0]

    # -- the cluster --------------------------------------------------------------------------

    def apply_runs(self, prefix: str, n: int, pool: str = "default",
                   tasks: list[str] | None = None) -> None:
        agent = {"model": "claude-sonnet-4-5", "maxTokens": 1024, "pool": pool,
                 "tools": sorted({name for name, _ in TURNS})}
        docs = [{"apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
                 "metadata": {"name": f"{prefix}-{i}", "namespace": NAMESPACE},
                 "spec": {"agent": agent, "maxAttempts": 8,
                          "task": (tasks or [])[i] if tasks else
                          f"{prefix} run {i}: do the seven steps"}} for i in range(n)]
        self.node.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(docs))

    def worker_pods(self, pool: str = "default") -> list[dict[str, Any]]:
        pods = self.node.get("pods", "-n", NAMESPACE, "-l",
                             f"app.kubernetes.io/component=worker,agentrun.dev/pool={pool}")
        return [p for p in pods["items"] if not p["metadata"].get("deletionTimestamp")]

    def ready_workers(self, pool: str = "default") -> list[str]:
        return [p["metadata"]["name"] for p in self.worker_pods(pool)
                if any(c["type"] == "Ready" and c["status"] == "True"
                       for c in p.get("status", {}).get("conditions", []))]

    def holder_pod(self, prefix: str) -> str:
        """A worker pod holding runs of ``prefix`` (worker ids start with the pod's name)."""
        owners = [r["owner"] for r in self.runs(prefix).values() if r["owner"]]
        for pod in self.ready_workers():
            if any(o.startswith(pod + "-") for o in owners):
                return pod
        raise AssertionError(f"no ready worker pod holds a run of {prefix}: {owners}")

    # -- one scenario -------------------------------------------------------------------------

    def scenario(self, name: str, disrupt: Callable[[], dict[str, Any] | None], *,
                 runs: int = 4, within: float = 240, pace: str = "") -> dict[str, Any]:
        """``pace``: "SLOW" or "CRAWL" for runs that outlive a disruption that takes a while
        to reach the worker (a pod's termination, a rollout)."""
        wait_for(lambda: len(self.ready_workers()) >= 2, 180, "two ready workers")
        self.apply_runs(name, runs, tasks=[f"{name} run {i}: {pace}" for i in range(runs)]
                        if pace else None)
        # Mid-flight: every run has committed a few steps and is held by a worker.
        wait_for(lambda: len(r := self.runs(name)) == runs and all(
            x["step"] >= 3 and x["status"] == "running" for x in r.values()), 120,
            f"{runs} runs of {name} mid-flight")
        held = {n: r["owner"] for n, r in self.runs(name).items()}
        t0 = self.now()
        extra = disrupt() or {}
        pods = [extra["pod"]] if "pod" in extra else extra.get("pods", [])
        affected = sorted(n for n, owner in held.items() if owner and
                          any(owner.startswith(f"{pod}-") for pod in pods))
        decided = self.finish(name, within)
        result = {**self.check(name, runs), "decisions": decided}
        # A run's next step after t0. For a run the disrupted pod held, a step its dying holder
        # still committed between t0 and the signal landing (the disruption takes a moment to
        # reach the process) is not the hand-over: count the first step of another worker.
        steps_after = self.query(
            "SELECT r.k8s_name, s.worker, EXTRACT(EPOCH FROM s.created_at - %s) FROM agent_run r "
            "JOIN agent_step s ON s.run_id = r.id WHERE r.k8s_namespace = %s "
            "AND r.k8s_name LIKE %s AND s.created_at > %s",
            t0, NAMESPACE, f"{name}-%", t0)
        after: dict[str, float] = {}
        for n, worker, t in steps_after:
            if n in affected and worker == held.get(n):
                continue
            after[n] = min(after.get(n, float(t)), float(t))
        figures = {**result, **extra, "runs": runs, "affected": affected,
                   "next_step_after_disruption_s": spread(list(after.values())),
                   # The runs the disrupted pod held: their hand-over (or lease expiry).
                   "affected_next_step_s": spread([after[n] for n in affected]),
                   **self.handovers(name, t0),
                   # Which workers wrote each run's steps, in order (a change of hands shows).
                   "writers": self.writers(name)}
        self.figures.record(name, **figures)
        return figures

    def handovers(self, prefix: str, since: Any) -> dict[str, Any]:
        """The store's record of every change of hands since ``since`` (run_handover,
        migration 0009), hand-overs apart from lease expiries: how many, which runs, the time
        from ``since`` to the claim that took each over, and from the release (or the lease's
        end) to that claim."""
        rows = self.query(
            "SELECT r.k8s_name, h.kind, EXTRACT(EPOCH FROM h.claimed_at - %s), "
            "EXTRACT(EPOCH FROM h.claimed_at - h.lost_at) FROM run_handover h "
            "JOIN agent_run r ON r.id = h.run_id WHERE r.k8s_namespace = %s "
            "AND r.k8s_name LIKE %s AND h.claimed_at > %s ORDER BY h.claimed_at",
            since, NAMESPACE, f"{prefix}-%", since)
        out: dict[str, Any] = {}
        for kind in ("handed_over", "lease_expired"):
            mine = [r for r in rows if r[1] == kind]
            out[kind] = {"count": len(mine), "runs": sorted({r[0] for r in mine}),
                         "claimed_after_s": spread([float(r[2]) for r in mine]),
                         "gap_s": spread([float(r[3]) for r in mine if r[3] is not None])}
        return out

    def writers(self, prefix: str) -> dict[str, list[str]]:
        """Each run's step writers in order, consecutive repeats collapsed."""
        out: dict[str, list[str]] = {}
        for name, worker in self.query(
                "SELECT r.k8s_name, s.worker FROM agent_step s JOIN agent_run r ON r.id = s.run_id "
                "WHERE r.k8s_namespace = %s AND r.k8s_name LIKE %s ORDER BY r.k8s_name, s.seq",
                NAMESPACE, f"{prefix}-%"):
            seen = out.setdefault(name, [])
            if not seen or seen[-1] != worker:
                seen.append(worker)
        return out

    def events(self, prefix: str, reason: str) -> dict[str, list[dict[str, Any]]]:
        """The operator's Events of ``reason`` on the AgentRuns of ``prefix``, by object."""
        items = self.node.get("events", "-n", NAMESPACE, "--field-selector",
                              f"reason={reason}")["items"]
        out: dict[str, list[dict[str, Any]]] = {}
        for e in items:
            name = e["involvedObject"]["name"]
            if e["involvedObject"].get("kind") == "AgentRun" and name.startswith(f"{prefix}-"):
                out.setdefault(name, []).append(e)
        return out

    def assert_events_tell_hand_overs_from_expiries(self, prefix: str,
                                                    figures: dict[str, Any]) -> None:
        """Each run the store says was handed over has a Normal HandedOver Event; each run
        whose lease expired a Warning LeaseExpired one; a run only handed over has no Warning
        (issue 19: 11 of 14 hand-overs were Warnings)."""
        handed = set(figures["handed_over"]["runs"])
        expired = set(figures["lease_expired"]["runs"])
        wait_for(lambda: handed <= set(self.events(prefix, "HandedOver"))
                 and expired <= set(self.events(prefix, "LeaseExpired")), 60,
                 f"the HandedOver and LeaseExpired Events of {prefix}")
        for name, events in self.events(prefix, "HandedOver").items():
            assert {e["type"] for e in events} == {"Normal"}, (name, events)
        warned = set(self.events(prefix, "LeaseExpired"))
        assert warned == expired, (warned, figures)

    def finish(self, name: str, within: float) -> list[str]:
        """Wait for every run of ``name`` to end. A run killed inside its irreversible call waits
        for a human (its outcome is unknown): the test decides as the on-call would, from the
        target system (the ledger): reject a retry if the effect happened, approve if not."""
        decided: list[str] = []

        def settled() -> bool:
            runs = self.runs(name)
            for run_name, r in runs.items():
                if r["status"] != "waiting_approval":
                    continue
                done = self.query("SELECT count(*) FROM ledger_effects WHERE run_id = %s AND "
                                  "tool = 'drop_table'", str(r["id"]))[0][0]
                pending = (self.node.get("agentrun", run_name, "-n", NAMESPACE).get("status")
                           or {}).get("pendingApproval")
                if not pending:
                    return False  # not mirrored yet
                verdict = "reject" if done else "approve"
                self.node.kubectl("annotate", "agentrun", run_name, "-n", NAMESPACE,
                                  f"agentrun.dev/{verdict}={pending['decide']}")
                decided.append(f"{run_name}:{verdict}")
                return False
            return all(r["status"] in ("succeeded", "failed", "cancelled", "dead_letter")
                       for r in runs.values())

        wait_for(settled, within, f"every run of {name} to finish", every=0.5)
        return decided

    def check(self, name: str, runs: int) -> dict[str, Any]:
        got = self.runs(name)
        assert {r["status"] for r in got.values()} == {"succeeded"}, got
        for run_name, r in got.items():
            seqs = [s for (s,) in self.query(
                "SELECT seq FROM agent_step WHERE run_id = %s ORDER BY seq", r["id"])]
            assert seqs == list(range(STEPS)), (run_name, seqs)  # contiguous, none lost
            effects = self.query(
                "SELECT count(*), count(DISTINCT key) FROM ledger_effects "
                "WHERE run_id = %s AND tool = 'send_email'", str(r["id"]))[0]
            assert effects == (EMAILS, EMAILS), (run_name, effects)  # each email once
            drops = self.query("SELECT count(*) FROM ledger_effects WHERE run_id = %s "
                               "AND tool = 'drop_table'", str(r["id"]))[0][0]
            assert drops == DROPS, (run_name, drops)  # the irreversible call, exactly once
            flag = self.query("SELECT value FROM ledger_state WHERE run_id = %s "
                              "AND tool = 'set_flag'", str(r["id"]))
            assert flag == [("b",)], (run_name, flag)
        attempts = self.query(
            "SELECT count(*) FROM ledger_attempts a JOIN agent_run r ON a.run_id = r.id::text "
            "WHERE r.k8s_name LIKE %s AND a.tool = 'send_email'", f"{name}-%")[0][0]
        return {"steps": runs * STEPS, "emails": runs * EMAILS, "email_calls": attempts,
                "irreversible": runs * DROPS,
                "duplicates": 0, "lost": 0,
                "attempts": sorted(r["attempt"] for r in got.values())}


def chart_values(model_port: str) -> dict[str, Any]:
    """The chart's values: the README's install plus the test's image, addresses and pools."""
    repo, tag = TOOLS_IMAGE.rsplit(":", 1)
    return {
        "image": {"repository": repo, "tag": tag, "pullPolicy": "Never"},
        "database": {"existingSecret": "agentrun-db"},
        # The node has no cluster DNS (shared/k8s/README.md), so the test pod that asks the
        # operator's -health Service by name cannot resolve it; the operator's readiness is
        # checked by the kubelet's probe and from the host instead (test_helm_test_...).
        "tests": {"operator": {"enabled": False}},
        "anthropic": {"existingSecret": "anthropic",
                      "baseUrl": f"http://{NODE_IP}:{model_port}"},
        "workers": {
            "poolDefaults": {
                "tools": [TOOLS_PATH],
                "autoscaling": {"enabled": False},
                "replicas": 2,
                "leaseTtlSeconds": LEASE_TTL,
                "drainGraceSeconds": 20,
            },
            "pools": [
                {"name": "default"},
                # Scaled by the operator: one run per worker, down 3 s after demand drops.
                {"name": "scaled", "autoscaling": {
                    "enabled": True, "runsPerWorker": 1, "minReplicas": 0, "maxReplicas": 3,
                    "scaleDownDelaySeconds": 3}},
                # A memory limit the hog tool passes: the kernel OOM-kills the worker.
                {"name": "oom", "resources": {
                    "requests": {"cpu": "50m", "memory": "128Mi"},
                    "limits": {"cpu": "1", "memory": "200Mi"}}},
            ],
        },
    }


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    scripts = check_host()
    home = tmp_path_factory.mktemp("node")
    node = Node(home, scripts, kubectl(), helm())
    figures = Figures(Path(os.environ.get("AGENTRUN_E2E_FIGURES")
                           or tmp_path_factory.getbasetemp() / "e2e-figures.json"))
    # A PostgreSQL of the tier's own, never the machine's shared one: the restart scenario
    # restarts it. Pods reach it through the proxy on the bridge (which the cut scenario cuts).
    pg = OwnPostgres(settings={"max_connections": "300"})
    proxy: TcpProxy | None = None
    model: Process | None = None
    try:
        node.up()
        node.build_images()
        pg.start()
        db = pg.url("postgres")

        async def _migrate() -> None:
            aconn = await psycopg.AsyncConnection.connect(db, autocommit=True)
            try:
                await migrate(aconn)
            finally:
                await aconn.close()

        asyncio.run(_migrate())
        with psycopg.connect(db, autocommit=True) as conn:
            ledger = (Path(__file__).parents[1] / "tool_modules" / "ledger_tools.py").read_text()
            schema = ledger.split('SCHEMA = """', 1)[1].split('"""', 1)[0]
            conn.execute(schema)  # type: ignore[call-overload]
        proxy = TcpProxy(("127.0.0.1", pg.port), host=NODE_IP).start()
        model = start_model_server(scenario(), free_port(NODE_IP), home)
        model_port = model.popen.args[-1]  # type: ignore[index]
        pod_db = f"postgresql://postgres@{NODE_IP}:{proxy.port}/postgres"
        node.kubectl("create", "namespace", NAMESPACE)
        node.kubectl("-n", NAMESPACE, "create", "secret", "generic", "agentrun-db",
                     f"--from-literal=url={pod_db}")
        node.kubectl("-n", NAMESPACE, "create", "secret", "generic", "anthropic",
                     "--from-literal=api-key=sk-e2e")
        values = home / "e2e-values.yaml"
        values.write_text(yaml.safe_dump(chart_values(model_port)))
        node.helm("install", RELEASE, "charts/agentrun", "-n", NAMESPACE, "-f", str(values),
                  "--wait", "--timeout", "5m")
        inst = Installed(node, pg, db, proxy, model, figures)
        wait_for(lambda: len(inst.ready_workers()) == 2, 180, "two ready workers")
        # Before any scenario breaks anything: what the fresh install's pods went through.
        inst.install_restarts = {
            p["metadata"]["name"]: sum(c.get("restartCount", 0)
                                       for c in p["status"].get("containerStatuses", []))
            for p in node.get("pods", "-n", NAMESPACE, "-l",
                              "app.kubernetes.io/component=worker")["items"]}
        yield inst
    finally:
        if model is not None:
            model.stop()
        if proxy is not None:
            proxy.stop()
        node.down()
        pg.close()


def test_a_fresh_install_starts_its_workers_without_a_restart(installed: Installed) -> None:
    # Issue 19: a fresh install's worker restarted once with "the database schema is at
    # version 0" (it started before the operator had migrated).
    assert installed.install_restarts, "no worker pods after install"
    assert set(installed.install_restarts.values()) == {0}, installed.install_restarts


def test_helm_test_passes_on_the_installed_release(installed: Installed) -> None:
    out = installed.node.helm("test", RELEASE, "-n", NAMESPACE, "--timeout", "3m")
    assert "Phase:          Succeeded" in out.stdout, out.stdout
    # The operator is Ready by the kubelet's readinessProbe on its /readyz (API server and
    # database reached), and its /readyz says so on the pod's bridge address.
    (pod,) = installed.node.get("pods", "-n", NAMESPACE, "-l",
                                "app.kubernetes.io/component=operator")["items"]
    ready = {c["type"]: c["status"] for c in pod["status"]["conditions"]}
    assert ready["Ready"] == "True", pod["status"]
    probe = pod["spec"]["containers"][0]["readinessProbe"]["httpGet"]
    assert probe["path"] == "/readyz", probe
    port = next(p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]
                if p["name"] == probe["port"] or p["containerPort"] == probe["port"])
    url = f"http://{pod['status']['podIP']}:{port}/readyz"
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200, r.read()


def test_a_worker_killed_with_sigkill_loses_nothing(installed: Installed) -> None:
    def kill() -> dict[str, Any]:
        pod = installed.holder_pod("sigkill")
        status = installed.node.get("pod", pod, "-n", NAMESPACE)["status"]
        cid = status["containerStatuses"][0]["containerID"].split("//", 1)[1]
        # A real SIGKILL of the container's process (a force delete still runs preStop).
        installed.node.ctr("tasks", "kill", "--signal", "SIGKILL", cid)
        return {"pod": pod}

    figures = installed.scenario("sigkill", kill)
    # The killed worker's runs waited for their lease (LEASE_TTL), were claimed again, and
    # that claim counted an attempt.
    assert figures["affected"], figures
    assert figures["attempts"].count(2) == len(figures["affected"]), figures
    assert figures["affected_next_step_s"]["min"] >= LEASE_TTL * 0.5, figures
    # The store and the Events say so: lease expiries, no hand-over.
    assert figures["lease_expired"]["runs"] == figures["affected"], figures
    assert figures["handed_over"]["count"] == 0, figures
    installed.assert_events_tell_hand_overs_from_expiries("sigkill", figures)


def test_a_force_deleted_worker_pod_loses_nothing(installed: Installed) -> None:
    def force_delete() -> dict[str, Any]:
        pod = installed.holder_pod("force")
        # What an operator types for a stuck pod: the object goes at once, the ReplicaSet makes
        # a replacement, and the kubelet still stops the old container (its preStop runs on a
        # real kubelet, so the runs may be handed over or may wait for their lease).
        installed.node.kubectl("delete", "pod", pod, "-n", NAMESPACE, "--grace-period=0",
                               "--force")
        return {"pod": pod}

    figures = installed.scenario("force", force_delete)
    assert figures["affected"], figures
    # Whatever the kubelet did, a run is never claimed more than once for it.
    assert max(figures["attempts"]) <= 2, figures
    # Each held run changed hands once, one way or the other, and its Event says which.
    assert sorted(figures["handed_over"]["runs"] + figures["lease_expired"]["runs"]) == (
        figures["affected"]), figures
    installed.assert_events_tell_hand_overs_from_expiries("force", figures)


def test_a_graceful_pod_delete_hands_the_runs_over_at_once(installed: Installed) -> None:
    def delete() -> dict[str, Any]:
        pod = installed.holder_pod("graceful")
        installed.node.kubectl("delete", "pod", pod, "-n", NAMESPACE, "--wait=false")
        return {"pod": pod}

    # Slow runs (2.8 s a turn): the kubelet takes seconds to run the preStop hook, and a run at
    # the normal pace finished on the deleted pod before it drained (the store showed no
    # hand-over: every step by one worker).
    figures = installed.scenario("graceful", delete, pace="SLOW")
    # preStop drain + SIGTERM: runs are released, not expired; the attempt is not counted, and
    # the next worker claims each at once, well before a lease could have expired.
    assert figures["affected"], figures
    assert figures["attempts"] == [1, 1, 1, 1], figures
    assert figures["handed_over"]["runs"] == figures["affected"], figures
    assert figures["handed_over"]["gap_s"]["max"] < LEASE_TTL, figures
    assert figures["lease_expired"]["count"] == 0, figures
    installed.assert_events_tell_hand_overs_from_expiries("graceful", figures)


def test_a_rolling_helm_upgrade_costs_nothing(installed: Installed) -> None:
    def upgrade() -> dict[str, Any]:
        t0 = installed.now()
        old = installed.ready_workers()
        installed.node.helm(
            "upgrade", RELEASE, "charts/agentrun", "-n", NAMESPACE, "--reuse-values",
            # --set-string: a hex id of digits only would be a number, which the schema refuses.
            "--set-string", f"workers.poolDefaults.podAnnotations.e2e/rollout={uuid.uuid4().hex}")
        installed.node.kubectl("rollout", "status", "-n", NAMESPACE, "--timeout=180s",
                               f"deployment/{RELEASE}-agentrun-worker-default", timeout=200)
        return {"pods": old, "rollout_s": (installed.now() - t0).total_seconds()}

    # Crawling runs (5.6 s a turn): the old pods are replaced while they still hold them (at
    # 2.8 s a turn the runs ended on the old pods before the rollout reached them).
    figures = installed.scenario("upgrade", upgrade, pace="CRAWL")
    assert figures["affected"], figures
    assert figures["handed_over"]["count"] >= 1, figures
    # Every old pod drained and handed its runs over: no attempt counted (a run whose lease
    # had to expire would have been claimed again, which counts one).
    assert figures["attempts"] == [1, 1, 1, 1], figures
    assert figures["lease_expired"]["count"] == 0, figures
    assert set(figures["affected"]) <= set(figures["handed_over"]["runs"]), figures
    installed.assert_events_tell_hand_overs_from_expiries("upgrade", figures)


def test_the_operator_pod_killed_mid_run_costs_nothing(installed: Installed) -> None:
    def kill_operator() -> dict[str, Any]:
        pods = installed.node.get("pods", "-n", NAMESPACE, "-l",
                                  "app.kubernetes.io/component=operator")["items"]
        for p in pods:
            installed.node.kubectl("delete", "pod", p["metadata"]["name"], "-n", NAMESPACE,
                                   "--grace-period=0", "--force")
        return {}

    figures = installed.scenario("operator", kill_operator)
    assert figures["handed_over"]["count"] == figures["lease_expired"]["count"] == 0, figures
    # The new operator mirrors the end of every run.
    for i in range(4):
        wait_for(lambda n=i: installed.node.get("agentrun", f"operator-{n}", "-n", NAMESPACE)
                 .get("status", {}).get("phase") == "succeeded", 60, "the status mirrored")


def database_outage_seen(installed: Installed, prefix: str) -> Callable[[], bool]:
    """True once the operator, which reaches PostgreSQL through the same proxy as the workers,
    marks one of the runs DatabaseAvailable=False: the outage seen from inside the cluster."""
    def seen() -> bool:
        for i in range(4):
            conds = installed.node.get("agentrun", f"{prefix}-{i}", "-n", NAMESPACE).get(
                "status", {}).get("conditions", [])
            if any(c["type"] == "DatabaseAvailable" and c["status"] == "False" for c in conds):
                return True
        return False
    return seen


def test_postgresql_restarted_mid_run_costs_nothing(installed: Installed) -> None:
    def restart() -> dict[str, Any]:
        # An immediate shutdown is a crash to every client (no goodbye, crash recovery at the
        # next start); the server stays down until the cluster has seen it gone.
        installed.pg.stop(mode="immediate")
        wait_for(database_outage_seen(installed, "pgrestart"), 90,
                 "the outage seen in the cluster")
        installed.pg.start()
        return {"postgres_restarts": installed.pg.restarts}

    figures = installed.scenario("pgrestart", restart)
    assert figures["postgres_restarts"] >= 1, figures


def test_postgresql_unreachable_mid_run_costs_nothing(installed: Installed) -> None:
    def outage() -> dict[str, Any]:
        installed.proxy.cut()  # every pod's connection dies; new ones are refused
        wait_for(database_outage_seen(installed, "pgcut"), 60, "the outage seen in the cluster")
        installed.proxy.restore()
        return {}

    installed.scenario("pgcut", outage)


def test_a_node_drain_respects_the_disruption_budget(installed: Installed) -> None:
    def drain() -> dict[str, Any]:
        # The PDB lets one worker go at a time; on one node the evicted pod cannot come back
        # until uncordon, so the drain stops at the budget (it times out) and we uncordon.
        proc = installed.node.kubectl(
            "drain", NODE_NAME, "--ignore-daemonsets", "--delete-emptydir-data",
            f"--pod-selector=app.kubernetes.io/instance={RELEASE},"
            "app.kubernetes.io/component=worker,agentrun.dev/pool=default", "--timeout=20s",
            check=False, timeout=90)
        # kubectl prints "pod/NAME evicted" for each pod the Eviction API let go.
        evicted = [ln.split()[0].split("/", 1)[1] for ln in proc.stdout.splitlines()
                   if ln.startswith("pod/") and ln.endswith(" evicted")]
        installed.node.kubectl("uncordon", NODE_NAME)
        return {"evicted": len(evicted), "pods": evicted, "drain_exit": proc.returncode}

    figures = installed.scenario("drain", drain)
    assert figures["evicted"] == 1, figures  # the budget held the second worker
    # The evicted pod drained (preStop) and handed its runs over: no attempt counted.
    assert figures["attempts"] == [1, 1, 1, 1], figures
    assert figures["lease_expired"]["count"] == 0, figures
    assert set(figures["affected"]) <= set(figures["handed_over"]["runs"]), figures
    installed.assert_events_tell_hand_overs_from_expiries("drain", figures)


def test_a_scale_down_removes_idle_pods_never_a_busy_one(installed: Installed) -> None:
    # Three runs in the autoscaled pool (one per worker): three pods. Two runs end; the demand
    # drops to one; after the delay the operator scales to one and the real ReplicaSet
    # controller picks the pods to delete by their pod-deletion-cost: the idle ones. The slow
    # run keeps its worker to the end (every step by one worker, attempt 1).
    node = installed.node
    workers = f"{RELEASE}-agentrun-worker-scaled"

    def replicas() -> int:
        return int(node.get("deployment", workers, "-n", NAMESPACE)["spec"].get("replicas") or 0)

    installed.apply_runs("scaled", 3, pool="scaled", tasks=[
        "scaled run 0: SLOW, do the seven steps", "scaled run 1", "scaled run 2"])
    wait_for(lambda: replicas() == 3, 60, "three workers for three runs")
    wait_for(lambda: all(r["status"] in ("succeeded",) for n, r in installed.runs("scaled")
                         .items() if n != "scaled-0"), 180, "the two short runs to finish")
    assert installed.runs("scaled")["scaled-0"]["status"] == "running"
    wait_for(lambda: replicas() == 1, 60, "the scale-down to one worker")
    wait_for(lambda: installed.runs("scaled")["scaled-0"]["status"] == "succeeded", 240,
             "the slow run to finish")
    slow = installed.runs("scaled")["scaled-0"]
    writers = installed.query("SELECT DISTINCT worker FROM agent_step WHERE run_id = %s",
                              slow["id"])
    assert len(writers) == 1 and slow["attempt"] == 1, (writers, slow)
    installed.check("scaled", 3)
    installed.figures.record("scale-down", runs=3, steps=3 * STEPS, duplicates=0, lost=0,
                             attempts=sorted(r["attempt"] for r in
                                             installed.runs("scaled").values()),
                             slow_run_writers=len(writers))


def test_an_oom_kill_resumes_the_run_and_a_run_that_always_ooms_is_dead_lettered_alone(
    installed: Installed,
) -> None:
    # A tool holds more memory than the pool's limit: the kernel kills the worker container
    # (OOMKilled), its runs' leases expire and other workers (or the restarted container) take
    # them. A call that OOMs once resumes and succeeds; one that OOMs on every attempt is
    # dead-lettered with a message saying why, and its neighbours on the same pods are not.
    node = installed.node
    agent = {"model": "claude-sonnet-4-5", "maxTokens": 1024, "pool": "oom",
             "tools": sorted({name for name, _ in TURNS} | {"hog"})}
    tasks = {"oom-0": ("OOM-ONCE: load the table", 8), "oom-1": ("OOM-ALWAYS: load it all", 2),
             "oom-2": ("oom neighbour 2: do the seven steps", 8),
             "oom-3": ("oom neighbour 3: do the seven steps", 8)}
    docs = [{"apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
             "metadata": {"name": name, "namespace": NAMESPACE},
             "spec": {"agent": agent, "task": task, "maxAttempts": attempts}}
            for name, (task, attempts) in tasks.items()]
    t0 = installed.now()
    node.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(docs))
    wait_for(lambda: len(r := installed.runs("oom")) == 4 and all(
        x["status"] in ("succeeded", "failed", "cancelled", "dead_letter") for x in r.values()),
        300, "every oom run to finish")
    runs = installed.runs("oom")
    assert runs["oom-0"]["status"] == "succeeded" and runs["oom-0"]["attempt"] >= 2, runs
    assert runs["oom-1"]["status"] == "dead_letter", runs
    # The operator adds why when it handles the dead letter (its Event), moments after.
    try:
        wait_for(lambda: "OOMKilled" in (installed.runs("oom")["oom-1"]["error"] or ""), 60,
                 "the operator to say the run's worker was OOMKilled")
    except AssertionError:
        pods = node.get("pods", "-n", NAMESPACE, "-l", "agentrun.dev/pool=oom")["items"]
        raise AssertionError(
            f"{installed.runs('oom')['oom-1']}; pods: "
            f"{[(p['metadata']['name'], p['status'].get('containerStatuses')) for p in pods]}; "
            f"operator: {operator_log(node)}") from None
    runs = installed.runs("oom")
    assert "raise workers.pools[].resources.limits.memory" in runs["oom-1"]["error"]
    for name in ("oom-2", "oom-3"):
        assert runs[name]["status"] == "succeeded", runs
        seqs = [q for (q,) in installed.query(
            "SELECT seq FROM agent_step WHERE run_id = %s ORDER BY seq", runs[name]["id"])]
        assert seqs == list(range(STEPS)), (name, seqs)
        emails = installed.query("SELECT count(*), count(DISTINCT key) FROM ledger_effects "
                                 "WHERE run_id = %s AND tool = 'send_email'",
                                 str(runs[name]["id"]))[0]
        assert emails == (EMAILS, EMAILS), (name, emails)
    once = [q for (q,) in installed.query(
        "SELECT seq FROM agent_step WHERE run_id = %s ORDER BY seq", runs["oom-0"]["id"])]
    assert once == list(range(7)), once
    pods = node.get("pods", "-n", NAMESPACE, "-l", "agentrun.dev/pool=oom")["items"]
    reasons = [((c.get("lastState") or {}).get("terminated") or {}).get("reason")
               for p in pods for c in p["status"].get("containerStatuses", [])]
    assert "OOMKilled" in reasons, reasons
    events = node.get("events", "-n", NAMESPACE, "--field-selector",
                      "involvedObject.name=oom-1,reason=DeadLettered")["items"]
    assert events and "OOMKilled" in events[0]["message"], events
    kills = installed.query("SELECT count(*) FROM ledger_attempts a JOIN agent_run r "
                            "ON a.run_id = r.id::text WHERE r.k8s_name LIKE 'oom-%%' "
                            "AND a.tool = 'hog' AND a.at > %s", t0)[0][0]
    changes = installed.handovers("oom", t0)
    # An OOM kill is a death, not a drain: the store says their leases expired.
    assert changes["lease_expired"]["count"] >= 1, changes
    installed.figures.record(
        "oom", runs=4, steps=2 * STEPS + 7, duplicates=0, lost=0,
        attempts=sorted(r["attempt"] for r in runs.values()), hog_calls=kills,
        oom_killed_containers=reasons.count("OOMKilled"),
        dead_lettered=["oom-1"], **changes)


def test_uninstall_then_deleting_the_namespace_does_not_hang(installed: Installed) -> None:
    # Issue 19: after `helm uninstall`, deleting the namespace hung on every finished AgentRun's
    # finalizer, with no operator left to remove them. Last in this module: it removes it all.
    node = installed.node
    objects = node.get("agentruns", "-n", NAMESPACE)["items"]
    assert objects and all(not o["metadata"].get("finalizers") for o in objects), [
        (o["metadata"]["name"], o["metadata"].get("finalizers")) for o in objects]
    node.helm("uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--timeout", "3m")
    node.kubectl("delete", "namespace", NAMESPACE, "--timeout=120s", timeout=150)
    gone = node.kubectl("get", "namespace", NAMESPACE, check=False)
    assert gone.returncode != 0 and "NotFound" in gone.stderr, (gone.stdout, gone.stderr)
    installed.figures.record("uninstall", agentruns=len(objects), finalizers=0)


def operator_log(node: Node) -> str:
    return node.kubectl("logs", "-n", NAMESPACE, "-l", "app.kubernetes.io/component=operator",
                        "--tail=40", check=False).stdout
