"""One tool per class, each writing what it does to ledger tables in the test's database.

``ledger_attempts`` gets a row for every invocation (committed at once, so a crash after it does not
erase it); ``ledger_effects`` holds the effects themselves. The non-idempotent tool hands
``ctx.idempotency_key`` to its "remote system" (a unique key), as the seed tells tool owners to;
the irreversible one has no such protection at all.

The ledger is the tools' "remote system": it lives in ``LEDGER_DATABASE_URL`` when that is set
(the soak keeps it on a server of its own, which it never restarts: the outages it makes are the
store's, not the mail service's), else in the store's own database.
"""

from __future__ import annotations

import os
import time

import psycopg

from agentrun import ToolContext, tool

SCHEMA = """
CREATE TABLE IF NOT EXISTS ledger_attempts (
    id serial PRIMARY KEY, tool text NOT NULL, run_id text NOT NULL, seq int NOT NULL,
    key text NOT NULL, pid int NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE IF NOT EXISTS ledger_effects (
    id serial PRIMARY KEY, tool text NOT NULL, run_id text NOT NULL, key text UNIQUE,
    at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE IF NOT EXISTS ledger_fenced (
    id serial PRIMARY KEY, run_id text NOT NULL, pid int NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE IF NOT EXISTS ledger_state (
    run_id text NOT NULL, tool text NOT NULL, value text NOT NULL, PRIMARY KEY (run_id, tool));
"""


def _attempt(conn: psycopg.Connection[tuple[object, ...]], ctx: ToolContext) -> None:
    conn.execute(
        "INSERT INTO ledger_attempts (tool, run_id, seq, key, pid) VALUES (%s, %s, %s, %s, %s)",
        (ctx.tool_name, ctx.run_id, ctx.seq, ctx.idempotency_key, os.getpid()),
    )


def _effect(conn: psycopg.Connection[tuple[object, ...]], ctx: ToolContext, what: str) -> None:
    """The effect, once per idempotency key: what a non-idempotent tool's target must do."""
    conn.execute(
        "INSERT INTO ledger_effects (tool, run_id, key) VALUES (%s, %s, %s) "
        "ON CONFLICT (key) DO NOTHING",
        (what, ctx.run_id, ctx.idempotency_key),
    )


def _connect() -> psycopg.Connection[tuple[object, ...]]:
    url = os.environ.get("LEDGER_DATABASE_URL") or os.environ["AGENTRUN_DATABASE_URL"]
    return psycopg.connect(url, autocommit=True)


@tool(kind="pure")
def look(ctx: ToolContext, what: str) -> str:
    """Look at something (no side effect)."""
    with _connect() as conn:
        _attempt(conn, ctx)
    return f"looked at {what}"


@tool(kind="idempotent")
def set_flag(ctx: ToolContext, value: str) -> str:
    """Set a flag to a value (the same end state however often)."""
    with _connect() as conn:
        _attempt(conn, ctx)
        conn.execute(
            "INSERT INTO ledger_state (run_id, tool, value) VALUES (%s, 'set_flag', %s) "
            "ON CONFLICT (run_id, tool) DO UPDATE SET value = EXCLUDED.value",
            (ctx.run_id, value),
        )
    return f"flag is {value}"


@tool(kind="non_idempotent")
def send_email(ctx: ToolContext, to: str) -> str:
    """Send an email (the mail service dedupes on the idempotency key)."""
    with _connect() as conn:
        _attempt(conn, ctx)
        conn.execute(
            "INSERT INTO ledger_effects (tool, run_id, key) VALUES ('send_email', %s, %s) "
            "ON CONFLICT (key) DO NOTHING",
            (ctx.run_id, ctx.idempotency_key),
        )
    return f"sent to {to}"


@tool(kind="irreversible")
def drop_table(ctx: ToolContext, table: str) -> str:
    """Drop a table (irreversible, and nothing downstream dedupes it)."""
    with _connect() as conn:
        _attempt(conn, ctx)
        conn.execute(
            "INSERT INTO ledger_effects (tool, run_id, key) VALUES ('drop_table', %s, NULL)",
            (ctx.run_id,),
        )
    return f"dropped {table}"


