"""A tool cannot take its worker down, hold its run for ever, or keep a stopped worker alive.

Real worker processes and real signals: a tool that calls ``sys.exit``/raises BaseException is
a failed call, the worker lives; one that calls ``os._exit`` kills its worker, and the run whose
call did it is the one blamed (with the tool's name), while the runs sharing that worker lose
no attempt; a call that outlives its timeout is a failed call (an irreversible one's outcome is
unknown: a human decides); a call stuck in a thread does not keep a SIGTERMed worker alive.
"""

from __future__ import annotations

import signal
from typing import Any

import pytest

from agentrun.store import Store
from tests.workerkit import AGENT, TOOLS_DIR, FakeFactory, Workers, wait_run

TOOLS = str(TOOLS_DIR / "containment_tools.py")


def calls(
    *uses: tuple[str, dict[str, Any]], delay_ms: dict[str, int] | None = None
) -> dict[str, Any]:
    """One script per tool: "use TOOL." calls it once, then answers."""
    return {
        "name": "containment",
        "scripts": [
            {
                "name": tool,
                "match": f"use {tool}.",
                "turns": [
                    {
                        "delay_ms": (delay_ms or {}).get(tool, 0),
                        "content": [{"tool_use": {"name": tool, "input": tool_input}}],
                    },
                    {"content": [{"text": f"{tool} done."}]},
                ],
            }
            for tool, tool_input in uses
        ],
    }


def agent(*tools: str) -> Any:
    return AGENT.model_copy(update={"tools": list(tools), "thinking": None})


async def test_a_tool_raising_base_exceptions_fails_its_call_and_the_worker_lives(
    store: Store, workers: Workers, fake: FakeFactory
) -> None:
    hows = ["sys_exit", "keyboard_interrupt", "base_exception"]
    srv = fake(
        {
            "name": "quit",
            "scripts": [
                *[
                    {
                        "name": how,
                        "match": f"quit by {how}",
                        "turns": [
                            {
                                "content": [
                                    {"tool_use": {"name": "quit_worker", "input": {"how": how}}}
                                ]
                            },
                            {"content": [{"text": "still here"}]},
                        ],
                    }
                    for how in hows
                ],
                *calls(("cancel_itself", {}))["scripts"],
            ],
        }
    )
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    runs = [(await store.create_run(f"quit by {how}", agent("quit_worker")))[0] for how in hows] + [
        (await store.create_run("use cancel_itself.", agent("cancel_itself")))[0]
    ]
    w = workers.start("w", tools=TOOLS, extra=["--concurrency", "2"])
    expected = [
        "tool quit_worker raised SystemExit: 3",
        "tool quit_worker raised KeyboardInterrupt",
        "tool quit_worker raised Escape: escaped",
        "tool cancel_itself raised CancelledError",
    ]
    for run, text in zip(runs, expected, strict=True):
        done = await wait_run(store, run.id, lambda r: r.finished, 30)
        assert done.status == "succeeded", (done.error, w.output()[-2000:])
        result = (await store.steps(run.id))[1].payload["content"][0]
        assert result["is_error"] is True and text in result["content"], result
        assert done.attempt == 1
    assert w.popen.poll() is None, w.output()[-2000:]  # one worker did all four, and lives


async def test_a_tool_that_kills_its_worker_is_blamed_and_its_neighbours_lose_no_attempt(
    store: Store, workers: Workers, fake: FakeFactory
) -> None:
    # The neighbour's first model turn is slow: it is in flight whenever the other run's tool
    # calls os._exit, on each worker that holds both.
    srv = fake(
        calls(
            ("quit_worker", {"how": "os_exit"}),
            ("echo", {"text": "hi"}),
            delay_ms={"echo": 4000},
        )
    )
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    await killed_three_times(store, workers, "use quit_worker.", "quit_worker", "quit_worker")


