"""The scenario file: what the fake Anthropic server answers, turn by turn.

A scenario is data, not code, so that users can script their own agent's conversation offline and
the demo can ship one as a package resource. Every model forbids extra fields: a typo in a YAML
key must name the key, not be silently ignored (a silently ignored ``faults`` typo would make a
retry test pass for the wrong reason).

Content blocks mirror the Messages API (``{type: text, text: ...}``) and also accept a shorthand
with the block type as the only key (``{text: ...}``, ``{thinking: ...}``,
``{tool_use: {name: ..., input: {...}}}``) because a 12-turn script is mostly content blocks.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from agentrun.errors import ConfigError
from agentrun.fake_anthropic.platforms import BedrockAuth, VertexAuth

DEFAULT_SECRET = "agentrun-fake-anthropic-default-secret"

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "pause_turn", "refusal"]

# The error ``type`` the real API uses for each status; any other 5xx is an ``api_error``.
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


def error_type_for(status: int) -> str:
    """The API error type for an HTTP status (``api_error`` for unlisted 5xx)."""
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


class ScenarioError(ConfigError):
    """A scenario file that cannot be used; the message names the file and the field. Exit 2."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TextBlock(_Strict):
    type: Literal["text"] = "text"
    text: str
    # The text holds JSON string escapes, decoded when the turn is sent: the way to script a lone
    # surrogate (\ud800), which no YAML or pydantic string can hold, or a NUL (\u0000).
    json_escapes: bool = False

    @property
    def sent_text(self) -> str:
        return str(json.loads(f'"{self.text}"')) if self.json_escapes else self.text


class ThinkingBlock(_Strict):
    """A thinking block; the server signs it per request (the signature is never scripted)."""

    type: Literal["thinking"] = "thinking"
    thinking: str


class ToolUseBlock(_Strict):
    """A tool call. ``id`` defaults to a deterministic ``toolu_...`` derived from the position."""

    type: Literal["tool_use"] = "tool_use"
    name: str = Field(min_length=1)
    input: dict[str, Any] = Field(default_factory=dict)
    id: str | None = None


ContentBlock = Annotated[TextBlock | ThinkingBlock | ToolUseBlock, Field(discriminator="type")]

_SHORTHAND_KEYS = ("text", "thinking", "tool_use")


def _expand_shorthand(value: Any) -> Any:
    """``{text: "hi"}`` -> ``{type: text, text: "hi"}``; ``{tool_use: {...}}`` -> flattened."""
    if not isinstance(value, dict) or "type" in value:
        return value
    present = [key for key in _SHORTHAND_KEYS if key in value]
    if len(present) != 1:
        return value  # let the discriminator report the missing ``type``
    kind = present[0]
    if kind == "tool_use":
        inner = value["tool_use"]
        if not isinstance(inner, dict):
            return value
        rest = {k: v for k, v in value.items() if k != "tool_use"}
        return {"type": "tool_use", **inner, **rest}
    return {"type": kind, **value}


StreamFault = Literal["error", "pings", "garbage", "truncated"]


class Fault(_Strict):
    """A failure answered instead of the real turn, ``times`` times in a row: an HTTP error
    (``status``), or a 200 stream that goes wrong after its first ``after_events`` events
    (``stream``): an ``event: error`` of ``type`` (``error``), pings and nothing else until the
    client gives up (``pings``), a line of garbage and a data line that is not JSON
    (``garbage``), or a data line cut off in the middle of its JSON, then the end of the
    response (``truncated``)."""

    status: int | None = Field(default=None, ge=400, le=599)
    stream: StreamFault | None = None
    times: int = Field(default=1, ge=1)
    retry_after: float | None = Field(default=None, gt=0)
    type: str | None = None  # defaults to the real API's type for the status / overloaded_error
    message: str | None = None
    after_events: int = Field(default=1, ge=0)  # stream faults: events of the real answer first
    interval_ms: int = Field(default=100, ge=1)  # pings: the wait between two pings

    @model_validator(mode="after")
    def _one_kind(self) -> Fault:
        if (self.status is None) == (self.stream is None):
            raise ValueError("a fault sets exactly one of `status` (an HTTP error) or `stream`")
        if self.stream is not None and self.retry_after is not None:
            raise ValueError("retry_after is for HTTP faults (`status`), not stream faults")
        return self

    @property
    def kind(self) -> str:
        """For the request log: ``http 429`` or ``stream error``."""
        return f"http {self.status}" if self.status is not None else f"stream {self.stream}"

    @property
    def error_type(self) -> str:
        if self.type:
            return self.type
        return error_type_for(self.status) if self.status is not None else "overloaded_error"

    @property
    def error_message(self) -> str:
        what = self.status if self.status is not None else "mid-stream"
        return self.message or f"fake-anthropic: injected {what} ({self.error_type})"


