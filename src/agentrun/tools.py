"""The tool SDK: how users declare the tools their agent may call.

A tool is a plain function (sync or async) whose first parameter is a :class:`ToolContext`; the
other parameters, with their type hints and defaults, become the JSON schema the model sees::

    from agentrun import tool, ToolContext

    @tool(kind="non_idempotent")
    def send_email(ctx: ToolContext, to: str, body: str) -> str:
        \"\"\"Send an email.\"\"\"
        ...

Every tool declares one of four classes (``kind``). The class tells the runtime what it may do
when a worker dies in the middle of a call and the run is resumed elsewhere:

``pure``
    No side effects (a computation, a parse). Resume policy: simply re-run.
``idempotent``
    Side effects, but running it twice is the same as running it once (a PUT, an upsert, a read).
    Resume policy: re-run.
``non_idempotent``
    Running it twice would do the thing twice (send an email, charge a card). Resume policy: the
    call carries ``ctx.idempotency_key`` (derived from the step position, identical on every
    attempt) for the tool to hand to the remote system, and once the effect is recorded its
    recorded result is reused instead of calling again.
``irreversible``
    Cannot be undone and the remote system offers no idempotency (a wire transfer, a deploy to
    production). Resume policy: an intent row is written before the call; if the worker dies
    between the intent and the recorded outcome, the outcome is unknown and the run waits for a
    human instead of guessing. Never retried automatically.

This module only *declares*: it builds the schema, validates model input, converts return values
and classifies exceptions (:meth:`ToolSpec.classify`). The runtime that enforces the resume
policies (intent rows, recorded effects, retries with backoff, compensation) lives in the worker.
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import enum
import hashlib
import importlib
import importlib.util
import inspect
import json
import logging
import re
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar, get_type_hints, overload

import pydantic
import pydantic_core

from agentrun.canonical import canonical_json
from agentrun.errors import AgentrunError, ConfigError

__all__ = [
    "DEFAULT_TOOL_TIMEOUT",
    "Disposition",
    "KindName",
    "LeaseExpired",
    "LeaseFence",
    "ToolContext",
    "ToolCrashed",
    "ToolDefinitionError",
    "ToolError",
    "ToolKind",
    "ToolLoadError",
    "ToolOutcome",
    "ToolRegistry",
    "ToolSpec",
    "ToolTimeout",
    "UnknownToolError",
    "default_registry",
    "idempotency_key",
    "load_tool_modules",
    "make_context",
    "run_logger",
    "tool",
    "tool_spec",
]

F = TypeVar("F", bound=Callable[..., Any])

KindName = Literal["pure", "idempotent", "non_idempotent", "irreversible"]
OnError = Literal["result", "abort"]
Disposition = Literal["retry", "result", "abort"]

# How long the worker waits for a tool call that declares no ``timeout`` (the worker's
# --tool-timeout / AGENTRUN_TOOL_TIMEOUT overrides it).
DEFAULT_TOOL_TIMEOUT = 300.0
#: The longest a tool call may be given (a week; values.schema.json's toolTimeoutSeconds maximum):
#: an unknown outcome is waited out until the old lease's end plus the timeout, a date that must
#: stay representable (1e12 s overflowed it at every claim, and the run was dead-lettered).
MAX_TOOL_TIMEOUT = 604_800

_TOOL_NAME_RE = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_SPEC_ATTR = "__agentrun_tool__"


class ToolKind(enum.StrEnum):
    """The four tool classes; see the module docstring for each one's resume policy."""

    PURE = "pure"
    IDEMPOTENT = "idempotent"
    NON_IDEMPOTENT = "non_idempotent"
    IRREVERSIBLE = "irreversible"

    @property
    def rerun_on_resume(self) -> bool:
        """True when a call whose outcome was not recorded may simply be run again."""
        return self in (ToolKind.PURE, ToolKind.IDEMPOTENT)


