"""A decision on an irreversible call's unknown outcome is about one attempt, whatever made the
outcome unknown: the worker's death inside the call, or the call's timeout.

A timeout's wait did not name its attempt. The store then took it for attempt 1, so after an
approved re-run (attempt 2) that timed out too, the next decision was recorded against attempt 1,
which already had one: it was dropped, the run resumed all the same, `agentrun reject` said
"attempt 1 ... rejected by bob", and the next claim waited again on attempt 2 with a reason
saying the worker had died. (Found by an adversarial review on 2026-12-06.)

In process: the worker's RunExecutor against a real store, an irreversible tool that hangs past
its timeout, and the decisions made by the store's own ``decide`` (what `agentrun approve` /
`reject` and the annotations call).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from agentrun.errors import ConfigError
from agentrun.manifests import AgentSpec
from agentrun.store import Lease, Run, Store
from agentrun.tools import ToolContext, ToolRegistry, tool
from agentrun.waits import WaitRef
from agentrun.worker.executor import RunExecutor, RunHandle, WaitForApproval
from agentrun.worker.health import Health, WorkerMetrics
from agentrun.worker.providers import Providers
from agentrun.worker.settings import RetryPolicy
from tests.workerkit import unnamed_attempt_wait

TOOLS = ToolRegistry()
RELEASE = threading.Event()  # set at the end of each test: the hung calls' threads return
CALLS: list[int] = []
AGENT = AgentSpec(model="claude-sonnet-4-5", system="pay", tools=["wire_money"])
TURN = {"content": [{"type": "tool_use", "id": "toolu_1", "name": "wire_money",
                     "input": {"amount": 100}}], "stop_reason": "tool_use"}


@tool(kind="irreversible", registry=TOOLS, timeout=0.2)
def wire_money(ctx: ToolContext, amount: int) -> str:
    """Send money; it never answers in time, so its outcome is unknown."""
    CALLS.append(amount)
    RELEASE.wait()
    return "sent"


@pytest.fixture(autouse=True)
def hung_calls_released() -> Iterator[None]:
    RELEASE.clear()
    CALLS.clear()
    yield
    RELEASE.set()


def executor(store: Store) -> RunExecutor:
    metrics = WorkerMetrics()
    return RunExecutor(store, Providers(default=None), TOOLS, metrics, Health(60, metrics),
                       RetryPolicy(max_retries=0), is_draining=lambda: False)


async def claim(store: Store, worker: str) -> tuple[Run, Lease]:
    ((run, lease),) = (await store.claim("default", worker, 1)).claimed
    return run, lease


async def call_once(store: Store, ex: RunExecutor, worker: str) -> dict[str, Any]:
    """One claim's go at step 0's call; its wait is recorded as the worker records it."""
    run, lease = await claim(store, worker)
    effect = (await store.effects(run.id, 0)).get(0)
    try:
        return await ex.call_tool(RunHandle(run, lease, lease_ttl=60), 0, 0, TURN["content"][0],
                                  effect)
    except WaitForApproval as wait:
        await store.wait_for_approval(lease, wait.reason, wait.pending_call)
        return {"waiting": wait.pending_call, "reason": wait.reason}


async def approvals(store: Store) -> list[tuple[str, int, str, str]]:
    async with store.pool.connection() as conn:
        cur = await conn.execute(
            "SELECT stage, attempt, decision, decided_by FROM approval ORDER BY attempt")
        return [tuple(r) for r in await cur.fetchall()]  # type: ignore[misc]


async def test_a_decision_after_a_re_run_that_timed_out_is_about_that_re_run(
    store: Store,
) -> None:
    run, _ = await store.create_run("pay 100", AGENT)
    _, lease = await claim(store, "w1")
    await store.append_step(lease, 0, "model_turn", TURN)
    await store.release(lease)
    ex = executor(store)

    first = await call_once(store, ex, "w1")
    assert first["waiting"]["attempt"] == 1
    assert "(step 0, attempt 1) did not return within its 0.2 s timeout" in first["reason"]
    assert "run it once more (attempt 2)" in first["reason"]
    approved = await store.decide(run.id, 0, "approved", decided_by="alice")
    assert approved["attempt"] == 1

    # The approved re-run is attempt 2, and it times out as well: the wait says so.
    second = await call_once(store, ex, "w2")
    assert second["waiting"]["stage"] == "outcome_unknown"
    assert second["waiting"]["attempt"] == 2
    assert "(step 0, attempt 2) did not return within" in second["reason"]
    assert "run it once more (attempt 3)" in second["reason"]
    # The step had a decision: the re-run's wait is named (a bare 0 could be a late one for 0.0.1).
    rejected = await store.decide(run.id, WaitRef(0, 0, 2), "rejected", decided_by="bob",
                                  reason="it went out")
    assert rejected["attempt"] == 2
    assert await approvals(store) == [
        ("outcome_unknown", 1, "approved", "alice"), ("outcome_unknown", 2, "rejected", "bob")]

    # Bob's rejection is what the next claim acts on: the model is told, nothing runs again.
    third = await call_once(store, ex, "w3")
    assert third["is_error"] is True
    assert "bob rejected a retry (it went out)" in third["content"]
    assert CALLS == [100, 100]  # attempt 1 and the one approved re-run, never a third


async def test_a_wait_that_does_not_name_its_attempt_is_decided_for_its_intents(
    store: Store,
) -> None:
    """A timeout's wait written by a worker from before the fix (no attempt in it), on a re-run:
    the decision goes to the attempt the intent counts, not to attempt 1."""
    run = await unnamed_attempt_wait(store)
    decided = await store.decide(run.id, WaitRef(0, 0, 2), "rejected", decided_by="bob")
    assert decided["attempt"] == 2
    assert await approvals(store) == [
        ("outcome_unknown", 1, "approved", "alice"), ("outcome_unknown", 2, "rejected", "bob")]
    assert (await store.get_run(run.id)).status == "pending"


async def test_a_decision_that_is_not_recorded_is_refused_and_the_run_still_waits(
    store: Store,
) -> None:
    """Should a run ever wait on an attempt decided before, the new decision is refused with
    the reason, and nothing changes: it is never reported as taken."""
    run, _ = await store.create_run("pay 100", AGENT)
    _, lease = await claim(store, "w1")
    await store.record_effect(lease, 0, 0, key="k", tool="wire_money",
                              tool_kind="irreversible", state="intent")
    pending = {"seq": 0, "call_index": 0, "tool": "wire_money", "input": {"amount": 100},
               "stage": "outcome_unknown", "attempt": 1}
    await store.wait_for_approval(lease, "outcome unknown", pending)
    await store.decide(run.id, 0, "approved", decided_by="alice")
    _, lease = await claim(store, "w2")
    await store.wait_for_approval(lease, "outcome unknown", pending)  # attempt 1 again

    with pytest.raises(ConfigError, match=(
            "attempt 1 of step 0 call 0 \\(wire_money, outcome unknown\\) was decided before; "
            "nothing was recorded and the run still waits")):
        await store.decide(run.id, WaitRef(0, 0, 1), "rejected", decided_by="bob")
    assert await approvals(store) == [("outcome_unknown", 1, "approved", "alice")]
    still = await store.get_run(run.id)
    assert still.status == "waiting_approval" and still.pending_call == pending


async def test_a_late_bare_decision_never_decides_the_steps_next_wait(store: Store) -> None:
    """Two humans see call 0 of step 0 wait. The first one's decision is recorded, and the run
    goes on to the step's call 1, which waits in turn. The second human's ``0``, meant for call
    0, once decided call 1 with nobody having looked at it. A bare step number is refused once
    the step has a decision, and so is a named wait the run is not on; the wait to name is said,
    nothing is recorded, and the run still waits."""
    run, _ = await store.create_run("pay twice", AGENT)
    _, lease = await claim(store, "w1")
    first = {"seq": 0, "call_index": 0, "tool": "wire_money", "input": {"amount": 1},
             "stage": "before_call"}
    await store.wait_for_approval(lease, "approval required", first)
    assert (await store.decide(run.id, 0, "approved", decided_by="alice"))["call_index"] == 0
    _, lease = await claim(store, "w2")
    second = {**first, "call_index": 1, "input": {"amount": 1_000_000}}
    await store.wait_for_approval(lease, "approval required", second)

    for late, why in [
        (0, "step 0 was decided before (approved by alice) and now waits on 0.1 (wire_money, "
            "before call); name that wait to decide it (0.1); nothing was recorded"),
        # Named, the late one hears who decided the wait it names.
        (WaitRef(0, 0), "waits on 0.1 (wire_money, before call), not 0.0, which was decided "
                        "before (approved by alice); nothing was recorded"),
        (WaitRef(0, 1, 1), "waits on 0.1 (wire_money, before call), not 0.1.1"),
    ]:
        with pytest.raises(ConfigError) as refused:
            await store.decide(run.id, late, "approved", decided_by="bob")
        assert why in str(refused.value)
    assert await approvals(store) == [("before_call", 1, "approved", "alice")]
    still = await store.get_run(run.id)
    assert still.status == "waiting_approval" and still.pending_call == second

    decided = await store.decide(run.id, WaitRef(0, 1), "rejected", decided_by="bob")
    assert (decided["call_index"], decided["input"]) == (1, {"amount": 1_000_000})
    assert (await store.get_run(run.id)).status == "pending"
    with pytest.raises(ConfigError) as refused:  # the run waits on nothing now
        await store.decide(run.id, WaitRef(0, 1), "approved", decided_by="carol")
    assert str(refused.value) == (f"run {run.id} is not waiting for approval (it is pending); "
                                  "wait 0.1 was decided before (rejected by bob)")
    with pytest.raises(ConfigError) as refused:  # bare (an operator's replay of "approve=0")
        await store.decide(run.id, 0, "approved", decided_by="carol")
    assert str(refused.value) == (f"run {run.id} is not waiting for approval (it is pending); "
                                  "step 0 was decided before (rejected by bob)")


@pytest.mark.parametrize("text", ["", "x", "3.", ".3", "3.1.0", "3.1.2.4", "-1", "3,1", "1e3",
                                  "99999999999", "3.99999999999", "\u0663",
                                  # past the AgentRunApproval's bounds: --kube tracebacked
                                  "3.1000000001", "3.0.1000000001", "1000000001"])
def test_a_wait_that_is_not_one_is_refused_in_one_line(text: str) -> None:
    with pytest.raises(ConfigError) as refused:
        WaitRef.parse(text, "agentrun.dev/approve")
    message = str(refused.value)
    assert message.startswith("agentrun.dev/approve must name the wait the run is stopped on")
    assert message.endswith(f"not {text!r}") and "\n" not in message


def test_a_wait_reads_back_as_it_is_written() -> None:
    for text, ref in [("3", WaitRef(3)), ("3.1", WaitRef(3, 1)), (" 3.1.2 ", WaitRef(3, 1, 2)),
                      ("0.0", WaitRef(0, 0))]:
        assert WaitRef.parse(text, "WAIT") == ref
        assert str(ref) == text.strip()
    assert WaitRef.of({"seq": 3, "call_index": 1, "stage": "outcome_unknown", "attempt": 2}) == (
        WaitRef(3, 1, 2))
    assert WaitRef.of({"seq": 3, "call_index": 1, "stage": "before_call", "attempt": 1}) == (
        WaitRef(3, 1))


async def test_a_rejection_with_abort_asks_for_the_rollback(store: Store) -> None:
    """reject --abort in the fast tier: the request shares request_rollback with cancel
    --rollback, whose parameters grew (a dead letter's compensations due); it broke once with
    only the process tier to notice."""
    run, _ = await store.create_run("pay 100", AGENT)
    _, lease = await claim(store, "w1")
    pending = {"seq": 0, "call_index": 0, "tool": "wire_money", "input": {"amount": 100},
               "stage": "before_call"}
    await store.wait_for_approval(lease, "approval required", pending)
    decided = await store.decide(run.id, 0, "rejected", decided_by="bob", reason="no", abort=True)
    assert decided["call_index"] == 0
    after = await store.get_run(run.id)
    assert (after.status, after.rollback_reason, after.rollback_end) == (
        "pending", "rejected by bob: no", "failed")


async def test_a_wait_written_without_its_attempt_names_it_as_stored(store: Store) -> None:
    """The operator mirrors the wait as stored: an older worker's outcome-unknown wait named no
    attempt, so .status.pendingApproval.decide said 0.0.1 while the store decides attempt 2 (its
    intent's), and that token, which AgentRunApprovals and `approve --kube` take from the
    status, was refused. Migration 0022 completes such a wait as it is written."""
    run = await unnamed_attempt_wait(store)
    stored = (await store.get_run(run.id)).pending_call or {}
    assert stored["attempt"] == 2 and WaitRef.of(stored) == WaitRef(0, 0, 2)
    decided = await store.decide(run.id, WaitRef.of(stored), "rejected", decided_by="bob")
    assert decided["attempt"] == 2
    assert await approvals(store) == [
        ("outcome_unknown", 1, "approved", "alice"), ("outcome_unknown", 2, "rejected", "bob")]
