"""Limits, bad tool input, heartbeats, poison runs and the drain's treatment of running tools."""

from __future__ import annotations

import signal
import time
from typing import Any

from agentrun.store import Store
from tests.workerkit import AGENT, FakeFactory, Workers, echo_scenario, wait_for, wait_run

SLEEPY = AGENT.model_copy(update={"tools": ["echo", "sleepy"]})


def one_tool_scenario(tool: str, tool_input: dict[str, Any], **turn: Any) -> dict[str, Any]:
    return {
        "name": "one",
        "scripts": [
            {
                "name": "one",
                "turns": [
                    {
                        "content": [
                            {"text": "calling"},
                            {"tool_use": {"name": tool, "input": tool_input}},
                        ],
                        **turn,
                    },
                    {"content": [{"text": "done"}]},
                ],
            }
        ],
    }


async def test_limits_fail_the_run_with_the_reason_and_bad_tool_input_is_reported_to_the_model(
    store: Store, workers: Workers, fake: FakeFactory
) -> None:
    srv = fake(
        {
            "name": "limits",
            "scripts": [
                {
                    "name": "maxtok",
                    "match": "truncate",
                    "turns": [
                        {"content": [{"text": "a very long answer"}], "stop_reason": "max_tokens"}
                    ],
                },
                {
                    "name": "badinput",
                    "match": "bad input",
                    "turns": [
                        {"content": [{"tool_use": {"name": "echo", "input": {"txt": "typo"}}}]},
                        {"content": [{"text": "I fixed my call."}]},
                    ],
                },
                {
                    "name": "loop",
                    "turns": [
                        {"content": [{"tool_use": {"name": "echo", "input": {"text": str(i)}}}]}
                        for i in range(5)
                    ],
                },
            ],
        }
    )
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    truncated, _ = await store.create_run("truncate this", AGENT)
    bad, _ = await store.create_run("bad input please", AGENT)
    looping, _ = await store.create_run("loop forever", AGENT, max_steps=3)
    workers.start("w")
    t = await wait_run(store, truncated.id, lambda r: r.finished, 30)
    assert t.status == "failed" and t.error is not None and "max_tokens" in t.error
    b = await wait_run(store, bad.id, lambda r: r.finished, 30)
    assert b.status == "succeeded" and b.result == "I fixed my call."
    result = (await store.steps(bad.id))[1].payload["content"][0]
    assert result["is_error"] is True and "text" in result["content"]
    loop = await wait_run(store, looping.id, lambda r: r.finished, 30)
    assert loop.status == "failed" and loop.error == "maxSteps 3 reached without a final answer"
    assert sum(1 for s in await store.steps(looping.id) if s.kind == "model_turn") == 3


async def test_heartbeat_keeps_the_lease_through_a_model_call_longer_than_the_ttl(
    store: Store, workers: Workers, fake: FakeFactory
) -> None:
    srv = fake(echo_scenario(2, delay_ms=4000))  # each model call takes 4 s; the lease is 1.5 s
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    run, _ = await store.create_run("echo slowly", AGENT)
    workers.start("a", lease_ttl=1.5)
    await wait_run(store, run.id, lambda r: r.lease_owner == "a", 20)
    workers.start("b", lease_ttl=1.5)  # would take the run over if a's lease ever lapsed
    done = await wait_run(store, run.id, lambda r: r.finished, 40)
    assert done.status == "succeeded" and done.attempt == 1 and done.lease_epoch == 1
    assert {s.worker for s in await store.steps(run.id)} == {"a"}


async def test_transient_failures_past_the_retry_budget_dead_letter_the_run(
    store: Store, workers: Workers, fake: FakeFactory
) -> None:
    srv = fake(echo_scenario(2, faults={0: [{"status": 529, "times": 100}]}))
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    run, _ = await store.create_run("echo", AGENT, max_attempts=3)
    workers.start("w", extra=["--model-retries", "1"])
    done = await wait_run(store, run.id, lambda r: r.finished, 60)
    assert done.status == "dead_letter" and done.attempt == 3
    assert done.error is not None and "529" in done.error
    assert len(srv.requests()) == 6  # 3 claims x (1 call + 1 retry), then never again


async def test_a_run_that_progresses_between_sigkills_is_never_dead_lettered(
    store: Store, workers: Workers, fake: FakeFactory
) -> None:
    srv = fake(echo_scenario(6))  # model turns at seqs 0, 2, 4, 6, 8 call echo; seq 10 answers
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    healthy, _ = await store.create_run("echo", AGENT, max_attempts=3)
    # Each worker commits one model turn (after the previous turn's tool result) and dies.
    for n in range(5):
        w = workers.start(f"k{n}", faults="after_model_turn_commit@*")
        assert w.wait() == -signal.SIGKILL, w.output()[-2000:]
        run = await store.get_run(healthy.id)
        assert run.next_seq == 2 * n + 1 and run.status == "running", (n, run.error)
    workers.start("last")
    done = await wait_run(store, healthy.id, lambda r: r.finished, 40)
    assert done.status == "succeeded", done.error
    assert done.attempt == 6 and done.next_seq == 11  # every death counted, none fatal


async def test_a_run_killed_before_any_step_every_time_is_dead_lettered_at_max_attempts(
    store: Store, workers: Workers, fake: FakeFactory
) -> None:
    srv = fake(echo_scenario(2))
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    poison, _ = await store.create_run("echo", AGENT, max_attempts=3)
    for n in range(3):
        w = workers.start(f"k{n}", faults="mid_model_stream@*")
        assert w.wait() == -signal.SIGKILL, w.output()[-2000:]
    workers.start("last")
    done = await wait_run(store, poison.id, lambda r: r.finished, 40)
    assert done.status == "dead_letter" and done.attempt == 3 and done.next_seq == 0
    assert done.error is not None and "claimed 3 times in a row without committing a step" in (
        done.error
    )
    assert len(srv.requests()) == 3  # the fourth claim dead-lettered it: no fourth model call


async def test_drain_lets_a_running_tool_commit_then_releases_and_a_second_signal_exits_at_once(
    store: Store, workers: Workers, fake: FakeFactory
) -> None:
    srv = fake(one_tool_scenario("sleepy", {"seconds": 1.5}))
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    run, _ = await store.create_run("sleep a little", SLEEPY)
    a = workers.start("a", lease_ttl=30, poll=30)
    await wait_run(store, run.id, lambda r: r.next_seq == 1, 20)  # the tool is running now
    a.signal(signal.SIGTERM)
    assert a.wait() == 0
    steps = await store.steps(run.id)
    assert [(s.kind, s.worker) for s in steps] == [("model_turn", "a"), ("tool_result", "a")]
    assert steps[1].payload["content"][0]["content"] == "slept 1.5s"
    assert (await store.get_run(run.id)).status == "pending"  # released at once, not after 30 s

    srv2 = fake(one_tool_scenario("sleepy", {"seconds": 30}))
    workers.env["ANTHROPIC_BASE_URL"] = srv2.base_url
    stuck, _ = await store.create_run("sleep a long time", SLEEPY)
    await store.cancel(run.id)
    b = workers.start("b", lease_ttl=30, poll=30)
    await wait_run(store, stuck.id, lambda r: r.next_seq == 1, 20)
    b.signal(signal.SIGTERM)
    await wait_for(lambda: "draining" in b.output(), 10, "the drain to start")
    t0 = time.monotonic()
    b.signal(signal.SIGTERM)
    assert b.wait(10) == 1
    assert time.monotonic() - t0 < 2
