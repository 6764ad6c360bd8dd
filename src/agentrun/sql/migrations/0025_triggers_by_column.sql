-- agentrun schema, version 25: agent_run's row triggers name the columns they watch (issue 17).
--
-- Every update of a run evaluated the WHEN clause of each of its row triggers, whatever the
-- statement set, and agent_run_pinned's compared the run's task and whole agent spec, old against
-- new. A real spec (a system prompt and a dozen tool schemas, 11.6 KB here) and task are stored
-- out of line (TOAST), and comparing them reads and decompresses both copies: each append, each
-- group commit's row, each heartbeat, each tool call's mark read the run's whole spec twice to
-- find it unchanged. Measured (database CPU per append, the 0024 triggers against these,
-- interleaved in one process, 2026-12-08): 0.335 against 0.264 ms with an 11.6 KB spec and a 3.2
-- KB task (0.267 with every trigger off); with a 42-byte spec the WHEN clauses alone cost about
-- 0.03 ms of an append's 0.24-0.33.
--
-- A trigger made `UPDATE OF <columns>` is skipped, its WHEN not even evaluated, by a statement
-- whose SET list names none of them. Each WHEN below can only be true when one of its columns is
-- set: a column no statement sets keeps its old value, and no BEFORE trigger of agent_run sets
-- any column another one watches (handover sets released_by, released_at and handover; tool_loss
-- tool_call, error, attempt and stalled_attempts; rollback_end rollback_end; wait_attempt
-- pending_call; the pin function updated_at). So each fires for exactly the rows it fired for:
--   handover, tool_loss   a claim, the only statement that moves lease_epoch;
--   wait_attempt          a write of pending_call (every stored wait was completed by 0022);
--   rollback_end          a write of rollback_reason or rollback_end (a stored row has both or
--                         neither: the CHECK of 0016), or an insert, as before;
--   notify_update         a write of status, lease_epoch, lease_owner or rollback_reason.
-- agent_run_pinned had two jobs and is split in two: refusing a pinned column's change
-- (agent_run_pinned_columns, by column) and stamping updated_at for a statement that leaves it
-- alone (agent_run_pinned, whose WHEN is now that one timestamp comparison). Both call the same
-- function, which refuses a pinned column's change and stamps updated_at, as it always did.
-- tests/test_pin_trigger.py: the worker's statements read nothing of a run's stored spec.

DROP TRIGGER agent_run_handover ON agent_run;
CREATE TRIGGER agent_run_handover
    BEFORE UPDATE OF lease_epoch ON agent_run
    FOR EACH ROW
    WHEN (NEW.lease_epoch IS DISTINCT FROM OLD.lease_epoch)
    EXECUTE FUNCTION agentrun_handover_v1();

DROP TRIGGER agent_run_tool_loss ON agent_run;
CREATE TRIGGER agent_run_tool_loss
    BEFORE UPDATE OF lease_epoch ON agent_run
    FOR EACH ROW
    WHEN (OLD.lease_owner IS NOT NULL AND OLD.status = 'running'
          AND NEW.lease_epoch IS DISTINCT FROM OLD.lease_epoch)
    EXECUTE FUNCTION agentrun_tool_loss_v1();

DROP TRIGGER agent_run_wait_attempt ON agent_run;
CREATE TRIGGER agent_run_wait_attempt
    BEFORE UPDATE OF pending_call ON agent_run
    FOR EACH ROW
    WHEN (NEW.pending_call ->> 'stage' = 'outcome_unknown' AND NOT NEW.pending_call ? 'attempt')
    EXECUTE FUNCTION agentrun_wait_attempt_v1();

DROP TRIGGER agent_run_rollback_end ON agent_run;
CREATE TRIGGER agent_run_rollback_end
    BEFORE INSERT OR UPDATE OF rollback_reason, rollback_end ON agent_run
    FOR EACH ROW
    WHEN ((NEW.rollback_reason IS NULL) <> (NEW.rollback_end IS NULL))
    EXECUTE FUNCTION agentrun_rollback_end_v1();

DROP TRIGGER agent_run_notify_update ON agent_run;
CREATE TRIGGER agent_run_notify_update
    AFTER UPDATE OF status, lease_epoch, lease_owner, rollback_reason ON agent_run
    FOR EACH ROW
    WHEN (OLD.status IS DISTINCT FROM NEW.status
          OR OLD.lease_epoch IS DISTINCT FROM NEW.lease_epoch
          OR OLD.lease_owner IS DISTINCT FROM NEW.lease_owner
          OR OLD.rollback_reason IS DISTINCT FROM NEW.rollback_reason)
    EXECUTE FUNCTION agentrun_notify_run_v3();

DROP TRIGGER agent_run_pinned ON agent_run;
CREATE TRIGGER agent_run_pinned
    BEFORE UPDATE ON agent_run
    FOR EACH ROW
    WHEN (NEW.updated_at IS NOT DISTINCT FROM OLD.updated_at)
    EXECUTE FUNCTION agentrun_forbid_pin_change_v1();
CREATE TRIGGER agent_run_pinned_columns
    BEFORE UPDATE OF task, model, agent_spec, prompt_version, k8s_uid, external_key ON agent_run
    FOR EACH ROW
    WHEN (NEW.task IS DISTINCT FROM OLD.task
          OR NEW.model IS DISTINCT FROM OLD.model
          OR NEW.agent_spec IS DISTINCT FROM OLD.agent_spec
          OR (OLD.prompt_version IS NOT NULL
              AND NEW.prompt_version IS DISTINCT FROM OLD.prompt_version)
          OR NEW.k8s_uid IS DISTINCT FROM OLD.k8s_uid
          OR NEW.external_key IS DISTINCT FROM OLD.external_key)
    EXECUTE FUNCTION agentrun_forbid_pin_change_v1();
