"""The prompt-caching benchmark at 6 turns: its invariants (not its figures) hold, with real
worker processes (one SIGKILLed) and the scripted server's cache accounting."""

from __future__ import annotations

import pytest
from benchmarks import cache_bench

from agentrun.pricing import RATIOS, cost_usd


async def test_caching_costs_less_and_a_resumed_run_reads_the_cache(database_url: str) -> None:
    r = await cache_bench.cache_bench(database_url, 6)
    cached, uncached, resumed = r["cached"], r["uncached"], r["resumed"]
    assert cached["requests"] == uncached["requests"] == 6
    assert resumed["requests"] == 7  # the turn the first worker died in is sent twice
    assert uncached["billed"]["cache_read"] == uncached["billed"]["cache_write"] == 0
    assert cached["billed"]["cache_read"] > 0 and resumed["billed"]["cache_read"] > 0
    # Every run sends the same prompts: caching moves tokens from input to cache read and write.
    total = {
        how: sum(r[how]["billed"][k] for k in ("input", "cache_read", "cache_write"))
        for how in ("cached", "uncached")
    }
    assert total["cached"] == total["uncached"]
    assert cached["cost_usd"] < uncached["cost_usd"]
    assert r["cached_over_uncached"] < 1 and r["resumed_over_uncached"] < 1
    # The re-done turn read what the dead worker's request wrote: it wrote nothing new, so the
    # resumed run writes no more than the uncrashed one.
    assert resumed["billed"]["cache_write"] == cached["billed"]["cache_write"]
    # The run's recorded totals are its committed turns: the billed ones without the lost turn.
    assert cached["recorded"] == cached["billed"]
    assert resumed["recorded"]["output"] <= resumed["billed"]["output"]
    assert cost_usd("claude-sonnet-4-5", {"cache_read": 10**6}) == pytest.approx(
        3.0 * RATIOS["cache_read"]
    )
