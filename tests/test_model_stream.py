"""Model calls whose 200 stream goes wrong, shown with real worker processes.

An error event inside the stream, a stream of pings alone, malformed server-sent events: each is
classified by what the stream carried (not by the HTTP status, which was 200), retried within the
call with backoff while the worker keeps the run's lease, and never wedges the run or burns its
attempts in milliseconds. And the request a resumed worker sends is byte for byte the one the
first worker sent, so the provider's prompt cache keeps hitting.
"""

from __future__ import annotations

import asyncio
import json
import signal
import urllib.request
from typing import Any

from agentrun.fake_anthropic import FakeAnthropicServer
from agentrun.store import Store
from tests.conftest import run_cli
from tests.workerkit import AGENT, FakeFactory, Workers, echo_scenario, wait_run


def use(workers: Workers, srv: FakeAnthropicServer) -> None:
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url


def scripts(**faults: list[dict[str, Any]]) -> dict[str, Any]:
    """One two-turn echo script per keyword, chosen by a task that names it; its turn 0 has the
    given faults."""
    out = []
    for name, turn0 in faults.items():
        script = echo_scenario(2, name=name, faults={0: turn0})["scripts"][0]
        out.append({**script, "match": f"[{name}]"})
    return {"name": "stream-faults", "scripts": out}


def turn0(srv: FakeAnthropicServer, script: str) -> list[dict[str, Any]]:
    return [e for e in srv.requests() if e.get("script") == script and e.get("turn") == 0]


def retries(lines: list[dict[str, Any]], run_id: Any) -> list[str]:
    return [
        x["msg"]
        for x in lines
        if x["logger"] == "agentrun.worker.model"
        and "retry" in x["msg"]
        and x.get("run_id") == str(run_id)
    ]


async def test_an_overload_inside_a_200_stream_is_retried_and_a_refusal_fails_once(
    store: Store, workers: Workers, fake: FakeFactory
) -> None:
    srv = fake(
        scripts(
            overloaded=[
                {"stream": "error", "type": "overloaded_error", "times": 2},
                {"stream": "error", "type": "api_error", "after_events": 4},
            ],
            refused=[{"stream": "error", "type": "invalid_request_error", "message": "bad"}],
        )
    )
    use(workers, srv)
    ok, _ = await store.create_run("echo [overloaded]", AGENT, max_attempts=1)
    refused, _ = await store.create_run("echo [refused]", AGENT, max_attempts=3)
    w = workers.start("w")
    done = await wait_run(store, ok.id, lambda r: r.finished, 60)
    # Retried within the one claim: a single attempt, and the fourth request got through.
    assert done.status == "succeeded", done.error
    assert done.attempt == 1
    assert [e.get("fault") for e in turn0(srv, "overloaded")] == ["stream error"] * 3 + [None]
    failed = await wait_run(store, refused.id, lambda r: r.finished, 30)
    assert failed.status == "failed" and failed.attempt == 1
    assert failed.error == (
        "model call failed: error event in the stream invalid_request_error: bad"
    )
    assert len(turn0(srv, "refused")) == 1  # a permanent error type is not retried
    w.signal(signal.SIGTERM)
    assert w.wait() == 0
    said = retries(w.json_lines(), ok.id)
    assert len(said) == 3
    assert sum("overloaded_error" in m for m in said) == 2 and "api_error" in said[2]


async def test_a_stream_of_pings_alone_ends_at_the_call_deadline_with_the_lease_kept(
    store: Store, workers: Workers, fake: FakeFactory
) -> None:
    srv = fake(scripts(stalled=[{"stream": "pings", "after_events": 0, "times": 2}]))
    use(workers, srv)
    run, _ = await store.create_run("echo [stalled]", AGENT, max_attempts=1)
    # The deadline (3 s) is longer than the lease TTL (1 s): the run is kept by the heartbeat,
    # not re-claimed (which maxAttempts 1 would dead-letter).
    w = workers.start("w", lease_ttl=1, health=True, env={"AGENTRUN_MODEL_DEADLINE": "3"})
    done = await wait_run(store, run.id, lambda r: r.finished, 60)
    assert done.status == "succeeded", done.error
    assert done.attempt == 1
    asked = turn0(srv, "stalled")
    assert [e.get("fault") for e in asked] == ["stream pings"] * 2 + [None]
    assert all(e["disconnected"] for e in asked[:2])  # the worker hung up on them
    url = f"http://127.0.0.1:{w.health_port}/metrics"
    metrics = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=30).read())
    assert b'agentrun_model_retries_total{reason="deadline"} 2.0' in metrics
    w.signal(signal.SIGTERM)
    assert w.wait() == 0
    said = retries(w.json_lines(), run.id)
    assert len(said) == 2 and all("deadline" in m for m in said)


