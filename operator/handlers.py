"""The kopf handlers: AgentRun objects become runs; annotations and deletion act on them.

* create: the spec is validated, the agent resolved (a reference to an Agent in the same
  namespace, from an in-memory kopf index, or an inline agent) and the run created in the store,
  idempotently on the object's uid (a handler that runs twice, e.g. after the operator died
  between the insert and kopf's own bookkeeping, finds the same row). An unknown Agent is a
  condition (Accepted=False, AgentNotFound), one Warning Event and one log line, and a quiet
  retry every 15 s (by default), so creating the Agent later is enough.
* resume (operator start): the object is tracked by the status mirror again.
* annotations ``agentrun.dev/cancel: "true"``, ``agentrun.dev/approve: "<seq>.<call>"``,
  ``agentrun.dev/reject: "<seq>.<call>"`` (the wait, as .status.pendingApproval.decide names
  it), ``agentrun.dev/retry: "true"`` (or a reason): acted on in
  the store and removed (consumed), with an Event saying what was done or why it was refused;
  on every event of an object carrying one (:func:`on_action`), not on kopf's change detection.
  The approve/reject annotations are unauthenticated (whoever may patch the AgentRun decides);
  ``approval_annotations=False`` refuses them. AgentRunApproval objects, whose approver the API
  server vouches for, are handled in :mod:`agentrun.operator.approvals`.
* ``spec.ttlSecondsAfterFinished``: the object is deleted that long after its run
  finished (the run's rows stay in the store; ``agentrun prune`` deletes those).
* delete: the watch's DELETED event cancels the run in the store (its history stays there).
  No finalizer: an AgentRun never waits for the operator to go away, so uninstalling, deleting
  the CRDs or a namespace cannot hang. A deletion the operator did not see (it was down) is
  found by the status mirror at its next resync, which cancels the run then. Objects that still
  carry the finalizer of earlier versions have it removed by kopf (no handler needs it).
* Events: posted by the operator alone (kopf's posting of its log lines is off), so an object's
  Events come from one source, ``agentrun-operator``.

Status mirroring, scaling and metrics are background loops (:mod:`agentrun.operator.app`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from agentrun.errors import ConfigError, DatabaseUnavailable, RunNotFound
from agentrun.faults import crash_point
from agentrun.manifests import AgentRef, AgentRunSpec, AgentSpec
from agentrun.operator import approvals
from agentrun.operator.api import (
    ACTIONS,
    AGENTRUNS,
    AGENTS,
    APPROVE,
    CANCEL,
    GROUP,
    REJECT,
    RETRY,
    VERSION,
    CondType,
    Reason,
)
from agentrun.operator.app import APP, OUTAGES, OperatorApp, backoff, memo_get
from agentrun.operator.kube import KubeApi, NotFound
from agentrun.operator.metrics import OperatorMetrics
from agentrun.operator.settings import OperatorSettings
from agentrun.operator.status import (
    Cond,
    Event,
    db_condition,
    not_ready,
    one_line,
    set_condition,
    status_for,
)
from agentrun.store import DB_ERRORS, K8sRef, Store
from agentrun.supervise import describe, watch
from agentrun.vocabulary import TERMINAL_STATUSES, VERDICTS
from agentrun.waits import WaitRef

log = logging.getLogger(__name__)


async def _check_pool(
    op: OperatorApp,
    pool: str,
    namespace: str,
    current: dict[str, Any],
    ref: dict[str, Any],
    refuse: Callable[[Reason, str, str], None],
) -> None:
    """Refuse an AgentRun whose pool does not admit its namespace, before any run exists: a pool
    is its workers' tools and credentials. Retried like an unknown Agent (a namespace labelled
    later is admitted then), with one Event per object."""
    tenancy = op.settings.tenancy
    labels = None
    if tenancy.needs_labels(pool, namespace):
        try:
            labels = await op.kube.namespace_labels(namespace)
        except ApiException as exc:
            raise kopf.TemporaryError(
                f"namespace {namespace}: cannot read its labels ({exc.status} {exc.reason})",
                delay=DB_RETRY_DELAY,
            ) from None
    why = tenancy.refusal(pool, namespace, labels)
    if why is None:
        return
    if not _has_reason(current, CondType.ACCEPTED, Reason.POOL_NOT_ALLOWED):
        await op.event(ref, Event("Warning", Reason.POOL_NOT_ALLOWED, why), run_id=None)
    refuse(Reason.POOL_NOT_ALLOWED, f"pool {pool} does not admit namespace {namespace}", why)
    raise kopf.TemporaryError(
        f"pool {pool} does not admit namespace {namespace}",
        delay=op.settings.agent_retry_delay,
    )


async def _check_tools(
    op: OperatorApp,
    store: Store,
    pool: str,
    agent: AgentSpec,
    current: dict[str, Any],
    ref: dict[str, Any],
) -> None:
    """Warn at apply time when the Agent asks for tools that its pool's workers did not register
    (migration 0013). A warning, not a refusal: a pool scaled to zero whose new image adds the
    tool has no worker to register it until a run makes the operator scale it up, so refusing
    would wait forever. The run's own check at its first claim still fails it, naming the tool."""
    if not agent.tools or current.get("runId"):
        return
    try:
        served = await store.served_tools(pool)
    except DB_ERRORS as exc:
        raise kopf.TemporaryError(f"database: {exc}", delay=DB_RETRY_DELAY) from None
    missing = [t for t in agent.tools if served is not None and t not in served]
    if not missing:
        return
    known = ", ".join(sorted(served or ())) or "none"
    await op.event(ref, Event("Warning", Reason.UNKNOWN_TOOL, one_line(
        f"pool {pool}'s workers serve the tools {known}; the Agent asks for "
        f"{', '.join(missing)}, which none of them registered: the run fails at its first claim "
        f"unless a worker with them starts (add the module to workers.pools[{pool}].tools)",
        1000)), run_id=None)


