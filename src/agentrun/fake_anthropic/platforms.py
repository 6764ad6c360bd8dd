"""The Messages API as Amazon Bedrock and Google Vertex AI serve it, where they differ from the
first-party API: the model in the path, ``anthropic_version`` in the body, their own
authentication, and (Bedrock) the AWS event-stream framing of the streamed events.

Everything else (scripts, faults, signed thinking, the prompt cache) is the first-party server's:
a request is turned into a first-party body (the path's model put back) and answered by the same
code, so one scenario drives all three shapes.

* Bedrock: ``POST /model/{modelId}/invoke`` (a JSON Message) and
  ``/model/{modelId}/invoke-with-response-stream`` (``application/vnd.amazon.eventstream``: one
  binary frame per event, its payload ``{"bytes": base64(event JSON)}``), signed with SigV4: the
  ``Authorization`` header's credential scope must name the service ``bedrock``; with
  ``bedrock.access_key_id`` / ``region`` in the scenario they must match, and with
  ``secret_access_key`` the signature itself is checked over the bytes received.
* Vertex: ``POST /v1/projects/{p}/locations/{r}/publishers/anthropic/models/{model}:rawPredict``
  and ``:streamRawPredict`` (server-sent events, as the first-party API), with a
  ``Bearer`` token; with ``vertex`` in the scenario only a token this server issued is accepted,
  from its GCE/GKE metadata endpoints (``/computeMetadata/v1/...``, found by google-auth through
  ``GCE_METADATA_HOST`` and ``GCE_METADATA_IP``), so a client's real Application Default
  Credentials path (the one GKE workload identity takes) is exercised.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import secrets
import zlib
from typing import Any
from urllib.parse import quote

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BedrockAuth(_Strict):
    """What the Bedrock routes accept; None: anything well formed."""

    access_key_id: str | None = None
    secret_access_key: str | None = None  # set: the SigV4 signature is verified
    region: str | None = None

    def __repr__(self) -> str:  # never print the secret
        return f"BedrockAuth(access_key_id={self.access_key_id!r}, region={self.region!r})"


class VertexAuth(_Strict):
    """What the Vertex routes accept: only tokens this server's metadata endpoint issued (to
    ``service_account``); ``project`` / ``region``: None, any."""

    project: str | None = None
    region: str | None = None
    service_account: str = "agentrun-worker@fake-project.iam.gserviceaccount.com"
    token_lifetime_s: int = Field(default=3600, ge=1)


class PlatformError(Exception):
    """A refusal; ``status`` and ``message`` in the platform's own error shape."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


# --- Bedrock ---------------------------------------------------------------------------------

_AUTH_RE = re.compile(
    r"^AWS4-HMAC-SHA256 Credential=(?P<key>[^/]+)/(?P<date>\d{8})/(?P<region>[^/]+)/"
    r"(?P<service>[^/]+)/aws4_request, ?SignedHeaders=(?P<signed>[^,]+), ?"
    r"Signature=(?P<sig>[0-9a-f]+)$"
)


def check_sigv4(
    auth: BedrockAuth | None,
    method: str,
    raw_path: str,
    headers: dict[str, str],
    body: bytes,
) -> dict[str, str]:
    """Check a SigV4-signed request; returns what the request log shows of it (key id, scope).
    ``headers``: lower-cased names."""
    m = _AUTH_RE.match(headers.get("authorization", ""))
    if m is None:
        raise PlatformError(403, "Missing Authentication Token: expected a SigV4 Authorization "
                                 "header (AWS4-HMAC-SHA256 Credential=...)")
    scope = f"{m['date']}/{m['region']}/{m['service']}/aws4_request"
    seen = {"aws_access_key_id": m["key"], "credential_scope": scope}
    if m["service"] != "bedrock":
        raise PlatformError(403, f"Credential should be scoped to correct service: 'bedrock' "
                                 f"(got {m['service']!r})")
    if auth is None:
        return seen
    if auth.access_key_id is not None and m["key"] != auth.access_key_id:
        raise PlatformError(403, "The security token included in the request is invalid.")
    if auth.region is not None and m["region"] != auth.region:
        raise PlatformError(403, f"Credential should be scoped to a valid region: "
                                 f"{auth.region!r} (got {m['region']!r})")
    if auth.secret_access_key is not None:
        expected = sigv4_signature(
            auth.secret_access_key, method, raw_path, headers, body,
            m["signed"].split(";"), scope,
        )
        if not hmac.compare_digest(expected, m["sig"]):
            raise PlatformError(403, "The request signature we calculated does not match the "
                                     "signature you provided.")
    return seen


