-- agentrun schema, version 11: the run's estimated cost in US dollars, summed by the fenced append
-- of each model turn in the same statement as its tokens (migrations 3 and 10). The worker prices
-- the turn with its price table (agentrun.pricing) when it commits it, so a run's cost is what
-- the prices were when each turn ran, and the operator, the CLI and a budget read one figure
-- instead of each pricing the tokens again with a table of its own. Not indexed (HOT updates).
ALTER TABLE agent_run ADD COLUMN cost_usd double precision NOT NULL DEFAULT 0;