@tool(kind="non_idempotent", compensate="release")
def reserve(ctx: ToolContext, item: str) -> str:
    """Reserve an item (undone by release)."""
    with _connect() as conn:
        _attempt(conn, ctx)
        _effect(conn, ctx, f"reserve:{item}")
    return f"reserved {item}"


@tool(kind="idempotent")
def release(ctx: ToolContext, item: str) -> str:
    """Release a reserved item (the compensation of reserve)."""
    with _connect() as conn:
        _attempt(conn, ctx)
        _effect(conn, ctx, f"release:{item}")
    return f"released {item}"


@tool(kind="non_idempotent", on_error="abort")
def charge(ctx: ToolContext, amount: int) -> str:
    """Charge the card; a decline aborts the whole run (tier 3)."""
    with _connect() as conn:
        _attempt(conn, ctx)
    raise RuntimeError(f"card declined for {amount}")


@tool(kind="pure")
def hog(ctx: ToolContext, megabytes: int, every_attempt: bool = False) -> str:
    """Hold memory, to be OOM-killed (the e2e tier): on the call's first attempt only, or on
    every attempt. The attempt is recorded (committed) before the allocation."""
    with _connect() as conn:
        row = conn.execute(
            "SELECT count(*) FROM ledger_attempts WHERE key = %s", (ctx.idempotency_key,)
        ).fetchone()
        _attempt(conn, ctx)
    if every_attempt or not (row and row[0]):
        block = bytearray(megabytes * 1024 * 1024)
        for i in range(0, len(block), 4096):  # touch every page: resident, not just reserved
            block[i] = 1
        return f"held {len(block) // (1024 * 1024)} MB"
    return "held nothing: this call was OOM-killed once already"


#: The advisory lock ``unbook`` waits on: a test holds it to keep a compensation in flight.
GATE_LOCK = 7146120500


@tool(kind="non_idempotent", compensate="unbook")
def book(ctx: ToolContext, item: str) -> str:
    """Book an item (undone by unbook, which waits on the test's gate)."""
    with _connect() as conn:
        _attempt(conn, ctx)
        _effect(conn, ctx, f"book:{item}")
    return f"booked {item}"


@tool(kind="idempotent")
def unbook(ctx: ToolContext, item: str) -> str:
    """Undo a booking, once the test lets it: the attempt is committed first (the test sees the
    compensation in flight), then it waits for the advisory lock GATE_LOCK the test holds."""
    with _connect() as conn:
        _attempt(conn, ctx)
        conn.execute("SELECT pg_advisory_lock(%s)", (GATE_LOCK,))
        conn.execute("SELECT pg_advisory_unlock(%s)", (GATE_LOCK,))
        _effect(conn, ctx, f"unbook:{item}")
    return f"unbooked {item}"


@tool(kind="irreversible")
def wire_transfer(ctx: ToolContext, amount: int) -> str:
    """Wire money (irreversible). On its first attempt it waits for the bank (up to 120 s),
    checking ctx.lease_valid() as a cooperative long call should, and stops at the fence
    (recording that it saw it) instead of sending."""
    with _connect() as conn:
        row = conn.execute(
            "SELECT count(*) FROM ledger_attempts WHERE key = %s", (ctx.idempotency_key,)
        ).fetchone()
        first = row is not None and row[0] == 0
        _attempt(conn, ctx)
        if first:
            deadline = time.monotonic() + 120
            while ctx.lease_valid() and time.monotonic() < deadline:
                time.sleep(0.05)
            if not ctx.lease_valid():
                conn.execute(
                    "INSERT INTO ledger_fenced (run_id, pid) VALUES (%s, %s)",
                    (ctx.run_id, os.getpid()),
                )
                ctx.check_lease()  # raises: this worker must not send the money
        conn.execute(
            "INSERT INTO ledger_effects (tool, run_id, key) VALUES ('wire_transfer', %s, NULL)",
            (ctx.run_id,),
        )
    return f"sent {amount}"
