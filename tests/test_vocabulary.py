"""The run vocabulary (agentrun.vocabulary) is the one list of each value: the database's CHECKs,
the CRD's phase enum and the operator's terminal reasons say the same, and a rollback's end is
read back from its stored reason as it was asked for."""

from __future__ import annotations

import re
from typing import get_args

import psycopg
import pytest

from agentrun.operator.api import TERMINAL_REASONS
from agentrun.operator.crds import agentrun_crd
from agentrun.store import Store
from agentrun.vocabulary import (
    LIVE_STATUSES,
    RUN_STATUSES,
    STEP_KINDS,
    TERMINAL_STATUSES,
    RollbackEnd,
    rollback_end,
    rollback_reason,
)


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
            " WHERE contype = 'c' AND conrelid::regclass::text IN ('agent_run', 'agent_step')"
        )
        checks = await cur.fetchall()
    status = [d for table, d in checks if table == "agent_run" and "status" in d
              and "'pending'" in d]
    kind = [d for table, d in checks if table == "agent_step" and "kind" in d]
    assert len(status) == 1 and len(kind) == 1, checks
    assert _check_values(status[0]) == set(RUN_STATUSES)
    assert _check_values(kind[0]) == set(STEP_KINDS)


@pytest.mark.parametrize("end", get_args(RollbackEnd))
@pytest.mark.parametrize("why", [None, "", "card declined", "cancelled by a tool's own text",
                                 "rejected by alice: too risky", "failed: cancelled"])
def test_a_rollback_ends_as_it_was_asked_to(end: RollbackEnd, why: str | None) -> None:
    assert rollback_end(rollback_reason(end, why)) == end


def test_the_stored_rollback_reasons_read_as_before() -> None:
    # Rows written by earlier versions (and the texts users see) are unchanged.
    assert rollback_reason("cancelled") == "cancelled with rollback"
    assert rollback_reason("cancelled", "wrong table") == "cancelled: wrong table"
    assert rollback_reason("failed", "rejected by bob") == "rejected by bob"
    assert rollback_end("cancelled: wrong table") == "cancelled"
    assert rollback_end("tool charge failed: card declined") == "failed"
    # A failure whose text happens to start like a cancel's is marked as a failure.
    assert rollback_reason("failed", "cancelled order 7 failed") == (
        "failed: cancelled order 7 failed")
