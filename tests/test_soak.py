"""The seeded chaos soak (small in the process tier, large behind the slow marker), and proof that
its checker fails when a duplicate, a lost step, a dead-lettered healthy run or an odd payload
that reads back changed is planted.

The soaks restart PostgreSQL, so they run on a server of their own (benchmarks/own_pg.py), never
the machine's shared one; the server is stopped by its pid when the test ends, however it ends.
The tools' ledger (their "remote system") is a fresh database on the machine's server, which the
soak does not restart, as the soak command keeps it on a second server of its own.
The soak stops its workers by pid (SIGKILL ends a SIGSTOPped one too).
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from benchmarks.bench_tools import ODD_PAYLOADS
from benchmarks.own_pg import OwnPostgres, _alive
from benchmarks.soak import (
    AGENT,
    EFFECTS_PER_RUN,
    MIN_CALM_S,
    Report,
    _Fleet,
    check,
    decide_waiting,
    ledger_schema,
    model_text,
    odd_task,
    odd_turns,
    soak,
    trace,
)
from psycopg.types.json import Jsonb

from agentrun.migrations import migrate
from agentrun.store import Store

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def own_postgres() -> Iterator[OwnPostgres]:
    with OwnPostgres(settings={"max_connections": "200"}) as pg:
        with psycopg.connect(pg.url(), autocommit=True) as conn:
            conn.execute("CREATE DATABASE agentrun_soak")

        async def _migrate() -> None:
            async with await psycopg.AsyncConnection.connect(
                pg.url("agentrun_soak"), autocommit=True
            ) as conn:
                await migrate(conn)

        asyncio.run(_migrate())
        yield pg


@pytest.fixture
def ledger_url(empty_database_url: str) -> str:
    """The tools' ledger, on a server the soak does not restart."""
    return empty_database_url


async def _soak(
    pg: OwnPostgres,
    ledger_url: str,
    runs: int,
    seconds: float,
    pg_restarts: int,
    sigstop_rate: float = 0.15,
    odd_payloads: float = 0.1,
    seed: int = 11,
    **chaos: Any,
) -> Report:
    # Slow turns and few slots per worker, so the chaos lands in the middle of runs. Its logs
    # stay only if it failed (its problems.log is the evidence) or raised.
    logdir = Path(tempfile.mkdtemp(prefix="agentrun-soak-"))
    report = await soak(
        pg.url("agentrun_soak"),
        runs,
        seconds,
        seed=seed,
        logdir=logdir,
        delay_ms=400,
        concurrency=2,
        pg=pg,
        pg_restarts=pg_restarts,
        sigstop_rate=sigstop_rate,
        odd_payloads=odd_payloads,
        calm_s=MIN_CALM_S,  # ends as soon as every run has; longer only when one is stuck
        ledger_url=ledger_url,
        **chaos,
    )
    if report.ok:
        shutil.rmtree(logdir, ignore_errors=True)
    return report


async def test_small_seeded_soak_with_zombies_odd_payloads_and_postgres_restarts(
    own_postgres: OwnPostgres, ledger_url: str
) -> None:
    """The default maxAttempts, SIGKILLs, SIGTERMs, SIGSTOPped zombies, two PostgreSQL restarts
    and one odd-payload run of each kind: every healthy run succeeds (none dead-lettered), every
    odd one ends, exactly once per effect, and the odd ones read back as produced."""
    # With seed 11 and a share of 0.25, the first chaos step makes a zombie due (4 of the first
    # 10 draws do), which is made as soon as a worker holds runs.
    report = await _soak(
        own_postgres,
        ledger_url,
        runs=12,
        seconds=30,
        pg_restarts=2,
        sigstop_rate=0.25,
        odd_payloads=1 / 3,
    )
    print(report)
    assert report.zombies >= 1 and report.kills + report.terms >= 3
    assert report.zombie_runs_taken >= 1  # a zombie is stopped until others took its runs
    assert report.pg_restarts == own_postgres.restarts == 2
    assert report.odd_runs == 4  # one of each kind: nul, surrogates, unicode, huge
    assert report.dead_lettered == 0, report.problems  # a healthy run is never given up on
    assert report.failed == report.cancelled == report.stuck == 0, report.problems
    assert report.succeeded + report.odd_failed == report.runs == 12
    assert report.worker_crashes == 0, report.problems  # the workers rode everything out
    assert report.ok, report.problems
    # Every healthy run's 17 steps; 5 for an odd one that succeeded, fewer for one that failed.
    healthy = 8 * 17 + 5 * report.odd_succeeded
    assert healthy <= report.steps <= healthy + 4 * report.odd_failed


