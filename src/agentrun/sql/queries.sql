-- Every query the store runs, by name. agentrun/sql/__init__.py splits this file on the
-- "-- name --" headers; Python code says queries["name"]. Parameters are psycopg named
-- placeholders: values are always sent separately from the SQL text.

-- insert_prompt_version --
-- Content-addressed and write-once: a second insert of the same id is a no-op.
INSERT INTO prompt_version (id, model, system, tools, params)
VALUES (%(id)s, %(model)s, %(system)s, %(tools)s, %(params)s)
ON CONFLICT (id) DO NOTHING;

-- get_prompt_version --
-- One pinned prompt version (model, system, tools, params) by its content address.
SELECT id, model, system, tools::text AS tools, params::text AS params
  FROM prompt_version WHERE id = %(id)s;

-- insert_run --
-- Idempotent on external_key: a replayed create (an operator handler that ran twice) returns
-- nothing here and the caller reads the existing row.
INSERT INTO agent_run (external_key, k8s_namespace, k8s_name, k8s_uid, pool, task, model,
                       agent_spec, max_steps, max_attempts)
VALUES (%(external_key)s, %(k8s_namespace)s, %(k8s_name)s, %(k8s_uid)s, %(pool)s, %(task)s,
        %(model)s, %(agent_spec)s, %(max_steps)s, %(max_attempts)s)
ON CONFLICT DO NOTHING
RETURNING *;

