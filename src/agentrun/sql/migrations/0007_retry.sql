-- agentrun schema, version 7: retry and restart, recorded on the run.
--
-- A retry (agentrun retry, the agentrun.dev/retry annotation) makes a failed or dead-lettered run
-- pending again with a fresh poison-run budget; it continues from its step log. What it cleared
-- is kept here, so the run still says why it needed one: how many retries it had, the latest
-- one's reason, and the error that retry cleared. attempt (every claim, what users see) is not
-- reset: it counts the claims of the run's whole life.
-- restarted_from: the run a restart (agentrun restart) copied its spec from. No foreign key: the
-- original may be pruned while its copy lives.
ALTER TABLE agent_run
    ADD COLUMN retries        integer NOT NULL DEFAULT 0,
    ADD COLUMN retry_reason   text,
    ADD COLUMN retried_error  text,
    ADD COLUMN restarted_from uuid;

-- agentrun prune picks finished runs by when they ended, oldest first, in batches: without this
-- index every batch would scan the whole table. Partial, so live runs are not in it; its columns
-- do not change on an append, so appends stay HOT.
CREATE INDEX agent_run_finished_idx ON agent_run (finished_at, id)
    WHERE status IN ('succeeded', 'failed', 'cancelled', 'dead_letter');
