"""The ``agentrun`` command line.

Every command that touches the store finds the database through ``AGENTRUN_DATABASE_URL``, or the
embedded PostgreSQL when it is unset. Errors are one line on stderr and a non-zero exit:
2 for bad input or configuration, 3 when the database cannot be reached, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable, Coroutine, Sequence
from datetime import UTC, datetime
from typing import Any

import psycopg

from agentrun import __version__
from agentrun.config import redact_url
from agentrun.embedded import database_url
from agentrun.errors import AgentrunError, DatabaseUnavailable
from agentrun.migrations import migrate, schema_version
from agentrun.store import Run, Step, Store, check_connect


def _age(ts: datetime | None) -> str:
    if ts is None:
        return "-"
    secs = int((datetime.now(UTC) - ts).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if secs >= size:
            return f"{secs // size}{unit}"
    return f"{max(secs, 0)}s"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    lines = ["   ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    for row in rows:
        lines.append("   ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)


def _short(text: str | None, n: int = 60) -> str:
    if not text:
        return ""
    one = " ".join(text.split())
    return one if len(one) <= n else one[: n - 1] + "…"


def run_to_json(run: Run) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in vars(run).items():
        out[key] = value.isoformat() if isinstance(value, datetime) else (
            str(value) if key == "id" else value
        )
    return out


def step_to_json(step: Step) -> dict[str, Any]:
    return {
        "run_id": str(step.run_id),
        "seq": step.seq,
        "kind": step.kind,
        "payload": step.payload,
        "request_id": step.request_id,
        "lease_epoch": step.lease_epoch,
        "worker": step.worker,
        "created_at": step.created_at.isoformat(),
    }


def summarize_payload(kind: str, payload: Any) -> str:
    """One line for a step: what the model said or called, or what a tool returned."""
    blocks = payload.get("content", payload) if isinstance(payload, dict) else payload
    if not isinstance(blocks, list):
        return _short(json.dumps(payload))
    parts: list[str] = []
    for b in blocks:
        if not isinstance(b, dict):
            continue
        t = b.get("type")
        if t == "text":
            parts.append(_short(b.get("text"), 40))
        elif t == "thinking":
            parts.append("[thinking]")
        elif t == "tool_use":
            parts.append(f"{b.get('name')}({_short(json.dumps(b.get('input')), 50)})")
        elif t == "tool_result":
            err = " ERROR" if b.get("is_error") else ""
            content = b.get("content")
            text = content if isinstance(content, str) else json.dumps(content)
            parts.append(f"→{err} {_short(text, 50)}")
    return _short(" ".join(parts), 100)


# -- commands ------------------------------------------------------------------------------------


async def cmd_migrate(args: argparse.Namespace) -> int:
    url = database_url()
    await check_connect(url)
    conn = await psycopg.AsyncConnection.connect(url, autocommit=True)
    try:
        before = await schema_version(conn)
        result = await migrate(conn)
    finally:
        await conn.close()
    if result.applied:
        print(f"migrated {redact_url(url)} from version {before} to {result.version} "
              f"(applied {', '.join(f'{v:04d}' for v in result.applied)})")
    else:
        print(f"schema already at version {result.version}; nothing to do")
    return 0


async def _open_store() -> Store:
    return await Store.open(database_url(quiet=True), max_size=2)


async def cmd_runs(args: argparse.Namespace) -> int:
    async with await _open_store() as store:
        runs = await store.list_runs(pool=args.pool, status=args.status, limit=args.limit)
    if args.output == "json":
        print(json.dumps([run_to_json(r) for r in runs], indent=2))
        return 0
    rows = [
        [str(r.id), r.k8s_name or "-", r.pool, r.status, str(r.next_seq), str(r.attempt),
         r.model, _age(r.created_at), _short(r.error or r.result, 50)]
        for r in runs
    ]
    print(_table(["ID", "NAME", "POOL", "STATUS", "STEP", "ATTEMPT", "MODEL", "AGE", "MESSAGE"],
                 rows))
    return 0


async def cmd_steps(args: argparse.Namespace) -> int:
    async with await _open_store() as store:
        run = await store.get_run(args.run)  # RunNotFound for an unknown id
        steps = await store.steps(run.id)
    if args.output == "json":
        print(json.dumps([step_to_json(s) for s in steps], indent=2))
        return 0
    rows = [
        [str(s.seq), s.kind, s.created_at.strftime("%H:%M:%S.%f")[:-3], s.worker,
         str(s.lease_epoch), summarize_payload(s.kind, s.payload)]
        for s in steps
    ]
    print(f"run {run.id}: {run.status}, {len(steps)} steps, attempt {run.attempt}")
    print(_table(["SEQ", "KIND", "TIME", "WORKER", "EPOCH", "SUMMARY"], rows))
    return 0


async def cmd_cancel(args: argparse.Namespace) -> int:
    async with await _open_store() as store:
        run, changed = await store.cancel(args.run, reason=args.reason)
    if changed:
        print(f"run {run.id} cancelled")
        return 0
    print(f"run {run.id} already finished ({run.status}); nothing to cancel", file=sys.stderr)
    return 1


# -- wiring --------------------------------------------------------------------------------------

AsyncCommand = Callable[[argparse.Namespace], Coroutine[Any, Any, int]]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="agentrun",
        description="Durable execution for long-running LLM agents. The database is "
        "AGENTRUN_DATABASE_URL, or an embedded PostgreSQL when it is unset.",
    )
    p.add_argument("--version", action="version", version=f"agentrun {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    s = sub.add_parser("migrate", help="create or upgrade the schema (safe to run concurrently)")
    s.set_defaults(func=cmd_migrate)

    s = sub.add_parser("runs", help="list runs")
    s.add_argument("-o", "--output", choices=["table", "json"], default="table")
    s.add_argument("--pool")
    s.add_argument("--status")
    s.add_argument("--limit", type=int, default=100)
    s.set_defaults(func=cmd_runs)

    s = sub.add_parser("steps", help="show a run's step log")
    s.add_argument("run", help="run id")
    s.add_argument("-o", "--output", choices=["table", "json"], default="table")
    s.set_defaults(func=cmd_steps)

    s = sub.add_parser("cancel", help="cancel a run (stops an in-flight model call)")
    s.add_argument("run", help="run id")
    s.add_argument("--reason")
    s.set_defaults(func=cmd_cancel)

    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: AsyncCommand = args.func
    try:
        return asyncio.run(func(args))
    except AgentrunError as exc:
        print(f"agentrun: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except psycopg.OperationalError as exc:
        err = DatabaseUnavailable(f"database error: {' '.join(str(exc).split())}")
        print(f"agentrun: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
