"""Worker benchmark: the cost of durability per step, resume latency and cancel latency.

    python -m benchmarks.worker_bench [--turns 30] [--repeat 3] [--admin-url URL] [--json FILE]

1. Per-step time with a zero-latency scripted model (agentrun fake-anthropic, in a process of its
   own): the seed's plain in-memory loop (messages in a Python list) next to agentrun's durable
   loop (RunExecutor: rebuild from the log, commit each turn and each tool result, fenced). Same
   SDK streaming call, same tools, same server, same process; the difference is the cost of
   durability. Goal: under 2 ms a step.
2. Resume latency: a worker process is SIGKILLed (another resumes after the lease expires; goal:
   lease TTL + under 1 s) or SIGTERMed (it releases; goal: under 1 s).
3. Cancel latency: a worker process is in the middle of a slow streamed model call when
   ``Store.cancel`` is called; measured until the scripted server sees the stream dropped and until
   the worker's ``agentrun_active_runs`` gauge says it let go of the run. Goal: under 1 s.

Importable: :func:`per_step_bench`, :func:`resume_bench` and :func:`cancel_bench` return dicts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import yaml

from agentrun.fake_anthropic import FakeAnthropicServer
from agentrun.manifests import AgentSpec
from agentrun.store import Store
from agentrun.tools import default_registry, make_context
from agentrun.worker.executor import RunExecutor, RunHandle
from agentrun.worker.health import Health, WorkerMetrics
from agentrun.worker.model_call import RetryPolicy, build_request
from agentrun.worker.providers import Providers
from benchmarks.bench_tools import echo
from benchmarks.throwaway_db import throwaway_database

REGISTRY = default_registry
#: The worker processes load the echo tool from this file.
TOOLS_FILE = str(Path(__file__).resolve().parent / "bench_tools.py")
Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


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
    await executor.advance(RunHandle(claimed, lease, lease_ttl=60))
    return sum(1 for s in await store.steps(run.id) if s.kind == "model_turn")


async def per_step(url: str, base_url: str, turns: int, repeat: int) -> dict[str, float]:
    client = anthropic.AsyncAnthropic(base_url=base_url, api_key="bench", max_retries=0)
    store = await Store.open(url, max_size=4)
    metrics = WorkerMetrics()
    executor = RunExecutor(
        store,
        Providers(default=client),
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


def spawn_worker(
    name: str,
    env: dict[str, str],
    logdir: Path,
    *,
    ttl: float = 15,
    poll: float = 5,
    concurrency: int = 4,
    health_port: int = -1,
    extra: list[str] | None = None,
    prelude: list[str] | None = None,
) -> subprocess.Popen[bytes]:
    """A real ``agentrun worker`` process with the bench tools; the caller stops it by pid.
    ``prelude``: the interpreter's arguments before ``worker`` (default ``-m agentrun``)."""
    with open(logdir / f"{name}.log", "wb") as log:
        return subprocess.Popen(
            [
                sys.executable,
                *(prelude or ["-m", "agentrun"]),
                "worker",
                "--tools",
                TOOLS_FILE,
                "--worker-id",
                name,
                "--lease-ttl",
                str(ttl),
                "--poll-interval",
                str(poll),
                "--concurrency",
                str(concurrency),
                "--health-port",
                str(health_port),
                "--control-port",
                "-1",
                *(extra or []),
            ],
            env={**os.environ, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=tempfile.gettempdir(),
        )


def stop_processes(procs: list[subprocess.Popen[bytes]], grace: float = 10) -> None:
    """SIGTERM every live process (by pid), SIGKILL what is still alive after ``grace``."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def http_get(port: int, path: str, timeout: float = 2) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return 0, ""


async def wait_ready(proc: subprocess.Popen[bytes], port: int, within: float = 60) -> float:
    """Wait until the worker's /readyz says 200; return how long that took."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within:
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited with {proc.returncode} before it was ready")
        status, _ = await asyncio.to_thread(http_get, port, "/readyz", 0.5)
        if status == 200:
            return time.monotonic() - t0
        await asyncio.sleep(0.1)
    raise TimeoutError("worker not ready")


def gauge(metrics_text: str, name: str) -> float | None:
    for line in metrics_text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


async def wait_owner(store: Store, rid: Any, owner: str, within: float = 60) -> float:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        run = await store.get_run(rid)
        if run.lease_owner == owner:
            return time.monotonic()
        await asyncio.sleep(0.005)
    raise TimeoutError(f"{owner} never claimed {rid}")


async def resume(
    url: str, base_url: str, ttl: float, progress: Progress = _quiet
) -> dict[str, float]:
    env = {
        "AGENTRUN_DATABASE_URL": url,
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": "bench",
    }
    logdir = Path(tempfile.mkdtemp(prefix="agentrun-bench-"))
    procs: list[subprocess.Popen[bytes]] = []
    out: dict[str, float] = {}
    store = await Store.open(url, max_size=2)
    try:
        for how in ("sigkill", "sigterm"):
            run, _ = await store.create_run(f"resume after {how}", AGENT, pool="default")
            a = spawn_worker(f"{how}-a", env, logdir, ttl=ttl, poll=30)
            procs.append(a)
            await wait_owner(store, run.id, f"{how}-a")
            port = free_port()
            b = spawn_worker(f"{how}-b", env, logdir, ttl=ttl, poll=30, health_port=port)
            procs.append(b)
            await wait_ready(b, port)  # b imported the SDK and serves
            await asyncio.sleep(0.5)  # and its listener is connected
            await wait_run_step(store, run.id)
            before = await store.get_run(run.id)
            t0 = time.monotonic()
            a.send_signal(signal.SIGKILL if how == "sigkill" else signal.SIGTERM)
            t1 = await wait_owner(store, run.id, f"{how}-b")
            out[f"{how}_resume_s"] = t1 - t0
            progress(f"resume after {how.upper()}: {t1 - t0:.2f} s")
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


def cancel_scenario() -> dict[str, Any]:
    """Turn 0 streams for about 15 s (1,500 events of 32 characters, 10 ms apart), so the cancel
    always lands mid-stream; the server notices a dropped client at its next write."""
    text = [{"text": "x" * 32 * 100} for _ in range(15)]
    turns = [
        {"content": [{"thinking": "slow"}, *text, {"tool_use": {"name": "echo", "input": {}}}],
         "stream_delay_ms": 10},
        {"content": [{"text": "done"}]},
    ]  # fmt: skip
    return {"name": "cancel", "scripts": [{"name": "cancel", "turns": turns}]}


async def cancel(url: str, repeat: int = 3, progress: Progress = _quiet) -> dict[str, Any]:
    """Cancel a run mid model call, ``repeat`` times, against one real worker process."""
    logdir = Path(tempfile.mkdtemp(prefix="agentrun-bench-cancel-"))
    path = logdir / "cancel.yaml"
    path.write_text(yaml.safe_dump(cancel_scenario()))
    store = await Store.open(url, max_size=2)
    aborted: list[float] = []
    released: list[float] = []
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with FakeAnthropicServer(path) as srv:
            env = {
                "AGENTRUN_DATABASE_URL": url,
                "ANTHROPIC_BASE_URL": srv.base_url,
                "ANTHROPIC_API_KEY": "bench",
            }
            port = free_port()
            w = spawn_worker("cancel-w", env, logdir, ttl=30, poll=30, health_port=port)
            procs.append(w)
            await wait_ready(w, port)

            def count(key: str) -> int:
                return sum(1 for e in srv.requests() if e.get(key))

            for i in range(repeat):
                calls = sum(1 for e in srv.requests() if e.get("turn") == 0)
                drops = count("disconnected")
                run, _ = await store.create_run(f"cancel {i}", AGENT)
                deadline = time.monotonic() + 30
                while sum(1 for e in srv.requests() if e.get("turn") == 0) <= calls:
                    if time.monotonic() > deadline:
                        raise TimeoutError("the model call never started")
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.5)  # well into the stream
                t0 = time.monotonic()
                await store.cancel(run.id)
                t_abort = t_release = None
                while (t_abort is None or t_release is None) and time.monotonic() - t0 < 10:
                    if t_abort is None and count("disconnected") > drops:
                        t_abort = time.monotonic() - t0
                    if t_release is None:
                        _, text = await asyncio.to_thread(http_get, port, "/metrics", 1)
                        if gauge(text, "agentrun_active_runs") == 0:
                            t_release = time.monotonic() - t0
                    await asyncio.sleep(0.005)
                if t_abort is None or t_release is None:
                    raise TimeoutError("the cancel never landed")
                aborted.append(t_abort)
                released.append(t_release)
                progress(f"cancel {i + 1}/{repeat}: stream dropped after {t_abort * 1000:.0f} ms")
            if w.poll() is not None:
                raise RuntimeError("the worker died during the cancel benchmark")
    finally:
        stop_processes(procs)
        await store.close()
    return {
        "cancel_to_stream_aborted_s": statistics.median(aborted),
        "cancel_to_run_released_s": statistics.median(released),
        "cancel_samples_s": aborted,
        "cancel_repeat": repeat,
    }


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


