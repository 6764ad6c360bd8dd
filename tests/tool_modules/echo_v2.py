"""The same tool, redeployed with a reworded description: a changed tool definition."""

from agentrun import ToolContext, tool


@tool(kind="pure")
def echo(ctx: ToolContext, text: str) -> str:
    """Return the given text in upper case (reworded in a later deploy)."""
    return text.upper()
