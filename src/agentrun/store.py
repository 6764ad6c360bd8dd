"""The run store: the async API every other part of agentrun stands on.

A run is a row in ``agent_run``; its conversation is the append-only log ``agent_step``. Workers
hold runs with short leases; each claim bumps the run's ``lease_epoch`` (a fencing token), and every
write a worker makes checks, in the same statement, that it still holds the run with that epoch.
A worker that lost its lease (it stalled past the TTL and another worker claimed the run, or the run
was cancelled) therefore cannot write, whatever it believes: it gets :class:`LeaseLost`.

The SQL lives in ``agentrun/sql/queries.sql``; this module only binds parameters and turns rows
into typed objects. Every connection is in autocommit mode: the hot-path writes (append, renew,
claim) are each one statement, so one round trip and one transaction.

Every connection agentrun opens to its database (the pool, the LISTEN connection, the one-off ones
of the CLI, the worker's start-up and the operator's migrations) goes through :func:`connect` or
:meth:`Store.open`, which add the same :class:`ConnectOptions`: TCP keepalives and
``tcp_user_timeout``, so a connection whose peer vanished without a RST or FIN (a dead node, a
dropped NAT entry) fails within seconds instead of the kernel's ~15 minutes of retransmissions,
and ``statement_timeout`` / ``idle_in_transaction_session_timeout``, so no statement or forgotten
transaction holds locks for ever.
"""

from __future__ import annotations

import copy
import decimal
import hashlib
import json
import logging
import math
import os
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, fields, replace
from datetime import datetime
from functools import cached_property
from typing import Any, Literal, Self, TypeVar, overload
from uuid import UUID

import psycopg
from psycopg import sql
from psycopg.abc import Buffer
from psycopg.adapt import AdaptersMap
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import BaseRowFactory, RowMaker, dict_row
from psycopg.types.json import Json, Jsonb, set_json_dumps, set_json_loads
from psycopg.types.string import (
    StrBinaryDumper,
    StrDumper,
    StrDumperUnknown,
    TextBinaryLoader,
    TextLoader,
)
from psycopg_pool import AsyncConnectionPool

from agentrun.canonical import canonical_json
from agentrun.config import (
    DATABASE_URL_ENV,
    env_float,
    login_refused,
    redact_message,
    redact_url,
    setting_refused,
)
from agentrun.errors import (
    ConfigError,
    DatabaseUnavailable,
    DuplicateStep,
    LeaseLost,
    RollbackRequested,
    RunCancelled,
    RunNotFound,
)
from agentrun.group_commit import AppendStats, GroupCommit
from agentrun.manifests import (
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_MAX_STEPS,
    DEFAULT_PROVIDER,
    AgentSpec,
    PinnedAgentSpec,
    pool_problem,
)
from agentrun.sent import StoreConnection, last_message_queued
from agentrun.sql import queries
from agentrun.tools import idempotency_key, tool_uses
from agentrun.vocabulary import (
    TERMINAL_STATUSES,
    EffectState,
    HandoverKind,
    RollbackEnd,
    RunStatus,
    StepKind,
    TerminalStatus,
    Verdict,
    rollback_reason,
)
from agentrun.waits import WaitRef, describe_wait

log = logging.getLogger(__name__)


#: Notification channels (see docs/store.md).
CHANNEL_RUN_CHANGED = "agentrun_run_changed"
CHANNEL_RUN_READY = "agentrun_run_ready"
#: Payload: the run id. Sent by an append only while the run has a follower (migration 0009).
CHANNEL_RUN_STEPS = "agentrun_run_steps"

#: How long a follower's registration (:meth:`Store.follow_run`) holds unless renewed: a follower
#: that dies without deleting its row stops costing appends a NOTIFY after this long.
FOLLOWER_LEASE = 60.0

#: The longest external key (a client's idempotency key) a run takes, in UTF-8 bytes: past
#: about 2,700 the unique index refuses it, as a database error (1,024 characters of emoji were).
MAX_EXTERNAL_KEY = 1024

#: The most runs one listing returns (agentrun runs --limit, Client.list(limit=)).
MAX_LIST = 100_000

#: Default lease TTL in seconds (the store's, the worker's --lease-ttl). Short, so a dead
#: worker's run waits at most this long; workers renew with every commit and from a heartbeat at
#: a third of the TTL. 15 s: a SIGKILLed worker's runs resume 15 s later, while a GC pause, a slow
#: commit or a database fail-over shorter than that costs nothing. Renewals (every 5 s, only when
#: no commit renewed) cost 0.2 queries/s per held run. The seed's 60 s made every crash cost a
#: minute.
DEFAULT_LEASE_TTL = 15.0

#: Errors that mean "the database is not answering" (an outage: back off and retry, or let the
#: lease run out), as opposed to a bug or a bad schema, which are logged with their traceback.
#: The worker's and the operator's one list (psycopg_pool's PoolTimeout is an OperationalError).
DB_ERRORS: tuple[type[BaseException], ...] = (
    psycopg.OperationalError,
    psycopg.InterfaceError,
    DatabaseUnavailable,
    OSError,
)


#: The environment variables of :class:`ConnectOptions` (docs/worker.md, "Database connections").
TCP_TIMEOUT_ENV = "AGENTRUN_DB_TCP_TIMEOUT"
STATEMENT_TIMEOUT_ENV = "AGENTRUN_DB_STATEMENT_TIMEOUT"
#: The longest either may be, in seconds.
MAX_DB_TIMEOUT = 86400.0


@dataclass(frozen=True)
class ConnectOptions:
    """What every agentrun connection to PostgreSQL is opened with (read from the environment
    once, by :meth:`from_env`; a value in the database URL itself wins over these).

    ``tcp_timeout``: a connection whose peer is gone is closed after this long, idle or busy:
    keepalive probes start after a third of it and are sent every sixth (4 unanswered probes end
    it), and ``tcp_user_timeout`` ends it when sent data stays unacknowledged that long.
    ``statement_timeout``: the server cancels any statement (and ends any session idle inside a
    transaction) that takes longer. 0 turns either off. ``connect_timeout``: a new connection
    that gets no answer (a black-holed address) fails after this long.
    """

    tcp_timeout: float = 30.0
    statement_timeout: float = 30.0
    connect_timeout: float = 10.0

    @classmethod
    def from_env(cls) -> ConnectOptions:
        opts = cls(
            tcp_timeout=env_float(TCP_TIMEOUT_ENV, cls.tcp_timeout),
            statement_timeout=env_float(STATEMENT_TIMEOUT_ENV, cls.statement_timeout),
        )
        for env, value in ((TCP_TIMEOUT_ENV, opts.tcp_timeout),
                           (STATEMENT_TIMEOUT_ENV, opts.statement_timeout)):
            # A day at most: libpq and the kernel take these in int milliseconds and 16-bit
            # seconds (TCP_KEEPIDLE); nan, inf or 1e7 was a traceback, or a refusal at connect
            # time that read like an outage.
            if not 0 <= value <= MAX_DB_TIMEOUT:
                raise ConfigError(f"{env}={value:g}: must be from 0 to {MAX_DB_TIMEOUT:g} "
                                  "seconds (0 turns it off)")
        return opts

    def libpq(self, url: str, *, statement_timeout: float | None = None) -> dict[str, Any]:
        """The libpq parameters to add to ``url`` (only those it does not set itself).
        ``statement_timeout`` overrides the configured one (0: none, for migrations)."""
        given = conninfo_to_dict(url)
        params: dict[str, Any] = {"connect_timeout": max(1, round(self.connect_timeout))}
        if self.tcp_timeout > 0:
            t = self.tcp_timeout
            params.update(
                keepalives=1,
                keepalives_idle=max(1, round(t / 3)),
                keepalives_interval=max(1, round(t / 6)),
                keepalives_count=4,
                tcp_user_timeout=max(1, round(t * 1000)),
            )
        params = {k: v for k, v in params.items() if k not in given}
        if self.statement_timeout == 0:
            # Nothing to send: PgBouncer refuses the `options` startup parameter unless told to
            # ignore it, so behind one the timeouts are set on the role instead (docs/worker.md).
            return params
        stmt = self.statement_timeout if statement_timeout is None else statement_timeout
        gucs = (
            f"-c statement_timeout={round(stmt * 1000)} "
            f"-c idle_in_transaction_session_timeout={round(self.statement_timeout * 1000)}"
        )
        # The URL's own -c options come after ours, so they win.
        params["options"] = f"{gucs} {given['options']}" if given.get("options") else gucs
        return params


class StalePlan(DatabaseUnavailable):
    """A prepared statement a migration outdated, met inside a transaction (so not sent again
    here): the transaction's rollback makes psycopg forget its prepared statements, and the
    statement tried again is prepared anew."""


