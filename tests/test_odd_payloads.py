"""Payloads PostgreSQL cannot hold as is are stored losslessly (issue 12, F7).

text refuses NUL; jsonb refuses the \\u0000 escape and lone surrogates (which have no UTF-8 form).
Refused, a step used to be abandoned and re-claimed, its tools re-run each time, until the run was
dead-lettered. The store now escapes such strings on write and unescapes them on read
(agentrun.store, "what PostgreSQL cannot hold"): a real worker runs the run once, the step log
reads back exactly, and the next request carries exactly what the model sent and the tool
returned.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from psycopg.types.json import Jsonb

from agentrun.manifests import AgentSpec
from agentrun.store import (
    PromptVersion,
    Store,
    escape_text,
    jsonb_form,
    loaded_json,
    stored_json,
    unescape_text,
)
from tests.workerkit import AGENT, FakeFactory, Workers, wait_run

MODEL_TEXT = "x\x00y\ud800z"  # what the scripted model says (sent as JSON escapes)
TOOL_TEXT = "a\x00b\ud800c"  # what tests/tool_modules/odd_payloads.py returns
TASK = "task with a NUL \x00 and a lone surrogate \udc80"

ODD_STRINGS = [
    "",
    "plain text, ünïcödé and 😀",
    "\x00",
    "\ud800",
    "\udfff\ud800",
    "\ud83d\ude00",  # a surrogate pair held as two code points: kept as two
    "\uffff",
    "\uffff0",
    "\uffff\uffff0\x00",
    "\uffffd800",
    "tail escape \uffff",
    MODEL_TEXT,
]


@pytest.mark.parametrize("text", ODD_STRINGS)
def test_the_escape_is_lossless(text: str) -> None:
    assert unescape_text(escape_text(text)) == text
    assert "\x00" not in escape_text(text)
    assert not any(0xD800 <= ord(c) <= 0xDFFF for c in escape_text(text))
    value = {text: [text, {"k": text}, 1, 2.5, None, True]}
    assert loaded_json(stored_json(value)) == value


JSONB_NUMBERS = [1e16, -1e16, 1.5e300, 1.7976931348623157e308, -0.0, 0.0, 1e-7, 5e-324, 0.1,
                 123.5, 1e15, 10**20, -0, True, None]


async def test_jsonb_form_is_what_a_jsonb_column_gives_back(store: Store) -> None:
    """jsonb_form (what the live run carries on from) against PostgreSQL's own jsonb: the same
    values of the same types, compared as JSON text (1e16 == 10**16 in Python)."""
    value = {"n": JSONB_NUMBERS, "deep": [{"x": n} for n in JSONB_NUMBERS]}
    async with store.pool.connection() as conn:
        cur = await conn.execute("SELECT %s::jsonb", [Jsonb(value)])
        row = await cur.fetchone()
    assert row is not None
    assert json.dumps(jsonb_form(value)) == json.dumps(row[0])
    same = {"n": [1, 2.5, 1e-7, "1e+16"]}
    assert jsonb_form(same) is same  # nothing to change: not copied


async def test_odd_strings_round_trip_through_every_kind_of_column(store: Store) -> None:
    agent = AgentSpec(model="claude-sonnet-4-5", system="system \x00 prompt")
    run, _ = await store.create_run(TASK, agent)
    assert (await store.get_run(run.id)).task == TASK
    assert (await store.get_run(run.id)).agent_spec["system"] == "system \x00 prompt"
    pv = PromptVersion(
        model="claude-sonnet-4-5",
        system="".join(ODD_STRINGS),
        tools=[{"name": "t", "description": s, "input_schema": {s: s}} for s in ODD_STRINGS],
        params={"max_tokens": 10},
    )
    await store.ensure_prompt_version(pv)
    assert await store.get_prompt_version(pv.id) == pv
    [(_, lease)] = (await store.claim(run.pool, "w1")).claimed
    payload: dict[str, Any] = {"content": [{"type": "text", "text": s} for s in ODD_STRINGS],
                               "\x00key\ud800": "\uffff"}
    await store.append_step(lease, 0, "model_turn", payload)
    [step] = await store.steps(run.id)
    assert step.payload == payload
    await store.finish(lease, "failed", error="error \x00\ud800", result="result \udfff")
    done = await store.get_run(run.id)
    assert (done.error, done.result) == ("error \x00\ud800", "result \udfff")


def odd_scenario() -> dict[str, Any]:
    return {"name": "odd", "record_messages": True, "scripts": [{"name": "odd", "turns": [
        {"content": [{"text": "x\\u0000y\\ud800z", "json_escapes": True},
                     {"tool_use": {"name": "odd", "input": {"text": "go"}}}]},
        {"content": [{"text": "done"}]},
    ]}]}


@pytest.mark.parametrize("resumed", [False, True], ids=["one-worker", "resumed-from-the-log"])
async def test_a_nul_and_a_lone_surrogate_from_model_and_tool_are_kept_exactly(
    store: Store, workers: Workers, fake: FakeFactory, tmp_path: Path, resumed: bool
) -> None:
    srv = fake(odd_scenario())
    calls = tmp_path / "odd-calls.txt"
    workers.env.update(ANTHROPIC_BASE_URL=srv.base_url, ODD_TOOL_CALLS=str(calls))
    # Without cache breakpoints, so the messages sent compare equal to the step log as stored
    # (tests/test_prompt_cache.py covers the bytes with breakpoints, across a resume).
    agent = AGENT.model_copy(update={"tools": ["odd"], "thinking": None, "prompt_caching": False})
    run, _ = await store.create_run(TASK, agent)
    if resumed:
        # SIGKILLed once the tool result is committed: the next worker rebuilds the
        # conversation it sends from the step log alone.
        first = workers.start("w0", tools="odd_payloads.py", faults="after_tool_result_commit@1")
        assert first.wait(60) == -9, first.output()[-3000:]
    w = workers.start("w1", tools="odd_payloads.py")
    done = await wait_run(store, run.id, lambda r: r.finished, 60)
    assert done.status == "succeeded", (done.error, w.output()[-3000:])
    assert done.attempt == (2 if resumed else 1)  # no abandon and re-claim loop
    assert calls.read_text().splitlines() == [f"{run.id} 0"]  # the tool ran once

    steps = await store.steps(run.id)
    assert [s.kind for s in steps] == ["model_turn", "tool_result", "model_turn"]
    turn = steps[0].payload["content"]
    assert [b["text"] for b in turn if b["type"] == "text"] == [MODEL_TEXT]
    [result] = steps[1].payload["content"]
    assert result["content"] == TOOL_TEXT

    asked = [r for r in srv.requests() if r.get("status") == 200]
    # Resumed: the killed worker's next request may already be out (its call overlaps the
    # results' commit, the fault point fires after that commit); the resumed worker then asks
    # the same turn again, with the same messages.
    assert len(asked) in ((2, 3) if resumed else (2,)), asked
    first, second = asked[0], asked[-1]
    if len(asked) == 3:
        assert asked[1]["messages"] == second["messages"]
    assert first["messages"] == [{"role": "user", "content": TASK}]
    # The second request is the task, the model's turn as it sent it, and the tool's output.
    assert second["messages"][0] == {"role": "user", "content": TASK}
    assert second["messages"][1]["role"] == "assistant"
    sent = second["messages"][1]["content"]
    assert [b["text"] for b in sent if b["type"] == "text"] == [MODEL_TEXT]
    assert sent == turn
    assert second["messages"][2] == {"role": "user", "content": steps[1].payload["content"]}
    assert second["messages"][2]["content"][0]["content"] == TOOL_TEXT


async def test_a_number_beyond_the_float_range_fails_the_run_once_with_its_place(
    store: Store, workers: Workers, fake: FakeFactory
) -> None:
    """A model may write a tool input number beyond the float range (1e400, valid JSON), which
    Python reads as infinity: jsonb refuses it, and no request could carry it back. The run fails
    at once, naming where, instead of being given up and claimed again, the model paid each time,
    until it was dead-lettered (found by an adversarial review on 2026-12-06)."""
    srv = fake({"name": "huge", "scripts": [{"name": "huge", "turns": [
        {"content": [{"text": "scaling"},
                     {"tool_use": {"name": "echo",
                                   "input": {"text": "go", "factor": [1.5, math.inf]}}}]},
        {"content": [{"text": "done"}]},
    ]}]})
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    run, _ = await store.create_run("scale it", AGENT, max_attempts=3)
    w = workers.start("w1")
    done = await wait_run(store, run.id, lambda r: r.finished, 60)
    assert (done.status, done.attempt) == ("failed", 1), (done.status, done.error,
                                                          w.output()[-3000:])
    assert done.error == (
        "the model's turn at seq 0 holds a number beyond the float range at "
        "content[1].input.factor[1] (such as 1e400): it can be neither stored verbatim nor sent "
        "back to the model; `agentrun retry` asks the model again")
    assert await store.steps(run.id) == []  # nothing half-stored
    assert len([r for r in srv.requests() if r.get("status") == 200]) == 1  # paid once


@pytest.mark.parametrize("resumed", [False, True], ids=["one-worker", "resumed-from-the-log"])
async def test_numbers_jsonb_writes_back_otherwise_give_the_same_key_and_request(
    store: Store, workers: Workers, fake: FakeFactory, tmp_path: Path, resumed: bool
) -> None:
    """jsonb writes 1e+16 back as 10000000000000000 (an int) and -0.0 as 0.0. The live worker
    hashed a tool call's idempotency key from the input as the model sent it, a resumed worker
    from the input read back from the log: a non-idempotent call retried after a crash reached
    its target under a new key, and was done twice; every later request differed too (found by
    an adversarial review on 2026-12-06). The live run now carries on from the stored form."""
    srv = fake({"name": "big", "record_messages": True, "scripts": [{"name": "big", "turns": [
        {"content": [{"text": "charging"}, {"tool_use": {"name": "charge", "input": {
            "amount": 1e16, "offset": -0.0, "rate": 1.5e300}}}]},
        {"content": [{"text": "done"}]},
    ]}]})
    calls = tmp_path / "charge-calls.txt"
    workers.env.update(ANTHROPIC_BASE_URL=srv.base_url, ODD_TOOL_CALLS=str(calls))
    agent = AGENT.model_copy(update={"tools": ["charge"], "thinking": None,
                                     "prompt_caching": False})
    run, _ = await store.create_run("charge it", agent)
    if resumed:
        # SIGKILLed after the call returned, before its effect is recorded: called again.
        first = workers.start("w0", tools="odd_payloads.py", faults="after_tool_return@0")
        assert first.wait(60) == -9, first.output()[-3000:]
    w = workers.start("w1", tools="odd_payloads.py")
    done = await wait_run(store, run.id, lambda r: r.finished, 60)
    assert done.status == "succeeded", (done.error, w.output()[-3000:])

    made = calls.read_text().splitlines()
    assert len(made) == (2 if resumed else 1)
    assert len({line.split()[2] for line in made}) == 1, made  # one key: its target dedupes
    assert {" ".join(line.split()[3:]) for line in made} == {"1e+16 0.0 1.5e+300"}, made
    steps = await store.steps(run.id)
    stored = steps[0].payload["content"]
    assert stored[1]["input"]["amount"] == 10_000_000_000_000_000
    asked = [r for r in srv.requests() if r.get("status") == 200]
    sent = asked[-1]["messages"][1]["content"]  # the turn, as the next request carried it
    assert json.dumps(sent, sort_keys=True) == json.dumps(stored, sort_keys=True)


async def test_a_turn_that_stops_for_tools_but_asks_for_none_fails_the_run_without_a_call(
    store: Store, workers: Workers, fake: FakeFactory
) -> None:
    """stop_reason tool_use with no tool_use block: answered, it committed an empty tool_result
    step and sent an empty user message (which the API refuses), a step `agentrun retry` would
    replay (found by an adversarial review on 2026-12-06). The scripted server will not write
    such a turn, so it is in the log as a worker would have committed it; the next worker fails
    the run, naming it, before asking the model anything."""
    srv = fake({"name": "x", "scripts": [{"name": "x", "turns": [{"content": [{"text": "hi"}]}]}]})
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    run, _ = await store.create_run("task", AGENT.model_copy(update={"tools": ["echo"]}))
    ((_, lease),) = (await store.claim("default", "w0", 1)).claimed
    await store.append_step(lease, 0, "model_turn", {
        "role": "assistant", "content": [{"type": "text", "text": "let me call a tool"}],
        "stop_reason": "tool_use"})
    await store.release(lease)
    w = workers.start("w1")
    done = await wait_run(store, run.id, lambda r: r.finished, 60)
    assert (done.status, done.error) == ("failed", (
        "model stopped with stop_reason 'tool_use' at seq 0 but asked for no tool (no tool_use "
        "block)")), w.output()[-3000:]
    assert [s.kind for s in await store.steps(run.id)] == ["model_turn"]
    assert srv.requests() == []

