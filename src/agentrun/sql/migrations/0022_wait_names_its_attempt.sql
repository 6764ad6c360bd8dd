-- agentrun schema, version 22: a wait for a decision on an unknown outcome always names its attempt.
--
-- A decision is about one attempt of a call (0004), and names the wait it answers (agentrun/
-- waits.py: <seq>.<call>.<attempt>). A worker of a release before the timeout's wait named its
-- attempt wrote {"stage": "outcome_unknown"} without one; the store decided it against the
-- attempt the call's intent counts, but the operator mirrored the wait as written, so
-- .status.pendingApproval.decide (and what AgentRunApprovals and `approve --kube` take from it)
-- named attempt 1, which the store refused. A BEFORE trigger now completes such a wait by the
-- store's rule (Store.waited_on: the intent's attempts, else 1), and the waits already written
-- are completed here. Its WHEN calls it only then: this release's workers always name it.
CREATE FUNCTION agentrun_wait_attempt_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.pending_call := NEW.pending_call || jsonb_build_object('attempt', coalesce((
        SELECT e.attempts FROM tool_effect e
         WHERE e.run_id = NEW.id AND e.seq = (NEW.pending_call ->> 'seq')::int
           AND e.call_index = (NEW.pending_call ->> 'call_index')::int
           AND e.state = 'intent'), 1));
    RETURN NEW;
END
$$;

CREATE TRIGGER agent_run_wait_attempt
    BEFORE UPDATE ON agent_run
    FOR EACH ROW
    WHEN (NEW.pending_call ->> 'stage' = 'outcome_unknown' AND NOT NEW.pending_call ? 'attempt')
    EXECUTE FUNCTION agentrun_wait_attempt_v1();

UPDATE agent_run SET pending_call = pending_call
 WHERE pending_call ->> 'stage' = 'outcome_unknown' AND NOT pending_call ? 'attempt';
