-- agentrun schema, version 24: the pending runs a claim passes over for their namespace's quota.
--
-- The operator scaled a pool by all of its pending runs, so 40 runs queued behind a namespace
-- quota of 1 asked for 10 pods that could claim nothing, for as long as the backlog lasted. A
-- claim is per pool and takes any of a namespace's free slots (max_running - running), so of a
-- namespace's pending runs in one pool, as many as it has free slots are claimable there and
-- the rest are held back; counted by pool, for pool_depth and operator_probe (queries.sql),
-- which take them off the pool's demand. Each pool is granted all the free slots: runs of one
-- namespace in two pools may ask for a pod each where one slot is left, never for none where a
-- claim in that pool would take one (ranked across pools, an older run in a pool nobody served
-- held back a healthy pool's runs, and a pool at minReplicas 0 never scaled up). A count, not a
-- ranking: no sort of the backlog at every operator tick.
CREATE VIEW pool_held_back AS
SELECT pool, sum(held)::bigint AS held_back
  FROM (SELECT r.pool,
               greatest(count(*) - greatest(max(q.max_running) - max(q.running), 0), 0) AS held
          FROM agent_run r JOIN namespace_quota q ON q.namespace = r.k8s_namespace
         WHERE r.status = 'pending'
         GROUP BY r.pool, r.k8s_namespace) per_namespace
 GROUP BY pool;
