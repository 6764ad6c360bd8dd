"""The worker reads a first-party stream itself (model_call.RAW_STREAM, issue 17): the payload it
stores is the one the SDK's events assemble to, key for key and value for value, and every way a
200 stream goes wrong is classified as it was through the SDK."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anthropic
import pytest

from agentrun.canonical import canonical_json
from agentrun.fake_anthropic import FakeAnthropicServer
from agentrun.fake_anthropic.scenario import builtin_scenario_path, load_scenario, parse_scenario
from agentrun.worker import model_call
from agentrun.worker.client import AsyncAnthropic
from agentrun.worker.model_call import MalformedStream, classify

THINKING = {"type": "enabled", "budget_tokens": 1024}


def _scripts() -> dict[str, Any]:
    turns = {
        "text": [{"content": [{"text": "Hello there, " * 30}]}],
        "tool": [{"content": [{"text": "Calling."},
                              {"tool_use": {"name": "echo", "input": {"text": "é ✓ \\u2028"}}}]}],
        "multi": [{"content": [
            {"tool_use": {"name": "echo", "input": {"text": "a", "n": [1, 2.5, None, True]}}},
            {"tool_use": {"name": "echo", "input": {}}},
            {"tool_use": {"name": "echo", "input": {"nested": {"deep": ["x" * 200]}}}},
        ]}],
        "thinking": [{"content": [{"thinking": "Let me think. " * 40}, {"text": "Done."},
                                  {"tool_use": {"name": "echo", "input": {"text": "t"}}}]}],
        "error": [{"content": [{"text": "never"}],
                   "faults": [{"stream": "error", "type": "overloaded_error", "after_events": 4}]}],
        "refused": [{"content": [{"text": "never"}],
                     "faults": [{"stream": "error", "type": "invalid_request_error",
                                 "message": "bad"}]}],
        "truncated": [{"content": [{"text": "never"}],
                       "faults": [{"stream": "truncated", "after_events": 3}]}],
        "garbage": [{"content": [{"text": "never"}],
                     "faults": [{"stream": "garbage", "after_events": 3}]}],
    }
    return {"name": "raw", "scripts": [
        {"name": name, "match": f"[{name}]", "turns": t} for name, t in turns.items()
    ]}


@pytest.fixture
async def srv() -> AsyncIterator[FakeAnthropicServer]:
    async with FakeAnthropicServer(parse_scenario(_scripts())) as server:
        yield server


def request(task: str, *, thinking: bool = False) -> dict[str, Any]:
    req: dict[str, Any] = {
        "model": "claude-sonnet-4-5", "max_tokens": 4096,
        "messages": [{"role": "user", "content": task}],
        "tools": [{"name": "echo", "description": "echo",
                   "input_schema": {"type": "object"}}],
    }
    if thinking:
        req["thinking"] = THINKING
    return req


async def both(client: AsyncAnthropic, req: dict[str, Any]) -> tuple[Any, Any]:
    assert model_call.raw_route(client)
    raw = await model_call._stream_turn(client, req, None)
    sdk = await model_call._stream_turn_sdk(client, req, None)
    return raw, sdk


def same(raw: Any, sdk: Any) -> None:
    # The message id is the server's random one per answer; everything else is byte-exact.
    a, b = dict(raw.payload), dict(sdk.payload)
    assert a.pop("id") != b.pop("id")
    assert canonical_json(a) == canonical_json(b)
    assert (raw.stop_reason, raw.input_tokens, raw.output_tokens, raw.cache_read_tokens,
            raw.cache_write_tokens) == (sdk.stop_reason, sdk.input_tokens, sdk.output_tokens,
                                        sdk.cache_read_tokens, sdk.cache_write_tokens)
    assert raw.request_id and sdk.request_id


@pytest.mark.parametrize("name", ["text", "tool", "multi", "thinking"])
async def test_the_raw_payload_is_the_sdks(srv: FakeAnthropicServer, name: str) -> None:
    async with AsyncAnthropic(api_key="k", base_url=srv.base_url, max_retries=0,
                              open_telemetry=False) as client:
        raw, sdk = await both(client, request(f"go [{name}]", thinking=name == "thinking"))
    same(raw, sdk)
    assert isinstance(raw.payload["content"], list) and raw.payload["content"]


async def test_every_turn_of_the_builtin_scenarios_is_the_sdks() -> None:
    path = builtin_scenario_path("demo_migration")
    assert path is not None
    scenario = load_scenario(path)
    async with FakeAnthropicServer(scenario) as server, AsyncAnthropic(
        api_key="k", base_url=server.base_url, max_retries=0, open_telemetry=False
    ) as client:
        req = request("migrate the orders table", thinking=True)
        for _ in scenario.scripts[0].turns:
            raw = await model_call._stream_turn(client, req, None)
            # The same turn again through the SDK: the server answers by the history's length.
            sdk = await model_call._stream_turn_sdk(client, req, None)
            same(raw, sdk)
            if raw.stop_reason != "tool_use":
                break
            uses = [b for b in raw.payload["content"] if b["type"] == "tool_use"]
            req = {**req, "messages": [
                *req["messages"], {"role": "assistant", "content": raw.payload["content"]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": b["id"], "content": "ok"}
                    for b in uses]},
            ]}


async def test_an_error_event_in_the_stream_is_classified_by_its_type(
    srv: FakeAnthropicServer,
) -> None:
    async with AsyncAnthropic(api_key="k", base_url=srv.base_url, max_retries=0,
                              open_telemetry=False) as client:
        seen: list[int] = []
        with pytest.raises(anthropic.APIStatusError) as err:
            await model_call._stream_turn(client, request("x [error]"), lambda: seen.append(1))
        assert err.value.status_code == 200 and model_call.error_type(err.value) == \
            "overloaded_error"
        assert classify(err.value) == "transient" and seen == [1]
        with pytest.raises(anthropic.APIStatusError) as refused:
            await model_call._stream_turn(client, request("x [refused]"), None)
        assert classify(refused.value) == "permanent"
        assert model_call._provider_message(refused.value) == \
            "error event in the stream invalid_request_error: bad"


async def test_a_truncated_stream_is_transient(srv: FakeAnthropicServer) -> None:
    async with AsyncAnthropic(api_key="k", base_url=srv.base_url, max_retries=0,
                              open_telemetry=False) as client:
        with pytest.raises(MalformedStream, match="before message_stop") as err:
            await model_call._stream_turn(client, request("x [truncated]"), None)
        assert classify(err.value) == "transient"


async def test_a_data_line_that_is_not_json_is_a_malformed_stream(
    srv: FakeAnthropicServer,
) -> None:
    async with AsyncAnthropic(api_key="k", base_url=srv.base_url, max_retries=0,
                              open_telemetry=False) as client:
        with pytest.raises(MalformedStream, match="JSONDecodeError") as err:
            await model_call._stream_turn(client, request("x [garbage]"), None)
        assert classify(err.value) == "transient"


def test_traced_bedrock_and_switched_off_clients_take_the_sdks_events(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plain = AsyncAnthropic(api_key="k", max_retries=0, open_telemetry=False)
    assert model_call.raw_route(plain)
    monkeypatch.setattr(model_call, "RAW_STREAM", False)
    assert not model_call.raw_route(plain)


async def test_a_lone_surrogate_is_sent_escaped_on_the_raw_route(
    srv: FakeAnthropicServer,
) -> None:
    async with AsyncAnthropic(api_key="k", base_url=srv.base_url, max_retries=0,
                              open_telemetry=False) as client:
        turn = await model_call._stream_turn(client, request("file \udcff [text]"), None)
    assert turn.stop_reason == "end_turn"
    assert model_call._body(request("\udcff")).count(b"\\udcff") == 1


async def test_the_raw_route_sends_the_request_the_sdks_post_would() -> None:
    """The raw route builds the SDK's request options once (model_call.post_options) instead of
    through ``client.post``, whose construct deep-copies every default on each call: the request
    that leaves, method, URL, every header and the body, is the one ``post`` sends, every time
    (the shared options are copied, never changed by a request)."""
    import httpx2 as httpx
    from anthropic._constants import RAW_RESPONSE_HEADER

    sent: list[tuple[str, str, list[tuple[str, str]], bytes]] = []

    def record(request: httpx.Request) -> httpx.Response:
        headers = sorted(kv for kv in request.headers.items() if kv[0] != "x-stainless-retry-count")
        sent.append((request.method, str(request.url), headers, request.content))
        return httpx.Response(200, content=b"")

    client = anthropic.AsyncAnthropic(
        api_key="k", base_url="http://model.test", max_retries=0, open_telemetry=False,
        http_client=httpx.AsyncClient(transport=httpx.MockTransport(record)),
    )  # fmt: skip
    body = model_call._body({"model": "m", "max_tokens": 8, "messages": []})
    response = await client.post(
        "/v1/messages", cast_to=httpx.Response, content=body, stream=True,
        options={"headers": {RAW_RESPONSE_HEADER: "stream"}},
    )  # fmt: skip
    await response.aclose()
    before = model_call._POST.model_dump()
    for _ in range(2):
        options = model_call.post_options(body)
        response = await client.request(httpx.Response, options, stream=True)
        await response.aclose()
    await client.close()
    assert len(sent) == 3 and sent[0] == sent[1] == sent[2], sent
    assert ("x-stainless-raw-response", "stream") in sent[0][2] and sent[0][3] == body
    assert model_call._POST.model_dump() == before


def test_the_body_is_the_sdks_encoding_of_the_canonical_request() -> None:
    """model_call._body writes the history's canonical key order straight into the bytes; they
    are the SDK's encoder's bytes for the request with that order put into its dicts (the SDK's
    route), whatever the values: odd strings, nesting, a lone surrogate (escaped the same),
    key orders that differ between the live turns and the stored ones."""
    import random

    from anthropic._utils._json import openapi_dumps

    from agentrun.worker.client import escape_surrogates

    rng = random.Random(5)

    def value(depth: int = 0) -> Any:
        r = rng.random()
        if depth > 2 or r < 0.3:
            return rng.choice(["é✓\u2028", 'q"\\', 1, -2.5, None, True, "x" * rng.randint(0, 9)])
        if r < 0.6:
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        keys = rng.sample(["z", "a", "type", "m", "cache_control"], rng.randint(0, 4))
        return {k: value(depth + 1) for k in keys}

    for i in range(300):
        req: dict[str, Any] = {"model": "m", "max_tokens": 8, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "t", "z": value()}]},
            {"content": value(), "role": "assistant"}]}
        if i % 2:
            req["system"] = [{"type": "text", "text": value(), "cache_control": value()}]
            req["tools"] = [{"name": "echo", "input_schema": value()}]
            req["thinking"] = {"type": "enabled", "budget_tokens": 1024}  # its order is kept
        if i % 7 == 0:
            req["messages"][0]["content"][0]["text"] = "lone \udcff"
        expected = {**model_call.canonical_request(req), "stream": True}
        try:
            sdk = openapi_dumps(expected)
        except UnicodeEncodeError:
            from anthropic._utils._json import openapi_dumps_str
            sdk = escape_surrogates(openapi_dumps_str(expected))
        assert model_call._body(req) == sdk


@pytest.mark.parametrize("caching", [False, True])
def test_a_runs_history_is_encoded_once_and_sent_as_the_same_bytes(
    caching: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run's requests carry the whole conversation every turn; with the run's BodyTexts what
    is encoded anew each turn is what is new (the newest messages, and with prompt caching the
    blocks it marks, the task's block, the last tool and the system prompt), not the whole
    history again: no more at the 12th turn than at the 5th. The bytes are those of the
    body encoded whole, and what is kept is no more than the latest request holds."""
    from agentrun.store import PromptVersion

    tools = [{"name": f"tool{i}", "input_schema": {"type": "object", "z": i, "a": [2]}}
             for i in range(4)]
    pv = PromptVersion(model="m", system="sys é", tools=tools,
                       params={"max_tokens": 64, "prompt_caching": caching})
    fresh: list[int] = []  # the characters encoded anew, of lists and dicts (not the parts)
    canonical_text = model_call._canonical_text

    def counting(value: Any) -> str:
        text = canonical_text(value)
        if isinstance(value, list | dict):
            fresh.append(len(text))
        return text

    monkeypatch.setattr(model_call, "_canonical_text", counting)
    texts = model_call.BodyTexts()
    messages: list[dict[str, Any]] = [{"role": "user", "content": "the task \udcff"}]
    per_turn: list[int] = []
    for turn in range(12):
        req = model_call.build_request(pv, messages)
        fresh.clear()
        body = model_call._body(req, texts)
        per_turn.append(sum(fresh))
        assert body == model_call._body(req)  # the same bytes as encoded whole
        blocks = sum(len(m["content"]) + 1 for m in req["messages"]
                     if isinstance(m["content"], list))
        assert len(texts) <= blocks + len(tools) + 1 + 2  # the request's lists and blocks
        call = {"type": "tool_use", "id": f"t{turn:02}", "name": "tool0",
                "input": {"text": "é" * 5, "n": [0.5, None]}}
        messages.append({"role": "assistant", "content": [{"type": "text", "text": "x"}, call]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"t{turn:02}", "content": "y" * 5}]})
    assert per_turn[-1] <= per_turn[4], per_turn  # no more at the 12th turn than at the 5th


def test_body_texts_keep_no_value_by_an_id_another_object_took() -> None:
    """Kept by identity, each entry holding its value: an equal list is encoded anew, a list no
    request uses any more is let go, and one that is is still the same text."""
    texts = model_call.BodyTexts()
    a = [{"type": "text", "text": "a"}]
    first = texts.text(a)
    texts.body_done()
    assert texts.text(a) is first  # the same object: the text kept
    b = [{"type": "text", "text": "b"}]
    assert texts.text(b) == '[{"text":"b","type":"text"}]'
    texts.body_done()
    texts.body_done()  # a body that used nothing: nothing kept
    assert len(texts) == 0