#: Put on AgentRuns by versions before 0.2; kopf removes it now that no handler needs it.
FINALIZER = "agentrun.dev/finalizer"
DB_RETRY_DELAY = 5.0
#: Where the TTL handler's bookkeeping is kept in kopf's memo.
EXPIRIES = "agentrun_expiries"
#: Why an approve/reject annotation is refused when the chart turns them off.
ANNOTATIONS_OFF = "approve by annotation is disabled; create an AgentRunApproval"
#: How a retry while the Agent does not exist starts; its kopf log line is filtered out (we log
#: the wait once, at WARNING, instead of an ERROR every retry).
AWAITING_AGENT = "waiting for Agent"
#: An action annotation's retry while the object has no run yet (not said at each try).
RUN_NOT_CREATED = "the run is not created yet"


class _QuietAgentRetries(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(f"failed temporarily: {quiet}" in message
                       for quiet in (AWAITING_AGENT, RUN_NOT_CREATED))


def _ref(namespace: str, name: str, uid: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "AgentRun",
        "metadata": {"name": name, "namespace": namespace, "uid": uid},
    }


def _validation_message(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"] if not str(x).startswith(("AgentRef", "AgentSpec")))
        parts.append(f"spec.{loc}: {e['msg']}")
    return "; ".join(parts)


def has_action(annotations: Mapping[str, str], **_: Any) -> bool:
    return any(key in annotations for key in ACTIONS)


def ttl_due(spec: kopf.Spec, status: kopf.Status, **_: Any) -> bool:
    """The object has a TTL and its run finished (the timer checks the time)."""
    return (
        spec.get("ttlSecondsAfterFinished") is not None
        and status.get("phase") in TERMINAL_STATUSES
        and bool(status.get("finishedAt"))
    )


@dataclass
class Expiries:
    """The TTL handler's bookkeeping (see :func:`ttl`): one task per object waiting for its
    expiry, and the objects being deleted by one (their DELETED event must not cancel it)."""

    expiring: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    deleting: set[str] = field(default_factory=set)


@dataclass
class Acting:
    """The action annotations' bookkeeping (see :func:`on_action`): one task per object acting on
    its annotations, and the objects that had an event while theirs acted (read once more)."""

    tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    again: set[str] = field(default_factory=set)


#: Where the action annotations' bookkeeping is kept in kopf's memo.
ACTING = "agentrun_acting"


def _app(memo: kopf.Memo) -> OperatorApp:
    return memo_get(memo, APP, OperatorApp)


def _expiries(memo: kopf.Memo) -> Expiries:
    return memo_get(memo, EXPIRIES, Expiries)


def build_registry(config: OperatorSettings) -> kopf.OperatorRegistry:
    """The operator's handlers on a registry of their own. What they share lives in kopf's
    ``memo``, which kopf hands to every handler: the startup handler puts the
    :class:`OperatorApp` (built from ``config``) and the handlers' bookkeeping there, before any
    object is watched (each object's memo is a shallow copy of that one)."""
    registry = kopf.OperatorRegistry()

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        await start(config, settings, memo)

    kopf.on.login(registry=registry)(login)
    # AgentRunApproval objects (operator/approvals.py): decisions whose approver is vouched for.
    approvals.register(registry)
    kopf.on.cleanup(registry=registry)(cleanup)
    kopf.index(*AGENTS, registry=registry, id="agents_by_name")(agents_by_name)
    kopf.on.create(*AGENTRUNS, registry=registry, id="run", backoff=5)(create_run)
    kopf.on.resume(*AGENTRUNS, registry=registry, id="track")(resume)
    # Every event, not kopf's change detection: see on_action.
    kopf.on.event(*AGENTRUNS, registry=registry, id="actions", when=has_action)(on_action)
    kopf.on.event(*AGENTRUNS, registry=registry, id="ttl")(ttl)
    kopf.on.event(*AGENTRUNS, registry=registry, id="cancel-on-delete")(deleted)
    return registry


def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    # A registry of our own gets no default login: the pod's service account when in a
    # cluster, else $KUBECONFIG, through the official client (as kopf's default does).
    return kopf.login_via_client(**kwargs)


async def start(config: OperatorSettings, ks: kopf.OperatorSettings, memo: kopf.Memo) -> None:
    ks.persistence.finalizer = FINALIZER
    # Keep kopf's bookkeeping in annotations: .status is ours, and the CRD's structural
    # schema would prune anything else written there.
    ks.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix="operator.agentrun.dev"
    )
    ks.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="operator.agentrun.dev",
        key="last-handled-configuration",
        # The spec is immutable (CEL) and may be 100s of KB (the task): kopf would copy it
        # into this annotation, and an annotation over 256 KiB wedges the object. The action
        # annotations are anyone's text too (a 180 KB one made kopf's own patch fail, with a
        # traceback), and no kopf handler compares them (on_action).
        ignored_fields=["spec", *(("metadata", "annotations", key) for key in ACTIONS)],
    )
    ks.posting.enabled = False  # Events come from the operator alone (app.event)
    logging.getLogger("kopf.objects").addFilter(_QuietAgentRetries())
    metrics = OperatorMetrics()
    if config.metrics_port is not None:
        try:
            metrics.serve(config.metrics_port)
        except ConfigError as exc:  # taken since `agentrun operator` checked it: exit 2
            raise kopf.PermanentError(str(exc)) from exc
    kube = KubeApi.from_environment(on_call=lambda verb: metrics.kube_calls.labels(verb).inc())
    app = OperatorApp(config, kube, metrics)
    memo[APP] = app
    memo[EXPIRIES] = Expiries()
    memo[ACTING] = Acting()
    memo[approvals.WORKING] = approvals.Working()
    await app.start()


