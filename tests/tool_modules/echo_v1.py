"""Tools for worker tests (loaded by path with --tools)."""

from agentrun import ToolContext, tool


@tool(kind="pure")
def echo(ctx: ToolContext, text: str) -> str:
    """Echo the text back in capitals."""
    return text.upper()
