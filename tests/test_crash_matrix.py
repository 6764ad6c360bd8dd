"""The crash matrix: every fault point x every tool class, with a real SIGKILL and a real resume.

For each case a worker process SIGKILLs itself at the named point of a run that makes one call of
the given class; a second worker resumes it. The tools write an effect ledger to PostgreSQL, and
the test checks it: pure and idempotent tools end in the same state, a non-idempotent effect
happens exactly once, an irreversible effect never happens twice (the run waits for a human when
its outcome is unknown, and the human's decision is given through the real CLI), seqs are
contiguous and the run ends right. Beyond the matrix: re-runs of an irreversible call whose
approved attempt was killed again (each needs a decision of its own), compensation chains killed
or cancelled in their middle, approvals across a worker restart; and one point that is a SIGSTOP,
not a SIGKILL: a zombie worker woken inside a tool call after another worker took its run.
"""

from __future__ import annotations

import signal
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest

from agentrun.store import Store
from tests.conftest import run_cli
from tests.workerkit import AGENT, TOOLS_DIR, FakeFactory, Workers, wait_for, wait_run

TOOLS = {  # tool -> (kind, input)
    "look": ("pure", {"what": "the schema"}),
    "set_flag": ("idempotent", {"value": "migrated"}),
    "send_email": ("non_idempotent", {"to": "ops@example.com"}),
    "drop_table": ("irreversible", {"table": "orders_old"}),
}
POINTS = {  # fault point -> the seq it fires at in these runs
    "after_model_turn_commit": 0,
    "after_intent_commit": 0,  # irreversible calls only
    "after_tool_return": 0,
    "after_tool_result_commit": 1,
}
CASES = [
    (point, tool)
    for point in POINTS
    for tool in TOOLS
    if point != "after_intent_commit" or TOOLS[tool][0] == "irreversible"
]


def scenario() -> dict[str, Any]:
    return {
        "name": "matrix",
        "scripts": [
            {
                "name": tool,
                "match": f"use {tool}",
                "turns": [
                    {
                        "content": [
                            {"thinking": f"I need {tool}."},
                            {"text": f"Calling {tool}."},
                            {"tool_use": {"name": tool, "input": tool_input}},
                        ]
                    },
                    {"content": [{"text": f"{tool} done."}]},
                ],
            }
            for tool, (_, tool_input) in TOOLS.items()
        ],
    }


def ledger(url: str, run_id: str) -> dict[str, Any]:
    with psycopg.connect(url) as conn:
        attempts = conn.execute(
            "SELECT count(*) FROM ledger_attempts WHERE run_id = %s", (run_id,)
        ).fetchone()
        effects = conn.execute(
            "SELECT count(*) FROM ledger_effects WHERE run_id = %s", (run_id,)
        ).fetchone()
        state = conn.execute(
            "SELECT value FROM ledger_state WHERE run_id = %s", (run_id,)
        ).fetchall()
    return {
        "attempts": attempts[0] if attempts else 0,
        "effects": effects[0] if effects else 0,
        "state": [v for (v,) in state],
    }


@pytest.fixture
def ledger_db(database_url: str) -> str:
    # The tools' own schema, read from their module without importing it (importing would
    # register its tools in this process).
    source = (TOOLS_DIR / "ledger_tools.py").read_text()
    schema = source.split('SCHEMA = """', 1)[1].split('"""', 1)[0]
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(schema)
    return database_url


