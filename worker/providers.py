"""The worker's side of the model providers that needs no SDK: the client's interface, the
per-process clients by provider, and the outcomes of a model call the worker acts on.

Light on purpose (issue 17, start-up): importing the anthropic SDK takes about 2 s of CPU, so
nothing on the way from ``exec`` to the first claim may import it. ``agentrun worker`` imports
the SDK in a thread of its own meanwhile (:func:`import_sdk_in_background`); the first run that
calls a model waits only for what is left of that import. The SDK's client classes live in
worker/client.py and the streamed call in worker/model_call.py, which import it at the top.
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import logging
import threading
import urllib.parse
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

from agentrun.worker.settings import DEFAULT_MODEL_TRANSPORT

if TYPE_CHECKING:
    from anthropic.resources.messages import AsyncMessages

log = logging.getLogger("agentrun.worker")

#: The modules a worker imports off its claim path, in this order.
SDK_MODULES = ("agentrun.worker.client", "agentrun.worker.model_call")

# One import at a time for the worker's import threads (import_in_turn).
_IMPORTING = threading.Lock()


def import_in_turn(name: str) -> ModuleType:
    """``importlib.import_module(name)``, one at a time among the threads that import off the
    event loop. Two threads importing modules of one package at once can each wait for a module
    the other is importing; CPython's deadlock detection then fails one of the imports. Seen in
    CI: the health server's ``aiohttp.web`` failed with ``KeyError: 'aiohttp'`` while this
    module's SDK thread imported the aiohttp the first-party client sends over."""
    with _IMPORTING:
        return importlib.import_module(name)


class ModelClient(Protocol):
    """What the worker needs of a client: the Messages resource, and closing it."""

    @property
    def messages(self) -> AsyncMessages: ...

    async def close(self) -> None: ...


class ProviderUnavailable(Exception):
    """This worker cannot call the provider (a setting or the credentials are missing); the
    message is one line naming what to set."""


class PermanentModelError(Exception):
    """The provider refused the request for good; the run fails with this message."""


class TransientExhausted(Exception):
    """Transient failures outlasted the retry budget; the worker gives the claim up."""


#: (traced, the model transport) -> a client. The transport is the first-party API's
#: (worker/client.py); the Bedrock and Vertex factories take it and send over the SDK's default.
Factory = Callable[[bool, str], ModelClient]


def _sdk_factories() -> Mapping[str, Factory]:
    from agentrun.worker.client import FACTORIES  # the SDK: see the module docstring

    return FACTORIES


def import_sdk_in_background(on_imported: Callable[[], None] | None = None) -> threading.Thread:
    """Start importing the SDK (and the modules built on it) in a daemon thread, so that the
    worker's first claim does not wait for it; a later import of them waits for this one to end
    (Python's import lock) rather than starting over. A failure is left for that later import
    to raise where it is handled. ``on_imported`` is called from the thread once all are in."""

    def run() -> None:
        for name in SDK_MODULES:
            try:
                import_in_turn(name)
            except Exception:
                return
        if on_imported is not None:
            on_imported()

    thread = threading.Thread(target=run, name="import-sdk", daemon=True)
    thread.start()
    return thread


def freeze_startup_objects() -> None:
    """Leave every object the collector tracks so far out of its passes from now on (gc.freeze),
    and log how many. Called by ``agentrun worker`` on its event loop's thread once the SDK is
    imported: the modules' objects (about 200,000, most of them the SDK's and pydantic's) live as
    long as the process, and every full collection walked them all, about 0.12 s of CPU with the
    event loop held, once every few thousand steps (docs/benchmarks.md). Garbage among them is
    not collected (there is little at start-up, once); what is freed by reference counting still
    is. On the loop's thread, not the import thread's: never in the middle of a collection that
    another thread started."""
    gc.freeze()
    log.debug("%d start-up objects frozen: the collector passes them over", gc.get_freeze_count())


def endpoint(url: object) -> str:
    """``scheme://host[:port]/path`` of a base URL, for a log line: never its user info or its
    query, where a gateway's credentials may ride (``ANTHROPIC_BASE_URL`` from a Secret)."""
    parts = urllib.parse.urlsplit(str(url))
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    try:
        port = parts.port
    except ValueError:
        port = None
    return urllib.parse.urlunsplit(
        (parts.scheme, host + (f":{port}" if port else ""), parts.path, "", ""))


class Providers:
    """One client per provider for the whole worker process, each made when a run first needs
    it (in a thread: finding credentials may ask a metadata server, and the SDK's import, if
    still going on, must not hold the event loop). ``default``: one client for every provider
    instead (an in-process worker's own client, a test's)."""

    def __init__(
        self,
        factories: Mapping[str, Factory] | None = None,
        *,
        default: ModelClient | None = None,
        traced: bool = False,
        transport: str = DEFAULT_MODEL_TRANSPORT,
    ) -> None:
        self._clients: dict[str, ModelClient] = {}
        self._factories = factories
        self._default = default
        self._traced = traced
        self._transport = transport  # WorkerSettings.model_transport, checked there
        # One per provider: a slow credential probe of one (a metadata server that does not
        # answer) holds up no run of another.
        self._locks: dict[str, asyncio.Lock] = {}

    async def get(self, provider: str) -> ModelClient:
        """The provider's client; :class:`ProviderUnavailable` if this worker cannot call it.
        A failure is not remembered: the next run asks again (a metadata server may answer)."""
        client = self._clients.get(provider, self._default)
        if client is not None:
            return client
        async with self._locks.setdefault(provider, asyncio.Lock()):  # runs claimed together
            client = self._clients.get(provider)
            if client is None:
                client = await asyncio.to_thread(self._make, provider)
                self._clients[provider] = client
                log.info("provider %s: calling %s", provider,
                         endpoint(getattr(client, "base_url", "?")))
        return client

    def _make(self, provider: str) -> ModelClient:
        factories = self._factories if self._factories is not None else _sdk_factories()
        factory = factories.get(provider)
        if factory is None:
            raise ProviderUnavailable(
                f"provider {provider!r} is not one this worker knows ({', '.join(factories)})"
            )
        return factory(self._traced, self._transport)

    async def close(self) -> None:
        """Close the clients it made (``default`` is its caller's to close)."""
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.close()
