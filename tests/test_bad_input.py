"""Bad input and settings are one line naming the flag or field and the fix, exit 2, never a
traceback (issue 12, F14); text PostgreSQL cannot hold as is (a NUL in a task) is stored as
given (F7). Every case runs the real CLI in a subprocess."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from psycopg.conninfo import make_conninfo

from agentrun.errors import ConfigError
from agentrun.manifests import AgentSpec
from agentrun.operator.status import one_line
from agentrun.store import Store
from tests.conftest import run_cli


def one_line_error(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert lines[0].startswith("agentrun: error: "), stderr
    return lines[0]


def refused(*args: str, url: str, says: str, env: dict[str, str] | None = None) -> str:
    proc = run_cli(*args, env={"AGENTRUN_DATABASE_URL": url, "ANTHROPIC_API_KEY": "test",
                               **(env or {})}, timeout=30)
    line = one_line_error(proc.stderr)
    assert proc.returncode == 2, proc.stderr
    assert says in line, line
    return line


@pytest.mark.parametrize("limit", ["-1", "0", "100001"])
def test_runs_limit_out_of_range(database_url: str, limit: str) -> None:
    refused("runs", "--limit", limit, url=database_url, says=f"--limit {limit}: must be between")


# Found by a review: nan and inf were a traceback (ValueError, OverflowError), 1e7 a refusal
# at connect time said as an outage (exit 3) with the parameter's name masked.
@pytest.mark.parametrize("env", ["AGENTRUN_DB_STATEMENT_TIMEOUT", "AGENTRUN_DB_TCP_TIMEOUT"])
@pytest.mark.parametrize("value", ["nan", "inf", "1e7", "-1"])
def test_a_database_timeout_out_of_range(database_url: str, env: str, value: str) -> None:
    refused("runs", url=database_url, env={env: value},
            says=f"{env}={float(value):g}: must be from 0 to 86400 seconds")


# Found by a review: said as an outage, exit 3 (a worker would wait for it for ever).
@pytest.mark.parametrize(("setting", "says"), [
    ({"sslmode": "bogus"}, 'invalid sslmode value: "bogus"'),
    ({"options": "-c statement_timeout=abc"}, 'invalid value for parameter "statement_timeout"'),
    ({"options": "-c no_such_setting=1"}, 'unrecognized configuration parameter "no_such_setting"'),
])
def test_a_connection_setting_postgres_refuses_is_exit_2(
    database_url: str, setting: dict[str, str], says: str
) -> None:
    line = refused("runs", url=make_conninfo(database_url, **setting), says=says)
    assert "refused a connection setting" in line and "check the parameters" in line


WORKER_CASES = [
    (["--concurrency", "-3"], "--concurrency -3 (AGENTRUN_CONCURRENCY): must be at least 1"),
    (["--concurrency", "0"], "--concurrency 0 (AGENTRUN_CONCURRENCY): must be at least 1"),
    (["--lease-ttl", "-5"], "--lease-ttl -5.0 (AGENTRUN_LEASE_TTL): must be from 1 to 86400"),
    (["--lease-ttl", "0.2"], "--lease-ttl 0.2 (AGENTRUN_LEASE_TTL): must be from 1 to 86400"),
    (["--lease-ttl", "nan"], "--lease-ttl nan (AGENTRUN_LEASE_TTL): must be from 1 to 86400"),
    # A lease past year 9999 was committed, then unreadable: the worker died, the run was wedged.
    (["--lease-ttl", "1e12"], "--lease-ttl 1000000000000.0 (AGENTRUN_LEASE_TTL): must be from 1 "
                              "to 86400"),
    # An unknown outcome's wait (the old lease's end plus this) overflowed the calendar at every
    # claim of the run, until it was dead-lettered.
    (["--tool-timeout", "1e12"], "--tool-timeout 1000000000000.0 (AGENTRUN_TOOL_TIMEOUT): must be "
                                 "more than 0 and at most 604800"),
    (["--poll-interval", "0"], "--poll-interval 0.0 (AGENTRUN_POLL_INTERVAL): must be more"),
    (["--idle-interval", "0"], "--idle-interval 0.0 (AGENTRUN_IDLE_INTERVAL): must be more"),
    (["--drain-grace", "-1"], "--drain-grace -1.0 (AGENTRUN_DRAIN_GRACE): must be 0 or more"),
    (["--liveness-threshold", "0"], "--liveness-threshold 0.0 (AGENTRUN_LIVENESS_THRESHOLD)"),
    (["--model-retries", "-1"], "--model-retries -1 (AGENTRUN_MODEL_RETRIES): must be 0 or"),
    (["--pool", "p" * 9000], "(9000 chars) (AGENTRUN_POOL): must be a DNS label of at most 63"),
    (["--pool", "Bad_Pool"], "--pool 'Bad_Pool' (AGENTRUN_POOL): must be a DNS label"),
]


@pytest.mark.parametrize(("flags", "says"), WORKER_CASES)
def test_worker_settings_are_checked_at_start(
    database_url: str, flags: list[str], says: str
) -> None:
    refused("worker", "--health-port", "-1", *flags, url=database_url, says=says)


def test_worker_settings_from_the_environment_name_the_variable(database_url: str) -> None:
    refused("worker", "--health-port", "-1", url=database_url,
            env={"AGENTRUN_CONCURRENCY": "0"}, says="(AGENTRUN_CONCURRENCY): must be at least 1")


#: Each was a traceback, or a wrong exit code, before an adversarial review on 2026-12-06:
#: (arguments, environment, exit code, what the last line of stderr says).
BINARY = "\udcff\udcfebinary"  # a file of bytes that are not UTF-8 (written below)
CLI_CASES: list[tuple[list[str], dict[str, str], int, str]] = [
    (["worker", "--log-level", "bogus"], {}, 2,
     "--log-level: 'bogus': must be DEBUG, INFO, WARNING or ERROR ($AGENTRUN_LOG_LEVEL)"),
    (["worker"], {"AGENTRUN_LOG_LEVEL": "bogus"}, 2, "must be DEBUG, INFO, WARNING or ERROR"),
    (["operator"], {"AGENTRUN_LOG_FORMAT": "xml"}, 2,
     "--log-format: 'xml': must be text or json ($AGENTRUN_LOG_FORMAT)"),
    (["worker", "--prices", BINARY], {}, 2, "(AGENTRUN_PRICES): not UTF-8 text (byte 0)"),
    (["fake-anthropic", "--scenario", BINARY], {}, 2, "not UTF-8 text (byte 0)"),
    (["fake-anthropic", "--scenario", "demo_migration", "--port", "99999"], {}, 2,
     "--port: 99999: must be between 0 and 65535"),
    (["prune", "--older-than", "1d", "--batch", "99999999999999999999"], {}, 2,
     "--batch 99999999999999999999: must be between 1 and 10000"),
    (["drain-local", "--port", "18082", "--timeout", "nan"], {}, 2,
     "--timeout nan: must be more than 0 and at most 604800 seconds"),
    (["drain-local", "--port", "18082", "--timeout", "1e300"], {}, 2,
     "--timeout 1e+300: must be more than 0 and at most 604800 seconds"),
    (["drain-local", "--port", "99999"], {}, 2, "--port 99999: must be the worker's"),
    (["logs", "-f", "3f1e2b7a-0000-4000-8000-000000000000"], {"AGENTRUN_FOLLOW_LEASE": "inf"}, 2,
     "AGENTRUN_FOLLOW_LEASE=inf: must be more than 1 and at most 86400 seconds"),
    (["logs", "-f", "3f1e2b7a-0000-4000-8000-000000000000"],
     {"AGENTRUN_FOLLOW_RESYNC": "1e-9"}, 2, "AGENTRUN_FOLLOW_RESYNC=1e-09: must be more than"),
    (["approve", "my-run", "3", "--kubeconfig", "KUBECONFIG", "--timeout", "inf"], {}, 2,
     "--timeout inf: must be more than 0 and at most 604800 seconds"),
    (["approve", "my-run", "3", "--kubeconfig", BINARY], {}, 2, "binary.yaml: 'utf-8' codec"),
    # Found by a review: a KUBECONFIG that is not YAML was "no Kubernetes credentials: set
    # KUBECONFIG", with KUBECONFIG set.
    (["approve", "my-run", "3", "--kube"], {"KUBECONFIG": BINARY}, 2,
     "binary.yaml: 'utf-8' codec"),
    (["approve", "my-run", "3", "--kubeconfig", "KUBECONFIG"], {}, 3,
     "cannot reach the Kubernetes API server http://127.0.0.1:1 ("),
    # Found on 2026-12-06: accepted, or refused as "cannot be reached" (exit 3).
    (["worker", "--worker-id", ""], {}, 2,
     "--worker-id '' (AGENTRUN_WORKER_ID): must be 1 to 253 printable characters, not blank"),
    (["worker", "--worker-id", "w\x1b[2J"], {}, 2, "--worker-id 'w\\x1b[2J' (AGENTRUN_WORKER_ID)"),
    (["worker", "--concurrency", "99999999999"], {}, 2,
     "--concurrency 99999999999 (AGENTRUN_CONCURRENCY): must be at least 1 and at most 10000"),
    (["runs"], {"AGENTRUN_DATABASE_URL": "postgresql://postgres@127.0.0.1:99999/postgres"}, 2,
     "AGENTRUN_DATABASE_URL has port '99999', not a number from 1 to 65535"),
]


@pytest.mark.parametrize(("args", "env", "code", "says"), CLI_CASES)
def test_bad_values_are_one_line_and_the_right_exit_code(
    database_url: str, tmp_path: Path, args: list[str], env: dict[str, str], code: int,
    says: str,
) -> None:
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00binary")
    kubeconfig = tmp_path / "kubeconfig"  # an API server nothing listens on
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: x\n"
        "clusters: [{name: c, cluster: {server: 'http://127.0.0.1:1'}}]\n"
        "users: [{name: u, user: {token: not-to-be-printed}}]\n"
        "contexts: [{name: x, context: {cluster: c, user: u}}]\n")
    placed = {BINARY: str(binary), "KUBECONFIG": str(kubeconfig)}
    args = [placed.get(a, a) for a in args]
    env = {k: placed.get(v, v) for k, v in env.items()}
    proc = run_cli(*args, env={"AGENTRUN_DATABASE_URL": database_url, **env}, timeout=60)
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr and "not-to-be-printed" not in proc.stderr
    assert says in proc.stderr.strip().splitlines()[-1], proc.stderr


OPERATOR_CASES = [  # each once accepted: a busy loop, a division by zero, a spin, no bound
    ({"AGENTRUN_HEALTH_INTERVAL": "0"},
     "AGENTRUN_HEALTH_INTERVAL 0: must be more than 0 (seconds; default 5)"),
    ({"AGENTRUN_MAX_PATCHES_PER_SECOND": "0"},
     "AGENTRUN_MAX_PATCHES_PER_SECOND 0: must be more than 0 (a second; default 50)"),
    ({"AGENTRUN_MAX_PATCHES_PER_SECOND": "-3"}, "AGENTRUN_MAX_PATCHES_PER_SECOND -3: must be"),
    ({"AGENTRUN_RESYNC_INTERVAL": "-1"}, "AGENTRUN_RESYNC_INTERVAL -1: must be more than 0"),
    ({"AGENTRUN_SCALE_INTERVAL": "nan"}, "AGENTRUN_SCALE_INTERVAL nan: must be more than 0"),
    ({"AGENTRUN_STATUS_FLUSH_INTERVAL": "-0.5"},
     "AGENTRUN_STATUS_FLUSH_INTERVAL -0.5: must be 0 or more (seconds; default 0.2)"),
]


@pytest.mark.parametrize(("env", "says"), OPERATOR_CASES)
def test_operator_settings_are_checked_at_start(
    database_url: str, env: dict[str, str], says: str
) -> None:
    refused("operator", url=database_url, env=env, says=says)


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield int(sock.getsockname()[1])


def test_worker_health_port_taken(database_url: str, taken_port: int) -> None:
    refused("worker", "--health-port", str(taken_port), url=database_url,
            says=f"--health-port {taken_port} (AGENTRUN_HEALTH_PORT) is already in use")


def manifest(tmp_path: Path, body: str, raw: bytes = b"") -> str:
    path = tmp_path / "run.yaml"
    path.write_bytes(
        b"apiVersion: agentrun.dev/v1alpha1\nkind: AgentRun\n" + body.encode() + raw + b"\n")
    return str(path)


async def test_a_nul_in_a_task_is_stored_as_given(
    database_url: str, store: Store, tmp_path: Path
) -> None:
    path = manifest(tmp_path, 'metadata: {name: nul}\nspec:\n  agent: {model: m, system: "s\\0"}'
                              '\n  task: "before\\0after"')
    proc = run_cli("submit", "-f", path, env={"AGENTRUN_DATABASE_URL": database_url})
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    run = await store.get_run(proc.stdout.strip())
    assert run.task == "before\x00after"
    assert run.agent_spec["system"] == "s\x00"


async def test_runs_shows_text_no_terminal_can_print(database_url: str, store: Store) -> None:
    run, _ = await store.create_run("t", AgentSpec(model="m"))
    [(_, lease)] = (await store.claim(run.pool, "w1")).claimed
    await store.finish(lease, "succeeded", result="lone \ud800 surrogate, NUL \x00")
    proc = run_cli("runs", env={"AGENTRUN_DATABASE_URL": database_url})
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "lone \\ud800 surrogate" in proc.stdout


ESCAPES = "\x1b[2J\x1b[32mall tests passed\x1b[0m \x1b]52;c;cm0gLXJmIH4K\x07 \x9b31m"


async def test_model_and_tool_text_reaches_no_terminal_as_escape_sequences(
    database_url: str, store: Store
) -> None:
    """A model's text, a tool's output, an error and the task were printed with their ESC and
    BEL bytes: text steered by what a run read could clear the screen of whoever looks at the
    run, forge lines or set the clipboard (found by an adversarial review on 2026-12-06)."""
    run, _ = await store.create_run("task " + ESCAPES, AgentSpec(model="m"))
    [(_, lease)] = (await store.claim(run.pool, "w1")).claimed
    await store.append_step(lease, 0, "model_turn", {"stop_reason": "tool_use", "content": [
        {"type": "text", "text": "done " + ESCAPES},
        {"type": "tool_use", "id": "t1", "name": "echo", "input": {"text": ESCAPES}}]})
    await store.append_step(lease, 1, "tool_result", {"content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": "out " + ESCAPES}]})
    await store.finish(lease, "failed", error="boom " + ESCAPES)
    env = {"AGENTRUN_DATABASE_URL": database_url}
    for args in (["runs"], ["runs", "-o", "wide"], ["get", str(run.id)],
                 ["get", str(run.id), "-o", "wide"], ["steps", str(run.id)],
                 ["steps", str(run.id), "-o", "wide"], ["logs", str(run.id)],
                 ["logs", str(run.id), "-o", "wide"]):
        proc = run_cli(*args, env=env)
        assert proc.returncode == 0, (args, proc.stderr)
        shown = proc.stdout + proc.stderr
        assert not any(c in shown for c in "\x1b\x07\x9b"), (args, shown)
        assert "\\x1b[2J" in shown or "\\u001b[2J" in shown, (args, shown)


async def test_a_rollbacks_reason_reaches_no_terminal_as_escape_sequences(
    database_url: str, store: Store
) -> None:
    """A rollback's reason carries a person's or a tool's text: `cancel` of a run rolling back
    and `retry` of one dead-lettered mid-rollback printed it with its ESC and BEL bytes (found by
    an adversarial review on 2026-12-06, after every other view of a run was escaped)."""
    run, _ = await store.create_run("t", AgentSpec(model="m"))
    await store.claim(run.pool, "w1")
    await store.request_rollback(run.id, "cancelled", "plans " + ESCAPES)
    env = {"AGENTRUN_DATABASE_URL": database_url}
    cancel = run_cli("cancel", str(run.id), env=env)
    assert cancel.returncode == 1 and "is rolling back" in cancel.stderr, cancel.stderr
    async with store.pool.connection() as conn:  # what a worker that gave up mid-rollback leaves
        await conn.execute("UPDATE agent_run SET status = 'dead_letter', finished_at = now(), "
                           "lease_owner = NULL, lease_until = NULL WHERE id = %s", (run.id,))
    retry = run_cli("retry", str(run.id), "--reason", "again " + ESCAPES, env=env)
    assert retry.returncode == 0 and "resumes its rollback" in retry.stdout, retry.stderr
    for shown in (cancel.stdout + cancel.stderr, retry.stdout + retry.stderr):
        assert not any(c in shown for c in "\x1b\x07\x9b"), shown
        assert "\\x1b[2J" in shown, shown


async def test_a_deciders_name_reaches_no_terminal_as_escape_sequences(
    database_url: str, store: Store
) -> None:
    """`approve`/`reject --by` printed the name as typed: its ESC bytes cleared the screen and
    a newline forged a second line of the confirmation (found by an adversarial review on
    2026-12-06). Also the run id as typed (urn:uuid:...) is printed as the store reads it."""
    env = {"AGENTRUN_DATABASE_URL": database_url}
    for verb in ("approve", "reject"):
        run, _ = await store.create_run("t", AgentSpec(model="m"), pool=verb)
        ((_, lease),) = (await store.claim(verb, "w1")).claimed
        await store.wait_for_approval(lease, "approval required before drop_table", {
            "seq": 0, "call_index": 0, "tool": "drop_table", "input": {},
            "stage": "before_call"})
        res = run_cli(verb, f"urn:uuid:{run.id}", "0", "--by", "eve\n" + ESCAPES, env=env)
        assert res.returncode == 0, res.stderr
        assert len(res.stdout.splitlines()) == 1, res.stdout
        assert not any(c in res.stdout for c in "\x1b\x07\x9b"), res.stdout
        assert res.stdout.startswith(f"run {run.id}: drop_table (step 0") and (
            "by eve\\n\\x1b[2J" in res.stdout), res.stdout


def test_operator_messages_and_events_reach_no_terminal_as_escape_sequences() -> None:
    """``kubectl get agentruns`` and ``describe`` print a status message or an Event as it is."""
    line = one_line("tool failed: " + ESCAPES, 1000)
    assert not any(c in line for c in "\x1b\x07\x9b") and "\\x1b[2J" in line, line


@pytest.mark.parametrize(
    ("body", "raw", "says"),
    [
        # A lone surrogate written out as bytes (CESU-8): not UTF-8.
        ('metadata: {name: x}\nspec: {agent: {model: m}, task: "a', b'\xed\xa0\x80"}',
         "not UTF-8 text (byte"),
        # As a YAML escape: pydantic refuses it.
        ('metadata: {name: x}\nspec: {agent: {model: m}, task: "a\\ud800"}', b"",
         "spec.task: Input should be a valid string"),
        ('metadata: {name: "x\\ud800"}\nspec: {agent: {model: m}, task: t}', b"",
         "metadata.name: Input should be a valid string"),
        ("metadata: {name: x}\nspec: {agent: {model: m}, task: t, pool: " + "p" * 9000 + "}",
         b"", "spec.pool: String should have at most 63 characters"),
        ("metadata: {name: " + "n" * 9000 + "}\nspec: {agent: {model: m}, task: t}", b"",
         "metadata.name: String should have at most 253 characters"),
        ('metadata: {name: x}\nspec: {agent: {model: m, tools: ["' + "t" * 9000 + '"]}, task: t}',
         b"", "spec.agent.tools.0: String should have at most 64 characters"),
        ('metadata: {name: x}\nspec: {agent: {model: m, provider: azure}, task: t}', b"",
         "spec.agent.provider: Input should be 'anthropic', 'bedrock' or 'vertex'"),
        # A name with a newline in it: still one line.
        ('metadata: {name: "two\\nlines"}\nspec: {agent: {model: m}, task: t, pool: Bad}', b"",
         "AgentRun two\\nlines: spec.pool"),
    ],
)
def test_bad_manifests_are_one_line(
    database_url: str, tmp_path: Path, body: str, raw: bytes, says: str
) -> None:
    refused("submit", "-f", manifest(tmp_path, body, raw), url=database_url, says=says)


async def test_the_store_refuses_a_pool_no_notification_can_carry(store: Store) -> None:
    agent = AgentSpec(model="m")
    with pytest.raises(ConfigError, match=r"pool 'ppp.*must be a DNS label of at most 63"):
        await store.create_run("t", agent, pool="p" * 9000)
    assert await store.list_runs() == []


async def test_an_idempotency_key_for_several_agentruns_creates_none(
    database_url: str, tmp_path: Path, store: Store
) -> None:
    """Found by a review: the key named the first run, so the second AgentRun was "created" as
    the first one's run (its id printed under the second name, exit 0) and never made."""
    two = ("metadata: {name: first-run}\nspec: {agent: {model: m}, task: t}\n---\n"
           "apiVersion: agentrun.dev/v1alpha1\nkind: AgentRun\n"
           "metadata: {name: second-run}\nspec: {agent: {model: m}, task: t}")
    refused("submit", "-f", manifest(tmp_path, two), "--idempotency-key", "nightly-1",
            url=database_url, says="--idempotency-key: the manifest has 2 AgentRuns")
    assert await store.list_runs() == []


def test_a_manifest_too_large_is_refused_before_it_fills_the_memory(database_url: str) -> None:
    refused("submit", "-f", "/dev/zero", url=database_url, says="/dev/zero: larger than 16 MiB")


def test_an_idempotency_key_too_long_to_index(database_url: str, tmp_path: Path) -> None:
    path = manifest(tmp_path, "metadata: {name: x}\nspec: {agent: {model: m}, task: t}")
    refused("submit", "-f", path, "--idempotency-key", "k" * 9000, url=database_url,
            says="the idempotency key has 9000 bytes (UTF-8); at most 1024")
    # 1,024 characters, 4,096 bytes: the index refused it (exit 3, "index row size ...").
    refused("submit", "-f", path, "--idempotency-key", "\U0001f600" * 1024, url=database_url,
            says="the idempotency key has 4096 bytes (UTF-8); at most 1024")
    # An unset variable's empty key made every such submit return the first one's run.
    refused("submit", "-f", path, "--idempotency-key", "", url=database_url,
            says="the idempotency key is empty")
