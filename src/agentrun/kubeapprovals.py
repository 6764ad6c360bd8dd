"""Decisions as AgentRunApproval objects: what ``agentrun approve --kube`` and the Python client
do when they talk to Kubernetes instead of the store.

A decision is an object created with the caller's own credentials (the kubeconfig's), so RBAC
says who may decide (``create`` on agentrunapprovals) and the chart's admission policy makes the
recorded approver the authenticated user: ``spec.approver`` is the name the API server reports
for those credentials (a SelfSubjectReview, authentication.k8s.io/v1, GA in Kubernetes 1.28),
which is exactly what the policy compares it with. The operator records the decision and marks
the object Applied or Refused; the caller waits for that (a watch of the one object) and gets
the outcome, or :class:`ApprovalRefused` with the operator's reason.

The kubernetes client is synchronous: :class:`KubeApprovals` blocks, :class:`AsyncKubeApprovals`
runs each call in a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Self

import kubernetes
import urllib3
import yaml
from kubernetes.client.exceptions import ApiException

from agentrun.errors import EXIT_TIMEOUT, AgentrunError, ConfigError, DatabaseUnavailable
from agentrun.manifests import API_VERSION, AgentRunApprovalSpec
from agentrun.vocabulary import ApprovalDecision
from agentrun.waits import WaitRef

#: Which wait a decision answers: "<seq>.<call>[.<attempt>]", a WaitRef, a bare step number,
#: or None (the wait the AgentRun is stopped on now).
Wait = str | WaitRef | int | None

GROUP, VERSION = API_VERSION.split("/")
PLURAL = "agentrunapprovals"
#: How long a decision waits for the operator by default.
DEFAULT_TIMEOUT = 60.0
#: metadata.generateName: the API server appends 5 characters to at most this many.
_GENERATE_NAME = 58

__all__ = ["ApprovalOutcome", "ApprovalRefused", "ApprovalTimeout", "AsyncKubeApprovals",
           "KubeApprovals", "KubeError"]


class KubeError(AgentrunError):
    """The API server refused a request (RBAC, the admission policy, a missing object): its own
    message, on one line."""


class ApprovalRefused(ConfigError):
    """The operator did not record the decision (the run waits on another step, or on none;
    another decision came first). The object stays, phase Refused, with this message."""

    def __init__(self, outcome: ApprovalOutcome) -> None:
        super().__init__(f"AgentRunApproval {outcome.namespace}/{outcome.name} refused: "
                         f"{outcome.message}")
        self.outcome = outcome


class ApprovalTimeout(AgentrunError, TimeoutError):
    """No Applied or Refused within the timeout: the object stays and the operator acts on it
    when it can."""

    exit_code = EXIT_TIMEOUT


@dataclass(frozen=True)
class ApprovalOutcome:
    """An AgentRunApproval the operator acted on."""

    name: str
    namespace: str
    agent_run: str
    seq: int
    decision: ApprovalDecision
    approver: str
    #: Applied or Refused.
    phase: str
    message: str
    run_id: str | None

    @classmethod
    def of(cls, obj: dict[str, Any]) -> ApprovalOutcome:
        spec, status = obj["spec"], obj.get("status") or {}
        return cls(
            name=obj["metadata"]["name"],
            namespace=obj["metadata"]["namespace"],
            agent_run=spec["agentRun"],
            seq=int(spec["seq"]),
            decision=spec["decision"],
            approver=spec["approver"],
            phase=str(status.get("phase") or "Pending"),
            message=str(status.get("message") or ""),
            run_id=status.get("runId"),
        )


def _api_error(exc: ApiException, what: str) -> KubeError:
    """The API server's own message (RBAC's "forbidden: User ... cannot create ...", the
    admission policy's), as one line."""
    try:
        body = json.loads(exc.body or "{}")
        message = str(body.get("message") or exc.reason)
    except ValueError:
        message = str(exc.reason)
    return KubeError(f"{what}: {exc.status} {' '.join(message.split())}")


class KubeUnreachable(AgentrunError):
    """The API server did not answer (refused, unknown host, timed out). Exit 3, as an
    unreachable database."""

    exit_code = DatabaseUnavailable.exit_code


@contextlib.contextmanager
def _reaching(server: str) -> Iterator[None]:
    """urllib3's errors (the connection refused, a name that does not resolve) as one line:
    they were a traceback of retries."""
    try:
        yield
    except urllib3.exceptions.HTTPError as exc:
        reason = getattr(exc, "reason", None) or exc
        raise KubeUnreachable(f"cannot reach the Kubernetes API server {server} "
                              f"({' '.join(str(reason).split())[:200]})") from None


#: What reading a kubeconfig raises besides the client's own ConfigException: a file that is
#: not UTF-8 text or not YAML was a traceback.
KUBECONFIG_ERRORS = (kubernetes.config.ConfigException, OSError, UnicodeDecodeError,
                     yaml.YAMLError)


