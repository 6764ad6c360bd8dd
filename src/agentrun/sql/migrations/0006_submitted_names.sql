-- agentrun schema, version 6: a run submitted from a manifest keeps its name.
--
-- `agentrun submit -f` creates runs from the same AgentRun YAML that `kubectl apply` takes, but
-- the manifest's metadata.name and namespace were dropped (the NAME column of `agentrun runs`
-- was always "-"): k8s_name and k8s_namespace could only be set together with k8s_uid. Now a run
-- may carry a name and namespace without a uid: the name it was submitted under. k8s_uid stays
-- what marks a run of an AgentRun object (the operator reads only runs with one, and its
-- external key "k8s:<uid>" is reserved for it), so a submitted run never passes for one. A uid
-- still needs both its name and namespace; a name still needs its namespace, and vice versa.
ALTER TABLE agent_run DROP CONSTRAINT agent_run_k8s_identity;
ALTER TABLE agent_run ADD CONSTRAINT agent_run_k8s_identity CHECK (
    (k8s_name IS NULL) = (k8s_namespace IS NULL)
    AND (k8s_uid IS NULL OR k8s_name IS NOT NULL));
