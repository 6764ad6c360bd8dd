"""src/agentrun/sql/schema.sql is the schema the migrations produce (procrastinate's habit: one
readable file of the whole current schema, checked against the migrations, never hand-edited)."""

from __future__ import annotations

import psycopg
import pytest
from benchmarks.dump_schema import REGENERATE, SCHEMA_SQL, _major, dump, dumped_by, pg_dump_for

from agentrun.migrations import migrate

STALE = (
    "src/agentrun/sql/schema.sql is not what the migrations produce; regenerate it:\n"
    f"    {REGENERATE}"
)


async def _migrated(url: str) -> str:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await migrate(conn)
    return url


async def test_schema_sql_is_the_dump_of_a_freshly_migrated_database(
    empty_database_url: str,
) -> None:
    url = await _migrated(empty_database_url)
    checked_in = SCHEMA_SQL.read_text()
    here = _major(pg_dump_for(url))
    if dumped_by(checked_in) != here:
        # pg_dump's text differs a little between major versions; the next test still compares
        # the two schemas on this server.
        pytest.skip(f"schema.sql was dumped by pg_dump {dumped_by(checked_in)}; this is {here}")
    assert dump(url) == checked_in, STALE


async def test_schema_sql_builds_the_schema_the_migrations_build(
    database_url: str, empty_database_url: str
) -> None:
    """Version-independent: schema.sql applied to an empty database dumps as the migrated one."""
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        conn.execute(SCHEMA_SQL.read_text())  # no parameters: one simple-protocol batch
    assert dump(empty_database_url) == dump(database_url), STALE
