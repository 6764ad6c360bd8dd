"""A tool that blocks until the test opens its gate (loaded by path with --tools).

It holds a run at a known point for as long as the test needs, with no clock: the test waits
for ``PATH.entered`` (the call started), does what it checks, then creates ``PATH``."""

import os
import time

from agentrun import ToolContext, tool


@tool(kind="pure")
def gate(ctx: ToolContext, path: str) -> str:
    """Wait until the file at path exists."""
    with open(path + ".entered", "w") as f:
        f.write(f"{ctx.run_id} {ctx.seq}\n")
    deadline = time.monotonic() + 120  # a test that never opens it has failed already
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the gate {path} was never opened")
        time.sleep(0.02)
    return "the gate opened"
