"""The HTTP side: an aiohttp app that speaks the Messages API well enough for the real SDK.

Turn selection is stateless on purpose: the turn index of a request is the number of assistant
messages it carries, and the script is chosen from the first user message. A client that crashes
and resumes from its stored history therefore gets the same answer a never-crashed client would,
and any number of workers can share one server. Only the injected-fault counters and the request
log live in memory; ``POST /_fake/reset`` clears both.

Streaming emits the same server-sent events as the real API (message_start, ping,
content_block_start/delta/stop, message_delta, message_stop), built from the very dict the
non-streaming call returns, so ``stream.get_final_message()`` equals the non-streaming Message.
A stream fault cuts that answer short and breaks it the ways a real provider or proxy can: an
``event: error`` inside the 200 stream, pings and nothing else, malformed events.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from aiohttp import web

from agentrun.canonical import canonical_json
from agentrun.fake_anthropic import platforms
from agentrun.fake_anthropic.canon import RequestTexts, prefix_tokens
from agentrun.fake_anthropic.platforms import PlatformError, TokenIssuer, VertexAuth
from agentrun.fake_anthropic.scenario import (
    Fault,
    Scenario,
    Script,
    TextBlock,
    ThinkingBlock,
    Turn,
    error_type_for,
    resolve_scenario,
)
from agentrun.fake_anthropic.signing import Signatures

log = logging.getLogger("agentrun.fake_anthropic")

# Deltas are cut into pieces of this many characters so clients see a real multi-chunk stream.
CHUNK_CHARS = 32
MAX_REQUEST_BYTES = 32 * 1024 * 1024


class ApiError(Exception):
    """An error answer in the real API's JSON shape."""

    def __init__(self, status: int, message: str, error_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type or error_type_for(status)
        self.headers: dict[str, str] = {}


class ServerState:
    """Everything mutable: the request log, the fault counters (per script and turn) and the
    prompt cache."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.log: list[dict[str, Any]] = []
        self.fault_counters: dict[tuple[str, int], int] = {}

        self.cache = PromptCache()
        # Kept across a reset: a client holding a token it was issued must still be let in.
        self.tokens = TokenIssuer()

    def reset(self) -> None:
        self.log.clear()
        self.fault_counters.clear()
        self.cache.clear()

    def next_fault(self, script: Script, turn_index: int, turn: Turn) -> Fault | None:
        """The fault for this (script, turn)'s next request, or None once all are used up."""
        key = (script.name, turn_index)
        seen = self.fault_counters.get(key, 0)
        self.fault_counters[key] = seen + 1
        upto = 0
        for fault in turn.faults:
            upto += fault.times
            if seen < upto:
                return fault
        return None


# --- request parsing -------------------------------------------------------------------------


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            str(block.get("text", ""))
            for block in content
            if isinstance(block, dict) and block.get("type") == "text"
        )
    return ""