def scenario_file(directory: Path, name: str, data: dict[str, Any]) -> Path:
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


async def per_step_bench(
    url: str, turns: int = 30, repeat: int = 3, progress: Progress = _quiet
) -> dict[str, float]:
    """Durable vs in-memory ms per step, with and without thinking blocks."""
    tmp = Path(tempfile.mkdtemp(prefix="agentrun-bench-"))
    # The scripted model runs in a process of its own, as a real provider would: in this
    # process its thread would compete with the loop under test for the GIL.
    with fake_server(scenario_file(tmp, "fast", scenario(turns))) as fast:
        steps = await per_step(url, fast, turns, repeat)
    progress(
        f"per step: in-memory {steps['in_memory_ms_per_step']:.2f} ms, "
        f"durable {steps['durable_ms_per_step']:.2f} ms"
    )
    # Without thinking blocks the scripted server checks no signatures, so it burns far less CPU
    # beside PostgreSQL on a small machine: a cleaner view of our own cost.
    with fake_server(scenario_file(tmp, "plain", scenario(turns, thinking=False))) as plain:
        plain_steps = await per_step(url, plain, turns, repeat)
    steps.update({f"plain_{k}": v for k, v in plain_steps.items()})
    steps.update(turns=turns, repeat=repeat)
    progress(
        f"per step without thinking: in-memory {plain_steps['in_memory_ms_per_step']:.2f} ms, "
        f"durable {plain_steps['durable_ms_per_step']:.2f} ms"
    )
    return steps