#: The per-slot mode, small: 3 slots, each on its own clock, until the 8th SIGKILL (the same for
#: exec'ed and forked worker lives, so the two runs compare).
PER_SLOT: dict[str, Any] = {
    "runs": 12,
    "seconds": 300,
    "pg_restarts": 0,
    "sigstop_rate": 0.1,
    "seed": 3,
    "workers": 3,
    "kill_every": 1.0,
    "kills": 8,
}


async def test_each_worker_slot_is_killed_on_a_clock_of_its_own_until_the_kill_target(
    own_postgres: OwnPostgres, ledger_url: str
) -> None:
    """--kill-every/--kills (the 10,000-kill soak's mode): three slots, each hit on its own
    seeded clock, so workers die independently; the chaos ends at exactly the kill target, and
    the checker still finds every run done exactly once. With seed 3 and a 0.1 zombie share,
    each slot's first turn is a SIGKILL (the draws are the slot's own, whatever the timing), and
    all three come before the eighth kill."""
    report = await _soak(own_postgres, ledger_url, **PER_SLOT, odd_payloads=0)
    print(report)
    assert report.kills == 8 == sum(report.kills_per_slot), report.kills_per_slot
    assert all(report.kills_per_slot), report.kills_per_slot  # each slot on its own clock
    # A kill waits until its worker holds runs (there are always pending ones here).
    assert 1 <= report.kills_holding_runs <= report.kills
    assert report.workers_started >= 3 + 8
    assert report.ok, report.problems
    assert report.succeeded == report.runs == 12


def _zygote_processes() -> list[int]:
    """Processes of benchmarks/zygote.py, its forked workers included (they keep its argv)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if b"benchmarks.zygote" in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return found


async def test_forked_worker_lives_are_killed_independently_and_nothing_outlives_the_soak(
    own_postgres: OwnPostgres, ledger_url: str
) -> None:
    """--fork-workers (how the 10,000-kill soak fits in 90 minutes on 2 cores): every worker life
    is forked from the zygote, which imported the worker's stack once; each is still a process
    of its own, SIGKILLed by its own pid while the others go on, and the checker finds every run
    done exactly once. When the soak ends, the zygote and every life it forked are gone. Its two
    PostgreSQL restarts come within the 8 kills, seconds before the 300 s would place them (the
    10,000-kill soak reached its kills at 59% of its seconds, just after its last restart)."""
    assert not _zygote_processes()  # none of another test's
    chaos = {**PER_SLOT, "pg_restarts": 2}
    report = await _soak(own_postgres, ledger_url, **chaos, odd_payloads=0.25, fork_workers=True)
    print(report)
    assert report.pg_restarts == own_postgres.restarts == 2
    assert report.workers_forked == report.workers_started >= 3 + 8
    assert report.kills == 8 == sum(report.kills_per_slot), report.kills_per_slot
    assert all(report.kills_per_slot), report.kills_per_slot
    assert 1 <= report.kills_holding_runs <= report.kills
    assert report.ok, report.problems
    assert report.succeeded + report.odd_failed == report.runs == 12
    assert report.odd_runs == 3 and report.odd_mismatched == 0
    assert not _zygote_processes()


def test_the_zygote_and_its_lives_are_out_of_the_soaks_session() -> None:
    """The first 10,000-kill soak of 2026-12-08 counted three "crashes": lives stopped as zombies
    when the shell that had started the soak exited, SIGHUPped by the kernel with the whole
    process group the soak ran in (an orphaned group with a stopped member). The zygote, and so
    every life it forks, now runs in a session of its own, which no such SIGHUP reaches."""
    from benchmarks.soak import Zygote

    zygote = Zygote(dict(os.environ))
    try:
        pid = zygote.popen.pid
        assert os.getsid(pid) == pid != os.getsid(0)
        assert os.getpgid(pid) == pid != os.getpgid(0)
    finally:
        zygote.close()
    assert zygote.popen.poll() is not None


class _Life:
    """A worker life as the fleet sees one (benchmarks.soak.Proc), without a process behind it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.signals: list[int] = []

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)

    def kill(self) -> None:
        self.returncode = -9

    def wait(self, timeout: float | None = None) -> int:
        assert self.returncode is not None
        return self.returncode


