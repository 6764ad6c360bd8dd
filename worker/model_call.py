"""One model turn through the Anthropic SDK: streaming, retries, error classes.

The SDK's own retries are off (``max_retries=0``): retrying here keeps the run's lease alive (the
heartbeat runs beside the backoff), logs each retry with the run id, counts it in metrics, and lets
a cancellation interrupt a backoff at once.

An error is classified by the error ``type`` in its body when it has one, else by its HTTP status:
an overload can arrive as an ``event: error`` inside a stream whose status was 200.

* Transient, retried with exponential backoff and full jitter (honouring ``retry-after``), up to
  ``max_retries`` times, after which the claim is given up so that the run's attempt counter (and,
  past it, the dead letter) decides: the types ``overloaded_error``, ``api_error``,
  ``rate_limit_error``, ``timeout_error``; without a known type 429, 529, 5xx, 408, 409; an error
  event of an unknown type in a 200 stream; connection failures (including a read timeout in the
  middle of a stream, which surfaces as a bare httpx error); a malformed stream (a data line that
  is not JSON, events the SDK cannot assemble, a stream that ends before ``message_stop``); and a
  call that outlasts its overall deadline (the SDK's timeout is per read, so a stream of pings
  alone would never end).
* Permanent, the run fails at once with the provider's own message: the types
  ``invalid_request_error``, ``authentication_error``, ``permission_error``, ``not_found_error``,
  ``request_too_large``, ``billing_error``; without a known type any other 4xx (a retired model,
  a bad key).

The request is built from the pinned prompt version and the history in canonical key order, the
form the prompt version is stored in: the first worker and every resumed one send the same bytes,
so the provider's prompt cache keeps hitting across a resume.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx2 as httpx  # anthropic >= 2 ships its HTTP client as httpx2
from anthropic._constants import RAW_RESPONSE_HEADER
from anthropic._models import FinalRequestOptions
from anthropic._utils._json import openapi_dumps_str
from jiter import from_json

from agentrun.canonical import canonical_json
from agentrun.manifests import DEFAULT_MAX_TOKENS
from agentrun.store import PromptVersion, jsonb_form
from agentrun.worker.client import escape_surrogates
from agentrun.worker.providers import ModelClient, PermanentModelError, TransientExhausted
from agentrun.worker.settings import RetryPolicy

log = logging.getLogger("agentrun.worker.model")


class MalformedStream(Exception):
    """The 200 stream could not be read as a Message (a transient failure of the provider)."""


class DeadlineExceeded(Exception):
    """The call gave no complete answer within its overall deadline (a transient failure)."""


@dataclass(frozen=True)
class ModelTurn:
    #: The assembled message as message.to_dict() gives it, in its stored form (jsonb_form): what
    #: the log gives a resumed worker, so the live run carries on from the same values.
    payload: dict[str, Any]
    request_id: str | None
    stop_reason: str | None
    input_tokens: int
    output_tokens: int
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0




TRANSIENT_STATUS = {408, 409, 429}
# The API's error types (docs.anthropic.com/en/api/errors); they decide before the status does.
TRANSIENT_TYPES = frozenset({"overloaded_error", "api_error", "rate_limit_error", "timeout_error"})
PERMANENT_TYPES = frozenset({
    "invalid_request_error", "authentication_error", "permission_error", "not_found_error",
    "request_too_large", "billing_error",
})
# What the SDK raises when the bytes of a 200 stream are not a Message: JSONDecodeError and
# UnicodeDecodeError (ValueError), pydantic's ValidationError (ValueError), "Unexpected event
# order" (RuntimeError), a delta for a block that never started (IndexError), an event of no
# known shape (TypeError). Provider and transport errors derive from none of these.
_MALFORMED = (ValueError, RuntimeError, LookupError, TypeError)


def _malformed() -> tuple[type[BaseException], ...]:
    """:data:`_MALFORMED`, and botocore's event-stream ParserError once botocore is loaded (a
    Bedrock stream whose frames do not parse); never imported here for a worker without it."""
    eventstream = sys.modules.get("botocore.eventstream")
    parser_error = getattr(eventstream, "ParserError", None)
    return (*_MALFORMED, parser_error) if isinstance(parser_error, type) else _MALFORMED


def _credential_error(exc: BaseException) -> str | None:
    """'transient' or 'permanent' for a failure to get the provider's credentials (google-auth
    refreshing a token, boto3 resolving the pod's role), raised before a request is sent; None
    for anything else. A network failure or one the library calls retryable is transient; a
    refusal (no credentials, a revoked grant, a role that cannot be assumed) is permanent."""
    gauth = sys.modules.get("google.auth.exceptions")
    if gauth is not None and isinstance(exc, gauth.GoogleAuthError):
        transient = isinstance(exc, gauth.TransportError) or getattr(exc, "retryable", False)
        return "transient" if transient else "permanent"
    boto = sys.modules.get("botocore.exceptions")
    if boto is not None and isinstance(exc, boto.BotoCoreError | boto.ClientError):
        if isinstance(exc, boto.HTTPClientError | boto.ConnectionError):
            return "transient"
        return "permanent"
    return None


def _canonical(value: Any) -> Any:
    return json.loads(canonical_json(value))


EPHEMERAL = {"type": "ephemeral"}
MAX_BREAKPOINTS = 4  # the API's limit of cache_control blocks per request


def _blocks(content: Any) -> list[dict[str, Any]]:
    """Content as a list of blocks: a string becomes one text block, in every turn alike, so a
    message reads the same bytes whether or not it carries this turn's breakpoint. A list is
    returned as it is, shared with the history (never written to: place_breakpoints copies the
    one block it marks and the list that holds it), so a turn copies two messages, not all."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    blocks: list[dict[str, Any]] = content
    return blocks


