"""Worker start-up: from ``exec`` of ``agentrun worker`` to its first claim, and to its first
committed model turn (issue 17: goal ≤ 0.5 s to the first claim).

    python -m benchmarks.startup_bench --rounds 8

Each round starts two real worker processes one after the other, each with one pending run in a
pool of its own, and reads the claim's time (``agent_run.started_at``, the claim statement's
``now()``) and the first step's commit time from the database, counted from the wall clock at
``Popen``: the same clock on one machine. The two:

* ``lazy``: ``agentrun worker`` as shipped (the SDK imported in a thread, off the claim path);
* ``eager`` (the baseline): the same command with the SDK imported first, before anything else:
  the order every worker had before issue 17.

Interleaved (eager, lazy, eager, ...) so that both see the same machine; the figures are medians
with min and max, and the ratio eager / lazy. Both start from bytecode, as an installed worker does:
the benchmark compiles a checkout's own modules first (benchmarks/bytecode.py; in an editable
checkout under PYTHONDONTWRITEBYTECODE=1 they were compiled from source at every start).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from agentrun.store import Store
from benchmarks.bytecode import compile_agentrun
from benchmarks.worker_bench import (
    AGENT,
    Progress,
    _quiet,
    fake_server,
    scenario,
    scenario_file,
    spawn_worker,
    stop_processes,
)

#: The baseline's interpreter prelude: import the SDK, then run the CLI exactly as `agentrun`.
EAGER = ["-c", "import anthropic, runpy; runpy.run_module('agentrun', run_name='__main__')"]


async def _one(store: Store, url: str, base_url: str, logdir: Path, variant: str, n: int
               ) -> tuple[float, float]:
    pool = f"startup-{variant}-{n}"
    run, _ = await store.create_run("start-up", AGENT, pool=pool)
    env = {"AGENTRUN_DATABASE_URL": url, "ANTHROPIC_BASE_URL": base_url,
           "ANTHROPIC_API_KEY": "bench"}
    t0 = time.time()
    proc = spawn_worker(f"su-{variant}-{n}", env, logdir, extra=["--pool", pool],
                        prelude=EAGER if variant == "eager" else None)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{variant} worker exited with {proc.returncode}: see "
                                   f"{logdir}/su-{variant}-{n}.log")
            steps = await store.steps(run.id)
            if steps:
                break
            await asyncio.sleep(0.01)
        claimed = await store.get_run(run.id)
        assert claimed.started_at is not None
        return claimed.started_at.timestamp() - t0, steps[0].created_at.timestamp() - t0
    finally:
        stop_processes([proc])


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


async def startup_bench(url: str, rounds: int = 8, progress: Progress = _quiet) -> dict[str, Any]:
    """``rounds`` interleaved pairs of worker starts; seconds from exec to claim and to the
    first committed model turn, for both variants. agentrun's modules are compiled to bytecode
    first, as an installed worker has them (benchmarks/bytecode.py)."""
    bytecode = compile_agentrun()
    out: dict[str, list[float]] = {k: [] for k in
                                   ("lazy_claim", "lazy_turn", "eager_claim", "eager_turn")}
    with tempfile.TemporaryDirectory(prefix="agentrun-startup-") as tmp:
        logdir = Path(tmp)
        path = scenario_file(logdir, "startup", scenario(1, thinking=False))
        with fake_server(path) as base_url:
            store = await Store.open(url, max_size=2)
            try:
                for n in range(rounds):
                    for variant in ("eager", "lazy"):
                        claim, turn = await _one(store, url, base_url, logdir, variant, n)
                        out[f"{variant}_claim"].append(claim)
                        out[f"{variant}_turn"].append(turn)
                    progress(f"start-up round {n + 1}/{rounds}: claim {out['lazy_claim'][-1]:.2f}"
                             f" s (eager {out['eager_claim'][-1]:.2f} s)")
            finally:
                await store.close()
    res: dict[str, Any] = {"rounds": rounds, "bytecode": bytecode,
                           **{k: _stats(v) for k, v in out.items()}}
    res["claim_ratio_eager_over_lazy"] = (res["eager_claim"]["median"]
                                          / res["lazy_claim"]["median"])
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--database-url", help="a migrated database (default: a throwaway one)")
    args = ap.parse_args()
    from benchmarks.throwaway_db import throwaway_database

    def say(msg: str) -> None:
        print(msg, flush=True)

    if args.database_url:
        res = asyncio.run(startup_bench(args.database_url, args.rounds, say))
    else:
        with throwaway_database("agentrun_su") as url:
            res = asyncio.run(startup_bench(url, args.rounds, say))
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
