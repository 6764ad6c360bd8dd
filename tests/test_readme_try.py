"""The README's "Try it by hand", command for command, on a fresh database.

Only the demo's tools and a scripted model: the fake-anthropic server with the demo_migration
scenario, a worker with ``--tools agentrun.demo_tools``, ``agentrun submit -f
examples/migrate-orders.yaml``. Nothing creates the ``demo_production`` schema beforehand (that
used to be done by ``agentrun demo`` only, so every tool call failed while the run still
"succeeded").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from agentrun.store import Run, Store
from tests.conftest import run_cli, start_cli, stop_embedded
from tests.workerkit import free_port

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "migrate-orders.yaml"
#: The scenario's turn 1 looks for a customers table that the demo database does not have (the
#: model then backfills a default region): the one tool error the script means to provoke.
SCRIPTED_ERROR = "unknown table 'customers'"


def _start(
    procs: list[subprocess.Popen[str]], args: list[str], env: dict[str, str], out: Path | None
) -> subprocess.Popen[str]:
    return start_cli(procs, args, env, out, stderr_apart=False)


def _output(log: Path) -> str:
    return log.read_text(errors="replace")


async def _wait_finished(
    store: Store, run_id: str, worker: subprocess.Popen[str], log: Path, within: float
) -> Run:
    deadline = time.monotonic() + within
    while True:
        run = await store.get_run(run_id)
        if run.finished:
            return run
        assert worker.poll() is None, f"the worker exited ({worker.returncode}): {_output(log)}"
        assert time.monotonic() < deadline, f"run {run_id} still {run.status} at {run.next_seq}"
        await asyncio.sleep(0.05)


def _tool_results(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    for s in steps:
        if s["kind"] != "tool_result":
            continue
        payload = s["payload"]
        content = payload.get("content", payload) if isinstance(payload, dict) else payload
        blocks += [b for b in content if b.get("type") == "tool_result"]
    return blocks


async def test_try_it_by_hand_runs_the_example_and_writes_production_once(
    database_url: str, store: Store, tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    env = {"AGENTRUN_DATABASE_URL": database_url}
    port = free_port()
    # $ agentrun fake-anthropic --scenario demo_migration --port 8765 &
    fake = _start(
        procs, ["fake-anthropic", "--scenario", "demo_migration", "--port", str(port)], env, None
    )
    assert fake.stdout is not None
    ready = fake.stdout.readline()  # printed once it listens; "" if it died
    assert "listening" in ready, ready + fake.stdout.read()
    # $ ANTHROPIC_BASE_URL=http://127.0.0.1:8765 ANTHROPIC_API_KEY=x \
    #     agentrun worker --tools agentrun.demo_tools &
    # (its health and control ports off: 8080 and 8081 may be taken on the machine running the
    # tests)
    log = tmp_path / "worker.log"
    worker = _start(
        procs,
        ["worker", "--tools", "agentrun.demo_tools"],
        {
            **env,
            "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{port}",
            "ANTHROPIC_API_KEY": "x",
            "AGENTRUN_HEALTH_PORT": "-1",
            "AGENTRUN_CONTROL_PORT": "-1",
        },
        log,
    )
    # $ agentrun submit -f examples/migrate-orders.yaml
    res = run_cli("submit", "-f", str(EXAMPLE), env=env)
    assert res.returncode == 0, res.stderr
    run_id = res.stdout.strip()

    run = await _wait_finished(store, run_id, worker, log, within=120)
    assert run.status == "succeeded", (run.status, run.error, _output(log))

    # $ agentrun runs; agentrun steps RUN_ID
    res = run_cli("runs", env=env)
    assert res.returncode == 0 and run_id in res.stdout and "succeeded" in res.stdout
    res = run_cli("steps", run_id, "-o", "json", env=env)
    assert res.returncode == 0, res.stderr
    results = _tool_results(json.loads(res.stdout))
    assert len(results) == 11  # one per tool call: turns 0..10 each call one tool
    errors = [str(r["content"]) for r in results if r.get("is_error")]
    assert len(errors) == 1 and SCRIPTED_ERROR in errors[0], errors

    with psycopg.connect(database_url) as conn:
        ledger = conn.execute(
            "SELECT run_id, statement, rows_affected FROM demo_production.write_ledger ORDER BY seq"
        ).fetchall()
        nulls = conn.execute(
            "SELECT count(*) FROM demo_production.orders WHERE region IS NULL"
        ).fetchone()
    assert ledger == [
        (run_id, "ALTER TABLE orders ADD COLUMN region text", 0),
        (run_id, "UPDATE orders SET region = 'eu' WHERE region IS NULL", 1000),
    ]
    assert nulls == (0,)


def test_workers_creating_the_demo_schema_at_once_create_and_seed_it_once(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from agentrun import demo_tools

    monkeypatch.setenv("AGENTRUN_DEMO_PRODUCTION_URL", database_url)
    start = threading.Barrier(8)
    failures: list[BaseException] = []

    def first_call() -> None:
        try:
            start.wait(10)
            demo_tools._connect().close()
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=first_call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failures, failures
    with psycopg.connect(database_url) as conn:
        counts = conn.execute(
            "SELECT (SELECT count(*) FROM demo_production.orders),"
            " (SELECT count(*) FROM demo_production.write_ledger)"
        ).fetchone()
    assert counts == (demo_tools.SEED_ROWS, 0)


# -- the README's text itself, pasted into a fresh shell ------------------------------------------

README = EXAMPLE.parent.parent / "README.md"
REPO = README.parent


def _section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def readme_commands(title: str) -> list[str]:
    """The commands of the ```console blocks of one README section, as a user pastes them: each
    ``$ `` line without its prompt, joined with its ``\\`` continuation lines."""
    commands: list[str] = []
    for block in re.findall(r"```console\n(.*?)```", _section(title), flags=re.S):
        for line in block.splitlines():
            if line.startswith("$ "):
                commands.append(line[2:])
            elif commands and commands[-1].endswith("\\"):
                commands[-1] += "\n" + line
    return commands


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0,
                    reason="needs root and unshare for a network namespace of its own")
def test_try_it_by_hand_pasted_into_a_fresh_shell_works(tmp_path: Path) -> None:
    """The section's commands, literally, in bash: a fresh shell (a PATH without the venv, no
    AGENTRUN_* variables, a HOME of its own, so the embedded PostgreSQL of the README) in the
    repository. It runs in a network namespace of its own, so the README's fixed ports (8765,
    8080, 8081) are free whatever else runs on this machine."""
    commands = readme_commands("Try it by hand")
    assert commands, "README: no console block under Try it by hand"
    assert (REPO / ".venv" / "bin" / "activate").exists(), "the README's install command first"
    script = tmp_path / "pasted.sh"
    script.write_text(
        "set -euo pipefail\n"
        "ip link set lo up\n"  # a new network namespace starts with loopback down
        + "\n".join(commands) + "\n"
    )
    # A short HOME: the embedded server's Unix socket lives in its data directory, and a socket
    # path may not pass 107 bytes (pytest's tmp_path is longer).
    home = Path(tempfile.mkdtemp(prefix="ar-home-", dir="/tmp"))
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin", "HOME": str(home),
           "LANG": "C.UTF-8", "TMPDIR": str(tmp_path)}
    shell = subprocess.Popen(
        ["unshare", "--net", "bash", str(script)], cwd=REPO, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        out, _ = shell.communicate(timeout=240)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the shell's group: its & jobs too
            os.killpg(shell.pid, signal.SIGKILL)
        shell.wait()
        stop_embedded(home / ".local" / "share" / "agentrun")
        shutil.rmtree(home, ignore_errors=True)
    assert shell.returncode == 0, out
    run_id = re.search(r"run ([0-9a-f-]{36}) succeeded", out)
    assert run_id, out
    assert f"run {run_id.group(1)}: succeeded, 23 steps" in out, out


def _help_options(command: str) -> set[str]:
    res = run_cli(command, "--help")
    assert res.returncode == 0, (command, res.stderr)
    return set(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", res.stdout))


def test_every_command_in_the_readme_table_exists_with_the_options_it_shows() -> None:
    rows = [ln for ln in _section("Commands").splitlines() if ln.startswith("| `agentrun")]
    assert len(rows) >= 15, rows
    seen = set()
    for row in rows:
        cell = row.split(" | ")[0].replace("\\|", "|")
        for shown in re.findall(r"`(agentrun [^`]+)`", cell):
            command = shown.split()[1]
            known = _help_options(command)
            for option in re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", shown):
                assert option in known, f"README: {shown!r}: agentrun {command} has no {option}"
            seen.add(command)
    assert {"runs", "get", "wait", "logs", "steps", "submit", "worker", "demo"} <= seen
