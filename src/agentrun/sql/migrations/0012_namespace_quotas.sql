-- agentrun schema, version 12: per-namespace quotas on running runs, enforced at claim time.
--
-- A namespace with a row here may have at most max_running runs in status 'running' at once,
-- across every pool; its other runs stay pending (the operator shows why in their status) while
-- the other namespaces' runs are claimed past them. Namespaces without a row have no cap.
--
-- running is the namespace's count of running runs, kept exact in the same transactions that
-- change it: the claim (the only statement that makes a run 'running', queries.sql claim_runs)
-- adds what it grants, under the row's lock, and the trigger below takes one off whenever a run
-- leaves 'running' (finish, cancel, release, wait for approval, dead letter). Counting live runs
-- in the claim instead would race: two claims see the same snapshot and both take the last
-- slot. Store.set_quota creates a row with the count taken under a SHARE lock on agent_run, so no
-- transition is missed between the count and the row's first commit.
-- last_grant is scratch for the claim: the slots its latest admission granted (SET expressions
-- all read the old row, and RETURNING only sees the new one).
CREATE TABLE namespace_quota (
    namespace   text PRIMARY KEY,
    max_running integer NOT NULL CHECK (max_running >= 0),
    running     integer NOT NULL DEFAULT 0,
    last_grant  integer NOT NULL DEFAULT 0,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

CREATE FUNCTION agentrun_quota_release() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE namespace_quota SET running = running - 1 WHERE namespace = OLD.k8s_namespace;
    RETURN NULL;
END
$$;

-- A probe of a tiny table's primary key when the namespace has no quota.
CREATE TRIGGER agent_run_quota_release
    AFTER UPDATE OF status ON agent_run
    FOR EACH ROW
    WHEN (OLD.status = 'running' AND NEW.status <> 'running' AND OLD.k8s_namespace IS NOT NULL)
    EXECUTE FUNCTION agentrun_quota_release();

CREATE TRIGGER agent_run_quota_release_on_delete
    AFTER DELETE ON agent_run
    FOR EACH ROW
    WHEN (OLD.status = 'running' AND OLD.k8s_namespace IS NOT NULL)
    EXECUTE FUNCTION agentrun_quota_release();
