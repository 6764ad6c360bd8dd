"""Liveness by progress (issue 12, F4) and readiness by listening.

Connections that die without a RST or FIN are faked with tests/proxykit.py's traps: the one
connection that carries a given write goes silent (or is held back), while every other keeps
working, so the worker's heartbeat and claim loop stay busy and only progress can tell.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from uuid import UUID

import anthropic
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from agentrun.manifests import AgentSpec
from agentrun.store import ConnectOptions, Store, connect
from agentrun.tools import ToolRegistry
from agentrun.worker.executor import RunHandle
from agentrun.worker.liveness import Progress
from agentrun.worker.process import Worker, WorkerSettings
from tests.proxykit import TcpProxy
from tests.workerkit import AGENT, FakeFactory, Workers, echo_scenario, wait_for, wait_run

MARKER = "commit-me-into-a-black-hole"


def status_of(port: int | None, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return 0  # not serving yet


@pytest.fixture
def proxy(database_url: str) -> Iterator[TcpProxy]:
    parts = conninfo_to_dict(database_url)
    p = TcpProxy((str(parts.get("host") or "127.0.0.1"), int(parts.get("port") or 5432))).start()
    try:
        yield p
    finally:
        p.stop()


def via(proxy: TcpProxy, url: str) -> str:
    params = conninfo_to_dict(url)
    params.update(host="127.0.0.1", port=str(proxy.port))
    return make_conninfo(**params)  # type: ignore[arg-type]


class Poller:
    """Polls a worker's /healthz in a thread and keeps every answer (a short 503 is seen)."""

    def __init__(self, port: int | None) -> None:
        self.port = port
        self.seen: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.wait(0.05):
            self.seen.append(status_of(self.port, "/healthz"))

    def __enter__(self) -> Poller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


async def test_a_run_whose_connection_dies_silently_is_let_go_and_resumed(
    store: Store, workers: Workers, fake: FakeFactory, proxy: TcpProxy, database_url: str
) -> None:
    # Turn 0's commit carries MARKER: the proxy swallows that write and forwards nothing more on
    # that connection, without closing it (no RST, no FIN). The run's task waits for an answer
    # that never comes, while the heartbeat and the claim loop use the pool's other, healthy
    # connections. Before, the heartbeat renewed the lease for ever and /healthz said 200: the
    # run was held until the kernel gave up on the connection (~15 minutes on a real network,
    # never through this proxy). Now the run is abandoned once it made no progress within the
    # budget, and resumed from its last commit; /healthz says 503 while it is stuck.
    scenario = echo_scenario(2)
    scenario["scripts"][0]["turns"][0]["content"].insert(1, {"text": MARKER})
    srv = fake(scenario)
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    trap = proxy.trap(MARKER.encode())
    w = workers.start(
        "w",
        lease_ttl=2,
        health=True,
        extra=["--concurrency", "1"],  # the stuck run's slot is the only one: nothing else runs
        # Through the environment: a worker without the setting still runs, and holds the run.
        env={"AGENTRUN_DATABASE_URL": via(proxy, database_url), "AGENTRUN_PROGRESS_BUDGET": "6"},
    )
    run, _ = await store.create_run("echo", AGENT)
    with Poller(w.health_port) as health:
        await wait_for(trap.sprung.is_set, 30, "turn 0's commit to fall into the black hole")
        sprung_at = len(health.seen)
        done = await wait_run(store, run.id, lambda r: r.finished, 60)
        # Well again once the stuck task was stopped: waited for, not read off the last sample,
        # which may predate the run's end by a poll (a CI run under load saw a 503 there).
        await wait_for(lambda: bool(health.seen) and health.seen[-1] == 200, 30,
                       "/healthz to answer 200 again")
    assert done.status == "succeeded", done.error
    assert 503 in health.seen[sprung_at:], "/healthz never failed while the run was stuck"
    steps = await store.steps(run.id)
    assert [s.seq for s in steps] == [0, 1, 2]
    assert {s.lease_epoch for s in steps} == {2}  # all by the second claim: resumed once
    stalled = [
        x for x in w.json_lines()
        if "abandoning the run" in x["msg"] and x.get("run_id") == str(run.id)
    ]  # fmt: skip
    assert len(stalled) == 1, w.output()[-3000:]
    assert "no progress for" in stalled[0]["msg"] and "since its last commit" in stalled[0]["msg"]


