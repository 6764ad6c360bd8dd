"""The tool the benchmarks' agents call. Worker processes load this file with ``--tools``, so echo
lives in the default registry as a user's tool would."""

from __future__ import annotations

from agentrun.tools import ToolContext, tool


@tool(kind="pure")
def echo(ctx: ToolContext, text: str) -> str:
    """Echo the text back."""
    return text