async def test_malformed_streams_are_retried_within_the_call_and_then_end_the_run(
    store: Store, workers: Workers, fake: FakeFactory
) -> None:
    srv = fake(
        scripts(
            flaky=[{"stream": "garbage", "after_events": 3}, {"stream": "truncated"}],
            broken=[{"stream": "garbage", "times": 100}],
        )
    )
    use(workers, srv)
    # maxAttempts 1: a malformed stream that gave the claim up (the old "unknown error") would
    # dead-letter the run at once.
    flaky, _ = await store.create_run("echo [flaky]", AGENT, max_attempts=1)
    broken, _ = await store.create_run("echo [broken]", AGENT, max_attempts=1)
    w = workers.start("w", extra=["--model-retries", "2"])
    done = await wait_run(store, flaky.id, lambda r: r.finished, 60)
    assert done.status == "succeeded", done.error
    assert done.attempt == 1
    assert [e.get("fault") for e in turn0(srv, "flaky")] == [
        "stream garbage",
        "stream truncated",
        None,
    ]
    # The truncated stream was never committed as a turn: the log holds the real answers only.
    steps = await store.steps(flaky.id)
    assert [s.kind for s in steps] == ["model_turn", "tool_result", "model_turn"]
    assert all(s.payload["stop_reason"] for s in steps if s.kind == "model_turn")
    # A provider that is malformed every time: the retry budget (1 + 2 tries, with backoff), then
    # the claim is given up and the attempt cap ends the run, saying why.
    ended = await wait_run(store, broken.id, lambda r: r.finished, 60)
    assert ended.status == "dead_letter"
    assert ended.error is not None
    last = "model call failed 3 times; last: malformed_stream: malformed stream: JSONDecodeError"
    assert last in ended.error
    assert len(turn0(srv, "broken")) == 3
    w.signal(signal.SIGTERM)
    assert w.wait() == 0
    assert len(retries(w.json_lines(), broken.id)) == 2


async def test_a_resumed_worker_sends_the_same_request_bytes_as_the_first(
    store: Store, workers: Workers, fake: FakeFactory
) -> None:
    scenario = echo_scenario(3, slow={1: 100})
    srv = fake({**scenario, "record_bodies": True})
    use(workers, srv)
    run, _ = await store.create_run("echo three times", AGENT)
    # Turn 1 is seq 2: w1 commits turn 0 and its tool result, then dies as turn 1 streams.
    w1 = workers.start("w1", faults="mid_model_stream@2")
    assert w1.wait() == -signal.SIGKILL
    workers.start("w2")
    done = await wait_run(store, run.id, lambda r: r.finished, 30)
    assert done.status == "succeeded", done.error
    # In arrival order: turn 0 (w1), turn 1 (w1, killed while it streamed), turn 1 (w2).
    first, killed, resumed = [e["body"] for e in srv.requests() if e["turn"] in (0, 1)]
    # The whole request of turn 1, tools, system and history, byte for byte: w1's (its tool
    # definitions as resolved, its turn as the SDK assembled it) and w2's (rebuilt from the store).
    assert killed == resumed
    assert raw_value(first, "tools") == raw_value(resumed, "tools")
    assert raw_value(first, "system") == raw_value(resumed, "system")
    assert json.loads(raw_value(first, "tools"))[0]["name"] == "echo"


def raw_value(body: str, key: str) -> str:
    """The exact text of top-level ``key``'s value in a JSON body."""
    decoder = json.JSONDecoder()
    start = body.index(f'"{key}":') + len(key) + 3
    while body[start] in " \t\n":
        start += 1
    _, end = decoder.raw_decode(body, start)
    return body[start:end]


def test_a_model_deadline_that_is_not_positive_is_one_line_and_exit_2(database_url: str) -> None:
    done = run_cli(
        "worker", "--model-deadline", "0", env={"AGENTRUN_DATABASE_URL": database_url}
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "agentrun: error: --model-deadline 0.0 (AGENTRUN_MODEL_DEADLINE): must be more than 0 "
        "(seconds one model call may take; default 600)"
    ]
