"""agentrun logs -f hears each step by LISTEN, and only followed runs' appends notify: the real
CLI in subprocesses and the store's own fenced append, on a real PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import tempfile
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any
from uuid import UUID

import psycopg
import pytest

from agentrun.store import Lease, Store
from tests.conftest import listeners
from tests.workerkit import AGENT, wait_for

#: The channel is a contract (docs/store.md): a literal here.
CHANNEL_RUN_STEPS = "agentrun_run_steps"

#: So long that in these tests only a notification (or the run's end) makes logs -f read steps.
NO_RESYNC = {"AGENTRUN_FOLLOW_RESYNC": "3600"}


class Follower:
    """One ``agentrun logs -f`` subprocess; killed by its pid at the end, also on failure."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        raw = await asyncio.wait_for(self.proc.stdout.readline(), 60)
        assert raw, "logs -f ended before printing the step"
        step: dict[str, Any] = json.loads(raw)
        return step

    async def exit_code(self) -> int:
        return await asyncio.wait_for(self.proc.wait(), 60)


@pytest.fixture
async def follow(database_url: str) -> AsyncIterator[Any]:
    started: list[asyncio.subprocess.Process] = []

    async def start(run_id: UUID, **env: str) -> Follower:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "agentrun", "logs", "-f", str(run_id), "-o", "json",
            env={**os.environ, "AGENTRUN_DATABASE_URL": database_url, **env},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
            cwd=tempfile.gettempdir(),
        )
        started.append(proc)
        return Follower(proc)

    try:
        yield start
    finally:
        for proc in started:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def live_run(store: Store) -> Lease:
    await store.create_run("followed", AGENT, pool="follow")
    ((_, lease),) = (await store.with_lease_ttl(600).claim("follow", "tester", limit=1)).claimed
    return lease


async def followers(url: str, run_id: UUID) -> list[tuple[str, datetime]]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT follower, until FROM run_follower WHERE run_id = %s ORDER BY follower",
            (run_id,),
        )
        return [(str(f), u) for f, u in await cur.fetchall()]


async def until_true(check: Any, within: float, what: str) -> Any:
    """Poll the async ``check`` until it returns something truthy (a generous deadline)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not (got := await check()):
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)
    return got


async def test_logs_follow_prints_a_step_when_its_notification_arrives(
    store: Store, database_url: str, follow: Any
) -> None:
    lease = await live_run(store)
    await store.append_step(lease, 0, "note", {"n": 0})
    f = await follow(lease.run_id, **NO_RESYNC)
    assert (await f.line())["seq"] == 0  # what was there: the first read
    # Registered as a follower and listening on the steps channel; the log is re-read only every
    # hour, so what prints the next steps is their notification.
    await until_true(lambda: followers(database_url, lease.run_id), 30, "a follower row")
    await wait_for(
        lambda: listeners(database_url, CHANNEL_RUN_STEPS) >= 1, 30, "LISTEN agentrun_run_steps"
    )
    for seq in (1, 2, 3):
        await store.append_step(lease, seq, "note", {"n": seq})
        step = await f.line()
        assert (step["seq"], step["payload"]) == (seq, {"n": seq})
    await store.finish(lease, "succeeded", result="done")
    assert await f.exit_code() == 0
    assert await followers(database_url, lease.run_id) == []  # deleted on its way out


async def test_only_a_followed_run_with_an_unexpired_follower_notifies_its_appends(
    store: Store, database_url: str
) -> None:
    followed, unfollowed, expired = [await live_run(store) for _ in range(3)]
    await store.follow_run(followed.run_id, "f1")
    await store.follow_run(expired.run_id, "gone", lease=-1)  # its lease ran out a second ago
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(f"LISTEN {CHANNEL_RUN_STEPS}")
        await store.append_step(unfollowed, 0, "note", {"n": 0})
        await store.append_step(expired, 0, "note", {"n": 0})
        # The marker: notifications arrive in commit order, so one sent by either append above
        # would come before this one.
        await store.append_step(followed, 0, "note", {"n": 0})
        got = []
        async for n in conn.notifies(timeout=30):
            got.append(n.payload)
            if n.payload == str(followed.run_id):
                break
    assert got == [str(followed.run_id)]
    # The expired row is ignored, and deleted by the next registration of anyone.
    assert len(await followers(database_url, expired.run_id)) == 1
    await store.follow_run(unfollowed.run_id, "f2")
    assert await followers(database_url, expired.run_id) == []
    await store.unfollow_run(followed.run_id, "f1")
    assert await followers(database_url, followed.run_id) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_logs_follow_deletes_its_follower_row_when_stopped(
    store: Store, database_url: str, follow: Any, sig: signal.Signals
) -> None:
    lease = await live_run(store)
    f = await follow(lease.run_id)
    await until_true(lambda: followers(database_url, lease.run_id), 30, "a follower row")
    f.proc.send_signal(sig)
    code = await f.exit_code()
    assert code == (143 if sig == signal.SIGTERM else 130)
    assert await followers(database_url, lease.run_id) == []


async def test_a_follower_renews_its_lease_and_a_killed_ones_row_expires(
    store: Store, database_url: str, follow: Any
) -> None:
    lease = await live_run(store)
    f = await follow(lease.run_id, AGENTRUN_FOLLOW_LEASE="1.5")
    ((name, first),) = await until_true(
        lambda: followers(database_url, lease.run_id), 30, "a follower row"
    )

    async def renewed() -> bool:
        rows = await followers(database_url, lease.run_id)
        return bool(rows) and rows[0][1] > first

    await until_true(renewed, 30, "the follower's lease renewed")
    f.proc.kill()  # no chance to delete its row
    await f.exit_code()
    assert [n for n, _ in await followers(database_url, lease.run_id)] == [name]

    async def expired() -> bool:
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as c:
            cur = await c.execute(
                "SELECT bool_and(until < now()) FROM run_follower WHERE run_id = %s",
                (lease.run_id,),
            )
            row = await cur.fetchone()
        return bool(row and row[0])

    await until_true(expired, 30, "the killed follower's lease to run out")
    # Ignored from then on (see the test above); the next registration of anyone deletes it.
    other = await live_run(store)
    await store.follow_run(other.run_id, "next")
    assert await followers(database_url, lease.run_id) == []
