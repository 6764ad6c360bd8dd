"""A worker started before its schema exists waits for it, alive and not ready (issue 19).

On a fresh install the worker pods may start before the operator has migrated the database.
They used to exit at once ("the database schema is at version 0 ... run agentrun migrate") and
were restarted by the kubelet. Now a worker says once what it waits for, keeps /healthz at 200
(so the kubelet does not restart it) and /readyz at 503, and starts claiming as soon as the
schema is there. A schema newer than the worker knows is one warning, and the worker works on.
"""

from __future__ import annotations

import json
import re
import signal
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from agentrun.migrations import latest_version
from agentrun.store import Store
from tests.conftest import run_cli
from tests.proxykit import TcpProxy
from tests.workerkit import (
    AGENT,
    FakeFactory,
    WorkerProc,
    Workers,
    echo_scenario,
    wait_for,
    wait_run,
)


def get(port: int | None, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as e:
        return int(e.code), e.read().decode()
    except OSError:
        return 0, ""  # not serving (yet, or any more)


def last_progress(w: WorkerProc) -> float:
    """The worker's liveness clock as /metrics shows it (0 before its first stamp)."""
    _, body = get(w.health_port, "/metrics")
    m = re.search(r"^agentrun_last_progress_timestamp_seconds (\S+)$", body, re.M)
    return float(m.group(1)) if m else 0.0


def waiting_lines(w: WorkerProc) -> list[dict[str, Any]]:
    return [x for x in w.json_lines() if "waiting for the database schema" in x.get("msg", "")]


@pytest.fixture
def bare(tmp_path: Path, empty_database_url: str) -> Iterator[Workers]:
    """Workers on a database nobody has migrated."""
    w = Workers(
        env={"AGENTRUN_DATABASE_URL": empty_database_url, "ANTHROPIC_API_KEY": "test"},
        tmp=tmp_path,
    )
    try:
        yield w
    finally:
        w.stop_all()


async def test_a_worker_on_an_unmigrated_database_waits_alive_and_unready_then_works(
    bare: Workers, fake: FakeFactory, empty_database_url: str
) -> None:
    bare.env["ANTHROPIC_BASE_URL"] = fake(echo_scenario(2)).base_url
    w = bare.start("w", health=True, poll=0.5)
    alive = lambda: w.popen.poll() is None  # noqa: E731
    await wait_for(lambda: bool(waiting_lines(w)) or not alive(), 30, "the waiting line")
    assert alive(), w.output()  # before issue 19: exit 2, "the schema is at version 0"
    [line] = waiting_lines(w)
    need = latest_version()
    assert f"version {need}" in line["msg"] and "agentrun migrate" in line["msg"], line
    assert line["level"] == "warning"

    # Alive for the kubelet (its liveness clock moves on while it waits), not ready for traffic.
    first = last_progress(w)
    await wait_for(lambda: last_progress(w) > first > 0 or not alive(), 30, "liveness stamps")
    assert alive()
    assert get(w.health_port, "/healthz")[0] == 200
    status, body = get(w.health_port, "/readyz")
    assert status == 503
    ready = json.loads(body)
    assert ready["ready"] is False and f"version {need}" in ready["waiting_for"], ready
    assert len(waiting_lines(w)) == 1  # said once, not at every check

    # The operator (here: the CLI) migrates; the worker turns ready and works, never restarted.
    migrated = run_cli("migrate", env={"AGENTRUN_DATABASE_URL": empty_database_url})
    assert migrated.returncode == 0, migrated.stderr
    await wait_for(lambda: get(w.health_port, "/readyz")[0] == 200 or not alive(), 30, "ready")
    assert alive()
    assert "waiting_for" not in json.loads(get(w.health_port, "/readyz")[1])
    async with await Store.open(empty_database_url, max_size=2) as store:
        run, _ = await store.create_run("echo twice", AGENT)
        done = await wait_run(store, run.id, lambda r: r.finished, 30)
    assert (done.status, done.attempt, done.lease_owner) == ("succeeded", 1, None), done.error
    assert alive()
    msgs = [x["msg"] for x in w.json_lines()]
    assert any(m.startswith(f"database schema at version {need}") for m in msgs), msgs
    w.signal(signal.SIGTERM)
    assert w.wait() == 0


async def test_a_worker_waiting_for_its_schema_stops_cleanly_on_sigterm(bare: Workers) -> None:
    w = bare.start("w", health=True)
    await wait_for(lambda: bool(waiting_lines(w)) or w.popen.poll() is not None, 30, "waiting")
    w.signal(signal.SIGTERM)
    assert w.wait() == 0, w.output()


async def test_a_schema_newer_than_the_worker_knows_is_one_warning_and_work_goes_on(
    bare: Workers, fake: FakeFactory, empty_database_url: str
) -> None:
    """An image rolled back after its successor migrated must not crash-loop every worker. The
    successor's migration adds columns, as most have: read with SELECT * and RETURNING *, they
    failed the worker with a TypeError after each claim had committed, until its runs were
    dead-lettered, and the CLI with a traceback (found by an adversarial review on 2026-12-06)."""
    env = {"AGENTRUN_DATABASE_URL": empty_database_url}
    assert run_cli("migrate", env=env).returncode == 0
    newer = latest_version() + 1
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        conn.execute("INSERT INTO agentrun_migration (version, name) VALUES (%s, 'from_later')",
                     (newer,))  # fmt: skip
        for table in ("agent_run", "agent_step", "tool_effect", "approval", "run_handover"):
            conn.execute(f"ALTER TABLE {table} ADD COLUMN from_later text DEFAULT 'x'")
    bare.env["ANTHROPIC_BASE_URL"] = fake(echo_scenario(2)).base_url
    w = bare.start("w", health=True, poll=0.5)
    alive = lambda: w.popen.poll() is None  # noqa: E731
    await wait_for(lambda: get(w.health_port, "/readyz")[0] == 200 or not alive(), 30, "ready")
    assert alive(), w.output()
    warned = [x for x in w.json_lines() if f"version {newer}" in x.get("msg", "")]
    assert len(warned) == 1 and warned[0]["level"] == "warning", w.output()
    assert "newer than this worker knows" in warned[0]["msg"] and "upgrade" in warned[0]["msg"]
    async with await Store.open(empty_database_url, max_size=2) as store:
        run, _ = await store.create_run("echo twice", AGENT)
        done = await wait_run(store, run.id, lambda r: r.finished, 30)
    assert (done.status, done.attempt) == ("succeeded", 1), done.error
    for args in (["runs"], ["get", str(run.id)], ["steps", str(run.id)]):
        shown = run_cli(*args, env=env)
        assert shown.returncode == 0 and str(run.id)[:8] in shown.stdout, (args, shown.stderr)
    w.signal(signal.SIGTERM)
    assert w.wait() == 0


def _through(url: str, proxy: TcpProxy) -> str:
    """``url`` (a conninfo) pointed at the proxy instead."""
    params = conninfo_to_dict(url)
    params.update(host="127.0.0.1", port=str(proxy.port))
    return make_conninfo(**params)  # type: ignore[arg-type]


@pytest.fixture
def down_db(tmp_path: Path, database_url: str) -> Iterator[tuple[Workers, TcpProxy]]:
    """Workers whose (migrated) database refuses every connection until the test restores it:
    the chart's own PostgreSQL still starting when the worker pods do."""
    params = conninfo_to_dict(database_url)
    proxy = TcpProxy((str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432)))
    proxy.start()
    proxy.cut()
    w = Workers(
        env={"AGENTRUN_DATABASE_URL": _through(database_url, proxy), "ANTHROPIC_API_KEY": "test"},
        tmp=tmp_path,
    )
    try:
        yield w, proxy
    finally:
        w.stop_all()
        proxy.stop()


