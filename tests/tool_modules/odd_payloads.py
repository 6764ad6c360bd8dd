"""A tool whose output PostgreSQL cannot hold as is: a NUL and a lone surrogate (issue 12, F7)."""

import os

from agentrun import ToolContext, tool

ODD = "a\x00b\ud800c"


@tool(kind="pure")
def odd(ctx: ToolContext, text: str) -> str:
    """Return text that holds a NUL and a lone surrogate; count each call."""
    with open(os.environ["ODD_TOOL_CALLS"], "a") as calls:
        calls.write(f"{ctx.run_id} {ctx.seq}\n")
    return ODD
