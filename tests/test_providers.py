"""Providers: a run's model called on Amazon Bedrock or Google Vertex AI through the SDK's own
clients, by real worker processes against the scripted server's Bedrock and Vertex shapes.

Credentials come the way a pod's identity gives them, through the SDK's default chains: boto3
reads an AWS shared-credentials file (as it would IRSA's web identity), and google-auth finds
the scripted server's GCE/GKE metadata endpoints (as a pod with GKE workload identity finds the
GKE metadata server) and asks it for tokens. The server checks each platform's authentication
(the SigV4 signature itself, a token it issued), so a wrong path is a refused request.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from anthropic._constants import ANTHROPIC_API_VERSION
from anthropic.lib.aws._auth import _get_session
from botocore.eventstream import EventStreamBuffer

from agentrun.fake_anthropic import FakeAnthropicServer
from agentrun.fake_anthropic.platforms import chunk_frame, exception_frame
from agentrun.manifests import AgentSpec
from agentrun.pricing import INPUT_USD_PER_MTOK, cost_usd
from agentrun.store import PromptVersion, Store
from agentrun.worker.client import bedrock_client
from agentrun.worker.model_call import RetryPolicy, build_request, call_model
from agentrun.worker.providers import PermanentModelError, Providers
from tests.conftest import run_cli
from tests.test_prompt_cache import answered, assert_totals_are_the_steps_sum
from tests.workerkit import AGENT, FakeFactory, Workers, echo_scenario, wait_for, wait_run

ACCESS_KEY = "AKIDAGENTRUNTEST"
SECRET_KEY = "agentrun-test-secret-key"
AWS_REGION = "eu-west-1"
BEDROCK_MODEL = "anthropic.claude-sonnet-4-5-20250929-v1:0"
PROJECT, VERTEX_REGION = "agentrun-test", "us-east5"
VERTEX_MODEL = "claude-sonnet-4-5@20250929"

BEDROCK_AGENT = AGENT.model_copy(update={"provider": "bedrock", "model": BEDROCK_MODEL})
VERTEX_AGENT = AGENT.model_copy(update={"provider": "vertex", "model": VERTEX_MODEL})

#: No key for the first-party API, and nothing of the host's own cloud configuration.
ISOLATED = {"ANTHROPIC_API_KEY": "", "AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "",
            "AWS_SESSION_TOKEN": "", "AWS_REGION": "", "AWS_DEFAULT_REGION": "",
            "AWS_EC2_METADATA_DISABLED": "true",
            "GOOGLE_APPLICATION_CREDENTIALS": "", "CLOUD_ML_REGION": "",
            "ANTHROPIC_VERTEX_PROJECT_ID": ""}


def aws_env(tmp: Path, srv: FakeAnthropicServer, *, credentials: bool = True) -> dict[str, str]:
    """boto3's default chain finds a shared-credentials file; the region from AWS_REGION."""
    creds = tmp / "aws-credentials"
    creds.write_text(
        f"[default]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n"
        if credentials else ""
    )
    (tmp / "aws-config").write_text("")
    return {**ISOLATED, "AWS_SHARED_CREDENTIALS_FILE": str(creds),
            "AWS_CONFIG_FILE": str(tmp / "aws-config"), "AWS_REGION": AWS_REGION,
            "ANTHROPIC_BEDROCK_BASE_URL": srv.base_url}


def gcp_env(tmp: Path, srv: FakeAnthropicServer) -> dict[str, str]:
    """google-auth's ADC: no credentials file, no gcloud; the metadata server (the scripted
    server's endpoints) answers, as the GKE metadata server does for workload identity."""
    host = f"127.0.0.1:{srv.port}"
    return {**ISOLATED, "GCE_METADATA_HOST": host, "GCE_METADATA_IP": host,
            "CLOUDSDK_CONFIG": str(tmp / "gcloud"), "CLOUD_ML_REGION": VERTEX_REGION,
            "ANTHROPIC_VERTEX_PROJECT_ID": PROJECT,
            "ANTHROPIC_VERTEX_BASE_URL": f"{srv.base_url}/v1"}


