"""The tools of ``agentrun demo``: a migration agent working on a "production" table.

Production is the schema ``demo_production`` (AGENTRUN_DEMO_SCHEMA names another: each ``agentrun
demo`` uses its own, so two demos, or a demo and a worker started by hand, never share one) in the
database named by AGENTRUN_DEMO_PRODUCTION_URL (the demo sets it), else in the run store's own
database. The first call creates it if missing (1000 orders and an empty ledger).
``write_production`` is non-idempotent (ALTER TABLE twice fails, an UPDATE twice is two writes),
so it does what the seed tells a tool owner to do: the effect and a ledger row keyed by
``ctx.idempotency_key`` commit in one transaction, and a second call with the same key returns
the recorded result instead of writing again. The ledger is what the demo prints.
"""

from __future__ import annotations

import functools
import os

import psycopg
from psycopg import sql

from agentrun.tools import ToolContext, ToolError, tool

#: The production schema of a worker started by hand (the README's "Try it by hand").
SCHEMA = "demo_production"
SCHEMA_ENV = "AGENTRUN_DEMO_SCHEMA"
SEED_ROWS = 1000
#: Serialises creating the schema (an arbitrary key; the store's migrations use another).
PRODUCTION_LOCK = 0x64656D6F  # "demo"


def schema() -> str:
    """The production schema: $AGENTRUN_DEMO_SCHEMA (``agentrun demo`` sets its own), else
    ``demo_production``."""
    return os.environ.get(SCHEMA_ENV) or SCHEMA


def _production_url() -> str:
    """AGENTRUN_DEMO_PRODUCTION_URL (``agentrun demo`` sets it), else the run store's database:
    AGENTRUN_DATABASE_URL, or the embedded server when it is unset (the README's worker)."""
    override = os.environ.get("AGENTRUN_DEMO_PRODUCTION_URL")
    if override:
        return override
    return _store_url()


@functools.cache
def _store_url() -> str:
    # Cached: with AGENTRUN_DATABASE_URL unset this finds the embedded server, too slow per call.
    from agentrun.embedded import database_url

    return database_url(quiet=True).url


def _connect() -> psycopg.Connection[tuple[object, ...]]:
    conn = psycopg.connect(_production_url())
    _ensure_production(conn)
    conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema())))
    return conn


def _ensure_production(conn: psycopg.Connection[tuple[object, ...]]) -> None:
    """Create the schema on first use, so a worker started by hand with ``--tools
    agentrun.demo_tools`` works without ``agentrun demo`` having run first (every call used to
    fail on the missing schema while the run still ended "succeeded").

    The check without the lock is the common case (one query); creating takes the lock, so
    workers that start at once neither race on CREATE nor seed the orders twice."""
    with conn.transaction():
        if {"orders", "write_ledger"} <= _tables(conn):
            return
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (PRODUCTION_LOCK,))
        # Asked again under the lock: another worker may have just created it.
        _create_production(conn, schema(), seed="orders" not in _tables(conn))


def _tables(conn: psycopg.Connection[tuple[object, ...]]) -> set[str]:
    # A query of pg_tables, not to_regclass(): that goes through the catalog cache, which still
    # said "no such schema" after the lock was granted, so every waiting worker seeded again.
    rows = conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = %s", (schema(),))
    return {str(r[0]) for r in rows}


def setup_production(url: str, name: str = SCHEMA, rows: int = SEED_ROWS) -> None:
    """(Re)create the production schema ``name``: an orders table and an empty ledger."""
    with psycopg.connect(url) as conn, conn.transaction():
        # Same lock as _ensure_production: a worker creating it at this moment waits for us.
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (PRODUCTION_LOCK,))
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))
        _create_production(conn, name, seed=True, rows=rows)


def drop_production(url: str, name: str) -> None:
    """Drop the production schema ``name`` (``agentrun demo``'s own, once it has reported)."""
    with psycopg.connect(url) as conn, conn.transaction():
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


def _create_production(
    conn: psycopg.Connection[tuple[object, ...]], name: str, *, seed: bool,
    rows: int = SEED_ROWS,
) -> None:
    """Whatever of the schema ``name`` is missing (IF NOT EXISTS), in the caller's transaction,
    which holds PRODUCTION_LOCK; ``seed``: orders is new, fill it."""
    schema = sql.Identifier(name)
    conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(schema))
    conn.execute(
        sql.SQL(
            "CREATE TABLE IF NOT EXISTS {}.orders (id serial PRIMARY KEY, amount numeric NOT NULL)"
        ).format(schema)
    )
    if seed:
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.orders (amount) "
                "SELECT (g %% 97) + 0.5 FROM generate_series(1, %s) g"
            ).format(schema),
            (rows,),
        )
    conn.execute(
        sql.SQL(
            """CREATE TABLE IF NOT EXISTS {}.write_ledger (
                   idempotency_key text PRIMARY KEY,
                   run_id text NOT NULL,
                   seq integer NOT NULL,
                   statement text NOT NULL,
                   rows_affected integer NOT NULL,
                   pid integer NOT NULL,
                   written_at timestamptz NOT NULL DEFAULT clock_timestamp())"""
        ).format(schema)
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
            (schema(), table),
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
            (schema(), table, column),
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
