"""The pin trigger (agent_run_pinned) calls its plpgsql function only when it has something to do
(migration 0018). The statements a worker sends most stamp updated_at themselves, so they run
no trigger function of it; pinned columns are refused whoever stamps updated_at, and a statement
that does not stamp it still gets it stamped. Since migration 0025 those statements do not even
compare the pinned columns (agent_run_pinned_columns watches them by name): they read nothing of a
run's stored spec and task, however big.

Each statement runs as the store sends it (queries.sql, with its own parameters) under EXPLAIN
ANALYZE inside a transaction rolled back after it, which lists every trigger that fired.
"""

from __future__ import annotations

import random
from datetime import datetime
from typing import Any
from uuid import uuid4

import psycopg
import pytest
from psycopg import sql
from psycopg.types.json import Jsonb

from agentrun.manifests import AgentSpec
from agentrun.sql import queries
from agentrun.store import Lease, Store

SPEC = AgentSpec(model="m", system="pinned", tools=["echo"])


def explain(conn: psycopg.Connection[Any], sql: str, params: Any) -> dict[str, Any]:
    """EXPLAIN ANALYZE of ``sql``, in a transaction rolled back after it."""
    with conn.transaction(force_rollback=True):
        row = conn.execute(  # type: ignore[call-overload]
            "EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params
        ).fetchone()
    top: dict[str, Any] = row[0][0]
    return top


def triggers(top: dict[str, Any]) -> dict[str, int]:
    """The triggers a statement fired, by name, with their calls."""
    return {t["Trigger Name"]: int(t["Calls"]) for t in top.get("Triggers", [])}


def runs_updated(plan: dict[str, Any]) -> int:
    """Rows the plan's UPDATEs of agent_run returned (each of these statements returns them)."""
    own = plan.get("Actual Rows", 0) if (
        plan.get("Node Type") == "ModifyTable" and plan.get("Operation") == "Update"
        and plan.get("Relation Name") == "agent_run") else 0
    return int(own) + sum(runs_updated(p) for p in plan.get("Plans", []))


def statements(lease: Lease, pending_pool: str) -> dict[str, dict[str, Any]]:
    """The hot statements and the parameters the store would send for ``lease``."""
    fence = {"run_id": lease.run_id, "worker": lease.worker, "epoch": lease.epoch, "ttl": 15.0}
    usage = {"input_tokens": 1, "output_tokens": 2, "cache_read_tokens": 0,
             "cache_write_tokens": 0, "cost_usd": 0.001}
    payload = Jsonb({"role": "assistant", "content": [{"type": "text", "text": "hi"}]})
    mark = Jsonb({"worker": lease.worker, "epoch": lease.epoch, "tool": "echo", "seq": 0,
                  "call_index": 0, "step": 1})
    return {
        "append_step": {**fence, **usage, "seq": 0, "kind": "model_turn", "payload": payload,
                        "request_id": "req_1", "tool_call": mark},
        "append_steps": {
            "worker": lease.worker, "run_ids": [lease.run_id], "epochs": [lease.epoch],
            "seqs": [0], "ttls": [15.0], "kinds": ["model_turn"], "payloads": [payload],
            "request_ids": ["req_1"], "tool_calls": [None],
            **{k: [v] for k, v in usage.items()},
        },
        "renew_lease": fence,
        "renew_leases": {"worker": lease.worker, "run_ids": [lease.run_id],
                         "epochs": [lease.epoch], "ttl": 15.0},
        "begin_tool_call": {**fence, "tool_call": mark},
        "claim_runs": {"pool": pending_pool, "worker": "w2", "limit": 1, "ttl": 15.0},
    }


@pytest.fixture
async def held(store: Store) -> Lease:
    """A run held by worker w1, and a pending run in pool "next" for the claim."""
    await store.create_run("held", SPEC)
    await store.create_run("next", SPEC, pool="next")
    ((_, lease),) = (await store.claim("default", "w1")).claimed
    return lease