async def test_a_full_worker_cut_off_from_the_database_fails_healthz_and_stops_its_model_call(
    store: Store, workers: Workers, fake: FakeFactory, proxy: TcpProxy, database_url: str
) -> None:
    """Found by a review. A worker whose every slot is busy claims nothing, and its wait between
    claims counted as progress: through a database outage /healthz said 200 for as long as its
    runs were in their calls. And a model call went on streaming (and retrying) after the
    lease had run out by the worker's own clock, while another worker could take the run and
    pay for the same turn. Turn 0's first call here streams pings for ever; the lease TTL (20 s)
    is far beyond the liveness threshold (3 s), so the worker holds the run, its renewals
    failing, long after /healthz must have turned 503."""
    srv = fake(echo_scenario(2, faults={0: [{"stream": "pings", "interval_ms": 200}]}))
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    w = workers.start("w", lease_ttl=20, health=True,
                      extra=["--concurrency", "1", "--liveness-threshold", "3"],
                      env={"AGENTRUN_DATABASE_URL": via(proxy, database_url)})
    run, _ = await store.create_run("echo", AGENT)
    await wait_for(lambda: bool(srv.requests()), 30, "turn 0's model call")
    with Poller(w.health_port) as health:
        # Healthy while it reaches the database: renewed (the heartbeat runs at a third of the
        # threshold, not of the TTL) for longer than the threshold, never a 503.
        renewals: set[object] = set()
        deadline = time.monotonic() + 60
        while len(renewals) <= 4:
            assert time.monotonic() < deadline, "the heartbeat renewed the lease too rarely"
            renewals.add((await store.get_run(run.id)).lease_until)
            await asyncio.sleep(0.2)
        assert health.seen and 503 not in health.seen, health.seen
        proxy.cut()
        await wait_for(lambda: 503 in health.seen, 60, "/healthz to fail")
        assert "dropping the run" not in w.output(), "503 only once the run was let go"
        await wait_for(lambda: srv.requests()[0]["disconnected"], 60, "the model call stopped")
    assert "stopped the model call" in w.output(), w.output()[-3000:]
    proxy.restore()
    try:
        done = await wait_run(store, run.id, lambda r: r.finished, 60)
    except AssertionError:
        print(w.output()[-5000:])
        raise
    assert done.status == "succeeded", done.error
    assert [r.get("fault") for r in srv.requests()][:2] == ["stream pings", None]


async def test_a_run_let_go_by_the_workers_clock_is_claimable_at_once(
    store: Store, fake: FakeFactory
) -> None:
    """Found by a review: a worker paused past its lease woke with a renewal in flight; its
    model call stopped (the lease had run out by its clock) and the run was dropped, while the
    renewal then extended the lease in the database, for a run no task held. Nobody took it for
    the whole lease, and the worker, alone in its pool, for its idle interval (60 s). Here the
    database's lease is 60 s and the worker's clock says 2: dropped, the lease ends at once."""
    srv = fake(echo_scenario(2, faults={0: [{"stream": "pings", "interval_ms": 200}]}))
    client = anthropic.AsyncAnthropic(base_url=srv.base_url, api_key="test")
    # The database's leases last 60 s (the claim's and every commit's), the worker's clock 2 s.
    worker = Worker(store.with_lease_ttl(60), client, ToolRegistry(),
                    WorkerSettings(lease_ttl=2, health_port=None, worker_id="w"))
    # No tools: the call never returns, and this worker's registry has none.
    run, _ = await store.create_run("echo", AgentSpec(model="claude-sonnet-4-5"))
    ((_, lease),) = (await store.with_lease_ttl(60).claim("default", "w", 1)).claimed
    h = RunHandle(run, lease, lease_ttl=2)
    worker._start_run(h)
    try:
        assert h.task is not None
        await asyncio.wait({h.task}, timeout=30)
        assert h.task.done(), "the model call went on past the worker's lease"
        taken: list[UUID] = []
        deadline = time.monotonic() + 20  # far below the 60 s lease it waited out before
        while not taken:
            assert time.monotonic() < deadline, "the lease was not ended"
            taken = [r.id for r, _ in (await store.claim("default", "w2", 1)).claimed]
            await asyncio.sleep(0.1)
        assert taken == [run.id]
    finally:
        if h.task is not None and not h.task.done():
            h.task.cancel()
        await client.close()