-- get_run_by_external_key --
-- The run an external key (an AgentRun's uid) created, for a replayed create.
SELECT * FROM agent_run WHERE external_key = %(external_key)s;

-- get_run --
-- One run by id.
SELECT * FROM agent_run WHERE id = %(id)s;

-- list_runs --
-- Runs newest first, optionally of one pool, status and namespace (`agentrun get`).
SELECT * FROM agent_run
 WHERE (%(pool)s::text IS NULL OR pool = %(pool)s)
   AND (%(status)s::text IS NULL OR status = %(status)s)
   AND (%(namespace)s::text IS NULL OR k8s_namespace = %(namespace)s)
 ORDER BY created_at DESC, id
 LIMIT %(limit)s;

-- claim_runs --
-- Oldest claimable runs of one pool: pending ones, and running ones whose holder's lease expired
-- (pgqueuer's trick: the claim itself takes back stale leases, no reaper process needed).
-- SKIP LOCKED lets concurrent claimers pass each other instead of queueing on the same rows.
-- A run claimed max_attempts times in a row without committing a step is failing
-- deterministically (a poison run): it goes to dead_letter here instead of being handed out
-- again. A step committed since the previous claim (claim_seq) starts the count over, so worker
-- deaths between steps of a healthy run never add up to a dead letter. The epoch is bumped
-- either way, so a worker still holding an old claim is fenced off.
--
-- O(claimed), not O(held) (migration 0015): the pending runs come from agent_run_pending_idx,
-- the expired leases from agent_run_lease_idx (expired ones first in it), each branch the oldest
-- `limit` it may lock, and the claim takes the oldest `limit` of both: the same runs as one scan
-- of every claimable run in created_at order would take (the oldest N of a union are among the
-- oldest N of each part). A held run is never read. Each branch locks as it goes (a run another
-- claim holds is skipped, the next one taken); a run locked by one branch and not taken stays
-- unclaimed and is unlocked at the statement's commit.
--
-- Quotas (migration 0012): a pending run of a namespace at its quota is passed over, as this
-- statement's snapshot sees the quota, so a noisy namespace's backlog cannot fill the batch and
-- starve the runs behind it. The snapshot may be stale, so admission is decided again on the
-- quota rows themselves: locked in namespace order (no deadlock between two claims), each grants
-- at most its free slots and adds them to running in the same statement; an UPDATE re-reads a row
-- another claim changed meanwhile, so two claims can never both take the last slot. The starting
-- runs of a namespace past its grant stay pending. An expired running run is taken back whatever
-- the quota: it was counted when it started.
--
-- Every call returns at least one row: next_expiry (seconds from now, null if none) is when the
-- earliest lease of another worker in the pool runs out, left out the runs this claim takes, so
-- an idle worker sleeps until then in the same round trip (worker/process.py _claim_loop); a
-- row whose id is null carries only it (nothing was claimed). Served by agent_run_lease_idx.
WITH pending AS (
    SELECT id, k8s_namespace, status, max_attempts, created_at,
           CASE WHEN next_seq > claim_seq THEN 0 ELSE stalled_attempts END AS stalled
      FROM agent_run r
     WHERE pool = %(pool)s
       AND status = 'pending'
       AND (lease_until IS NULL OR lease_until < now())  -- each way back to pending clears it
       AND NOT EXISTS (
               SELECT 1 FROM namespace_quota q
                WHERE q.namespace = r.k8s_namespace AND q.running >= q.max_running)
     ORDER BY created_at, id
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
), expired AS (
    SELECT id, k8s_namespace, status, max_attempts, created_at,
           CASE WHEN next_seq > claim_seq THEN 0 ELSE stalled_attempts END AS stalled
      FROM agent_run
     WHERE pool = %(pool)s
       AND status = 'running'
       AND lease_until < now()  -- never null while running: only this statement makes a run so
     ORDER BY created_at, id
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
), candidate AS (
    SELECT * FROM (SELECT * FROM pending UNION ALL SELECT * FROM expired) both_kinds
     ORDER BY created_at, id
     LIMIT %(limit)s
), starting AS (
    SELECT id, k8s_namespace,
           row_number() OVER (PARTITION BY k8s_namespace ORDER BY created_at, id) AS rank
      FROM candidate
     WHERE status = 'pending' AND stalled < max_attempts AND k8s_namespace IS NOT NULL
), wanted AS (
    SELECT k8s_namespace AS namespace, count(*)::integer AS n FROM starting GROUP BY 1
), locked AS (
    SELECT q.namespace FROM namespace_quota q
     WHERE q.namespace IN (SELECT namespace FROM wanted)
     ORDER BY q.namespace
       FOR UPDATE
), granted AS (
    UPDATE namespace_quota q
       SET running    = q.running + least(w.n, greatest(q.max_running - q.running, 0)),
           last_grant = least(w.n, greatest(q.max_running - q.running, 0))
      FROM wanted w
     WHERE q.namespace = w.namespace AND q.namespace IN (SELECT namespace FROM locked)
    RETURNING q.namespace, q.last_grant
), refused AS (
    SELECT s.id FROM starting s JOIN granted g ON g.namespace = s.k8s_namespace
     WHERE s.rank > g.last_grant
), claimed AS (
    UPDATE agent_run r
       SET status      = CASE WHEN c.stalled >= r.max_attempts THEN 'dead_letter' ELSE 'running' END,
           lease_owner = CASE WHEN c.stalled >= r.max_attempts THEN NULL ELSE %(worker)s END,
           lease_until = CASE WHEN c.stalled >= r.max_attempts THEN NULL
                              ELSE now() + make_interval(secs => %(ttl)s) END,
           lease_epoch = r.lease_epoch + 1,
           attempt     = CASE WHEN c.stalled >= r.max_attempts THEN r.attempt
                              ELSE r.attempt + 1 END,
           stalled_attempts = CASE WHEN c.stalled >= r.max_attempts THEN c.stalled
                                   ELSE c.stalled + 1 END,
           claim_seq   = r.next_seq,
           error       = CASE WHEN c.stalled >= r.max_attempts
                              THEN format('dead-lettered: claimed %%s times in a row without '
                                          'committing a step (maxAttempts %%s; %%s claims in '
                                          'all); last error: %%s',
                                          c.stalled, r.max_attempts, r.attempt,
                                          coalesce(r.error, 'none'))
                              ELSE r.error END,
           started_at  = coalesce(r.started_at, now()),
           finished_at = CASE WHEN c.stalled >= r.max_attempts THEN now() ELSE NULL END,
           updated_at  = now()  -- stamped here: the pin trigger is skipped (migration 0018)
      FROM candidate c
     WHERE r.id = c.id
       AND r.id NOT IN (SELECT id FROM refused)
    RETURNING r.*
), expiry AS (
    SELECT extract(epoch FROM min(lease_until) - now())::float8 AS next_expiry
      FROM agent_run
     WHERE pool = %(pool)s AND status = 'running'
       AND lease_owner IS DISTINCT FROM %(worker)s
       AND id NOT IN (SELECT id FROM candidate)
)
SELECT claimed.*, expiry.next_expiry FROM expiry LEFT JOIN claimed ON true;

-- quota_count_running --
-- A namespace's running runs, for a new quota row (taken under agent_run's SHARE lock).
SELECT count(*)::integer FROM agent_run WHERE k8s_namespace = %(namespace)s AND status = 'running';

-- lock_runs_for_quota --
-- Waits for every transaction writing agent_run and holds new ones off until this one commits,
-- so a new quota row's count misses no run leaving 'running' (no trigger found its row yet).
LOCK TABLE agent_run IN SHARE MODE;

-- upsert_quota --
-- A new quota row with its counted running runs (or a recount, when a concurrent call made it).
INSERT INTO namespace_quota (namespace, max_running, running)
VALUES (%(namespace)s, %(max_running)s, %(running)s)
ON CONFLICT (namespace) DO UPDATE
   SET max_running = EXCLUDED.max_running, running = EXCLUDED.running, updated_at = now();

-- set_quota_limit --
-- A new limit for an existing row; its count is kept (it is exact).
UPDATE namespace_quota SET max_running = %(max_running)s, updated_at = now()
 WHERE namespace = %(namespace)s
RETURNING running;

-- delete_quota --
-- Drop a namespace's quota: its runs are claimed without a limit from then on.
DELETE FROM namespace_quota WHERE namespace = %(namespace)s RETURNING namespace;

-- list_quotas --
-- Every namespace quota with its limit and running count.
SELECT namespace, max_running, running FROM namespace_quota ORDER BY namespace;

-- append_step --
-- The fenced append, in ONE statement (one round trip, autocommit): the UPDATE only matches while
-- this worker still holds the run with this epoch and the run is running; the INSERT is fed by the
-- UPDATE's RETURNING, so no match means no step. Committing a step also renews the lease.
-- A duplicate (run_id, seq) still fails on the primary key.
-- Only a run someone follows (`agentrun logs -f`: an unexpired run_follower row, migration 0008)
-- gets pg_notify('agentrun_run_steps', run_id), delivered at commit; the appends of every other
-- run stay off PostgreSQL's notification queue (a NOTIFY in every append halves 16-writer
-- throughput). The check is done here rather than in a trigger on agent_step: about the same cost
-- measured, and it stays in the one statement that appends. `followed` runs because RETURNING
-- reads it; no row from `fence` (fenced off) means no step and no notification.
-- A model turn whose first tool call starts at once carries that call's mark (tool_call, as
-- begin_tool_call writes it): one fenced round trip less per tool turn. Null keeps the mark.
WITH fence AS (
    UPDATE agent_run
       SET next_seq      = greatest(next_seq, %(seq)s + 1),
           lease_until   = now() + make_interval(secs => %(ttl)s),
           tool_call     = coalesce(%(tool_call)s::jsonb
                                    || jsonb_build_object('started_at', now()), tool_call),
           input_tokens  = input_tokens + %(input_tokens)s,
           output_tokens = output_tokens + %(output_tokens)s,
           cache_read_tokens  = cache_read_tokens + %(cache_read_tokens)s,
           cache_write_tokens = cache_write_tokens + %(cache_write_tokens)s,
           cost_usd      = cost_usd + %(cost_usd)s,
           updated_at    = now()  -- stamped here: the pin trigger is skipped (migration 0018)
     WHERE id = %(run_id)s
       AND lease_owner = %(worker)s
       AND lease_epoch = %(epoch)s
       AND status = 'running'
    RETURNING id
), followed AS (
    SELECT pg_notify('agentrun_run_steps', fence.id::text)
      FROM fence
     WHERE EXISTS (SELECT 1 FROM run_follower f WHERE f.run_id = fence.id AND f.until > now())
)
INSERT INTO agent_step (run_id, seq, kind, payload, request_id, lease_epoch, worker)
SELECT fence.id, %(seq)s, %(kind)s, %(payload)s, %(request_id)s, %(epoch)s, %(worker)s
  FROM fence
RETURNING seq, created_at, (SELECT count(*) FROM followed) AS notified;