async def test_a_workers_hot_statements_call_no_pin_function_and_stamp_updated_at(
    held: Lease, database_url: str
) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        for name, params in statements(held, "next").items():
            top = explain(conn, queries[name], params)
            # The statement did its work, a fenced update of one run, without a call of the pin
            # function (before migration 0018: one call for every row updated).
            assert runs_updated(top["Plan"]) == 1, name
            fired = triggers(top)
            assert not {"agent_run_pinned", "agent_run_pinned_columns"} & set(fired), (name, fired)
        before = _updated_at(conn, held.run_id)
        conn.execute(queries["renew_lease"], statements(held, "next")["renew_lease"])
        assert _updated_at(conn, held.run_id) > before


async def test_pinned_columns_are_refused_even_when_the_statement_stamps_updated_at(
    held: Lease, database_url: str
) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        stamped = sql.SQL("UPDATE agent_run SET updated_at = now(), {} = %s WHERE id = %s")
        for column, value in (("model", "other"), ("task", "other"), ("agent_spec", Jsonb({})),
                              ("k8s_uid", uuid4()), ("external_key", "other")):
            with pytest.raises(psycopg.errors.RestrictViolation, match="pinned"):
                conn.execute(stamped.format(sql.Identifier(column)), (value, held.run_id))
        # Any other statement, which leaves updated_at alone, still gets it stamped.
        before = _updated_at(conn, held.run_id)
        conn.execute("UPDATE agent_run SET error = 'noted' WHERE id = %s", (held.run_id,))
        assert _updated_at(conn, held.run_id) > before
        top = explain(conn, "UPDATE agent_run SET error = 'again' WHERE id = %s", (held.run_id,))
        assert triggers(top).get("agent_run_pinned") == 1


async def test_a_workers_hot_statements_read_nothing_of_a_big_spec_stored_out_of_line(
    store: Store, database_url: str
) -> None:
    # A spec of production size (a long system prompt, words that do not compress away) and a
    # long task: both stored out of line, in agent_run's TOAST table.
    words = random.Random(7)
    system = " ".join(f"w{words.randrange(10**6)}" for _ in range(2000))
    task = " ".join(f"t{words.randrange(10**6)}" for _ in range(500))
    await store.create_run(task, SPEC.model_copy(update={"system": system}))
    await store.create_run("next", SPEC, pool="next")
    ((_, lease),) = (await store.claim("default", "w1")).claimed
    with psycopg.connect(database_url) as conn:
        toast = conn.execute("SELECT reltoastrelid FROM pg_class WHERE relname = 'agent_run'"
                             ).fetchone()

        def toast_blocks_read(statement: str, params: Any) -> int:
            """Blocks of the TOAST table the statement fetched, in a transaction undone after."""
            count = "SELECT pg_stat_get_xact_blocks_fetched(%s)"
            with conn.transaction(force_rollback=True):
                before = conn.execute(count, toast).fetchone()
                conn.execute(statement, params)
                after = conn.execute(count, toast).fetchone()
            assert before is not None and after is not None
            return int(after[0]) - int(before[0])

        # The measure sees a read of the spec (and so the spec is stored out of line).
        assert toast_blocks_read("SELECT agent_spec::text, task FROM agent_run WHERE id = %s",
                                 (lease.run_id,)) > 0
        for name, params in statements(lease, "next").items():
            if name == "claim_runs":
                continue  # returns the claimed run's whole row: the worker reads its spec
            # Before migration 0025: 2-4 blocks each, the old and new spec and task compared.
            assert toast_blocks_read(queries[name], params) == 0, name


def _updated_at(conn: psycopg.Connection[Any], run_id: Any) -> datetime:
    row = conn.execute("SELECT updated_at FROM agent_run WHERE id = %s", (run_id,)).fetchone()
    assert row is not None
    value: datetime = row[0]
    return value