class StoreCursor(psycopg.AsyncCursor[Any]):
    """The cursor of every store connection: a statement prepared before a migration changed
    its result (``agentrun migrate`` of a newer release, which the chart's operator runs at its
    start, beside the workers and CLIs of the old one) is prepared anew and sent again. Every
    worker, ``wait`` and ``logs -f`` died with a traceback at its next statement before.

    Sent again only outside a transaction: the statement failed whole before it ran (the check is
    the plan's revalidation), so it did nothing. Inside one, :class:`StalePlan` is raised and the
    caller's retry (an outage's) sends it in a fresh transaction."""

    async def execute(
        self, query: Any, params: Any = None, *, prepare: bool | None = None,
        binary: bool | None = None,
    ) -> Self:
        try:
            return await super().execute(query, params, prepare=prepare, binary=binary)
        except psycopg.errors.FeatureNotSupported as exc:
            # "cached plan must not change result type": a migration added a column under a
            # SELECT * or RETURNING *. Told by the routine, which is not translated.
            if exc.diag.source_function != "RevalidateCachedQuery":
                raise
            if self.connection.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                raise StalePlan(f"the schema changed under a prepared statement: {exc}") from exc
            # psycopg forgets its own prepared statements when it sees this command succeed.
            await self.connection.execute("DEALLOCATE ALL")
            return await super().execute(query, params, prepare=prepare, binary=binary)

    # The two ways psycopg queues a statement's last message (a first use's Parse, sent and
    # answered before it, is neither): agentrun/sent.py's callback waits for this, then a flush.
    def _send_query_prepared(self, *args: Any, **kwargs: Any) -> None:
        super()._send_query_prepared(*args, **kwargs)
        last_message_queued(self.connection)

    def _execute_send(self, *args: Any, **kwargs: Any) -> None:
        super()._execute_send(*args, **kwargs)
        last_message_queued(self.connection)


async def connect(
    url: str,
    *,
    options: ConnectOptions | None = None,
    statement_timeout: float | None = None,
    autocommit: bool = True,
    **kwargs: Any,
) -> psycopg.AsyncConnection[Any]:
    """Open one connection with agentrun's :class:`ConnectOptions` (the only way agentrun opens
    a connection outside the pool). ``statement_timeout`` overrides the configured one."""
    opts = options or ConnectOptions.from_env()
    params = opts.libpq(url, statement_timeout=statement_timeout)
    kwargs.setdefault("cursor_factory", StoreCursor)
    return await StoreConnection.connect(url, autocommit=autocommit, **params, **kwargs)


# -- what PostgreSQL cannot hold -------------------------------------------------------------------
#
# A tool's output or a model's text may contain NUL (text and jsonb refuse U+0000) or a lone
# surrogate (U+D800-U+DFFF: not Unicode scalar values, so they have no UTF-8 form and jsonb refuses
# their escapes). Refused, such a step was abandoned and re-claimed until the run was dead-lettered,
# re-running its tools each time. Instead every string the store writes (text parameters, and
# every string and key inside JSON) is escaped losslessly, and every string it reads is unescaped:
# callers put in and get back exactly the same Python strings. The escape character is U+FFFF, a
# noncharacter ("permanently reserved for internal use"), so ordinary text is stored unchanged:
#
#     U+0000 -> U+FFFF "0"     a lone surrogate U+Dxxx -> U+FFFF "dxxx"     U+FFFF -> U+FFFF U+FFFF
#
# The escaping is applied in one place: the adapters of every connection the store opens
# (STORE_ADAPTERS below), so no query can forget it. SQL that reads such a string sees its
# escaped form (payload ->> 'content' of such a step starts with the escape); it is
# concatenated and compared consistently, since the escape works character by character.

ESCAPE = "\uffff"
_TO_ESCAPE = re.compile("[\x00\ud800-\udfff\uffff]")
_ESCAPED = re.compile("\uffff(0|\uffff|d[89a-f][0-9a-f]{2})")
#: In JSON text: a NUL escape, a raw surrogate or the escape character (false positives only cost
#: a walk over the value).
_JSON_NEEDS_ESCAPE = re.compile("\\\\u0000|[\ud800-\udfff\uffff]")
_ESCAPE_UTF8 = ESCAPE.encode()


def _escape_char(m: re.Match[str]) -> str:
    c = m.group()
    if c == "\x00":
        return ESCAPE + "0"
    if c == ESCAPE:
        return ESCAPE + ESCAPE
    return f"{ESCAPE}{ord(c):04x}"


def _unescape_char(m: re.Match[str]) -> str:
    code = m.group(1)
    if code == "0":
        return "\x00"
    if code == ESCAPE:
        return ESCAPE
    return chr(int(code, 16))


def escape_text(value: str) -> str:
    """``value`` as the store writes it: no NUL, no lone surrogate (see above)."""
    return _TO_ESCAPE.sub(_escape_char, value) if _TO_ESCAPE.search(value) else value


def unescape_text(value: str) -> str:
    """The inverse of :func:`escape_text`."""
    return _ESCAPED.sub(_unescape_char, value) if ESCAPE in value else value


def _walk(value: Any, fix: Callable[[str], str]) -> Any:
    if isinstance(value, str):
        return fix(value)
    if isinstance(value, dict):
        return {fix(k) if isinstance(k, str) else k: _walk(v, fix) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_walk(v, fix) for v in value]
    return value


def stored_json(value: Any) -> str:
    """The JSON text the store writes for ``value``: canonical, its strings escaped."""
    text = canonical_json(value)
    if _JSON_NEEDS_ESCAPE.search(text):
        text = canonical_json(_walk(value, escape_text))
    return text


# -- what jsonb does to numbers ------------------------------------------------------------------
#
# jsonb keeps a number as numeric, written back positionally: 1e+16 (how Python writes a float of
# 16 digits or more) comes back as 10000000000000000, an int in Python, and -0.0 as 0.0. A turn
# carried on from its live form would then differ from the same turn read back by a resumed
# worker: the idempotency key of a tool call that takes such a number (hashed from its input), the
# value the tool gets and the bytes of every later request. So a model turn, the one step built
# from JSON the model wrote (a tool's output is text), goes on in its stored form (jsonb_form,
# applied in worker/model_call.py), the value any reader of the log gets.


def _jsonb_changes(value: Any) -> bool:
    # Looked at in every model turn: by exact type (what a JSON parser builds), strings first.
    kind = type(value)
    if kind is str:
        return False
    if kind is dict:
        return any(map(_jsonb_changes, value.values()))
    if kind is list:
        return any(map(_jsonb_changes, value))
    if kind is float:
        # repr writes an exponent from 1e16 up; -0.0 is the one zero numeric has not.
        return (abs(value) >= 1e16 and math.isfinite(value)) or (
            value == 0.0 and math.copysign(1.0, value) < 0)
    return False


