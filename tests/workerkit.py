"""Helpers for tests that run real worker processes against the scripted model server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import yaml

from agentrun.fake_anthropic import FakeAnthropicServer
from agentrun.manifests import AgentSpec, ThinkingSpec
from agentrun.store import Run, Store
from agentrun.tools import ToolRegistry
from agentrun.worker.executor import RunExecutor, RunHandle
from agentrun.worker.health import Health, WorkerMetrics
from agentrun.worker.providers import Providers
from agentrun.worker.settings import RetryPolicy

TOOLS_DIR = Path(__file__).parent / "tool_modules"

AGENT = AgentSpec(
    model="claude-sonnet-4-5",
    system="You echo carefully.",
    tools=["echo"],
    thinking=ThinkingSpec(budgetTokens=1024),
)

FakeFactory = Callable[[dict[str, Any]], FakeAnthropicServer]


def echo_scenario(
    turns: int,
    *,
    name: str = "echo",
    slow: dict[int, int] | None = None,
    faults: dict[int, list[dict[str, Any]]] | None = None,
    models: list[str] | None = None,
    long_text: dict[int, int] | None = None,
    delay_ms: int = 0,
) -> dict[str, Any]:
    """``turns`` model turns: each but the last thinks, says something and calls echo; the last
    answers. ``slow`` maps turn -> stream_delay_ms; ``long_text`` turn -> extra text blocks."""
    script: list[dict[str, Any]] = []
    for i in range(turns):
        content: list[dict[str, Any]] = [{"thinking": f"Turn {i}: what next?"}]
        content += [
            {"text": f"chunk {k} of turn {i}. " * 4} for k in range((long_text or {}).get(i, 0))
        ]
        if i < turns - 1:
            content += [
                {"text": f"Step {i}."},
                {"tool_use": {"name": "echo", "input": {"text": f"t{i}"}}},
            ]
        else:
            content += [{"text": f"All {turns} turns done."}]
        turn: dict[str, Any] = {"content": content}
        if slow and i in slow:
            turn["stream_delay_ms"] = slow[i]
        if faults and i in faults:
            turn["faults"] = faults[i]
        script.append(turn)
    scenario: dict[str, Any] = {"name": name, "scripts": [{"name": name, "turns": script}]}
    if models:
        scenario["models"] = models
    if delay_ms:
        scenario["delay_ms"] = delay_ms
    return scenario


def write_scenario(tmp: Path, scenario: dict[str, Any]) -> Path:
    path = tmp / "scenario.yaml"
    path.write_text(yaml.safe_dump(scenario))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class WorkerProc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    health_port: int | None
    control_port: int | None = None  # the loopback-only /drain (agentrun drain-local --port)

    def signal(self, sig: signal.Signals) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)

    def wait(self, within: float = 30) -> int:
        return self.popen.wait(within)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def json_lines(self) -> list[dict[str, Any]]:
        out = []
        for line in self.output().splitlines():
            if line.startswith("{"):
                out.append(json.loads(line))
        return out


@dataclass
class Workers:
    """Starts ``agentrun worker`` processes; every one is stopped by its pid at teardown."""

    env: dict[str, str]
    tmp: Path
    procs: list[WorkerProc] = field(default_factory=list)

    def start(
        self,
        name: str,
        *,
        tools: str = "echo_v1.py",
        faults: str = "",
        lease_ttl: float = 2,
        poll: float = 0.5,
        health: bool = False,
        extra: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> WorkerProc:
        port = free_port() if health else None
        control = free_port() if health else None  # never the default: tests run side by side
        cmd = [
            sys.executable,
            "-m",
            "agentrun",
            "worker",
            "--tools",
            str(TOOLS_DIR / tools),
            "--worker-id",
            name,
            "--lease-ttl",
            str(lease_ttl),
            "--poll-interval",
            str(poll),
            "--health-port",
            str(port if port else -1),
            "--control-port",
            str(control if control else -1),
            "--log-format",
            "json",
            *(extra or []),
        ]
        full_env = {**os.environ, **self.env, **(env or {})}
        if faults:
            full_env["AGENTRUN_TEST_FAULTS"] = faults
        log = self.tmp / f"{name}.log"
        with open(log, "wb") as out:
            popen = subprocess.Popen(
                cmd,
                env=full_env,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=tempfile.gettempdir(),
            )
        proc = WorkerProc(name, popen, log, port, control)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for p in self.procs:
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGCONT)  # in case a test left it stopped
                p.popen.kill()
            p.popen.wait()


async def unnamed_attempt_wait(store: Store, decided_by: str = "alice") -> Run:
    """A run waiting on attempt 2 of an irreversible call (its intent's count) by a wait that
    does not name the attempt, as a worker of a release before attempts were named wrote it:
    attempt 1 was approved (by ``decided_by``) and re-run, and that re-run timed out."""
    run, _ = await store.create_run("pay 100", AGENT)
    (_, lease), = (await store.claim("default", "w1", 1)).claimed
    await store.record_effect(lease, 0, 0, key="k", tool="wire_money",
                              tool_kind="irreversible", state="intent")
    pending = {"seq": 0, "call_index": 0, "tool": "wire_money", "input": {"amount": 100},
               "stage": "outcome_unknown"}
    await store.wait_for_approval(lease, "outcome unknown", {**pending, "attempt": 1})
    await store.decide(run.id, 0, "approved", decided_by=decided_by)
    (_, lease), = (await store.claim("default", "w2", 1)).claimed
    assert await store.retry_intent(lease, 0, 0, 1) == 2
    await store.wait_for_approval(lease, "outcome unknown: wire_money (step 0) timed out", pending)
    return run


async def wait_run(store: Store, run_id: Any, pred: Callable[[Run], bool], within: float) -> Run:
    deadline = time.monotonic() + within
    while True:
        run = await store.get_run(run_id)
        if pred(run):
            return run
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out: run {run_id} is {run.status} at step {run.next_seq}")
        await asyncio.sleep(0.05)


async def wait_for(pred: Callable[[], bool], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def in_process_executor(
    store: Store, base_url: str, registry: ToolRegistry, *, max_retries: int = 2,
    **options: Any,
) -> AsyncIterator[RunExecutor]:
    """A worker's RunExecutor in this process, against ``store`` and the scripted model server
    at ``base_url``, with ``registry``'s tools (no listener, no heartbeat: a test drives it);
    ``options``: RunExecutor's own (``pipeline=False``, ...)."""
    client = anthropic.AsyncAnthropic(base_url=base_url, api_key="test", max_retries=0)
    metrics = WorkerMetrics()
    try:
        yield RunExecutor(store, Providers(default=client), registry, metrics,
                          Health(60, metrics), RetryPolicy(max_retries=max_retries, base_delay=0.0),
                          is_draining=lambda: False, **options)
    finally:
        await client.close()


async def held_run(store: Store, agent: AgentSpec, pool: str = "default",
                   task: str = "a task") -> RunHandle:
    """A new run of ``agent``, claimed by worker "w" under a 60 s lease."""
    await store.create_run(task, agent, pool=pool)
    ((run, lease),) = (await store.with_lease_ttl(60).claim(pool, "w", 1)).claimed
    return RunHandle(run, lease, lease_ttl=60)
