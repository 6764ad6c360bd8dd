-- The schema the migrations produce (src/agentrun/sql/migrations), for reading: generated
-- by `python -m benchmarks.dump_schema > src/agentrun/sql/schema.sql`
-- (pg_dump 15); tests/test_schema_sql.py keeps it in sync.

CREATE FUNCTION public.agentrun_forbid_pin_change_v1() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
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

CREATE FUNCTION public.agentrun_forbid_prompt_change_v1() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    RAISE EXCEPTION 'prompt_version is write-once: % is not allowed', TG_OP
        USING ERRCODE = 'restrict_violation';
END;
$$;

CREATE FUNCTION public.agentrun_forbid_step_change_v1() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    IF TG_OP = 'DELETE' AND current_setting('agentrun.allow_prune', true) = 'on' THEN
        RETURN OLD;
    END IF;
    RAISE EXCEPTION 'agent_step is append-only: % is not allowed', TG_OP
        USING ERRCODE = 'restrict_violation';
END;
$$;

CREATE FUNCTION public.agentrun_handover_v1() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
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

CREATE FUNCTION public.agentrun_notify_run_v3() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    PERFORM pg_notify('agentrun_run_changed', json_build_object(
        'id', NEW.id, 'pool', NEW.pool, 'status', NEW.status, 'step', NEW.next_seq,
        'attempt', NEW.attempt, 'epoch', NEW.lease_epoch,
        'rollback', NEW.rollback_reason IS NOT NULL, 'cost_usd', NEW.cost_usd)::text);
    IF NEW.status = 'pending' AND NEW.lease_owner IS NULL
       AND (TG_OP = 'INSERT' OR OLD.status IS DISTINCT FROM NEW.status
            OR OLD.lease_owner IS NOT NULL) THEN
        PERFORM pg_notify('agentrun_run_ready', NEW.pool);
    END IF;
    RETURN NULL;
END;
$$;

CREATE FUNCTION public.agentrun_quota_release() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    UPDATE namespace_quota SET running = greatest(running - 1, 0)
     WHERE namespace = OLD.k8s_namespace;
    RETURN NULL;
END
$$;

CREATE FUNCTION public.agentrun_rollback_end_v1() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    NEW.rollback_end := CASE
        WHEN NEW.rollback_reason IS NULL THEN NULL
        WHEN NEW.rollback_reason LIKE 'cancelled%' THEN 'cancelled'
        ELSE 'failed' END;
    RETURN NEW;
END
$$;

CREATE FUNCTION public.agentrun_tool_loss_v1() RETURNS trigger
    LANGUAGE plpgsql
    AS $_$
DECLARE
    mark jsonb := OLD.tool_call;
    blame text;
BEGIN
    IF mark IS NOT NULL
       AND mark ->> 'worker' = OLD.lease_owner
       AND (mark ->> 'epoch')::bigint = OLD.lease_epoch
       AND OLD.next_seq <= (mark ->> 'step')::int THEN
        -- This run's call was running when its worker died: blame it.
        NEW.tool_call := mark || jsonb_build_object('lease_until', OLD.lease_until);
        blame := format('worker %s died or stopped responding while tool %s (step %s, call %s) '
                        'was running', OLD.lease_owner, mark ->> 'tool', mark ->> 'seq',
                        mark ->> 'call_index');
        IF NEW.status = 'running' THEN
            NEW.error := blame;
        ELSE  -- a dead letter keeps the claim's message, naming this death as the last error
            NEW.error := regexp_replace(NEW.error, 'last error: .*$', 'last error: ' || blame);
        END IF;
        DELETE FROM worker_loss WHERE lost_at < now() - interval '1 day';
        INSERT INTO worker_loss (worker, run_id, tool_call)
        VALUES (OLD.lease_owner, OLD.id, NEW.tool_call)
        ON CONFLICT (worker) DO NOTHING;
    ELSIF NEW.status = 'running' AND (
        EXISTS (SELECT 1 FROM worker_loss WHERE worker = OLD.lease_owner)
        OR EXISTS (SELECT 1 FROM agent_run o
                    WHERE o.id <> OLD.id AND o.status = 'running'
                      AND o.lease_owner = OLD.lease_owner
                      AND o.tool_call ->> 'worker' = OLD.lease_owner
                      AND (o.tool_call ->> 'epoch')::bigint = o.lease_epoch
                      AND o.next_seq <= (o.tool_call ->> 'step')::int)) THEN
        -- Co-located with a call that took the worker down: a hand-over, not an attempt, on
        -- both counters (the poison-run guard dead-letters on stalled_attempts, migration 4).
        NEW.attempt := greatest(NEW.attempt - 1, 0);
        NEW.stalled_attempts := greatest(NEW.stalled_attempts - 1, 0);
    END IF;
    RETURN NEW;
