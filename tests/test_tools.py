"""The tool SDK: declaration checks, schemas, input validation, invocation, loading."""

from __future__ import annotations

import asyncio
import json
import logging
import textwrap
import threading
import uuid
from pathlib import Path
from typing import Annotated, Any

import pytest
from pydantic import BaseModel, Field

import agentrun
from agentrun import tools
from agentrun.tools import (
    MAX_TOOL_TIMEOUT,
    ToolContext,
    ToolDefinitionError,
    ToolError,
    ToolKind,
    ToolLoadError,
    ToolOutcome,
    ToolRegistry,
    ToolSpec,
    UnknownToolError,
    idempotency_key,
    load_tool_modules,
    make_context,
    run_logger,
    tool,
    tool_spec,
)


class Address(BaseModel):
    street: str
    city: str = "Paris"


class Receipt(BaseModel):
    id: int
    to: str


class Transient(Exception):
    pass


class Opaque:
    """Not describable as JSON schema."""


@pytest.fixture
def reg() -> ToolRegistry:
    return ToolRegistry()


@pytest.fixture
def fresh_default(monkeypatch: pytest.MonkeyPatch) -> ToolRegistry:
    """Swap the module-level default registry so loaded modules register into a clean one."""
    registry = ToolRegistry()
    monkeypatch.setattr(tools, "default_registry", registry)
    return registry


def ctx_for(name: str, args: dict[str, Any] | None = None) -> ToolContext:
    return make_context("run-1", 4, 0, name, args or {})


def spec_of(reg: ToolRegistry, fn: Any, kind: str = "pure", **kw: Any) -> ToolSpec:
    """Decorate ``fn`` into ``reg`` and return its spec."""
    tool(fn, kind=kind, registry=reg, **kw)  # type: ignore[call-overload]
    return tool_spec(fn)


# ------------------------------------------------------------------------------------ public API


def test_package_exports() -> None:
    assert agentrun.tool is tool
    assert agentrun.ToolContext is ToolContext
    assert agentrun.ToolError is ToolError
    assert agentrun.ToolKind is ToolKind
    assert "tool" in agentrun.__all__ and agentrun.__version__


def test_decorator_returns_function_and_registers(reg: ToolRegistry) -> None:
    @tool(kind="non_idempotent", registry=reg)
    def send_email(ctx: ToolContext, to: str, body: str) -> str:
        """Send an email.

        Second paragraph is not part of the description.
        """
        return f"sent to {to}"

    assert send_email(ctx_for("send_email"), "a@b.c", "hi") == "sent to a@b.c"
    spec = reg.get("send_email")
    assert spec is tool_spec(send_email)
    assert spec.kind is ToolKind.NON_IDEMPOTENT
    assert str(spec.kind) == "non_idempotent"
    assert spec.description == "Send an email."
    assert spec.on_error == "result" and spec.retryable == () and spec.compensate is None
    assert reg.names() == ["send_email"]


def test_name_and_description_overrides(reg: ToolRegistry) -> None:
    @tool(kind="pure", name="add-numbers", description="Add  two\n numbers.", registry=reg)
    def add(ctx: ToolContext, a: int, b: int) -> int:
        """Ignored."""
        return a + b

    assert reg.definitions(["add-numbers"])[0]["description"] == "Add two numbers."
    assert "add" not in reg


def test_default_registry_is_used(fresh_default: ToolRegistry) -> None:
    @tool(kind="pure")
    def echo_default(ctx: ToolContext, text: str) -> str:
        return text

    assert fresh_default.names() == ["echo_default"]


# --------------------------------------------------------------------------- declaration checks


def test_kind_is_validated(reg: ToolRegistry) -> None:
    def f(ctx: ToolContext) -> None: ...

    with pytest.raises(ValueError, match="pure, idempotent, non_idempotent, irreversible"):
        tool(f, kind="sideeffect", registry=reg)  # type: ignore[call-overload]
    assert reg.names() == []


def test_kind_accepts_enum(reg: ToolRegistry) -> None:
    def f(ctx: ToolContext) -> None: ...

    assert spec_of(reg, f, ToolKind.IRREVERSIBLE).kind is ToolKind.IRREVERSIBLE
    assert ToolKind.PURE.rerun_on_resume and not ToolKind.NON_IDEMPOTENT.rerun_on_resume


