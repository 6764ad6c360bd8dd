-- agentrun schema, version 21: every namespace's running count recounted, once.
--
-- 0020 stopped the count from going below zero, but left a count that was below zero already
-- where it was: a namespace paused at max_running 0 whose count workers of a release before 0012
-- had taken to -3 was still handed 3 runs, and then read 0 with 3 runs running. Nothing else
-- repairs it (a limit changed on an existing row keeps its count), so the count is taken again
-- here, as a new quota row's is (queries.sql quota_count_running): the runs 'running' now, under
-- agent_run's SHARE lock, so no run enters or leaves 'running' between the count and the commit.
-- A run a pre-0012 worker claimed is counted too: its release will take it off.
LOCK TABLE agent_run IN SHARE MODE;

UPDATE namespace_quota q
   SET running = (SELECT count(*)::integer FROM agent_run r
                   WHERE r.k8s_namespace = q.namespace AND r.status = 'running'),
       updated_at = now();
