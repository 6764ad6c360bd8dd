"""The scripted server's per-request work in one pass (its prompt cache's prefix keys and token
counts, the thinking signatures it checks) gives what the plain definitions give: the same keys,
counts and verdicts, on random histories with every odd value the store can hold (a lone
surrogate, U+2028, nested cache_control); one request's canonical JSON is written about once for
the three readers (fake_anthropic/canon.py). The benchmarks' scripted server shares the worker's
two cores, so its cost per step is part of every steps/s figure; its answers must not change."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import random
from typing import Any

import agentrun.canonical as canonical
from agentrun.canonical import canonical_json
from agentrun.fake_anthropic.canon import RequestTexts, prefix_tokens, strip_cache_control
from agentrun.fake_anthropic.scenario import parse_scenario
from agentrun.fake_anthropic.server import PromptCache, build_message, estimate_tokens
from agentrun.fake_anthropic.signing import Signatures, invalid_signature_message

# -- the definitions, written whole: what the server's one-pass texts must equal ---------------


def sign_thinking(
    secret: str,
    *,
    model: Any,
    system: Any,
    tools: Any,
    messages_before: list[Any],
    thinking: str,
) -> str:
    """The binding written whole (the definition signing.Signatures is checked against):
    HMAC-SHA256 over its canonical JSON without cache_control, base64-encoded."""
    payload = canonical_json(
        strip_cache_control({
            "model": model,
            "system": system,
            "tools": tools,
            "messages_before": messages_before,
            "thinking_text": thinking,
        })
    )
    # surrogatepass: a lone surrogate (a tool's output, sent as a JSON \ud800 escape) is still
    # bound by the signature instead of making the server answer 500.
    digest = hmac.new(secret.encode(), payload.encode("utf-8", "surrogatepass"),
                      hashlib.sha256).digest()
    return base64.b64encode(digest).decode("ascii")


def prompt_blocks(body: dict[str, Any]) -> tuple[list[Any], list[int]]:
    """The prompt as the API's cache sees it: tools, then system, then every message block, in
    order (a string is one text block, as the API tokenizes it), without their cache_control;
    and the positions (prefix lengths) that end at a ``cache_control`` breakpoint. The definition
    RequestTexts.prompt's texts are checked against."""
    items: list[Any] = []
    marks: list[int] = []

    def add(item: Any, block: Any) -> None:
        items.append(strip_cache_control(item))
        if isinstance(block, dict) and block.get("cache_control"):
            marks.append(len(items))

    tools = body.get("tools")
    for tool in tools if isinstance(tools, list) else []:
        add({"tool": tool}, tool)
    system = body.get("system")
    if isinstance(system, str) and system:
        add({"system": {"type": "text", "text": system}}, None)
    elif isinstance(system, list):
        for block in system:
            add({"system": block}, block)
    for i, message in enumerate(body["messages"]):
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        for block in blocks if isinstance(blocks, list) else []:
            add({"message": i, "role": message.get("role"), "block": block}, block)
    return items, marks


def find_invalid_signature(secret: str, body: dict[str, Any]) -> str | None:
    return Signatures(secret, RequestTexts(body)).first_invalid()


def _value(rng: random.Random, depth: int = 0) -> Any:
    r = rng.random()
    if depth > 2 or r < 0.3:
        return rng.choice(["é✓\u2028", "x" * rng.randint(0, 30), 1, 2.5, None, True, "\ud800",
                           '"cache_control":{}'])
    if r < 0.6:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(["a", "cache_control", "z"]): _value(rng, depth + 1)
            for _ in range(rng.randint(0, 3))}


def test_the_prefix_keys_and_token_counts_are_the_definitions() -> None:
    rng = random.Random(1)
    for _ in range(200):
        items = [_value(rng) for _ in range(rng.randint(0, 40))]
        model = rng.choice(["claude", None, 3])
        keys = PromptCache._prefix_keys(model, [canonical_json(i) for i in items], len(items))
        assert keys == [PromptCache._key(model, items[:n]) for n in range(len(items) + 1)]