async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    # The per-object tasks first: left to kopf, which waits 5 s for tasks it did not start, one
    # sleeping in a retry woke after the store was closed and said the database was down. The
    # next start acts on what they left (the watch's first listing).
    acting, expiries = memo.get(ACTING), memo.get(EXPIRIES)  # none if the start-up failed
    tasks = [*(acting.tasks.values() if isinstance(acting, Acting) else ()),
             *(expiries.expiring.values() if isinstance(expiries, Expiries) else ())]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if APP in memo:
        await _app(memo).stop()


def agents_by_name(
    namespace: str | None, name: str, spec: kopf.Spec, **_: Any
) -> dict[tuple[str | None, str], dict[str, Any]]:
    return {(namespace, name): dict(spec)}


async def _store_or_retry(app: OperatorApp, patch: kopf.Patch, status: dict[str, Any]) -> Store:
    store = await app.ready_store()
    if store is None:
        conditions = set_condition(status.get("conditions"), db_condition(False))
        patch.status["conditions"] = conditions
        raise kopf.TemporaryError("database unavailable; retrying", delay=DB_RETRY_DELAY)
    return store


async def create_run(
    spec: kopf.Spec,
    namespace: str | None,
    name: str,
    uid: str,
    status: kopf.Status,
    patch: kopf.Patch,
    meta: kopf.Meta,
    memo: kopf.Memo,
    **kwargs: Any,
) -> None:
    assert namespace is not None  # AgentRun is namespaced
    app = _app(memo)
    config = app.settings
    agents: kopf.Index[tuple[str | None, str], dict[str, Any]] = kwargs["agents_by_name"]
    current = dict(status)
    generation = meta.get("generation")
    ref = _ref(namespace, name, uid)

    def refuse(reason: Reason, message: str, why: str) -> None:
        conditions = set_condition(
            current.get("conditions"), Cond(CondType.ACCEPTED, False, reason, why), generation
        )
        patch.status["conditions"] = set_condition(
            conditions, not_ready(reason, why), generation
        )
        patch.status["message"] = message
        patch.status["observedGeneration"] = generation

    try:
        run_spec = AgentRunSpec.model_validate(dict(spec))
        if isinstance(run_spec.agent, AgentRef):
            key = (namespace, run_spec.agent.name)
            found = list(agents.get(key, []))
            if not found:
                why = (
                    f"spec.agent.name: no Agent {run_spec.agent.name!r} in namespace "
                    f"{namespace}; create it (kubectl apply -f agent.yaml) and the run "
                    f"starts within {config.agent_retry_delay:.0f}s"
                )
                if not _has_reason(current, CondType.ACCEPTED, Reason.AGENT_NOT_FOUND):
                    # Once per object (and per operator restart it is not repeated: the
                    # condition is on the object): one Event, and its one WARNING line.
                    await app.event(
                        ref, Event("Warning", Reason.AGENT_NOT_FOUND, why), run_id=None
                    )
                refuse(Reason.AGENT_NOT_FOUND, f"Agent {run_spec.agent.name} not found", why)
                raise kopf.TemporaryError(
                    f"{AWAITING_AGENT} {run_spec.agent.name!r}",
                    delay=config.agent_retry_delay,
                )
            agent = AgentSpec.model_validate(found[0])
        else:
            agent = run_spec.agent
        agent = run_spec.resolved_agent(agent)
        await _check_pool(app, run_spec.pool or agent.pool, namespace, current, ref, refuse)
    except ValidationError as exc:
        why = _validation_message(exc)
        refuse(Reason.INVALID_SPEC, "invalid spec", why)
        await app.event(ref, Event("Warning", Reason.INVALID_SPEC, why), run_id=None)
        raise kopf.PermanentError(why) from None

    store = await _store_or_retry(app, patch, current)
    await _check_tools(app, store, run_spec.pool or agent.pool, agent, current, ref)
    try:
        run, created = await store.create_run(
            run_spec.task,
            agent,
            pool=run_spec.pool,
            max_steps=run_spec.max_steps,
            max_attempts=run_spec.max_attempts,
            k8s=K8sRef(namespace, name, uid),
        )
    except DB_ERRORS as exc:
        raise kopf.TemporaryError(f"database: {exc}", delay=DB_RETRY_DELAY) from None
    # Crash tests kill the operator here: the row exists, kopf has not recorded success.
    crash_point("operator_after_create_run", 0)
    new = status_for(run, db_up=True, previous=current, generation=generation)
    # A merge patch: keys the new status lacks (an earlier "message") are set to null.
    patch.status.update({**{k: None for k in current}, **new})
    app.mirror.track(namespace, name, uid, new, generation)
    log.info(
        "AgentRun %s/%s: %s run in pool %s",
        namespace, name, "created" if created else "found the existing", run.pool,
        extra={"run_id": str(run.id)},
    )
    if created:
        await app.event(
            ref, Event("Normal", Reason.CREATED, f"run {run.id} in pool {run.pool}"), run.id
        )