-- append_steps --
-- Group commit (Store.append_step with group_commit, agentrun/group_commit.py): the appends of
-- one worker's concurrent runs in ONE statement, one row per run, each fenced on its own run and
-- epoch exactly as append_step is, from arrays (the statement text, and so its prepared plan, is
-- the same whatever the batch size). A row whose seq is there already matches nothing rather than
-- failing the statement, so it neither renews its lease nor adds its tokens (append_step's
-- duplicate rolls back the same way): the rows RETURNING leaves out were fenced off or duplicates,
-- and fence_states tells which. The run ids of a batch are distinct (one UPDATE per row). The
-- step's columns ride along in the same unnest and come out of the UPDATE's RETURNING: no second
-- unnest, no join. The two jsonb arrays are sent in binary (the b placeholders): in text,
-- psycopg quotes each payload inside the array literal, one regex substitution per double quote of
-- its JSON (measured: 46 against 13 us a payload, the JSON encoding included; about 5 percent of a
-- worker's CPU a step at 16 runs).
WITH fence AS (
    UPDATE agent_run
       SET next_seq      = greatest(next_seq, held.seq + 1),
           lease_until   = now() + make_interval(secs => held.ttl),
           -- agent_run's own columns named in full: held has columns of the same names
           input_tokens  = agent_run.input_tokens + held.input_tokens,
           output_tokens = agent_run.output_tokens + held.output_tokens,
           cache_read_tokens  = agent_run.cache_read_tokens + held.cache_read_tokens,
           cache_write_tokens = agent_run.cache_write_tokens + held.cache_write_tokens,
           cost_usd      = agent_run.cost_usd + held.cost_usd,
           tool_call     = coalesce(held.tool_call || jsonb_build_object('started_at', now()),
                                    agent_run.tool_call),
           updated_at    = now()  -- stamped here: the pin trigger is skipped (migration 0018)
      FROM unnest(%(run_ids)s::uuid[], %(epochs)s::bigint[], %(seqs)s::integer[],
                  %(ttls)s::double precision[], %(input_tokens)s::bigint[],
                  %(output_tokens)s::bigint[], %(cache_read_tokens)s::bigint[],
                  %(cache_write_tokens)s::bigint[], %(cost_usd)s::double precision[],
                  %(kinds)s::text[], %(payloads)b::jsonb[], %(request_ids)s::text[],
                  %(tool_calls)b::jsonb[])
           AS held(run_id, epoch, seq, ttl, input_tokens, output_tokens, cache_read_tokens,
                   cache_write_tokens, cost_usd, kind, payload, request_id, tool_call)
     WHERE id = held.run_id
       AND lease_owner = %(worker)s AND lease_epoch = held.epoch AND status = 'running'
       -- The batch's runs by primary key, whatever the planner guesses of the unnest: without
       -- it a plan may read every running run (agent_run_lease_idx) to join them (measured 0.3 ms
       -- more per statement with 5,000 running runs in the table, at 2 rows a batch).
       AND id = ANY(%(run_ids)s::uuid[])
       -- Not a duplicate. next_seq is past every seq the run has (each append raises it), so the
       -- usual row, the next seq, needs no look into agent_step (8 percent of the statement).
       AND (held.seq >= agent_run.next_seq
            OR NOT EXISTS (SELECT 1 FROM agent_step s
                            WHERE s.run_id = held.run_id AND s.seq = held.seq))
    RETURNING id, held.epoch, held.seq, held.kind, held.payload, held.request_id
), followed AS (
    SELECT pg_notify('agentrun_run_steps', fence.id::text)
      FROM fence
     WHERE EXISTS (SELECT 1 FROM run_follower f WHERE f.run_id = fence.id AND f.until > now())
)
INSERT INTO agent_step (run_id, seq, kind, payload, request_id, lease_epoch, worker)
SELECT fence.id, fence.seq, fence.kind, fence.payload, fence.request_id, fence.epoch, %(worker)s
  FROM fence
RETURNING run_id, created_at, (SELECT count(*) FROM followed) AS notified;

-- pin_prompt_version --
-- Invariant 3: the first worker to claim a run pins the tool definitions it resolved; later
-- claims (another worker, a redeployed image with changed tools) reuse them. Fenced. The version
-- is stored (as insert_prompt_version does) in the same statement, one round trip on a run's
-- first claim: the foreign key is checked at the statement's end, when the CTE's row is there. A
-- fenced-off pin still stores it: content-addressed and write-once, it is never wrong to have.
WITH version AS (
    INSERT INTO prompt_version (id, model, system, tools, params)
    VALUES (%(id)s, %(model)s, %(system)s, %(tools)s, %(params)s)
    ON CONFLICT (id) DO NOTHING
)
UPDATE agent_run SET prompt_version = coalesce(prompt_version, %(id)s)
 WHERE id = %(run_id)s AND lease_owner = %(worker)s AND lease_epoch = %(epoch)s
   AND status = 'running'
RETURNING prompt_version;

-- renew_lease --
-- The heartbeat: pushes the lease out by the TTL while this worker holds the run. Fenced.
UPDATE agent_run
   SET lease_until = now() + make_interval(secs => %(ttl)s),
       updated_at = now()  -- stamped here: the pin trigger is skipped (migration 0018)
 WHERE id = %(run_id)s AND lease_owner = %(worker)s AND lease_epoch = %(epoch)s
   AND status = 'running'
RETURNING lease_until;

-- renew_leases --
-- The worker's heartbeat for every held run that is due, in one statement whatever their number
-- (Store.renew_all): each row is fenced by its own epoch, as renew_lease is; the ids returned
-- were renewed, the others are no longer this worker's (fence_states says why).
-- The rows are locked first, in id order: the order of a group commit's batch (append_steps,
-- read by its primary key). Locked as the join met them, a renewal and a batch of the same runs
-- deadlocked, and PostgreSQL failed one of them.
WITH locked AS (
    SELECT id FROM agent_run WHERE id = ANY(%(run_ids)s::uuid[]) ORDER BY id
       FOR NO KEY UPDATE
)
UPDATE agent_run
   SET lease_until = now() + make_interval(secs => %(ttl)s),
       updated_at = now()  -- stamped here: the pin trigger is skipped (migration 0018)
  FROM unnest(%(run_ids)s::uuid[], %(epochs)s::bigint[]) AS held(run_id, epoch)
 WHERE id = held.run_id
   AND lease_owner = %(worker)s AND lease_epoch = held.epoch AND status = 'running'
   AND id IN (SELECT id FROM locked)