def test_first_parameter_must_be_toolcontext(reg: ToolRegistry) -> None:
    def no_ctx(to: str) -> None: ...

    def unannotated(ctx, to: str) -> None:  # type: ignore[no-untyped-def]
        ...

    def nothing() -> None: ...

    for fn in (no_ctx, unannotated, nothing):
        with pytest.raises(ToolDefinitionError, match=rf"{fn.__name__}.*ToolContext"):
            tool(fn, kind="pure", registry=reg)


def test_other_declaration_errors(reg: ToolRegistry) -> None:
    def varargs(ctx: ToolContext, *items: str) -> None: ...

    def ok(ctx: ToolContext) -> None: ...

    with pytest.raises(ToolDefinitionError, match="items"):
        tool(varargs, kind="pure", registry=reg)
    with pytest.raises(ToolDefinitionError, match="on_error"):
        tool(ok, kind="pure", on_error="ignore", registry=reg)  # type: ignore[call-overload]
    with pytest.raises(ToolDefinitionError, match="retryable"):
        tool(ok, kind="pure", retryable=("nope",), registry=reg)  # type: ignore[call-overload]
    with pytest.raises(ToolDefinitionError, match="name"):
        tool(ok, kind="pure", name="has space", registry=reg)
    with pytest.raises(ToolDefinitionError, match="compensate itself"):
        tool(ok, kind="idempotent", compensate="ok", registry=reg)
    with pytest.raises(ToolDefinitionError, match="pure"):
        tool(ok, kind="pure", compensate="undo", registry=reg)
    assert reg.names() == []


def test_compensate_and_single_retryable_type(reg: ToolRegistry) -> None:
    def charge(ctx: ToolContext, amount: int) -> None: ...

    spec = spec_of(reg, charge, "non_idempotent", compensate="refund", retryable=Transient)
    assert spec.compensate == "refund"
    assert spec.retryable == (Transient,)


def test_duplicate_name_from_another_function(reg: ToolRegistry) -> None:
    @tool(kind="pure", name="lookup", registry=reg)
    def lookup_one(ctx: ToolContext) -> None: ...

    def lookup_two(ctx: ToolContext) -> None: ...

    with pytest.raises(ToolDefinitionError) as info:
        tool(lookup_two, kind="pure", name="lookup", registry=reg)
    assert "lookup_one" in str(info.value) and "lookup_two" in str(info.value)
    # the same function again (a module imported twice) is not a conflict
    tool(lookup_one, kind="pure", name="lookup", registry=reg)
    assert reg.get("lookup").fn is lookup_one


# ---------------------------------------------------------------------------------------- schema


def _schema_tool(reg: ToolRegistry) -> ToolSpec:
    def book(
        ctx: ToolContext,
        title: Annotated[str, Field(description="Title of the booking")],
        nights: int,
        guests: int = 2,
        note: str | None = None,
        address: Address | None = None,
    ) -> str:
        """Book a room."""
        return "ok"

    return spec_of(reg, book, "idempotent")


def test_schema_shape(reg: ToolRegistry) -> None:
    d = _schema_tool(reg).definition()
    assert set(d) == {"name", "description", "input_schema"}
    assert d["name"] == "book" and d["description"] == "Book a room."
    s = d["input_schema"]
    assert s["type"] == "object"
    assert s["required"] == ["title", "nights"]
    assert s["additionalProperties"] is False
    props = s["properties"]
    assert list(props) == ["title", "nights", "guests", "note", "address"]
    # a parameter called "title" survives the title stripping
    assert props["title"] == {"type": "string", "description": "Title of the booking"}
    assert props["nights"] == {"type": "integer"}
    assert props["guests"] == {"type": "integer", "default": 2}
    assert props["note"]["default"] is None
    assert props["address"]["anyOf"][0] == {"$ref": "#/$defs/Address"}
    assert s["$defs"]["Address"]["required"] == ["street"]

    def titles(node: Any, key: str = "") -> list[str]:
        if isinstance(node, dict):
            found = [key] if key != "properties" and "title" in node else []
            return found + [t for k, v in node.items() for t in titles(v, k)]
        if isinstance(node, list):
            return [t for v in node for t in titles(v)]
        return []

    assert titles(s) == []


