"""Retry, restart and prune, through the real CLI, real workers and the scripted model server.

A retried run continues from its step log with a fresh poison-run budget: nothing committed is
repeated (no model turn asked for again, no recorded effect called again). A run whose failure
rolled back what it did, a live run and a succeeded one are refused (one line, exit 2). A restart
is a new run with the same spec. A prune deletes only finished runs older than its cutoff, in
batches, passing over rows somebody holds a lock on, and leaves live runs and their steps alone.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any
from uuid import UUID

import psycopg
import pytest

from agentrun.store import Lease, Store
from tests.conftest import run_cli
from tests.workerkit import AGENT, TOOLS_DIR, FakeFactory, Workers, echo_scenario, wait_run

TOOLS = str(TOOLS_DIR / "retry_tools.py")
BROKEN = {"RETRY_TEST_BROKEN": "1"}


def booking_scenario(faults: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Turn 0 books (a recorded effect), turn 1 checks the deploy, turn 2 answers."""
    check: dict[str, Any] = {
        "content": [{"tool_use": {"name": "deploy_check", "input": {}}}]
    }
    if faults:
        check["faults"] = faults
    return {
        "name": "retry",
        "scripts": [
            {
                "name": "retry",
                "turns": [
                    {"content": [{"tool_use": {"name": "book", "input": {"item": "room"}}}]},
                    check,
                    {"content": [{"text": "All booked."}]},
                ],
            }
        ],
    }


def agent() -> Any:
    return AGENT.model_copy(update={"tools": ["book", "deploy_check"], "thinking": None})


async def bookings(database_url: str, run_id: UUID) -> int:
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        cur = await conn.execute(
            "SELECT count(*) FROM retry_bookings WHERE run_id = %s", (str(run_id),)
        )
        row = await cur.fetchone()
    return int(row[0]) if row else 0


def cli(database_url: str, *args: str) -> Any:
    return run_cli(*args, env={"AGENTRUN_DATABASE_URL": database_url})


async def test_a_dead_lettered_run_retried_continues_from_its_log_and_repeats_nothing(
    store: Store, workers: Workers, fake: FakeFactory, database_url: str
) -> None:
    # One turn asks for both calls: the booking's effect is recorded before deploy_check takes
    # the worker down, in a turn whose tool_result step is never committed; every resume of
    # that turn, the retry's included, must reuse the recorded booking, not book again.
    srv = fake({
        "name": "retry",
        "scripts": [{"name": "retry", "turns": [
            {"content": [{"tool_use": {"name": "book", "input": {"item": "room"}}},
                         {"tool_use": {"name": "deploy_check", "input": {}}}]},
            {"content": [{"text": "All booked."}]},
        ]}],
    })
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    run, _ = await store.create_run("book a room", agent(), max_attempts=1)
    # A bad deploy: deploy_check takes two workers down (the first claim committed steps, which
    # restores the budget once); the third claim dead-letters the run (maxAttempts 1).
    for name in ("w1", "w2"):
        w = workers.start(name, tools=TOOLS, env=BROKEN)
        assert w.wait(60) == 7, w.output()[-2000:]
    fixed = workers.start("w3", tools=TOOLS)
    dead = await wait_run(store, run.id, lambda r: r.finished, 30)
    assert dead.status == "dead_letter", dead.error
    before = await store.steps(run.id)
    assert [s.kind for s in before] == ["model_turn"]
    assert await bookings(database_url, run.id) == 1
    asked = len(srv.requests())

    out = cli(database_url, "retry", str(run.id), "--reason", "deploy fixed")
    assert out.returncode == 0, out.stderr
    assert f"run {run.id}: retry 1 (deploy fixed)" in out.stdout, out.stdout

    done = await wait_run(store, run.id, lambda r: r.finished, 30)
    assert done.status == "succeeded", (done.error, fixed.output()[-2000:])
    assert done.result == "All booked."
    assert done.retries == 1 and done.retry_reason == "deploy fixed"
    assert done.retried_error is not None and done.retried_error.startswith("dead-lettered")
    after = await store.steps(run.id)
    # The log goes on where it stopped: the committed steps are the same rows, unchanged.
    assert [(s.seq, s.lease_epoch, s.created_at) for s in after[:1]] == [
        (s.seq, s.lease_epoch, s.created_at) for s in before
    ]
    assert [s.kind for s in after[1:]] == ["tool_result", "model_turn"]
    results = [b["content"] for b in after[1].payload["content"]]
    assert results == ["booked room", "deploy ok"], results
    assert await bookings(database_url, run.id) == 1  # the booking was not made again
    assert len(srv.requests()) == asked + 1  # only the final turn was asked for
    # attempt counts every claim of the run's life (w1, w2, w3's retry claim).
    assert done.attempt == 3, done.attempt


