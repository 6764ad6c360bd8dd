"""The scaling decision, fed real per-pool depth from the store and a clock of the test's own."""

from __future__ import annotations

import pytest

from agentrun.manifests import AgentSpec
from agentrun.operator.scaling import PoolScaling, Scaler
from agentrun.store import Store

AGENT = AgentSpec(model="m", pool="gpu")


async def test_scales_from_zero_up_with_depth_capped_and_down_only_after_the_delay(
    store: Store,
) -> None:
    scaler = Scaler(
        PoolScaling(
            pool="gpu",
            deployment="workers-gpu",
            runs_per_worker=2,
            min_replicas=0,
            max_replicas=3,
            scale_down_delay=60,
        )
    )
    assert scaler.decide((await store.pool_depth()).get("gpu"), 0, now=0).replicas == 0

    first, _ = await store.create_run("t", AGENT)  # one pending run: from zero at once
    d = scaler.decide((await store.pool_depth())["gpu"], 0, now=1)
    assert d.replicas == 1 and d.reason.startswith("scale up")

    runs = [first.id] + [(await store.create_run("t", AGENT))[0].id for _ in range(4)]
    assert scaler.decide((await store.pool_depth())["gpu"], 1, now=2).replicas == 3  # 5/2 -> 3
    for _ in range(6):
        await store.create_run("t", AGENT)
    assert scaler.decide((await store.pool_depth())["gpu"], 3, now=3).replicas == 3  # capped

    for rid in [*runs, *[r.id for r in await store.list_runs(status="pending")]]:
        await store.cancel(rid)  # demand drops to zero
    depth = (await store.pool_depth()).get("gpu")
    assert scaler.decide(depth, 3, now=10).replicas == 3  # not yet: the delay holds
    assert scaler.decide(depth, 3, now=69).reason.startswith("hold")
    down = scaler.decide(depth, 3, now=71)
    assert down.replicas == 0 and down.reason.startswith("scale down")


async def test_a_new_run_during_the_delay_cancels_the_scale_down(store: Store) -> None:
    scaler = Scaler(
        PoolScaling(
            pool="gpu", deployment="w", runs_per_worker=1, max_replicas=5, scale_down_delay=30
        )
    )
    assert scaler.decide(None, 2, now=0).reason.startswith("hold")
    await store.create_run("t", AGENT)
    await store.create_run("t", AGENT)
    assert scaler.decide((await store.pool_depth())["gpu"], 2, now=20).reason == "steady"
    # The clock restarts: dropping again must wait the full delay.
    assert scaler.decide(None, 2, now=45).reason.startswith("hold")
    assert scaler.decide(None, 2, now=76).replicas == 0


async def test_down_to_the_highest_demand_of_the_last_delay_never_postponed_for_ever(
    store: Store,
) -> None:
    """As the HorizontalPodAutoscaler's stabilization window. Found by two reviews: with the
    clock counted from the first lower reading, runs that came within the delay lost their pods
    to the instant's demand once it was out; with a new run restarting the clock instead, a run
    every 200 s kept a burst's 10 pods for ever (300 s delay)."""
    def scaler() -> Scaler:
        return Scaler(PoolScaling(pool="gpu", deployment="w", runs_per_worker=4, max_replicas=10,
                                  scale_down_delay=300))

    trickle = scaler()
    assert trickle.decide(None, 10, now=0).reason == (
        "hold: 0 would do; demand seen for 0s of 300s")
    run, _ = await store.create_run("t", AGENT)
    one = (await store.pool_depth())["gpu"]
    for t in range(200, 36000, 200):  # a run every 200 s, done within 60 s
        arrived, ended = trickle.decide(one, 10, now=t), trickle.decide(None, 10, now=t + 60)
        if min(arrived.replicas, ended.replicas) < 10:
            break
    assert (t, arrived.replicas, ended.replicas) == (400, 1, 1)
    assert ended.reason == "scale down: 0 live runs need 0, at most 1 within the last 300s"

    # 8 runs (2 pods) come and go within the window: the pool keeps 2 until they are out of it.
    burst = scaler()
    assert burst.decide(None, 5, now=0).replicas == 5
    for _ in range(7):
        await store.create_run("t", AGENT)
    assert burst.decide((await store.pool_depth())["gpu"], 5, now=100).replicas == 5
    assert burst.decide(None, 5, now=150).replicas == 5
    down = burst.decide(None, 5, now=301)
    assert (down.replicas, down.reason) == (
        2, "scale down: 0 live runs need 0, at most 2 within the last 300s")
    assert burst.decide(None, 2, now=449).reason == (
        "hold: 0 would do; 2 were needed within the last 300s")
    assert burst.decide(None, 2, now=451).replicas == 0
    await store.cancel(run.id)


def test_bad_pool_settings_name_the_field() -> None:
    with pytest.raises(ValueError, match="runsPerWorker"):
        PoolScaling(pool="p", deployment="d", runs_per_worker=0)
    with pytest.raises(ValueError, match="minReplicas"):
        PoolScaling(pool="p", deployment="d", min_replicas=4, max_replicas=2)


async def test_spare_slots_add_headroom_while_there_are_live_runs(store: Store) -> None:
    # Issue 19: after a pod delete, runs beyond the survivors' free slots waited for the
    # replacement pod. spareSlots keeps that many free slots on running workers.
    settings = PoolScaling(pool="gpu", deployment="w", runs_per_worker=4, max_replicas=5,
                           spare_slots=4, scale_down_delay=30)
    scaler = Scaler(settings)
    # Idle: no headroom, the pool still scales to minReplicas (zero).
    assert scaler.demand((await store.pool_depth()).get("gpu")) == 0
    assert scaler.decide(None, 0, now=0).replicas == 0
    await store.create_run("t", AGENT)
    one = (await store.pool_depth())["gpu"]
    d = scaler.decide(one, 0, now=1)
    assert d.replicas == 2  # ceil((1 + 4) / 4): one pod's worth of free slots beside the run
    assert d.reason == "scale up: 1 live runs + 4 spare slots need 2"
    for _ in range(3):
        await store.create_run("t", AGENT)
    # held runs count too
    [(_, lease)] = (await store.with_lease_ttl(30).claim("gpu", "w1")).claimed
    four = (await store.pool_depth())["gpu"]
    assert (four.pending, four.running) == (3, 1)
    assert scaler.demand(four) == 2  # ceil((4 + 4) / 4)
    for _ in range(12):
        await store.create_run("t", AGENT)
    assert scaler.demand((await store.pool_depth())["gpu"]) == 5  # ceil(20 / 4), at maxReplicas
    # Without spare slots the same depth needs fewer pods: the headroom is the difference.
    plain = Scaler(PoolScaling(pool="gpu", deployment="w", runs_per_worker=4, max_replicas=5))
    assert plain.demand(one) == 1 and plain.demand(four) == 1
    assert lease.run_id


def test_spare_slots_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="spareSlots"):
        PoolScaling(pool="p", deployment="d", spare_slots=-1)
