"""agentrun.canonical writes what json.dumps writes with the canonical options, byte for byte, and
refuses what it refuses with the same error: on random values with every odd string the store can
hold, non-finite numbers, keys json.dumps converts, values it cannot write and a cycle. The store's
rows, the effect keys and the request bodies of runs written before it must not change."""

from __future__ import annotations

import json
import math
import random
from typing import Any

import pytest

from agentrun.canonical import canonical_json

pytestmark = pytest.mark.unit

_ODD = ["", "é✓\u2028", "\ud800", "\x00", "\uffff", "x" * 40, '"cache_control":', "\\", "\x7f"]
_NUMBERS = [0, -1, 2**70, 1.5, -0.0, 1e300, 5e-324, True, False, None]


def _value(rng: random.Random, depth: int = 0) -> Any:
    r = rng.random()
    if depth > 3 or r < 0.35:
        return rng.choice(_ODD + _NUMBERS)
    if r < 0.65:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    keys = [*_ODD, "a", "b", "z", "cache_control"]
    return {rng.choice(keys): _value(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def _plain(value: Any, allow_nan: bool = True) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=allow_nan)


def test_the_same_text_as_json_dumps_on_random_values() -> None:
    rng = random.Random(5)
    for _ in range(3000):
        value = _value(rng)
        assert canonical_json(value) == _plain(value)
        assert canonical_json(value, allow_nan=False) == _plain(value, allow_nan=False)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, [1, {"a": math.inf}]])
def test_non_finite_numbers_written_or_refused_as_json_dumps_does(value: Any) -> None:
    assert canonical_json(value) == _plain(value)
    with pytest.raises(ValueError) as mine:
        canonical_json(value, allow_nan=False)
    with pytest.raises(ValueError) as theirs:
        _plain(value, allow_nan=False)
    assert str(mine.value) == str(theirs.value)


@pytest.mark.parametrize("value", [
    {1: "a", 2.5: "b", -3: "c"},  # keys json.dumps writes as strings
    {None: "c"},
    {True: 1},
])
def test_keys_converted_as_json_dumps_converts_them(value: Any) -> None:
    assert canonical_json(value) == _plain(value)


def _cycle() -> Any:
    value: list[Any] = [1]
    value.append({"back": value})
    return value


@pytest.mark.parametrize(("value", "error"), [
    ({"a": {1, 2}}, TypeError),  # not JSON
    ({1: "a", "b": 2}, TypeError),  # keys that cannot be sorted together
    (_cycle(), ValueError),  # a circular reference
])
def test_refused_with_json_dumps_error(value: Any, error: type[Exception]) -> None:
    with pytest.raises(error) as mine:
        canonical_json(value)
    with pytest.raises(error) as theirs:
        _plain(value)
    assert str(mine.value) == str(theirs.value)
    # A refusal leaves nothing behind that a later call would trip on (the cycle table is the
    # call's own).
    assert canonical_json([{"a": 1}]) == '[{"a":1}]'
