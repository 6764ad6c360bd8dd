"""Seeded chaos soak: many runs mixing every tool class and odd payloads, workers killed and
SIGSTOPped at random, PostgreSQL restarted now and then, then a strict checker.

    python -m benchmarks.soak --runs 40 --seconds 120 --seed 7 [--pg-restarts 2]
    python -m benchmarks.soak --runs 40 --seconds 36000 --continuous --pg-restarts 20  # a night

Runs are created with the default maxAttempts (what ``agentrun run`` and an AgentRun get), so a
healthy run the runtime gives up on is seen. They use the test tools in
tests/tool_modules/ledger_tools.py, which write an effect ledger; ``--odd-payloads SHARE`` of them
(default 0.1) instead call benchmarks/bench_tools.py's ``odd`` tools, whose results hold NUL
bytes, lone surrogates, odd but valid unicode or about 250 KB, with a model that says NUL bytes
and odd unicode back, on a task in odd unicode.

Each chaos step (every 1-4 s, seeded) SIGSTOPs a worker that holds runs (``--sigstop-rate``,
default 0.15 of the steps) or else SIGKILLs (80%) or SIGTERMs one. A killed worker is replaced at
once, as Kubernetes would; so is a stopped one (Kubernetes might not notice: the soak does, so
that the stopped worker's runs have somewhere to go). A stopped worker is a zombie: it stays
stopped for 1.5-4 lease TTLs and until the runs it held are taken by others, then gets SIGCONT
and either carries on or is SIGKILLed 0.2-3 s later (seeded), its threads having had that long
to act on leases they no longer hold. A worker that exits by itself is replaced too. Runs whose
irreversible call has an unknown outcome are decided by a scripted on-call human who looks at the
ledger (it happened: reject the retry; it did not: approve it). ``--continuous`` keeps ``--runs``
runs unfinished for as long as the chaos goes on (without it the soak stops once every run has
finished).

Unless ``--database-url`` is given, the soak runs its own PostgreSQL server (own_pg.py: initdb in a
temporary directory, a free port), which ``--pg-restarts N`` stops (``pg_ctl -m fast``) and starts
again N times at seeded moments, down for a seeded 0.5-3 s each time; the server is stopped by
its pid at the end, whatever happened. Workers must ride the outages out by themselves. A worker
started during an outage exits 3 (database unreachable) and is replaced; any other exit that the
soak did not cause is counted as a worker crash. The tools' ledger (their "remote system") is on
a second server of the soak's own, which it never restarts (``--ledger-url``: elsewhere).

Then the checker reads the database. The soak fails on any of: a run dead-lettered, failed or
cancelled (only an odd-payload run may fail, once, with an error: the runtime may refuse a
payload it cannot store), a run not finished (stuck), a step log with a gap, a model turn
committed twice, a non-idempotent effect more or less than once per call, an irreversible effect
twice or never, an odd-payload run whose task, steps or result do not read back (through the
store) exactly as the tools and the model produced them, a worker crash. It prints the figures
and the first problems. ``--check-only --database-url URL [--ledger-url URL]`` runs only the
checker.

A failed soak keeps its evidence: its own servers' data directories (not removed; the soak
prints where they are) and, in the log directory, ``problems.log``: every line of every worker
life's log that names a run the checker complained about, each under its life's name (the logs of
lives older than the last KEEP_LOGS are kept compressed in ``lives.log.gz`` for this).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, Protocol

import psycopg
from psycopg_pool import PoolTimeout

from agentrun.errors import ConfigError
from agentrun.fake_anthropic import FakeAnthropicServer
from agentrun.manifests import AgentSpec
from agentrun.store import Run, Step, Store
from agentrun.vocabulary import TERMINAL_STATUSES
from agentrun.waits import WaitRef
from benchmarks.bench_tools import ODD_PAYLOADS
from benchmarks.own_pg import OwnPostgres

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tests" / "tool_modules" / "ledger_tools.py"
ODD_TOOLS = ROOT / "benchmarks" / "bench_tools.py"
AGENT = AgentSpec(
    model="claude-sonnet-4-5",
    system="Soak.",
    tools=["look", "set_flag", "send_email", "drop_table", "reserve", "release"],
)
ODD_AGENT = AgentSpec(model="claude-sonnet-4-5", system="Soak.", tools=["odd", "odd_echo"])
#: One conversation: every tool class, twice over, then an answer.
CALLS = [
    ("look", {"what": "a"}),
    ("set_flag", {"value": "x"}),
    ("send_email", {"to": "a@x"}),
    ("reserve", {"item": "r1"}),
    ("drop_table", {"table": "t1"}),
    ("look", {"what": "b"}),
    ("send_email", {"to": "b@x"}),
    ("set_flag", {"value": "y"}),
]
#: The effects a run that succeeded has in the ledger, each exactly that often (a different key
#: for the same call would be a duplicate too: it is one more row).
EFFECTS_PER_RUN = {"send_email": 2, "drop_table": 1, "reserve:r1": 1}
#: The worker's lease TTL in the soak: short, so that takeovers are frequent.
LEASE_TTL_S = 2.0
#: How much longer than its seeded stop a zombie is kept stopped, at most, waiting for its runs to
#: be taken by the others.
ZOMBIE_WAIT_S = 20.0
# The soak's tools return in milliseconds; the bound the on-call human waits out for a zombie that
# carries on is its lease's end plus this, longer than any zombie stays stopped (8 s plus
# ZOMBIE_WAIT_S), so a thawed zombie has left the call by then.
TOOL_TIMEOUT_S = 60.0
#: The shortest calm that can tell a stuck run from one rightly waiting for its human: an unknown
#: outcome whose caller the mark no longer names (the next call of its turn moved the mark on) is
#: decided only after its bound, the taking claim's time plus TOOL_TIMEOUT_S, and the run then
#: has its remaining turns to take. A 60 s calm once ended before that bound and called the run
#: stuck.
MIN_CALM_S = TOOL_TIMEOUT_S + LEASE_TTL_S + 60
#: The calm unless told otherwise (soak() and --calm alike).
DEFAULT_CALM_S = 600.0
#: What a database outage looks like to the soak's own client.
DB_ERRORS = (psycopg.OperationalError, PoolTimeout, OSError)
#: Worker logs kept as files; older ones are appended to ARCHIVE, compressed (a night's soak
#: starts thousands of workers, and a failed one needs them all: see trace()).
KEEP_LOGS = 200
ARCHIVE = "lives.log.gz"
#: A run id, as the checker's problems and every worker log line about a run spell it.
RUN_ID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
PROGRESS_EVERY_S = 30.0
HOLD_WAIT_S = 10.0  # --kill-every: how long a slot's clock waits for its worker's first steps

#: The odd-payload runs: one kind per run, in turn. The task starts with ODD_PREFIX + the kind.
ODD_KINDS = ("nul", "surrogates", "unicode", "huge")
ODD_PREFIX = "soak odd "
ODD_TASK_RE = re.compile(r"^soak odd (\w+) run (\d+): ")
#: Valid but unusual unicode in every odd run's task (a task with a NUL byte is bad input, refused
#: at create: not the soak's business; lone surrogates cannot be sent to the model at all).
ODD_TASK = (
    "\u0645\u0631\u062d\u0628\u0627 \u202eevil\u202c \U0001f469\u200d\U0001f469\u200d\U0001f467 "
    "e\u0301 \U0001d518\U0010ffff \ufeff\uffff \u2028 a literal \\u0000 and \\ud800, 'quotes' \""
)


def model_text(kind: str) -> str:
    """What the scripted model says in an odd run (thinking, text and a tool input). NUL bytes and
    odd unicode it can say; lone surrogates it cannot: the SDK refuses to send them back (it
    encodes requests as UTF-8), and so does any real provider's API."""
    if kind in ("nul", "unicode"):
        return ODD_PAYLOADS[kind]
    if kind == "huge":
        return ODD_PAYLOADS["huge"][:20_000]
    return "plain words: a model never says a lone surrogate"


