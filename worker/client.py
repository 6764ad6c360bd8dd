"""The Anthropic client the worker uses: the SDK's, able to send every string the store holds.

The SDK encodes a request body as UTF-8 JSON with the characters written out (``ensure_ascii``
off), so a string holding a lone surrogate (U+D800-U+DFFF: a tool that decoded a file name with
``surrogateescape``, or a model's own text) cannot be encoded, and the call fails before it is
sent, on every attempt. JSON can carry such a code point as a ``\\udxxx`` escape; this client
writes it so, and changes nothing else: a body without a lone surrogate is the SDK's own bytes.
"""

from __future__ import annotations

import re
from typing import Any

import anthropic
from anthropic._models import FinalRequestOptions
from anthropic._utils._json import openapi_dumps_str

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def escape_surrogates(json_text: str) -> bytes:
    """UTF-8 JSON bytes of ``json_text`` with each lone surrogate as a ``\\u`` escape (in JSON
    text written with ``ensure_ascii`` off a surrogate can only stand inside a string)."""
    return _LONE_SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", json_text).encode()


class AsyncAnthropic(anthropic.AsyncAnthropic):
    def _build_request(self, options: FinalRequestOptions, *, retries_taken: int = 0) -> Any:
        try:
            return super()._build_request(options, retries_taken=retries_taken)
        except UnicodeEncodeError:
            if options.json_data is None or options.extra_json is not None:
                raise
            body = escape_surrogates(openapi_dumps_str(options.json_data))
            escaped = options.model_copy(update={"json_data": None, "content": body})
            return super()._build_request(escaped, retries_taken=retries_taken)
