"""The model clients the worker uses: the SDK's own, one per provider, able to send every string
the store holds.

The SDK encodes a request body as UTF-8 JSON with the characters written out (``ensure_ascii``
off), so a string holding a lone surrogate (U+D800-U+DFFF: a tool that decoded a file name with
``surrogateescape``, or a model's own text) cannot be encoded, and the call fails before it is
sent, on every attempt. JSON can carry such a code point as a ``\\udxxx`` escape;
:class:`EscapeSurrogates` writes it so, and changes nothing else: a body without a lone surrogate
is the SDK's own bytes. The Bedrock and Vertex clients build their requests the same way (after
moving the model into the URL), so the same mixin serves all three; Bedrock signs the body
after it is built, so the escaped bytes are the signed ones.

A run says where its model is called (the pinned ``spec.provider``). :class:`Providers` makes
each provider's client the first time a run needs it, one per worker process, and imports the
Bedrock or Vertex client (and boto3 or google-auth) only then: a worker that never sees a bedrock
run never imports boto3. Settings come from the worker's environment, read as the SDK reads them
(AWS_REGION / AWS_DEFAULT_REGION, ANTHROPIC_BEDROCK_BASE_URL; CLOUD_ML_REGION,
ANTHROPIC_VERTEX_PROJECT_ID, ANTHROPIC_VERTEX_BASE_URL), and credentials from the pod's identity
through the SDK's default chains (boto3's: IRSA web identity, EKS Pod Identity, the environment;
google-auth's Application Default Credentials: GKE workload identity,
GOOGLE_APPLICATION_CREDENTIALS). A provider whose settings or credentials are missing is
:class:`ProviderUnavailable`, one line naming what to set: the run fails at once rather than
retrying a call that cannot succeed on this worker.

The first-party client sends over the SDK's aiohttp transport (``anthropic.DefaultAioHttpClient``,
the SDK's ``aiohttp`` extra), not its default httpx one: the SDK's request building, auth,
headers, timeouts, proxies from the environment and error statuses are the same, but the HTTP is
parsed in aiohttp's C parser instead of h11 and httpcore, whose pool also probes every idle
connection's socket (getpeername, poll) on each request and each response's end. That is about a
third of the worker's CPU per step at 16 runs (benchmarks/cpu_bench.py). Its connections keep the
TCP keepalives the SDK's default transport sets (:data:`KEEPALIVE`), so a peer that vanished
without a reset is found as it was. ``AGENTRUN_MODEL_TRANSPORT=httpx`` is the way back. Bedrock
and Vertex keep the SDK's default transport (``transport`` is not theirs to choose).
"""

from __future__ import annotations

import logging
import os
import re
import socket
from typing import TYPE_CHECKING, Any

import aiohttp
import anthropic
import httpx2 as httpx  # anthropic >= 2 ships its HTTP client as httpx2
from aiohappyeyeballs import AddrInfoType
from anthropic._constants import DEFAULT_CONNECTION_LIMITS
from anthropic._models import FinalRequestOptions
from anthropic._utils._json import openapi_dumps_str
from anthropic._vendor.httpx_aiohttp import AiohttpTransport

from agentrun.manifests import PROVIDERS
from agentrun.worker.providers import Factory, ModelClient, ProviderUnavailable
from agentrun.worker.settings import DEFAULT_MODEL_TRANSPORT

log = logging.getLogger("agentrun.worker")

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")

#: The SDK's own retries are off for every client: the worker retries with its lease kept alive
#: (model_call.py). The timeout is per read; model_call.py bounds the whole call.
CLIENT_OPTIONS: dict[str, Any] = {"max_retries": 0, "timeout": 600.0}


def client_options(traced: bool) -> dict[str, Any]:
    """CLIENT_OPTIONS, and the SDK's own spans following ours (worker/tracing.py): off unless
    OTEL_* turned tracing on, and then as ANTHROPIC_OPEN_TELEMETRY* say."""
    return {**CLIENT_OPTIONS, "open_telemetry": None if traced else False}


def escape_surrogates(json_text: str) -> bytes:
    """UTF-8 JSON bytes of ``json_text`` with each lone surrogate as a ``\\u`` escape (in JSON
    text written with ``ensure_ascii`` off a surrogate can only stand inside a string)."""
    return _LONE_SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", json_text).encode()