END;
$_$;

CREATE FUNCTION public.agentrun_wait_attempt_v1() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    NEW.pending_call := NEW.pending_call || jsonb_build_object('attempt', coalesce((
        SELECT e.attempts FROM tool_effect e
         WHERE e.run_id = NEW.id AND e.seq = (NEW.pending_call ->> 'seq')::int
           AND e.call_index = (NEW.pending_call ->> 'call_index')::int
           AND e.state = 'intent'), 1));
    RETURN NEW;
END
$$;

CREATE TABLE public.agent_run (
    id uuid DEFAULT gen_random_uuid() NOT NULL,
    external_key text,
    k8s_namespace text,
    k8s_name text,
    k8s_uid text,
    pool text DEFAULT 'default'::text NOT NULL,
    status text DEFAULT 'pending'::text NOT NULL,
    task text NOT NULL,
    model text NOT NULL,
    agent_spec jsonb NOT NULL,
    prompt_version text,
    max_steps integer NOT NULL,
    max_attempts integer NOT NULL,
    lease_owner text,
    lease_until timestamp with time zone,
    lease_epoch bigint DEFAULT 0 NOT NULL,
    attempt integer DEFAULT 0 NOT NULL,
    next_seq integer DEFAULT 0 NOT NULL,
    result text,
    error text,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    started_at timestamp with time zone,
    finished_at timestamp with time zone,
    wait_reason text,
    pending_call jsonb,
    rollback_reason text,
    input_tokens bigint DEFAULT 0 NOT NULL,
    output_tokens bigint DEFAULT 0 NOT NULL,
    stalled_attempts integer DEFAULT 0 NOT NULL,
    claim_seq integer DEFAULT 0 NOT NULL,
    tool_call jsonb,
    retries integer DEFAULT 0 NOT NULL,
    retry_reason text,
    retried_error text,
    restarted_from uuid,
    released_by text,
    released_at timestamp with time zone,
    handover jsonb,
    cache_read_tokens bigint DEFAULT 0 NOT NULL,
    cache_write_tokens bigint DEFAULT 0 NOT NULL,
    cost_usd double precision DEFAULT 0 NOT NULL,
    rollback_end text,
    CONSTRAINT agent_run_k8s_identity CHECK ((((k8s_name IS NULL) = (k8s_namespace IS NULL)) AND ((k8s_uid IS NULL) OR (k8s_name IS NOT NULL)))),
    CONSTRAINT agent_run_max_attempts_check CHECK ((max_attempts > 0)),
    CONSTRAINT agent_run_max_steps_check CHECK ((max_steps > 0)),
    CONSTRAINT agent_run_rollback_end_check CHECK ((rollback_end = ANY (ARRAY['cancelled'::text, 'failed'::text]))),
    CONSTRAINT agent_run_rollback_end_with_reason CHECK (((rollback_end IS NULL) = (rollback_reason IS NULL))),
    CONSTRAINT agent_run_status_check CHECK ((status = ANY (ARRAY['pending'::text, 'running'::text, 'waiting_approval'::text, 'succeeded'::text, 'failed'::text, 'cancelled'::text, 'dead_letter'::text])))
);

CREATE TABLE public.agent_step (
    run_id uuid NOT NULL,
    seq integer NOT NULL,
    kind text NOT NULL,
    payload jsonb NOT NULL,
    request_id text,
    lease_epoch bigint NOT NULL,
    worker text NOT NULL,
    created_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    CONSTRAINT agent_step_kind_check CHECK ((kind = ANY (ARRAY['model_turn'::text, 'tool_result'::text, 'user'::text, 'note'::text, 'compensation'::text]))),
    CONSTRAINT agent_step_seq_check CHECK ((seq >= 0))
);

