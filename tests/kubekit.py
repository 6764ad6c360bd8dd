"""A Kubernetes API for tests: the kmock emulator, fixed where it differs from a real API server,
served from its own thread; plus a client to drive it and the ``agentrun operator`` process.

kmock 0.8 differs from a real API server in four ways that matter to kopf (see
shared/notes/kopf-kmock.md); :class:`Emulator` fills them in: the namespace of a created object
comes from the URL, every object gets a uid, creationTimestamp, generation and a resourceVersion
that changes on every write (and a list's resourceVersion that a watch resumes from, without the
stale replay or the lost write of stock kmock), ``generateName`` is honoured, a failed JSON-patch
``test`` answers 422 (not 500, which kopf would retry forever), and a create answers 201.
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp.web
import jsonpatch
import kmock
import yaml

ROOT = Path(__file__).resolve().parent.parent
AGENTRUNS = "/apis/agentrun.dev/v1alpha1"


class Emulator(kmock.KubernetesEmulator):  # type: ignore[misc]
    _versions = itertools.count(1)
    _last = [0]  # the newest resourceVersion handed out

    #: How many past requests kmock keeps (its filters scan them all on every request, which
    #: made each request cost O(requests so far): 50 ms after a few thousand).
    keep_requests = 8

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        if len(self._requests) > self.keep_requests:
            del self._requests[: -self.keep_requests]
        if not hasattr(self, "calls"):
            self.calls: list[tuple[str, str, bool]] = []
        resource = request.resource.plural if request.resource else request.url.path
        sub = f"/{request.subresource}" if request.subresource else ""
        self.calls.append((
            f"{request.method.value} {resource}{sub}" + (" (watch)" if
                                                         request.params.get("watch") else ""),
            str(request.headers.get("User-Agent", "")),
            True,
        ))
        if request.resource is not None and request.action in (
            kmock.action.CREATE, kmock.action.UPDATE
        ):
            self._last[0] = next(self._versions)
            rv = str(self._last[0])
            if request.action == kmock.action.CREATE and isinstance(request.data, dict):
                meta = request.data.setdefault("metadata", {})
                if request.namespace and not meta.get("namespace"):
                    meta["namespace"] = request.namespace
                if not meta.get("name") and meta.get("generateName"):  # kopf's own Events
                    meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.setdefault(
                    "creationTimestamp",
                    datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                )
                meta.setdefault("generation", 1)
                meta["resourceVersion"] = rv
            elif request.action == kmock.action.UPDATE:
                if isinstance(request.data, dict):
                    request.data.setdefault("metadata", {})["resourceVersion"] = rv
                elif isinstance(request.data, list):
                    request.data.append(
                        {"op": "add", "path": "/metadata/resourceVersion", "value": rv}
                    )
        response = await super()._handle(request)
        if request.action == kmock.action.CREATE and response.status == 200:
            response.set_status(201)
        return response

    def _KubernetesEmulator__get_objs(self, request: kmock.Request, strict: bool) -> list[Any]:
        # Stock kmock compares the request with every stored object (~0.25 ms each): a GET or
        # PATCH costs 50 ms at 200 objects. The store is a dict keyed by (resource, ns, name).
        objects = self._objects._objects
        if request.name is not None and (strict or request.namespace is not None):
            found = objects.get((request.resource, request.namespace, request.name))
            return [found] if found is not None else []
        return [
            obj for (resource, namespace, name), obj in objects.items()
            if resource == request.resource
            and (namespace == request.namespace if strict else
                 request.namespace is None or namespace == request.namespace)
            and (request.name is None or name == request.name)
        ]

    async def _serve_list(self, request: kmock.Request) -> Any:
        # A real resourceVersion on the list, so the watch that follows can resume from it.
        out = await super()._serve_list(request)
        out["metadata"]["resourceVersion"] = str(self._last[0])
        return out

    async def _serve_watch(self, request: kmock.Request) -> Any:
        # kmock 0.8 ignores ?resourceVersion= and replays every object as ADDED, then subscribes
        # to its event bus: kopf (which lists first) gets stale duplicates, and a write between
        # the snapshot and the subscription is never streamed; kopf then waits forever for the
        # resourceVersion its own patch produced. A real API server does neither: it streams what
        # changed after the given version. So: mark the bus under the snapshot's lock, send only
        # objects newer than the version asked for, then everything after the mark.
        yield b""
        since = int(request.params.get("resourceVersion") or 0)
        bus = self._buses[request.resource]
        async with self._lock:
            mark = await bus.mark()
            objs = self._KubernetesEmulator__get_objs(request, strict=False)
            events = [
                {"type": "ADDED" if since == 0 else "MODIFIED", "object": o.raw}
                for o in objs
                if not o.deleted and int(o.raw["metadata"].get("resourceVersion", 0)) > since
            ]
        try:
            for event in events:
                yield event
            async for event in bus.stream(since=mark):
                meta = event.get("object", {}).get("metadata", {})
                if self._KubernetesEmulator__check(
                    request, request.resource, meta.get("namespace"), meta.get("name"), strict=False
                ):
                    yield event
        finally:
            await bus.unmark(mark)

    async def _render_error(self, exc: Exception) -> aiohttp.web.StreamResponse:
        if isinstance(exc, jsonpatch.JsonPatchException | jsonpatch.JsonPointerException):
            exc = kmock.KubernetesError(status=422, reason="Invalid", message=str(exc))
        return await super()._render_error(exc)


def _declare(emulator: Emulator) -> None:
    emulator.resources.load_bundled()
    emulator.resources["agentrun.dev/v1alpha1/agentruns"] = kmock.ResourceInfo(
        kind="AgentRun",
        namespaced=True,
        verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
        subresources={"status"},
    )
    emulator.resources["agentrun.dev/v1alpha1/agents"] = kmock.ResourceInfo(
        kind="Agent",
        namespaced=True,
        verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
    )


class RestVerbs:
    """create/get/patch/delete over a subclass's ``request(method, path, body, content_type)``:
    the emulator's client here and the real API server's (tests/realkube.Kube) share them."""

    def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> tuple[int, Any]:
        raise NotImplementedError

    def create(self, path: str, obj: dict[str, Any]) -> dict[str, Any]:
        code, out = self.request("POST", path, obj)
        assert code == 201, (code, out)
        return dict(out)

    def get(self, path: str) -> dict[str, Any] | None:
        code, out = self.request("GET", path)
        return dict(out) if code == 200 else None

    def patch(
        self, path: str, body: Any, content_type: str = "application/merge-patch+json"
    ) -> dict[str, Any]:
        code, out = self.request("PATCH", path, body, content_type)
        assert code == 200, (code, out)
        return dict(out)

    def delete(self, path: str) -> int:
        return self.request("DELETE", path)[0]


@dataclass
class KubeCluster(RestVerbs):
    """The emulator on 127.0.0.1 in a thread of its own, with a small synchronous client."""

    url: str = ""
    emulator: Emulator | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _stop: asyncio.Event | None = None
    calls: list[tuple[str, str]] = field(default_factory=list)

    def start(self) -> KubeCluster:
        ready = threading.Event()
        errors: list[BaseException] = []

        async def serve() -> None:
            self._stop = asyncio.Event()
            self.emulator = Emulator()
            _declare(self.emulator)
            async with self.emulator, kmock.Server(self.emulator) as server:
                self.url = str(server.url).rstrip("/")
                ready.set()
                await self._stop.wait()

        def main() -> None:
            self._loop = asyncio.new_event_loop()
            try:
                self._loop.run_until_complete(serve())
            except BaseException as exc:  # surfaced by start()
                errors.append(exc)
                ready.set()
            finally:
                self._loop.close()

        self._thread = threading.Thread(target=main, name="kmock", daemon=True)
        self._thread.start()
        if not ready.wait(30) or errors:
            raise RuntimeError(f"the API emulator did not start: {errors}")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(10)

    def kubeconfig(self, directory: Path) -> Path:
        path = directory / "kubeconfig"
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
            "users": [{"name": "test", "user": {"token": "test-token"}}],
            "contexts": [{"name": "kmock", "context": {
                "cluster": "kmock", "user": "test", "namespace": "default"}}],
            "current-context": "kmock",
        }))
        return path

    # -- a tiny client ------------------------------------------------------------------------

    def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")


    def agentrun(self, name: str, ns: str = "default") -> dict[str, Any] | None:
        return self.get(f"{AGENTRUNS}/namespaces/{ns}/agentruns/{name}")

    def apply_agentrun(self, manifest: dict[str, Any], ns: str = "default") -> dict[str, Any]:
        return self.create(f"{AGENTRUNS}/namespaces/{ns}/agentruns", manifest)

    def apply_agent(self, manifest: dict[str, Any], ns: str = "default") -> dict[str, Any]:
        return self.create(f"{AGENTRUNS}/namespaces/{ns}/agents", manifest)

    def annotate(self, name: str, annotations: dict[str, str | None], ns: str = "default") -> None:
        self.patch(
            f"{AGENTRUNS}/namespaces/{ns}/agentruns/{name}",
            {"metadata": {"annotations": annotations}},
        )

    def events(self, name: str | None = None, ns: str = "default") -> list[dict[str, Any]]:
        code, out = self.request("GET", f"/api/v1/namespaces/{ns}/events")
        items = out.get("items", []) if code == 200 else []
        return [e for e in items if name is None or e["involvedObject"].get("name") == name]

    def reasons(self, name: str, ns: str = "default") -> list[str]:
        return [e["reason"] for e in self.events(name, ns)]

    def deployment(self, name: str, ns: str = "default") -> dict[str, Any] | None:
        return self.get(f"/apis/apps/v1/namespaces/{ns}/deployments/{name}")

    def create_deployment(
        self, name: str, ns: str = "default", replicas: int | None = 0, pool: str = "default"
    ) -> dict[str, Any]:
        return self.create(f"/apis/apps/v1/namespaces/{ns}/deployments",
                           deployment_manifest(name, ns, replicas, pool))

    def create_pod(self, name: str, pool: str, ns: str = "default") -> dict[str, Any]:
        return self.create(f"/api/v1/namespaces/{ns}/pods", {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "labels": {"agentrun.dev/pool": pool}},
            "spec": {"containers": [{"name": "worker", "image": "agentrun"}]},
        })

    def pod(self, name: str, ns: str = "default") -> dict[str, Any] | None:
        return self.get(f"/api/v1/namespaces/{ns}/pods/{name}")


def deployment_manifest(
    name: str, ns: str, replicas: int | None, pool: str
) -> dict[str, Any]:
    """A worker Deployment of ``pool`` (no replicas: the API server's default of 1)."""
    spec: dict[str, Any] = {
        "selector": {"matchLabels": {"agentrun.dev/pool": pool}},
        "template": {"metadata": {"labels": {"agentrun.dev/pool": pool}}, "spec": {
            "containers": [{"name": "worker", "image": "agentrun"}]}},
    }
    if replicas is not None:
        spec["replicas"] = replicas
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": ns}, "spec": spec}


def wait_until(pred: Callable[[], Any], within: float, what: str, every: float = 0.05) -> Any:
    deadline = time.monotonic() + within
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        time.sleep(every)


async def eventually(
    pred: Callable[[], Any], within: float, what: str, every: float = 0.05
) -> Any:
    deadline = time.monotonic() + within
    while True:
        value = await asyncio.to_thread(pred)
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(every)


@dataclass
class OperatorProc:
    popen: subprocess.Popen[bytes]
    log: Path
    metrics_port: int

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            return str(r.read().decode())

    def metric(self, name: str, **labels: str) -> float | None:
        """A sample's value (None: absent, or the operator not serving yet)."""
        try:
            text = self.metrics()
        except OSError:
            return None
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in text.splitlines():
            if line.startswith("#"):
                continue
            key, _, value = line.rpartition(" ")
            metric, _, rest = key.partition("{")
            got = ",".join(sorted(rest.rstrip("}").split(","))) if rest else ""
            if metric == name and got == want:
                return float(value)
        return None

    def stop(self) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                return self.popen.wait(15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
        return self.popen.wait()


@dataclass
class Operators:
    """Starts ``agentrun operator`` processes; each is stopped by its pid at teardown.

    The operator talks to ``cluster`` (the emulator), or, when ``kubeconfig`` is given, to the
    server and with the credentials of that file (a real API server and a ServiceAccount's own
    token: tests/realkube.py), so it has exactly the permissions the chart grants."""

    cluster: KubeCluster | None
    database_url: str
    tmp: Path
    procs: list[OperatorProc] = field(default_factory=list)
    kubeconfig: Path | None = None

    def start(
        self,
        *,
        pools: list[dict[str, Any]] | None = None,
        env: dict[str, str] | None = None,
        extra: list[str] | None = None,
    ) -> OperatorProc:
        from tests.workerkit import free_port

        n = len(self.procs)
        metrics_port = free_port()
        full_env = {
            **os.environ,
            "KUBECONFIG": str(self._kubeconfig()),
            "AGENTRUN_DATABASE_URL": self.database_url,
            "AGENTRUN_RESYNC_INTERVAL": "1",
            "AGENTRUN_STATUS_FLUSH_INTERVAL": "0.05",
            "AGENTRUN_SCALE_INTERVAL": "1",
            "AGENTRUN_METRICS_INTERVAL": "1",
            **(env or {}),
        }
        if pools is not None:
            path = self.tmp / f"pools-{n}.yaml"
            path.write_text(yaml.safe_dump({"pools": pools}))
            full_env["AGENTRUN_POOLS_FILE"] = str(path)
        log = self.tmp / f"operator-{n}.log"
        cmd = [
            sys.executable, "-m", "agentrun", "operator",
            "--metrics-port", str(metrics_port), "--health-port", "-1",
            *(extra or []),
        ]
        with open(log, "wb") as out:
            popen = subprocess.Popen(
                cmd, env=full_env, stdout=out, stderr=subprocess.STDOUT,
                cwd=tempfile.gettempdir(),
            )
        proc = OperatorProc(popen, log, metrics_port)
        self.procs.append(proc)
        return proc

    def _kubeconfig(self) -> Path:
        if self.kubeconfig is not None:
            return self.kubeconfig
        if self.cluster is None:
            raise ValueError("Operators needs a cluster or a kubeconfig")
        return self.cluster.kubeconfig(self.tmp)

    def stop_all(self) -> None:
        for p in self.procs:
            if p.popen.poll() is None:
                p.popen.kill()
            p.popen.wait()


def agentrun_manifest(
    name: str, *, agent: dict[str, Any] | None = None, task: str = "echo", **spec: Any
) -> dict[str, Any]:
    return {
        "apiVersion": "agentrun.dev/v1alpha1",
        "kind": "AgentRun",
        "metadata": {"name": name},
        "spec": {"agent": agent or {"name": "echoer"}, "task": task, **spec},
    }


def agent_manifest(name: str = "echoer", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "agentrun.dev/v1alpha1",
        "kind": "Agent",
        "metadata": {"name": name},
        "spec": {"model": "claude-sonnet-4-5", "system": "You echo carefully.",
                 "tools": ["echo"], **spec},
    }
