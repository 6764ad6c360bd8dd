"""Worker benchmark: what durability costs per step, and how fast a run resumes.

    python benchmarks/worker_bench.py [--turns 30] [--repeat 3] [--admin-url URL]

1. Per-step time with a zero-latency scripted model (agentrun fake-anthropic, in this process):
   the seed's plain in-memory loop (messages in a Python list) next to agentrun's durable loop
   (RunExecutor: rebuild from the log, commit each turn and each tool result, fenced). Same SDK
   streaming call, same tools, same server, same process; the difference is the cost of
   durability. Goal: under 2 ms a step.
2. Resume latency: a worker process is SIGKILLed (another resumes after the lease expires; goal:
   lease TTL + under 1 s) or SIGTERMed (it releases; goal: under 1 s).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import yaml

from agentrun.manifests import AgentSpec
from agentrun.store import Store
from agentrun.tools import ToolContext, default_registry, make_context, tool
from agentrun.worker.executor import RunExecutor, RunHandle
from agentrun.worker.health import Health, WorkerMetrics
from agentrun.worker.model_call import RetryPolicy, build_request

sys.path.insert(0, str(Path(__file__).parent))
from throwaway_db import throwaway_database

# The worker processes of the resume benchmark load this file with --tools, so echo lives in the
# default registry, as a user's tool would.
REGISTRY = default_registry


@tool(kind="pure")
def echo(ctx: ToolContext, text: str) -> str:
    """Echo the text back."""
    return text


def scenario(turns: int, delay_ms: int = 0, thinking: bool = True) -> dict[str, Any]:
    script = []
    for i in range(turns):
        content: list[dict[str, Any]] = [{"thinking": f"turn {i}"}] if thinking else []
        content.append({"text": f"step {i}"})
        if i < turns - 1:
            content.append({"tool_use": {"name": "echo", "input": {"text": f"t{i}"}}})
        script.append({"content": content})
    return {"name": "bench", "delay_ms": delay_ms, "scripts": [{"name": "bench", "turns": script}]}


AGENT = AgentSpec(model="bench-model", system="bench", tools=["echo"], maxTokens=1024)


async def in_memory_loop(client: anthropic.AsyncAnthropic, task: str) -> int:
    """The seed's loop, verbatim in spirit: the conversation lives in a list in this process."""
    pv = prompt_for_agent()
    messages: list[dict[str, Any]] = [{"role": "user", "content": task}]
    turns = 0
    while True:
        async with client.messages.stream(**build_request(pv, messages)) as stream:
            message = await stream.get_final_message()
        turns += 1
        content = message.to_dict()["content"]
        messages.append({"role": "assistant", "content": content})
        if message.stop_reason != "tool_use":
            return turns
        results = []
        for block in content:
            if block["type"] == "tool_use":
                ctx = make_context("mem", turns, 0, "echo", block["input"])
                out = echo(ctx, **block["input"])
                results.append({"type": "tool_result", "tool_use_id": block["id"], "content": out})
        messages.append({"role": "user", "content": results})


def prompt_for_agent() -> Any:
    from agentrun.store import PromptVersion

    return PromptVersion(
        model=AGENT.model,
        system=AGENT.system,
        tools=REGISTRY.definitions(["echo"]),
        params={"max_tokens": 1024},
    )


async def durable_loop(store: Store, executor: RunExecutor, task: str) -> int:
    run, _ = await store.create_run(task, AGENT, pool="bench")
    ((claimed, lease),) = (await store.claim("bench", "bench-worker", 1, ttl=60)).claimed
    await executor.advance(RunHandle(claimed, lease))
    return sum(1 for s in await store.steps(run.id) if s.kind == "model_turn")


async def per_step(url: str, base_url: str, turns: int, repeat: int) -> dict[str, float]:
    client = anthropic.AsyncAnthropic(base_url=base_url, api_key="bench", max_retries=0)
    store = await Store.open(url, max_size=4)
    metrics = WorkerMetrics()
    executor = RunExecutor(
        store,
        client,
        REGISTRY,
        metrics,
        Health(60, metrics),
        RetryPolicy(),
        is_draining=lambda: False,
    )
    mem: list[float] = []
    dur: list[float] = []
    try:
        await in_memory_loop(client, "warm up")
        await durable_loop(store, executor, "warm up")
        for _ in range(repeat):
            t0 = time.perf_counter()
            n = await in_memory_loop(client, "in memory")
            mem.append((time.perf_counter() - t0) * 1000 / n)
            t0 = time.perf_counter()
            n = await durable_loop(store, executor, "durable")
            dur.append((time.perf_counter() - t0) * 1000 / n)
    finally:
        await store.close()
        await client.close()
    m, d = statistics.median(mem), statistics.median(dur)
    return {
        "in_memory_ms_per_step": m,
        "durable_ms_per_step": d,
        "cost_ms_per_step": d - m,
        "ratio": d / m,
    }


def spawn(name: str, env: dict[str, str], ttl: float, poll: float, logdir: Path) -> Any:
    log = open(logdir / f"{name}.log", "wb")
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agentrun",
            "worker",
            "--tools",
            __file__,
            "--worker-id",
            name,
            "--lease-ttl",
            str(ttl),
            "--poll-interval",
            str(poll),
            "--health-port",
            "-1",
        ],
        env={**os.environ, **env},
        stdout=log,
        stderr=subprocess.STDOUT,
    )