@pytest.mark.parametrize(("point", "tool"), CASES, ids=[f"{p}-{t}" for p, t in CASES])
async def test_crash_at_every_point_for_every_tool_class(
    point: str, tool: str, store: Store, workers: Workers, fake: FakeFactory, ledger_db: str
) -> None:
    kind = TOOLS[tool][0]
    srv = fake(scenario())
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    run, _ = await store.create_run(f"use {tool}", AGENT.model_copy(update={"tools": [tool]}))
    rid = str(run.id)
    tools = str(TOOLS_DIR / "ledger_tools.py")
    w1 = workers.start("w1", tools=tools, faults=f"{point}@{POINTS[point]}")
    assert w1.wait() == -signal.SIGKILL, w1.output()[-2000:]
    at_crash = ledger(ledger_db, rid)
    workers.start("w2", tools=tools)
    done = await wait_run(store, run.id, lambda r: r.finished or r.status == "waiting_approval", 30)

    outcome_unknown = kind == "irreversible" and point in (
        "after_intent_commit",
        "after_tool_return",
    )
    if outcome_unknown:
        # The worker died between the intent and the outcome: never guess, wait for a human.
        assert done.status == "waiting_approval", done
        assert done.wait_reason is not None and done.wait_reason.startswith("outcome unknown")
        assert done.pending_call is not None
        assert done.pending_call["tool"] == tool and done.pending_call["seq"] == 0
        assert ledger(ledger_db, rid)["effects"] == at_crash["effects"]  # nothing re-ran
        # The operator looks: it happened if the tool returned before the crash.
        happened = at_crash["effects"] == 1
        verb = "reject" if happened else "approve"
        res = run_cli(
            verb,
            rid,
            "0",
            "--by",
            "oncall",
            "--reason",
            "checked the target",
            env={"AGENTRUN_DATABASE_URL": ledger_db},
        )
        assert res.returncode == 0, res.stderr
        assert f"{'rejected' if happened else 'approved'} by oncall" in res.stdout
        done = await wait_run(store, run.id, lambda r: r.finished, 30)

    assert done.status == "succeeded", done.error
    steps = await store.steps(run.id)
    assert [s.seq for s in steps] == [0, 1, 2]
    assert [s.kind for s in steps] == ["model_turn", "tool_result", "model_turn"]
    result = steps[1].payload["content"][0]
    final = ledger(ledger_db, rid)
    if kind == "pure":
        assert final["effects"] == 0 and result["content"] == "looked at the schema"
    elif kind == "idempotent":
        assert final["state"] == ["migrated"]  # same end state, however often it ran
    elif kind == "non_idempotent":
        assert final["effects"] == 1  # exactly once
        # The recorded effect is reused: the tool is only called again when the crash came
        # after it returned and before its effect was recorded (then the key dedupes it).
        assert final["attempts"] == (2 if point == "after_tool_return" else 1)
    else:
        assert final["effects"] == 1 and final["attempts"] == 1  # never twice
        if outcome_unknown and at_crash["effects"] == 1:
            assert result["is_error"] is True and "not retried" in result["content"]
            assert "oncall" in result["content"]
        else:
            assert result["content"] == "dropped orders_old"
    assert {e["status"] for e in srv.requests()} == {200}  # every replay passed the signature check


async def test_an_agent_requiring_approval_waits_before_irreversible_calls(
    store: Store, workers: Workers, fake: FakeFactory, ledger_db: str
) -> None:
    srv = fake(scenario())
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    agent = AGENT.model_copy(update={"tools": ["drop_table"], "require_approval": True})
    approved, _ = await store.create_run("use drop_table", agent)
    rejected, _ = await store.create_run("use drop_table", agent)
    env = {"AGENTRUN_DATABASE_URL": ledger_db}
    tools = str(TOOLS_DIR / "ledger_tools.py")
    w1 = workers.start("w1", tools=tools)
    for run in (approved, rejected):
        waiting = await wait_run(store, run.id, lambda r: r.status == "waiting_approval", 30)
        assert waiting.wait_reason == "approval required before drop_table (step 0)"
        assert ledger(ledger_db, str(run.id))["attempts"] == 0
    listed = run_cli("runs", env=env)
    assert "waiting_approval" in listed.stdout and "approval required" in listed.stdout
    # A bad decision is refused with a message naming the problem, and changes nothing.
    bad = run_cli("approve", str(approved.id), "4", env=env)
    assert bad.returncode == 2 and "waits on step 0 (drop_table), not step 4" in bad.stderr
    # The worker is restarted; the decisions are durable rows and the new worker acts on them.
    w1.signal(signal.SIGTERM)
    assert w1.wait() == 0
    assert run_cli("approve", str(approved.id), "0", "--by", "alice", env=env).returncode == 0
    assert (
        run_cli(
            "reject", str(rejected.id), "0", "--by", "bob", "--reason", "not today", env=env
        ).returncode
        == 0
    )
    workers.start("w2", tools=tools)
    ok = await wait_run(store, approved.id, lambda r: r.finished, 30)
    no = await wait_run(store, rejected.id, lambda r: r.finished, 30)
    assert ok.status == no.status == "succeeded"
    assert ledger(ledger_db, str(approved.id))["effects"] == 1
    assert ledger(ledger_db, str(rejected.id)) == {"attempts": 0, "effects": 0, "state": []}
    result = (await store.steps(rejected.id))[1].payload["content"][0]
    assert result == {
        "type": "tool_result",
        "tool_use_id": result["tool_use_id"],
        "content": "drop_table was rejected by bob: not today",
        "is_error": True,
    }
    with psycopg.connect(ledger_db) as conn:
        rows = conn.execute(
            "SELECT decision, decided_by, stage FROM approval ORDER BY decided_by"
        ).fetchall()
    assert rows == [("approved", "alice", "before_call"), ("rejected", "bob", "before_call")]


