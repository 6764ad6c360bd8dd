"""What a deploy costs: the end-to-end tier's figures as a Markdown report.

    .venv/bin/pytest -m e2e -n 0 tests/e2e        # writes e2e-figures.json ($AGENTRUN_E2E_FIGURES)
    python -m benchmarks.e2e_report FIGURES.json [--out docs/e2e.md]

The figures are what the tier measured while it checked its guarantees (a real node, the image
built from the Dockerfile, the chart installed with Helm): per scenario, the runs broken
mid-flight, their steps and emails, duplicates and lost steps (always 0, or the tier fails), the
attempts each run ended with, the time from the disruption to each run's next committed step,
and, from the store's record of every change of hands (run_handover, migration 0009), the
graceful hand-overs apart from the lease expiries, with their times.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

TITLES = {
    "sigkill": "worker SIGKILLed (the container's process, by containerd)",
    "force": "worker pod force-deleted (`--grace-period=0 --force`)",
    "graceful": "worker pod deleted (preStop drain, then SIGTERM)",
    "upgrade": "`helm upgrade` rolling the worker pods",
    "operator": "operator pod force-deleted",
    "pgrestart": "PostgreSQL restarted (immediate shutdown: a crash to its clients)",
    "pgcut": "PostgreSQL unreachable from every pod, then back",
    "drain": "`kubectl drain` of the node under the PodDisruptionBudget, then uncordon",
    "oom": "worker OOM-killed by the kernel",
    "scale-down": "scale-down by the operator: idle pods removed, the busy one kept",
}


def _spread(t: dict[str, float] | None) -> str:
    if not t:
        return "-"
    return f"{t['min']:.2f} s / {t['median']:.2f} s / {t['max']:.2f} s"


def _changes(c: dict[str, Any] | None) -> str:
    """A kind of change of hands: how many, then (min / median / max) the time from the
    disruption to the claim that took each run over, and from the release or the lease's end."""
    if not c or not c.get("count"):
        return "0"
    return (f"{c['count']}: {_spread(c.get('claimed_after_s'))}; "
            f"{_spread(c.get('gap_s'))}")


def render(figures: dict[str, dict[str, Any]]) -> str:
    lines = [
        "# What a deploy costs: agentrun on a real Kubernetes node",
        "",
        "Measured by the end-to-end tier (`pytest -m e2e -n 0 tests/e2e`; `python -m "
        "benchmarks.e2e_report`): a single-node Kubernetes 1.36 (kubelet, containerd, runc, a "
        "CNI bridge, memory cgroups) on 2 cores, the image built from the Dockerfile, the chart "
        "installed with Helm, two worker pods in each fixed pool, AgentRuns broken mid-flight "
        "(each 17 steps: 8 tool calls, pure, idempotent, non-idempotent with their idempotency "
        "key, and "
        "irreversible). Each run's steps are contiguous, each non-idempotent and irreversible "
        "call wrote exactly one effect, or the tier fails.",
        "",
        "| disruption | runs | steps | duplicates | lost | attempts | next step after it, all "
        "runs (min / median / max) | same, the runs the disrupted pod held | handed over: n: "
        "disruption → claim; release → claim | lease expired: n: disruption → claim; lease "
        "end → claim |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    scenarios = {name: f for name, f in figures.items() if "runs" in f}
    for name, f in scenarios.items():
        lines.append(
            f"| {TITLES.get(name, name)} | {f['runs']} | {f['steps']} | {f['duplicates']} | "
            f"{f['lost']} | {', '.join(str(a) for a in f['attempts'])} | "
            f"{_spread(f.get('next_step_after_disruption_s'))} | "
            f"{_spread(f.get('affected_next_step_s'))} | "
            f"{_changes(f.get('handed_over'))} | {_changes(f.get('lease_expired'))} |")
    lines += [
        "",
        "Hand-overs and lease expiries are the store's record of every claim that took a run "
        "over from a holder (`run_handover`, migration 0009), since the disruption: *handed "
        "over* when the holder released the run (its drain: the attempt is given back; the "
        "operator posts a Normal `HandedOver` Event), *lease expired* when the holder was still "
        "the owner and its lease ran out (a Warning `LeaseExpired`). The tier checks that each "
        "run's Events say the same as the store.",
        "",
        "The time is from the disruption to each run's first step committed after it, by the "
        "database's clock; it includes the scripted model's 0.7 s per turn (2.8 s in the pod "
        "deletion scenario and 5.6 s in the upgrade's, so that the runs outlive the seconds the "
        "kubelet takes to run the preStop drain, or the rollout to reach the old pods; at the "
        "normal pace they ended on the old pods, handed over never). A SIGKILL or an OOM "
        "kill waits for the lease to expire (5 s in the tier, `workers.*.leaseTtlSeconds`, 15 s "
        "by default); a graceful hand-over (pod deletion, rolling upgrade, drain) releases the "
        "runs at once and does not count an attempt.",
        "",
    ]
    if "uninstall" in figures:
        u = figures["uninstall"]
        lines += [
            f"Then the release uninstalled and its namespace deleted: the namespace went with its "
            f"{u.get('agentruns')} finished AgentRuns, none of which carried a finalizer "
            "(no operator was left to remove one).",
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("figures", help="the JSON the e2e tier wrote")
    ap.add_argument("--out", default="docs/e2e.md")
    args = ap.parse_args(argv)
    try:
        figures = json.loads(Path(args.figures).read_text())
    except (OSError, ValueError) as exc:
        print(f"e2e_report: {args.figures}: {exc}", file=sys.stderr)
        return 2
    Path(args.out).write_text(render(figures))
    print(f"wrote {args.out} ({len(figures)} scenarios)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
