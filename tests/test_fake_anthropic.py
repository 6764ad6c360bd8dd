"""The fake Anthropic server, driven by the real anthropic SDK over real HTTP (no mocks).

What matters most is that the fake is at least as strict as the real API where a durable runtime
can go wrong: a replayed history must be byte-for-byte what the model produced (modulo key order),
or the signed thinking blocks in it are rejected.
"""

from __future__ import annotations

import asyncio
import copy
import json
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anthropic
import pytest
import yaml

from agentrun.fake_anthropic import (
    FakeAnthropicServer,
    Scenario,
    ScenarioError,
    builtin_scenario_path,
    load_scenario,
    main,
    parse_scenario,
)
from agentrun.fake_anthropic.server import tool_use_id

MODEL = "claude-test-1"
OTHER_MODEL = "claude-test-2"
SYSTEM = "You are a careful weather bot."
TOOLS: list[dict[str, Any]] = [
    {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }
]
INVALID_SIGNATURE = "Invalid `signature` in `thinking` block"

SCENARIO: dict[str, Any] = {
    "name": "test",
    "secret": "test-secret",
    "models": [MODEL, OTHER_MODEL],
    "scripts": [
        {
            "name": "weather",
            "match": "weather",
            "turns": [
                {
                    "content": [
                        {"thinking": "The user wants the weather; I should call the tool."},
                        {"text": "Let me check Paris."},
                        {"tool_use": {"name": "get_weather", "input": {"city": "Paris"}}},
                    ]
                },
                {
                    "content": [
                        {"type": "thinking", "thinking": "Paris is sunny. Lyon next, " * 4},
                        {"type": "text", "text": "Now Lyon."},
                        {"type": "tool_use", "name": "get_weather", "input": {"city": "Lyon"}},
                    ]
                },
                {"content": [{"text": "Both cities are sunny."}]},
            ],
        },
        {
            "name": "rate-limited",
            "match": "rate-limit",
            "turns": [
                {
                    "faults": [{"status": 429, "retry_after": 0.2, "times": 2}],
                    "content": [{"text": "finally"}],
                }
            ],
        },
        {
            "name": "overloaded",
            "match": "overload",
            "turns": [
                {
                    "faults": [{"status": 529, "times": 1}, {"status": 500, "times": 1}],
                    "content": [{"text": "survived"}],
                }
            ],
        },
        {
            "name": "slow",
            "match": "slow",
            "turns": [{"stream_delay_ms": 100, "content": [{"text": "word " * 80}]}],
        },
        {
            "name": "truncated",
            "match": "truncate",
            "turns": [{"stop_reason": "max_tokens", "content": [{"text": "cut sho"}]}],
        },
        {"name": "default", "turns": [{"content": [{"text": "hello"}]}]},
    ],
}


@pytest.fixture
def scenario() -> Scenario:
    return parse_scenario(SCENARIO)


@pytest.fixture
async def server(scenario: Scenario) -> AsyncIterator[FakeAnthropicServer]:
    async with FakeAnthropicServer(scenario, port=0) as srv:
        yield srv


@pytest.fixture
def make_client(
    server: FakeAnthropicServer,
) -> Callable[..., anthropic.AsyncAnthropic]:
    def make(max_retries: int = 0) -> anthropic.AsyncAnthropic:
        return anthropic.AsyncAnthropic(
            base_url=server.base_url, api_key="x", max_retries=max_retries, timeout=10
        )

    return make


@pytest.fixture
def client(make_client: Callable[..., anthropic.AsyncAnthropic]) -> anthropic.AsyncAnthropic:
    return make_client()


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def _assistant(message: anthropic.types.Message) -> dict[str, Any]:
    """What a durable runtime stores and sends back: the SDK's exact round-trip form."""
    return {"role": "assistant", "content": message.to_dict()["content"]}


def _tool_results(message: anthropic.types.Message) -> dict[str, Any]:
    results = [
        {"type": "tool_result", "tool_use_id": block.id, "content": "sunny, 21C"}
        for block in message.content
        if block.type == "tool_use"
    ]
    return {"role": "user", "content": results}


