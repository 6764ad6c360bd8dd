"""The run vocabulary (agentrun.vocabulary) is the one list of each value: the database's CHECKs,
the CRD's phase enum and the operator's terminal reasons say the same, and a rollback's end is
stored as it was asked for, beside its reason (migration 0016), never read back from the words."""

from __future__ import annotations

import re
from typing import get_args

import psycopg
import pytest

from agentrun.migrations import migrate
from agentrun.operator.api import TERMINAL_REASONS
from agentrun.operator.crds import agentrun_crd
from agentrun.sql import migrations, queries
from agentrun.store import Store
from agentrun.vocabulary import (
    LIVE_STATUSES,
    RUN_STATUSES,
    STEP_KINDS,
    TERMINAL_STATUSES,
    HandoverKind,
    RollbackEnd,
    rollback_reason,
)
from tests.workerkit import AGENT


def test_the_crd_phase_enum_is_the_run_statuses() -> None:
    crd = agentrun_crd()
    status = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    assert status["properties"]["phase"]["enum"] == list(RUN_STATUSES)


def test_every_terminal_status_has_its_reason_and_only_those() -> None:
    assert set(TERMINAL_REASONS) == TERMINAL_STATUSES
    assert TERMINAL_STATUSES | LIVE_STATUSES == set(RUN_STATUSES)
    assert not TERMINAL_STATUSES & LIVE_STATUSES


def _check_values(definition: str) -> set[str]:
    return set(re.findall(r"'([a-z_ ]+)'", definition))


async def test_the_database_checks_allow_exactly_the_vocabulary(store: Store) -> None:
    async with await psycopg.AsyncConnection.connect(store.url) as conn:
        cur = await conn.execute(
            "SELECT conrelid::regclass::text, pg_get_constraintdef(oid) FROM pg_constraint"
            " WHERE contype = 'c'"
            " AND conrelid::regclass::text IN ('agent_run', 'agent_step', 'run_handover')"
        )
        checks = await cur.fetchall()
    status = [d for table, d in checks if table == "agent_run" and "status" in d
              and "'pending'" in d]
    kind = [d for table, d in checks if table == "agent_step" and "kind" in d]
    assert len(status) == 1 and len(kind) == 1, checks
    assert _check_values(status[0]) == set(RUN_STATUSES)
    assert _check_values(kind[0]) == set(STEP_KINDS)
    handover = [d for table, d in checks if table == "run_handover" and "kind" in d]
    assert len(handover) == 1, checks
    assert _check_values(handover[0]) == set(get_args(HandoverKind))
    rollback = [d for table, d in checks if table == "agent_run" and "'cancelled'" in d
                and "rollback_end" in d]
    assert len(rollback) == 1, checks
    assert _check_values(rollback[0]) == set(get_args(RollbackEnd))


@pytest.mark.parametrize("end", get_args(RollbackEnd))
@pytest.mark.parametrize("why", [None, "", "card declined", "cancelled by a tool's own text",
                                 "rejected by alice: too risky", "failed: cancelled"])
async def test_a_rollback_ends_as_it_was_asked_to(
    store: Store, end: RollbackEnd, why: str | None
) -> None:
    """Stored as asked, whatever the words say; the worker's own begin_rollback (a tier-3
    failure, which would end failed) keeps the request's end and reason: the first stays."""
    run, _ = await store.create_run("roll back", AGENT)
    asked, recorded = await store.request_rollback(run.id, end, why)
    assert recorded and asked.rollback_end == end
    assert asked.rollback_reason == rollback_reason(end, why)
    ((_, lease),) = (await store.claim("default", "w")).claimed
    assert await store.begin_rollback(lease, "tool charge failed: card declined") == (
        rollback_reason(end, why), end)
    assert (await store.get_run(run.id)).rollback_end == end


async def test_a_failure_begins_a_rollback_that_ends_failed(store: Store) -> None:
    await store.create_run("fail", AGENT)
    ((_, lease),) = (await store.claim("default", "w")).claimed
    # Words that start like a cancel's do not make it one.
    assert await store.begin_rollback(lease, "cancelled order 7 failed") == (
        "cancelled order 7 failed", "failed")


async def test_the_migration_reads_earlier_rows_as_earlier_versions_did(
    empty_database_url: str,
) -> None:
    async with await psycopg.AsyncConnection.connect(empty_database_url, autocommit=True) as conn:
        await conn.execute(queries["create_migration_table"])
        for mig in migrations():
            if mig.version < 16:
                await conn.execute(mig.sql)
                await conn.execute(queries["record_migration"],
                                   {"version": mig.version, "name": mig.name})
        ids = {}
        for reason in ("cancelled: wrong table", "cancelled with rollback",
                       "tool charge failed: card declined", None):
            cur = await conn.execute(
                "INSERT INTO agent_run (task, model, agent_spec, status, rollback_reason) "
                "VALUES ('t', 'm', '{}', 'pending', %s) RETURNING id", (reason,))
            row = await cur.fetchone()
            assert row is not None
            ids[reason] = row[0]
        assert (await migrate(conn)).applied[0] == 16
        cur = await conn.execute("SELECT id, rollback_end FROM agent_run")
        got = {rid: end for rid, end in await cur.fetchall()}
    assert got == {ids["cancelled: wrong table"]: "cancelled",
                   ids["cancelled with rollback"]: "cancelled",
                   ids["tool charge failed: card declined"]: "failed", ids[None]: None}


def test_the_stored_rollback_reasons_read_as_before() -> None:
    # Rows written by earlier versions (and the texts users see) are unchanged.
    assert rollback_reason("cancelled") == "cancelled with rollback"
    assert rollback_reason("cancelled", "wrong table") == "cancelled: wrong table"
    assert rollback_reason("failed", "rejected by bob") == "rejected by bob"
    # A failure whose text happens to start like a cancel's is marked as a failure.
    assert rollback_reason("failed", "cancelled order 7 failed") == (
        "failed: cancelled order 7 failed")
