"""A compensation that does not undo its effect leaves the rollback incomplete, never "compensated".

Found by an adversarial review on 2026-12-06:

* a compensating tool that raised ToolError (or refused the undone call's input) was counted as
  done: the run's error said "compensated: release for reserve", a compensation step was committed
  (so the effect was never offered again) and no alert (`compensation_failed`) was counted;
* compensations were called without the tool's timeout and outside the lease's fence: a hung one
  held the run for the whole progress budget (900 s) on every claim, and its
  ``ctx.lease_valid()`` was always True.

In process: the worker's RunExecutor against a real store; the run's effect is recorded by the
executor's own call_tool, and the rollback is the executor's abort, as a failing run does it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from agentrun.errors import ConfigError
from agentrun.manifests import AgentSpec
from agentrun.store import Lease, Run, Store
from agentrun.tools import ToolContext, ToolError, ToolRegistry, tool
from agentrun.waits import WaitRef
from agentrun.worker.executor import RunExecutor, RunFailed, RunHandle
from agentrun.worker.health import Health, WorkerMetrics
from agentrun.worker.providers import Providers
from agentrun.worker.settings import RetryPolicy

TOOLS = ToolRegistry()
RELEASE = threading.Event()  # set at the end of each test: a hung compensation's thread returns
SEEN: list[bool] = []  # what each compensation saw of the fence
FIXED: list[bool] = []  # non-empty: the service a "down_until_fixed" compensation needs is back
UNKNOWN: list[bool] = []  # what each compensation was told of the undone call's outcome
COMPENSATING = threading.Event()  # set once a compensation is running
GRABS: list[str] = []  # grab's calls
UNDONE_AT: list[datetime] = []  # when each compensation started
SLOW_GRABS: list[int] = []  # the attempts of slow_grab's and flaky_grab's calls


# A short timeout: a rollback waits it out (after the lost lease's end) before undoing a call a
# lost worker may still be inside.
@tool(kind="non_idempotent", registry=TOOLS, compensate="unhold", timeout=0.3)
def hold(ctx: ToolContext, item: str, how: str) -> str:
    """Hold an item; ``how`` says how its compensation will behave."""
    return f"held {item}"


@tool(kind="irreversible", registry=TOOLS, compensate="unhold")
def hold_for_good(ctx: ToolContext, item: str, how: str) -> str:
    """Hold an item with no way to dedupe it (its intent is recorded before the call)."""
    return f"held {item} for good"


@tool(kind="non_idempotent", registry=TOOLS, compensate="unhold", timeout=0.2)
def slow_hold(ctx: ToolContext, item: str, how: str) -> str:
    """Hold an item, past the call's timeout (its thread returns at the end of the test)."""
    RELEASE.wait()
    return f"held {item} late"


@tool(kind="non_idempotent", registry=TOOLS, compensate="unhold", timeout=0.2,
      on_error="abort")
def slow_grab(ctx: ToolContext, item: str, how: str) -> str:
    """Grab an item, past the call's timeout, which fails the run (its thread returns at the
    end of the test)."""
    SLOW_GRABS.append(ctx.attempt)
    RELEASE.wait()
    return f"grabbed {item} late"


@tool(kind="non_idempotent", registry=TOOLS, compensate="unhold", timeout=0.2,
      on_error="abort", retryable=(TimeoutError,))
def flaky_grab(ctx: ToolContext, item: str, how: str) -> str:
    """Attempt 1 hangs past its timeout (and may grab late); attempt 2 fails outright."""
    SLOW_GRABS.append(ctx.attempt)
    if ctx.attempt == 1:
        RELEASE.wait()
        return f"grabbed {item} late"
    raise RuntimeError("the grab service said no")


@tool(kind="pure", registry=TOOLS)
def peek(ctx: ToolContext, item: str) -> str:
    """Look at an item (no effect)."""
    return f"{item} is free"


@tool(kind="non_idempotent", registry=TOOLS, compensate="unhold", on_error="abort")
def grab(ctx: ToolContext, item: str, how: str) -> str:
    """Grab an item; the first call fails, and its failure ends the run."""
    GRABS.append(item)
    if len(GRABS) == 1:
        raise RuntimeError(f"could not grab {item}")
    return f"grabbed {item}"


@tool(kind="irreversible", registry=TOOLS, compensate="unhold", on_error="abort")
def charge(ctx: ToolContext, item: str, how: str) -> str:
    """Charge for an item; the card is declined, which fails the run."""
    raise RuntimeError(f"card declined for {item}")


