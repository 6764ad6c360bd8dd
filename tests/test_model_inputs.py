"""What the model call takes from the provider's answer is checked, not trusted (found by a
review on 2026-12-07):

* a ``retry-after`` that is negative or not a number set the retry delay: -30 retried at once,
  every retry in milliseconds against a provider asking to wait, and nan slept for ever;
* a tool input whose ``input_json_delta`` pieces never made whole JSON (a lost delta) was parsed
  in the SDK's partial mode, which keeps a number cut short: {"amount": 10} of 1000 was run by a
  non-idempotent tool and recorded as the model's call. On both routes: the worker's raw stream
  and the SDK's events (Bedrock, Vertex, a traced worker).

Against tests/sse_kit.py, which sends what the scripted model server cannot."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp import web

from agentrun.store import Store
from agentrun.tools import ToolContext, ToolRegistry, tool
from agentrun.worker.client import AsyncAnthropic
from agentrun.worker.model_call import call_model, raw_route
from agentrun.worker.providers import Providers
from agentrun.worker.settings import RetryPolicy
from tests.sse_kit import SSEServer, message_stream
from tests.workerkit import AGENT, held_run, in_process_executor

REQUEST = {"model": "claude-sonnet-4-5", "max_tokens": 100,
           "messages": [{"role": "user", "content": "go"}]}


def rate_limited_twice(retry_after: str) -> Any:
    def answer(turn: int, body: Any, n: int) -> Any:
        if n < 2:
            return web.json_response(
                {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}},
                status=429, headers={"retry-after": retry_after})
        return message_stream([{"type": "text", "text": "hi"}])
    return answer


@pytest.mark.parametrize("retry_after", ["-30", "nan"])
async def test_an_absurd_retry_after_is_the_policys_backoff(retry_after: str) -> None:
    slept: list[float] = []

    async def sleep(delay: float) -> None:
        slept.append(delay)

    async with SSEServer(rate_limited_twice(retry_after)) as srv, AsyncAnthropic(
        api_key="k", base_url=srv.base_url, max_retries=0, open_telemetry=False
    ) as client:
        turn = await call_model(client, REQUEST, policy=RetryPolicy(max_retries=3, max_delay=30),
                                sleep=sleep)
    assert turn.stop_reason == "end_turn"
    assert len(slept) == 2 and all(0 <= d <= 30 for d in slept), slept


async def test_a_retry_after_of_seconds_is_still_followed() -> None:
    slept: list[float] = []

    async def sleep(delay: float) -> None:
        slept.append(delay)

    async with SSEServer(rate_limited_twice("7")) as srv, AsyncAnthropic(
        api_key="k", base_url=srv.base_url, max_retries=0, open_telemetry=False
    ) as client:
        await call_model(client, REQUEST, policy=RetryPolicy(max_retries=3), sleep=sleep)
    assert len(slept) == 2 and all(7 <= d <= 7.7 for d in slept), slept


TOOLS = ToolRegistry()
PAID: list[dict[str, Any]] = []


@tool(kind="non_idempotent", registry=TOOLS)
def pay(ctx: ToolContext, to: str, amount: int) -> str:
    """Pay someone."""
    PAID.append({"to": to, "amount": amount})
    return "paid"


@pytest.mark.parametrize("route", ["raw", "sdk"])
async def test_a_tool_input_whose_json_never_completed_is_retried_never_called(
    store: Store, route: str
) -> None:
    cut = ['{"to": "bob", ', '"amount": 10']  # "00}" never came

    def answer(turn: int, body: Any, n: int) -> Any:
        if turn == 0:
            return message_stream([{"type": "tool_use", "id": "toolu_1", "name": "pay"}],
                                  stop_reason="tool_use",
                                  partial_json={0: cut if n == 0 else [*cut, "00}"]})
        return message_stream([{"type": "text", "text": "done"}])

    PAID.clear()
    async with SSEServer(answer) as srv:
        agent = AGENT.model_copy(update={"tools": ["pay"], "thinking": None})
        h = await held_run(store, agent, task="pay bob 1000")
        client = AsyncAnthropic(api_key="k", base_url=srv.base_url, max_retries=0,
                                open_telemetry=False if route == "raw" else None)
        assert raw_route(client) == (route == "raw")
        async with client, in_process_executor(store, srv.base_url, TOOLS) as ex:
            ex.clients = Providers(default=client)
            assert await ex.advance(h) is None
        assert len(srv.bodies) == 3  # the cut stream, its retry, the final turn
    assert PAID == [{"to": "bob", "amount": 1000}]
    steps = await store.steps(h.run.id)
    assert steps[0].payload["content"][0]["input"] == {"to": "bob", "amount": 1000}
