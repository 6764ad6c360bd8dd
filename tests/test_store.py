"""The run store's guarantees, each checked against a real PostgreSQL."""

from __future__ import annotations

import asyncio
import json
from typing import Literal
from uuid import UUID

import psycopg
import pytest

from agentrun.errors import DuplicateStep, LeaseLost, RunCancelled, RunNotFound
from agentrun.manifests import DEFAULT_MAX_ATTEMPTS, DEFAULT_MAX_STEPS, AgentSpec
from agentrun.store import (
    CHANNEL_RUN_CHANGED,
    CHANNEL_RUN_READY,
    K8sRef,
    Lease,
    PromptVersion,
    Store,
)
from agentrun.waits import WaitRef

AGENT = AgentSpec(
    model="claude-sonnet-4-5", system="You migrate databases carefully.", tools=["read_schema"]
)
PROMPT = PromptVersion(
    model="claude-sonnet-4-5",
    system="You migrate databases carefully.",
    tools=[
        {
            "name": "read_schema",
            "description": "Read a schema",
            "input_schema": {"type": "object", "properties": {"table": {"type": "string"}}},
        }
    ],
    params={"max_tokens": 8192},
)


async def make_runs(store: Store, n: int, **kw: object) -> list[UUID]:
    ids = []
    for i in range(n):
        run, created = await store.create_run(f"task {i}", AGENT, **kw)  # type: ignore[arg-type]
        assert created
        ids.append(run.id)
    return ids