@tool(kind="idempotent", registry=TOOLS, timeout=0.2)
def unhold(ctx: ToolContext, item: str, how: str) -> str:
    """Undo a hold: refuse it, hang past the timeout, or release it."""
    SEEN.append(ctx.fence is not None)
    UNKNOWN.append(ctx.compensates_unknown)
    UNDONE_AT.append(datetime.now(UTC))
    COMPENSATING.set()
    if how == "refuse":
        raise ToolError(f"the reservation service refused to release {item}")
    if how == "hang":
        RELEASE.wait()
    if how == "down_until_fixed" and not FIXED:
        raise ToolError(f"the reservation service is down; {item} not released")
    return f"released {item}"


@pytest.fixture(autouse=True)
def hung_calls_released() -> Iterator[None]:
    RELEASE.clear()
    SEEN.clear()
    FIXED.clear()
    UNKNOWN.clear()
    COMPENSATING.clear()
    GRABS.clear()
    UNDONE_AT.clear()
    SLOW_GRABS.clear()
    yield
    RELEASE.set()


def executor(store: Store) -> RunExecutor:
    metrics = WorkerMetrics()
    return RunExecutor(store, Providers(default=None), TOOLS, metrics, Health(60, metrics),
                       RetryPolicy(max_retries=0), is_draining=lambda: False)


async def recorded_hold(
    store: Store, how: str, **create: Any
) -> tuple[RunExecutor, WorkerMetrics, RunHandle]:
    """A claimed run whose hold (step 0, compensated per ``how``) the executor called and
    recorded; ``create``: more of create_run's arguments."""
    agent = AgentSpec(model="claude-sonnet-4-5", system="book", tools=["hold", "unhold"])
    await store.create_run("book a seat", agent, **create)
    ((run, lease),) = (await store.claim("default", "w1", 1)).claimed
    block = {"type": "tool_use", "id": "toolu_1", "name": "hold",
             "input": {"item": "seat", "how": how}}
    await store.append_step(lease, 0, "model_turn",
                            {"content": [block], "stop_reason": "tool_use"})
    ex = executor(store)
    metrics = ex.metrics
    h = RunHandle(run, lease, lease_ttl=60)
    result = await ex.call_tool(h, 0, 0, block, None)
    assert result["content"] == "held seat"
    return ex, metrics, h


async def rolled_back(store: Store, how: str) -> tuple[str, WorkerMetrics, RunHandle]:
    """A run whose hold (step 0) is recorded, failed by the executor's abort: its error."""
    ex, metrics, h = await recorded_hold(store, how)
    run = h.run
    # Bounded only so that a hang fails the test instead of stalling it (the fix makes it 0.2 s).
    await asyncio.wait_for(ex.abort(h, "tool charge failed: card declined"), 60)
    done = await store.get_run(run.id)
    assert done.status == "failed"
    assert done.error is not None
    return done.error, metrics, h


@pytest.mark.parametrize(("how", "why"), [
    ("refuse", "unhold for hold (step 0) failed: the reservation service refused to release seat"),
    ("hang", "unhold for hold (step 0) raised ToolTimeout: tool unhold did not return within its "
             "timeout of 0.2 s"),
])
async def test_a_compensation_that_does_not_undo_leaves_the_rollback_incomplete(
    store: Store, how: str, why: str
) -> None:
    error, metrics, h = await rolled_back(store, how)
    assert error == ("tool charge failed: card declined; ROLLBACK INCOMPLETE, manual action "
                     f"needed: {why}")
    assert [s.kind for s in await store.steps(h.run.id)] == ["model_turn"]  # none recorded
    assert [e.tool for e in await store.compensations_due(h.run.id)] == ["hold"]  # still due
    assert metrics.aborts.labels("compensation_failed")._value.get() == 1
    assert metrics.aborts.labels("compensated")._value.get() == 0
    assert SEEN == [True]  # the compensation was handed the fence


async def test_a_compensation_that_undoes_is_recorded_and_counted(store: Store) -> None:
    error, metrics, h = await rolled_back(store, "release")
    assert error == "tool charge failed: card declined; compensated: unhold for hold (step 0)"
    assert [s.kind for s in await store.steps(h.run.id)] == ["model_turn", "compensation"]
    assert await store.compensations_due(h.run.id) == []
    assert metrics.aborts.labels("compensated")._value.get() == 1


async def expire(store: Store, run_id: Any) -> None:
    """The holder's lease runs out now (its worker died), as the clock would make it."""
    async with store.pool.connection() as conn:
        await conn.execute("UPDATE agent_run SET lease_until = now() - interval '1 second', "
                           "updated_at = now() WHERE id = %s", [run_id])


async def next_claim_ends(store: Store, ex: RunExecutor, worker: str) -> Run:
    """The next claim's go at the (only) run, which ends it: the run as it ended, every
    compensation done."""
    ((run, lease),) = (await store.claim("default", worker, 1)).claimed
    assert await ex.advance(RunHandle(run, lease, lease_ttl=60)) is None
    done = await store.get_run(run.id)
    assert await store.compensations_due(run.id) == []
    return done


