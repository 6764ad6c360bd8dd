"""The one rule every entry point (the CLI's commands, the worker, the Python client) applies to
the schema before it uses a database: migrate the embedded database, which nobody else will, and
insist that any other is current (the operator, a Helm hook or `agentrun migrate` migrates it)."""

from __future__ import annotations

from agentrun.config import DATABASE_URL_ENV
from agentrun.errors import ConfigError
from agentrun.migrations import latest_version, migrate, schema_version
from agentrun.store import Store, connect


async def ensure_schema(url: str, *, auto: bool) -> None:
    """Migrate when ``auto`` (the embedded database: no set-up), else insist it is current."""
    async with await connect(url, statement_timeout=0 if auto else None) as conn:
        if auto:
            await migrate(conn)
            return
        _require_current(await schema_version(conn))


def _require_current(have: int) -> None:
    need = latest_version()
    if have < need:
        raise ConfigError(
            f"the database schema is at version {have}, this agentrun needs {need}: "
            "run agentrun migrate"
        )


async def open_store(
    url: str, *, embedded: bool, max_size: int, source: str = DATABASE_URL_ENV
) -> Store:
    """An open store on a current schema: the one route of the CLI's commands and the Python
    client. The database is checked once: Store.open's connection check (a one-line error), then
    the schema version read on the pool's own connection. Only the embedded database is migrated
    here, on a connection of its own first (a migration runs without a statement timeout).
    ``source``: where the URL came from, named by an error that blames the URL."""
    if embedded:
        await ensure_schema(url, auto=True)
    store = await Store.open(url, max_size=max_size, source=source)
    if not embedded:
        try:
            async with store.pool.connection() as conn:
                _require_current(await schema_version(conn))
        except BaseException:
            await store.close()
            raise
    return store
