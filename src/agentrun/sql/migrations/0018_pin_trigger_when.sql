-- agentrun schema, version 18: the pin trigger runs only when its function has something to do
-- (issue 17).
--
-- agent_run_pinned ran a plpgsql function on every update of a run, for two jobs: refuse a
-- change of a pinned column, and stamp updated_at (which the operator's fingerprint hashes). The
-- statements a worker sends most (each append, the group commit's rows, each heartbeat row, each
-- tool call's mark, each claim) now stamp updated_at themselves, so for them the function has
-- nothing to do unless a pinned column changes; the WHEN clause says that in C, without calling
-- plpgsql. Measured: an append sent alone costs the database 1.02-1.05x less CPU; in a group
-- commit's batch no difference shows (docs/benchmarks.md, 2026-12-06). Small, and nothing is
-- traded for it. Every other
-- statement leaves updated_at as it was, so the function runs for it as before; a statement
-- that stamps updated_at in the same transaction as an earlier one (the same now()) runs it too,
-- harmlessly. Pinned columns are refused as before, whatever stamps updated_at. Old and new
-- workers both get what they expect during a rolling upgrade: an old statement never sets
-- updated_at, so the function runs for it.
DROP TRIGGER agent_run_pinned ON agent_run;
CREATE TRIGGER agent_run_pinned
    BEFORE UPDATE ON agent_run
    FOR EACH ROW
    WHEN (NEW.updated_at IS NOT DISTINCT FROM OLD.updated_at
          OR NEW.task IS DISTINCT FROM OLD.task
          OR NEW.model IS DISTINCT FROM OLD.model
          OR NEW.agent_spec IS DISTINCT FROM OLD.agent_spec
          OR (OLD.prompt_version IS NOT NULL
              AND NEW.prompt_version IS DISTINCT FROM OLD.prompt_version)
          OR NEW.k8s_uid IS DISTINCT FROM OLD.k8s_uid
          OR NEW.external_key IS DISTINCT FROM OLD.external_key)
    EXECUTE FUNCTION agentrun_forbid_pin_change_v1();