async def test_a_retry_of_a_run_dead_lettered_in_its_rollback_resumes_the_rollback(
    store: Store,
) -> None:
    """cancel --rollback, then every claim's worker died in the compensation until the claim
    dead-lettered the run: `agentrun retry` (what a dead letter asks for) cleared the rollback,
    and the run went back to the model and its tools, ending succeeded with the effect it was
    to undo still done (found by an adversarial review on 2026-12-06)."""
    ex, _, h = await recorded_hold(store, "release", max_attempts=1)
    run = h.run
    await store.request_rollback(run.id, "cancelled", "plans changed")
    # The holder dies; the next claim's worker dies inside the compensation; the one after
    # dead-letters the run (maxAttempts 1).
    await expire(store, run.id)
    assert len((await store.claim("default", "w2", 1)).claimed) == 1
    await expire(store, run.id)
    assert len((await store.claim("default", "w3", 1)).dead_lettered) == 1

    retried = await store.retry(run.id, "worker fixed")
    assert (retried.status, retried.rollback_end) == ("pending", "cancelled")
    assert retried.retried_as() == (
        "it resumes its rollback (cancelled: plans changed) with a fresh budget of 1 attempts, "
        "then ends cancelled")
    done = await next_claim_ends(store, ex, "w4")
    assert (done.status, done.error) == (
        "cancelled", "cancelled: plans changed; compensated: unhold for hold (step 0)")


@pytest.mark.parametrize("end", ["failed", "cancelled"])
async def test_a_retry_finishes_a_rollback_that_ended_incomplete(store: Store, end: str) -> None:
    """A rollback whose compensation failed (the service it needs was down) ended the run with
    ROLLBACK INCOMPLETE. `agentrun retry`, once the service is back, went back to the model and
    could end succeeded with the effect still in place (a failed run, a reject --abort's
    included), and a cancelled one could not be retried at all (found by an adversarial review
    on 2026-12-06). It now finishes the rollback, and the run ends as it was to."""
    ex, _, h = await recorded_hold(store, "down_until_fixed")
    run = h.run
    if end == "cancelled":
        await store.request_rollback(run.id, "cancelled", "plans changed")
        await ex.abort(h)
        why = "cancelled: plans changed"
    else:
        await ex.abort(h, "tool charge failed: card declined")
        why = "tool charge failed: card declined"
    first = await store.get_run(run.id)
    assert first.status == end and "ROLLBACK INCOMPLETE" in (first.error or ""), first.error

    FIXED.append(True)
    retried = await store.retry(run.id, "reservation service back")
    assert (retried.status, retried.rollback_reason, retried.rollback_end) == (
        "pending", why, end)
    assert retried.retried_as().startswith(f"it resumes its rollback ({why})")
    done = await next_claim_ends(store, ex, "w2")
    assert (done.status, done.error) == (end, f"{why}; compensated: unhold for hold (step 0)")
    # Rolled back whole: nothing is left to retry into.
    with pytest.raises(ConfigError, match="be retried"):
        await store.retry(run.id)


async def test_cancel_rollback_undoes_what_a_dead_lettered_run_did(store: Store) -> None:
    """A run whose workers died maxAttempts claims in a row is dead-lettered with its effects in
    place. `cancel --rollback` refused it ("already finished"), a retry sends it back to the
    model, and a restart starts afresh: nothing could undo its hold (found by an adversarial
    review on 2026-12-06). The request now makes it pending with a fresh poison-run budget, and
    the next claim runs its compensations only and ends it cancelled."""
    ex, _, h = await recorded_hold(store, "release", max_attempts=1)
    run = h.run
    # Its worker dies; so does the next claim's, before it commits a step; the claim after
    # that dead-letters the run (maxAttempts 1).
    await expire(store, run.id)
    assert len((await store.claim("default", "w2", 1)).claimed) == 1
    await expire(store, run.id)
    assert len((await store.claim("default", "w3", 1)).dead_lettered) == 1
    assert (await store.get_run(run.id)).status == "dead_letter"

    asked, requested = await store.request_rollback(run.id, "cancelled", "undo the hold")
    assert requested is True
    assert (asked.status, asked.rollback_reason, asked.rollback_end, asked.finished_at) == (
        "pending", "cancelled: undo the hold", "cancelled", None)
    assert asked.stalled_attempts == 0 and asked.claim_seq == asked.next_seq  # a fresh budget
    # Rolling back, it no longer reads as dead-lettered; why it was is kept, as a retry keeps it.
    assert asked.error is None and (asked.retried_error or "").startswith("dead-lettered: ")
    done = await next_claim_ends(store, ex, "w4")
    assert (done.status, done.error) == (
        "cancelled", "cancelled: undo the hold; compensated: unhold for hold (step 0)")
    assert [s.kind for s in await store.steps(run.id)] == ["model_turn", "compensation"]


