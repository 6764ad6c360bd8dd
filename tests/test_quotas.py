"""Per-namespace quotas on running runs (migration 0012), enforced by the claim on a real
PostgreSQL: a namespace at its cap has its pending runs passed over while the other namespaces'
runs are claimed, the count stays exact through every way a run leaves 'running', and eight
concurrent claimers over 100 pending runs from three namespaces never take a slot twice.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections import Counter

import psycopg

from agentrun.migrations import migrate
from agentrun.operator.scaling import PoolScaling, Scaler
from agentrun.store import Lease, ManifestName, Run, Store
from tests.workerkit import AGENT


async def create(store: Store, namespace: str, n: int, max_attempts: int = 8) -> list[Run]:
    runs = []
    for _ in range(n):
        run, _ = await store.create_run(
            f"task {namespace}", AGENT, name=ManifestName(namespace, f"r{uuid.uuid4().hex[:8]}"),
            max_attempts=max_attempts,
        )
        runs.append(run)
    return runs


async def until_lapsed(url: str, run: Run) -> None:
    """Until the run's lease has run out, as the database's clock sees it."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        while True:
            cur = await conn.execute(
                "SELECT lease_until < now() FROM agent_run WHERE id = %s", (run.id,)
            )
            row = await cur.fetchone()
            if row is not None and row[0]:
                return
            await asyncio.sleep(0.005)


async def running_by_namespace(url: str) -> Counter[str]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT k8s_namespace, count(*) FROM agent_run WHERE status = 'running' GROUP BY 1"
        )
        return Counter({ns: n for ns, n in await cur.fetchall()})


async def counters(store: Store) -> dict[str, int]:
    return {q.namespace: q.running for q in await store.quotas()}


async def test_a_namespace_at_its_quota_is_passed_over_and_the_others_are_claimed(
    store: Store, database_url: str
) -> None:
    await store.set_quota("noisy", 2)
    await create(store, "noisy", 6)  # older: they come first in the queue
    quiet = await create(store, "quiet", 3)
    got = (await store.claim("default", "w1", limit=10)).claimed
    by_ns = Counter(r.k8s_namespace for r, _ in got)
    assert by_ns == {"noisy": 2, "quiet": 3}
    assert {r.id for r, _ in got} >= {r.id for r in quiet}
    assert await counters(store) == {"noisy": 2}
    # Full: another claim finds nothing of noisy, though four of its runs are the oldest pending.
    assert (await store.claim("default", "w2", limit=10)).claimed == []
    # One ends: one slot, one more run.
    lease = next(ls for r, ls in got if r.k8s_namespace == "noisy")
    await store.finish(lease, "succeeded", result="ok")
    assert await counters(store) == {"noisy": 1}
    again = (await store.claim("default", "w2", limit=10)).claimed
    assert [r.k8s_namespace for r, _ in again] == ["noisy"]
    assert await running_by_namespace(database_url) == {"noisy": 2, "quiet": 3}


async def test_runs_held_back_by_a_quota_are_no_demand_for_workers(store: Store) -> None:
    """Found by a review: 40 runs queued behind a quota of 1 asked the autoscaler for 10 pods,
    idle for as long as the backlog lasted. Held back, they are pending (the oldest-pending
    alert still sees them) but not live: no pod for them."""
    await store.set_quota("team-a", 1)
    await create(store, "team-a", 40)
    await create(store, "team-b", 2)  # no quota: both are demand
    assert len((await store.claim("default", "w1", 1)).claimed) == 1  # team-a's one slot
    depth = (await store.pool_depth())["default"]
    probed = (await store.operator_probe()).depths["default"]
    assert depth == probed
    # Live: team-a's running run and team-b's two.
    assert (depth.pending, depth.held_back, depth.running, depth.live) == (41, 39, 1, 3)
    scaler = Scaler(PoolScaling("default", "workers", runs_per_worker=1, max_replicas=20))
    assert scaler.demand(depth) == 3
    # A raised quota lets 4 more through.
    await store.set_quota("team-a", 5)
    assert (await store.pool_depth())["default"].live == 7


