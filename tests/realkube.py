"""A real Kubernetes API server for the tests: where kubectl, RBAC, CEL and controllers are real.

Where the API server comes from, in this order:

* ``AGENTRUN_TEST_KUBECONFIG=PATH``: a cluster of yours (kind, k3d, a dev cluster). The tests
  create namespaces ``agentrun-t-*`` and cluster-scoped RBAC objects named ``agentrun-t-*``,
  apply agentrun's CRDs server-side, and delete what they created (the CRDs stay).
* ``AGENTRUN_K8S_HOME=DIR``, or ``shared/k8s`` beside the repository (or beside a folder above
  it): a folder holding
  ``control-plane.sh`` (etcd, kube-apiserver and kube-controller-manager v1.36 on 127.0.0.1),
  started once per test session (per xdist worker) and stopped by its own pids at the end.

Without either, the tier is skipped with one line saying so; with ``CI=true`` a missing control
plane fails the session instead, so CI can never pass by skipping it.

kubectl and helm are the real binaries (tests/helmtools.py). Every kubectl call uses a fresh
discovery cache (``--cache-dir`` per :class:`Kube`), so a renamed category or short name is seen
as a new user would see it.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from tests.helmtools import helm, kubectl
from tests.kubekit import RestVerbs, deployment_manifest, wait_until

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "agentrun"
AGENTRUNS = "/apis/agentrun.dev/v1alpha1"
TEST_PREFIX = "agentrun-t-"


def _k8s_home() -> Path | None:
    configured = os.environ.get("AGENTRUN_K8S_HOME")
    # Else a shared/k8s beside the repository or beside any folder above it (a worktree or a CI
    # clone may sit deeper than the usual checkout).
    candidates = [Path(configured)] if configured else [
        parent / "shared" / "k8s" for parent in ROOT.parents]
    for c in candidates:
        if (c / "control-plane.sh").exists():
            return c
    return None


def _unavailable(why: str) -> None:
    if os.environ.get("CI", "").lower() in ("true", "1"):
        pytest.fail(f"real Kubernetes tier: {why} (CI=true: this is a failure, not a skip)")
    pytest.skip(f"real Kubernetes tier skipped: {why}")


@dataclass
class ControlPlane:
    """A running API server: its admin kubeconfig, and how it is stopped (None: not ours)."""

    kubeconfig: Path
    home: Path
    stop: Callable[[], None] | None = None


def start_control_plane(workdir: Path) -> ControlPlane:
    own = os.environ.get("AGENTRUN_TEST_KUBECONFIG")
    if own:
        return ControlPlane(Path(own), workdir)
    k8s = _k8s_home()
    if k8s is None:
        _unavailable(
            "no API server: set AGENTRUN_TEST_KUBECONFIG to a cluster's kubeconfig, or "
            "AGENTRUN_K8S_HOME to a folder with control-plane.sh (../shared/k8s)"
        )
        raise AssertionError("unreachable")
    script = k8s / "control-plane.sh"
    proc = subprocess.run(
        ["bash", str(script), "up", str(workdir)], capture_output=True, text=True, check=False
    )

    def down() -> None:
        subprocess.run(["bash", str(script), "down", str(workdir)], check=False,
                       capture_output=True)

    if proc.returncode != 0:
        down()
        _unavailable(f"{script} up failed: {proc.stderr.strip()[-800:]}")
    return ControlPlane(workdir / "kubeconfig", workdir, down)


class KubectlError(AssertionError):
    pass


#: The kubectl and helm caches of every Kube of this process, each in a directory of its own
#: under this one, which goes when the process exits: a Kube made for a moment (for_namespace's,
#: a ServiceAccount's) is seldom closed, and a CI run left about 90 kcache-* directories in /tmp.
_CACHE_ROOT: Path | None = None


def kube_cache_dir() -> Path:
    """A new cache directory under this process's root (made, and removal at exit arranged, on
    first use)."""
    global _CACHE_ROOT
    if _CACHE_ROOT is None:
        _CACHE_ROOT = Path(tempfile.mkdtemp(prefix="kcache-"))
        atexit.register(shutil.rmtree, _CACHE_ROOT, True)
    return Path(tempfile.mkdtemp(dir=_CACHE_ROOT))


@dataclass
class Kube(RestVerbs):
    """A client of a real API server (its kubeconfig's credentials), bound to a namespace.

    The methods mirror tests/kubekit.KubeCluster (the emulator's client), so a test reads the
    same whichever server it talks to."""

    kubeconfig: Path
    namespace: str = "default"
    cache_dir: Path = field(default_factory=kube_cache_dir)
    _api: kubernetes.client.ApiClient | None = None

    @property
    def api(self) -> kubernetes.client.ApiClient:
        if self._api is None:
            self._api = kubernetes.config.new_client_from_config(config_file=str(self.kubeconfig))
        return self._api

    def close(self) -> None:
        if self._api is not None:
            self._api.close()
            self._api = None
        shutil.rmtree(self.cache_dir, ignore_errors=True)

    # -- kubectl -------------------------------------------------------------------------------

    def kubectl(
        self, *args: str, check: bool = True, stdin: str | None = None, namespaced: bool = True
    ) -> subprocess.CompletedProcess[str]:
        cmd = [str(kubectl()), "--kubeconfig", str(self.kubeconfig),
               "--cache-dir", str(self.cache_dir)]
        if namespaced and not any(a in ("-n", "--namespace", "-A") or a.startswith("--namespace=")
                                  for a in args):
            cmd += ["-n", self.namespace]
        proc = subprocess.run(
            [*cmd, *args], input=stdin, capture_output=True, text=True, check=False, timeout=120
        )
        if check and proc.returncode != 0:
            raise KubectlError(f"kubectl {' '.join(args)} failed ({proc.returncode}): "
                               f"{proc.stderr.strip()}")
        return proc

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig),
               "HELM_CACHE_HOME": str(self.cache_dir / "helm-cache"),
               "HELM_CONFIG_HOME": str(self.cache_dir / "helm-config"),
               "HELM_DATA_HOME": str(self.cache_dir / "helm-data")}
        proc = subprocess.run([str(helm()), *args], capture_output=True, text=True, check=False,
                              timeout=300, env=env)
        if check and proc.returncode != 0:
            raise KubectlError(f"helm {' '.join(args)} failed ({proc.returncode}): "
                               f"{proc.stderr.strip()}")
        return proc

    def apply_yaml(self, docs: Any, *extra: str) -> str:
        text = docs if isinstance(docs, str) else yaml.safe_dump_all(
            docs if isinstance(docs, list) else [docs])
        return self.kubectl("apply", "-f", "-", *extra, stdin=text).stdout

    # -- raw requests (the emulator client's interface) ---------------------------------------

    def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> tuple[int, Any]:
        headers = {"Content-Type": content_type, "Accept": "application/json"}
        try:
            # kubernetes>=35: param_serialize (auth, host) then call_api (the request itself).
            m, url, hdrs, payload, _ = self.api.param_serialize(
                method, path, header_params=headers, body=body, auth_settings=["BearerToken"]
            )
            resp = self.api.call_api(m, url, header_params=hdrs, body=payload,
                                     _request_timeout=30)
            data = resp.read()
            if resp.status >= 400:
                return resp.status, json.loads(data or b"null")
            return resp.status, json.loads(data or b"null")
        except ApiException as exc:
            try:
                return exc.status, json.loads(exc.body or b"null")
            except ValueError:
                return exc.status, {"message": str(exc.body)}

    def _ns(self, ns: str | None) -> str:
        return ns or self.namespace

    def agentrun(self, name: str, ns: str | None = None) -> dict[str, Any] | None:
        return self.get(f"{AGENTRUNS}/namespaces/{self._ns(ns)}/agentruns/{name}")

    def apply_agentrun(self, manifest: dict[str, Any], ns: str | None = None) -> dict[str, Any]:
        return self.create(f"{AGENTRUNS}/namespaces/{self._ns(ns)}/agentruns", manifest)

    def apply_agent(self, manifest: dict[str, Any], ns: str | None = None) -> dict[str, Any]:
        return self.create(f"{AGENTRUNS}/namespaces/{self._ns(ns)}/agents", manifest)

    def delete_agentrun(self, name: str, ns: str | None = None) -> int:
        return self.delete(f"{AGENTRUNS}/namespaces/{self._ns(ns)}/agentruns/{name}")

    def annotate(
        self, name: str, annotations: dict[str, str | None], ns: str | None = None
    ) -> None:
        self.patch(
            f"{AGENTRUNS}/namespaces/{self._ns(ns)}/agentruns/{name}",
            {"metadata": {"annotations": annotations}},
        )

    def events(self, name: str | None = None, ns: str | None = None) -> list[dict[str, Any]]:
        code, out = self.request("GET", f"/api/v1/namespaces/{self._ns(ns)}/events")
        items = out.get("items", []) if code == 200 else []
        return [e for e in items if name is None or e["involvedObject"].get("name") == name]

    def reasons(self, name: str, ns: str | None = None) -> list[str]:
        return [e["reason"] for e in self.events(name, ns)]

    def deployment(self, name: str, ns: str | None = None) -> dict[str, Any] | None:
        return self.get(f"/apis/apps/v1/namespaces/{self._ns(ns)}/deployments/{name}")

    def create_deployment(
        self, name: str, ns: str | None = None, replicas: int | None = 0, pool: str = "default"
    ) -> dict[str, Any]:
        return self.create(f"/apis/apps/v1/namespaces/{self._ns(ns)}/deployments",
                           deployment_manifest(name, self._ns(ns), replicas, pool))

    def pods(self, labels: dict[str, str], ns: str | None = None) -> list[dict[str, Any]]:
        selector = ",".join(f"{k}={v}" for k, v in labels.items())
        code, out = self.request(
            "GET", f"/api/v1/namespaces/{self._ns(ns)}/pods?labelSelector={selector}")
        assert code == 200, out
        return list(out.get("items", []))

    def pod(self, name: str, ns: str | None = None) -> dict[str, Any] | None:
        return self.get(f"/api/v1/namespaces/{self._ns(ns)}/pods/{name}")

    def for_namespace(self, ns: str) -> Kube:
        return Kube(self.kubeconfig, ns, _api=None)


def write_token_kubeconfig(admin: Path, token: str, target: Path, namespace: str) -> Path:
    """A kubeconfig for the same server as ``admin`` that authenticates with ``token`` only."""
    cfg = yaml.safe_load(admin.read_text())
    ctx_name = cfg["current-context"]
    ctx = next(c for c in cfg["contexts"] if c["name"] == ctx_name)["context"]
    cluster = next(c for c in cfg["clusters"] if c["name"] == ctx["cluster"])
    target.write_text(yaml.safe_dump({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [cluster],
        "users": [{"name": "sa", "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {
            "cluster": cluster["name"], "user": "sa", "namespace": namespace}}],
        "current-context": "sa",
    }))
    return target


def apply_crds(kube: Kube) -> None:
    kube.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"),
                 namespaced=False)
    for crd in ("agentruns.agentrun.dev", "agents.agentrun.dev",
                "agentrunapprovals.agentrun.dev"):
        kube.kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=60s",
                     namespaced=False)


def new_namespace(kube: Kube, labels: dict[str, str] | None = None) -> str:
    name = f"{TEST_PREFIX}{uuid.uuid4().hex[:8]}"
    kube.create("/api/v1/namespaces", {
        "apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": name, "labels": {"agentrun.dev/test": "true", **(labels or {})}},
    })
    # Pods (even Pending ones) are admitted only once the default ServiceAccount exists.
    wait_until(lambda: kube.get(f"/api/v1/namespaces/{name}/serviceaccounts/default"), 60,
               f"the default ServiceAccount of {name}")
    return name


@dataclass
class Release:
    """A ``helm install`` of charts/agentrun into a test namespace (pods stay Pending: the
    control plane has no node), with kubeconfigs for its ServiceAccounts' own tokens."""

    kube: Kube
    name: str
    namespace: str
    values: list[str]

    @property
    def fullname(self) -> str:  # the chart's agentrun.fullname
        return self.name if "agentrun" in self.name else f"{self.name}-agentrun"

    @property
    def operator_sa(self) -> str:
        return f"{self.fullname}-operator"

    @property
    def worker_sa(self) -> str:
        return f"{self.fullname}-worker"

    def worker_deployment(self, pool: str = "default") -> str:
        return f"{self.fullname}-worker-{pool}"

    def token(self, sa: str) -> str:
        return self.kube.kubectl("create", "token", sa, "-n", self.namespace,
                                 "--duration=2h").stdout.strip()

    def kubeconfig_for(self, sa: str, directory: Path) -> Path:
        return write_token_kubeconfig(self.kube.kubeconfig, self.token(sa),
                                      directory / f"kubeconfig-{sa}", self.namespace)

    def pools_file(self, directory: Path) -> Path:
        cm = self.kube.get(
            f"/api/v1/namespaces/{self.namespace}/configmaps/{self.fullname}-pools")
        assert cm is not None, "the chart's pools ConfigMap"
        path = directory / "pools.yaml"
        path.write_text(cm["data"]["pools.yaml"])
        return path


def install_chart(
    kube: Kube, namespace: str, *values: str, name: str | None = None
) -> Release:
    """``helm install`` with the secrets the chart requires (made here, fake) and ``values``
    (``--set`` pairs)."""
    release = name or f"r{uuid.uuid4().hex[:6]}"
    ns = kube.for_namespace(namespace)
    for secret, key in (("agentrun-db", "url"), ("anthropic", "api-key")):
        if ns.get(f"/api/v1/namespaces/{namespace}/secrets/{secret}") is None:
            ns.kubectl("create", "secret", "generic", secret, f"--from-literal={key}=unused")
    args = ["install", release, str(CHART), "-n", namespace,
            "--set", "database.existingSecret=agentrun-db",
            "--set", "anthropic.existingSecret=anthropic"]
    for v in values:
        args += ["--set", v]
    ns.helm(*args)
    return Release(ns, release, namespace, list(values))


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    workdir = tmp_path_factory.mktemp("k8s")
    cp = start_control_plane(workdir)
    try:
        admin = Kube(cp.kubeconfig)
        apply_crds(admin)
        admin.close()
        yield cp
    finally:
        if cp.stop is not None:
            cp.stop()


@pytest.fixture(scope="session")
def admin_kube(control_plane: ControlPlane) -> Iterator[Kube]:
    k = Kube(control_plane.kubeconfig)
    try:
        yield k
    finally:
        k.close()


@pytest.fixture
def kube(admin_kube: Kube) -> Iterator[Kube]:
    """An admin client bound to a namespace of this test's own (deleted afterwards)."""
    ns = new_namespace(admin_kube)
    k = Kube(admin_kube.kubeconfig, ns)
    try:
        yield k
    finally:
        k.close()
        admin_kube.request("DELETE", f"/api/v1/namespaces/{ns}")
