-- agentrun schema, version 8: a notification per appended step, only for runs someone follows.
--
-- A NOTIFY in every append serialises commits on PostgreSQL's notification queue (a global lock
-- taken at commit) and halved 16-writer append throughput (migration 0001), so appends notify
-- nothing by default. `agentrun logs -f RUN` wants each step as it commits, so it registers here
-- for the time it follows: a row per follower with a lease (`until`), refreshed well before it
-- runs out and deleted when the follower exits. The fenced append (queries.sql append_step)
-- sends pg_notify('agentrun_run_steps', run_id) only while an unexpired row exists for its run:
-- the commits of runs nobody follows never touch the notification queue. A follower that died
-- without deleting its row (SIGKILL) stops counting when its lease runs out; the next follower
-- to register deletes such rows.
--
-- No foreign key to agent_run: a row outlives nothing it needs (the run's end ends the follow),
-- and a key would make every prune of a run with a stale row fail or cascade.
CREATE TABLE run_follower (
    run_id    uuid NOT NULL,
    follower  text NOT NULL,                -- host:pid:random of the `agentrun logs -f` process
    until     timestamptz NOT NULL,         -- the lease: ignored (and deleted) after this
    PRIMARY KEY (run_id, follower)
);
