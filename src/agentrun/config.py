"""Where the database is, and the knobs every process shares.

Everything comes from the environment (``AGENTRUN_*``) so the same image runs as a worker, an
operator or a CLI; command-line flags override where a command has them. Secrets (the database
password, the provider's API key) come only from the environment, filled from Kubernetes Secrets,
and are never printed: :func:`redact_url` masks the password of a connection string, and
:func:`redact_message` whatever libpq or the server quote of it, in every message.
"""

from __future__ import annotations

import os
import re
import urllib.parse

import psycopg
from psycopg.conninfo import conninfo_to_dict

from agentrun.errors import ConfigError
from agentrun.logs import MASK

DATABASE_URL_ENV = "AGENTRUN_DATABASE_URL"
# Seconds one model call may take in all, request to assembled message (the SDK's own timeout is
# per read: a stream of pings alone would never end). Past it the call is a transient failure.
DEFAULT_MODEL_DEADLINE = 600.0


_URI_PREFIXES = ("postgresql://", "postgres://")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
#: Anything that looks like a password wherever it stands (a URI's user info, a password= pair,
#: quoted or not): also one hidden in another value, as libpq expands a dbname=postgresql://...
_URI_PASSWORD = re.compile(r"://[^:/@\s]*:([^@]*)@")
_KEYWORD_PASSWORD = re.compile(r"password\s*=\s*('(?:[^'\\]|\\.)*'?|(?:[^\s\\]|\\.)*)")
_QUOTED = re.compile(r'"([^"]*)"')
#: What libpq's own message templates quote (missing "=" after ..., looking for matching "]").
_LIBPQ_WORDS = frozenset({"=", "]"})


def _keyword_spans(url: str) -> list[tuple[int, int]] | None:
    """Where each password value is written in a keyword/value string, read as libpq reads it
    (``key = value``, a value quoted with ' or ending at whitespace, backslash escapes); None if
    libpq would refuse the string."""
    spans: list[tuple[int, int]] = []
    i, n = 0, len(url)
    while True:
        while i < n and url[i].isspace():
            i += 1
        if i >= n:
            return spans
        start = i
        while i < n and url[i] != "=" and not url[i].isspace():
            i += 1
        key = url[start:i]
        while i < n and url[i].isspace():
            i += 1
        if i >= n or url[i] != "=":
            return None
        i += 1
        while i < n and url[i].isspace():
            i += 1
        value = i
        if i < n and url[i] == "'":
            i += 1
            while i < n and url[i] != "'":
                i += 2 if url[i] == "\\" else 1
            if i >= n:
                return None
            i += 1
        else:
            while i < n and not url[i].isspace():
                i += 2 if url[i] == "\\" else 1
        if key == "password":
            spans.append((value, min(i, n)))


def _uri_spans(url: str) -> list[tuple[int, int]]:
    """Where the password is, or may be, written in a URI that libpq accepts: from the user
    info's colon to the authority's last @, and any password= query parameter.

    libpq ends the user info at the first @ or /, so a password with an unencoded @ or / still
    parses, its tail read as the host (``u:pw@rd@h``: host 'rd@h') or its head as the port and
    its tail as the database (``u:pw/rd@h/db``: port 'pw', database 'rd@h/db'). Masking only
    what libpq calls the password showed the rest. So the span runs to the last @ before the
    first / (or ?), or, with none there, to the last @ before the first ?: over-masking a
    database name with an @ in it is the price."""
    spans = []
    rest = url.index("://") + 3
    query = url.find("?", rest)
    head_end = query if query >= 0 else len(url)
    slash = url.find("/", rest, head_end)
    at = url.rfind("@", rest, slash if slash >= 0 else head_end)
    if at < 0:
        at = url.rfind("@", rest, head_end)
    if at >= 0 and ":" in url[rest:at]:
        spans.append((url.index(":", rest) + 1, at))
    return spans + _query_spans(url, to_end=False)


