"""One model turn through the Anthropic SDK: streaming, retries, error classes.

The SDK's own retries are off (``max_retries=0``): retrying here keeps the run's lease alive (the
heartbeat runs beside the backoff), logs each retry with the run id, counts it in metrics, and lets
a cancellation interrupt a backoff at once.

* 429, 529, 5xx, 408, 409 and connection failures (including a read timeout in the middle of a
  stream, which surfaces as a bare httpx error) are transient: retried with exponential backoff and
  full jitter, honouring ``retry-after``; after ``max_retries`` the claim is given up, so the run's
  attempt counter (and, past it, the dead letter) decides.
* 400, 401, 403, 404, 413, 422 are permanent (a retired model, a bad key): the run fails at once
  with the provider's own message.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx2 as httpx  # anthropic >= 2 ships its HTTP client as httpx2

from agentrun.store import PromptVersion

log = logging.getLogger("agentrun.worker.model")


class PermanentModelError(Exception):
    """The provider refused the request for good; the run fails with this message."""


class TransientExhausted(Exception):
    """Transient failures outlasted the retry budget; the worker gives the claim up."""


@dataclass(frozen=True)
class ModelTurn:
    payload: dict[str, Any]  # message.to_dict(): exactly what the SDK assembled, stored verbatim
    request_id: str | None
    stop_reason: str | None
    input_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = 8
    base_delay: float = 0.5
    max_delay: float = 30.0

    def delay(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return min(retry_after, 300.0) + random.uniform(0, 0.1 * max(retry_after, 0.1))
        return random.uniform(0, min(self.max_delay, self.base_delay * 2**attempt))


TRANSIENT_STATUS = {408, 409, 429}


def build_request(pv: PromptVersion, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The request body, entirely from the run's pinned prompt version plus its history."""
    req: dict[str, Any] = {
        "model": pv.model,
        "max_tokens": int(pv.params.get("max_tokens", 8192)),
        "messages": messages,
    }
    if pv.system:
        req["system"] = pv.system
    if pv.tools:
        req["tools"] = pv.tools
    thinking = pv.params.get("thinking")
    if thinking:
        req["thinking"] = {"type": "enabled", "budget_tokens": int(thinking["budget_tokens"])}
    return req


def _retry_after(exc: Exception) -> float | None:
    response = getattr(exc, "response", None)
    if response is None:
        return None
    raw = response.headers.get("retry-after")
    try:
        return float(raw) if raw is not None else None
    except ValueError:
        return None


def _provider_message(exc: anthropic.APIStatusError) -> str:
    body = exc.body
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return f"{exc.status_code} {err.get('type', 'error')}: {err['message']}"
    return f"{exc.status_code}: {exc.message}"


def classify(exc: BaseException) -> str:
    """'transient', 'permanent' or 'unknown' (re-raised)."""
    if isinstance(exc, anthropic.APIStatusError):
        code = exc.status_code
        if code in TRANSIENT_STATUS or code >= 500:
            return "transient"
        return "permanent"
    if isinstance(exc, anthropic.APIConnectionError | httpx.TransportError):
        return "transient"  # includes APITimeoutError and a bare httpx ReadTimeout mid-stream
    return "unknown"


OnEvent = Callable[[], None]


async def call_model(
    client: anthropic.AsyncAnthropic,
    request: dict[str, Any],
    *,
    policy: RetryPolicy,
    on_first_event: OnEvent | None = None,
    on_retry: Callable[[str], None] | None = None,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> ModelTurn:
    """Stream one turn and return the assembled message; retry transient failures."""
    attempt = 0
    while True:
        try:
            async with client.messages.stream(**request) as stream:
                first = True
                async for _event in stream:
                    if first and on_first_event is not None:
                        on_first_event()
                    first = False
                message = await stream.get_final_message()
                request_id = stream.request_id
            return ModelTurn(
                payload=message.to_dict(),
                request_id=request_id,
                stop_reason=message.stop_reason,
                input_tokens=message.usage.input_tokens,
                output_tokens=message.usage.output_tokens,
            )
        except Exception as exc:
            kind = classify(exc)
            if kind == "permanent":
                assert isinstance(exc, anthropic.APIStatusError)
                raise PermanentModelError(_provider_message(exc)) from None
            if kind != "transient":
                raise
            reason = (
                str(exc.status_code)
                if isinstance(exc, anthropic.APIStatusError)
                else type(exc).__name__
            )
            if attempt >= policy.max_retries:
                raise TransientExhausted(
                    f"model call failed {attempt + 1} times; last: {reason} {exc}"
                ) from None
            delay = policy.delay(attempt, _retry_after(exc))
            log.warning("model call failed (%s); retry %d in %.2fs", reason, attempt + 1, delay)
            if on_retry is not None:
                on_retry(reason)
            attempt += 1
            await sleep(delay)
