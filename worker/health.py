"""Health and metrics endpoints: /healthz, /readyz, /metrics on the health port; /drain on the
control port, which listens on the loopback interface only.

Liveness is progress, not process existence (invariant 8), on two clocks:

* the loop's: it stamps :meth:`Health.progress` on every claim poll, lease renewal and step commit
  (and a sleep of the claim loop between claims counts until its end: :meth:`Health.resting_until`);
  /healthz fails once no stamp is newer than the liveness threshold, so a worker wedged by a
  database outage (the seed's nine-hour incident: the process kept breathing while nothing moved)
  is restarted by Kubernetes. It turns healthy again by itself when PostgreSQL comes back;
* the held runs' (worker/liveness.py): /healthz also fails while the worker holds runs and none of
  them progressed within the progress budget (every task wedged, e.g. on connections that died
  without a RST), however busy the heartbeats are.

/drain stops the worker, so it is not on the health port, which anything that may scrape
metrics can reach: it is on a control listener bound to 127.0.0.1, which only the pod's own
preStop hook (``agentrun drain-local``, run inside the container) can call.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from agentrun.group_commit import AppendStats
from agentrun.metrics import register_standard_collectors
from agentrun.worker.liveness import DEFAULT_PROGRESS_BUDGET

if TYPE_CHECKING:
    from aiohttp import web

#: Step durations, in seconds: a tool result commits in milliseconds, a model turn (a long
#: thinking budget, a big answer) can stream for minutes, so the buckets reach 10 minutes.
STEP_SECONDS_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600,
)

#: Model call latency: the step buckets, for a call is most of a model turn's step.
MODEL_SECONDS_BUCKETS = STEP_SECONDS_BUCKETS[4:]

class WorkerMetrics:
    """The worker's Prometheus metrics, in a registry of their own (one per worker)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        register_standard_collectors(r)
        self.steps = Counter("agentrun_steps", "Steps committed", ["kind"], registry=r)
        self.step_seconds = Histogram(
            "agentrun_step_seconds",
            "Time from the start of a step to its commit",
            ["kind"],
            registry=r,
            buckets=STEP_SECONDS_BUCKETS,
        )
        self.model_seconds = Histogram(
            "agentrun_model_call_seconds",
            "Model call latency (streamed turn)",
            registry=r,
            buckets=MODEL_SECONDS_BUCKETS,
        )
        # type: input, output, cache_read, cache_write (the API's four billed kinds).
        self.tokens = Counter(
            "agentrun_tokens", "Model tokens", ["type", "model"], registry=r
        )
        self.cost = Counter(
            "agentrun_cost_usd",
            "Estimated US dollars of the model turns this worker ran (its price table), by "
            "model; sum by the scrape's pool label for a pool's spend",
            ["model"], registry=r,
        )
        self.budget_stops = Counter(
            "agentrun_budget_stops",
            "Runs stopped before a model turn that would pass spec.budget, by the limit",
            ["limit"], registry=r,
        )
        self.claims = Counter("agentrun_claims", "Runs claimed", registry=r)
        self.dead_letters = Counter("agentrun_dead_letters", "Runs dead-lettered", registry=r)
        self.lease_losses = Counter(
            "agentrun_lease_losses", "Runs dropped because the lease was lost", registry=r
        )
        self.model_retries = Counter(
            "agentrun_model_retries", "Model calls retried", ["reason"], registry=r
        )
        self.runs_finished = Counter(
            "agentrun_runs_finished", "Runs this worker finished", ["status"], registry=r
        )
        self.aborts = Counter(
            "agentrun_run_aborts",
            "Runs failed by a tier-3 error, by what the rollback did (alert on "
            "outcome=compensation_failed: a human must finish it)",
            ["outcome"], registry=r,
        )
        self.active_runs = Gauge("agentrun_active_runs", "Runs held now", registry=r)
        self.tool_calls_refused = Counter(
            "agentrun_tool_calls_refused",
            "Tool calls the model asked for that the run was not given (refused, never run); "
            "alert on any: a prompt injection or a misconfigured agent",
            registry=r,
        )
        self.runs_stalled = Counter(
            "agentrun_runs_stalled",
            "Held runs let go (abandoned, lease no longer renewed) because they made no progress "
            "within the progress budget",
            registry=r,
        )
        self.last_progress = Gauge(
            "agentrun_last_progress_timestamp_seconds",
            "Unix time of the last claim poll, lease renewal or commit",
            registry=r,
        )

    def watch_appends(self, stats: AppendStats) -> None:
        """Export the store's append counters (read at each scrape): rows / statements is the
        group commit's batch size."""
        self.registry.register(_AppendCollector(stats))

    def count_tokens(
        self,
        model: str,
        *,
        input: int,
        output: int,
        cache_read: int,
        cache_write: int,
        cost_usd: float = 0.0,
    ) -> None:
        """One model turn's usage, by kind and model (prices differ per model and kind), and
        its estimated cost."""
        for kind, n in (("input", input), ("output", output), ("cache_read", cache_read),
                        ("cache_write", cache_write)):
            self.tokens.labels(kind, model).inc(n)
        self.cost.labels(model).inc(cost_usd)