async def resume(
    namespace: str | None, name: str, uid: str, status: kopf.Status, meta: kopf.Meta,
    memo: kopf.Memo, **_: Any,
) -> None:
    _app(memo).mirror.track(namespace or "", name, uid, dict(status), meta.get("generation"))


# The action annotations: a raw-event handler, not kopf's on.update. kopf calls an update handler
# only when the object differs from the last body it handled, which held the annotation: the same
# value set again by a second human a moment after the first one's was consumed (or X, then Y, then
# X within one of kopf's batches) looked like no change and was never handled, until some other
# change to the object applied it, a retry included, long after, with nobody asking. Every event
# of an object carrying one now makes sure one task acts on what the object reads (from the API
# server: an event's body may be older than the consume that followed it), again while events
# keep coming; retries (no run yet, the database or the API server down) are the task's own.
async def on_action(
    event: kopf.RawEvent, namespace: str | None, name: str, uid: str, memo: kopf.Memo, **_: Any,
) -> None:
    if event.get("type") == "DELETED":
        return
    acting = memo_get(memo, ACTING, Acting)
    if uid in acting.tasks:
        acting.again.add(uid)  # read once more when the running pass ends
        return
    acting.tasks[uid] = watch(asyncio.create_task(
        act(memo, acting, namespace or "", name, uid), name=f"actions-{uid}"),
        lambda exc: log.error("AgentRun %s/%s: acting on its annotations failed: %s",
                              namespace, name, describe(exc)))


