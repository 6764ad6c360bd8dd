"""``agentrun demo`` on its own: its own pool, production schema and worker ids per invocation, a
deadline, Ctrl-C, and no temporary directory left behind, through the real CLI.

The demo used to share the ``default`` pool, the ``demo_production`` schema and the worker ids
``worker-1``/``worker-2`` with everything else: a leftover run or a worker started by hand made
it hang or fail its own exactly-once check, and two demos at once broke each other.
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from agentrun.demo import SUMMARY_WIDTH
from tests.conftest import run_cli, start_cli
from tests.workerkit import free_port

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "migrate-orders.yaml"
POOL_LINE = re.compile(r"pool (demo-[0-9a-f]+), production schema (demo_production_[0-9a-f]+)")


def _agentrun(
    procs: list[subprocess.Popen[str]], args: list[str], env: dict[str, str], out: Path | None
) -> subprocess.Popen[str]:
    return start_cli(procs, args, env, out, stderr_apart=True)


def _wait_exit(p: subprocess.Popen[str], within: float) -> tuple[str, str]:
    out, err = p.communicate(timeout=within)
    return out, err


def _demo_dirs(tmp: Path) -> list[Path]:
    return sorted(tmp.glob("agentrun-demo-*"))


def _processes_with(text: str) -> list[int]:
    """The pids whose command line holds ``text`` (the demo's workers carry its pool name)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmdline = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(int(d.name))
    return found


def _schemas(url: str) -> list[str]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT nspname FROM pg_namespace WHERE nspname LIKE 'demo_production%' ORDER BY 1"
        ).fetchall()
    return [str(r[0]) for r in rows]


def _passed(out: str) -> None:
    lines = out.splitlines()
    top = next(i for i, ln in enumerate(lines) if ln.startswith("timeline ("))
    header = lines[top + 1]
    rows = [ln for ln in lines[top + 2 : lines.index("", top)] if not ln.strip().startswith("---")]
    assert len(rows) == 23, rows
    at = header.index("SUMMARY")
    for row in rows:  # a long summary is cut to the column's width, and says so
        summary = row[at:]
        assert len(summary) <= SUMMARY_WIDTH, row
        assert len(summary) < SUMMARY_WIDTH or summary.endswith("…"), row
    assert "True" not in out and "False" not in out, out
    assert "each production write happened exactly once: yes" in out, out
    assert "run succeeded: 12 model turns, 23 steps (contiguous: yes)" in out, out
    assert "written by worker-1, worker-2" in out, out


def test_two_demos_at_once_both_pass_each_in_its_own_pool_and_schema(
    database_url: str, tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    env = {"AGENTRUN_DATABASE_URL": database_url, "TMPDIR": str(tmp_path)}
    demos = [_agentrun(procs, ["demo"], env, None) for _ in range(2)]
    results = [_wait_exit(p, 240) for p in demos]
    for p, (out, err) in zip(demos, results, strict=True):
        assert p.returncode == 0, out + err
        _passed(out)
    pools = {m.group(1) for out, _ in results for m in [POOL_LINE.search(out)] if m}
    assert len(pools) == 2, results
    with psycopg.connect(database_url) as conn:
        rows = conn.execute("SELECT pool, status FROM agent_run ORDER BY pool").fetchall()
        workers = conn.execute(
            "SELECT DISTINCT s.worker FROM agent_step s ORDER BY 1"
        ).fetchall()
    assert sorted(r[0] for r in rows) == sorted(pools) and {r[1] for r in rows} == {"succeeded"}
    assert len(workers) == 4, workers  # two workers each, and no id shared between the demos
    assert _schemas(database_url) == []  # each dropped its production schema once it reported
    assert _demo_dirs(tmp_path) == []


def test_a_demo_passes_beside_a_leftover_run_and_a_worker_started_by_hand(
    database_url: str, tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    env = {"AGENTRUN_DATABASE_URL": database_url}
    # A run left pending in the default pool (the README's example, submitted by hand earlier).
    res = run_cli("submit", "-f", str(EXAMPLE), env=env)
    assert res.returncode == 0, res.stderr
    leftover = res.stdout.strip()
    port = free_port()
    fake = _agentrun(
        procs, ["fake-anthropic", "--scenario", "demo_migration", "--port", str(port)], env, None
    )
    assert fake.stdout is not None and "listening" in fake.stdout.readline()
    demo = _agentrun(procs, ["demo"], env, None)
    # The README's worker, on the default pool and the demo_production schema, by hand.
    by_hand = _agentrun(
        procs,
        ["worker", "--tools", "agentrun.demo_tools", "--health-port", "-1",
         "--control-port", "-1", "--worker-id", "worker-1"],
        {**env, "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{port}", "ANTHROPIC_API_KEY": "x"},
        tmp_path / "by-hand.log",
    )
    out, err = _wait_exit(demo, 240)
    assert demo.returncode == 0, out + err
    _passed(out)
    # The worker started by hand ran the leftover run, in its own schema, meanwhile.
    assert by_hand.poll() is None, (tmp_path / "by-hand.log").read_text()
    deadline = time.monotonic() + 120
    while True:
        with psycopg.connect(database_url) as conn:
            row = conn.execute(
                "SELECT status FROM agent_run WHERE id = %s", (leftover,)
            ).fetchone()
        if row and row[0] == "succeeded":
            break
        assert time.monotonic() < deadline, (row, (tmp_path / "by-hand.log").read_text())
        time.sleep(0.2)
    with psycopg.connect(database_url) as conn:
        ledger = conn.execute(
            "SELECT DISTINCT run_id FROM demo_production.write_ledger"
        ).fetchall()
    assert ledger == [(leftover,)]


@pytest.fixture
def black_hole() -> Iterator[int]:
    """A port that accepts connections and never answers: a model call that hangs, so the
    demo is certainly mid-run when the deadline passes or the test interrupts it."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except TimeoutError:
                continue
            except OSError:
                return

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield int(srv.getsockname()[1])
    finally:
        stop.set()
        t.join(5)
        for c in held:
            c.close()
        srv.close()


def _hanging_demo_env(database_url: str, tmp_path: Path, port: int) -> dict[str, str]:
    # --model with a key: the demo's workers call ANTHROPIC_BASE_URL, which never answers.
    return {
        "AGENTRUN_DATABASE_URL": database_url,
        "TMPDIR": str(tmp_path),
        "ANTHROPIC_API_KEY": "x",
        "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{port}",
    }


def _wait_for_worker(demo: subprocess.Popen[str]) -> str:
    """The demo's pool, once its first worker process is running."""
    assert demo.stdout is not None
    lines = [demo.stdout.readline() for _ in range(2)]  # "run ID: ..." and "  model: ...; pool"
    m = POOL_LINE.search(lines[1])
    assert m, lines
    pool = m.group(1)
    deadline = time.monotonic() + 60
    while not _processes_with(pool):
        assert demo.poll() is None and time.monotonic() < deadline, lines
        time.sleep(0.05)
    return pool


def test_the_demo_deadline_is_one_line_exit_124_saying_what_is_left(
    database_url: str, tmp_path: Path, black_hole: int, procs: list[subprocess.Popen[str]]
) -> None:
    env = _hanging_demo_env(database_url, tmp_path, black_hole)
    demo = _agentrun(procs, ["demo", "--model", "claude-sonnet-4-5", "--timeout", "20"], env,
                     None)
    pool = _wait_for_worker(demo)
    assert _demo_dirs(tmp_path)  # it made its temporary directory ...
    out, err = _wait_exit(demo, 120)
    assert demo.returncode == 124, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith("agentrun: error: demo: not finished after 20s (--timeout)"), err
    (schema,) = _schemas(database_url)
    with psycopg.connect(database_url) as conn:
        (run_id,) = conn.execute("SELECT id::text FROM agent_run").fetchone() or (None,)
    assert f"run {run_id} in pool {pool}" in line and f"schema {schema}" in line, line
    assert _demo_dirs(tmp_path) == []  # ... and removed it
    assert _processes_with(pool) == []  # its workers are gone


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)],
                         ids=["ctrl-c", "sigterm"])