_KIND_VALUES = ", ".join(k.value for k in ToolKind)


# --------------------------------------------------------------------------------------- errors


class ToolError(Exception):
    """Raise from a tool to report ``str(err)`` to the model as an error tool_result.

    Applies whatever the tool's ``on_error`` and ``retryable`` say: it is the tool's own, deliberate
    answer ("no such customer"), not a failure of the infrastructure.
    """


def message_of(exc: BaseException) -> str:
    """``str(exc)``, or a placeholder when the exception's ``__str__`` raises (a library error
    that reads an attribute it never set): a tool's failure stays the tool's. Raised while the
    executor described it, it escaped as the worker's own error, the claim was given up with
    nothing recorded, and every claim after it called a non-idempotent tool again."""
    try:
        return str(exc)
    except Exception as broken:
        return f"<its message cannot be read: {type(broken).__name__}>"


class ToolCrashed(Exception):
    """A tool raised a BaseException that is not an ``Exception`` (``sys.exit()``,
    ``KeyboardInterrupt``, a ``CancelledError`` of its own, ...).

    Contained: it is a failure of that call (classified like any other exception, see
    :meth:`ToolSpec.classify`), never the end of the worker and of every run it holds.
    """

    def __init__(self, tool_name: str, exc: BaseException) -> None:
        text = message_of(exc)
        detail = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
        super().__init__(f"tool {tool_name} raised {detail} (a tool cannot stop the worker)")
        self.original = exc


class ToolTimeout(TimeoutError):
    """A call did not return within its timeout (``@tool(timeout=...)`` or the worker's
    --tool-timeout). A TimeoutError: ``retryable=(TimeoutError,)`` retries it (never for an
    irreversible tool, whose outcome is then unknown)."""

    def __init__(self, tool_name: str, timeout: float) -> None:
        super().__init__(f"tool {tool_name} did not return within its timeout of {timeout:g} s")
        self.timeout = timeout


class LeaseExpired(AgentrunError):
    """Raised by :meth:`ToolContext.check_lease`: this worker no longer holds the run."""


class ToolDefinitionError(ConfigError, ValueError):
    """A tool is declared wrongly (bad kind, missing ctx parameter, duplicate name, ...)."""


class ToolLoadError(ConfigError):
    """A module given to ``--tools`` could not be imported."""


class UnknownToolError(AgentrunError, KeyError):
    """A tool name that is not registered (a KeyError, so ``except KeyError`` also catches it)."""

    def __init__(self, names: str | Sequence[str], known: Sequence[str]) -> None:
        self.names = [names] if isinstance(names, str) else list(names)
        self.name = self.names[0] if self.names else ""
        self.known = sorted(known)
        listed = ", ".join(self.names)
        noun = "tool" if len(self.names) == 1 else "tools"
        if self.known:
            hint = "known tools: " + ", ".join(self.known)
        else:
            hint = "no tools are registered; load them with: agentrun worker --tools MODULE"
        msg = f"unknown {noun} {listed} ({hint})"
        AgentrunError.__init__(self, msg)
        self.message = msg

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.message


# -------------------------------------------------------------------------------------- context


def run_logger(run_id: str, **extra: Any) -> logging.LoggerAdapter[logging.Logger]:
    """A logger whose records carry ``run_id`` (and any ``extra``) as record attributes."""
    return logging.LoggerAdapter(logging.getLogger("agentrun.tools"), {"run_id": run_id, **extra})


