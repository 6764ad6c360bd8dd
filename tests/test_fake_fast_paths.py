"""The scripted server's per-request work in one pass (its prompt cache's prefix keys and token
counts, the thinking signatures it checks) gives what the plain definitions give: the same keys,
counts and verdicts, on random histories with every odd value the store can hold (a lone
surrogate, U+2028, nested cache_control). The benchmarks' scripted server shares the worker's two
cores, so its cost per step is part of every steps/s figure; its answers must not change."""

from __future__ import annotations

import random
from typing import Any

from agentrun.fake_anthropic.server import PromptCache, estimate_tokens
from agentrun.fake_anthropic.signing import (
    canonical_json,
    find_invalid_signature,
    invalid_signature_message,
    sign_thinking,
)


def _value(rng: random.Random, depth: int = 0) -> Any:
    r = rng.random()
    if depth > 2 or r < 0.3:
        return rng.choice(["é✓\u2028", "x" * rng.randint(0, 30), 1, 2.5, None, True, "\ud800"])
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
        usage = cache.account(body)
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