async def test_a_compensation_chain_survives_a_sigkill_in_its_middle_and_runs_once(
    store: Store, workers: Workers, fake: FakeFactory, ledger_db: str
) -> None:
    srv = fake(
        {
            "name": "saga",
            "scripts": [
                {
                    "name": "saga",
                    "turns": [
                        {"content": [{"tool_use": {"name": "reserve", "input": {"item": "seat"}}}]},
                        {
                            "content": [
                                {"tool_use": {"name": "reserve", "input": {"item": "hotel"}}}
                            ]
                        },
                        {"content": [{"tool_use": {"name": "charge", "input": {"amount": 120}}}]},
                        {"content": [{"text": "never reached"}]},
                    ],
                }
            ],
        }
    )
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    agent = AGENT.model_copy(update={"tools": ["reserve", "release", "charge"]})
    run, _ = await store.create_run("book a trip", agent)
    tools = str(TOOLS_DIR / "ledger_tools.py")
    # seq 0-3: two reservations; seq 4: the charge turn, whose decline aborts the run. The
    # rollback's first compensation (release hotel, seq 5) returns and the worker dies before
    # committing it.
    w1 = workers.start("w1", tools=tools, faults="mid_compensation@5")
    assert w1.wait() == -signal.SIGKILL, w1.output()[-2000:]
    mid = await store.get_run(run.id)
    assert mid.rollback_reason is not None and "card declined" in mid.rollback_reason
    workers.start("w2", tools=tools)
    done = await wait_run(store, run.id, lambda r: r.finished, 30)
    assert done.status == "failed"
    assert done.error == (
        "tool charge failed: RuntimeError: card declined for 120; compensated: "
        "release for reserve (step 2), release for reserve (step 0)"
    )
    steps = await store.steps(run.id)
    assert [s.kind for s in steps] == ["model_turn", "tool_result"] * 2 + [
        "model_turn",
        "compensation",
        "compensation",
    ]
    assert [s.payload["content"] for s in steps[5:]] == ["released hotel", "released seat"]
    with psycopg.connect(ledger_db) as conn:
        effects = conn.execute(
            "SELECT tool FROM ledger_effects WHERE run_id = %s ORDER BY id", (str(run.id),)
        ).fetchall()
        release_calls = conn.execute(
            "SELECT count(*) FROM ledger_attempts WHERE run_id = %s AND tool = 'release' "
            "GROUP BY seq ORDER BY seq",
            (str(run.id),),
        ).fetchall()
    # Each effect and each compensation happened exactly once, undone newest first; the release
    # that returned before the kill was called again with the same key and deduplicated.
    assert [t for (t,) in effects] == [
        "reserve:seat",
        "reserve:hotel",
        "release:hotel",
        "release:seat",
    ]
    assert release_calls == [(1,), (2,)]  # seat once; hotel twice, one effect
    assert len(srv.requests()) == 3  # no model call after the abort


def _effects(url: str, run_id: str) -> list[str]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT tool FROM ledger_effects WHERE run_id = %s ORDER BY id", (run_id,)
        ).fetchall()
    return [t for (t,) in rows]