def tool_uses(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """A model turn's tool calls, in order (its tool_use blocks): a call's index is its place
    among them."""
    return [b for b in payload.get("content", []) if b.get("type") == "tool_use"]


def idempotency_key(run_id: str, seq: int, tool: str, args: dict[str, Any], call_index: int) -> str:
    """The idempotency key of one tool call, derived from its position in the run.

    Never from the clock or a random id: every attempt at the same step yields the same key, and
    two identical calls in the same turn differ by ``call_index``.
    """
    canonical = canonical_json(args)
    raw = f"{run_id}:{seq}:{call_index}:{tool}:{canonical}"
    return hashlib.sha256(raw.encode("utf-8")).hexdigest()


class LeaseFence(Protocol):
    """What a :class:`ToolContext` asks the worker about its hold on the run."""

    def lease_lost(self) -> str | None:
        """Why the run is no longer held (its lease was lost, or ran out by the worker's own
        clock), or None while it is. Safe to call from any thread."""
        ...


@dataclass(frozen=True)
class ToolContext:
    """What a tool learns about the call it is serving (the first parameter of every tool)."""

    run_id: str
    seq: int  # step position of the tool_use turn in the run
    call_index: int  # index of this call among the turn's tool_use blocks
    tool_name: str
    idempotency_key: str  # identical on every attempt at this call; hand it to remote systems
    attempt: int = 1  # 1 on the first try, incremented by each retry
    # In a compensation: the idempotency key of the call being undone (what the remote system
    # knows the original effect by: the charge a refund must find). None otherwise.
    compensates_key: str | None = None
    # In a compensation: the undone call's outcome was never recorded (its worker died inside
    # it), so its effect may or may not exist. Look it up by compensates_key; nothing found is
    # nothing to undo, not a failure.
    compensates_unknown: bool = False
    # The worker's hold on the run. A worker that lost its lease (it was stopped, partitioned or
    # too slow, and another worker took the run) must stop acting: a long tool checks
    # lease_valid() / check_lease() before each step it cannot take back. None: always valid
    # (a context built by hand, in a unit test).
    fence: LeaseFence | None = None

    def lease_valid(self) -> bool:
        """False once this worker has lost the run (or its lease ran out by the worker's own
        monotonic clock, which also counts the time the process was stopped)."""
        return self.fence is None or self.fence.lease_lost() is None

    def check_lease(self) -> None:
        """Raise :class:`LeaseExpired` if this worker no longer holds the run."""
        lost = self.fence.lease_lost() if self.fence is not None else None
        if lost is not None:
            raise LeaseExpired(f"run {self.run_id}: {lost}; {self.tool_name} must stop")

    @cached_property
    def logger(self) -> logging.LoggerAdapter[logging.Logger]:
        """A logger whose records carry ``run_id`` (plus seq, call_index, tool and attempt)."""
        return run_logger(
            self.run_id,
            seq=self.seq,
            call_index=self.call_index,
            tool=self.tool_name,
            attempt=self.attempt,
        )


def make_context(
    run_id: str,
    seq: int,
    call_index: int,
    tool_name: str,
    args: dict[str, Any],
    attempt: int = 1,
    fence: LeaseFence | None = None,
) -> ToolContext:
    """Build the :class:`ToolContext` for one call, computing its idempotency key."""
    key = idempotency_key(run_id, seq, tool_name, args, call_index)
    return ToolContext(run_id, seq, call_index, tool_name, key, attempt, fence=fence)


# ----------------------------------------------------------------------------------------- spec


@dataclass(frozen=True)
class ToolOutcome:
    """The result of one invocation: ``content`` becomes the tool_result block's content."""

    content: str
    is_error: bool = False
    value: Any = None  # JSON-able return value (None for errors), for recording


def _describe(fn: Callable[..., Any]) -> str:
    doc = inspect.getdoc(fn)
    if not doc:
        return ""
    first = doc.strip().split("\n\n", 1)[0]
    return " ".join(first.split())


def _strip_titles(node: Any) -> Any:
    """Drop pydantic's ``title`` keys, leaving properties (or $defs) that happen to be so named."""
    if isinstance(node, list):
        return [_strip_titles(item) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "title" and isinstance(value, str):
            continue
        if key in ("properties", "$defs", "definitions", "patternProperties") and isinstance(
            value, dict
        ):
            out[key] = {name: _strip_titles(sub) for name, sub in value.items()}
        else:
            out[key] = _strip_titles(value)
    return out


def _qualname(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _build_input_model(fn: Callable[..., Any], name: str) -> type[pydantic.BaseModel]:
    label = _qualname(fn)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise ToolDefinitionError(f"tool {label}: cannot read its signature: {exc}") from exc
    try:
        hints = get_type_hints(fn, include_extras=True)
    except Exception as exc:
        raise ToolDefinitionError(
            f"tool {label}: cannot resolve its type hints: {type(exc).__name__}: {exc}"
        ) from exc
    params = list(sig.parameters.values())
    if not params or hints.get(params[0].name) is not ToolContext:
        raise ToolDefinitionError(
            f"tool {label}: the first parameter must be annotated ToolContext "
            f"(def {getattr(fn, '__name__', name)}(ctx: ToolContext, ...))"
        )
    fields: dict[str, Any] = {}
    for p in params[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ToolDefinitionError(
                f"tool {label}: *args/**kwargs ({p.name}) cannot be described to the model"
            )
        if p.name.startswith("_"):
            raise ToolDefinitionError(
                f"tool {label}: parameter {p.name} starts with an underscore; rename it"
            )
        annotation = hints.get(p.name, Any)
        default = ... if p.default is p.empty else p.default
        fields[p.name] = (annotation, default)
    config = pydantic.ConfigDict(extra="forbid", protected_namespaces=())
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=".*shadows an attribute", category=UserWarning
            )
            model: type[pydantic.BaseModel] = pydantic.create_model(
                f"{name}_input", __config__=config, **fields
            )
            model.model_json_schema()
    except Exception as exc:
        raise ToolDefinitionError(
            f"tool {label}: cannot build an input schema: {type(exc).__name__}: "
            + " ".join(str(exc).split())
        ) from exc
    return model


def _error_summary(tool_name: str, err: pydantic.ValidationError) -> str:
    parts = []
    for e in err.errors(include_url=False):
        loc = ".".join(str(x) for x in e["loc"]) or "input"
        parts.append(f"{loc}: {e['msg']}")
    return f"invalid input for tool {tool_name}: " + "; ".join(parts)


def not_an_object(tool_name: str, raw_input: object) -> str:
    """What the model is told of a call whose input is not a JSON object (the tool not called)."""
    return (f"invalid input for tool {tool_name}: expected a JSON object, "
            f"got {type(raw_input).__name__}")


def _render(value: Any) -> tuple[str, Any]:
    """(content, JSON-able value) for a tool's return value. Never raises: the call returned, so
    its effect happened, and a failure here was taken for the tool's own (the model told it
    failed, a retryable tool called again, the effect recorded as an error no saga undoes).
    What JSON cannot take (bytes that are not UTF-8, a cycle) is rendered as its repr."""
    if isinstance(value, str):
        return value, value
    try:
        jsonable = pydantic_core.to_jsonable_python(value, fallback=str)
        content = json.dumps(jsonable, sort_keys=True, separators=(",", ":"), default=str)
    except Exception:
        try:
            content = repr(value)
        except Exception:  # a __repr__ that raises: the type at least
            content = f"<{type(value).__name__} that cannot be rendered>"
        return content, content
    return content, jsonable


def _settle(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.done():  # the caller stopped waiting (a timeout, a lost lease, a cancel)
        return
    if isinstance(exc, StopIteration):
        # A future refuses it (a TypeError inside this callback, the future never settled: the
        # call hung until its timeout, then read as one). A coroutine turns it into a
        # RuntimeError (PEP 479), as an async or inline tool's would be.
        error = RuntimeError(f"tool raised StopIteration: {message_of(exc)}")
        error.__cause__ = exc
        exc = error
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


@dataclass(frozen=True)
class _Rendered:
    """A sync tool's return value as :func:`_render` made it, in the tool's thread."""

    content: str
    value: Any


async def _in_daemon_thread(name: str, fn: Callable[..., Any], /, *args: Any, **kw: Any) -> Any:
    """Run a sync tool in a thread of its own, marked daemon.

    Not ``asyncio.to_thread``: the default executor's threads are joined when the event loop and
    the interpreter shut down, so one call stuck in a blocking read kept a SIGTERMed worker alive
    for ever. A daemon thread is abandoned at exit. The caller's context variables (the run id
    the log lines carry) go with the call, as to_thread would do.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()
    context = contextvars.copy_context()

    def target() -> None:
        result: Any = None
        error: BaseException | None = None
        try:
            result = context.run(fn, *args, **kw)
        except BaseException as exc:  # handed to the awaiting task, which contains it
            error = exc
        try:
            loop.call_soon_threadsafe(_settle, future, result, error)
        except RuntimeError:  # the loop is closed: nobody waits for this call any more
            pass

    threading.Thread(target=target, name=name, daemon=True).start()
    return await future


@dataclass(frozen=True, eq=False)
class ToolSpec:
    """A declared tool: everything the runtime needs to describe, call and recover it."""

    name: str
    kind: ToolKind
    description: str
    fn: Callable[..., Any]
    input_model: type[pydantic.BaseModel]
    retryable: tuple[type[BaseException], ...] = ()
    compensate: str | None = None
    on_error: OnError = "result"
    timeout: float | None = None  # seconds; None: the worker's --tool-timeout
    inline: bool = False  # a sync tool that never blocks: called on the event loop (no thread)

    @classmethod
    def from_function(
        cls,
        fn: Callable[..., Any],
        *,
        kind: ToolKind | KindName,
        name: str | None = None,
        description: str | None = None,
        retryable: tuple[type[BaseException], ...] | type[BaseException] = (),
        compensate: str | None = None,
        on_error: OnError = "result",
        timeout: float | None = None,
        inline: bool = False,
    ) -> ToolSpec:
        """Validate the declaration and build the spec (what ``@tool`` does, minus registering)."""
        label = _qualname(fn)
        if not callable(fn):
            raise ToolDefinitionError(f"@tool must decorate a function, got {fn!r}")
        if inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn):
            raise ToolDefinitionError(f"tool {label}: generators cannot be tools; return a value")
        try:
            tool_kind = ToolKind(kind)
        except ValueError:
            raise ToolDefinitionError(
                f"tool {label}: kind={kind!r} is not one of: {_KIND_VALUES}"
            ) from None
        tool_name = name if name is not None else getattr(fn, "__name__", "")
        if not isinstance(tool_name, str) or not _TOOL_NAME_RE.match(tool_name):
            raise ToolDefinitionError(
                f"tool {label}: name {tool_name!r} must be 1-64 letters, digits, _ or -"
            )
        if isinstance(retryable, type):
            retryable = (retryable,)
        if not isinstance(retryable, tuple) or not all(
            isinstance(t, type) and issubclass(t, BaseException) for t in retryable
        ):
            raise ToolDefinitionError(
                f"tool {label}: retryable must be a tuple of exception types, got {retryable!r}"
            )
        if on_error not in ("result", "abort"):
            raise ToolDefinitionError(
                f"tool {label}: on_error={on_error!r} is not one of: result, abort"
            )
        if compensate is not None:
            if not isinstance(compensate, str) or not _TOOL_NAME_RE.match(compensate):
                raise ToolDefinitionError(
                    f"tool {label}: compensate must be the name of another tool, got {compensate!r}"
                )
            if compensate == tool_name:
                raise ToolDefinitionError(f"tool {label}: a tool cannot compensate itself")
            if tool_kind is ToolKind.PURE:
                raise ToolDefinitionError(
                    f"tool {label}: a pure tool has no side effects to compensate"
                )
        if timeout is not None and (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not 0 < timeout <= MAX_TOOL_TIMEOUT
        ):
            raise ToolDefinitionError(
                f"tool {label}: timeout must be a positive number of seconds up to "
                f"{MAX_TOOL_TIMEOUT} (a week), got {timeout!r}"
            )
        if inline:
            _check_inline(label, fn, tool_kind, compensate)
        desc = _describe(fn) if description is None else " ".join(description.split())
        return cls(
            name=tool_name,
            kind=tool_kind,
            description=desc,
            fn=fn,
            input_model=_build_input_model(fn, tool_name),
            retryable=retryable,
            compensate=compensate,
            on_error=on_error,
            timeout=None if timeout is None else float(timeout),
            inline=bool(inline),
        )

    @cached_property
    def _definition(self) -> dict[str, Any]:
        schema = _strip_titles(self.input_model.model_json_schema())
        return {"name": self.name, "description": self.description, "input_schema": schema}

    def definition(self) -> dict[str, Any]:
        """The Anthropic tool definition ``{"name", "description", "input_schema"}``.

        Deterministic: the same function always gives a byte-identical
        ``json.dumps(..., sort_keys=True)``, so runs can pin definitions by hash.
        """
        return copy.deepcopy(self._definition)

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)

    async def invoke(self, ctx: ToolContext, raw_input: Any) -> ToolOutcome:
        """Validate the model's input, call the tool and convert its return value.

        Bad input and :class:`ToolError` become an error outcome the model can react to; any
        other exception propagates (see :meth:`classify` for what the runtime does with it),
        a BaseException that is not an Exception as :class:`ToolCrashed`. Only the caller's own
        cancellation propagates as such. A sync tool runs in a daemon thread, unless it is
        ``inline``: then it is called right here, on the event loop's thread.
        """
        if not isinstance(raw_input, dict):
            return ToolOutcome(not_an_object(self.name, raw_input), is_error=True)
        try:
            validated = self.input_model.model_validate(raw_input)
        except pydantic.ValidationError as err:
            return ToolOutcome(_error_summary(self.name, err), is_error=True)
        kwargs = dict(validated)  # keeps nested models as models (model_dump would not)
        try:
            if self.is_async:
                result = await self.fn(ctx, **kwargs)
            elif self.inline:  # on this thread, in a copy of its context as a thread would be
                result = contextvars.copy_context().run(self.fn, ctx, **kwargs)
                if inspect.isawaitable(result):
                    result = await result
            else:
                thread = f"tool-{self.name}-{ctx.run_id}"
                result = await _in_daemon_thread(thread, self._call_and_render, ctx, kwargs)
                if isinstance(result, _Rendered):
                    return ToolOutcome(result.content, is_error=False, value=result.value)
                result = await result  # an awaitable a sync function returned
        except ToolError as err:
            return ToolOutcome(message_of(err) or f"tool {self.name} failed", is_error=True)
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # our own cancellation (a timeout, a lost lease, a cancelled run)
            raise ToolCrashed(self.name, exc) from exc
        except Exception:
            raise
        except BaseException as exc:  # sys.exit(), KeyboardInterrupt, ...: contained
            raise ToolCrashed(self.name, exc) from exc
        content, value = _render(result)
        return ToolOutcome(content, is_error=False, value=value)

    def _call_and_render(self, ctx: ToolContext, kwargs: dict[str, Any]) -> Any:
        """A sync tool's call, in its thread, and its return value rendered there too: a lazy
        value (a generator reading a socket, a slow ``__str__``) was consumed on the event loop,
        outside the call's timeout, stalling every run of the worker and its heartbeat. An
        awaitable it returns is awaited on the loop."""
        result = self.fn(ctx, **kwargs)
        if inspect.isawaitable(result):
            return result
        return _Rendered(*_render(result))

    def classify(self, exc: BaseException) -> Disposition:
        """What the runtime should do with an exception the tool raised.

        ``retry`` (transient, tier 1 backoff) for a ``retryable`` type, except that an
        irreversible tool is never retried; otherwise ``on_error``: ``result`` reports the error
        to the model, ``abort`` fails the run. :class:`ToolError` is always ``result``.
        """
        if isinstance(exc, ToolError):
            return "result"
        if not isinstance(exc, Exception):  # cancellation, KeyboardInterrupt, SystemExit
            return "abort"
        if self.retryable and isinstance(exc, self.retryable):
            if self.kind is ToolKind.IRREVERSIBLE:
                return "abort" if self.on_error == "abort" else "result"
            return "retry"
        return self.on_error


def _check_inline(
    label: str, fn: Callable[..., Any], kind: ToolKind, compensate: str | None
) -> None:
    """Where ``inline=True`` is refused. An async tool runs on the loop already. A tool whose
    calls are recorded (non_idempotent, irreversible, or one with a compensation) pays a fenced
    write per call, beside which a thread hop is noise, and acts on another system: a call that
    blocks there would stall every run of the worker, its heartbeat included."""
    if inspect.iscoroutinefunction(fn):
        raise ToolDefinitionError(
            f"tool {label}: inline=True is for sync tools; an async tool runs on the event loop"
        )
    if not kind.rerun_on_resume or compensate is not None:
        raise ToolDefinitionError(
            f"tool {label}: inline=True is for pure and idempotent tools without a compensation "
            f"(a {kind.value} tool's calls are recorded; its thread hop costs nothing beside that)"
        )


def tool_spec(fn: Callable[..., Any]) -> ToolSpec:
    """The :class:`ToolSpec` that ``@tool`` attached to ``fn``."""
    spec = getattr(fn, _SPEC_ATTR, None)
    if not isinstance(spec, ToolSpec):
        raise TypeError(f"{_qualname(fn)} is not decorated with @tool")
    return spec


# ------------------------------------------------------------------------------------- registry


class ToolRegistry:
    """Tools by name. ``@tool`` registers into :data:`default_registry` unless told otherwise."""

    def __init__(self) -> None:
        self._tools: dict[str, ToolSpec] = {}

    def register(self, spec: ToolSpec) -> ToolSpec:
        """Add ``spec``. Re-registering the same function (a module imported again) replaces it;
        a different function under an existing name is an error."""
        old = self._tools.get(spec.name)
        if old is not None and old.fn is not spec.fn and _qualname(old.fn) != _qualname(spec.fn):
            raise ToolDefinitionError(
                f"duplicate tool name {spec.name!r}: defined by {_qualname(old.fn)} "
                f"and by {_qualname(spec.fn)}"
            )
        self._tools[spec.name] = spec
        return spec

    def get(self, name: str) -> ToolSpec:
        try:
            return self._tools[name]
        except KeyError:
            raise UnknownToolError(name, list(self._tools)) from None

    def names(self) -> list[str]:
        """Registered names, in registration order."""
        return list(self._tools)

    def check(self, names: Sequence[str]) -> list[str]:
        """The names that are not registered, in the given order."""
        return [n for n in names if n not in self._tools]

    def definitions(self, names: Sequence[str]) -> list[dict[str, Any]]:
        """Tool definitions for ``names``, in the given order."""
        missing = self.check(names)
        if missing:
            raise UnknownToolError(missing, list(self._tools))
        return [self._tools[n].definition() for n in names]

    def __contains__(self, name: object) -> bool:
        # A model's tool name is anyone's JSON: a list there raised TypeError (unhashable).
        return isinstance(name, str) and name in self._tools

    def __len__(self) -> int:
        return len(self._tools)

    def __iter__(self) -> Iterator[ToolSpec]:
        return iter(list(self._tools.values()))


default_registry = ToolRegistry()


# ------------------------------------------------------------------------------------ decorator


@overload
def tool(
    fn: F,
    *,
    kind: ToolKind | KindName,
    name: str | None = None,
    description: str | None = None,
    retryable: tuple[type[BaseException], ...] | type[BaseException] = (),
    compensate: str | None = None,
    on_error: OnError = "result",
    timeout: float | None = None,
    inline: bool = False,
    registry: ToolRegistry | None = None,
) -> F: ...


@overload
def tool(
    fn: None = None,
    *,
    kind: ToolKind | KindName,
    name: str | None = None,
    description: str | None = None,
    retryable: tuple[type[BaseException], ...] | type[BaseException] = (),
    compensate: str | None = None,
    on_error: OnError = "result",
    timeout: float | None = None,
    inline: bool = False,
    registry: ToolRegistry | None = None,
) -> Callable[[F], F]: ...


def tool(
    fn: F | None = None,
    *,
    kind: ToolKind | KindName,
    name: str | None = None,
    description: str | None = None,
    retryable: tuple[type[BaseException], ...] | type[BaseException] = (),
    compensate: str | None = None,
    on_error: OnError = "result",
    timeout: float | None = None,
    inline: bool = False,
    registry: ToolRegistry | None = None,
) -> F | Callable[[F], F]:
    """Declare a tool: ``@tool(kind="idempotent")``.

    The function is returned unchanged (still callable directly, e.g. in unit tests); its
    :class:`ToolSpec` is registered in ``registry`` (default: :data:`default_registry`) and
    reachable with :func:`tool_spec`. ``timeout`` (seconds) bounds each call; without it the
    worker's --tool-timeout applies. ``inline=True`` (a sync pure or idempotent tool that never
    blocks: a parse, a lookup in memory) calls it on the event loop instead of in a thread of its
    own; no timeout or lost lease can interrupt such a call, and while it runs the worker's other
    runs and its heartbeat wait (see docs/tools.md).
    """

    def decorate(f: F) -> F:
        spec = ToolSpec.from_function(
            f,
            kind=kind,
            name=name,
            description=description,
            retryable=retryable,
            compensate=compensate,
            on_error=on_error,
            timeout=timeout,
            inline=inline,
        )
        (registry if registry is not None else default_registry).register(spec)
        setattr(f, _SPEC_ATTR, spec)
        return f

    return decorate if fn is None else decorate(fn)


# -------------------------------------------------------------------------------------- loading


def _file_module_name(path: Path) -> str:
    stem = re.sub(r"\W", "_", path.stem) or "tools"
    digest = hashlib.sha256(str(path).encode("utf-8")).hexdigest()[:10]
    return f"agentrun_tools_{stem}_{digest}"


def _is_path(spec: str) -> bool:
    return spec.endswith(".py") or "/" in spec or "\\" in spec


def _import_one(spec: str) -> str:
    """Import one ``--tools`` entry; return its module name."""
    if not _is_path(spec):
        importlib.import_module(spec)
        return spec
    path = Path(spec).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    mod_name = _file_module_name(path)
    if mod_name in sys.modules:
        return mod_name
    mspec = importlib.util.spec_from_file_location(mod_name, path)
    if mspec is None or mspec.loader is None:
        raise ImportError(f"cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(mspec)
    sys.modules[mod_name] = module
    try:
        mspec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(mod_name, None)
        raise
    return mod_name


def load_tool_modules(specs: Sequence[str]) -> list[str]:
    """Import tool modules (dotted names or ``.py`` paths) so their ``@tool`` decorators register.

    Returns the names of the tools those modules registered in :data:`default_registry` (also
    when a module had been imported before), in registration order.
    """
    registry = default_registry
    before = set(registry.names())
    modules: set[str] = set()
    for spec in specs:
        try:
            modules.add(_import_one(spec))
        except Exception as exc:
            detail = " ".join(f"{type(exc).__name__}: {exc}".split())
            raise ToolLoadError(f"cannot load tool module {spec}: {detail}") from exc
    return [
        s.name
        for s in registry
        if s.name not in before or getattr(s.fn, "__module__", None) in modules
    ]
