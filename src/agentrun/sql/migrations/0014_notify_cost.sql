-- agentrun schema, version 14: the run-changed notification carries the run's estimated cost
-- (migration 0011), so the operator's agentrun_run_cost_usd histogram observes every finished
-- run, as agentrun_run_steps does, without reading the run back.
CREATE FUNCTION agentrun_notify_run_v3() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('agentrun_run_changed', json_build_object(
        'id', NEW.id, 'pool', NEW.pool, 'status', NEW.status, 'step', NEW.next_seq,
        'attempt', NEW.attempt, 'epoch', NEW.lease_epoch,
        'rollback', NEW.rollback_reason IS NOT NULL, 'cost_usd', NEW.cost_usd)::text);
    IF NEW.status = 'pending' AND NEW.lease_owner IS NULL
       AND (TG_OP = 'INSERT' OR OLD.status IS DISTINCT FROM NEW.status
            OR OLD.lease_owner IS NOT NULL) THEN
        PERFORM pg_notify('agentrun_run_ready', NEW.pool);
    END IF;
    RETURN NULL;
END;
$$;

DROP TRIGGER agent_run_notify_insert ON agent_run;
DROP TRIGGER agent_run_notify_update ON agent_run;
DROP FUNCTION agentrun_notify_run_v2();
CREATE TRIGGER agent_run_notify_insert
    AFTER INSERT ON agent_run
    FOR EACH ROW EXECUTE FUNCTION agentrun_notify_run_v3();
CREATE TRIGGER agent_run_notify_update
    AFTER UPDATE ON agent_run
    FOR EACH ROW
    WHEN (OLD.status IS DISTINCT FROM NEW.status
          OR OLD.lease_epoch IS DISTINCT FROM NEW.lease_epoch
          OR OLD.lease_owner IS DISTINCT FROM NEW.lease_owner
          OR OLD.rollback_reason IS DISTINCT FROM NEW.rollback_reason)
    EXECUTE FUNCTION agentrun_notify_run_v3();
