"""The store commands of the real CLI, run as subprocesses against a real PostgreSQL."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile

import psycopg
import pytest

from agentrun.migrations import latest_version
from agentrun.store import Store
from tests.conftest import run_cli
from tests.workerkit import AGENT


def _procs_env(url: str) -> dict[str, str]:
    return {"AGENTRUN_DATABASE_URL": url}


def test_migrate_twice_is_idempotent(empty_database_url: str) -> None:
    env = _procs_env(empty_database_url)
    first = run_cli("migrate", env=env)
    assert first.returncode == 0, first.stderr
    assert f"to {latest_version()}" in first.stdout
    second = run_cli("migrate", env=env)
    assert second.returncode == 0, second.stderr
    assert "nothing to do" in second.stdout
    with psycopg.connect(empty_database_url) as conn:
        rows = conn.execute("SELECT version FROM agentrun_migration").fetchall()
    assert rows == [(v,) for v in range(1, latest_version() + 1)]


def test_migrate_from_four_processes_at_once(empty_database_url: str) -> None:
    env = {"AGENTRUN_DATABASE_URL": empty_database_url}
    import os

    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "agentrun", "migrate"],
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tempfile.gettempdir(),
        )
        for _ in range(4)
    ]
    try:
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0, 0, 0], [e for _, e in outs]
    applied = [o for o, _ in outs if "migrated" in o]
    assert len(applied) == 1, outs  # exactly one process did the work; the others waited
    with psycopg.connect(empty_database_url) as conn:
        assert conn.execute("SELECT count(*) FROM agentrun_migration").fetchone() == (
            latest_version(),
        )
        assert conn.execute("SELECT to_regclass('agent_step') IS NOT NULL").fetchone() == (True,)


def test_unreachable_database_is_one_line_and_exit_3() -> None:
    res = run_cli("runs", env={"AGENTRUN_DATABASE_URL": "postgresql://u:hunter2@127.0.0.1:1/x"})
    assert res.returncode == 3
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot connect to PostgreSQL" in lines[0]
    assert "hunter2" not in res.stderr and "***" in res.stderr


def test_malformed_database_url_is_one_line_and_exit_2() -> None:
    for url, expect in [
        ("mysql://root@localhost/db", "scheme 'mysql'"),
        ("host=a port=b c", "malformed"),
        ("postgresql://u:pw@localhost:notaport/db", "port 'notaport'"),
    ]:
        res = run_cli("runs", env={"AGENTRUN_DATABASE_URL": url})
        assert res.returncode == 2, (url, res.stderr)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and expect in lines[0], lines
        assert "AGENTRUN_DATABASE_URL" in lines[0]


def test_unknown_run_id_is_one_line_and_non_zero(database_url: str) -> None:
    env = _procs_env(database_url)
    res = run_cli("steps", "3f1e2b7a-0000-4000-8000-000000000000", env=env)
    assert res.returncode == 1
    assert res.stderr.strip() == (
        "agentrun: error: no run with id 3f1e2b7a-0000-4000-8000-000000000000 "
        "(list runs with: agentrun runs)"
    )
    res = run_cli("cancel", "not-a-uuid", env=env)
    assert res.returncode == 2 and "is not a run id" in res.stderr


def test_runs_and_cancel_from_the_cli(database_url: str) -> None:
    import asyncio

    from agentrun.manifests import AgentSpec
    from agentrun.store import Store

    async def seed() -> str:
        async with await Store.open(database_url) as store:
            run, _ = await store.create_run("t", AgentSpec(model="m"))
            return str(run.id)

    rid = asyncio.run(seed())
    env = _procs_env(database_url)
    res = run_cli("runs", env=env)
    assert res.returncode == 0 and rid in res.stdout and "pending" in res.stdout
    res = run_cli("cancel", rid, env=env)
    assert res.returncode == 0 and "cancelled" in res.stdout
    res = run_cli("runs", "-o", "json", env=env)
    (row,) = json.loads(res.stdout)
    assert row["id"] == rid and row["status"] == "cancelled"
    res = run_cli("cancel", rid, env=env)
    assert res.returncode == 1 and "already finished" in res.stderr


def test_a_bad_numeric_environment_setting_is_one_line_and_exit_2() -> None:
    res = run_cli("runs", env={"AGENTRUN_LEASE_TTL": "fifteen"})
    assert res.returncode == 2
    assert res.stderr.strip() == "agentrun: error: AGENTRUN_LEASE_TTL='fifteen' is not a number"


@pytest.mark.parametrize("encoding", ["utf-8", "ascii", "latin-1"])
async def test_every_json_output_is_valid_json_in_any_terminal_encoding(
    store: Store, database_url: str, encoding: str
) -> None:
    """Found by a review: `logs -o json` wrote its text unescaped, and a terminal encoding that
    cannot show an emoji turned it into a Python escape (\\U0001f600), which no JSON reader
    takes. Every -o json reads back as what was stored, whatever the encoding."""
    text = "smile \U0001f600, NUL \x00, lone \ud800, RTL \u202e, é"
    run, _ = await store.create_run(text, AGENT)
    ((_, lease),) = (await store.claim("default", "w1", 1)).claimed
    turn = {"content": [{"type": "text", "text": text}], "stop_reason": "end_turn"}
    await store.append_step(lease, 0, "model_turn", turn)
    env = {"AGENTRUN_DATABASE_URL": database_url, "PYTHONIOENCODING": encoding}
    lines = run_cli("logs", str(run.id), "-o", "json", env=env).stdout.splitlines()
    assert [json.loads(line)["payload"]["content"][0]["text"] for line in lines] == [text]
    (step,) = json.loads(run_cli("steps", str(run.id), "-o", "json", env=env).stdout)
    assert step["payload"]["content"][0]["text"] == text
    assert json.loads(run_cli("get", str(run.id), "-o", "json", env=env).stdout)["task"] == text
