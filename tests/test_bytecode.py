"""The start-up benchmark's workers start from bytecode, as an installed worker does
(benchmarks/bytecode.py): a checkout's modules, those behind the package's symlinks included."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.bytecode import compile_tree, source_dirs


def _package(tmp_path: Path) -> Path:
    """pkg/ with a module, a subpackage, and sub -> ../outside as agentrun has worker/."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "__init__.py").write_text("")
    (outside / "deep.py").write_text("VALUE = 2\n")
    pkg = tmp_path / "pkg"
    (pkg / "inner").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "top.py").write_text("VALUE = 1\n")
    (pkg / "inner" / "__init__.py").write_text("")
    (pkg / "sub").symlink_to("../outside")
    return pkg


def test_every_module_behind_a_symlink_too_gets_its_bytecode(tmp_path: Path) -> None:
    pkg = _package(tmp_path)
    assert source_dirs(pkg) == sorted([pkg.resolve(), (tmp_path / "outside").resolve()])
    assert compile_tree(pkg)
    for source in (pkg / "top.py", pkg / "inner" / "__init__.py", tmp_path / "outside" / "deep.py"):
        assert Path(importlib.util.cache_from_source(str(source))).is_file(), source
    # The interpreter reads it under PYTHONDONTWRITEBYTECODE=1 (these machines, the image): the
    # module behind the symlink is not compiled from source again.
    out = subprocess.run(
        [sys.executable, "-v", "-c", "import pkg.sub.deep, pkg.top"],
        cwd=tmp_path, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True, text=True, check=True,
    ).stderr
    loaded = [line for line in out.splitlines() if line.startswith("# code object from")]
    assert any("deep.cpython" in line for line in loaded), loaded
    assert any("top.cpython" in line for line in loaded), loaded
    assert not any(line.endswith(".py") and "/pkg/" in line for line in loaded), loaded

