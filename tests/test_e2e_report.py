"""The e2e report command: figures the real-node tier wrote become docs/e2e.md's table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_report_renders_each_scenario_and_refuses_a_bad_file(tmp_path: Path) -> None:
    figures = {
        "sigkill": {"runs": 4, "steps": 60, "duplicates": 0, "lost": 0, "attempts": [1, 1, 2, 2],
                    "next_step_after_disruption_s": {"min": 0.5, "median": 0.7, "max": 5.6},
                    "affected_next_step_s": {"min": 4.9, "median": 5.1, "max": 5.6},
                    "handed_over": {"count": 0, "runs": []},
                    "lease_expired": {"count": 2, "runs": ["sigkill-0", "sigkill-3"],
                                      "claimed_after_s": {"min": 5.2, "median": 5.3, "max": 5.3},
                                      "gap_s": {"min": 0.1, "median": 0.2, "max": 0.2}}},
        "graceful": {"runs": 4, "steps": 60, "duplicates": 0, "lost": 0,
                     "attempts": [1, 1, 1, 1],
                     "handed_over": {"count": 2, "runs": ["graceful-1", "graceful-2"],
                                     "claimed_after_s": {"min": 0.3, "median": 0.3, "max": 0.4},
                                     "gap_s": {"min": 0.011, "median": 0.02, "max": 0.128}},
                     "lease_expired": {"count": 0, "runs": []}},
        "uninstall": {"agentruns": 41, "finalizers": 0},
        "scale-down": {"runs": 3, "steps": 45, "duplicates": 0, "lost": 0,
                       "attempts": [1, 1, 1]},
    }
    src = tmp_path / "figures.json"
    src.write_text(json.dumps(figures))
    out = tmp_path / "e2e.md"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.e2e_report", str(src), "--out",
                           str(out)], cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    assert "| worker SIGKILLed" in text and "4.90 s / 5.10 s / 5.60 s" in text
    assert "| scale-down by the operator" in text and "| 1, 1, 1 | - | - | 0 | 0 |" in text
    # Hand-overs apart from lease expiries, each with its times (issue 19).
    assert "| 0 | 2: 5.20 s / 5.30 s / 5.30 s; 0.10 s / 0.20 s / 0.20 s |" in text
    assert "| 2: 0.30 s / 0.30 s / 0.40 s; 0.01 s / 0.02 s / 0.13 s | 0 |" in text
    assert "the namespace went with its 41 finished AgentRuns" in text
    bad = subprocess.run([sys.executable, "-m", "benchmarks.e2e_report",
                          str(tmp_path / "missing.json")], cwd=ROOT, capture_output=True,
                         text=True, check=False)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