def _validate_body(body: Any) -> dict[str, Any]:
    """The few checks the real API makes that a client bug would trip, with its field paths."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    if not isinstance(body.get("model"), str):
        raise ApiError(400, "model: Field required")
    if not isinstance(body.get("max_tokens"), int):
        raise ApiError(400, "max_tokens: Field required")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages: Field required (a non-empty list)")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise ApiError(400, f"messages.{i}.role: Input should be 'user' or 'assistant'")
        if "content" not in message:
            raise ApiError(400, f"messages.{i}.content: Field required")
    return body


def _system_text(system: Any) -> Any:
    return _text_of(system) if isinstance(system, list) else system


def _tool_names(tools: Any) -> list[str]:
    if not isinstance(tools, list):
        return []
    return [str(tool.get("name")) for tool in tools if isinstance(tool, dict)]


def estimate_tokens(value: Any) -> int:
    """A deterministic stand-in for token counts: four characters of canonical JSON per token."""
    return max(1, len(canonical_json(value)) // 4)


def tool_use_id(script_name: str, turn_index: int, block_index: int) -> str:
    """Deterministic, so a resumed client sees the same ids it saw before the crash."""
    seed = f"{script_name}\x1f{turn_index}\x1f{block_index}".encode()
    return "toolu_" + hashlib.sha256(seed).hexdigest()[:24]


# --- prompt caching ---------------------------------------------------------------------------

# The API checks for a cache hit at block boundaries up to this many blocks before a breakpoint.
CACHE_LOOKBACK_BLOCKS = 20


class PromptCache:
    """The API's prompt cache, per server: a breakpoint writes the prefix up to it; a request
    reads the longest written prefix that it starts with, checked at every block boundary up to
    CACHE_LOOKBACK_BLOCKS before each of its breakpoints. Keys are the model plus the canonical
    JSON of the prefix (key order does not matter, every value does). Entries never expire
    (the API's live five minutes, refreshed on each read) and there is no minimum length."""

    def __init__(self) -> None:
        self._written: set[str] = set()

    def clear(self) -> None:
        self._written.clear()

    @staticmethod
    def _key(model: Any, items: list[Any]) -> str:
        return hashlib.sha256(canonical_json([model, items]).encode("utf-8", "surrogatepass")
                              ).hexdigest()

    @staticmethod
    def _prefix_keys(model: Any, parts: list[str], upto: int) -> list[str]:
        """``_key(model, items[:n])`` for every n up to ``upto``, from each item's canonical JSON
        (``parts``) hashed once: the same bytes as the canonical JSON of each prefix, in one pass
        instead of one per prefix (a request checks up to CACHE_LOOKBACK_BLOCKS of them at each
        breakpoint, and the history grows every turn)."""
        h = hashlib.sha256(f"[{canonical_json(model)},[".encode("utf-8", "surrogatepass"))
        keys = []
        for n in range(upto + 1):
            if n:
                h.update((b"," if n > 1 else b"") + parts[n - 1].encode("utf-8", "surrogatepass"))
            end = h.copy()
            end.update(b"]]")
            keys.append(end.hexdigest())
        return keys

    def account(self, texts: RequestTexts) -> dict[str, int]:
        """The usage fields of the prompt, and the breakpoints' prefixes written."""
        parts, marks = texts.prompt()
        keys = self._prefix_keys(texts.body.get("model"), parts, max(marks, default=0))
        counts = prefix_tokens(parts)
        read = 0
        for mark in marks:
            for n in range(mark, max(0, mark - CACHE_LOOKBACK_BLOCKS) - 1, -1):
                if n > read and keys[n] in self._written:
                    read = n
                    break
        written = max(marks, default=0)
        for mark in marks:
            self._written.add(keys[mark])
        read_tokens = counts[read] if read else 0
        write_tokens = max(0, counts[written] - read_tokens) if written > read else 0
        return {
            "input_tokens": max(0, counts[-1] - read_tokens - write_tokens),
            "cache_creation_input_tokens": write_tokens,
            "cache_read_input_tokens": read_tokens,
        }


# --- answers ---------------------------------------------------------------------------------


def model_json(value: Any, *, ensure_ascii: bool = True) -> str:
    """JSON as a model writes it: a scripted infinite number goes out as a number beyond the
    float range (``1e400``, valid JSON that Python reads back as infinity), never as the
    ``Infinity`` Python's encoder writes, which is not JSON."""
    try:
        return json.dumps(value, ensure_ascii=ensure_ascii, allow_nan=False)
    except ValueError:  # a non-finite number somewhere: the slow path, only then
        return _huge_json(value, ensure_ascii)


def _huge_json(value: Any, ensure_ascii: bool) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        if math.isnan(value):
            raise ValueError("a scripted NaN has no JSON form")
        return "1e400" if value > 0 else "-1e400"
    if isinstance(value, dict):
        return "{" + ",".join(
            f"{json.dumps(str(k), ensure_ascii=ensure_ascii)}:{_huge_json(v, ensure_ascii)}"
            for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ",".join(_huge_json(v, ensure_ascii) for v in value) + "]"
    return json.dumps(value, ensure_ascii=ensure_ascii)


def build_message(
    scenario: Scenario,
    script: Script,
    turn_index: int,
    signatures: Signatures,
    prompt_usage: dict[str, int] | None = None,
) -> dict[str, Any]:
    """The Message the non-streaming call returns; streaming replays it as events.
    ``signatures``: the request's, which checked its history (its canonical JSON written and
    hashed once for both)."""
    texts = signatures.texts
    body = texts.body
    turn = script.turns[turn_index]
    content: list[dict[str, Any]] = []
    for k, block in enumerate(turn.content):
        if isinstance(block, TextBlock):
            content.append({"type": "text", "text": block.sent_text, "citations": None})
        elif isinstance(block, ThinkingBlock):
            # Bound to every message of the request.
            signature = signatures.expected(len(texts.messages), block.thinking)
            content.append({"type": "thinking", "thinking": block.thinking, "signature": signature})
        else:
            content.append(
                {
                    "type": "tool_use",
                    "id": block.id or tool_use_id(script.name, turn_index, k),
                    "name": block.name,
                    "input": block.input,
                }
            )
    if prompt_usage is None:  # no cache: the whole prompt is input
        prompt_usage = {
            "input_tokens": texts.prompt_tokens(),
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        }
    return {
        "id": "msg_fake_" + secrets.token_hex(12),
        "type": "message",
        "role": "assistant",
        "model": body["model"],
        "content": content,
        "stop_reason": turn.effective_stop_reason,
        "stop_sequence": None,
        "stop_details": None,
        "usage": {
            "input_tokens": prompt_usage["input_tokens"],
            "output_tokens": estimate_tokens(content),
            "cache_creation_input_tokens": prompt_usage["cache_creation_input_tokens"],
            "cache_read_input_tokens": prompt_usage["cache_read_input_tokens"],
        },
    }


def _chunks(text: str) -> Iterator[str]:
    for start in range(0, len(text), CHUNK_CHARS):
        yield text[start : start + CHUNK_CHARS]


def stream_events(message: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """The SSE events, in the real API's order, that assemble into ``message``."""
    usage = message["usage"]
    start = {
        **message,
        "content": [],
        "stop_reason": None,
        "usage": {**usage, "output_tokens": 1},
    }
    yield "message_start", {"type": "message_start", "message": start}
    yield "ping", {"type": "ping"}
    for index, block in enumerate(message["content"]):
        kind = block["type"]
        if kind == "text":
            empty: dict[str, Any] = {**block, "text": ""}
            deltas = [{"type": "text_delta", "text": piece} for piece in _chunks(block["text"])]
        elif kind == "thinking":
            empty = {**block, "thinking": "", "signature": ""}
            deltas = [
                {"type": "thinking_delta", "thinking": piece}
                for piece in _chunks(block["thinking"])
            ]
            deltas.append({"type": "signature_delta", "signature": block["signature"]})
        else:
            empty = {**block, "input": {}}
            raw = model_json(block["input"], ensure_ascii=False)
            deltas = [{"type": "input_json_delta", "partial_json": ""}]
            deltas += [{"type": "input_json_delta", "partial_json": p} for p in _chunks(raw)]
        yield (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": index,
                "content_block": empty,
            },
        )
        for delta in deltas:
            event = {"type": "content_block_delta", "index": index, "delta": delta}
            yield "content_block_delta", event
        yield "content_block_stop", {"type": "content_block_stop", "index": index}
    yield (
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
            "usage": usage,
        },
    )
    yield "message_stop", {"type": "message_stop"}


# --- handlers --------------------------------------------------------------------------------


def _request_id() -> str:
    return "req_fake_" + secrets.token_hex(12)


def _error_response(
    err: ApiError | PlatformError, request_id: str, platform: str = "anthropic"
) -> web.Response:
    """The error in the shape of the one who answers: Bedrock answers every error itself
    (``{"message"}``, x-amzn-ErrorType); on Vertex the platform's own refusals are Google's
    (``{"error": {"code", "message", "status"}}``) and the model's are the first-party API's."""
    extra = dict(err.headers) if isinstance(err, ApiError) else {}
    headers = {"request-id": request_id, **extra}
    if platform == "bedrock":
        payload, amz = platforms.bedrock_error(err.status, err.message)
        return web.json_response(payload, status=err.status,
                                 headers={**headers, **amz, "x-amzn-RequestId": request_id})
    if isinstance(err, PlatformError):
        return web.json_response(platforms.vertex_error(err.status, err.message),
                                 status=err.status, headers=headers)
    payload = {
        "type": "error",
        "error": {"type": err.error_type, "message": err.message},
        "request_id": request_id,
    }
    return web.json_response(payload, status=err.status, headers=headers)


def _check_api_key(scenario: Scenario, request: web.Request) -> None:
    if scenario.api_key is None:
        return
    given = request.headers.get("x-api-key")
    bearer = request.headers.get("authorization", "")
    if bearer.lower().startswith("bearer "):
        given = given or bearer[7:]
    if given is None or not secrets.compare_digest(given, scenario.api_key):
        raise ApiError(401, "invalid x-api-key")


def _select(scenario: Scenario, body: dict[str, Any]) -> tuple[Script, int]:
    """Which script and turn answer this request; raises the 400/404 the client should see."""
    if scenario.models is not None and body["model"] not in scenario.models:
        raise ApiError(404, f"model: {body['model']}")
    messages: list[dict[str, Any]] = body["messages"]
    first_user = next((m for m in messages if m.get("role") == "user"), None)
    if first_user is None:
        raise ApiError(400, "messages: at least one user message is required")
    script = scenario.select_script(_text_of(first_user.get("content")))
    if script is None:
        raise ApiError(
            400,
            f"fake-anthropic: no script of scenario {scenario.name!r} matches the first user "
            "message, and the scenario has no default script (one without `match`)",
        )
    turn_index = sum(1 for m in messages if m.get("role") == "assistant")
    if turn_index >= len(script.turns):
        raise ApiError(
            400,
            f"fake-anthropic: script {script.name!r} has {len(script.turns)} turn(s) "
            f"(0..{len(script.turns) - 1}); this request carries {turn_index} assistant "
            f"message(s), so it asks for turn {turn_index}, which is not scripted",
        )
    return script, turn_index


class _Handlers:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/messages: the first-party API."""
        return await self._answer(request, "anthropic")

    async def bedrock(self, request: web.Request) -> web.StreamResponse:
        """POST /model/{modelId}/invoke and /invoke-with-response-stream: Amazon Bedrock."""
        stream = request.match_info["action"] == "invoke-with-response-stream"
        return await self._answer(request, "bedrock", request.match_info["model"], stream)

    async def vertex(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/projects/{p}/locations/{r}/publishers/anthropic/models/{model}:rawPredict
        and :streamRawPredict: Google Vertex AI."""
        model, _, specifier = request.match_info["tail"].rpartition(":")
        if not model or specifier not in ("rawPredict", "streamRawPredict"):
            return await self.not_found(request)
        return await self._answer(request, "vertex", model, specifier == "streamRawPredict")

    def _metadata_flavor(self, request: web.Request) -> web.Response | None:
        if request.headers.get("Metadata-Flavor") != "Google":
            return web.Response(status=403, text="Missing Metadata-Flavor:Google header.")
        return None

    async def metadata_ping(self, request: web.Request) -> web.Response:
        """GET /: the metadata server's ping (google-auth's "am I on GCE/GKE?")."""
        refused = self._metadata_flavor(request)
        return refused or web.Response(text="ok", headers={"Metadata-Flavor": "Google"})

    async def metadata(self, request: web.Request) -> web.Response:
        """GET /computeMetadata/v1/...: what google-auth's compute_engine credentials read,
        the GKE metadata server's answers for a pod with workload identity."""
        refused = self._metadata_flavor(request)
        if refused is not None:
            return refused
        auth = self.state.scenario.vertex
        sa = auth.service_account if auth is not None else VertexAuth().service_account
        path = request.match_info["path"].rstrip("/")
        flavor = {"Metadata-Flavor": "Google"}
        if path == "project/project-id":
            project = (auth.project if auth is not None else None) or "fake-project"
            return web.Response(text=project, headers=flavor)
        if path == "universe/universe-domain":
            return web.Response(text="googleapis.com", headers=flavor)
        account = path.removeprefix("instance/service-accounts/")
        name, _, leaf = account.partition("/")
        if account != path and name in ("default", sa):
            if leaf == "":
                info = {"aliases": ["default"], "email": sa,
                        "scopes": ["https://www.googleapis.com/auth/cloud-platform"]}
                return web.json_response(info, headers=flavor)
            if leaf == "token":  # counted in state.tokens, not in the Messages request log
                return web.json_response(self.state.tokens.issue(auth), headers=flavor)
            if leaf == "email":
                return web.Response(text=sa, headers=flavor)
        return web.Response(status=404, text=f"no metadata {path}", headers=flavor)

    def _authenticate(
        self, request: web.Request, platform: str, data: bytes
    ) -> dict[str, str]:
        """The platform's own authentication; what the request log shows of it."""
        scenario = self.state.scenario
        if platform == "anthropic":
            _check_api_key(scenario, request)
            return {}
        if platform == "bedrock":
            headers = {k.lower(): v for k, v in request.headers.items()}
            return platforms.check_sigv4(
                scenario.bedrock, request.method, request.raw_path, headers, data
            )
        seen = self.state.tokens.check(scenario.vertex, request.headers.get("authorization", ""))
        auth = scenario.vertex
        project, region = request.match_info["project"], request.match_info["region"]
        if auth is not None and auth.project is not None and project != auth.project:
            raise PlatformError(403, f"Permission denied on project {project!r}")
        if auth is not None and auth.region is not None and region != auth.region:
            raise PlatformError(404, f"location {region!r} is not served here")
        return {**seen, "project": project, "region": region}

    def _body(self, platform: str, data: bytes, model: str | None, stream: bool | None,
              entry: dict[str, Any]) -> dict[str, Any]:
        try:
            raw = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError(400, "request body is not valid JSON") from None
        if platform == "anthropic" or model is None:
            return _validate_body(raw)
        entry["anthropic_version"] = raw.get("anthropic_version") if isinstance(raw, dict) else None
        body = platforms.first_party_body(raw, model)
        if platform == "bedrock":
            if "stream" in body:  # the path says it; Bedrock refuses the key
                raise PlatformError(400, "extraneous key [stream] is not permitted")
            body["stream"] = stream
        elif bool(body.get("stream")) != stream:
            raise PlatformError(400, f"stream must be {str(stream).lower()} for "
                                     f"{'streamRawPredict' if stream else 'rawPredict'}")
        return _validate_body(body)

    async def _answer(
        self,
        request: web.Request,
        platform: str,
        model: str | None = None,
        stream: bool | None = None,
    ) -> web.StreamResponse:
        scenario = self.state.scenario
        request_id = _request_id()
        entry: dict[str, Any] = {"request_id": request_id, "path": request.path,
                                 "provider": platform}
        self.state.log.append(entry)
        try:
            data = await request.read()
            entry.update(self._authenticate(request, platform, data))
            if scenario.record_bodies:
                # The bytes as sent: a test can check that a resumed client sends exactly what
                # the first one did (the prompt cache keys on the bytes, not on their meaning).
                entry["body"] = data.decode("utf-8", errors="replace")
            body = self._body(platform, data, model, stream, entry)
            entry.update(
                model=body["model"],
                # The text, also of a list of blocks (one with cache_control, say).
                system=_system_text(body.get("system")),
                tools=_tool_names(body.get("tools")),
                n_messages=len(body["messages"]),
                stream=bool(body.get("stream")),
            )
            if scenario.record_messages:
                entry["messages"] = body["messages"]
            script, turn_index = _select(scenario, body)
            entry.update(script=script.name, turn=turn_index)
            # The request's canonical JSON, written once for the signatures and the cache.
            signatures = Signatures(scenario.secret, RequestTexts(body))
            invalid = signatures.first_invalid()
            if invalid is not None:
                raise ApiError(400, invalid)
            turn = script.turns[turn_index]
            delay_ms = turn.delay_ms if turn.delay_ms is not None else scenario.delay_ms
            if delay_ms:
                await asyncio.sleep(delay_ms / 1000)
            fault = self.state.next_fault(script, turn_index, turn)
            if fault is not None:
                entry["fault"] = fault.kind
                if fault.status is not None:
                    raise _fault_error(fault)
                if not entry["stream"]:
                    raise ApiError(
                        400,
                        f"fake-anthropic: script {script.name!r} turn {turn_index} has a "
                        f"`stream: {fault.stream}` fault, which needs a streaming request",
                    )
            # Accounted once the request is answered (a fault above writes nothing), as the API
            # writes the cache for a request it processes.
            usage = self.state.cache.account(signatures.texts)
            message = build_message(scenario, script, turn_index, signatures, usage)
            entry["usage"] = dict(message["usage"])
        except (ApiError, PlatformError) as err:
            entry.update(status=err.status, error=err.message, completed=True)
            log.info("%s %s -> %d", request.method, request.path, err.status)
            return _error_response(err, request_id, platform)
        entry["status"] = 200
        log.info(
            "%s %s script=%s turn=%d stream=%s -> 200",
            request.method,
            request.path,
            script.name,
            turn_index,
            entry["stream"],
        )
        if not entry["stream"]:
            entry["completed"] = True
            return web.json_response(message, headers={"request-id": request_id},
                                     dumps=model_json)
        stream_delay = turn.stream_delay_ms
        if stream_delay is None:
            stream_delay = scenario.stream_delay_ms
        return await _stream(request, request_id, message, stream_delay / 1000, entry, fault,
                             bedrock=platform == "bedrock")

    async def count_tokens(self, request: web.Request) -> web.Response:
        request_id = _request_id()
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return _error_response(ApiError(400, "request body is not valid JSON"), request_id)
        if not isinstance(body, dict):
            return _error_response(ApiError(400, "request body must be a JSON object"), request_id)
        if not isinstance(body.get("messages"), list):
            return _error_response(ApiError(400, "messages: Field required"), request_id)
        return web.json_response(
            {"input_tokens": RequestTexts(body).prompt_tokens()},
            headers={"request-id": request_id},
        )

    async def requests_log(self, request: web.Request) -> web.Response:
        return web.json_response(self.state.log)

    async def reset(self, request: web.Request) -> web.Response:
        self.state.reset()
        return web.json_response({"ok": True})

    async def not_found(self, request: web.Request) -> web.Response:
        err = ApiError(404, f"fake-anthropic: no route {request.method} {request.path}")
        return _error_response(err, _request_id())


def _fault_error(fault: Fault) -> ApiError:
    assert fault.status is not None
    err = ApiError(fault.status, fault.error_message, fault.error_type)
    if fault.retry_after is not None:
        seconds = fault.retry_after
        err.headers["retry-after"] = str(int(seconds)) if seconds == int(seconds) else str(seconds)
        err.headers["retry-after-ms"] = str(int(seconds * 1000))
    return err


async def _stream(
    request: web.Request,
    request_id: str,
    message: dict[str, Any],
    delay: float,
    entry: dict[str, Any],
    fault: Fault | None = None,
    *,
    bedrock: bool = False,
) -> web.StreamResponse:
    """Write the events with ``delay`` seconds between them; a vanished client is not an error.
    A stream ``fault`` cuts the answer after its first events and goes wrong as it says.
    ``bedrock``: as AWS event-stream frames instead of server-sent events."""
    response = web.StreamResponse(
        headers={
            "content-type": "application/vnd.amazon.eventstream" if bedrock
            else "text/event-stream",
            "cache-control": "no-cache",
            "request-id": request_id,
        }
    )
    entry.update(completed=False, disconnected=False)
    events = list(stream_events(message))
    if fault is not None:
        events = events[: fault.after_events]
    try:
        # A client killed before the headers went out (a SIGKILLed worker) is a disconnect too.
        await response.prepare(request)
        for n, (name, data) in enumerate(events):
            if bedrock:
                await response.write(platforms.chunk_frame(data))
            else:
                await response.write(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode())
            if delay and (n < len(events) - 1 or fault is not None):
                await asyncio.sleep(delay)
        if fault is not None:
            await (_go_wrong_bedrock if bedrock else _go_wrong)(response, fault, request_id)
        await response.write_eof()
    except ConnectionError:
        log.info("client went away mid-stream (%s)", request_id)
        entry["disconnected"] = True
        return response
    entry["completed"] = True
    return response


async def _go_wrong(response: web.StreamResponse, fault: Fault, request_id: str) -> None:
    """The end of a faulty stream; ``pings`` returns only when the client goes away."""
    if fault.stream == "error":
        error = {
            "type": "error",
            "error": {"type": fault.error_type, "message": fault.error_message},
            "request_id": request_id,
        }
        await response.write(f"event: error\ndata: {json.dumps(error)}\n\n".encode())
    elif fault.stream == "pings":
        ping = b'event: ping\ndata: {"type": "ping"}\n\n'
        while True:  # until the client disconnects (ConnectionError) or the server stops
            await response.write(ping)
            await asyncio.sleep(fault.interval_ms / 1000)
    elif fault.stream == "garbage":
        await response.write(
            b"%%% this line is not server-sent events %%%\n"
            b"event: content_block_delta\ndata: {this is not JSON\n\n"
        )
    elif fault.stream == "truncated":
        # No blank line after it: the event is never complete, and the response ends here.
        await response.write(
            b'event: content_block_delta\ndata: {"type": "content_block_delta", "index": 0, "del'
        )


async def _go_wrong_bedrock(response: web.StreamResponse, fault: Fault, request_id: str) -> None:
    """:func:`_go_wrong` in event-stream frames: an ``exception`` frame, pings, bytes that are
    no frame, a frame cut short."""
    if fault.stream == "error":
        await response.write(platforms.exception_frame(fault.error_type, fault.error_message))
    elif fault.stream == "pings":
        while True:
            await response.write(platforms.chunk_frame({"type": "ping"}))
            await asyncio.sleep(fault.interval_ms / 1000)
    elif fault.stream == "garbage":
        await response.write(b"%%% these bytes are not an AWS event-stream frame %%%")
    elif fault.stream == "truncated":
        frame = platforms.chunk_frame({"type": "content_block_delta", "index": 0,
                                       "delta": {"type": "text_delta", "text": "cut"}})
        await response.write(frame[: len(frame) // 2])


def build_app(state: ServerState) -> web.Application:
    handlers = _Handlers(state)
    # Long agent histories exceed aiohttp's 1 MiB default; the real API takes 32 MB requests.
    app = web.Application(client_max_size=MAX_REQUEST_BYTES)
    app.router.add_post("/v1/messages", handlers.messages)
    app.router.add_post("/v1/messages/count_tokens", handlers.count_tokens)
    app.router.add_post(r"/model/{model}/{action:invoke|invoke-with-response-stream}",
                        handlers.bedrock)
    app.router.add_post(
        "/v1/projects/{project}/locations/{region}/publishers/anthropic/models/{tail}",
        handlers.vertex,
    )
    app.router.add_get("/", handlers.metadata_ping)
    app.router.add_get("/computeMetadata/v1/{path:.*}", handlers.metadata)
    app.router.add_get("/_fake/requests", handlers.requests_log)
    app.router.add_post("/_fake/reset", handlers.reset)
    app.router.add_route("*", "/{tail:.*}", handlers.not_found)
    return app


# --- running it ------------------------------------------------------------------------------


class FakeAnthropicServer:
    """The server, either inside a running loop (``await start()`` / ``await stop()``, or
    ``async with``) or in a background thread with its own loop (``with``), for sync callers."""

    def __init__(self, scenario: Scenario | str | Path, host: str = "127.0.0.1", port: int = 0):
        self.scenario = scenario if isinstance(scenario, Scenario) else resolve_scenario(scenario)
        self.host = host
        self._requested_port = port
        self.state = ServerState(self.scenario)
        self._runner: web.AppRunner | None = None
        self._port: int | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("fake-anthropic server is not started")
        return self._port

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def requests(self) -> list[dict[str, Any]]:
        """A copy of the request log (same content as ``GET /_fake/requests``)."""
        return [dict(entry) for entry in self.state.log]

    def reset(self) -> None:
        """Clear the request log and the fault counters (same as ``POST /_fake/reset``)."""
        self.state.reset()

    async def start(self) -> None:
        if self._runner is not None:
            raise RuntimeError("fake-anthropic server already started")
        runner = web.AppRunner(build_app(self.state), access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.host, self._requested_port)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self._port = int(runner.addresses[0][1])

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    def __enter__(self) -> Self:
        ready = threading.Event()
        failure: list[BaseException] = []
        loop = asyncio.new_event_loop()

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self.start())
            except BaseException as err:  # handed to the caller's thread below
                failure.append(err)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(self.stop())
                loop.close()

        self._loop = loop
        self._thread = threading.Thread(target=run, name="fake-anthropic", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            self._thread.join()
            self._thread = self._loop = None
            raise failure[0]
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        self._thread = self._loop = None
