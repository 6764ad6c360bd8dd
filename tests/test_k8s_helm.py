"""The chart on a real API server (tests/realkube.py): real ``helm install``, ``upgrade``,
``uninstall``, real RBAC checked with the chart's own ServiceAccount tokens, and the operator run
locally with exactly the operator ServiceAccount's permissions.

What each part guards:

* B3: with ``operator.watchNamespaces`` the operator must serve the listed namespaces at once,
  with no Forbidden error (kopf, started with specific namespaces, lists and watches Namespace
  objects cluster-wide; without that permission it retries for ~54 s serving nothing). And the
  cluster-wide install must not carry that permission, which kopf does not use there.
* RBAC: the worker ServiceAccount can do nothing beyond what every authenticated identity can;
  worker pods get no token; the operator can never read Secrets.
* Helm: install, upgrade --reuse-values, uninstall and re-install into the same namespace, as
  docs/helm.md documents; the CRDs and AgentRun objects survive an uninstall, and the documented
  ways to remove everything (deleting the namespace, deleting the CRDs) finish instead of hanging
  on a finalizer nobody will remove (B4).

Pods stay Pending (no kubelet): the operator runs here as a subprocess, with a kubeconfig holding
its ServiceAccount's token, against the release's pools file.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from tests.kubekit import OperatorProc, Operators, agent_manifest, agentrun_manifest
from tests.realkube import (
    AGENTRUNS,
    CHART,
    ControlPlane,
    Kube,
    KubectlError,
    Release,
    apply_crds,
    install_chart,
    new_namespace,
    wait_until,
)

T = TypeVar("T")
CRDS = ("agentruns.agentrun.dev", "agents.agentrun.dev")
FINALIZER = "agentrun.dev/finalizer"
#: What every authenticated identity may do on a stock API server (the system:basic-user,
#: system:discovery and system:public-info-viewer ClusterRoles).
SELF_REVIEWS = {
    "selfsubjectreviews.authentication.k8s.io",
    "selfsubjectaccessreviews.authorization.k8s.io",
    "selfsubjectrulesreviews.authorization.k8s.io",
}


def timed(what: str, fn: Callable[[], T]) -> T:
    """``fn()``, printing how long it took (shown with ``-s``, and in a failure's report), so a
    slow helm or kubectl step is visible."""
    start = time.monotonic()
    try:
        return fn()
    finally:
        print(f"{what}: {time.monotonic() - start:.2f}s")


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture
def operators(tmp_path: Path, database_url: str) -> Iterator[Operators]:
    ops = Operators(None, database_url, tmp_path)
    try:
        yield ops
    finally:
        ops.stop_all()  # by pid, also when the test failed


@pytest.fixture
def releases(admin_kube: Kube) -> Iterator[list[Release]]:
    """Releases a test installed; uninstalled at teardown (their ClusterRole and binding are
    cluster-scoped: deleting the test namespace would not remove them)."""
    installed: list[Release] = []
    try:
        yield installed
    finally:
        for r in installed:
            admin_kube.helm("uninstall", r.name, "-n", r.namespace, "--ignore-not-found",
                            check=False)


@pytest.fixture
def extra_namespaces(admin_kube: Kube) -> Iterator[Callable[[], str]]:
    made: list[str] = []

    def make() -> str:
        made.append(new_namespace(admin_kube))
        return made[-1]

    try:
        yield make
    finally:
        for ns in made:
            admin_kube.request("DELETE", f"/api/v1/namespaces/{ns}")


SaKube = Callable[[Release, str], Kube]


@pytest.fixture
def as_sa(tmp_path: Path) -> Iterator[SaKube]:
    """A client (kubectl, requests) authenticated as one of a release's ServiceAccounts, with
    that ServiceAccount's own token, in the release namespace; closed at teardown."""
    made: list[Kube] = []

    def make(release: Release, sa: str) -> Kube:
        made.append(Kube(release.kubeconfig_for(sa, tmp_path), release.namespace))
        return made[-1]

    try:
        yield make
    finally:
        for k in made:
            k.close()


def install(
    kube: Kube, releases: list[Release], *values: str, name: str | None = None
) -> Release:
    release = timed("helm install", lambda: install_chart(kube, kube.namespace, *values,
                                                          name=name))
    releases.append(release)
    return release


def start_operator(
    ops: Operators, release: Release, tmp: Path, watch: list[str] | None = None
) -> OperatorProc:
    """``agentrun operator`` with the operator ServiceAccount's token, the release's pools file
    and the namespaces the chart would give it (AGENTRUN_WATCH_NAMESPACES)."""
    ops.kubeconfig = release.kubeconfig_for(release.operator_sa, tmp)
    return ops.start(env={
        "AGENTRUN_POOLS_FILE": str(release.pools_file(tmp)),
        "AGENTRUN_WATCH_NAMESPACES": ",".join(watch or []),
    })


def submit(kube: Kube, ns: str, name: str = "one") -> None:
    kube.apply_agent(agent_manifest("echoer"), ns)
    kube.apply_agentrun(agentrun_manifest(name), ns)


def run_id(kube: Kube, ns: str, name: str, op: OperatorProc, within: float = 30) -> str:
    def created() -> str | None:
        assert op.popen.poll() is None, f"the operator exited:\n{op.output()[-3000:]}"
        obj = kube.agentrun(name, ns) or {}
        return str(obj.get("status", {}).get("runId") or "") or None

    try:
        return str(wait_until(created, within, f"AgentRun {ns}/{name} to get .status.runId"))
    except AssertionError as exc:
        obj = kube.agentrun(name, ns) or {}
        raise AssertionError(f"{exc}\nstatus: {obj.get('status')}\n"
                             f"operator log:\n{op.output()[-4000:]}") from None


def forbidden_lines(log: str) -> list[str]:
    # Every refusal by RBAC says forbidden; a bare "403" also matches timestamps (12:00:01.403).
    return [line for line in log.splitlines() if "forbidden" in line.lower()]


def can_i(kube: Kube, *args: str) -> bool:
    proc = kube.kubectl("auth", "can-i", *args, check=False)
    answer = proc.stdout.strip()
    assert answer in ("yes", "no"), (args, proc.stdout, proc.stderr)
    return answer == "yes"



# -- B3: the operator's RBAC, cluster-wide and with watchNamespaces --------------------------


def serve_one_run(
    kube: Kube, release: Release, operators: Operators, tmp: Path, ns: str,
    watch: list[str] | None = None,
) -> OperatorProc:
    """The operator (with its SA's token) turns an AgentRun into a run and scales the pool;
    returns it stopped, its log complete."""
    op = start_operator(operators, release, tmp, watch)
    submit(kube, ns)
    run_id(kube, ns, "one", op)
    # The pending run makes the autoscaler scale the pool up (deployments/scale in the release
    # namespace), and kopf posted its handler Events: each permission was exercised once.
    wait_until(lambda: (kube.deployment(release.worker_deployment()) or {})
               .get("spec", {}).get("replicas") == 1, 30, "the autoscaler to scale the pool to 1")
    assert op.stop() == 0, op.output()[-3000:]
    return op


def test_operator_with_watch_namespaces_serves_them_without_forbidden(
    kube: Kube, releases: list[Release], operators: Operators, tmp_path: Path,
    extra_namespaces: Callable[[], str], as_sa: SaKube,
) -> None:
    team = extra_namespaces()
    release = install(kube, releases, f"operator.watchNamespaces={{{team}}}")
    op = serve_one_run(kube, release, operators, tmp_path, team, watch=[team])
    assert not forbidden_lines(op.output()), "\n".join(forbidden_lines(op.output()))
    # What it may do: read Namespace objects (kopf's namespace observer), nothing in namespaces
    # it does not watch.
    as_operator = as_sa(release, release.operator_sa)
    assert can_i(as_operator, "watch", "namespaces")
    assert not can_i(as_operator, "list", "agentruns.agentrun.dev", "-n", "default")
    assert not can_i(as_operator, "list", "agentruns.agentrun.dev", "--all-namespaces")
    assert can_i(as_operator, "patch", "agentruns.agentrun.dev", "-n", team)


def test_operator_cluster_wide_serves_every_namespace_without_forbidden(
    kube: Kube, releases: list[Release], operators: Operators, tmp_path: Path,
    extra_namespaces: Callable[[], str], as_sa: SaKube,
) -> None:
    elsewhere = extra_namespaces()
    release = install(kube, releases)
    op = serve_one_run(kube, release, operators, tmp_path, elsewhere)
    assert not forbidden_lines(op.output()), "\n".join(forbidden_lines(op.output()))
    # kopf lists no Namespace when it watches cluster-wide: the chart grants none.
    as_operator = as_sa(release, release.operator_sa)
    assert not can_i(as_operator, "list", "namespaces")
    assert can_i(as_operator, "watch", "agentruns.agentrun.dev", "--all-namespaces")


# -- RBAC --------------------------------------------------------------------------------------


def rules_table(kube: Kube) -> set[tuple[str, ...]]:
    """``kubectl auth can-i --list`` as rows (resource, non-resource URLs, names, verbs)."""
    out = kube.kubectl("auth", "can-i", "--list", "--no-headers").stdout
    rows = set()
    for line in out.splitlines():
        # Columns are padded with spaces; a resource row starts with its name, a non-resource
        # row with spaces. Bracketed cells hold no spaces except between list items.
        cells = re.findall(r"\[[^\]]*\]|\S+", line)
        rows.add(tuple(cells if not line.startswith(" ") else ["", *cells]))
    return rows


def test_worker_service_account_can_do_nothing(
    kube: Kube, releases: list[Release], as_sa: SaKube
) -> None:
    release = install(kube, releases)
    worker = rules_table(as_sa(release, release.worker_sa))
    resources = {row[0] for row in worker if row[0]}
    assert resources <= SELF_REVIEWS, sorted(worker)
    for row in worker:
        if not row[0]:  # non-resource URLs: discovery and health, read-only
            assert row[-1] == "[get]", row
    # The same rules as an identity with no binding at all (the namespace's default SA).
    nobody = rules_table(as_sa(release, "default"))
    assert worker == nobody
    as_worker = as_sa(release, release.worker_sa)
    for verb, what in (("get", "secrets"), ("list", "pods"), ("get", "agentruns.agentrun.dev"),
                       ("get", "deployments.apps")):
        assert not can_i(as_worker, verb, what), (verb, what)


def test_worker_pods_mount_no_token_operator_pods_do(
    kube: Kube, releases: list[Release]
) -> None:
    release = install(kube, releases)
    # The objects the API server stored, and the Pods its admission made from them (the
    # ServiceAccount admission plugin adds the token volume unless automount is off).
    sa = kube.get(f"/api/v1/namespaces/{kube.namespace}/serviceaccounts/{release.worker_sa}")
    assert sa is not None and sa["automountServiceAccountToken"] is False
    dep = kube.deployment(release.worker_deployment())
    assert dep is not None
    assert dep["spec"]["template"]["spec"]["automountServiceAccountToken"] is False

    def pods_of(component: str) -> list[dict[str, Any]]:
        return kube.pods({"app.kubernetes.io/component": component,
                          "app.kubernetes.io/instance": release.name})

    # A Deployment with no replicas field is defaulted to 1 by the API server: one Pending pod.
    worker_pods = wait_until(lambda: pods_of("worker"), 60, "a worker pod")
    operator_pods = wait_until(lambda: pods_of("operator"), 60, "the operator pod")

    def token_mounts(pod: dict[str, Any]) -> list[str]:
        projected = {v["name"] for v in pod["spec"].get("volumes", []) if "projected" in v}
        return [m["mountPath"] for c in pod["spec"]["containers"]
                for m in c.get("volumeMounts", []) if m["name"] in projected
                or m["mountPath"].startswith("/var/run/secrets/kubernetes.io")]

    for pod in worker_pods:
        assert token_mounts(pod) == [], pod["metadata"]["name"]
    # The control: the same check sees the operator's token (so it is not vacuous).
    assert token_mounts(operator_pods[0]) == ["/var/run/secrets/kubernetes.io/serviceaccount"]


@pytest.mark.parametrize("watch", [False, True], ids=["cluster-wide", "watch-namespaces"])
def test_operator_cannot_read_secrets(
    kube: Kube, releases: list[Release], as_sa: SaKube, extra_namespaces: Callable[[], str],
    watch: bool,
) -> None:
    team = extra_namespaces()
    values = [f"operator.watchNamespaces={{{team}}}"] if watch else []
    release = install(kube, releases, *values)
    as_operator = as_sa(release, release.operator_sa)
    assert can_i(as_operator, "patch", "agentruns.agentrun.dev", "-n", team), "a live identity"
    for ns in ("--all-namespaces", f"--namespace={release.namespace}", f"--namespace={team}"):
        for verb in ("get", "list", "watch"):
            assert not can_i(as_operator, verb, "secrets", ns), (verb, ns)


# -- Helm: install, upgrade, uninstall, re-install ---------------------------------------------


def pools_yaml(kube: Kube, release: Release) -> list[dict[str, Any]]:
    cm = kube.get(f"/api/v1/namespaces/{kube.namespace}/configmaps/{release.fullname}-pools")
    assert cm is not None
    pools: list[dict[str, Any]] = yaml.safe_load(cm["data"]["pools.yaml"])["pools"]
    return pools


def release_status(kube: Kube, release: Release) -> dict[str, Any]:
    out = kube.helm("status", release.name, "-n", release.namespace, "-o", "json").stdout
    status: dict[str, Any] = json.loads(out)
    return status


def wait_deleted(kube: Kube, what: str) -> None:
    """``kubectl wait --for=delete`` of a cluster-scoped object (60 s), failing with the
    finalizers that hold it."""
    proc = kube.kubectl("wait", "--for=delete", what, "--timeout=60s", check=False,
                        namespaced=False)
    if proc.returncode != 0:
        raise AssertionError(f"{what} was not deleted within 60s ({proc.stderr.strip()}); "
                             f"held by: {held_agentruns(kube) or 'no AgentRun'}")


def finalized_agentruns(kube: Kube, ns: str | None = None) -> list[dict[str, Any]]:
    """AgentRuns (of ``ns``, else of every namespace) that carry a finalizer; none once the CRD
    is gone."""
    where = f"--namespace={ns}" if ns else "--all-namespaces"
    proc = kube.kubectl("get", "agentruns.agentrun.dev", where, "-o", "json", check=False)
    if proc.returncode != 0:  # the CRD is deleted: no AgentRun is left to hold anything
        return []
    items: list[dict[str, Any]] = json.loads(proc.stdout)["items"]
    return [o for o in items if o["metadata"].get("finalizers")]


def held_agentruns(kube: Kube, ns: str | None = None) -> list[str]:
    return [f"AgentRun {o['metadata']['namespace']}/{o['metadata']['name']} with finalizers "
            f"{o['metadata']['finalizers']}" for o in finalized_agentruns(kube, ns)]


def release_held(kube: Kube, ns: str | None = None) -> None:
    """Drop the finalizers left on AgentRuns (what an admin does by hand: docs/helm.md), so a
    failed test leaves no namespace or CRD Terminating for ever."""
    for o in finalized_agentruns(kube, ns):
        meta = o["metadata"]
        kube.kubectl("patch", "agentruns.agentrun.dev", meta["name"], "-n", meta["namespace"],
                     "--type=merge", "-p", '{"metadata":{"finalizers":null}}', check=False)


def test_install_upgrade_uninstall_reinstall_then_delete_the_namespace(
    kube: Kube, admin_kube: Kube, releases: list[Release], operators: Operators,
    tmp_path: Path,
) -> None:
    release = install(kube, releases, name="lifecycle")
    assert release_status(kube, release)["info"]["status"] == "deployed"
    assert pools_yaml(kube, release)[0]["maxReplicas"] == 10

    # The operator (its SA's token) processes an AgentRun of the release's namespace.
    op = start_operator(operators, release, tmp_path)
    submit(kube, kube.namespace)
    first_run = run_id(kube, kube.namespace, "one", op)
    # An AgentRun made by an earlier version carries its finalizer: the operator drops it (what
    # docs/helm.md tells users to rely on: upgrade, then uninstall).
    legacy = agentrun_manifest("legacy")
    legacy["metadata"]["finalizers"] = [FINALIZER]
    kube.apply_agentrun(legacy)
    run_id(kube, kube.namespace, "legacy", op)
    wait_until(lambda: not held_agentruns(kube, kube.namespace), 30,
               f"the operator to remove {FINALIZER} from AgentRun legacy")
    assert op.stop() == 0, op.output()[-3000:]

    # Scale the pool as the operator would (stopped: it would set its own count back); helm
    # upgrade must leave that alone, the chart's Deployment having no replicas field.
    kube.kubectl("scale", f"deployment/{release.worker_deployment()}", "--replicas=3")
    timed("helm upgrade --reuse-values", lambda: kube.helm(
        "upgrade", release.name, str(CHART), "-n", kube.namespace, "--reuse-values",
        "--set", "workers.pools[0].name=default",
        "--set", "workers.pools[0].autoscaling.maxReplicas=4"))
    status = release_status(kube, release)
    assert (status["version"], status["info"]["status"]) == (2, "deployed")
    assert pools_yaml(kube, release)[0]["maxReplicas"] == 4, "the changed value applied"
    # --reuse-values kept the install's values (the Secrets' names are required by the schema).
    values = json.loads(kube.helm("get", "values", release.name, "-n", kube.namespace,
                                  "-o", "json").stdout)
    assert values["database"]["existingSecret"] == "agentrun-db"
    dep = kube.deployment(release.worker_deployment())
    assert dep is not None and dep["spec"]["replicas"] == 3, "helm upgrade reset the scale"

    timed("helm uninstall", lambda: kube.helm("uninstall", release.name, "-n", kube.namespace,
                                              "--wait", "--timeout=60s"))
    # What docs/helm.md promises survives: the CRDs, the AgentRun and Agent objects.
    for crd in CRDS:
        assert kube.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd}")
    survivor = kube.agentrun("one")
    assert survivor is not None and survivor["status"]["runId"] == first_run
    assert kube.get(f"{AGENTRUNS}/namespaces/{kube.namespace}/agents/echoer") is not None
    assert kube.deployment(release.worker_deployment()) is None, "the release's objects went"
    assert kube.get(f"/apis/rbac.authorization.k8s.io/v1/clusterroles/{release.operator_sa}") \
        is None

    # The same name into the same namespace: nothing left behind conflicts.
    again = install(kube, releases, name="lifecycle")
    assert release_status(kube, again)["version"] == 1
    timed("helm uninstall (2)", lambda: kube.helm("uninstall", again.name, "-n", kube.namespace,
                                                  "--wait", "--timeout=60s"))

    # The documented way to remove it all: uninstall, then delete the namespace with its
    # AgentRuns. Nothing may hold them now that no operator runs.
    try:
        admin_kube.kubectl("delete", "namespace", kube.namespace, "--wait=false",
                           namespaced=False)
        timed("namespace deletion", lambda: wait_deleted(
            admin_kube, f"namespace/{kube.namespace}"))
    finally:
        release_held(admin_kube, kube.namespace)


