"""The operator's status and Events as pure functions of the run row (no cluster needed)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from agentrun.operator.status import Snapshot, same_status, status_for, transitions
from agentrun.store import Run


def run(**fields: Any) -> Run:
    now = datetime.now(UTC)
    base: dict[str, Any] = dict(
        id=uuid.uuid4(), external_key="k8s:u", k8s_namespace="default", k8s_name="r",
        k8s_uid="u", pool="default", status="pending", task="t", model="m", agent_spec={},
        prompt_version=None, max_steps=50, max_attempts=8, lease_owner=None, lease_until=None,
        lease_epoch=0, attempt=0, next_seq=0, result=None, error=None, created_at=now,
        updated_at=now, started_at=None, finished_at=None,
    )
    base.update(fields)
    return Run(**base)


def reasons(old: Snapshot | None, new: Run) -> list[tuple[str, str]]:
    return [(e.type, e.reason) for e in transitions(old, new)]


def test_a_first_claim_seen_late_is_claimed_not_resumed() -> None:
    # Coalescing: the mirror may first see the run several steps in.
    late = run(status="running", lease_owner="w1", lease_epoch=1, attempt=1, next_seq=4)
    assert reasons(Snapshot("pending", 0, None, 0), late) == [("Normal", "Claimed")]


def handover(kind: str, epoch: int, step: int, holder: str = "w1") -> dict[str, Any]:
    """What migration 0009's trigger writes on the claim that took a run over."""
    return {"kind": kind, "from": holder, "to": "w2", "epoch": epoch, "step": step,
            "lost_at": "2026-12-01T23:00:00+00:00", "claimed_at": "2026-12-01T23:00:00+00:00"}


def test_a_release_seen_coalesced_with_the_next_claim_is_a_normal_hand_over() -> None:
    # Release and claim 10 ms apart: the mirror sees w1 -> w2 with no pending in between. The
    # store's record of the claim says it was a release, not a lease that ran out.
    handed = run(status="running", lease_owner="w2", lease_epoch=2, attempt=1, next_seq=5,
                 claim_seq=3, handover=handover("handed_over", 2, 3))
    [e] = transitions(Snapshot("running", 1, "w1", 1), handed)
    assert (e.type, e.reason) == ("Normal", "HandedOver")
    assert e.message == "w1 handed the run over at step 3; resumed by w2 (attempt 1)"
    # Seen in between as pending, the same.
    assert reasons(Snapshot("pending", 1, None, 0), handed) == [("Normal", "HandedOver")]


def test_only_an_expired_lease_is_a_warning() -> None:
    expired = run(status="running", lease_owner="w2", lease_epoch=2, attempt=2, next_seq=4,
                  claim_seq=3, handover=handover("lease_expired", 2, 3))
    [e] = transitions(Snapshot("running", 1, "w1", 1), expired)
    assert (e.type, e.reason) == ("Warning", "LeaseExpired")
    assert e.message == "w1 stopped renewing its lease; resumed by w2 at step 3 (attempt 2)"


def test_a_hand_over_seen_only_once_the_run_finished_is_still_told() -> None:
    # The new holder finished the run before the operator looked (a drain on a loaded node):
    # the mirror goes from w1's claim straight to succeeded. The claim's record still says it.
    done = run(status="succeeded", lease_owner=None, lease_epoch=2, attempt=1, next_seq=17,
               claim_seq=3, result="ok", handover=handover("handed_over", 2, 3))
    events = transitions(Snapshot("running", 1, "w1", 1), done)
    assert [(e.type, e.reason) for e in events] == [("Normal", "HandedOver"),
                                                    ("Normal", "Finished")]
    assert events[0].message == "w1 handed the run over at step 3; resumed by w2 (attempt 1)"
    expired = run(status="succeeded", lease_owner=None, lease_epoch=2, attempt=2, next_seq=17,
                  claim_seq=3, result="ok", handover=handover("lease_expired", 2, 3))
    assert reasons(Snapshot("running", 1, "w1", 1), expired) == [
        ("Warning", "LeaseExpired"), ("Normal", "Finished")]
    # A record of an earlier claim says nothing of this one; the same epoch, nothing new.
    earlier = run(status="succeeded", lease_owner=None, lease_epoch=3, attempt=1, next_seq=17,
                  result="ok", handover=handover("handed_over", 2, 3))
    assert reasons(Snapshot("running", 1, "w1", 1), earlier) == [("Normal", "Finished")]
    assert reasons(Snapshot("running", 2, "w2", 1), done) == [("Normal", "Finished")]


