-- What the operator mirrors into AgentRun .status, kept cheap at 10,000 runs.

-- Token usage, summed by the fenced append of each model turn (same statement, no extra round
-- trip). Not indexed, so an append stays a HOT update.
ALTER TABLE agent_run
    ADD COLUMN input_tokens  bigint NOT NULL DEFAULT 0,
    ADD COLUMN output_tokens bigint NOT NULL DEFAULT 0;

-- The operator's periodic resync reads the live runs that belong to AgentRun objects. Steps are
-- not notified (see 0001), so this read is how step counts reach .status; the partial index keeps
-- it proportional to the live runs, however many finished runs the table holds. Its columns and
-- predicate do not change on an append, so appends stay HOT.
CREATE INDEX agent_run_k8s_live_idx ON agent_run (id)
    WHERE k8s_uid IS NOT NULL AND status IN ('pending', 'running', 'waiting_approval');
