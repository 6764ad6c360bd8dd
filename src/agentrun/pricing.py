"""Token prices: the one table the cost estimates read.

The API bills four kinds of tokens: input, output, prompt-cache writes (``cache_creation``, 1.25x
the input price for the five-minute cache) and prompt-cache reads (0.1x the input price). The
ratios are Anthropic's published ones; the base prices are per million tokens, in US dollars,
from the public price list, and a model not in the table is priced as ``DEFAULT_MODEL``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

#: Price of each token kind as a multiple of the input price.
RATIOS: Mapping[str, float] = {
    "input": 1.0,
    "output": 5.0,
    "cache_write": 1.25,
    "cache_read": 0.1,
}

#: USD per million input tokens.
INPUT_USD_PER_MTOK: Mapping[str, float] = {
    "claude-sonnet-4-5": 3.0,
    "claude-opus-4-1": 15.0,
    "claude-haiku-4-5": 1.0,
}
DEFAULT_MODEL = "claude-sonnet-4-5"


#: What a model id carries besides its family, in each provider's form: an ARN's path, an
#: inference profile's geography and Bedrock's ``anthropic.`` (``us.anthropic.claude-...``),
#: and the version (``-20250929``, Bedrock's ``-v1:0``, Vertex's ``@20250929``).
_ID_NOISE = re.compile(
    r"^(?:.*/)?(?:(?:us|eu|apac|jp|au|global)\.)?(?:anthropic\.)?|@.*$|(?:-\d{8})?(?:-v\d+(?::\d+)?)?$"
)


def model_family(model: str) -> str:
    """The price table's key for a model id of any provider: ``claude-sonnet-4-5`` for
    ``claude-sonnet-4-5-20250929``, ``us.anthropic.claude-sonnet-4-5-20250929-v1:0`` (Bedrock)
    and ``claude-sonnet-4-5@20250929`` (Vertex) alike."""
    return _ID_NOISE.sub("", model)


def cost_usd(model: str, tokens: Mapping[str, int]) -> float:
    """Estimated cost of ``tokens`` (kind -> count, kinds as in :data:`RATIOS`)."""
    per_mtok = INPUT_USD_PER_MTOK.get(model) or INPUT_USD_PER_MTOK.get(model_family(model))
    base = (per_mtok or INPUT_USD_PER_MTOK[DEFAULT_MODEL]) / 1e6
    unknown = set(tokens) - set(RATIOS)
    if unknown:
        raise ValueError(f"token kind(s) {sorted(unknown)}: not one of {sorted(RATIOS)}")
    return sum(base * RATIOS[kind] * n for kind, n in tokens.items())
