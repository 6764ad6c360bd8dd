"""The claim loop's wake-ups, in process, with a real store whose claim we can hold open."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import anthropic

from agentrun.store import ClaimResult, Store
from agentrun.tools import ToolRegistry
from agentrun.worker.process import Worker, WorkerSettings


class HeldClaimStore(Store):
    """A real store whose next claim waits for the test (to land a signal mid-claim)."""

    entered: asyncio.Event
    proceed: asyncio.Event

    async def claim(self, *args: Any, **kwargs: Any) -> ClaimResult:
        self.entered.set()
        await self.proceed.wait()
        return await super().claim(*args, **kwargs)


async def test_a_drain_requested_during_a_claim_query_is_not_lost(database_url: str) -> None:
    store = await HeldClaimStore.open(database_url)
    store.entered, store.proceed = asyncio.Event(), asyncio.Event()
    client = anthropic.AsyncAnthropic(base_url="http://127.0.0.1:9", api_key="unused")
    worker = Worker(
        store,
        client,
        ToolRegistry(),
        WorkerSettings(poll_interval=60, health_port=None, worker_id="w"),
    )
    try:
        serving = asyncio.create_task(worker.serve())
        await asyncio.wait_for(store.entered.wait(), 10)
        worker.request_drain()  # SIGTERM lands while the claim query is in flight
        t0 = time.monotonic()
        store.proceed.set()
        await asyncio.wait_for(serving, 10)  # not the 60 s poll interval
        assert time.monotonic() - t0 < 2
    finally:
        await store.close()
        await client.close()