def place_breakpoints(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, system: str | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, list[dict[str, Any]] | None]:
    """``cache_control`` breakpoints, a function of the history and the pinned prompt alone (never
    of worker state), so a resumed worker places them exactly where the first one did.

    On the last tool definition and on the system prompt (the fixed prefix, shared by every run
    of the agent); on the last block of the history (this turn writes its whole prefix); and on
    the last block of the previous turn's last message, the prefix the previous turn wrote, so
    this turn reads it even when the new turn added more blocks than the API looks back over."""
    out = [{"role": m["role"], "content": _blocks(m["content"])} for m in messages]
    new_tools = [*tools[:-1], {**tools[-1], "cache_control": dict(EPHEMERAL)}] if tools else None
    new_system = (
        [{"type": "text", "text": system, "cache_control": dict(EPHEMERAL)}] if system else None
    )
    marks = [len(out) - 1]
    # The previous request ended with the message before the newest assistant turn.
    newest = next((i for i in range(len(out) - 1, -1, -1) if out[i]["role"] == "assistant"), None)
    if newest and newest - 1 != marks[0]:  # an assistant turn at 0 has no request before it
        marks.append(newest - 1)
    for i in marks[: MAX_BREAKPOINTS - 2]:
        content = out[i]["content"]
        if content:
            out[i]["content"] = [*content[:-1], {**content[-1], "cache_control": dict(EPHEMERAL)}]
    return out, new_tools, new_system


#: The parts of a request sent in canonical key order (sorted, as the prompt version is stored):
#: the resolved tool definitions (insertion order), the history rebuilt from JSONB (its own key
#: order) and the live turns (the SDK's order) would otherwise serialize to different bytes
#: before and after a resume, and the provider's prompt cache would miss.
CANONICAL_PARTS = frozenset({"messages", "system", "tools"})


