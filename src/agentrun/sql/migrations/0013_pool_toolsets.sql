-- agentrun schema, version 13: the tool names each pool's workers serve, so the operator can
-- check an Agent's tools when its AgentRun is applied (it never loads tool code itself).
--
-- One row per distinct tool set a pool's workers started with (an image, a --tools list): every
-- worker upserts its own at start. A rollout shows two sets side by side; the operator reads the
-- sets started within an hour of the pool's newest (queries.sql served_tools), so a set no
-- worker has started with for longer than that is taken as gone. A handful of rows per pool.
CREATE TABLE pool_toolset (
    pool       text NOT NULL,
    tools_hash text NOT NULL,
    tools      text[] NOT NULL,
    worker     text NOT NULL,   -- the latest worker to start with it
    started_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (pool, tools_hash)
);
