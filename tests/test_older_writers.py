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

from agentrun.store import Store
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