class KubeApprovals:
    """Approve or reject the call an AgentRun waits on, as an AgentRunApproval::

        with KubeApprovals(namespace="team-a") as k:
            outcome = k.approve("migrate-orders", 3, reason="reviewed the migration")

    ``kubeconfig`` / ``context``: which credentials (default: $KUBECONFIG or ~/.kube/config and
    its current context; in a pod without one, the pod's ServiceAccount). ``namespace``: of the
    AgentRun (default: the context's namespace, else "default").
    """

    def __init__(
        self,
        *,
        kubeconfig: str | None = None,
        context: str | None = None,
        namespace: str | None = None,
    ) -> None:
        self.namespace = namespace or _context_namespace(kubeconfig, context) or "default"
        config = kubernetes.client.Configuration()
        try:
            kubernetes.config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=kubeconfig, context=context, client_configuration=config)
        except KUBECONFIG_ERRORS as exc:
            env = os.environ.get("KUBECONFIG", "")
            named = kubeconfig or (env if env and os.path.exists(env) else None)
            if named or context:
                # A KUBECONFIG that is there but unusable (not YAML, no such context) is said
                # as it is, not as "set KUBECONFIG" (found by a review); one that names no file
                # leaves the in-cluster credentials to try, as before.
                where = f"kubeconfig {named}" if named else "kubeconfig"
                raise ConfigError(f"{where}: {' '.join(str(exc).split())}") from None
            try:
                kubernetes.config.load_incluster_config(  # type: ignore[no-untyped-call]
                    client_configuration=config)
            except kubernetes.config.ConfigException:
                raise ConfigError(
                    "no Kubernetes credentials: set KUBECONFIG (or pass --kubeconfig), or run "
                    "in a pod with a ServiceAccount token"
                ) from None
        self._client = kubernetes.client.ApiClient(config)
        self._custom = kubernetes.client.CustomObjectsApi(self._client)

    def close(self) -> None:
        self._client.close()  # type: ignore[no-untyped-call]

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def whoami(self) -> str:
        """The user name the API server authenticates these credentials as (what the admission
        policy compares ``spec.approver`` with)."""
        with _reaching(self._client.configuration.host):
            return self._whoami()

    def _whoami(self) -> str:
        auth = kubernetes.client.AuthenticationV1Api(self._client)
        try:
            review = auth.create_self_subject_review(kubernetes.client.V1SelfSubjectReview(
                api_version="authentication.k8s.io/v1", kind="SelfSubjectReview"))
        except ApiException as exc:
            raise _api_error(exc, "who am I (SelfSubjectReview)") from None
        user = review.status.user_info if review.status else None
        if user is None or not user.username:
            raise KubeError("the API server reports no user name for these credentials")
        return str(user.username)

    def approve(
        self, agent_run: str, seq: Wait = None, *, reason: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> ApprovalOutcome:
        """Approve wait ``seq`` of AgentRun ``agent_run`` ("<seq>.<call>", as its
        .status.pendingApproval.decide names it; a bare step number is refused once the step
        had a decision, see agentrun/waits.py; None: the wait it is stopped on now);
        returns once the operator applied it. Raises :class:`ApprovalRefused`,
        :class:`ApprovalTimeout`, :class:`KubeError`."""
        return self.decide(agent_run, seq, "approve", reason=reason, timeout=timeout)

    def reject(
        self, agent_run: str, seq: Wait = None, *, reason: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> ApprovalOutcome:
        """As :meth:`approve`, rejecting: the model is told the call was rejected (and why)."""
        return self.decide(agent_run, seq, "reject", reason=reason, timeout=timeout)

    def decide(
        self, agent_run: str, seq: Wait, decision: ApprovalDecision, *,
        reason: str | None = None, timeout: float = DEFAULT_TIMEOUT,
    ) -> ApprovalOutcome:
        with _reaching(self._client.configuration.host):
            return self._decide(agent_run, seq, decision, reason=reason, timeout=timeout)

    def _decide(
        self, agent_run: str, seq: Wait, decision: ApprovalDecision, *,
        reason: str | None, timeout: float,
    ) -> ApprovalOutcome:
        deadline = time.monotonic() + timeout
        wait = self.pending_wait(agent_run) if seq is None else WaitRef.named_by(seq, "seq")
        spec = AgentRunApprovalSpec(agent_run=agent_run, seq=wait.seq, call=wait.call,
                                    attempt=wait.attempt, decision=decision,
                                    reason=reason, approver=self.whoami())
        base = f"{agent_run[:_GENERATE_NAME - 12]}-{decision}-{wait.seq}"[:_GENERATE_NAME - 1]
        body = {
            "apiVersion": API_VERSION,
            "kind": "AgentRunApproval",
            "metadata": {"generateName": base.rstrip("-.") + "-"},
            "spec": spec.model_dump(mode="json", by_alias=True, exclude_none=True),
        }
        try:
            created: Any = self._custom.create_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, body)
        except ApiException as exc:
            raise _api_error(exc, f"creating an AgentRunApproval in {self.namespace}") from None
        outcome = self.wait(created["metadata"]["name"], max(0.0, deadline - time.monotonic()))
        if outcome.phase == "Refused":
            raise ApprovalRefused(outcome)
        return outcome

    def pending_wait(self, agent_run: str) -> WaitRef:
        """The wait AgentRun ``agent_run`` is stopped on (its .status.pendingApproval), named
        whole: a bare step number read here would be refused on a step's second wait."""
        try:
            obj: Any = self._custom.get_namespaced_custom_object(
                GROUP, VERSION, self.namespace, "agentruns", agent_run)
        except ApiException as exc:
            raise _api_error(exc, f"AgentRun {self.namespace}/{agent_run}") from None
        pending = (obj.get("status") or {}).get("pendingApproval")
        if not pending:
            phase = (obj.get("status") or {}).get("phase") or "not started"
            raise ConfigError(f"AgentRun {self.namespace}/{agent_run} is not waiting for "
                              f"approval (it is {phase})")
        if pending.get("decide"):
            return WaitRef.parse(str(pending["decide"]), ".status.pendingApproval.decide")
        return WaitRef(int(pending["seq"]))  # an operator before the token: the step alone

    def wait(self, name: str, timeout: float = DEFAULT_TIMEOUT) -> ApprovalOutcome:
        """Until the operator marked approval ``name`` Applied or Refused (a watch of that one
        object, re-established until ``timeout``)."""
        deadline = time.monotonic() + timeout
        selector = f"metadata.name={name}"
        while True:
            try:
                listed: Any = self._custom.list_namespaced_custom_object(
                    GROUP, VERSION, self.namespace, PLURAL, field_selector=selector)
            except ApiException as exc:
                raise _api_error(exc, f"AgentRunApproval {self.namespace}/{name}") from None
            for obj in listed.get("items", []):
                outcome = ApprovalOutcome.of(obj)
                if outcome.phase in ("Applied", "Refused"):
                    return outcome
            if not listed.get("items"):
                raise KubeError(f"AgentRunApproval {self.namespace}/{name} was deleted")
            left = deadline - time.monotonic()
            if left <= 0:
                raise ApprovalTimeout(
                    f"AgentRunApproval {self.namespace}/{name} is still Pending after "
                    f"{timeout:g} s: is the operator running? (the object stays; the operator "
                    "acts on it when it can)")
            watch = kubernetes.watch.Watch()  # type: ignore[no-untyped-call]
            try:
                for event in watch.stream(  # type: ignore[no-untyped-call]
                    self._custom.list_namespaced_custom_object, GROUP, VERSION,
                    self.namespace, PLURAL, field_selector=selector,
                    resource_version=listed["metadata"]["resourceVersion"],
                    timeout_seconds=max(1, int(left + 0.999)),
                ):
                    obj = event["object"]
                    phase = (obj.get("status") or {}).get("phase")
                    if event["type"] == "DELETED" or phase in ("Applied", "Refused"):
                        break
            except ApiException as exc:
                if exc.status != 410:  # 410: resourceVersion too old; list again
                    raise _api_error(exc, f"watching AgentRunApproval {name}") from None
            finally:
                watch.stop()  # type: ignore[no-untyped-call]


class AsyncKubeApprovals:
    """:class:`KubeApprovals` for async code: each call runs in a thread."""

    def __init__(
        self,
        *,
        kubeconfig: str | None = None,
        context: str | None = None,
        namespace: str | None = None,
    ) -> None:
        self.sync = KubeApprovals(kubeconfig=kubeconfig, context=context, namespace=namespace)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.sync.close()

    async def whoami(self) -> str:
        return await asyncio.to_thread(self.sync.whoami)

    async def approve(
        self, agent_run: str, seq: Wait = None, *, reason: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,  # noqa: ASYNC109
    ) -> ApprovalOutcome:
        """See :meth:`KubeApprovals.approve`."""
        return await self.decide(agent_run, seq, "approve", reason=reason, timeout=timeout)

    async def reject(
        self, agent_run: str, seq: Wait = None, *, reason: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,  # noqa: ASYNC109
    ) -> ApprovalOutcome:
        """See :meth:`KubeApprovals.reject`."""
        return await self.decide(agent_run, seq, "reject", reason=reason, timeout=timeout)

    async def decide(
        self, agent_run: str, seq: Wait, decision: ApprovalDecision, *,
        reason: str | None = None, timeout: float = DEFAULT_TIMEOUT,  # noqa: ASYNC109
    ) -> ApprovalOutcome:
        return await asyncio.to_thread(
            self.sync.decide, agent_run, seq, decision, reason=reason, timeout=timeout)


def _context_namespace(kubeconfig: str | None, context: str | None) -> str | None:
    """The namespace of the kubeconfig's context (``context``, else the current one)."""
    try:
        contexts, current = kubernetes.config.list_kube_config_contexts(  # type: ignore[no-untyped-call]
            config_file=kubeconfig)
    except KUBECONFIG_ERRORS:
        return None
    chosen = next((c for c in contexts if c.get("name") == context), None) if context else current
    ns = ((chosen or {}).get("context") or {}).get("namespace")
    return str(ns) if ns else None

