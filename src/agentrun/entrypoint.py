"""The ``agentrun`` console script and ``python -m agentrun``.

Importing the CLI (psycopg, pydantic, asyncio, the store) takes a few hundred milliseconds, and
the CLI can only turn a Ctrl-C into exit 130 once it is imported. A Ctrl-C in that window printed
a KeyboardInterrupt traceback. This module imports nothing heavy itself (the package's own
``__init__`` is lazy), so the window left is the interpreter's own start.
"""

from __future__ import annotations

from agentrun.errors import EXIT_INTERRUPTED


def main() -> int:
    try:
        from agentrun.cli import main as cli_main

        return cli_main()
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
