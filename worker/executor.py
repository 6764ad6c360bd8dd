"""Advance one claimed run, one committed step at a time.

The conversation is a projection of the step log: ``[task] + [step payloads]``. It is rebuilt from
the log on every claim (a run never appended to, next_seq 0, has an empty one and is not read),
and each new step is appended to it in its *stored* form (the dict that was written), never as
live SDK objects: what a resumed run sends is what the first worker sent, so signed thinking
blocks replay without a signature error.

Order of a step (invariant 1): call the model -> commit the turn -> run its tools -> commit their
results as one step -> next model call. A resume finds the log in one of three states and carries
on from there: empty or ending in tool results (call the model), ending in a tool_use turn (run its
tools), ending in a final turn (finish the run).

Overlap (``RunExecutor.overlap``, on by default): the results' commit and the next model call start
together, and the turn is committed only once that commit has landed, so the log's order, and what a
resume finds, are unchanged. A commit that fails cancels the call and its error is raised as
before; a crash in between leaves the results committed (or not) and the turn is asked again.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg

from agentrun.errors import LeaseLost, RollbackRequested
from agentrun.faults import armed, crash_point
from agentrun.pricing import BUILT_IN, PriceTable
from agentrun.store import Effect, Lease, PromptVersion, Run, Step, Store
from agentrun.tools import (
    DEFAULT_TOOL_TIMEOUT,
    LeaseExpired,
    ToolContext,
    ToolError,
    ToolKind,
    ToolOutcome,
    ToolRegistry,
    ToolSpec,
    ToolTimeout,
    UnknownToolError,
    idempotency_key,
    message_of,
    not_an_object,
    tool_uses,
)
from agentrun.vocabulary import AbortReason, EffectState, StepKind, rollback_reason
from agentrun.worker.budget import Spend, over_budget
from agentrun.worker.health import Health, WorkerMetrics
from agentrun.worker.liveness import Progress
from agentrun.worker.providers import (
    SDK_MODULES,
    ModelClient,
    Providers,
    ProviderUnavailable,
    import_in_turn,
)
from agentrun.worker.settings import RetryPolicy
from agentrun.worker.tracing import RunTracer

if TYPE_CHECKING:
    from agentrun.manifests import AgentSpec
    from agentrun.worker.model_call import ModelTurn

log = logging.getLogger("agentrun.worker.run")


class RunFailed(Exception):
    """The run cannot go on (a limit, an unknown tool, a tool that aborts): it fails."""


class CompensationFailed(Exception):
    """A compensation could not run: the rollback stops and a human must finish it."""


class ToolRaised(Exception):
    """What a tool raised (or its timeout), as ``_call`` hands it to ``_invoke`` to classify.

    Wrapped so that the worker's own failures around the call (a lease lost by the local clock,
    the fenced mark's database error) never reach the tool's classification: reported to the
    model as the tool's error and committed, they stood for a call that was never made (a
    soak's PostgreSQL restart turned a send_email into "LeaseLost: ..." and the email was
    never sent)."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(f"{type(exc).__name__}: {message_of(exc)}")
        self.exc = exc


class WaitForApproval(Exception):
    """The run must wait for a human decision on one call before it can go on."""

    def __init__(self, reason: str, pending_call: dict[str, Any]) -> None:
        super().__init__(reason)
        self.reason = reason
        self.pending_call = pending_call


@dataclass
class RunHandle:
    """What the worker tracks about a run it holds."""

    run: Run
    lease: Lease
    task: asyncio.Task[None] | None = None
    abort_reason: AbortReason | None = None
    in_model_call: bool = False
    rollback_requested: bool = False  # set by the listener; acted on at the next boundary
    # Monotonic time at which the last write that renewed the lease was SENT: the database set
    # lease_until from its own clock after that, so last_renewed + lease_ttl is never later than
    # the real expiry. CLOCK_MONOTONIC goes on while the process is stopped (SIGSTOP), so a
    # worker woken after its lease ran out knows it at once, before asking anyone.
    last_renewed: float = field(default_factory=time.monotonic)
    #: What the heartbeat renews by (worker/liveness.py): commits, and calls within deadline.
    progress: Progress = field(default_factory=Progress)
    lease_ttl: float = field(kw_only=True)  # the TTL the claim and every renewal asked for
    #: (seq, call_index) of the call whose mark the model turn's append carried: its first
    #: attempt starts without a mark of its own (RunExecutor.first_call_mark).
    marked: tuple[int, int] | None = None
    #: A pipelined pure turn's append, sent and not yet answered (RunExecutor.advance): a fenced
    #: write of the turn's later calls (their marks) waits for it to land first.
    turn_commit: asyncio.Task[None] | None = None

    @property
    def run_id(self) -> str:
        return str(self.run.id)

    @property
    def lease_expires(self) -> float:
        """When the lease runs out by this worker's monotonic clock (at the latest)."""
        return self.last_renewed + self.lease_ttl

    def lease_lost(self) -> str | None:
        """The fence tools see (agentrun.tools.LeaseFence); safe to call from a tool's thread."""
        if self.abort_reason is not None:  # the task is being stopped; a drain hands the run over
            return {"cancelled": "the run was cancelled", "drain": "the worker handed the run over"
                    }.get(self.abort_reason, self.abort_reason)
        late = time.monotonic() - self.lease_expires
        if late >= 0:
            return f"lease expired {late:.1f} s ago by this worker's clock"
        return None

    def abort(self, reason: AbortReason) -> None:
        """Stop the run's task now, interrupting an in-flight model call or backoff."""
        if self.abort_reason is None:
            self.abort_reason = reason
        if self.task is not None and not self.task.done():
            self.task.cancel()


class _MidStream:
    """The mid_model_stream crash point of an overlapped call: it fires at the first event, or,
    if that came before the previous results' commit landed, once it has, so the state a crash
    there leaves is the one it always left (those results committed, the turn not)."""

    def __init__(self, seq: int, *, landed: bool) -> None:
        self.seq = seq
        self.landed = landed
        self.early = False

    def first_event(self) -> None:
        if self.landed:
            crash_point("mid_model_stream", self.seq)
        else:
            self.early = True

    def committed(self) -> None:
        self.landed = True
        if self.early:
            crash_point("mid_model_stream", self.seq)


T = TypeVar("T")


