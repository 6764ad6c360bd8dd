"""The worker's guarantees, shown with real processes: SIGKILL, SIGSTOP, SIGTERM, cancel, faults.

Each test runs real ``agentrun worker`` processes against a real PostgreSQL database of its own and
the scripted Messages API server, which the real anthropic SDK talks to over HTTP. The server
checks thinking signatures on every request, so any resumed conversation that differs from what
the model saw by one field fails with the real 400.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

from agentrun.fake_anthropic import FakeAnthropicServer
from agentrun.store import Store
from tests.conftest import run_cli
from tests.workerkit import (
    AGENT,
    FakeFactory,
    Workers,
    echo_scenario,
    free_port,
    wait_for,
    wait_run,
)


def use(workers: Workers, srv: FakeAnthropicServer) -> None:
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url


def statuses(srv: FakeAnthropicServer) -> list[int]:
    return [int(e["status"]) for e in srv.requests() if "status" in e]


async def test_sigkill_between_steps_and_mid_stream_resumes_without_repeating(
    store: Store, workers: Workers, fake: FakeFactory
) -> None:
    srv = fake(echo_scenario(6, slow={4: 100}))
    use(workers, srv)
    run, _ = await store.create_run("echo six times", AGENT)
    # Steps: turn k is seq 2k, its tool results seq 2k+1. Step 3's results are seq 5.
    w1 = workers.start("w1", faults="after_tool_result_commit@5")
    assert w1.wait() == -signal.SIGKILL
    w2 = workers.start("w2", faults="mid_model_stream@8")  # killed while turn 4 streams
    assert w2.wait() == -signal.SIGKILL
    workers.start("w3")
    done = await wait_run(store, run.id, lambda r: r.finished, 30)
    assert done.status == "succeeded", done.error
    assert done.result == "All 6 turns done."
    steps = await store.steps(run.id)
    assert [s.seq for s in steps] == list(range(11))
    assert [s.kind for s in steps] == ["model_turn", "tool_result"] * 5 + ["model_turn"]
    assert [s.worker for s in steps] == ["w1"] * 6 + ["w2"] * 2 + ["w3"] * 3
    # No turn committed twice: each committed turn answers a different scripted turn.
    texts = [
        b["text"]
        for s in steps
        if s.kind == "model_turn"
        for b in s.payload["content"]
        if b["type"] == "text"
    ]
    assert len(texts) == len(set(texts)) == 6
    # Every resumed request passed the signature check; turn 4 was asked twice (once killed).
    # Turn 3 once or twice: w1's request for it overlaps the commit of seq 5, after which w1 died.
    assert set(statuses(srv)) == {200}
    turns = [e["turn"] for e in srv.requests()]
    assert turns.count(4) == 2 and turns.count(3) in (1, 2) and turns.count(2) == 1
    assert (await store.get_run(run.id)).attempt == 3


async def test_resumed_run_sends_its_pinned_system_prompt_and_tool_definitions(
    store: Store, workers: Workers, fake: FakeFactory
) -> None:
    srv = fake(echo_scenario(4))
    use(workers, srv)
    old, _ = await store.create_run("echo four times", AGENT)
    w1 = workers.start("w1", tools="echo_v1.py", faults="after_model_turn_commit@2")
    assert w1.wait() == -signal.SIGKILL
    # The Agent is edited (new system prompt) and the workers are redeployed with a reworded tool.
    edited = AGENT.model_copy(update={"system": "You echo, reworded."})
    new, _ = await store.create_run("echo four times", edited)
    workers.start("w2", tools="echo_v2.py")
    for rid in (old.id, new.id):
        done = await wait_run(store, rid, lambda r: r.finished, 30)
        assert done.status == "succeeded", done.error
    # The signature binds system and tools: a single 400 would mean the old run sent new ones.
    assert set(statuses(srv)) == {200}
    systems = [e["system"] for e in srv.requests()]
    # Turns 0-1 before the kill, turns 2-3 resumed by w2 under the edited Agent and new tools.
    assert systems.count("You echo carefully.") == 4
    assert systems.count("You echo, reworded.") == 4
    assert systems[:2] == ["You echo carefully."] * 2
    old_pv = await store.get_prompt_version((await store.get_run(old.id)).prompt_version or "")
    new_pv = await store.get_prompt_version((await store.get_run(new.id)).prompt_version or "")
    assert old_pv.tools[0]["description"] == "Echo the text back in capitals."
    assert new_pv.tools[0]["description"].startswith("Return the given text")


async def test_two_workers_never_both_commit_a_step(
    store: Store, workers: Workers, fake: FakeFactory
) -> None:
    srv = fake(echo_scenario(4, slow={1: 100}, long_text={1: 4}))
    use(workers, srv)
    run, _ = await store.create_run("echo", AGENT)
    a = workers.start("a", lease_ttl=1.5)
    await wait_for(lambda: any(e.get("turn") == 1 for e in srv.requests()), 20, "turn 1 request")
    # The tool result (seq 1) is committed beside the turn-1 call (overlap), so the request alone
    # does not say it landed: wait for it, or a loaded machine stops a before it does.
    await wait_run(store, run.id, lambda r: r.next_seq >= 2, 20)
    a.signal(signal.SIGSTOP)  # a stalls mid-call: no heartbeat, its lease runs out
    try:
        workers.start("b", lease_ttl=1.5)
        done = await wait_run(store, run.id, lambda r: r.finished, 30)
    finally:
        a.signal(signal.SIGCONT)
    assert done.status == "succeeded"
    # a wakes up, finishes its stale call, and must not commit it: it says so when it tries.
    await wait_for(lambda: any("lease lost" in line.get("msg", "") for line in a.json_lines()),
                   30, "worker a to find its lease lost")
    steps = await store.steps(run.id)
    assert [s.seq for s in steps] == list(range(7))
    assert [(s.worker, s.lease_epoch) for s in steps[:2]] == [("a", 1), ("a", 1)]
    assert all((s.worker, s.lease_epoch) == ("b", 2) for s in steps[2:])
    a.signal(signal.SIGTERM)
    assert a.wait() == 0


async def test_sigterm_hands_the_run_to_another_worker_at_once(
    store: Store, workers: Workers, fake: FakeFactory
) -> None:
    srv = fake(echo_scenario(3, slow={0: 200}, long_text={0: 20}))
    use(workers, srv)
    run, _ = await store.create_run("echo", AGENT)
    # A 30 s lease and a 30 s poll: only the release + NOTIFY path can hand over quickly.
    a = workers.start("a", lease_ttl=30, poll=30)
    await wait_run(store, run.id, lambda r: r.lease_owner == "a", 20)
    b = workers.start("b", lease_ttl=30, poll=30)
    await wait_for(lambda: "worker b: pool" in b.output(), 30, "worker b to start")
    await asyncio.sleep(0.5)  # b is idle and listening
    await wait_for(lambda: any(e.get("turn") == 0 for e in srv.requests()), 10, "model call")
    t0 = time.monotonic()
    a.signal(signal.SIGTERM)
    await wait_run(store, run.id, lambda r: r.lease_owner == "b", 10)
    handover = time.monotonic() - t0
    print(f"SIGTERM handover: {handover * 1000:.0f} ms")
    assert handover < 3, handover  # far below the 30 s lease and poll
    assert a.wait() == 0
    done = await wait_run(store, run.id, lambda r: r.finished, 30)
    assert done.status == "succeeded" and done.attempt == 1  # the release gave the attempt back


async def test_cancel_stops_an_in_flight_model_call_within_a_second(
    store: Store, workers: Workers, fake: FakeFactory
) -> None:
    srv = fake(echo_scenario(2, slow={0: 300}, long_text={0: 40}))
    use(workers, srv)
    run, _ = await store.create_run("echo", AGENT)
    w = workers.start("w", lease_ttl=30, poll=30)
    await wait_for(lambda: any(e.get("turn") == 0 for e in srv.requests()), 20, "model call")
    await asyncio.sleep(0.5)
    t0 = time.monotonic()
    await store.cancel(run.id)
    await wait_for(
        lambda: any(e.get("disconnected") for e in srv.requests()), 5, "the stream to be dropped"
    )
    stopped = time.monotonic() - t0
    print(f"cancel to aborted model call: {stopped * 1000:.0f} ms")
    assert stopped < 1.0, stopped
    assert (await store.get_run(run.id)).status == "cancelled"
    assert await store.steps(run.id) == []
    assert w.popen.poll() is None  # the worker lives on
    w.signal(signal.SIGTERM)
    assert w.wait() == 0


async def test_rate_limits_and_overloads_are_retried_and_a_retired_model_fails_the_run(
    store: Store, workers: Workers, fake: FakeFactory
) -> None:
    scenario = echo_scenario(
        3,
        faults={
            1: [
                {"status": 429, "retry_after": 1, "times": 1},
                {"status": 529, "times": 1},
                {"status": 500, "times": 1},
            ]
        },
        models=["claude-sonnet-4-5"],
    )
    srv = fake(scenario)
    use(workers, srv)
    ok, _ = await store.create_run("echo", AGENT)
    retired, _ = await store.create_run("echo", AGENT.model_copy(update={"model": "claude-2.0"}))
    w = workers.start("w")
    done = await wait_run(store, ok.id, lambda r: r.finished, 30)
    assert done.status == "succeeded", done.error
    failed = await wait_run(store, retired.id, lambda r: r.finished, 30)
    assert failed.status == "failed"
    assert failed.error is not None
    assert "404" in failed.error and "model: claude-2.0" in failed.error
    assert failed.attempt == 1  # failed at once, not retried
    assert [
        e["status"]
        for e in srv.requests()
        if e.get("turn") == 1 and e.get("model") == "claude-sonnet-4-5"
    ] == [429, 529, 500, 200]
    w.signal(signal.SIGTERM)
    assert w.wait() == 0
    # Every log line about a run carries its run id.
    lines = w.json_lines()
    about_runs = [
        x for x in lines if x["logger"].startswith(("agentrun.worker.run", "agentrun.worker.model"))
    ]
    assert about_runs and all(x.get("run_id") for x in about_runs)
    assert {x["run_id"] for x in about_runs} == {str(ok.id), str(retired.id)}
    retries = [x for x in about_runs if "retry" in x["msg"]]
    assert len(retries) == 3 and all(x["run_id"] == str(ok.id) for x in retries)


async def test_unknown_tool_fails_the_run_with_a_message_naming_it(
    store: Store, workers: Workers, fake: FakeFactory
) -> None:
    srv = fake(echo_scenario(2))
    use(workers, srv)
    run, _ = await store.create_run(
        "echo", AGENT.model_copy(update={"tools": ["echo", "send_email"]})
    )
    workers.start("w")
    done = await wait_run(store, run.id, lambda r: r.finished, 20)
    assert done.status == "failed"
    assert done.error is not None and "send_email" in done.error and "--tools" in done.error
    assert srv.requests() == []  # nothing was sent to the model


def listening_on(port: int | None) -> set[str]:
    """The IPv4 addresses a socket listens on at ``port`` (from /proc/net/tcp)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        ip, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
            found.add(socket.inet_ntoa(bytes.fromhex(ip)[::-1]))
    return found