# Last in the file (and it restores what it deletes): it deletes the session's CRDs.
def test_uninstall_then_delete_the_crds_never_hangs(
    kube: Kube, admin_kube: Kube, control_plane: ControlPlane, releases: list[Release],
    operators: Operators, tmp_path: Path,
) -> None:
    if control_plane.stop is None:
        pytest.skip("AGENTRUN_TEST_KUBECONFIG: not deleting the CRDs (and every AgentRun) of a "
                    "cluster this test session does not own")
    release = install(kube, releases)
    op = start_operator(operators, release, tmp_path)
    submit(kube, kube.namespace)
    run_id(kube, kube.namespace, "one", op)
    assert op.stop() == 0, op.output()[-3000:]
    kube.helm("uninstall", release.name, "-n", kube.namespace, "--wait", "--timeout=60s")
    assert kube.agentrun("one") is not None, "an AgentRun for the CRD deletion to remove"
    try:
        admin_kube.kubectl("delete", "crd", *CRDS, "--wait=false", namespaced=False)
        for crd in CRDS:
            timed(f"crd/{crd} deletion", partial(wait_deleted, admin_kube, f"crd/{crd}"))
    finally:
        # Whatever happened, leave the session's CRDs as they were: unblock a held deletion,
        # wait for it to finish (a Terminating CRD cannot be re-created), apply them again.
        release_held(admin_kube)
        for crd in CRDS:
            admin_kube.kubectl("wait", "--for=delete", f"crd/{crd}", "--timeout=60s",
                               namespaced=False, check=False)
        try:
            apply_crds(admin_kube)
        except KubectlError as exc:
            pytest.fail(f"could not restore the session's CRDs: {exc}")