def sigv4_signature(
    secret: str,
    method: str,
    raw_path: str,
    headers: dict[str, str],
    body: bytes,
    signed: list[str],
    scope: str,
) -> str:
    """The SigV4 signature (AWS's "Create a signed AWS API request"), as botocore computes it
    for a service other than S3: the path URI-encoded once more, no query string here."""
    path, _, query = raw_path.partition("?")
    canonical_headers = "".join(f"{h}:{' '.join(headers.get(h, '').split())}\n" for h in signed)
    canonical = "\n".join([
        method.upper(),
        quote(path, safe="/~"),
        "&".join(sorted(query.split("&"))) if query else "",
        canonical_headers,
        ";".join(signed),
        hashlib.sha256(body).hexdigest(),
    ])
    date, region, service, _ = scope.split("/")
    to_sign = "\n".join([
        "AWS4-HMAC-SHA256",
        headers.get("x-amz-date", ""),
        scope,
        hashlib.sha256(canonical.encode()).hexdigest(),
    ])
    key = ("AWS4" + secret).encode()
    for part in (date, region, service, "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    return hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()


def _header(name: str, value: str) -> bytes:
    n, v = name.encode(), value.encode()
    return bytes([len(n)]) + n + bytes([7]) + len(v).to_bytes(2, "big") + v  # 7: a string


def event_frame(headers: dict[str, str], payload: bytes) -> bytes:
    """One AWS event-stream message: a prelude (total length, headers length, their CRC32),
    the headers, the payload, and the CRC32 of all that."""
    encoded = b"".join(_header(k, v) for k, v in headers.items())
    prelude = (12 + len(encoded) + len(payload) + 4).to_bytes(4, "big")
    prelude += len(encoded).to_bytes(4, "big")
    prelude += zlib.crc32(prelude).to_bytes(4, "big")
    message = prelude + encoded + payload
    return message + zlib.crc32(message).to_bytes(4, "big")


def chunk_frame(event: dict[str, Any]) -> bytes:
    """A streamed Messages event as Bedrock sends it: a ``chunk`` whose bytes are its JSON."""
    data = base64.b64encode(json.dumps(event).encode()).decode()
    return event_frame(
        {":event-type": "chunk", ":content-type": "application/json", ":message-type": "event"},
        json.dumps({"bytes": data}).encode(),
    )


#: The ResponseStream exception a first-party error type arrives as on Bedrock.
BEDROCK_STREAM_EXCEPTIONS = {
    "rate_limit_error": "throttlingException",
    "overloaded_error": "serviceUnavailableException",
    "api_error": "internalServerException",
    "timeout_error": "modelTimeoutException",
    "invalid_request_error": "validationException",
}


def exception_frame(error_type: str, message: str) -> bytes:
    """An error in the middle of a 200 stream, as Bedrock sends it (an ``exception`` frame)."""
    kind = BEDROCK_STREAM_EXCEPTIONS.get(error_type, "modelStreamErrorException")
    return event_frame(
        {":exception-type": kind, ":content-type": "application/json",
         ":message-type": "exception"},
        json.dumps({"message": message}).encode(),
    )


#: The x-amzn-ErrorType of an HTTP error on Bedrock, by status.
BEDROCK_ERROR_TYPES = {
    400: "ValidationException", 403: "AccessDeniedException", 404: "ResourceNotFoundException",
    408: "ModelTimeoutException", 424: "ModelErrorException", 429: "ThrottlingException",
    500: "InternalServerException", 503: "ServiceUnavailableException",
}


def bedrock_error(status: int, message: str) -> tuple[dict[str, Any], dict[str, str]]:
    """Bedrock's error body and headers: ``{"message": ...}`` and its x-amzn-ErrorType."""
    kind = BEDROCK_ERROR_TYPES.get(status, "InternalServerException" if status >= 500
                                   else "ValidationException")
    return {"message": message}, {"x-amzn-ErrorType": f"{kind}:http://internal.amazon.com/"}


# --- Vertex ----------------------------------------------------------------------------------

#: Google's canonical status name for an HTTP status.
GOOGLE_STATUS = {
    400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
    409: "ABORTED", 429: "RESOURCE_EXHAUSTED", 499: "CANCELLED", 500: "INTERNAL",
    503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED",
}


def vertex_error(status: int, message: str) -> dict[str, Any]:
    """A Google API error body (what Vertex AI answers before the model sees the request)."""
    return {"error": {"code": status, "message": message,
                      "status": GOOGLE_STATUS.get(status, "UNKNOWN")}}


class TokenIssuer:
    """The access tokens the metadata endpoint issued (GKE's metadata server hands a pod its
    workload identity's tokens the same way: google-auth asks for one as it needs it)."""

    def __init__(self) -> None:
        self._issued: set[str] = set()
        self.issued = 0

    def issue(self, auth: VertexAuth | None) -> dict[str, Any]:
        token = "ya29.fake-" + secrets.token_urlsafe(24)
        self._issued.add(token)
        self.issued += 1
        lifetime = auth.token_lifetime_s if auth is not None else 3600
        return {"access_token": token, "expires_in": lifetime, "token_type": "Bearer"}

    def check(self, auth: VertexAuth | None, authorization: str) -> dict[str, str]:
        if not authorization.lower().startswith("bearer ") or not authorization[7:].strip():
            raise PlatformError(401, "Request is missing required authentication credential. "
                                     "Expected OAuth 2 access token.")
        token = authorization[7:].strip()
        if auth is not None and token not in self._issued:
            raise PlatformError(401, "Request had invalid authentication credentials.")
        return {"bearer": "issued" if token in self._issued else "any"}


# --- both ------------------------------------------------------------------------------------


def first_party_body(raw: Any, model: str) -> dict[str, Any]:
    """The platform body as the first-party API would have received it: ``anthropic_version``
    is required and dropped, ``model`` must not be there (the path names it) and is put back."""
    if not isinstance(raw, dict):
        raise PlatformError(400, "request body must be a JSON object")
    if "model" in raw:
        raise PlatformError(400, "extraneous key [model] is not permitted: the model is in the "
                                 "path")
    version = raw.get("anthropic_version")
    if not isinstance(version, str) or not version:
        raise PlatformError(400, "anthropic_version: Field required")
    body = {k: v for k, v in raw.items() if k != "anthropic_version"}
    return {**body, "model": model}


__all__ = [
    "BedrockAuth",
    "PlatformError",
    "TokenIssuer",
    "VertexAuth",
    "bedrock_error",
    "check_sigv4",
    "chunk_frame",
    "event_frame",
    "exception_frame",
    "first_party_body",
    "vertex_error",
]
