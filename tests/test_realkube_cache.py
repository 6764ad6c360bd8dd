"""The real-cluster tests' clients clean up after themselves: every Kube's kubectl and helm
caches go when the test process exits, closed or not (a CI run left about 90 of them in /tmp)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# A test process in small: Kubes made and used (a cache file written), one closed, the rest not
# (as for_namespace's and the ServiceAccounts' are), then a normal exit.
SCRIPT = """
from pathlib import Path
from tests.realkube import Kube

kubes = [Kube(Path("kubeconfig"), f"ns-{i}") for i in range(3)]
for k in kubes:
    (k.cache_dir / "discovery").write_text("cached")
assert len({k.cache_dir for k in kubes}) == 3  # each its own
kubes[0].close()
print(kubes[1].cache_dir.parent)
"""


def test_every_kube_cache_is_gone_when_the_test_process_exits(tmp_path: Path) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    res = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True,
                         text=True, env={**os.environ, "TMPDIR": str(scratch)}, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert Path(res.stdout.strip()).is_relative_to(scratch)  # made where the test looks
    assert sorted(p.name for p in scratch.iterdir()) == []