def test_after_an_operator_restart_the_step_named_is_the_hand_overs_not_the_current_one() -> None:
    # The restarted operator knows the object's old status only; the run moved on since.
    before = run(status="running", lease_owner="w1", lease_epoch=1, attempt=1, next_seq=3)
    shown = status_for(before, db_up=True, previous=None)
    now = run(status="running", lease_owner="w2", lease_epoch=2, attempt=1, next_seq=11,
              claim_seq=3, handover=handover("handed_over", 2, 3))
    [e] = transitions(Snapshot.from_status(shown), now)
    assert e.reason == "HandedOver" and "at step 3;" in e.message and "11" not in e.message


def test_a_claim_after_no_holder_is_a_plain_resume_at_its_claim_step() -> None:
    # The record is of an earlier claim (epoch 2); this claim followed an approval.
    after_approval = run(status="running", lease_owner="w3", lease_epoch=3, attempt=2,
                         next_seq=8, claim_seq=6, handover=handover("lease_expired", 2, 3))
    [e] = transitions(Snapshot("pending", 2, None, 2), after_approval)
    assert (e.type, e.reason, e.message) == ("Normal", "Resumed",
                                             "resumed by w3 at step 6 (attempt 2)")


def test_an_operator_restart_repeats_no_event() -> None:
    current = run(status="running", lease_owner="w1", lease_epoch=3, attempt=2, next_seq=9)
    shown = status_for(current, db_up=True, previous=None)
    assert reasons(Snapshot.from_status(shown), current) == []


def test_terminal_transitions_and_the_approval_wait() -> None:
    waiting = run(status="waiting_approval", lease_epoch=1, attempt=1, next_seq=2,
                  wait_reason="approval required before drop_table (step 1)",
                  pending_call={"seq": 1, "tool": "drop_table", "input": {"t": "x"}})
    [(kind, reason)] = reasons(Snapshot("running", 1, "w1", 1), waiting)
    assert (kind, reason) == ("Warning", "WaitingForApproval")
    message = transitions(Snapshot("running", 1, "w1", 1), waiting)[0].message
    assert "kubectl annotate agentrun r -n default agentrun.dev/approve=1" in message
    for status, expected in (("succeeded", "Finished"), ("failed", "Failed"),
                             ("cancelled", "Cancelled"), ("dead_letter", "DeadLettered")):
        ended = run(status=status, lease_epoch=1, attempt=1, next_seq=2)
        assert reasons(Snapshot("running", 1, "w1", 1), ended)[-1][1] == expected


def test_status_is_stable_and_truncates_long_text() -> None:
    done = run(status="succeeded", result="x" * 5000, lease_epoch=1, attempt=1, next_seq=3,
               input_tokens=10, output_tokens=2, cache_read_tokens=300, cache_write_tokens=40,
               cost_usd=0.25)
    first = status_for(done, db_up=True, previous=None)
    again = status_for(done, db_up=True, previous=first)
    assert first == again  # condition timestamps carried over: nothing to patch
    assert len(first["result"]) == 1024 and first["tokens"] == {
        "input": 10, "output": 2, "cacheRead": 300, "cacheWrite": 40
    }
    assert first["costUSD"] == 0.25
    assert [c["type"] for c in first["conditions"]] == [
        "Accepted", "WaitingForApproval", "Completed", "DatabaseAvailable", "Ready"]
    assert first["conditions"][4]["status"] == "True"
    down = status_for(done, db_up=False, previous=first)
    assert down["conditions"][3]["status"] == "False"


def test_ready_is_true_only_once_the_run_succeeded() -> None:
    def ready(**fields: Any) -> tuple[str, str]:
        [c] = [c for c in status_for(run(**fields), db_up=True, previous=None)["conditions"]
               if c["type"] == "Ready"]
        return c["status"], c["reason"]

    assert ready(status="pending") == ("False", "InProgress")
    assert ready(status="running", lease_owner="w") == ("False", "InProgress")
    assert ready(status="waiting_approval", pending_call={"seq": 1}) == (
        "False", "WaitingForApproval")
    assert ready(status="failed", error="boom") == ("False", "Failed")
    assert ready(status="succeeded", result="ok") == ("True", "Succeeded")


def test_a_status_read_back_without_its_null_fields_is_the_same_status() -> None:
    # B5: the API server drops null fields; comparing the object's status (keys absent) with
    # a freshly computed one (keys None) found a difference on every restart.
    pending = run(status="pending")
    computed = status_for(pending, db_up=True, previous=None, generation=1)
    assert all(v is not None for v in computed.values())
    read_back = {k: v for k, v in computed.items()}
    read_back["worker"] = None
    read_back["pendingApproval"] = None
    assert same_status(read_back, status_for(pending, db_up=True, previous=read_back,
                                             generation=1))
    assert computed["observedGeneration"] == 1
    assert {c["observedGeneration"] for c in computed["conditions"]} == {1}