async def _create(
    client: anthropic.AsyncAnthropic, messages: list[dict[str, Any]], **overrides: Any
) -> anthropic.types.Message:
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 1024,
        "system": SYSTEM,
        "tools": TOOLS,
        "messages": messages,
    }
    kwargs.update(overrides)
    message: anthropic.types.Message = await client.messages.create(**kwargs)
    return message


async def _weather_history(client: anthropic.AsyncAnthropic) -> list[dict[str, Any]]:
    """Two tool-using turns, stored with to_dict(): assistant thinking at messages 1 and 3."""
    messages = [_user("What is the weather in Paris and Lyon?")]
    for _ in range(2):
        answer = await _create(client, messages)
        messages += [_assistant(answer), _tool_results(answer)]
    return messages


def _reverse_keys(value: Any) -> Any:
    """Every dict with its keys in reverse order, as a JSONB round trip might leave it."""
    if isinstance(value, dict):
        return {k: _reverse_keys(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return [_reverse_keys(v) for v in value]
    return value


# --- responses ---------------------------------------------------------------------------------


async def test_streaming_assembles_the_same_message_as_non_streaming(
    client: anthropic.AsyncAnthropic,
) -> None:
    history = await _weather_history(client)
    for messages in (history[:1], history[:3]):
        plain = await _create(client, messages)
        request: dict[str, Any] = {"model": MODEL, "max_tokens": 1024, "system": SYSTEM}
        request.update(tools=TOOLS, messages=messages)
        delta_types: set[str] = set()
        async with client.messages.stream(**request) as stream:
            async for event in stream:
                if event.type == "content_block_delta":
                    delta_types.add(event.delta.type)
            streamed = await stream.get_final_message()
        assert delta_types == {
            "thinking_delta",
            "signature_delta",
            "text_delta",
            "input_json_delta",
        }
        plain_dict, streamed_dict = plain.to_dict(), streamed.to_dict()
        assert plain_dict.pop("id") != streamed_dict.pop("id")
        assert streamed_dict == plain_dict


async def test_ids_usage_and_request_id_look_like_the_real_api(
    client: anthropic.AsyncAnthropic,
) -> None:
    message = await _create(client, [_user("weather in Paris?")])
    assert message.id.startswith("msg_fake_")
    assert message._request_id is not None and message._request_id.startswith("req_fake_")
    assert message.stop_reason == "tool_use"
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0
    text = message.content[1]
    assert text.type == "text" and text.to_dict() == {
        "type": "text",
        "text": "Let me check Paris.",
        "citations": None,
    }


async def test_tool_use_ids_are_deterministic_across_calls_and_restarts(
    scenario: Scenario, client: anthropic.AsyncAnthropic
) -> None:
    first = await _create(client, [_user("weather?")])
    second = await _create(client, [_user("weather?")])
    async with FakeAnthropicServer(scenario) as other:
        other_client = anthropic.AsyncAnthropic(base_url=other.base_url, api_key="x")
        third = await _create(other_client, [_user("weather?")])
    ids = {m.content[2].id for m in (first, second, third) if m.content[2].type == "tool_use"}
    assert ids == {tool_use_id("weather", 0, 2)}
    assert next(iter(ids)).startswith("toolu_") and len(next(iter(ids))) == len("toolu_") + 24


async def test_scripted_stop_reason_and_default_script(client: anthropic.AsyncAnthropic) -> None:
    truncated = await _create(client, [_user("please truncate")])
    assert truncated.stop_reason == "max_tokens"
    fallback = await _create(client, [_user("something unscripted")])
    assert fallback.stop_reason == "end_turn" and fallback.content[0].type == "text"


async def test_a_turn_beyond_the_script_is_a_clear_400(client: anthropic.AsyncAnthropic) -> None:
    history = await _weather_history(client)
    final = await _create(client, history)
    assert final.stop_reason == "end_turn"
    with pytest.raises(anthropic.BadRequestError) as caught:
        await _create(client, [*history, _assistant(final), _user("and now?")])
    assert "has 3 turn(s)" in caught.value.message and "turn 3" in caught.value.message


# --- thinking signatures -----------------------------------------------------------------------


async def test_replaying_the_stored_history_passes_the_signature_check(
    client: anthropic.AsyncAnthropic,
) -> None:
    history = await _weather_history(client)
    assert (await _create(client, history)).stop_reason == "end_turn"
    # A JSON round trip (what a database does) and reordered keys (what JSONB does) both pass.
    assert (await _create(client, json.loads(json.dumps(history)))).stop_reason == "end_turn"
    assert (await _create(client, _reverse_keys(history))).stop_reason == "end_turn"
    reordered_tools = _reverse_keys(TOOLS)
    assert (await _create(client, history, tools=reordered_tools)).stop_reason == "end_turn"


def _change_first_user_char(h: list[dict[str, Any]]) -> None:
    h[0]["content"] = h[0]["content"].replace("Paris", "Parus")


def _change_tool_result(h: list[dict[str, Any]]) -> None:
    h[2]["content"][0]["content"] = "sunny, 22C"


def _drop_citations(h: list[dict[str, Any]]) -> None:
    del h[1]["content"][1]["citations"]


def _add_caller(h: list[dict[str, Any]]) -> None:
    h[1]["content"][2]["caller"] = None


@pytest.mark.parametrize(
    ("mutate", "overrides", "where"),
    [
        pytest.param(None, {"system": SYSTEM + " "}, "messages.1.content.0", id="system"),
        pytest.param(
            None,
            {"tools": [{**TOOLS[0], "description": "Weather."}]},
            "messages.1.content.0",
            id="tool-definition",
        ),
        pytest.param(None, {"model": OTHER_MODEL}, "messages.1.content.0", id="model"),
        pytest.param(_change_first_user_char, {}, "messages.1.content.0", id="first-user-char"),
        pytest.param(_change_tool_result, {}, "messages.3.content.0", id="tool-result"),
        pytest.param(_drop_citations, {}, "messages.3.content.0", id="dropped-citations-null"),
        pytest.param(_add_caller, {}, "messages.3.content.0", id="added-caller-null"),
    ],
)
async def test_any_change_to_the_history_invalidates_the_thinking_signature(
    client: anthropic.AsyncAnthropic,
    mutate: Callable[[list[dict[str, Any]]], None] | None,
    overrides: dict[str, Any],
    where: str,
) -> None:
    history = await _weather_history(client)
    tampered = copy.deepcopy(history)
    if mutate is not None:
        mutate(tampered)
    with pytest.raises(anthropic.BadRequestError) as caught:
        await _create(client, tampered, **overrides)
    assert caught.value.status_code == 400
    body = caught.value.body
    assert isinstance(body, dict)
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"] == f"{where}: {INVALID_SIGNATURE}"
    assert body["request_id"] == caught.value.request_id


async def test_a_tampered_signature_is_rejected(client: anthropic.AsyncAnthropic) -> None:
    history = await _weather_history(client)
    history[3]["content"][0]["signature"] = history[1]["content"][0]["signature"]
    with pytest.raises(anthropic.BadRequestError, match=r"messages\.3\.content\.0: Invalid"):
        await _create(client, history)


# --- faults ------------------------------------------------------------------------------------


async def test_429_with_retry_after_is_retried_by_the_sdk(
    server: FakeAnthropicServer, make_client: Callable[..., anthropic.AsyncAnthropic]
) -> None:
    started = time.monotonic()
    message = await _create(make_client(max_retries=2), [_user("rate-limit me")])
    assert message.content[0].type == "text" and message.content[0].text == "finally"
    assert time.monotonic() - started >= 0.4  # two retry-after waits of 0.2 s
    assert [e["status"] for e in server.requests()] == [429, 429, 200]

    server.reset()
    with pytest.raises(anthropic.RateLimitError) as caught:
        await _create(make_client(max_retries=0), [_user("rate-limit me")])
    assert caught.value.response.headers["retry-after"] == "0.2"
    assert caught.value.request_id is not None and caught.value.request_id.startswith("req_fake_")
    body = caught.value.body
    assert isinstance(body, dict) and body["error"]["type"] == "rate_limit_error"


async def test_529_and_500_are_retried_by_the_sdk(
    server: FakeAnthropicServer, make_client: Callable[..., anthropic.AsyncAnthropic]
) -> None:
    message = await _create(make_client(max_retries=2), [_user("overload")])
    assert message.content[0].type == "text" and message.content[0].text == "survived"
    assert [e["status"] for e in server.requests()] == [529, 500, 200]

    server.reset()
    client = make_client(max_retries=0)
    with pytest.raises(anthropic.OverloadedError):
        await _create(client, [_user("overload")])
    with pytest.raises(anthropic.InternalServerError) as caught:
        await _create(client, [_user("overload")])
    assert not isinstance(caught.value, anthropic.OverloadedError)
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["error"]["type"] == "api_error"


async def test_unknown_model_is_not_found(client: anthropic.AsyncAnthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as caught:
        await _create(client, [_user("weather?")], model="claude-nope-9")
    assert "claude-nope-9" in str(caught.value)
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["error"] == {
        "type": "not_found_error",
        "message": "model: claude-nope-9",
    }


async def test_a_slow_stream_can_be_cancelled_midway(
    server: FakeAnthropicServer, client: anthropic.AsyncAnthropic
) -> None:
    first_text = asyncio.Event()

    async def consume() -> None:
        request: dict[str, Any] = {"model": MODEL, "max_tokens": 1024, "messages": [_user("slow")]}
        async with client.messages.stream(**request) as stream:
            async for event in stream:
                if event.type == "text":
                    first_text.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(first_text.wait(), timeout=5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    for _ in range(100):  # the server notices at its next write, at most 100 ms later
        if server.requests()[-1].get("disconnected"):
            break
        await asyncio.sleep(0.05)
    entry = server.requests()[-1]
    assert entry["disconnected"] is True and entry["completed"] is False
    # The server is still healthy afterwards.
    assert (await _create(client, [_user("hi")])).stop_reason == "end_turn"


async def test_api_key_is_checked_when_the_scenario_sets_one() -> None:
    scenario = parse_scenario({**SCENARIO, "api_key": "sk-right"})
    async with FakeAnthropicServer(scenario) as srv:
        wrong = anthropic.AsyncAnthropic(base_url=srv.base_url, api_key="sk-wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError):
            await _create(wrong, [_user("hi")])
        right = anthropic.AsyncAnthropic(base_url=srv.base_url, api_key="sk-right")
        assert (await _create(right, [_user("hi")])).stop_reason == "end_turn"


# --- stream faults: a 200 stream that goes wrong ----------------------------------------------

STREAM_FAULTS: dict[str, Any] = {
    "name": "stream-faults",
    "record_bodies": True,
    "scripts": [
        {
            "name": name,
            "match": name,
            "turns": [{"faults": [fault], "content": [{"text": "the real answer " * 8}]}],
        }
        for name, fault in {
            "overloaded": {"stream": "error", "after_events": 3},
            "refused": {"stream": "error", "type": "invalid_request_error", "message": "no"},
            "pings": {"stream": "pings", "interval_ms": 20},
            "garbage": {"stream": "garbage", "after_events": 3},
            "truncated": {"stream": "truncated"},
        }.items()
    ],
}


@pytest.fixture
async def faulty() -> AsyncIterator[FakeAnthropicServer]:
    async with FakeAnthropicServer(parse_scenario(STREAM_FAULTS)) as srv:
        yield srv


async def _stream(
    client: anthropic.AsyncAnthropic, text: str
) -> tuple[list[str], anthropic.types.Message]:
    request: dict[str, Any] = {"model": MODEL, "max_tokens": 100, "messages": [_user(text)]}
    async with client.messages.stream(**request) as stream:
        types = [event.type async for event in stream]
        return types, await stream.get_final_message()


async def test_an_error_event_inside_a_200_stream_reaches_the_sdk_with_its_type(
    faulty: FakeAnthropicServer,
) -> None:
    client = anthropic.AsyncAnthropic(base_url=faulty.base_url, api_key="x", max_retries=0)
    for text, etype in [("overloaded", "overloaded_error"), ("refused", "invalid_request_error")]:
        with pytest.raises(anthropic.APIStatusError) as caught:
            await _stream(client, text)
        assert caught.value.status_code == 200  # the stream had started: the status says nothing
        body = caught.value.body
        assert isinstance(body, dict) and body["error"]["type"] == etype
    assert body["error"]["message"] == "no"
    # Only the first request of the turn is faulty: the next one streams the real answer.
    types, message = await _stream(client, "overloaded")
    assert types[-1] == "message_stop" and message.stop_reason == "end_turn"
    log = faulty.requests()
    assert [(e["script"], e["status"], e.get("fault")) for e in log] == [
        ("overloaded", 200, "stream error"),
        ("refused", 200, "stream error"),
        ("overloaded", 200, None),
    ]


async def test_a_stream_of_pings_never_ends_and_no_read_timeout_fires(
    faulty: FakeAnthropicServer,
) -> None:
    # The SDK's timeout is per read: pings every 20 ms keep a 0.5 s read timeout from firing.
    client = anthropic.AsyncAnthropic(
        base_url=faulty.base_url, api_key="x", max_retries=0, timeout=0.5
    )
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(_stream(client, "pings"), timeout=2)
    for _ in range(100):  # the server notices at its next ping, 20 ms later
        if faulty.requests()[-1].get("disconnected"):
            break
        await asyncio.sleep(0.05)
    entry = faulty.requests()[-1]
    assert entry["fault"] == "stream pings"
    assert entry["disconnected"] is True and entry["completed"] is False


async def test_a_malformed_stream_breaks_the_sdk_or_ends_without_message_stop(
    faulty: FakeAnthropicServer,
) -> None:
    client = anthropic.AsyncAnthropic(base_url=faulty.base_url, api_key="x", max_retries=0)
    with pytest.raises(json.JSONDecodeError):
        await _stream(client, "garbage")
    # A data line cut mid-JSON, then the end: the SDK drops the incomplete event and hands out
    # what it had, a message with no stop_reason. A client must check for message_stop itself.
    types, message = await _stream(client, "truncated")
    assert types == ["message_start"]
    assert message.stop_reason is None and message.content == []
    assert [e.get("fault") for e in faulty.requests()] == ["stream garbage", "stream truncated"]


async def test_a_stream_fault_needs_a_streaming_request_and_bodies_are_recorded_raw(
    faulty: FakeAnthropicServer,
) -> None:
    client = anthropic.AsyncAnthropic(base_url=faulty.base_url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="`stream: error` fault, which needs a"):
        await client.messages.create(
            model=MODEL, max_tokens=100, messages=[{"role": "user", "content": "overloaded"}]
        )
    body = faulty.requests()[0]["body"]
    assert isinstance(body, str)
    assert json.loads(body) == {
        "max_tokens": 100,
        "messages": [{"role": "user", "content": "overloaded"}],
        "model": MODEL,
    }


# --- introspection and the threaded server -----------------------------------------------------


def test_threaded_server_and_introspection_endpoints(scenario: Scenario) -> None:
    with FakeAnthropicServer(scenario) as srv:
        client = anthropic.Anthropic(base_url=srv.base_url, api_key="x", max_retries=0)
        request: dict[str, Any] = {"model": MODEL, "max_tokens": 100, "system": SYSTEM}
        request.update(tools=TOOLS, messages=[_user("weather?")])
        client.messages.create(**request)
        with urllib.request.urlopen(f"{srv.base_url}/_fake/requests") as response:
            entries = json.load(response)
        assert len(entries) == 1
        entry = entries[0]
        assert {k: entry[k] for k in ("model", "system", "tools", "n_messages", "stream")} == {
            "model": MODEL,
            "system": SYSTEM,
            "tools": ["get_weather"],
            "n_messages": 1,
            "stream": False,
        }
        assert (entry["script"], entry["turn"], entry["status"]) == ("weather", 0, 200)
        assert "body" not in entry  # raw bodies only with `record_bodies: true`
        reset = urllib.request.Request(f"{srv.base_url}/_fake/reset", method="POST", data=b"")
        with urllib.request.urlopen(reset) as response:
            assert json.load(response) == {"ok": True}
        assert srv.requests() == []


# --- the demo scenario -------------------------------------------------------------------------


async def test_demo_scenario_plays_through_twelve_turns_with_signed_thinking() -> None:
    path = builtin_scenario_path("demo_migration")
    assert path is not None
    async with FakeAnthropicServer(load_scenario(path)) as srv:
        client = anthropic.AsyncAnthropic(base_url=srv.base_url, api_key="x", max_retries=0)
        messages = [_user("Add a region column to orders and backfill it.")]
        calls: list[tuple[str, dict[str, object]]] = []
        thinking_turns: list[int] = []
        for turn in range(12):
            answer = await _create(client, messages, system="You migrate databases carefully.")
            if any(block.type == "thinking" for block in answer.content):
                thinking_turns.append(turn)
            calls += [(b.name, b.input) for b in answer.content if b.type == "tool_use"]
            messages += [_assistant(answer), _tool_results(answer)]
        assert answer.stop_reason == "end_turn"
    assert [name for name, _ in calls] == [
        "read_schema", "read_schema", "count_rows", "write_production", "check_migration",
        "write_production", "check_migration", "read_schema", "check_migration", "count_rows",
        "check_migration",
    ]  # fmt: skip
    assert calls[3][1] == {"statement": "ALTER TABLE orders ADD COLUMN region text"}
    assert calls[5][1] == {"statement": "UPDATE orders SET region = 'eu' WHERE region IS NULL"}
    assert {0, 3, 6, 7} <= set(thinking_turns)


# --- scenario files and the CLI ----------------------------------------------------------------


def test_shorthand_and_explicit_blocks_are_the_same(scenario: Scenario) -> None:
    turns = scenario.scripts[0].turns
    assert [b.type for b in turns[0].content] == [b.type for b in turns[1].content]
    assert turns[0].effective_stop_reason == "tool_use"
    assert turns[2].effective_stop_reason == "end_turn"
    assert "test-secret" not in repr(scenario)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            "name: x\nscripts:\n  - name: s\n    turns:\n      - content: [{text: hi}]\n"
            "        fautls: []\n",
            "scripts.0.turns.0.fautls: Extra inputs are not permitted",
            id="typo",
        ),
        pytest.param(
            "name: x\nscripts:\n  - name: s\n    turns:\n      - content:\n"
            "          - tool_use: {input: {a: 1}}\n",
            "scripts.0.turns.0.content.0.tool_use.name: Field required",
            id="missing-tool-name",
        ),
        pytest.param(
            "name: x\nscripts:\n  - name: s\n    turns:\n      - content: [{text: hi}]\n"
            "        faults: [{status: 200}]\n",
            "scripts.0.turns.0.faults.0.status",
            id="bad-fault-status",
        ),
        pytest.param(
            "name: x\nscripts:\n  - name: s\n    turns:\n      - content: [{text: hi}]\n"
            "        faults: [{status: 529, stream: error}]\n",
            "scripts.0.turns.0.faults.0: Value error, a fault sets exactly one of `status`",
            id="fault-of-two-kinds",
        ),
        pytest.param(
            "name: x\nscripts:\n  - name: s\n    turns:\n      - content: [{text: hi}]\n"
            "        faults: [{stream: stall}]\n",
            "scripts.0.turns.0.faults.0.stream: Input should be 'error', 'pings', 'garbage' or "
            "'truncated'",
            id="unknown-stream-fault",
        ),
        pytest.param("name: x\nscripts: [\n", "not valid YAML", id="bad-yaml"),
    ],
)
def test_a_bad_scenario_file_names_the_field_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, expected: str
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    with pytest.raises(ScenarioError, match=expected.split(":")[0]):
        load_scenario(bad)
    assert main(["--scenario", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and expected in err
    assert err.count("\n") == 1


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_cli_serves_and_exits_0_on_sigterm(tmp_path: Path) -> None:
    scenario_file = tmp_path / "scenario.json"
    scenario_file.write_text(json.dumps(SCENARIO))
    port = _free_port()
    command = [sys.executable, "-m", "agentrun.fake_anthropic"]
    command += ["--scenario", str(scenario_file), "--port", str(port)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 15)
        assert ready, "the CLI printed nothing within 15 s"
        line = proc.stdout.readline()
        assert line == f"fake-anthropic listening on http://127.0.0.1:{port} (scenario: test)\n"
        client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="x")
        answer = client.messages.create(
            model=MODEL, max_tokens=100, messages=[{"role": "user", "content": "hi"}]
        )
        assert answer.content[0].type == "text" and answer.content[0].text == "hello"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_bad_scenario_subprocess_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"name": "x", "scripts": [], "modles": []}))
    result = subprocess.run(
        [sys.executable, "-m", "agentrun.fake_anthropic", "--scenario", str(bad)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert str(bad) in result.stderr and "modles" in result.stderr