async def test_a_dead_letter_with_nothing_to_undo_is_left_as_it_is(store: Store) -> None:
    agent = AgentSpec(model="claude-sonnet-4-5", system="book", tools=["hold", "unhold"])
    run, _ = await store.create_run("book a seat", agent, max_attempts=1)
    assert len((await store.claim("default", "w1", 1)).claimed) == 1
    await expire(store, run.id)
    assert len((await store.claim("default", "w2", 1)).dead_lettered) == 1
    now, requested = await store.request_rollback(run.id, "cancelled", "undo")
    assert requested is False
    assert (now.status, now.rollback_reason) == ("dead_letter", None)


async def one_call_turn(
    store: Store, tool_name: str, *more_tools: str, **create: Any
) -> tuple[Run, Lease, dict[str, Any]]:
    """A claimed run, and the call of ``tool_name`` on the seat its step 0 is to make (the run
    may call it, unhold and ``more_tools``); ``create``: more of create_run's arguments."""
    agent = AgentSpec(model="claude-sonnet-4-5", system="book",
                      tools=[tool_name, "unhold", *more_tools])
    await store.create_run("book a seat", agent, **create)
    ((run, lease),) = (await store.claim("default", "w1", 1)).claimed
    block = {"type": "tool_use", "id": "toolu_1", "name": tool_name,
             "input": {"item": "seat", "how": "release"}}
    return run, lease, block


async def test_an_effect_of_unknown_outcome_is_compensated_and_says_so(store: Store) -> None:
    """An irreversible compensable call with an intent and no outcome (its worker died inside
    it), then a rollback: the intent was skipped and the run reported compensated with the effect
    perhaps in place. It is compensated now, the compensation told the outcome is unknown."""
    run, lease, block = await one_call_turn(store, "hold_for_good")
    await store.append_step(lease, 0, "model_turn", {"content": [block], "stop_reason": "tool_use"})
    await store.record_effect(lease, 0, 0, key="k", tool="hold_for_good",
                              tool_kind="irreversible", state="intent",
                              tool_input=block["input"], compensate="unhold")
    await store.request_rollback(run.id, "cancelled", "plans changed")
    await expire(store, run.id)
    done = await next_claim_ends(store, executor(store), "w2")
    assert (done.status, done.error) == ("cancelled", "cancelled: plans changed; compensated: "
                                         "unhold for hold_for_good (step 0, outcome unknown)")
    assert UNKNOWN == [True]


@pytest.mark.parametrize("older", [False, True])
async def test_a_call_its_worker_died_inside_is_undone_after_a_dead_letter(
    store: Store, older: bool
) -> None:
    """The mark of a compensable call, its worker lost inside it (no effect recorded), then a
    dead letter: cancel --rollback finds something to undo and undoes it. ``older``: the mark of
    a worker of the previous build (a rolling upgrade), which names no undo: the store alone
    found nothing to undo and refused, and nothing ever undid the hold (found by a review on
    2026-12-07); it counts now, and the worker's registry decides."""
    run, lease, block = await one_call_turn(store, "hold", max_attempts=1)
    ex = executor(store)
    h = RunHandle(run, lease, lease_ttl=60)
    # The turn's append carries the call's mark, as the worker sends it; then the worker dies.
    mark = ex.first_call_mark(h, 0, {"content": [block], "stop_reason": "tool_use"}) or {}
    if older:
        mark = {k: v for k, v in mark.items() if k not in ("compensate", "kind")}
    await store.append_step(lease, 0, "model_turn", {"content": [block], "stop_reason": "tool_use"},
                            tool_call=mark)
    for worker in ("w2", "w3"):
        await expire(store, run.id)
        await store.claim("default", worker, 1)
    assert (await store.get_run(run.id)).status == "dead_letter"
    _, requested = await store.request_rollback(run.id, "cancelled", "undo the hold")
    assert requested is True
    done = await next_claim_ends(store, ex, "w4")
    assert (done.status, done.error) == ("cancelled", "cancelled: undo the hold; compensated: "
                                         "unhold for hold (step 0, outcome unknown)")
    assert UNKNOWN == [True]