async def test_a_run_failed_by_a_permanent_model_error_retried_calls_the_model_again(
    store: Store, workers: Workers, fake: FakeFactory, database_url: str
) -> None:
    srv = fake(booking_scenario(faults=[{"status": 400, "message": "bad request, once"}]))
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    run, _ = await store.create_run("book a room", agent())
    workers.start("w", tools=TOOLS)
    failed = await wait_run(store, run.id, lambda r: r.finished, 30)
    assert failed.status == "failed" and failed.error is not None, failed.error
    assert "model call failed" in failed.error
    assert [s.kind for s in await store.steps(run.id)] == ["model_turn", "tool_result"]

    out = cli(database_url, "retry", str(run.id))
    assert out.returncode == 0, out.stderr
    done = await wait_run(store, run.id, lambda r: r.finished, 30)
    assert done.status == "succeeded", done.error
    assert [s.kind for s in await store.steps(run.id)] == [
        "model_turn", "tool_result", "model_turn", "tool_result", "model_turn"
    ]
    assert await bookings(database_url, run.id) == 1
    assert done.retried_error is not None and "model call failed" in done.retried_error

    # A succeeded run is not retried: one line, exit 2.
    again = cli(database_url, "retry", str(run.id))
    assert again.returncode == 2, again
    assert again.stderr.count("\n") == 1 and "succeeded" in again.stderr, again.stderr


async def test_retry_refuses_live_and_rolled_back_runs(store: Store, database_url: str) -> None:
    live, _ = await store.create_run("still going", AGENT)
    out = cli(database_url, "retry", str(live.id))
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out
    assert "still pending" in out.stderr
    assert (await store.get_run(live.id)).retries == 0

    # A run whose abort compensated an effect: continuing would build on an undone state.
    rolled, _ = await store.create_run("rolled back", AGENT, pool="rolled")
    claim = await store.claim("rolled", "tester")
    lease = next(lease for r, lease in claim.claimed if r.id == rolled.id)
    await store.append_step(lease, 0, "model_turn", {"content": [], "stop_reason": "tool_use"})
    await store.begin_rollback(lease, "card declined")
    await store.append_step(
        lease, 1, "compensation",  # type: ignore[arg-type]
        {"compensation": "release", "tool": "reserve", "seq": 0, "call_index": 0},
    )
    await store.finish(lease, "failed", error="card declined; compensated: release")
    out = cli(database_url, "retry", str(rolled.id))
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out
    assert "rolled back" in out.stderr and "agentrun restart" in out.stderr
    assert (await store.get_run(rolled.id)).status == "failed"

    bad = cli(database_url, "retry", "not-a-uuid")
    assert bad.returncode == 2, bad


async def test_a_second_retry_says_the_run_was_retried_already(
    store: Store, database_url: str
) -> None:
    """Two humans retry one dead-lettered run: the second was told the run "is still pending",
    true but not why; it now names the retry that came first, by its reason."""
    run, _ = await store.create_run("poison", AGENT.model_copy(), max_attempts=1)
    ((_, lease),) = (await store.claim("default", "w")).claimed
    await store.abandon(lease, "worker died")
    claimed = await store.claim("default", "w")
    assert claimed.claimed == []  # the cap: dead-lettered instead of claimed
    assert (await store.get_run(run.id)).status == "dead_letter"
    first = cli(database_url, "retry", str(run.id), "--reason", "alice: fixed the tool")
    assert first.returncode == 0, first.stderr
    second = cli(database_url, "retry", str(run.id), "--reason", "bob: retrying")
    assert second.returncode == 2 and second.stderr.count("\n") == 1, second
    assert ("is still pending (retried 1 time(s); the latest retry: alice: fixed the tool)"
            in second.stderr), second.stderr


async def test_restart_makes_a_new_run_with_the_same_spec(
    store: Store, workers: Workers, fake: FakeFactory, database_url: str
) -> None:
    srv = fake(echo_scenario(2))
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    first, _ = await store.create_run("echo twice", AGENT, max_steps=7, max_attempts=3)
    workers.start("w", tools="echo_v1.py")
    await wait_run(store, first.id, lambda r: r.status == "succeeded", 30)

    out = cli(database_url, "restart", str(first.id))
    assert out.returncode == 0, out.stderr
    new_id = UUID(out.stdout.strip())
    assert new_id != first.id
    again = await wait_run(store, new_id, lambda r: r.status == "succeeded", 30)
    assert (again.task, again.agent_spec, again.pool, again.max_steps, again.max_attempts) == (
        first.task, first.agent_spec, first.pool, 7, 3
    )
    assert again.restarted_from == first.id
    assert len(await store.steps(new_id)) == len(await store.steps(first.id)) == 3
    assert (await store.get_run(first.id)).status == "succeeded"  # the original is untouched


