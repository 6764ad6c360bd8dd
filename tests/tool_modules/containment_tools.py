"""Tools that misbehave the ways a worker must survive (loaded by path with --tools)."""

from __future__ import annotations

import asyncio
import os
import sys
import threading

from agentrun import ToolContext, tool


class Escape(BaseException):
    """Not an Exception: it would pass every ``except Exception``."""


@tool(kind="pure")
def quit_worker(ctx: ToolContext, how: str) -> str:
    """Try to stop the worker: sys_exit, keyboard_interrupt, base_exception or os_exit."""
    if how == "sys_exit":
        sys.exit(3)
    if how == "keyboard_interrupt":
        raise KeyboardInterrupt
    if how == "base_exception":
        raise Escape("escaped")
    if how == "os_exit":
        os._exit(7)
    return f"unknown way {how}"


@tool(kind="pure")
async def cancel_itself(ctx: ToolContext) -> str:
    """An async tool that raises CancelledError of its own (nobody cancelled it)."""
    raise asyncio.CancelledError


@tool(kind="pure")
def echo(ctx: ToolContext, text: str) -> str:
    """Echo the text back in capitals."""
    return text.upper()


@tool(kind="pure", timeout=0.5)
def hang(ctx: ToolContext) -> str:
    """Block for ever in a sync call (declares a 0.5 s timeout)."""
    threading.Event().wait()
    return "never"


@tool(kind="pure")
def hang_sync(ctx: ToolContext) -> str:
    """Block for ever in a sync call (the worker's --tool-timeout applies)."""
    threading.Event().wait()
    return "never"


@tool(kind="pure")
async def hang_in_executor(ctx: ToolContext) -> str:
    """Block for ever in the event loop's default executor (asyncio.to_thread)."""
    await asyncio.to_thread(threading.Event().wait)
    return "never"


@tool(kind="irreversible")
def hang_irreversible(ctx: ToolContext) -> str:
    """An irreversible call that never returns (the worker's --tool-timeout applies)."""
    threading.Event().wait()
    return "never"


@tool(kind="idempotent", compensate="unhold_by_exit")
def hold(ctx: ToolContext, item: str) -> str:
    """Hold an item; its compensation takes the worker down."""
    return f"held {item}"


@tool(kind="idempotent")
def unhold_by_exit(ctx: ToolContext, item: str) -> str:
    """The compensation of hold: it kills its worker (os._exit) instead of releasing."""
    os._exit(7)
