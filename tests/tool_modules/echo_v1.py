"""Tools for worker tests (loaded by path with --tools)."""

from agentrun import ToolContext, tool


@tool(kind="pure")
def echo(ctx: ToolContext, text: str) -> str:
    """Echo the text back in capitals."""
    return text.upper()


@tool(kind="pure")
def sleepy(ctx: ToolContext, seconds: float) -> str:
    """Sleep, then say so (a long tool call)."""
    import time

    time.sleep(seconds)
    return f"slept {seconds}s"