async def test_cancel_with_rollback_compensates_then_ends_cancelled(
    store: Store, workers: Workers, fake: FakeFactory, ledger_db: str
) -> None:
    srv = fake(
        {
            "name": "trip",
            "scripts": [
                {
                    "name": "trip",
                    "turns": [
                        {"content": [{"tool_use": {"name": "reserve", "input": {"item": "seat"}}}]},
                        {
                            "delay_ms": 2500,
                            "content": [
                                {"tool_use": {"name": "reserve", "input": {"item": "hotel"}}}
                            ],
                        },
                        {"content": [{"text": "booked"}]},
                    ],
                }
            ],
        }
    )
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    run, _ = await store.create_run(
        "book a trip", AGENT.model_copy(update={"tools": ["reserve", "release"]})
    )
    workers.start("w", tools=str(TOOLS_DIR / "ledger_tools.py"))
    await wait_run(store, run.id, lambda r: r.next_seq == 2, 30)  # seat reserved; turn 1 asked
    res = run_cli(
        "cancel",
        str(run.id),
        "--rollback",
        "--reason",
        "plans changed",
        env={"AGENTRUN_DATABASE_URL": ledger_db},
    )
    assert res.returncode == 0 and "rollback requested" in res.stdout, res.stderr
    done = await wait_run(store, run.id, lambda r: r.finished, 30)
    assert done.status == "cancelled"
    assert done.error == "cancelled: plans changed; compensated: release for reserve (step 0)"
    assert _effects(ledger_db, str(run.id)) == ["reserve:seat", "release:seat"]


async def test_reject_with_abort_compensates_and_fails_the_run(
    store: Store, workers: Workers, fake: FakeFactory, ledger_db: str
) -> None:
    srv = fake(
        {
            "name": "risky",
            "scripts": [
                {
                    "name": "risky",
                    "turns": [
                        {"content": [{"tool_use": {"name": "reserve", "input": {"item": "slot"}}}]},
                        {
                            "content": [
                                {"tool_use": {"name": "drop_table", "input": {"table": "orders"}}}
                            ]
                        },
                        {"content": [{"text": "done"}]},
                    ],
                }
            ],
        }
    )
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    agent = AGENT.model_copy(
        update={"tools": ["reserve", "release", "drop_table"], "require_approval": True}
    )
    run, _ = await store.create_run("risky migration", agent)
    workers.start("w", tools=str(TOOLS_DIR / "ledger_tools.py"))
    await wait_run(store, run.id, lambda r: r.status == "waiting_approval", 30)
    res = run_cli(
        "reject",
        str(run.id),
        "2",
        "--abort",
        "--by",
        "bob",
        "--reason",
        "too risky",
        env={"AGENTRUN_DATABASE_URL": ledger_db},
    )
    assert res.returncode == 0, res.stderr
    done = await wait_run(store, run.id, lambda r: r.finished, 30)
    assert done.status == "failed"
    assert done.error == ("rejected by bob: too risky; compensated: release for reserve (step 0)")
    assert _effects(ledger_db, str(run.id)) == ["reserve:slot", "release:slot"]


async def test_a_rollback_undoes_the_call_its_worker_was_killed_inside(
    store: Store, workers: Workers, fake: FakeFactory, ledger_db: str
) -> None:
    """A reserve returned and its worker was SIGKILLed before recording it: the seat is held in
    the ledger, and the store has no effect of it. `cancel --rollback` then skipped it: the run
    ended cancelled with nothing compensated and the seat still held (found by an adversarial
    review on 2026-12-06). The call's mark names it: the rollback undoes it, its compensation
    told that the outcome is unknown."""
    srv = fake({"name": "seat", "scripts": [{"name": "seat", "turns": [
        {"content": [{"tool_use": {"name": "reserve", "input": {"item": "seat"}}}]},
        {"content": [{"text": "booked"}]},
    ]}]})
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    run, _ = await store.create_run(
        "book a seat", AGENT.model_copy(update={"tools": ["reserve", "release"]}))
    tools = str(TOOLS_DIR / "ledger_tools.py")
    # The rollback waits out w0's lease plus the call's timeout (w0 may still be inside it).
    w0 = workers.start("w0", tools=tools, faults="after_tool_return@0",
                       extra=["--tool-timeout", "1"])
    assert w0.wait() == -signal.SIGKILL, w0.output()[-2000:]
    assert _effects(ledger_db, str(run.id)) == ["reserve:seat"]
    assert await store.effects(run.id, 0) == {}  # killed before the effect was recorded
    res = run_cli("cancel", str(run.id), "--rollback", "--reason", "plans changed",
                  env={"AGENTRUN_DATABASE_URL": ledger_db})
    assert res.returncode == 0 and "rollback requested" in res.stdout, res.stderr
    workers.start("w1", tools=tools)
    done = await wait_run(store, run.id, lambda r: r.finished, 30)
    assert done.status == "cancelled", done.error
    assert done.error == ("cancelled: plans changed; compensated: release for reserve (step 0, "
                          "outcome unknown)")
    assert _effects(ledger_db, str(run.id)) == ["reserve:seat", "release:seat"]
    [undo] = [s for s in await store.steps(run.id) if s.kind == "compensation"]
    assert undo.payload["outcome_unknown"] is True