async def _within_lease(
    h: RunHandle, call: asyncio.Future[T], stopping: str, deadline: float = math.inf
) -> bool:
    """Wait for ``call`` until ``deadline`` (monotonic) or until the run's lease runs out by
    this worker's clock (the heartbeat cannot reach the database): LeaseLost then, saying
    ``stopping``, and the caller cancels the call. True: the call is done; False: the deadline
    passed first. Tool calls and model calls alike: a model call once streamed on after the
    lease, paid for twice once another worker had taken the run, and its retries could go on
    for the whole retry bound (hours)."""
    while True:
        wait = min(deadline, h.lease_expires) - time.monotonic()
        done, _ = await asyncio.wait({call}, timeout=max(wait, 0.0))
        if done:
            return True
        lost = h.lease_lost()
        if lost is not None:
            raise LeaseLost(h.run_id, f"{lost}; {stopping}")
        if time.monotonic() >= deadline:
            return False


async def _settle(call: asyncio.Future[Any]) -> None:
    """Cancel a model call nobody will use and wait for it to let go of its connection."""
    if call.done():
        if not call.cancelled():
            call.exception()  # retrieved: a call whose commit failed may have failed too
        return
    call.cancel()
    await asyncio.wait({call})
    if not call.cancelled():
        call.exception()


