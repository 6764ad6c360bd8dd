"""A warm parent for the soak's worker lives (``soak.py --fork-workers``).

A worker life started from ``exec`` pays about 1.5 s of CPU before it does anything, most of it
``import anthropic``: on 2 cores that caps the soak at about one worker life per second, a third
of what 10,000 SIGKILLs in 90 minutes need (docs/benchmarks.md). This process imports the
worker's whole stack once, then forks one child per worker life, the way a pre-forking server
(gunicorn's ``--preload``) does. Each child is a process of its own: from ``agentrun.cli.main``
on, it runs the worker as ``python -m agentrun worker`` would (its own event loop, pool,
connections, SDK client, signal handlers), and it is SIGKILLed, SIGTERMed and SIGSTOPped by its
own pid, independently of the others. What the children share is only what ``fork`` shares:
the parent's imported modules, copy-on-write.

Protocol, one JSON object per line. On stdin, from the soak:
``{"spawn": TAG, "argv": [...], "log": PATH}``. On stdout, to the soak: ``{"spawned": TAG,
"pid": PID}`` once the child exists, and ``{"exited": PID, "rc": RC}`` when it is reaped (RC as
``subprocess.Popen.returncode``: the exit code, or minus the signal that killed it). At the end
of stdin (the soak is done, or died), the children still alive are SIGKILLed and reaped before
this process exits: nothing it started outlives it.

    python -m benchmarks.zygote   # started by the soak, with the workers' environment
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import sys
import traceback
from typing import Any

#: How long the loop waits on stdin before it reaps again (a child's exit is reported within it).
REAP_EVERY_S = 0.05


def preload() -> None:
    """Import what a worker life imports, so that a child starts from here."""
    import agentrun.cli  # the CLI, the worker, the store and psycopg with it
    import agentrun.worker.client  # the SDK client: `import anthropic`
    import agentrun.worker.model_call
    import agentrun.worker.process  # noqa: F401


def child(argv: list[str], log: str) -> None:
    """In the forked child: stdout and stderr to ``log``, stdin from nowhere, then the CLI's
    main as ``python -m agentrun`` runs it. Never returns."""
    code = 1
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        gc.enable()
        from agentrun.cli import main

        sys.argv = ["agentrun", *argv]
        code = main(argv)
    except SystemExit as exc:  # argparse's errors, as `python -m agentrun` would exit
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # a closed stream: nothing more to say
                pass
        os._exit(code)


def say(msg: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def reap(children: set[int], *, block: bool = False) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            children.clear()
            return
        if pid == 0:
            return
        children.discard(pid)
        say({"exited": pid, "rc": os.waitstatus_to_exitcode(status)})


def serve() -> int:
    preload()
    # Objects made so far are shared with every child: freezing them keeps the children's
    # collector from touching (and so copying) their pages.
    gc.disable()
    gc.freeze()
    children: set[int] = set()
    buffered = b""
    stdin = sys.stdin.fileno()
    say({"ready": os.getpid()})
    try:
        while True:
            ready, _, _ = select.select([stdin], [], [], REAP_EVERY_S)
            reap(children)
            if not ready:
                continue
            chunk = os.read(stdin, 65536)
            if not chunk:
                return 0
            buffered += chunk
            *lines, buffered = buffered.split(b"\n")
            for line in lines:
                if not line.strip():
                    continue
                req = json.loads(line)
                sys.stdout.flush()
                pid = os.fork()
                if pid == 0:
                    child([str(a) for a in req["argv"]], str(req["log"]))
                children.add(pid)
                say({"spawned": req["spawn"], "pid": pid})
    finally:
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        reap(children, block=True)


if __name__ == "__main__":
    sys.exit(serve())
