"""A small scripted SSE server for what the scripted model server cannot send: any raw event of
the Messages stream (a tool input cut short), or any HTTP answer (a 429 with an absurd
retry-after). Each request is answered by ``answer(turn, body, n)``: the raw events of a 200
stream, or an aiohttp response; it records every request body."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from aiohttp import web


def ev(name: str, data: Any) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()


def message_stream(content: list[dict[str, Any]], *, stop_reason: str = "end_turn",
                   partial_json: dict[int, list[str]] | None = None) -> list[bytes]:
    """A whole message's events; block ``i``'s tool input streamed as ``partial_json[i]``."""
    out = [ev("message_start", {"type": "message_start", "message": {
        "id": "msg_x", "type": "message", "role": "assistant", "model": "claude-sonnet-4-5",
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": 10, "output_tokens": 1}}})]
    for i, block in enumerate(content):
        pieces = (partial_json or {}).get(i)
        out.append(ev("content_block_start", {
            "type": "content_block_start", "index": i,
            "content_block": {**block, "input": {}} if pieces is not None else block}))
        for piece in pieces or []:
            out.append(ev("content_block_delta", {
                "type": "content_block_delta", "index": i,
                "delta": {"type": "input_json_delta", "partial_json": piece}}))
        out.append(ev("content_block_stop", {"type": "content_block_stop", "index": i}))
    out.append(ev("message_delta", {"type": "message_delta",
                                    "delta": {"stop_reason": stop_reason, "stop_sequence": None},
                                    "usage": {"output_tokens": 5}}))
    out.append(ev("message_stop", {"type": "message_stop"}))
    return out


Answer = Callable[[int, dict[str, Any], int], "list[bytes] | web.StreamResponse"]


class SSEServer:
    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.bodies: list[bytes] = []
        self.runner: web.AppRunner | None = None
        self.base_url = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.bodies.append(raw)
        body = json.loads(raw)
        turn = sum(1 for m in body["messages"] if m["role"] == "assistant")
        out = self.answer(turn, body, len(self.bodies) - 1)
        if isinstance(out, web.StreamResponse):
            return out
        resp = web.StreamResponse(status=200, headers={"content-type": "text/event-stream",
                                                       "request-id": f"req_{len(self.bodies)}"})
        await resp.prepare(request)
        for chunk in out:
            await resp.write(chunk)
        await resp.write_eof()
        return resp

    async def __aenter__(self) -> SSEServer:
        app = web.Application()
        app.router.add_post("/v1/messages", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        server: Any = site._server
        self.base_url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()
