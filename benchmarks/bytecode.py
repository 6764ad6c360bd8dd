"""agentrun's own modules compiled to bytecode before a benchmark starts worker processes.

An installed agentrun has its bytecode: ``pip install`` compiles every module it installs (the
image's ``pip install ".[otel,...]"``, Dockerfile), and the image's PYTHONDONTWRITEBYTECODE only
stops the interpreter writing more. An editable checkout has none until an interpreter writes it,
and under PYTHONDONTWRITEBYTECODE=1 (set on these machines, and in the image) none ever does: every
worker started from it compiled agentrun's modules from source again, about 60 ms of each start
measured here (0.52 s against 0.38 s from exec to the first claim, the same hour). The start-up
benchmark then timed a cost no installed worker pays. The dependencies in site-packages were
compiled by pip; only the checkout's own sources need it.
"""

from __future__ import annotations

import compileall
import os
from pathlib import Path

import agentrun


def source_dirs(root: Path) -> list[Path]:
    """Each real directory the package at ``root`` has modules in. agentrun holds symlinks to
    the worker and operator folders (src/agentrun/worker -> ../../worker), which compileall does
    not follow: their targets are listed on their own."""
    root = root.resolve()
    dirs = {root}
    for entry in root.iterdir():
        if entry.is_symlink() and entry.is_dir():
            dirs.add(entry.resolve())
    return sorted(dirs)


def compile_tree(root: Path) -> bool:
    """Write the bytecode of every module of the package at ``root`` whose cache is missing or
    stale, as ``pip install`` does (the interpreter reads it while the source is unchanged). True
    when every module compiled; a directory that cannot be written (a read-only install) is an
    installed one, which has its bytecode already."""
    ok = True
    for directory in source_dirs(root):
        if not os.access(directory, os.W_OK):
            continue
        ok = bool(compileall.compile_dir(directory, quiet=1)) and ok
    return ok


def compile_agentrun() -> bool:
    """:func:`compile_tree` of the agentrun package this interpreter imports."""
    return compile_tree(Path(agentrun.__file__).parent)