class Turn(_Strict):
    """One model answer: the turn index is the number of assistant messages in the request."""

    content: list[ContentBlock] = Field(min_length=1)
    stop_reason: StopReason | None = None
    faults: list[Fault] = Field(default_factory=list)
    delay_ms: int | None = Field(default=None, ge=0)
    stream_delay_ms: int | None = Field(default=None, ge=0)

    @field_validator("content", mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        if isinstance(value, list):
            return [_expand_shorthand(item) for item in value]
        return value

    @model_validator(mode="after")
    def _stop_reason_consistent(self) -> Turn:
        if self.stop_reason == "tool_use" and not self.has_tool_use:
            raise ValueError("stop_reason tool_use needs a tool_use block in content")
        return self

    @property
    def has_tool_use(self) -> bool:
        return any(isinstance(block, ToolUseBlock) for block in self.content)

    @property
    def effective_stop_reason(self) -> str:
        if self.stop_reason is not None:
            return self.stop_reason
        return "tool_use" if self.has_tool_use else "end_turn"


class Script(_Strict):
    """One conversation. ``match`` is a substring of the first user message; none = default."""

    name: str = Field(min_length=1)
    match: str | None = None
    turns: list[Turn] = Field(min_length=1)


class Scenario(_Strict):
    """The whole file: scripts plus server-wide defaults."""

    name: str = Field(min_length=1)
    description: str | None = None
    secret: str = DEFAULT_SECRET
    models: list[str] | None = None  # None: any model exists
    api_key: str | None = None  # None: any x-api-key is accepted
    bedrock: BedrockAuth | None = None  # None: any SigV4 signature scoped to bedrock
    vertex: VertexAuth | None = None  # None: any bearer token; the token endpoint grants any
    delay_ms: int = Field(default=0, ge=0)
    stream_delay_ms: int = Field(default=0, ge=0)
    record_bodies: bool = False  # keep each request's raw body in the request log (as `body`)
    record_messages: bool = False  # keep each request's messages in the request log
    scripts: list[Script] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_scripts(self) -> Scenario:
        names = [script.name for script in self.scripts]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"duplicate script name(s): {', '.join(duplicates)}")
        defaults = [script.name for script in self.scripts if script.match is None]
        if len(defaults) > 1:
            raise ValueError(
                f"more than one script without `match` (default): {', '.join(defaults)}"
            )
        return self

    def __repr__(self) -> str:  # never print the secret
        return f"Scenario(name={self.name!r}, scripts={[s.name for s in self.scripts]!r})"

    __str__ = __repr__

    def select_script(self, first_user_text: str) -> Script | None:
        """The first script whose ``match`` occurs in the text, else the default script."""
        for script in self.scripts:
            if script.match is not None and script.match in first_user_text:
                return script
        for script in self.scripts:
            if script.match is None:
                return script
        return None


def _format_validation_error(err: ValidationError) -> str:
    """One line: the first error's dotted field path and message (+ how many more).

    Unknown fields go first: a misspelt key also makes the real key "missing", and the typo is
    the thing to fix."""
    errors = sorted(err.errors(), key=lambda e: e["type"] != "extra_forbidden")
    first = errors[0]
    loc = ".".join(str(part) for part in first["loc"]) or "(top level)"
    line = f"{loc}: {first['msg']}"
    if len(errors) > 1:
        line += f" (and {len(errors) - 1} more error(s))"
    return line


def parse_scenario(data: Any, source: str = "<scenario>") -> Scenario:
    """Validate already-parsed data; errors become a one-line ScenarioError naming the field."""
    if not isinstance(data, dict):
        raise ScenarioError(f"{source}: expected a mapping at the top level")
    try:
        return Scenario.model_validate(data)
    except ValidationError as err:
        raise ScenarioError(f"{source}: {_format_validation_error(err)}") from None


def load_scenario(path: str | Path) -> Scenario:
    """Read a YAML or JSON scenario file (JSON is parsed as JSON, anything else as YAML)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ScenarioError(f"{path}: cannot read scenario file: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise ScenarioError(f"{path}: not UTF-8 text (byte {err.start})") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        detail = " ".join(str(err).split())
        kind = "JSON" if path.suffix == ".json" else "YAML"
        raise ScenarioError(f"{path}: not valid {kind}: {detail}") from None
    return parse_scenario(data, str(path))


def builtin_scenario_path(name: str) -> Path | None:
    """The path of a scenario shipped in ``agentrun/scenarios`` (e.g. ``demo_migration``)."""
    stem = name.removesuffix(".yaml")
    candidate = resources.files("agentrun").joinpath("scenarios", f"{stem}.yaml")
    if candidate.is_file():
        return Path(str(candidate))
    return None


def resolve_scenario(value: str | Path) -> Scenario:
    """Load a file path, falling back to a built-in scenario name when no such file exists."""
    path = Path(value)
    if not path.exists():
        builtin = builtin_scenario_path(str(value))
        if builtin is not None:
            return load_scenario(builtin)
    return load_scenario(path)