def _query_spans(url: str, *, to_end: bool) -> list[tuple[int, int]]:
    """The values of a URI's query parameters whose key is a password's: libpq percent-decodes
    keys, so ``pass%77ord=`` sets the password as ``password=`` does (and ``sslpassword``, the
    client key's). ``to_end``: the URI does not parse, so a value has no known end."""
    spans = []
    query = url.find("?")
    if query >= 0:
        at = query + 1
        for pair in url[query + 1 :].split("&"):
            key = pair.split("=", 1)[0]
            if "=" in pair and urllib.parse.unquote(key).strip().lower().endswith("password"):
                spans.append((at + len(key) + 1, len(url) if to_end else at + len(pair)))
            at += len(pair) + 1
    return spans


def _password_spans(url: str) -> list[tuple[int, int]]:
    """Every stretch of ``url`` that is, or may be, a password. A string libpq refuses has no
    known end to its password (``password=se cret`` is 'se' and a stray 'cret'): everything from
    where a password may begin to the end of the string counts."""
    try:
        conninfo_to_dict(url)
        parsed = True
    except psycopg.ProgrammingError:
        parsed = False
    spans: list[tuple[int, int]] = []
    if url.startswith(_URI_PREFIXES):
        if parsed:
            spans += _uri_spans(url)
        else:
            rest = url.index("://") + 3
            last_at = url.rfind("@")
            colon = url.find(":", rest)
            if 0 <= colon < last_at:
                spans.append((colon + 1, last_at))
            m = re.search(r"password=", url)
            if m:
                spans.append((m.end(), len(url)))
            spans += _query_spans(url, to_end=True)
    else:
        keyword = _keyword_spans(url) if parsed else None
        if keyword is not None:
            spans += keyword
        else:
            m = re.search(r"password\s*=\s*", url)
            if m:
                spans.append((m.end(), len(url)))
    spans += [m.span(1) for m in _URI_PASSWORD.finditer(url)]
    spans += [m.span(1) for m in _KEYWORD_PASSWORD.finditer(url)]
    return sorted((a, b) for a, b in spans if b > a)


def _mask(text: str, spans: list[tuple[int, int]], mask: str) -> str:
    merged: list[list[int]] = []
    for start, end in spans:  # sorted
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    out, at = [], 0
    for start, end in merged:
        out.append(text[at:start] + mask)
        at = end
    return "".join(out) + text[at:]

#: The worker's loopback-only control port (/drain; AGENTRUN_CONTROL_PORT, --control-port): the
#: worker listens on it and ``agentrun drain-local`` (the pod's preStop hook) calls it.
CONTROL_PORT_ENV = "AGENTRUN_CONTROL_PORT"
DEFAULT_CONTROL_PORT = 8081
#: The worker's drain grace (AGENTRUN_DRAIN_GRACE, --drain-grace), seconds.
DRAIN_GRACE_ENV = "AGENTRUN_DRAIN_GRACE"
DEFAULT_DRAIN_GRACE = 25.0


def redact_url(url: str) -> str:
    """The URL or keyword/value connection string with its password replaced by ``***``, for
    messages and logs. No part of a password survives, however it is quoted or mis-quoted."""
    return _mask(url, _password_spans(url), MASK)


#: What the server (or libpq, for a password it was asked for) says when it refuses the login
#: itself: the user, password or database in the URL is wrong, no network problem. These carry
#: no SQLSTATE in psycopg (the connection never opened), so the message is what tells.
_LOGIN_REFUSED = re.compile(
    r"password authentication failed|role \"[^\"]*\" does not exist|database \"[^\"]*\" does "
    r"not exist|no pg_hba\.conf entry|pg_hba\.conf rejects|no password supplied|"
    r"authentication failed|permission denied for database|is not permitted to log in|"
    r"SCRAM authentication requires|server requested .* password"
)


#: What libpq or the server says of a connection setting it refuses (the URL's sslmode,
#: target_session_attrs, options=-c ...): a configuration error (exit 2), not an outage.
_SETTING_REFUSED = re.compile(
    r"invalid \w+ value: |invalid value for parameter|unrecognized configuration parameter|"
    r"server does not support SSL, but SSL was required|invalid connection option"
)