async def test_a_call_that_failed_its_run_in_this_worker_is_not_undone_and_is_retried(
    store: Store,
) -> None:
    """Its own mark names the call that raised: a failure, not a worker lost inside it. Undoing
    it would take back what never happened; and nothing is recorded of it, so a retry calls it
    again under the same key (recording the failure as its outcome, tried once, showed the model
    the error on the retry and never called the tool again: found by a review on 2026-12-06)."""
    run, lease, block = await one_call_turn(store, "grab")
    await store.append_step(lease, 0, "model_turn", {"content": [block], "stop_reason": "tool_use"})
    ex = executor(store)
    h = RunHandle(run, lease, lease_ttl=60)
    with pytest.raises(RunFailed) as failed:
        await ex.call_tool(h, 0, 0, block, None)
    await ex.abort(h, str(failed.value))
    done = await store.get_run(run.id)
    assert (done.status, done.error) == (
        "failed", "tool grab failed: RuntimeError: could not grab seat")
    assert UNKNOWN == [] and await store.compensations_due(run.id) == []
    await store.retry(run.id, "service back")
    ((run, lease),) = (await store.claim("default", "w2", 1)).claimed
    [told] = await ex.run_tools(RunHandle(run, lease, lease_ttl=60), 0,
                                {"content": [block], "stop_reason": "tool_use"})
    assert told["content"] == "grabbed seat" and GRABS == ["seat", "seat"]


async def test_an_irreversible_call_that_failed_its_run_is_undone_as_unknown(
    store: Store,
) -> None:
    """Its intent stays (a raise may come after the effect: a retry asks a human, as after a
    death), so the failing run's rollback undoes it, told the outcome is unknown, its
    compensation finding by key whether there is anything to undo. So with an approved re-run
    that failed its run: attempt 1 was left in place (found by a review on 2026-12-06)."""
    run, lease, block = await one_call_turn(store, "charge")
    await store.append_step(lease, 0, "model_turn", {"content": [block], "stop_reason": "tool_use"})
    await store.record_effect(lease, 0, 0, key="k", tool="charge", tool_kind="irreversible",
                              state="intent", tool_input=block["input"], compensate="unhold")
    await store.wait_for_approval(lease, "outcome unknown", {
        "seq": 0, "call_index": 0, "tool": "charge", "input": block["input"],
        "stage": "outcome_unknown", "attempt": 1})
    await store.decide(run.id, WaitRef(0, 0, 1), "approved", decided_by="alice")
    ex = executor(store)
    ((run, lease),) = (await store.claim("default", "w2", 1)).claimed
    h = RunHandle(run, lease, lease_ttl=60)
    with pytest.raises(RunFailed) as failed:  # the approved re-run (attempt 2) is declined
        await ex.call_tool(h, 0, 0, block, (await store.effects(run.id, 0))[0])
    await ex.abort(h, str(failed.value))
    done = await store.get_run(run.id)
    assert (done.status, done.error) == (
        "failed", "tool charge failed: RuntimeError: card declined for seat; compensated: "
        "unhold for charge (step 0, outcome unknown)")
    assert UNKNOWN == [True]


async def lost_inside_hold(store: Store, how: str) -> tuple[RunExecutor, RunHandle]:
    """A run whose worker w1 was lost inside its hold (step 0, compensated per ``how``), held
    again by w2: the hold is due as an unrecorded effect."""
    run, lease, block = await one_call_turn(store, "hold")
    ex = executor(store)
    turn = {"content": [block], "stop_reason": "tool_use"}
    await store.append_step(lease, 0, "model_turn", {**turn, "content": [
        {**block, "input": {"item": "seat", "how": how}}]},
        tool_call=ex.first_call_mark(RunHandle(run, lease, lease_ttl=60), 0, turn))
    await expire(store, run.id)
    ((run, lease),) = (await store.claim("default", "w2", 1)).claimed
    assert [e.state for e in await store.compensations_due(run.id)] == ["unrecorded"]
    return ex, RunHandle(run, lease, lease_ttl=60)


async def test_a_lost_call_whose_compensation_failed_stays_due(store: Store) -> None:
    """The lost call's only record was the run's mark, which its compensation's own mark
    replaced: a compensation that failed left ROLLBACK INCOMPLETE with nothing due, and a retry
    went back to the model instead of finishing the rollback (found by an adversarial review on
    2026-12-06). It is recorded, as an intent, before its compensation starts."""
    ex, h = await lost_inside_hold(store, "down_until_fixed")
    await ex.abort(h, "tool charge failed: card declined")
    first = await store.get_run(h.run.id)
    assert "ROLLBACK INCOMPLETE" in (first.error or ""), first.error
    assert [(e.tool, e.state) for e in await store.compensations_due(h.run.id)] == [
        ("hold", "intent")]
    FIXED.append(True)
    retried = await store.retry(h.run.id, "reservation service back")
    assert retried.rolling_back, retried.retried_as()
    done = await next_claim_ends(store, ex, "w3")
    assert (done.status, done.error) == ("failed", "tool charge failed: card declined; "
                                         "compensated: unhold for hold (step 0, outcome unknown)")
    assert UNKNOWN == [True, True]