async def test_prestop_drain_releases_the_runs_and_waits_for_sigterm(
    store: Store, workers: Workers, fake: FakeFactory
) -> None:
    # The Helm chart's preStop hook is `agentrun drain-local`, run inside the container: it must
    # hand the run back and return only once nothing is held, then the worker must stay up (not
    # crash-exit) until SIGTERM, and that SIGTERM must be a clean exit, not the "second signal
    # exits at once". /drain is not on the health port, which metrics scrapers can reach.
    srv = fake(echo_scenario(3, slow={0: 200}, long_text={0: 20}))
    use(workers, srv)
    run, _ = await store.create_run("echo", AGENT)
    w = workers.start("w", lease_ttl=30, poll=30, health=True)
    await wait_run(store, run.id, lambda r: r.lease_owner == "w", 20)
    await wait_for(lambda: any(e.get("turn") == 0 for e in srv.requests()), 10, "model call")

    def call(port: int | None, path: str, method: str = "GET") -> tuple[int, str]:
        req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    assert listening_on(w.control_port) == {"127.0.0.1"}  # only the pod itself can reach it
    assert listening_on(w.health_port) == {"0.0.0.0"}
    for method in ("GET", "POST"):
        status, _ = await asyncio.to_thread(call, w.health_port, "/drain", method)
        assert status in (404, 405), f"{method} /drain on the health port answered {status}"
    assert (await store.get_run(run.id)).lease_owner == "w"  # nothing was drained by those

    res = await asyncio.to_thread(run_cli, "drain-local", "--port", str(w.control_port))
    assert (res.returncode, res.stdout.strip()) == (0, "drained: 1 run(s) handed back"), res
    released = await store.get_run(run.id)
    assert released.lease_owner is None and released.status == "pending"
    assert (await asyncio.to_thread(call, w.health_port, "/readyz"))[0] == 503
    await asyncio.sleep(1.0)
    assert w.popen.poll() is None, "a drained worker must wait for SIGTERM, not exit by itself"
    w.signal(signal.SIGTERM)
    assert w.wait(10) == 0


def test_drain_local_without_a_worker_says_so_in_one_line() -> None:
    port = free_port()  # nobody listens there
    res = run_cli("drain-local", "--port", str(port), "--timeout", "5")
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.startswith(
        f"agentrun: error: cannot reach the worker's drain endpoint http://127.0.0.1:{port}/drain"
    ) and res.stderr.rstrip().endswith(f"--control-port {port} (AGENTRUN_CONTROL_PORT)?")
    assert len(res.stderr.splitlines()) == 1
