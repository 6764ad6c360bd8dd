"""The kopf handlers: AgentRun objects become runs; annotations and deletion act on them.

* create: the spec is validated, the agent resolved (a reference to an Agent in the same
  namespace, from an in-memory kopf index, or an inline agent) and the run created in the store,
  idempotently on the object's uid (a handler that runs twice, e.g. after the operator died
  between the insert and kopf's own bookkeeping, finds the same row). An unknown Agent is a
  condition (Accepted=False, AgentNotFound) and a retry every 15 s (by default), so creating the
  Agent later is enough.
* resume (operator start): the object is tracked by the status mirror again.
* annotations ``agentrun.dev/cancel: "true"``, ``agentrun.dev/approve: "<seq>"``,
  ``agentrun.dev/reject: "<seq>"``: acted on in the store, then removed (consumed), with an
  Event saying what was done or why it was refused.
* delete: kopf's finalizer holds the object until the run is cancelled in the store; the run's
  history stays there.

Status mirroring, scaling and metrics are background loops (:mod:`agentrun.operator.app`).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import kopf
from pydantic import ValidationError

from agentrun.errors import ConfigError
from agentrun.faults import crash_point
from agentrun.manifests import AgentRef, AgentRunSpec, AgentSpec
from agentrun.operator.app import DB_ERRORS, OperatorApp
from agentrun.operator.crds import GROUP, VERSION
from agentrun.operator.kube import KubeApi
from agentrun.operator.metrics import OperatorMetrics
from agentrun.operator.settings import OperatorSettings
from agentrun.operator.status import Cond, db_condition, set_condition, status_for
from agentrun.store import K8sRef, Store

log = logging.getLogger(__name__)

AGENTRUNS = (GROUP, VERSION, "agentruns")
AGENTS = (GROUP, VERSION, "agents")
CANCEL = "agentrun.dev/cancel"
APPROVE = "agentrun.dev/approve"
REJECT = "agentrun.dev/reject"
ACTIONS = (CANCEL, APPROVE, REJECT)
FINALIZER = "agentrun.dev/finalizer"
DB_RETRY_DELAY = 5.0


def _validation_message(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"] if not str(x).startswith(("AgentRef", "AgentSpec")))
        parts.append(f"spec.{loc}: {e['msg']}")
    return "; ".join(parts)


def has_action(annotations: kopf.Annotations, **_: Any) -> bool:
    return any(key in annotations for key in ACTIONS)


def build_registry(config: OperatorSettings) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    state: dict[str, OperatorApp] = {}

    def app() -> OperatorApp:
        return state["app"]

    async def store_or_retry(patch: kopf.Patch, status: dict[str, Any]) -> Store:
        store = await app().ready_store()
        if store is None:
            conditions = set_condition(status.get("conditions"), db_condition(False))
            patch.status["conditions"] = conditions
            raise kopf.TemporaryError("database unavailable; retrying", delay=DB_RETRY_DELAY)
        return store

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # A registry of our own gets no default login: the pod's service account when in a
        # cluster, else $KUBECONFIG, through the official client (as kopf's default does).
        return kopf.login_via_client(**kwargs)

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        ks = settings
        ks.persistence.finalizer = FINALIZER
        # Keep kopf's bookkeeping in annotations: .status is ours, and the CRD's structural
        # schema would prune anything else written there.
        ks.persistence.progress_storage = kopf.AnnotationsProgressStorage(
            prefix="operator.agentrun.dev"
        )
        ks.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix="operator.agentrun.dev", key="last-handled-configuration"
        )
        ks.posting.level = logging.INFO
        metrics = OperatorMetrics()
        if config.metrics_port is not None:
            metrics.serve(config.metrics_port)
        kube = KubeApi.from_environment(on_call=lambda verb: metrics.kube_calls.labels(verb).inc())
        state["app"] = OperatorApp(config, kube, metrics)
        await state["app"].start()


    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
        if "app" in state:
            await state["app"].stop()

    @kopf.index(*AGENTS, registry=registry, id="agents_by_name")
    def agents_by_name(
        namespace: str | None, name: str, spec: kopf.Spec, **_: Any
    ) -> dict[tuple[str | None, str], dict[str, Any]]:
        return {(namespace, name): dict(spec)}

    @kopf.on.create(*AGENTRUNS, registry=registry, id="run", backoff=5)
    async def create_run(
        body: kopf.Body,
        spec: kopf.Spec,
        namespace: str | None,
        name: str,
        uid: str,
        status: kopf.Status,
        patch: kopf.Patch,
        **kwargs: Any,
    ) -> None:
        assert namespace is not None  # AgentRun is namespaced
        agents: kopf.Index[tuple[str | None, str], dict[str, Any]] = kwargs["agents_by_name"]
        current = dict(status)
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
                    patch.status["message"] = f"Agent {run_spec.agent.name} not found"
                    patch.status["conditions"] = set_condition(
                        current.get("conditions"), Cond("Accepted", False, "AgentNotFound", why)
                    )
                    kopf.warn(body, reason="AgentNotFound", message=why)
                    raise kopf.TemporaryError(why, delay=config.agent_retry_delay)
                agent = AgentSpec.model_validate(found[0])
            else:
                agent = run_spec.agent
        except ValidationError as exc:
            why = _validation_message(exc)
            patch.status["message"] = "invalid spec"
            patch.status["conditions"] = set_condition(
                current.get("conditions"), Cond("Accepted", False, "InvalidSpec", why)
            )
            kopf.warn(body, reason="InvalidSpec", message=why)
            raise kopf.PermanentError(why) from None

        store = await store_or_retry(patch, current)
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
        new = status_for(run, db_up=True, previous=current)
        patch.status.update(new)
        app().mirror.track(namespace, name, uid, new)
        log.info(
            "AgentRun %s/%s: %s run in pool %s",
            namespace, name, "created" if created else "found the existing", run.pool,
            extra={"run_id": str(run.id)},
        )
        if created:
            kopf.info(body, reason="Created", message=f"run {run.id} in pool {run.pool}")

    @kopf.on.resume(*AGENTRUNS, registry=registry, id="track")
    async def resume(
        namespace: str | None, name: str, uid: str, status: kopf.Status, **_: Any
    ) -> None:
        app().mirror.track(namespace or "", name, uid, dict(status))

    @kopf.on.create(*AGENTRUNS, registry=registry, id="actions", when=has_action)
    @kopf.on.update(*AGENTRUNS, registry=registry, id="actions", when=has_action)
    @kopf.on.resume(*AGENTRUNS, registry=registry, id="actions", when=has_action)
    async def actions(
        body: kopf.Body,
        annotations: kopf.Annotations,
        namespace: str | None,
        name: str,
        uid: str,
        status: kopf.Status,
        patch: kopf.Patch,
        **_: Any,
    ) -> None:
        store = await store_or_retry(patch, dict(status))
        try:
            run = await store.get_run_by_k8s_uid(uid)
        except DB_ERRORS as exc:
            raise kopf.TemporaryError(f"database: {exc}", delay=DB_RETRY_DELAY) from None
        if run is None:
            raise kopf.TemporaryError("the run is not created yet", delay=1)
        who = f"annotation on AgentRun {namespace}/{name}"
        for key in ACTIONS:
            if key not in annotations:
                continue
            value = str(annotations[key]).strip()
            try:
                if key == CANCEL:
                    if value.lower() not in ("true", "yes", "1"):
                        raise ConfigError(f'{key} must be "true", not {value!r}')
                    _run, changed = await store.cancel(run.id, f"cancelled by {who}")
                    if not changed:
                        kopf.info(body, reason="CancelIgnored",
                                  message=f"the run had already ended ({run.status})")
                else:
                    try:
                        seq = int(value)
                    except ValueError:
                        raise ConfigError(
                            f"{key} must be the step number the run waits on (see .status."
                            f"pendingApproval.seq), not {value!r}"
                        ) from None
                    decision: Literal["approved", "rejected"] = (
                        "approved" if key == APPROVE else "rejected"
                    )
                    call = await store.decide(run.id, seq, decision, decided_by=who)
                    kopf.info(
                        body,
                        reason="Approved" if key == APPROVE else "Rejected",
                        message=f"step {seq} ({call.get('tool')}) {decision} by {who}",
                    )
                log.info("AgentRun %s/%s: %s=%s applied", namespace, name, key, value,
                         extra={"run_id": str(run.id)})
            except ConfigError as exc:
                kopf.warn(body, reason="ActionRefused", message=f"{key}={value}: {exc}")
                log.warning("AgentRun %s/%s: %s=%s refused: %s", namespace, name, key, value, exc,
                            extra={"run_id": str(run.id)})
            except DB_ERRORS as exc:
                raise kopf.TemporaryError(f"database: {exc}", delay=DB_RETRY_DELAY) from None
            # Consumed: the same annotation can be set again for the next decision.
            patch.metadata.annotations[key] = None

    @kopf.on.delete(*AGENTRUNS, registry=registry, id="cancel-on-delete")
    async def delete(
        namespace: str | None, name: str, uid: str, status: kopf.Status, patch: kopf.Patch, **_: Any
    ) -> None:
        store = await store_or_retry(patch, dict(status))
        try:
            run = await store.get_run_by_k8s_uid(uid)
            if run is not None and not run.finished:
                await store.cancel(run.id, f"AgentRun {namespace}/{name} deleted")
                log.info("AgentRun %s/%s deleted: run cancelled; its history stays in the store",
                         namespace, name, extra={"run_id": str(run.id)})
        except DB_ERRORS as exc:
            raise kopf.TemporaryError(f"database: {exc}", delay=DB_RETRY_DELAY) from None
        app().mirror.forget(uid)

    return registry
