"""The run store: the async API every other part of agentrun stands on.

A run is a row in ``agent_run``; its conversation is the append-only log ``agent_step``. Workers
hold runs with short leases; each claim bumps the run's ``lease_epoch`` (a fencing token), and every
write a worker makes checks, in the same statement, that it still holds the run with that epoch.
A worker that lost its lease (it stalled past the TTL and another worker claimed the run, or the run
was cancelled) therefore cannot write, whatever it believes: it gets :class:`LeaseLost`.

The SQL lives in ``agentrun/sql/queries.sql``; this module only binds parameters and turns rows
into typed objects. Every connection is in autocommit mode: the hot-path writes (append, renew,
claim) are each one statement, so one round trip and one transaction.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, Self, overload
from uuid import UUID

import psycopg
from psycopg import sql
from psycopg.rows import class_row, dict_row
from psycopg.types.json import Json, Jsonb
from psycopg_pool import AsyncConnectionPool

from agentrun.config import redact_url
from agentrun.errors import (
    ConfigError,
    DatabaseUnavailable,
    DuplicateStep,
    LeaseLost,
    RunCancelled,
    RunNotFound,
)
from agentrun.manifests import AgentSpec
from agentrun.sql import queries

log = logging.getLogger(__name__)

RunStatus = Literal[
    "pending", "running", "waiting_approval", "succeeded", "failed", "cancelled", "dead_letter"
]
TERMINAL_STATUSES: frozenset[str] = frozenset({"succeeded", "failed", "cancelled", "dead_letter"})
StepKind = Literal["model_turn", "tool_result", "user", "note"]

#: Notification channels (see docs/store.md).
CHANNEL_RUN_CHANGED = "agentrun_run_changed"
CHANNEL_RUN_READY = "agentrun_run_ready"

#: Default lease TTL in seconds. Short, so a dead worker's run waits at most this long; workers
#: renew with every commit and from a heartbeat at a third of the TTL.
DEFAULT_LEASE_TTL = 15.0


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True)
class PromptVersion:
    """What a run sends besides its conversation: pinned, content-addressed, write-once."""

    model: str
    system: str
    tools: list[dict[str, Any]]
    params: dict[str, Any] = field(default_factory=dict)  # max_tokens, thinking

    @property
    def id(self) -> str:
        body = canonical_json(
            {"model": self.model, "system": self.system, "tools": self.tools, "params": self.params}
        )
        return hashlib.sha256(body.encode()).hexdigest()


def k8s_key(uid: str) -> str:
    """The external key of the run of the AgentRun object with this uid."""
    return f"k8s:{uid}"


@dataclass(frozen=True)
class K8sRef:
    namespace: str
    name: str
    uid: str


@dataclass
class Run:
    id: UUID
    external_key: str | None
    k8s_namespace: str | None
    k8s_name: str | None
    k8s_uid: str | None
    pool: str
    status: str
    task: str
    model: str
    agent_spec: dict[str, Any]
    prompt_version: str | None
    max_steps: int
    max_attempts: int
    lease_owner: str | None
    lease_until: datetime | None
    lease_epoch: int
    attempt: int
    next_seq: int
    result: str | None
    error: str | None
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    wait_reason: str | None = None
    pending_call: dict[str, Any] | None = None
    rollback_reason: str | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    # The last tool call marked before it was invoked (migration 0005); after a takeover from a
    # worker that died inside it, also that worker's "lease_until".
    tool_call: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.status in TERMINAL_STATUSES


@dataclass(frozen=True)
class Lease:
    """Proof of a claim: only the holder of the current epoch may write to the run."""

    run_id: UUID
    worker: str
    epoch: int


@dataclass
class Step:
    run_id: UUID
    seq: int
    kind: str
    payload: Any
    request_id: str | None
    lease_epoch: int
    worker: str
    created_at: datetime


@dataclass(frozen=True)
class Effect:
    """A recorded side effect of one non-idempotent or irreversible call."""

    seq: int
    call_index: int
    idempotency_key: str
    tool: str
    tool_kind: str
    state: str  # "intent" (called, outcome unknown) | "done"
    result: dict[str, Any] | None
    input: dict[str, Any]
    compensate: str | None


@dataclass(frozen=True)
class Approval:
    decision: str  # "approved" | "rejected"
    decided_by: str
    reason: str | None
    decided_at: datetime


@dataclass(frozen=True)
class ClaimResult:
    claimed: list[tuple[Run, Lease]]
    dead_lettered: list[Run]


@dataclass(frozen=True)
class PoolDepth:
    pool: str
    pending: int
    running: int
    oldest_pending: datetime | None


@dataclass(frozen=True)
class Notification:
    channel: str
    payload: str

    def json(self) -> Any:
        return json.loads(self.payload)


def parse_run_id(value: str | UUID) -> UUID:
    if isinstance(value, UUID):
        return value
    try:
        return UUID(value)
    except ValueError:
        raise ConfigError(
            f"{value!r} is not a run id (a UUID, as printed by agentrun runs)"
        ) from None


async def check_connect(url: str, connect_timeout: float = 5.0) -> None:
    """Connect once, turning any failure into a one-line :class:`DatabaseUnavailable`."""
    try:
        timeout = max(1, int(connect_timeout))
        conn = await psycopg.AsyncConnection.connect(url, connect_timeout=timeout)
    except psycopg.OperationalError as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise DatabaseUnavailable(
            f"cannot connect to PostgreSQL at {redact_url(url)}: {redact_url(reason)}"
        ) from None
    await conn.close()


def prepare_threshold() -> int | None:
    """Prepare each statement on its first use (0) unless AGENTRUN_PREPARE_THRESHOLD says
    otherwise ("off" behind PgBouncer in transaction mode, which cannot keep prepared statements).

    Our statements are a small fixed set. With psycopg's default (5 uses per connection) a pool
    spreads a rare query such as the claim over its connections and re-plans it nearly every time:
    claims measured up to 2.4x the single-connection baseline before this; appends were unaffected.
    """
    raw = os.environ.get("AGENTRUN_PREPARE_THRESHOLD", "0").strip().lower()
    if raw in ("off", "none", "no"):
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(
            f"AGENTRUN_PREPARE_THRESHOLD={raw!r}: expected a number or 'off'"
        ) from None


class Store:
    """Async access to runs and steps over a psycopg connection pool."""

    def __init__(
        self, pool: AsyncConnectionPool, url: str, *, lease_ttl: float = DEFAULT_LEASE_TTL
    ) -> None:
        self.pool = pool
        self.url = url
        self.lease_ttl = lease_ttl

    @classmethod
    async def open(
        cls,
        url: str,
        *,
        min_size: int = 1,
        max_size: int = 10,
        lease_ttl: float = DEFAULT_LEASE_TTL,
        connect_timeout: float = 5.0,
        pool_timeout: float = 30.0,
    ) -> Self:
        """``pool_timeout``: how long a query waits for a pooled connection (through an outage)
        before it fails; the operator keeps it short to report a database outage quickly."""
        await check_connect(url, connect_timeout)
        pool: AsyncConnectionPool = AsyncConnectionPool(
            url,
            min_size=min_size,
            max_size=max_size,
            kwargs={"autocommit": True, "prepare_threshold": prepare_threshold()},
            open=False,
            name="agentrun",
            timeout=pool_timeout,
            # A connection broken by a database restart is discarded when returned; the caller's
            # retry gets a fresh one. reconnect_timeout keeps the pool trying through an outage.
            reconnect_timeout=3600,
        )
        await pool.open(wait=True, timeout=connect_timeout)
        return cls(pool, url, lease_ttl=lease_ttl)

    async def close(self) -> None:
        await self.pool.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- prompt versions -----------------------------------------------------------------------

    async def ensure_prompt_version(self, pv: PromptVersion) -> str:
        async with self.pool.connection() as conn:
            await conn.execute(
                queries["insert_prompt_version"],
                {
                    "id": pv.id,
                    "model": pv.model,
                    "system": pv.system,
                    "tools": Json(pv.tools, dumps=canonical_json),
                    "params": Json(pv.params, dumps=canonical_json),
                },
            )
        return pv.id

    async def get_prompt_version(self, version_id: str) -> PromptVersion:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(queries["get_prompt_version"], {"id": version_id})
            row = await cur.fetchone()
        if row is None:
            raise ConfigError(f"no prompt version {version_id}")
        return PromptVersion(
            model=row["model"],
            system=row["system"],
            tools=json.loads(row["tools"]),
            params=json.loads(row["params"]),
        )

    # -- runs ----------------------------------------------------------------------------------

    async def create_run(
        self,
        task: str,
        agent: AgentSpec,
        *,
        pool: str | None = None,
        max_steps: int = 50,
        max_attempts: int = 8,
        external_key: str | None = None,
        k8s: K8sRef | None = None,
    ) -> tuple[Run, bool]:
        """Create a run pinned to ``agent`` (model, system prompt, tool names, params);
        idempotent on ``external_key`` (for an AgentRun object: ``k8s:<uid>``). Returns the run
        and whether this call created it."""
        if k8s is not None and external_key is None:
            external_key = k8s_key(k8s.uid)
        params = {
            "external_key": external_key,
            "k8s_namespace": k8s.namespace if k8s else None,
            "k8s_name": k8s.name if k8s else None,
            "k8s_uid": k8s.uid if k8s else None,
            "pool": pool or agent.pool,
            "task": task,
            "model": agent.model,
            "agent_spec": Jsonb(agent.pinned()),
            "max_steps": max_steps,
            "max_attempts": max_attempts,
        }
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=class_row(Run))
            await cur.execute(queries["insert_run"], params)
            created = await cur.fetchone()
            if created is not None:
                return created, True
            if external_key is None:  # pragma: no cover - only a uuid clash could get here
                raise RuntimeError("run insert matched a conflict without an external key")
            await cur.execute(queries["get_run_by_external_key"], {"external_key": external_key})
            existing = await cur.fetchone()
        if existing is None:  # pragma: no cover - k8s_uid clash under a different external key
            raise ConfigError(f"a run for Kubernetes uid {params['k8s_uid']} already exists")
        return existing, False

    async def get_run(self, run_id: str | UUID) -> Run:
        rid = parse_run_id(run_id)
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=class_row(Run))
            await cur.execute(queries["get_run"], {"id": rid})
            run = await cur.fetchone()
        if run is None:
            raise RunNotFound(str(rid))
        return run

    async def list_runs(
        self, *, pool: str | None = None, status: str | None = None, limit: int = 100
    ) -> list[Run]:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=class_row(Run))
            await cur.execute(
                queries["list_runs"], {"pool": pool, "status": status, "limit": limit}
            )
            return await cur.fetchall()

    async def claim(
        self, pool: str, worker: str, limit: int = 1, *, ttl: float | None = None
    ) -> ClaimResult:
        """Claim up to ``limit`` of the oldest claimable runs of ``pool`` for ``worker``."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=class_row(Run))
            await cur.execute(
                queries["claim_runs"],
                {"pool": pool, "worker": worker, "limit": limit, "ttl": ttl or self.lease_ttl},
            )
            rows = await cur.fetchall()
        claimed = [(r, Lease(r.id, worker, r.lease_epoch)) for r in rows if r.status == "running"]
        dead = [r for r in rows if r.status == "dead_letter"]
        for r in dead:
            log.warning(
                "run %s dead-lettered after %d claims", r.id, r.attempt, extra={"run_id": str(r.id)}
            )
        return ClaimResult(claimed=claimed, dead_lettered=dead)

    async def pin_prompt_version(self, lease: Lease, pv: PromptVersion) -> str:
        """Pin ``pv`` on the run unless a prompt version is pinned already; return the pinned id
        (the earlier one wins: a resumed run keeps what it first sent)."""
        await self.ensure_prompt_version(pv)
        row = await self._fenced("pin_prompt_version", lease, prompt_version=pv.id)
        pinned: str = row[0]
        return pinned

    async def renew(self, lease: Lease, *, ttl: float | None = None) -> datetime:
        row = await self._fenced("renew_lease", lease, ttl=ttl)
        until: datetime = row[0]
        return until

    async def append_step(
        self,
        lease: Lease,
        seq: int,
        kind: StepKind,
        payload: Any,
        *,
        request_id: str | None = None,
        ttl: float | None = None,
        input_tokens: int = 0,
        output_tokens: int = 0,
    ) -> datetime:
        """Append step ``seq`` (fenced; renews the lease). Returns its commit time.
        A model turn passes its token usage, summed on the run for ``kubectl get``.

        Raises :class:`LeaseLost` (or :class:`RunCancelled`) when this worker no longer holds the
        run, and :class:`DuplicateStep` when ``seq`` already exists.
        """
        params = self._fence_params(lease, ttl=ttl or self.lease_ttl)
        params.update(
            seq=seq,
            kind=kind,
            payload=Jsonb(payload),
            request_id=request_id,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
        )
        async with self.pool.connection() as conn:
            try:
                cur = await conn.execute(queries["append_step"], params)
            except psycopg.errors.UniqueViolation:
                raise DuplicateStep(str(lease.run_id), seq) from None
            row = await cur.fetchone()
            if row is None:
                raise await self._fence_error(conn, lease)
        created_at: datetime = row[1]
        return created_at

    async def release(self, lease: Lease) -> bool:
        """Hand the run back (draining): claimable at once. False if it was no longer ours."""
        return await self._fenced("release_lease", lease, required=False) is not None

    async def abandon(self, lease: Lease, error: str) -> bool:
        """Give the claim up, keeping the attempt spent (see queries.sql abandon_run)."""
        return await self._fenced("abandon_run", lease, required=False, error=error) is not None

    async def next_lease_expiry(self, pool: str, worker: str) -> float | None:
        """Seconds until the earliest lease of ``pool`` held by another worker expires."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(queries["next_lease_expiry"], {"pool": pool, "worker": worker})
            row = await cur.fetchone()
        if row is None or row[0] is None:
            return None
        return float(row[0].total_seconds())

    async def run_statuses(self, ids: Sequence[UUID]) -> dict[UUID, tuple[str, int]]:
        async with self.pool.connection() as conn:
            cur = await conn.execute(queries["run_statuses"], {"ids": list(ids)})
            return {rid: (status, epoch) for rid, status, epoch in await cur.fetchall()}

    async def finish(
        self,
        lease: Lease,
        status: Literal["succeeded", "failed", "cancelled", "dead_letter"],
        *,
        result: str | None = None,
        error: str | None = None,
    ) -> None:
        await self._fenced("finish_run", lease, status=status, result=result, error=error)

    async def cancel(self, run_id: str | UUID, reason: str | None = None) -> tuple[Run, bool]:
        """Cancel a run that has not finished. Returns the run as it now is and whether this call
        cancelled it (False: it had already finished)."""
        rid = parse_run_id(run_id)
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=class_row(Run))
            await cur.execute(queries["cancel_run"], {"run_id": rid, "reason": reason})
            run = await cur.fetchone()
        return (run, True) if run is not None else (await self.get_run(rid), False)

    # -- side effects and approvals ------------------------------------------------------------

    async def effects(self, run_id: UUID, seq: int) -> dict[int, Effect]:
        """The recorded effects of the calls of turn ``seq``, by call index."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=class_row(Effect))
            await cur.execute(queries["list_effects"], {"run_id": run_id, "seq": seq})
            return {e.call_index: e for e in await cur.fetchall()}

    async def record_effect(
        self,
        lease: Lease,
        seq: int,
        call_index: int,
        *,
        key: str,
        tool: str,
        tool_kind: str,
        state: Literal["intent", "done"],
        result: dict[str, Any] | None = None,
        tool_input: dict[str, Any] | None = None,
        compensate: str | None = None,
    ) -> None:
        """Record an intent or an outcome (fenced: LeaseLost if the run is no longer ours)."""
        params = self._fence_params(lease)
        params.update(
            seq=seq,
            call_index=call_index,
            key=key,
            tool=tool,
            tool_kind=tool_kind,
            state=state,
            result=Jsonb(result) if result is not None else None,
            input=Jsonb(tool_input or {}),
            compensate=compensate,
        )
        async with self.pool.connection() as conn:
            cur = await conn.execute(queries["record_effect"], params)
            if await cur.fetchone() is None:
                check = await conn.cursor(row_factory=dict_row).execute(
                    queries["fence_state"], {"run_id": lease.run_id}
                )
                row = await check.fetchone()
                held = (
                    row is not None
                    and row["status"] == "running"
                    and (row["lease_owner"], row["lease_epoch"]) == (lease.worker, lease.epoch)
                )
                if not held:
                    raise await self._fence_error(conn, lease)
                # Held, and the row was there already (an intent recorded twice, or an outcome
                # already done): nothing to change.

    async def compensations_due(self, run_id: UUID) -> list[Effect]:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=class_row(Effect))
            await cur.execute(queries["compensations_due"], {"run_id": run_id})
            return await cur.fetchall()

    async def begin_rollback(self, lease: Lease, reason: str) -> str:
        """Mark the run as rolling back (once; the first reason stays). Fenced."""
        row = await self._fenced("begin_rollback", lease, reason=reason)
        pinned: str = row[0]
        return pinned

    async def begin_tool_call(self, lease: Lease, call: dict[str, Any]) -> None:
        """Mark the tool call about to be invoked (fenced; renews the lease). Raises
        :class:`LeaseLost` when this worker no longer holds the run: the call must not start."""
        await self._fenced("begin_tool_call", lease, tool_call=Jsonb(call))

    async def wait_for_approval(
        self, lease: Lease, reason: str, pending_call: dict[str, Any]
    ) -> None:
        await self._fenced(
            "wait_for_approval", lease, reason=reason, pending_call=Jsonb(pending_call)
        )

    async def get_approval(
        self, run_id: UUID, seq: int, call_index: int, stage: str
    ) -> Approval | None:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=class_row(Approval))
            await cur.execute(
                queries["get_approval"],
                {"run_id": run_id, "seq": seq, "call_index": call_index, "stage": stage},
            )
            return await cur.fetchone()

    async def decide(
        self,
        run_id: str | UUID,
        seq: int,
        decision: Literal["approved", "rejected"],
        *,
        decided_by: str,
        reason: str | None = None,
        abort: bool = False,
    ) -> dict[str, Any]:
        """Record a human decision on the call a run waits on; the run is claimable again.
        ``abort`` (with a rejection) ends the run instead, compensating what it did.
        Returns the call that was decided."""
        rid = parse_run_id(run_id)
        async with self.pool.connection() as conn, conn.transaction():
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(queries["pending_call"], {"run_id": rid})
            row = await cur.fetchone()
            if row is None:
                raise RunNotFound(str(rid))
            pending = row["pending_call"]
            if row["status"] != "waiting_approval" or pending is None:
                raise ConfigError(f"run {rid} is not waiting for approval (it is {row['status']})")
            if int(pending["seq"]) != seq:
                raise ConfigError(
                    f"run {rid} waits on step {pending['seq']} ({pending['tool']}), not step {seq}"
                )
            await cur.execute(
                queries["insert_approval"],
                {
                    "run_id": rid,
                    "seq": seq,
                    "call_index": pending["call_index"],
                    "stage": pending["stage"],
                    "decision": decision,
                    "decided_by": decided_by,
                    "reason": reason,
                },
            )
            if abort:
                why = f"rejected by {decided_by}" + (f": {reason}" if reason else "")
                await cur.execute(queries["request_rollback"], {"run_id": rid, "reason": why})
            else:
                await cur.execute(queries["resume_after_decision"], {"run_id": rid, "seq": seq})
        return dict(pending)

    async def request_rollback(self, run_id: str | UUID, reason: str) -> tuple[Run, bool]:
        """Ask for the run's compensations to run and the run to end (see queries.sql).
        Returns the run and whether the request was recorded (False: already finished)."""
        rid = parse_run_id(run_id)
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=class_row(Run))
            await cur.execute(queries["request_rollback"], {"run_id": rid, "reason": reason})
            run = await cur.fetchone()
        return (run, True) if run is not None else (await self.get_run(rid), False)

    # -- steps and depth -----------------------------------------------------------------------

    async def steps(self, run_id: str | UUID) -> list[Step]:
        rid = parse_run_id(run_id)
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=class_row(Step))
            await cur.execute(queries["list_steps"], {"run_id": rid})
            return await cur.fetchall()

    async def pool_depth(self) -> dict[str, PoolDepth]:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=class_row(PoolDepth))
            await cur.execute(queries["pool_depth"])
            return {d.pool: d for d in await cur.fetchall()}

    # -- what the operator reads -----------------------------------------------------------------

    async def get_run_by_k8s_uid(self, uid: str) -> Run | None:
        return await self._one_run("get_run_by_external_key", external_key=k8s_key(uid))

    async def k8s_runs(self, ids: Sequence[UUID]) -> list[Run]:
        """The runs among ``ids`` that belong to AgentRun objects."""
        return await self._runs("k8s_runs_by_id", ids=list(ids))

    async def k8s_live_runs(self) -> list[Run]:
        """Every unfinished run that belongs to an AgentRun object."""
        return await self._runs("k8s_live_runs")

    async def runs_by_status(self) -> dict[tuple[str, str], int]:
        """(pool, status) -> number of runs, finished ones included."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(queries["runs_by_status"])
            return {(r[0], r[1]): int(r[2]) for r in await cur.fetchall()}

    async def last_writer(self, run_id: UUID) -> str | None:
        """The worker id that committed the run's last step (None: no step yet)."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(queries["last_writer"], {"run_id": run_id})
            row = await cur.fetchone()
        return str(row[0]) if row else None

    async def note_dead_letter(self, run_id: UUID, note: str) -> None:
        """Append ``note`` to a dead-lettered run's error (once; other runs are untouched)."""
        async with self.pool.connection() as conn:
            await conn.execute(queries["note_dead_letter"], {"run_id": run_id, "note": note})

    async def lease_holders(self, pool: str) -> dict[str, int]:
        """worker id -> runs of ``pool`` it holds."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(queries["lease_holders"], {"pool": pool})
            return {r[0]: int(r[1]) for r in await cur.fetchall()}

    async def _one_run(self, query: str, **params: Any) -> Run | None:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=class_row(Run))
            await cur.execute(queries[query], params)
            return await cur.fetchone()

    async def _runs(self, query: str, **params: Any) -> list[Run]:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=class_row(Run))
            await cur.execute(queries[query], params)
            return await cur.fetchall()

    # -- notifications -------------------------------------------------------------------------

    async def listen(
        self, channels: Sequence[str] = (CHANNEL_RUN_CHANGED, CHANNEL_RUN_READY)
    ) -> AsyncIterator[Notification]:
        """Yield notifications from a dedicated connection (LISTEN needs one connection for its
        whole life, so it does not come from the pool). The generator ends with an
        OperationalError when the connection drops; callers reconnect."""
        conn = await psycopg.AsyncConnection.connect(self.url, autocommit=True)
        try:
            for channel in channels:
                await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
            async for n in conn.notifies():
                yield Notification(n.channel, n.payload)
        finally:
            await conn.close()

    # -- internals -----------------------------------------------------------------------------

    def _fence_params(self, lease: Lease, *, ttl: float | None = None) -> dict[str, Any]:
        return {
            "run_id": lease.run_id,
            "worker": lease.worker,
            "epoch": lease.epoch,
            "ttl": ttl if ttl is not None else self.lease_ttl,
        }

    @overload
    async def _fenced(
        self,
        name: str,
        lease: Lease,
        *,
        required: Literal[True] = ...,
        ttl: float | None = ...,
        **extra: Any,
    ) -> tuple[Any, ...]: ...

    @overload
    async def _fenced(
        self,
        name: str,
        lease: Lease,
        *,
        required: Literal[False],
        ttl: float | None = ...,
        **extra: Any,
    ) -> tuple[Any, ...] | None: ...

    async def _fenced(
        self,
        name: str,
        lease: Lease,
        *,
        required: bool = True,
        ttl: float | None = None,
        **extra: Any,
    ) -> tuple[Any, ...] | None:
        """Run one fenced statement of queries.sql (it matches only while ``lease`` holds the
        running run). No match: None, or with ``required`` the error that says why."""
        params = self._fence_params(lease, ttl=ttl)
        params.update(extra)
        async with self.pool.connection() as conn:
            cur = await conn.execute(queries[name], params)
            row = await cur.fetchone()
            if row is None and required:
                raise await self._fence_error(conn, lease)
        return row

    async def _fence_error(self, conn: psycopg.AsyncConnection[Any], lease: Lease) -> Exception:
        """Explain why a fenced write matched nothing."""
        cur = conn.cursor(row_factory=dict_row)
        await cur.execute(queries["fence_state"], {"run_id": lease.run_id})
        row = await cur.fetchone()
        rid = str(lease.run_id)
        if row is None:
            return RunNotFound(rid)
        if row["status"] == "cancelled":
            return RunCancelled(rid)
        if row["lease_epoch"] != lease.epoch:
            return LeaseLost(
                rid,
                f"claimed again (epoch {row['lease_epoch']}, by {row['lease_owner']}); "
                f"this worker held epoch {lease.epoch}",
            )
        return LeaseLost(rid, f"run is {row['status']}, no longer running under this lease")
