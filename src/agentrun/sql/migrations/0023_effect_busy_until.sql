-- agentrun schema, version 23: an effect of unknown outcome keeps how long its call may still run.
--
-- A compensable call whose worker was lost inside it is recorded as an intent by the next claim
-- (worker/executor.py _record_lost_call). Its worker may still be inside the call (a sync tool
-- that never checks the fence) until its lease's end plus the call's timeout, and a rollback
-- must not undo the call before then: the compensation would find nothing, and the call then
-- complete with its effect in place. The bound was read from the run's mark, which the next call
-- replaces; it is kept with the effect now. Null: no such bound (an intent its own worker wrote).
ALTER TABLE tool_effect ADD COLUMN busy_until timestamptz;