# -- resources: a limit below its request (issue 19) --------------------------------------------


def test_install_refuses_a_worker_limit_below_the_request_in_one_line(
    kube: Kube, releases: list[Release]
) -> None:
    # Found on a node: `--set workers.poolDefaults.resources.limits.memory=160Mi` (the request
    # stays the chart's 256Mi) was refused by the API server, about the Deployment's pod
    # template. helm install now refuses it first, naming both values, and installs nothing.
    with pytest.raises(KubectlError) as refused:
        install(kube, releases, "workers.poolDefaults.resources.limits.memory=160Mi",
                name="tight")
    [line] = [ln for ln in str(refused.value).splitlines() if "is below" in ln]
    assert line.endswith(
        "workers.poolDefaults.resources.limits.memory (160Mi) is below "
        'workers.poolDefaults.resources.requests.memory (256Mi) for pool "default", which '
        "Kubernetes refuses: raise the limit, or lower the request with it"), line
    listed = kube.helm("list", "-n", kube.namespace, "-a", "-q").stdout.split()
    assert "tight" not in listed
    assert kube.deployment("tight-agentrun-worker-default") is None

    # A pool's own resources are checked too (they replace poolDefaults' as a whole).
    with pytest.raises(KubectlError) as refused:
        install(kube, releases, "workers.pools[0].name=default",
                "workers.pools[0].resources.requests.memory=1Gi",
                "workers.pools[0].resources.limits.memory=512Mi", name="tight2")
    assert ("workers.pools[default].resources.limits.memory (512Mi) is below "
            "workers.pools[default].resources.requests.memory (1Gi)") in str(refused.value)

    # The control: what the API server says without the check (the same Deployment, limit
    # lowered by hand), which the user had to decode.
    ok = install(kube, releases, "workers.poolDefaults.resources.limits.memory=256Mi",
                 name="exact")
    dep = kube.deployment(ok.worker_deployment())
    assert dep is not None
    [c] = dep["spec"]["template"]["spec"]["containers"]
    assert c["resources"]["limits"]["memory"] == c["resources"]["requests"]["memory"] == "256Mi"
    for key in ("resourceVersion", "uid", "creationTimestamp", "generation", "managedFields"):
        dep["metadata"].pop(key, None)
    dep.pop("status", None)
    c["resources"]["limits"]["memory"] = "160Mi"
    proc = kube.kubectl("apply", "--dry-run=server", "-f", "-", stdin=json.dumps(dep),
                        check=False)
    assert proc.returncode != 0
    assert "must be less than or equal to memory limit" in proc.stderr, proc.stderr