async def killed_three_times(
    store: Store, workers: Workers, task: str, tool: str, culprit: str
) -> None:
    """The killer run (``task``, granted ``tool``) takes each worker down in ``culprit`` beside
    its neighbour ("use echo.", in a slow model call on the same worker): it is blamed and
    dead-lettered, the neighbour loses no attempt."""
    killer, _ = await store.create_run(task, agent(tool), max_attempts=2)
    neighbour, _ = await store.create_run("use echo.", agent("echo"), max_attempts=2)
    # Three deaths: the first claim committed the killer's model turn, which restores its
    # attempt budget once (a run that progresses is not a poison run); the next two committed
    # nothing, and maxAttempts 2 dead-letters it at the fourth claim.
    for name in ("w1", "w2", "w3"):
        w = workers.start(name, tools=TOOLS, extra=["--concurrency", "2"])
        assert w.wait(60) == 7, w.output()[-2000:]
    workers.start("w4", tools=TOOLS, extra=["--concurrency", "2"])
    dead = await wait_run(store, killer.id, lambda r: r.finished, 30)
    assert dead.status == "dead_letter"
    # The dead letter names the death that ended it: the last worker the tool took down.
    assert dead.error is not None and dead.error.endswith(
        f"last error: worker w3 died or stopped responding while tool {culprit} "
        "(step 0, call 0) was running"
    ), dead.error
    ok = await wait_run(store, neighbour.id, lambda r: r.finished, 30)
    assert ok.status == "succeeded", ok.error
    assert ok.attempt == 1  # three worker deaths that were not its doing did not count



async def test_a_compensation_that_kills_its_worker_is_blamed_and_spares_its_neighbours(
    store: Store, workers: Workers, fake: FakeFactory
) -> None:
    # The killer holds an item, then the model refuses: the run fails, and its rollback calls
    # hold's compensation, which calls os._exit, on every claim. Its neighbour is in a slow
    # model call on the same worker each time (as in the test above).
    scenario = calls(("echo", {"text": "hi"}), delay_ms={"echo": 4000})
    scenario["scripts"].append({
        "name": "saga",
        "match": "use hold.",
        "turns": [
            {"content": [{"tool_use": {"name": "hold", "input": {"item": "seat"}}}]},
            {"stop_reason": "refusal", "content": [{"text": "no"}]},
        ],
    })
    srv = fake(scenario)
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    await killed_three_times(store, workers, "use hold.", "hold", "unhold_by_exit")


async def test_a_call_past_its_timeout_is_a_failed_call(
    store: Store, workers: Workers, fake: FakeFactory
) -> None:
    srv = fake(calls(("hang", {}), ("hang_irreversible", {})))
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    pure, _ = await store.create_run("use hang.", agent("hang"))
    irreversible, _ = await store.create_run("use hang_irreversible.", agent("hang_irreversible"))
    w = workers.start("w", tools=TOOLS, extra=["--concurrency", "1", "--tool-timeout", "1"])
    done = await wait_run(store, pure.id, lambda r: r.finished, 30)
    assert done.status == "succeeded", done.error
    result = (await store.steps(pure.id))[1].payload["content"][0]
    assert result["is_error"] is True
    assert result["content"] == "ToolTimeout: tool hang did not return within its timeout of 0.5 s"
    # The slot is free again (concurrency 1): the irreversible call runs, times out after the
    # worker's --tool-timeout, and its outcome is unknown: a human decides.
    waiting = await wait_run(store, irreversible.id, lambda r: r.status == "waiting_approval", 30)
    assert waiting.wait_reason is not None and waiting.wait_reason.startswith(
        "outcome unknown: hang_irreversible (step 0, attempt 1) did not return within its 1 s "
        "timeout; it may still be running in worker w"
    ), waiting.wait_reason
    call = waiting.pending_call
    assert call is not None and (call["stage"], call["attempt"]) == ("outcome_unknown", 1)
    assert w.popen.poll() is None


@pytest.mark.parametrize("tool", ["hang_sync", "hang_in_executor"])
async def test_a_worker_stuck_in_a_tool_exits_on_sigterm_within_its_grace(
    tool: str, store: Store, workers: Workers, fake: FakeFactory
) -> None:
    srv = fake(calls((tool, {})))
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    run, _ = await store.create_run(f"use {tool}.", agent(tool))
    w = workers.start("w", tools=TOOLS, extra=["--drain-grace", "1", "--tool-timeout", "3600"])
    # The call is marked on the run just before it is invoked.
    await wait_run(store, run.id, lambda r: (r.tool_call or {}).get("tool") == tool, 30)
    w.signal(signal.SIGTERM)
    assert w.wait(30) == 0, w.output()[-2000:]
    released = await store.get_run(run.id)
    assert (released.status, released.lease_owner, released.attempt) == ("pending", None, 0)
