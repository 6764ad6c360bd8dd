"""A run's first claim costs two round trips fewer than a resume: its log is not read (it has
none) and its prompt version is stored and pinned in one statement. A resumed run still reads
its log and keeps the prompt version it pinned first.

In process: a RunExecutor against a real store and the scripted model server; the statements
each advance sends are recorded by name (queries.sql) from psycopg's cursor as they go out.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest
from benchmarks import worker_bench

from agentrun.errors import LeaseLost
from agentrun.fake_anthropic import FakeAnthropicServer
from agentrun.store import PromptVersion, Store
from agentrun.worker.executor import RunExecutor, RunHandle
from tests.workerkit import FakeFactory


@contextlib.asynccontextmanager
async def worker(
    store: Store, fake: FakeFactory, turns: int
) -> AsyncIterator[tuple[RunExecutor, FakeAnthropicServer]]:
    """The shipped executor (inline tools) against a scripted model of ``turns`` turns."""
    srv = fake(worker_bench.scenario(turns, thinking=False))
    client = worker_bench.worker_client(srv.base_url)
    try:
        yield worker_bench.bench_executor(store, client, worker_bench.registry_for(True)), srv
    finally:
        await client.close()


async def test_a_fresh_run_reads_no_log_and_pins_in_one_statement(
    store: Store, fake: FakeFactory, sent: list[str]
) -> None:
    async with worker(store, fake, 2) as (ex, _):
        run, _ = await store.create_run("first claim", worker_bench.AGENT, pool="first")
        ((claimed, lease),) = (await store.claim("first", "w1")).claimed
        assert claimed.next_seq == 0
        sent.clear()
        await ex.advance(RunHandle(claimed, lease, lease_ttl=60))
    assert "list_steps" not in sent  # no log to read
    assert "insert_prompt_version" not in sent  # stored by the pin itself
    assert sent[0] == "pin_prompt_version"
    # The tool turn (its call's mark carried), its results, the final turn: then the run ends.
    assert sent.count("append_step") == 3
    done = await store.get_run(run.id)
    assert done.status == "succeeded" and done.next_seq == 3
    # What the pin stored is the prompt version the run sent, whole.
    assert done.prompt_version is not None
    pinned = await store.get_prompt_version(done.prompt_version)
    assert pinned.id == done.prompt_version and pinned.tools[0]["name"] == "echo"


async def test_a_resumed_run_reads_its_log_and_keeps_its_first_pin(
    store: Store, fake: FakeFactory, sent: list[str]
) -> None:
    # The first worker pinned a prompt version and committed a final turn, then let go.
    run, _ = await store.create_run("resumed", worker_bench.AGENT, pool="resumed")
    ((_, lease),) = (await store.claim("resumed", "w1")).claimed
    first = worker_bench.prompt_for_agent()
    other = PromptVersion(model=first.model, system="an older system prompt", tools=first.tools,
                          params=first.params)
    assert await store.pin_prompt_version(lease, other) == other.id
    final = {"role": "assistant", "content": [{"type": "text", "text": "done before"}],
             "stop_reason": "end_turn"}
    await store.append_step(lease, 0, "model_turn", final)
    assert await store.release(lease)
    async with worker(store, fake, 1) as (ex, srv):
        ((again, lease2),) = (await store.claim("resumed", "w2")).claimed
        assert again.next_seq == 1
        sent.clear()
        await ex.advance(RunHandle(again, lease2, lease_ttl=60))
    assert "list_steps" in sent  # the log is read, and the run ends on its committed turn
    assert "append_step" not in sent and srv.requests() == []
    done = await store.get_run(run.id)
    assert done.status == "succeeded" and done.result == "done before"
    assert done.prompt_version == other.id  # the earlier pin wins


async def test_the_pin_of_a_fenced_off_worker_pins_nothing(store: Store) -> None:
    """One statement or two, the pin stays fenced: a worker that lost the run pins nothing."""
    await store.create_run("fenced", worker_bench.AGENT, pool="fenced")
    ((run, lease),) = (await store.with_lease_ttl(60).claim("fenced", "w1")).claimed
    assert await store.release(lease)
    ((_, lease2),) = (await store.claim("fenced", "w2")).claimed
    with pytest.raises(LeaseLost):
        await store.pin_prompt_version(lease, worker_bench.prompt_for_agent())
    assert (await store.get_run(run.id)).prompt_version is None
    # The holder pins as usual.
    pv = worker_bench.prompt_for_agent()
    assert await store.pin_prompt_version(lease2, pv) == pv.id