async def test_a_namespaces_free_slot_is_demand_in_each_of_its_pools(store: Store) -> None:
    """Found by a review of the test above's fix: ranked across pools, an older run of the
    namespace in a pool nobody serves held back its runs in a healthy pool (demand 0, a pool at
    minReplicas 0 never scaled up), though that pool's claim takes one at once."""
    await store.set_quota("team", 1)
    await store.create_run("t", AGENT, pool="gpu", name=ManifestName("team", "older"))
    for i in range(5):
        await store.create_run("t", AGENT, pool="cpu", name=ManifestName("team", f"r{i}"))
    depths = await store.pool_depth()
    assert depths == (await store.operator_probe()).depths
    assert {p: (d.pending, d.held_back, d.live) for p, d in depths.items()} == {
        "gpu": (1, 0, 1), "cpu": (5, 4, 1)}
    assert len((await store.claim("cpu", "w1", 4)).claimed) == 1  # as its demand said


async def test_the_count_follows_every_way_out_of_running(store: Store) -> None:
    await store.set_quota("ns", 10)
    await create(store, "ns", 5, max_attempts=1)
    held = dict((r.id, ls) for r, ls in (await store.claim("default", "w", limit=5)).claimed)
    assert await counters(store) == {"ns": 5}
    ids = list(held)
    await store.finish(held[ids[0]], "failed", error="x")  # finished
    await store.cancel(ids[1], "no")  # cancelled
    assert await store.release(held[ids[2]])  # handed back (drain): pending again
    await store.wait_for_approval(  # waiting for a human
        held[ids[3]], "needs a human", {"seq": 0, "call_index": 0, "tool": "t", "stage": "before"}
    )
    assert await counters(store) == {"ns": 1}
    # The released one is claimed again: counted again.
    (back,) = (await store.claim("default", "w", limit=5)).claimed
    assert back[0].id == ids[2]
    assert await counters(store) == {"ns": 2}


async def test_an_expired_run_is_taken_back_at_its_quota_and_a_dead_letter_frees_its_slot(
    store: Store, database_url: str
) -> None:
    await store.set_quota("ns", 1)
    (run,) = await create(store, "ns", 1, max_attempts=2)
    await store.with_lease_ttl(0.01).claim("default", "dead-worker", limit=1)
    await create(store, "ns", 1)
    await until_lapsed(database_url, run)
    # At its quota, yet the expired run is taken over (it was counted when it started); the
    # pending one waits.
    (taken,) = (await store.with_lease_ttl(0.01).claim("default", "w2", limit=5)).claimed
    assert taken[0].id == run.id and await counters(store) == {"ns": 1}
    await until_lapsed(database_url, run)
    # Claimed twice without a step (maxAttempts 2): dead-lettered by the next claim, which
    # frees the slot for the pending run in the same statement's aftermath.
    result = await store.claim("default", "w3", limit=5)
    assert [r.id for r in result.dead_lettered] == [run.id]
    assert await counters(store) == {"ns": 0}
    (later,) = (await store.claim("default", "w3", limit=5)).claimed
    assert later[0].id != run.id and await counters(store) == {"ns": 1}


async def test_a_new_quota_counts_the_runs_already_running_and_a_lifted_one_stops_counting(
    store: Store,
) -> None:
    await create(store, "ns", 4)
    await store.claim("default", "w", limit=3)
    q = await store.set_quota("ns", 2)
    assert (q.running, q.max_running) == (3, 2)  # over it: nothing more starts
    assert (await store.claim("default", "w", limit=5)).claimed == []
    assert (await store.set_quota("ns", 4)).running == 3  # a new limit keeps the exact count
    assert len((await store.claim("default", "w", limit=5)).claimed) == 1
    assert await store.delete_quota("ns") and await store.quotas() == []


