"""A scripted Anthropic Messages API server for offline runs: the demo, the tests, users' agents.

It is a real HTTP server that the real ``anthropic`` SDK talks to (``base_url=...``), so a client
is exercised end to end: retries on 429/529/500, streaming, cancellation mid-stream, and, above
all, replay of signed thinking blocks after a resume. See ``docs/fake-anthropic.md``.

Public API::

    scenario = load_scenario("my_scenario.yaml")
    with FakeAnthropicServer(scenario) as srv:          # background thread
        client = anthropic.Anthropic(base_url=srv.base_url, api_key="x")
    async with FakeAnthropicServer(scenario) as srv:    # inside a running loop
        ...
    main(["--scenario", "my_scenario.yaml", "--port", "8765"])   # the CLI
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from agentrun.fake_anthropic.scenario import (
    Scenario,
    ScenarioError,
    builtin_scenario_path,
    load_scenario,
    parse_scenario,
    resolve_scenario,
)
from agentrun.fake_anthropic.server import FakeAnthropicServer

__all__ = [
    "FakeAnthropicServer",
    "Scenario",
    "ScenarioError",
    "builtin_scenario_path",
    "load_scenario",
    "main",
    "parse_scenario",
]

DEFAULT_PORT = 8765


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agentrun fake-anthropic",
        description="Serve a scripted Anthropic Messages API (see docs/fake-anthropic.md).",
    )
    parser.add_argument(
        "--scenario",
        required=True,
        metavar="FILE",
        help="scenario file (YAML or JSON), or the name of a built-in one (demo_migration)",
    )
    parser.add_argument("--port", type=_port, default=DEFAULT_PORT,
                        help="0-65535, 0: any free one (default: %(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="default: %(default)s")
    parser.add_argument("--verbose", action="store_true", help="log every request to stderr")
    return parser


async def _serve(scenario: Scenario, host: str, port: int) -> None:
    """Serve until SIGINT or SIGTERM, then shut down cleanly (in-flight streams are cut)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    server = FakeAnthropicServer(scenario, host=host, port=port)
    await server.start()
    try:
        print(
            f"fake-anthropic listening on {server.base_url} (scenario: {scenario.name})",
            flush=True,
        )
        await stop.wait()
    finally:
        await server.stop()


def _port(value: str) -> int:
    """A TCP port: out of range, bind() raised OverflowError past the OSError handled below."""
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port}: must be between 0 and 65535")
    return port


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit code (2 for a bad scenario file or bad arguments)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 2
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        scenario = resolve_scenario(args.scenario)
    except ScenarioError as err:
        print(f"fake-anthropic: {err}", file=sys.stderr)
        return err.exit_code
    try:
        asyncio.run(_serve(scenario, args.host, args.port))
    except OSError as err:
        print(f"fake-anthropic: cannot listen on {args.host}:{args.port}: {err}", file=sys.stderr)
        return 1
    return 0