#: What act() tries again: no run yet, the database or the API server down.
RETRIED: tuple[type[BaseException], ...] = (kopf.TemporaryError, *OUTAGES)


async def act(memo: kopf.Memo, acting: Acting, namespace: str, name: str, uid: str) -> None:
    """Act on the object's action annotations until none is left to act on and no event came
    meanwhile; an outage is said once and retried, backing off."""
    app = _app(memo)
    retry, said = 0, ""  # said: the kind of outage said last (each kind once, not each try)
    try:
        while True:
            acting.again.discard(uid)
            run_id: Any = None
            try:
                obj = await app.kube.get_agentrun(namespace, name)
                meta = obj.get("metadata") or {}
                if meta.get("uid") != uid:
                    return  # deleted, or re-created under the name: its own events act on it
                status = dict(obj.get("status") or {})
                run_id = status.get("runId")
                annotations = dict(meta.get("annotations") or {})
                if has_action(annotations):
                    await actions(annotations=annotations, namespace=namespace, name=name,
                                  uid=uid, status=status, patch=kopf.Patch(), memo=memo,
                                  retry=retry)
                retry, said = 0, ""
            except NotFound:
                return
            except Exception as exc:
                # No run yet (not said: it is a moment behind, or waits for its Agent, which is
                # said where the run is created), the database or the API server down: said
                # once per kind of outage. Anything else is a fault of ours, said as one, and
                # tried again all the same: ended, the task left the annotation to the object's
                # next event, which may never come or come with nobody expecting it.
                kind = type(exc).__name__ if isinstance(exc, RETRIED) else "fault"
                if kind != said and str(exc) != RUN_NOT_CREATED:
                    said = kind
                    log.log(logging.WARNING if kind != "fault" else logging.ERROR,
                            "AgentRun %s/%s: its annotations are not acted on yet (%s); "
                            "retrying", namespace, name, one_line(describe(exc), 300),
                            extra={"run_id": str(run_id)})
                delay = exc.delay if isinstance(exc, kopf.TemporaryError) else None
                await asyncio.sleep(backoff(retry) if delay is None else delay)
                retry += 1
                continue
            if uid not in acting.again:
                return
    finally:
        if acting.tasks.get(uid) is asyncio.current_task():  # not a successor's entry
            del acting.tasks[uid]