def test_schema_is_deterministic_and_copied(reg: ToolRegistry) -> None:
    first = _schema_tool(reg).definition()
    first["input_schema"]["properties"].clear()  # callers cannot corrupt the cached definition
    a = json.dumps(_schema_tool(ToolRegistry()).definition(), sort_keys=True)
    b = json.dumps(_schema_tool(ToolRegistry()).definition(), sort_keys=True)
    assert a == b
    assert json.dumps(reg.get("book").definition(), sort_keys=True) == a


def test_schema_without_parameters(reg: ToolRegistry) -> None:
    def ping(ctx: ToolContext) -> str:
        return "pong"

    s = spec_of(reg, ping).definition()["input_schema"]
    assert s == {"type": "object", "properties": {}, "additionalProperties": False}
    assert spec_of(reg, ping).description == ""


def test_unsupported_parameter_type_fails_at_decoration(reg: ToolRegistry) -> None:
    def bad(ctx: ToolContext, thing: Opaque) -> None: ...

    with pytest.raises(ToolDefinitionError, match=r"bad.*input schema"):
        tool(bad, kind="pure", registry=reg)


# ------------------------------------------------------------------------------------ validation


async def _email_spec(reg: ToolRegistry) -> ToolSpec:
    def send_email(ctx: ToolContext, to: str, count: int = 1) -> str:
        return f"{to}x{count}"

    return spec_of(reg, send_email, "non_idempotent")


async def test_missing_field(reg: ToolRegistry) -> None:
    out = await (await _email_spec(reg)).invoke(ctx_for("send_email"), {})
    assert out == ToolOutcome("invalid input for tool send_email: to: Field required", True)


async def test_wrong_type_and_extra_field(reg: ToolRegistry) -> None:
    spec = await _email_spec(reg)
    out = await spec.invoke(ctx_for("send_email"), {"to": "a", "count": "many", "cc": "b"})
    assert out.is_error and out.value is None
    assert out.content.startswith("invalid input for tool send_email: ")
    assert "count: Input should be a valid integer" in out.content
    assert "cc: Extra inputs are not permitted" in out.content


async def test_nested_and_non_object_input(reg: ToolRegistry) -> None:
    def ship(ctx: ToolContext, address: Address) -> str:
        return f"{address.street}, {address.city}"  # receives the model, not a dict

    spec = spec_of(reg, ship, "idempotent")
    ctx = ctx_for("ship")
    assert (await spec.invoke(ctx, {"address": {"street": "1 Rue"}})).content == "1 Rue, Paris"
    bad = await spec.invoke(ctx, {"address": {}})
    assert bad.is_error and "address.street: Field required" in bad.content
    not_obj = await spec.invoke(ctx, ["x"])
    assert not_obj.is_error and "expected a JSON object" in not_obj.content


async def test_lax_coercion_is_applied(reg: ToolRegistry) -> None:
    out = await (await _email_spec(reg)).invoke(ctx_for("send_email"), {"to": "a", "count": "3"})
    assert out == ToolOutcome("ax3", False, "ax3")


# ------------------------------------------------------------------------------------ invocation


async def test_sync_tool_runs_in_a_thread(reg: ToolRegistry) -> None:
    seen: list[Any] = []

    def where(ctx: ToolContext) -> str:
        seen.append((threading.get_ident(), ctx))
        return "done"

    ctx = ctx_for("where")
    out = await spec_of(reg, where).invoke(ctx, {})
    assert out == ToolOutcome("done", False, "done")
    assert seen[0][0] != threading.get_ident()
    assert seen[0][1] is ctx


