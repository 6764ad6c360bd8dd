"""Logs and metrics a collector can use (issue 15), shown with real processes and real libraries.

* worker lines carry worker, pool and pod (the chart's POD_NAME) as JSON fields;
* the HTTP client's one-INFO-line-per-request is gone at INFO and back at --log-level debug;
* /metrics has step-duration buckets up to 10 minutes and the standard process_* series, on the
  worker's and on the operator's registry;
* kopf's per-object loggers keep the object's reference through our formatters.
"""

from __future__ import annotations

import io
import json
import logging
import signal
import urllib.request
from collections.abc import Iterator
from typing import Any

import kopf
import pytest
from kopf._core.actions.loggers import ObjectLogger
from prometheus_client import generate_latest

from agentrun.logs import JsonFormatter, RunIdFilter, TextFormatter, setup_logging
from agentrun.operator.metrics import OperatorMetrics
from agentrun.store import Store
from tests.workerkit import AGENT, FakeFactory, WorkerProc, Workers, echo_scenario, wait_run

POD = "agentrun-worker-default-7d9f8-x2x4q"


def metrics(w: WorkerProc) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{w.health_port}/metrics", timeout=5) as r:
        return str(r.read().decode())


def http_request_lines(w: WorkerProc) -> list[dict[str, Any]]:
    """The HTTP client's per-request lines (httpx2's 'HTTP Request: POST ... 200 OK')."""
    return [x for x in w.json_lines() if x["msg"].startswith("HTTP Request:")]


def sample(body: str, series: str) -> float:
    for line in body.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[1])
    raise AssertionError(f"{series} not in /metrics:\n{body[:2000]}")


async def test_worker_metrics_have_long_step_buckets_and_the_process_series(
    store: Store, workers: Workers, fake: FakeFactory
) -> None:
    srv = fake(echo_scenario(3))
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    run, _ = await store.create_run("echo twice", AGENT)
    w = workers.start("w-metrics", health=True)
    done = await wait_run(store, run.id, lambda r: r.finished, 60)
    assert done.status == "succeeded", done.error

    body = metrics(w)
    # A model turn that streams for 8 minutes lands in a bucket of its own, not in +Inf.
    buckets = [
        float(line.split('le="')[1].split('"')[0])
        for line in body.splitlines()
        if line.startswith('agentrun_step_seconds_bucket{kind="model_turn"')
        and 'le="+Inf"' not in line
    ]
    assert max(buckets) == 600 and {120.0, 300.0} <= set(buckets), buckets
    assert sample(body, 'agentrun_step_seconds_count{kind="model_turn"}') == 3
    assert sample(body, "process_resident_memory_bytes") > 0
    assert sample(body, "process_cpu_seconds_total") > 0
    assert "python_gc_collections_total" in body


async def test_worker_lines_name_worker_pool_and_pod_and_no_http_request_lines(
    store: Store, workers: Workers, fake: FakeFactory
) -> None:
    srv = fake(echo_scenario(3))
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    run, _ = await store.create_run("echo twice", AGENT)
    w = workers.start("w-obs", env={"POD_NAME": POD})
    done = await wait_run(store, run.id, lambda r: r.finished, 60)
    assert done.status == "succeeded", done.error
    w.signal(signal.SIGTERM)
    assert w.wait() == 0
    lines = w.json_lines()
    ours = [x for x in lines if x["logger"].startswith("agentrun")]
    assert ours, w.output()
    for x in ours:
        assert (x.get("worker"), x.get("pool"), x.get("pod")) == ("w-obs", "default", POD), x
    # The lines about the run still carry its run id.
    assert any(x.get("run_id") == str(run.id) for x in ours)
    # Three model calls, no per-request INFO line from the HTTP client.
    assert len([e for e in srv.requests() if e.get("status") == 200]) == 3
    assert http_request_lines(w) == [], http_request_lines(w)


async def test_debug_level_brings_the_http_client_lines_back(
    store: Store, workers: Workers, fake: FakeFactory
) -> None:
    srv = fake(echo_scenario(2))
    workers.env["ANTHROPIC_BASE_URL"] = srv.base_url
    run, _ = await store.create_run("echo once", AGENT)
    w = workers.start("w-debug", extra=["--log-level", "debug"])
    done = await wait_run(store, run.id, lambda r: r.finished, 60)
    assert done.status == "succeeded", done.error
    w.signal(signal.SIGTERM)
    assert w.wait() == 0
    requests = http_request_lines(w)
    assert len(requests) >= 2, w.output()[-3000:]
    assert all(x.get("run_id") == str(run.id) for x in requests)


def test_the_operator_registry_has_the_process_collectors() -> None:
    body = generate_latest(OperatorMetrics().registry).decode()
    assert sample(body, "process_resident_memory_bytes") > 0
    assert "process_cpu_seconds_total" in body and "python_info" in body


@pytest.fixture
def root_logging() -> Iterator[None]:
    """setup_logging replaces the root handlers: restore them for the other tests."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


BODY = {
    "apiVersion": "agentrun.dev/v1alpha1",
    "kind": "AgentRun",
    "metadata": {"namespace": "team-a", "name": "triage-42", "uid": "0b7c-uid"},
}


def object_line(fmt: str) -> str:
    """What kopf's own per-object logger (as handlers get it) prints through our formatter."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(RunIdFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    kopf_logger = logging.getLogger("kopf.objects")
    kopf_logger.addHandler(handler)
    try:
        ObjectLogger(body=kopf.Body(BODY), settings=kopf.OperatorSettings()).info("created")
    finally:
        kopf_logger.removeHandler(handler)
    return out.getvalue().strip()


def test_kopf_object_lines_keep_the_object_reference(root_logging: None) -> None:
    setup_logging("json")  # as `agentrun operator --log-format json` does
    line = json.loads(object_line("json"))
    assert line["object"] == {
        "kind": "AgentRun", "namespace": "team-a", "name": "triage-42", "uid": "0b7c-uid",
    }
    assert line["msg"] == "created" and line["logger"] == "kopf.objects"
    text = object_line("text")
    assert text.endswith("kopf.objects: [team-a/triage-42] created"), text


def test_a_text_line_is_one_line_whatever_its_message_holds(root_logging: None) -> None:
    """libpq's errors span lines, and a model's or a user's text may hold a newline or an escape
    sequence: each forged a line of its own (no timestamp, level or run id) or reached the
    terminal of whoever tails the log. The message is escaped on its line; a traceback still
    follows it."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(RunIdFilter())
    handler.setFormatter(TextFormatter())
    log = logging.getLogger("agentrun.test.oneline")
    log.addHandler(handler)
    try:
        log.warning("connection failed: %s", "refused\n\tIs the server running?\r\n"
                    "12:00:00.000 INFO    agentrun.worker: all clear\x1b[2J\x9b31m",
                    extra={"run_id": "r-1"})
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("with a traceback")
    finally:
        log.removeHandler(handler)
    first, *rest = out.getvalue().splitlines()
    assert first.endswith(
        "agentrun.test.oneline run=r-1: connection failed: refused\\n\tIs the server running?"
        "\\r\\n12:00:00.000 INFO    agentrun.worker: all clear\\x1b[2J\\x9b31m"), first
    assert rest[0].endswith("agentrun.test.oneline: with a traceback"), rest
    assert rest[1] == "Traceback (most recent call last):" and rest[-1] == "ValueError: boom"