RETURNING id;

-- release_lease --
-- A graceful hand-off (SIGTERM drain): the run is claimable at once, not after the lease TTL, and
-- the attempt is given back, since a deploy is not a sign of a poison run.
UPDATE agent_run
   SET status = 'pending', lease_owner = NULL, lease_until = NULL,
       attempt = greatest(attempt - 1, 0), stalled_attempts = greatest(stalled_attempts - 1, 0),
       -- who gave it back, for the next claim's hand-over record (migration 8)
       released_by = %(worker)s, released_at = now()
 WHERE id = %(run_id)s AND lease_owner = %(worker)s AND lease_epoch = %(epoch)s
   AND status = 'running'
RETURNING id;

-- expire_lease --
-- A worker let the run go because its lease ran out by its own clock (its renewals failed, or
-- it was paused), while the database may have it renewed (a renewal in flight when a paused
-- worker woke): the lease ends now, as the worker believes it did, so the next claim takes the
-- run at once. It waited out the renewed lease, and a worker alone in its pool its whole idle
-- interval (a claim wakes for other workers' leases only). Counted as a lost lease is (the next
-- claim's attempt), not given back as a drain's.
UPDATE agent_run SET lease_until = now(), updated_at = now()
 WHERE id = %(run_id)s AND lease_owner = %(worker)s AND lease_epoch = %(epoch)s
   AND status = 'running'
RETURNING id;

-- finish_run --
-- A run's terminal status, result and error, its lease given up. Fenced.
-- Never 'succeeded' once a rollback was asked for (cancel --rollback, reject --abort): the holder
-- hears of the request by notification, and one sent while its LISTEN connection was down never
-- arrived, so the run ended succeeded with its effects in place and the request left unanswered.
-- Matching nothing here, the holder reads why (fence_state) and rolls back instead.
UPDATE agent_run
   SET status = %(status)s, result = %(result)s, error = %(error)s,
       lease_owner = NULL, lease_until = NULL, finished_at = now()
 WHERE id = %(run_id)s AND lease_owner = %(worker)s AND lease_epoch = %(epoch)s
   AND status = 'running'
   AND (%(status)s::text <> 'succeeded' OR rollback_reason IS NULL)
RETURNING id;

-- cancel_run --
-- Cancellation is a status change. The holder's next append, renewal or finish no longer matches
-- its fence (status is no longer running) and it stops; workers also hear it on
-- agentrun_run_changed and abort an in-flight model call.
-- A run that is rolling back (rollback_reason set) is not cancelled: stopping it would abandon
-- its saga half undone, with nothing recorded. Its rollback runs to the end, then it ends.
UPDATE agent_run
   SET status = 'cancelled', lease_until = NULL, finished_at = now(),
       error = coalesce(%(reason)s, 'cancelled')
 WHERE id = %(run_id)s
   AND status IN ('pending', 'running', 'waiting_approval')
   AND rollback_reason IS NULL
RETURNING *;

-- fence_state --
-- Only read after a fenced statement matched nothing, to say why.
SELECT status, lease_owner, lease_epoch, rollback_reason IS NOT NULL AS rollback
  FROM agent_run WHERE id = %(run_id)s;

-- fence_states --
-- fence_state of several runs at once: after renew_leases left some out.
SELECT id, status, lease_owner, lease_epoch FROM agent_run WHERE id = ANY(%(ids)s);

-- list_steps --
-- Every step of a run, in order.
SELECT run_id, seq, kind, payload, request_id, lease_epoch, worker, created_at
  FROM agent_step WHERE run_id = %(run_id)s ORDER BY seq;

-- pool_depth --
-- Pending and running runs of every pool, each status counted from its own index
-- (agent_run_pending_idx, agent_run_lease_idx): finished runs are never read. held_back: the
-- pending runs a claim passes over for their namespace's quota (the pool_held_back view,
-- migration 0024), which are no demand for workers.
SELECT pool, sum(pending)::bigint AS pending, sum(running)::bigint AS running,
       min(oldest_pending) AS oldest_pending, sum(held_back)::bigint AS held_back
  FROM (SELECT pool, count(*) AS pending, 0 AS running, min(created_at) AS oldest_pending,
               0 AS held_back
          FROM agent_run WHERE status = 'pending' GROUP BY pool
        UNION ALL
        SELECT pool, 0, count(*), NULL, 0
          FROM agent_run WHERE status = 'running' GROUP BY pool
        UNION ALL
        SELECT pool, 0, 0, NULL, held_back FROM pool_held_back) by_status
 GROUP BY pool;

-- operator_probe --
-- The operator's idle tick in ONE statement: every pool's depth (as pool_depth; a row with a NULL
-- pool when no pool has live runs) beside a fingerprint of the live runs of AgentRun objects
-- (their number and a hash of every id and updated_at, which the agent_run trigger bumps on every
-- change, so any change moves it, also one committed out of order) and of the namespace quotas.
-- The full resync reads the runs only when a fingerprint moved. held_back: as pool_depth's.
WITH depth AS (
    SELECT a.pool,
           count(*) FILTER (WHERE status = 'pending')  AS pending,
           count(*) FILTER (WHERE status = 'running')  AS running,
           min(created_at) FILTER (WHERE status = 'pending') AS oldest_pending,
           coalesce(max(h.held_back), 0) AS held_back
      FROM agent_run a LEFT JOIN pool_held_back h ON h.pool = a.pool
     WHERE status IN ('pending', 'running')
     GROUP BY a.pool
), live AS (
    SELECT count(*) AS live_runs,
           coalesce(sum(hashtext(id::text || updated_at::text)), 0) AS live_hash
      FROM agent_run
     WHERE k8s_uid IS NOT NULL AND status IN ('pending', 'running', 'waiting_approval')
), quota AS (
    SELECT coalesce(sum(hashtext(namespace || ':' || max_running || ':' || running)), 0)
           AS quota_hash
      FROM namespace_quota
)
SELECT d.pool, d.pending, d.running, d.oldest_pending, l.live_runs, l.live_hash, q.quota_hash,
       d.held_back
  FROM live l CROSS JOIN quota q LEFT JOIN depth d ON true;

-- ping --
-- The operator's readiness check: a pooled connection answers (no table is read).
SELECT 1;