def platform_scenario(turns: int, **extra: Any) -> dict[str, Any]:
    return {
        **echo_scenario(turns, **extra),
        "record_bodies": True,
        "bedrock": {"access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY,
                    "region": AWS_REGION},
        "vertex": {"project": PROJECT, "region": VERTEX_REGION},
    }


async def assert_echoed_to_the_end(store: Store, run_id: Any, turns: int) -> None:
    steps = await store.steps(run_id)
    assert [s.kind for s in steps] == ["model_turn", "tool_result"] * (turns - 1) + ["model_turn"]
    echoed = [s.payload["content"][0]["content"] for s in steps if s.kind == "tool_result"]
    assert echoed == [f"T{i}" for i in range(turns - 1)]  # echo_v1 shouts
    assert (await store.get_run(run_id)).result == f"All {turns} turns done."


async def finish(store: Store, workers: Workers, run_id: Any, env: dict[str, str]) -> None:
    w = workers.start("w", env=env)
    done = await wait_run(store, run_id, lambda r: r.finished, 60)
    assert done.status == "succeeded", done.error
    w.signal(signal.SIGTERM)
    assert w.wait() == 0


async def test_a_bedrock_run_calls_tools_to_the_end_with_signed_requests(
    store: Store, workers: Workers, fake: FakeFactory, tmp_path: Path
) -> None:
    srv = fake(platform_scenario(3))
    run, _ = await store.create_run("echo three times", BEDROCK_AGENT)
    assert run.agent_spec["provider"] == "bedrock"
    await finish(store, workers, run.id, aws_env(tmp_path, srv))
    entries = answered(srv)
    assert [e["turn"] for e in entries] == [0, 1, 2]
    for e in entries:
        assert e["provider"] == "bedrock"
        assert e["path"] == f"/model/{BEDROCK_MODEL}/invoke-with-response-stream"
        assert e["aws_access_key_id"] == ACCESS_KEY  # and the server verified the signature
        assert e["credential_scope"].endswith(f"/{AWS_REGION}/bedrock/aws4_request")
        body = json.loads(e["body"])
        assert body["anthropic_version"] == e["anthropic_version"] == ANTHROPIC_API_VERSION
        assert "model" not in body and "stream" not in body
    await assert_echoed_to_the_end(store, run.id, 3)
    # The prompt cache works as on the first-party API: each turn reads the previous prefix.
    assert entries[1]["usage"]["cache_read_input_tokens"] > 0
    await assert_totals_are_the_steps_sum(store, await store.get_run(run.id))


async def test_a_vertex_run_calls_tools_to_the_end_with_workload_identity_tokens(
    store: Store, workers: Workers, fake: FakeFactory, tmp_path: Path
) -> None:
    srv = fake(platform_scenario(3))
    run, _ = await store.create_run("echo three times", VERTEX_AGENT)
    await finish(store, workers, run.id, gcp_env(tmp_path, srv))
    entries = answered(srv)
    assert [e["turn"] for e in entries] == [0, 1, 2]
    path = (f"/v1/projects/{PROJECT}/locations/{VERTEX_REGION}/publishers/anthropic/models/"
            f"{VERTEX_MODEL}:streamRawPredict")
    for e in entries:
        assert e["provider"] == "vertex" and e["path"] == path
        assert e["bearer"] == "issued"  # a token google-auth got from the metadata server
        body = json.loads(e["body"])
        assert body["anthropic_version"] == ANTHROPIC_API_VERSION and "model" not in body
    assert srv.state.tokens.issued >= 1
    await assert_echoed_to_the_end(store, run.id, 3)
    assert entries[1]["usage"]["cache_read_input_tokens"] > 0