async def test_eight_claimers_over_100_pending_runs_from_three_namespaces_never_pass_a_quota(
    database_url: str,
) -> None:
    quota = {"a": 3, "b": 5}
    store = await Store.open(database_url, max_size=12)
    try:
        for ns, cap in quota.items():
            await store.set_quota(ns, cap)
        names = ["a", "b", "c"]
        for i in range(100):  # interleaved, so every namespace has old runs
            await create(store, names[i % 3], 1)
        worst: Counter[str] = Counter()
        finished = 0
        rng = random.Random(7)

        async def check() -> None:
            now = await running_by_namespace(database_url)
            for ns, n in now.items():
                worst[ns] = max(worst[ns], n)
            for ns, cap in quota.items():
                assert now[ns] <= cap, (ns, now)

        async def claimer(k: int) -> None:
            nonlocal finished
            held: list[Lease] = []
            while finished < 100:
                got = (await store.claim("default", f"w{k}", limit=rng.randint(1, 6))).claimed
                held += [ls for _, ls in got]
                await check()
                # Finish some of what is held, at random, so slots open and close all the time.
                cut = rng.randint(0, len(held))
                done, held = held[:cut], held[cut:]
                for lease in done:
                    await store.finish(lease, "succeeded", result="ok")
                    finished += 1

        await asyncio.gather(*(claimer(k) for k in range(8)))
        await check()
        assert finished == 100
        assert worst["a"] == 3 and worst["b"] == 5  # the caps were reached, never passed
        assert await counters(store) == {"a": 0, "b": 0}  # exact after 100 ins and outs
    finally:
        await store.close()


async def test_a_run_an_older_release_claimed_never_takes_the_count_below_zero(
    store: Store, database_url: str
) -> None:
    """A worker of a release before 0012 claims without counting into the quota, and the
    trigger took the run off when it left 'running': the count went below zero for good, and
    later claims passed the quota by as many (found by an adversarial review on 2026-12-06)."""
    await store.set_quota("ns", 1)
    (old,) = await create(store, "ns", 1)
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        # The claim of that release, as far as the quota is concerned: no count.
        await conn.execute(
            "UPDATE agent_run SET status = 'running', lease_owner = 'old-worker', "
            "lease_until = now() + interval '1 minute', lease_epoch = lease_epoch + 1 "
            "WHERE id = %s", (old.id,))
    await store.finish(Lease(old.id, "old-worker", old.lease_epoch + 1), "succeeded",
                       result="ok")
    assert await counters(store) == {"ns": 0}
    await create(store, "ns", 3)
    assert len((await store.claim("default", "w", limit=10)).claimed) == 1  # the cap holds


async def test_migration_0021_recounts_a_count_older_releases_took_below_zero(
    store: Store, database_url: str
) -> None:
    """0020 floors releases at zero from then on, but a count already below zero stayed: a
    namespace paused at 0 whose count was -3 was handed 3 runs, then read 0 with 3 running
    (found by an adversarial review on 2026-12-06). 0021 recounts every row once."""
    await store.set_quota("paused", 0)
    await store.set_quota("busy", 2)
    (uncounted,) = await create(store, "busy", 1)
    await create(store, "paused", 5)
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        # What releases before 0012 and 0020 left: a count below zero, and a run a worker of
        # the old release claimed without counting it.
        await conn.execute("UPDATE namespace_quota SET running = -3 WHERE namespace = 'paused'")
        await conn.execute(
            "UPDATE agent_run SET status = 'running', lease_owner = 'old-worker', "
            "lease_until = now() + interval '1 minute', lease_epoch = lease_epoch + 1 "
            "WHERE id = %s", (uncounted.id,))
        # The database as it was at version 20, then the upgrade.
        await conn.execute("DELETE FROM agentrun_migration WHERE version = 21")
        assert (await migrate(conn)).applied == [21]
    assert await counters(store) == {"paused": 0, "busy": 1}
    assert (await store.claim("default", "w", limit=10)).claimed == []  # paused stays paused
    await create(store, "busy", 3)
    assert len((await store.claim("default", "w", limit=10)).claimed) == 1  # 1 of 2 was running
    assert await counters(store) == {"paused": 0, "busy": 2}


async def test_a_restarted_run_stays_in_its_namespace_and_under_its_quota(store: Store) -> None:
    """agentrun restart copied the run's spec but not its namespace: the new run escaped the
    quota of a paused namespace (found by a review on 2026-12-07)."""
    await store.set_quota("team-a", 0)  # the namespace is paused
    run, _ = await store.create_run("t", AGENT, name=ManifestName("team-a", "nightly"))
    assert (await store.claim("default", "w1", 5)).claimed == []
    new = await store.restart(run.id)
    assert (new.k8s_namespace, new.k8s_name, new.k8s_uid) == ("team-a", "nightly", None)
    assert new.restarted_from == run.id
    assert (await store.claim("default", "w1", 5)).claimed == []
    assert [r.id for r in await store.list_runs(namespace="team-a")] == [new.id, run.id]
