"""agentrun: durable execution for long-running LLM agents.

The shared core lives here (store, config, SQL, tool SDK); the worker and the operator are the
subpackages ``agentrun.worker`` and ``agentrun.operator``. Dependencies point one way:
operator -> core <- worker.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from agentrun.tools import ToolContext, ToolError, ToolKind, tool

__all__ = ["ToolContext", "ToolError", "ToolKind", "__version__", "tool"]


def __getattr__(name: str) -> Any:
    # The tool SDK on first use, not at `import agentrun` (PEP 562): every `agentrun` command
    # imports this package first, and the SDK's pydantic took 160 ms of the window in which a
    # Ctrl-C could only end in a traceback (see agentrun.entrypoint).
    if name in __all__ and name != "__version__":
        from agentrun import tools

        return getattr(tools, name)
    raise AttributeError(f"module 'agentrun' has no attribute {name!r}")