def _to_jsonb_form(value: Any) -> Any:
    if isinstance(value, float):
        if value == 0.0:
            return 0.0
        text = repr(value)
        # Exact: the decimal digits Python writes, as numeric keeps them (not the binary value).
        return int(decimal.Decimal(text)) if "e+" in text else value
    if isinstance(value, dict):
        return {k: _to_jsonb_form(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_to_jsonb_form(v) for v in value]
    return value


def jsonb_form(value: Any) -> Any:
    """``value`` as a jsonb column gives it back (see above); ``value`` itself, unchanged and not
    copied, when jsonb would give back the same. Infinities and NaN are left as they are (jsonb
    refuses them)."""
    return _to_jsonb_form(value) if _jsonb_changes(value) else value


def loaded_json(data: bytes | bytearray | memoryview | str) -> Any:
    """The value of JSON text the store wrote (:func:`stored_json`)."""
    raw = bytes(data) if isinstance(data, memoryview | bytearray) else data
    value = json.loads(raw)
    escaped = (ESCAPE in raw) if isinstance(raw, str) else (_ESCAPE_UTF8 in raw)
    return _walk(value, unescape_text) if escaped else value


class _StrDumper(StrDumperUnknown):
    def dump(self, obj: str) -> Buffer | None:
        return super().dump(escape_text(obj))


class _StrTextDumper(StrDumper):
    def dump(self, obj: str) -> Buffer | None:
        return super().dump(escape_text(obj))


class _StrBinaryDumper(StrBinaryDumper):
    def dump(self, obj: str) -> Buffer | None:
        return super().dump(escape_text(obj))


class _TextLoader(TextLoader):
    def load(self, data: Buffer) -> bytes | str:
        value = super().load(data)
        return unescape_text(value) if isinstance(value, str) else value


class _TextBinaryLoader(TextBinaryLoader):
    def load(self, data: Buffer) -> bytes | str:
        value = super().load(data)
        return unescape_text(value) if isinstance(value, str) else value


def _store_adapters() -> AdaptersMap:
    adapters = AdaptersMap(psycopg.adapters)
    # The order matters: the dumper registered last for str is the default (psycopg registers
    # its "unknown"-typed one last too, so a str parameter can stand for any type).
    adapters.register_dumper(str, _StrBinaryDumper)
    adapters.register_dumper(str, _StrTextDumper)
    adapters.register_dumper(str, _StrDumper)
    for oid in ("text", "varchar"):
        adapters.register_loader(oid, _TextLoader)
        adapters.register_loader(oid, _TextBinaryLoader)
    set_json_dumps(stored_json, adapters)
    set_json_loads(loaded_json, adapters)
    return adapters


#: The adapters of every store connection: the escaping above, in both directions.
STORE_ADAPTERS = _store_adapters()


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
        # surrogatepass: a lone surrogate has no UTF-8 form; valid text hashes as before.
        return hashlib.sha256(body.encode("utf-8", "surrogatepass")).hexdigest()


def _prompt_version_params(pv: PromptVersion) -> dict[str, Any]:
    """The parameters of a prompt version's insert (queries.sql insert_prompt_version)."""
    return {
        "id": pv.id,
        "model": pv.model,
        "system": pv.system,
        # No dumps= here: the store's own (stored_json) is canonical and escapes.
        "tools": Json(pv.tools),
        "params": Json(pv.params),
    }


#: The external keys of AgentRun objects' runs start with this; no other run's may.
K8S_KEY_PREFIX = "k8s:"


def k8s_key(uid: str) -> str:
    """The external key of the run of the AgentRun object with this uid."""
    return f"{K8S_KEY_PREFIX}{uid}"


@dataclass(frozen=True)
class ManifestName:
    """The metadata of the AgentRun manifest a run was submitted from without Kubernetes
    (``agentrun submit -f``, ``Client.submit_manifest``): shown as its name, it is no object (it
    has no uid)."""

    namespace: str
    name: str

    @classmethod
    def of(cls, namespace: str | None, name: str) -> ManifestName:
        """A manifest without a namespace is in ``default``, as ``kubectl apply`` would put it."""
        return cls(namespace or "default", name)


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
    status: RunStatus
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
    rollback_end: RollbackEnd | None = None  # what the rollback ends as (migration 0016)
    input_tokens: int = 0
    output_tokens: int = 0
    # Prompt-cache tokens (migration 0010), apart from input_tokens as the API reports them.
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    #: Estimated USD (migration 0011): each model turn priced by the worker that committed it.
    cost_usd: float = 0.0
    #: Claims in a row that committed no step (the poison-run guard dead-letters on this one,
    #: not on ``attempt``); ``claim_seq``: next_seq when the latest claim was made.
    stalled_attempts: int = 0
    claim_seq: int = 0

    @property
    def total_tokens(self) -> int:
        """Every token the run's committed turns used: what ``spec.budget.maxTokens`` counts."""
        return self.input_tokens + self.output_tokens + self.cache_read_tokens + (
            self.cache_write_tokens
        )

    @property
    def rolling_back(self) -> bool:
        """A rollback was asked for or began and the run has not ended: it runs to the end."""
        return self.rollback_reason is not None and not self.finished

    def retried_as(self) -> str:
        """What a retried run does next, for the retry's message (CLI and Event)."""
        if self.rolling_back:
            return (f"it resumes its rollback ({self.rollback_reason}) with a fresh budget of "
                    f"{self.max_attempts} attempts, then ends {self.rollback_end or 'failed'}")
        return (f"it continues from step {self.next_seq} with a fresh budget of "
                f"{self.max_attempts} attempts")
    # The last tool call marked before it was invoked (migration 0005); after a takeover from a
    # worker that died inside it, also that worker's "lease_until".
    tool_call: dict[str, Any] | None = None
    # Retries (migration 0007): how many, the latest one's reason and the error it cleared;
    # restarted_from: the run a restart copied this one's spec from.
    retries: int = 0
    retry_reason: str | None = None
    retried_error: str | None = None
    restarted_from: UUID | None = None
    # Hand-overs (migration 0009): who released the run and when (until the next claim), and
    # the latest change of hands: {"kind": "handed_over" | "lease_expired", "from", "to",
    # "epoch" (the claim that took it over), "step" (where it resumed), "lost_at",
    # "claimed_at"}. Every one is kept in run_handover (Store.handovers).
    released_by: str | None = None
    released_at: datetime | None = None
    handover: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.status in TERMINAL_STATUSES

    @cached_property
    def agent(self) -> AgentSpec:
        """The pinned agent spec, validated back into its model (a ValidationError if it does
        not validate; see :class:`agentrun.manifests.PinnedAgentSpec`). Validated once per Run
        read (the pinned spec never changes): the worker asks for it at every tool call."""
        return PinnedAgentSpec.model_validate(self.agent_spec)

    @property
    def provider(self) -> str:
        """Where the run's model is called (the pinned spec.provider; runs pinned before
        providers existed have none, and called the Anthropic API)."""
        return str(self.agent_spec.get("provider") or DEFAULT_PROVIDER)  # shown, never fails


@dataclass(frozen=True)
class Handover:
    """A run changing hands (the run_handover table): ``kind`` ``handed_over`` (its holder
    released it) or ``lease_expired`` (the holder's lease ran out); ``epoch``: the claim that
    took it over; ``step``: where that claim resumed; ``lost_at``: the release, or the expired
    lease's end."""

    epoch: int
    kind: HandoverKind
    from_worker: str
    to_worker: str | None
    step: int
    lost_at: datetime | None
    claimed_at: datetime


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
    kind: StepKind
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
    # "intent" (called, outcome unknown) | "done" | "unrecorded" (its worker was lost inside the
    # call before recording it: compensations_due only)
    state: str
    result: dict[str, Any] | None
    input: dict[str, Any]
    compensate: str | None
    attempts: int = 1  # execution attempts started (an irreversible call: one per decision)
    # Until when a thread may still be inside the call: a lost worker's (its lease's end plus
    # the call's timeout), or a timed-out call's (its timeout's moment plus the timeout once
    # more); a rollback undoes it only after (migration 0023). None: no such bound.
    busy_until: datetime | None = None


@dataclass(frozen=True)
class Approval:
    decision: str  # "approved" | "rejected"
    decided_by: str
    reason: str | None
    decided_at: datetime
    attempt: int = 1  # the attempt of the call it decides (see migration 0004)


@dataclass(frozen=True)
class ClaimResult:
    claimed: list[tuple[Run, Lease]]
    dead_lettered: list[Run]
    #: Seconds until the earliest lease of another worker in the pool runs out (negative: one
    #: ran out and another claim holds it right now), None if no other worker holds a run: the
    #: claim found out in the same statement, so an idle worker's empty claim is one query.
    next_expiry: float | None = None
    #: When the claim statement was sent (time.monotonic()), once it had a connection: the
    #: leases run from no earlier than this. Taken before the wait for a pooled connection, it
    #: was up to the pool's 30 s early after an outage, and the new lease looked expired at once.
    sent: float = 0.0


@dataclass(frozen=True)
class Quota:
    """A namespace's cap on running runs (migration 0012) and how many it has now."""

    namespace: str
    max_running: int
    running: int


@dataclass(frozen=True)
class PoolDepth:
    pool: str
    pending: int
    running: int
    oldest_pending: datetime | None
    #: Of ``pending``, those a claim passes over while their namespace is at its quota.
    held_back: int = 0

    @property
    def live(self) -> int:
        """The runs that want a worker now: running, or pending and claimable."""
        return self.pending - self.held_back + self.running


@dataclass(frozen=True)
class Probe:
    """What the operator's idle tick reads (:meth:`Store.operator_probe`)."""

    depths: dict[str, PoolDepth]
    #: (live k8s runs, a hash of their ids and updated_at, a hash of the quotas): equal
    #: fingerprints mean nothing the resync reads changed.
    fingerprint: tuple[int, int, int]


@dataclass(frozen=True)
class Notification:
    channel: str
    payload: str

    def json(self) -> Any:
        return loaded_json(self.payload)  # built in SQL from escaped columns


@dataclass(frozen=True)
class PruneBatch:
    """What one batch of :meth:`Store.prune_batch` deleted."""

    runs: int
    steps: int
    effects: int
    approvals: int


#: The statuses a run may be retried from (:meth:`Store.retry`).
RETRYABLE_STATUSES: frozenset[str] = frozenset({"failed", "dead_letter"})


def parse_run_id(value: str | UUID) -> UUID:
    if isinstance(value, UUID):
        return value
    if not isinstance(value, str):  # a Run, a number: an AttributeError from deep in uuid
        raise ConfigError(f"a run id is a UUID or its text (run.id), not {type(value).__name__}")
    try:
        return UUID(value)
    except ValueError:
        raise ConfigError(
            f"{value!r} is not a run id (a UUID, as printed by agentrun runs)"
        ) from None


async def check_connect(
    url: str,
    connect_timeout: float = 5.0,
    options: ConnectOptions | None = None,
    source: str = DATABASE_URL_ENV,
) -> None:
    """Connect once, turning any failure into a one-line :class:`DatabaseUnavailable`, or a
    :class:`ConfigError` that names ``source`` (where the URL came from) when it is the URL's."""
    try:
        opts = replace(options or ConnectOptions.from_env(), connect_timeout=connect_timeout)
        conn = await connect(url, options=opts)
    except psycopg.OperationalError as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        said = redact_message(reason, url)
        if login_refused(reason):
            raise ConfigError(
                f"PostgreSQL at {redact_url(url)} refused the login: {said}; check the user, "
                f"password and database in {source}"
            ) from None
        if setting_refused(reason):
            raise ConfigError(
                f"PostgreSQL at {redact_url(url)} refused a connection setting: {said}; check "
                f"the parameters in {source}"
            ) from None
        raise DatabaseUnavailable(
            f"cannot connect to PostgreSQL at {redact_url(url)}: {said}"
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
        self,
        pool: AsyncConnectionPool,
        url: str,
        *,
        lease_ttl: float = DEFAULT_LEASE_TTL,
        options: ConnectOptions | None = None,
        group_commit: bool = True,
    ) -> None:
        """``group_commit``: concurrent appends go out together, one statement per batch
        (agentrun/group_commit.py); False sends each in a statement of its own, as before."""
        self.pool = pool
        self.url = url
        self.lease_ttl = lease_ttl
        self.options = options or ConnectOptions.from_env()
        #: Statements and rows of the appends (shared by the views of :meth:`with_lease_ttl`).
        self.append_stats = AppendStats()
        self._group: GroupCommit[_Append, datetime, psycopg.AsyncConnection[Any]] | None = (
            GroupCommit(self._send_appends, self.pool.connection, _append_key,
                        alive=lambda conn: not (conn.closed or conn.broken))
            if group_commit else None
        )

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
        options: ConnectOptions | None = None,
        group_commit: bool = True,
        source: str = DATABASE_URL_ENV,
    ) -> Self:
        """``pool_timeout``: how long a query waits for a pooled connection (through an outage)
        before it fails; the operator keeps it short to report a database outage quickly.
        ``source``: where the URL came from, named by an error that blames the URL."""
        opts = options or ConnectOptions.from_env()
        await check_connect(url, connect_timeout, opts, source)
        pool: AsyncConnectionPool = AsyncConnectionPool(
            url,
            min_size=min_size,
            max_size=max_size,
            connection_class=StoreConnection,
            kwargs={
                "autocommit": True,
                "cursor_factory": StoreCursor,
                "prepare_threshold": prepare_threshold(),
                "context": STORE_ADAPTERS,
                **opts.libpq(url),
            },
            open=False,
            name="agentrun",
            timeout=pool_timeout,
            # A connection broken by a database restart is discarded when returned; the caller's
            # retry gets a fresh one. reconnect_timeout keeps the pool trying through an outage.
            reconnect_timeout=3600,
        )
        await pool.open(wait=True, timeout=connect_timeout)
        return cls(pool, url, lease_ttl=lease_ttl, options=opts, group_commit=group_commit)

    def with_lease_ttl(self, lease_ttl: float) -> Self:
        """This store (the same pool) with another lease TTL; itself if it has that one."""
        if lease_ttl == self.lease_ttl:
            return self
        view = copy.copy(self)
        view.lease_ttl = lease_ttl
        return view

    async def close(self) -> None:
        await self.pool.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- prompt versions -----------------------------------------------------------------------

    async def ensure_prompt_version(self, pv: PromptVersion) -> str:
        async with self.pool.connection() as conn:
            await conn.execute(queries["insert_prompt_version"], _prompt_version_params(pv))
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
            # Read as text, already unescaped: a NUL or lone surrogate is a raw character inside
            # a JSON string now, which strict=False accepts.
            tools=json.loads(row["tools"], strict=False),
            params=json.loads(row["params"], strict=False),
        )

    # -- runs ----------------------------------------------------------------------------------

    async def create_run(
        self,
        task: str,
        agent: AgentSpec,
        *,
        pool: str | None = None,
        max_steps: int = DEFAULT_MAX_STEPS,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        external_key: str | None = None,
        k8s: K8sRef | None = None,
        name: ManifestName | None = None,
    ) -> tuple[Run, bool]:
        """Create a run pinned to ``agent`` (model, system prompt, tool names, params);
        idempotent on ``external_key`` (for an AgentRun object: ``k8s:<uid>``). ``name``: the
        manifest name of a run submitted outside Kubernetes (not an object: no uid). Returns the
        run and whether this call created it."""
        if k8s is not None and external_key is None:
            external_key = k8s_key(k8s.uid)
        elif k8s is None and external_key is not None and external_key.startswith(K8S_KEY_PREFIX):
            # Else a client's key could be taken for an AgentRun object's and the operator would
            # adopt that run as the object's (or the object's run be returned to the client).
            raise ConfigError(
                f"the idempotency key {external_key[:80]!r} starts with {K8S_KEY_PREFIX!r}, "
                "which is reserved for the runs of AgentRun objects; choose another key"
            )
        if k8s is not None:
            name = ManifestName(k8s.namespace, k8s.name)
        if (problem := pool_problem(pool or agent.pool)) is not None:
            raise ConfigError(f"pool {(pool or agent.pool)[:80]!r}: {problem}")
        if external_key is not None and not external_key.strip():
            # An unset variable ($KEY) made every such submit the first one's run, silently.
            raise ConfigError("the idempotency key is empty; give one, or none "
                              "(submit --idempotency-key)")
        if external_key is not None and (
                size := len(external_key.encode("utf-8", "surrogatepass"))) > MAX_EXTERNAL_KEY:
            raise ConfigError(
                f"the idempotency key has {size} bytes (UTF-8); at most "
                f"{MAX_EXTERNAL_KEY} (submit --idempotency-key)"
            )
        params = {
            "external_key": external_key,
            "k8s_namespace": name.namespace if name else None,
            "k8s_name": name.name if name else None,
            "k8s_uid": k8s.uid if k8s else None,
            "pool": pool or agent.pool,
            "task": task,
            "model": agent.model,
            "agent_spec": Jsonb(agent.pinned()),
            "max_steps": max_steps,
            "max_attempts": max_attempts,
        }
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=known_row(Run))
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
            cur = conn.cursor(row_factory=known_row(Run))
            await cur.execute(queries["get_run"], {"id": rid})
            run = await cur.fetchone()
        if run is None:
            raise RunNotFound(str(rid))
        return run

    async def list_runs(
        self,
        *,
        pool: str | None = None,
        status: RunStatus | None = None,
        limit: int = 100,
        namespace: str | None = None,
    ) -> list[Run]:
        """The newest runs first; ``namespace``: only runs of that (Kubernetes or manifest)
        namespace."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=known_row(Run))
            await cur.execute(
                queries["list_runs"],
                {"pool": pool, "status": status, "limit": limit, "namespace": namespace},
            )
            return await cur.fetchall()

    async def claim(self, pool: str, worker: str, limit: int = 1) -> ClaimResult:
        """Claim up to ``limit`` of the oldest claimable runs of ``pool`` for ``worker``, within
        the namespaces' quotas."""
        params = {"pool": pool, "worker": worker, "limit": limit, "ttl": self.lease_ttl}
        rows, next_expiry, sent = await self._claim_rows(params)
        claimed = [(r, Lease(r.id, worker, r.lease_epoch)) for r in rows if r.status == "running"]
        dead = [r for r in rows if r.status == "dead_letter"]
        for r in dead:
            log.warning(
                "run %s dead-lettered after %d claims", r.id, r.attempt, extra={"run_id": str(r.id)}
            )
        return ClaimResult(claimed=claimed, dead_lettered=dead, next_expiry=next_expiry,
                           sent=sent)

    # -- tools served ---------------------------------------------------------------------------

    async def register_toolset(self, pool: str, worker: str, tools: list[str]) -> None:
        """Record that ``worker`` of ``pool`` serves ``tools`` (at its start)."""
        names = sorted(set(tools))
        digest = hashlib.sha256("\x1f".join(names).encode()).hexdigest()[:32]
        async with self.pool.connection() as conn:
            await conn.execute(queries["register_toolset"], {
                "pool": pool, "tools_hash": digest, "tools": names, "worker": worker})

    async def served_tools(self, pool: str) -> set[str] | None:
        """The tools ``pool``'s workers serve, from what they registered lately; None when no
        worker of the pool ever registered (nothing is known)."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(queries["served_tools"], {"pool": pool})
            rows = await cur.fetchall()
        if not rows:
            return None
        return {name for (tools,) in rows for name in tools}

    # -- quotas ---------------------------------------------------------------------------------

    async def set_quota(self, namespace: str, max_running: int) -> Quota:
        """Cap ``namespace``'s running runs at ``max_running`` (0: none may start). A new row's
        count is taken while agent_run is SHARE-locked (a few milliseconds in which no run
        changes), so no run leaving 'running' is missed; an existing row keeps its exact count."""
        if max_running < 0:
            raise ConfigError(f"quota of namespace {namespace}: {max_running} is below 0")
        params = {"namespace": namespace, "max_running": max_running}
        async with self.pool.connection() as conn:
            cur = await conn.execute(queries["set_quota_limit"], params)
            row = await cur.fetchone()
            if row is not None:
                return Quota(namespace, max_running, int(row[0]))
            async with conn.transaction():
                await conn.execute(queries["lock_runs_for_quota"])
                cur = await conn.execute(queries["quota_count_running"], params)
                counted = await cur.fetchone()
                running = int(counted[0]) if counted else 0
                await conn.execute(queries["upsert_quota"], {**params, "running": running})
        return Quota(namespace, max_running, running)

    async def delete_quota(self, namespace: str) -> bool:
        """Lift ``namespace``'s quota; False if it had none."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(queries["delete_quota"], {"namespace": namespace})
            return await cur.fetchone() is not None

    async def quotas(self) -> list[Quota]:
        async with self.pool.connection() as conn:
            cur = await conn.execute(queries["list_quotas"])
            return [Quota(str(n), int(m), int(r)) for n, m, r in await cur.fetchall()]

    async def _claim_rows(
        self, params: dict[str, Any], tries: int = 3
    ) -> tuple[list[Run], float | None, float]:
        """The claim statement's runs, its next foreign lease expiry and when it was sent
        (:attr:`ClaimResult.sent`). A claim locks quota rows
        in namespace order; a statement that ends runs of several namespaces at once takes theirs
        in row order. PostgreSQL breaks such a cycle by failing one side: nothing was claimed, so
        claiming again is safe."""
        for attempt in range(1, tries + 1):
            try:
                async with self.pool.connection() as conn:
                    cur = conn.cursor(row_factory=_claim_row)
                    sent = time.monotonic()
                    await cur.execute(queries["claim_runs"], params)
                    rows = await cur.fetchall()
                    break
            except psycopg.errors.DeadlockDetected:
                if attempt == tries:
                    raise
        else:
            raise AssertionError("tries must be at least 1")
        # Every row carries the expiry; a lone row without a run says only that.
        next_expiry = rows[0][1] if rows else None
        return [run for run, _ in rows if run is not None], next_expiry, sent

    async def pin_prompt_version(self, lease: Lease, pv: PromptVersion) -> str:
        """Pin ``pv`` on the run unless a prompt version is pinned already; return the pinned id
        (the earlier one wins: a resumed run keeps what it first sent). ``pv`` is stored as
        :meth:`ensure_prompt_version` stores it, in the same statement."""
        row = await self._fenced("pin_prompt_version", lease, **_prompt_version_params(pv))
        pinned: str = row[0]
        return pinned

    async def renew(self, lease: Lease) -> datetime:
        row = await self._fenced("renew_lease", lease)
        until: datetime = row[0]
        return until

    async def renew_all(self, leases: Sequence[Lease]) -> dict[UUID, Exception]:
        """Renew the leases of one worker in one statement, each fenced on its own epoch (the
        worker's heartbeat, whatever the number of runs it holds). Returns the runs not renewed,
        each with the error a single renewal would have raised (:class:`LeaseLost`,
        :class:`RunCancelled`, :class:`RunNotFound`), read in one more query only then."""
        if not leases:
            return {}
        workers = {lease.worker for lease in leases}
        if len(workers) != 1:
            raise ValueError(f"renew_all renews the leases of one worker, not {sorted(workers)}")
        params = {  # the statement locks the rows in id order itself (queries.sql)
            "worker": workers.pop(),
            "run_ids": [lease.run_id for lease in leases],
            "epochs": [lease.epoch for lease in leases],
            "ttl": self.lease_ttl,
        }
        async with self.pool.connection() as conn:
            for tries_left in (1, 0):
                try:
                    cur = await conn.execute(queries["renew_leases"], params)
                    break
                except ROLLED_BACK:  # nothing was renewed: once more, at once
                    if not tries_left:
                        raise
            renewed = {row[0] for row in await cur.fetchall()}
            lost = [lease for lease in leases if lease.run_id not in renewed]
            if not lost:
                return {}
            explain = conn.cursor(row_factory=dict_row)
            await explain.execute(queries["fence_states"],
                                  {"ids": [lease.run_id for lease in lost]})
            states = {row["id"]: row for row in await explain.fetchall()}
        return {lease.run_id: _fence_error(states.get(lease.run_id), lease) for lease in lost}

    async def append_step(
        self,
        lease: Lease,
        seq: int,
        kind: StepKind,
        payload: Any,
        *,
        request_id: str | None = None,
        input_tokens: int = 0,
        output_tokens: int = 0,
        cache_read_tokens: int = 0,
        cache_write_tokens: int = 0,
        cost_usd: float = 0.0,
        tool_call: dict[str, Any] | None = None,
        on_sent: Callable[[], None] | None = None,
    ) -> datetime:
        """Append step ``seq`` (fenced; renews the lease). Returns its commit time.
        A model turn passes its token usage (input, output, cache read, cache write) and its
        estimated cost, summed on the run for ``kubectl get`` and the budget.

        ``tool_call``: the mark of the call the step leads to at once (the turn's first tool
        call), written in the same statement as :meth:`begin_tool_call` would write it, so that
        call needs no round trip of its own before it starts (issue 17). None leaves the run's
        mark as it is.

        ``on_sent``: called once the statement carrying the append has been written to the
        database's socket whole (agentrun/sent.py), before its answer; never if it was not (the
        connection broke, no connection could be had). From then on the append lands even if
        this process dies, unless it fails for what it is (fenced off, refused).

        Raises :class:`LeaseLost` (or :class:`RunCancelled`) when this worker no longer holds the
        run, and :class:`DuplicateStep` when ``seq`` already exists.

        With group commit (the default) an append made while another is in flight goes out with
        the others that wait, in one statement, each still fenced on its own (docs/store.md,
        "Group commit"); the answer is the same.
        """
        append = _Append(
            lease,
            seq,
            kind,
            Jsonb(payload),
            request_id,
            self.lease_ttl,
            input_tokens,
            output_tokens,
            cache_read_tokens,
            cache_write_tokens,
            cost_usd,
            None if tool_call is None else Jsonb(tool_call),
            on_sent,
        )
        if self._group is None:
            async with self.pool.connection() as conn:
                return await self._append_one(append, conn)
        return await self._group.submit(append)

    async def _append_one(self, a: _Append, conn: psycopg.AsyncConnection[Any]) -> datetime:
        """One append in a statement of its own (queries.sql append_step)."""
        params = self._fence_params(a.lease, ttl=a.ttl)
        params.update(
            seq=a.seq,
            kind=a.kind,
            payload=a.payload,
            request_id=a.request_id,
            input_tokens=a.input_tokens,
            output_tokens=a.output_tokens,
            cache_read_tokens=a.cache_read_tokens,
            cache_write_tokens=a.cache_write_tokens,
            cost_usd=a.cost_usd,
            tool_call=a.tool_call,
        )
        self.append_stats.count(1)
        try:
            with _on_sent(conn, a.on_sent):
                cur = await conn.execute(queries["append_step"], params)
        except psycopg.errors.UniqueViolation:
            raise DuplicateStep(str(a.lease.run_id), a.seq) from None
        row = await cur.fetchone()
        if row is None:
            raise await self._fence_error(conn, a.lease)
        created_at: datetime = row[1]
        return created_at

    async def _send_appends(
        self, batch: Sequence[_Append], conn: psycopg.AsyncConnection[Any]
    ) -> list[datetime | Exception]:
        """A batch of the group commit (distinct runs of one worker): one append_steps
        statement on ``conn``; each append's commit time, or the error its own caller gets."""
        if len(batch) == 1:
            # Alone: the single statement, exactly as without group commit. Its own answer is
            # returned, not raised: the connection is fine, the next batch may use it.
            try:
                return [await self._append_one(batch[0], conn)]
            except (LeaseLost, DuplicateStep, RunNotFound, psycopg.IntegrityError,
                    psycopg.DataError) as exc:
                return [exc]
        worker = batch[0].lease.worker
        # Rows in id order, the order the heartbeat locks them (renew_leases): in their own
        # orders, a batch and the same worker's renewal of the same runs deadlocked, and
        # PostgreSQL failed the whole batch. (The statement reads them by primary key, in that
        # order too; the sorted arrays keep it for a plan that follows the unnest.)
        ordered = sorted(batch, key=lambda a: a.lease.run_id)
        params = {
            "worker": worker,
            "run_ids": [a.lease.run_id for a in ordered],
            "epochs": [a.lease.epoch for a in ordered],
            "seqs": [a.seq for a in ordered],
            "ttls": [float(a.ttl) for a in ordered],
            "input_tokens": [a.input_tokens for a in ordered],
            "output_tokens": [a.output_tokens for a in ordered],
            "cache_read_tokens": [a.cache_read_tokens for a in ordered],
            "cache_write_tokens": [a.cache_write_tokens for a in ordered],
            "cost_usd": [float(a.cost_usd) for a in ordered],
            "kinds": [a.kind for a in ordered],
            "payloads": [a.payload for a in ordered],
            "request_ids": [a.request_id for a in ordered],
            "tool_calls": [a.tool_call for a in ordered],
        }
        self.append_stats.count(len(batch))
        sent = [a.on_sent for a in batch if a.on_sent is not None]

        def all_sent() -> None:
            for callback in sent:
                callback()

        try:
            with _on_sent(conn, all_sent if sent else None):
                cur = await conn.execute(queries["append_steps"], params)
            written: dict[UUID, datetime] = {row[0]: row[1] for row in await cur.fetchall()}
        except (psycopg.IntegrityError, psycopg.DataError, *ROLLED_BACK, TypeError, ValueError):
            # The statement failed whole, so nothing of it was applied: a value a column refuses,
            # a duplicate that raced the statement's check (a concurrent append of the same seq),
            # or a deadlock PostgreSQL broke by failing it; or, before anything was sent, a
            # payload the JSON encoder refuses (a set, an int of 5,000 digits), which failed every
            # run of the batch. Each append again on its own, so each caller gets its own answer.
            self.append_stats.fallbacks += 1
            return await _outcomes(self._append_one(a, conn) for a in batch)
        missed = [a for a in batch if a.lease.run_id not in written]
        states: dict[UUID, dict[str, Any]] = {}
        unexplained: Exception | None = None
        if missed:
            try:
                explain = conn.cursor(row_factory=dict_row)
                await explain.execute(queries["fence_states"],
                                      {"ids": [a.lease.run_id for a in missed]})
                states = {row["id"]: row for row in await explain.fetchall()}
            except psycopg.Error as exc:
                # The batch committed: its written appends stand. Only the missed ones, which
                # were not written anyway, get the error (their runs are dropped as in an outage).
                unexplained = exc
        out: list[datetime | Exception] = []
        for a in batch:
            if a.lease.run_id in written:
                out.append(written[a.lease.run_id])
                continue
            if unexplained is not None:
                out.append(unexplained)
                continue
            state = states.get(a.lease.run_id)
            held = (
                state is not None
                and state["status"] == "running"
                and (state["lease_owner"], state["lease_epoch"]) == (worker, a.lease.epoch)
            )
            # Still held, so the fence let it through: its seq was there already.
            out.append(DuplicateStep(str(a.lease.run_id), a.seq) if held
                       else _fence_error(state, a.lease))
        return out

    async def release(self, lease: Lease) -> bool:
        """Hand the run back (draining): claimable at once. False if it was no longer ours."""
        return await self._fenced("release_lease", lease, required=False) is not None

    async def expire_lease(self, lease: Lease) -> bool:
        """End the lease now, the run left as it is (see queries.sql expire_lease). False if it
        was no longer ours."""
        return await self._fenced("expire_lease", lease, required=False) is not None

    async def abandon(self, lease: Lease, error: str) -> bool:
        """Give the claim up, keeping the attempt spent (see queries.sql abandon_run)."""
        return await self._fenced("abandon_run", lease, required=False, error=error) is not None

    async def run_statuses(self, ids: Sequence[UUID]) -> dict[UUID, tuple[str, int, bool]]:
        """Each run's status, epoch and whether a rollback was asked for."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(queries["run_statuses"], {"ids": list(ids)})
            return {rid: (status, epoch, rollback)
                    for rid, status, epoch, rollback in await cur.fetchall()}

    async def finish(
        self,
        lease: Lease,
        status: TerminalStatus,
        *,
        result: str | None = None,
        error: str | None = None,
    ) -> None:
        """End the run (fenced). Raises :class:`RollbackRequested`, writing nothing, for a
        ``succeeded`` while a rollback was asked for: the caller rolls back instead."""
        params = self._fence_params(lease)
        params.update(status=status, result=result, error=error)
        await self._unless_rolling_back("finish_run", lease, params)

    async def _unless_rolling_back(self, name: str, lease: Lease, params: dict[str, Any]) -> None:
        """A fenced statement that a requested rollback refuses too (finish_run's succeeded,
        wait_for_approval): :class:`RollbackRequested` when that is why it matched nothing."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(queries[name], params)
            if await cur.fetchone() is not None:
                return
            state = await (await conn.execute(queries["fence_state"],
                                              {"run_id": lease.run_id})).fetchone()
            if state is not None and tuple(state) == ("running", lease.worker, lease.epoch, True):
                # Still this lease's: only the statement's rollback guard refuses that.
                raise RollbackRequested(str(lease.run_id))
            raise await self._fence_error(conn, lease)

    async def cancel(self, run_id: str | UUID, reason: str | None = None) -> tuple[Run, bool]:
        """Cancel a run that has not finished. Returns the run as it now is and whether this call
        cancelled it (False: it had already finished, or it is rolling back (``rolling_back``):
        a cancel never interrupts a rollback, which runs to its end)."""
        rid = parse_run_id(run_id)
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=known_row(Run))
            await cur.execute(queries["cancel_run"], {"run_id": rid, "reason": reason})
            run = await cur.fetchone()
        return (run, True) if run is not None else (await self.get_run(rid), False)

    # -- side effects and approvals ------------------------------------------------------------

    async def effects(self, run_id: UUID, seq: int) -> dict[int, Effect]:
        """The recorded effects of the calls of turn ``seq``, by call index."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=known_row(Effect))
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
        state: EffectState,
        result: dict[str, Any] | None = None,
        tool_input: dict[str, Any] | None = None,
        compensate: str | None = None,
        busy_until: datetime | None = None,
    ) -> None:
        """Record an intent or an outcome (fenced: LeaseLost if the run is no longer ours).
        ``busy_until``: see :attr:`Effect.busy_until`."""
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
            busy_until=busy_until,
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

    async def compensations_due(
        self, run_id: UUID, undo: Callable[[str], tuple[str, str] | None] | None = None
    ) -> list[Effect]:
        """The effects a rollback of the run undoes, newest first: those recorded (done, or an
        intent whose outcome is unknown), and before them the compensable call a worker was lost
        inside before recording it (state "unrecorded"; queries.sql lost_call), the newest.

        ``undo``: a tool's compensation and kind, for a lost call whose mark names none (an older
        worker's, written before marks named the undo): a worker's registry knows them. Without
        it (the store alone: is a rollback due?) such a call counts, its compensate None: it may
        be one, and the worker that rolls the run back decides."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=known_row(Effect))
            await cur.execute(queries["compensations_due"], {"run_id": run_id})
            due = await cur.fetchall()
            lost = await (await conn.execute(queries["lost_call"], {"run_id": run_id})).fetchone()
        if lost is None:
            return due
        seq, index, tool, kind, compensate, turn, busy_until = lost
        if compensate is None and undo is not None:
            known = undo(tool)
            if known is None:
                return due  # not a compensable call, as far as this worker's registry knows
            compensate, kind = known
        calls = tool_uses(turn or {})
        if index >= len(calls) or calls[index].get("name") != tool:
            return due  # a mark that does not name this turn's call: nothing to go on
        args = dict(calls[index].get("input") or {})
        key = idempotency_key(str(run_id), seq, tool, args, index)
        return [Effect(seq, index, key, tool, kind, "unrecorded", None, args, compensate,
                       busy_until=busy_until), *due]

    async def begin_rollback(
        self, lease: Lease, reason: str, end: RollbackEnd = "failed"
    ) -> tuple[str, RollbackEnd]:
        """Mark the run as rolling back (once; the first reason and end stay: a requested
        rollback's). Fenced. Returns the stored reason and what the rollback ends as."""
        row = await self._fenced("begin_rollback", lease, reason=reason, end=end)
        return row[0], row[1]

    async def begin_tool_call(self, lease: Lease, call: dict[str, Any]) -> None:
        """Mark the tool call about to be invoked (fenced; renews the lease). Raises
        :class:`LeaseLost` when this worker no longer holds the run: the call must not start."""
        await self._fenced("begin_tool_call", lease, tool_call=Jsonb(call))

    async def wait_for_approval(
        self, lease: Lease, reason: str, pending_call: dict[str, Any]
    ) -> None:
        """Park the run for a human (fenced). Raises :class:`RollbackRequested`, writing
        nothing, once a rollback was asked for: the caller rolls back instead."""
        params = self._fence_params(lease)
        params.update(reason=reason, pending_call=Jsonb(pending_call))
        await self._unless_rolling_back("wait_for_approval", lease, params)

    async def get_approval(
        self, run_id: UUID, seq: int, call_index: int, stage: str, attempt: int = 1
    ) -> Approval | None:
        """The decision on attempt ``attempt`` of a call at ``stage`` ('before_call': may
        attempt 1 start; 'outcome_unknown': attempt n died mid-call, may attempt n + 1 start)."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=known_row(Approval))
            await cur.execute(
                queries["get_approval"],
                {"run_id": run_id, "seq": seq, "call_index": call_index, "stage": stage,
                 "attempt": attempt},
            )
            return await cur.fetchone()

    async def last_approval_on_step(self, run_id: UUID, seq: int) -> Approval | None:
        """The latest decision on any call of step ``seq``."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=known_row(Approval))
            await cur.execute(queries["last_approval_on_step"], {"run_id": run_id, "seq": seq})
            return await cur.fetchone()

    async def retry_intent(self, lease: Lease, seq: int, call_index: int, attempt: int) -> int:
        """Count an approved re-run of an irreversible call (whose attempt ``attempt`` has an
        unknown outcome) before calling it, fenced; returns the new attempt number. A crash
        during the re-run then needs a decision on that attempt: one decision, one execution."""
        row = await self._fenced(
            "retry_intent", lease, required=False, seq=seq, call_index=call_index,
            attempt=attempt,
        )
        if row is None:
            async with self.pool.connection() as conn:
                cur = await conn.execute(queries["fence_state"], {"run_id": lease.run_id})
                state = tuple(await cur.fetchone() or ())[:3]  # status, owner, epoch
                if state != ("running", lease.worker, lease.epoch):
                    raise await self._fence_error(conn, lease)
            # Held, yet the intent is not at that attempt any more: this claim read a stale
            # effect and must not call the tool on its strength.
            raise LeaseLost(str(lease.run_id), f"the intent of step {seq} call {call_index} is "
                            f"no longer at attempt {attempt}; not calling it again")
        attempts: int = row[0]
        return attempts

    async def waited_on(self, run_id: str | UUID) -> dict[str, Any] | None:
        """The call the run waits on, with the attempt :meth:`decide` would record a decision
        against (also when the wait does not name it); None if the run waits on nothing or is
        gone."""
        async with self.pool.connection() as conn, conn.transaction():
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(queries["pending_call"], {"run_id": parse_run_id(run_id)})
            row = await cur.fetchone()
        return None if row is None else _waited_on(row)

    async def decide(
        self,
        run_id: str | UUID,
        wait: int | WaitRef,
        decision: Verdict,
        *,
        decided_by: str,
        reason: str | None = None,
        abort: bool = False,
    ) -> dict[str, Any]:
        """Record a human decision on the call a run waits on; the run is claimable again.
        ``wait``: the wait decided (agentrun/waits.py); a bare step number only while no
        decision on that step is recorded. ``abort`` (with a rejection) ends the run instead,
        compensating what it did. Returns the call that was decided."""
        rid = parse_run_id(run_id)
        ref = WaitRef.named_by(wait, "wait")
        seq = ref.seq
        async with self.pool.connection() as conn, conn.transaction():
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(queries["pending_call"], {"run_id": rid})
            row = await cur.fetchone()
            if row is None:
                raise RunNotFound(str(rid))
            pending = _waited_on(row)
            if pending is None or not ref.answers(pending):
                # A named wait decided before (a second human's, or an operator's replay of
                # the annotation it applied before it was killed) says so: not only where the
                # run is now.
                if ref.named:
                    await cur.execute(queries["get_approval"], {
                        "run_id": rid, "seq": seq, "call_index": ref.call,
                        "stage": "before_call" if ref.attempt is None else "outcome_unknown",
                        "attempt": ref.attempt or 1})
                else:  # a bare step number: the step's last decision
                    await cur.execute(queries["last_approval_on_step"],
                                      {"run_id": rid, "seq": seq})
                earlier = await cur.fetchone()
                before = "" if earlier is None else (
                    f"decided before ({earlier['decision']} by {earlier['decided_by']})")
                what = f"wait {ref}" if ref.named else f"step {seq}"
                if pending is None:
                    raise ConfigError(
                        f"run {rid} is not waiting for approval (it is {row['status']})"
                        + (f"; {what} was {before}" if before else ""))
                if int(pending["seq"]) != seq:
                    raise ConfigError(
                        f"run {rid} waits on step {pending['seq']} ({pending['tool']}), not step "
                        f"{seq}" + (f"; {what} was {before}" if before else ""))
                raise ConfigError(
                    f"run {rid} waits on {describe_wait(pending)}, not {ref}"
                    + (f", which was {before}" if before else "") + "; nothing was recorded")
            if not ref.named:
                # A bare step number may be a decision made on an earlier wait of this step,
                # arriving after that one was decided: never applied to the wait that followed.
                await cur.execute(queries["last_approval_on_step"], {"run_id": rid, "seq": seq})
                first = await cur.fetchone()
                if first is not None:
                    raise ConfigError(
                        f"run {rid}: step {seq} was decided before ({first['decision']} by "
                        f"{first['decided_by']}) and now waits on {describe_wait(pending)}; "
                        f"name that wait to decide it ({WaitRef.of(pending)}); nothing was "
                        "recorded")
            attempt = int(pending["attempt"])
            await cur.execute(
                queries["insert_approval"],
                {
                    "run_id": rid,
                    "seq": seq,
                    "call_index": pending["call_index"],
                    "stage": pending["stage"],
                    "attempt": attempt,
                    "decision": decision,
                    "decided_by": decided_by,
                    "reason": reason,
                },
            )
            if await cur.fetchone() is None:
                # That attempt was decided already, yet the run waits on it: never report a
                # decision that was not recorded, nor resume the run on the earlier one.
                raise ConfigError(
                    f"run {rid}: attempt {attempt} of step {seq} call {pending['call_index']} "
                    f"({pending['tool']}, {str(pending['stage']).replace('_', ' ')}) was decided "
                    "before; nothing was recorded and the run still waits"
                )
            if abort:
                why = rollback_reason("failed", f"rejected by {decided_by}" + (
                    f": {reason}" if reason else ""))
                # The run waits (it is live): what a dead letter's request reads is not needed.
                await cur.execute(queries["request_rollback"],
                                  {"run_id": rid, "reason": why, "end": "failed",
                                   "rollback_due": False})
            else:
                await cur.execute(queries["resume_after_decision"], {"run_id": rid, "seq": seq})
        return dict(pending)

    async def request_rollback(
        self, run_id: str | UUID, end: RollbackEnd, why: str | None = None
    ) -> tuple[Run, bool]:
        """Ask for the run's compensations to run and the run to end as ``end`` (see
        queries.sql; stored beside the reason, migration 0016). A dead-lettered run with
        compensations due rolls back too. Returns the run and whether the request changed it
        (False: already finished, or rolling back already, on a request whose reason and end
        stand; True also for a rollback an older worker parked behind an approval, which it
        resumes, its first reason and end standing)."""
        rid = parse_run_id(run_id)
        reason = rollback_reason(end, why)
        # Read first, not in the statement: only a dead letter needs it, and a finished run's
        # effects do not change (a live one's are the holder's to roll back whatever this says).
        rollback_due = bool(await self.compensations_due(rid))
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=known_row(Run))
            await cur.execute(queries["request_rollback"],
                              {"run_id": rid, "reason": reason, "end": end,
                               "rollback_due": rollback_due})
            run = await cur.fetchone()
        # None: finished, or rolling back already, whose reason and end stand (run.rolling_back
        # says why); the run is unchanged.
        return (run, True) if run is not None else (await self.get_run(rid), False)

    # -- steps and depth -----------------------------------------------------------------------

    async def steps(self, run_id: str | UUID) -> list[Step]:
        rid = parse_run_id(run_id)
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=known_row(Step))
            await cur.execute(queries["list_steps"], {"run_id": rid})
            return await cur.fetchall()

    async def pool_depth(self) -> dict[str, PoolDepth]:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=known_row(PoolDepth))
            await cur.execute(queries["pool_depth"])
            return {d.pool: d for d in await cur.fetchall()}

    async def operator_probe(self) -> Probe:
        """Every pool's depth and a fingerprint of the live k8s runs and the quotas, in one
        statement: the operator's idle tick."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(queries["operator_probe"])
            rows = await cur.fetchall()
        depths = {str(r[0]): PoolDepth(str(r[0]), int(r[1]), int(r[2]), r[3], int(r[7]))
                  for r in rows if r[0] is not None}
        first = rows[0]
        return Probe(depths, (int(first[4]), int(first[5]), int(first[6])))

    async def ping(self) -> None:
        """One round trip through the pool (the operator's readiness check)."""
        async with self.pool.connection() as conn:
            await conn.execute(queries["ping"])

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

    async def handovers(self, run_id: UUID) -> list[Handover]:
        """Every change of hands of the run, oldest first: graceful hand-overs and the claims
        that took over an expired lease (migration 0009)."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=known_row(Handover))
            await cur.execute(queries["run_handovers"], {"run_id": run_id})
            return list(await cur.fetchall())

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
            cur = conn.cursor(row_factory=known_row(Run))
            await cur.execute(queries[query], params)
            return await cur.fetchone()

    async def _runs(self, query: str, **params: Any) -> list[Run]:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=known_row(Run))
            await cur.execute(queries[query], params)
            return await cur.fetchall()

    # -- notifications -------------------------------------------------------------------------

    async def listen(
        self,
        channels: Sequence[str] = (CHANNEL_RUN_CHANGED, CHANNEL_RUN_READY),
        on_listening: Callable[[], None] | None = None,
    ) -> AsyncIterator[Notification]:
        """Yield notifications from a dedicated connection (LISTEN needs one connection for its
        whole life, so it does not come from the pool). ``on_listening`` is called once every
        LISTEN is in place: from then on no notification is missed. The generator ends with an
        OperationalError when the connection drops (its keepalives notice a silent death too);
        callers reconnect."""
        conn = await connect(self.url, options=self.options)
        try:
            for channel in channels:
                await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
            if on_listening is not None:
                on_listening()
            async for n in conn.notifies():
                yield Notification(n.channel, n.payload)
        finally:
            await conn.close()

    # -- what the CLI follows --------------------------------------------------------------------

    async def steps_from(self, run_id: UUID, from_seq: int) -> list[Step]:
        """The run's steps with seq >= ``from_seq``, in order (agentrun logs -f)."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=known_row(Step))
            await cur.execute(queries["list_steps_after"], {"run_id": run_id, "from_seq": from_seq})
            return await cur.fetchall()

    async def follow_run(
        self, run_id: UUID, follower: str, lease: float = FOLLOWER_LEASE
    ) -> datetime:
        """Register (or renew) ``follower`` on the run for ``lease`` seconds: until then, each
        step appended to it is notified on :data:`CHANNEL_RUN_STEPS`. Renew well before the
        returned expiry; :meth:`unfollow_run` when done. Deletes expired registrations."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                queries["follow_run"], {"run_id": run_id, "follower": follower, "lease": lease}
            )
            row = await cur.fetchone()
        assert row is not None  # an upsert always returns its row
        until: datetime = row[0]
        return until

    async def unfollow_run(self, run_id: UUID, follower: str) -> None:
        async with self.pool.connection() as conn:
            await conn.execute(queries["unfollow_run"], {"run_id": run_id, "follower": follower})

    # -- retry, restart and prune (issue 14) ------------------------------------------------

    async def retry(self, run_id: str | UUID, reason: str | None = None) -> Run:
        """Make a failed or dead-lettered run pending again with a fresh poison-run budget; it
        continues from its step log (see ``retry_run`` in queries.sql), or, if its rollback ended
        incomplete (failed or cancelled), finishes that rollback. Raises :class:`ConfigError`
        (one line) when the run cannot be retried: it is live, it succeeded or was cancelled, or
        its failure rolled back (compensated) what it did."""
        rid = parse_run_id(run_id)
        # A rollback that ended incomplete is resumed, never abandoned (queries.sql retry_run).
        rollback_due = bool(await self.compensations_due(rid))
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=known_row(Run))
            await cur.execute(queries["retry_run"],
                              {"run_id": rid, "reason": reason, "rollback_due": rollback_due})
            run = await cur.fetchone()
            if run is not None:
                return run
            count = await conn.execute(queries["compensation_count"], {"run_id": rid})
            compensations = int((await count.fetchone() or (0,))[0])
        now = await self.get_run(rid)  # RunNotFound for an unknown id
        if not now.finished:
            # Retried already (two humans at once, or a retry after a retry): say so, with the
            # retry's own reason, not only that the run is live.
            retried = (f" (retried {now.retries} time(s); the latest retry: "
                       f"{now.retry_reason or 'no reason given'})" if now.retries else "")
            raise ConfigError(f"run {rid} is still {now.status}{retried}; only a failed or "
                              "dead-lettered run can be retried")
        if now.status in RETRYABLE_STATUSES and compensations:
            raise ConfigError(
                f"run {rid} cannot be retried: its failure rolled back ({compensations} "
                "compensation(s) done); agentrun restart starts it afresh"
            )
        raise ConfigError(f"run {rid} {now.status}; only a failed or dead-lettered run, or one "
                          "whose rollback ended incomplete, can be retried (agentrun restart "
                          "starts a new run with its spec)")

    async def model_turns(self, run_id: str | UUID) -> int:
        """How many model turns the run has taken (what maxSteps counts)."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(queries["model_turns"], {"run_id": parse_run_id(run_id)})
            row = await cur.fetchone()
        return int(row[0]) if row else 0

    async def restart(self, run_id: str | UUID) -> Run:
        """A new run with the spec of ``run_id`` (task, model, agent spec, pool, limits), from
        step 0, in its namespace under its name; the original is left as it is."""
        rid = parse_run_id(run_id)
        run = await self._one_run("restart_run", run_id=rid)
        if run is None:
            raise RunNotFound(str(rid))
        return run

    async def prune_preview(self, cutoff: datetime, statuses: Sequence[str]) -> tuple[int, int]:
        """(runs, steps) a prune of runs finished before ``cutoff`` would delete now."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                queries["prune_preview"], {"cutoff": cutoff, "statuses": list(statuses)}
            )
            row = await cur.fetchone()
        return (int(row[0]), int(row[1])) if row else (0, 0)

    async def prune_batch(
        self, cutoff: datetime, statuses: Sequence[str], batch: int
    ) -> PruneBatch:
        """Delete up to ``batch`` runs that finished before ``cutoff`` (only finished ones,
        whatever ``statuses`` says) with their steps, effects and approvals, in one short
        transaction of its own; runs someone holds a lock on are skipped, not waited for."""
        async with self.pool.connection() as conn, conn.transaction():
            await conn.execute(queries["prune_set_flag"])
            cur = conn.cursor(row_factory=known_row(PruneBatch))
            await cur.execute(
                queries["prune_batch"],
                {"cutoff": cutoff, "statuses": list(statuses), "batch": batch},
            )
            done = await cur.fetchone()
        assert done is not None  # an aggregate always returns its row
        return done

    # -- internals -----------------------------------------------------------------------------

    def _fence_params(self, lease: Lease, *, ttl: float | None = None) -> dict[str, Any]:
        """The fence of ``lease``; ``ttl`` is the TTL a queued append was made with (the
        group commit's batch mixes the appends of views with other TTLs)."""
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
        **extra: Any,
    ) -> tuple[Any, ...]: ...

    @overload
    async def _fenced(
        self,
        name: str,
        lease: Lease,
        *,
        required: Literal[False],
        **extra: Any,
    ) -> tuple[Any, ...] | None: ...

    async def _fenced(
        self,
        name: str,
        lease: Lease,
        *,
        required: bool = True,
        **extra: Any,
    ) -> tuple[Any, ...] | None:
        """Run one fenced statement of queries.sql (it matches only while ``lease`` holds the
        running run). No match: None, or with ``required`` the error that says why."""
        params = self._fence_params(lease)
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
        return _fence_error(await cur.fetchone(), lease)


@dataclass(frozen=True)
class _Append:
    """One :meth:`Store.append_step`, as the group commit queues it."""

    lease: Lease
    seq: int
    kind: StepKind
    payload: Jsonb
    request_id: str | None
    ttl: float
    input_tokens: int
    output_tokens: int
    cache_read_tokens: int
    cache_write_tokens: int
    cost_usd: float
    tool_call: Jsonb | None  # the mark carried by the append (None: the run's stays)
    on_sent: Callable[[], None] | None = field(default=None, compare=False)


def _on_sent(
    conn: psycopg.AsyncConnection[Any], callback: Callable[[], None] | None
) -> AbstractContextManager[None]:
    """``conn``'s :meth:`StoreConnection.on_sent` for the statement run inside (nothing to
    watch, or a connection of another class: a block that does nothing)."""
    if callback is None or not isinstance(conn, StoreConnection):
        return nullcontext()
    return conn.on_sent(callback)


def _append_key(a: _Append) -> tuple[str, UUID]:
    """Appends share a statement when they are one worker's (its fence names one owner), at
    most one per run (an UPDATE ... FROM changes a row once, whatever the rows that match it)."""
    return a.lease.worker, a.lease.run_id


async def _outcomes(calls: Iterable[Awaitable[datetime]]) -> list[datetime | Exception]:
    """Each call's result or its error, one after the other (the fallback of a refused batch)."""
    out: list[datetime | Exception] = []
    for call in calls:
        try:
            out.append(await call)
        except Exception as exc:
            out.append(exc)
    return out


def _waited_on(row: dict[str, Any]) -> dict[str, Any] | None:
    """The call of a ``pending_call`` row (queries.sql), None unless the run waits on one, with
    the attempt a decision is about. A wait that does not say which: an unknown outcome is about
    the attempt its intent counts (a timeout's wait written by a worker before it named its
    attempt); otherwise the first (a wait recorded before 0004)."""
    pending = row["pending_call"]
    if row["status"] != "waiting_approval" or pending is None:
        return None
    attempt = int(pending.get("attempt") or (
        pending["stage"] == "outcome_unknown" and row["intent_attempt"]) or 1)
    return {**pending, "attempt": attempt}


#: What PostgreSQL fails a statement with to break a deadlock or a serialization conflict: the
#: statement applied nothing, so sending it again is safe.
ROLLED_BACK = (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure)


def _fence_error(row: dict[str, Any] | None, lease: Lease) -> Exception:
    """Why a fenced write for ``lease`` matched nothing, from the run's status, owner and epoch
    (queries.sql fence_state; None: no such run)."""
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


#: A row of queries.sql claim_runs: the run claimed (or none) and the next foreign lease expiry.
ClaimRow = tuple[Run | None, float | None]


T = TypeVar("T")


def known_row(cls: type[T]) -> BaseRowFactory[T]:
    """psycopg's class_row, from the columns ``cls`` has a field for: a column a later migration
    added is left out (``SELECT *``, ``RETURNING *``). With class_row, a worker of the previous
    release (or a rolled-back image) failed with a TypeError after its claim had committed, at
    every claim, until its runs were dead-lettered."""
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]

    def factory(cursor: Any) -> RowMaker[T]:
        picks = [(i, c.name) for i, c in enumerate(cursor.description or ())
                 if c.name in known]

        def make(values: Sequence[Any]) -> T:
            return cls(**{name: values[i] for i, name in picks})

        return make

    return factory


def _claim_row(cursor: psycopg.AsyncCursor[Any]) -> Callable[[Sequence[Any]], ClaimRow]:
    """Rows of queries.sql claim_runs: the claimed run (None on the row that says only the
    expiry) and the next foreign lease expiry. The run from its known columns (known_row)."""
    names = [c.name for c in cursor.description or ()]
    id_at = names.index("id")
    run = known_row(Run)(cursor)

    def make(values: Sequence[Any]) -> ClaimRow:
        expiry = values[-1]
        if values[id_at] is None:
            return None, expiry
        return run(values), expiry

    return make

