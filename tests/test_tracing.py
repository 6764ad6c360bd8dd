"""OpenTelemetry traces of run attempts (issue 15), with real workers and the real SDKs.

In process: a Worker built as `agentrun worker` builds it (the client from anthropic_client, the
provider handed to Worker) with the OpenTelemetry SDK's in-memory exporter, against the scripted
server: one trace per claim, a `chat {model}` span per model call with the anthropic SDK's own
call span nested in it, an `execute_tool {name}` span per tool call, the run id as
gen_ai.conversation.id everywhere, tokens equal to the step log's, log lines carrying the ids of
the span they were emitted in, and no content in any span. Out of process: `agentrun worker`
switched on by the OTEL_* environment alone, exporting OTLP protobuf to a sink in this test or
printing to the console, and exporting nothing when the environment does not ask.
"""

from __future__ import annotations

import ast
import asyncio
import io
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from agentrun.logs import JsonFormatter, RunIdFilter
from agentrun.manifests import AgentSpec
from agentrun.store import Run, Store
from agentrun.tools import ToolContext, ToolError, ToolRegistry, tool
from agentrun.worker.client import anthropic_client
from agentrun.worker.process import Worker, WorkerSettings
from agentrun.worker.tracing import exporter_names, setup_tracing
from tests.workerkit import AGENT, FakeFactory, Workers, echo_scenario, wait_run

MODEL = "claude-sonnet-4-5"
SECRET = "s3cr3t-customer-42"  # in the task and in a tool's input: never in a span
SDK_SPAN = "anthropic.messages.create"

REGISTRY = ToolRegistry()
tool_log = logging.getLogger("agentrun.test_tracing.tool")


@tool(kind="pure", registry=REGISTRY)
def shout(ctx: ToolContext, text: str) -> str:
    """Say it louder (and log a line from inside the call)."""
    tool_log.info("shouting for call %d", ctx.call_index)
    return text.upper()


@tool(kind="idempotent", registry=REGISTRY)
def balk(ctx: ToolContext, text: str) -> str:
    """Refuse, as a tool reports an error to the model."""
    raise ToolError(f"will not do {text}")


class Gate:
    """What the `hold` tool waits on: the test drains its worker while the call is inside."""

    entered: asyncio.Event
    release: asyncio.Event


GATE = Gate()


@tool(kind="pure", registry=REGISTRY)
async def hold(ctx: ToolContext, text: str) -> str:
    """Wait for the test once (the first call), then answer."""
    if not GATE.release.is_set():
        GATE.entered.set()
        await GATE.release.wait()
    return text


def scenario(turns: list[list[dict[str, Any]]], final: str = "done") -> dict[str, Any]:
    """One model turn per item: its tool calls; then a final answer."""
    script = [{"content": [{"text": f"step {i}"}, *({"tool_use": c} for c in calls)]}
              for i, calls in enumerate(turns)]
    script.append({"content": [{"text": final}]})
    return {"name": "tracing", "scripts": [{"name": "tracing", "turns": script}]}


def agent(*tools: str) -> AgentSpec:
    return AgentSpec(model=MODEL, system="You are careful.", tools=list(tools))


@pytest.fixture
def spans() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))  # exported as each span ends
    try:
        yield provider, exporter
    finally:
        provider.shutdown()


@pytest.fixture
def log_lines() -> Iterator[Callable[[], list[dict[str, Any]]]]:
    """The worker's JSON log lines, formatted as `agentrun worker --log-format json` does."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(RunIdFilter())
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("agentrun")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lambda: [json.loads(line) for line in out.getvalue().splitlines()]
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.fixture
def no_otel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever this machine has set: each test says what OTEL_* its worker gets."""
    for name in [n for n in os.environ if n.startswith(("OTEL_", "ANTHROPIC_OPEN_TELEMETRY"))]:
        monkeypatch.delenv(name)


@pytest.fixture
def model_env(monkeypatch: pytest.MonkeyPatch, no_otel_env: None) -> Callable[[str], None]:
    """anthropic_client reads the environment, as in a worker pod."""

    def point_at(base_url: str) -> None:
        monkeypatch.setenv("ANTHROPIC_API_KEY", "test")
        monkeypatch.setenv("ANTHROPIC_BASE_URL", base_url)

    return point_at


