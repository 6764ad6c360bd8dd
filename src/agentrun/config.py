"""Where the database is, and the knobs every process shares.

Everything comes from the environment (``AGENTRUN_*``) so the same image runs as a worker, an
operator or a CLI; command-line flags override where a command has them. Secrets (the database
password, the provider's API key) come only from the environment, filled from Kubernetes Secrets,
and are never printed: :func:`redact_url` masks the password in every message.
"""

from __future__ import annotations

import os
import re

import psycopg
from psycopg.conninfo import conninfo_to_dict

from agentrun.errors import ConfigError

DATABASE_URL_ENV = "AGENTRUN_DATABASE_URL"

#: The worker's loopback-only control port (/drain; AGENTRUN_CONTROL_PORT, --control-port): the
#: worker listens on it and ``agentrun drain-local`` (the pod's preStop hook) calls it.
CONTROL_PORT_ENV = "AGENTRUN_CONTROL_PORT"
DEFAULT_CONTROL_PORT = 8081
#: The worker's drain grace (AGENTRUN_DRAIN_GRACE, --drain-grace), seconds.
DRAIN_GRACE_ENV = "AGENTRUN_DRAIN_GRACE"
DEFAULT_DRAIN_GRACE = 25.0


def redact_url(url: str) -> str:
    """The URL with any password replaced by ``***``, for messages and logs."""
    url = re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)
    return re.sub(r"(password=)\S+", r"\1***", url)


def validate_database_url(url: str) -> str:
    """Check the URL parses as a libpq connection string; raise ConfigError naming the problem."""
    if not url.strip():
        raise ConfigError(f"{DATABASE_URL_ENV} is empty; unset it to use the embedded PostgreSQL")
    if "://" in url and not url.startswith(("postgresql://", "postgres://")):
        scheme = url.split("://", 1)[0]
        raise ConfigError(
            f"{DATABASE_URL_ENV} has scheme {scheme!r}; expected postgresql://USER@HOST:PORT/DB"
        )
    try:
        params = conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(
            f"{DATABASE_URL_ENV} is malformed ({redact_url(reason)}); "
            "expected postgresql://USER@HOST:PORT/DB"
        ) from None
    port = str(params.get("port") or "")
    if port and not all(p.isdigit() for p in port.split(",")):
        raise ConfigError(
            f"{DATABASE_URL_ENV} has port {port!r}, not a number; "
            "expected postgresql://USER@HOST:PORT/DB"
        )
    return url


def env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None