if TYPE_CHECKING:
    from anthropic._base_client import BaseClient

    _ClientBase = BaseClient[Any, Any]
else:
    _ClientBase = object


class EscapeSurrogates(_ClientBase):
    """Mixed in before an SDK client class: a body the SDK cannot encode is sent escaped."""

    def _build_request(self, options: FinalRequestOptions, *, retries_taken: int = 0) -> Any:
        try:
            return super()._build_request(options, retries_taken=retries_taken)
        except UnicodeEncodeError:
            if options.json_data is None or options.extra_json is not None:
                raise
            body = escape_surrogates(openapi_dumps_str(options.json_data))
            escaped = options.model_copy(update={"json_data": None, "content": body})
            return super()._build_request(escaped, retries_taken=retries_taken)


#: The TCP keepalives of the SDK's default transport (anthropic._base_client, on Linux): probes
#: after 60 s idle, every 60 s, 5 of them.
KEEPALIVE: tuple[tuple[int, int, int], ...] = (
    (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
    *((socket.IPPROTO_TCP, getattr(socket, name), value)
      for name, value in (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 60), ("TCP_KEEPCNT", 5))
      if hasattr(socket, name)),
)


def _keepalive_socket(addr_info: AddrInfoType) -> socket.socket:
    family, type_, proto, _, _ = addr_info
    sock = socket.socket(family=family, type=type_, proto=proto)
    for level, option, value in KEEPALIVE:
        sock.setsockopt(level, option, value)
    return sock


def aiohttp_client() -> httpx.AsyncClient:
    """The SDK's aiohttp client (its limits, redirects, proxies from the environment) whose
    connections carry :data:`KEEPALIVE`. Its session is made at the first request, on the loop
    that sends it."""
    transport = AiohttpTransport(limits=DEFAULT_CONNECTION_LIMITS)

    def session() -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(
            limit=DEFAULT_CONNECTION_LIMITS.max_connections or 0,
            keepalive_timeout=DEFAULT_CONNECTION_LIMITS.keepalive_expiry,
            ssl=transport.ssl_context,
            socket_factory=_keepalive_socket,
        )
        return aiohttp.ClientSession(connector=connector)

    transport.client = session
    client: httpx.AsyncClient = anthropic.DefaultAioHttpClient(transport=transport)
    return client


class AsyncAnthropic(EscapeSurrogates, anthropic.AsyncAnthropic):
    """The first-party client, sending over :func:`aiohttp_client` unless given an
    ``http_client`` of its own or told ``transport="httpx"``."""

    def __init__(self, *, transport: str = DEFAULT_MODEL_TRANSPORT, **kwargs: Any) -> None:
        if transport == "aiohttp" and kwargs.get("http_client") is None:
            kwargs["http_client"] = aiohttp_client()
        super().__init__(**kwargs)


def _env(*names: str) -> str | None:
    return next((os.environ[n] for n in names if os.environ.get(n)), None)


def _missing_extra(provider: str, library: str) -> ProviderUnavailable:
    return ProviderUnavailable(
        f"provider {provider} needs {library}, which this worker's installation lacks: "
        f"install agentrun[{provider}] (the agentrun image has it)"
    )


def anthropic_client(
    traced: bool = False, transport: str = DEFAULT_MODEL_TRANSPORT
) -> ModelClient:
    """The Anthropic API: the key from ANTHROPIC_API_KEY (ANTHROPIC_BASE_URL as the SDK reads
    it, for a gateway or the scripted server)."""
    key = os.environ.get("ANTHROPIC_API_KEY")
    if not key:
        raise ProviderUnavailable(
            "provider anthropic: ANTHROPIC_API_KEY is not set on this worker; set it (from a "
            "Secret), or point ANTHROPIC_BASE_URL at agentrun fake-anthropic with any key to run "
            "offline"
        )
    return AsyncAnthropic(api_key=key, transport=transport, **client_options(traced))


