-- agentrun schema, version 16: a rollback's end is a column of its own (issue 18).
--
-- What a rollback ends as (cancelled for a cancel that asked for it, failed for every other) was
-- kept in the text of rollback_reason and read back by its prefix: a reason starting with
-- "cancelled" ended cancelled, so a failure's own text had to be marked ("failed: ...") not to
-- read as a cancel. It is now stored beside the reason, by the same statements and with the same
-- rule (the first request stays), and read from there; the reason is only words for a human.
ALTER TABLE agent_run ADD COLUMN rollback_end text
    CONSTRAINT agent_run_rollback_end_check CHECK (rollback_end IN ('cancelled', 'failed'));

-- Rows of earlier versions, read as those versions read them.
UPDATE agent_run
   SET rollback_end = CASE WHEN rollback_reason LIKE 'cancelled%' THEN 'cancelled' ELSE 'failed' END
 WHERE rollback_reason IS NOT NULL;

ALTER TABLE agent_run ADD CONSTRAINT agent_run_rollback_end_with_reason
    CHECK ((rollback_end IS NULL) = (rollback_reason IS NULL));