def test_the_cache_accounts_every_prefix_as_the_definition_would() -> None:
    # A history that grows by a turn at a time, its breakpoint moving: reads, writes and input
    # tokens are what keys and counts of whole prefixes give.
    cache, rng = PromptCache(), random.Random(3)
    messages: list[dict[str, Any]] = []
    for turn in range(12):
        messages.append({"role": "user" if turn % 2 == 0 else "assistant",
                         "content": [{"type": "text", "text": f"é\ud800 {rng.random()}" * turn}]})
        body = {"model": "claude", "system": "s", "messages": [dict(m) for m in messages]}
        body["messages"][-1] = {**messages[-1], "content": [
            {**messages[-1]["content"][0], "cache_control": {"type": "ephemeral"}}]}
        usage = cache.account(RequestTexts(body))
        total = sum(usage.values())
        items = [{"system": {"type": "text", "text": "s"}}] + [
            {"message": i, "role": m["role"], "block": m["content"][0]}
            for i, m in enumerate(messages)]
        assert total == estimate_tokens(items)
        read = usage["cache_read_input_tokens"]
        assert read == (estimate_tokens(items[:-1]) if turn else 0)


def _reference(secret: str, body: dict[str, Any]) -> str | None:
    messages = body["messages"]
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        for k, block in enumerate(message["content"]):
            if block.get("type") != "thinking":
                continue
            expected = sign_thinking(secret, model=body.get("model"), system=body.get("system"),
                                     tools=body.get("tools"), messages_before=messages[:i],
                                     thinking=block["thinking"])
            if expected != block["signature"]:
                return invalid_signature_message(i, k)
    return None


def test_the_signature_check_is_sign_thinking_block_by_block() -> None:
    rng, verdicts = random.Random(2), set()
    for _ in range(300):
        body: dict[str, Any] = {"model": _value(rng), "system": _value(rng),
                                "tools": _value(rng), "messages": []}
        if rng.random() < 0.2:
            body.pop(rng.choice(["model", "system", "tools"]))
        for i in range(rng.randint(0, 8)):
            if i % 2 == 0:
                body["messages"].append({"role": "user", "content": [_value(rng)],
                                         "cache_control": _value(rng)})
                continue
            content: list[dict[str, Any]] = []
            for _ in range(rng.randint(0, 3)):
                if rng.random() < 0.4:
                    content.append({"type": "text", "text": "x"})
                    continue
                thinking = rng.choice(["th", "é\ud800", ""])
                signature = sign_thinking(
                    "s", model=body.get("model"), system=body.get("system"),
                    tools=body.get("tools"), messages_before=list(body["messages"]),
                    thinking=thinking)
                if rng.random() < 0.1:
                    signature = signature[:-2] + "AA"  # tampered
                content.append({"type": "thinking", "thinking": thinking,
                                "signature": signature, "cache_control": {"type": "ephemeral"}})
            body["messages"].append({"role": "assistant", "content": content})
        verdict = find_invalid_signature("s", body)
        assert verdict == _reference("s", body)
        verdicts.add(verdict is None)
    assert verdicts == {True, False}  # both outcomes were met


def _body(rng: random.Random) -> dict[str, Any]:
    """A request with odd values everywhere the texts are built from: tools and system as lists
    or not, string and list contents, blocks that are not dicts, cache_control at any depth."""
    body: dict[str, Any] = {"model": _value(rng), "messages": []}
    for key in ("system", "tools"):
        r = rng.random()
        if r < 0.4:
            body[key] = [_value(rng) for _ in range(rng.randint(0, 3))]
        elif r < 0.6:
            body[key] = rng.choice(["s", "", "é\ud800"])
        elif r < 0.8:
            body[key] = _value(rng)
    for i in range(rng.randint(1, 6)):
        message: dict[str, Any] = {"role": rng.choice(["user", "assistant"])}
        r = rng.random()
        if r < 0.2:
            message["content"] = rng.choice(["go", "é\ud800\x00", ""])
        elif r < 0.3:
            message["content"] = _value(rng)
        else:
            message["content"] = [
                {"type": "text", "text": f"{i}", "cache_control": {"type": "ephemeral"}}
                if rng.random() < 0.3 else _value(rng) for _ in range(rng.randint(0, 3))]
        if rng.random() < 0.2:
            message[rng.choice(["cache_control", "name"])] = _value(rng)
        body["messages"].append(message)
    return body