def bedrock_client(
    traced: bool = False, transport: str = DEFAULT_MODEL_TRANSPORT
) -> ModelClient:
    """Amazon Bedrock through the SDK's AsyncAnthropicBedrock: the region from AWS_REGION or
    AWS_DEFAULT_REGION (or the AWS profile's), requests signed (SigV4) with what boto3's default
    credential chain finds; or, with AWS_BEARER_TOKEN_BEDROCK set, that Bedrock API key."""
    try:
        import boto3
        import botocore.exceptions
        from anthropic.lib.bedrock import AsyncAnthropicBedrock
    except ImportError as exc:
        raise _missing_extra("bedrock", exc.name or "boto3") from None

    class Bedrock(EscapeSurrogates, AsyncAnthropicBedrock):
        pass

    if os.environ.get("AWS_BEARER_TOKEN_BEDROCK") == "":
        # The SDK would send it as "Bearer " (an illegal header: a connection error each time).
        raise ProviderUnavailable(
            "provider bedrock: AWS_BEARER_TOKEN_BEDROCK is set but empty on this worker; unset "
            "it to sign with the pod's AWS credentials, or give it a Bedrock API key"
        )
    try:
        session = boto3.Session()
        region = _env("AWS_REGION", "AWS_DEFAULT_REGION") or session.region_name
        bearer = os.environ.get("AWS_BEARER_TOKEN_BEDROCK")
        found = bearer or region is None or session.get_credentials() is not None
    except botocore.exceptions.BotoCoreError as exc:  # a broken AWS config (an unknown profile)
        raise ProviderUnavailable(
            f"provider bedrock: the AWS configuration on this worker is unusable: {exc}"
        ) from None
    if not region:
        raise ProviderUnavailable(
            "provider bedrock: no AWS region on this worker; set AWS_REGION (the pool's env)"
        )
    if not found:
        raise ProviderUnavailable(
            "provider bedrock: boto3 found no AWS credentials on this worker; give the pool's "
            "ServiceAccount an IAM role (IRSA: eks.amazonaws.com/role-arn, or an EKS Pod "
            "Identity association), or set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
        )
    return Bedrock(**client_options(traced))


def vertex_client(
    traced: bool = False, transport: str = DEFAULT_MODEL_TRANSPORT
) -> ModelClient:
    """Google Vertex AI through the SDK's AsyncAnthropicVertex: the region from CLOUD_ML_REGION,
    the project from ANTHROPIC_VERTEX_PROJECT_ID (else the credentials' own), tokens from
    google-auth's Application Default Credentials, refreshed by the SDK as they expire."""
    try:
        import google.auth
        import google.auth.exceptions
        from anthropic.lib.vertex import AsyncAnthropicVertex
    except ImportError as exc:
        raise _missing_extra("vertex", exc.name or "google-auth") from None

    class Vertex(EscapeSurrogates, AsyncAnthropicVertex):
        pass

    region = _env("CLOUD_ML_REGION")
    if not region:
        raise ProviderUnavailable(
            "provider vertex: no region on this worker; set CLOUD_ML_REGION (the pool's env), "
            "e.g. us-east5 or global"
        )
    try:
        # The scope the SDK asks for itself; loading does not refresh (the first call does).
        credentials, found_project = google.auth.default(
            scopes=["https://www.googleapis.com/auth/cloud-platform"]
        )
    except google.auth.exceptions.DefaultCredentialsError:
        raise ProviderUnavailable(
            "provider vertex: google-auth found no credentials on this worker; give the pool's "
            "ServiceAccount a Google service account (GKE workload identity: "
            "iam.gke.io/gcp-service-account), or set GOOGLE_APPLICATION_CREDENTIALS"
        ) from None
    project = _env("ANTHROPIC_VERTEX_PROJECT_ID") or found_project
    if not project:
        raise ProviderUnavailable(
            "provider vertex: no Google Cloud project on this worker; set "
            "ANTHROPIC_VERTEX_PROJECT_ID (the pool's env)"
        )
    return Vertex(
        region=region, project_id=project, credentials=credentials, **client_options(traced)
    )


FACTORIES: dict[str, Factory] = {
    "anthropic": anthropic_client,
    "bedrock": bedrock_client,
    "vertex": vertex_client,
}
assert set(FACTORIES) == set(PROVIDERS)
