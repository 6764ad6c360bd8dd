"""OpenTelemetry traces of run attempts, opt-in by the standard ``OTEL_*`` environment.

Off unless the environment asks (:func:`exporter_names`): then :func:`setup_tracing` builds the
SDK's tracer provider with the exporters asked for, registers it as the global one, and the
worker hands it to :class:`RunTracer`. Off, nothing beyond ``opentelemetry-api`` (which the
anthropic SDK already imports) is loaded, the SDK client is made with its own spans off, and
every hook here is one ``is None`` test (docs/tracing.md has the measured cost).

The spans follow the gen_ai semantic conventions:

* one trace per claim (run attempt): ``invoke_agent [name]``, current in the run's task from
  the claim to the release, so every log line about the attempt carries its ids (logs.py);
* ``chat {model}`` per model call (its retries included), with the usage of the turn; the
  anthropic SDK's own call span (``anthropic.messages.create``) nests under it;
* ``execute_tool {name}`` per tool call.

Spans carry ids, names and counts only: never a prompt, a tool input or output, or an error's
message (a tool's exception can quote what it was given); an error is its type
(``error.type``) and the ``ERROR`` status.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
from collections.abc import Awaitable, Mapping
from typing import TYPE_CHECKING, Any, Final, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, TracerProvider

from agentrun import __version__
from agentrun.logs import POD_NAME_ENV

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

    from agentrun.tools import ToolRegistry
    from agentrun.worker.executor import RunHandle
    from agentrun.worker.model_call import ModelTurn

log = logging.getLogger("agentrun.worker.tracing")

#: The instrumentation scope of the worker's spans.
SCOPE: Final = "agentrun.worker"
#: service.name unless OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES says otherwise.
DEFAULT_SERVICE_NAME: Final = "agentrun-worker"

#: The entry point (group ``opentelemetry_traces_exporter``, as the SDK's own autoconfiguration
#: uses) that serves ``otlp`` for each OTLP protocol; the ``otel`` extra installs the first.
OTLP_EXPORTERS: Final = {
    "http/protobuf": "otlp_proto_http",
    "grpc": "otlp_proto_grpc",
    "http/json": "otlp_json_http",
}
EXPORTER_GROUP: Final = "opentelemetry_traces_exporter"
INSTALL_HINT: Final = "pip install 'agentrun[otel]'"

T = TypeVar("T")
C = TypeVar("C")  # a model client of any provider


def exporter_names(env: Mapping[str, str]) -> list[str]:
    """The span exporters the standard environment asks for; empty: tracing stays off.

    ``OTEL_SDK_DISABLED=true`` wins; then ``OTEL_TRACES_EXPORTER`` (a comma-separated list,
    ``none`` names nothing); without it, an OTLP endpoint (``OTEL_EXPORTER_OTLP_ENDPOINT`` or
    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) means ``otlp``. Unlike the SDK's autoconfiguration,
    whose default exporter is ``otlp``, nothing set means off: a worker never sends spans to a
    collector nobody named.
    """
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    named = env.get("OTEL_TRACES_EXPORTER", "").strip()
    if named:
        return [n for n in (p.strip().lower() for p in named.split(",")) if n and n != "none"]
    if env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return ["otlp"]
    return []


def _exporter(name: str, env: Mapping[str, str]) -> SpanExporter | None:
    """The exporter ``name`` from its installed entry point (it reads its own OTEL_* settings:
    endpoint, headers, timeout, compression); None, with a warning, when none is installed."""
    entry = name
    if name == "otlp":
        protocol = (
            env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            or "http/protobuf"
        ).strip().lower()
        if protocol not in OTLP_EXPORTERS:
            log.warning("OTEL_EXPORTER_OTLP_PROTOCOL %r is not one of %s; no otlp spans",
                        protocol, ", ".join(OTLP_EXPORTERS))
            return None
        entry = OTLP_EXPORTERS[protocol]
    found = importlib.metadata.entry_points(group=EXPORTER_GROUP, name=entry)
    if not found:
        log.warning("OTEL_TRACES_EXPORTER %s: no span exporter %r is installed (%s has otlp "
                    "over http/protobuf, and console)", name, entry, INSTALL_HINT)
        return None
    try:
        exporter: SpanExporter = next(iter(found)).load()()
    except Exception as exc:  # a malformed OTEL_EXPORTER_* setting, say: the worker runs on
        log.warning("OTEL_TRACES_EXPORTER %s: the exporter could not be made: %s", name, exc)
        return None
    return exporter


def setup_tracing(*, worker_id: str | None = None) -> TracerProvider | None:
    """The worker's tracer provider when the ``OTEL_*`` environment asks for spans, else None.

    Made once per process, before the worker (``agentrun worker`` does) and registered as the
    global provider. A provider already registered (``opentelemetry-instrument``) is used as is.
    Asked for but opentelemetry-sdk is missing: one warning, and the worker runs without spans.
    """
    env = os.environ
    names = exporter_names(env)
    if not names:
        return None
    current = trace.get_tracer_provider()
    if not isinstance(current, trace.ProxyTracerProvider):
        log.info("tracing: using the tracer provider already registered (%s)",
                 type(current).__name__)
        return current
    try:
        from opentelemetry.sdk.resources import OTELResourceDetector, Resource
        from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        log.warning("OTEL_* asks for traces (%s) but opentelemetry-sdk is not installed (%s); "
                    "running without them: %s", ", ".join(names), exc, INSTALL_HINT)
        return None
    exporters = [(n, e) for n in names if (e := _exporter(n, env)) is not None]
    if not exporters:
        return None
    # Ours are defaults: OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES override each of them.
    defaults = {"service.name": DEFAULT_SERVICE_NAME, "service.version": __version__}
    if worker_id:
        defaults["service.instance.id"] = worker_id
    if pod := env.get(POD_NAME_ENV):
        defaults["k8s.pod.name"] = pod
    from_env = OTELResourceDetector().detect().attributes
    resource = Resource.create({k: v for k, v in defaults.items() if k not in from_env})
    # The sampler comes from OTEL_TRACES_SAMPLER, the batching from OTEL_BSP_*.
    provider = SdkTracerProvider(resource=resource)
    for _, exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    log.info("tracing: spans of each run attempt go to %s (service.name %s)",
             ", ".join(n for n, _ in exporters), resource.attributes.get("service.name"))
    return provider


def shutdown_tracing(provider: TracerProvider | None) -> None:
    """Export what is still batched and stop the exporters (the API's provider type declares
    no shutdown; the SDK's has one)."""
    shutdown = getattr(provider, "shutdown", None)
    if callable(shutdown):
        shutdown()


def _error_type(exc: BaseException) -> str:
    return type(exc).__name__


class Attempt:
    """The root span of one claim, current in the run's task until :meth:`end`."""

    def __init__(self, span: Span | None) -> None:
        self._span = span
        self._token = (
            otel_context.attach(trace.set_span_in_context(span)) if span is not None else None
        )

    def failed(self, exc: BaseException) -> None:
        """The attempt ended with this error (called where the worker handles it)."""
        if self._span is not None:
            self._span.set_attribute("error.type", _error_type(exc))
            self._span.set_status(Status(StatusCode.ERROR))

    def end(self, abort_reason: str | None = None) -> None:
        if self._span is None:
            return
        if abort_reason is not None:  # drain, cancelled, lease lost, stalled
            self._span.set_attribute("agentrun.attempt.abort_reason", abort_reason)
        self._span.end()
        if self._token is not None:
            otel_context.detach(self._token)
        self._span = self._token = None


class RunTracer:
    """The spans of the runs one worker holds. Without a provider every hook does nothing.

    ``not_failures``: exceptions that end a call or an attempt without it having failed (a
    wait for approval, a cancel); they leave the status unset.
    """

    def __init__(
        self,
        provider: TracerProvider | None = None,
        *,
        pool: str = "",
        worker: str = "",
        not_failures: tuple[type[BaseException], ...] = (),
    ) -> None:
        self.provider = provider
        self._tracer: Tracer | None = (
            provider.get_tracer(SCOPE, __version__) if provider is not None else None
        )
        self._pool, self._worker = pool, worker
        self._not_failures = not_failures

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def _fail(self, span: Span, exc: BaseException) -> None:
        # A cancellation (drain, cancel, lease lost) is the worker stopping the call: no error.
        if isinstance(exc, Exception) and not isinstance(exc, self._not_failures):
            span.set_attribute("error.type", _error_type(exc))
            span.set_status(Status(StatusCode.ERROR))

    def attempt(self, h: RunHandle) -> Attempt:
        """Start the claim's trace and make it current in the calling task (the run's)."""
        if self._tracer is None:
            return Attempt(None)
        run = h.run
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.conversation.id": h.run_id,
            "gen_ai.request.model": run.model,
            "agentrun.run.id": h.run_id,
            "agentrun.run.attempt": run.attempt,
            "agentrun.lease.epoch": h.lease.epoch,
            "agentrun.run.resume_seq": run.next_seq,
            "agentrun.pool": run.pool or self._pool,
            "agentrun.worker.id": self._worker or h.lease.worker,
        }
        if run.k8s_namespace:
            attrs["k8s.namespace.name"] = run.k8s_namespace
        if run.k8s_name:
            attrs["agentrun.run.name"] = run.k8s_name
        name = f"invoke_agent {run.k8s_name}" if run.k8s_name else "invoke_agent"
        # An empty parent context: each claim is a trace of its own, whatever is current here.
        span = self._tracer.start_span(
            name, context=otel_context.Context(), kind=SpanKind.INTERNAL, attributes=attrs
        )
        return Attempt(span)

    def client_for(self, client: C, run_id: str) -> C:
        """The SDK client for one claim (any provider's: they share the SDK's base client): its
        call spans go to our provider and carry the run id as gen_ai.conversation.id. A copy
        shares the original's connection pool."""
        with_options = getattr(client, "with_options", None)
        if self.provider is None or with_options is None:
            return client
        copy: C = with_options(open_telemetry={
            **getattr(client, "open_telemetry", {}), "tracer_provider": self.provider,
            "conversation_id": run_id,
        })
        return copy

    async def model_turn(
        self,
        client: object,
        model: str,
        seq: int,
        call: Awaitable[ModelTurn],
    ) -> ModelTurn:
        """Await one model call (retries included) inside a ``chat {model}`` span."""
        if self._tracer is None:
            return await call
        conversation = (getattr(client, "open_telemetry", None) or {}).get("conversation_id")
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": "chat",
            # The SDK's name for its provider (a Bedrock or Vertex client says so); the attribute
            # is the client's, not ours to guess.
            "gen_ai.provider.name": getattr(getattr(client, "_otel", None), "provider_name",
                                            "anthropic"),
            "gen_ai.request.model": model,
            "agentrun.step.seq": seq,
        }
        if conversation:
            attrs["gen_ai.conversation.id"] = conversation
        with self._tracer.start_as_current_span(
            f"chat {model}", kind=SpanKind.INTERNAL, attributes=attrs,
            record_exception=False, set_status_on_exception=False,
        ) as span:
            try:
                turn = await call
            except BaseException as exc:
                self._fail(span, exc)
                raise
            payload = turn.payload
            # gen_ai.usage.input_tokens counts the cached tokens too (the conventions, and the
            # SDK's own span); the step log keeps the API's three numbers apart.
            span.set_attributes({
                "gen_ai.response.id": str(payload.get("id", "")),
                "gen_ai.response.model": str(payload.get("model", "")),
                "gen_ai.response.finish_reasons": [str(turn.stop_reason)],
                "gen_ai.usage.input_tokens": (
                    turn.input_tokens + turn.cache_read_tokens + turn.cache_write_tokens
                ),
                "gen_ai.usage.output_tokens": turn.output_tokens,
                "gen_ai.usage.cache_read.input_tokens": turn.cache_read_tokens,
                "gen_ai.usage.cache_creation.input_tokens": turn.cache_write_tokens,
            })
            return turn

    async def tool_call(
        self,
        block: dict[str, Any],
        registry: ToolRegistry,
        seq: int,
        index: int,
        call: Awaitable[dict[str, Any]],
    ) -> dict[str, Any]:
        """Await one tool call (its tool_result block) inside an ``execute_tool {name}`` span.
        ``seq``: the tool_result step the call's result goes into."""
        if self._tracer is None:
            return await call
        name = str(block.get("name", ""))
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": name,
            "gen_ai.tool.call.id": str(block.get("id", "")),
            "gen_ai.tool.type": "function",
            "agentrun.step.seq": seq,
            "agentrun.tool.call_index": index,
        }
        if name in registry:
            spec = registry.get(name)
            attrs["agentrun.tool.kind"] = spec.kind.value
            if spec.compensate:
                attrs["agentrun.tool.compensation"] = spec.compensate
        with self._tracer.start_as_current_span(
            f"execute_tool {name}", kind=SpanKind.INTERNAL, attributes=attrs,
            record_exception=False, set_status_on_exception=False,
        ) as span:
            try:
                result = await call
            except BaseException as exc:
                self._fail(span, exc)
                raise
            if result.get("is_error"):  # what the model is told; the text stays out of the span
                span.set_attribute("error.type", "tool_error")
                span.set_status(Status(StatusCode.ERROR))
            return result