async def actions(
    annotations: Mapping[str, str],
    namespace: str | None,
    name: str,
    uid: str,
    status: Mapping[str, Any],
    patch: kopf.Patch,
    memo: kopf.Memo,
    retry: int = 0,
    **_: Any,
) -> None:
    app = _app(memo)
    store = await _store_or_retry(app, patch, dict(status))
    try:
        run = await store.get_run_by_k8s_uid(uid)
    except DB_ERRORS as exc:
        raise kopf.TemporaryError(f"database: {exc}", delay=DB_RETRY_DELAY) from None
    ref = _ref(namespace or "", name, uid)

    async def remove(key: str) -> bool:
        """Remove the action annotation ``key`` while it reads what was acted on (a patch
        testing the object's resourceVersion); False: gone or changed since it was read."""
        return await app.kube.consume_annotation(namespace or "", name, uid, key,
                                                 str(annotations[key]))

    if run is None:
        keys = [key for key in ACTIONS if key in annotations]
        pruned = status.get("runId")
        if pruned:
            # The object had a run, since pruned from the store: nothing will ever act on it.
            # Refused once and consumed (before the Event, as below), not retried every second
            # for ever.
            for key in keys:
                await remove(key)
            await app.event(ref, Event("Warning", Reason.ACTION_REFUSED, one_line(
                f"{', '.join(keys)}: run {pruned} was pruned from the store; there is nothing "
                "to act on (create a new AgentRun)", 1000)), str(pruned))
            log.warning("AgentRun %s/%s: %s refused: its run was pruned", namespace, name,
                        ", ".join(keys), extra={"run_id": str(pruned)})
            return
        # Not accepted yet (a moment behind, or waiting for its Agent or its pool): tried again,
        # backing off to the Agent's retry delay, and not logged at each try.
        raise kopf.TemporaryError(RUN_NOT_CREATED,
                                  delay=min(2.0 ** retry, app.settings.agent_retry_delay))
    who = f"annotation on AgentRun {namespace}/{name}"

    async def taken(key: str) -> bool:
        """Remove ``key`` before it is acted on; False: consumed before (a replay of this
        handler) or changed since, so not acted on."""
        if await remove(key):
            return True
        log.info("AgentRun %s/%s: %s=%s was consumed before; not applied again", namespace,
                 name, key, annotations[key], extra={"run_id": str(run.id)})
        return False

    # Both decisions in one look (two humans a moment apart, or one patch setting both): which
    # one was meant is not the operator's to guess. Approve was taken, silently, before.
    both = APPROVE in annotations and REJECT in annotations
    for key in ACTIONS:
        if key not in annotations:
            continue
        value = str(annotations[key]).strip()
        # Every annotation is removed by remove() (only while it still reads what was acted on),
        # never by kopf's patch: that one lands after the handler returns, whatever the
        # annotation reads by then, and deleted the decision a human set on seeing this one's
        # Event ("approve=3" refused, "approve=0" set, then erased with no Event: the run
        # waited on).
        consumed = False
        try:
            if key == CANCEL:
                if value.lower() not in ("true", "yes", "1"):
                    raise ConfigError(f'{key} must be "true", not {value!r}')
                # Acted on before it is consumed: a cancel applied twice is one cancel.
                now, changed = await store.cancel(run.id, f"cancelled by {who}")
                consumed = True
                await remove(key)
                if not changed:
                    await app.event(ref, Event(
                        "Normal", Reason.CANCEL_IGNORED, one_line(
                            f"the run is rolling back ({now.rollback_reason}): a cancel does "
                            "not interrupt a rollback; it ends once its compensations ran"
                            if now.rolling_back
                            else f"the run had already ended ({now.status})", 1000)),
                        run.id)
            elif key == RETRY:
                if value.lower() in ("", "false", "no", "0"):
                    # Read as a reason, "false" retried the run it was meant to leave alone.
                    raise ConfigError(f'{key} must be "true" or the reason for the retry, '
                                      f"not {value!r}")
                reason = who if value.lower() in ("true", "yes", "1") else f"{value} ({who})"
                # Consumed first, as approve/reject: a replay after an operator killed before
                # kopf's removal retried a run that had failed again, with nobody asking.
                if not await taken(key):
                    continue
                consumed = True
                try:
                    now = await store.retry(run.id, reason)  # ConfigError: refused
                except DB_ERRORS as exc:
                    raise _not_recorded(exc) from None
                crash_point("operator_after_annotation_retry", now.retries)
                await app.event(ref, Event(
                    "Normal", Reason.RETRIED, one_line(
                        f"retry {now.retries} by {who}: {now.retried_as()}", 1000)),
                    run.id)
            else:
                if not app.settings.approval_annotations:
                    raise ConfigError(ANNOTATIONS_OFF)
                wait = WaitRef.parse(value, key)  # the call named: see agentrun/waits.py
                if both:
                    other = REJECT if key == APPROVE else APPROVE
                    raise ConfigError(
                        f"set together with {other}={str(annotations[other]).strip()!r}: "
                        "nothing was decided; set one of them again")
                decision = VERDICTS["approve" if key == APPROVE else "reject"]
                # Acted on, then consumed: an operator killed in between acts on it again once
                # back, and the store refuses it, saying who decided that wait (a decision names
                # its wait, which never comes back, and a bare step number is refused once the
                # step had a decision), so it is never applied twice nor to a wait nobody
                # looked at. Consumed first, as before named waits, such a death lost the
                # decision without a word. A database error leaves it to be tried again.
                call = await store.decide(run.id, wait, decision, decided_by=who)
                crash_point("operator_after_annotation_decide", wait.seq)
                consumed = True
                await remove(key)
                await app.event(ref, Event(
                    "Normal",
                    Reason.APPROVED if key == APPROVE else Reason.REJECTED,
                    one_line(f"step {wait.seq} call {call.get('call_index')} "
                             f"({call.get('tool')}, wait {WaitRef.of(call)}) {decision} by {who}",
                             1000),
                ), run.id)
            log.info("AgentRun %s/%s: %s=%r applied", namespace, name, key, value,
                     extra={"run_id": str(run.id)})
        except (ConfigError, RunNotFound) as exc:
            # Pruned between the lookup above and the action (agentrun prune beside it).
            why = (f"run {run.id} was pruned from the store; there is nothing to act on "
                   "(create a new AgentRun)" if isinstance(exc, RunNotFound) else str(exc))
            # Consumed before the Event says so: whoever reads it and sets the annotation again
            # is never undone by this removal. Changed since it was read: the new value is
            # handled next; this one is moot.
            if not consumed and not await taken(key):
                continue
            # The value is anyone's text: escaped on one line, or a newline in it forged rows of
            # `kubectl describe`'s Events table and an escape sequence reached the terminal.
            await app.event(ref, Event(
                "Warning", Reason.ACTION_REFUSED, one_line(f"{key}={value!r}: {why}", 1000)),
                run.id)
            log.warning("AgentRun %s/%s: %s=%r refused: %s", namespace, name, key, value, why,
                        extra={"run_id": str(run.id)})
        except DB_ERRORS as exc:
            raise kopf.TemporaryError(f"database: {exc}", delay=DB_RETRY_DELAY) from None