async def test_a_lost_call_whose_compensating_worker_died_is_still_undone(store: Store) -> None:
    """The worker stops inside the lost call's compensation: its mark had replaced the lost
    call's, and the next claim ended the rollback without it, reporting the run rolled back
    (found by an adversarial review on 2026-12-06)."""
    ex, h = await lost_inside_hold(store, "hang")
    await store.request_rollback(h.run.id, "cancelled", "plans changed")
    rolling = asyncio.create_task(ex.abort(h))
    assert await asyncio.to_thread(COMPENSATING.wait, 60)  # it runs (hanging until RELEASE)
    rolling.cancel()  # this worker stops here: nothing more of it is written
    await asyncio.wait({rolling})
    RELEASE.set()  # the next attempt's compensation returns at once
    await expire(store, h.run.id)
    done = await next_claim_ends(store, ex, "w3")
    assert (done.status, done.error) == ("cancelled", "cancelled: plans changed; compensated: "
                                         "unhold for hold (step 0, outcome unknown)")
    assert UNKNOWN == [True, True]


async def test_a_rejected_retry_of_an_unknown_outcome_is_still_undone(store: Store) -> None:
    """A human rejects the re-run of an irreversible call whose outcome is unknown (not
    --abort): it was recorded as an error, which a rollback skips, although the first attempt
    may have taken effect (found by an adversarial review on 2026-12-06). The record says the
    outcome is unknown; the model is shown the rejection alone."""
    run, lease, block = await one_call_turn(store, "hold_for_good")
    await store.append_step(lease, 0, "model_turn", {"content": [block], "stop_reason": "tool_use"})
    await store.record_effect(lease, 0, 0, key="k", tool="hold_for_good",
                              tool_kind="irreversible", state="intent",
                              tool_input=block["input"], compensate="unhold")
    await store.wait_for_approval(lease, "outcome unknown", {
        "seq": 0, "call_index": 0, "tool": "hold_for_good", "input": block["input"],
        "stage": "outcome_unknown", "attempt": 1})
    await store.decide(run.id, WaitRef(0, 0, 1), "rejected", decided_by="bob", reason="unsure")
    ex = executor(store)
    ((run, lease),) = (await store.claim("default", "w2", 1)).claimed
    told = await ex.call_tool(RunHandle(run, lease, lease_ttl=60), 0, 0, block,
                              (await store.effects(run.id, 0))[0])
    assert set(told) == {"type", "tool_use_id", "content", "is_error"}, told
    # Resumed from the record (a worker died after it), the model is shown the same.
    again = await ex.call_tool(RunHandle(run, lease, lease_ttl=60), 0, 0, block,
                               (await store.effects(run.id, 0))[0])
    assert again == told
    assert [e.tool for e in await store.compensations_due(run.id)] == ["hold_for_good"]
    await store.request_rollback(run.id, "cancelled", "undo everything")
    await ex.abort(RunHandle(run, lease, lease_ttl=60))
    done = await store.get_run(run.id)
    assert (done.status, done.error) == ("cancelled", "cancelled: undo everything; compensated: "
                                         "unhold for hold_for_good (step 0, outcome unknown)")
    assert UNKNOWN == [True]


async def test_a_call_lost_behind_another_is_remembered_when_the_resume_marks_the_first(
    store: Store,
) -> None:
    """A turn of [peek, hold]: w1 is lost inside hold (call 1). w2's resume calls peek again,
    whose mark replaces the one that named hold, and w2 is lost too: the rollback found nothing
    and reported the run rolled back with the hold perhaps in place (found by a review on
    2026-12-06). The claim records the lost call before anything replaces its mark."""
    run, lease, block = await one_call_turn(store, "hold", "peek")
    calls = [{"type": "tool_use", "id": "toolu_0", "name": "peek", "input": {"item": "seat"}},
             {**block, "id": "toolu_1"}]
    await store.append_step(lease, 0, "model_turn", {"content": calls, "stop_reason": "tool_use"})
    ex = executor(store)
    h = RunHandle(run, lease, lease_ttl=60)
    await ex.call_tool(h, 0, 0, calls[0], None)
    await store.begin_tool_call(lease, ex._mark(h, TOOLS.get("hold"), 0, 1))  # then w1 is lost
    await expire(store, run.id)
    ((run, lease),) = (await store.claim("default", "w2", 1)).claimed
    h = RunHandle(run, lease, lease_ttl=60)
    async with store.pool.connection() as conn:  # w1's lease ended just now, not a second ago
        await conn.execute("UPDATE agent_run SET tool_call = jsonb_set(tool_call, "
                           "'{lease_until}', to_jsonb(now())), updated_at = now() "
                           "WHERE id = %s", [run.id])
    mark = (await store.get_run(run.id)).tool_call or {}
    w1_out = datetime.fromisoformat(str(mark["lease_until"])) + timedelta(seconds=0.3)
    await ex._record_lost_call(h)  # what advance() does first on a claim
    await ex.call_tool(h, 0, 0, calls[0], None)  # the resume's first call: its mark replaces it
    await expire(store, run.id)  # and w2 is lost
    await store.request_rollback(run.id, "cancelled", "undo")
    done = await next_claim_ends(store, ex, "w3")
    assert (done.status, done.error) == ("cancelled", "cancelled: undo; compensated: unhold for "
                                         "hold (step 0, outcome unknown)")
    assert UNKNOWN == [True]
    # w1 may have been inside hold until its lease's end plus hold's timeout: the bound is kept
    # with the effect, not read from the mark the resume replaced (undone 1.8 s early before).
    assert UNDONE_AT[0] >= w1_out