-- migration_lock --
-- Serialises concurrent `agentrun migrate` runs (operator replicas and worker pods starting
-- together). Transaction-scoped: released by the commit that records the migrations.
SELECT pg_advisory_xact_lock(7146120421);

-- create_migration_table --
-- The table recording applied migrations (the first migration cannot create it).
CREATE TABLE IF NOT EXISTS agentrun_migration (
    version     integer PRIMARY KEY,
    name        text NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now()
);

-- applied_migrations --
-- The versions already applied.
SELECT version FROM agentrun_migration ORDER BY version;

-- record_migration --
-- Note one migration as applied, in the transaction that applied it.
INSERT INTO agentrun_migration (version, name) VALUES (%(version)s, %(name)s);

-- schema_version --
-- The newest migration applied (0 on an empty table).
SELECT coalesce(max(version), 0) AS version FROM agentrun_migration;

-- abandon_run --
-- Give a claim up WITHOUT giving the attempt back (transient provider failures outlasted the retry
-- budget, or an unexpected error): claimable again at once, and the attempt counter moves on
-- toward the dead letter, so a run that fails every time stops.
UPDATE agent_run
   SET status = 'pending', lease_owner = NULL, lease_until = NULL, error = %(error)s
 WHERE id = %(run_id)s AND lease_owner = %(worker)s AND lease_epoch = %(epoch)s
   AND status = 'running'
RETURNING id;

-- run_statuses --
-- Status, epoch and whether a rollback was asked for, of several runs at once (a worker checking
-- the runs it holds after its LISTEN connection was back: what it may not have heard).
SELECT id, status, lease_epoch, rollback_reason IS NOT NULL AS rollback
  FROM agent_run WHERE id = ANY(%(ids)s);

-- list_effects --
-- The recorded tool effects of one step.
SELECT seq, call_index, idempotency_key, tool, tool_kind, state, result, input, compensate,
       attempts
  FROM tool_effect WHERE run_id = %(run_id)s AND seq = %(seq)s;

-- compensations_due --
-- Effects that declared a compensation and have not been compensated yet, newest first (a saga
-- undoes in reverse order). A compensation step names the call it undid. An intent without an
-- outcome (an irreversible call its worker died inside) may have happened: it is due as well,
-- and its compensation is told the outcome is unknown. Skipped, the rollback reported the run
-- compensated with that effect perhaps in place. So is an outcome recorded as an error that
-- leaves an earlier attempt unknown (outcome_unknown: a rejected or failed re-run; executor.py
-- UNKNOWN_OUTCOME); any other error is a call that did not take effect.
SELECT e.seq, e.call_index, e.idempotency_key, e.tool, e.tool_kind, e.state, e.result, e.input,
       e.compensate, e.attempts, e.busy_until
  FROM tool_effect e
 WHERE e.run_id = %(run_id)s AND e.compensate IS NOT NULL AND e.state IN ('done', 'intent')
   AND (coalesce((e.result ->> 'is_error')::boolean, false) = false
        OR coalesce((e.result ->> 'outcome_unknown')::boolean, false))
   AND NOT EXISTS (
       SELECT 1 FROM agent_step s
        WHERE s.run_id = e.run_id AND s.kind = 'compensation'
          AND (s.payload ->> 'seq')::int = e.seq
          AND (s.payload ->> 'call_index')::int = e.call_index)
 ORDER BY e.seq DESC, e.call_index DESC;

-- lost_call --
-- The call a worker was lost inside, outcome never recorded: a compensable tool's call is recorded
-- only once it returns, so its mark (begin_tool_call: "compensate" names its undo) is all that says
-- an effect may need undoing, with the lease_until the claim that found the worker dead added to
-- it (agentrun_tool_loss_v1). A mark an older worker wrote (a rolling upgrade) names no undo:
-- compensate and kind NULL, which the caller's registry may know. Not once a later holder
-- recorded it (a resume calls it again under the same key) or its compensation is logged. Its
-- model turn, for the call's arguments.
SELECT (r.tool_call ->> 'seq')::int AS seq, (r.tool_call ->> 'call_index')::int AS call_index,
       r.tool_call ->> 'tool' AS tool, r.tool_call ->> 'kind' AS kind,
       r.tool_call ->> 'compensate' AS compensate, s.payload AS turn,
       (r.tool_call ->> 'lease_until')::timestamptz
         + make_interval(secs => coalesce((r.tool_call ->> 'timeout')::float8, 0)) AS busy_until
  FROM agent_run r
  JOIN agent_step s ON s.run_id = r.id AND s.seq = (r.tool_call ->> 'seq')::int
                   AND s.kind = 'model_turn'
 WHERE r.id = %(run_id)s AND r.tool_call ? 'tool' AND r.tool_call ? 'lease_until'
   AND NOT EXISTS (
       SELECT 1 FROM tool_effect e
        WHERE e.run_id = r.id AND e.seq = (r.tool_call ->> 'seq')::int
          AND e.call_index = (r.tool_call ->> 'call_index')::int)
   AND NOT EXISTS (
       SELECT 1 FROM agent_step c
        WHERE c.run_id = r.id AND c.kind = 'compensation'
          AND (c.payload ->> 'seq')::int = (r.tool_call ->> 'seq')::int
          AND (c.payload ->> 'call_index')::int = (r.tool_call ->> 'call_index')::int);

-- begin_rollback --
-- Mark the run as rolling back (the first reason and end stay: a requested rollback's). Fenced.
-- The run's mark is cleared: it names the last call this worker made (its failure, when that
-- failed the run), and a death before the first compensation's mark made the next claim take
-- that call for one its worker was lost inside (lost_call), and undo a call known to have failed.
-- A call an earlier holder was lost inside was recorded by this claim before (_record_lost_call).
UPDATE agent_run SET rollback_reason = coalesce(rollback_reason, %(reason)s),
                     rollback_end = coalesce(rollback_end, %(end)s),
                     tool_call = NULL
 WHERE id = %(run_id)s AND lease_owner = %(worker)s AND lease_epoch = %(epoch)s
   AND status = 'running'
RETURNING rollback_reason, rollback_end;

