-- agentrun schema, version 5: which tool a dead worker was running, and who is blamed for it.
--
-- A tool can take its whole worker down (os._exit, a segfault in a C extension, an OOM kill):
-- nothing in the process can record why. So the worker marks the call on the run BEFORE it
-- invokes the tool (a fenced write, which also checks the lease right before the call):
--   tool_call = {"worker","epoch","tool","seq","call_index","step","timeout","started_at"}
-- The mark is live while the holder that wrote it still holds the run (same epoch) and the step
-- that records the call's result (its "step") is not committed yet.
--
-- When another worker takes over a run whose lease expired (a claim: the epoch moves on, the
-- owner changes), the trigger below decides whom to blame:
--   * the run's own mark is live: that call was running when its worker died. The run is blamed
--     (its attempt counts, as every claim's does) with an error naming the tool, so a dead letter
--     says "last error: worker W died or stopped responding while tool T (step S, call I) was
--     running", not "none";
--     the mark keeps the old lease's end for the approval message of an irreversible call
--     ("may still be running until ...").
--   * another run of the same dead worker has a live mark, or worker_loss says the worker died
--     inside a tool call: this run was only co-located. Its attempt does not count (a hand-over,
--     like a drain's release), so a run that keeps killing its workers cannot dead-letter the
--     healthy runs sharing them.
--   * neither: a plain worker death (SIGKILL, OOM during a model call, node loss), counted as
--     before: the poison-run guard stays.

ALTER TABLE agent_run ADD COLUMN tool_call jsonb;

-- Workers that died inside a tool call, recorded by the claim that found the live mark: the
-- runs of that worker claimed after its culprit (whose mark a new holder overwrites) are still
-- recognised as co-located. One row per dead worker; rows older than a day are dropped.
CREATE TABLE worker_loss (
    worker     text PRIMARY KEY,
    run_id     uuid NOT NULL,
    tool_call  jsonb NOT NULL,
    lost_at    timestamptz NOT NULL DEFAULT now()
);

CREATE FUNCTION agentrun_tool_loss_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    mark jsonb := OLD.tool_call;
    blame text;
BEGIN
    IF mark IS NOT NULL
       AND mark ->> 'worker' = OLD.lease_owner
       AND (mark ->> 'epoch')::bigint = OLD.lease_epoch
       AND OLD.next_seq <= (mark ->> 'step')::int THEN
        -- This run's call was running when its worker died: blame it.
        NEW.tool_call := mark || jsonb_build_object('lease_until', OLD.lease_until);
        blame := format('worker %s died or stopped responding while tool %s (step %s, call %s) '
                        'was running', OLD.lease_owner, mark ->> 'tool', mark ->> 'seq',
                        mark ->> 'call_index');
        IF NEW.status = 'running' THEN
            NEW.error := blame;
        ELSE  -- a dead letter keeps the claim's message, naming this death as the last error
            NEW.error := regexp_replace(NEW.error, 'last error: .*$', 'last error: ' || blame);
        END IF;
        DELETE FROM worker_loss WHERE lost_at < now() - interval '1 day';
        INSERT INTO worker_loss (worker, run_id, tool_call)
        VALUES (OLD.lease_owner, OLD.id, NEW.tool_call)
        ON CONFLICT (worker) DO NOTHING;
    ELSIF NEW.status = 'running' AND (
        EXISTS (SELECT 1 FROM worker_loss WHERE worker = OLD.lease_owner)
        OR EXISTS (SELECT 1 FROM agent_run o
                    WHERE o.id <> OLD.id AND o.status = 'running'
                      AND o.lease_owner = OLD.lease_owner
                      AND o.tool_call ->> 'worker' = OLD.lease_owner
                      AND (o.tool_call ->> 'epoch')::bigint = o.lease_epoch
                      AND o.next_seq <= (o.tool_call ->> 'step')::int)) THEN
        -- Co-located with a call that took the worker down: a hand-over, not an attempt, on
        -- both counters (the poison-run guard dead-letters on stalled_attempts, migration 4).
        NEW.attempt := greatest(NEW.attempt - 1, 0);
        NEW.stalled_attempts := greatest(NEW.stalled_attempts - 1, 0);
    END IF;
    RETURN NEW;
END;
$$;

-- Only a takeover: a claim of a run another worker held (the epoch moves on). A release, an
-- abandon, a wait for approval or a finish clears the owner without a new epoch.
CREATE TRIGGER agent_run_tool_loss
    BEFORE UPDATE ON agent_run
    FOR EACH ROW
    WHEN (OLD.lease_owner IS NOT NULL AND OLD.status = 'running'
          AND NEW.lease_epoch IS DISTINCT FROM OLD.lease_epoch)
    EXECUTE FUNCTION agentrun_tool_loss_v1();