async def test_a_call_a_lost_worker_may_still_be_inside_is_undone_once_it_cannot_be(
    store: Store,
) -> None:
    """A lost worker's thread may still be inside its call (a sync tool that never checks the
    fence) until its lease's end plus the call's timeout. Undone at once, the compensation found
    nothing, was recorded, and the call then completed with its effect in place (found by a
    review on 2026-12-06). The rollback waits that bound out first."""
    ex, h = await lost_inside_hold(store, "release")
    await store.request_rollback(h.run.id, "cancelled", "plans changed")
    async with store.pool.connection() as conn:  # w1's lease ended just now, not a second ago
        await conn.execute("UPDATE agent_run SET tool_call = jsonb_set(tool_call, "
                           "'{lease_until}', to_jsonb(now())), updated_at = now() "
                           "WHERE id = %s", [h.run.id])
    mark = (await store.get_run(h.run.id)).tool_call or {}
    until = datetime.fromisoformat(str(mark["lease_until"])) + timedelta(
        seconds=float(mark["timeout"]))
    await ex.abort(h)
    done = await store.get_run(h.run.id)
    assert (done.status, done.error) == ("cancelled", "cancelled: plans changed; compensated: "
                                         "unhold for hold (step 0, outcome unknown)")
    assert float(mark["timeout"]) == 0.3 and UNDONE_AT and UNDONE_AT[0] >= until


async def test_a_call_that_failed_its_run_is_not_undone_after_a_death_mid_rollback(
    store: Store,
) -> None:
    """grab fails its run in w1, whose abort begins the rollback; w1 dies before it ends. The
    call's mark, still naming grab, was stamped as a loss by the next claim, which undid a call
    known to have failed (after waiting out its timeout) (found by a review on 2026-12-06). The
    rollback clears the mark as it begins."""
    run, lease, block = await one_call_turn(store, "grab")
    await store.append_step(lease, 0, "model_turn", {"content": [block], "stop_reason": "tool_use"})
    ex = executor(store)
    with pytest.raises(RunFailed) as failed:
        await ex.call_tool(RunHandle(run, lease, lease_ttl=60), 0, 0, block, None)
    await store.begin_rollback(lease, str(failed.value))  # abort's first write; then w1 dies
    await expire(store, run.id)
    done = await next_claim_ends(store, ex, "w2")
    assert (done.status, done.error) == (
        "failed", "tool grab failed: RuntimeError: could not grab seat")
    assert UNKNOWN == [] and GRABS == ["seat"]


async def test_a_call_cut_off_by_its_timeout_is_undone_on_a_rollback(store: Store) -> None:
    """A compensable call that timed out was recorded as a plain error, which a rollback skips:
    its thread runs on and may yet take effect, and the run ended "compensated" without it. It
    is recorded as an unknown outcome now; the model is shown the error alone."""
    run, lease, block = await one_call_turn(store, "slow_hold")
    await store.append_step(lease, 0, "model_turn", {"content": [block], "stop_reason": "tool_use"})
    ex = executor(store)
    h = RunHandle(run, lease, lease_ttl=60)
    called = datetime.now(UTC)  # cut off 0.2 s after this, at the earliest
    told = await ex.call_tool(h, 0, 0, block, None)
    assert set(told) == {"type", "tool_use_id", "content", "is_error"}, told
    assert told["is_error"] is True and told["content"].startswith("ToolTimeout")
    assert [e.tool for e in await store.compensations_due(run.id)] == ["slow_hold"]
    await store.request_rollback(run.id, "cancelled", "plans changed")
    await ex.abort(h)
    done = await store.get_run(run.id)
    assert (done.status, done.error) == ("cancelled", "cancelled: plans changed; compensated: "
                                         "unhold for slow_hold (step 0, outcome unknown)")
    assert UNKNOWN == [True]
    # Its thread may still take effect: undone only once its timeout (0.2 s) passed once more.
    assert UNDONE_AT[0] >= called + timedelta(seconds=0.4)


