"""Formatting for the CLI and the demo: tables, ages, one-line step summaries, JSON rows."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

from agentrun.store import Run, Step


def age(ts: datetime | None) -> str:
    if ts is None:
        return "-"
    secs = int((datetime.now(UTC) - ts).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if secs >= size:
            return f"{secs // size}{unit}"
    return f"{max(secs, 0)}s"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    lines = ["   ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    for row in rows:
        lines.append("   ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)


def short(text: str | None, n: int = 60) -> str:
    if not text:
        return ""
    one = " ".join(text.split())
    return one if len(one) <= n else one[: n - 1] + "…"


def run_to_json(run: Run) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in vars(run).items():
        out[key] = (
            value.isoformat()
            if isinstance(value, datetime)
            else (str(value) if isinstance(value, UUID) else value)
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


def summarize_payload(payload: Any) -> str:
    """One line for a step: what the model said or called, or what a tool returned."""
    blocks = payload.get("content", payload) if isinstance(payload, dict) else payload
    if not isinstance(blocks, list):
        return short(json.dumps(payload))
    parts: list[str] = []
    for b in blocks:
        if not isinstance(b, dict):
            continue
        t = b.get("type")
        if t == "text":
            parts.append(short(b.get("text"), 40))
        elif t == "thinking":
            parts.append("[thinking]")
        elif t == "tool_use":
            parts.append(f"{b.get('name')}({short(json.dumps(b.get('input')), 50)})")
        elif t == "tool_result":
            err = " ERROR" if b.get("is_error") else ""
            content = b.get("content")
            text = content if isinstance(content, str) else json.dumps(content)
            parts.append(f"→{err} {short(text, 50)}")
    return short(" ".join(parts), 100)
