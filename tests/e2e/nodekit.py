"""A real single-node Kubernetes for the end-to-end tier, and agentrun installed on it the way
README.md tells a platform engineer to.

``shared/k8s/node/node-up.sh`` brings up kubelet, scheduler, containerd, runc, a CNI bridge and
memory cgroups; ``build-images.sh`` builds the project's image from its Dockerfile with buildah
and imports it into the node's containerd; a second image ``FROM`` it adds the test's tool module
(tests/tool_modules/ledger_tools.py), as README says to add your own tools. Pods reach only the
node's bridge address (10.244.77.1): PostgreSQL is a server of the tier's own
(benchmarks/own_pg.py, which the restart scenario restarts), reached through a TCP proxy of the
test listening there (which the cut scenario cuts), and the scripted model server listens there
too. Everything is stopped by its own pid, and ``node-down.sh --wipe`` removes the bridge,
cgroups, iptables chains and pods.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.kubekit import wait_until as wait_for

ROOT = Path(__file__).resolve().parents[2]
NODE_IP = "10.244.77.1"
NODE_NAME = "k8snode"
IMAGE = "localhost/agentrun:dev"
TOOLS_IMAGE = "localhost/agentrun-e2e:dev"
TOOLS_PATH = "/opt/agentrun-tools/ledger_tools.py"
CTR_SOCK = "/run/node-containerd/containerd.sock"
NAMESPACE = "agentrun-e2e"
RELEASE = "e2e"
APT = ["containerd", "runc", "buildah", "debootstrap", "iptables"]


def node_scripts() -> Path | None:
    configured = os.environ.get("AGENTRUN_K8S_HOME")
    candidates = [Path(configured)] if configured else [p / "shared" / "k8s" for p in
                                                        ROOT.parents]
    for c in candidates:
        if (c / "node" / "node-up.sh").exists():
            return c / "node"
    return None


def unavailable(why: str) -> None:
    if os.environ.get("CI", "").lower() in ("true", "1"):
        pytest.fail(f"e2e tier: {why} (CI=true: this is a failure, not a skip)")
    pytest.skip(f"e2e tier skipped: {why}")


def check_host() -> Path:
    scripts = node_scripts()
    if scripts is None:
        unavailable("no shared/k8s/node/node-up.sh (set AGENTRUN_K8S_HOME)")
        raise AssertionError("unreachable")
    if os.geteuid() != 0:
        unavailable("needs root (containerd, cgroups, the bridge)")
    missing = [b for b in APT if shutil.which(b) is None]
    if missing:
        unavailable(f"missing {', '.join(missing)}: apt-get install -y containerd runc "
                    "containernetworking-plugins iptables buildah debootstrap")
    return scripts


def sh(cmd: list[str], *, env: dict[str, str] | None = None, timeout: float = 600,
       check: bool = True, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False,
                          env={**os.environ, **(env or {})}, cwd=cwd)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return proc


@dataclass
class Node:
    home: Path
    scripts: Path
    kubectl_bin: Path
    helm_bin: Path

    @property
    def kubeconfig(self) -> Path:
        return self.home / "kubeconfig"

    @property
    def env(self) -> dict[str, str]:
        return {"NODE_HOME": str(self.home), "KUBECONFIG": str(self.kubeconfig),
                "HELM_CACHE_HOME": str(self.home / "helm" / "cache"),
                "HELM_CONFIG_HOME": str(self.home / "helm" / "config"),
                "HELM_DATA_HOME": str(self.home / "helm" / "data")}

    def up(self) -> None:
        (self.home / "bin").mkdir(parents=True, exist_ok=True)
        link = self.home / "bin" / "kubectl"
        if not link.exists():
            link.symlink_to(self.kubectl_bin)
        sh(["bash", str(self.scripts / "node-up.sh")], env=self.env, timeout=300)

    def down(self) -> None:
        sh(["bash", str(self.scripts / "node-down.sh"), "--wipe"], env=self.env, timeout=300,
           check=False)

    def build_images(self) -> None:
        sh(["bash", str(self.scripts / "build-images.sh"), str(ROOT), IMAGE], env=self.env,
           timeout=900)
        # The test's tools, added FROM the project's image as README tells users to.
        storage = {"CONTAINERS_STORAGE_CONF": str(self.home / "containers" / "storage.conf")}
        # Its own build context: the repository's .dockerignore leaves tests/ out.
        ctx = self.home / "tools-context"
        ctx.mkdir(exist_ok=True)
        shutil.copy(ROOT / "tests" / "tool_modules" / "ledger_tools.py", ctx)
        sh(["buildah", "bud", "-q", "--pull=never", "--layers=false", "-t", TOOLS_IMAGE,
            "-f", str(ROOT / "tests" / "e2e" / "Containerfile"), str(ctx)],
           env={**self.env, **storage}, timeout=300)
        tar = self.home / "images" / "agentrun-e2e.tar"
        tar.unlink(missing_ok=True)
        sh(["buildah", "push", "-q", TOOLS_IMAGE, f"docker-archive:{tar}:{TOOLS_IMAGE}"],
           env={**self.env, **storage}, timeout=300)
        sh(["ctr", "-a", CTR_SOCK, "-n", "k8s.io", "images", "import", str(tar)], timeout=300)

    def kubectl(self, *args: str, check: bool = True, timeout: float = 120,
                stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([str(self.kubectl_bin), *args], capture_output=True, text=True,
                              env={**os.environ, **self.env}, timeout=timeout, input=stdin,
                              check=False)
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {proc.stderr.strip()}")
        return proc

    def helm(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return sh([str(self.helm_bin), *args], env=self.env, timeout=timeout, cwd=ROOT)

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def ctr(self, *args: str) -> subprocess.CompletedProcess[str]:
        return sh(["ctr", "-a", CTR_SOCK, "-n", "k8s.io", *args], timeout=60)


@dataclass
class Process:
    """A process of the test's own (the model server), stopped by its pid."""

    popen: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def start_model_server(scenario: dict[str, Any], port: int, tmp: Path) -> Process:
    path = tmp / "e2e-scenario.yaml"
    path.write_text(yaml.safe_dump(scenario))
    log = tmp / "fake-anthropic.log"
    with open(log, "wb") as out:
        popen = subprocess.Popen(
            [sys.executable, "-m", "agentrun", "fake-anthropic", "--scenario", str(path),
             "--host", NODE_IP, "--port", str(port)], stdout=out, stderr=subprocess.STDOUT)
    proc = Process(popen, log)
    wait_for(lambda: "listening" in log.read_text() or popen.poll() is not None, 30,
             "the model server")
    assert popen.poll() is None, log.read_text()
    return proc


@dataclass
class Figures:
    """What the e2e run measured, written for the report (docs/e2e.md)."""

    path: Path
    scenarios: dict[str, dict[str, Any]] = field(default_factory=dict)

    def record(self, name: str, **values: Any) -> None:
        self.scenarios[name] = values
        self.path.write_text(json.dumps(self.scenarios, indent=1, default=str))
