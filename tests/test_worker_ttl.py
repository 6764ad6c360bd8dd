"""Every fenced write of a worker asks for the worker's lease TTL, whatever TTL its store was
opened with.

The Worker views the store it is given with its own TTL (``Store.with_lease_ttl``): the claim,
the heartbeats. Its RunExecutor was handed the store as given, so a worker embedded with a store
opened at another TTL (an in-process worker's, a test's, a benchmark's) renewed the lease by
that TTL at every append, while it counted its own clock (and the tools' fence) by the worker's:
a worker with a 5 s TTL on a store opened at 600 s pushed its runs' leases 600 s out at each
step, so another worker would wait 10 minutes to take over a run of a dead one. (Found by an
adversarial review on 2026-12-06.)
"""

from __future__ import annotations

import asyncio
from typing import Any

import anthropic

from agentrun.store import Lease, Store
from agentrun.tools import ToolContext, ToolRegistry, tool
from agentrun.worker.process import Worker, WorkerSettings
from tests.workerkit import AGENT, FakeFactory, echo_scenario, wait_run

TOOLS = ToolRegistry()


@tool(kind="pure", registry=TOOLS)
def echo(ctx: ToolContext, text: str) -> str:
    """Echo the text back in capitals."""
    return text.upper()


class TtlRecordingStore(Store):
    """A real store that notes the TTL each fenced statement asks for (in a list its TTL views
    share: ``with_lease_ttl`` copies the store, not the list)."""

    asked: list[float]

    def _fence_params(self, lease: Lease, *, ttl: float | None = None) -> dict[str, Any]:
        self.asked.append(self.lease_ttl if ttl is None else ttl)
        return super()._fence_params(lease, ttl=ttl)


async def test_a_workers_writes_renew_by_its_own_ttl_not_its_stores(
    database_url: str, fake: FakeFactory
) -> None:
    srv = fake(echo_scenario(3))
    store = await TtlRecordingStore.open(database_url, lease_ttl=600)
    store.asked = []
    client = anthropic.AsyncAnthropic(base_url=srv.base_url, api_key="test", max_retries=0)
    worker = Worker(store, client, TOOLS, WorkerSettings(lease_ttl=5, health_port=None,
                                                         worker_id="w"))
    try:
        run, _ = await store.create_run("echo twice, then answer", AGENT)
        serving = asyncio.create_task(worker.serve())
        done = await wait_run(store, run.id, lambda r: r.finished, 30)
        assert done.status == "succeeded", done.error
        worker.request_drain()
        await asyncio.wait_for(serving, 30)
        appended = [s.kind for s in await store.steps(run.id)]
        assert appended.count("tool_result") == 2  # the fenced writes were made
        assert store.asked and set(store.asked) == {5}, store.asked
    finally:
        await client.close()
        await store.close()
