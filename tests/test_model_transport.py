"""The worker's first-party client sends over the SDK's aiohttp transport (worker/client.py,
issue 17's CPU per step), with the SDK's own request and the TCP keepalives the SDK's default
transport sets; AGENTRUN_MODEL_TRANSPORT=httpx is the SDK's default transport again. Against the
scripted server, through the worker's own factory."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import httpx2 as httpx
import pytest
from anthropic._vendor.httpx_aiohttp import AiohttpTransport

from agentrun.fake_anthropic import FakeAnthropicServer
from agentrun.fake_anthropic.scenario import parse_scenario
from agentrun.store import PromptVersion
from agentrun.worker import model_call
from agentrun.worker.client import KEEPALIVE, anthropic_client
from agentrun.worker.model_call import build_request

pytestmark = pytest.mark.unit

PV = PromptVersion(model="claude-sonnet-4-5", system="s", tools=[], params={"max_tokens": 64})


@pytest.fixture
async def srv() -> AsyncIterator[FakeAnthropicServer]:
    scenario = {"name": "t", "scripts": [{"name": "hi", "turns": [{"content": [{"text": "hi"}]}]}]}
    async with FakeAnthropicServer(parse_scenario(scenario)) as server:
        yield server


def _sockets(client: object) -> list[socket.socket]:
    transport = client._client._transport  # type: ignore[attr-defined]
    assert isinstance(transport, AiohttpTransport)
    connector = transport.client.connector  # type: ignore[union-attr]
    return [proto.transport.get_extra_info("socket")
            for conns in connector._conns.values() for proto, _ in conns]


async def test_the_worker_client_streams_over_aiohttp_with_the_sdks_keepalives(
    srv: FakeAnthropicServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", "k")
    monkeypatch.setenv("ANTHROPIC_BASE_URL", srv.base_url)
    client = anthropic_client()
    try:
        assert model_call.raw_route(client)
        for _ in range(2):  # the second on the kept connection
            turn = await model_call._stream_turn(
                client, build_request(PV, [{"role": "user", "content": "echo hi"}]), None)
            assert turn.stop_reason == "end_turn" and turn.request_id
        (sock,) = _sockets(client)  # one connection, kept alive between the two calls
        want = {(level, option): value for level, option, value in KEEPALIVE}
        got = {(level, option): sock.getsockopt(level, option) for level, option in want}
        assert got == want and want[(socket.SOL_SOCKET, socket.SO_KEEPALIVE)] == 1
        assert want.get((socket.IPPROTO_TCP, socket.TCP_KEEPIDLE)) == 60
    finally:
        await client.close()
    session = client._client._transport.client  # type: ignore[attr-defined]
    assert session.closed and sock.fileno() == -1  # closing the client closes its connections


async def test_httpx_is_the_sdks_default_transport_again(
    srv: FakeAnthropicServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", "k")
    monkeypatch.setenv("ANTHROPIC_BASE_URL", srv.base_url)
    client = anthropic_client(transport="httpx")
    try:
        assert isinstance(client._client._transport, httpx.AsyncHTTPTransport)  # type: ignore[attr-defined]
        turn = await model_call._stream_turn(
            client, build_request(PV, [{"role": "user", "content": "echo hi"}]), None)
        assert turn.request_id
    finally:
        await client.close()