def odd_task(kind: str, n: int) -> str:
    return f"{ODD_PREFIX}{kind} run {n}: {ODD_TASK}"


def odd_turns(kind: str) -> list[dict[str, Any]]:
    """The odd run's conversation: the odd tool's payload, then the model's odd text echoed
    through a tool, then an answer that ends with that text."""
    said = model_text(kind)
    return [
        {"content": [{"thinking": f"odd {kind}"},
                     {"tool_use": {"name": "odd", "input": {"kind": kind}}}]},
        {"content": [{"thinking": said}, {"text": said},
                     {"tool_use": {"name": "odd_echo", "input": {"text": said}}}]},
        {"content": [{"text": f"odd {kind} done: {said}"}]},
    ]  # fmt: skip


def scenario(delay_ms: int) -> dict[str, Any]:
    turns = [
        {"content": [{"thinking": f"call {i}"}, {"tool_use": {"name": n, "input": a}}]}
        for i, (n, a) in enumerate(CALLS)
    ]
    turns.append({"content": [{"text": "soak run done"}]})
    odd = [
        {"name": f"odd-{kind}", "match": f"{ODD_PREFIX}{kind} run ", "turns": odd_turns(kind)}
        for kind in ODD_KINDS
    ]
    return {
        "name": "soak",
        "delay_ms": delay_ms,
        "scripts": [*odd, {"name": "soak", "turns": turns}],  # the default script last
    }


def ledger_schema() -> str:
    source = TOOLS.read_text()
    return source.split('SCHEMA = """', 1)[1].split('"""', 1)[0]


@dataclass
class Report:
    runs: int = 0
    succeeded: int = 0
    steps: int = 0
    kills: int = 0
    terms: int = 0
    zombies: int = 0  # workers SIGSTOPped past their lease TTL, then SIGCONTed
    zombie_runs_taken: int = 0  # runs a zombie held that others took while it was stopped
    zombies_killed: int = 0  # zombies SIGKILLed after their SIGCONT (the others carried on)
    # SIGKILLs that landed on a worker holding runs at that moment (read just before): a kill
    # of a worker still starting up tests little.
    kills_holding_runs: int = 0
    kills_per_slot: list[int] = field(default_factory=list)  # --kill-every: each slot's kills
    pg_restarts: int = 0
    outage_s: float = 0.0
    decisions: int = 0
    workers_started: int = 0
    workers_forked: int = 0  # --fork-workers: of those, the ones benchmarks/zygote.py forked
    refused_during_outage: int = 0  # exit 3: started while the database was down
    odd_runs: int = 0
    odd_succeeded: int = 0
    odd_failed: int = 0  # allowed: the runtime refused a payload once, with an error
    worker_crashes: int = 0  # any other exit the soak did not cause
    dead_lettered: int = 0
    failed: int = 0  # runs other than odd-payload ones that failed
    cancelled: int = 0
    stuck: int = 0
    duplicate_effects: int = 0
    lost_effects: int = 0
    lost_steps: int = 0
    duplicate_turns: int = 0
    odd_mismatched: int = 0  # odd-payload runs whose log does not read back as produced
    most_claims: int = 0  # the most claims of a run that succeeded (the default cap is 8)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (
            self.dead_lettered
            or self.failed
            or self.cancelled
            or self.stuck
            or self.duplicate_effects
            or self.lost_effects
            or self.lost_steps
            or self.duplicate_turns
            or self.odd_mismatched
            or self.worker_crashes
        )