#: Re-runs of an irreversible call whose outcome is unknown: after a first attempt killed after
#: its tool returned, each decision in turn, with the fault armed in the worker that acts on it.
RERUNS: dict[str, tuple[list[tuple[str, str]], int]] = {  # case -> (decisions, tool calls)
    # The approved re-run dies after its tool returned: a second decision is needed, and a
    # rejection ends it. One call per decision, never more.
    "killed-after-approved-call-returned-then-rejected": (
        [("approve", "after_tool_return@0"), ("reject", "")],
        2,
    ),
    # The approved re-run dies after counting its attempt, before calling: the decision is spent
    # all the same (a crash cannot tell the two apart), so a second one is needed.
    "killed-before-approved-call-then-approved": (
        [("approve", "after_intent_commit@0"), ("approve", "")],
        2,
    ),
    "killed-after-two-approved-calls-then-rejected": (
        [("approve", "after_tool_return@0"), ("approve", "after_tool_return@0"), ("reject", "")],
        3,
    ),
}
DECIDED = {"approve": "approved", "reject": "rejected"}


@pytest.mark.parametrize("case", list(RERUNS))
async def test_one_decision_authorises_one_attempt_of_an_irreversible_call(
    case: str, store: Store, workers: Workers, fake: FakeFactory, ledger_db: str
) -> None:
    decisions, calls = RERUNS[case]
    srv = fake(scenario())
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    agent = AGENT.model_copy(update={"tools": ["drop_table"]})
    run, _ = await store.create_run("use drop_table", agent)
    rid = str(run.id)
    tools = str(TOOLS_DIR / "ledger_tools.py")
    env = {"AGENTRUN_DATABASE_URL": ledger_db}
    w0 = workers.start("w0", tools=tools, faults="after_tool_return@0")
    assert w0.wait() == -signal.SIGKILL, w0.output()[-2000:]
    for n, (verb, fault) in enumerate(decisions, 1):
        calls_so_far = ledger(ledger_db, rid)["attempts"]
        w = workers.start(f"w{n}", tools=tools, faults=fault)
        waiting = await wait_run(
            store, run.id, lambda r: r.finished or r.status == "waiting_approval", 30
        )
        # Attempt n's outcome is unknown: the run waits for decision n, and says which.
        assert waiting.status == "waiting_approval", (n, waiting.status, waiting.error)
        assert waiting.pending_call is not None and waiting.pending_call["attempt"] == n
        assert waiting.wait_reason is not None
        assert f"drop_table (step 0, attempt {n})" in waiting.wait_reason
        assert f"run it once more (attempt {n + 1})" in waiting.wait_reason
        assert ledger(ledger_db, rid)["attempts"] == calls_so_far  # nothing ran while waiting
        if n > 1:
            # A bare step number after the step's first decision may be a late one, meant for
            # an earlier wait: refused, nothing recorded, and the wait to name is said.
            late = run_cli(verb, rid, "0", "--by", "late", env=env)
            assert late.returncode == 2, (late.stdout, late.stderr)
            assert f"name that wait to decide it (0.0.{n})" in late.stderr, late.stderr
        res = run_cli(verb, rid, f"0.0.{n}", "--by", f"oncall{n}", env=env)
        assert res.returncode == 0, res.stderr
        assert (f"(step 0 call 0, outcome unknown, attempt {n}) {DECIDED[verb]} by oncall{n}"
                in res.stdout)
        if fault:
            assert w.wait() == -signal.SIGKILL, w.output()[-2000:]
    done = await wait_run(store, run.id, lambda r: r.finished, 30)
    assert done.status == "succeeded", done.error
    final = ledger(ledger_db, rid)
    assert final["attempts"] == final["effects"] == calls
    result = (await store.steps(run.id))[1].payload["content"][0]
    last_verb = decisions[-1][0]
    if last_verb == "reject":
        assert result["is_error"] is True and "not retried" in result["content"]
        assert f"oncall{len(decisions)}" in result["content"]
    else:
        assert result["content"] == "dropped orders_old"
    with psycopg.connect(ledger_db) as conn:
        rows = conn.execute(
            "SELECT stage, attempt, decision, decided_by FROM approval ORDER BY attempt"
        ).fetchall()
    assert rows == [
        ("outcome_unknown", n, DECIDED[verb], f"oncall{n}")
        for n, (verb, _) in enumerate(decisions, 1)
    ]