def _no_runs() -> list[float]:
    return []


@dataclass
class Health:
    liveness_threshold: float
    metrics: WorkerMetrics
    progress_budget: float = DEFAULT_PROGRESS_BUDGET
    #: Seconds since each held run last progressed (set by the worker).
    held_runs_idle: Callable[[], list[float]] = _no_runs
    last_progress: float = field(default_factory=time.monotonic)
    #: Until when the claim loop sleeps by choice (monotonic; see :meth:`resting_until`).
    resting: float = 0.0
    ready: bool = False
    draining: bool = False
    #: What the worker waits for before it can be ready (its schema), for /readyz to say.
    waiting_for: str | None = None
    #: Starts the drain and returns once no run is held (set by the worker; serves /drain).
    drain: Callable[[], Awaitable[int]] | None = None

    def progress(self) -> None:
        self.last_progress = time.monotonic()
        self.metrics.last_progress.set(time.time())

    def resting_until(self, until: float) -> None:
        """The claim loop sleeps until ``until`` (monotonic) unless woken: an idle worker claims
        once a minute or so (worker/settings.py idle_interval), beyond the liveness threshold,
        and is not wedged while it sleeps. Counted as progress up to ``until``, not after: a loop
        that does not come back by then fails /healthz one threshold later, as before."""
        self.resting = until

    def stalled_for(self) -> float:
        now = time.monotonic()
        return now - max(self.last_progress, min(now, self.resting))

    def runs_stalled(self) -> bool:
        """The worker holds runs and none of them progressed within the budget."""
        idle = self.held_runs_idle()
        return bool(idle) and min(idle) > self.progress_budget

    def alive(self) -> bool:
        return self.stalled_for() < self.liveness_threshold and not self.runs_stalled()


def make_app(health: Health) -> web.Application:
    from aiohttp import web  # off the claim path: Worker._start_servers

    async def healthz(_: web.Request) -> web.Response:
        stalled = health.stalled_for()
        if health.alive():
            return web.json_response({"status": "ok", "last_progress_s": round(stalled, 3)})
        idle = health.held_runs_idle()
        if health.runs_stalled():
            return web.json_response(
                {
                    "status": "stalled",
                    "reason": "no held run progressed within the progress budget",
                    "held_runs": len(idle),
                    "least_idle_run_s": round(min(idle), 3),
                    "progress_budget_s": health.progress_budget,
                },
                status=503,
            )
        return web.json_response(
            {
                "status": "stalled",
                "reason": "no claim poll, lease renewal or commit within the liveness threshold",
                "last_progress_s": round(stalled, 3),
                "threshold_s": health.liveness_threshold,
            },
            status=503,
        )

    async def readyz(_: web.Request) -> web.Response:
        ok = health.ready and not health.draining and health.alive()
        body: dict[str, object] = {"ready": ok, "draining": health.draining}
        if health.waiting_for is not None:
            body["waiting_for"] = health.waiting_for
        return web.json_response(body, status=200 if ok else 503)

    async def metrics(_: web.Request) -> web.Response:
        body = generate_latest(health.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    return app


def make_control_app(health: Health) -> web.Application:
    """The loopback-only control listener: POST /drain (``agentrun drain-local``)."""
    from aiohttp import web

    async def drain(_: web.Request) -> web.Response:
        # The pod's preStop hook: stop claiming, hand the runs back, answer once drained, so
        # Kubernetes sends SIGTERM to a worker that holds nothing. Idempotent.
        if health.drain is None:
            return web.json_response({"error": "drain not available"}, status=404)
        released = await health.drain()
        return web.json_response({"drained": True, "released": released})

    app = web.Application()
    app.router.add_post("/drain", drain)
    return app


class _AppendCollector(Collector):
    """agentrun_append_statements_total and agentrun_append_rows_total, from the store's
    :class:`AppendStats`."""

    def __init__(self, stats: AppendStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "agentrun_append_statements",
            "Statements the step appends went out in (group commit: several runs' appends each)",
            value=self.stats.statements,
        )
        yield CounterMetricFamily(
            "agentrun_append_rows", "Step appends sent", value=self.stats.rows
        )