async def wait_owner(store: Store, rid: Any, owner: str, within: float = 60) -> float:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        run = await store.get_run(rid)
        if run.lease_owner == owner:
            return time.monotonic()
        await asyncio.sleep(0.005)
    raise TimeoutError(f"{owner} never claimed {rid}")


async def resume(url: str, base_url: str, ttl: float) -> dict[str, float]:
    env = {
        "AGENTRUN_DATABASE_URL": url,
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": "bench",
    }
    logdir = Path(tempfile.mkdtemp(prefix="agentrun-bench-"))
    procs: list[Any] = []
    out: dict[str, float] = {}
    store = await Store.open(url, max_size=2)
    try:
        for how in ("sigkill", "sigterm"):
            run, _ = await store.create_run(f"resume after {how}", AGENT, pool="default")
            a = spawn(f"{how}-a", env, ttl, 30, logdir)
            procs.append(a)
            await wait_owner(store, run.id, f"{how}-a")
            b = spawn(f"{how}-b", env, ttl, 30, logdir)
            procs.append(b)
            await asyncio.sleep(5)  # b imports the SDK and starts listening
            await wait_run_step(store, run.id)
            before = await store.get_run(run.id)
            t0 = time.monotonic()
            a.send_signal(signal.SIGKILL if how == "sigkill" else signal.SIGTERM)
            t1 = await wait_owner(store, run.id, f"{how}-b")
            out[f"{how}_resume_s"] = t1 - t0
            if how == "sigkill" and before.lease_until is not None:
                # How long after a's lease ran out did b take the run over (database clock)?
                seen = await current_db_time(store)
                out["sigkill_after_lease_expiry_s"] = seen - before.lease_until.timestamp()
            try:
                a.wait(10)
            except subprocess.TimeoutExpired:
                a.send_signal(signal.SIGUSR1)
                await asyncio.sleep(1)
                raise
            await store.cancel(run.id)  # each phase leaves nothing behind for the next
            b.send_signal(signal.SIGTERM)
            b.wait(30)
    finally:
        await store.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    out["lease_ttl_s"] = ttl
    return out


async def wait_run_step(store: Store, rid: Any) -> None:
    deadline = time.monotonic() + 30
    while (await store.get_run(rid)).next_seq < 2 and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.01)


async def current_db_time(store: Store) -> float:
    async with store.pool.connection() as conn:
        cur = await conn.execute("SELECT extract(epoch FROM clock_timestamp())")
        row = await cur.fetchone()
    return float(row[0]) if row else time.time()


@contextlib.contextmanager
def fake_server(scenario_path: Path) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agentrun.fake_anthropic",
            "--scenario",
            str(scenario_path),
            "--port",
            str(port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert proc.stdout is not None
        proc.stdout.readline()  # "fake-anthropic listening on ..."
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--turns", type=int, default=30)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--lease-ttl", type=float, default=5.0)
    ap.add_argument("--admin-url")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    fast_path, slow_path = tmp / "fast.yaml", tmp / "slow.yaml"
    plain_path = tmp / "plain.yaml"
    fast_path.write_text(yaml.safe_dump(scenario(args.turns)))
    plain_path.write_text(yaml.safe_dump(scenario(args.turns, thinking=False)))
    slow_path.write_text(yaml.safe_dump(scenario(200, delay_ms=300)))
    with throwaway_database("agentrun_wbench", args.admin_url) as url:

        async def run() -> tuple[dict[str, float], dict[str, float]]:
            # The scripted model runs in a process of its own, as a real provider would: in this
            # process its thread would compete with the loop under test for the GIL.
            with fake_server(fast_path) as fast:
                steps = await per_step(url, fast, args.turns, args.repeat)
            # Without thinking blocks the scripted server checks no signatures, so it burns
            # far less CPU beside PostgreSQL on a small machine: a cleaner view of our own cost.
            with fake_server(plain_path) as plain:
                plain_steps = await per_step(url, plain, args.turns, args.repeat)
            steps.update({f"plain_{k}": v for k, v in plain_steps.items()})
            with fake_server(slow_path) as slow:
                res = await resume(url, slow, args.lease_ttl)
            return steps, res

        steps, res = asyncio.run(run())
        print(
            f"worker benchmark: {os.cpu_count()} cores, python {sys.version.split()[0]}, "
            f"{args.turns} turns x {args.repeat} runs, zero-latency scripted model"
        )
        print(f"  in-memory loop (the seed's)   {steps['in_memory_ms_per_step']:7.2f} ms/step")
        print(f"  durable loop (agentrun)       {steps['durable_ms_per_step']:7.2f} ms/step")
        print(
            f"  cost of durability            {steps['cost_ms_per_step']:7.2f} ms/step "
            f"(ratio {steps['ratio']:.2f}x; goal < 2 ms)"
        )
        print(
            f"  without thinking blocks: in-memory {steps['plain_in_memory_ms_per_step']:.2f}, "
            f"durable {steps['plain_durable_ms_per_step']:.2f}, cost "
            f"{steps['plain_cost_ms_per_step']:.2f} ms/step (ratio {steps['plain_ratio']:.2f}x)"
        )
        print(
            f"  resume after SIGKILL          {res['sigkill_resume_s']:7.2f} s "
            f"(lease TTL {res['lease_ttl_s']:.0f} s; goal TTL + < 1 s)"
        )
        if "sigkill_after_lease_expiry_s" in res:
            print(f"    of which after lease expiry {res['sigkill_after_lease_expiry_s']:7.2f} s")
        print(f"  resume after SIGTERM          {res['sigterm_resume_s']:7.2f} s (goal < 1 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
