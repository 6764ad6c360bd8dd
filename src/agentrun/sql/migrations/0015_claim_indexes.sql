-- agentrun schema, version 15: the claim reads O(claimed), not O(held) (issue 17).
--
-- agent_run_claimable_idx held pending and running runs in one (pool, created_at) order, and the
-- claim filtered out the unexpired leases as it went: every run held longer than the oldest
-- pending one was visited on every claim (1.8 ms with 6,000 held runs, growing with them). The
-- claim now reads its two kinds of candidate from one index each (queries.sql claim_runs):
--
-- * pending runs, oldest first, from a pending-only index;
-- * running runs whose lease expired, from (pool, lease_until) over running runs: the expired
--   ones come first in it, so no live lease is visited. The same index gives the claim the
--   earliest foreign lease expiry (the idle worker sleeps until it), and, with lease_owner
--   included, serves lease_holders from the index alone.
--
-- pool_depth counts each status from its own index. The price: lease_until is now indexed, so a
-- renewal or an append of a running run (both push lease_until) is no longer a HOT update of
-- agent_run: it adds an entry to this index and to the table's other indexes that hold the row.
CREATE INDEX agent_run_pending_idx ON agent_run (pool, created_at, id)
    WHERE status = 'pending';

CREATE INDEX agent_run_lease_idx ON agent_run (pool, lease_until) INCLUDE (lease_owner)
    WHERE status = 'running';

DROP INDEX agent_run_claimable_idx;
