"""Canonical JSON of a request, each part written once.

The scripted server reads every request three ways: it checks the thinking signatures of the
history (bound to the model, the system prompt, the tools and every message before the block),
signs the thinking blocks of its answer (bound to the whole history), and accounts the prompt
cache (a key per prefix of tools, system and message blocks). All three hash canonical JSON with
``cache_control`` left out. Written by each on its own, the history was stripped (a Python copy of
every block) and encoded three times per request, which grows with the conversation: 1.3 ms a
request at 30 turns, on the benchmarks' two cores beside the worker. :class:`RequestTexts` writes
each block once and builds the messages, lists and prompt items from the blocks' texts: the same
bytes as :func:`canonical_json` of the stripped value (tests/test_fake_fast_paths.py checks
them against the definitions written whole).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from agentrun.canonical import canonical_json

K = TypeVar("K")
V = TypeVar("V")

#: Only JSON that holds this key has anything to strip (a key is written as a JSON string
#: followed by ``:``; a string value that holds the words is written with its quotes escaped).
_CACHE_CONTROL = '"cache_control":'
#: The roles' JSON, written once (every message of every request has one).
_ROLES = {"user": '"user"', "assistant": '"assistant"'}


def strip_cache_control(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: strip_cache_control(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [strip_cache_control(v) for v in value]
    return value


def bare_json(value: Any) -> str:
    """``canonical_json(strip_cache_control(value))``, copying the value only when it holds a
    ``cache_control`` (most blocks of a history do not)."""
    text = canonical_json(value)
    return canonical_json(strip_cache_control(value)) if _CACHE_CONTROL in text else text


def _list_json(texts: list[str]) -> str:
    return "[" + ",".join(texts) + "]"


def _role_json(role: Any) -> str:
    return (_ROLES.get(role) if type(role) is str else None) or bare_json(role)


def _kept(cache: dict[K, V], key: K, make: Callable[[], V]) -> V:
    """``cache[key]``, made once."""
    value = cache.get(key)
    if value is None:
        value = cache[key] = make()
    return value


def _str_keys(value: dict[Any, Any]) -> bool:
    return all(isinstance(k, str) for k in value)


class RequestTexts:
    """One request's bare canonical JSON (``cache_control`` left out), shared by the signature
    check, the answer's signatures and the prompt cache. Built lazily, each part at most once."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body
        messages = body.get("messages")
        self.messages: list[Any] = messages if isinstance(messages, list) else []
        self._top: dict[str, str] = {}
        self._items: dict[str, list[str]] = {}
        self._blocks: dict[int, list[str]] = {}
        self._messages: dict[int, str] = {}

    def items(self, key: str) -> list[str]:
        """The bare JSON of each element of ``body[key]`` when it is a list (tools, system)."""
        def make() -> list[str]:
            value = self.body.get(key)
            return [bare_json(v) for v in value] if isinstance(value, list) else []
        return _kept(self._items, key, make)

    def top(self, key: str) -> str:
        """The bare JSON of ``body.get(key)`` (model, system, tools)."""
        def make() -> str:
            value = self.body.get(key)
            return _list_json(self.items(key)) if isinstance(value, list) else bare_json(value)
        return _kept(self._top, key, make)

    def blocks(self, i: int) -> list[str]:
        """The bare JSON of each block of message ``i`` whose content is a list."""
        def make() -> list[str]:
            message = self.messages[i]
            content = message.get("content") if isinstance(message, dict) else None
            return [bare_json(b) for b in content] if isinstance(content, list) else []
        return _kept(self._blocks, i, make)

    def message(self, i: int) -> str:
        """The bare JSON of message ``i``: its content list from its blocks' texts."""
        return _kept(self._messages, i, lambda: self._message(i))

    def _message(self, i: int) -> str:
        message = self.messages[i]
        if not isinstance(message, dict) or not isinstance(message.get("content"), list):
            return bare_json(message)
        if len(message) == 2 and type(message.get("role")) is str:  # as a client sends it
            return (f'{{"content":{_list_json(self.blocks(i))},'
                    f'"role":{_role_json(message["role"])}}}')
        if not _str_keys(message):
            return bare_json(message)
        return "{" + ",".join(
            f"{canonical_json(k)}:"
            + (_list_json(self.blocks(i)) if k == "content" else bare_json(message[k]))
            for k in sorted(message) if k != "cache_control") + "}"

    def prompt(self) -> tuple[list[str], list[int]]:
        """The prompt as the API's cache sees it: the bare JSON of each item (tools, then system,
        then every message block, a string content as one text block) and the positions (prefix
        lengths) that end at a breakpoint. tests/test_fake_fast_paths.py holds the definition,
        the items themselves."""
        parts: list[str] = []
        marks: list[int] = []

        def add(text: str, block: Any) -> None:
            parts.append(text)
            if isinstance(block, dict) and block.get("cache_control"):
                marks.append(len(parts))

        tools = self.body.get("tools")
        if isinstance(tools, list):
            for tool, text in zip(tools, self.items("tools"), strict=True):
                add('{"tool":' + text + "}", tool)
        system = self.body.get("system")
        if isinstance(system, str) and system:
            add('{"system":' + canonical_json({"type": "text", "text": system}) + "}", None)
        elif isinstance(system, list):
            for block, text in zip(system, self.items("system"), strict=True):
                add('{"system":' + text + "}", block)
        for i, message in enumerate(self.messages):
            content = message.get("content")
            role = _role_json(message.get("role"))
            if isinstance(content, str):
                add(f'{{"block":{canonical_json({"type": "text", "text": content})},'
                    f'"message":{i},"role":{role}}}', None)
            elif isinstance(content, list):
                for block, text in zip(content, self.blocks(i), strict=True):
                    add(f'{{"block":{text},"message":{i},"role":{role}}}', block)
        return parts, marks

    def prompt_tokens(self) -> int:
        """The whole prompt's token estimate, as if nothing were cached."""
        return prefix_tokens(self.prompt()[0])[-1]


def prefix_tokens(parts: list[str]) -> list[int]:
    """``estimate_tokens(items[:n])`` (four characters of canonical JSON a token) for every n,
    from the items' texts: their lengths, commas and the list's brackets, never the list written
    out. The empty prefix counts 1, as an empty list does."""
    counts, length = [1], 0
    for n, part in enumerate(parts, 1):
        length += len(part)
        counts.append(max(1, (length + n + 1) // 4))
    return counts
