"""Seeded chaos soak: many runs mixing every tool class, workers killed at random, PostgreSQL
restarted now and then, then a checker.

    python benchmarks/soak.py --runs 40 --seconds 120 --seed 7 [--pg-restarts 2]
    python benchmarks/soak.py --runs 40 --seconds 36000 --continuous --pg-restarts 20  # a night

Runs use the test tools in tests/tool_modules/ledger_tools.py, which write an effect ledger.
Workers are SIGKILLed (and now and then SIGTERMed) at seeded random moments and replaced; a
worker that exits by itself is replaced too, as Kubernetes would. Runs whose irreversible call has
an unknown outcome are decided by a scripted on-call human who looks at the ledger (it happened:
reject the retry; it did not: approve it). ``--continuous`` keeps ``--runs`` runs unfinished for
as long as the killing goes on (without it the soak stops killing once every run has finished).

Unless ``--database-url`` is given, the soak runs its own PostgreSQL server (own_pg.py: initdb in a
temporary directory, a free port), which ``--pg-restarts N`` stops (``pg_ctl -m fast``) and starts
again N times at seeded moments, down for a seeded 0.5-3 s each time; the server is stopped by
its pid at the end, whatever happened. Workers must ride the outages out by themselves. A worker
started during an outage exits 3 (database unreachable) and is replaced; any other exit that the
soak did not cause is counted as a worker crash.

Then the checker reads the database and reports runs finished, steps, kills, SIGTERMs, PostgreSQL
restarts, duplicate effects, lost steps and stuck runs; it exits non-zero if any duplicate, lost
step, stuck run or worker crash is found. ``--check-only --database-url URL`` runs only the checker.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
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
from psycopg_pool import PoolTimeout

sys.path.insert(0, str(Path(__file__).resolve().parent))
from own_pg import OwnPostgres

from agentrun.fake_anthropic import FakeAnthropicServer
from agentrun.manifests import AgentSpec
from agentrun.store import TERMINAL_STATUSES, Store

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
#: What a database outage looks like to the soak's own client.
DB_ERRORS = (psycopg.OperationalError, PoolTimeout, OSError)
#: Worker logs kept (the oldest are removed: a night's soak starts thousands of workers).
KEEP_LOGS = 200


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
    pg_restarts: int = 0
    outage_s: float = 0.0
    decisions: int = 0
    workers_started: int = 0
    refused_during_outage: int = 0  # exit 3: started while the database was down
    worker_crashes: int = 0  # any other exit the soak did not cause
    duplicate_effects: int = 0
    lost_steps: int = 0
    duplicate_turns: int = 0
    stuck: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (
            self.duplicate_effects
            or self.lost_steps
            or self.duplicate_turns
            or self.stuck
            or self.worker_crashes
        )


def check(url: str, report: Report | None = None) -> Report:
    """Read the database and count what must never happen (set-based: a night's soak leaves tens
    of thousands of runs)."""
    r = report or Report()
    with psycopg.connect(url) as conn:
        conn.execute(ledger_schema())  # no ledger yet: no effects (IF NOT EXISTS, rolled back)
        row = conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE status = 'succeeded'),"
            " count(*) FILTER (WHERE status NOT IN ('succeeded', 'failed', 'cancelled'))"
            " FROM agent_run"
        ).fetchone()
        r.runs, r.succeeded, r.stuck = row if row else (0, 0, 0)
        for rid, status in conn.execute(
            "SELECT id, status FROM agent_run"
            " WHERE status NOT IN ('succeeded', 'failed', 'cancelled') LIMIT 20"
        ):
            r.problems.append(f"run {rid}: stuck in {status}")
        row = conn.execute("SELECT count(*) FROM agent_step").fetchone()
        r.steps = row[0] if row else 0
        # Contiguous from 0: n steps, lowest 0, highest n - 1 (the primary key forbids repeats).
        for rid, seqs in conn.execute(
            "SELECT run_id, array_agg(seq ORDER BY seq) FROM agent_step GROUP BY run_id"
            " HAVING min(seq) <> 0 OR max(seq) <> count(*) - 1"
        ):
            r.lost_steps += 1
            r.problems.append(f"run {rid}: seqs not contiguous: {seqs}")
        for (rid,) in conn.execute(
            "SELECT DISTINCT run_id FROM ("
            " SELECT run_id FROM agent_step WHERE kind = 'model_turn'"
            " GROUP BY run_id, payload::text HAVING count(*) > 1) twice"
        ):
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


async def unfinished(store: Store) -> int:
    async with store.pool.connection() as conn:
        cur = await conn.execute(
            "SELECT count(*) FROM agent_run WHERE status <> ALL(%s)", (list(TERMINAL_STATUSES),)
        )
        row = await cur.fetchone()
    return int(row[0]) if row else 0


class _Fleet:
    """The soak's worker processes: started, signalled and reaped by pid."""

    def __init__(self, env: dict[str, str], logdir: Path, concurrency: int, report: Report):
        self.env = env
        self.logdir = logdir
        self.concurrency = concurrency
        self.report = report
        self.procs: list[subprocess.Popen[bytes]] = []
        self.signalled: set[int] = set()  # pids the soak itself signalled
        self.accounted: set[int] = set()  # pids whose exit has been counted
        self.names: dict[int, str] = {}

    def spawn(self) -> None:
        n = len(self.procs)
        with open(self.logdir / f"worker-{n}.log", "wb") as log:
            proc = subprocess.Popen(
                [
                    sys.executable, "-m", "agentrun", "worker",
                    "--tools", str(TOOLS),
                    "--worker-id", f"soak-{n}",
                    "--lease-ttl", "2",
                    "--poll-interval", "0.5",
                    "--health-port", "-1",
                    "--control-port", "-1",
                    "--concurrency", str(self.concurrency),
                ],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        self.procs.append(proc)
        self.names[proc.pid] = f"soak-{n}"
        self.report.workers_started += 1
        old = n - KEEP_LOGS
        if old >= 0 and self.procs[old].poll() is not None:
            (self.logdir / f"worker-{old}.log").unlink(missing_ok=True)

    def live(self) -> list[subprocess.Popen[bytes]]:
        return [p for p in self.procs if p.poll() is None]

    def hit(self, victim: subprocess.Popen[bytes], sig: signal.Signals) -> None:
        self.signalled.add(victim.pid)
        victim.send_signal(sig)

    def top_up(self, want: int) -> None:
        """Count the exits the soak did not cause, and start workers until ``want`` are alive."""
        for p in self.procs:
            if p.returncode is None or p.pid in self.accounted or p.pid in self.signalled:
                continue
            self.accounted.add(p.pid)
            if p.returncode == 3:  # "database unreachable" at start: an outage
                self.report.refused_during_outage += 1
            else:
                self.report.worker_crashes += 1
                self.report.problems.append(
                    f"worker {self.names[p.pid]} exited {p.returncode} by itself (log: "
                    f"{self.logdir / (self.names[p.pid].replace('soak', 'worker') + '.log')})"
                )
        while len(self.live()) < want:
            self.spawn()

    def stop_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


async def soak(
    url: str,
    runs: int,
    seconds: float,
    seed: int,
    logdir: Path,
    *,
    delay_ms: int = 30,
    concurrency: int = 4,
    workers: int = 2,
    pg: OwnPostgres | None = None,
    pg_restarts: int = 0,
    continuous: bool = False,
    calm_s: float = 90,
    progress: Any = None,
) -> Report:
    """Kill workers for ``seconds`` (restarting ``pg`` ``pg_restarts`` times), let every run
    finish, then check. ``url`` must be a migrated database with no runs; with ``pg_restarts``,
    it must be on ``pg``."""
    if pg_restarts and pg is None:
        raise ValueError("restarting PostgreSQL needs the soak's own server (pg)")
    rng = random.Random(seed)
    report = Report()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(ledger_schema())
    path = logdir / "soak.yaml"
    path.write_text(yaml.safe_dump(scenario(delay_ms=delay_ms)))
    # Seeded moments for the restarts, in the first 60% of the killing, so that runs are still
    # going on around them and the killing goes on after them.
    restart_at = sorted(rng.uniform(0.1, 0.6) * seconds for _ in range(pg_restarts))
    outage: asyncio.Task[None] | None = None
    store = await Store.open(url, max_size=4)
    submitted = 0
    say = progress or (lambda _msg: None)

    async def submit(n: int) -> None:
        nonlocal submitted
        for _ in range(n):
            await store.create_run(f"soak run {submitted}", AGENT, max_attempts=50)
            submitted += 1

    async def restart(down_s: float) -> None:
        assert pg is not None
        t0 = time.monotonic()
        await asyncio.to_thread(pg.stop)
        await asyncio.sleep(down_s)
        await asyncio.to_thread(pg.start)
        report.pg_restarts += 1
        report.outage_s += time.monotonic() - t0
        say(f"PostgreSQL restarted ({report.pg_restarts}/{pg_restarts}), down {down_s:.1f} s")

    def db_up() -> bool:
        return outage is None or outage.done()

    with FakeAnthropicServer(path) as srv:
        env = {
            **os.environ,
            "AGENTRUN_DATABASE_URL": url,
            "ANTHROPIC_BASE_URL": srv.base_url,
            "ANTHROPIC_API_KEY": "soak",
        }
        fleet = _Fleet(env, logdir, concurrency, report)
        try:
            await submit(runs)
            fleet.top_up(workers)
            t_start = time.monotonic()
            deadline = t_start + seconds
            last_note = t_start
            while time.monotonic() < deadline:
                await asyncio.sleep(rng.uniform(1.0, 4.0))
                if restart_at and time.monotonic() - t_start >= restart_at[0] and db_up():
                    restart_at.pop(0)
                    outage = asyncio.create_task(restart(rng.uniform(0.5, 3.0)))
                live = fleet.live()
                if live:
                    victim = rng.choice(live)
                    if rng.random() < 0.8:
                        fleet.hit(victim, signal.SIGKILL)
                        report.kills += 1
                    else:
                        fleet.hit(victim, signal.SIGTERM)
                        report.terms += 1
                    fleet.spawn()
                fleet.top_up(workers)
                if not db_up():
                    continue  # the soak's own reads wait for the database like everyone's
                try:
                    report.decisions += await decide_waiting(store, url)
                    left = await unfinished(store)
                    if continuous and left < runs:
                        await submit(runs - left)
                except DB_ERRORS as exc:
                    say(f"soak: database error ({type(exc).__name__}); going on")
                    continue
                if time.monotonic() - last_note > 60:
                    last_note = time.monotonic()
                    say(
                        f"soak: {time.monotonic() - t_start:.0f} s, {report.kills} kills, "
                        f"{report.terms} SIGTERMs, {report.pg_restarts} PostgreSQL restarts, "
                        f"{submitted} runs submitted, {left} unfinished"
                    )
                if not left and not restart_at and not continuous:
                    break
            if outage is not None:
                await outage
            # Calm: no more kills; let every run finish, answering approvals as they come.
            calm = time.monotonic() + calm_s
            while time.monotonic() < calm:
                fleet.top_up(workers)
                try:
                    report.decisions += await decide_waiting(store, url)
                    if not await unfinished(store):
                        break
                except DB_ERRORS:
                    pass
                await asyncio.sleep(0.5)
            fleet.top_up(0)  # count any last exits
        finally:
            if outage is not None and not outage.done():
                with contextlib.suppress(Exception):
                    await outage
            fleet.stop_all()
            await store.close()
    return check(url, report)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--runs", type=int, default=40, help="runs (in flight, with --continuous)")
    ap.add_argument("--seconds", type=float, default=120, help="how long to keep killing")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument(
        "--pg-restarts",
        type=int,
        default=2,
        help="PostgreSQL restarts during the killing (default 2; 0 for none)",
    )
    ap.add_argument(
        "--continuous",
        action="store_true",
        help="keep --runs runs unfinished until --seconds is over (for a long soak)",
    )
    ap.add_argument("--workers", type=int, default=2, help="worker processes kept alive")
    ap.add_argument("--concurrency", type=int, default=4, help="runs per worker")
    ap.add_argument("--delay-ms", type=int, default=30, help="scripted model latency per turn")
    ap.add_argument(
        "--calm",
        type=float,
        default=600,
        help="after the killing, the longest wait for every run to finish (default 600 s)",
    )
    ap.add_argument(
        "--database-url",
        help="a migrated database with no runs yet, on a server the soak must not restart "
        "(needs --pg-restarts 0; default: the soak's own server)",
    )
    ap.add_argument("--check-only", action="store_true", help="only run the checker")
    args = ap.parse_args()
    if args.check_only:
        if not args.database_url:
            ap.error("--check-only needs --database-url")
        report = check(args.database_url)
        return _print(report)
    if args.database_url and args.pg_restarts:
        ap.error("--pg-restarts needs the soak's own PostgreSQL: drop --database-url, or pass 0")
    t0 = time.monotonic()
    # A worker SIGKILLed while sending a request makes the scripted server (in this process) log
    # a ConnectionResetError with its traceback: expected here, and noise.
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)

    def say(msg: str) -> None:
        print(f"[{time.monotonic() - t0:7.1f}s] {msg}", flush=True)

    with contextlib.ExitStack() as stack:
        pg: OwnPostgres | None = None
        if args.database_url:
            url = args.database_url
        else:
            pg = stack.enter_context(OwnPostgres(settings={"max_connections": "200"}))
            say(f"own PostgreSQL server on port {pg.port} (pid {pg.pid}), data in {pg.root}")
            with psycopg.connect(pg.url(), autocommit=True) as conn:
                conn.execute("CREATE DATABASE agentrun_soak")
            url = pg.url("agentrun_soak")
        subprocess.run(
            [sys.executable, "-m", "agentrun", "migrate"],
            check=True,
            env={**os.environ, "AGENTRUN_DATABASE_URL": url},
            stdout=subprocess.DEVNULL,
        )
        logdir = Path(tempfile.mkdtemp(prefix="agentrun-soak-"))
        say(f"worker logs in {logdir}")
        report = asyncio.run(
            soak(
                url,
                args.runs,
                args.seconds,
                args.seed,
                logdir,
                delay_ms=args.delay_ms,
                concurrency=args.concurrency,
                workers=args.workers,
                pg=pg,
                pg_restarts=args.pg_restarts,
                continuous=args.continuous,
                calm_s=args.calm,
                progress=say,
            )
        )
        say(f"soak done in {time.monotonic() - t0:.0f} s")
        return _print(report)


def _print(report: Report) -> int:
    for key, value in asdict(report).items():
        if key != "problems":
            print(f"{key:22} {round(value, 1) if isinstance(value, float) else value}")
    for problem in report.problems[:50]:
        print(f"PROBLEM: {problem}")
    print("soak: OK" if report.ok else "soak: FAILED")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