async def check(url: str, report: Report | None = None, ledger_url: str | None = None) -> Report:
    """Read the database and count what must never happen (set-based: a night's soak leaves tens
    of thousands of runs), then read every odd-payload run back through the store. The effects are
    read from ``ledger_url`` (default: ``url``)."""
    r = report or Report()
    ledger = ledger_url or url
    params: dict[str, Any] = {"terminal": list(TERMINAL_STATUSES), "odd": ODD_PREFIX + "%"}
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE status = 'succeeded'),"
            " count(*) FILTER (WHERE status <> ALL(%(terminal)s)),"
            " count(*) FILTER (WHERE status = 'dead_letter'),"
            " count(*) FILTER (WHERE status = 'failed' AND task NOT LIKE %(odd)s),"
            " count(*) FILTER (WHERE status = 'cancelled'),"
            " count(*) FILTER (WHERE task LIKE %(odd)s),"
            " count(*) FILTER (WHERE task LIKE %(odd)s AND status = 'succeeded'),"
            " count(*) FILTER (WHERE task LIKE %(odd)s AND status = 'failed'),"
            " coalesce(max(attempt) FILTER (WHERE status = 'succeeded'), 0)"
            " FROM agent_run",
            params,
        ).fetchone()
        assert row is not None
        (r.runs, r.succeeded, r.stuck, r.dead_lettered, r.failed, r.cancelled,
         r.odd_runs, r.odd_succeeded, r.odd_failed, r.most_claims) = row  # fmt: skip
        # A healthy run must succeed: one dead-lettered, failed or cancelled (the soak cancels
        # nothing) is the runtime giving up on it, and one not finished is stuck.
        for rid, status, attempt, error in conn.execute(
            "SELECT id, status, attempt, error FROM agent_run"
            " WHERE status <> ALL(%(terminal)s) OR status IN ('dead_letter', 'cancelled')"
            " OR (status = 'failed' AND task NOT LIKE %(odd)s) ORDER BY created_at LIMIT 50",
            params,
        ):
            stuck = "stuck in " if status not in TERMINAL_STATUSES else ""
            r.problems.append(
                f"run {rid}: {stuck}{status} after {attempt} claims: {(error or '')[:300]!r}"
            )
        for rid, error in conn.execute(
            "SELECT id, error FROM agent_run WHERE task LIKE %(odd)s AND status = 'failed'"
            " ORDER BY created_at LIMIT 20",
            params,
        ):
            r.notes.append(f"odd-payload run {rid} failed: {(error or '')[:300]!r}")
        row = conn.execute("SELECT count(*) FROM agent_step").fetchone()
        r.steps = row[0] if row else 0
        # Contiguous from 0: n steps, lowest 0, highest n - 1 (the primary key forbids repeats).
        for rid, seqs in conn.execute(
            "SELECT run_id, array_agg(seq ORDER BY seq) FROM agent_step GROUP BY run_id"
            " HAVING min(seq) <> 0 OR max(seq) <> count(*) - 1"
        ):
            r.lost_steps += 1
            r.problems.append(f"run {rid}: seqs not contiguous: {seqs}")
        for (rid,) in conn.execute(
            "SELECT DISTINCT run_id FROM ("
            " SELECT run_id FROM agent_step WHERE kind = 'model_turn'"
            " GROUP BY run_id, payload::text HAVING count(*) > 1) twice"
        ):
            r.duplicate_turns += 1
            r.problems.append(f"run {rid}: a model turn was committed twice")
        # Each effect of a run exactly as often as its conversation calls for: more is a
        # duplicate (a non-idempotent call under a second key, an irreversible call run twice),
        # fewer is an effect lost (only for a run that succeeded: the others stopped midway).
        # The ledger may be on a server of its own, so it is read apart and compared here.
        with psycopg.connect(ledger) as lconn:
            lconn.execute(ledger_schema())  # (IF NOT EXISTS, rolled back)
            effects: dict[tuple[str, str], int] = {
                (tool, rid): n
                for tool, rid, n in lconn.execute(
                    "SELECT tool, run_id, count(*) FROM ledger_effects GROUP BY tool, run_id"
                )
            }
        for rid, status in conn.execute(
            "SELECT id::text, status FROM agent_run WHERE task NOT LIKE %(odd)s"
            " ORDER BY created_at",
            params,
        ):
            for tool, want in EFFECTS_PER_RUN.items():
                n = effects.get((tool, rid), 0)
                if n > want:
                    r.duplicate_effects += n - want
                elif n < want and status == "succeeded":
                    r.lost_effects += want - n
                else:
                    continue
                said = tool_errors(conn, rid, tool.split(":")[0])
                r.problems.append(
                    f"run {rid} ({status}): {tool} happened {n} times (expected {want})"
                    + (f"; the tool reported: {said}" if said else "")
                )
        for (tool, rid), n in effects.items():  # any other effect (a compensation): at most once
            if tool not in EFFECTS_PER_RUN and n > 1:
                r.duplicate_effects += n - 1
                r.problems.append(f"run {rid}: {tool} happened {n} times (expected at most 1)")
        odd_ids = [
            rid
            for (rid,) in conn.execute(
                "SELECT id FROM agent_run WHERE task LIKE %(odd)s AND status = 'succeeded'"
                " ORDER BY created_at",
                params,
            )
        ]
    if odd_ids:
        # Through the store, as a worker reads them back: however it stores an odd payload, it
        # must hand back exactly what the tool and the model produced.
        async with await Store.open(url, max_size=1) as store:
            for rid in odd_ids:
                wrong = odd_mismatches(await store.get_run(rid), await store.steps(rid))
                if wrong:
                    r.odd_mismatched += 1
                    r.problems.append(f"odd-payload run {rid}: {wrong}")
    return r


def tool_errors(conn: psycopg.Connection[Any], run_id: str, tool: str) -> list[str]:
    """The errors the run's log holds for its calls of ``tool`` (what the model was told), so a
    lost effect names its cause when it has one."""
    return [
        str(text)[:200]
        for (text,) in conn.execute(
            "SELECT res.b->>'content' FROM agent_step t"
            " CROSS JOIN jsonb_array_elements(t.payload->'content') AS use(b)"
            " JOIN agent_step s ON s.run_id = t.run_id AND s.kind = 'tool_result'"
            " CROSS JOIN jsonb_array_elements(s.payload->'content') AS res(b)"
            " WHERE t.run_id = %s AND t.kind = 'model_turn' AND use.b->>'type' = 'tool_use'"
            " AND use.b->>'name' = %s AND res.b->>'tool_use_id' = use.b->>'id'"
            " AND (res.b->>'is_error')::boolean ORDER BY s.seq",
            (run_id, tool),
        )
    ]


def _said(block: dict[str, Any]) -> tuple[str, Any]:
    """What a content block says, by its type (ids, signatures and citations left out)."""
    kind = str(block.get("type"))
    value = {"thinking": "thinking", "text": "text", "tool_use": "input"}.get(kind, "content")
    return kind, block.get(value)


def odd_mismatches(run: Run, steps: list[Step]) -> str | None:
    """Where an odd-payload run that succeeded does not read back as produced (None: nowhere)."""
    m = ODD_TASK_RE.match(run.task)
    if m is None or m.group(1) not in ODD_KINDS or run.task != odd_task(m.group(1), int(m[2])):
        return f"the task reads back changed: {run.task[:200]!r}"
    kind, said = m.group(1), model_text(m.group(1))
    produced: list[tuple[str, list[tuple[str, Any]]]] = []
    for turn, result in zip(odd_turns(kind), (ODD_PAYLOADS[kind], said, None), strict=True):
        blocks = [
            ("thinking", b["thinking"]) if "thinking" in b
            else ("text", b["text"]) if "text" in b
            else ("tool_use", b["tool_use"]["input"])
            for b in turn["content"]
        ]  # fmt: skip
        produced.append(("model_turn", blocks))
        if result is not None:
            produced.append(("tool_result", [("tool_result", result)]))
    read = [
        (s.kind, [_said(b) for b in s.payload.get("content", [])])
        for s in steps
        if s.kind in ("model_turn", "tool_result")
    ]
    for i, (want, got) in enumerate(zip(produced, read, strict=False)):  # lengths: below
        if want != got:
            return f"step {i} ({want[0]}) reads back changed: {_short(got)} for {_short(want)}"
    if len(read) != len(produced):
        return f"{len(read)} conversation steps for {len(produced)}"
    final = f"odd {kind} done: {said}"
    if run.result != final:
        return f"the result reads back changed: {_short(run.result)} for {_short(final)}"
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 160 else f"{text[:160]}... ({len(text)} characters)"