def test_a_life_that_gets_the_pid_of_a_killed_one_serves_and_is_hit_like_any_other(
    tmp_path: Path,
) -> None:
    """An hour's soak forks more processes than pid_max, so pids come back. The first 90-minute
    run kept its records by pid: a life that got the pid of one it had SIGKILLed counted as on
    its way out, was never hit, and its slot got another life beside it (about 30 lives for 8
    slots by minute 14, and the kill rate fell from 2.4 to 0.9 a second)."""
    fleet = _Fleet({}, tmp_path, 4, Report())
    first, second = _Life(4242), _Life(4242)
    fleet.add(first, 0, "soak-0")
    fleet.hit(first, signal.SIGKILL)
    first.returncode = -9
    fleet.top_up(0)  # its exit counted: the soak's own kill, no crash
    fleet.add(second, 0, "soak-1")  # the slot's next life, with the same pid
    assert fleet.live() == [second] and fleet.serving(0) is second
    assert fleet.alive("soak-1") and not fleet.alive("soak-0")
    fleet.hit(second, signal.SIGTERM)
    assert second.signals == [signal.SIGTERM] and fleet.live() == []
    assert fleet.report.worker_crashes == 0 and fleet.current == [second]


@pytest.mark.slow
@pytest.mark.timeout(1800)
async def test_large_seeded_soak(own_postgres: OwnPostgres, ledger_url: str) -> None:
    report = await _soak(own_postgres, ledger_url, runs=200, seconds=600, pg_restarts=5)
    print(report)
    assert report.pg_restarts == 5 and report.zombies >= 1
    assert report.ok, report.problems