async def run_worker(
    store: Store, provider: TracerProvider, name: str, until: Callable[[], Any],
    then: Callable[[], None] | None = None,
) -> None:
    """A worker as `agentrun worker` makes it (traced client, provider handed over) until
    ``until()`` (awaitable) returns; then it drains (and ``then()`` is called)."""
    client = anthropic_client(traced=True)
    worker = Worker(
        store, client, REGISTRY,
        WorkerSettings(health_port=None, worker_id=name, lease_ttl=5, poll_interval=0.5),
        tracer_provider=provider,
    )
    serving = asyncio.create_task(worker.serve())
    try:
        await until()
        worker.request_drain()
        if then is not None:
            then()
        await asyncio.wait_for(serving, 30)
    finally:
        if not serving.done():
            serving.cancel()
        await client.close()


def hexid(n: int, width: int) -> str:
    return format(n, f"0{width}x")


def by_name(spans: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return sorted((s for s in spans if s.name == name), key=lambda s: s.start_time or 0)


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def assert_no_content(spans: list[ReadableSpan]) -> None:
    for s in spans:
        for key, value in attrs(s).items():
            assert SECRET not in str(value), (s.name, key)
        for event in s.events:
            assert SECRET not in str(dict(event.attributes or {})), (s.name, event.name)


async def test_a_run_is_one_trace_of_model_turns_and_tool_calls_with_the_sdk_spans_inside(
    store: Store, fake: FakeFactory, model_env: Callable[[str], None],
    spans: tuple[TracerProvider, InMemorySpanExporter],
    log_lines: Callable[[], list[dict[str, Any]]],
) -> None:
    provider, exporter = spans
    srv = fake(scenario([
        [{"name": "shout", "input": {"text": SECRET}}],
        [{"name": "shout", "input": {"text": "b"}}, {"name": "balk", "input": {"text": "c"}}],
    ]))
    model_env(srv.base_url)
    run, _ = await store.create_run(f"help {SECRET}", agent("shout", "balk"))
    done: Run | None = None

    async def finished() -> None:
        nonlocal done
        done = await wait_run(store, run.id, lambda r: r.finished, 60)

    await run_worker(store, provider, "w-trace", finished)
    assert done is not None and done.status == "succeeded", done and done.error
    rid = str(run.id)
    got = list(exporter.get_finished_spans())

    # One trace, rooted at the claim.
    roots = [s for s in got if s.parent is None]
    assert [s.name for s in roots] == ["invoke_agent"], [s.name for s in got]
    root = roots[0]
    trace_id = root.context.trace_id
    assert {s.context.trace_id for s in got} == {trace_id}
    assert attrs(root) == {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.conversation.id": rid,
        "gen_ai.request.model": MODEL,
        "agentrun.run.id": rid,
        "agentrun.run.attempt": 1,
        "agentrun.lease.epoch": 1,
        "agentrun.run.resume_seq": 0,
        "agentrun.pool": "default",
        "agentrun.worker.id": "w-trace",
    }
    assert root.status.status_code is StatusCode.UNSET

    # A chat span per model turn, children of the root, with the step log's usage.
    chats = by_name(got, f"chat {MODEL}")
    steps = await store.steps(run.id)
    turns = [s for s in steps if s.kind == "model_turn"]
    assert [attrs(c)["agentrun.step.seq"] for c in chats] == [t.seq for t in turns] == [0, 2, 4]
    for chat, step in zip(chats, turns, strict=True):
        assert chat.parent is not None and chat.parent.span_id == root.context.span_id
        a, usage = attrs(chat), step.payload["usage"]
        assert a["gen_ai.operation.name"] == "chat"
        assert a["gen_ai.provider.name"] == "anthropic"
        assert a["gen_ai.request.model"] == MODEL
        assert a["gen_ai.conversation.id"] == rid
        assert a["gen_ai.response.id"] == step.payload["id"]
        assert a["gen_ai.usage.output_tokens"] == usage["output_tokens"]
        assert a["gen_ai.usage.cache_read.input_tokens"] == usage["cache_read_input_tokens"]
        assert a["gen_ai.usage.cache_creation.input_tokens"] == (
            usage["cache_creation_input_tokens"])
        assert a["gen_ai.usage.input_tokens"] == (
            usage["input_tokens"] + usage["cache_read_input_tokens"]
            + usage["cache_creation_input_tokens"])
    assert attrs(chats[1])["gen_ai.usage.cache_read.input_tokens"] > 0  # the cache is in play

    # The anthropic SDK's call span nests under each chat span and carries the run id.
    calls = by_name(got, SDK_SPAN)
    assert len(calls) == 3
    for chat, call in zip(chats, calls, strict=True):
        assert call.parent is not None and call.parent.span_id == chat.context.span_id
        assert attrs(call)["gen_ai.conversation.id"] == rid
        assert attrs(call)["gen_ai.usage.input_tokens"] == attrs(chat)["gen_ai.usage.input_tokens"]

    # A span per tool call, under the root, named and identified as the step log has them.
    tools = sorted((s for s in got if s.name.startswith("execute_tool ")),
                   key=lambda s: s.start_time or 0)
    uses = [b for t in turns for b in t.payload["content"] if b["type"] == "tool_use"]
    assert [s.name for s in tools] == ["execute_tool shout", "execute_tool shout",
                                      "execute_tool balk"]
    assert [attrs(s)["gen_ai.tool.call.id"] for s in tools] == [b["id"] for b in uses]
    assert [(attrs(s)["agentrun.step.seq"], attrs(s)["agentrun.tool.call_index"])
            for s in tools] == [(1, 0), (3, 0), (3, 1)]
    assert [attrs(s)["agentrun.tool.kind"] for s in tools] == ["pure", "pure", "idempotent"]
    for s in tools:
        assert s.parent is not None and s.parent.span_id == root.context.span_id
        assert attrs(s)["gen_ai.operation.name"] == "execute_tool"
    assert [s.status.status_code for s in tools] == [
        StatusCode.UNSET, StatusCode.UNSET, StatusCode.ERROR]
    assert attrs(tools[2])["error.type"] == "tool_error"
    assert_no_content(got)

    # Log lines carry the ids of the span current where they were emitted.
    lines = [x for x in log_lines() if x.get("run_id") == rid]
    claimed = next(x for x in lines if x["msg"].startswith("claimed:"))
    assert (claimed["trace_id"], claimed["span_id"]) == (
        hexid(trace_id, 32), hexid(root.context.span_id, 16))
    shouted = [x for x in lines if x["logger"] == tool_log.name]
    assert [x["span_id"] for x in shouted] == [
        hexid(s.context.span_id, 16) for s in tools[:2]]
    assert {x["trace_id"] for x in lines} == {hexid(trace_id, 32)}
    # Outside any run's span (the worker's own lines) there are none.
    assert all("trace_id" not in x for x in log_lines() if x.get("run_id") is None)


async def test_a_resumed_run_is_a_second_trace_with_the_same_conversation_id(
    store: Store, fake: FakeFactory, model_env: Callable[[str], None],
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = spans
    GATE.entered, GATE.release = asyncio.Event(), asyncio.Event()
    srv = fake(scenario([[{"name": "hold", "input": {"text": "x"}}]]))
    model_env(srv.base_url)
    run, _ = await store.create_run("hold then answer", agent("hold"))

    async def inside_the_tool() -> None:
        await asyncio.wait_for(GATE.entered.wait(), 30)

    # w1 drains while the tool runs: the call goes on to its commit, then the run is released.
    await run_worker(store, provider, "w1", inside_the_tool, then=GATE.release.set)
    handed_over = await store.get_run(run.id)
    assert (handed_over.status, handed_over.next_seq) == ("pending", 2)

    async def finished() -> None:
        await wait_run(store, run.id, lambda r: r.finished, 60)

    await run_worker(store, provider, "w2", finished)
    assert (await store.get_run(run.id)).status == "succeeded"
    rid = str(run.id)
    got = list(exporter.get_finished_spans())
    roots = sorted((s for s in got if s.parent is None), key=lambda s: s.start_time or 0)
    assert [s.name for s in roots] == ["invoke_agent", "invoke_agent"]
    assert roots[0].context.trace_id != roots[1].context.trace_id
    assert [(attrs(r)["agentrun.worker.id"], attrs(r)["agentrun.lease.epoch"],
             attrs(r)["agentrun.run.resume_seq"]) for r in roots] == [("w1", 1, 0), ("w2", 2, 2)]

    def in_trace(root: ReadableSpan) -> list[str]:
        return sorted(s.name for s in got if s.context.trace_id == root.context.trace_id)

    assert in_trace(roots[0]) == sorted(
        [SDK_SPAN, f"chat {MODEL}", "execute_tool hold", "invoke_agent"])
    assert in_trace(roots[1]) == sorted([SDK_SPAN, f"chat {MODEL}", "invoke_agent"])
    # Both traces, and every model call in them, are the one conversation: the run.
    for s in got:
        if s.name in ("invoke_agent", f"chat {MODEL}", SDK_SPAN):
            assert attrs(s)["gen_ai.conversation.id"] == rid, s.name
    (resumed_chat,) = [s for s in by_name(got, f"chat {MODEL}")
                       if s.context.trace_id == roots[1].context.trace_id]
    assert attrs(resumed_chat)["agentrun.step.seq"] == 2


async def test_errors_are_recorded_by_type_with_no_message(
    store: Store, fake: FakeFactory, model_env: Callable[[str], None],
    spans: tuple[TracerProvider, InMemorySpanExporter],
    log_lines: Callable[[], list[dict[str, Any]]],
) -> None:
    provider, exporter = spans
    script = scenario([])
    # An overload (retried, inside the same chat span), then a refusal that fails the run; its
    # message (which a provider may fill with the request's text) stays out of the spans.
    script["scripts"][0]["turns"][0]["faults"] = [
        {"status": 529}, {"status": 400, "message": f"bad request about {SECRET}"}]
    srv = fake(script)
    model_env(srv.base_url)
    run, _ = await store.create_run("fail", agent())

    async def finished() -> None:
        await wait_run(store, run.id, lambda r: r.finished, 60)

    await run_worker(store, provider, "w-err", finished)
    assert (await store.get_run(run.id)).status == "failed"
    got = list(exporter.get_finished_spans())
    (root,) = [s for s in got if s.parent is None]
    (chat,) = by_name(got, f"chat {MODEL}")
    for s in (root, chat):
        assert s.status.status_code is StatusCode.ERROR, s.name
        assert attrs(s)["error.type"] == "PermanentModelError", s.name
        assert not s.status.description and not s.events, s.name
    calls = by_name(got, SDK_SPAN)
    assert [c.parent.span_id for c in calls if c.parent] == [chat.context.span_id] * 2
    assert [attrs(c).get("http.response.status_code") for c in calls] == [529, 400]
    assert_no_content(got)
    retried = [x for x in log_lines() if x["msg"].startswith("model call failed")]
    assert [x["span_id"] for x in retried] == [hexid(chat.context.span_id, 16)]
    failed = [x for x in log_lines() if x["msg"].startswith("run failed")]
    assert [x["span_id"] for x in failed] == [hexid(root.context.span_id, 16)]


# -- the environment switch ----------------------------------------------------------------


@pytest.mark.parametrize(("env", "names"), [
    ({}, []),
    ({"OTEL_SERVICE_NAME": "x", "OTEL_RESOURCE_ATTRIBUTES": "a=b"}, []),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, ["otlp"]),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, ["otlp"]),
    ({"OTEL_TRACES_EXPORTER": "console"}, ["console"]),
    ({"OTEL_TRACES_EXPORTER": "otlp, Console"}, ["otlp", "console"]),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, []),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, []),
    ({"OTEL_SDK_DISABLED": "TRUE", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, []),
    ({"OTEL_SDK_DISABLED": "false", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, ["otlp"]),
])
def test_only_the_standard_environment_turns_tracing_on(
    env: dict[str, str], names: list[str]
) -> None:
    assert exporter_names(env) == names


