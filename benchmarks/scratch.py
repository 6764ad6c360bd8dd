"""The benchmarks' scratch directories (scripted scenarios, worker logs): removed when the
benchmark ends well, kept when it fails, since its workers' logs are then the evidence; the
error says where they are. Before, every run of the report left half a dozen directories in /tmp.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def scratch_dir(prefix: str) -> Iterator[Path]:
    """A new directory under the system's temporary directory (``TMPDIR``), named ``prefix...``:
    removed at the end of the block, unless the block raised (then the exception notes it)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    except BaseException as exc:
        exc.add_note(f"(kept for its logs: {path})")
        raise
    shutil.rmtree(path, ignore_errors=True)
