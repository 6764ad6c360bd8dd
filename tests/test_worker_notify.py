"""What a worker does with the agentrun_run_changed notifications of a run it holds (issue 19).

A notification tells the state of the row at the moment some transaction changed it, and it may
be heard after later changes: the insert notification of a run (epoch 0) commonly arrives after
the worker's own claim (epoch 1). Only a notification about the current claim or a later one says
anything about this worker's hold: a newer epoch means another worker took the run over (abort at
once, the fence would refuse every commit anyway); an older one describes the row before this
claim and must change nothing, whatever its status or rollback flag says.

Each test holds a real ``agentrun worker`` inside a tool call that blocks on a gate file, with a
lease of 300 s (renewed every 100 s): within the test, only a notification can make it let go.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import psycopg

from agentrun.manifests import AgentSpec
from agentrun.store import CHANNEL_RUN_CHANGED, Run, Store
from tests.workerkit import FakeFactory, Workers, wait_for, wait_run

GATE_AGENT = AgentSpec(model="claude-sonnet-4-5", system="You wait at gates.", tools=["gate"])
LONG_LEASE = 300.0  # renewed every 100 s: no renewal can find the lease gone within a test


def gate_scenario(gate: Path) -> dict[str, Any]:
    """Turn 0 calls the gate tool; turn 1 answers."""
    turns = [
        {"content": [{"text": "To the gate."},
                     {"tool_use": {"name": "gate", "input": {"path": str(gate)}}}]},
        {"content": [{"text": "Through the gate."}]},
    ]  # fmt: skip
    return {"name": "gate", "scripts": [{"name": "gate", "turns": turns}]}


async def held_at_gate(
    store: Store, workers: Workers, fake: FakeFactory, tmp_path: Path, *, log_level: str = "INFO"
) -> tuple[Run, Path, Any]:
    gate = tmp_path / "gate"
    workers.env["ANTHROPIC_BASE_URL"] = fake(gate_scenario(gate)).base_url
    run, _ = await store.create_run("wait at the gate", GATE_AGENT)
    w = workers.start(
        "w", tools="gate_tools.py", lease_ttl=LONG_LEASE, poll=3600,
        extra=["--log-level", log_level],
    )  # fmt: skip
    entered = Path(f"{gate}.entered")
    await wait_for(lambda: entered.exists() or w.popen.poll() is not None, 30, "the gate tool")
    assert w.popen.poll() is None, w.output()
    held = await store.get_run(run.id)
    assert (held.status, held.lease_owner, held.lease_epoch, held.attempt) == ("running", "w", 1, 1)
    return held, gate, w


def notify(url: str, payload: dict[str, Any]) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL_RUN_CHANGED, json.dumps(payload)))


async def test_a_stale_notification_of_an_older_epoch_does_not_drop_the_held_run(
    store: Store, workers: Workers, fake: FakeFactory, tmp_path: Path, database_url: str
) -> None:
    run, gate, w = await held_at_gate(store, workers, fake, tmp_path, log_level="DEBUG")
    # What the row said before this claim, in the trigger's payload shape (migration 0002): its
    # insert (pending, epoch 0), and stale ones whose status or rollback flag would stop the run
    # if they were about this claim.
    base = {"id": str(run.id), "pool": run.pool, "step": 0, "attempt": 0, "epoch": 0,
            "rollback": False}  # fmt: skip
    stale = [
        {**base, "status": "pending"},
        {**base, "status": "cancelled"},
        {**base, "status": "running", "rollback": True},
    ]
    for payload in stale:
        notify(database_url, payload)

    def ignored() -> int:
        return sum("stale notification" in x.get("msg", "") for x in w.json_lines())

    # Heard: the worker says it ignored each one (the code before issue 19 aborted the run at
    # the first one as a lost lease, and left it to stall for the whole lease).
    await wait_for(lambda: ignored() == len(stale) or "aborted" in w.output(), 30,
                   "the worker to hear the notifications")  # fmt: skip
    assert "aborted" not in w.output()  # neither "lease lost" nor "run cancelled"
    assert ignored() == len(stale)
    lines = [x for x in w.json_lines() if "stale notification" in x.get("msg", "")]
    assert {x.get("run_id") for x in lines} == {str(run.id)}  # invariant 9

    gate.touch()
    done = await wait_run(store, run.id, lambda r: r.finished, 30)
    # Finished on the claim it was on: no attempt spent, no other epoch, no rollback.
    assert (done.status, done.attempt, done.lease_epoch) == ("succeeded", 1, 1), done.error
    assert done.result == "Through the gate." and done.rollback_reason is None
    steps = await store.steps(run.id)
    assert [(s.kind, s.lease_epoch, s.worker) for s in steps] == [
        ("model_turn", 1, "w"), ("tool_result", 1, "w"), ("model_turn", 1, "w"),
    ]  # fmt: skip
    assert "lease lost" not in w.output()
    w.signal(signal.SIGTERM)
    assert w.wait() == 0


async def test_a_takeover_notification_of_a_newer_epoch_aborts_the_held_run_at_once(
    store: Store, workers: Workers, fake: FakeFactory, tmp_path: Path, database_url: str
) -> None:
    run, gate, w = await held_at_gate(store, workers, fake, tmp_path)
    # Another worker takes the run over: the lease is made to lapse (the holder looks dead), then
    # the real claim query runs for worker "b". Its trigger notifies epoch 2.
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("UPDATE agent_run SET lease_until = now() - interval '1 second' "
                     "WHERE id = %s", (run.id,))  # fmt: skip
    result = await store.with_lease_ttl(LONG_LEASE).claim(run.pool, "b", 1)
    assert [(r.id, lease.epoch) for r, lease in result.claimed] == [(run.id, 2)]
    # No renewal is due for 100 s and the tool call blocks: only the notification can tell it.
    await wait_for(lambda: "lease lost; in-flight work aborted" in w.output(), 30,
                   "the worker to drop the run it lost")  # fmt: skip
    assert w.popen.poll() is None
    gate.touch()  # the tool returns into a dropped run: nothing more is committed
    w.signal(signal.SIGTERM)
    assert w.wait() == 0
    steps = await store.steps(run.id)
    assert [(s.kind, s.lease_epoch, s.worker) for s in steps] == [("model_turn", 1, "w")]
    now = await store.get_run(run.id)
    assert (now.status, now.lease_owner, now.lease_epoch) == ("running", "b", 2)