async def test_async_tool(reg: ToolRegistry) -> None:
    async def fetch(ctx: ToolContext, key: str) -> dict[str, Any]:
        await asyncio.sleep(0)
        return {"key": key, "seq": ctx.seq, "idem": ctx.idempotency_key}

    spec = spec_of(reg, fetch, "idempotent")
    assert spec.is_async
    ctx = ctx_for("fetch", {"key": "k"})
    out = await spec.invoke(ctx, {"key": "k"})
    assert out.value == {"key": "k", "seq": 4, "idem": ctx.idempotency_key}
    assert out.content == json.dumps(out.value, sort_keys=True, separators=(",", ":"))


@pytest.mark.parametrize(
    ("value", "content"),
    [
        ("plain text", "plain text"),
        ("", ""),
        ({"b": 1, "a": [1, 2]}, '{"a":[1,2],"b":1}'),
        ([1, "x"], '[1,"x"]'),
        (42, "42"),
        (1.5, "1.5"),
        (True, "true"),
        (None, "null"),
        (Receipt(id=7, to="a"), '{"id":7,"to":"a"}'),
        ({"r": Receipt(id=1, to="b")}, '{"r":{"id":1,"to":"b"}}'),
        ({"p": Path("/x")}, '{"p":"/x"}'),
    ],
)
async def test_return_value_conversion(reg: ToolRegistry, value: Any, content: str) -> None:
    def give(ctx: ToolContext) -> Any:
        return value

    out = await spec_of(reg, give).invoke(ctx_for("give"), {})
    assert out.content == content and not out.is_error
    assert json.loads(content) == out.value if not isinstance(value, str) else out.value == value


CYCLE: dict[str, Any] = {"id": 1}
CYCLE["self"] = CYCLE


@pytest.mark.parametrize(
    ("value", "content"),
    [(b"RCPT\xff\x01 ok", "b'RCPT\\xff\\x01 ok'"), (CYCLE, "{'id': 1, 'self': {...}}")],
    ids=["bytes-not-utf-8", "a-cycle"],
)
async def test_a_value_json_cannot_take_is_returned_as_its_repr_never_as_a_failure(
    reg: ToolRegistry, value: Any, content: str
) -> None:
    """The call returned, so its effect happened: bytes that are not UTF-8 or a cycle used to
    raise here, after the call, and were taken for the tool's failure (the model told the call
    failed, a retryable tool called again; found by an adversarial review on 2026-12-06)."""
    def give(ctx: ToolContext) -> Any:
        return value

    out = await spec_of(reg, give).invoke(ctx_for("give"), {})
    assert (out.content, out.is_error, out.value) == (content, False, content)


async def test_exceptions_propagate_but_toolerror_is_a_result(reg: ToolRegistry) -> None:
    def explode(ctx: ToolContext) -> None:
        raise Transient("socket reset")

    async def refuse(ctx: ToolContext, customer: str) -> None:
        raise ToolError(f"no customer {customer}")

    with pytest.raises(Transient):
        await spec_of(reg, explode, retryable=(Transient,)).invoke(ctx_for("explode"), {})
    spec = spec_of(reg, refuse, "idempotent", on_error="abort")
    out = await spec.invoke(ctx_for("refuse"), {"customer": "c9"})
    assert out == ToolOutcome("no customer c9", True, None)


# -------------------------------------------------------------------------------------- classify


def test_classify_rules(reg: ToolRegistry) -> None:
    def t(ctx: ToolContext) -> None: ...

    def mk(kind: str, **kw: Any) -> ToolSpec:
        return ToolSpec.from_function(t, kind=kind, **kw)  # type: ignore[arg-type]

    boom, transient, refused = ValueError("x"), Transient("y"), ToolError("z")

    idem = mk("idempotent", retryable=(Transient,))
    assert idem.classify(transient) == "retry"
    assert idem.classify(boom) == "result"
    assert idem.classify(refused) == "result"

    aborting = mk("non_idempotent", retryable=(Transient,), on_error="abort")
    assert aborting.classify(transient) == "retry"
    assert aborting.classify(boom) == "abort"
    assert aborting.classify(refused) == "result"

    # irreversible: never retried, even for a declared transient error
    irr = mk("irreversible", retryable=(Transient,))
    assert irr.classify(transient) == "result"
    assert irr.classify(boom) == "result"
    irr_abort = mk("irreversible", retryable=(Transient,), on_error="abort")
    assert irr_abort.classify(transient) == "abort"
    assert irr_abort.classify(boom) == "abort"

    # subclasses of a retryable type are retryable; nothing is retryable by default
    assert idem.classify(type("Sub", (Transient,), {})()) == "retry"
    assert mk("pure").classify(transient) == "result"
    assert mk("pure").classify(asyncio.CancelledError()) == "abort"


