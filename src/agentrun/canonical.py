"""Canonical JSON: keys sorted, no whitespace, text as it is (not \\u-escaped).

What the store writes, the key an effect is recorded under, the body a worker sends and what the
scripted server signs and hashes are all this one encoding. It is written for many small values
(a block of a message, a tool's arguments), where ``json.dumps`` with options of its own costs
more in its Python layers (a new ``JSONEncoder`` each call, then ``encode`` and ``iterencode``)
than the C encoder spends on the value: about 6 us against 1.5-2.5 us for a thinking block on
these machines. So the C encoder ``json.dumps`` would make is made once per setting and called
directly, with a fresh circular-reference table each call, as ``json.dumps`` does. The output is
byte for byte ``json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)``:
checked here at import, and on random values by tests/test_canonical.py; where the C encoder is
missing or differs, ``json.dumps`` itself is used.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from json.encoder import c_make_encoder, encode_basestring  # type: ignore[attr-defined]
from typing import Any

_DEFAULT = json.JSONEncoder().default  # the TypeError json.dumps raises for what it cannot write


def _dumps(allow_nan: bool) -> Callable[[Any], str]:
    def dumps(value: Any) -> str:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                          allow_nan=allow_nan)

    return dumps


def _direct(allow_nan: bool) -> Callable[[Any], str]:
    make: Any = c_make_encoder

    def dumps(value: Any) -> str:
        # markers, default, encoder, indent, key and item separators, sort_keys, skipkeys,
        # allow_nan: what JSONEncoder.iterencode passes for these options.
        return "".join(make({}, _DEFAULT, encode_basestring, None, ":", ",", True, False,
                            allow_nan)(value, 0))

    return dumps


_SAMPLE = {"b": [1, 2.5, None, True, "é\u2028\ud800"], "a": {"z": "", "y": -0.0}}


def _encoder(allow_nan: bool) -> Callable[[Any], str]:
    plain = _dumps(allow_nan)
    if c_make_encoder is None:
        return plain
    try:
        direct = _direct(allow_nan)
        if direct(_SAMPLE) == plain(_SAMPLE) and direct("x") == plain("x"):
            return direct
    except (TypeError, ValueError):  # another interpreter's encoder signature
        pass
    return plain


_ENCODE = _encoder(allow_nan=True)
_ENCODE_FINITE = _encoder(allow_nan=False)


def canonical_json(value: Any, *, allow_nan: bool = True) -> str:
    """``value`` as canonical JSON. ``allow_nan=False`` refuses a NaN or an infinity with the
    ValueError ``json.dumps`` raises (a request body must hold only what the API can parse)."""
    return _ENCODE(value) if allow_nan else _ENCODE_FINITE(value)
