"""Formatting for the CLI and the demo: tables, ages, one-line step summaries, JSON rows."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import fields
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

from agentrun.store import Run, Step
from agentrun.waits import WaitRef


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


#: What a terminal acts on: C0 controls but newline and tab, DEL, and C1 controls; and the
#: bidirectional controls (U+061C, U+200E-F, U+202A-E, U+2066-9), which reorder what is shown
#: around them: a task could make a line read as something it does not say.
_TERMINAL_CONTROL = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _escape(m: re.Match[str]) -> str:
    code = ord(m.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str) -> str:
    """``text`` with what a terminal would act on shown as escapes (``\x1b``, ``\u202e``): a
    model's or a tool's text, steered by what the run read, could otherwise clear the screen,
    forge lines, set the clipboard of whoever looks at the run or reorder what it shows."""
    return _TERMINAL_CONTROL.sub(_escape, text)


def short(text: str | None, n: int = 60) -> str:
    if not text:
        return ""
    one = printable(" ".join(text.split()))  # before the cut: never half an escape sequence
    return one if len(one) <= n else one[: n - 1] + "…"


def yes_no(value: bool) -> str:
    """A boolean as a person reads it in a table or a summary line."""
    return "yes" if value else "no"


def budget_text(run: Run) -> str:
    """The run's limits (pinned with its agent spec) and how much of each it used."""
    budget = run.agent_spec.get("budget") or {}
    parts = []
    if budget.get("maxTokens") is not None:
        parts.append(f"{run.total_tokens} of {budget['maxTokens']} tokens")
    if budget.get("maxCostUSD") is not None:
        parts.append(f"${run.cost_usd:.4f} of ${budget['maxCostUSD']:g}")
    return ", ".join(parts) or "-"


def run_to_json(run: Run) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for column in fields(run):  # its columns only, not what a cached property keeps beside them
        key, value = column.name, getattr(run, column.name)
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


def to_yaml(value: Any) -> str:
    """``value`` (what ``-o json`` prints) as YAML: the same fields, block style."""
    import yaml

    text: str = yaml.safe_dump(value, sort_keys=False, allow_unicode=True, default_flow_style=False)
    return text.rstrip("\n")


def pending_text(run: Run, waited_on: dict[str, Any] | None = None) -> str | None:
    """The approval a waiting run needs, with the command that gives it (None: none).
    ``waited_on``: the call as :meth:`Store.waited_on` reads it, with the attempt a decision
    would be recorded against (a wait an older worker wrote may not name it: the intent's
    attempt counts then, not the first)."""
    call = waited_on or run.pending_call
    if run.status != "waiting_approval" or not call:
        return None
    wait = WaitRef.of(call)  # the call named: a bare seq would also fit the step's next wait
    stage = str(call.get("stage", "")).replace("_", " ")
    if call.get("stage") == "outcome_unknown":
        stage += f", attempt {int(call.get('attempt') or 1)}"
    return (
        f"step {wait.seq} call {wait.call}, {call.get('tool')} ({stage}): agentrun approve "
        f"{run.id} {wait} | agentrun reject {run.id} {wait}"
    )


def describe_run(
    run: Run, *, full: bool = False, waited_on: dict[str, Any] | None = None,
    turns: int | None = None,
) -> str:
    """``agentrun get``: one field a line. ``full`` (-o wide): the task, result and error whole,
    not cut to one line. ``waited_on``: see :func:`pending_text`. ``turns``: the model turns
    taken (Store.model_turns), which maxSteps counts; next_seq counts the tool results too."""

    def text(value: str | None) -> str:
        if value is None:
            return "-"
        return printable(value) if full else short(value, 200)

    def when(ts: datetime | None) -> str:
        return f"{ts.isoformat(timespec='seconds')} ({age(ts)} ago)" if ts else "-"

    if run.k8s_uid:
        origin = f"AgentRun {run.k8s_namespace}/{run.k8s_name} (uid {run.k8s_uid})"
    elif run.k8s_name:
        origin = f"{run.k8s_namespace}/{run.k8s_name} (submitted from a manifest; no object)"
    else:
        origin = "-"
    holder = "-"
    if run.lease_owner:
        holder = f"{run.lease_owner} (lease epoch {run.lease_epoch}, until {when(run.lease_until)})"
    fields: list[tuple[str, str]] = [
        ("id", str(run.id)),
        ("name", origin),
        ("status", run.status + (" (rolling back)" if run.rolling_back else "")),
        ("pool", run.pool),
        ("model", run.model),
        # Pinned with the run (spec.promptCaching, default on).
        ("caching", "on" if run.agent_spec.get("promptCaching", True) else "off"),
        ("provider", run.provider),
        ("turns", f"{'?' if turns is None else turns} (max {run.max_steps}); "
                  f"{run.next_seq} step{'' if run.next_seq == 1 else 's'} in the log"),
        # The claim's own rule (queries.sql claim_runs): a step committed since the last claim
        # starts the count over, though the stored count changes only at the next claim.
        ("attempt", f"{run.attempt} (in a row without a step: "
                    f"{0 if run.next_seq > run.claim_seq else run.stalled_attempts}, "
                    f"max {run.max_attempts})"),
        ("tokens", f"{run.input_tokens} in, {run.output_tokens} out, "
                   f"{run.cache_read_tokens} cache read, {run.cache_write_tokens} cache write"),
        ("cost", f"${run.cost_usd:.4f} (estimated)"),
        ("budget", budget_text(run)),
        ("worker", holder),
        ("waiting", text(run.wait_reason) if run.wait_reason else "-"),
        ("approval", pending_text(run, waited_on) or "-"),
        ("rollback", text(run.rollback_reason) if run.rollback_reason else "-"),
        ("error", text(run.error)),
        ("result", text(run.result)),
        ("task", text(run.task)),
        ("created", when(run.created_at)),
        ("started", when(run.started_at)),
        ("finished", when(run.finished_at)),
        ("key", run.external_key or "-"),
    ]
    width = max(len(k) for k, _ in fields) + 1
    return "\n".join(f"{(k + ':').ljust(width)} {v}" for k, v in fields)


def step_line(step: Step, *, wide: bool = False) -> str:
    """One step as ``agentrun logs`` prints it."""
    summary = summarize_payload(step.payload)
    if wide:
        summary = printable(json.dumps(step.payload, ensure_ascii=False))
    when = step.created_at.strftime("%H:%M:%S.%f")[:-3]
    return f"{step.seq:>4}  {when}  {step.kind:<11}  {step.worker}  {summary}"