# ------------------------------------------------------------------------------- context and keys


def test_idempotency_key_is_positional_and_stable() -> None:
    args = {"to": "a@b.c", "body": "héllo"}
    k = idempotency_key("run-1", 3, "send_email", args, 0)
    assert len(k) == 64 and int(k, 16) >= 0
    # same position, same args (in any key order) -> same key on every attempt
    assert k == idempotency_key("run-1", 3, "send_email", {"body": "héllo", "to": "a@b.c"}, 0)
    # the second identical call in the same turn differs
    assert k != idempotency_key("run-1", 3, "send_email", args, 1)
    assert k != idempotency_key("run-1", 4, "send_email", args, 0)
    assert k != idempotency_key("run-2", 3, "send_email", args, 0)
    assert k != idempotency_key("run-1", 3, "send_email", {**args, "to": "x"}, 0)
    import hashlib

    canonical = '{"body":"héllo","to":"a@b.c"}'
    expected = hashlib.sha256(f"run-1:3:0:send_email:{canonical}".encode()).hexdigest()
    assert k == expected


def test_context(caplog: pytest.LogCaptureFixture) -> None:
    args = {"q": 1}
    a = make_context("run-9", 2, 1, "search", args, attempt=1)
    b = make_context("run-9", 2, 1, "search", args, attempt=3)
    assert a.idempotency_key == b.idempotency_key == idempotency_key("run-9", 2, "search", args, 1)
    assert (b.run_id, b.seq, b.call_index, b.tool_name, b.attempt) == ("run-9", 2, 1, "search", 3)
    with pytest.raises(AttributeError):
        a.seq = 5  # type: ignore[misc]
    assert isinstance(a.logger, logging.LoggerAdapter)
    with caplog.at_level(logging.INFO, logger="agentrun.tools"):
        a.logger.info("hello")
    rec = caplog.records[-1]
    assert rec.getMessage() == "hello"
    assert rec.run_id == "run-9" and rec.tool == "search"  # type: ignore[attr-defined]
    assert run_logger("r").extra == {"run_id": "r"}


# -------------------------------------------------------------------------------------- registry


def test_registry_definitions_order_and_unknown(reg: ToolRegistry) -> None:
    for name in ("alpha", "beta", "gamma"):

        def noop(ctx: ToolContext) -> None: ...

        tool(noop, kind="pure", name=name, registry=reg)
    assert [d["name"] for d in reg.definitions(["gamma", "alpha"])] == ["gamma", "alpha"]
    assert reg.definitions([]) == []
    assert reg.check(["alpha", "nope", "zeta"]) == ["nope", "zeta"]
    with pytest.raises(UnknownToolError) as info:
        reg.definitions(["alpha", "nope"])
    assert "nope" in str(info.value) and "alpha, beta, gamma" in str(info.value)
    with pytest.raises(KeyError, match="unknown tool missing"):
        reg.get("missing")
    assert "no tools are registered" in str(UnknownToolError("x", []))
    assert len(reg) == 3 and [s.name for s in reg] == ["alpha", "beta", "gamma"]


# ---------------------------------------------------------------------------------------- loading

TOOL_SOURCE = """
from agentrun import tool, ToolContext

@tool(kind="pure")
def {name}_a(ctx: ToolContext, x: int) -> int:
    \"\"\"Double it.\"\"\"
    return 2 * x

@tool(kind="idempotent")
async def {name}_b(ctx: ToolContext) -> str:
    return "b"
"""