async def decide_waiting(store: Store, ledger_url: str, alive: Callable[[str], bool]) -> int:
    """The scripted on-call human: look at the target, then approve or reject the retry.

    As docs/side-effects.md tells a human to, an unknown outcome is decided only once its previous
    holder cannot be inside the call any more: that worker's process is gone (``alive``: the
    soak's ``kubectl get pod``), or the pending call's ``busy_until`` has passed. Deciding by the
    target alone approved a retry while a SIGSTOPped worker was inside ``drop_table``: it woke up
    and dropped the table a second time."""
    decided = 0
    now = datetime.now(UTC)
    for run in await store.list_runs(status="waiting_approval", limit=1000):
        call = run.pending_call or {}
        if call.get("busy_until") and now < datetime.fromisoformat(call["busy_until"]):
            holder = call.get("busy_worker")
            if holder is None or alive(holder):
                continue  # it may still be inside the call: look again later
        with psycopg.connect(ledger_url) as conn:
            row = conn.execute(
                "SELECT count(*) FROM ledger_effects WHERE run_id = %s AND tool = %s",
                (str(run.id), call.get("tool")),
            ).fetchone()
        happened = bool(row and row[0])
        try:
            # The wait named as `agentrun approve RUN 8.0.2` names it: a bare step number is
            # refused once the step had a decision (an approved re-run whose outcome is unknown
            # again waits on its next attempt), and the soak died of that refusal.
            await store.decide(
                run.id,
                WaitRef.of(call),
                "rejected" if happened else "approved",
                decided_by="soak-oncall",
                reason="checked the ledger",
            )
        except ConfigError:  # refused, nothing recorded: the run moved on since it was listed
            continue  # (claimed, waiting on another call): looked at again next round
        decided += 1
    return decided


async def unfinished(store: Store) -> int:
    async with store.pool.connection() as conn:
        cur = await conn.execute(
            "SELECT count(*) FROM agent_run WHERE status <> ALL(%s)", (list(TERMINAL_STATUSES),)
        )
        row = await cur.fetchone()
    return int(row[0]) if row else 0


async def held_by(store: Store, worker: str) -> set[str]:
    """The runs ``worker`` holds the lease of (as the database says: expired or not)."""
    async with store.pool.connection() as conn:
        cur = await conn.execute(
            "SELECT id::text FROM agent_run WHERE status = 'running' AND lease_owner = %s",
            (worker,),
        )
        return {row[0] for row in await cur.fetchall()}


class Proc(Protocol):
    """A worker process as the soak handles it: a ``subprocess.Popen``, or a :class:`Forked`."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def send_signal(self, sig: int) -> None: ...
    def kill(self) -> None: ...
    def wait(self, timeout: float | None = None) -> int: ...


class Forked:
    """A worker life forked by the zygote (benchmarks/zygote.py): signalled through a pidfd (so
    never another process that got its pid), its exit reported by the zygote, which reaps it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._ended = threading.Event()
        self._lock = threading.Lock()
        self._pidfd: int | None
        try:
            self._pidfd = os.pidfd_open(pid)
        except ProcessLookupError:  # gone and reaped already: its exit line follows
            self._pidfd = None

    def exited(self, rc: int) -> None:
        with self._lock:
            self.returncode = rc
            if self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, sig: int) -> None:
        with self._lock:
            if self._pidfd is not None:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(self._pidfd, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0)
        assert self.returncode is not None
        return self.returncode


class Zygote:
    """The soak's side of benchmarks/zygote.py: start it, ask it for worker lives, stop it (it
    SIGKILLs and reaps whatever it started that is still alive)."""

    def __init__(self, env: dict[str, str]) -> None:
        # A session of its own, for it and the lives it forks: when the process group the soak
        # runs in is orphaned (the shell that started the soak exits) while a zombie life is
        # stopped, the kernel SIGHUPs that whole group, and a stopped life died of it "by itself"
        # (three on 2026-12-08, docs/benchmarks.md). Nothing it forked outlives the soak anyway:
        # the end of its stdin, the soak gone, makes it SIGKILL them all.
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.zygote"],
            env=env, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            start_new_session=True,
        )  # fmt: skip
        assert self.popen.stdin is not None and self.popen.stdout is not None
        self._in: IO[bytes] = self.popen.stdin
        self._out: IO[bytes] = self.popen.stdout
        ready = json.loads(self._out.readline() or b"{}")
        if "ready" not in ready:
            self.close()
            raise RuntimeError(f"benchmarks.zygote did not start (exit {self.popen.poll()})")
        self._procs: dict[int, Forked] = {}
        self._spawned: dict[str, Forked] = {}
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self._out:
            msg = json.loads(line)
            with self._cond:
                if "spawned" in msg:
                    proc = Forked(int(msg["pid"]))
                    self._procs[proc.pid] = proc
                    self._spawned[str(msg["spawned"])] = proc
                    self._cond.notify_all()
                elif "exited" in msg and (gone := self._procs.pop(int(msg["exited"]), None)):
                    gone.exited(int(msg["rc"]))
        with self._cond:  # the zygote is gone, and with it every child (it kills them first)
            for proc in self._procs.values():
                proc.exited(-signal.SIGKILL)
            self._procs.clear()
            self._cond.notify_all()

    def spawn(self, tag: str, argv: list[str], log: Path) -> Forked:
        self._in.write(json.dumps({"spawn": tag, "argv": argv, "log": str(log)}).encode() + b"\n")
        self._in.flush()
        with self._cond:
            if not self._cond.wait_for(
                lambda: tag in self._spawned or not self._reader.is_alive(), 30
            ) or tag not in self._spawned:
                raise RuntimeError(f"benchmarks.zygote did not fork {tag}")
            return self._spawned.pop(tag)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.popen.stdin.close()  # type: ignore[union-attr]
        try:
            self.popen.wait(60)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


def life_name(n: int) -> str:
    """The n-th worker life's name: its --worker-id, the zygote's tag, its log's heading."""
    return f"soak-{n}"


def log_path(logdir: Path, n: int) -> Path:
    """Where the n-th worker life writes its log (until it is archived)."""
    return logdir / f"worker-{n}.log"


