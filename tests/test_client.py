"""agentrun.client against a real database, real worker processes and the scripted model server.

The client's wait is LISTEN-based: one test cuts its LISTEN connection (pg_terminate_backend, with
new connections to the database refused meanwhile) and finishes the run while it is cut, with the
periodic re-read pushed out of reach, so only the re-read on reconnect can see the change. The
examples of docs/client.md are extracted and run as scripts.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any
from uuid import uuid4

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import agentrun.client as client_module
from agentrun import demo_tools
from agentrun.client import AsyncClient, Client
from agentrun.errors import (
    AgentrunError,
    ConfigError,
    DatabaseUnavailable,
    RunNotFound,
    RunUnsuccessful,
    WaitTimeout,
)
from agentrun.fake_anthropic import FakeAnthropicServer
from agentrun.fake_anthropic.scenario import builtin_scenario_path
from agentrun.store import Store
from tests.proxykit import TcpProxy
from tests.workerkit import (
    AGENT,
    TOOLS_DIR,
    FakeFactory,
    Workers,
    echo_scenario,
    wait_for,
    wait_run,
)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "migrate-orders.yaml"
LEDGER_TOOLS = str(TOOLS_DIR / "ledger_tools.py")


@pytest.fixture
async def client(database_url: str) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(database_url) as c:
        yield c


def approval_scenario() -> dict[str, Any]:
    return {
        "name": "approval",
        "scripts": [
            {
                "name": "drop",
                "turns": [
                    {"content": [{"text": "Dropping it."},
                                 {"tool_use": {"name": "drop_table",
                                               "input": {"table": "orders_old"}}}]},
                    {"content": [{"text": "drop_table handled."}]},
                ],
            }
        ],
    }


@pytest.fixture
def ledger_db(database_url: str) -> str:
    # The tools' own schema, read from their module without importing it (as test_crash_matrix).
    source = (TOOLS_DIR / "ledger_tools.py").read_text()
    schema = source.split('SCHEMA = """', 1)[1].split('"""', 1)[0]
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(schema)
    return database_url


def effects(url: str, run_id: str) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM ledger_effects WHERE run_id = %s", (run_id,)
        ).fetchone()
    return int(row[0]) if row else 0


async def test_submit_from_objects_wait_returns_the_finished_run_and_result_its_text(
    client: AsyncClient, workers: Workers, fake: FakeFactory
) -> None:
    srv = fake(echo_scenario(3))
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    run = await client.submit("echo three times", AGENT, max_steps=10)
    assert (run.status, run.task, run.model, run.max_steps) == (
        "pending", "echo three times", AGENT.model, 10
    )
    workers.start("w1")
    done = await client.wait(run.id, timeout=60)
    assert done.id == run.id and done.status == "succeeded" and done.finished
    assert await client.result(run.id) == "All 3 turns done."
    assert done.result == "All 3 turns done."
    steps = await client.steps(str(run.id))  # a string id works as well as a UUID
    assert [s.kind for s in steps] == ["model_turn", "tool_result"] * 2 + ["model_turn"]
    assert [s.seq for s in steps] == list(range(5))
    # A finished run's wait returns at once, whatever the timeout.
    assert (await client.wait(run.id, timeout=0)).status == "succeeded"


async def test_submit_from_a_manifest_path_or_its_text_keeps_its_spec(
    client: AsyncClient,
) -> None:
    [from_path] = await client.submit_manifest(EXAMPLE)
    [from_str_path] = await client.submit_manifest(str(EXAMPLE))
    [from_text] = await client.submit_manifest(EXAMPLE.read_text())
    for run in (from_path, from_str_path, from_text):
        assert run.status == "pending"
        assert run.task == "Add a region column to orders and backfill it."
        assert (run.model, run.pool, run.max_steps, run.max_attempts) == (
            "claude-sonnet-4-5", "default", 50, 8
        )
        assert run.agent_spec["tools"] == [
            "read_schema", "count_rows", "write_production", "check_migration"
        ]
        assert run.agent_spec["thinking"] == {"budgetTokens": 2048}
        # The manifest's name is kept (as by agentrun submit -f), in kubectl's default namespace.
        assert (run.k8s_namespace, run.k8s_name, run.k8s_uid) == ("default", "migrate-orders", None)
    assert len({from_path.id, from_str_path.id, from_text.id}) == 3
    # An idempotency key names one run: the second submit returns the first run.
    [a] = await client.submit_manifest(EXAMPLE, idempotency_key="nightly-1")
    [b] = await client.submit_manifest(EXAMPLE, idempotency_key="nightly-1")
    assert a.id == b.id


async def test_bad_input_is_one_config_error_naming_the_field(client: AsyncClient) -> None:
    with pytest.raises(ConfigError, match=r"^submit: task: String should have at least 1"):
        await client.submit("", AGENT)
    with pytest.raises(ConfigError, match=r"^submit: max_steps: Input should be greater"):
        await client.submit("x", AGENT, max_steps=0)
    with pytest.raises(ConfigError, match=r"manifest text \(document 1\): apiVersion is 'v1'"):
        await client.submit_manifest("apiVersion: v1\nkind: AgentRun\n")
    with pytest.raises(ConfigError, match=r"nope\.yaml: cannot read"):
        await client.submit_manifest("nope.yaml")
    with pytest.raises(ConfigError, match=r"status='bogus': expected one of pending, running"):
        await client.list(status="bogus")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"until='done': expected one of finished, succeeded"):
        await client.wait(uuid4(), until="done")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="is not a run id"):
        await client.get("not-a-uuid")
    missing = uuid4()
    for call in (client.get(missing), client.wait(missing), client.steps(missing),
                 client.cancel(missing)):
        with pytest.raises(RunNotFound, match=str(missing)):
            await call
    # Found by a review: a psycopg error, an AttributeError, or no refusal at all.
    with pytest.raises(ConfigError, match=r"limit=10{20}: must be a number from 1 to 100000"):
        await client.list(limit=10**20)
    with pytest.raises(ConfigError, match=r"a run id is a UUID or its text \(run.id\), not Run"):
        await client.get(await client.submit("x", AGENT, pool="nobody"))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"not int"):
        await client.get(12345)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"seq must be a step number from 0 to 1000000000.*True"):
        await client.approve(missing, True)
    with pytest.raises(ConfigError, match=r"seq must be a step number.*1.5"):
        await client.approve(missing, 1.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"timeout=nan: must be >= 0"):
        await client.wait(missing, timeout=float("nan"))


async def test_wait_on_a_failing_run_returns_it_or_raises_per_until(
    client: AsyncClient, workers: Workers, fake: FakeFactory
) -> None:
    srv = fake(echo_scenario(3))
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    run = await client.submit("echo, but only one turn is allowed", AGENT, max_steps=1)
    workers.start("w1")
    ended = await client.wait(run.id, timeout=60)  # until="finished": returned, not raised
    assert ended.status == "failed" and "maxSteps 1 reached" in (ended.error or "")
    with pytest.raises(RunUnsuccessful) as info:
        await client.wait(run.id, until="succeeded", timeout=60)
    assert info.value.run.id == run.id and info.value.run.status == "failed"
    assert str(info.value).startswith(f"run {run.id} ended failed: maxSteps 1 reached")
    with pytest.raises(RunUnsuccessful):
        await client.result(run.id)


async def test_wait_with_a_timeout_on_a_run_that_never_ends_raises_timeout_error(
    client: AsyncClient,
) -> None:
    # No worker serves this pool: the run stays pending.
    run = await client.submit("never claimed", AGENT, pool="nobody")
    with pytest.raises(TimeoutError) as info:
        await client.wait(run.id, timeout=0.5)
    assert isinstance(info.value, WaitTimeout)
    assert (info.value.run_id, info.value.status) == (str(run.id), "pending")
    assert f"run {run.id} is still pending after 0.5 s" in str(info.value)
    with pytest.raises(WaitTimeout):
        await client.result(run.id, timeout=0.2)
    assert (await client.get(run.id)).status == "pending"  # the run goes on


async def test_approve_and_reject_a_waiting_irreversible_call(
    client: AsyncClient, store: Store, workers: Workers, fake: FakeFactory, ledger_db: str
) -> None:
    srv = fake(approval_scenario())
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    agent = AGENT.model_copy(update={"tools": ["drop_table"], "require_approval": True})
    approved = await client.submit("drop it", agent)
    rejected = await client.submit("drop it", agent)
    workers.start("w1", tools=LEDGER_TOOLS)
    for run in (approved, rejected):
        waiting = await wait_run(store, run.id, lambda r: r.status == "waiting_approval", 30)
        assert waiting.pending_call is not None and waiting.pending_call["tool"] == "drop_table"
        assert effects(ledger_db, str(run.id)) == 0
    # A wait goes on through waiting_approval: give the decision while one is in flight.
    pending_wait = asyncio.create_task(client.wait(approved.id, timeout=60))
    with pytest.raises(ConfigError, match="waits on step 0 \\(drop_table\\), not step 4"):
        await client.approve(approved.id, 4)
    call = await client.approve(approved.id, by="alice")  # seq: the one it waits on
    assert (call["tool"], call["seq"], call["stage"]) == ("drop_table", 0, "before_call")
    await client.reject(rejected.id, 0, by="bob", reason="not today")
    ok = await pending_wait
    no = await client.wait(rejected.id, timeout=60)
    assert ok.status == no.status == "succeeded"
    assert effects(ledger_db, str(approved.id)) == 1
    assert effects(ledger_db, str(rejected.id)) == 0
    result = (await client.steps(rejected.id))[1].payload["content"][0]
    assert result["content"] == "drop_table was rejected by bob: not today"
    assert result["is_error"] is True
    with pytest.raises(ConfigError, match=f"run {approved.id} is not waiting for approval"):
        await client.approve(approved.id)


async def test_cancel_ends_a_run_once_and_its_wait_returns_it(client: AsyncClient) -> None:
    run = await client.submit("never claimed", AGENT, pool="nobody")
    waiting = asyncio.create_task(client.wait(run.id, timeout=60))
    cancelled, changed = await client.cancel(run.id, reason="changed my mind")
    assert changed and cancelled.status == "cancelled"
    assert (await waiting).status == "cancelled"
    again, changed = await client.cancel(run.id)
    assert not changed and again.status == "cancelled"
    with pytest.raises(RunUnsuccessful, match="ended cancelled"):
        await client.wait(run.id, until="succeeded")


async def test_list_filters_by_pool_and_status(client: AsyncClient) -> None:
    a = await client.submit("a", AGENT, pool="alpha")
    b = await client.submit("b", AGENT, pool="alpha")
    c = await client.submit("c", AGENT, pool="beta")
    await client.cancel(b.id)
    assert {r.id for r in await client.list()} == {a.id, b.id, c.id}
    assert {r.id for r in await client.list(pool="alpha")} == {a.id, b.id}
    assert [r.id for r in await client.list(status="cancelled")] == [b.id]
    assert [r.id for r in await client.list(pool="alpha", status="pending")] == [a.id]
    assert await client.list(pool="beta", status="cancelled") == []
    assert len(await client.list(limit=2)) == 2


async def test_wait_rereads_the_run_when_its_listen_connection_comes_back(
    client: AsyncClient, store: Store, database_url: str, admin_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The periodic re-read out of reach: only a notification or a reconnection can end the wait.
    monkeypatch.setattr(client_module, "RECHECK_INTERVAL", 3600.0)
    dbname = conninfo_to_dict(database_url)["dbname"]
    run = await client.submit("never claimed", AGENT, pool="nobody")
    waiting = asyncio.create_task(client.wait(run.id, timeout=120))

    def listeners() -> list[int]:
        with psycopg.connect(admin_url) as conn:
            rows = conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = %s AND query LIKE 'LISTEN %%'",
                (dbname,),
            ).fetchall()
        return [int(pid) for (pid,) in rows]

    await wait_for(lambda: len(listeners()) == 1, 30, "the wait's LISTEN connection")
    [pid] = listeners()
    allow = sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS {}")
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(allow.format(sql.Identifier(dbname), sql.SQL("false")))
        try:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            await wait_for(lambda: not listeners(), 30, "the LISTEN connection to be gone")
            # Cancelled while nobody listens (the store's pool keeps its open connection): the
            # notification is lost; the wait can only learn of it by re-reading the run.
            _, changed = await store.cancel(run.id)
            assert changed
            assert not waiting.done()
        finally:
            admin.execute(allow.format(sql.Identifier(dbname), sql.SQL("true")))
    ended = await waiting
    assert ended.status == "cancelled"


async def test_the_database_is_found_as_the_cli_finds_it(
    database_url: str, empty_database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTRUN_DATABASE_URL", database_url)
    async with AsyncClient() as from_env:
        run = await from_env.submit("found through AGENTRUN_DATABASE_URL", AGENT)
    async with AsyncClient(database_url) as given:
        assert (await given.get(run.id)).task == "found through AGENTRUN_DATABASE_URL"
    # The argument wins over the environment; a database other than the embedded one is not
    # migrated behind anyone's back.
    with pytest.raises(ConfigError, match="run agentrun migrate"):
        async with AsyncClient(empty_database_url):
            pass
    monkeypatch.setenv("AGENTRUN_DATABASE_URL", "postgresql://postgres@127.0.0.1:1/agentrun")
    with pytest.raises(DatabaseUnavailable, match="cannot connect to PostgreSQL at"):
        async with AsyncClient():
            pass
    with pytest.raises(DatabaseUnavailable):
        Client()
    # The failed Client stopped the loop thread it had started.
    assert "agentrun-client" not in {t.name for t in threading.enumerate()}
    with pytest.raises(AgentrunError, match="the client is not open"):
        await AsyncClient(database_url).get(run.id)


async def test_opening_checks_the_database_once(database_url: str) -> None:
    """Store.open's connection check, then the pool's own connection (which reads the schema
    version): two connections. It was four: a check, a schema connection, and Store.open's check
    before its pool."""
    parts = conninfo_to_dict(database_url)
    proxy = TcpProxy((str(parts.get("host") or "127.0.0.1"), int(parts.get("port") or 5432)))
    proxy.start()
    try:
        parts.update(host="127.0.0.1", port=str(proxy.port))
        async with AsyncClient(make_conninfo(**parts), max_connections=1) as c:
            assert await c.list() == []
        assert proxy.accepted == 2
    finally:
        proxy.stop()


def test_the_sync_client_from_a_plain_function(
    database_url: str, workers: Workers, fake: FakeFactory
) -> None:
    srv = fake(echo_scenario(2))
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    with Client(database_url) as client:
        run = client.submit("echo twice", AGENT)
        workers.start("w1")
        assert client.wait(run.id, until="succeeded", timeout=60).status == "succeeded"
        assert client.result(run.id) == "All 2 turns done."
        assert [s.seq for s in client.steps(run.id)] == [0, 1, 2]
        assert [r.id for r in client.list(status="succeeded")] == [run.id]
        stuck = client.submit("never claimed", AGENT, pool="nobody")
        with pytest.raises(TimeoutError):
            client.wait(stuck.id, timeout=0.2)
        assert client.cancel(stuck.id)[0].status == "cancelled"
        with pytest.raises(RunNotFound):
            client.get(uuid4())
        thread = client._thread
    assert not thread.is_alive()  # closing stops its loop's thread
    with pytest.raises(Exception, match="this Client is closed"):
        client.get(run.id)


async def test_the_sync_client_from_inside_a_running_event_loop(
    database_url: str, workers: Workers, fake: FakeFactory
) -> None:
    srv = fake(echo_scenario(2))
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    asyncio.get_running_loop()  # as in Jupyter: a loop runs in this thread
    with Client(database_url) as client:
        run = client.submit("echo twice", AGENT)
        workers.start("w1")
        assert client.result(run.id, timeout=60) == "All 2 turns done."
        assert client.get(run.id).status == "succeeded"


INTERRUPTED_WAIT = """
import sys
from agentrun.client import Client