def build_request(pv: PromptVersion, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The request, entirely from the run's pinned prompt version plus its history. With
    ``prompt_caching`` in the pinned params, :func:`place_breakpoints` adds the cache_control
    breakpoints.

    Its :data:`CANONICAL_PARTS` are sent in canonical key order, put so where it is encoded:
    :func:`_body` writes each straight into the body (one encoding of the history a turn, where
    putting the order into the dicts took three: the whole conversation to JSON, back, and to
    JSON again in the SDK, every turn of every run), and :func:`canonical_request` puts it into
    the dicts for the SDK's own route."""
    caching = bool(pv.params.get("prompt_caching"))
    history: list[dict[str, Any]] = messages
    tools = pv.tools or None
    system: Any = pv.system or None
    if caching:
        history, tools, system = place_breakpoints(history, tools, system)
    req: dict[str, Any] = {
        "model": pv.model,
        "max_tokens": int(pv.params.get("max_tokens", DEFAULT_MAX_TOKENS)),
        "messages": history,
    }
    if system:
        req["system"] = system
    if tools:
        req["tools"] = tools
    thinking = pv.params.get("thinking")
    if thinking:
        req["thinking"] = {"type": "enabled", "budget_tokens": int(thinking["budget_tokens"])}
    return req


def canonical_request(request: dict[str, Any]) -> dict[str, Any]:
    """``request`` with its :data:`CANONICAL_PARTS` in canonical key order, for an encoder that
    keeps the order of the dicts it is given (the SDK's)."""
    return {k: _canonical(v) if k in CANONICAL_PARTS else v for k, v in request.items()}


def _retry_after(exc: Exception) -> float | None:
    response = getattr(exc, "response", None)
    if response is None:
        return None
    raw = response.headers.get("retry-after")
    try:
        value = float(raw) if raw is not None else None
    except ValueError:
        return None
    # A negative one retried at once, all retries in milliseconds against a provider asking to
    # wait, and a nan slept for ever (asyncio.sleep(nan)): both are the policy's backoff instead.
    # An infinite one is the longest wait the policy allows (RetryPolicy.delay).
    if value is None or math.isnan(value) or value < 0:
        return None
    return value


def _error_body(exc: anthropic.APIStatusError) -> dict[str, Any]:
    body = exc.body
    err = body.get("error") if isinstance(body, dict) else None
    return err if isinstance(err, dict) else {}


def error_type(exc: anthropic.APIStatusError) -> str | None:
    """The error ``type`` of the body (``overloaded_error``...), if it has one."""
    etype = _error_body(exc).get("type")
    return etype if isinstance(etype, str) else None


def _in_stream(exc: anthropic.APIStatusError) -> bool:
    """An ``event: error`` inside a stream: the SDK raises it with the stream's own 200."""
    return exc.status_code < 400


def _provider_message(exc: BaseException) -> str:
    if not isinstance(exc, anthropic.APIStatusError):  # the provider's credentials
        return f"credentials: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    err = _error_body(exc)
    where = "error event in the stream" if _in_stream(exc) else str(exc.status_code)
    if err.get("message"):  # the API's {type, message}, or Google's {code, message, status}
        return f"{where} {err.get('type') or err.get('status') or 'error'}: {err['message']}"
    body = exc.body
    if isinstance(body, dict) and isinstance(body.get("message"), str):  # Bedrock's errors
        return f"{where}: {body['message']}"
    return f"{where}: {exc.message}"


def _reason(exc: Exception) -> str:
    """The metric label and log word for a transient failure."""
    if isinstance(exc, anthropic.APIStatusError):
        if _in_stream(exc):
            return error_type(exc) or "stream_error"
        return str(exc.status_code)
    if isinstance(exc, MalformedStream):
        return "malformed_stream"
    if isinstance(exc, DeadlineExceeded):
        return "deadline"
    return type(exc).__name__


def classify(exc: BaseException) -> str:
    """'transient', 'permanent' or 'unknown' (re-raised)."""
    if isinstance(exc, anthropic.APIStatusError):
        etype = error_type(exc)
        if etype in TRANSIENT_TYPES:
            return "transient"
        if etype in PERMANENT_TYPES:
            return "permanent"
        code = exc.status_code
        # An error event of a type we do not know broke a 200 stream off: retry it, bounded.
        if _in_stream(exc) or code in TRANSIENT_STATUS or code >= 500:
            return "transient"
        return "permanent"
    if isinstance(exc, MalformedStream | DeadlineExceeded):
        return "transient"
    if isinstance(exc, anthropic.APIConnectionError | httpx.TransportError):
        return "transient"  # includes APITimeoutError and a bare httpx ReadTimeout mid-stream
    return _credential_error(exc) or "unknown"


OnEvent = Callable[[], None]


async def call_model(
    client: ModelClient,
    request: dict[str, Any],
    *,
    policy: RetryPolicy,
    on_first_event: OnEvent | None = None,
    on_retry: Callable[[str], None] | None = None,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    texts: BodyTexts | None = None,
) -> ModelTurn:
    """Stream one turn and return the assembled message; retry transient failures.
    ``texts``: the run's :class:`BodyTexts`, so the history is not encoded whole every turn."""
    attempt = 0
    while True:
        try:
            return await _call_once(client, request, policy.deadline, on_first_event, texts)
        except Exception as exc:
            kind = classify(exc)
            if kind == "permanent":
                raise PermanentModelError(_provider_message(exc)) from None
            if kind != "transient":
                raise
            reason, detail = _reason(exc), " ".join(str(exc).split())[:300]
            if attempt >= policy.max_retries:
                raise TransientExhausted(
                    f"model call failed {attempt + 1} times; last: {reason}: {detail}"
                ) from None
            delay = policy.delay(attempt, _retry_after(exc))
            log.warning("model call failed (%s: %s); retry %d in %.2fs",
                        reason, detail, attempt + 1, delay)
            if on_retry is not None:
                on_retry(reason)
            attempt += 1
            await sleep(delay)


async def _call_once(
    client: ModelClient,
    request: dict[str, Any],
    deadline: float,
    on_first_event: OnEvent | None,
    texts: BodyTexts | None = None,
) -> ModelTurn:
    """One request, its whole stream read within ``deadline`` seconds."""
    timeout = asyncio.timeout(deadline)
    try:
        async with timeout:
            return await _stream_turn(client, request, on_first_event, texts)
    except TimeoutError:
        if not timeout.expired():
            raise  # not ours (a cancellation of the run is a CancelledError and passes through)
        raise DeadlineExceeded(
            f"no complete answer within the {deadline:g}s model call deadline"
        ) from None


#: The one switch between the two ways of reading a stream (issue 17). On: a first-party client
#: without the SDK's own spans sends the request through the SDK (its auth, headers, transport,
#: timeouts, error statuses) but reads the server-sent events itself, straight into the dicts the
#: step log stores, about half the worker's CPU per step less than building the SDK's event
#: models and converting them back (benchmarks/cpu_bench.py). Off: every client takes the SDK's
#: events (:func:`_stream_turn_sdk`), the route Bedrock, Vertex and a traced client always take.
RAW_STREAM = True

# The content blocks whose input streams as input_json_delta (the SDK's TRACKS_TOOL_INPUT).
_TOOL_INPUT_BLOCKS = frozenset({"tool_use", "server_tool_use"})


#: What ``client.post("/v1/messages", content=..., stream=True)`` builds, built once: the SDK's
#: ``FinalRequestOptions.construct`` deep-copies every field's default on each call (52 us a
#: turn here, against 7 us for a shallow copy of this; the client copies its options again
#: before it uses them).
_POST_HEADERS = {RAW_RESPONSE_HEADER: "stream"}
_POST = FinalRequestOptions.construct(
    method="post", url="/v1/messages", json_data=None, files=None, headers=_POST_HEADERS
)


def post_options(body: bytes) -> FinalRequestOptions:
    """The options of a streamed Messages request with ``body``: a copy of :data:`_POST` (its
    headers copied too, so no request can change the next one's)."""
    return _POST.model_copy(update={"content": body, "headers": dict(_POST_HEADERS)})


def raw_route(client: ModelClient) -> bool:
    """Whether :func:`_stream_turn` reads this client's stream itself. Only the first-party
    client's: Bedrock frames its stream as AWS event-stream messages and Vertex is left to the
    SDK that knows it; and a client with the SDK's own spans on (worker/tracing.py) keeps them,
    since the SDK records the usage of its span from the events it builds."""
    return (
        RAW_STREAM
        and isinstance(client, anthropic.AsyncAnthropic)
        and getattr(client, "_tracer", None) is None
    )


async def _stream_turn(
    client: ModelClient,
    request: dict[str, Any],
    on_first_event: OnEvent | None,
    texts: BodyTexts | None = None,
) -> ModelTurn:
    if not raw_route(client):
        return await _stream_turn_sdk(client, request, on_first_event)
    assert isinstance(client, anthropic.AsyncAnthropic)  # raw_route's
    # The client's own request (what its post does): its auth, headers, transport, timeouts, and
    # a non-2xx status raised as its APIStatusError before any byte is read. The body goes as the
    # bytes the SDK would send (its own encoder), made here: the SDK would first copy the whole
    # history, every turn, looking for file inputs a worker never sends.
    response = await client.request(httpx.Response, post_options(_body(request, texts)),
                                    stream=True)
    try:
        message = await _read_stream(response, on_first_event, anthropic_client=client)
    except _malformed() as exc:
        raise MalformedStream(
            f"malformed stream: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
        ) from exc
    finally:
        await response.aclose()  # at once, also on a cancellation: the stream is dropped
    request_id = response.headers.get("request-id")
    usage = message["usage"]
    return ModelTurn(
        payload=jsonb_form(message),
        request_id=request_id,
        stop_reason=message.get("stop_reason"),
        input_tokens=usage.get("input_tokens") or 0,
        output_tokens=usage.get("output_tokens") or 0,
        cache_read_tokens=usage.get("cache_read_input_tokens") or 0,
        cache_write_tokens=usage.get("cache_creation_input_tokens") or 0,
    )


def _canonical_text(value: Any) -> str:
    # canonical_json's bytes, a NaN or infinity refused as the SDK's encoder refuses it
    # (anthropic._utils._json): the body must not hold what the API cannot parse.
    return canonical_json(value, allow_nan=False)


class BodyTexts:
    """The canonical JSON of a run's history, kept from one turn's request to the next, so each
    message's content is encoded once rather than at every turn (the whole conversation every
    turn: quadratic in its length; benchmarks/cpu_bench.py, docs/benchmarks.md).

    A list is kept whole, and a list not kept is written from its blocks (the dicts in it), each
    kept: prompt caching marks the last block of two messages, and of the tools, by copying that
    block and the list holding it, so a copy's other blocks are the history's own and only the
    marked block is new (all the tools were encoded again every turn, the conversation's marked
    messages too).

    Kept by the identity of the value encoded, which the entry holds, so no other object can take
    its id while it is here. Sound because a value of the history is never written to once it is
    in it: a content list is a step's payload as committed (the executor's and rebuild_messages'
    messages), the tools are the pinned prompt version's, and place_breakpoints copies what it
    marks. Only what the latest request used is kept (:meth:`body_done`): a copy made for one
    turn's breakpoint is dropped at the next, and what is held is about one request's JSON."""

    def __init__(self) -> None:
        self._texts: dict[int, tuple[object, str]] = {}
        self._used: dict[int, tuple[object, str]] = {}

    def __len__(self) -> int:
        return len(self._texts)

    def text(self, value: Any) -> str:
        """``value``'s canonical JSON (:func:`_canonical_text`), encoded once while kept; a
        list not kept is written from its blocks' texts (the same bytes: ``[``, the items
        joined by ``,``, ``]``)."""
        return self._kept(value, self._list_text if type(value) is list else _canonical_text)

    def _list_text(self, value: list[Any]) -> str:
        return "[" + ",".join(map(self._block, value)) + "]"

    def _block(self, value: Any) -> str:
        return self._kept(value, _canonical_text) if type(value) is dict else _canonical_text(value)

    def _kept(self, value: Any, encode: Callable[[Any], str]) -> str:
        entry = self._texts.get(id(value))
        if entry is None or entry[0] is not value:
            entry = (value, encode(value))
        self._used[id(value)] = entry
        return entry[1]

    def body_done(self) -> None:
        """A request's body is written: keep what it used, nothing else."""
        self._texts, self._used = self._used, {}


#: A message's role as JSON, for the messages the executor makes (role and content alone).
_ROLE_TEXT = {"user": '"user"', "assistant": '"assistant"'}


def _message_text(message: dict[str, Any], texts: BodyTexts) -> str:
    """What _canonical_text(message) writes, its content from ``texts``: keys sorted (content,
    role), no spaces. Anything else (a string's content, the task's; another key) is encoded
    whole, as it comes."""
    content, role = message.get("content"), message.get("role")
    role_text = _ROLE_TEXT.get(role) if isinstance(role, str) else None
    if role_text is None or len(message) != 2 or not isinstance(content, list):
        return _canonical_text(message)
    return '{"content":' + texts.text(content) + ',"role":' + role_text + "}"


def _part_text(key: str, value: Any, texts: BodyTexts | None) -> str:
    if key not in CANONICAL_PARTS:
        return openapi_dumps_str(value)
    if texts is None:
        return _canonical_text(value)
    if key == "messages" and isinstance(value, list):
        return "[" + ",".join(
            _message_text(m, texts) if isinstance(m, dict) else _canonical_text(m) for m in value
        ) + "]"
    return texts.text(value)  # the tools and the system prompt: the same objects every turn


def _body(request: dict[str, Any], texts: BodyTexts | None = None) -> bytes:
    """The streamed request's JSON as the SDK writes ``canonical_request(request)``, written in
    one pass, a lone surrogate escaped as the clients of worker/client.py escape it (the SDK's
    encoder cannot write one as UTF-8). With ``texts``, what an earlier request of the run
    encoded is not encoded again (the same bytes)."""
    text = "{" + ",".join(
        f"{openapi_dumps_str(key)}:{_part_text(key, value, texts)}"
        for key, value in {**request, "stream": True}.items()
    ) + "}"
    if texts is not None:
        texts.body_done()
    try:
        return text.encode()
    except UnicodeEncodeError:
        return escape_surrogates(text)


async def _read_stream(
    response: httpx.Response,
    on_first_event: OnEvent | None,
    *,
    anthropic_client: Any,
) -> dict[str, Any]:
    """The message a 200 stream of server-sent events assembles to, as the SDK's
    ``get_final_message().to_dict()`` would give it (the same keys and values), read from the
    provider's JSON without a model object in between. Raises what the SDK would: the SDK's
    APIStatusError (status 200) for an ``event: error``; a ValueError or LookupError for bytes
    that are not a message (the caller's MalformedStream); MalformedStream for a stream that
    ends before ``message_stop``."""
    event: bytes | None = None
    data: list[bytes] = []
    message: dict[str, Any] | None = None
    json_bufs: dict[int, bytes] = {}
    first = True
    rest = b""
    chunks = response.aiter_bytes()
    async for chunk in chunks:
        lines = (rest + chunk).split(b"\n")
        rest = lines.pop()  # the line not yet ended
        for line in lines:
            if line.endswith(b"\r"):
                line = line[:-1]
            if line:
                # An SSE field: name, colon, one optional space, value; a line starting with a
                # colon is a comment, one without a colon a field of no value (both ignored).
                name, sep, value = line.partition(b":")
                if value.startswith(b" "):
                    value = value[1:]
                if name == b"data" and sep:
                    data.append(value)
                elif name == b"event":
                    event = value
                continue
            # A blank line dispatches the event, as the SDK's decoder does: pings, events of no
            # name and events of no data are skipped.
            if event is None or event == b"ping" or (not data and event != b"error"):
                event, data = None, []
                continue
            body = data[0] if len(data) == 1 else b"\n".join(data)
            name_, event, data = event, None, []
            if name_ == b"error":
                try:
                    err: Any = json.loads(body)
                    err_msg = f"{err}"
                except ValueError:
                    err, err_msg = body.decode(errors="replace"), body.decode(errors="replace")
                raise anthropic_client._make_status_error(err_msg, body=err, response=response)
            ev = json.loads(body)  # bytes: a line that is not UTF-8 is a ValueError too
            if first:
                first = False
                if on_first_event is not None:
                    on_first_event()
            kind = ev["type"]
            if message is None:
                if kind != "message_start":
                    raise RuntimeError(f'Unexpected event order, got {kind} before "message_start"')
                message = dict(ev["message"])
                message["content"] = list(message.get("content") or [])
                message["usage"] = dict(message["usage"])
            elif kind == "content_block_delta":
                block = message["content"][ev["index"]]
                delta = ev["delta"]
                dtype = delta["type"]
                btype = block["type"]
                if dtype == "text_delta":
                    if btype == "text":
                        block["text"] += delta["text"]
                elif dtype == "input_json_delta":
                    if btype in _TOOL_INPUT_BLOCKS:
                        i = ev["index"]
                        json_bufs[i] = json_bufs.get(i, b"") + delta["partial_json"].encode()
                elif dtype == "thinking_delta":
                    if btype == "thinking":
                        block["thinking"] += delta["thinking"]
                elif dtype == "signature_delta":
                    if btype == "thinking":
                        block["signature"] = delta["signature"]
                elif dtype == "citations_delta":
                    if btype == "text":
                        if not block.get("citations"):
                            block["citations"] = [delta["citation"]]
                        else:
                            block["citations"].append(delta["citation"])
            elif kind == "content_block_start":
                message["content"].append(dict(ev["content_block"]))
            elif kind == "message_delta":
                delta, usage = ev["delta"], ev["usage"]
                message["stop_reason"] = delta.get("stop_reason")
                message["stop_sequence"] = delta.get("stop_sequence")
                message["stop_details"] = delta.get("stop_details")
                if delta.get("container") is not None:
                    message["container"] = delta["container"]
                mu = message["usage"]
                mu["output_tokens"] = usage["output_tokens"]
                # Cumulative totals: they overwrite; one left out keeps message_start's value.
                for key in ("input_tokens", "cache_creation_input_tokens",
                            "cache_read_input_tokens", "server_tool_use",
                            "output_tokens_details"):
                    if usage.get(key) is not None:
                        mu[key] = usage[key]
            elif kind == "message_stop":
                for i, buf in json_bufs.items():
                    if buf:
                        message["content"][i]["input"] = _whole_input(buf, i)
                # Read the response to its end, as the SDK does: one closed before its end
                # takes its connection with it, and every turn would pay a new one.
                async for _ in chunks:
                    pass
                return message
    # The SDK would hand out whatever it assembled (no stop_reason, maybe no content): it is not
    # a turn, and committing it would put a broken message into the history.
    raise MalformedStream("malformed stream: it ended before message_stop")


def _whole_input(buf: bytes, index: int) -> Any:
    """A tool_use block's input from its ``input_json_delta`` pieces, which must make one whole
    JSON value. The SDK parses them in partial mode, which drops an unfinished value and keeps a
    number cut short: a lost delta ({"to": "bob", "amount": 10 of 1000}) was run, and recorded as
    the model's call. A stream that does not add up to its message is malformed (retried)."""
    try:
        return from_json(buf)
    except ValueError as exc:
        raise MalformedStream(
            f"malformed stream: the input of content block {index} is not whole JSON "
            f"({' '.join(str(exc).split())[:200]})"
        ) from None


async def _stream_turn_sdk(
    client: ModelClient,
    request: dict[str, Any],
    on_first_event: OnEvent | None,
) -> ModelTurn:
    """One turn through the SDK's events (Bedrock, Vertex, a traced client, RAW_STREAM off)."""
    async with client.messages.stream(**canonical_request(request)) as stream:
        events = aiter(stream)
        first, stopped = True, False
        json_bufs: dict[int, bytes] = {}  # each tool input's pieces, checked whole (_whole_input)
        while True:
            try:
                event = await anext(events)
            except StopAsyncIteration:
                break
            except _malformed() as exc:
                raise MalformedStream(
                    f"malformed stream: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
                ) from exc
            if first and on_first_event is not None:
                on_first_event()
            first = False
            stopped = stopped or event.type == "message_stop"
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                piece = escape_surrogates(event.delta.partial_json)
                json_bufs[event.index] = json_bufs.get(event.index, b"") + piece
        if not stopped:
            # The SDK hands out whatever it assembled (no stop_reason, maybe no content): it is
            # not a turn, and committing it would put a broken message into the history.
            raise MalformedStream("malformed stream: it ended before message_stop")
        for i, buf in json_bufs.items():
            if buf:
                _whole_input(buf, i)
        message = await stream.get_final_message()
        request_id = stream.request_id
    return ModelTurn(
        payload=jsonb_form(message.to_dict()),
        request_id=request_id,
        stop_reason=message.stop_reason,
        input_tokens=message.usage.input_tokens,
        output_tokens=message.usage.output_tokens,
        cache_read_tokens=message.usage.cache_read_input_tokens or 0,
        cache_write_tokens=message.usage.cache_creation_input_tokens or 0,
    )