class _Fleet:
    """The soak's worker processes: started, signalled and reaped.

    Every record is keyed by the life (its Proc), never by its pid: an hour's soak forks more
    processes than pid_max (32,768 here; PostgreSQL forks a backend per connection), so pids come
    back. Keyed by pid, a new life that got a pid the soak had signalled before counted as on its
    way out: never hit, never serving, its slot given another life beside it, until about 30
    lives served 8 slots and the kill rate fell from 2.4 to 0.9 a second (the first 90-minute
    run)."""

    def __init__(
        self, env: dict[str, str], logdir: Path, concurrency: int, report: Report,
        zygote: Zygote | None = None,
    ) -> None:
        self.env = env
        self.logdir = logdir
        self.concurrency = concurrency
        self.report = report
        self.zygote = zygote
        self.procs: list[Proc] = []  # every life, in order of start
        # The lives whose exit is not counted yet: what live() and top_up() look through, so
        # their cost does not grow with the 10,000 lives behind them.
        self.current: list[Proc] = []
        self.signalled: set[Proc] = set()  # SIGKILLed or SIGTERMed by the soak, not exited yet
        self.stopped: set[Proc] = set()  # SIGSTOPped now
        self.names: dict[Proc, str] = {}
        self.slot_of: dict[Proc, int] = {}  # the worker slot each life serves

    def spawn(self, slot: int) -> None:
        n = len(self.procs)
        name = life_name(n)
        argv = [
            "worker",
            "--tools", str(TOOLS),
            "--tools", str(ODD_TOOLS),
            "--worker-id", name,
            "--lease-ttl", str(LEASE_TTL_S),
            "--tool-timeout", str(TOOL_TIMEOUT_S),
            "--poll-interval", "0.5",
            "--health-port", "-1",
            "--control-port", "-1",
            "--concurrency", str(self.concurrency),
        ]  # fmt: skip
        path = log_path(self.logdir, n)
        proc: Proc
        if self.zygote is not None:
            proc = self.zygote.spawn(name, argv, path)
            self.report.workers_forked += 1
        else:
            with open(path, "wb") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "agentrun", *argv],
                    env=self.env, stdout=log, stderr=subprocess.STDOUT,
                )  # fmt: skip
        self.add(proc, slot, name)
        self.report.workers_started += 1
        old = n - KEEP_LOGS
        if old >= 0 and self.procs[old].poll() is not None:
            self.archive(old)

    def archive(self, n: int) -> None:
        """Move life ``n``'s log into ARCHIVE, under a line with its name (one gzip member per
        life: a file of concatenated members reads as one)."""
        path = log_path(self.logdir, n)
        with contextlib.suppress(FileNotFoundError):
            data = path.read_bytes()
            with gzip.open(self.logdir / ARCHIVE, "ab") as gz:
                gz.write(f"=== {life_name(n)}\n".encode() + data)
            path.unlink()

    def add(self, proc: Proc, slot: int, name: str) -> None:
        """Count ``proc`` as the newest life of ``slot``."""
        self.procs.append(proc)
        self.current.append(proc)
        self.names[proc] = name
        self.slot_of[proc] = slot

    def live(self) -> list[Proc]:
        """Running, not stopped and not on its way out: what serves runs now."""
        return [
            p
            for p in self.current
            if p.poll() is None and p not in self.signalled and p not in self.stopped
        ]

    def serving(self, slot: int) -> Proc | None:
        """The newest live worker of ``slot`` (None: its replacement is not started yet)."""
        mine = [p for p in self.live() if self.slot_of[p] == slot]
        return mine[-1] if mine else None

    def hit(self, victim: Proc, sig: signal.Signals) -> None:
        self.signalled.add(victim)
        victim.send_signal(sig)

    def stop(self, victim: Proc) -> None:
        self.stopped.add(victim)
        victim.send_signal(signal.SIGSTOP)

    def cont(self, victim: Proc) -> None:
        if victim.poll() is None:
            victim.send_signal(signal.SIGCONT)
        self.stopped.discard(victim)

    def top_up(self, want: int) -> None:
        """Count the exits the soak did not cause, and start workers until ``want`` serve."""
        for p in [p for p in self.current if p.poll() is not None]:
            self.current.remove(p)
            self.stopped.discard(p)
            if p in self.signalled:
                self.signalled.discard(p)
                continue
            if p.returncode == 3:  # "database unreachable" at start: an outage
                self.report.refused_during_outage += 1
            else:
                self.report.worker_crashes += 1
                self.report.problems.append(
                    f"worker {self.names[p]} exited {p.returncode} by itself (log: "
                    f"{self.logdir / (self.names[p].replace('soak', 'worker') + '.log')})"
                )
        # Each slot is one Deployment replica: a slot whose worker was killed, stopped or exited
        # gets a new one (a zombie that carries on after its SIGCONT serves beside it).
        for slot in range(want):
            if self.serving(slot) is None:
                self.spawn(slot)

    def alive(self, name: str) -> bool:
        """Whether the worker called ``name`` is a process still (stopped or not)."""
        return any(self.names[p] == name and p.poll() is None for p in self.current)

    def stop_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()  # a stopped process dies of SIGKILL too
            p.wait()
        if self.zygote is not None:
            self.zygote.close()


