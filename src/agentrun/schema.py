"""The one rule every entry point (the CLI's commands, the worker, the Python client) applies to
the schema before it uses a database: migrate the embedded database, which nobody else will, and
insist that any other is current (the operator, a Helm hook or `agentrun migrate` migrates it)."""

from __future__ import annotations

from agentrun.errors import ConfigError
from agentrun.migrations import latest_version, migrate, schema_version
from agentrun.store import connect


async def ensure_schema(url: str, *, auto: bool) -> None:
    """Migrate when ``auto`` (the embedded database: no set-up), else insist it is current."""
    async with await connect(url, statement_timeout=0 if auto else None) as conn:
        if auto:
            await migrate(conn)
            return
        have, need = await schema_version(conn), latest_version()
    if have < need:
        raise ConfigError(
            f"the database schema is at version {have}, this agentrun needs {need}: "
            "run agentrun migrate"
        )