def _not_recorded(exc: BaseException) -> ConfigError:
    """The refusal of a consumed action the database did not take: it is gone, so say so."""
    return ConfigError(f"not recorded: the database is unavailable ({one_line(str(exc), 200)}); "
                       "set the annotation again")


# spec.ttlSecondsAfterFinished: a raw-event handler, not a kopf timer (a timer makes kopf
# put a finalizer on every object, and an AgentRun must never wait for the operator to be
# deleted). Every event of a finished object with a TTL (the status mirror's patch that
# shows it finished, or the watch's initial listing after an operator restart) makes sure
# one task waits for its expiry, then deletes it. The task outlives an outage of the database
# or the API server at its expiry by retrying (said once per outage, with the run's id): a
# finished object may see no other event that would schedule it again.
async def expire(app: OperatorApp, expiries: Expiries, namespace: str, name: str, uid: str,
                 at: datetime, ttl: int, run_id: str | None) -> None:
    expiring, deleting = expiries.expiring, expiries.deleting
    attempt, waiting_said = 0, False
    due = at  # by the object's status: what counts once the run is pruned from the store
    try:
        while True:
            await asyncio.sleep(max(0.0, (at - datetime.now(UTC)).total_seconds()))
            try:
                later = await _expire_once(app, deleting, namespace, name, uid, ttl, run_id, due)
            except OUTAGES as exc:
                if not waiting_said:
                    waiting_said = True
                    log.warning("AgentRun %s/%s: not deleted after its TTL yet (%s); retrying",
                                namespace, name, one_line(str(exc) or type(exc).__name__, 300),
                                extra={"run_id": str(run_id)})
                at = datetime.now(UTC) + timedelta(seconds=backoff(attempt))
                attempt += 1
                continue
            if later is None:
                return
            # Answered: a later outage is a new one, said again and backed off from its start.
            at, attempt, waiting_said = later, 0, False
    finally:
        if expiring.get(uid) is asyncio.current_task():  # not a successor's entry
            del expiring[uid]
        deleting.discard(uid)