async def test_a_resumed_bedrock_run_sends_the_same_bytes_and_reads_the_cache(
    store: Store, workers: Workers, fake: FakeFactory, tmp_path: Path
) -> None:
    srv = fake(platform_scenario(3, slow={1: 100}))
    env = aws_env(tmp_path, srv)
    run, _ = await store.create_run("echo three times", BEDROCK_AGENT)
    # Turn 1 is seq 2: w1 commits turn 0 and its tool result, then dies as turn 1 streams.
    w1 = workers.start("w1", faults="mid_model_stream@2", env=env)
    assert w1.wait() == -signal.SIGKILL
    await finish(store, workers, run.id, env)
    _, killed, resumed = [e for e in answered(srv) if e["turn"] in (0, 1)]
    assert killed["body"] == resumed["body"]
    assert resumed["usage"]["cache_creation_input_tokens"] == 0
    assert resumed["usage"]["cache_read_input_tokens"] == (
        killed["usage"]["cache_read_input_tokens"] + killed["usage"]["cache_creation_input_tokens"]
    )
    await assert_echoed_to_the_end(store, run.id, 3)


async def test_a_provider_this_worker_cannot_call_fails_the_run_at_once_naming_the_setting(
    store: Store, workers: Workers, fake: FakeFactory, tmp_path: Path
) -> None:
    srv = fake(platform_scenario(2))
    # A worker with no provider configured at all, then one with a region but no credentials.
    cases = [
        (BEDROCK_AGENT, {}, "no AWS region on this worker; set AWS_REGION"),
        (VERTEX_AGENT, {}, "no region on this worker; set CLOUD_ML_REGION"),
        (AGENT, {}, "ANTHROPIC_API_KEY is not set on this worker"),
        (BEDROCK_AGENT, {"AWS_REGION": AWS_REGION}, "boto3 found no AWS credentials"),
    ]
    for i, (agent, extra, says) in enumerate(cases):
        env = {**aws_env(tmp_path, srv, credentials=False), "AWS_REGION": "", **extra}
        run, _ = await store.create_run(f"echo {i}", agent)
        w = workers.start(f"w{i}", env=env)
        done = await wait_run(store, run.id, lambda r: r.finished, 60)
        w.signal(signal.SIGTERM)
        assert w.wait() == 0
        assert done.status == "failed" and done.attempt == 1, (done.status, done.error)
        assert done.error is not None and says in done.error and "\n" not in done.error
        assert done.error.startswith(f"provider {agent.provider}"), done.error
        assert (await store.steps(run.id)) == []
    assert answered(srv) == []  # nothing was sent anywhere


async def test_get_shows_the_provider_and_a_bad_one_is_refused_naming_the_field(
    store: Store, database_url: str, tmp_path: Path
) -> None:
    run, _ = await store.create_run("t", VERTEX_AGENT)
    shown = run_cli("get", str(run.id), env={"AGENTRUN_DATABASE_URL": database_url})
    assert shown.returncode == 0, shown.stderr
    assert re.search(r"^provider:\s+vertex$", shown.stdout, re.M), shown.stdout
    wide = run_cli("runs", "-o", "wide", env={"AGENTRUN_DATABASE_URL": database_url})
    header, row = wide.stdout.splitlines()[:2]
    assert header.split()[8] == "PROVIDER" and row.split()[8] == "vertex", wide.stdout
    path = tmp_path / "bad.yaml"
    path.write_text(
        "apiVersion: agentrun.dev/v1alpha1\nkind: Agent\nmetadata: {name: a}\n"
        "spec: {model: m, provider: azure}\n---\n"
        "apiVersion: agentrun.dev/v1alpha1\nkind: AgentRun\nmetadata: {name: r}\n"
        "spec: {agent: {name: a}, task: t}\n"
    )
    proc = run_cli("submit", "-f", str(path), env={"AGENTRUN_DATABASE_URL": database_url})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "Agent a: spec.provider: Input should be 'anthropic', 'bedrock' or 'vertex'" in lines[0]