async def test_without_otel_env_no_provider_is_set_up_and_the_sdk_makes_no_spans(
    model_env: Callable[[str], None],
) -> None:
    model_env("http://127.0.0.1:9")
    assert setup_tracing(worker_id="w") is None
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    # The SDK client's own spans follow ours: off, whatever provider someone registers later.
    off, on = anthropic_client(traced=False), anthropic_client(traced=True)
    try:
        assert off.open_telemetry["traces"]["enabled"] is False
        assert on.open_telemetry["traces"]["enabled"] is True
    finally:
        await off.close()
        await on.close()


def test_off_nothing_beyond_the_opentelemetry_api_is_imported(no_otel_env: None) -> None:
    # A fresh interpreter: this one has the SDK loaded for the other tests.
    probe = (
        "import sys\n"
        "from agentrun import cli\n"
        "from agentrun.worker import process\n"
        "from agentrun.worker.tracing import setup_tracing\n"
        "assert setup_tracing(worker_id='w') is None\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    loaded = set(ast.literal_eval(out))
    assert "opentelemetry.trace" in loaded  # the API, which the anthropic SDK imports anyway
    assert not {m for m in loaded if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter",
                                                   "opentelemetry.proto"))}, loaded


def test_asked_for_without_the_sdk_one_warning_and_no_tracing(
    model_env: Callable[[str], None], monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    for module in ("opentelemetry.sdk.resources", "opentelemetry.sdk.trace"):
        monkeypatch.setitem(sys.modules, module, None)  # as if opentelemetry-sdk were missing
    with caplog.at_level(logging.INFO, logger="agentrun"):
        assert setup_tracing(worker_id="w") is None
    said = [r for r in caplog.records if r.name.startswith("agentrun")]
    assert [r.levelname for r in said] == ["WARNING"], [r.getMessage() for r in said]
    assert "opentelemetry-sdk is not installed" in said[0].getMessage()
    assert "agentrun[otel]" in said[0].getMessage()
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


class Sink:
    """A tiny OTLP/HTTP receiver: keeps every POSTed body (protobuf) by path."""

    def __init__(self, port: int = 0) -> None:
        self.posts: list[tuple[str, str, bytes]] = []
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                sink.posts.append((self.path, self.headers.get("Content-Type", ""), body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()

    def spans(self) -> tuple[dict[str, Any], list[Any]]:
        """The resource attributes and the spans of every export request received."""
        resource: dict[str, Any] = {}
        found: list[Any] = []
        for _, _, body in self.posts:
            req = ExportTraceServiceRequest.FromString(body)
            for rs in req.resource_spans:
                resource |= {a.key: a.value.string_value for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    found.extend(ss.spans)
        return resource, found


async def run_one(
    store: Store, workers: Workers, name: str, env: dict[str, str]
) -> tuple[Run, str]:
    """A real `agentrun worker` with this environment (and no other OTEL_*: no_otel_env) runs
    the echo scenario, then drains."""
    run, _ = await store.create_run(f"echo {SECRET}", AGENT)
    w = workers.start(name, env=env)
    done = await wait_run(store, run.id, lambda r: r.finished, 60)
    assert done.status == "succeeded", done.error
    w.signal(signal.SIGTERM)
    assert await asyncio.to_thread(w.wait) == 0, w.output()[-3000:]
    return done, w.output()


async def test_an_otlp_endpoint_alone_exports_the_run_as_protobuf(
    store: Store, workers: Workers, fake: FakeFactory, no_otel_env: None
) -> None:
    srv = fake(echo_scenario(3))
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    sink = Sink()
    try:
        run, output = await run_one(store, workers, "w-otlp", {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink.port}",
            "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment.name=test",
        })
    finally:
        sink.close()
    # Sent at the drain's shutdown at the latest (the batch delay is 5 s).
    assert sink.posts, output[-3000:]
    assert {(p, t) for p, t, _ in sink.posts} == {("/v1/traces", "application/x-protobuf")}
    resource, got = sink.spans()
    assert resource["service.name"] == "agentrun-worker"
    assert resource["service.instance.id"] == "w-otlp"
    assert resource["deployment.environment.name"] == "test"
    names = sorted(s.name for s in got)
    assert names == sorted(["invoke_agent", *[f"chat {MODEL}"] * 3, *[SDK_SPAN] * 3,
                            *["execute_tool echo"] * 2])
    assert len({s.trace_id for s in got}) == 1
    (root,) = [s for s in got if not s.parent_span_id]
    conversation = {a.key: a.value.string_value for a in root.attributes}
    assert conversation["gen_ai.conversation.id"] == str(run.id)
    assert all(SECRET.encode() not in s.SerializeToString() for s in got)
    lines = [json.loads(x) for x in output.splitlines() if x.startswith("{")]
    assert any(x["msg"].startswith("tracing: spans of each run attempt go to otlp")
               for x in lines)
    about_run = [x for x in lines if x.get("run_id") == str(run.id)]
    assert about_run and {x.get("trace_id") for x in about_run} == {root.trace_id.hex()}


async def test_the_console_exporter_prints_the_spans(
    store: Store, workers: Workers, fake: FakeFactory, no_otel_env: None
) -> None:
    srv = fake(echo_scenario(2))
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    run, output = await run_one(store, workers, "w-console", {
        "OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "my-agents",
        "PYTHONUNBUFFERED": "1",  # each span printed whole, between the log lines
    })
    decoder, printed, at = json.JSONDecoder(), [], 0
    while (at := output.find("{\n", at)) != -1:  # the exporter pretty-prints each span
        obj, end = decoder.raw_decode(output, at)
        printed.append(obj)
        at = end
    assert sorted(p["name"] for p in printed) == sorted(
        ["invoke_agent", f"chat {MODEL}", f"chat {MODEL}", SDK_SPAN, SDK_SPAN,
         "execute_tool echo"]), output[-3000:]
    assert {p["resource"]["attributes"]["service.name"] for p in printed} == {"my-agents"}
    root = next(p for p in printed if p["name"] == "invoke_agent")
    assert root["attributes"]["gen_ai.conversation.id"] == str(run.id)


def default_collector() -> Sink | None:
    """A sink on the OTLP default address (127.0.0.1:4318), if the port is free here."""
    try:
        return Sink(4318)
    except OSError:
        return None


@pytest.mark.parametrize("case", ["no OTEL env", "OTEL_SDK_DISABLED wins"])
async def test_a_worker_the_environment_does_not_ask_exports_nothing(
    case: str, store: Store, workers: Workers, fake: FakeFactory, no_otel_env: None
) -> None:
    srv = fake(echo_scenario(2))
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    # The SDK's autoconfiguration would send to the default collector address unasked.
    sink = default_collector() if case == "no OTEL env" else Sink()
    env = {} if case == "no OTEL env" else {
        "OTEL_SDK_DISABLED": "true",
        "OTEL_TRACES_EXPORTER": "otlp,console",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink.port if sink else 9}",
    }
    try:
        run, output = await run_one(store, workers, "w-off", env)
    finally:
        if sink is not None:
            sink.close()
    assert sink is None or sink.posts == []
    assert "invoke_agent" not in output, output[-3000:]  # nor printed by a console exporter
    lines = [json.loads(x) for x in output.splitlines() if x.startswith("{")]
    assert any(x.get("run_id") == str(run.id) for x in lines)
    assert not [x for x in lines if "trace_id" in x or x["msg"].startswith("tracing:")]


def test_json_lines_carry_the_current_spans_ids_and_none_outside(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, _ = spans
    formatter = JsonFormatter()

    def line() -> dict[str, Any]:
        record = logging.LogRecord("agentrun.x", logging.INFO, __file__, 1, "hi", None, None)
        out: dict[str, Any] = json.loads(formatter.format(record))
        return out

    assert "trace_id" not in line() and "span_id" not in line()
    with provider.get_tracer("t").start_as_current_span("s") as span:
        ctx = span.get_span_context()
        assert (line()["trace_id"], line()["span_id"]) == (
            hexid(ctx.trace_id, 32), hexid(ctx.span_id, 16))
    assert "trace_id" not in line()