async def test_a_run_whose_task_is_wedged_or_gone_is_no_longer_renewed(
    store: Store, database_url: str
) -> None:
    # The heartbeat, on a real store: one held run's task awaits for ever outside any model or
    # tool call (wedged), the other's task has ended without letting its run go. Neither may be
    # renewed; both are abandoned with the reason, and the wedged task is stopped.
    client = anthropic.AsyncAnthropic(base_url="http://127.0.0.1:9", api_key="unused")
    settings = WorkerSettings(
        lease_ttl=1, progress_budget=1.0, health_port=None, worker_id="w"
    )
    worker = Worker(store, client, ToolRegistry(), settings)
    for task in ("wedged", "gone"):
        await store.create_run(task, AGENT)
    claimed = (await store.with_lease_ttl(settings.lease_ttl).claim("default", "w", 2)).claimed
    handles = {run.task: RunHandle(run, lease, lease_ttl=settings.lease_ttl)
               for run, lease in claimed}
    handles["wedged"].task = asyncio.create_task(asyncio.Event().wait())
    gone = handles["gone"].task = asyncio.create_task(asyncio.sleep(0))
    await gone
    worker.active = {h.run.id: h for h in handles.values()}
    try:
        beat = asyncio.create_task(worker._heartbeat())
        # Before, the heartbeat renewed their leases for as long as the process lived.
        try:
            await wait_for(lambda: all(h.abort_reason == "stalled" for h in handles.values()),
                           20, "both runs to be let go")
        finally:
            beat.cancel()
            await asyncio.wait({beat}, timeout=5)
        assert not worker.health.alive()  # held runs, none progressing: /healthz says 503
        wedged = handles["wedged"].task
        await asyncio.wait({wedged}, timeout=10)
        assert wedged.cancelled()
        for name, h in handles.items():
            run = await store.get_run(h.run.id)
            assert (run.status, run.lease_owner) == ("pending", None), name
            assert run.error is not None and run.error.startswith("stalled on worker w: "), name
        assert "since its last commit" in (await store.get_run(handles["wedged"].run.id)).error
        assert "its task ended" in (await store.get_run(handles["gone"].run.id)).error
    finally:
        await client.close()


# -- connection options ----------------------------------------------------------------------


