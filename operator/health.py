"""The operator's health port: ``/healthz`` (liveness) and ``/readyz`` (readiness).

* ``/healthz``: 200 while the operator's event loop answers (what kopf's liveness endpoint
  said; the loop is kopf's, so a wedged loop fails it). It does not look at the API server or
  the database: a restart cures neither an outage of the one nor of the other.
* ``/readyz``: 200 only while the operator's latest API-server check AND its latest database
  check succeeded, each within ``stale_after`` seconds. Found on a node: without it the pod was
  Ready while every API call failed ("Network is unreachable"), and ``helm test`` passed. The
  checks run in the operator (:meth:`agentrun.operator.app.OperatorApp._health_loop`): a
  ``list agentruns?limit=1`` with the operator's own credentials (reachability, authentication
  and the RBAC it needs most, in one cheap call) and a ``SELECT 1`` through its pool. The answer
  names what is wrong, in one line.

``python -m agentrun.operator.health URL [--wait S]`` is the chart's ``helm test`` of the
operator: it asks ``URL`` (the operator's ``/readyz``) until it says ready or ``--wait`` runs
out, and prints one line either way.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class Check:
    """The latest outcome of one periodic check (monotonic times)."""

    what: str
    ok_at: float | None = None
    error: str | None = "not checked yet"

    def ok(self, now: float | None = None) -> None:
        self.ok_at = time.monotonic() if now is None else now
        self.error = None

    def failed(self, error: str) -> None:
        self.error = " ".join(error.split()) or "failed"

    def problem(self, stale_after: float, now: float) -> str | None:
        """Why this check does not count as passing now (None: it does)."""
        if self.error is not None:
            return f"{self.what}: {self.error}"
        assert self.ok_at is not None
        age = now - self.ok_at
        if age > stale_after:
            return (f"{self.what}: no successful check for {age:.0f}s (more than "
                    f"{stale_after:.0f}s; the check itself is stuck)")
        return None


@dataclass
class Readiness:
    #: A check older than this no longer counts (a check that hangs must not keep us Ready).
    stale_after: float = 15.0
    api: Check = field(default_factory=lambda: Check("API server"))
    database: Check = field(default_factory=lambda: Check("database"))

    def report(self, now: float | None = None) -> tuple[bool, dict[str, Any]]:
        now = time.monotonic() if now is None else now
        problems = [p for c in (self.api, self.database)
                    if (p := c.problem(self.stale_after, now)) is not None]
        body: dict[str, Any] = {"ready": not problems}
        for key, c in (("api", self.api), ("database", self.database)):
            body[f"{key}_checked_s_ago"] = None if c.ok_at is None else round(now - c.ok_at, 3)
        if problems:
            body["reason"] = "; ".join(problems)
        return not problems, body


def make_app(readiness: Readiness) -> web.Application:
    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(_: web.Request) -> web.Response:
        ok, body = readiness.report()
        return web.json_response(body, status=200 if ok else 503)

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app


async def serve(readiness: Readiness, host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(make_app(readiness), handle_signals=False, shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


# -- the helm test --------------------------------------------------------------------------------


def ask(url: str, timeout: float) -> tuple[bool, str]:
    """One GET of ``url``: (ready, what it said, in one line)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return True, json.loads(resp.read() or b"{}").get("reason") or "ready"
    except urllib.error.HTTPError as exc:
        try:
            reason = json.loads(exc.read() or b"{}").get("reason")
        except ValueError:
            reason = None
        return False, reason or f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        why = getattr(exc, "reason", exc)
        return False, f"cannot reach {url}: {why}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m agentrun.operator.health",
        description="Exit 0 once the operator's /readyz says ready (the chart's helm test).",
    )
    p.add_argument("url", help="the operator's readiness URL, e.g. http://HOST:8080/readyz")
    p.add_argument("--wait", type=float, default=0.0,
                   help="keep asking for this many seconds before failing (default 0: once)")
    p.add_argument("--every", type=float, default=2.0, help="seconds between two asks")
    args = p.parse_args(argv)
    deadline = time.monotonic() + args.wait
    while True:
        ready, said = ask(args.url, timeout=5.0)
        if ready:
            print(f"operator ready ({args.url})")
            return 0
        if time.monotonic() >= deadline:
            waited = f" after {args.wait:g}s" if args.wait else ""
            print(f"operator not ready{waited}: {said}", file=sys.stderr)
            return 1
        time.sleep(args.every)


if __name__ == "__main__":
    sys.exit(main())
