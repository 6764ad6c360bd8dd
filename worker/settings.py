"""The worker's settings: one route for each, as the operator's (agentrun.operator.settings).

:meth:`WorkerSettings.from_env` owns every default and reads every ``AGENTRUN_*`` variable of
the worker; ``agentrun worker``'s flags only override what it read (a flag not given leaves the
variable's value, or the default). :func:`check_settings` refuses a value the worker cannot work
with, naming the flag and its variable. Light to import: the CLI reads these for every command
(a malformed variable is a one-line error whatever the command), without the model SDK.
"""

from __future__ import annotations

import math
import os
import random
import socket
import uuid
from dataclasses import dataclass, field

from agentrun.config import (
    CONTROL_PORT_ENV,
    DEFAULT_CONTROL_PORT,
    DEFAULT_DRAIN_GRACE,
    DEFAULT_MODEL_DEADLINE,
    DRAIN_GRACE_ENV,
    env_float,
    env_int,
)
from agentrun.errors import ConfigError
from agentrun.logs import POD_NAME_ENV
from agentrun.manifests import pool_problem
from agentrun.pricing import BUILT_IN, PriceTable, load_prices
from agentrun.store import DEFAULT_LEASE_TTL
from agentrun.tools import DEFAULT_TOOL_TIMEOUT, MAX_TOOL_TIMEOUT
from agentrun.worker.liveness import DEFAULT_PROGRESS_BUDGET

