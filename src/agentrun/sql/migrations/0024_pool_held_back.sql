-- agentrun schema, version 24: the pending runs a claim passes over for their namespace's quota.
--
-- The operator scaled a pool by all of its pending runs, so 40 runs queued behind a namespace
-- quota of 1 asked for 10 pods that could claim nothing, for as long as the backlog lasted. A
-- namespace's free slots (max_running - running) let through its oldest pending runs, in the
-- claim's own order (created_at, id; queries.sql claim_runs); the rest of them are held back.
-- Counted by pool, for pool_depth and operator_probe (queries.sql), which take them off the
-- pool's demand. Only the pending runs of namespaces with a quota are ranked.
CREATE VIEW pool_held_back AS
SELECT pool, count(*) AS held_back
  FROM (SELECT r.pool, greatest(q.max_running - q.running, 0) AS free,
               row_number() OVER (PARTITION BY r.k8s_namespace ORDER BY r.created_at, r.id) AS rank
          FROM agent_run r JOIN namespace_quota q ON q.namespace = r.k8s_namespace
         WHERE r.status = 'pending') ranked
 WHERE rank > free
 GROUP BY pool;
