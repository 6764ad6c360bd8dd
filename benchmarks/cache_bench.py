"""Prompt-caching benchmark: what a long scripted run costs with caching, without, and resumed.

    python -m benchmarks.cache_bench [--turns 30] [--admin-url URL] [--json FILE]

Three runs of the same ``turns``-turn agent (a tool call every turn, a system prompt and tool
definitions of a realistic size), each through real ``agentrun worker`` processes and the
scripted server (agentrun fake-anthropic), whose prompt cache accounts tokens as the API does
(docs/fake-anthropic.md):

* ``cached``: spec.promptCaching on (the default);
* ``uncached``: spec.promptCaching off;
* ``resumed``: caching on, and the first worker SIGKILLs itself in the middle of the turn at half
  way (after that turn's request was sent); a second worker takes the run over and re-does it.

Figures are billed tokens: every request the server answered, so the resumed run also pays for
the turn the dead worker never committed. The cost is estimated with agentrun.pricing (the public
price ratios: cache write 1.25x input, cache read 0.1x input). Importable: :func:`cache_bench`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from agentrun.fake_anthropic import FakeAnthropicServer
from agentrun.fake_anthropic.scenario import parse_scenario
from agentrun.manifests import AgentSpec
from agentrun.pricing import cost_usd
from agentrun.store import Store
from benchmarks.scratch import scratch_dir
from benchmarks.throwaway_db import throwaway_database
from benchmarks.worker_bench import spawn_worker

MODEL = "claude-sonnet-4-5"
KINDS = ("input", "cache_read", "cache_write", "output")
USAGE_FIELDS = {
    "input": "input_tokens",
    "cache_read": "cache_read_input_tokens",
    "cache_write": "cache_creation_input_tokens",
    "output": "output_tokens",
}
# A system prompt and tool results of a size agents have (a few thousand characters each), so
# the history, not the fixed prefix, grows the prompt.
SYSTEM = "You are a careful operator. " + "Follow the runbook step by step. " * 60
RESULT_TEXT = "observed state: " + "ok " * 300


def scenario(turns: int) -> dict[str, Any]:
    script = []
    for i in range(turns):
        content: list[dict[str, Any]] = [{"text": f"step {i}: checking the next item"}]
        if i < turns - 1:
            content.append({"tool_use": {"name": "echo", "input": {"text": f"{i} {RESULT_TEXT}"}}})
        script.append({"content": content})
    return {"name": "cache-bench", "scripts": [{"name": "cache-bench", "turns": script}]}


def billed(srv: FakeAnthropicServer) -> dict[str, int]:
    out = dict.fromkeys(KINDS, 0)
    for entry in srv.requests():
        usage = entry.get("usage")
        if entry.get("status") == 200 and usage:
            for kind in KINDS:
                out[kind] += usage[USAGE_FIELDS[kind]]
    return out


async def wait_finished(store: Store, rid: Any, within: float) -> Any:
    deadline = time.monotonic() + within
    while True:
        run = await store.get_run(rid)
        if run.finished:
            return run
        if time.monotonic() > deadline:
            raise TimeoutError(f"run {rid} not finished within {within:.0f}s: {run.status}")
        await asyncio.sleep(0.1)


async def one_run(url: str, turns: int, how: str, logdir: Path) -> dict[str, Any]:
    agent = AgentSpec(model=MODEL, system=SYSTEM, tools=["echo"], maxTokens=1024,
                      promptCaching=how != "uncached")
    procs: list[subprocess.Popen[bytes]] = []
    store = await Store.open(url, max_size=2)
    try:
        # A server per run: its cache starts empty, as a provider's does for a new prefix.
        with FakeAnthropicServer(parse_scenario(scenario(turns))) as srv:
            env = {
                "AGENTRUN_DATABASE_URL": url,
                "ANTHROPIC_BASE_URL": srv.base_url,
                "ANTHROPIC_API_KEY": "bench",
            }
            run, _ = await store.create_run("cache bench", agent, max_steps=turns + 1)
            if how == "resumed":
                # Turn k is seq 2k: the first worker dies as the middle turn streams.
                kill_seq = 2 * (turns // 2)
                first = spawn_worker(f"{how}-a", {**env, "AGENTRUN_TEST_FAULTS":
                                                  f"mid_model_stream@{kill_seq}"},
                                     logdir, ttl=2, poll=0.2)
                procs.append(first)
                code = await asyncio.to_thread(first.wait, 120)
                if code != -signal.SIGKILL:
                    raise RuntimeError(f"worker {how}-a exited {code}, not by its SIGKILL fault")
            procs.append(spawn_worker(f"{how}-b", env, logdir, ttl=2, poll=0.2))
            done = await wait_finished(store, run.id, 300)
            if done.status != "succeeded":
                raise RuntimeError(f"{how} run ended {done.status}: {done.error}")
            tokens = billed(srv)
            requests = sum(1 for e in srv.requests() if e.get("status") == 200)
        recorded = {
            "input": done.input_tokens,
            "cache_read": done.cache_read_tokens,
            "cache_write": done.cache_write_tokens,
            "output": done.output_tokens,
        }
    finally:
        await store.close()
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    return {
        "requests": requests,
        "billed": tokens,
        "recorded": recorded,
        "cost_usd": cost_usd(MODEL, tokens),
    }


async def cache_bench(url: str, turns: int) -> dict[str, Any]:
    with scratch_dir("agentrun-cache-bench-") as logdir:
        out: dict[str, Any] = {"turns": turns, "model": MODEL}
        for how in ("cached", "uncached", "resumed"):
            out[how] = await one_run(url, turns, how, logdir)
        out["cached_over_uncached"] = out["cached"]["cost_usd"] / out["uncached"]["cost_usd"]
        out["resumed_over_uncached"] = out["resumed"]["cost_usd"] / out["uncached"]["cost_usd"]
        return out


def report(result: dict[str, Any]) -> str:
    lines = [
        f"{result['turns']}-turn scripted run, {result['model']} prices (agentrun.pricing)",
        f"{'run':<10}{'requests':>9}{'input':>10}{'cache read':>12}{'cache write':>13}"
        f"{'output':>9}{'cost USD':>11}",
    ]
    for how in ("cached", "uncached", "resumed"):
        r = result[how]
        t = r["billed"]
        lines.append(
            f"{how:<10}{r['requests']:>9}{t['input']:>10}{t['cache_read']:>12}"
            f"{t['cache_write']:>13}{t['output']:>9}{r['cost_usd']:>11.4f}"
        )
    lines.append(f"cost cached/uncached: {result['cached_over_uncached']:.3f}")
    lines.append(f"cost resumed/uncached: {result['resumed_over_uncached']:.3f}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--admin-url", default=None)
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
    with throwaway_database("cache_bench", args.admin_url) as url:
        result = asyncio.run(cache_bench(url, args.turns))
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
