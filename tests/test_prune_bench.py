"""The prune benchmark at a small size: its invariants (not its timings) hold. Live runs keep
appending through the real fenced append while Store.prune_batch deletes finished runs in
batches, on a real PostgreSQL."""

from __future__ import annotations

from benchmarks import prune_bench


async def test_a_prune_beside_live_appends_deletes_every_old_finished_run_and_no_live_step(
    database_url: str,
) -> None:
    r = await prune_bench.prune_bench(
        database_url, steps=20_000, per_run=100, live=4, batch=20, baseline=1.0,
        log=lambda *_: None,
    )
    assert r["problems"] == []
    # What the checks above are made of, spelled out.
    assert r["fill"]["finished_runs"] == 200 and r["fill"]["finished_steps"] == 20_000
    assert (r["prune"]["runs_deleted"], r["prune"]["steps_deleted"]) == (200, 20_000)
    assert r["prune"]["batches"] == 10  # 200 runs, 20 a batch
    assert "old" not in r["left"]  # every old finished run is gone, with its steps
    assert r["left"]["young"] == (prune_bench.YOUNG_FINISHED, prune_bench.YOUNG_FINISHED * 10)
    assert r["left"]["live"][0] == 4 and r["left"]["parked"] == (1, 5)
    # The live runs kept appending (the baseline second alone gives each many appends).
    assert r["left"]["live"][1] > 4 * prune_bench.LIVE_INITIAL_STEPS
    assert r["live_appends"]["baseline"]["n"] > 0
    assert r["locks"]["prune_locks_on_live_rows"] == []
