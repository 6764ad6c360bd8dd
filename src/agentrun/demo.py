"""``agentrun demo``: the seed's story on one machine, with no cluster, no network and no key.

An agent migrates a "production" orders table in 12 model turns; two of its tool calls write to
production. A worker process is SIGKILLed in the middle of step 7 (its model call streaming), a
second worker resumes the run at step 7, and the demo prints the timeline and the write ledger:
each production write happened exactly once, and the resumed conversation passed the scripted
model's thinking-signature check (it was replayed byte for byte).

Each invocation is on its own: its own pool (``demo-TAG``), production schema
(``demo_production_TAG``) and worker ids, so a leftover run in another pool, a worker started by
hand or a second demo at the same moment can neither claim its run nor write to its ledger. It
has one deadline (``--timeout``), removes its temporary directory however it ends, and when it
is interrupted (Ctrl-C) or runs out of time says in one line what it left in the database.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from agentrun.cli_format import short, summarize_payload, table, yes_no
from agentrun.demo_tools import SCHEMA, SCHEMA_ENV, drop_production, setup_production
from agentrun.errors import EXIT_TIMEOUT, AgentrunError
from agentrun.fake_anthropic import FakeAnthropicServer, builtin_scenario_path
from agentrun.manifests import AgentSpec, ThinkingSpec
from agentrun.migrations import migrate
from agentrun.store import Run, Store, connect

TASK = "Add a region column to orders and backfill it."
KILL_AT_TURN = 6  # 0-based: the model call of step 7
LEASE_TTL = 3.0  # short, so the story fits in a minute; production default is 15 s
#: How long an interrupted demo gives a worker to stop on SIGTERM before it is SIGKILLed.
STOP_GRACE = 3.0


class DemoTimeout(AgentrunError):
    """The demo did not finish within its ``--timeout``."""

    exit_code = EXIT_TIMEOUT


@dataclass
class Proc:
    label: str
    popen: subprocess.Popen[bytes]
    log: Path


@dataclass
class Isolation:
    """What this invocation has to itself: a tag shared by its pool, schema and worker ids."""

    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:8])

    @property
    def pool(self) -> str:
        return f"demo-{self.tag}"

    @property
    def schema(self) -> str:
        return f"{SCHEMA}_{self.tag}"

    def worker_id(self, label: str) -> str:
        return f"{label}.demo-{self.tag}"


@dataclass
class Leftovers:
    """What the demo put in the database so far, for the line an interrupted demo prints."""

    iso: Isolation
    run_id: str | None = None
    schema: bool = False

    def line(self) -> str:
        parts: list[str] = []
        if self.run_id:
            parts.append(
                f"run {self.run_id} in pool {self.iso.pool}, which no worker claims "
                f"(agentrun cancel {self.run_id})"
            )
        if self.schema:
            parts.append(f"schema {self.iso.schema} (DROP SCHEMA {self.iso.schema} CASCADE)")
        return "left in the database: " + ("; ".join(parts) if parts else "nothing")


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel SIGTERM the child when this process dies, however
    it dies: a demo that is SIGKILLed (the OOM killer, ``kill -9``) gets no chance to stop its
    workers, and they would idle in their pool for ever. Linux only (``prctl``); elsewhere
    None. Bound before the fork: the child calls one C function and touches no Python lock."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # it died before the line above: nothing would signal us
            os.kill(os.getpid(), signal.SIGTERM)

    return arm


#: <linux/prctl.h>: signal this process when its parent thread exits.
PR_SET_PDEATHSIG = 1


def _spawn(label: str, iso: Isolation, env: dict[str, str], logdir: Path) -> Proc:
    log = logdir / f"{label}.log"
    cmd = [
        sys.executable,
        "-m",
        "agentrun",
        "worker",
        "--pool",
        iso.pool,
        "--tools",
        "agentrun.demo_tools",
        "--lease-ttl",
        str(LEASE_TTL),
        "--poll-interval",
        "1",
        "--health-port",
        "-1",
        "--control-port",
        "-1",
        "--concurrency",
        "1",
        "--worker-id",
        iso.worker_id(label),
    ]
    with open(log, "wb") as out:
        # The parent *thread* counts for PR_SET_PDEATHSIG: this runs on the demo's main thread
        # (the event loop's), which lives as long as the process.
        popen = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                 preexec_fn=_die_with_parent())
    return Proc(label, popen, log)


def _stop(proc: Proc, grace: float = 10) -> None:
    if proc.popen.poll() is None:
        proc.popen.send_signal(signal.SIGTERM)
        try:
            proc.popen.wait(grace)
        except subprocess.TimeoutExpired:
            proc.popen.kill()
            proc.popen.wait()


def _last_line(log: Path) -> str:
    try:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return short(lines[-1], 200) if lines else ""


async def _wait_for(store: Store, run_id: Any, pred: Any, worker: Proc) -> Run:
    """The run once ``pred`` holds; the demo's deadline bounds the wait. A worker that exits
    meanwhile ends it at once, with the last line of its log."""
    while True:
        run = await store.get_run(run_id)
        if pred(run):
            return run
        code = worker.popen.poll()
        if code is not None:
            raise AgentrunError(
                f"demo: {worker.label} exited with code {code} while run {run_id} was "
                f"{run.status} at step {run.next_seq}: {_last_line(worker.log) or 'no output'}"
            )
        await asyncio.sleep(0.05)


def _say(text: str) -> None:
    print(text, flush=True)


async def run_demo(model: str | None, deadline: float) -> int:
    from agentrun.embedded import database_url

    started = time.monotonic()
    iso = Isolation()
    left = Leftovers(iso)
    procs: list[Proc] = []
    logdir: Path | None = None
    url = ""

    def clean_up(grace: float) -> None:
        """Stop the workers and remove the temporary directory, on every way out (idempotent;
        _story stops the scripted model)."""
        nonlocal logdir
        for p in procs:
            _stop(p, grace)
        if logdir is not None:
            shutil.rmtree(logdir, ignore_errors=True)
            logdir = None

    try:
        async with asyncio.timeout(deadline):
            url = database_url().url
            async with await connect(url, statement_timeout=0) as conn:
                await migrate(conn)
            left.schema = True  # before: a Ctrl-C in the middle may leave it half made
            await asyncio.to_thread(setup_production, url, iso.schema)
            logdir = Path(tempfile.mkdtemp(prefix="agentrun-demo-"))
            final, steps, killed_at = await _story(model, url, iso, left, procs, logdir)
    except TimeoutError:
        last = procs[-1] if procs else None
        where = f"; {last.label}'s log ends: {_last_line(last.log)}" if last else ""
        clean_up(STOP_GRACE)
        raise DemoTimeout(
            f"demo: not finished after {deadline:g}s (--timeout){where}; {left.line()}"
        ) from None
    except (asyncio.CancelledError, KeyboardInterrupt):  # Ctrl-C
        clean_up(STOP_GRACE)
        print(
            "agentrun demo: interrupted; its workers are stopped and its temporary files "
            f"removed; {left.line()}",
            file=sys.stderr,
            flush=True,
        )
        raise
    except BaseException:
        clean_up(STOP_GRACE)
        raise
    clean_up(10)
    code = _report(url, iso, final, steps, killed_at, started)
    # The ledger is printed and checked: this demo's production schema goes (the run stays).
    drop_production(url, iso.schema)
    return code


async def _story(
    model: str | None, url: str, iso: Isolation, left: Leftovers, procs: list[Proc],
    logdir: Path,
) -> tuple[Run, list[Any], float]:
    real_api = model is not None and bool(os.environ.get("ANTHROPIC_API_KEY"))
    env = {
        **os.environ,
        "AGENTRUN_DATABASE_URL": url,
        "AGENTRUN_DEMO_PRODUCTION_URL": url,
        SCHEMA_ENV: iso.schema,
    }
    fake: FakeAnthropicServer | None = None
    try:
        if not real_api:
            scenario = builtin_scenario_path("demo_migration")
            assert scenario is not None, "the demo scenario ships with agentrun"
            fake = FakeAnthropicServer(scenario)
            fake.__enter__()
            env.update(ANTHROPIC_BASE_URL=fake.base_url, ANTHROPIC_API_KEY="demo-no-key-needed")
        return await _play(model, real_api, iso, left, procs, logdir, env, fake)
    finally:
        if fake is not None:
            fake.__exit__(None, None, None)


async def _play(
    model: str | None, real_api: bool, iso: Isolation, left: Leftovers, procs: list[Proc],
    logdir: Path, env: dict[str, str], fake: FakeAnthropicServer | None,
) -> tuple[Run, list[Any], float]:
    agent = AgentSpec(
        model=model or "claude-sonnet-4-5",
        system="You migrate production databases carefully, one verified step at a time.",
        tools=["read_schema", "count_rows", "write_production", "check_migration"],
        thinking=ThinkingSpec(budget_tokens=2048),
    )
    async with await Store.open(env["AGENTRUN_DATABASE_URL"], max_size=2) as store:
        run, _ = await store.create_run(TASK, agent, pool=iso.pool, max_steps=20)
        left.run_id = str(run.id)
        _say(f"run {run.id}: {TASK!r}")
        source = f"the real API, {agent.model}" if real_api else "scripted (fake-anthropic)"
        _say(f"  model: {source}; pool {iso.pool}, production schema {iso.schema}")
        procs.append(_spawn("worker-1", iso, env, logdir))
        # Step 7 starts when seq 2*6 is the next one to write; kill once its stream is flowing.
        await _wait_for(store, run.id, lambda r: r.next_seq >= 2 * KILL_AT_TURN, procs[0])
        if fake is not None:
            while not any(  # noqa: ASYNC110 - polling the fake server thread's log
                e.get("turn") == KILL_AT_TURN and e.get("stream") for e in fake.requests()
            ):
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)  # a few chunks into the streamed turn
        procs[0].popen.send_signal(signal.SIGKILL)
        procs[0].popen.wait()
        killed_at = time.time()
        _say(
            f"  ✗ SIGKILL worker-1 (pid {procs[0].popen.pid}) during step 7, "
            "its model call streaming"
        )
        procs.append(_spawn("worker-2", iso, env, logdir))
        final = await _wait_for(store, run.id, lambda r: r.finished, procs[1])
        steps = await store.steps(run.id)
    return final, steps, killed_at


#: The widest a summary cell of the demo's timeline gets; longer ones end in an ellipsis.
SUMMARY_WIDTH = 80
STATEMENT_WIDTH = 70


def _report(
    url: str, iso: Isolation, run: Run, steps: list[Any], killed_at: float, started: float
) -> int:
    labels = {iso.worker_id(n): n for n in ("worker-1", "worker-2")}
    _say("")
    _say("timeline (step = model turn; each committed before its tools ran)")
    rows: list[list[str]] = []
    turn = 0
    shown_kill = False
    kill_row = -1
    for s in steps:
        if not shown_kill and s.created_at.timestamp() > killed_at:
            kill_row = len(rows)
            shown_kill = True
        if s.kind == "model_turn":
            turn += 1
        step = str(turn) if s.kind == "model_turn" else ""
        rows.append([
            str(s.seq), step, labels.get(s.worker, s.worker), s.kind,
            short(summarize_payload(s.payload), SUMMARY_WIDTH),
        ])
    lines = table(["SEQ", "STEP", "WORKER", "KIND", "SUMMARY"], rows).splitlines()
    for i, line in enumerate(lines):
        if i - 1 == kill_row:
            _say(
                "  ---  worker-1 SIGKILLed here; worker-2 resumes after the lease "
                f"({LEASE_TTL:.0f}s) from the step log, replaying it verbatim ---"
            )
        _say(f"  {line}")
    with psycopg.connect(url) as conn:
        ledger = conn.execute(
            sql.SQL(
                "SELECT seq, statement, rows_affected, pid FROM {}.write_ledger "
                "WHERE run_id = %s ORDER BY seq"
            ).format(sql.Identifier(iso.schema)),
            (str(run.id),),
        ).fetchall()
    _say("")
    _say("production write ledger (one row per write that actually happened)")
    for seq, stmt, nrows, pid in ledger:
        _say(f"  seq {seq:>2}  pid {pid}  {nrows:>5} rows  {short(stmt, STATEMENT_WIDTH)}")
    statements = [row[1] for row in ledger]
    once = len(statements) == 2 and len(set(statements)) == 2
    contiguous = [s.seq for s in steps] == list(range(len(steps)))
    workers = sorted({labels.get(s.worker, s.worker) for s in steps})
    _say("")
    _say(
        f"run {run.status}: {turn} model turns, {len(steps)} steps (contiguous: "
        f"{yes_no(contiguous)}), written by {', '.join(workers)}"
    )
    _say(f"each production write happened exactly once: {yes_no(once)}")
    if run.result:
        _say(f"result: {short(run.result, 160)}")
    _say(
        f"demo finished in {time.monotonic() - started:.1f}s; the run stays in the store "
        f"(agentrun steps {run.id}), its production schema {iso.schema} is dropped"
    )
    ok = run.status == "succeeded" and once and contiguous and workers == ["worker-1", "worker-2"]
    return 0 if ok else 1
