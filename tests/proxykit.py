"""A TCP proxy in front of PostgreSQL that a test can cut and restore: a real network outage for
one process (the operator) while the machine's server, which other tests use, keeps running."""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass, field


@dataclass
class TcpProxy:
    target: tuple[str, int]
    port: int = 0
    #: Where it listens: loopback, or a node's bridge address for pods (tests/e2e).
    host: str = "127.0.0.1"
    _server: socket.socket | None = None
    _conns: list[socket.socket] = field(default_factory=list)
    _up: bool = True
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stopped: bool = False

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
            conns, self._conns = self._conns, []
        for c in conns:
            _close(c)

    def restore(self) -> None:
        with self._lock:
            self._up = True

    def stop(self) -> None:
        self._stopped = True
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
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        _close(src)
        _close(dst)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()