MAX_RETRY_AFTER = 300.0  # a provider's retry-after is honoured up to this many seconds
#: The longest lease a worker may take (a day; values.schema.json's leaseTtlSeconds maximum).
MAX_LEASE_TTL = 86_400
MAX_CONCURRENCY = 10_000  # runs one worker holds at once
MAX_WORKER_ID = 253  # a pod name's bound: the chart's default id is the pod's name


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = 8
    base_delay: float = 0.5
    max_delay: float = 30.0
    # One call, from the request to the assembled message; each retry gets a new one.
    deadline: float = DEFAULT_MODEL_DEADLINE

    def delay(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return min(retry_after, MAX_RETRY_AFTER) + random.uniform(
                0, 0.1 * max(min(retry_after, MAX_RETRY_AFTER), 0.1))
        return random.uniform(0, min(self.max_delay, self.base_delay * 2**attempt))

    def bound(self) -> float:
        """The longest one :func:`call_model` can take, retries and backoffs included: every
        try ends by its deadline, so the liveness clock (worker/liveness.py) can count the whole
        call as progress up to here and no further."""
        backoff = max(self.max_delay, MAX_RETRY_AFTER * 1.1)
        return (self.max_retries + 1) * self.deadline + self.max_retries * backoff


def default_worker_id() -> str:
    """``<pod name>-<pid>-<random>``: the operator finds a pod's runs by this prefix to spare busy
    pods at a scale-down (operator/autoscaler.py). The pod's name from the chart's ``POD_NAME``,
    not its hostname, which the kubelet cuts to 63 characters (the same for every pod of a long
    Deployment name); the hostname outside Kubernetes."""
    host = os.environ.get(POD_NAME_ENV) or socket.gethostname()
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


def env_name(flag: str) -> str:
    """The variable of an ``agentrun worker`` flag: --lease-ttl is AGENTRUN_LEASE_TTL."""
    return "AGENTRUN_" + flag.removeprefix("--").replace("-", "_").upper()


#: The first-party API's HTTP transports (AGENTRUN_MODEL_TRANSPORT; worker/client.py): the SDK's
#: aiohttp one, the default, or the SDK's own default, httpx.
MODEL_TRANSPORTS = ("aiohttp", "httpx")
DEFAULT_MODEL_TRANSPORT = MODEL_TRANSPORTS[0]

#: The health port's default (AGENTRUN_HEALTH_PORT, --health-port).
DEFAULT_HEALTH_PORT = 8080


def port_or_off(value: int) -> int | None:
    return None if value < 0 else value  # -1: off


@dataclass
class WorkerSettings:
    pool: str = "default"
    concurrency: int = 4
    # --tools MODULE ... / AGENTRUN_TOOLS (comma-separated): the modules (or .py files) whose
    # @tool functions this worker can run. Given flags replace the variable's list.
    tools: tuple[str, ...] = ()
    lease_ttl: float = DEFAULT_LEASE_TTL
    # The claim loop sleeps until a NOTIFY (a new run, a finished one), the next foreign lease
    # expiry (the claim returns it), or at most this long while LISTEN is in place...
    idle_interval: float = 60.0
    # ...and at most this long while it is not (the listener is reconnecting: no NOTIFY comes).
    poll_interval: float = 5.0
    drain_grace: float = DEFAULT_DRAIN_GRACE  # under Kubernetes' default grace period of 30 s
    liveness_threshold: float = 60.0
    progress_budget: float = DEFAULT_PROGRESS_BUDGET  # see worker/liveness.py
    tool_timeout: float = DEFAULT_TOOL_TIMEOUT  # for tools that declare no timeout of their own
    health_host: str = "0.0.0.0"
    health_port: int | None = DEFAULT_HEALTH_PORT  # None: no health server; 0: any free port
    # Loopback only, whatever the health host: /drain stops the worker.
    # None (in-process workers, tests): no control listener; `agentrun worker` (from_env) has
    # DEFAULT_CONTROL_PORT. 0: any free port.
    control_port: int | None = None
    worker_id: str = field(default_factory=default_worker_id)
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    prices: PriceTable = BUILT_IN  # --prices FILE (agentrun.pricing.load_prices)
    model_transport: str = DEFAULT_MODEL_TRANSPORT  # AGENTRUN_MODEL_TRANSPORT

    @classmethod
    def from_env(cls, *, prices: bool = True) -> WorkerSettings:
        """The settings ``agentrun worker`` starts from: each ``AGENTRUN_*`` variable that is
        set, else its default. ``prices=False``: the price file is not read (the CLI checks the
        variables for every command; only the worker needs the table)."""
        d = cls(worker_id="")
        retry = RetryPolicy()
        prices_file = os.environ.get(env_name("--prices"), "")
        return cls(
            pool=os.environ.get(env_name("--pool"), d.pool),
            concurrency=env_int(env_name("--concurrency"), d.concurrency),
            tools=tuple(x for x in os.environ.get(env_name("--tools"), "").split(",") if x),
            lease_ttl=env_float(env_name("--lease-ttl"), d.lease_ttl),
            poll_interval=env_float(env_name("--poll-interval"), d.poll_interval),
            idle_interval=env_float(env_name("--idle-interval"), d.idle_interval),
            drain_grace=env_float(DRAIN_GRACE_ENV, d.drain_grace),
            liveness_threshold=env_float(env_name("--liveness-threshold"),
                                         d.liveness_threshold),
            progress_budget=env_float(env_name("--progress-budget"), d.progress_budget),
            tool_timeout=env_float(env_name("--tool-timeout"), d.tool_timeout),
            health_port=port_or_off(env_int(env_name("--health-port"), DEFAULT_HEALTH_PORT)),
            control_port=port_or_off(env_int(CONTROL_PORT_ENV, DEFAULT_CONTROL_PORT)),
            worker_id=os.environ.get(env_name("--worker-id")) or default_worker_id(),
            retry=RetryPolicy(
                max_retries=env_int(env_name("--model-retries"), retry.max_retries),
                deadline=env_float(env_name("--model-deadline"), retry.deadline),
            ),
            prices=load_prices(prices_file) if prices else d.prices,
            model_transport=os.environ.get(env_name("--model-transport")) or d.model_transport,
        )


def check_settings(s: WorkerSettings) -> None:
    """Refuse settings a worker cannot work with, naming the flag, its variable and the fix.

    Each of these used to start a worker that did harm or nothing: a negative lease TTL
    dead-lettered every run it claimed (each claim expired at once and was claimed again),
    concurrency 0 never claimed, a negative one failed deep in the connection pool."""
    def bad(flag: str, value: object, fix: str) -> ConfigError:
        return ConfigError(f"{flag} {value} ({env_name(flag)}): {fix}")

    finite = math.isfinite
    if (problem := pool_problem(s.pool)) is not None:
        shown = repr(s.pool) if len(s.pool) <= 80 else f"{s.pool[:40]!r}... ({len(s.pool)} chars)"
        raise bad("--pool", shown, problem)
    if not 1 <= s.concurrency <= MAX_CONCURRENCY:
        # Bounded above: the claim's LIMIT and the connection pool are sized by it, and 10**11
        # failed deep in both.
        raise bad("--concurrency", s.concurrency,
                  f"must be at least 1 and at most {MAX_CONCURRENCY} (runs held at once)")
    worker = s.worker_id
    if not worker.strip() or len(worker) > MAX_WORKER_ID or not worker.isprintable():
        # The lease owner and the key a worker's deaths are counted by: an empty one is every
        # other misconfigured worker's too, a control character reaches every log and Event.
        shown = repr(worker) if len(worker) <= 80 else f"{worker[:40]!r}... ({len(worker)} chars)"
        raise bad("--worker-id", shown,
                  f"must be 1 to {MAX_WORKER_ID} printable characters, not blank (default: "
                  "host name and pid)")
    if not (finite(s.lease_ttl) and 1 <= s.lease_ttl <= MAX_LEASE_TTL):
        # Bounded above too: a lease past year 9999 is committed by the claim, then cannot be
        # read back (the worker died with a traceback), and never expires for anyone else.
        raise bad("--lease-ttl", s.lease_ttl,
                  f"must be from 1 to {MAX_LEASE_TTL} (seconds; default {DEFAULT_LEASE_TTL:g})")
    if not (finite(s.poll_interval) and s.poll_interval > 0):
        raise bad("--poll-interval", s.poll_interval, "must be more than 0 (seconds; default 5)")
    if not (finite(s.idle_interval) and s.idle_interval > 0):
        raise bad("--idle-interval", s.idle_interval, "must be more than 0 (seconds; default 60)")
    if not (finite(s.drain_grace) and s.drain_grace >= 0):
        raise bad("--drain-grace", s.drain_grace,
                  f"must be 0 or more (seconds; default {DEFAULT_DRAIN_GRACE:g})")
    if not (finite(s.liveness_threshold) and s.liveness_threshold > 0):
        raise bad("--liveness-threshold", s.liveness_threshold,
                  "must be more than 0 (seconds; default 60)")
    if s.health_port is not None and not 0 <= s.health_port <= 65535:
        raise bad("--health-port", s.health_port, "choose 1-65535, 0 for any, -1 to turn it off")
    if s.retry.max_retries < 0:
        raise bad("--model-retries", s.retry.max_retries,
                  f"must be 0 or more (default {RetryPolicy.max_retries})")
    if not (finite(s.retry.deadline) and s.retry.deadline > 0):
        raise bad("--model-deadline", s.retry.deadline,
                  f"must be more than 0 (seconds one model call may take; default "
                  f"{DEFAULT_MODEL_DEADLINE:g})")
    if not (finite(s.tool_timeout) and 0 < s.tool_timeout <= MAX_TOOL_TIMEOUT):
        raise bad("--tool-timeout", s.tool_timeout,
                  f"must be more than 0 and at most {MAX_TOOL_TIMEOUT} (a week; seconds a tool "
                  f"call may take unless it declares @tool(timeout=...); default "
                  f"{DEFAULT_TOOL_TIMEOUT:g})")
    if s.model_transport not in MODEL_TRANSPORTS:
        raise bad("--model-transport", repr(s.model_transport),
                  f"choose {' or '.join(MODEL_TRANSPORTS)} (the first-party API's HTTP "
                  f"transport; default {DEFAULT_MODEL_TRANSPORT})")
    if not (finite(s.progress_budget) and s.progress_budget > 0):
        raise bad("--progress-budget", s.progress_budget,
                  f"must be more than 0 (seconds; default {DEFAULT_PROGRESS_BUDGET:g})")
