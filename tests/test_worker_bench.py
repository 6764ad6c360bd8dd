"""The loop-overhead benchmark compares like with like: its in-memory loop asks the model exactly
what the durable loop (the shipped RunExecutor) asks it, byte for byte, so that the difference it
reports is what durability costs and nothing else."""

from __future__ import annotations

import json
import re
from typing import Any

from benchmarks import worker_bench

from agentrun.store import Store
from tests.workerkit import FakeFactory

# The scripted server names each tool_use block afresh; the ids are the only bytes that may differ.
_IDS = re.compile(r"toolu_[A-Za-z0-9]+")


def bodies(entries: list[dict[str, Any]]) -> list[str]:
    return [_IDS.sub("toolu_X", e["body"]) for e in entries if e.get("status") == 200]


async def test_the_in_memory_loop_sends_the_durable_loops_requests(
    store: Store, fake: FakeFactory
) -> None:
    srv = fake({**worker_bench.scenario(3, thinking=False), "record_bodies": True})
    client = worker_bench.worker_client(srv.base_url)
    registry = worker_bench.registry_for(True)
    executor = worker_bench.bench_executor(store, client, registry)
    try:
        assert await worker_bench.in_memory_loop(client, "the same task", registry) == 3
        in_memory = bodies(srv.requests())
        srv.reset()
        assert await worker_bench.durable_loop(store, executor, "the same task") == 3
        durable = bodies(srv.requests())
    finally:
        await client.close()
    assert len(durable) == 3
    # Prompt caching is on by default, so both mark breakpoints (the old bench's did not).
    assert all("cache_control" in json.dumps(json.loads(b)) for b in durable)
    assert in_memory == durable
