"""Tools for the retry tests (loaded by path with --tools).

``book`` is a non-idempotent effect that records every invocation in the test's database, so a
test can tell that a retry did not call it again. ``deploy_check`` takes its worker down with
``os._exit`` while the worker runs with RETRY_TEST_BROKEN set (a bad deploy), and passes once a
worker without it (the fix) calls it.
"""

from __future__ import annotations

import os

import psycopg

from agentrun import ToolContext, tool


@tool(kind="non_idempotent")
def book(ctx: ToolContext, item: str) -> str:
    """Book an item (every invocation is counted)."""
    with psycopg.connect(os.environ["AGENTRUN_DATABASE_URL"], autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS retry_bookings (run_id text, key text, item text)")
        conn.execute(
            "INSERT INTO retry_bookings VALUES (%s, %s, %s)",
            (ctx.run_id, ctx.idempotency_key, item),
        )
    return f"booked {item}"


@tool(kind="pure")
def deploy_check(ctx: ToolContext) -> str:
    """Check the deploy: a broken one takes the worker down."""
    if os.environ.get("RETRY_TEST_BROKEN"):
        os._exit(7)
    return "deploy ok"