def pg_sockets(pid: int, pg_port: int) -> list[socket.socket]:
    """Duplicates of every TCP socket of process ``pid`` connected to port ``pg_port``
    (pidfd_getfd: the socket options can be read from another process)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    found = []
    try:
        for name in os.listdir(f"/proc/{pid}/fd"):
            try:
                if not os.readlink(f"/proc/{pid}/fd/{name}").startswith("socket:"):
                    continue
            except OSError:
                continue
            fd = libc.syscall(438, pidfd, int(name), 0)  # SYS_pidfd_getfd
            if fd < 0:
                if ctypes.get_errno() == errno.EPERM:
                    pytest.skip("pidfd_getfd is not permitted here (no CAP_SYS_PTRACE)")
                continue
            s = socket.socket(fileno=fd)
            try:
                if s.type == socket.SOCK_STREAM and s.family in (socket.AF_INET, socket.AF_INET6):
                    if s.getpeername()[1] == pg_port:
                        found.append(s)
                        continue
            except OSError:
                pass
            s.close()
    finally:
        os.close(pidfd)
    return found


def tcp_options(s: socket.socket) -> dict[str, int]:
    return {
        "keepalive": s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
        "idle": s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
        "interval": s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
        "count": s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
        "user_timeout_ms": s.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
    }


#: What ConnectOptions' defaults (a 30 s TCP timeout) come to on the socket.
DEFAULT_TCP = {"keepalive": 1, "idle": 10, "interval": 5, "count": 4, "user_timeout_ms": 30000}


async def test_every_connection_the_store_opens_has_keepalives_and_timeouts(
    database_url: str,
) -> None:
    pg_port = int(conninfo_to_dict(database_url).get("port") or 5432)
    store = await Store.open(database_url)
    listening = asyncio.Event()

    async def listen() -> None:
        async for _ in store.listen(on_listening=listening.set):
            pass

    listener = asyncio.create_task(listen())
    one_off = await connect(database_url)
    migrating = await connect(database_url, statement_timeout=0)
    try:
        await asyncio.wait_for(listening.wait(), 10)
        sockets = pg_sockets(os.getpid(), pg_port)
        assert len(sockets) >= 4  # the pool's, the listener's and the two one-off connections
        for s in sockets:
            assert tcp_options(s) == DEFAULT_TCP
            s.close()
        async with store.pool.connection() as conn:
            cur = await conn.execute("SHOW statement_timeout")
            assert await cur.fetchone() == ("30s",)
            cur = await conn.execute("SHOW idle_in_transaction_session_timeout")
            assert await cur.fetchone() == ("30s",)
        cur = await one_off.execute("SHOW statement_timeout")
        assert await cur.fetchone() == ("30s",)
        cur = await migrating.execute("SHOW statement_timeout")
        assert await cur.fetchone() == ("0",)  # a migration may take long
    finally:
        listener.cancel()
        await one_off.close()
        await migrating.close()
        await store.close()


def test_connect_options_come_from_the_environment_and_the_url_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AGENTRUN_DB_TCP_TIMEOUT", "12")
    monkeypatch.setenv("AGENTRUN_DB_STATEMENT_TIMEOUT", "5")
    opts = ConnectOptions.from_env()
    params = opts.libpq("host=db keepalives_idle=99 options='-c statement_timeout=7s'")
    assert "keepalives_idle" not in params  # the URL's own value stays
    assert (params["keepalives_interval"], params["tcp_user_timeout"]) == (2, 12000)
    assert params["options"] == (
        "-c statement_timeout=5000 -c idle_in_transaction_session_timeout=5000 "
        "-c statement_timeout=7s"  # after ours: it wins
    )
    monkeypatch.setenv("AGENTRUN_DB_STATEMENT_TIMEOUT", "0")  # PgBouncer: no `options` at all
    assert "options" not in ConnectOptions.from_env().libpq("host=db")
    monkeypatch.setenv("AGENTRUN_DB_TCP_TIMEOUT", "-1")
    with pytest.raises(Exception, match=r"AGENTRUN_DB_TCP_TIMEOUT=-1: must be from 0 to 86400"):
        ConnectOptions.from_env()


#: Connections that are not agentrun's own: the demo's tools write to (and the demo reads) a
#: "production" schema as a user's tool would, and the embedded server is bootstrapped once.
NOT_OURS = {"demo_tools.py", "demo.py", "embedded.py"}


def test_connections_are_opened_in_one_place() -> None:
    # Every connection of the worker, the operator and the CLI gets the ConnectOptions because
    # only agentrun.store opens any: a new psycopg.connect elsewhere would lack them.
    root = Path(__file__).resolve().parent.parent
    opening = re.compile(r"\b(psycopg\.connect|(Async|Store)Connection\.connect|ConnectionPool)\(")
    found = {
        str(f.relative_to(root))
        for d in ("src/agentrun", "operator", "worker")
        for f in (root / d).glob("*.py")
        if f.name not in NOT_OURS and opening.search(f.read_text())
    }
    assert found == {"src/agentrun/store.py"}


async def test_a_worker_process_connections_have_keepalives_and_a_user_timeout(
    store: Store, workers: Workers, fake: FakeFactory, database_url: str
) -> None:
    # Before, libpq's defaults: keepalives after 2 hours idle, no user timeout, so a connection
    # whose peer vanished was noticed after ~15 minutes of retransmissions, or never when idle.
    workers.env["ANTHROPIC_BASE_URL"] = fake(echo_scenario(1)).base_url
    w = workers.start("w", health=True)
    await wait_for(lambda: status_of(w.health_port, "/readyz") == 200, 30, "the worker ready")
    pg_port = int(conninfo_to_dict(database_url).get("port") or 5432)
    sockets = pg_sockets(w.popen.pid, pg_port)
    try:
        assert len(sockets) >= 2  # its pool's and its listener's
        assert [tcp_options(s) for s in sockets] == [DEFAULT_TCP] * len(sockets)
    finally:
        for s in sockets:
            s.close()


# -- readiness -------------------------------------------------------------------------------


async def test_ready_and_the_first_claim_only_once_listening(
    store: Store, workers: Workers, fake: FakeFactory, proxy: TcpProxy, database_url: str
) -> None:
    # The worker's LISTEN is held back by the proxy until the test releases it. With a poll
    # interval of an hour, a run is claimed within the test only by a claim made after LISTEN is
    # open or by its notification. Before, the worker was ready (and made its first claim) with
    # LISTEN still pending: a run created in that window waited a whole poll interval.
    workers.env["ANTHROPIC_BASE_URL"] = fake(echo_scenario(1)).base_url
    listen = proxy.trap(b"LISTEN", hold=True)
    w = workers.start(
        "w", poll=3600, health=True, extra=["--concurrency", "4"],
        env={"AGENTRUN_DATABASE_URL": via(proxy, database_url)},
    )  # fmt: skip
    await wait_for(listen.sprung.is_set, 30, "the worker's LISTEN")
    await wait_for(lambda: status_of(w.health_port, "/readyz") != 0, 30, "the health server")
    assert status_of(w.health_port, "/readyz") == 503  # not ready: not listening yet
    early, _ = await store.create_run("echo", AGENT)  # its notification is not heard
    assert (await store.get_run(early.id)).lease_owner is None  # no claim before LISTEN

    listen.release()
    await wait_for(lambda: status_of(w.health_port, "/readyz") == 200, 30, "the worker ready")
    late, _ = await store.create_run("echo", AGENT)  # right as it turned ready
    for run in (early, late):
        done = await wait_run(store, run.id, lambda r: r.finished, 30)  # never the 1 h poll
        assert (done.status, done.lease_owner, done.attempt) == ("succeeded", None, 1)
    lines = [x["msg"] for x in w.json_lines()]
    assert lines.index("listening for notifications") < min(
        i for i, m in enumerate(lines) if m.startswith("claimed")
    )



def test_progress_is_a_commit_or_a_call_within_its_deadline() -> None:
    # The rule the heartbeat renews by, on explicit clocks (t: now, monotonic).
    t = time.monotonic()
    p = Progress(last=t - 10)
    assert p.idle_for(now=t) == 10.0
    assert p.stalled(30, None, now=t) is None
    assert "since its last commit" in (p.stalled(30, None, now=t + 21) or "")
    with p.working("model call", deadline=t + 1000):  # a long call within its deadline: progress
        assert p.idle_for(now=t + 900) == 0.0
        assert p.stalled(30, None, now=t + 900) is None
        assert p.idle_for(now=t + 1010) == 10.0  # past its deadline the clock runs again
        assert "past its deadline" in (p.stalled(5, None, now=t + 1010) or "")
    assert p.activity is None and p.last >= t  # the call's end counts as progress
    q = Progress(last=t - 100)
    with q.working("tool slow", deadline=None):  # no deadline of its own: one budget from start
        started = q.activity.started if q.activity else 0.0
        assert q.stalled(30, None, now=started + 29) is None
        assert "which has no deadline" in (q.stalled(30, None, now=started + 31) or "")
    r = Progress(last=t - 100)
    with r.working("tool late", deadline=t - 50):
        pass
    assert r.last == t - 50  # it ended past its deadline: progress only up to it
