-- agentrun schema, version 19: writers of a release before 0016 keep working through a rollout.
--
-- 0016 stores a rollback's end beside its reason, and a CHECK keeps the two together. A writer of
-- an earlier release sets or clears the reason alone (cancel --rollback and reject --abort, the
-- worker's abort that every failure passes through, a retry): the CHECK refused each of those
-- statements, so while a rollout went on an old CLI or operator could not roll a run back and an
-- old worker could not fail one (its run waited for its lease, then was claimed again). A BEFORE
-- trigger now completes what such a writer leaves out, by the rule 0016's backfill used (the
-- rule those releases read the reason by). Its WHEN calls it only then: the statements of this
-- release always write both, and never call it.
CREATE FUNCTION agentrun_rollback_end_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.rollback_end := CASE
        WHEN NEW.rollback_reason IS NULL THEN NULL
        WHEN NEW.rollback_reason LIKE 'cancelled%' THEN 'cancelled'
        ELSE 'failed' END;
    RETURN NEW;
END
$$;

CREATE TRIGGER agent_run_rollback_end
    BEFORE INSERT OR UPDATE ON agent_run
    FOR EACH ROW
    WHEN ((NEW.rollback_reason IS NULL) <> (NEW.rollback_end IS NULL))
    EXECUTE FUNCTION agentrun_rollback_end_v1();