async def test_a_call_whose_timeout_failed_its_run_is_undone_by_its_rollback(
    store: Store,
) -> None:
    """A compensable call whose timeout fails the run (on_error="abort") recorded nothing: the
    rollback that follows at once passed it by, and its thread, still running, could take
    effect after the run said it was rolled back. It is recorded as an unknown outcome, and
    undone once its timeout passed once more."""
    run, lease, block = await one_call_turn(store, "slow_grab")
    await store.append_step(lease, 0, "model_turn", {"content": [block], "stop_reason": "tool_use"})
    ex = executor(store)
    h = RunHandle(run, lease, lease_ttl=60)
    called = datetime.now(UTC)  # cut off 0.2 s after this, at the earliest
    with pytest.raises(RunFailed, match="ToolTimeout") as failed:
        await ex.call_tool(h, 0, 0, block, None)
    await ex.abort(h, str(failed.value))
    done = await store.get_run(run.id)
    assert done.status == "failed"
    assert done.error == (f"{failed.value}; compensated: unhold for slow_grab (step 0, outcome "
                          "unknown)")
    assert UNKNOWN == [True]
    assert UNDONE_AT[0] >= called + timedelta(seconds=0.4)


async def test_a_call_an_older_worker_was_lost_inside_is_undone_from_the_registry(
    store: Store,
) -> None:
    """A rolling upgrade: a worker of the previous build, whose marks name no undo, is lost
    inside hold; the rollback by this build's worker found nothing to undo and reported the run
    cancelled with the hold perhaps in place. The tool's undo is read from the registry."""
    run, lease, block = await one_call_turn(store, "hold")
    ex = executor(store)
    mark = ex._mark(RunHandle(run, lease, lease_ttl=60), TOOLS.get("hold"), 0, 0)
    older = {k: v for k, v in mark.items() if k not in ("compensate", "kind")}
    await store.append_step(lease, 0, "model_turn", {"content": [block], "stop_reason": "tool_use"},
                            tool_call=older)  # then w1 is lost inside hold
    await expire(store, run.id)
    await store.request_rollback(run.id, "cancelled", "plans changed")
    done = await next_claim_ends(store, ex, "w2")
    assert (done.status, done.error) == ("cancelled", "cancelled: plans changed; compensated: "
                                         "unhold for hold (step 0, outcome unknown)")
    assert UNKNOWN == [True]


async def test_a_call_whose_timeout_failed_its_run_is_called_again_by_a_resume(
    store: Store,
) -> None:
    """The worker dies after a timeout failed the run, before its rollback began: recorded as
    done with the timeout, the call was shown to the model on the resume and the run went on,
    the late call never undone (found by a review on 2026-12-07). Recorded as an intent, the
    resume calls it again under the same key, and the rollback that follows undoes it."""
    run, lease, block = await one_call_turn(store, "slow_grab")
    turn = {"content": [block], "stop_reason": "tool_use"}
    await store.append_step(lease, 0, "model_turn", turn)
    ex = executor(store)
    with pytest.raises(RunFailed, match="ToolTimeout"):
        await ex.run_tools(RunHandle(run, lease, lease_ttl=60), 0, turn)
    await expire(store, run.id)  # w1 died before abort() began the rollback
    ((run, lease),) = (await store.claim("default", "w2", 1)).claimed
    h = RunHandle(run, lease, lease_ttl=60)
    with pytest.raises(RunFailed, match="ToolTimeout") as failed:
        await ex.run_tools(h, 0, turn)  # as advance() resumes the turn
    assert SLOW_GRABS == [1, 1]  # called again, not its first timeout shown to the model
    await ex.abort(h, str(failed.value))
    done = await store.get_run(run.id)
    assert done.error == (f"{failed.value}; compensated: unhold for slow_grab (step 0, outcome "
                          "unknown)")
    assert UNKNOWN == [True]


async def test_an_attempt_cut_off_by_its_timeout_is_undone_whatever_its_retry_said(
    store: Store,
) -> None:
    """Attempt 1 timed out (its thread runs on), attempt 2 raised, which failed the run: the
    rollback undid nothing, since the failure recorded was attempt 2's (found by a review on
    2026-12-07)."""
    run, lease, block = await one_call_turn(store, "flaky_grab")
    await store.append_step(lease, 0, "model_turn", {"content": [block], "stop_reason": "tool_use"})
    metrics = WorkerMetrics()
    ex = RunExecutor(store, Providers(default=None), TOOLS, metrics, Health(60, metrics),
                     RetryPolicy(max_retries=1), is_draining=lambda: False)
    h = RunHandle(run, lease, lease_ttl=60)
    with pytest.raises(RunFailed, match="the grab service said no") as failed:
        await ex.call_tool(h, 0, 0, block, None)
    assert SLOW_GRABS == [1, 2]
    await ex.abort(h, str(failed.value))
    assert (await store.get_run(run.id)).error == (
        f"{failed.value}; compensated: unhold for flaky_grab (step 0, outcome unknown)")
    assert UNKNOWN == [True]