async def test_the_oncall_human_waits_while_the_previous_holder_may_be_inside_the_call(
    store: Store, database_url: str
) -> None:
    """An unknown outcome is decided only once its previous holder is gone or its busy_until has
    passed: deciding by the ledger alone approved a retry while a SIGSTOPped worker was inside
    drop_table, and it dropped the table twice (a 150-second soak, seed 7)."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(ledger_schema())
    later = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    earlier = (datetime.now(UTC) - timedelta(seconds=1)).isoformat()
    runs = {}
    for name, busy in (
        ("zombie", {"busy_worker": "w-zombie", "busy_until": later}),
        ("unknown", {"busy_worker": None, "busy_until": later}),
        ("past", {"busy_worker": "w-zombie", "busy_until": earlier}),
    ):
        run, _ = await store.create_run(f"run {name}", AGENT)
        [(_, lease)] = (await store.claim("default", f"w-{name}")).claimed
        call: dict[str, Any] = {
            "seq": 0,
            "call_index": 0,
            "tool": "drop_table",
            "input": {},
            "stage": "outcome_unknown",
            "attempt": 1,
            **busy,
        }
        await store.wait_for_approval(lease, "outcome unknown", call)
        runs[name] = run.id

    async def verdicts() -> dict[str, str | None]:
        got = {}
        for name, rid in runs.items():
            a = await store.get_approval(rid, 0, 0, "outcome_unknown", 1)
            got[name] = a.decision if a else None
        return got

    # The zombie's process is alive and its bound is ahead: only the bound that passed is decided.
    assert await decide_waiting(store, database_url, lambda _name: True) == 1
    assert await verdicts() == {"zombie": None, "unknown": None, "past": "approved"}
    # The zombie's process is gone (its pod deleted): its call is over, so it is decided; a
    # holder that is not known is still waited out.
    assert await decide_waiting(store, database_url, lambda _name: False) == 1
    assert await verdicts() == {"zombie": "approved", "unknown": None, "past": "approved"}


def _block(scripted: dict[str, Any], tool_id: str) -> dict[str, Any]:
    """A scripted block as the SDK hands it to the worker (and the worker stores it)."""
    if "thinking" in scripted:
        return {"type": "thinking", "thinking": scripted["thinking"], "signature": "sig"}
    if "text" in scripted:
        return {"type": "text", "text": scripted["text"], "citations": None}
    use = scripted["tool_use"]
    return {"type": "tool_use", "id": tool_id, "name": use["name"], "input": use["input"]}


def test_the_checker_fails_on_each_planted_problem(database_url: str) -> None:
    def checked() -> Report:
        return asyncio.run(check(database_url))

    def run(task: str, status: str, effects: dict[str, int] | None = None) -> str:
        rid = str(
            conn.execute(
                "INSERT INTO agent_run (task, model, agent_spec, status, max_steps, max_attempts)"
                " VALUES (%s, 'm', '{}', %s, 50, 8) RETURNING id",
                (task, status),
            ).fetchone()[0]  # type: ignore[index]
        )
        for tool, n in (effects or {}).items():
            for i in range(n):
                conn.execute(
                    "INSERT INTO ledger_effects (tool, run_id, key) VALUES (%s, %s, %s)",
                    (tool, rid, f"{rid}-{tool}-{i}"),
                )
        return rid

    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(ledger_schema())
        assert checked().ok  # nothing yet: nothing wrong
        run("healthy", "succeeded", EFFECTS_PER_RUN)
        assert checked().ok
        rid = run("a lost step", "succeeded", EFFECTS_PER_RUN)
        for seq in (0, 1, 3):  # seq 2 is missing
            conn.execute(
                "INSERT INTO agent_step (run_id, seq, kind, payload, lease_epoch, worker) "
                "VALUES (%s, %s, 'model_turn', %s, 1, 'w')",
                (rid, seq, f'{{"n": {seq}}}'),
            )
        report = checked()
        assert report.lost_steps == 1 and report.duplicate_effects == 0 and not report.ok
        # An irreversible effect that happened twice; a non-idempotent one under a second key.
        rid = run("duplicates", "succeeded", EFFECTS_PER_RUN)
        conn.execute("INSERT INTO ledger_effects (tool, run_id) VALUES ('drop_table', %s)", (rid,))
        conn.execute(
            "INSERT INTO ledger_effects (tool, run_id, key) VALUES ('send_email', %s, 'k3')",
            (rid,),
        )
        assert checked().duplicate_effects == 2
        # An email that never went out, though its run succeeded.
        run("an effect lost", "succeeded", {**EFFECTS_PER_RUN, "send_email": 1})
        report = checked()
        assert report.lost_effects == 1 and report.duplicate_effects == 2
        # A healthy run dead-lettered (as after 8 SIGKILLs it survived), one failed, one stuck.
        run("given up on", "dead_letter")
        run("failed", "failed")
        run("stuck", "running")
        report = checked()
        assert report.dead_lettered == report.failed == report.stuck == 1 and not report.ok
        assert any("dead_letter after" in p for p in report.problems)
        # An odd-payload run may fail (once, with an error); one that succeeded must read back
        # as produced: this one has no steps at all.
        run(odd_task("nul", 0), "failed")
        report = checked()
        assert report.odd_failed == 1 and report.failed == 1
        run(odd_task("unicode", 1), "succeeded")
        report = checked()
        assert report.odd_runs == 2 and report.odd_mismatched == 1
        assert any("0 conversation steps for 5" in p for p in report.problems)
        # One whose log reads back exactly as produced passes; one with a result changed fails.
        for n, changed in ((2, None), (3, "a line separator dropped")):
            rid = run(odd_task("unicode", n), "succeeded")
            turns = odd_turns("unicode")
            said = model_text("unicode")
            results = [ODD_PAYLOADS["unicode"], said]
            if changed:
                results[0] = results[0].replace("\u2028", "")
            steps: list[tuple[str, dict[str, Any]]] = []
            for i, turn in enumerate(turns):
                blocks = [_block(b, f"toolu_{i}") for b in turn["content"]]
                stop = "tool_use" if i < len(results) else "end_turn"
                steps.append(("model_turn", {"content": blocks, "stop_reason": stop}))
                if i < len(results):
                    result = {"type": "tool_result", "tool_use_id": f"toolu_{i}"}
                    steps.append(("tool_result", {"content": [{**result, "content": results[i]}]}))
            for seq, (kind, payload) in enumerate(steps):
                conn.execute(
                    "INSERT INTO agent_step (run_id, seq, kind, payload, lease_epoch, worker) "
                    "VALUES (%s, %s, %s, %s, 1, 'w')",
                    (rid, seq, kind, Jsonb(payload)),
                )
            conn.execute(
                "UPDATE agent_run SET result = %s WHERE id = %s",
                (f"odd unicode done: {said}", rid),
            )
            report = checked()
            assert report.odd_mismatched == (2 if changed else 1), report.problems
        assert any("step 1 (tool_result) reads back changed" in p for p in report.problems)
    # The command's exit code says so too.
    res = subprocess.run(
        [sys.executable, "-m", "benchmarks.soak", "--check-only", "--database-url", database_url],
        capture_output=True,
        text=True,
        cwd=ROOT,  # the benchmarks package is run from the repository root
    )
    assert res.returncode == 1 and "soak: FAILED" in res.stdout
    assert "drop_table happened 2 times" in res.stdout and "dead_letter after" in res.stdout


def test_the_checker_reads_the_ledger_where_the_tools_keep_it_and_names_a_tools_error(
    database_url: str, ledger_url: str
) -> None:
    """The soak keeps the tools' ledger on a server it does not restart (in the first
    10,000-kill soak it was the store's own: a tool that met an outage told the model so, and
    two runs succeeded without an effect). The checker reads the effects from there, and a lost
    effect says what the tool reported to the model, if it reported an error."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        runs = [
            str(row[0])
            for row in conn.execute(
                "INSERT INTO agent_run (task, model, agent_spec, status, max_steps, max_attempts)"
                " SELECT 'run ' || n, 'm', '{}', 'succeeded', 50, 8 FROM generate_series(1, 2) n"
                " RETURNING id"
            )
        ]
        use = {"type": "tool_use", "id": "toolu_1", "name": "send_email", "input": {"to": "x"}}
        said = "OperationalError: connection failed: Connection refused"
        result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": said}
        for seq, kind, block in ((0, "model_turn", use), (1, "tool_result", result)):
            conn.execute(
                "INSERT INTO agent_step (run_id, seq, kind, payload, lease_epoch, worker) "
                "VALUES (%s, %s, %s, %s, 1, 'w')",
                (runs[1], seq, kind, Jsonb({"content": [{**block, "is_error": True}]})),
            )
    with psycopg.connect(ledger_url, autocommit=True) as conn:
        conn.execute(ledger_schema())
        for rid, effects in (
            (runs[0], EFFECTS_PER_RUN),
            (runs[1], {**EFFECTS_PER_RUN, "send_email": 1}),
        ):
            for tool, n in effects.items():
                for i in range(n):
                    conn.execute(
                        "INSERT INTO ledger_effects (tool, run_id, key) VALUES (%s, %s, %s)",
                        (tool, rid, f"{rid}-{tool}-{i}"),
                    )
    report = asyncio.run(check(database_url, ledger_url=ledger_url))
    assert report.lost_effects == 1 and report.duplicate_effects == 0 and not report.ok
    [problem] = report.problems
    assert problem == (
        f"run {runs[1]} (succeeded): send_email happened 1 times (expected 2);"
        f" the tool reported: [{said!r}]"
    )
    # Read from the store's database instead, every effect of both runs is missing.
    assert asyncio.run(check(database_url)).lost_effects == 2 * sum(EFFECTS_PER_RUN.values())
    res = subprocess.run(
        [sys.executable, "-m", "benchmarks.soak", "--check-only", "--database-url", database_url,
         "--ledger-url", ledger_url],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert res.returncode == 1 and f"PROBLEM: {problem}" in res.stdout
    assert "lost_effects           1" in res.stdout


def test_a_failed_soak_traces_its_problem_runs_through_every_lifes_log(tmp_path: Path) -> None:
    """A failed soak writes problems.log: each line of each life's log that names a run the
    checker complained about, under the life's name, from the lives archived (compressed, once
    KEEP_LOGS newer ones exist) and the ones still in files alike (the first 10,000-kill soak
    had removed the logs of the two runs it failed on, so their cause could only be inferred)."""
    bad, good = "6e904573-0d3c-4c1a-9a57-7f7b0c2d9e11", "cca35a37-1b2c-4d5e-8f90-123456789abc"
    logs = {
        0: f"claimed run {bad}\nrun {good}: turn 1\n",
        1: "idle\n",
        2: f"run {bad}: tool drop_table raised OperationalError: reported to the model\n",
    }
    for n, text in logs.items():
        (tmp_path / f"worker-{n}.log").write_text(text)
    fleet = _Fleet({}, tmp_path, 4, Report())
    fleet.archive(0)
    fleet.archive(1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lives.log.gz", "worker-2.log"]
    with gzip.open(tmp_path / "lives.log.gz", "rt") as gz:
        assert gz.read() == f"=== soak-0\n{logs[0]}=== soak-1\n{logs[1]}"
    out = trace(tmp_path, [f"run {bad} (succeeded): drop_table happened 0 times (expected 1)"])
    assert out.read_text().splitlines() == [
        f"soak-0: claimed run {bad}",
        f"soak-2: run {bad}: tool drop_table raised OperationalError: reported to the model",
    ]


def test_a_kept_server_is_stopped_but_its_data_stays() -> None:
    """A failed soak keeps its servers' data (OwnPostgres.keep): the server is stopped by its pid
    as always, and its directory, the database the checker read included, stays."""
    pg = OwnPostgres()
    try:
        with pg:
            pid = pg.pid
            pg.keep = True
        assert pid is not None and not _alive(pid)  # (a zombie until its parent reaps it)
        assert (pg.pgdata / "PG_VERSION").exists() and pg.log.exists()
    finally:
        shutil.rmtree(pg.root, ignore_errors=True)


async def test_the_oncall_human_names_the_wait_of_a_second_unknown_outcome(
    store: Store, database_url: str
) -> None:
    """An approved re-run whose outcome is unknown again waits on its next attempt, and a bare
    step number no longer decides it (Store.decide refuses it once the step had a decision): the
    scripted on-call named only the step, was refused, and the soak died of it, 1,000 s into a
    5,000-kill run. It names the wait, as `agentrun approve RUN 0.0.2` does."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(ledger_schema())
    run, _ = await store.create_run("run twice unknown", AGENT)
    call: dict[str, Any] = {"seq": 0, "call_index": 0, "tool": "drop_table", "input": {},
                            "stage": "outcome_unknown", "attempt": 1}
    for attempt in (1, 2):
        [(_, lease)] = (await store.claim("default", f"w{attempt}")).claimed
        await store.wait_for_approval(lease, "outcome unknown", {**call, "attempt": attempt})
        waiting = await store.get_run(run.id)
        assert waiting.pending_call is not None
        assert waiting.pending_call["attempt"] == attempt
        assert await decide_waiting(store, database_url, lambda _name: False) == 1
        decided = await store.get_approval(run.id, 0, 0, "outcome_unknown", attempt)
        assert decided is not None and decided.decision == "approved"