-- record_effect --
-- Fenced like an append (the UPDATE matches only while this worker holds the run; it also renews
-- the lease). state 'intent' inserts the intent of an irreversible call; state 'done' records an
-- outcome, completing an intent if there is one.
WITH fence AS (
    UPDATE agent_run SET lease_until = now() + make_interval(secs => %(ttl)s)
     WHERE id = %(run_id)s AND lease_owner = %(worker)s AND lease_epoch = %(epoch)s
       AND status = 'running'
    RETURNING id
)
INSERT INTO tool_effect (run_id, seq, call_index, idempotency_key, tool, tool_kind, state,
                         result, input, compensate, lease_epoch, worker, completed_at, busy_until)
SELECT fence.id, %(seq)s, %(call_index)s, %(key)s, %(tool)s, %(tool_kind)s, %(state)s,
       %(result)s, %(input)s, %(compensate)s, %(epoch)s, %(worker)s,
       CASE WHEN %(state)s = 'done' THEN clock_timestamp() END, %(busy_until)s
  FROM fence
ON CONFLICT (run_id, seq, call_index) DO UPDATE
   SET state = 'done', result = EXCLUDED.result, completed_at = clock_timestamp(),
       lease_epoch = EXCLUDED.lease_epoch, worker = EXCLUDED.worker,
       -- the later bound of the two (a lost call's re-run that timed out): greatest skips NULL
       busy_until = greatest(tool_effect.busy_until, EXCLUDED.busy_until)
 WHERE tool_effect.state = 'intent' AND EXCLUDED.state = 'done'
RETURNING state;

-- begin_tool_call --
-- Marks the call a worker is about to invoke (see migration 0005): if the process dies inside
-- it, the next claim blames this run and hands its co-located runs over. Fenced, so it is also
-- the lease check right before the call; it renews the lease.
UPDATE agent_run
   SET tool_call = %(tool_call)s::jsonb || jsonb_build_object('started_at', now()),
       lease_until = now() + make_interval(secs => %(ttl)s),
       updated_at = now()  -- stamped here: the pin trigger is skipped (migration 0018)
 WHERE id = %(run_id)s AND lease_owner = %(worker)s AND lease_epoch = %(epoch)s
   AND status = 'running'
RETURNING id;

-- wait_for_approval --
-- The run stops and waits for a human; its lease is given up (and the attempt with it: waiting is
-- not failing), so no worker holds a run nobody can advance. Never once a rollback was asked for
-- (as finish_run's succeeded): the rollback was parked behind a call it would never make, and the
-- run sat in waiting_approval until someone decided that call (Store.wait_for_approval raises
-- RollbackRequested, and the worker rolls back instead).
UPDATE agent_run
   SET status = 'waiting_approval', wait_reason = %(reason)s, pending_call = %(pending_call)s,
       lease_owner = NULL, lease_until = NULL, attempt = greatest(attempt - 1, 0),
       stalled_attempts = greatest(stalled_attempts - 1, 0)
 WHERE id = %(run_id)s AND lease_owner = %(worker)s AND lease_epoch = %(epoch)s
   AND status = 'running' AND rollback_reason IS NULL
RETURNING id;

-- get_approval --
-- The decision on one attempt of one call (see 0004: each decision buys one attempt).
SELECT decision, decided_by, reason, decided_at, attempt FROM approval
 WHERE run_id = %(run_id)s AND seq = %(seq)s AND call_index = %(call_index)s
   AND stage = %(stage)s AND attempt = %(attempt)s;

-- last_approval_on_step --
-- The latest decision on any call of one step: what a refused second decision names when it does
-- not know which call the first one decided (it read the run after that decision).
SELECT decision, decided_by, reason, decided_at, attempt FROM approval
 WHERE run_id = %(run_id)s AND seq = %(seq)s
 ORDER BY decided_at DESC
 LIMIT 1;

-- insert_approval --
-- Record a decision on one attempt of one call; a second decision on it is ignored.
INSERT INTO approval (run_id, seq, call_index, stage, attempt, decision, decided_by, reason)
VALUES (%(run_id)s, %(seq)s, %(call_index)s, %(stage)s, %(attempt)s, %(decision)s,
        %(decided_by)s, %(reason)s)
ON CONFLICT DO NOTHING
RETURNING decision;

-- retry_intent --
-- An approved re-run of an irreversible call whose outcome was unknown is counted, fenced, BEFORE
-- the tool is called: a crash during it leaves the intent of the new attempt, which needs a
-- decision of its own. It matches only the attempt that was decided (and renews the lease).
WITH fence AS (
    UPDATE agent_run SET lease_until = now() + make_interval(secs => %(ttl)s)
     WHERE id = %(run_id)s AND lease_owner = %(worker)s AND lease_epoch = %(epoch)s
       AND status = 'running'
    RETURNING id
)
UPDATE tool_effect e
   SET attempts = e.attempts + 1, lease_epoch = %(epoch)s, worker = %(worker)s
  FROM fence
 WHERE e.run_id = fence.id AND e.seq = %(seq)s AND e.call_index = %(call_index)s
   AND e.state = 'intent' AND e.attempts = %(attempt)s
RETURNING e.attempts;

-- resume_after_decision --
-- Only the call the run is actually waiting on can be decided; the run becomes claimable again.
UPDATE agent_run
   SET status = 'pending', wait_reason = NULL, pending_call = NULL
 WHERE id = %(run_id)s AND status = 'waiting_approval'
   AND (pending_call ->> 'seq')::int = %(seq)s
RETURNING pending_call;

-- pending_call --
-- The call a run waits on, locked so one decision at a time resumes it, and the attempt its
-- intent counts (an irreversible call's): what a wait that does not name its attempt is about (a
-- timeout's wait written by a worker before it named it).
SELECT r.status, r.pending_call,
       (SELECT e.attempts FROM tool_effect e
         WHERE e.run_id = r.id AND e.seq = (r.pending_call ->> 'seq')::int
           AND e.call_index = (r.pending_call ->> 'call_index')::int
           AND e.state = 'intent') AS intent_attempt
  FROM agent_run r WHERE r.id = %(run_id)s FOR UPDATE OF r;

-- request_rollback --
-- Ask for a run's effects to be compensated and the run ended. A holder is NOT fenced off (a
-- tool of it may be running, and its effect must be recorded to be undone): it hears the
-- notification and rolls back at its next commit boundary. A run nobody holds becomes claimable,
-- and the next claim rolls it back.
-- The first request's reason and end stay: a second request matches no row (the run was rolling
-- back already, and ends as that rollback said; the CLI said "ends cancelled" of a run that then
-- ended failed, and dropped the second reason without a word).
-- A dead-lettered run (its workers died maxAttempts claims in a row) never rolled back: its
-- done compensable effects (%(rollback_due)s: Store.request_rollback reads compensations_due)
-- stayed done, and nothing could undo them. It becomes pending with a fresh poison-run budget
-- (as a retry gives it), and the next claim runs its compensations only, then ends it as asked.
-- One dead-lettered in the middle of a rollback keeps that rollback: a retry resumes it.
-- Its dead-letter error moves to retried_error, as a retry's does: it said "dead-lettered" while
-- the run was pending and rolling back, until the rollback ended.
-- A rollback parked behind an approval (a worker before wait_for_approval's guard) is resumed by
-- a second request, which reports it (resumed): it said "not recorded" while it moved the run.
-- Any other second request changes nothing.
WITH before AS (
    SELECT id, rollback_reason IS NULL AS requested_now,
           rollback_reason IS NOT NULL AND status = 'waiting_approval' AS resumed
      FROM agent_run
     WHERE id = %(run_id)s
       AND (status IN ('pending', 'running', 'waiting_approval')
            OR (status = 'dead_letter' AND rollback_reason IS NULL AND %(rollback_due)s))
       FOR NO KEY UPDATE
)
UPDATE agent_run r
   SET rollback_reason = coalesce(r.rollback_reason, %(reason)s),
       rollback_end = coalesce(r.rollback_end, %(end)s),
       status = CASE WHEN r.status IN ('waiting_approval', 'dead_letter') THEN 'pending'
                     ELSE r.status END,
       wait_reason = CASE WHEN r.status = 'waiting_approval' THEN NULL ELSE r.wait_reason END,
       pending_call = CASE WHEN r.status = 'waiting_approval' THEN NULL ELSE r.pending_call END,
       stalled_attempts = CASE WHEN r.status = 'dead_letter' THEN 0 ELSE r.stalled_attempts END,
       claim_seq = CASE WHEN r.status = 'dead_letter' THEN r.next_seq ELSE r.claim_seq END,
       finished_at = CASE WHEN r.status = 'dead_letter' THEN NULL ELSE r.finished_at END,
       retried_error = CASE WHEN r.status = 'dead_letter' THEN r.error ELSE r.retried_error END,
       error = CASE WHEN r.status = 'dead_letter' THEN NULL ELSE r.error END
  FROM before
 WHERE r.id = before.id AND (before.requested_now OR before.resumed)
RETURNING r.*;

-- k8s_runs_by_id --
-- The operator's status flush: the runs it was notified about, in one round trip, in the order
-- of their ids (a flush patches them in a known order, whatever the plan).
SELECT * FROM agent_run WHERE id = ANY(%(ids)s) AND k8s_uid IS NOT NULL ORDER BY id;

-- k8s_live_runs --
-- The operator's resync (served by agent_run_k8s_live_idx).
SELECT * FROM agent_run
 WHERE k8s_uid IS NOT NULL AND status IN ('pending', 'running', 'waiting_approval');

-- runs_by_status --
-- For the operator's agentrun_runs gauge; read on a slow timer, it counts every run.
SELECT pool, status, count(*) AS n FROM agent_run GROUP BY pool, status;

-- last_writer --
-- The worker that committed a run's last step: after a dead letter, whose process died last.
SELECT worker FROM agent_step WHERE run_id = %(run_id)s ORDER BY seq DESC LIMIT 1;

-- run_handovers --
-- Every change of hands of one run (migration 8), oldest first.
SELECT epoch, kind, from_worker, to_worker, step, lost_at, claimed_at
  FROM run_handover WHERE run_id = %(run_id)s ORDER BY epoch;

-- note_dead_letter --
-- Appends why a dead-lettered run's workers died (found by the operator, e.g. OOMKilled), once.
UPDATE agent_run
   SET error = coalesce(error, '') || %(note)s
 WHERE id = %(run_id)s AND status = 'dead_letter'
   AND position(%(note)s IN coalesce(error, '')) = 0;

-- lease_holders --
-- Which workers hold how many runs of a pool: busy pods get a higher pod-deletion-cost.
-- Served by agent_run_lease_idx alone (it includes lease_owner).
SELECT lease_owner AS worker, count(*) AS held
  FROM agent_run
 WHERE pool = %(pool)s AND status = 'running' AND lease_owner IS NOT NULL
 GROUP BY lease_owner;

-- list_steps_after --
-- agentrun logs -f: the steps committed since the last it printed (served by the primary key).
SELECT run_id, seq, kind, payload, request_id, lease_epoch, worker, created_at
  FROM agent_step WHERE run_id = %(run_id)s AND seq >= %(from_seq)s ORDER BY seq;

-- retry_run --
-- agentrun retry / the agentrun.dev/retry annotation: a failed or dead-lettered run becomes
-- pending again and the next claim continues from its step log (nothing committed is repeated:
-- its steps and recorded effects stay, the pinned prompt version stays). The poison-run guard
-- starts over (stalled_attempts 0, claim_seq at the log's end: a fresh maxAttempts budget);
-- attempt, the claims of the run's whole life, is kept. Every failure passes through the
-- worker's abort, which records rollback_reason; it is cleared, or the next claim would abort
-- again. A run whose abort compensated something (a 'compensation' step) is not retried: what
-- it undid would be missing from the state it continues from. The error the retry clears is
-- kept in retried_error, the reason in retry_reason (see migration 0007).
-- A run dead-lettered in the middle of its rollback (every claim's worker died before the
-- rollback ended, e.g. in a compensation) never finished it: it keeps its rollback_reason and
-- rollback_end, so the retry resumes the rollback and the run ends as it was asked to. Cleared,
-- it went back to the model and tools, and what it had to undo stayed done.
-- So does a run whose rollback ended incomplete (a compensation failed: ROLLBACK INCOMPLETE),
-- failed or cancelled: %(rollback_due)s, compensations_due is not empty (Store.retry reads it; a
-- finished run's effects and steps do not change). The retry is how a rollback is finished once
-- what its compensation needed is back. Before, a failed one went back to the model and could end
-- succeeded with its effects in place (after a reject --abort too), and a cancelled one could
-- never be finished.
UPDATE agent_run r
   SET status = 'pending', lease_owner = NULL, lease_until = NULL,
       stalled_attempts = 0, claim_seq = r.next_seq,
       rollback_reason = CASE WHEN r.status = 'dead_letter' OR %(rollback_due)s
                              THEN r.rollback_reason END,
       rollback_end = CASE WHEN r.status = 'dead_letter' OR %(rollback_due)s
                           THEN r.rollback_end END,
       result = NULL, finished_at = NULL,
       retried_error = r.error, error = NULL,
       retries = r.retries + 1, retry_reason = %(reason)s
 WHERE r.id = %(run_id)s
   AND ((r.status IN ('failed', 'dead_letter', 'cancelled')
         AND r.rollback_reason IS NOT NULL AND %(rollback_due)s)
        OR (r.status IN ('failed', 'dead_letter')
            AND ((r.status = 'dead_letter' AND r.rollback_reason IS NOT NULL)
                 OR NOT EXISTS (SELECT 1 FROM agent_step s
                                 WHERE s.run_id = r.id AND s.kind = 'compensation'))))
RETURNING r.*;

-- compensation_count --
-- Why a retry was refused: how many compensations the run's rollback committed.
SELECT count(*) AS n FROM agent_step WHERE run_id = %(run_id)s AND kind = 'compensation';

-- restart_run --
-- agentrun restart: a new run with the pinned parts of an old one (task, model, agent spec,
-- pool, limits), from step 0, in its namespace under its name (a namespace's quota counts it,
-- and `runs --namespace` lists it: without them a restart escaped a paused namespace's quota).
-- Not its object's uid or external key (both unique: they name the original; a run with a name
-- and no uid is a submitted one, which the operator never reads) and not its prompt version:
-- the first claim resolves its tools afresh, as for any new run.
INSERT INTO agent_run (pool, task, model, agent_spec, max_steps, max_attempts, restarted_from,
                       k8s_namespace, k8s_name)
SELECT pool, task, model, agent_spec, max_steps, max_attempts, id, k8s_namespace, k8s_name
  FROM agent_run WHERE id = %(run_id)s
RETURNING *;

-- model_turns --
-- agentrun get: the model turns a run has taken, which maxSteps counts (next_seq counts every
-- step: a turn's tool results too).
SELECT count(*)::integer FROM agent_step WHERE run_id = %(run_id)s AND kind = 'model_turn';

-- prune_set_flag --
-- agent_step's append-only trigger lets a DELETE through only with this set, for the
-- transaction (migration 0001): the prune is the one deletion there is.
SELECT set_config('agentrun.allow_prune', 'on', true);

-- prune_batch --
-- One batch of agentrun prune, its own short transaction: up to `batch` finished runs that
-- ended before the cutoff, and everything that belongs to them. Only finished statuses ever
-- match (whatever the caller passes), so no live run is touched; FOR UPDATE SKIP LOCKED passes
-- over a run someone else holds a lock on (a concurrent retry), and the lock on the chosen ones
-- makes a retry that comes in meanwhile wait for this batch and then find no run. The CTEs run
-- on one snapshot; the foreign keys are checked at the statement's end, when the children are
-- gone.
WITH doomed AS (
    SELECT id FROM agent_run
     WHERE status IN ('succeeded', 'failed', 'cancelled', 'dead_letter')
       AND status = ANY(%(statuses)s)
       AND finished_at < %(cutoff)s
     ORDER BY finished_at, id
     LIMIT %(batch)s
     FOR UPDATE SKIP LOCKED
), steps AS (
    DELETE FROM agent_step s USING doomed d WHERE s.run_id = d.id RETURNING 1
), effects AS (
    DELETE FROM tool_effect e USING doomed d WHERE e.run_id = d.id RETURNING 1
), approvals AS (
    DELETE FROM approval a USING doomed d WHERE a.run_id = d.id RETURNING 1
), runs AS (
    DELETE FROM agent_run r USING doomed d WHERE r.id = d.id RETURNING 1
)
SELECT (SELECT count(*) FROM runs) AS runs, (SELECT count(*) FROM steps) AS steps,
       (SELECT count(*) FROM effects) AS effects, (SELECT count(*) FROM approvals) AS approvals;

-- prune_preview --
-- agentrun prune --dry-run: what a prune with the same cutoff and statuses would delete now.
SELECT count(*) AS runs,
       coalesce(sum((SELECT count(*) FROM agent_step s WHERE s.run_id = r.id)), 0) AS steps
  FROM agent_run r
 WHERE r.status IN ('succeeded', 'failed', 'cancelled', 'dead_letter')
   AND r.status = ANY(%(statuses)s)
   AND r.finished_at < %(cutoff)s;

-- follow_run --
-- agentrun logs -f registers (and, well before `until`, renews) its follow of a run, so the run's
-- appends notify agentrun_run_steps (migration 0008). Expired rows, left by followers that died
-- without deleting theirs, are deleted on the way: they are few and already ignored. (Not this
-- follower's own row: one statement must not both delete and update it.)
WITH expired AS (
    DELETE FROM run_follower
     WHERE until < now() AND (run_id, follower) <> (%(run_id)s, %(follower)s)
)
INSERT INTO run_follower (run_id, follower, until)
VALUES (%(run_id)s, %(follower)s, now() + make_interval(secs => %(lease)s))
ON CONFLICT (run_id, follower) DO UPDATE SET until = EXCLUDED.until
RETURNING until;

-- unfollow_run --
-- A follower (`agentrun logs -f`) stops following a run.
DELETE FROM run_follower WHERE run_id = %(run_id)s AND follower = %(follower)s;

-- register_toolset --
-- A worker's tool names, at its start (migration 0013).
INSERT INTO pool_toolset (pool, tools_hash, tools, worker)
VALUES (%(pool)s, %(tools_hash)s, %(tools)s, %(worker)s)
ON CONFLICT (pool, tools_hash) DO UPDATE SET worker = EXCLUDED.worker, started_at = now();

-- served_tools --
-- The tool sets a pool's workers started with lately: within an hour of its newest set's start.
SELECT tools FROM pool_toolset
 WHERE pool = %(pool)s
   AND started_at >= (SELECT max(started_at) FROM pool_toolset WHERE pool = %(pool)s)
                     - interval '1 hour';
