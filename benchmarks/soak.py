"""Seeded chaos soak: many runs mixing every tool class, workers killed at random, then a checker.

    python benchmarks/soak.py --runs 40 --seconds 120 --seed 7 [--database-url URL]

Runs use the test tools in tests/tool_modules/ledger_tools.py, which write an effect ledger.
Workers are SIGKILLed (and now and then SIGTERMed) at seeded random moments and replaced. Runs
whose irreversible call has an unknown outcome are decided by a scripted on-call human who looks
at the ledger (it happened: reject the retry; it did not: approve it). Then the checker reads the
database and reports runs finished, steps, kills, duplicate effects, lost steps and stuck runs;
it exits non-zero if any duplicate, lost step or stuck run is found.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import yaml

from agentrun.fake_anthropic import FakeAnthropicServer
from agentrun.manifests import AgentSpec
from agentrun.store import Store

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tests" / "tool_modules" / "ledger_tools.py"
AGENT = AgentSpec(
    model="claude-sonnet-4-5",
    system="Soak.",
    tools=["look", "set_flag", "send_email", "drop_table", "reserve", "release"],
)
#: One conversation: every tool class, twice over, then an answer.
CALLS = [
    ("look", {"what": "a"}),
    ("set_flag", {"value": "x"}),
    ("send_email", {"to": "a@x"}),
    ("reserve", {"item": "r1"}),
    ("drop_table", {"table": "t1"}),
    ("look", {"what": "b"}),
    ("send_email", {"to": "b@x"}),
    ("set_flag", {"value": "y"}),
]
EFFECTS_PER_RUN = {"send_email": 2, "drop_table": 1, "reserve:r1": 1}


def scenario(delay_ms: int) -> dict[str, Any]:
    turns = [
        {"content": [{"thinking": f"call {i}"}, {"tool_use": {"name": n, "input": a}}]}
        for i, (n, a) in enumerate(CALLS)
    ]
    turns.append({"content": [{"text": "soak run done"}]})
    return {"name": "soak", "delay_ms": delay_ms, "scripts": [{"name": "soak", "turns": turns}]}


def ledger_schema() -> str:
    source = TOOLS.read_text()
    return source.split('SCHEMA = """', 1)[1].split('"""', 1)[0]


@dataclass
class Report:
    runs: int = 0
    succeeded: int = 0
    steps: int = 0
    kills: int = 0
    terms: int = 0
    decisions: int = 0
    duplicate_effects: int = 0
    lost_steps: int = 0
    duplicate_turns: int = 0
    stuck: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.duplicate_effects or self.lost_steps or self.duplicate_turns or self.stuck)


def check(url: str, report: Report | None = None) -> Report:
    """Read the database and count what must never happen."""
    r = report or Report()
    with psycopg.connect(url) as conn:
        conn.execute(ledger_schema())  # no ledger yet: no effects (IF NOT EXISTS, rolled back)
        runs = conn.execute("SELECT id, status FROM agent_run").fetchall()
        r.runs = len(runs)
        r.succeeded = sum(1 for _, s in runs if s == "succeeded")
        r.stuck = sum(1 for _, s in runs if s not in ("succeeded", "failed", "cancelled"))
        for rid, _ in runs:
            seqs = [
                s
                for (s,) in conn.execute(
                    "SELECT seq FROM agent_step WHERE run_id = %s ORDER BY seq", (rid,)
                )
            ]
            r.steps += len(seqs)
            if seqs != list(range(len(seqs))):
                r.lost_steps += 1
                r.problems.append(f"run {rid}: seqs not contiguous: {seqs}")
            turns = [
                t
                for (t,) in conn.execute(
                    "SELECT payload::text FROM agent_step"
                    " WHERE run_id = %s AND kind = 'model_turn'",
                    (rid,),
                )
            ]
            if len(turns) != len(set(turns)):
                r.duplicate_turns += 1
                r.problems.append(f"run {rid}: a model turn was committed twice")
        for tool, run_id, n in conn.execute(
            "SELECT tool, run_id, count(*) FROM ledger_effects GROUP BY tool, run_id"
        ):
            expected = EFFECTS_PER_RUN.get(tool, 1)
            if n > expected:
                r.duplicate_effects += n - expected
                r.problems.append(f"run {run_id}: {tool} happened {n} times (expected {expected})")
    return r


async def decide_waiting(store: Store, url: str) -> int:
    """The scripted on-call human: look at the target, then approve or reject the retry."""
    decided = 0
    for run in await store.list_runs(status="waiting_approval", limit=1000):
        call = run.pending_call or {}
        with psycopg.connect(url) as conn:
            row = conn.execute(
                "SELECT count(*) FROM ledger_effects WHERE run_id = %s AND tool = %s",
                (str(run.id), call.get("tool")),
            ).fetchone()
        happened = bool(row and row[0])
        await store.decide(
            run.id,
            int(call["seq"]),
            "rejected" if happened else "approved",
            decided_by="soak-oncall",
            reason="checked the ledger",
        )
        decided += 1
    return decided


async def soak(
    url: str,
    runs: int,
    seconds: float,
    seed: int,
    logdir: Path,
    *,
    delay_ms: int = 30,
    concurrency: int = 4,
) -> Report:
    rng = random.Random(seed)
    report = Report()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(ledger_schema())
    path = logdir / "soak.yaml"
    path.write_text(yaml.safe_dump(scenario(delay_ms=delay_ms)))
    store = await Store.open(url, max_size=4)
    workers: list[subprocess.Popen[bytes]] = []
    with FakeAnthropicServer(path) as srv:
        env = {
            **os.environ,
            "AGENTRUN_DATABASE_URL": url,
            "ANTHROPIC_BASE_URL": srv.base_url,
            "ANTHROPIC_API_KEY": "soak",
        }

        def spawn() -> None:
            n = len(workers)
            log = open(logdir / f"worker-{n}.log", "wb")  # closed when the process ends
            workers.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "agentrun",
                        "worker",
                        "--tools",
                        str(TOOLS),
                        "--worker-id",
                        f"soak-{n}",
                        "--lease-ttl",
                        "2",
                        "--poll-interval",
                        "0.5",
                        "--health-port",
                        "-1",
                        "--concurrency",
                        str(concurrency),
                    ],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )

        try:
            for i in range(runs):
                await store.create_run(f"soak run {i}", AGENT, max_attempts=50)
            for _ in range(2):
                spawn()
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                await asyncio.sleep(rng.uniform(1.0, 4.0))
                report.decisions += await decide_waiting(store, url)
                live = [w for w in workers if w.poll() is None]
                if live:
                    victim = rng.choice(live)
                    if rng.random() < 0.8:
                        victim.send_signal(signal.SIGKILL)
                        report.kills += 1
                    else:
                        victim.send_signal(signal.SIGTERM)
                        report.terms += 1
                    spawn()
                unfinished = [r for r in await store.list_runs(limit=10000) if not r.finished]
                if not unfinished:
                    break
            # Calm: no more kills; let every run finish, answering approvals as they come.
            calm = time.monotonic() + 90
            while time.monotonic() < calm:
                report.decisions += await decide_waiting(store, url)
                if all(r.finished for r in await store.list_runs(limit=10000)):
                    break
                await asyncio.sleep(0.5)
        finally:
            for w in workers:
                if w.poll() is None:
                    w.kill()
                w.wait()
            await store.close()
    return check(url, report)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--seconds", type=float, default=120, help="how long to keep killing")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--database-url", help="a database with no runs yet (default: a throwaway one)")
    ap.add_argument("--check-only", action="store_true", help="only run the checker")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from throwaway_db import throwaway_database

    with contextlib.ExitStack() as stack:
        url = args.database_url or stack.enter_context(throwaway_database("agentrun_soak"))
        if args.check_only:
            report = check(url)
        else:
            subprocess.run(
                [sys.executable, "-m", "agentrun", "migrate"],
                check=True,
                env={**os.environ, "AGENTRUN_DATABASE_URL": url},
                stdout=subprocess.DEVNULL,
            )
            logdir = Path(tempfile.mkdtemp(prefix="agentrun-soak-"))
            report = asyncio.run(soak(url, args.runs, args.seconds, args.seed, logdir))
        for key, value in asdict(report).items():
            if key != "problems":
                print(f"{key:18} {value}")
        for problem in report.problems[:50]:
            print(f"PROBLEM: {problem}")
        print("soak: OK" if report.ok else "soak: FAILED")
        return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