async def _expire_once(app: OperatorApp, deleting: set[str], namespace: str, name: str,
                       uid: str, ttl: int, run_id: str | None, due: datetime) -> datetime | None:
    """Delete the object if its run's TTL has passed; the new expiry if it has not.
    ``due``: the expiry by the object's status, which counts once the run is pruned."""
    # The store decides, not the mirrored status (it may lag): a run retried since is live
    # (its next finish schedules a new expiry), one that finished again counts from its new
    # finish. A run pruned from the store (a prune's cutoff shorter than the TTL) finished
    # when the status says: the object still expires (it stayed for ever).
    store = await app.ready_store()
    if store is None:
        raise DatabaseUnavailable("database unavailable")
    run = await store.get_run_by_k8s_uid(uid)
    if run is None:
        at = due
    elif run.finished and run.finished_at is not None:
        at = run.finished_at + timedelta(seconds=ttl)
    else:
        return None
    if datetime.now(UTC) < at:
        return at
    deleting.add(uid)  # its own DELETED event must not cancel the Event that follows
    if await app.kube.delete_agentrun(namespace, name, uid):
        await app.event(_ref(namespace, name, uid), Event(
            "Normal", Reason.EXPIRED,
            f"deleted {ttl}s after the run finished (spec.ttlSecondsAfterFinished); "
            "the run's rows stay in the store"), run_id)
    return None


async def ttl(
    event: kopf.RawEvent, spec: kopf.Spec, status: kopf.Status, namespace: str | None,
    name: str, uid: str, memo: kopf.Memo, **_: Any,
) -> None:
    expiries = _expiries(memo)
    expiring, deleting = expiries.expiring, expiries.deleting
    if event.get("type") == "DELETED":
        if uid not in deleting:  # deleted by someone else while it waited: stop waiting
            task = expiring.pop(uid, None)
            if task is not None:
                task.cancel()
        return
    if not ttl_due(spec, status):
        task = expiring.pop(uid, None) if uid not in deleting else None
        if task is not None:  # no longer finished (retried): it is not to expire
            task.cancel()
        return
    if uid in expiring:
        return
    finished = datetime.fromisoformat(str(status["finishedAt"]).replace("Z", "+00:00"))
    seconds = int(spec["ttlSecondsAfterFinished"])
    run_id = status.get("runId")
    # expire() retries outages; anything else that ends it is said, not lost.
    expiring[uid] = watch(asyncio.create_task(expire(
        _app(memo), expiries, namespace or "", name, uid, finished + timedelta(seconds=seconds),
        seconds, run_id), name=f"ttl-{uid}"),
        lambda exc: log.error("AgentRun %s/%s: its TTL task failed: %s", namespace, name,
                              describe(exc), extra={"run_id": str(run_id)}))


async def deleted(
    event: kopf.RawEvent, namespace: str | None, name: str, uid: str, memo: kopf.Memo, **_: Any
) -> None:
    if event.get("type") != "DELETED":
        return
    app = _app(memo)
    app.mirror.forget(uid, gone=True)
    store = await app.ready_store()
    try:
        if store is None:
            raise DatabaseUnavailable("database unavailable")
        await app.cancel_for_deleted(store, namespace or "", name, uid)
    except DB_ERRORS:
        # The object is gone and no retry comes from the watch: the mirror's next resync
        # after the outage finds the run's object missing and cancels it then.
        app.mirror.gone.discard(uid)
        log.warning("AgentRun %s/%s deleted while the database is unavailable; its run is "
                    "cancelled once the database answers", namespace, name)


def _has_reason(status: dict[str, Any], ctype: CondType, reason: Reason) -> bool:
    return any(
        c.get("type") == ctype and c.get("reason") == reason
        for c in status.get("conditions") or []
    )