async def soak(
    url: str,
    runs: int,
    seconds: float,
    seed: int,
    logdir: Path,
    *,
    delay_ms: int = 30,
    concurrency: int = 4,
    workers: int = 2,
    pg: OwnPostgres | None = None,
    pg_restarts: int = 0,
    sigstop_rate: float = 0.15,
    odd_payloads: float = 0.1,
    continuous: bool = False,
    calm_s: float = DEFAULT_CALM_S,
    progress: Any = None,
    kill_every: float | None = None,
    kills: int | None = None,
    fork_workers: bool = False,
    ledger_url: str | None = None,
) -> Report:
    """Kill and SIGSTOP workers for ``seconds`` (restarting ``pg`` ``pg_restarts`` times), let
    every run finish, then check. ``url`` must be a migrated database with no runs; with
    ``pg_restarts``, it must be on ``pg``. ``sigstop_rate``: the share of chaos steps that make a
    zombie; ``odd_payloads``: the share of runs with odd payloads. ``kill_every``: each worker
    slot is hit on a seeded clock of its own, every 0.5-1.5 times that many seconds (several
    workers die independently, so the kill rate grows with ``workers``), instead of one chaos
    step every 1-4 s for the whole fleet; a slot's clock starts once its worker has committed a
    step on each run of its first claim (waited for up to HOLD_WAIT_S). ``kills``: the chaos
    ends once that many SIGKILLs were sent (or ``seconds`` is over, whichever comes first).
    ``fork_workers``: each worker life is forked by benchmarks/zygote.py, which imported the
    worker's stack once, instead of exec'ed (about 1.5 s of CPU less per life). ``ledger_url``:
    where the tools keep their ledger, their "remote system" (default ``url``); on a server that
    ``pg_restarts`` does not restart, an effect is lost only if the runtime loses it (with the
    ledger on ``pg``, a tool that met an outage told the model so, and its effect was rightly
    never done: 2 of them in the first 10,000-kill soak)."""
    if kill_every is not None and kill_every <= 0:
        raise ValueError("kill_every must be positive")
    if pg_restarts and pg is None:
        raise ValueError("restarting PostgreSQL needs the soak's own server (pg)")
    rng = random.Random(seed)
    # The kind of each chaos step comes from a stream of its own, so the first steps' kinds are
    # the seed's whatever the timing (a short soak with a given seed is sure to make a zombie).
    kinds = random.Random(f"{seed}:kinds")
    report = Report()
    ledger = ledger_url or url
    with psycopg.connect(ledger, autocommit=True) as conn:
        conn.execute(ledger_schema())
    path = logdir / "soak.json"  # JSON: the scenario holds NUL bytes
    path.write_text(json.dumps(scenario(delay_ms=delay_ms)))
    # Seeded moments for the restarts, in the first 60% of the chaos, so that runs are still
    # going on around them and the chaos goes on after them: as shares of ``seconds`` and, with
    # ``kills``, of the kills too, whichever comes first (a chaos that reaches its kills early
    # would otherwise end before its last restarts: at 3.13 kills/s, 10,000 kills end at 59%
    # of 5,400 s).
    restart_at = sorted(rng.uniform(0.1, 0.6) for _ in range(pg_restarts))

    def restart_due(elapsed: float) -> bool:
        share = restart_at[0]
        return elapsed >= share * seconds or (kills is not None and report.kills >= share * kills)

    outage: asyncio.Task[None] | None = None
    zombies: list[asyncio.Task[None]] = []
    store = await Store.open(url, max_size=4)
    submitted = 0
    odd_submitted = 0
    say = progress or (lambda _msg: None)

    async def submit(n: int) -> None:
        nonlocal submitted, odd_submitted
        for _ in range(n):
            # Spread evenly: run k is odd when the share's running total passes an integer.
            if int((submitted + 1) * odd_payloads) > int(submitted * odd_payloads):
                kind = ODD_KINDS[odd_submitted % len(ODD_KINDS)]
                await store.create_run(odd_task(kind, submitted), ODD_AGENT)
                odd_submitted += 1
            else:
                await store.create_run(f"soak run {submitted}", AGENT)
            submitted += 1

    async def restart(down_s: float) -> None:
        assert pg is not None
        t0 = time.monotonic()
        await asyncio.to_thread(pg.stop)
        await asyncio.sleep(down_s)
        await asyncio.to_thread(pg.start)
        report.pg_restarts += 1
        report.outage_s += time.monotonic() - t0
        say(f"PostgreSQL restarted ({report.pg_restarts}/{pg_restarts}), down {down_s:.1f} s")

    async def zombie(
        victim: Proc, held: set[str], stop_s: float, kill_after: float | None
    ) -> None:
        """Keep a stopped worker stopped past its lease and until the others have taken its
        runs, thaw it, and maybe kill it a moment later (its threads have had that moment)."""
        name = fleet.names[victim]
        t0 = time.monotonic()
        await asyncio.sleep(stop_s)
        still = held
        while time.monotonic() < t0 + stop_s + ZOMBIE_WAIT_S:
            with contextlib.suppress(*DB_ERRORS):
                still = held & await held_by(store, name)
                if not still:
                    break
            await asyncio.sleep(0.5)
        report.zombie_runs_taken += len(held - still)
        fleet.cont(victim)
        fate = "carries on" if kill_after is None else f"SIGKILL in {kill_after:.1f} s"
        say(f"zombie {name}: stopped {time.monotonic() - t0:.1f} s, {len(held - still)} of its "
            f"{len(held)} runs taken; {fate}")  # fmt: skip
        if kill_after is not None:
            await asyncio.sleep(kill_after)
            if victim.poll() is None:
                fleet.hit(victim, signal.SIGKILL)
                report.zombies_killed += 1

    zombie_due = False

    def make_zombie(victim: Proc, held: set[str], r: random.Random) -> None:
        stop_s = r.uniform(1.5, 4.0) * LEASE_TTL_S
        kill_after = r.uniform(0.2, 3.0) if r.random() < 0.5 else None
        fleet.stop(victim)
        report.zombies += 1
        zombies.append(asyncio.create_task(zombie(victim, held, stop_s, kill_after)))

    def kill(victim: Proc, r: random.Random, held: set[str] | None) -> None:
        if r.random() < 0.8:
            fleet.hit(victim, signal.SIGKILL)
            report.kills += 1
            report.kills_holding_runs += bool(held)
            if report.kills_per_slot:
                report.kills_per_slot[fleet.slot_of[victim]] += 1
        else:
            fleet.hit(victim, signal.SIGTERM)
            report.terms += 1

    async def holding(victim: Proc) -> set[str] | None:
        """The runs ``victim`` holds now (None: the database did not answer)."""
        with contextlib.suppress(*DB_ERRORS):
            return await held_by(store, fleet.names[victim])
        return None

    async def chaos_step() -> None:
        nonlocal zombie_due
        live = fleet.live()
        if not live:
            return
        zombie_due = zombie_due or kinds.random() < sigstop_rate
        if zombie_due:
            # Only a worker that holds runs makes a zombie worth the name: if none does now,
            # the stop waits for the next step.
            held: dict[Proc, set[str]] = {}
            with contextlib.suppress(*DB_ERRORS):
                for p in live:
                    held[p] = await held_by(store, fleet.names[p])
            busy = [p for p in live if held.get(p)]
            if not busy:
                return
            victim = rng.choice(busy)
            make_zombie(victim, held[victim], rng)
            zombie_due = False
        else:
            victim = rng.choice(live)
            kill(victim, rng, await holding(victim))

    chaos_over = asyncio.Event()

    async def slot_chaos(slot: int) -> None:
        """--kill-every: this slot's worker is hit on a seeded clock of its own."""
        assert kill_every is not None
        r = random.Random(f"{seed}:slot{slot}")
        due = False
        while not chaos_over.is_set():
            victim = fleet.serving(slot)
            if victim is None:  # the slot's replacement is not started yet
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(chaos_over.wait(), 0.1)
                continue
            # The clock starts once the worker has done work: each run of its first claim has
            # committed a step (or left it), waited for up to HOLD_WAIT_S (a worker with nothing
            # to claim is hit idle). A clock started at the previous kill lands most kills between
            # a claim and its first step (start-up eats the interval), and a run claimed
            # maxAttempts times in a row without a step is dead-lettered, rightly: the 15-minute
            # trial of that clock dead-lettered 759 of its 812 runs.
            waited = time.monotonic()
            first: set[str] | None = None
            while (
                not chaos_over.is_set()
                and victim in fleet.live()
                and time.monotonic() - waited < HOLD_WAIT_S
            ):
                if not first:
                    first = await holding(victim)
                elif await stepped(victim, first):
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(chaos_over.wait(), 0.1)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(chaos_over.wait(), r.uniform(0.5, 1.5) * kill_every)
            if chaos_over.is_set() or victim not in fleet.live():
                continue  # over, or it exited, or another task hit it meanwhile
            due = due or r.random() < sigstop_rate
            held = await holding(victim)
            if due:
                if held:  # a zombie worth the name holds runs; else the slot's next turn
                    make_zombie(victim, held, r)
                    due = False
            else:
                kill(victim, r, held)
            if kills is not None and report.kills >= kills:
                chaos_over.set()

    async def stepped(victim: Proc, runs: set[str]) -> bool:
        """Whether each of ``runs`` that ``victim`` still holds has committed a step since its
        claim (False: the database did not answer)."""
        with contextlib.suppress(*DB_ERRORS):
            async with store.pool.connection() as conn:
                cur = await conn.execute(
                    "SELECT count(*) FROM agent_run WHERE id = ANY(%s::uuid[])"
                    " AND status = 'running' AND lease_owner = %s AND next_seq <= claim_seq",
                    (list(runs), fleet.names[victim]),
                )
                row = await cur.fetchone()
                return bool(row and row[0] == 0)
        return False

    def db_up() -> bool:
        return outage is None or outage.done()

    with FakeAnthropicServer(path) as srv:
        env = {
            **os.environ,
            "AGENTRUN_DATABASE_URL": url,
            "LEDGER_DATABASE_URL": ledger,
            "ANTHROPIC_BASE_URL": srv.base_url,
            "ANTHROPIC_API_KEY": "soak",
        }
        fleet = _Fleet(env, logdir, concurrency, report, Zygote(env) if fork_workers else None)
        try:
            await submit(runs)
            fleet.top_up(workers)
            t_start = time.monotonic()
            deadline = t_start + seconds
            last_note = t_start
            slots: list[asyncio.Task[None]] = []
            if kill_every is not None:
                report.kills_per_slot = [0] * workers
                slots = [asyncio.create_task(slot_chaos(i)) for i in range(workers)]
            while time.monotonic() < deadline and not chaos_over.is_set():
                if kill_every is None:
                    await asyncio.sleep(rng.uniform(1.0, 4.0))
                else:  # the slots hit; this loop replaces the dead and keeps the runs coming
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(chaos_over.wait(), 0.25)
                if restart_at and restart_due(time.monotonic() - t_start) and db_up():
                    restart_at.pop(0)
                    outage = asyncio.create_task(restart(rng.uniform(0.5, 3.0)))
                if kill_every is None:
                    await chaos_step()
                    if kills is not None and report.kills >= kills:
                        chaos_over.set()
                fleet.top_up(workers)
                if not db_up():
                    continue  # the soak's own reads wait for the database like everyone's
                try:
                    report.decisions += await decide_waiting(store, ledger, fleet.alive)
                    left = await unfinished(store)
                    if continuous and left < runs:
                        await submit(runs - left)
                except DB_ERRORS as exc:
                    say(f"soak: database error ({type(exc).__name__}); going on")
                    continue
                if time.monotonic() - last_note > PROGRESS_EVERY_S:
                    last_note = time.monotonic()
                    took = time.monotonic() - t_start
                    say(
                        f"soak: {took:.0f} s, {report.kills}"
                        + (f"/{kills}" if kills is not None else "")
                        + f" kills ({report.kills / took:.2f}/s, "
                        f"{report.kills_holding_runs} holding runs), "
                        f"{report.terms} SIGTERMs, {report.zombies} zombies, "
                        f"{report.pg_restarts} PostgreSQL restarts, "
                        f"{submitted} runs submitted, {left} unfinished"
                    )
                if not left and not restart_at and not continuous:
                    break
            chaos_over.set()
            await asyncio.gather(*slots)
            if outage is not None:
                await outage
            # Calm: no more chaos (the zombies thaw as planned); let every run finish,
            # answering approvals as they come.
            calm = time.monotonic() + calm_s
            while time.monotonic() < calm:
                fleet.top_up(workers)
                try:
                    report.decisions += await decide_waiting(store, ledger, fleet.alive)
                    if not await unfinished(store) and all(z.done() for z in zombies):
                        break
                except DB_ERRORS:
                    pass
                await asyncio.sleep(0.5)
            fleet.top_up(0)  # count any last exits
        finally:
            if outage is not None and not outage.done():
                with contextlib.suppress(Exception):
                    await outage
            for z in zombies:
                z.cancel()
            await asyncio.gather(*zombies, return_exceptions=True)
            fleet.stop_all()
            await store.close()
    report = await check(url, report, ledger)
    if not report.ok:
        trace(logdir, report.problems)
    return report


