"""The seeded chaos soak (small in the default run, large behind the slow marker), and proof that
its checker fails when a duplicate or a lost step is planted.

The soaks restart PostgreSQL, so they run on a server of their own (benchmarks/own_pg.py), never
the machine's shared one; the server is stopped by its pid when the test ends, however it ends.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from own_pg import OwnPostgres
from soak import Report, check, ledger_schema, soak

from agentrun.migrations import migrate


@pytest.fixture
def own_postgres() -> Iterator[OwnPostgres]:
    with OwnPostgres(settings={"max_connections": "200"}) as pg:
        with psycopg.connect(pg.url(), autocommit=True) as conn:
            conn.execute("CREATE DATABASE agentrun_soak")

        async def _migrate() -> None:
            async with await psycopg.AsyncConnection.connect(
                pg.url("agentrun_soak"), autocommit=True
            ) as conn:
                await migrate(conn)

        asyncio.run(_migrate())
        yield pg


async def _soak(pg: OwnPostgres, runs: int, seconds: float, pg_restarts: int) -> Report:
    logdir = Path(tempfile.mkdtemp(prefix="agentrun-soak-"))
    # Slow turns and few slots per worker, so the kills and the outages land in the middle of runs.
    return await soak(
        pg.url("agentrun_soak"),
        runs,
        seconds,
        seed=11,
        logdir=logdir,
        delay_ms=400,
        concurrency=2,
        pg=pg,
        pg_restarts=pg_restarts,
    )


async def test_small_seeded_soak_with_postgres_restarts_loses_nothing_and_repeats_nothing(
    own_postgres: OwnPostgres,
) -> None:
    report = await _soak(own_postgres, runs=8, seconds=20, pg_restarts=2)
    print(report)
    assert report.kills + report.terms >= 3
    assert report.pg_restarts == own_postgres.restarts == 2
    assert report.runs == report.succeeded == 8  # every run finished through the outages
    assert report.worker_crashes == 0  # the workers rode the outages out
    assert report.ok, report.problems
    assert report.steps == 8 * 17


@pytest.mark.slow
@pytest.mark.timeout(1800)
async def test_large_seeded_soak(own_postgres: OwnPostgres) -> None:
    report = await _soak(own_postgres, runs=200, seconds=600, pg_restarts=5)
    print(report)
    assert report.pg_restarts == 5
    assert report.ok, report.problems


def test_the_checker_fails_when_a_duplicate_or_a_lost_step_is_planted(database_url: str) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(ledger_schema())
        rid = conn.execute(
            "INSERT INTO agent_run (task, model, agent_spec, status) "
            "VALUES ('t', 'm', '{}', 'succeeded') RETURNING id"
        ).fetchone()[0]  # type: ignore[index]
        for seq in (0, 1, 3):  # seq 2 is missing: a lost step
            conn.execute(
                "INSERT INTO agent_step (run_id, seq, kind, payload, lease_epoch, worker) "
                "VALUES (%s, %s, 'model_turn', %s, 1, 'w')",
                (rid, seq, f'{{"n": {seq}}}'),
            )
        assert check(database_url).ok is False
        report = check(database_url)
        assert report.lost_steps == 1 and report.duplicate_effects == 0
        for _ in range(2):  # an irreversible effect that happened twice
            conn.execute(
                "INSERT INTO ledger_effects (tool, run_id) VALUES ('drop_table', %s)", (str(rid),)
            )
        report = check(database_url)
        assert report.duplicate_effects == 1 and not report.ok
    # The command's exit code says so too.
    res = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).resolve().parent.parent / "benchmarks" / "soak.py"),
            "--check-only",
            "--database-url",
            database_url,
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 1 and "soak: FAILED" in res.stdout
    assert "drop_table happened 2 times" in res.stdout
