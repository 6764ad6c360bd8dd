-- agentrun schema, version 20: a namespace's running count never goes below zero.
--
-- A worker of a release before 0012 claims a run without counting it into its namespace's quota,
-- yet 0012's trigger takes it off when the run leaves 'running'. While such workers ran beside a
-- quota, the count went below zero and stayed there (an existing row keeps its count), and later
-- claims passed the quota by as many. Released at zero, the count is only low while those runs
-- last, and exact again once they ended.
CREATE OR REPLACE FUNCTION agentrun_quota_release() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE namespace_quota SET running = greatest(running - 1, 0)
     WHERE namespace = OLD.k8s_namespace;
    RETURN NULL;
END
$$;