def test_a_worker_imports_no_cloud_sdk_until_a_run_needs_it() -> None:
    code = (
        "import sys, agentrun.cli, agentrun.worker.process, agentrun.worker.client\n"
        "from agentrun.worker.providers import Providers\n"
        "Providers()\n"
        "print([m for m in ('boto3', 'botocore', 'google.auth') if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out


def test_the_way_to_a_workers_first_claim_imports_neither_the_sdk_nor_aiohttp() -> None:
    """Issue 17 (start-up): about 2 s of CPU for the SDK and 0.2 s for aiohttp stay off the claim
    path; `agentrun worker` imports both in threads (worker/providers.py, Worker.serve)."""
    code = (
        "import sys, agentrun.cli, agentrun.worker.process, agentrun.worker.executor\n"
        "print([m for m in ('anthropic', 'aiohttp', 'httpx2') if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out


async def test_a_worker_leaves_its_start_up_objects_out_of_the_collectors_passes(
    workers: Workers, store: Store, fake: FakeFactory
) -> None:
    """Issue 17 (CPU per step): once `agentrun worker` has imported the SDK it freezes what the
    collector tracks (gc.freeze), the imports' objects, which every full collection walked
    (about 0.12 s with the event loop held); the worker then works as before."""
    srv = fake(echo_scenario(2))
    w = workers.start("w-freeze", extra=["--log-level", "DEBUG"],
                      env={"ANTHROPIC_BASE_URL": srv.base_url})

    def frozen() -> list[int]:
        return [int(line["msg"].split()[0]) for line in w.json_lines()
                if "start-up objects frozen" in line.get("msg", "")]

    await wait_for(lambda: bool(frozen()), 60, "the worker's freeze after the SDK's import")
    assert len(frozen()) == 1 and frozen()[0] > 50_000, frozen()  # once; the imports' objects
    run, _ = await store.create_run("after the freeze", AGENT)
    done = await wait_run(store, run.id, lambda r: r.status == "succeeded", 60)
    assert done.next_seq == 3  # the tool turn, its result, the answer


def test_the_pinned_spec_says_the_provider_and_defaults_to_anthropic() -> None:
    assert AgentSpec(model="m").pinned()["provider"] == "anthropic"
    assert AgentSpec.model_validate({"model": "m", "provider": "bedrock"}).provider == "bedrock"


def test_event_stream_frames_decode_with_botocore() -> None:
    """The encoder's frames are what botocore's EventStreamBuffer (the SDK's decoder) reads:
    prelude, headers and both CRCs; a flipped byte is refused."""
    event = {"type": "content_block_delta", "index": 0,
             "delta": {"type": "text_delta", "text": "héllo \U0001f600"}}
    buffer = EventStreamBuffer()
    frames = chunk_frame(event) + exception_frame("rate_limit_error", "slow down")
    for i in range(0, len(frames), 7):  # in pieces, as a socket delivers them
        buffer.add_data(frames[i : i + 7])
    chunk, error = list(buffer)
    assert chunk.headers[":event-type"] == "chunk"
    assert json.loads(base64.b64decode(json.loads(chunk.payload)["bytes"])) == event
    assert error.to_response_dict()["status_code"] == 400
    assert error.headers[":exception-type"] == "throttlingException"
    broken = bytearray(chunk_frame(event))
    broken[20] ^= 1
    bad = EventStreamBuffer()
    bad.add_data(bytes(broken))
    with pytest.raises(Exception, match=r"(?i)checksum|crc"):
        list(bad)


# --- the platforms' errors, through the SDK's own clients and the worker's classification ---


def faulty(faults: list[dict[str, Any]]) -> dict[str, Any]:
    return platform_scenario(2, faults={0: faults})


@pytest.fixture
def bedrock_env(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Iterator[Callable[[Any], None]]:
    """The AWS environment of :func:`aws_env`, in this process. The SDK keeps one boto3 session
    (with its credentials) per process: cleared, so each test signs with its own."""
    def use(srv: FakeAnthropicServer) -> None:
        for name, value in aws_env(tmp_path, srv).items():
            monkeypatch.setenv(name, value)
        _get_session.cache_clear()

    yield use
    _get_session.cache_clear()


async def first_turn(client: Any, policy: RetryPolicy) -> Any:
    pv = PromptVersion(model=BEDROCK_MODEL, system="s", tools=[], params={"max_tokens": 1024})
    return await call_model(client, build_request(pv, [{"role": "user", "content": "echo"}]),
                            policy=policy, sleep=lambda _: asyncio.sleep(0))


@pytest.mark.parametrize("fault", [
    {"status": 429}, {"status": 503}, {"stream": "error", "type": "overloaded_error"},
    {"stream": "garbage"}, {"stream": "truncated"},
])
async def test_bedrock_errors_are_transient_where_the_first_party_ones_are(
    fake: FakeFactory, bedrock_env: Callable[[Any], None], fault: dict[str, Any]
) -> None:
    srv = fake(faulty([fault]))
    bedrock_env(srv)
    client = bedrock_client()
    retries: list[str] = []
    try:
        turn = await call_model(
            client,
            build_request(PromptVersion(model=BEDROCK_MODEL, system="", tools=[],
                                        params={"max_tokens": 1024}),
                          [{"role": "user", "content": "echo"}]),
            policy=RetryPolicy(max_retries=1),
            on_retry=retries.append,
            sleep=lambda _: asyncio.sleep(0),
        )
    finally:
        await client.close()
    assert turn.stop_reason == "tool_use" and len(retries) == 1, retries
    assert [e.get("status") for e in srv.requests()] == [
        fault.get("status", 200), 200]


async def test_a_bad_bedrock_signature_is_a_permanent_failure_with_bedrocks_message(
    fake: FakeFactory, bedrock_env: Callable[[Any], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    srv = fake(platform_scenario(2))
    bedrock_env(srv)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    _get_session.cache_clear()  # after bedrock_env's own clear: these credentials
    client = bedrock_client()
    try:
        with pytest.raises(PermanentModelError) as err:
            await first_turn(client, RetryPolicy(max_retries=3))
    finally:
        await client.close()
    assert str(err.value) == ("403: The request signature we calculated does not match the "
                              "signature you provided.")
    assert len(srv.requests()) == 1  # not retried


async def test_vertex_errors_in_googles_shape_are_classified_by_status(
    fake: FakeFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    from anthropic.lib.vertex import AsyncAnthropicVertex

    srv = fake({**echo_scenario(2, faults={0: [{"status": 429}]}),
                "vertex": {"project": PROJECT}})
    client = AsyncAnthropicVertex(region=VERTEX_REGION, project_id=PROJECT,
                                  access_token="not-issued", base_url=f"{srv.base_url}/v1",
                                  max_retries=0)
    try:
        with pytest.raises(PermanentModelError) as err:  # a token the server never issued
            await first_turn(client, RetryPolicy(max_retries=3))
        assert str(err.value) == (
            "401 UNAUTHENTICATED: Request had invalid authentication credentials.")
        token = srv.state.tokens.issue(None)["access_token"]
        client = client.copy(access_token=token)
        retries: list[str] = []
        pv = PromptVersion(model=VERTEX_MODEL, system="", tools=[], params={"max_tokens": 1024})
        turn = await call_model(client, build_request(pv, [{"role": "user", "content": "echo"}]),
                                policy=RetryPolicy(max_retries=1), on_retry=retries.append,
                                sleep=lambda _: asyncio.sleep(0))
    finally:
        await client.close()
    assert turn.stop_reason == "tool_use" and retries == ["429"]
    assert srv.requests()[1]["error"] and srv.requests()[1]["status"] == 429


@pytest.mark.parametrize("model", [
    "claude-opus-4-1", "claude-opus-4-1-20250805", "anthropic.claude-opus-4-1-20250805-v1:0",
    "us.anthropic.claude-opus-4-1-20250805-v1:0", "claude-opus-4-1@20250805",
    "arn:aws:bedrock:us-east-1:123456789012:inference-profile/"
    "us.anthropic.claude-opus-4-1-20250805-v1:0",
])
def test_every_providers_model_id_is_priced_as_its_family(model: str) -> None:
    assert cost_usd(model, {"input": 10**6}) == INPUT_USD_PER_MTOK["claude-opus-4-1"]


async def test_bedrock_signs_the_escaped_bytes_of_a_lone_surrogate_for_an_inference_profile_arn(
    fake: FakeFactory, bedrock_env: Callable[[Any], None]
) -> None:
    """The surrogate-escaping client is the Bedrock one too: a lone surrogate (a tool's output)
    goes as a \\udxxx escape, and the signature the server verifies covers those bytes. An
    inference profile's ARN (a "/" in the model id) reaches the route and the SigV4 path."""
    srv = fake(platform_scenario(2))
    bedrock_env(srv)
    client = bedrock_client()
    arn = ("arn:aws:bedrock:eu-west-1:123456789012:inference-profile/"
           "eu.anthropic.claude-sonnet-4-5-20250929-v1:0")
    try:
        message = await client.messages.create(
            model=arn, max_tokens=64, messages=[{"role": "user", "content": "echo \ud800"}])
    finally:
        await client.close()
    assert message.stop_reason == "tool_use"
    (entry,) = srv.requests()
    assert entry["status"] == 200 and entry["model"] == arn
    assert "echo \\ud800" in entry["body"]


def test_the_workers_import_threads_import_one_module_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two threads importing one package's modules at once can trip CPython's import deadlock
    # detection (CI: KeyError: 'aiohttp' in the health server's import beside the SDK thread's).
    # import_in_turn lets the second start only when the first is done.
    import builtins
    import sys
    import threading

    from agentrun.worker.providers import import_in_turn

    entered, gate, second_done = threading.Event(), threading.Event(), threading.Event()
    monkeypatch.setattr(builtins, "_agentrun_test_import_gate", (entered, gate), raising=False)
    (tmp_path / "agentrun_slow_import.py").write_text(
        "import builtins\nentered, gate = builtins._agentrun_test_import_gate\n"
        "entered.set()\ngate.wait(60)\n")
    (tmp_path / "agentrun_quick_import.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("agentrun_slow_import", "agentrun_quick_import"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    first = threading.Thread(target=import_in_turn, args=("agentrun_slow_import",))
    second = threading.Thread(
        target=lambda: (import_in_turn("agentrun_quick_import"), second_done.set()))
    first.start()
    try:
        assert entered.wait(60)
        second.start()
        # Without the lock the quick import ends at once; with it, it waits for the gate.
        assert not second_done.wait(0.5)
    finally:
        gate.set()
        first.join(60)
    second.join(60)
    assert second_done.is_set() and sys.modules["agentrun_quick_import"].VALUE == 1
    for name in ("agentrun_slow_import", "agentrun_quick_import"):
        sys.modules.pop(name, None)


async def test_the_log_line_naming_a_providers_endpoint_carries_no_credentials(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A gateway URL with user info or a ?key= token (ANTHROPIC_BASE_URL from a Secret) was
    logged whole at the first run (found by an adversarial review on 2026-12-06)."""
    import anthropic

    url = "https://gwuser:GatewayToken-987654@gateway.example.com:8443/anthropic?key=QueryKey-55"
    made: list[anthropic.AsyncAnthropic] = []

    def make(traced: bool, transport: str) -> anthropic.AsyncAnthropic:
        made.append(anthropic.AsyncAnthropic(base_url=url, api_key="unused"))
        return made[-1]

    with caplog.at_level(logging.INFO, logger="agentrun"):
        await Providers({"anthropic": make}).get("anthropic")
    await made[0].close()
    [line] = [r.getMessage() for r in caplog.records if "calling" in r.getMessage()]
    assert line == "provider anthropic: calling https://gateway.example.com:8443/anthropic"