def rebuild_messages(task: str, steps: list[Step]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": task}]
    for step in steps:
        if step.kind not in ("model_turn", "tool_result"):
            continue  # compensations and notes are the runtime's records, not conversation
        role = "assistant" if step.kind == "model_turn" else "user"
        messages.append({"role": role, "content": step.payload["content"]})
    return messages


def non_finite(value: Any, path: str = "") -> str | None:
    """Where ``value`` holds a number JSON cannot write (infinite or NaN), as a path such as
    ``content[1].input.factor``; None if nowhere. A model may write a number beyond the float range
    (``1e400``, valid JSON), which Python reads as infinity: jsonb refuses it, and the request that
    carries the turn back cannot hold it either."""
    if isinstance(value, float):
        return None if math.isfinite(value) else path or "the value"
    if isinstance(value, dict):
        items: Any = ((f"{path}.{k}" if path else str(k), v) for k, v in value.items())
    elif isinstance(value, list):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    return next((p for where, v in items if (p := non_finite(v, where)) is not None), None)


#: Set in a recorded outcome, and in the compensation step that undid it, when the effect may or
#: may not have happened (a call cut off by its timeout; a rejected or failed re-run of an
#: unknown outcome: the earlier attempt is unknown). queries.sql compensations_due reads it:
#: such an effect is undone on a rollback, its compensation told (ctx.compensates_unknown).
UNKNOWN_OUTCOME = "outcome_unknown"
#: What a recorded outcome shows the model when it is reused (a tool_result block's fields).
SHOWN = ("content", "is_error")


def records_effects(spec: ToolSpec) -> bool:
    """Whether a call of this tool is recorded in tool_effect (see docs/side-effects.md)."""
    return (
        spec.kind in (ToolKind.NON_IDEMPOTENT, ToolKind.IRREVERSIBLE)
        or spec.compensate is not None  # a saga step must be remembered to be undone
    )


def final_text(payload: dict[str, Any]) -> str:
    return "".join(b.get("text", "") for b in payload.get("content", []) if b.get("type") == "text")


def prompt_for(run: Run, registry: ToolRegistry) -> PromptVersion:
    """Resolve the run's pinned agent spec against this worker's tools (first claim only)."""
    return prompt_version_of(run.agent, run.model, registry)


def prompt_version_of(spec: AgentSpec, model: str, registry: ToolRegistry) -> PromptVersion:
    """The prompt version an agent spec pins with this worker's tools (and what the benchmarks'
    in-memory loops send, so that they ask the model exactly what a run asks it)."""
    names: list[str] = list(spec.tools)
    missing = registry.check(names)
    if missing:
        known = ", ".join(registry.names()) or "none"
        raise RunFailed(
            f"unknown tool(s) {', '.join(missing)}: not in this worker's registry "
            f"(loaded: {known}); start the worker with --tools MODULE that defines them"
        )
    params: dict[str, Any] = {"max_tokens": spec.max_tokens}
    # Pinned with the prompt version, so a resumed run places the same breakpoints (or none).
    if spec.prompt_caching:
        params["prompt_caching"] = True
    if spec.thinking is not None:
        params["thinking"] = {"budget_tokens": spec.thinking.budget_tokens}
    return PromptVersion(
        model=model,
        system=spec.system,
        tools=registry.definitions(names),
        params=params,
    )


@dataclass
class RunExecutor:
    store: Store
    clients: Providers  # one client per provider, made when a run first needs it
    registry: ToolRegistry
    metrics: WorkerMetrics
    health: Health
    retry: RetryPolicy
    is_draining: Callable[[], bool]
    tool_timeout: float = DEFAULT_TOOL_TIMEOUT  # for tools that declare no timeout of their own
    prices: PriceTable = BUILT_IN
    tracing: RunTracer = field(default_factory=RunTracer)  # no provider: no spans
    #: Overlap each tool_result commit with the next model call (the turn is still committed
    #: only after those results): False is the escape hatch, and the benchmark's "off".
    overlap: bool = True
    #: Carry a turn's first tool call's mark in the turn's own append (first_call_mark): False
    #: sends every mark on its own, as before issue 17 (the benchmark's "off").
    carry_mark: bool = True
    #: Pipeline pure turns: a turn whose calls are all pure starts them once its append (which
    #: carries the first call's mark) is sent, not once it is committed (issue 17). False waits
    #: for the commit, as before (the benchmark's "off").
    pipeline: bool = True
    _prompts: dict[str, PromptVersion] = field(default_factory=dict)

    async def pinned_prompt(self, h: RunHandle) -> PromptVersion:
        pv_id = h.run.prompt_version
        if pv_id is None:
            pv = prompt_for(h.run, self.registry)
            sent = time.monotonic()
            pv_id = await self.store.pin_prompt_version(h.lease, pv)
            self._committed(h, sent)
            if pv_id == pv.id:
                self._prompts[pv_id] = pv
        if pv_id not in self._prompts:
            self._prompts[pv_id] = await self.store.get_prompt_version(pv_id)
        return self._prompts[pv_id]

    def _committed(self, h: RunHandle, sent: float) -> None:
        h.last_renewed = sent  # every fenced write renews the lease (from when it was sent)
        h.progress.committed()
        self.health.progress()

    async def _append(
        self,
        h: RunHandle,
        seq: int,
        kind: StepKind,
        payload: Any,
        request_id: str | None = None,
        started: float | None = None,
        turn: ModelTurn | None = None,
        cost_usd: float = 0.0,
        tool_call: dict[str, Any] | None = None,
        on_sent: Callable[[], None] | None = None,
    ) -> None:
        sent = time.monotonic()
        await self.store.append_step(
            h.lease,
            seq,
            kind,
            payload,
            request_id=request_id,
            input_tokens=turn.input_tokens if turn else 0,
            output_tokens=turn.output_tokens if turn else 0,
            cache_read_tokens=turn.cache_read_tokens if turn else 0,
            cache_write_tokens=turn.cache_write_tokens if turn else 0,
            cost_usd=cost_usd,
            tool_call=tool_call,
            on_sent=on_sent,
        )
        self._committed(h, sent)
        self.metrics.steps.labels(kind).inc()
        if started is not None:
            self.metrics.step_seconds.labels(kind).observe(time.perf_counter() - started)

    async def advance(self, h: RunHandle) -> str | None:
        """Run until the run ends (returns None) or the worker drains (returns "drain")."""
        # The SDK's modules: off the worker's claim path (worker/providers.py). Imported in a
        # thread, so that a run claimed while `agentrun worker` still imports them in the
        # background waits for that import without holding the event loop (its heartbeats).
        await asyncio.to_thread(import_in_turn, SDK_MODULES[-1])
        from agentrun.worker.model_call import (  # imported: at once
            BodyTexts,
            build_request,
            call_model,
        )
        run = h.run
        try:
            agent = run.agent
        except ValueError as exc:  # pydantic's ValidationError
            raise RunFailed(
                "the run's pinned agent spec does not validate: "
                + " ".join(str(exc).split())[:300]
            ) from None
        pv = await self.pinned_prompt(h)
        # A run never appended to has no log to read (one round trip less on its first claim):
        # every append raises next_seq past its seq, and nothing else writes agent_step.
        steps = await self.store.steps(run.id) if run.next_seq else []
        if [s.seq for s in steps] != list(range(len(steps))):
            raise RunFailed(f"step log is not contiguous: {[s.seq for s in steps]}")
        messages = rebuild_messages(run.task, steps)
        texts = BodyTexts()  # the history's JSON, kept from one request to the next
        seq = len(steps)
        turns = sum(1 for s in steps if s.kind == "model_turn")
        spend = Spend.of(run, steps)
        budget = agent.budget
        last: tuple[str, dict[str, Any]] | None = (
            (steps[-1].kind, steps[-1].payload) if steps else None
        )
        log.info(
            "claimed: attempt %d, epoch %d, resuming at seq %d", run.attempt, h.lease.epoch, seq
        )
        await self._record_lost_call(h)
        if run.rollback_reason:  # a worker died mid-rollback: finish it, never go on
            await self.abort(h)
            return None
        # The run's provider's client; its spans carry the run id.
        client = self.tracing.client_for(await self.client_for(h), h.run_id)
        # The tool results' commit, due beside the next model call (overlap): started once that
        # call's request is on its way, so the commit's work is done while the model answers.
        pending: Coroutine[Any, Any, None] | None = None
        while True:
            if self.is_draining():
                return "drain"  # at a commit boundary: nothing in flight is lost
            if h.rollback_requested:  # cancel --rollback / reject --abort, heard while running
                await self.abort(h)
                return None
            if last is not None and last[0] == "model_turn":
                stop = last[1].get("stop_reason")
                if stop == "tool_use":
                    if not tool_uses(last[1]):
                        # Answered, it would send an empty user message (refused by the API)
                        # and keep a step without meaning in the log.
                        raise RunFailed(f"model stopped with stop_reason 'tool_use' at seq "
                                        f"{seq - 1} but asked for no tool (no tool_use block)")
                    started = time.perf_counter()
                    pipelined = h.turn_commit
                    try:
                        content = await self.run_tools(h, seq - 1, last[1])
                    except RollbackRequested:
                        await self._turn_landed(h)  # the turn first: its failure, if it failed
                        log.warning("a rollback was requested: rolling back before the turn's "
                                    "next tool call")
                        await self.abort(h)
                        return None
                    except BaseException as exc:
                        await self._turn_settled(h, exc)
                        raise
                    if pipelined is not None and armed("after_model_turn_commit", seq - 1):
                        # The crash point of a pipelined turn, where it leaves what it always
                        # did: the turn landed, no results, no next request (its calls are pure).
                        await pipelined
                        crash_point("after_model_turn_commit", seq - 1)
                    payload = {"content": content}
                    # The turn's append (done already if a later call waited for it to land): the
                    # results' commit waits for it and raises its error.
                    results = self._commit_results(h, seq, payload, started, pipelined)
                    h.turn_commit = None
                    messages.append({"role": "user", "content": content})
                    last, seq = ("tool_result", payload), seq + 1
                    if not self.overlap or self.is_draining() or h.rollback_requested:
                        await results  # no next call to overlap with (or overlap is off)
                        continue
                    pending = results
                elif stop in ("end_turn", "stop_sequence"):
                    try:
                        await self.store.finish(h.lease, "succeeded",
                                                result=final_text(last[1]))
                    except RollbackRequested:
                        # Asked for while this worker was not listening (its notification was
                        # lost with the connection): the run rolls back, as if heard in time.
                        log.warning("a rollback was requested: rolling back, not succeeding")
                        await self.abort(h)
                        return None
                    self.metrics.runs_finished.labels("succeeded").inc()
                    log.info("succeeded after %d steps", seq)
                    return None
                elif stop == "max_tokens":
                    raise RunFailed(
                        f"model stopped at max_tokens ({pv.params.get('max_tokens')}) at seq "
                        f"{seq - 1}; raise spec.maxTokens"
                    )
                elif stop != "pause_turn":
                    raise RunFailed(f"model stopped with stop_reason {stop!r} at seq {seq - 1}")
            try:
                if turns >= run.max_steps:
                    raise RunFailed(f"maxSteps {run.max_steps} reached without a final answer")
                caching = bool(pv.params.get("prompt_caching"))
                over = over_budget(budget, spend, pv.model, self.prices, caching)
                if over is not None:
                    self.metrics.budget_stops.labels(over[0]).inc()
                    raise RunFailed(over[1])
            except RunFailed:
                if pending is not None:  # the results land first, as they did before the check
                    await pending
                raise
            started = time.perf_counter()
            turn_seq = seq
            mid_stream = _MidStream(turn_seq, landed=pending is None)
            try:
                asking = call_model(client, build_request(pv, messages), policy=self.retry,
                                    on_first_event=mid_stream.first_event,
                                    on_retry=self._count_retry, texts=texts)
            except BaseException:
                if pending is not None:
                    await pending
                raise
            call = asyncio.ensure_future(
                self.tracing.model_turn(client, pv.model, turn_seq, asking))
            # Scheduled after the call: its request leaves first.
            commit = None if pending is None else asyncio.create_task(
                pending, name=f"commit seq {seq - 1}")
            pending = None
            try:
                if commit is not None:
                    # The turn is committed only after the results it answers: a commit that
                    # fails (LeaseLost, RunCancelled, the database) ends the call unheard.
                    await commit
                    mid_stream.committed()
                    if self.is_draining() or h.rollback_requested:
                        continue  # at the commit boundary, as without overlap (finally cancels)
                # Progress while it lasts: every try ends by its deadline, so the whole call is
                # bounded (retries and backoffs included) and never looks like a stall within it.
                # Not the commits before it: one that never answers (a connection dead without a
                # reset) is a stall, the call beside it or not.
                h.progress.begin("model call", deadline=time.monotonic() + self.retry.bound())
                h.in_model_call = True  # from here a drain aborts the call at once
                await _within_lease(h, call, "stopped the model call")
                turn = call.result()
            finally:
                h.in_model_call = False
                h.progress.end()
                await _settle(call)
            self.metrics.model_seconds.observe(time.perf_counter() - started)
            usage = {
                "input": turn.input_tokens,
                "output": turn.output_tokens,
                "cache_read": turn.cache_read_tokens,
                "cache_write": turn.cache_write_tokens,
            }
            # Priced when it ran, by this worker's table: the run's cost is summed from these.
            cost = self.prices.cost_usd(pv.model, usage)
            self.metrics.count_tokens(pv.model, cost_usd=cost, **usage)
            mark = self.first_call_mark(h, seq, turn.payload)
            if mark is not None and self.pipeline and self._pure_turn(h, turn.payload):
                # Pipelined: the turn's calls, all pure, start once its append (carrying the
                # first one's mark) is sent; it lands whatever then becomes of this process.
                sent = asyncio.get_running_loop().create_future()
                h.turn_commit = asyncio.create_task(
                    self._commit_turn(h, seq, turn, started, cost, mark, sent),
                    name=f"commit seq {seq}")
                try:
                    await asyncio.wait({sent, h.turn_commit},
                                       return_when=asyncio.FIRST_COMPLETED)
                    if h.turn_commit.done() or self.is_draining() or h.rollback_requested:
                        await self._turn_landed(h)  # answered already, or acted on once landed
                except BaseException as exc:
                    await self._turn_settled(h, exc)
                    raise
            else:
                await self._commit_turn(h, seq, turn, started, cost, mark)
            h.marked = None if mark is None else (seq, 0)
            spend.add(sum(usage.values()), cost)  # the four kinds: what maxTokens counts
            messages.append({"role": "assistant", "content": turn.payload["content"]})
            last, seq, turns = ("model_turn", turn.payload), seq + 1, turns + 1

    async def _commit_turn(
        self, h: RunHandle, seq: int, turn: ModelTurn, started: float, cost: float,
        mark: dict[str, Any] | None, sent: asyncio.Future[None] | None = None,
    ) -> None:
        """Append the model turn (with ``mark``, its first call's, if any); ``sent`` is set
        once the append is on its way (pipelined pure turns)."""

        def on_sent() -> None:
            if sent is not None and not sent.done():
                sent.set_result(None)

        try:
            await self._append(h, seq, "model_turn", turn.payload, turn.request_id, started,
                               turn=turn, cost_usd=cost, tool_call=mark,
                               on_sent=None if sent is None else on_sent)
        except psycopg.DataError:
            # Looked for only once the database refused the turn (nothing to pay per turn).
            # Given up, the claim was re-run, the model paid again, until a dead letter.
            where = non_finite(turn.payload)
            if where is None:
                raise
            raise RunFailed(
                f"the model's turn at seq {seq} holds a number beyond the float range at "
                f"{where} (such as 1e400): it can be neither stored verbatim nor sent back "
                "to the model; `agentrun retry` asks the model again"
            ) from None
        if sent is None:  # pipelined, the point fires once the turn's calls have run (advance)
            crash_point("after_model_turn_commit", seq)
        log.debug("seq %d: model turn committed (stop_reason %s)", seq, turn.stop_reason)

    def _pure_turn(self, h: RunHandle, payload: dict[str, Any]) -> bool:
        """Every call of the turn is one the run may make, of a pure tool this worker has: a
        call that may take effect (or be refused, or wait for a human) starts only once its turn
        is committed."""
        granted = h.run.agent.tools
        return all(
            b.get("name") in granted and b["name"] in self.registry
            and self.registry.get(b["name"]).kind is ToolKind.PURE
            for b in tool_uses(payload)
        )

    async def _turn_landed(self, h: RunHandle) -> None:
        """Wait for a pipelined turn's append to land; raises its failure."""
        commit, h.turn_commit = h.turn_commit, None
        if commit is not None:
            await commit

    async def _turn_settled(self, h: RunHandle, exc: BaseException) -> None:
        """The turn's tools raised ``exc``: first let the pipelined append they ran beside end
        (the caller's next write, a rollback or a finish, must come after it), cancelled with the
        run's task if that is what ``exc`` is. If the append failed, its failure is what the
        caller gets (the run is not this worker's any more, or the turn was refused), ``exc``
        its context."""
        commit, h.turn_commit = h.turn_commit, None
        if commit is None:
            return
        if isinstance(exc, asyncio.CancelledError):
            commit.cancel()
        await asyncio.wait({commit})
        if commit.cancelled():
            return
        failure = commit.exception()
        if failure is not None and not isinstance(exc, asyncio.CancelledError):
            raise failure from exc

    async def _commit_results(
        self, h: RunHandle, seq: int, payload: dict[str, Any], started: float,
        turn_commit: asyncio.Task[None] | None = None,
    ) -> None:
        if turn_commit is not None:
            await turn_commit  # the turn first, always: its failure ends the results unsent
        await self._append(h, seq, "tool_result", payload, started=started)
        crash_point("after_tool_result_commit", seq)

    async def client_for(self, h: RunHandle) -> ModelClient:
        """The client of the run's provider. One this worker cannot call (its settings or
        credentials are missing here) fails the run at once, before any model call, with the
        line naming what to set: every retry and every attempt would fail alike."""
        try:
            return await self.clients.get(h.run.agent.provider)
        except ProviderUnavailable as exc:
            raise RunFailed(str(exc)) from None

    async def abort(self, h: RunHandle, failure: str | None = None) -> None:
        """Tier 3: the run fails. First undo, newest first, every recorded effect that declared
        a compensation (tier 2), each as a durable step; then fail with a record of what was
        undone. A resume of a run that began to roll back lands here again and goes on.

        ``failure``: the error that fails the run; None: a rollback was requested (cancel
        --rollback, reject --abort), and its stored reason says why and what it ends as. The
        first reason stored stays either way."""
        # Recorded before begin_rollback clears the mark (advance did it at the claim; an
        # abort reached some other way must not lose it either).
        await self._record_lost_call(h)
        sent = time.monotonic()
        reason, final = await self.store.begin_rollback(
            h.lease, rollback_reason("failed", failure), "failed")
        self._committed(h, sent)
        outcome = "no_compensation"
        try:
            if await self.rollback(h):
                outcome = "compensated"
        except CompensationFailed as exc:
            outcome = "compensation_failed"
            reason = f"{reason}; ROLLBACK INCOMPLETE, manual action needed: {exc}"
        undone = [
            f"{s.payload['compensation']} for {s.payload['tool']} (step {s.payload['seq']}"
            + (", outcome unknown)" if s.payload.get(UNKNOWN_OUTCOME) else ")")
            for s in await self.store.steps(h.run.id)
            if s.kind == "compensation"
        ]
        error = reason + (f"; compensated: {', '.join(undone)}" if undone else "")
        # ``final``: what the rollback's request said it ends as, stored with it (read back after
        # a worker died mid-rollback too): a cancel's ends cancelled, every other failed.
        await self.store.finish(h.lease, final, error=error)
        self.metrics.aborts.labels(outcome).inc()
        self.metrics.runs_finished.labels(final).inc()
        log.error("run failed: %s", error)

    async def rollback(self, h: RunHandle) -> int:
        """Run the compensations still due, newest effect first. Returns how many ran now.
        Called once the rollback began (abort): a call a worker was lost inside was recorded as
        an intent before begin_rollback cleared the mark, so every effect due is a recorded one."""
        due = await self.store.compensations_due(h.run.id)
        seq = (await self.store.get_run(h.run.id)).next_seq
        for effect in due:
            assert effect.compensate is not None  # recorded effects only (see above)
            try:
                spec = self.registry.get(effect.compensate)
            except UnknownToolError as exc:
                raise CompensationFailed(str(exc)) from None
            # Its own key, derived from the effect it undoes: a crash in the middle of the
            # rollback and the resume that follows hand the compensating tool the same key.
            key = hashlib.sha256(f"{effect.idempotency_key}:compensate".encode()).hexdigest()
            # An intent, a call its worker died inside, or a decided call whose earlier attempt
            # may have taken effect.
            unknown = effect.state != "done" or bool((effect.result or {}).get(UNKNOWN_OUTCOME))
            ctx = ToolContext(
                h.run_id, effect.seq, effect.call_index, effect.compensate, key,
                compensates_key=effect.idempotency_key, compensates_unknown=unknown, fence=h,
            )
            what = f"{effect.compensate} for {effect.tool} (step {effect.seq})"
            # Fenced and bounded as every call is: a hung compensation held the run for the
            # whole progress budget on every claim, and its ctx.lease_valid() was always True.
            # Marked as every call is (_call), live until its compensation step lands at seq: a
            # compensation that takes its worker down (os._exit, a segfault) is blamed on this
            # run. Unmarked, the death was a plain one: this run's error said nothing, and the
            # runs sharing the worker each lost an attempt to it, until they dead-lettered.
            self._refuse_if_lost(h, effect.compensate)
            if effect.busy_until is not None:  # a lost worker's or a timed-out call's thread
                await self._outwait(h, effect, effect.busy_until)
            sent = time.monotonic()
            await self.store.begin_tool_call(
                h.lease, self._mark(h, spec, effect.seq, effect.call_index, step=seq))
            self._committed(h, sent)
            self._refuse_if_lost(h, effect.compensate)  # stopped since the write?
            try:
                with h.progress.working(f"tool {effect.compensate}",
                                        deadline=time.monotonic() + self._timeout(spec)):
                    outcome = await self._bounded(h, spec, ctx, effect.input)
            except ToolRaised as raised:
                failure = raised.exc
                if isinstance(failure, LeaseExpired):  # the tool saw the fence: this worker stops
                    raise LeaseLost(
                        h.run_id, f"{what} stopped at the fence: {message_of(failure)}") from None
                raise CompensationFailed(
                    f"{what} raised {type(failure).__name__}: {message_of(failure)}") from failure
            if outcome.is_error:
                # A ToolError, or input it refuses: the effect is not undone, and a step
                # recorded for it would keep it from ever being offered again.
                raise CompensationFailed(f"{what} failed: {outcome.content}")
            crash_point("mid_compensation", seq)
            payload = {"seq": effect.seq, "call_index": effect.call_index, "tool": effect.tool,
                       "compensation": effect.compensate, "content": outcome.content,
                       "is_error": outcome.is_error}
            if unknown:
                payload[UNKNOWN_OUTCOME] = True
            await self._append(h, seq, "compensation", payload)
            log.warning("compensated %s (step %d) with %s", effect.tool, effect.seq,
                        effect.compensate)
            seq += 1
        return len(due)

    async def _record_lost_call(self, h: RunHandle) -> None:
        """Record, as an intent of unknown outcome, the compensable call an earlier holder was
        lost inside before recording it (Store.compensations_due: "unrecorded"). Its only trace
        is the run's mark, which this claim's first call replaces: left to the rollback, a call
        lost at index 1 was forgotten once the resume re-ran index 0 (and that worker was lost
        too), and the rollback reported the run compensated with it in place."""
        mark = h.run.tool_call or {}
        # lease_until: added by the claim that found the worker dead. An older worker's mark
        # (a rolling upgrade) names no undo: this worker's registry may know the tool's.
        if "lease_until" not in mark or not (
                "compensate" in mark or self._undo_of(str(mark.get("tool")))):
            return  # the usual claim: no query
        for effect in await self.store.compensations_due(h.run.id, self._undo_of):
            if effect.state == "unrecorded":
                await self._record_intent(h, effect)

    def _undo_of(self, tool: str) -> tuple[str, str] | None:
        """The compensation and kind of ``tool`` as this worker's registry declares them."""
        if tool not in self.registry:
            return None
        spec = self.registry.get(tool)
        return None if spec.compensate is None else (spec.compensate, spec.kind.value)

    async def _record_intent(self, h: RunHandle, effect: Effect) -> None:
        sent = time.monotonic()
        await self.store.record_effect(
            h.lease, effect.seq, effect.call_index, key=effect.idempotency_key, tool=effect.tool,
            tool_kind=effect.tool_kind, state="intent", tool_input=effect.input,
            compensate=effect.compensate, busy_until=effect.busy_until)
        self._committed(h, sent)

    async def _outwait(self, h: RunHandle, effect: Effect, until: datetime) -> None:
        """Wait, before undoing a call a thread may still be inside, until it cannot be
        (Effect.busy_until: a lost worker's lease's end plus the call's timeout, as
        _previous_holder tells a human; a timed-out call's timeout once more): undone at once,
        the compensation found nothing yet and was recorded, and the call then completed, its
        effect in place."""
        delay = (until - datetime.now(UTC)).total_seconds()
        if delay <= 0:
            return
        log.warning("undoing %s (step %d) at %s UTC: a call of it that did not return (its "
                    "worker lost, or cut off by its timeout) may still be running until then",
                    effect.tool, effect.seq, f"{until.astimezone(UTC):%H:%M:%S}")
        with h.progress.working(f"waiting for {effect.tool} to end",
                                deadline=time.monotonic() + delay):
            await asyncio.sleep(delay)
        self._refuse_if_lost(h, str(effect.compensate))

    def first_call_mark(
        self, h: RunHandle, turn_seq: int, payload: dict[str, Any]
    ) -> dict[str, Any] | None:
        """The mark of the turn's first tool call, for the turn's own append to carry, when
        nothing but the call comes between that commit and the call's start: the run may call
        the tool, this worker has it, and it is not irreversible (whose intent, and perhaps a
        human, come first). The mark then costs no round trip of its own (issue 17). A worker
        that dies in the moment between the two is blamed as if inside the call: that run's
        attempt is counted, its co-located runs are handed over, as for a death inside it."""
        if not self.carry_mark or payload.get("stop_reason") != "tool_use":
            return None
        calls = tool_uses(payload)
        # call_tool's two refusals: a tool the run may not call, one this worker lacks.
        if not calls or calls[0]["name"] not in h.run.agent.tools or (
                calls[0]["name"] not in self.registry):
            return None
        spec = self.registry.get(calls[0]["name"])
        if spec.kind is ToolKind.IRREVERSIBLE:
            return None
        return self._mark(h, spec, turn_seq, 0)

    def _mark(self, h: RunHandle, spec: ToolSpec, seq: int, index: int,
              step: int | None = None) -> dict[str, Any]:
        """The mark of a call (queries.sql begin_tool_call), read by the next claim if this
        worker dies inside the call: the call of turn ``seq``, ``index``, whose outcome the step
        ``step`` records (default: the turn's results, seq + 1)."""
        mark = {"worker": h.lease.worker, "epoch": h.lease.epoch, "tool": spec.name,
                "seq": seq, "call_index": index, "step": seq + 1 if step is None else step,
                "timeout": self._timeout(spec)}
        if spec.compensate is not None:
            # A call of a compensable tool is recorded only once it returns: a worker lost
            # inside it leaves only this mark to say an effect may need undoing (queries.sql
            # lost_call), so a rollback does not report the run compensated without it.
            mark["compensate"], mark["kind"] = spec.compensate, spec.kind.value
        return mark

    def _count_retry(self, reason: str) -> None:
        self.metrics.model_retries.labels(reason).inc()

    async def run_tools(
        self, h: RunHandle, turn_seq: int, payload: dict[str, Any]
    ) -> list[dict[str, Any]]:
        """Run the turn's tool calls in order; one tool_result block each."""
        calls = tool_uses(payload)
        # Only calls of recording tools can have an effect on record: a turn of pure calls (the
        # common case) costs no extra round trip.
        recording = any(
            b["name"] in self.registry and records_effects(self.registry.get(b["name"]))
            for b in calls
        )
        effects = await self.store.effects(h.run.id, turn_seq) if recording else {}
        content = []
        for i, b in enumerate(calls):
            if h.rollback_requested:
                # Heard between two calls: the next may be one that waits for a human (the
                # rollback was parked behind it) or one more effect to undo. What ran is on
                # record (a recording tool's effect), so the rollback can start here.
                raise RollbackRequested(h.run_id)
            content.append(await self.tracing.tool_call(
                b, self.registry, turn_seq + 1, i, self.call_tool(h, turn_seq, i, b, effects.get(i))
            ))
        return content

    async def call_tool(
        self,
        h: RunHandle,
        turn_seq: int,
        index: int,
        block: dict[str, Any],
        effect: Effect | None = None,
    ) -> dict[str, Any]:
        """One call, by its tool's class (see agentrun.tools): pure and idempotent calls simply
        run (again); a non-idempotent call whose effect is recorded is not called again; an
        irreversible call writes its intent first, and one whose intent has no outcome waits for
        a human instead of guessing."""
        name, args = block["name"], block.get("input", {})
        result: dict[str, Any] = {"type": "tool_result", "tool_use_id": block["id"]}
        granted = h.run.agent.tools
        if name not in granted:
            # The run's pinned tools are all it may call: a model talked into calling another
            # tool this worker happens to have loaded (a tool result saying "call drop_table")
            # gets an error naming only its own tools, and nothing runs.
            self.metrics.tool_calls_refused.inc()
            log.warning("seq %d call %d: refused %r: not one of the run's tools (%s)",
                        turn_seq, index, name, ", ".join(granted) or "none")
            return {**result, "is_error": True, "content": (
                f"tool {name!r} is not available to this agent; its tools are: "
                f"{', '.join(granted) or 'none'}")}
        try:
            spec = self.registry.get(name)
        except UnknownToolError:
            # Granted but not loaded by this worker (its pool lacks the module): name the run's
            # tools only, never the rest of what this worker has loaded.
            return {**result, "is_error": True, "content": (
                f"tool {name!r} is not available on this worker; the agent's tools are: "
                f"{', '.join(granted)}")}
        if not isinstance(args, dict):
            # Before its key, intent, mark or record: `[]`, `""`, `0` or `null` was taken for
            # {}, and a tool whose parameters all have defaults ran.
            return {**result, "is_error": True, "content": not_an_object(name, args)}
        recorded = records_effects(spec)
        if recorded and effect is not None and effect.state == "done" and effect.result:
            log.info("seq %d call %d: %s already happened; reusing its recorded result",
                     turn_seq, index, name)
            # What the model is shown of it: the record may say more (UNKNOWN_OUTCOME), which
            # a tool_result block may not carry.
            return {**result, **{k: v for k, v in effect.result.items() if k in SHOWN}}
        key = idempotency_key(h.run_id, turn_seq, name, args, index)

        async def record(state: EffectState, outcome: dict[str, Any] | None = None,
                         busy_until: datetime | None = None) -> None:
            sent = time.monotonic()
            await self.store.record_effect(
                h.lease, turn_seq, index, key=key, tool=name, tool_kind=spec.kind.value,
                state=state, result=outcome, tool_input=args, compensate=spec.compensate,
                busy_until=busy_until)
            self._committed(h, sent)

        def cut_off() -> datetime:
            # A call cut off by its timeout just now: its thread runs on, and a rollback undoes
            # it only once the timeout has passed once more (undone at once, the compensation
            # found nothing yet, and the late call then took effect). A bound, not a proof.
            return datetime.now(UTC) + timedelta(seconds=self._timeout(spec))

        intent = 1  # which attempt of an irreversible call this is (its intent's count)
        if spec.kind is ToolKind.IRREVERSIBLE:
            decided = await self._gate_irreversible(h, turn_seq, index, name, args, effect, spec)
            if decided is not None:
                # A rejected re-run of an unknown outcome (an intent is there): not called again,
                # but the earlier attempt may have taken effect, and a rollback must undo it.
                await record("done", decided if effect is None else {
                    **decided, UNKNOWN_OUTCOME: True})
                return {**result, **decided}
            if effect is None:
                await record("intent")
            else:  # a decided re-run: counted before the call, so one decision buys one call
                sent = time.monotonic()
                intent = await self.store.retry_intent(h.lease, turn_seq, index, effect.attempts)
                self._committed(h, sent)
            crash_point("after_intent_commit", turn_seq)
        # Progress while it lasts, up to its timeout (the call is cut off there anyway).
        with h.progress.working(f"tool {name}",
                                deadline=time.monotonic() + self._timeout(spec)):
            # A call that fails its run (on_error="abort") records nothing: a retry calls it
            # again under the same key, and an irreversible one's intent stays unknown (its
            # re-run is a human's decision; a rollback undoes it, told the outcome is unknown).
            # Unless an attempt of a compensable one was cut off by its timeout: its thread runs
            # on, and the run's rollback, which follows, must undo it (recorded as nothing, it
            # was left in place). Recorded as an intent (the outcome unknown), as a call a lost
            # worker was inside: a resume before the rollback calls it again under the same key
            # (recorded as done, its error was shown to the model and the run went on), and a
            # rollback undoes it. Any other stays unrecorded, for a retry.
            timed_out: list[int] = []  # attempts cut off by their timeout (_invoke)
            try:
                outcome = await self._invoke(h, spec, turn_seq, index, name, args, key, intent,
                                             timed_out)
            except RunFailed:
                if spec.compensate is not None and timed_out:
                    await record("intent", None, cut_off())
                raise
        crash_point("after_tool_return", turn_seq)
        if recorded:
            # A re-run of an unknown outcome (an intent was there: an approved irreversible
            # re-run, or a call an earlier worker was lost inside) that failed leaves the earlier
            # attempt's outcome unknown: a rollback must still undo it. So does an attempt cut
            # off by its timeout, whatever the attempts after it said (its thread runs on).
            again = effect is not None and effect.state == "intent"
            unknown = (again or bool(timed_out)) and outcome.get("is_error")
            await record("done", {**outcome, UNKNOWN_OUTCOME: True} if unknown else outcome,
                         cut_off() if timed_out else None)
        return {**result, **{k: v for k, v in outcome.items() if k in SHOWN}}

    async def _gate_irreversible(
        self, h: RunHandle, seq: int, index: int, name: str, args: dict[str, Any],
        effect: Effect | None, spec: ToolSpec,
    ) -> dict[str, Any] | None:
        """None: go ahead and call. A dict: the decided tool_result (a rejection).

        A decision is about one attempt of the call: an approval of an unknown outcome buys one
        more attempt, and if that one's outcome is unknown too, the run waits again."""
        def pending(stage: str, attempt: int = 1) -> dict[str, Any]:
            return {"seq": seq, "call_index": index, "tool": name, "input": args, "stage": stage,
                    "attempt": attempt}

        if effect is not None:  # an intent without an outcome: the worker died mid-call
            attempt = effect.attempts
            decision = await self.store.get_approval(
                h.run.id, seq, index, "outcome_unknown", attempt)
            if decision is None:
                holder, busy = self._previous_holder(h, spec, seq, index)
                raise WaitForApproval(
                    f"outcome unknown: {name} (step {seq}, attempt {attempt}) was called and its "
                    f"worker died before the outcome was recorded; {holder}; check its target, "
                    f"then approve to run it once more (attempt {attempt + 1}) or reject to tell "
                    "the model it was not retried",
                    {**pending("outcome_unknown", attempt), **busy},
                )
            if decision.decision == "rejected":
                return {"content": f"{name} was not retried: its outcome is unknown, and "
                        f"{decision.decided_by} rejected a retry"
                        + (f" ({decision.reason})" if decision.reason else ""),
                        "is_error": True}
            return None
        if h.run.agent.require_approval:
            decision = await self.store.get_approval(h.run.id, seq, index, "before_call")
            if decision is None:
                raise WaitForApproval(
                    f"approval required before {name} (step {seq})", pending("before_call"))
            if decision.decision == "rejected":
                return {"content": f"{name} was rejected by {decision.decided_by}"
                        + (f": {decision.reason}" if decision.reason else ""),
                        "is_error": True}
        return None

    def _timeout(self, spec: ToolSpec) -> float:
        return spec.timeout if spec.timeout is not None else self.tool_timeout

    def _previous_holder(
        self, h: RunHandle, spec: ToolSpec, seq: int, index: int
    ) -> tuple[str, dict[str, Any]]:
        """Who may still be inside an irreversible call whose outcome is unknown, until when: the
        sentence for the reason, and the same as fields of the pending call (``busy_worker``,
        null when not known, and ``busy_until``) for an on-call script to wait on.

        A worker that lost its lease (SIGSTOPped, partitioned) may wake up inside the call: it
        stops waiting for it, commits nothing and starts nothing more, and the tool sees
        ctx.lease_valid() turn False; but a thread already inside a call that does not check
        cannot be killed. The bound: the old lease's end plus the tool's timeout.
        """
        marker = h.run.tool_call or {}
        mine = marker.get("seq") == seq and marker.get("call_index") == index
        timeout = self._timeout(spec)
        worker: str | None = None
        if mine and marker.get("lease_until"):
            worker = str(marker.get("worker"))
            who = f"worker {worker}"
            ended = datetime.fromisoformat(str(marker["lease_until"]))
        else:  # the previous lease ended before this claim took the run
            who, ended = "its previous holder", h.run.updated_at
        until = ended + timedelta(seconds=timeout)
        said = (
            f"{who} may still be running it until {until.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC "
            f"(its lease ended by {ended.astimezone(UTC):%H:%M:%S}, plus the tool's {timeout:g} s "
            "timeout)"
        )
        return said, {"busy_worker": worker, "busy_until": until.astimezone(UTC).isoformat()}

    async def _invoke(
        self, h: RunHandle, spec: ToolSpec, turn_seq: int, index: int, name: str,
        args: dict[str, Any], key: str, intent: int, timed_out: list[int],
    ) -> dict[str, Any]:
        """Call the tool; retry what it declares transient (never an irreversible call).
        ``intent``: the attempt an irreversible call's intent counts (1, or its approved re-run's),
        which a timeout's wait names, as a wait after a worker's death does: a decision is about
        one attempt. ``timed_out`` gets each attempt cut off by its timeout."""
        attempt = 1
        while True:
            # make_context's, with the key call_tool derived once (a hash of the arguments)
            ctx = ToolContext(h.run_id, turn_seq, index, name, key, attempt, fence=h)
            try:
                outcome = await self._call(h, spec, ctx, args)
            except ToolRaised as raised:
                exc = raised.exc
            else:
                if outcome.is_error:
                    return {"content": outcome.content, "is_error": True}
                return {"content": outcome.content}
            if isinstance(exc, ToolError):
                return {"content": message_of(exc), "is_error": True}
            if isinstance(exc, LeaseExpired):  # the tool saw the fence: this worker must stop
                raise LeaseLost(
                    h.run_id, f"{name} stopped at the fence: {message_of(exc)}") from None
            if isinstance(exc, ToolTimeout) and spec.kind is ToolKind.IRREVERSIBLE:
                # The attempt is named, as after a worker's death: without it a decision on a
                # re-run's timeout was recorded against attempt 1, which already had one, and
                # was dropped while `agentrun reject` said it was taken.
                raise WaitForApproval(
                    f"outcome unknown: {name} (step {turn_seq}, attempt {intent}) did not return "
                    f"within its {exc.timeout:g} s timeout; it may still be running in worker "
                    f"{h.lease.worker} (a call already inside the tool cannot be killed); "
                    f"check its target, then approve to run it once more (attempt {intent + 1}) "
                    "or reject to tell the model it was not retried",
                    {"seq": turn_seq, "call_index": index, "tool": name, "input": args,
                     "stage": "outcome_unknown", "attempt": intent},
                ) from exc
            if isinstance(exc, ToolTimeout):
                timed_out.append(attempt)
            disposition = spec.classify(exc)
            if disposition == "retry" and attempt <= self.retry.max_retries:
                delay = self.retry.delay(attempt - 1, None)
                log.warning("tool %s raised %s; retry %d in %.2fs",
                            name, type(exc).__name__, attempt, delay)
                attempt += 1
                await asyncio.sleep(delay)
                continue
            if disposition == "abort":
                raise RunFailed(
                    f"tool {name} failed: {type(exc).__name__}: {message_of(exc)}") from exc
            log.info("tool %s raised %s: reported to the model", name, type(exc).__name__)
            # A timeout is a cut-off, not a failure: its thread runs on and may yet take
            # effect. call_tool records it as an unknown outcome (the model is shown the error
            # alone), which a rollback undoes; recorded as a plain error, it never was.
            return {"content": f"{type(exc).__name__}: {message_of(exc)}", "is_error": True}

    async def _call(
        self, h: RunHandle, spec: ToolSpec, ctx: ToolContext, args: dict[str, Any]
    ) -> ToolOutcome:
        """One invocation, fenced and bounded.

        Before it starts, the call is marked on the run (a fenced write: a worker that lost the
        run learns it here, from the database, and starts nothing). The mark is what the next
        claim reads if this process dies inside the call (os._exit, a segfault, SIGKILL): that
        run is blamed, with the tool's name, and its co-located runs are handed over without
        losing an attempt (migration 0005). While the call runs the worker stops waiting for it
        at its timeout, or as soon as the lease is lost or runs out by the local clock; an async
        tool is cancelled then, a sync tool's daemon thread is left to finish (or to see the
        fence, ctx.lease_valid()).
        """
        self._refuse_if_lost(h, spec.name)
        if h.marked == (ctx.seq, ctx.call_index) and ctx.attempt == 1:
            h.marked = None  # the model turn's append carried this mark, moments ago
        else:
            await self._turn_landed(h)  # a pipelined turn's mark is older: it lands first
            sent = time.monotonic()
            await self.store.begin_tool_call(h.lease, self._mark(h, spec, ctx.seq, ctx.call_index))
            self._committed(h, sent)
        self._refuse_if_lost(h, spec.name)  # the process may have been stopped since the write
        return await self._bounded(h, spec, ctx, args)

    async def _bounded(
        self, h: RunHandle, spec: ToolSpec, ctx: ToolContext, args: dict[str, Any]
    ) -> ToolOutcome:
        """The tool's invocation, waited for until its timeout or the loss of the lease."""
        timeout = self._timeout(spec)
        call = asyncio.ensure_future(spec.invoke(ctx, args))
        deadline = time.monotonic() + timeout
        try:
            if not await _within_lease(h, call, f"stopped waiting for {spec.name}", deadline):
                log.warning("tool %s (step %d, call %d) timed out after %g s",
                            spec.name, ctx.seq, ctx.call_index, timeout)
                raise ToolRaised(ToolTimeout(spec.name, timeout))
            failure = call.exception()
            if failure is not None:
                raise ToolRaised(failure)
            return call.result()
        finally:
            if not call.done():
                call.cancel()  # an async tool stops here; a sync tool's thread is abandoned

    def _refuse_if_lost(self, h: RunHandle, name: str) -> None:
        lost = h.lease_lost()
        if lost is not None:
            raise LeaseLost(h.run_id, f"{lost}; not starting {name}")