async def resume_bench(
    url: str, lease_ttl: float = 5.0, progress: Progress = _quiet
) -> dict[str, float]:
    """Resume latency after SIGKILL and SIGTERM of a real worker process."""
    tmp = Path(tempfile.mkdtemp(prefix="agentrun-bench-"))
    with fake_server(scenario_file(tmp, "slow", scenario(200, delay_ms=300))) as slow:
        return await resume(url, slow, lease_ttl, progress)


async def cancel_bench(url: str, repeat: int = 3, progress: Progress = _quiet) -> dict[str, Any]:
    return await cancel(url, repeat, progress)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--turns", type=int, default=30)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--lease-ttl", type=float, default=5.0)
    ap.add_argument("--admin-url")
    ap.add_argument("--json", help="also write the results to this JSON file")
    args = ap.parse_args()
    with throwaway_database("agentrun_wbench", args.admin_url) as url:

        async def run() -> dict[str, Any]:
            out: dict[str, Any] = {}
            out.update(await per_step_bench(url, args.turns, args.repeat))
            out.update(await resume_bench(url, args.lease_ttl))
            out.update(await cancel_bench(url))
            return out

        r = asyncio.run(run())
    print(
        f"worker benchmark: {os.cpu_count()} cores, python {sys.version.split()[0]}, "
        f"{args.turns} turns x {args.repeat} runs, zero-latency scripted model"
    )
    print(f"  in-memory loop (the seed's)   {r['in_memory_ms_per_step']:7.2f} ms/step")
    print(f"  durable loop (agentrun)       {r['durable_ms_per_step']:7.2f} ms/step")
    print(
        f"  cost of durability            {r['cost_ms_per_step']:7.2f} ms/step "
        f"(ratio {r['ratio']:.2f}x; goal < 2 ms)"
    )
    print(
        f"  without thinking blocks: in-memory {r['plain_in_memory_ms_per_step']:.2f}, "
        f"durable {r['plain_durable_ms_per_step']:.2f}, cost "
        f"{r['plain_cost_ms_per_step']:.2f} ms/step (ratio {r['plain_ratio']:.2f}x)"
    )
    print(
        f"  resume after SIGKILL          {r['sigkill_resume_s']:7.2f} s "
        f"(lease TTL {r['lease_ttl_s']:.0f} s; goal TTL + < 1 s)"
    )
    if "sigkill_after_lease_expiry_s" in r:
        print(f"    of which after lease expiry {r['sigkill_after_lease_expiry_s']:7.2f} s")
    print(f"  resume after SIGTERM          {r['sigterm_resume_s']:7.2f} s (goal < 1 s)")
    print(
        f"  cancel to aborted model call  {r['cancel_to_stream_aborted_s'] * 1000:7.0f} ms; "
        f"worker let go after {r['cancel_to_run_released_s'] * 1000:.0f} ms (goal < 1 s)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