def setting_refused(message: str) -> bool:
    """Whether a connection failure is a setting of the URL that libpq or the server refuses
    (exit 2, like a refused login) rather than the server being unreachable."""
    return bool(_SETTING_REFUSED.search(message))


def login_refused(message: str) -> bool:
    """Whether a connection failure is the server refusing this URL's user, password or
    database (a configuration error, exit 2) rather than the server being unreachable."""
    return bool(_LOGIN_REFUSED.search(message))


def secret_pieces(url: str) -> frozenset[str]:
    """Every text a message about ``url`` may show of its password: each stretch that is or may
    be one, the password as libpq reads it, and each other value libpq reads out of a password's
    stretch (``u:pw@rd@h``: the host 'rd@h'; ``u:pw/rd@h/db``: the port 'pw' and the database
    'rd@h/db'), which libpq's own errors quote ("could not translate host name "rd@h"")."""
    spans = _password_spans(url)
    pieces = {url[a:b].strip("'") for a, b in spans}
    try:
        params = conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        params = {}
    pieces.add(str(params.get("password") or ""))
    for key, value in params.items():
        at = url.find(str(value)) if value and key != "password" else -1
        if at >= 0 and any(a < at + len(str(value)) and at < b for a, b in spans):
            pieces.add(str(value))
    pieces.discard("")
    return frozenset(pieces)


def redact_message(message: str, url: str | None) -> str:
    """A message from libpq or the server about ``url``, safe to print.

    libpq quotes pieces of the connection string in its errors (``missing "=" after "cret"``,
    ``invalid percent-encoded token: "pa%zz"``, a whole URI): a quoted piece is kept only if it
    stands in the string outside every password; the password itself is masked wherever it
    appears. Also masks any other connection string the message holds."""
    message = redact_url(message)
    if not url:
        return message
    spans = _password_spans(url)
    if url in message:
        message = message.replace(url, redact_url(url))
    outside = _mask(url, spans, "\x00")
    secrets = secret_pieces(url)

    def quoted(m: re.Match[str]) -> str:
        piece = m.group(1)
        if piece in _LIBPQ_WORDS or (piece in outside and not any(s in piece for s in secrets)):
            return m.group()
        return f'"{MASK}"'

    message = _QUOTED.sub(quoted, message)
    for secret in sorted(secrets, key=len, reverse=True):
        if len(secret) >= 4:  # shorter ones only where quoted: masking every "ab" garbles
            message = message.replace(secret, MASK)
    return message


def validate_database_url(url: str, source: str = DATABASE_URL_ENV) -> str:
    """Check the URL parses as a libpq connection string; raise ConfigError naming the problem
    and ``source``, where the URL came from (the environment variable, or a client's argument)."""
    if not url.strip():
        if source != DATABASE_URL_ENV:
            raise ConfigError(f"{source} is empty; pass None to find the database as the CLI does")
        raise ConfigError(f"{DATABASE_URL_ENV} is empty; unset it to use the embedded PostgreSQL")
    scheme_match = _SCHEME.match(url)
    if scheme_match and not url.startswith(_URI_PREFIXES):
        scheme = scheme_match.group()[:-3]
        raise ConfigError(
            f"{source} has scheme {scheme!r}; expected postgresql://USER@HOST:PORT/DB"
        )
    try:
        params = conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(
            f"{source} is malformed ({redact_message(reason, url)}); "
            "expected postgresql://USER@HOST:PORT/DB"
        ) from None
    port = str(params.get("port") or "")
    if port and not all(p.isascii() and p.isdigit() and 1 <= int(p) <= 65535
                        for p in port.split(",")):
        # The "port" may be a password's head (u:pw/rd@h: libpq ends the user info at the /).
        shown = MASK if port in secret_pieces(url) else repr(port)
        raise ConfigError(
            f"{source} has port {shown}, not a number from 1 "
            "to 65535; expected postgresql://USER@HOST:PORT/DB (percent-encode / @ : ? in a "
            "password)"
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
