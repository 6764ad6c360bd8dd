"""``agentrun demo``: the seed's story on one machine, with no cluster, no network and no key.

An agent migrates a "production" orders table in 12 model turns; two of its tool calls write to
production. A worker process is SIGKILLed in the middle of step 7 (its model call streaming), a
second worker resumes the run at step 7, and the demo prints the timeline and the write ledger:
each production write happened exactly once, and the resumed conversation passed the scripted
model's thinking-signature check (it was replayed byte for byte).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from agentrun.cli_format import summarize_payload
from agentrun.demo_tools import SCHEMA, setup_production
from agentrun.fake_anthropic import FakeAnthropicServer, builtin_scenario_path
from agentrun.manifests import AgentSpec, ThinkingSpec
from agentrun.migrations import migrate
from agentrun.store import Run, Store, connect

TASK = "Add a region column to orders and backfill it."
KILL_AT_TURN = 6  # 0-based: the model call of step 7
LEASE_TTL = 3.0  # short, so the story fits in a minute; production default is 15 s


@dataclass
class Proc:
    label: str
    popen: subprocess.Popen[bytes]
    log: Path


def _spawn(label: str, env: dict[str, str], logdir: Path) -> Proc:
    log = logdir / f"{label}.log"
    cmd = [
        sys.executable,
        "-m",
        "agentrun",
        "worker",
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
        label,
    ]
    with open(log, "wb") as out:
        popen = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    return Proc(label, popen, log)


def _stop(proc: Proc) -> None:
    if proc.popen.poll() is None:
        proc.popen.send_signal(signal.SIGTERM)
        try:
            proc.popen.wait(10)
        except subprocess.TimeoutExpired:
            proc.popen.kill()
            proc.popen.wait()


async def _wait_for(store: Store, run_id: Any, pred: Any, within: float) -> Run:
    deadline = time.monotonic() + within
    while True:
        run = await store.get_run(run_id)
        if pred(run):
            return run
        if time.monotonic() > deadline:
            raise TimeoutError(f"run {run_id}: still {run.status} at step {run.next_seq}")
        await asyncio.sleep(0.05)


def _say(text: str) -> None:
    print(text, flush=True)


async def run_demo(model: str | None = None) -> int:
    from agentrun.embedded import database_url

    started = time.monotonic()
    url = database_url()
    async with await connect(url, statement_timeout=0) as conn:
        await migrate(conn)
    setup_production(url)
    real_api = model is not None and bool(os.environ.get("ANTHROPIC_API_KEY"))
    logdir = Path(tempfile.mkdtemp(prefix="agentrun-demo-"))
    procs: list[Proc] = []
    fake: FakeAnthropicServer | None = None
    try:
        env = {**os.environ, "AGENTRUN_DATABASE_URL": url, "AGENTRUN_DEMO_PRODUCTION_URL": url}
        if not real_api:
            scenario = builtin_scenario_path("demo_migration")
            assert scenario is not None, "the demo scenario ships with agentrun"
            fake = FakeAnthropicServer(scenario)
            fake.__enter__()
            env.update(ANTHROPIC_BASE_URL=fake.base_url, ANTHROPIC_API_KEY="demo-no-key-needed")
        agent = AgentSpec(
            model=model or "claude-sonnet-4-5",
            system="You migrate production databases carefully, one verified step at a time.",
            tools=["read_schema", "count_rows", "write_production", "check_migration"],
            thinking=ThinkingSpec(budget_tokens=2048),
        )
        async with await Store.open(url, max_size=2) as store:
            run, _ = await store.create_run(TASK, agent, pool="default", max_steps=20)
            _say(f"run {run.id}: {TASK!r}")
            source = f"the real API, {agent.model}" if real_api else "scripted (fake-anthropic)"
            _say(f"  model: {source}; worker logs in {logdir}")
            procs.append(_spawn("worker-1", env, logdir))
            # Step 7 starts when seq 2*6 is the next one to write; kill once its stream is flowing.
            await _wait_for(store, run.id, lambda r: r.next_seq >= 2 * KILL_AT_TURN, 60)
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
            procs.append(_spawn("worker-2", env, logdir))
            final = await _wait_for(store, run.id, lambda r: r.finished, 90)
            steps = await store.steps(run.id)
        for p in procs:
            _stop(p)
        return _report(url, final, steps, killed_at, started)
    finally:
        for p in procs:
            if p.popen.poll() is None:
                p.popen.kill()
                p.popen.wait()
        if fake is not None:
            fake.__exit__(None, None, None)


def _report(url: str, run: Run, steps: list[Any], killed_at: float, started: float) -> int:
    _say("")
    _say("timeline (step = model turn; each committed before its tools ran)")
    _say(f"  {'seq':>3}  {'step':>4}  {'worker':8}  {'kind':11}  summary")
    turn = 0
    shown_kill = False
    for s in steps:
        if not shown_kill and s.created_at.timestamp() > killed_at:
            _say(
                "  ---  ----  worker-1 SIGKILLed here; worker-2 resumes after the lease "
                f"({LEASE_TTL:.0f}s) from the step log, replaying it verbatim ---"
            )
            shown_kill = True
        if s.kind == "model_turn":
            turn += 1
        step = str(turn) if s.kind == "model_turn" else ""
        _say(
            f"  {s.seq:>3}  {step:>4}  {s.worker:8}  {s.kind:11}  "
            f"{summarize_payload(s.payload)[:80]}"
        )
    with psycopg.connect(url) as conn:
        ledger = conn.execute(
            f"SELECT seq, statement, rows_affected, pid FROM {SCHEMA}.write_ledger ORDER BY seq"  # noqa: S608 - constant
        ).fetchall()
    _say("")
    _say("production write ledger (one row per write that actually happened)")
    for seq, stmt, rows, pid in ledger:
        _say(f"  seq {seq:>2}  pid {pid}  {rows:>5} rows  {stmt}")
    statements = [row[1] for row in ledger]
    once = len(statements) == 2 and len(set(statements)) == 2
    contiguous = [s.seq for s in steps] == list(range(len(steps)))
    workers = sorted({s.worker for s in steps})
    _say("")
    _say(
        f"run {run.status}: {turn} model turns, {len(steps)} steps (contiguous: {contiguous}), "
        f"written by {', '.join(workers)}"
    )
    _say(f"each production write happened exactly once: {'yes' if once else 'NO'}")
    if run.result:
        _say(f"result: {' '.join(run.result.split())[:160]}")
    _say(f"demo finished in {time.monotonic() - started:.1f}s")
    ok = run.status == "succeeded" and once and contiguous and workers == ["worker-1", "worker-2"]
    return 0 if ok else 1