def test_load_from_file_path(tmp_path: Path, fresh_default: ToolRegistry) -> None:
    path = tmp_path / "my-tools.py"
    path.write_text(TOOL_SOURCE.format(name="file"))
    assert load_tool_modules([str(path)]) == ["file_a", "file_b"]
    assert fresh_default.get("file_a").description == "Double it."
    module = fresh_default.get("file_a").fn.__module__
    assert module.startswith("agentrun_tools_my_tools_")
    # loading again is a no-op that still reports the module's tools (stable module name)
    assert load_tool_modules([str(path)]) == ["file_a", "file_b"]
    assert fresh_default.get("file_a").fn.__module__ == module


def test_load_from_dotted_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_default: ToolRegistry
) -> None:
    pkg = f"agentrun_test_pkg_{uuid.uuid4().hex[:8]}"
    (tmp_path / pkg).mkdir()
    (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / pkg / "tools.py").write_text(TOOL_SOURCE.format(name="dotted"))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_tool_modules([f"{pkg}.tools"]) == ["dotted_a", "dotted_b"]
    assert fresh_default.names() == ["dotted_a", "dotted_b"]


async def test_loaded_tool_invokes(tmp_path: Path, fresh_default: ToolRegistry) -> None:
    path = tmp_path / "inv.py"
    path.write_text(TOOL_SOURCE.format(name="inv"))
    load_tool_modules([str(path)])
    out = await fresh_default.get("inv_a").invoke(ctx_for("inv_a"), {"x": 21})
    assert out.content == "42"


def test_load_errors(tmp_path: Path, fresh_default: ToolRegistry) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('no API key\\nset FOO')\n")
    with pytest.raises(ToolLoadError) as info:
        load_tool_modules([str(broken)])
    msg = str(info.value)
    assert "\n" not in msg
    assert str(broken) in msg and "RuntimeError: no API key set FOO" in msg

    with pytest.raises(ToolLoadError, match=r"no_such_module_xyz.*ModuleNotFoundError"):
        load_tool_modules(["no_such_module_xyz.tools"])
    with pytest.raises(ToolLoadError, match=r"missing\.py.*FileNotFoundError"):
        load_tool_modules([str(tmp_path / "missing.py")])

    syntax = tmp_path / "syntax.py"
    syntax.write_text("def (:\n")
    with pytest.raises(ToolLoadError, match="SyntaxError"):
        load_tool_modules([str(syntax)])

    bad_decl = tmp_path / "bad_decl.py"
    bad_decl.write_text(
        textwrap.dedent(
            """
            from agentrun import tool

            @tool(kind="sometimes")
            def f(ctx): ...
            """
        )
    )
    with pytest.raises(ToolLoadError, match=r"bad_decl.*kind='sometimes'"):
        load_tool_modules([str(bad_decl)])
    assert fresh_default.names() == []


# --------------------------------------------------------------------------- containment, fence


class _Fence:
    def __init__(self) -> None:
        self.lost: str | None = None

    def lease_lost(self) -> str | None:
        return self.lost


def test_the_fence_turns_invalid_once_the_lease_is_lost() -> None:
    fence = _Fence()
    ctx = make_context("run-1", 4, 0, "wire", {}, fence=fence)
    assert ctx.lease_valid()
    ctx.check_lease()
    fence.lost = "lease expired 1.0 s ago by this worker's clock"
    assert not ctx.lease_valid()
    with pytest.raises(tools.LeaseExpired, match=r"run run-1: lease expired 1\.0 s .* wire must"):
        ctx.check_lease()
    assert make_context("run-1", 4, 0, "wire", {}).lease_valid()  # no fence: always valid


@pytest.mark.parametrize(
    ("raised", "text"),
    [
        (SystemExit(3), "tool quit raised SystemExit: 3"),
        (KeyboardInterrupt(), "tool quit raised KeyboardInterrupt"),
        (type("Escape", (BaseException,), {})("out"), "tool quit raised Escape: out"),
    ],
)
async def test_a_base_exception_from_a_tool_is_contained(
    reg: ToolRegistry, raised: BaseException, text: str
) -> None:
    def quit(ctx: ToolContext) -> str:
        raise raised

    spec = spec_of(reg, quit)
    with pytest.raises(tools.ToolCrashed) as err:
        await spec.invoke(ctx_for("quit"), {})
    assert str(err.value).startswith(text) and err.value.original is raised
    assert spec.classify(err.value) == "result"  # reported to the model, like any failure