async def expire_lease(database_url: str, run_id: UUID) -> None:
    """Make a lease look expired, as if its holder stalled past the TTL."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "UPDATE agent_run SET lease_until = now() - interval '1 second' WHERE id = %s",
            (run_id,),
        )


async def test_eight_concurrent_claimers_claim_each_of_100_runs_exactly_once(store: Store) -> None:
    ids = await make_runs(store, 100)
    claims: list[tuple[str, UUID]] = []

    async def claimer(name: str) -> None:
        while True:
            result = await store.claim("default", name, limit=3)
            if not result.claimed:
                return
            claims.extend((name, run.id) for run, _ in result.claimed)

    await asyncio.gather(*(claimer(f"w{i}") for i in range(8)))
    claimed_ids = [rid for _, rid in claims]
    assert len(claimed_ids) == 100
    assert set(claimed_ids) == set(ids)
    assert len({w for w, _ in claims}) > 1, "claims were not spread over claimers"
    for run in await store.list_runs(limit=200):
        assert run.status == "running"
        assert run.attempt == 1 and run.lease_epoch == 1


async def test_claim_order_is_oldest_first_and_per_pool(store: Store) -> None:
    first = await make_runs(store, 3, pool="gpu")
    await make_runs(store, 2, pool="default")
    result = await store.claim("gpu", "w", limit=2)
    assert [r.id for r, _ in result.claimed] == first[:2]


async def test_create_run_is_idempotent_on_external_key(store: Store) -> None:
    ref = K8sRef(namespace="ns", name="migrate-orders", uid="uid-1")
    run1, created1 = await store.create_run("task", AGENT, k8s=ref)
    run2, created2 = await store.create_run("task", AGENT, k8s=ref)
    assert created1 and not created2
    assert run1.id == run2.id
    assert run1.k8s_name == "migrate-orders" and run1.external_key == "k8s:uid-1"
    assert len(await store.list_runs()) == 1


async def test_duplicate_step_insert_fails_on_primary_key(store: Store, database_url: str) -> None:
    (rid,) = await make_runs(store, 1)
    ((_, lease),) = (await store.claim("default", "w1")).claimed
    await store.append_step(lease, 0, "model_turn", {"content": []})
    with pytest.raises(DuplicateStep):
        await store.append_step(lease, 0, "model_turn", {"content": ["again"]})
    # And directly in SQL, bypassing the store: the database itself refuses.
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.UniqueViolation):
            await conn.execute(
                "INSERT INTO agent_step (run_id, seq, kind, payload, lease_epoch, worker) "
                "VALUES (%s, 0, 'model_turn', '{}', 1, 'x')",
                (rid,),
            )


async def test_agent_step_is_append_only_in_the_database(store: Store, database_url: str) -> None:
    (rid,) = await make_runs(store, 1)
    ((_, lease),) = (await store.claim("default", "w1")).claimed
    await store.append_step(lease, 0, "model_turn", {"content": [{"type": "text", "text": "hi"}]})
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.RestrictViolation, match="append-only"):
            await conn.execute("UPDATE agent_step SET kind = 'note' WHERE run_id = %s", (rid,))
        with pytest.raises(psycopg.errors.RestrictViolation, match="append-only"):
            await conn.execute("DELETE FROM agent_step WHERE run_id = %s", (rid,))
        with pytest.raises(psycopg.errors.RestrictViolation, match="append-only"):
            await conn.execute("TRUNCATE agent_step CASCADE")
    steps = await store.steps(rid)
    assert [s.payload for s in steps] == [{"content": [{"type": "text", "text": "hi"}]}]


async def test_expired_lease_holder_is_fenced_off_after_another_claim(
    store: Store, database_url: str
) -> None:
    (rid,) = await make_runs(store, 1)
    ((_, lease_a),) = (await store.claim("default", "worker-a")).claimed
    await store.append_step(lease_a, 0, "model_turn", {"n": 0})
    await expire_lease(database_url, rid)
    ((_, lease_b),) = (await store.claim("default", "worker-b")).claimed
    assert lease_b.epoch == lease_a.epoch + 1
    # A's next append fails even for a seq that B has not written.
    with pytest.raises(LeaseLost, match="epoch"):
        await store.append_step(lease_a, 5, "model_turn", {"from": "a"})
    with pytest.raises(LeaseLost):
        await store.renew(lease_a)
    with pytest.raises(LeaseLost):
        await store.finish(lease_a, "succeeded", result="a thinks it won")
    assert not await store.release(lease_a)
    await store.append_step(lease_b, 1, "tool_result", {"from": "b"})
    await store.append_step(lease_b, 2, "model_turn", {"from": "b"})
    steps = await store.steps(rid)
    assert [(s.seq, s.worker, s.lease_epoch) for s in steps] == [
        (0, "worker-a", 1),
        (1, "worker-b", 2),
        (2, "worker-b", 2),
    ]
    await store.finish(lease_b, "succeeded", result="done")
    run = await store.get_run(rid)
    assert run.status == "succeeded" and run.result == "done" and run.lease_owner is None


async def test_live_lease_is_not_claimable(store: Store) -> None:
    await make_runs(store, 1)
    assert len((await store.claim("default", "a")).claimed) == 1
    assert (await store.claim("default", "b")).claimed == []


async def test_run_claimed_max_attempts_times_goes_to_dead_letter(
    store: Store, database_url: str
) -> None:
    (rid,) = await make_runs(store, 1, max_attempts=3)
    for attempt in range(1, 4):
        ((run, _),) = (await store.claim("default", f"w{attempt}")).claimed
        assert run.attempt == attempt
        await expire_lease(database_url, rid)
    result = await store.claim("default", "w4")
    assert result.claimed == []
    assert [r.id for r in result.dead_lettered] == [rid]
    run = await store.get_run(rid)
    assert run.status == "dead_letter" and run.attempt == 3
    assert run.error is not None and "maxAttempts 3" in run.error
    await expire_lease(database_url, rid)
    again = await store.claim("default", "w5")
    assert again.claimed == [] and again.dead_lettered == []


async def test_a_step_committed_since_the_last_claim_restores_the_attempt_budget(
    store: Store, database_url: str
) -> None:
    (rid,) = await make_runs(store, 1, max_attempts=2)
    # Five claims, each of which commits a step before its holder "dies": never dead-lettered.
    for n in range(5):
        ((run, lease),) = (await store.claim("default", f"w{n}")).claimed
        assert run.attempt == n + 1 and run.stalled_attempts == 1
        await store.append_step(lease, n, "note", {"n": n})
        await expire_lease(database_url, rid)
    # Then claims that commit nothing: the count of claims in a row without a step runs out.
    for n in range(2):
        ((run, _),) = (await store.claim("default", f"stall{n}")).claimed
        assert run.stalled_attempts == n + 1
        await expire_lease(database_url, rid)
    result = await store.claim("default", "last")
    assert [r.id for r in result.dead_lettered] == [rid]
    run = await store.get_run(rid)
    assert run.status == "dead_letter" and run.attempt == 7
    assert run.error is not None and run.error.startswith(
        "dead-lettered: claimed 2 times in a row without committing a step "
        "(maxAttempts 2; 7 claims in all)"
    )


async def test_cancelled_run_is_not_claimable_and_its_holder_is_stopped(store: Store) -> None:
    pending, held = await make_runs(store, 2)
    ((_, lease),) = (await store.claim("default", "w1")).claimed
    assert lease.run_id == pending
    await store.cancel(held)  # cancelled before anyone claimed it
    assert (await store.claim("default", "w2")).claimed == []
    await store.cancel(pending)  # cancelled while w1 holds it
    with pytest.raises(RunCancelled):
        await store.append_step(lease, 0, "model_turn", {})
    with pytest.raises(LeaseLost):  # RunCancelled is a LeaseLost
        await store.renew(lease)
    assert (await store.get_run(pending)).status == "cancelled"
    assert await store.steps(pending) == []


async def test_release_hands_the_run_over_at_once_without_spending_an_attempt(
    store: Store,
) -> None:
    (rid,) = await make_runs(store, 1)
    ((_, lease),) = (await store.claim("default", "w1")).claimed
    assert await store.release(lease)
    run = await store.get_run(rid)
    assert run.status == "pending" and run.lease_owner is None and run.attempt == 0
    ((run2, lease2),) = (await store.claim("default", "w2")).claimed
    assert run2.attempt == 1 and lease2.epoch == 2
    with pytest.raises(LeaseLost):
        await store.append_step(lease, 0, "model_turn", {})


async def test_renew_extends_the_lease(store: Store) -> None:
    await make_runs(store, 1)
    ((run, lease),) = (await store.with_lease_ttl(2).claim("default", "w1")).claimed
    until = await store.with_lease_ttl(60).renew(lease)
    assert run.lease_until is not None and until > run.lease_until


async def test_steps_read_back_in_order_and_verbatim(store: Store) -> None:
    (rid,) = await make_runs(store, 1)
    ((_, lease),) = (await store.claim("default", "w1")).claimed
    payloads = [
        {
            "content": [
                {"type": "thinking", "thinking": "ü — 🙂", "signature": "c2ln"},
                {"type": "text", "text": "x", "citations": None},
            ]
        },
        {"content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "3.0"}]},
        {"content": [{"type": "text", "text": "1e400 as text", "n": 12345678901234567890}]},
    ]
    for seq, payload in enumerate(payloads):
        await store.append_step(lease, seq, "model_turn", payload, request_id=f"req_{seq}")
    steps = await store.steps(rid)
    assert [s.seq for s in steps] == [0, 1, 2]
    assert [s.payload for s in steps] == payloads
    assert [json.dumps(s.payload, sort_keys=True) for s in steps] == [
        json.dumps(p, sort_keys=True) for p in payloads
    ]
    assert steps[0].request_id == "req_0"
    assert (await store.get_run(rid)).next_seq == 3


async def test_pinned_fields_and_prompt_versions_cannot_change(
    store: Store, database_url: str
) -> None:
    (rid,) = await make_runs(store, 1)
    ((run, lease),) = (await store.claim("default", "w1")).claimed
    assert run.agent_spec == {
        "model": "claude-sonnet-4-5",
        "maxTokens": 8192,
        "pool": "default",
        "system": "You migrate databases carefully.",
        "tools": ["read_schema"],
        "requireApproval": False,
        "promptCaching": True,
        "provider": "anthropic",
    }
    assert await store.pin_prompt_version(lease, PROMPT) == PROMPT.id
    # A later worker with other tool definitions keeps the first pin.
    other = PromptVersion(model=PROMPT.model, system=PROMPT.system, tools=[], params={})
    assert await store.pin_prompt_version(lease, other) == PROMPT.id
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.RestrictViolation, match="pinned"):
            await conn.execute("UPDATE agent_run SET model = 'other' WHERE id = %s", (rid,))
        with pytest.raises(psycopg.errors.RestrictViolation, match="pinned"):
            await conn.execute(
                "UPDATE agent_run SET prompt_version = %s WHERE id = %s", (other.id, rid)
            )
        with pytest.raises(psycopg.errors.RestrictViolation, match="write-once"):
            await conn.execute("UPDATE prompt_version SET system = 'reworded'")
        with pytest.raises(psycopg.errors.CheckViolation):
            await conn.execute("UPDATE agent_run SET status = 'paused' WHERE id = %s", (rid,))
    pv = await store.get_prompt_version(PROMPT.id)
    assert pv == PROMPT and pv.id == PROMPT.id


async def test_pool_depth_counts_pending_and_running_per_pool(store: Store) -> None:
    await make_runs(store, 3)
    await make_runs(store, 2, pool="gpu")
    await store.claim("default", "w", limit=1)
    depth = await store.pool_depth()
    assert (depth["default"].pending, depth["default"].running) == (2, 1)
    assert (depth["gpu"].pending, depth["gpu"].running) == (2, 0)


async def test_unknown_run_id_raises_run_not_found(store: Store) -> None:
    with pytest.raises(RunNotFound):
        await store.get_run("00000000-0000-0000-0000-000000000000")
    with pytest.raises(RunNotFound):
        await store.append_step(Lease(UUID(int=1), "w", 1), 0, "model_turn", {})


async def test_listen_reports_run_changes_and_ready_runs(store: Store) -> None:
    got: list[tuple[str, object]] = []
    ready = asyncio.Event()

    async def listener() -> None:
        async for n in store.listen([CHANNEL_RUN_CHANGED, CHANNEL_RUN_READY]):
            got.append((n.channel, n.json() if n.channel == CHANNEL_RUN_CHANGED else n.payload))
            if n.channel == CHANNEL_RUN_CHANGED and n.json()["status"] == "cancelled":
                ready.set()
                return

    task = asyncio.create_task(listener())
    await asyncio.sleep(0.3)  # LISTEN is in place
    (rid,) = await make_runs(store, 1, pool="p1")
    ((_, lease),) = (await store.claim("p1", "w")).claimed
    await store.append_step(lease, 0, "model_turn", {})
    await store.cancel(rid)
    await asyncio.wait_for(ready.wait(), 5)
    await task
    changed = [p for c, p in got if c == CHANNEL_RUN_CHANGED]
    assert [(p["status"], p["step"]) for p in changed] == [  # type: ignore[index]
        ("pending", 0),
        ("running", 0),
        ("cancelled", 1),
    ]  # no notification per step
    assert all(p["id"] == str(rid) and p["pool"] == "p1" for p in changed)  # type: ignore[index]
    assert (CHANNEL_RUN_READY, "p1") in got


async def test_each_decision_on_an_unknown_outcome_is_about_one_attempt(
    store: Store, database_url: str
) -> None:
    (rid,) = await make_runs(store, 1)
    ((_, lease),) = (await store.claim("default", "w1")).claimed
    await store.record_effect(
        lease, 0, 0, key="k", tool="drop_table", tool_kind="irreversible", state="intent"
    )
    Decision = Literal["approved", "rejected"]
    decisions: list[tuple[int, Decision]] = [(1, "approved"), (2, "rejected")]
    for attempt, decision in decisions:
        pending = {"seq": 0, "call_index": 0, "tool": "drop_table", "input": {},
                   "stage": "outcome_unknown", "attempt": attempt}
        await store.wait_for_approval(lease, "outcome unknown", pending)
        decided = await store.decide(rid, WaitRef(0, 0, attempt), decision,
                                     decided_by=f"oncall{attempt}")
        assert decided["attempt"] == attempt
        ((_, lease),) = (await store.claim("default", f"w{attempt + 1}")).claimed
        if decision == "approved":  # the approved re-run is counted before the tool is called
            assert await store.retry_intent(lease, 0, 0, attempt) == attempt + 1
            with pytest.raises(LeaseLost, match=f"no longer at attempt {attempt}"):
                await store.retry_intent(lease, 0, 0, attempt)  # one decision, one attempt
    assert (await store.effects(rid, 0))[0].attempts == 2
    got = [await store.get_approval(rid, 0, 0, "outcome_unknown", n) for n in (1, 2, 3)]
    assert [(a.decision, a.decided_by) if a else None for a in got] == [
        ("approved", "oncall1"), ("rejected", "oncall2"), None]
    # A worker whose claim was taken over cannot count an attempt.
    await expire_lease(database_url, rid)
    ((_, newer),) = (await store.claim("default", "w9")).claimed
    with pytest.raises(LeaseLost, match="claimed again"):
        await store.retry_intent(lease, 0, 0, 2)
    assert newer.epoch == lease.epoch + 1


async def test_a_runs_limits_have_one_default_and_it_is_not_in_the_schema(
    store: Store, database_url: str
) -> None:
    # The manifests' defaults are the only ones: create_run stores them, and the schema keeps no
    # second copy that an insert leaving them out would quietly get (migration 0017).
    run, _ = await store.create_run("defaults", AGENT)
    assert (run.max_steps, run.max_attempts) == (DEFAULT_MAX_STEPS, DEFAULT_MAX_ATTEMPTS)
    with psycopg.connect(database_url, autocommit=True) as conn:
        for column in ("max_steps", "max_attempts"):
            default = conn.execute(
                "SELECT column_default FROM information_schema.columns"
                " WHERE table_name = 'agent_run' AND column_name = %s", (column,)
            ).fetchone()
            assert default == (None,), f"agent_run.{column} has a DEFAULT of its own: {default}"
        with pytest.raises(psycopg.errors.NotNullViolation, match="max_steps"):
            conn.execute("INSERT INTO agent_run (task, model, agent_spec, max_attempts)"
                         " VALUES ('t', 'm', '{}', 1)")
