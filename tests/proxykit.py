"""A TCP proxy in front of PostgreSQL that a test can cut and restore: a real network outage for
one process (the operator) while the machine's server, which other tests use, keeps running.

Besides a cut (every connection closed: the client sees the error at once), it fakes the failures
that send nothing at all:

* :meth:`TcpProxy.trap` with ``hold=False``, a black hole: the one connection that next sends the
  given bytes stops forwarding (that write is swallowed) and nothing is closed, no RST, no FIN (a
  dead node, a dropped NAT entry): its client waits for an answer that never comes, while every
  other connection keeps working;
* :meth:`TcpProxy.trap` with ``hold=True``: that connection's writes are held back until the test
  calls :meth:`Trap.release`, then delivered in order (a slow network, under the test's control).

A black-holed connection stays dead: the proxy cannot forward half a protocol message.
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass, field


@dataclass
class Trap:
    """Springs on the first client-to-server write that contains ``marker``."""

    marker: bytes
    hold: bool
    #: Set when the trap has caught its connection.
    sprung: threading.Event = field(default_factory=threading.Event)
    _released: threading.Event = field(default_factory=threading.Event)

    def release(self) -> None:
        """A holding trap: deliver what it held back, and forward normally from now on."""
        self._released.set()


@dataclass
class _Link:
    """One proxied connection (client and upstream sockets)."""

    client: socket.socket
    upstream: socket.socket
    dead: bool = False  # black-holed: read and dropped both ways, nothing forwarded or closed
    tail: bytes = b""  # the end of the previous write, for a marker split across two writes


@dataclass
class TcpProxy:
    target: tuple[str, int]
    port: int = 0
    #: Where it listens: loopback, or a node's bridge address for pods (tests/e2e).
    host: str = "127.0.0.1"
    _server: socket.socket | None = None
    _links: list[_Link] = field(default_factory=list)
    _traps: list[Trap] = field(default_factory=list)
    _up: bool = True
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stopped: bool = False
    #: Connections accepted and forwarded so far (a client's connection count, as the server saw).
    accepted: int = 0

    def start(self) -> TcpProxy:
        self._server = socket.socket()
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind((self.host, self.port))
        self._server.listen(64)
        self.port = self._server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True, name="proxy").start()
        return self

    def cut(self) -> None:
        """Drop every connection and refuse new ones (as a dead network would)."""
        with self._lock:
            self._up = False
            links, self._links = self._links, []
        for link in links:
            _close(link.client)
            _close(link.upstream)

    def restore(self) -> None:
        with self._lock:
            self._up = True

    def trap(self, marker: bytes, *, hold: bool = False) -> Trap:
        """Catch the one connection whose client next writes ``marker``: black-hole it (from
        that write on, the write included), or with ``hold`` keep its writes until released."""
        t = Trap(marker, hold)
        with self._lock:
            self._traps.append(t)
        return t

    def stop(self) -> None:
        self._stopped = True
        for t in self._traps:
            t.release()
        self.cut()
        if self._server is not None:
            _close(self._server)

    def _accept(self) -> None:
        assert self._server is not None
        while not self._stopped:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            with self._lock:
                up = self._up
            if not up:
                _close(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                _close(client)
                continue
            with self._lock:
                link = _Link(client, upstream)
                self._links.append(link)
                self.accepted += 1
            threading.Thread(target=self._pump, args=(link, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(link, False), daemon=True).start()

    def _sprung(self, link: _Link, data: bytes) -> Trap | None:
        with self._lock:
            seen, link.tail = link.tail + data, data[-64:]
            for t in self._traps:
                if t.marker in seen:
                    self._traps.remove(t)
                    t.sprung.set()
                    if not t.hold:
                        link.dead = True
                    return t
        return None

    def _pump(self, link: _Link, outbound: bool) -> None:
        src, dst = (link.client, link.upstream) if outbound else (link.upstream, link.client)
        try:
            while data := src.recv(65536):
                if outbound and not link.dead:
                    trap = self._sprung(link, data)
                    if trap is not None and trap.hold:
                        while not trap._released.wait(0.1) and not self._stopped:
                            pass
                if link.dead:
                    continue  # read and dropped: the sender sees a network that eats packets
                dst.sendall(data)
        except OSError:
            pass
        finally:
            if not link.dead or self._stopped:
                _close(src)
                _close(dst)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()
