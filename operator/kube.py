"""The few Kubernetes API calls the operator makes outside kopf's handlers.

kopf owns the watches, the handler patches and the Events. The status mirror and the
autoscaler run in background tasks, so they patch through the official client: each call in a
thread (the client is synchronous), at most ``concurrency`` at once, each counted by verb for
the benchmark and the ``agentrun_kube_api_calls_total`` metric.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from typing import Any, TypeVar

import kubernetes
from kubernetes.client.exceptions import ApiException

from agentrun.operator.api import AGENTRUNS_PLURAL, APPROVALS_PLURAL, GROUP, VERSION

log = logging.getLogger(__name__)
T = TypeVar("T")

MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
#: Reads and removals of an action annotation before giving up on an object that keeps changing
#: under them (kopf then calls the handler again).
CONSUME_TRIES = 5


#: The field manager of the operator's writes (shown in managedFields where Kubernetes records
#: one; scale subresource writes are not recorded on a Deployment).
FIELD_MANAGER = "agentrun-operator"


@dataclass(frozen=True)
class Deployment:
    name: str
    namespace: str
    replicas: int
    annotations: dict[str, str]
    #: Its spec never changed since it was created (metadata.generation 1): the replica count
    #: is its creator's, the API's default of 1 when Helm rendered none. Every scale, by the
    #: operator or anyone, bumps the generation.
    pristine: bool = False


@dataclass(frozen=True)
class Pod:
    name: str
    labels: dict[str, str]
    annotations: dict[str, str]
    #: Why its container last ended (OOMKilled, Error, ...), from the kubelet; None if never.
    last_termination: str | None = None
    restarts: int = 0


class NotFound(Exception):
    pass


class Gone(NotFound):
    """The object the operator knew is gone: deleted, or deleted and re-created under the same
    name (another uid, another run)."""


class KubeApi:
    def __init__(
        self,
        api_client: kubernetes.client.ApiClient,
        *,
        concurrency: int = 8,
        on_call: Callable[[str], None] | None = None,
    ) -> None:
        self.api_client = api_client
        self.custom = kubernetes.client.CustomObjectsApi(api_client)
        self.apps = kubernetes.client.AppsV1Api(api_client)
        self.core = kubernetes.client.CoreV1Api(api_client)
        self._limit = asyncio.Semaphore(concurrency)
        self._on_call = on_call or (lambda verb: None)

    @classmethod
    def from_environment(cls, **kwargs: Any) -> KubeApi:
        """In a pod: the service account. Elsewhere: $KUBECONFIG or ~/.kube/config."""
        config = kubernetes.client.Configuration()
        try:
            kubernetes.config.load_incluster_config(client_configuration=config)  # type: ignore[no-untyped-call]
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config(client_configuration=config)  # type: ignore[no-untyped-call]
        return cls(kubernetes.client.ApiClient(config), **kwargs)

    def close(self) -> None:
        self.api_client.close()  # type: ignore[no-untyped-call]

    async def _call(self, verb: str, fn: Callable[[], T]) -> T:
        async with self._limit:
            self._on_call(verb)
            try:
                return await asyncio.to_thread(fn)
            except ApiException as exc:
                if exc.status == 404:
                    raise NotFound(str(exc.reason)) from None
                raise

    async def probe(self, namespaces: list[str], request_timeout: float) -> None:
        """The readiness check: list at most one AgentRun where the operator watches (each
        watched namespace, else cluster-wide) with its own credentials, so reachability,
        authentication and its main permission are checked by one cheap call. Raises on any
        failure; ``request_timeout`` bounds each request (a black-holed connection must not
        hang it)."""
        if not namespaces:
            await self._call("probe", lambda: self.custom.list_cluster_custom_object(
                GROUP, VERSION, AGENTRUNS_PLURAL, limit=1, _request_timeout=request_timeout))
        # kopf also takes glob patterns ("team-*", "!kube-*"): no list can name those.
        concrete = [ns for ns in namespaces if not any(c in ns for c in "*?[!")]
        served = 0
        for ns in concrete:
            try:
                await self._call("probe", partial(
                    self.custom.list_namespaced_custom_object, GROUP, VERSION, ns,
                    AGENTRUNS_PLURAL, limit=1, _request_timeout=request_timeout))
            except ApiException as exc:
                # A watched namespace deleted takes the chart's Role in it along: 403 there for
                # good, and the operator was never Ready again while it served the others.
                if exc.status != 403 or await self.namespace_exists(ns, request_timeout):
                    raise
            else:
                served += 1
        if namespaces and not served:  # nothing listed: reachability and credentials alone
            version = kubernetes.client.VersionApi(self.api_client)
            await self._call("probe", partial(version.get_code, _request_timeout=request_timeout))

    async def namespace_exists(self, name: str, request_timeout: float | None = None) -> bool:
        """Whether namespace ``name`` exists (terminating counts), by the list of namespaces the
        operator may read when it watches named namespaces (kopf's namespace observer). True
        when it may not ask: absent is what lets a caller treat a refusal as nothing to serve."""
        try:
            found: Any = await self._call("list_namespaces", partial(
                self.core.list_namespace, field_selector=f"metadata.name={name}", limit=1,
                _request_timeout=request_timeout))
        except ApiException:
            return True
        return bool(found.items)

    async def _json_patch(self, plural: str, namespace: str, name: str,
                          ops: list[dict[str, Any]], *, status: bool = False) -> None:
        """A JSON patch of the object (its status subresource with ``status``)."""
        patch = (self.custom.patch_namespaced_custom_object_status if status
                 else self.custom.patch_namespaced_custom_object)
        await self._call("patch_status" if status else "patch", lambda: patch(
            GROUP, VERSION, namespace, plural, name, ops, _content_type=JSON_PATCH))

    async def patch_agentrun_status(
        self, namespace: str, name: str, uid: str, status: dict[str, Any]
    ) -> None:
        """Replace the ``.status`` of the object ``uid``, never of another object that has its
        name now: a JSON patch whose ``test /metadata/uid`` fails is refused with 422 (a merge
        patch's ``metadata.uid`` is silently ignored). Raises :class:`Gone` when the object was
        deleted or replaced."""
        ops: list[dict[str, Any]] = [
            {"op": "test", "path": "/metadata/uid", "value": uid},
            {"op": "add", "path": "/status", "value": status},  # add: replaces one that exists
        ]
        try:
            await self._json_patch(AGENTRUNS_PLURAL, namespace, name, ops, status=True)
        except NotFound:
            raise Gone(f"AgentRun {namespace}/{name} was deleted") from None
        except ApiException as exc:
            if exc.status == 422 and not await self._same_uid(namespace, name, uid):
                raise Gone(
                    f"AgentRun {namespace}/{name} was deleted and re-created (uid {uid} is gone)"
                ) from None
            if exc.status == 403 and not await self.namespace_exists(namespace):
                # A watched namespace deleted while the operator was down: its Role went with
                # it, so 403, not 404, and its runs were never cancelled.
                raise Gone(f"AgentRun {namespace}/{name}: namespace {namespace} was deleted"
                           ) from None
            raise

    async def consume_annotation(
        self, namespace: str, name: str, uid: str, key: str, value: str
    ) -> bool:
        """Remove annotation ``key`` of the AgentRun ``uid`` if it still reads ``value``. True when
        this call removed it; False when it is gone or was changed (consumed before: by this
        handler, run again after an operator restart) or the object was deleted or replaced.

        The value is compared here, on the object as read, and the removal is a JSON patch that
        tests the uid and the resourceVersion read (all or nothing: an object changed since is
        read again). A ``test`` of the value itself compared JSON bytes on the API server, where
        Go writes ``&``, ``<`` and ``>`` escaped and the client writes every non-ASCII character
        escaped: "R&D fixed it" or "café" never matched, and such an action was taken for one
        consumed before, silently, for good."""
        path = "/metadata/annotations/" + key.replace("~", "~0").replace("/", "~1")
        for _ in range(CONSUME_TRIES):
            try:
                obj = await self.get_agentrun(namespace, name)
            except NotFound:
                return False
            meta = obj.get("metadata") or {}
            if meta.get("uid") != uid or (meta.get("annotations") or {}).get(key) != value:
                return False
            ops: list[dict[str, Any]] = [
                {"op": "test", "path": "/metadata/uid", "value": uid},
                {"op": "test", "path": "/metadata/resourceVersion",
                 "value": meta.get("resourceVersion")},
                {"op": "remove", "path": path},
            ]
            try:
                await self._json_patch(AGENTRUNS_PLURAL, namespace, name, ops)
            except NotFound:
                return False
            except ApiException as exc:
                if exc.status == 422:  # changed since it was read: read it again
                    continue
                raise
            return True
        raise ApiException(status=409, reason=(
            f"AgentRun {namespace}/{name} changed at each of {CONSUME_TRIES} tries to remove "
            f"annotation {key}"))

    async def get_agentrun(self, namespace: str, name: str) -> dict[str, Any]:
        """The AgentRun object; raises :class:`NotFound`."""
        obj: Any = await self._call(
            "get",
            lambda: self.custom.get_namespaced_custom_object(
                GROUP, VERSION, namespace, AGENTRUNS_PLURAL, name
            ),
        )
        return dict(obj)

    async def patch_approval_status(
        self, namespace: str, name: str, uid: str, status: dict[str, Any]
    ) -> None:
        """Replace the ``.status`` of the AgentRunApproval ``uid`` (the status subresource: the
        admission policy on approvals matches their creation, not this). A ``test`` of the uid,
        as for AgentRuns (a replaced object's 422 ends the attempt; its watch's DELETED event
        ends the work on it); raises :class:`Gone` when it was deleted."""
        ops: list[dict[str, Any]] = [
            {"op": "test", "path": "/metadata/uid", "value": uid},
            {"op": "add", "path": "/status", "value": status},
        ]
        try:
            await self._json_patch(APPROVALS_PLURAL, namespace, name, ops, status=True)
        except NotFound:
            raise Gone(f"AgentRunApproval {namespace}/{name} was deleted") from None

    async def delete_agentrun(self, namespace: str, name: str, uid: str) -> bool:
        """Delete the AgentRun object ``uid`` (a uid precondition: never another object that
        has its name now). False when it is gone already or was replaced."""
        body = kubernetes.client.V1DeleteOptions(
            preconditions=kubernetes.client.V1Preconditions(uid=uid)
        )
        try:
            await self._call(
                "delete",
                lambda: self.custom.delete_namespaced_custom_object(
                    GROUP, VERSION, namespace, AGENTRUNS_PLURAL, name, body=body
                ),
            )
        except NotFound:
            return False
        except ApiException as exc:
            if exc.status == 409:  # the precondition failed: another object by that name
                return False
            raise
        return True

    async def _same_uid(self, namespace: str, name: str, uid: str) -> bool:
        try:
            obj: Any = await self._call(
                "get",
                lambda: self.custom.get_namespaced_custom_object(
                    GROUP, VERSION, namespace, AGENTRUNS_PLURAL, name
                ),
            )
        except NotFound:
            return False
        return bool(obj.get("metadata", {}).get("uid") == uid)

    async def post_event(
        self, involved: dict[str, Any], type: str, reason: str, message: str
    ) -> None:
        """A core/v1 Event about ``involved`` (apiVersion, kind, metadata name/namespace/uid).

        The status mirror's Events come from background tasks, outside kopf's handler context
        where ``kopf.event()`` works, so they are posted here."""
        meta = involved["metadata"]
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body: Any = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {
                "name": f"{meta['name']}.{uuid.uuid4().hex[:16]}",
                "namespace": meta["namespace"],
            },
            "involvedObject": {
                "apiVersion": involved["apiVersion"],
                "kind": involved["kind"],
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta["uid"],
            },
            "type": type,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": "agentrun-operator"},
            "reportingComponent": "agentrun-operator",
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        await self._call(
            "post_event", lambda: self.core.create_namespaced_event(meta["namespace"], body)
        )

    async def namespace_labels(self, name: str) -> dict[str, str]:
        """A namespace's labels (a pool's namespaceSelector; RBAC: get namespaces)."""
        ns: Any = await self._call("get_namespace", lambda: self.core.read_namespace(name))
        return dict(ns.metadata.labels or {})

    async def get_deployment(self, namespace: str, name: str) -> Deployment:
        d: Any = await self._call(
            "get_deployment", lambda: self.apps.read_namespaced_deployment(name, namespace)
        )
        return Deployment(
            name=name,
            namespace=namespace,
            replicas=int(d.spec.replicas if d.spec.replicas is not None else 1),
            annotations=dict(d.metadata.annotations or {}),
            pristine=d.metadata.generation == 1,
        )

    async def scale_deployment(self, namespace: str, name: str, replicas: int) -> None:
        await self._call(
            "patch_scale",
            lambda: self.apps.patch_namespaced_deployment_scale(
                name, namespace, {"spec": {"replicas": replicas}}, _content_type=MERGE_PATCH,
                field_manager=FIELD_MANAGER,
            ),
        )

    async def list_pods(self, namespace: str, labels: dict[str, str]) -> list[Pod]:
        selector = ",".join(f"{k}={v}" for k, v in labels.items())
        result: Any = await self._call(
            "list_pods",
            lambda: self.core.list_namespaced_pod(namespace, label_selector=selector),
        )
        pods = []
        for p in result.items:
            pod_labels = dict(p.metadata.labels or {})
            # Filter here too: a selector is a request, and the test emulator ignores it.
            if all(pod_labels.get(k) == v for k, v in labels.items()):
                statuses = (p.status.container_statuses or []) if p.status else []
                ended = [s.last_state.terminated for s in statuses
                         if s.last_state and s.last_state.terminated]
                pods.append(Pod(
                    p.metadata.name, pod_labels, dict(p.metadata.annotations or {}),
                    last_termination=ended[0].reason if ended else None,
                    restarts=sum(int(s.restart_count or 0) for s in statuses),
                ))
        return pods

    async def annotate_pod(self, namespace: str, name: str, annotations: dict[str, str]) -> None:
        await self._call(
            "patch_pod",
            lambda: self.core.patch_namespaced_pod(
                name,
                namespace,
                {"metadata": {"annotations": annotations}},
                _content_type=MERGE_PATCH,
            ),
        )