async def test_a_plain_cancel_during_a_rollback_lets_every_compensation_run(
    store: Store, workers: Workers, fake: FakeFactory, ledger_db: str
) -> None:
    srv = fake(
        {
            "name": "trip",
            "scripts": [
                {
                    "name": "trip",
                    "turns": [
                        {"content": [{"tool_use": {"name": "book", "input": {"item": "seat"}}}]},
                        {"content": [{"tool_use": {"name": "book", "input": {"item": "hotel"}}}]},
                        {
                            "content": [
                                {"tool_use": {"name": "drop_table", "input": {"table": "plans"}}}
                            ]
                        },
                        {"content": [{"text": "never reached"}]},
                    ],
                }
            ],
        }
    )
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    agent = AGENT.model_copy(
        update={"tools": ["book", "unbook", "drop_table"], "require_approval": True}
    )
    run, _ = await store.create_run("book a trip", agent)
    rid = str(run.id)
    env = {"AGENTRUN_DATABASE_URL": ledger_db}
    gate_lock = 7146120500  # ledger_tools.GATE_LOCK: unbook waits for it
    with psycopg.connect(ledger_db, autocommit=True) as gate:
        gate.execute("SELECT pg_advisory_lock(%s)", (gate_lock,))
        workers.start("w", tools=str(TOOLS_DIR / "ledger_tools.py"))
        # Two bookings done; the run waits for approval of drop_table (step 4).
        await wait_run(store, run.id, lambda r: r.status == "waiting_approval", 30)
        res = run_cli("cancel", rid, "--rollback", "--reason", "plans changed", env=env)
        assert res.returncode == 0 and "rollback requested" in res.stdout, res.stderr

        def unbooks_started() -> int:
            with psycopg.connect(ledger_db) as conn:
                row = conn.execute(
                    "SELECT count(*) FROM ledger_attempts WHERE run_id = %s AND tool = 'unbook'",
                    (rid,),
                ).fetchone()
            return int(row[0]) if row else 0

        await wait_for(lambda: unbooks_started() == 1, 30, "the first compensation to start")
        # The first compensation (unbook hotel) is in flight, held by the gate: a plain cancel now
        # is refused, says why, and changes nothing.
        plain = run_cli("cancel", rid, env=env)
        assert plain.returncode == 1, plain.stdout
        assert f"run {rid} is rolling back (cancelled: plans changed)" in plain.stderr
        assert "a cancel does not interrupt a rollback" in plain.stderr
        mid = await store.get_run(rid)
        assert mid.status == "running" and mid.rollback_reason == "cancelled: plans changed"
        gate.execute("SELECT pg_advisory_unlock(%s)", (gate_lock,))
    done = await wait_run(store, run.id, lambda r: r.finished, 30)
    assert done.status == "cancelled"
    assert done.error == (
        "cancelled: plans changed; compensated: unbook for book (step 2), "
        "unbook for book (step 0)"
    )
    assert _effects(ledger_db, rid) == ["book:seat", "book:hotel", "unbook:hotel", "unbook:seat"]
    steps = await store.steps(rid)
    assert [s.kind for s in steps[-2:]] == ["compensation", "compensation"]


def _count(url: str, sql: str, run_id: str) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute(sql, (run_id,)).fetchone()
    return int(row[0]) if row else 0


