-- agentrun schema, version 2: side effects, approvals.
--
-- tool_effect records what a non-idempotent or irreversible tool call did, keyed by its position in
-- the run (run, seq of the turn that asked for it, index of the call within that turn). A resumed
-- run reuses a recorded result instead of calling the tool again. For an irreversible call an
-- 'intent' row is committed BEFORE the call: a resume that finds an intent without an outcome
-- does not guess; the run waits for a human.
--
-- Each effect is recorded, fenced, as soon as its call returns, not only with the turn's
-- tool_result step: a turn may carry several calls, and a crash during the second must not repeat
-- the first.

ALTER TABLE agent_run
    ADD COLUMN wait_reason     text,   -- why a run is waiting_approval, for humans and kubectl
    ADD COLUMN pending_call    jsonb,  -- {"seq","call_index","tool","input","stage"} it waits on
    ADD COLUMN rollback_reason text;   -- set once a run aborts: resumes roll back, never go on

-- Compensations are steps too (durable, ordered, each with its own idempotency key).
ALTER TABLE agent_step DROP CONSTRAINT agent_step_kind_check;
ALTER TABLE agent_step ADD CONSTRAINT agent_step_kind_check
    CHECK (kind IN ('model_turn', 'tool_result', 'user', 'note', 'compensation'));

CREATE TABLE tool_effect (
    run_id          uuid NOT NULL REFERENCES agent_run (id),
    seq             integer NOT NULL,
    call_index      integer NOT NULL,
    idempotency_key text NOT NULL UNIQUE,
    tool            text NOT NULL,
    tool_kind       text NOT NULL
                    CHECK (tool_kind IN ('idempotent', 'non_idempotent', 'irreversible')),
    input           jsonb NOT NULL,       -- the call's arguments (a compensation gets the same)
    compensate      text,                 -- the tool that undoes it (saga), if it declares one
    state           text NOT NULL CHECK (state IN ('intent', 'done')),
    result          jsonb,               -- {"content": ..., "is_error": ...} once done
    lease_epoch     bigint NOT NULL,
    worker          text NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    completed_at    timestamptz,
    PRIMARY KEY (run_id, seq, call_index),
    CONSTRAINT tool_effect_result_when_done CHECK ((state = 'done') = (result IS NOT NULL))
);

-- A human decision on one call, durable (who, when, why). stage says what was decided:
-- 'before_call' (an agent that requires approval before irreversible calls) or 'outcome_unknown'
-- (a worker died between an irreversible call's intent and its outcome). An approval given before
-- the call never authorises re-running it after a crash: that needs its own decision.
CREATE TABLE approval (
    run_id      uuid NOT NULL REFERENCES agent_run (id),
    seq         integer NOT NULL,
    call_index  integer NOT NULL,
    stage       text NOT NULL CHECK (stage IN ('before_call', 'outcome_unknown')),
    decision    text NOT NULL CHECK (decision IN ('approved', 'rejected')),
    decided_by  text NOT NULL,
    reason      text,
    decided_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, seq, call_index, stage)
);

-- Notifications now also say when a rollback was requested (agentrun cancel --rollback, agentrun
-- reject --abort), so the worker holding the run rolls back at its next commit boundary.
CREATE FUNCTION agentrun_notify_run_v2() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('agentrun_run_changed', json_build_object(
        'id', NEW.id, 'pool', NEW.pool, 'status', NEW.status, 'step', NEW.next_seq,
        'attempt', NEW.attempt, 'epoch', NEW.lease_epoch,
        'rollback', NEW.rollback_reason IS NOT NULL)::text);
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
DROP FUNCTION agentrun_notify_run_v1();
CREATE TRIGGER agent_run_notify_insert
    AFTER INSERT ON agent_run
    FOR EACH ROW EXECUTE FUNCTION agentrun_notify_run_v2();
CREATE TRIGGER agent_run_notify_update
    AFTER UPDATE ON agent_run
    FOR EACH ROW
    WHEN (OLD.status IS DISTINCT FROM NEW.status
          OR OLD.lease_epoch IS DISTINCT FROM NEW.lease_epoch
          OR OLD.lease_owner IS DISTINCT FROM NEW.lease_owner
          OR OLD.rollback_reason IS DISTINCT FROM NEW.rollback_reason)
    EXECUTE FUNCTION agentrun_notify_run_v2();