def _share(value: str) -> float:
    share = float(value)
    if not 0 <= share <= 1:
        raise argparse.ArgumentTypeError(f"{value}: a share from 0 to 1")
    return share


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--runs", type=int, default=40, help="runs (in flight, with --continuous)")
    ap.add_argument("--seconds", type=float, default=120, help="how long the chaos goes on")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument(
        "--pg-restarts",
        type=int,
        default=2,
        help="PostgreSQL restarts during the chaos (default 2; 0 for none)",
    )
    ap.add_argument(
        "--sigstop-rate",
        type=_share,
        default=0.15,
        help="share of chaos steps that SIGSTOP a worker past its lease, making a zombie, "
        "instead of killing one (default 0.15; 0 for none)",
    )
    ap.add_argument(
        "--odd-payloads",
        type=_share,
        default=0.1,
        help="share of runs whose tools and model produce NUL bytes, lone surrogates, odd "
        "unicode or about 250 KB (default 0.1; 0 for none)",
    )
    ap.add_argument(
        "--continuous",
        action="store_true",
        help="keep --runs runs unfinished until --seconds is over (for a long soak)",
    )
    ap.add_argument("--workers", type=int, default=2, help="worker processes kept alive")
    ap.add_argument(
        "--kill-every",
        type=float,
        metavar="SECONDS",
        help="hit each worker slot on a clock of its own, about every SECONDS (0.5-1.5x, "
        "seeded), instead of one chaos step every 1-4 s for the fleet",
    )
    ap.add_argument(
        "--kills",
        type=int,
        metavar="N",
        help="end the chaos once N SIGKILLs were sent (or --seconds is over)",
    )
    ap.add_argument(
        "--fork-workers",
        action="store_true",
        help="fork each worker life from a parent that imported the worker's stack once "
        "(benchmarks/zygote.py) instead of exec'ing it: about 1.5 s of CPU less per life",
    )
    ap.add_argument("--concurrency", type=int, default=4, help="runs per worker")
    ap.add_argument("--delay-ms", type=int, default=30, help="scripted model latency per turn")
    ap.add_argument(
        "--calm",
        type=float,
        default=DEFAULT_CALM_S,
        help="after the chaos, the longest wait for every run to finish "
        f"(default {DEFAULT_CALM_S:g} s, at least {MIN_CALM_S:g} s)",
    )
    ap.add_argument(
        "--database-url",
        help="a migrated database with no runs yet, on a server the soak must not restart "
        "(needs --pg-restarts 0; default: the soak's own server)",
    )
    ap.add_argument(
        "--ledger-url",
        help="a database for the tools' ledger, on a server the soak does not restart "
        "(default: a second server of the soak's own, or the --database-url database)",
    )
    ap.add_argument("--check-only", action="store_true", help="only run the checker")
    args = ap.parse_args()
    if args.check_only:
        if not args.database_url:
            ap.error("--check-only needs --database-url")
        return _print(asyncio.run(check(args.database_url, ledger_url=args.ledger_url)))
    if args.kill_every is not None and args.kill_every <= 0:
        ap.error(f"--kill-every {args.kill_every}: must be a positive number of seconds")
    if args.kills is not None and args.kills < 1:
        ap.error(f"--kills {args.kills}: must be at least 1")
    if args.calm < MIN_CALM_S:
        ap.error(f"--calm {args.calm:g}: must be at least {MIN_CALM_S:g} s (an unknown outcome "
                 "waits out its tool timeout before the on-call decides it)")
    if args.database_url and args.pg_restarts:
        ap.error("--pg-restarts needs the soak's own PostgreSQL: drop --database-url, or pass 0")
    t0 = time.monotonic()
    # A worker SIGKILLed while sending a request makes the scripted server (in this process) log
    # a ConnectionResetError with its traceback: expected here, and noise.
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)

    def say(msg: str) -> None:
        print(f"[{time.monotonic() - t0:7.1f}s] {msg}", flush=True)

    with contextlib.ExitStack() as stack:
        pg: OwnPostgres | None = None
        kept: list[OwnPostgres] = []  # the servers a failed soak keeps the data of
        if args.database_url:
            url = args.database_url
        else:
            pg = stack.enter_context(OwnPostgres(settings={"max_connections": "200"}))
            kept.append(pg)
            say(f"own PostgreSQL server on port {pg.port} (pid {pg.pid}), data in {pg.root}")
            with psycopg.connect(pg.url(), autocommit=True) as conn:
                conn.execute("CREATE DATABASE agentrun_soak")
            url = pg.url("agentrun_soak")
        ledger_url = args.ledger_url
        if ledger_url is None and pg is not None:
            # The tools' "remote system", which the restarts must not take down with the store.
            lpg = stack.enter_context(OwnPostgres(settings={"max_connections": "200"}))
            kept.append(lpg)
            say(f"the tools' ledger on a server of its own, port {lpg.port} (pid {lpg.pid})")
            ledger_url = lpg.url()
        subprocess.run(
            [sys.executable, "-m", "agentrun", "migrate"],
            check=True,
            env={**os.environ, "AGENTRUN_DATABASE_URL": url},
            stdout=subprocess.DEVNULL,
        )
        logdir = Path(tempfile.mkdtemp(prefix="agentrun-soak-"))
        say(f"worker logs in {logdir}")
        report = asyncio.run(
            soak(
                url,
                args.runs,
                args.seconds,
                args.seed,
                logdir,
                delay_ms=args.delay_ms,
                concurrency=args.concurrency,
                workers=args.workers,
                pg=pg,
                pg_restarts=args.pg_restarts,
                sigstop_rate=args.sigstop_rate,
                odd_payloads=args.odd_payloads,
                continuous=args.continuous,
                calm_s=args.calm,
                progress=say,
                kill_every=args.kill_every,
                kills=args.kills,
                fork_workers=args.fork_workers,
                ledger_url=ledger_url,
            )
        )
        say(f"soak done in {time.monotonic() - t0:.0f} s")
        if not report.ok:
            for server in kept:
                server.keep = True  # stopped at the end, but not removed
                say(f"kept the data of the server on port {server.port} in {server.root}")
            say(f"the problem runs' lines of every life's log in {logdir / 'problems.log'}")
        return _print(report)