def test_a_new_approval_wait_inside_one_flush_window_is_its_own_event() -> None:
    # B6: approve step 1 -> claim -> wait on step 3, all between two flushes: the mirror sees
    # waiting_approval twice, only the seq differs.
    first = Snapshot("waiting_approval", 1, None, 1, "1.0")
    again = run(status="waiting_approval", lease_epoch=2, attempt=1, next_seq=4,
                wait_reason="approval required before drop_table (step 3)",
                pending_call={"seq": 3, "tool": "drop_table", "input": {}})
    assert reasons(first, again) == [("Warning", "WaitingForApproval")]
    assert "approve=3" in transitions(first, again)[0].message
    same = Snapshot.of(again)
    assert reasons(same, again) == []


def test_the_steps_next_call_waiting_inside_one_flush_window_is_its_own_event() -> None:
    # Approve call 0 of step 0 -> claim -> call 1 of the same step waits, all between two
    # flushes: only the call differs (the seq and the attempt are the same). It was no Event,
    # and .status kept no trace of which call; the Event names the new wait.
    call = {"seq": 0, "call_index": 0, "tool": "drop_table", "input": {}, "stage": "before_call",
            "attempt": 1}
    first = run(status="waiting_approval", lease_epoch=1, attempt=1, next_seq=1,
                pending_call=call)
    again = run(status="waiting_approval", lease_epoch=2, attempt=1, next_seq=1,
                pending_call={**call, "call_index": 1})
    assert reasons(Snapshot.of(first), again) == [("Warning", "WaitingForApproval")]
    assert "agentrun.dev/approve=0.1 (or agentrun.dev/reject=0.1)" in (
        transitions(Snapshot.of(first), again)[0].message)
    status = status_for(again, db_up=True, previous=None, generation=1)
    assert (status["pendingApproval"]["call"], status["pendingApproval"]["decide"]) == (1, "0.1")
    assert reasons(Snapshot.from_status(status), again) == []


def test_an_unknown_outcome_of_an_approved_re_run_is_a_new_wait_on_the_same_step() -> None:
    # F2: one decision buys one attempt. Approve attempt 1 of step 0 -> the re-run's worker dies
    # -> the run waits again on step 0 for attempt 2, all between two flushes: only the attempt
    # differs, and it must be an Event of its own (the on-call has a new decision to make).
    call = {"seq": 0, "tool": "drop_table", "input": {}, "stage": "outcome_unknown"}
    first = run(status="waiting_approval", lease_epoch=1, attempt=1, next_seq=1,
                pending_call={**call, "attempt": 1})
    again = run(status="waiting_approval", lease_epoch=3, attempt=2, next_seq=1,
                pending_call={**call, "attempt": 2})
    assert reasons(Snapshot.of(first), again) == [("Warning", "WaitingForApproval")]
    assert reasons(Snapshot.of(again), again) == []
    status = status_for(again, db_up=True, previous=None, generation=1)
    assert status["pendingApproval"]["attempt"] == 2
    # An operator restart reads the attempt back from .status: no Event repeated.
    assert reasons(Snapshot.from_status(status), again) == []


def test_status_text_is_escaped_as_kubectl_describe_prints_it() -> None:
    """Found by an adversarial review on 2026-12-06: .status.error, .status.result and the
    pending call's arguments reached `kubectl describe` raw (ESC, BEL, a C1 CSI, a bidi
    override), while message and the conditions were escaped. Lines and tabs stay."""
    evil = "line one\n\tcol\x1b[2J\x07\x9b31m\u202eevil"
    shown = "line one\n\tcol\\x1b[2J\\x07\\x9b31m\\u202eevil"
    failed = run(status="failed", error=evil, result=evil, lease_epoch=1, attempt=1)
    st = status_for(failed, db_up=True, previous=None)
    assert (st["error"], st["result"]) == (shown, shown)
    waiting = run(status="waiting_approval", lease_epoch=1, attempt=1, wait_reason="approve?",
                  pending_call={"seq": 0, "call_index": 0, "tool": "t",
                                "input": {"q": "\x9b\x7f\u202e"}, "stage": "before_call"})
    assert status_for(waiting, db_up=True, previous=None)["pendingApproval"]["arguments"] == (
        '{"q": "\\x9b\\x7f\\u202e"}')
