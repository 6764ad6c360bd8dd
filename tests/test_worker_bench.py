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
        run_id = await worker_bench.durable_loop(store, executor, "the same task")
        durable = bodies(srv.requests())
        assert await worker_bench.turns_of(store, run_id) == 3
    finally:
        await client.close()
    assert len(durable) == 3
    # Prompt caching is on by default, so both mark breakpoints (the old bench's did not).
    assert all("cache_control" in json.dumps(json.loads(b)) for b in durable)
    assert in_memory == durable


async def test_the_timed_durable_loop_sends_only_what_a_worker_sends(
    store: Store, fake: FakeFactory, sent: list[str]
) -> None:
    """The durable loop the bench times is a run's life as a worker lives it. Its turns are
    counted from the log after the clock stops: no worker reads a run's log back at its end (the
    old bench did, inside the timed loop, and charged that read to durability)."""
    srv = fake(worker_bench.scenario(3, thinking=False))
    client = worker_bench.worker_client(srv.base_url)
    executor = worker_bench.bench_executor(store, client, worker_bench.registry_for(True))
    try:
        run_id = await worker_bench.durable_loop(store, executor, "timed")
    finally:
        await client.close()
    timed = list(sent)
    assert await worker_bench.turns_of(store, run_id) == 3
    # create, claim, pin (first claim: no log read), 3 turns and 2 results, the end
    assert "list_steps" not in timed
    assert timed.count("append_step") == 5
    assert timed[:3] == ["insert_run", "claim_runs", "pin_prompt_version"]
    assert sent[len(timed):] == ["list_steps"]