async def test_our_own_cancellation_still_cancels_an_async_tool(reg: ToolRegistry) -> None:
    started = asyncio.Event()

    async def wait(ctx: ToolContext) -> str:
        started.set()
        await asyncio.sleep(3600)
        return "never"

    spec = spec_of(reg, wait)
    call = asyncio.ensure_future(spec.invoke(ctx_for("wait"), {}))
    await started.wait()
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call


async def test_a_sync_tool_runs_in_a_daemon_thread(reg: ToolRegistry) -> None:
    def where(ctx: ToolContext) -> str:
        t = threading.current_thread()
        return f"{t.name} daemon={t.daemon}"

    out = await spec_of(reg, where).invoke(ctx_for("where"), {})
    assert out.content == "tool-where-run-1 daemon=True"


# 1e12: an unknown outcome's wait, the old lease's end plus the timeout, overflowed the calendar.
@pytest.mark.parametrize("bad", [0, -1, float("inf"), 1e12, MAX_TOOL_TIMEOUT + 1, "5", True])
def test_a_timeout_must_be_a_positive_number(reg: ToolRegistry, bad: Any) -> None:
    def slow(ctx: ToolContext) -> str:
        return ""

    with pytest.raises(ToolDefinitionError, match="timeout must be a positive number of seconds"):
        spec_of(reg, slow, timeout=bad)
    assert spec_of(reg, slow, timeout=2).timeout == 2.0
    assert spec_of(reg, slow, timeout=MAX_TOOL_TIMEOUT).timeout == MAX_TOOL_TIMEOUT


# -------------------------------------------------------------------------------------- inline


async def test_an_inline_tool_runs_on_the_loops_thread_and_a_plain_one_does_not(
    reg: ToolRegistry,
) -> None:
    seen: dict[str, int] = {}

    def here(ctx: ToolContext) -> str:
        seen["inline"] = threading.get_ident()
        return "here"

    def there(ctx: ToolContext) -> str:
        seen["thread"] = threading.get_ident()
        return "there"

    inline, plain = spec_of(reg, here, inline=True), spec_of(reg, there)
    assert inline.inline and not plain.inline
    assert (await inline.invoke(ctx_for("here"), {})).content == "here"
    assert (await plain.invoke(ctx_for("there"), {})).content == "there"
    loop_thread = threading.get_ident()  # the thread this test's event loop runs on
    assert seen["inline"] == loop_thread
    assert seen["thread"] != loop_thread


async def test_an_inline_tool_fails_as_a_threaded_one_does(reg: ToolRegistry) -> None:
    def picky(ctx: ToolContext, n: int) -> str:
        if n < 0:
            raise ToolError("n must not be negative")
        if n == 0:
            raise SystemExit(3)
        return str(n)

    spec = spec_of(reg, picky, inline=True)
    assert (await spec.invoke(ctx_for("picky"), {"n": "x"})).is_error  # validated first
    assert await spec.invoke(ctx_for("picky"), {"n": -1}) == ToolOutcome(
        "n must not be negative", is_error=True)
    with pytest.raises(tools.ToolCrashed):  # contained, never the end of the worker
        await spec.invoke(ctx_for("picky"), {"n": 0})
    assert (await spec.invoke(ctx_for("picky"), {"n": 2})).content == "2"


def test_inline_is_refused_where_it_cannot_help(reg: ToolRegistry) -> None:
    async def fetch(ctx: ToolContext) -> str:
        return ""

    def send(ctx: ToolContext) -> str:
        return ""

    with pytest.raises(ToolDefinitionError, match="inline=True is for sync tools"):
        spec_of(reg, fetch, inline=True)
    for kind in ("non_idempotent", "irreversible"):
        with pytest.raises(ToolDefinitionError, match="pure and idempotent tools"):
            spec_of(reg, send, kind=kind, inline=True)
    with pytest.raises(ToolDefinitionError, match="without a compensation"):
        spec_of(reg, send, kind="idempotent", compensate="unsend", inline=True)
    assert spec_of(reg, send, kind="idempotent", inline=True).inline
