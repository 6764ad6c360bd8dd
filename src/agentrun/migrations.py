"""Versioned schema migrations, safe to run from many processes at once.

All pending migrations are applied in ONE transaction that first takes a transaction-scoped
advisory lock: a second ``agentrun migrate`` waits on the lock, then finds nothing left to do.
PostgreSQL's DDL is transactional, so a failed migration leaves the schema as it was.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import psycopg
from psycopg.rows import dict_row

from agentrun.errors import AgentrunError
from agentrun.sql import migrations, queries

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MigrateResult:
    applied: list[int]
    version: int


def latest_version() -> int:
    return max(m.version for m in migrations())


async def migrate(conn: psycopg.AsyncConnection[object]) -> MigrateResult:
    """Bring the schema to the latest version. ``conn`` must not be inside a transaction."""
    applied: list[int] = []
    async with conn.transaction():
        await conn.execute(queries["migration_lock"])
        await conn.execute(queries["create_migration_table"])
        cur = await conn.execute(queries["applied_migrations"])
        done = {int(row[0]) for row in await cur.fetchall()}  # type: ignore[index]
        newest = latest_version()
        if done and max(done) > newest:
            raise AgentrunError(
                f"the database schema is at version {max(done)}, newer than this agentrun "
                f"knows ({newest}); upgrade agentrun"
            )
        for mig in migrations():
            if mig.version in done:
                continue
            log.info("applying migration %04d_%s", mig.version, mig.name)
            await conn.execute(mig.sql)
            await conn.execute(
                queries["record_migration"], {"version": mig.version, "name": mig.name}
            )
            applied.append(mig.version)
    return MigrateResult(applied=applied, version=latest_version())


async def schema_version(conn: psycopg.AsyncConnection[object]) -> int:
    """The schema version recorded in the database (0 when it was never migrated)."""
    try:
        cur = await conn.cursor(row_factory=dict_row).execute(queries["schema_version"])
        row = await cur.fetchone()
    except psycopg.errors.UndefinedTable:
        return 0
    return int(row["version"]) if row else 0
