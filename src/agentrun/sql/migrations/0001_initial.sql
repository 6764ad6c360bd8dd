-- agentrun schema, version 1.
--
-- The run store is the only source of truth for progress. Its guarantees are enforced here, by
-- PostgreSQL, not by the Python that talks to it:
--   * agent_step is append-only: UPDATE, DELETE and TRUNCATE raise (a retention job may prune whole
--     finished runs by setting agentrun.allow_prune = 'on' in its own transaction);
--   * PRIMARY KEY (run_id, seq) makes a double-write of a step impossible;
--   * prompt_version is write-once and content-addressed;
--   * the pinned parts of a run (task, model, agent spec, kubernetes identity) never change, and its
--     prompt version (the tool definitions resolved by the first worker to claim it) is set once;
--   * status is a closed set (text + CHECK, not an ENUM, so values can be added or dropped later).

CREATE TABLE prompt_version (
    id          text PRIMARY KEY,              -- sha256 hex of the canonical JSON of the fields below
    model       text NOT NULL,
    system      text NOT NULL,                 -- verbatim
    tools       json NOT NULL,                 -- json, not jsonb: the definitions' text kept verbatim
    params      json NOT NULL,                 -- max_tokens, thinking: they shape every request too
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE agent_run (
    id             uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    external_key   text UNIQUE,                -- idempotent creation: "k8s:<uid>" or a client's key
    k8s_namespace  text,
    k8s_name       text,
    k8s_uid        text UNIQUE,
    pool           text NOT NULL DEFAULT 'default',
    status         text NOT NULL DEFAULT 'pending'
                   CONSTRAINT agent_run_status_check CHECK (status IN (
                       'pending', 'running', 'waiting_approval',
                       'succeeded', 'failed', 'cancelled', 'dead_letter')),
    task           text NOT NULL,
    model          text NOT NULL,
    agent_spec     jsonb NOT NULL,             -- model, system, tool names, params: pinned at create
    prompt_version text REFERENCES prompt_version (id),  -- pinned at first claim, then never again
    max_steps      integer NOT NULL DEFAULT 50 CHECK (max_steps > 0),
    max_attempts   integer NOT NULL DEFAULT 8 CHECK (max_attempts > 0),
    lease_owner    text,
    lease_until    timestamptz,
    lease_epoch    bigint NOT NULL DEFAULT 0,  -- fencing token: +1 on every claim
    attempt        integer NOT NULL DEFAULT 0, -- claims that did not end in a graceful release
    next_seq       integer NOT NULL DEFAULT 0, -- seq of the next step; also "step" in kubectl get
    result         text,
    error          text,
    created_at     timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now(),
    started_at     timestamptz,
    finished_at    timestamptz,
    CONSTRAINT agent_run_k8s_identity CHECK (
        (k8s_uid IS NULL) = (k8s_name IS NULL) AND (k8s_uid IS NULL) = (k8s_namespace IS NULL))
);

-- The claim query and the per-pool depth query only ever look at live runs. A partial index keeps
-- both cheap however many finished runs the table holds.
CREATE INDEX agent_run_claimable_idx ON agent_run (pool, created_at, id)
    WHERE status IN ('pending', 'running');

CREATE TABLE agent_step (
    run_id      uuid NOT NULL REFERENCES agent_run (id),
    seq         integer NOT NULL CHECK (seq >= 0),
    kind        text NOT NULL CHECK (kind IN ('model_turn', 'tool_result', 'user', 'note')),
    payload     jsonb NOT NULL,                -- the provider's content blocks, verbatim
    request_id  text,                          -- provider request id, for support tickets
    lease_epoch bigint NOT NULL,               -- which claim wrote it
    worker      text NOT NULL,                 -- which worker wrote it
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (run_id, seq)
);

CREATE FUNCTION agentrun_forbid_step_change_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' AND current_setting('agentrun.allow_prune', true) = 'on' THEN
        RETURN OLD;
    END IF;
    RAISE EXCEPTION 'agent_step is append-only: % is not allowed', TG_OP
        USING ERRCODE = 'restrict_violation';
END;
$$;

CREATE TRIGGER agent_step_append_only
    BEFORE UPDATE OR DELETE ON agent_step
    FOR EACH ROW EXECUTE FUNCTION agentrun_forbid_step_change_v1();
CREATE TRIGGER agent_step_no_truncate
    BEFORE TRUNCATE ON agent_step
    FOR EACH STATEMENT EXECUTE FUNCTION agentrun_forbid_step_change_v1();

CREATE FUNCTION agentrun_forbid_prompt_change_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'prompt_version is write-once: % is not allowed', TG_OP
        USING ERRCODE = 'restrict_violation';
END;
$$;

CREATE TRIGGER prompt_version_write_once
    BEFORE UPDATE OR DELETE ON prompt_version
    FOR EACH ROW EXECUTE FUNCTION agentrun_forbid_prompt_change_v1();

-- Invariant 3: what pins a run never changes after creation.
CREATE FUNCTION agentrun_forbid_pin_change_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.task IS DISTINCT FROM OLD.task
       OR NEW.model IS DISTINCT FROM OLD.model
       OR NEW.agent_spec IS DISTINCT FROM OLD.agent_spec
       OR (OLD.prompt_version IS NOT NULL AND NEW.prompt_version IS DISTINCT FROM OLD.prompt_version)
       OR NEW.k8s_uid IS DISTINCT FROM OLD.k8s_uid
       OR NEW.external_key IS DISTINCT FROM OLD.external_key THEN
        RAISE EXCEPTION 'agent_run %: task, model, agent spec, prompt version and identity are pinned', OLD.id
            USING ERRCODE = 'restrict_violation';
    END IF;
    NEW.updated_at := now();
    RETURN NEW;
END;
$$;

CREATE TRIGGER agent_run_pinned
    BEFORE UPDATE ON agent_run
    FOR EACH ROW EXECUTE FUNCTION agentrun_forbid_pin_change_v1();

-- Change notifications (documented in docs/store.md):
--   agentrun_run_changed  payload {"id","pool","status","step","attempt","epoch"}: a run's status,
--                         claim or holder changed. The operator mirrors it into .status;
--                         workers watch it for cancellations of runs they hold.
--                         NOT sent for each appended step: a NOTIFY in every append serialises
--                         commits on the notification queue and halved 16-writer append throughput
--                         (850 vs 1,460-1,940 steps/s here). Step counts reach observers through
--                         a periodic resync of live runs (updated_at is bumped by every append).
--   agentrun_run_ready    payload: the pool name. A run of that pool became claimable (created,
--                         released, approved). Workers wake up to claim; the operator scales up.
CREATE FUNCTION agentrun_notify_run_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('agentrun_run_changed', json_build_object(
        'id', NEW.id, 'pool', NEW.pool, 'status', NEW.status, 'step', NEW.next_seq,
        'attempt', NEW.attempt, 'epoch', NEW.lease_epoch)::text);
    IF NEW.status = 'pending' AND NEW.lease_owner IS NULL
       AND (TG_OP = 'INSERT' OR OLD.status IS DISTINCT FROM NEW.status
            OR OLD.lease_owner IS NOT NULL) THEN
        PERFORM pg_notify('agentrun_run_ready', NEW.pool);
    END IF;
    RETURN NULL;
END;
$$;

CREATE TRIGGER agent_run_notify_insert
    AFTER INSERT ON agent_run
    FOR EACH ROW EXECUTE FUNCTION agentrun_notify_run_v1();
CREATE TRIGGER agent_run_notify_update
    AFTER UPDATE ON agent_run
    FOR EACH ROW
    WHEN (OLD.status IS DISTINCT FROM NEW.status
          OR OLD.lease_epoch IS DISTINCT FROM NEW.lease_epoch
          OR OLD.lease_owner IS DISTINCT FROM NEW.lease_owner)
    EXECUTE FUNCTION agentrun_notify_run_v1();
