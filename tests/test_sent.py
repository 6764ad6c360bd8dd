"""An append's ``on_sent``: called once the statement is written whole, before its answer; and
from then on the append lands even if its process dies at once (agentrun/sent.py).

What pipelined pure turns stand on (worker/executor.py): a pure tool starts once its turn's
append, which carries the call's mark, is sent, so a tool that takes its worker down (os._exit)
is still blamed by that mark. The process tests make the child die inside the callback itself,
with the statement held up by a lock the test holds, and then look for the append in the
database; the first of them holds up the statement's Parse too (the first use of a statement on a
connection sends a Parse and waits for it before the statement): a callback fired then would kill
the child before the statement itself ever left.
"""

from __future__ import annotations

import asyncio
import sys
from asyncio.subprocess import PIPE
from typing import Any
from uuid import UUID

import psycopg
import pytest

from agentrun.store import Lease, Store
from tests.workerkit import AGENT, wait_for

CHILD = r"""
import asyncio, os, sys
from uuid import UUID
from agentrun.store import Lease, Store

async def main(url, run_id, epoch, first_seq):
    store = await Store.open(url, min_size=1, max_size=1)
    lease = Lease(UUID(run_id), "w", int(epoch))
    seq = int(first_seq)

    def mark(seq):
        return {"worker": "w", "epoch": int(epoch), "tool": "look", "seq": seq, "call_index": 0,
                "step": seq + 1, "timeout": 30}

    if seq > 0:  # the statement prepared on this connection (for these parameter types) before
        await store.append_step(lease, 0, "model_turn", {"content": []}, tool_call=mark(0))
        print("ready", flush=True)
        sys.stdin.readline()
    mark = mark(seq)
    await store.append_step(lease, seq, "model_turn", {"content": [{"type": "text", "text": "x"}]},
                            tool_call=mark, on_sent=lambda: os._exit(0))
    sys.exit(3)  # answered without the callback ever firing

asyncio.run(main(*sys.argv[1:]))
"""


async def held(store: Store, pool: str = "sent") -> Lease:
    await store.create_run("a task", AGENT, pool=pool)
    ((_, lease),) = (await store.with_lease_ttl(60).claim(pool, "w", 1)).claimed
    return lease


async def lock_waiters(conn: psycopg.AsyncConnection[Any]) -> int:
    """Backends waiting for a lock (other than the test's own connections)."""
    cur = await conn.execute("SELECT count(*) FROM pg_locks WHERE NOT granted")
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def wait_blocked(url: str, what: str) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as probe:
        waiting = [0]

        async def look() -> None:
            waiting[0] = await lock_waiters(probe)

        deadline = asyncio.get_running_loop().time() + 30
        await look()
        while waiting[0] == 0:
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            await asyncio.sleep(0.02)
            await look()


async def step_seqs(store: Store, run_id: UUID) -> list[int]:
    return [s.seq for s in await store.steps(run_id)]


@pytest.mark.parametrize("first_seq", [0, 1], ids=["first_use_parse_held_too", "prepared"])
async def test_a_process_dying_in_on_sent_still_lands_the_append_and_its_mark(
    store: Store, database_url: str, first_seq: int
) -> None:
    lease = await held(store)
    locker = await psycopg.AsyncConnection.connect(database_url)
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD, database_url, str(lease.run_id), str(lease.epoch),
        str(first_seq), stdin=PIPE, stdout=PIPE, stderr=PIPE)
    assert child.stdin is not None and child.stdout is not None and child.stderr is not None
    stderr: asyncio.StreamReader = child.stderr

    async def exited() -> None:
        code = await asyncio.wait_for(child.wait(), 60)
        assert code == 0, (await stderr.read()).decode()  # 3: answered, the callback never fired

    try:
        if first_seq > 0:
            assert (await child.stdout.readline()).strip() == b"ready"
        # Every statement on agent_step waits: its Parse (a first use) and its execution.
        await locker.execute("LOCK TABLE agent_step IN ACCESS EXCLUSIVE MODE")
        if first_seq > 0:
            child.stdin.write(b"go\n")
            await child.stdin.drain()
            await exited()  # sent and held up by the lock: the callback fired, the child is gone
        else:
            await wait_blocked(database_url, "the child's Parse to wait for the lock")
        await locker.commit()
        await exited()
        # The server executes what it received, the client gone or not.
        await wait_for_async(lambda: step_seqs(store, lease.run_id),
                             list(range(first_seq + 1)), "the append to land")
        run = await store.get_run(lease.run_id)
        assert run.tool_call is not None
        assert (run.tool_call["seq"], run.tool_call["tool"]) == (first_seq, "look")
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
        await locker.close()


async def wait_for_async(read: Any, expected: Any, what: str, within: float = 30) -> None:
    seen: list[Any] = [await read()]
    deadline = asyncio.get_running_loop().time() + within
    while seen[0] != expected:
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}: {seen[0]!r}")
        await asyncio.sleep(0.02)
        seen[0] = await read()


async def test_on_sent_fires_before_the_answer_for_a_lone_append_and_for_a_batch(
    database_url: str,
) -> None:
    # A lone append (run A) held up by a row lock; two more (runs B and C) queue behind it and
    # go out as one batch, held up by B's row lock: each callback fires while its append waits.
    store = await Store.open(database_url, max_size=4)
    lock_a = await psycopg.AsyncConnection.connect(database_url)
    lock_b = await psycopg.AsyncConnection.connect(database_url)
    try:
        a, b, c = [await held(store, pool) for pool in ("sa", "sb", "sc")]
        for lock, lease in ((lock_a, a), (lock_b, b)):
            await lock.execute("SELECT 1 FROM agent_run WHERE id = %s FOR UPDATE",
                               (lease.run_id,))
        sent: dict[str, asyncio.Event] = {n: asyncio.Event() for n in "abc"}

        def append(name: str, lease: Lease) -> asyncio.Task[Any]:
            return asyncio.create_task(store.append_step(
                lease, 0, "model_turn", {"content": []}, on_sent=sent[name].set))

        first = append("a", a)
        await asyncio.wait_for(sent["a"].wait(), 30)
        assert not first.done()
        rest = [append("b", b), append("c", c)]
        await wait_for(lambda: store._group is not None and store._group.queued == 2, 30,
                       "b and c to queue behind a")
        await lock_a.commit()
        await first
        await asyncio.wait_for(asyncio.gather(sent["b"].wait(), sent["c"].wait()), 30)
        assert not any(t.done() for t in rest)
        assert store.append_stats.largest == 2  # b and c went out together
        await lock_b.commit()
        await asyncio.gather(*rest)
        for lease in (a, b, c):
            assert await step_seqs(store, lease.run_id) == [0]
    finally:
        await lock_a.close()
        await lock_b.close()
        await store.close()
