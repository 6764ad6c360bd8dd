-- agentrun schema, version 17: a run's step and claim limits have no default in the schema
-- (issue 18: one definition for each value).
--
-- DEFAULT 50 and DEFAULT 8 repeated agentrun.manifests.DEFAULT_MAX_STEPS and
-- DEFAULT_MAX_ATTEMPTS, so a change to one would have left the other behind for any insert that
-- left them out. Every insert of every version of agentrun names both (queries.sql insert_run,
-- restart_run), so dropping the defaults changes no stored row and no running version's insert;
-- an insert that leaves one out is now refused instead of getting a second copy of the value.
ALTER TABLE agent_run ALTER COLUMN max_steps DROP DEFAULT,
                      ALTER COLUMN max_attempts DROP DEFAULT;
