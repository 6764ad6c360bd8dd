-- agentrun schema, version 8: every change of hands of a run, and why: a hand-over or a lease
-- that expired.
--
-- A graceful release (SIGTERM drain, preStop, rolling upgrade, eviction) and a lease that ran
-- out (SIGKILL, OOM kill, node loss) both end in a claim by another worker, and the run row
-- after that claim looked the same for both: the operator, which sees runs coalesced, reported
-- every hand-over as a worker that "stopped renewing its lease". So the release records who
-- gave the run back and when (released_by, released_at: cleared by the next claim), and the
-- claim that takes over a run from a holder records what happened:
--   handed_over    the holder released it (the attempt was given back);
--   lease_expired  the holder was still the owner, its lease ran out (the attempt counts,
--                  unless migration 5 found it co-located with a tool that killed its worker).
-- agent_run.handover is the latest of them (the operator's Event names its worker and step,
-- whenever the operator reads it, also after a restart); run_handover keeps them all, with
-- their times, for reports (the end-to-end tier's figures). Rows go with their run (prune).
ALTER TABLE agent_run
    ADD COLUMN released_by text,
    ADD COLUMN released_at timestamptz,
    ADD COLUMN handover    jsonb;

CREATE TABLE run_handover (
    run_id      uuid NOT NULL REFERENCES agent_run (id) ON DELETE CASCADE,
    epoch       bigint NOT NULL,        -- the claim that took the run over
    kind        text NOT NULL CHECK (kind IN ('handed_over', 'lease_expired')),
    from_worker text NOT NULL,
    to_worker   text,                   -- NULL: that claim dead-lettered the run
    step        integer NOT NULL,       -- next_seq at the claim: where the new holder resumes
    lost_at     timestamptz,            -- the release, or the end of the expired lease
    claimed_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, epoch)
);

CREATE FUNCTION agentrun_handover_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    kind text;
    holder text;
    lost timestamptz;
BEGIN
    IF OLD.status = 'running' AND OLD.lease_owner IS NOT NULL THEN
        -- A claim only takes a running run whose lease is over: its holder never gave it back.
        kind := 'lease_expired'; holder := OLD.lease_owner; lost := OLD.lease_until;
    ELSIF OLD.released_by IS NOT NULL THEN
        kind := 'handed_over'; holder := OLD.released_by; lost := OLD.released_at;
    END IF;
    NEW.released_by := NULL;
    NEW.released_at := NULL;
    IF kind IS NOT NULL THEN
        NEW.handover := jsonb_build_object(
            'kind', kind, 'from', holder, 'to', NEW.lease_owner, 'epoch', NEW.lease_epoch,
            'step', OLD.next_seq, 'lost_at', lost, 'claimed_at', now());
        INSERT INTO run_handover (run_id, epoch, kind, from_worker, to_worker, step, lost_at)
        VALUES (OLD.id, NEW.lease_epoch, kind, holder, NEW.lease_owner, OLD.next_seq, lost)
        ON CONFLICT DO NOTHING;
    END IF;
    RETURN NEW;
END;
$$;

-- Only a claim moves the epoch on.
CREATE TRIGGER agent_run_handover
    BEFORE UPDATE ON agent_run
    FOR EACH ROW
    WHEN (NEW.lease_epoch IS DISTINCT FROM OLD.lease_epoch)
    EXECUTE FUNCTION agentrun_handover_v1();