CREATE TABLE public.agentrun_migration (
    version integer NOT NULL,
    name text NOT NULL,
    applied_at timestamp with time zone DEFAULT now() NOT NULL
);

CREATE TABLE public.approval (
    run_id uuid NOT NULL,
    seq integer NOT NULL,
    call_index integer NOT NULL,
    stage text NOT NULL,
    decision text NOT NULL,
    decided_by text NOT NULL,
    reason text,
    decided_at timestamp with time zone DEFAULT now() NOT NULL,
    attempt integer DEFAULT 1 NOT NULL,
    CONSTRAINT approval_attempt_check CHECK ((attempt > 0)),
    CONSTRAINT approval_decision_check CHECK ((decision = ANY (ARRAY['approved'::text, 'rejected'::text]))),
    CONSTRAINT approval_stage_check CHECK ((stage = ANY (ARRAY['before_call'::text, 'outcome_unknown'::text])))
);

CREATE TABLE public.namespace_quota (
    namespace text NOT NULL,
    max_running integer NOT NULL,
    running integer DEFAULT 0 NOT NULL,
    last_grant integer DEFAULT 0 NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT namespace_quota_max_running_check CHECK ((max_running >= 0))
);

CREATE VIEW public.pool_held_back AS
 SELECT per_namespace.pool,
    (sum(per_namespace.held))::bigint AS held_back
   FROM ( SELECT r.pool,
            GREATEST((count(*) - GREATEST((max(q.max_running) - max(q.running)), 0)), (0)::bigint) AS held
           FROM (public.agent_run r
             JOIN public.namespace_quota q ON ((q.namespace = r.k8s_namespace)))
          WHERE (r.status = 'pending'::text)
          GROUP BY r.pool, r.k8s_namespace) per_namespace
  GROUP BY per_namespace.pool;

CREATE TABLE public.pool_toolset (
    pool text NOT NULL,
    tools_hash text NOT NULL,
    tools text[] NOT NULL,
    worker text NOT NULL,
    started_at timestamp with time zone DEFAULT now() NOT NULL
);

CREATE TABLE public.prompt_version (
    id text NOT NULL,
    model text NOT NULL,
    system text NOT NULL,
    tools json NOT NULL,
    params json NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL
);

CREATE TABLE public.run_follower (
    run_id uuid NOT NULL,
    follower text NOT NULL,
    until timestamp with time zone NOT NULL
);

CREATE TABLE public.run_handover (
    run_id uuid NOT NULL,
    epoch bigint NOT NULL,
    kind text NOT NULL,
    from_worker text NOT NULL,
    to_worker text,
    step integer NOT NULL,
    lost_at timestamp with time zone,
    claimed_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT run_handover_kind_check CHECK ((kind = ANY (ARRAY['handed_over'::text, 'lease_expired'::text])))
);

CREATE TABLE public.tool_effect (
    run_id uuid NOT NULL,
    seq integer NOT NULL,
    call_index integer NOT NULL,
    idempotency_key text NOT NULL,
    tool text NOT NULL,
    tool_kind text NOT NULL,
    input jsonb NOT NULL,
    compensate text,
    state text NOT NULL,
    result jsonb,
    lease_epoch bigint NOT NULL,
    worker text NOT NULL,
    created_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    completed_at timestamp with time zone,
    attempts integer DEFAULT 1 NOT NULL,
    busy_until timestamp with time zone,
    CONSTRAINT tool_effect_attempts_check CHECK ((attempts > 0)),
    CONSTRAINT tool_effect_result_when_done CHECK (((state = 'done'::text) = (result IS NOT NULL))),
    CONSTRAINT tool_effect_state_check CHECK ((state = ANY (ARRAY['intent'::text, 'done'::text]))),
    CONSTRAINT tool_effect_tool_kind_check CHECK ((tool_kind = ANY (ARRAY['idempotent'::text, 'non_idempotent'::text, 'irreversible'::text])))
);

