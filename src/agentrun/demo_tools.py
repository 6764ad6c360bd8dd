"""The tools of ``agentrun demo``: a migration agent working on a "production" table.

Production is the schema ``demo_production`` in the database named by AGENTRUN_DEMO_PRODUCTION_URL
(the demo sets it). ``write_production`` is non-idempotent (ALTER TABLE twice fails, an UPDATE
twice is two writes), so it does what the seed tells a tool owner to do: the effect and a ledger row
keyed by ``ctx.idempotency_key`` commit in one transaction, and a second call with the same key
returns the recorded result instead of writing again. The ledger is what the demo prints.
"""

from __future__ import annotations

import os

import psycopg
from psycopg import sql

from agentrun.tools import ToolContext, ToolError, tool

SCHEMA = "demo_production"


def _connect() -> psycopg.Connection[tuple[object, ...]]:
    url = os.environ.get("AGENTRUN_DEMO_PRODUCTION_URL") or os.environ["AGENTRUN_DATABASE_URL"]
    conn = psycopg.connect(url)
    conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(SCHEMA)))
    return conn


def setup_production(url: str, rows: int = 1000) -> None:
    """(Re)create the demo's production schema: an orders table and an empty ledger."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(SCHEMA)))
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(SCHEMA)))
        conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(SCHEMA)))
        conn.execute("CREATE TABLE orders (id serial PRIMARY KEY, amount numeric NOT NULL)")
        conn.execute(
            "INSERT INTO orders (amount) SELECT (g %% 97) + 0.5 FROM generate_series(1, %s) g",
            (rows,),
        )
        conn.execute(
            """CREATE TABLE write_ledger (
                   idempotency_key text PRIMARY KEY,
                   run_id text NOT NULL,
                   seq integer NOT NULL,
                   statement text NOT NULL,
                   rows_affected integer NOT NULL,
                   pid integer NOT NULL,
                   written_at timestamptz NOT NULL DEFAULT clock_timestamp())"""
        )


def _check_table(table: str) -> None:
    if table != "orders":
        raise ToolError(f"unknown table {table!r}; this database has: orders")


@tool(kind="pure")
def read_schema(ctx: ToolContext, table: str) -> list[dict[str, str]]:
    """Read a table's columns and their types."""
    _check_table(table)
    with _connect() as conn:
        rows = conn.execute(
            "SELECT column_name, data_type FROM information_schema.columns "
            "WHERE table_schema = %s AND table_name = %s ORDER BY ordinal_position",
            (SCHEMA, table),
        ).fetchall()
    return [{"column": str(c), "type": str(t)} for c, t in rows]


@tool(kind="pure")
def count_rows(ctx: ToolContext, table: str) -> int:
    """Count a table's rows."""
    _check_table(table)
    with _connect() as conn:
        row = conn.execute("SELECT count(*) FROM orders").fetchone()
    return int(row[0]) if row else 0  # type: ignore[call-overload]


@tool(kind="pure")
def check_migration(ctx: ToolContext, table: str, column: str) -> dict[str, object]:
    """Check whether a column exists and how many rows still have it NULL."""
    _check_table(table)
    with _connect() as conn:
        exists = conn.execute(
            "SELECT 1 FROM information_schema.columns "
            "WHERE table_schema = %s AND table_name = %s AND column_name = %s",
            (SCHEMA, table, column),
        ).fetchone()
        if not exists:
            return {"column_exists": False}
        nulls = conn.execute(
            sql.SQL("SELECT count(*) FROM orders WHERE {} IS NULL").format(sql.Identifier(column))
        ).fetchone()
    return {"column_exists": True, "null_rows": int(nulls[0]) if nulls else 0}  # type: ignore[call-overload]


@tool(kind="non_idempotent")
def write_production(ctx: ToolContext, statement: str) -> str:
    """Run one SQL statement against the production orders table."""
    with _connect() as conn, conn.transaction():
        done = conn.execute(
            "SELECT rows_affected FROM write_ledger WHERE idempotency_key = %s FOR UPDATE",
            (ctx.idempotency_key,),
        ).fetchone()
        if done is not None:
            return f"already applied: {done[0]} rows (idempotency key {ctx.idempotency_key[:12]})"
        try:
            cur = conn.execute(statement.encode())  # the agent's SQL, in the demo's own schema
        except psycopg.Error as exc:
            raise ToolError(f"statement failed: {' '.join(str(exc).split())}") from None
        affected = max(cur.rowcount, 0)
        conn.execute(
            "INSERT INTO write_ledger (idempotency_key, run_id, seq, statement, rows_affected, pid)"
            " VALUES (%s, %s, %s, %s, %s, %s)",
            (ctx.idempotency_key, ctx.run_id, ctx.seq, statement, affected, os.getpid()),
        )
    return f"ok: {affected} rows"