async def test_a_sigstopped_worker_inside_a_tool_call_is_fenced_and_commits_nothing(
    store: Store, workers: Workers, fake: FakeFactory, ledger_db: str
) -> None:
    """The SIGSTOP zombie: a worker stopped inside an irreversible call loses its lease and
    another worker takes the run (which waits for a human, saying who may still be inside the
    call and until when). Woken by SIGCONT, the zombie commits nothing and starts nothing, and
    its tool sees the fence and stops instead of acting a second time."""
    srv = fake(
        {
            "name": "wire",
            "scripts": [
                {
                    "name": "wire",
                    "turns": [
                        {
                            "content": [
                                {"tool_use": {"name": "wire_transfer", "input": {"amount": 100}}}
                            ]
                        },
                        {"content": [{"text": "wired"}]},
                    ],
                }
            ],
        }
    )
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    run, _ = await store.create_run(
        "wire money", AGENT.model_copy(update={"tools": ["wire_transfer"]})
    )
    rid = str(run.id)
    tools = str(TOOLS_DIR / "ledger_tools.py")
    attempts_sql = "SELECT count(*) FROM ledger_attempts WHERE run_id = %s"
    fenced_sql = "SELECT count(*) FROM ledger_fenced WHERE run_id = %s"
    effects_sql = "SELECT count(*) FROM ledger_effects WHERE run_id = %s"
    opts = ["--tool-timeout", "60"]
    w1 = workers.start("w1", tools=tools, extra=opts)
    await wait_for(lambda: _count(ledger_db, attempts_sql, rid) == 1, 30, "w1 inside the call")
    w1.signal(signal.SIGSTOP)
    try:
        workers.start("w2", tools=tools, extra=opts)
        waiting = await wait_run(store, run.id, lambda r: r.status == "waiting_approval", 30)
    finally:
        w1.signal(signal.SIGCONT)
    reason = waiting.wait_reason or ""
    assert reason.startswith("outcome unknown: wire_transfer (step 0, attempt 1)"), reason
    assert "worker w1 may still be running it until" in reason, reason
    assert "plus the tool's 60 s timeout" in reason, reason
    # The same, as fields an on-call script can wait on (the soak's human does).
    call = waiting.pending_call or {}
    assert call["busy_worker"] == "w1", call
    busy_until = datetime.fromisoformat(call["busy_until"])
    lease_end = datetime.fromisoformat(str((waiting.tool_call or {})["lease_until"]))
    assert busy_until == lease_end + timedelta(seconds=60), (busy_until, lease_end)
    assert f"until {busy_until:%Y-%m-%d %H:%M:%S} UTC" in reason, reason
    assert waiting.error is not None and "while tool wire_transfer" in waiting.error

    await wait_for(lambda: _count(ledger_db, fenced_sql, rid) == 1, 30, "the zombie's fence")
    await wait_for(lambda: "lease lost" in w1.output(), 30, "the zombie to drop the run")
    assert w1.popen.poll() is None  # alive: it stopped acting on the run, nothing more
    after = await store.get_run(run.id)
    assert (after.status, after.lease_epoch) == ("waiting_approval", waiting.lease_epoch)
    assert [s.kind for s in await store.steps(run.id)] == ["model_turn"]
    with psycopg.connect(ledger_db) as conn:
        effect = conn.execute(
            "SELECT state, worker FROM tool_effect WHERE run_id = %s", (rid,)
        ).fetchall()
    assert effect == [("intent", "w1")]  # the zombie recorded no outcome
    assert _count(ledger_db, effects_sql, rid) == 0 and _count(ledger_db, attempts_sql, rid) == 1
    assert len(srv.requests()) == 1  # and called no model

    res = run_cli("approve", rid, "0", "--by", "oncall", env={"AGENTRUN_DATABASE_URL": ledger_db})
    assert res.returncode == 0, res.stderr
    done = await wait_run(store, run.id, lambda r: r.finished, 30)
    assert done.status == "succeeded", done.error
    assert _count(ledger_db, effects_sql, rid) == 1  # the money was sent once
    assert _count(ledger_db, attempts_sql, rid) == 2
    assert len(srv.requests()) == 2