CREATE TABLE public.worker_loss (
    worker text NOT NULL,
    run_id uuid NOT NULL,
    tool_call jsonb NOT NULL,
    lost_at timestamp with time zone DEFAULT now() NOT NULL
);

ALTER TABLE ONLY public.agent_run
    ADD CONSTRAINT agent_run_external_key_key UNIQUE (external_key);

ALTER TABLE ONLY public.agent_run
    ADD CONSTRAINT agent_run_k8s_uid_key UNIQUE (k8s_uid);

ALTER TABLE ONLY public.agent_run
    ADD CONSTRAINT agent_run_pkey PRIMARY KEY (id);

ALTER TABLE ONLY public.agent_step
    ADD CONSTRAINT agent_step_pkey PRIMARY KEY (run_id, seq);

ALTER TABLE ONLY public.agentrun_migration
    ADD CONSTRAINT agentrun_migration_pkey PRIMARY KEY (version);

ALTER TABLE ONLY public.approval
    ADD CONSTRAINT approval_pkey PRIMARY KEY (run_id, seq, call_index, stage, attempt);

ALTER TABLE ONLY public.namespace_quota
    ADD CONSTRAINT namespace_quota_pkey PRIMARY KEY (namespace);

ALTER TABLE ONLY public.pool_toolset
    ADD CONSTRAINT pool_toolset_pkey PRIMARY KEY (pool, tools_hash);

ALTER TABLE ONLY public.prompt_version
    ADD CONSTRAINT prompt_version_pkey PRIMARY KEY (id);

ALTER TABLE ONLY public.run_follower
    ADD CONSTRAINT run_follower_pkey PRIMARY KEY (run_id, follower);

ALTER TABLE ONLY public.run_handover
    ADD CONSTRAINT run_handover_pkey PRIMARY KEY (run_id, epoch);

ALTER TABLE ONLY public.tool_effect
    ADD CONSTRAINT tool_effect_idempotency_key_key UNIQUE (idempotency_key);

ALTER TABLE ONLY public.tool_effect
    ADD CONSTRAINT tool_effect_pkey PRIMARY KEY (run_id, seq, call_index);

ALTER TABLE ONLY public.worker_loss
    ADD CONSTRAINT worker_loss_pkey PRIMARY KEY (worker);

CREATE INDEX agent_run_finished_idx ON public.agent_run USING btree (finished_at, id) WHERE (status = ANY (ARRAY['succeeded'::text, 'failed'::text, 'cancelled'::text, 'dead_letter'::text]));

CREATE INDEX agent_run_k8s_live_idx ON public.agent_run USING btree (id) WHERE ((k8s_uid IS NOT NULL) AND (status = ANY (ARRAY['pending'::text, 'running'::text, 'waiting_approval'::text])));

CREATE INDEX agent_run_lease_idx ON public.agent_run USING btree (pool, lease_until) INCLUDE (lease_owner) WHERE (status = 'running'::text);

CREATE INDEX agent_run_pending_idx ON public.agent_run USING btree (pool, created_at, id) WHERE (status = 'pending'::text);

CREATE TRIGGER agent_run_handover BEFORE UPDATE OF lease_epoch ON public.agent_run FOR EACH ROW WHEN ((new.lease_epoch IS DISTINCT FROM old.lease_epoch)) EXECUTE FUNCTION public.agentrun_handover_v1();

CREATE TRIGGER agent_run_notify_insert AFTER INSERT ON public.agent_run FOR EACH ROW EXECUTE FUNCTION public.agentrun_notify_run_v3();

CREATE TRIGGER agent_run_notify_update AFTER UPDATE OF status, lease_epoch, lease_owner, rollback_reason ON public.agent_run FOR EACH ROW WHEN (((old.status IS DISTINCT FROM new.status) OR (old.lease_epoch IS DISTINCT FROM new.lease_epoch) OR (old.lease_owner IS DISTINCT FROM new.lease_owner) OR (old.rollback_reason IS DISTINCT FROM new.rollback_reason))) EXECUTE FUNCTION public.agentrun_notify_run_v3();

