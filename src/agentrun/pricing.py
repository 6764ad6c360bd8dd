"""Token prices: the one table the cost estimates (a run's cost, ``spec.budget.maxCostUSD``, the
``agentrun_cost_usd_total`` metric) read.

The API bills four kinds of tokens: input, output, prompt-cache writes (``cache_creation``: 1.25x
the input price for the five-minute cache) and prompt-cache reads (0.1x the input price). The
built-in table holds Anthropic's public list prices, in US dollars per million tokens. A price
list changes and an organisation may have its own, so the worker takes a table of its own from a
file (``--prices`` / ``AGENTRUN_PRICES``; the chart's ``pricing`` value) in the same shape::

    {"models": {"claude-sonnet-4-5": {"input": 3, "output": 15, "cacheWrite": 3.75,
                                      "cacheRead": 0.3}},
     "default": "claude-sonnet-4-5"}

A model is priced by the longest table entry its id contains, so the dated, Bedrock and Vertex
ids of a model (``claude-sonnet-4-5-20250929``, ``anthropic.claude-sonnet-4-5-20250929-v1:0``,
``claude-sonnet-4-5@20250929``) share its entry; a model matching none is priced as ``default``.
The figures are estimates: the provider's invoice is the truth.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrun.errors import ConfigError

#: The token kinds, as the worker counts them, and as a price file spells them.
KINDS: Mapping[str, str] = {
    "input": "input",
    "output": "output",
    "cache_write": "cacheWrite",
    "cache_read": "cacheRead",
}

#: Price of each token kind as a multiple of the input price (Anthropic's published ratios).
RATIOS: Mapping[str, float] = {
    "input": 1.0,
    "output": 5.0,
    "cache_write": 1.25,
    "cache_read": 0.1,
}

#: USD per million input tokens, from the public price list.
INPUT_USD_PER_MTOK: Mapping[str, float] = {
    "claude-sonnet-4-5": 3.0,
    "claude-sonnet-4": 3.0,
    "claude-opus-4-5": 5.0,
    "claude-opus-4-1": 15.0,
    "claude-opus-4": 15.0,
    "claude-haiku-4-5": 1.0,
}
DEFAULT_MODEL = "claude-sonnet-4-5"


@dataclass(frozen=True)
class PriceTable:
    """USD per million tokens, by model and token kind."""

    models: Mapping[str, Mapping[str, float]]
    default: str

    def prices_for(self, model: str) -> Mapping[str, float]:
        matches = [key for key in self.models if key in model]
        return self.models[max(matches, key=len)] if matches else self.models[self.default]

    def known(self, model: str) -> bool:
        """Whether ``model`` has an entry of its own (else it is priced as the default)."""
        return any(key in model for key in self.models)

    def cost_usd(self, model: str, tokens: Mapping[str, int]) -> float:
        """Estimated cost of ``tokens`` (kind -> count, kinds as in :data:`KINDS`)."""
        unknown = set(tokens) - set(KINDS)
        if unknown:
            raise ValueError(f"token kind(s) {sorted(unknown)}: not one of {sorted(KINDS)}")
        prices = self.prices_for(model)
        return sum(prices[kind] * n for kind, n in tokens.items()) / 1e6


BUILT_IN = PriceTable(
    models={
        model: {kind: usd * ratio for kind, ratio in RATIOS.items()}
        for model, usd in INPUT_USD_PER_MTOK.items()
    },
    default=DEFAULT_MODEL,
)


def cost_usd(model: str, tokens: Mapping[str, int]) -> float:
    """Estimated cost of ``tokens`` at the built-in prices."""
    return BUILT_IN.cost_usd(model, tokens)


def parse_prices(data: Any, where: str) -> PriceTable:
    """A :class:`PriceTable` from a price file's parsed content; ``where`` names it in errors."""

    def bad(path: str, fix: str) -> ConfigError:
        return ConfigError(f"{where}: {path}: {fix}")

    if not isinstance(data, dict):
        raise bad("(top level)", 'must be an object {"models": {...}, "default": MODEL}')
    extra = set(data) - {"models", "default"}
    if extra:
        raise bad(", ".join(sorted(extra)), 'unknown key; the keys are "models" and "default"')
    models = data.get("models")
    if not isinstance(models, dict) or not models:
        raise bad("models", "must be a non-empty object of model -> prices")
    table: dict[str, dict[str, float]] = {}
    for model, prices in models.items():
        if not isinstance(prices, dict):
            raise bad(f"models.{model}", f"must be an object with {', '.join(KINDS.values())}")
        wanted = {spelled: kind for kind, spelled in KINDS.items()}
        unknown = set(prices) - set(wanted)
        if unknown:
            raise bad(f"models.{model}.{sorted(unknown)[0]}",
                      f"unknown token kind; the kinds are {', '.join(KINDS.values())}")
        missing = [spelled for spelled in wanted if spelled not in prices]
        if missing:
            raise bad(f"models.{model}.{missing[0]}", "missing (USD per million tokens)")
        row: dict[str, float] = {}
        for spelled, kind in wanted.items():
            value = prices[spelled]
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise bad(f"models.{model}.{spelled}",
                          f"{value!r} is not a price: a number of USD per million tokens, >= 0")
            row[kind] = float(value)
        table[str(model)] = row
    default = data.get("default", next(iter(table)))
    if default not in table:
        raise bad("default", f"{default!r} is not one of the models in the table")
    return PriceTable(models=table, default=str(default))


def load_prices(path: str | None) -> PriceTable:
    """The price table of a JSON file (``None`` or empty: the built-in one)."""
    if not path:
        return BUILT_IN
    where = f"--prices {path} (AGENTRUN_PRICES)"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read it ({exc.strerror}); fix the path") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{where}: not UTF-8 text (byte {exc.start}); see "
                          "docs/worker.md#prices") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{where}: not JSON (line {exc.lineno}: {exc.msg}); see docs/worker.md#prices"
        ) from None
    return parse_prices(data, where)
