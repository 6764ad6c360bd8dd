"""Prompt caching with real worker processes against the scripted server's cache accounting.

The worker marks the tools, the system prompt and the history with cache_control breakpoints
derived from the pinned prompt and the step log alone; the scripted server keeps the prefixes
those breakpoints write and reports reads and writes as the API does. So every turn after the
first reads the previous turn's prefix, and a worker that resumes a run SIGKILLed mid-turn sends
the same bytes and reads the cache the dead one wrote.
"""

from __future__ import annotations

import itertools
import json
import signal
from typing import Any

from agentrun.fake_anthropic import FakeAnthropicServer
from agentrun.store import Run, Store
from tests.workerkit import AGENT, FakeFactory, Workers, echo_scenario, wait_run


async def assert_totals_are_the_steps_sum(store: Store, run: Run) -> None:
    """The run's four token totals are the sums of its committed turns' usage."""
    usage = [s.payload["usage"] for s in await store.steps(run.id) if s.kind == "model_turn"]
    assert usage
    assert (run.input_tokens, run.output_tokens, run.cache_read_tokens, run.cache_write_tokens) == (
        sum(u["input_tokens"] for u in usage),
        sum(u["output_tokens"] for u in usage),
        sum(u["cache_read_input_tokens"] for u in usage),
        sum(u["cache_creation_input_tokens"] for u in usage),
    )
    assert run.cache_read_tokens > 0 and run.cache_write_tokens > 0


def answered(srv: FakeAnthropicServer) -> list[dict[str, Any]]:
    return [e for e in srv.requests() if e.get("status") == 200]


async def test_every_turn_after_the_first_reads_the_previous_prefix(
    store: Store, workers: Workers, fake: FakeFactory
) -> None:
    srv = fake({**echo_scenario(4), "record_bodies": True})
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    run, _ = await store.create_run("echo four times", AGENT)
    w = workers.start("w")
    done = await wait_run(store, run.id, lambda r: r.finished, 60)
    assert done.status == "succeeded", done.error
    w.signal(signal.SIGTERM)
    assert w.wait() == 0
    entries = answered(srv)
    assert [e["turn"] for e in entries] == [0, 1, 2, 3]
    usage = [e["usage"] for e in entries]
    # Turn 0 writes tools + system + task; nothing was cached before it.
    assert usage[0]["cache_read_input_tokens"] == 0
    assert usage[0]["cache_creation_input_tokens"] > 0
    for prev, now in itertools.pairwise(usage):
        # Each turn reads all the previous one wrote or read, and writes only what is new.
        assert now["cache_read_input_tokens"] == (
            prev["cache_read_input_tokens"] + prev["cache_creation_input_tokens"]
        )
        assert now["cache_creation_input_tokens"] > 0
    body = json.loads(entries[1]["body"])
    assert body["tools"][-1]["cache_control"] == {"type": "ephemeral"}
    assert body["system"][-1]["cache_control"] == {"type": "ephemeral"}
    assert body["messages"][-1]["content"][-1]["cache_control"] == {"type": "ephemeral"}
    # The step log keeps each turn's usage as the provider reported it.
    turns = [s for s in await store.steps(run.id) if s.kind == "model_turn"]
    assert [s.payload["usage"]["cache_read_input_tokens"] for s in turns] == [
        u["cache_read_input_tokens"] for u in usage
    ]
    await assert_totals_are_the_steps_sum(store, done)


async def test_prompt_caching_off_sends_no_breakpoints_and_reads_nothing(
    store: Store, workers: Workers, fake: FakeFactory
) -> None:
    srv = fake({**echo_scenario(3), "record_bodies": True})
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    agent = AGENT.model_copy(update={"prompt_caching": False})
    run, _ = await store.create_run("echo three times", agent)
    w = workers.start("w")
    done = await wait_run(store, run.id, lambda r: r.finished, 60)
    assert done.status == "succeeded", done.error
    w.signal(signal.SIGTERM)
    assert w.wait() == 0
    entries = answered(srv)
    assert len(entries) == 3
    assert all("cache_control" not in e["body"] for e in entries)
    assert all(e["usage"]["cache_read_input_tokens"] == 0 for e in entries)
    assert all(e["usage"]["cache_creation_input_tokens"] == 0 for e in entries)


async def test_a_resumed_worker_sends_the_same_bytes_and_reads_the_dead_ones_cache(
    store: Store, workers: Workers, fake: FakeFactory
) -> None:
    srv = fake({**echo_scenario(3, slow={1: 100}), "record_bodies": True})
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    run, _ = await store.create_run("echo three times", AGENT)
    # Turn 1 is seq 2: w1 commits turn 0 and its tool result, then dies as turn 1 streams.
    w1 = workers.start("w1", faults="mid_model_stream@2")
    assert w1.wait() == -signal.SIGKILL
    w2 = workers.start("w2")
    done = await wait_run(store, run.id, lambda r: r.finished, 60)
    assert done.status == "succeeded", done.error
    w2.signal(signal.SIGTERM)
    assert w2.wait() == 0
    _, killed, resumed = [e for e in answered(srv) if e["turn"] in (0, 1)]
    assert killed["body"] == resumed["body"]
    # The killed request wrote its prefix; the resumed one reads all of it and writes nothing.
    assert killed["usage"]["cache_read_input_tokens"] > 0
    assert resumed["usage"]["cache_creation_input_tokens"] == 0
    assert resumed["usage"]["cache_read_input_tokens"] == (
        killed["usage"]["cache_read_input_tokens"] + killed["usage"]["cache_creation_input_tokens"]
    )
    await assert_totals_are_the_steps_sum(store, done)


def test_breakpoints_copy_only_what_they_mark_and_never_touch_the_history() -> None:
    """place_breakpoints shares the unmarked messages' blocks with the history (a turn no longer
    copies every block of a long conversation) and writes nothing into it: the history is what
    the step log holds, and a breakpoint that leaked into it would change every later request."""
    from agentrun.worker.model_call import EPHEMERAL, place_breakpoints

    history: list[dict[str, Any]] = [
        {"role": "user", "content": "task"},
        {"role": "assistant", "content": [{"type": "text", "text": "a"},
                                          {"type": "tool_use", "id": "t1", "name": "echo",
                                           "input": {"text": "x"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t2", "name": "echo",
                                           "input": {"text": "y"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2", "content": "y"}]},
    ]
    tools = [{"name": "a", "input_schema": {}}, {"name": "b", "input_schema": {}}]
    before = json.dumps([history, tools])
    out, new_tools, system = place_breakpoints(history, tools, "sys")
    assert json.dumps([history, tools]) == before  # nothing written into what was passed
    marked = [(i, j) for i, m in enumerate(out) for j, b in enumerate(m["content"])
              if "cache_control" in b]
    # The newest block, and the last block of the previous request (before the newest turn).
    assert marked == [(2, 0), (4, 0)]
    assert out[4]["content"][0]["cache_control"] == EPHEMERAL
    assert out[0]["content"] == [{"type": "text", "text": "task"}]  # a string: one text block
    assert out[1]["content"] is history[1]["content"]  # unmarked: shared, not copied
    assert new_tools is not None and "cache_control" in new_tools[-1]
    assert "cache_control" not in new_tools[0] and new_tools[0] is tools[0]
    assert system == [{"type": "text", "text": "sys", "cache_control": EPHEMERAL}]
