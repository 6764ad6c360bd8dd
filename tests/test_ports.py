"""A taken health or metrics port: one line on stderr and exit 2, before anything starts.

Each port is held by a real listening socket on the address the servers bind (0.0.0.0). The
operator gets a kubeconfig that does not exist and a database nobody listens on: its check must
come before it reaches either, so reaching them would show up as another error (or as kopf
retrying its startup handler, with the process never exiting, as it did before).
"""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import anthropic
import pytest

from agentrun.errors import ConfigError
from agentrun.operator.metrics import OperatorMetrics
from agentrun.store import Store
from agentrun.tools import ToolRegistry
from agentrun.worker.process import Worker, WorkerSettings
from tests.conftest import run_cli
from tests.workerkit import AGENT, TOOLS_DIR

#: Generous: the check takes milliseconds, but a loaded machine imports kopf slowly. A process
#: still running then is killed by its pid (subprocess.run does) and the test fails.
EXIT_WITHIN = 60


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port some other process is listening on, as the servers would bind it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("0.0.0.0", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def _operator(
    args: list[str], tmp_path: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return run_cli(
        "operator",
        *args,
        env={
            "KUBECONFIG": str(tmp_path / "no-such-kubeconfig"),
            "AGENTRUN_DATABASE_URL": "postgresql://agentrun@127.0.0.1:1/nowhere",
            **(env or {}),
        },
        timeout=EXIT_WITHIN,
    )


def _one_line(res: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    return lines[0]


@pytest.mark.parametrize("taken", ["--metrics-port", "--health-port"])
def test_operator_with_a_taken_port_exits_2_before_kopf_starts(
    taken: str, held_port: int, tmp_path: Path
) -> None:
    other = "--health-port" if taken == "--metrics-port" else "--metrics-port"
    res = _operator([taken, str(held_port), other, "-1"], tmp_path)
    assert res.returncode == 2, res.stderr
    env = "AGENTRUN_METRICS_PORT" if taken == "--metrics-port" else "AGENTRUN_HEALTH_PORT"
    assert _one_line(res) == (
        f"agentrun: error: {taken} {held_port} ({env}) is already in use on 0.0.0.0; "
        "free it or choose another port (-1 turns it off)"
    )
    assert res.stdout == ""


def test_operator_port_from_the_environment_is_checked_too(held_port: int, tmp_path: Path) -> None:
    res = _operator(
        ["--health-port", "-1"], tmp_path, env={"AGENTRUN_METRICS_PORT": str(held_port)}
    )
    assert res.returncode == 2, res.stderr
    line = _one_line(res)
    assert f"--metrics-port {held_port} (AGENTRUN_METRICS_PORT) is already in use" in line


def test_operator_with_both_endpoints_on_one_port_exits_2(tmp_path: Path) -> None:
    from tests.workerkit import free_port

    port = str(free_port())
    res = _operator(["--health-port", port, "--metrics-port", port], tmp_path)
    assert res.returncode == 2, res.stderr
    line = _one_line(res)
    assert f"--metrics-port {port} (AGENTRUN_METRICS_PORT) is also --health-port" in line


@pytest.mark.parametrize("how", ["flag", "env"])
async def test_worker_with_a_taken_health_port_exits_2_and_claims_nothing(
    how: str, held_port: int, database_url: str, store: Store
) -> None:
    run, _ = await store.create_run("echo", AGENT)
    port = ["--health-port", str(held_port)] if how == "flag" else []
    env = {
        "AGENTRUN_DATABASE_URL": database_url,
        "ANTHROPIC_API_KEY": "test",
        "AGENTRUN_CONTROL_PORT": "-1",  # 8081 may be taken on the machine running the tests
        **({"AGENTRUN_HEALTH_PORT": str(held_port)} if how == "env" else {}),
    }
    res = run_cli(
        "worker",
        "--tools",
        str(TOOLS_DIR / "echo_v1.py"),
        "--poll-interval",
        "0.2",
        *port,
        env=env,
        timeout=EXIT_WITHIN,
    )
    assert res.returncode == 2, res.stderr
    assert _one_line(res) == (
        f"agentrun: error: --health-port {held_port} (AGENTRUN_HEALTH_PORT) is already in use "
        "on 0.0.0.0; free it or choose another port (-1 turns it off)"
    )
    after = await store.get_run(run.id)
    assert after.status == "pending" and after.attempt == 0


async def test_worker_with_a_taken_control_port_exits_2_and_claims_nothing(
    database_url: str, store: Store
) -> None:
    # The control listener (/drain) binds the loopback interface only: held there.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        held = int(sock.getsockname()[1])
        run, _ = await store.create_run("echo", AGENT)
        res = run_cli(
            "worker", "--tools", str(TOOLS_DIR / "echo_v1.py"), "--health-port", "-1",
            "--control-port", str(held),
            env={"AGENTRUN_DATABASE_URL": database_url, "ANTHROPIC_API_KEY": "test"},
            timeout=EXIT_WITHIN,
        )  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert _one_line(res) == (
        f"agentrun: error: --control-port {held} (AGENTRUN_CONTROL_PORT) is already in use "
        "on 127.0.0.1; free it or choose another port (-1 turns it off)"
    )
    after = await store.get_run(run.id)
    assert after.status == "pending" and after.attempt == 0


# -- the servers themselves, when the port is taken after the check ------------------------------


async def test_worker_health_server_on_a_taken_port_raises_config_error(
    held_port: int, store: Store
) -> None:
    run, _ = await store.create_run("echo", AGENT)
    client = anthropic.AsyncAnthropic(api_key="test", max_retries=0)
    settings = WorkerSettings(health_port=held_port, poll_interval=0.2)
    worker = Worker(store, client, ToolRegistry(), settings)
    try:
        with pytest.raises(ConfigError, match=f"--health-port {held_port} .*address already in"):
            await worker.serve()
    finally:
        await client.close()
    after = await store.get_run(run.id)
    assert after.status == "pending" and after.attempt == 0


def test_operator_metrics_on_a_taken_port_raises_config_error(held_port: int) -> None:
    with pytest.raises(ConfigError, match=f"--metrics-port {held_port} .*address already in"):
        OperatorMetrics().serve(held_port)