async def _finished_run(store: Store, task: str, status: str, steps: int, age: str) -> UUID:
    run, _ = await store.create_run(task, AGENT, pool="prune")
    claim = await store.claim("prune", "tester")
    (_, lease), = claim.claimed
    for seq in range(steps):
        await store.append_step(lease, seq, "note", {"n": seq})
    await store.finish(lease, status, error=None if status == "succeeded" else status)  # type: ignore[arg-type]
    async with await psycopg.AsyncConnection.connect(store.url, autocommit=True) as conn:
        await conn.execute(
            "UPDATE agent_run SET finished_at = now() - %s::interval WHERE id = %s",
            (age, run.id),
        )
    return run.id


async def _live_run(store: Store) -> tuple[UUID, Lease]:
    run, _ = await store.create_run("live", AGENT, pool="prune")
    claim = await store.claim("prune", "tester")
    (_, lease), = claim.claimed
    await store.append_step(lease, 0, "note", {"n": 0})
    return run.id, lease


async def test_prune_deletes_only_finished_runs_older_than_the_cutoff_in_batches(
    store: Store, database_url: str
) -> None:
    old_ok = [await _finished_run(store, f"old {i}", "succeeded", 3, "3 days") for i in range(5)]
    old_failed = await _finished_run(store, "old failed", "failed", 2, "3 days")
    recent = await _finished_run(store, "recent", "succeeded", 2, "1 hour")
    live, lease = await _live_run(store)
    # A live run as old as the pruned ones (created days ago) is never a candidate.
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "UPDATE agent_run SET created_at = now() - interval '5 days' WHERE id = %s", (live,)
        )

    dry = cli(database_url, "prune", "--older-than", "1d", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "would delete 6 " in dry.stdout and "with 17 steps" in dry.stdout, dry.stdout
    assert len(await store.steps(old_ok[0])) == 3  # a dry run deletes nothing

    # One old finished run is locked by someone else: the prune passes it by, it does not wait.
    locker = await psycopg.AsyncConnection.connect(database_url)
    try:
        await locker.execute("SELECT 1 FROM agent_run WHERE id = %s FOR UPDATE", (old_ok[4],))
        out = await asyncio.to_thread(
            cli, database_url, "prune", "--older-than", "1d", "--status", "succeeded",
            "--batch", "2",
        )
    finally:
        await locker.rollback()
        await locker.close()
    assert out.returncode == 0, out.stderr
    batches = re.findall(r"^batch (\d+): deleted (\d+) runs, (\d+) steps", out.stdout, re.M)
    assert [(int(r), int(s)) for _, r, s in batches] == [(2, 6), (2, 6)], out.stdout
    assert "pruned 4 succeeded runs" in out.stdout, out.stdout
    for rid in old_ok[:4]:
        with pytest.raises(Exception, match="no run with id"):
            await store.get_run(rid)
    for rid, n in ((old_ok[4], 3), (old_failed, 2), (recent, 2), (live, 1)):
        assert len(await store.steps(rid)) == n, rid
    # The live run goes on as if nothing happened.
    await store.append_step(lease, 1, "note", {"n": 1})

    out = cli(database_url, "prune", "--older-than", "1d")
    assert out.returncode == 0, out.stderr
    assert "pruned 2 " in out.stdout, out.stdout  # the one that was locked, and the failed one
    assert (await store.get_run(recent)).status == "succeeded"
    assert len(await store.steps(live)) == 2 and not (await store.get_run(live)).finished

    # Bad input: exit 2, the error line names the option (argparse's usage line may precede it).
    for bad, field in ((["--older-than", "soon"], "--older-than"),
                       # Past the calendar: a traceback (OverflowError) before, --dry-run too.
                       (["--older-than", "200000w", "--dry-run"], "is too long: at most 52000w"),
                       (["--older-than", "999999999999w"], "is too long"),
                       (["--older-than", "1d", "--status", "running"], "--status"),
                       (["--older-than", "1d", "--batch", "0"], "--batch")):
        refused = cli(database_url, "prune", *bad)
        assert refused.returncode == 2, refused
        assert field in refused.stderr.strip().splitlines()[-1], refused.stderr
