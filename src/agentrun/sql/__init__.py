"""The SQL of agentrun, kept in this folder and nowhere else.

``queries.sql`` holds every statement the store runs, each under a ``-- name --`` header;
``migrations/NNNN_name.sql`` hold the schema, applied in order by :mod:`agentrun.migrations`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from typing import LiteralString

_HEADER = re.compile(r"^-- ([a-z][a-z0-9_]*) --$", re.MULTILINE)


def _load_queries() -> dict[str, LiteralString]:
    text = resources.files(__package__).joinpath("queries.sql").read_text(encoding="utf-8")
    parts = _HEADER.split(text)
    # parts = [preamble, name1, body1, name2, body2, ...]
    out: dict[str, LiteralString] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        out[name] = body.strip()
    return out


queries: dict[str, LiteralString] = _load_queries()


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: LiteralString


def migrations() -> list[Migration]:
    """Every migration shipped with this version of agentrun, oldest first."""
    folder = resources.files(__package__).joinpath("migrations")
    found: list[Migration] = []
    for entry in folder.iterdir():
        m = re.fullmatch(r"(\d{4})_([a-z0-9_]+)\.sql", entry.name)
        if m:
            found.append(Migration(int(m.group(1)), m.group(2), entry.read_text("utf-8")))
    found.sort(key=lambda mig: mig.version)
    return found
