"""agentrun: durable execution for long-running LLM agents.

The shared core lives here (store, config, SQL, tool SDK); the worker and the operator are the
subpackages ``agentrun.worker`` and ``agentrun.operator``. Dependencies point one way:
operator -> core <- worker.
"""

__version__ = "0.1.0"

from agentrun.tools import ToolContext, ToolError, ToolKind, tool

__all__ = ["ToolContext", "ToolError", "ToolKind", "__version__", "tool"]
