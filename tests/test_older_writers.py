"""Statements of an earlier release, sent to today's schema, as they are while a rollout goes on.

A release's migrations are written so the previous release keeps working through its rollout
(docs/worker.md). Migration 0016 broke that: its CHECK refused every statement of a release
before it that set or cleared a rollback's reason alone, so an old CLI or operator could not roll
a run back and an old worker could not fail one (found by an adversarial review on 2026-12-06;
migration 0019 completes what those writers leave out). The statements below are those of the
release before 0016 (`git show d0cf257^:src/agentrun/sql/queries.sql`), word for word.
"""

from __future__ import annotations

import psycopg
import pytest

from agentrun.store import DB_ERRORS, StalePlan, Store
from tests.workerkit import AGENT

#: request_rollback before 0016: cancel --rollback, reject --abort.
OLD_REQUEST_ROLLBACK = """
UPDATE agent_run
   SET rollback_reason = coalesce(rollback_reason, %(reason)s),
       status = CASE WHEN status = 'waiting_approval' THEN 'pending' ELSE status END,
       wait_reason = CASE WHEN status = 'waiting_approval' THEN NULL ELSE wait_reason END,
       pending_call = CASE WHEN status = 'waiting_approval' THEN NULL ELSE pending_call END
 WHERE id = %(run_id)s AND status IN ('pending', 'running', 'waiting_approval')
RETURNING *;
"""

#: begin_rollback before 0016: the worker's abort, which every failure passes through.
OLD_BEGIN_ROLLBACK = """
UPDATE agent_run SET rollback_reason = coalesce(rollback_reason, %(reason)s)
 WHERE id = %(run_id)s AND lease_owner = %(worker)s AND lease_epoch = %(epoch)s
   AND status = 'running'
RETURNING rollback_reason;
"""

#: The part of retry_run before 0016 that touches the rollback: it clears the reason alone.
OLD_RETRY_CLEARS = "UPDATE agent_run SET rollback_reason = NULL WHERE id = %(run_id)s"


def rollback_of(url: str, run_id: object) -> tuple[str | None, str | None]:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT rollback_reason, rollback_end FROM agent_run WHERE id = %s",
                           (run_id,)).fetchone()
    assert row is not None
    return row[0], row[1]


async def test_an_older_releases_rollback_statements_work_on_todays_schema(
    store: Store, database_url: str
) -> None:
    cancelled, _ = await store.create_run("cancel me", AGENT)
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(OLD_REQUEST_ROLLBACK,
                     {"run_id": cancelled.id, "reason": "cancelled: plans changed"})
    assert rollback_of(database_url, cancelled.id) == ("cancelled: plans changed", "cancelled")

    failing, _ = await store.create_run("fail me", AGENT, pool="old-writers")
    ((_, lease),) = (await store.claim("old-writers", "old-worker", 1)).claimed
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(OLD_BEGIN_ROLLBACK, {"run_id": failing.id, "reason": "tool boom failed",
                                          "worker": lease.worker, "epoch": lease.epoch})
    assert rollback_of(database_url, failing.id) == ("tool boom failed", "failed")

    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(OLD_RETRY_CLEARS, {"run_id": failing.id})
    assert rollback_of(database_url, failing.id) == (None, None)

    # Today's statements write both, and the first request still stays.
    now, recorded = await store.request_rollback(cancelled.id, "failed", "another reason")
    assert not recorded or (now.rollback_reason, now.rollback_end) == (
        "cancelled: plans changed", "cancelled")
    assert rollback_of(database_url, cancelled.id) == ("cancelled: plans changed", "cancelled")


def newer_release(url: str, table: str) -> None:
    """What a newer release's migration often does: a column added to ``table``."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"ALTER TABLE {table} ADD COLUMN from_a_newer_release integer")


async def test_statements_prepared_before_a_migration_are_prepared_anew_after_it(
    database_url: str,
) -> None:
    """The other side of a rollout: a newer release's migration (the chart's operator runs it
    at its start) adds a column under the statements a running worker or CLI prepared with
    ``SELECT *`` / ``RETURNING *``, and PostgreSQL refuses them ("cached plan must not change
    result type"). Every worker died at its next claim, and `wait` and `logs -f` with a traceback
    (found by a review). One connection, so every statement below meets its old plan."""
    store = await Store.open(database_url, min_size=1, max_size=1)
    try:
        run, _ = await store.create_run("outlive a migration", AGENT)
        ((_, lease),) = (await store.claim("default", "w1", 1)).claimed
        await store.get_run(run.id)
        newer_release(database_url, "agent_run")
        # Outside a transaction: sent again, prepared anew, as if nothing happened.
        assert (await store.get_run(run.id)).status == "running"
        await store.append_step(lease, 0, "model_turn", {"content": [], "stop_reason": "end_turn"})
        assert [s.seq for s in await store.steps(run.id)] == [0]
        other, _ = await store.create_run("claimed after it", AGENT)
        assert [r.id for r, _ in (await store.claim("default", "w1", 1)).claimed] == [other.id]
        # Inside a transaction: an outage to its caller, and the caller's retry goes through
        # (no store statement in a transaction returns a `*` today; the contract stands).
        assert issubclass(StalePlan, DB_ERRORS)
        every = "SELECT * FROM namespace_quota"
        async with store.pool.connection() as conn:
            await conn.execute(every)
        newer_release(database_url, "namespace_quota")
        async with store.pool.connection() as conn:
            with pytest.raises(StalePlan):
                async with conn.transaction():
                    await conn.execute(every)
        async with store.pool.connection() as conn, conn.transaction():
            await conn.execute(every)
    finally:
        await store.close()
