"""Thinking-block signatures, as strict as the real API's.

The real API rejects a replayed thinking block whose signature does not match the conversation it
was produced in. That is the failure a durable runtime must never cause: it stores the history,
resumes elsewhere, and sends it back. To catch a runtime that changes anything it stores, the fake
binds each signature to the model, the system prompt, the tool definitions, every message before
the assistant message carrying the block, and the thinking text itself.

The binding is over *canonical* JSON (sorted keys, no whitespace), so reordered keys (Postgres
JSONB does that) still verify while any added, dropped or changed field or value does not: a
dropped ``"citations": null`` is a change, exactly as it is for the real API.

The secret comes from the scenario, not from the process, so a restarted server still accepts
signatures it handed out before the restart.
"""

from __future__ import annotations

import base64
import hashlib
import hmac

from agentrun.canonical import canonical_json
from agentrun.fake_anthropic.canon import RequestTexts


def invalid_signature_message(message_index: int, block_index: int) -> str:
    """The real API's wording, so clients that match on it behave the same against the fake."""
    where = f"messages.{message_index}.content.{block_index}"
    return f"{where}: Invalid `signature` in `thinking` block"


def _b(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


class Signatures:
    """The signatures of one request's thinking blocks: HMAC-SHA256 over the canonical JSON of
    the binding (keys sorted: messages_before, model, system, thinking_text, tools), base64 like
    the API's opaque ones, ``cache_control`` left out (an instruction to the cache, not
    conversation: a client moves its history breakpoint every turn). The binding is the
    messages' bare JSON, one by one, then a tail, so one HMAC takes each message once and is
    copied at each block (a history of n turns is hashed in O(n), not O(n^2)). ``expected`` is
    asked for prefixes that never shrink: the history's blocks in order, then the answer's,
    bound to every message. tests/test_fake_fast_paths.py holds the binding written whole, the
    definition these are checked against."""

    def __init__(self, secret: str, texts: RequestTexts) -> None:
        self.texts = texts
        self._mac = hmac.new(secret.encode(), b'{"messages_before":[', hashlib.sha256)
        self._hashed = 0  # messages[:_hashed] are in _mac
        self._rest: str | None = None  # the binding after messages_before up to thinking_text

    def expected(self, before: int, thinking: str) -> str:
        """The signature of a thinking block that follows ``messages[:before]``."""
        texts = self.texts
        if before < self._hashed:
            raise ValueError("a shorter prefix than one already hashed")
        for i in range(self._hashed, before):
            self._mac.update((b"," if i else b"") + _b(texts.message(i)))
        self._hashed = before
        if self._rest is None:
            self._rest = f'],"model":{texts.top("model")},"system":{texts.top("system")}'
        mine = self._mac.copy()
        mine.update(_b(f'{self._rest},"thinking_text":{canonical_json(thinking)},'
                       f'"tools":{texts.top("tools")}}}'))
        return base64.b64encode(mine.digest()).decode("ascii")

    def first_invalid(self) -> str | None:
        """The first thinking block of the history whose signature is not the one its place
        gives (the API's error message), or None when all verify."""
        for i, message in enumerate(self.texts.messages):
            if not isinstance(message, dict) or message.get("role") != "assistant":
                continue
            content = message.get("content")
            if not isinstance(content, list):
                continue
            for k, block in enumerate(content):
                if not isinstance(block, dict) or block.get("type") != "thinking":
                    continue
                signature = block.get("signature")
                thinking = block.get("thinking")
                if not isinstance(signature, str) or not isinstance(thinking, str):
                    return invalid_signature_message(i, k)
                if not hmac.compare_digest(self.expected(i, thinking), signature):
                    return invalid_signature_message(i, k)
        return None