with Client() as client:
    try:
        client.wait(sys.argv[1])
    except KeyboardInterrupt:  # as Jupyter's interrupt: the session goes on
        print("interrupted", flush=True)
        sys.stdin.readline()  # until the test has looked at the database
"""


def until(pred: Callable[[], bool], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_ctrl_c_in_a_sync_wait_cancels_the_wait_and_closes_its_listen(
    database_url: str, admin_url: str, tmp_path: Path
) -> None:
    with Client(database_url) as client:
        run = client.submit("never claimed", AGENT, pool="nobody")
    dbname = conninfo_to_dict(database_url)["dbname"]

    def listeners() -> int:
        with psycopg.connect(admin_url) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = %s"
                " AND query LIKE 'LISTEN %%'",
                (dbname,),
            ).fetchone()
        return int(row[0]) if row else 0

    proc = subprocess.Popen(
        [sys.executable, "-c", INTERRUPTED_WAIT, str(run.id)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "AGENTRUN_DATABASE_URL": database_url}, cwd=tmp_path,
    )
    try:
        until(lambda: listeners() == 1 or proc.poll() is not None, 30, "the wait")
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGINT)
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline() == "interrupted\n", proc.communicate()
        # The process lives on; the cancelled wait closed its LISTEN connection.
        until(lambda: listeners() == 0, 30, "the LISTEN connection to close")
        proc.stdin.close()
        assert proc.wait(30) == 0, proc.communicate()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


# -- docs/client.md ---------------------------------------------------------------------------


def doc_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.DOTALL)


@pytest.fixture
def demo_server() -> Iterator[FakeAnthropicServer]:
    scenario = builtin_scenario_path("demo_migration")
    assert scenario is not None
    with FakeAnthropicServer(scenario) as srv:
        yield srv


@pytest.mark.parametrize("doc", ["client.md", "store.md"])
def test_the_docs_examples_run_as_written(
    doc: str, database_url: str, workers: Workers, demo_server: FakeAnthropicServer
) -> None:
    blocks = doc_blocks(ROOT / "docs" / doc)
    assert blocks, f"docs/{doc} has no python example"
    workers.env["ANTHROPIC_BASE_URL"] = demo_server.base_url
    # The README's worker: the demo's tools (as a file path: workerkit resolves under tool_modules).
    workers.start("w1", tools=str(Path(demo_tools.__file__)))
    outputs = []
    for block in blocks:
        res = subprocess.run(
            [sys.executable, "-c", block],
            capture_output=True, text=True, timeout=300, cwd=ROOT,
            env={**os.environ, **workers.env},
        )
        worker_log = workers.procs[0].output()[-3000:]
        assert res.returncode == 0, f"docs/{doc}:\n{block}\n{res.stderr}\n{worker_log}"
        outputs.append(res.stdout)
    if doc == "client.md":
        first, second = outputs
        lines = first.splitlines()
        assert lines[0].startswith("succeeded ")
        assert lines[1]  # the final text
        assert lines[2] == "0 model_turn" and lines[-1].endswith(" model_turn")
        assert second.splitlines()[:2] == ["pending", "cancelled True"]
        assert len(second.splitlines()) == 3  # the one succeeded run of the first block
    else:
        assert outputs[0].splitlines()[0].startswith("succeeded")


async def test_a_bad_url_argument_is_named_as_the_argument(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A URL given to the client is blamed as the argument it is: "check AGENTRUN_DATABASE_URL"
    sent its caller to an environment variable that may not even be set. The environment's URL
    is still named as the environment's."""
    monkeypatch.delenv("AGENTRUN_DATABASE_URL", raising=False)
    login = {**conninfo_to_dict(database_url), "user": "no_such_role_for_the_client"}
    bad = {
        "": "the database_url argument is empty",
        "mysql://u@h/db": "the database_url argument has scheme 'mysql'",
        "host=a port=b c": "the database_url argument is malformed",
        "postgresql://u@h:99999/db": "the database_url argument has port",
        make_conninfo(**login): "check the user, password and database in the database_url",
    }
    for url, says in bad.items():
        with pytest.raises(ConfigError) as refused:
            async with AsyncClient(url):
                pass
        assert says in str(refused.value), str(refused.value)
        assert "AGENTRUN_DATABASE_URL" not in str(refused.value)
    monkeypatch.setenv("AGENTRUN_DATABASE_URL", "host=a port=b c")
    with pytest.raises(ConfigError, match="AGENTRUN_DATABASE_URL is malformed"):
        async with AsyncClient():
            pass