def db_waiting_lines(w: WorkerProc) -> list[dict[str, Any]]:
    return [x for x in w.json_lines() if "waiting for the database:" in x.get("msg", "")]


async def test_a_worker_whose_database_is_not_up_yet_waits_then_works(
    down_db: tuple[Workers, TcpProxy], fake: FakeFactory, database_url: str
) -> None:
    ws, proxy = down_db
    ws.env["ANTHROPIC_BASE_URL"] = fake(echo_scenario(2)).base_url
    w = ws.start("w", health=True, poll=0.5)
    alive = lambda: w.popen.poll() is None  # noqa: E731
    await wait_for(lambda: bool(db_waiting_lines(w)) or not alive(), 30, "the waiting line")
    assert alive(), w.output()  # before: exit 3, "cannot connect to PostgreSQL"
    [line] = db_waiting_lines(w)
    assert line["level"] == "warning" and "cannot connect to PostgreSQL" in line["msg"], line
    proxy.restore()
    await wait_for(lambda: get(w.health_port, "/readyz")[0] == 200 or not alive(), 30, "ready")
    assert alive(), w.output()
    async with await Store.open(database_url, max_size=2) as store:
        run, _ = await store.create_run("echo twice", AGENT)
        done = await wait_run(store, run.id, lambda r: r.finished, 30)
    assert done.status == "succeeded", done.error
    assert any(x["msg"] == "the database answers: no longer waiting" for x in w.json_lines())
    w.signal(signal.SIGTERM)
    assert w.wait() == 0


async def test_a_worker_waiting_for_its_database_stops_cleanly_on_sigterm(
    down_db: tuple[Workers, TcpProxy],
) -> None:
    ws, _ = down_db
    w = ws.start("w", health=True)
    await wait_for(lambda: bool(db_waiting_lines(w)) or w.popen.poll() is not None, 30, "waiting")
    w.signal(signal.SIGTERM)
    assert w.wait() == 0, w.output()
