"""agentrun get, wait, submit --wait, logs -f, -o, --namespace and completion, through the real
CLI in subprocesses, with real workers and the scripted model server."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import yaml
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from agentrun.manifests import BudgetSpec
from agentrun.store import K8sRef, Store
from tests.conftest import listeners, run_cli
from tests.proxykit import TcpProxy
from tests.test_missed_rollback import park_while_rolling_back
from tests.workerkit import (
    AGENT,
    FakeFactory,
    Workers,
    echo_scenario,
    unnamed_attempt_wait,
    wait_for,
)

# The exit codes of agentrun wait and submit --wait are a contract (docs/cli.md): literals here.

MANIFEST = """\
apiVersion: agentrun.dev/v1alpha1
kind: AgentRun
metadata: {{name: {name}{namespace}}}
spec:
  agent:
    model: claude-sonnet-4-5
    system: "You echo carefully."
    tools: [echo]
    thinking: {{budgetTokens: 1024}}
  task: "echo a few times"
  maxSteps: {max_steps}
"""


def manifest(tmp: Path, name: str, *, namespace: str | None = None, max_steps: int = 50) -> str:
    path = tmp / f"{name}.yaml"
    ns = f", namespace: {namespace}" if namespace else ""
    path.write_text(MANIFEST.format(name=name, namespace=ns, max_steps=max_steps))
    return str(path)


class Clis:
    """``agentrun`` subprocesses started in the background; each is killed by its pid at the
    end of the test, also when it fails."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, *args: str) -> subprocess.Popen[str]:
        p = subprocess.Popen(
            [sys.executable, "-m", "agentrun", *args],
            env={**os.environ, **self.env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tempfile.gettempdir(),
        )
        self.procs.append(p)
        return p

    def stop_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.communicate()


@pytest.fixture
def clis(database_url: str) -> Iterator[Clis]:
    c = Clis({"AGENTRUN_DATABASE_URL": database_url})
    try:
        yield c
    finally:
        c.stop_all()


def submit(path: str, env: dict[str, str], *extra: str) -> str:
    res = run_cli("submit", "-f", path, *extra, env=env)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


async def test_logs_follow_prints_every_step_and_wait_exits_zero_when_it_succeeds(
    tmp_path: Path, database_url: str, store: Store, workers: Workers, fake: FakeFactory,
    clis: Clis,
) -> None:
    env = {"AGENTRUN_DATABASE_URL": database_url}
    srv = fake(echo_scenario(4, delay_ms=300))
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    rid = submit(manifest(tmp_path, "follow-me"), env)
    follow = clis.start("logs", "-f", rid, "-o", "json")
    follow_text = clis.start("logs", "--follow", rid)
    waiter = clis.start("wait", rid, "--timeout", "120")
    # Every follower is listening before the run starts: it finishes while they follow.
    await wait_for(lambda: listeners(database_url) >= 3, 30, "three LISTENing followers")
    workers.start("w1")
    out, err = follow.communicate(timeout=120)
    assert follow.returncode == 0, err
    steps = await store.steps(rid)
    run = await store.get_run(rid)
    assert run.status == "succeeded" and len(steps) == 7  # 4 model turns, 3 tool results
    printed = [json.loads(line) for line in out.splitlines()]
    assert [s["seq"] for s in printed] == [s.seq for s in steps] == list(range(7))
    assert [s["kind"] for s in printed] == [s.kind for s in steps]
    assert printed[-1]["payload"] == steps[-1].payload
    assert f"run {rid} succeeded: All 4 turns done." in err
    text_out, _ = follow_text.communicate(timeout=60)
    assert follow_text.returncode == 0 and len(text_out.splitlines()) == 7
    assert "echo(" in text_out and "All 4 turns done." in text_out
    w_out, w_err = waiter.communicate(timeout=60)
    assert waiter.returncode == 0, w_err
    assert w_out.strip() == f"run {rid} succeeded: All 4 turns done."
    # Without -f: the steps there are, then it returns.
    again = run_cli("logs", rid, env=env)
    assert again.returncode == 0 and again.stdout == text_out


async def test_wait_and_submit_wait_exit_non_zero_for_a_run_that_fails(
    tmp_path: Path, database_url: str, workers: Workers, fake: FakeFactory, clis: Clis
) -> None:
    env = {"AGENTRUN_DATABASE_URL": database_url}
    srv = fake(echo_scenario(6, delay_ms=200))
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    rid = submit(manifest(tmp_path, "too-short", max_steps=2), env)
    waiter = clis.start("wait", rid)
    finished = clis.start("wait", rid, "--for", "finished", "-o", "json")
    await wait_for(lambda: listeners(database_url) >= 2, 30, "two LISTENing waiters")
    workers.start("w1")
    out, err = waiter.communicate(timeout=120)
    assert waiter.returncode == 4, err
    assert out.strip() == f"run {rid} failed: maxSteps 2 reached without a final answer"
    out, err = finished.communicate(timeout=60)
    assert finished.returncode == 0, err  # --for finished: it ended, however
    assert json.loads(out)["status"] == "failed"
    # submit --wait: the id at once on stdout, the end on stderr, the exit code of wait.
    res = run_cli("submit", "-f", manifest(tmp_path, "again", max_steps=2), "--wait", env=env,
                  timeout=120)
    assert res.returncode == 4, res.stderr
    (new_id,) = res.stdout.split()
    assert f"run {new_id} failed: maxSteps 2" in res.stderr
    res = run_cli("submit", "-f", manifest(tmp_path, "json", max_steps=2), "--wait", "-o",
                  "json", env=env, timeout=120)
    assert res.returncode == 4, res.stderr
    row = json.loads(res.stdout)
    assert row["name"] == "json" and row["status"] == "failed" and "maxSteps" in row["error"]


async def test_wait_on_a_cancelled_run_exits_5(
    tmp_path: Path, database_url: str, clis: Clis
) -> None:
    env = {"AGENTRUN_DATABASE_URL": database_url}
    rid = submit(manifest(tmp_path, "to-cancel"), env)  # no worker: it stays pending
    waiter = clis.start("wait", rid)
    await wait_for(lambda: listeners(database_url) >= 1, 30, "a LISTENing waiter")
    assert run_cli("cancel", rid, "--reason", "not today", env=env).returncode == 0
    out, err = waiter.communicate(timeout=60)
    assert waiter.returncode == 5, err
    assert out.strip() == f"run {rid} cancelled: not today"


async def test_cancel_rollback_of_a_dead_letter_says_why_nothing_is_rolled_back(
    tmp_path: Path, database_url: str, store: Store
) -> None:
    """A dead letter with compensations due rolls back (tests/test_compensations.py); one with
    none, or one dead-lettered inside its rollback (a retry resumes that one), says so, exit 1,
    and is left as it was."""
    env = {"AGENTRUN_DATABASE_URL": database_url}
    plain = submit(manifest(tmp_path, "dead-plain"), env)
    mid = submit(manifest(tmp_path, "dead-mid-rollback"), env)
    with psycopg.connect(database_url, autocommit=True) as conn:  # as the claim dead-letters
        conn.execute("UPDATE agent_run SET status = 'dead_letter', finished_at = now(), "
                     "error = 'dead-lettered' WHERE id = %s", [plain])
        conn.execute("UPDATE agent_run SET status = 'dead_letter', finished_at = now(), "
                     "error = 'dead-lettered', rollback_reason = 'cancelled: plans changed', "
                     "rollback_end = 'cancelled' WHERE id = %s", [mid])
    res = run_cli("cancel", plain, "--rollback", env=env)
    assert (res.returncode, res.stdout) == (1, ""), res.stderr
    assert res.stderr.strip() == (f"run {plain} was dead-lettered with nothing to roll back (no "
                                  "compensable effect of it is left undone)")
    res = run_cli("cancel", mid, "--rollback", env=env)
    assert (res.returncode, res.stdout) == (1, ""), res.stderr
    assert res.stderr.strip() == (
        f"run {mid} was dead-lettered in the middle of its rollback (cancelled: plans changed); "
        f"`agentrun retry {mid}` resumes it")
    for rid in (plain, mid):
        assert (await store.get_run(rid)).status == "dead_letter"


async def test_cancel_rollback_of_a_run_rolling_back_already_says_how_it_ends(
    tmp_path: Path, database_url: str, store: Store
) -> None:
    """The first request's reason and end stand: a second one, or one after a reject --abort
    (ends failed), is not recorded and says so, exit 1. Before, both printed "rollback requested;
    ... then it ends cancelled", exit 0, and the run ended failed with the first reason."""
    env = {"AGENTRUN_DATABASE_URL": database_url}
    rid = submit(manifest(tmp_path, "roll-back"), env)  # no worker: it stays pending
    await store.request_rollback(rid, "failed", "rejected by bob")  # as reject --abort asks
    res = run_cli("cancel", rid, "--rollback", "--reason", "customer cancelled", env=env)
    assert res.returncode == 1, res.stdout
    assert res.stderr.strip() == (
        f"run {rid} is rolling back already (rejected by bob); its compensations run, then it "
        "ends failed; this request was not recorded")
    run = await store.get_run(rid)
    assert (run.rollback_reason, run.rollback_end) == ("rejected by bob", "failed")
    fresh = submit(manifest(tmp_path, "roll-back-2"), env)
    first = run_cli("cancel", fresh, "--rollback", "--reason", "plans changed", env=env)
    assert first.returncode == 0, first.stderr
    assert "ends cancelled" in first.stdout
    again = run_cli("cancel", fresh, "--rollback", env=env)
    assert again.returncode == 1 and "ends cancelled; this request was not recorded" in (
        again.stderr), again.stderr


def test_wait_timeout_on_a_run_that_never_ends_exits_124(
    tmp_path: Path, database_url: str
) -> None:
    env = {"AGENTRUN_DATABASE_URL": database_url}
    rid = submit(manifest(tmp_path, "never"), env)  # no worker: it never ends
    res = run_cli("wait", rid, "--timeout", "1", env=env)
    assert res.returncode == 124
    assert res.stderr.strip() == f"agentrun: error: run {rid} has not ended after 1s (--timeout)"
    res = run_cli("submit", "-f", manifest(tmp_path, "never2"), "--wait", "--timeout", "1",
                  env=env)
    assert res.returncode == 124 and len(res.stdout.split()) == 1, res.stderr
    # Bad input: exit 2, one line; an unknown run: 1 at once, not at the timeout.
    res = run_cli("wait", rid, "--timeout", "0", env=env)
    assert res.returncode == 2 and "--timeout 0: must be more than 0" in res.stderr
    res = run_cli("wait", rid, "--for", "done", env=env)
    assert res.returncode == 2 and "invalid choice: 'done'" in res.stderr
    res = run_cli("wait", "3f1e2b7a-0000-4000-8000-000000000000", "--timeout", "600", env=env)
    assert res.returncode == 1 and "no run with id" in res.stderr


async def test_get_and_reject_name_the_attempt_of_a_wait_that_does_not_name_it(
    database_url: str, store: Store
) -> None:
    """A timeout's wait written by a worker of an earlier release names no attempt: decide
    records the one the intent counts (attempt 2 here), and `get` said "attempt 1" and `reject`
    printed it too (found by an adversarial review on 2026-12-06)."""
    env = {"AGENTRUN_DATABASE_URL": database_url}
    run = await unnamed_attempt_wait(store)

    got = run_cli("get", str(run.id), env=env)
    assert got.returncode == 0, got.stderr
    assert "wire_money (outcome unknown, attempt 2): agentrun approve" in got.stdout, got.stdout
    # The step had alice's decision on attempt 1: get names the wait, a bare 0 is refused.
    assert f"agentrun reject {run.id} 0.0.2" in got.stdout, got.stdout
    bare = run_cli("reject", str(run.id), "0", "--by", "bob", env=env)
    assert bare.returncode == 2, (bare.stdout, bare.stderr)
    assert "name that wait to decide it (0.0.2); nothing was recorded" in bare.stderr, bare.stderr
    rejected = run_cli("reject", str(run.id), "0.0.2", "--by", "bob", env=env)
    assert rejected.returncode == 0, rejected.stderr
    said = rejected.stdout
    assert "(step 0 call 0, outcome unknown, attempt 2) rejected by bob" in said, said


async def test_a_refusal_naming_an_earlier_decider_shows_its_name_escaped(
    database_url: str, store: Store
) -> None:
    """A bare step number after the step's first decision is refused naming who decided it: that
    name is anyone's text (--by), and its bidirectional controls reordered the line."""
    env = {"AGENTRUN_DATABASE_URL": database_url}
    run = await unnamed_attempt_wait(store, decided_by="mallory\u202e)dexif( \u2066")
    bare = run_cli("reject", str(run.id), "0", "--by", "bob", env=env)
    assert bare.returncode == 2, (bare.stdout, bare.stderr)
    assert "approved by mallory\\u202e)dexif( \\u2066)" in bare.stderr, bare.stderr
    assert "\u202e" not in bare.stderr and "\u2066" not in bare.stderr


async def test_get_shows_the_pending_approval_with_its_seq_and_attempt(
    database_url: str, store: Store
) -> None:
    env = {"AGENTRUN_DATABASE_URL": database_url}
    capped = AGENT.model_copy(update={"budget": BudgetSpec(maxTokens=5000, maxCostUSD=2)})
    run, _ = await store.create_run("drop the table", capped)
    (_, lease), = (await store.claim("default", "worker-a")).claimed
    await store.append_step(lease, 0, "model_turn", {"content": []}, input_tokens=120,
                            output_tokens=45, cache_read_tokens=800, cache_write_tokens=30,
                            cost_usd=0.01234)
    await store.wait_for_approval(
        lease,
        "drop_table (step 0, call 0) may have run: worker-a died inside it",
        {"seq": 0, "call_index": 0, "tool": "drop_table", "stage": "outcome_unknown",
         "attempt": 2},
    )
    res = run_cli("get", str(run.id), env=env)
    assert res.returncode == 0, res.stderr
    fields = dict(line.split(":", 1) for line in res.stdout.splitlines())
    fields = {k: v.strip() for k, v in fields.items()}
    assert fields["status"] == "waiting_approval"
    assert fields["approval"] == (
        f"step 0 call 0, drop_table (outcome unknown, attempt 2): agentrun approve {run.id} "
        f"0.0.2 | agentrun reject {run.id} 0.0.2"
    )
    assert fields["tokens"] == "120 in, 45 out, 800 cache read, 30 cache write"
    assert fields["cost"] == "$0.0123 (estimated)"
    assert fields["caching"] == "on"
    assert fields["budget"] == "995 of 5000 tokens, $0.0123 of $2"
    assert fields["turns"] == "1 (max 50); 1 step in the log"
    assert fields["attempt"].startswith("0 ")
    assert "worker-a died inside it" in fields["waiting"]
    as_json = json.loads(run_cli("get", str(run.id), "-o", "json", env=env).stdout)
    assert as_json["pending_call"]["attempt"] == 2 and as_json["input_tokens"] == 120
    assert as_json["cache_read_tokens"] == 800 and as_json["cache_write_tokens"] == 30
    assert as_json["cost_usd"] == 0.01234
    as_yaml = yaml.safe_load(run_cli("get", str(run.id), "-o", "yaml", env=env).stdout)
    assert as_yaml == as_json
    # A running run shows who holds it.
    other, _ = await store.create_run("echo", AGENT)
    await store.claim("default", "worker-b")
    res = run_cli("get", str(other.id), "-o", "wide", env=env)
    assert "worker:   worker-b (lease epoch 1" in res.stdout
    assert "budget:   -" in res.stdout  # no limits


async def test_submitted_runs_keep_their_name_and_runs_filters_by_namespace(
    tmp_path: Path, database_url: str, store: Store
) -> None:
    env = {"AGENTRUN_DATABASE_URL": database_url}
    a = submit(manifest(tmp_path, "team-a-run", namespace="team-a"), env)
    plain = submit(manifest(tmp_path, "no-namespace"), env)
    # An AgentRun object's run, as the operator creates it: unaffected, and its key reserved.
    obj, _ = await store.create_run("t", AGENT, k8s=K8sRef("team-a", "from-kubectl", "uid-1"))
    res = run_cli("runs", env=env)
    assert res.returncode == 0, res.stderr
    names = {line.split()[0]: line.split()[1] for line in res.stdout.splitlines()[1:]}
    assert names == {a: "team-a-run", plain: "no-namespace", str(obj.id): "from-kubectl"}
    res = run_cli("runs", "--namespace", "team-a", "-o", "json", env=env)
    rows = json.loads(res.stdout)
    assert {r["id"] for r in rows} == {a, str(obj.id)}
    by_id = {r["id"]: r for r in rows}
    assert by_id[a]["k8s_uid"] is None and by_id[str(obj.id)]["k8s_uid"] == "uid-1"
    default = json.loads(run_cli("runs", "--namespace", "default", "-o", "json", env=env).stdout)
    assert [r["id"] for r in default] == [plain]
    assert yaml.safe_load(run_cli("runs", "-o", "yaml", env=env).stdout) == json.loads(
        run_cli("runs", "-o", "json", env=env).stdout
    )
    wide = run_cli("runs", "-o", "wide", env=env).stdout.splitlines()
    assert wide[0].split()[:3] == ["ID", "NAMESPACE", "NAME"]
    assert any(line.split()[:3] == [a, "team-a", "team-a-run"] for line in wide)
    # The operator only ever reads runs of objects: a submitted name is not one.
    assert [r.id for r in await store.k8s_live_runs()] == [obj.id]
    res = run_cli("get", a, env=env)
    assert "team-a/team-a-run (submitted from a manifest; no object)" in res.stdout
    # A client's key cannot pass for an object's.
    res = run_cli("submit", "-f", manifest(tmp_path, "sneaky"), "--idempotency-key", "k8s:uid-1",
                  env=env)
    assert res.returncode == 2 and "reserved for the runs of AgentRun objects" in res.stderr
    res = run_cli("runs", "--status", "bogus", env=env)
    assert res.returncode == 2 and "invalid choice: 'bogus'" in res.stderr


def test_every_option_has_help_its_default_and_its_valid_values() -> None:
    from agentrun.cli import _HelpFormatter, build_parser

    parser = build_parser()
    (subs,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sp in subs.choices.items():
        if name == "fake-anthropic":  # its own parser (agentrun fake-anthropic --help)
            continue
        for action in sp._actions:
            if not action.option_strings or action.dest == "help":
                continue
            option = f"agentrun {name} {action.option_strings[0]}"
            assert action.help, f"{option}: no help"
            shown = _HelpFormatter(name)._get_help_string(action) or ""
            if action.default not in (None, False, []):
                assert "default" in shown, f"{option}: its default is not shown"
            for choice in action.choices or ():
                assert str(choice) in shown, f"{option}: {choice} is not listed"
    runs = " ".join(run_cli("runs", "--help").stdout.split())
    assert "pending, running, waiting_approval, succeeded, failed, cancelled, dead_letter" in runs
    assert "list at most this many (1-100000) (default: 100)" in runs


def test_bash_completion_completes_commands_options_and_their_values(tmp_path: Path) -> None:
    res = run_cli("completion", "bash")
    assert res.returncode == 0, res.stderr
    script = tmp_path / "agentrun.bash"
    script.write_text(res.stdout)

    def complete(*words: str) -> list[str]:
        line = " ".join(f"'{w}'" for w in words)
        probe = (
            f"source {script}; COMP_WORDS=({line}); COMP_CWORD={len(words) - 1}; _agentrun; "
            'printf "%s\\n" "${COMPREPLY[@]}"'
        )
        out = subprocess.run(["bash", "--norc", "-c", probe], capture_output=True, text=True,
                             timeout=30, check=True)
        return out.stdout.split()

    assert complete("agentrun", "wa") == ["wait"]
    assert set(complete("agentrun", "")) >= {"runs", "get", "wait", "logs", "submit", "worker"}
    assert complete("agentrun", "wait", "RUN", "--for", "") == ["succeeded", "finished"]
    assert complete("agentrun", "runs", "--status", "dead") == ["dead_letter"]
    assert complete("agentrun", "runs", "-o", "") == ["table", "wide", "json", "yaml"]
    assert complete("agentrun", "logs", "RUN", "--f") == ["--follow"]
    assert "--timeout" in complete("agentrun", "submit", "--")


async def test_wait_re_reads_the_run_when_its_listen_connection_comes_back(
    tmp_path: Path, database_url: str, clis: Clis
) -> None:
    """The run ends while the waiter's LISTEN connection is gone (its backend terminated while
    the waiter is SIGSTOPped): that notification is lost for good, and the re-read after the
    reconnect is what sees the end."""
    env = {"AGENTRUN_DATABASE_URL": database_url}
    rid = submit(manifest(tmp_path, "lost-note"), env)
    waiter = clis.start("wait", rid)
    await wait_for(lambda: listeners(database_url) >= 1, 30, "a LISTENing waiter")
    waiter.send_signal(signal.SIGSTOP)
    try:
        with psycopg.connect(database_url, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND query LIKE 'LISTEN %'"
            ).fetchone()
        assert row == (1,)
        # pg_terminate_backend only signals: until the backend is gone, a NOTIFY may still
        # reach it and wait in the stopped waiter's socket (seen once under load: the waiter
        # then saw the end before the loss, and said nothing of it).
        await wait_for(lambda: listeners(database_url) == 0, 30, "the LISTEN backend gone")
        assert run_cli("cancel", rid, env=env).returncode == 0  # notified to nobody
    finally:
        waiter.send_signal(signal.SIGCONT)
    out, err = waiter.communicate(timeout=60)
    assert waiter.returncode == 5, err
    assert out.strip() == f"run {rid} cancelled"
    assert "lost the database's notifications" in err and "listening again" in err


async def test_wait_and_logs_follow_ride_out_a_restart_of_every_connection_they_hold(
    tmp_path: Path, database_url: str
) -> None:
    """A database restart kills the pooled connections too, not only the LISTEN one: the first
    re-read after the reconnect took a dead one from the pool, and `wait` and `logs -f` ended
    with exit 3 while the run went on (found by an adversarial review on 2026-12-06). Every
    backend of the two is terminated here, as a restart does; then the run is cancelled."""
    env = {"AGENTRUN_DATABASE_URL": database_url}
    rid = submit(manifest(tmp_path, "blip"), env)
    clis = Clis({**env, "PGAPPNAME": "agentrun-blip"})
    try:
        waiter = clis.start("wait", rid)
        follower = clis.start("logs", "-f", rid)
        await wait_for(lambda: listeners(database_url) >= 2, 30, "two LISTENing followers")

        def theirs() -> list[int]:
            with psycopg.connect(database_url, autocommit=True) as conn:
                return [pid for (pid,) in conn.execute(
                    "SELECT pid FROM pg_stat_activity WHERE application_name = 'agentrun-blip'")]

        killed = theirs()
        assert len(killed) >= 3  # two LISTEN sessions and at least one pooled connection
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS pid",
                         [killed])
        await wait_for(lambda: not set(killed) & set(theirs()), 30, "their backends gone")


        def still_following() -> bool:
            for p in (waiter, follower):
                if p.poll() is not None:
                    raise AssertionError(f"{p.args} exited {p.returncode}: "
                                         f"{p.communicate()[1][-1000:]}")
            return listeners(database_url) >= 2

        await wait_for(still_following, 30, "both listening again")
        assert run_cli("cancel", rid, env=env).returncode == 0
        out, waited = waiter.communicate(timeout=60)
        assert (waiter.returncode, out.strip()) == (5, f"run {rid} cancelled"), waited
        out, err = follower.communicate(timeout=60)
        assert follower.returncode == 0, err
        assert f"run {rid} cancelled" in err
        # Their own lines only: psycopg_pool's records of what it dropped and failed to open
        # (several lines each) filled stderr beside them (found by a review).
        assert "psycopg" not in waited + err, waited + err
    finally:
        clis.stop_all()


def stderr_to(path: Path, *args: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """``agentrun ARGS`` in the background, its stderr written to ``path`` as it goes."""
    with path.open("w") as out:
        return subprocess.Popen([sys.executable, "-m", "agentrun", *args],
                                stdout=subprocess.DEVNULL, stderr=out,
                                cwd=tempfile.gettempdir(), env={**os.environ, **env})


async def test_a_signal_ends_logs_follow_at_once_while_the_database_is_down(
    tmp_path: Path, database_url: str
) -> None:
    """Found by a review: with the database unreachable, taking the follower's row back waited
    for the pool's connection timeout (30 s) before a SIGTERM or a Ctrl-C took effect. It gives
    up after a second now; the row expires by itself."""
    rid = submit(manifest(tmp_path, "cut-off"), {"AGENTRUN_DATABASE_URL": database_url})
    parts = conninfo_to_dict(database_url)
    proxy = TcpProxy((str(parts.get("host") or "127.0.0.1"), int(parts.get("port") or 5432)))
    proxy.start()
    said = tmp_path / "stderr"
    follower = stderr_to(said, "logs", "-f", rid, env={"AGENTRUN_DATABASE_URL": make_conninfo(
        database_url, host="127.0.0.1", port=str(proxy.port))})
    try:
        await wait_for(lambda: listeners(database_url) >= 1, 30, "a LISTENing follower")
        proxy.cut()
        # Until its pool has lost its connections and waits for new ones.
        await wait_for(lambda: "cannot read it" in said.read_text(), 30, "a failed re-read")
        follower.send_signal(signal.SIGTERM)
        # Far below the 30 s it took: the exit no longer waits on the pool.
        assert follower.wait(timeout=20) == 143, said.read_text()
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
        proxy.stop()


async def test_get_counts_model_turns_against_max_steps(database_url: str, store: Store) -> None:
    """maxSteps counts model turns; `get` showed next_seq against it, which counts a turn's tool
    results too ("4 (max 2)" for a run that failed at 2 turns). The attempts in a row without a
    step follow the claim's rule: a step committed since the claim starts the count over."""
    run, _ = await store.create_run("t", AGENT, max_steps=2)
    (_, lease), = (await store.claim("default", "w1", 1)).claimed
    for seq in range(4):  # two model turns, each with its tool results
        kind = "model_turn" if seq % 2 == 0 else "tool_result"
        await store.append_step(lease, seq, kind, {"content": []})
    await store.finish(lease, "failed", error="maxSteps 2 reached without a final answer")
    env = {"AGENTRUN_DATABASE_URL": database_url}
    for command in (["get", str(run.id)], ["get", str(run.id), "-o", "wide"],
                    ["wait", str(run.id), "-o", "wide"]):
        out = run_cli(*command, env=env)
        fields = {k: v.strip() for k, v in (ln.split(":", 1) for ln in out.stdout.splitlines())}
        assert fields["turns"] == "2 (max 2); 4 steps in the log", (command, fields)
        assert fields["attempt"] == "1 (in a row without a step: 0, max 8)", (command, fields)


async def test_cancel_rollback_of_a_parked_rollback_says_it_resumes_it(
    database_url: str, store: Store
) -> None:
    """An older worker parked a run in waiting_approval while it rolled back: cancel --rollback
    resumed it, then said "this request was not recorded" (exit 1)."""
    h = await park_while_rolling_back(store)
    out = run_cli("cancel", str(h.run.id), "--rollback",
                  env={"AGENTRUN_DATABASE_URL": database_url})
    assert out.returncode == 0, out.stderr
    assert "its compensations run, then it ends failed" in out.stdout, out.stdout
    assert (await store.get_run(h.run.id)).status == "pending"
    again = run_cli("cancel", str(h.run.id), "--rollback",
                    env={"AGENTRUN_DATABASE_URL": database_url})
    assert again.returncode == 1 and "not recorded" in again.stderr, again.stderr
