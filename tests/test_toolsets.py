"""The tools each pool's workers serve (migration 0013): a worker registers its tool names at
start; the store answers with the sets started lately, so a rollout shows both and a set no
worker started with for over an hour is taken as gone."""

from __future__ import annotations

import asyncio

import psycopg

from agentrun.store import Store
from tests.workerkit import Workers


async def test_a_pool_serves_the_union_of_its_recent_tool_sets(
    store: Store, database_url: str
) -> None:
    assert await store.served_tools("default") is None  # no worker ever registered: unknown
    await store.register_toolset("default", "w-old", ["echo", "drop_table"])
    await store.register_toolset("default", "w-new", ["echo", "add_column"])  # a rollout
    await store.register_toolset("gpu", "w-gpu", ["render"])
    assert await store.served_tools("default") == {"echo", "drop_table", "add_column"}
    # The old image's set was last started with two hours before the newest: gone.
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "UPDATE pool_toolset SET started_at = now() - interval '2 hours' "
            "WHERE pool = 'default' AND 'drop_table' = ANY(tools)")
    assert await store.served_tools("default") == {"echo", "add_column"}
    assert await store.served_tools("gpu") == {"render"}
    # The same set again (another pod of the image) is one row, freshly started.
    await store.register_toolset("default", "w-old-2", ["drop_table", "echo"])
    assert await store.served_tools("default") == {"echo", "drop_table", "add_column"}


async def test_a_worker_registers_its_tools_when_it_starts(
    store: Store, workers: Workers
) -> None:
    w = workers.start("w-tools", extra=["--pool", "tools-pool"])
    served = None
    for _ in range(3000):  # until it has (the worker registers before its first claim)
        served = await store.served_tools("tools-pool")
        if served is not None or w.popen.poll() is not None:
            break
        await asyncio.sleep(0.01)
    assert served == {"echo", "sleepy"}, w.output()[-2000:]  # tests/tool_modules/echo_v1.py
    w.popen.terminate()
    assert w.wait() == 0
