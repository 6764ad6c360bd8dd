"""Tools with payloads PostgreSQL rewrites or cannot hold as is: output with a NUL and a lone
surrogate (issue 12, F7), input with numbers jsonb writes back otherwise."""

import os

from agentrun import ToolContext, tool

ODD = "a\x00b\ud800c"


@tool(kind="pure")
def odd(ctx: ToolContext, text: str) -> str:
    """Return text that holds a NUL and a lone surrogate; count each call."""
    with open(os.environ["ODD_TOOL_CALLS"], "a") as calls:
        calls.write(f"{ctx.run_id} {ctx.seq}\n")
    return ODD


@tool(kind="non_idempotent")
def charge(ctx: ToolContext, amount: float, offset: float, rate: float) -> str:
    """Charge an amount; record each call's idempotency key and the values it was given."""
    with open(os.environ["ODD_TOOL_CALLS"], "a") as calls:
        calls.write(f"{ctx.run_id} {ctx.seq} {ctx.idempotency_key} {amount!r} {offset!r} "
                    f"{rate!r}\n")
    return "charged"