def test_ctrl_c_stops_the_demos_workers_removes_its_files_and_says_what_is_left(
    database_url: str, tmp_path: Path, black_hole: int, procs: list[subprocess.Popen[str]],
    sig: signal.Signals, code: int,
) -> None:
    """SIGTERM (kill, timeout(1), a cancelled CI job) as Ctrl-C: it once ended the demo at once,
    saying nothing, its temporary directory left and a worker running for ever (found by an
    adversarial review on 2026-12-06)."""
    env = _hanging_demo_env(database_url, tmp_path, black_hole)
    demo = _agentrun(procs, ["demo", "--model", "claude-sonnet-4-5"], env, None)
    pool = _wait_for_worker(demo)
    assert _demo_dirs(tmp_path)
    demo.send_signal(sig)
    out, err = _wait_exit(demo, 60)
    assert demo.returncode == code, out + err
    lines = [ln for ln in err.splitlines() if not ln.startswith("agentrun: using the embedded")]
    assert len(lines) == 1, err
    (schema,) = _schemas(database_url)
    with psycopg.connect(database_url) as conn:
        (run_id,) = conn.execute("SELECT id::text FROM agent_run").fetchone() or (None,)
    assert lines[0].startswith("agentrun demo: interrupted;"), lines
    assert f"run {run_id} in pool {pool}" in lines[0] and f"schema {schema}" in lines[0], lines
    assert "Traceback" not in out + err
    assert _demo_dirs(tmp_path) == []
    assert _processes_with(pool) == []


def test_a_sigkilled_demo_takes_its_workers_with_it(
    database_url: str, tmp_path: Path, black_hole: int, procs: list[subprocess.Popen[str]]
) -> None:
    """``kill -9`` (or the OOM killer) gives the demo no chance to stop its workers: they were
    left idling in the demo's pool for ever, holding connections. The kernel now SIGTERMs each
    worker when the demo dies (PR_SET_PDEATHSIG); procs kills the group if it does not."""
    env = _hanging_demo_env(database_url, tmp_path, black_hole)
    demo = _agentrun(procs, ["demo", "--model", "claude-sonnet-4-5"], env, None)
    pool = _wait_for_worker(demo)
    workers = _processes_with(pool)
    demo.send_signal(signal.SIGKILL)  # the demo alone, not its process group
    demo.wait()
    deadline = time.monotonic() + 60  # a bound for a failing test, not a timing
    while _processes_with(pool):
        assert time.monotonic() < deadline, f"the demo's workers {workers} outlived it"
        time.sleep(0.05)