def test_the_request_texts_are_the_definitions() -> None:
    rng = random.Random(4)
    for _ in range(500):
        body = _body(rng)
        texts = RequestTexts(body)
        for i, message in enumerate(body["messages"]):
            assert texts.message(i) == canonical_json(strip_cache_control(message))
        for key in ("model", "system", "tools"):
            assert texts.top(key) == canonical_json(strip_cache_control(body.get(key)))
        items, marks = prompt_blocks(body)
        parts, my_marks = texts.prompt()
        assert parts == [canonical_json(item) for item in items]
        assert my_marks == marks
        counts = prefix_tokens(parts)
        assert counts == [estimate_tokens(items[:n]) for n in range(len(items) + 1)]


def _history(turns: int) -> tuple[Any, dict[str, Any]]:
    """A scenario with thinking blocks and the request of its last turn, as a worker sends it
    (prompt caching's breakpoints on the last tool and the last two messages)."""
    scenario = parse_scenario({"name": "h", "scripts": [{"name": "h", "turns": [
        {"content": [{"thinking": f"t{i}"}, {"text": f"s{i}"},
                     {"tool_use": {"name": "echo", "input": {"text": f"é{i}"}}}]}
        for i in range(turns)]}]})
    tools = [{"name": f"tool{k}", "description": "d" * 200,
              "input_schema": {"type": "object", "properties": {"text": {"type": "string"}}}}
             for k in range(5)]
    tools[-1] = {**tools[-1], "cache_control": {"type": "ephemeral"}}
    body: dict[str, Any] = {"model": "m", "max_tokens": 10, "system": "sys", "tools": tools,
                            "messages": [{"role": "user", "content": "go"}]}
    script = scenario.scripts[0]
    for turn in range(turns - 1):
        answer = build_message(scenario, script, turn, Signatures(scenario.secret,
                                                                  RequestTexts(body)))
        calls = [b for b in answer["content"] if b["type"] == "tool_use"]
        body["messages"] += [
            {"role": "assistant", "content": answer["content"]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": c["id"],
                                          "content": "x" * 50} for c in calls]}]
    for message in body["messages"][-2:]:
        blocks = message["content"]
        if isinstance(blocks, list):
            message["content"] = [*blocks[:-1], {**blocks[-1],
                                                 "cache_control": {"type": "ephemeral"}}]
    return scenario, body


def test_the_answer_is_signed_over_the_whole_history_after_the_check() -> None:
    # One Signatures checks the history, then signs the answer: the answer's signature is
    # sign_thinking's over every message, and the next request carrying it verifies.
    scenario, body = _history(6)
    signatures = Signatures(scenario.secret, RequestTexts(body))
    assert signatures.first_invalid() is None
    answer = build_message(scenario, scenario.scripts[0], 5, signatures)
    thinking = answer["content"][0]
    assert thinking["signature"] == sign_thinking(
        scenario.secret, model="m", system="sys", tools=body["tools"],
        messages_before=body["messages"], thinking=thinking["thinking"])
    following = {**body, "messages": [*body["messages"],
                                      {"role": "assistant", "content": answer["content"]}]}
    assert find_invalid_signature(scenario.secret, following) is None


def test_a_request_is_encoded_about_once(monkeypatch: Any) -> None:
    # The signature check, the prompt cache's accounting and the answer's signatures read one
    # request: its canonical JSON is written about once for all three (each block once, plus the
    # copies of what has a cache_control), not once per reader and per prefix. Counted as the
    # characters json's C encoder writes.
    scenario, body = _history(30)
    whole = len(canonical_json(body))
    written = 0
    real = json.encoder.c_make_encoder

    def counting(*args: Any) -> Any:
        encode = real(*args)

        def call(value: Any, level: int) -> Any:
            nonlocal written
            chunks = encode(value, level)
            written += sum(map(len, chunks))
            return chunks

        return call

    # Both routes to the C encoder: json.dumps's, and the one agentrun.canonical makes.
    monkeypatch.setattr(json.encoder, "c_make_encoder", counting)
    monkeypatch.setattr(canonical, "c_make_encoder", counting)
    monkeypatch.setattr(canonical, "_ENCODE", canonical._encoder(allow_nan=True))
    written = 0
    signatures = Signatures(scenario.secret, RequestTexts(body))
    assert signatures.first_invalid() is None
    usage = PromptCache().account(signatures.texts)
    build_message(scenario, scenario.scripts[0], 29, signatures, usage)
    assert whole > 10_000
    assert written < 1.2 * whole, (written, whole)
