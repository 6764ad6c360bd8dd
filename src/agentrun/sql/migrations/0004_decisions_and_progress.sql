-- agentrun schema, version 4: one decision buys one attempt; progress restores the attempt budget.

-- An irreversible call whose outcome is unknown may be re-run once per human decision, never
-- more: tool_effect counts the execution attempts started for the call (the first intent is
-- attempt 1; an approved re-run is counted, fenced, BEFORE the tool is called), and a decision
-- names the attempt it is about. 'before_call' attempt 1: may the first attempt start.
-- 'outcome_unknown' attempt n: attempt n's worker died mid-call; an approval authorises attempt
-- n + 1 and nothing after it (a crash during that one needs decision n + 1).
ALTER TABLE tool_effect
    ADD COLUMN attempts integer NOT NULL DEFAULT 1 CHECK (attempts > 0);

ALTER TABLE approval
    ADD COLUMN attempt integer NOT NULL DEFAULT 1 CHECK (attempt > 0);
ALTER TABLE approval DROP CONSTRAINT approval_pkey;
ALTER TABLE approval ADD PRIMARY KEY (run_id, seq, call_index, stage, attempt);

-- The poison-run guard counts claims in a row that committed no step, not worker deaths: a
-- healthy run that progresses between SIGKILLs must not be dead-lettered. claim_seq is next_seq
-- as the latest claim found it; the next claim compares: more steps since, and the count starts
-- over. attempt (every claim not ended gracefully, what users see) stays as it was.
ALTER TABLE agent_run
    ADD COLUMN stalled_attempts integer NOT NULL DEFAULT 0,
    ADD COLUMN claim_seq        integer NOT NULL DEFAULT 0;

-- Live runs keep the budget they have spent (as if nothing progressed since their last claim).
UPDATE agent_run SET stalled_attempts = attempt, claim_seq = next_seq
 WHERE status IN ('pending', 'running', 'waiting_approval');