def trace(logdir: Path, problems: list[str]) -> Path:
    """Write ``problems.log``: every line of every life's log (archived or not) that names a run
    one of ``problems`` names, each as ``soak-N: line``, lives in order of start."""
    wanted = set(RUN_ID_RE.findall("\n".join(problems)))
    out = logdir / "problems.log"

    def lines() -> Iterator[tuple[str, str]]:
        if (logdir / ARCHIVE).exists():
            life = "?"
            with gzip.open(logdir / ARCHIVE, "rt", errors="replace") as gz:
                for line in gz:
                    if line.startswith("=== "):
                        life = line[4:].strip()
                    else:
                        yield life, line
        numbered = ((int(path.stem.removeprefix("worker-")), path)
                    for path in logdir.glob("worker-*.log"))
        for n, path in sorted(numbered):
            with open(path, errors="replace") as f:
                for line in f:
                    yield life_name(n), line

    with open(out, "w") as f:
        for life, line in lines():
            if wanted.intersection(RUN_ID_RE.findall(line)):
                f.write(f"{life}: {line}")
    return out


def _print(report: Report) -> int:
    for key, value in asdict(report).items():
        if key not in ("problems", "notes"):
            print(f"{key:22} {round(value, 1) if isinstance(value, float) else value}")
    for note in report.notes[:20]:
        print(f"NOTE: {note}")
    for problem in report.problems[:50]:
        print(f"PROBLEM: {problem}")
    print("soak: OK" if report.ok else "soak: FAILED")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
