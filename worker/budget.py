"""A run's spending limits (``spec.budget``), checked before each model turn.

Before the turn, not after: a model turn is the one thing that spends, and stopping there leaves
the step log at a commit boundary (the last tool results are committed, no tool is cut off).
"Would pass" is judged by a floor: the next request re-sends the whole history, so it costs at
least what the previous turn read and wrote (its input, cache reads and writes, and its output,
which is now history). A run therefore stops at the turn whose floor passes the budget, and can
overrun it by at most one turn's new tokens (the latest tool results and the answer), which no
one can know before the call. The first turn has no floor: a run always gets one turn.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agentrun.manifests import BudgetSpec
from agentrun.pricing import PriceTable
from agentrun.store import Run, Step


@dataclass
class Spend:
    """What a run has spent, kept up to date turn by turn by the executor."""

    tokens: int
    cost_usd: float
    #: Tokens the next request re-sends at least: the previous turn's whole input and output.
    floor_tokens: int = 0

    @classmethod
    def of(cls, run: Run, steps: list[Step]) -> Spend:
        """From the run's committed totals (the claim's row) and its newest model turn."""
        floor = 0
        for step in reversed(steps):
            if step.kind == "model_turn":
                floor = turn_tokens(step.payload.get("usage") or {})
                break
        return cls(tokens=run.total_tokens, cost_usd=run.cost_usd, floor_tokens=floor)

    def add(self, tokens: int, cost_usd: float) -> None:
        self.tokens += tokens
        self.cost_usd += cost_usd
        self.floor_tokens = tokens


def turn_tokens(usage: Mapping[str, Any]) -> int:
    """A turn's tokens of every kind, from the provider's ``usage`` object."""
    return sum(
        int(usage.get(key) or 0)
        for key in (
            "input_tokens",
            "output_tokens",
            "cache_read_input_tokens",
            "cache_creation_input_tokens",
        )
    )


def over_budget(
    budget: BudgetSpec | None,
    spend: Spend,
    model: str,
    prices: PriceTable,
    caching: bool,
) -> tuple[str, str] | None:
    """(the limit, why) when the next model turn would pass the run's budget, else None.

    ``budget`` is the pinned agent spec's (``run.agent.budget``)."""
    if budget is None:
        return None
    max_tokens = budget.max_tokens
    if max_tokens is not None and spend.tokens + spend.floor_tokens > max_tokens:
        return "maxTokens", (
            f"budget: spec.budget.maxTokens {max_tokens} would be passed by the next model turn "
            f"(used {spend.tokens} tokens; the next request re-sends at least "
            f"{spend.floor_tokens}); stopped before it. Raise spec.budget.maxTokens (on the "
            "AgentRun or its Agent) in a new AgentRun to go further"
        )
    max_cost = budget.max_cost_usd
    if max_cost is not None:
        # The cheapest a re-sent token can be: a cache read where the prompt is cached.
        rates = prices.prices_for(model)
        per_token = min(rates["input"], rates["cache_read"]) if caching else rates["input"]
        floor_cost = spend.floor_tokens * per_token / 1e6
        if spend.cost_usd + floor_cost > max_cost:
            return "maxCostUSD", (
                f"budget: spec.budget.maxCostUSD {max_cost:g} would be passed by the next model "
                f"turn (spent ${spend.cost_usd:.4f} estimated; the next request costs at least "
                f"${floor_cost:.4f}); stopped before it. Raise spec.budget.maxCostUSD (on the "
                "AgentRun or its Agent) in a new AgentRun to go further"
            )
    return None