CREATE TRIGGER agent_run_pinned BEFORE UPDATE ON public.agent_run FOR EACH ROW WHEN ((NOT (new.updated_at IS DISTINCT FROM old.updated_at))) EXECUTE FUNCTION public.agentrun_forbid_pin_change_v1();

CREATE TRIGGER agent_run_pinned_columns BEFORE UPDATE OF task, model, agent_spec, prompt_version, k8s_uid, external_key ON public.agent_run FOR EACH ROW WHEN (((new.task IS DISTINCT FROM old.task) OR (new.model IS DISTINCT FROM old.model) OR (new.agent_spec IS DISTINCT FROM old.agent_spec) OR ((old.prompt_version IS NOT NULL) AND (new.prompt_version IS DISTINCT FROM old.prompt_version)) OR (new.k8s_uid IS DISTINCT FROM old.k8s_uid) OR (new.external_key IS DISTINCT FROM old.external_key))) EXECUTE FUNCTION public.agentrun_forbid_pin_change_v1();

CREATE TRIGGER agent_run_quota_release AFTER UPDATE OF status ON public.agent_run FOR EACH ROW WHEN (((old.status = 'running'::text) AND (new.status <> 'running'::text) AND (old.k8s_namespace IS NOT NULL))) EXECUTE FUNCTION public.agentrun_quota_release();

CREATE TRIGGER agent_run_quota_release_on_delete AFTER DELETE ON public.agent_run FOR EACH ROW WHEN (((old.status = 'running'::text) AND (old.k8s_namespace IS NOT NULL))) EXECUTE FUNCTION public.agentrun_quota_release();

CREATE TRIGGER agent_run_rollback_end BEFORE INSERT OR UPDATE OF rollback_reason, rollback_end ON public.agent_run FOR EACH ROW WHEN (((new.rollback_reason IS NULL) <> (new.rollback_end IS NULL))) EXECUTE FUNCTION public.agentrun_rollback_end_v1();

CREATE TRIGGER agent_run_tool_loss BEFORE UPDATE OF lease_epoch ON public.agent_run FOR EACH ROW WHEN (((old.lease_owner IS NOT NULL) AND (old.status = 'running'::text) AND (new.lease_epoch IS DISTINCT FROM old.lease_epoch))) EXECUTE FUNCTION public.agentrun_tool_loss_v1();

CREATE TRIGGER agent_run_wait_attempt BEFORE UPDATE OF pending_call ON public.agent_run FOR EACH ROW WHEN ((((new.pending_call ->> 'stage'::text) = 'outcome_unknown'::text) AND (NOT (new.pending_call ? 'attempt'::text)))) EXECUTE FUNCTION public.agentrun_wait_attempt_v1();

CREATE TRIGGER agent_step_append_only BEFORE DELETE OR UPDATE ON public.agent_step FOR EACH ROW EXECUTE FUNCTION public.agentrun_forbid_step_change_v1();

CREATE TRIGGER agent_step_no_truncate BEFORE TRUNCATE ON public.agent_step FOR EACH STATEMENT EXECUTE FUNCTION public.agentrun_forbid_step_change_v1();

CREATE TRIGGER prompt_version_write_once BEFORE DELETE OR UPDATE ON public.prompt_version FOR EACH ROW EXECUTE FUNCTION public.agentrun_forbid_prompt_change_v1();

ALTER TABLE ONLY public.agent_run
    ADD CONSTRAINT agent_run_prompt_version_fkey FOREIGN KEY (prompt_version) REFERENCES public.prompt_version(id);

ALTER TABLE ONLY public.agent_step
    ADD CONSTRAINT agent_step_run_id_fkey FOREIGN KEY (run_id) REFERENCES public.agent_run(id);

ALTER TABLE ONLY public.approval
    ADD CONSTRAINT approval_run_id_fkey FOREIGN KEY (run_id) REFERENCES public.agent_run(id);

ALTER TABLE ONLY public.run_handover
    ADD CONSTRAINT run_handover_run_id_fkey FOREIGN KEY (run_id) REFERENCES public.agent_run(id) ON DELETE CASCADE;

ALTER TABLE ONLY public.tool_effect
    ADD CONSTRAINT tool_effect_run_id_fkey FOREIGN KEY (run_id) REFERENCES public.agent_run(id);
