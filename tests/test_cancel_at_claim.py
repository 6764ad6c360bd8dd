"""A cancel that lands while the claim's answer is on its way is acted on at once.

The worker's listener hears a cancel of a run it does not hold and drops it. A run the claim has
just taken is not held until the claim's answer is back: a cancel in that window was dropped,
the run went on into its model call (paid), and only the next heartbeat (a third of the lease
TTL, 5 s by default) stopped it. (Found by an adversarial review on 2026-12-06.)

In process: a Worker against a real store whose claim, once it has taken the run, cancels it and
holds its answer until the worker's listener has heard that cancel. The run is a resumed one (its
prompt pinned by an earlier claim): a first claim's pin is a fenced write, which finds the cancel
before any model call, but a resumed run's first write comes after its model call.
"""

from __future__ import annotations

import asyncio
from typing import Any

import anthropic

from agentrun.store import ClaimResult, Store
from agentrun.tools import ToolContext, ToolRegistry, tool
from agentrun.worker.executor import prompt_for
from agentrun.worker.process import Worker, WorkerSettings
from tests.workerkit import AGENT, FakeFactory, echo_scenario, wait_for, wait_run

TOOLS = ToolRegistry()


@tool(kind="pure", registry=TOOLS)
def echo(ctx: ToolContext, text: str) -> str:
    """Echo the text back in capitals."""
    return text.upper()


class CancelledOnTheWayStore(Store):
    """A real store: its first claim that takes a run cancels it before answering, and answers
    once ``heard`` is set (the worker's listener has the cancel)."""

    heard: asyncio.Event
    done = False

    async def claim(self, *args: Any, **kwargs: Any) -> ClaimResult:
        result = await super().claim(*args, **kwargs)
        if result.claimed and not self.done:
            self.done = True
            ((run, _),) = result.claimed
            await self.cancel(run.id, "changed my mind")
            await asyncio.wait_for(self.heard.wait(), 30)
        return result


async def test_a_cancel_heard_while_the_claim_answers_stops_the_run_at_once(
    database_url: str, fake: FakeFactory
) -> None:
    srv = fake({**echo_scenario(2), "delay_ms": 60_000})  # a model call would outlast the test
    store = await CancelledOnTheWayStore.open(database_url, lease_ttl=60)  # the view is itself
    store.heard = asyncio.Event()
    client = anthropic.AsyncAnthropic(base_url=srv.base_url, api_key="test", max_retries=0)
    # A 60 s lease: the heartbeat that would find the cancel is 20 s away.
    worker = Worker(store, client, TOOLS,
                    WorkerSettings(lease_ttl=60, health_port=None, worker_id="w"))
    hear = worker._on_run_changed

    def heard(event: dict[str, object]) -> None:
        hear(event)
        if event.get("status") == "cancelled":
            store.heard.set()

    worker._on_run_changed = heard  # type: ignore[method-assign]
    # Pinned by an earlier holder, which handed the run back.
    run, _ = await store.create_run("echo, then answer", AGENT)
    store.done = True  # not this claim
    ((held, lease),) = (await store.claim("default", "earlier", 1)).claimed
    await store.pin_prompt_version(lease, prompt_for(held, TOOLS))
    await store.release(lease)
    store.done = False
    serving = asyncio.create_task(worker.serve())
    try:
        await wait_run(store, run.id, lambda r: r.status == "cancelled", 30)
        await wait_for(lambda: store.done and not worker.active, 10,
                       "the worker letting go of the cancelled run")
        assert worker.active == {}  # its slot is free again
        assert srv.requests() == []  # no model call was made for it
    finally:
        worker.request_drain()
        await asyncio.wait_for(serving, 30)
        await client.close()
        await store.close()
