"""Errors that cross module boundaries. Each message is one line a user can act on."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agentrun.store import Run


#: The exit code of a deadline that passed (``wait``/``submit --wait --timeout``, ``demo
#: --timeout``), as coreutils timeout's.
EXIT_TIMEOUT = 124
#: The exit code of a command ended by Ctrl-C (SIGINT), as a shell's: 128 + 2.
EXIT_INTERRUPTED = 130


class AgentrunError(Exception):
    """Base class: the CLI prints ``str(err)`` on one line and exits non-zero."""

    exit_code = 1


class ConfigError(AgentrunError):
    """Bad configuration or input (a malformed URL, a bad manifest). Exit code 2."""

    exit_code = 2


class DatabaseUnavailable(AgentrunError):
    """PostgreSQL cannot be reached. Exit code 3."""

    exit_code = 3


class RunNotFound(AgentrunError):
    def __init__(self, run_id: str) -> None:
        super().__init__(f"no run with id {run_id} (list runs with: agentrun runs)")
        self.run_id = run_id


class LeaseLost(AgentrunError):
    """This worker no longer holds the run (its lease expired and another worker claimed it, or
    the run left the running state). Nothing was written; the worker must drop the run."""

    def __init__(self, run_id: str, detail: str) -> None:
        super().__init__(f"run {run_id}: lease lost: {detail}")
        self.run_id = run_id
        self.detail = detail


class RunCancelled(LeaseLost):
    """The run was cancelled while this worker held it. A LeaseLost: nothing was written."""

    def __init__(self, run_id: str) -> None:
        AgentrunError.__init__(self, f"run {run_id}: cancelled")
        self.run_id = run_id
        self.detail = "cancelled"


class RollbackRequested(AgentrunError):
    """The run may not succeed: a rollback was asked for (cancel --rollback, reject --abort) that
    its holder had not heard of. Nothing was written; the holder rolls the run back."""

    def __init__(self, run_id: str) -> None:
        super().__init__(f"run {run_id}: a rollback was requested")
        self.run_id = run_id


class DuplicateStep(AgentrunError):
    """(run_id, seq) already exists: another writer got there first."""

    def __init__(self, run_id: str, seq: int) -> None:
        super().__init__(f"run {run_id}: step {seq} already exists")
        self.run_id = run_id
        self.seq = seq


class RunUnsuccessful(AgentrunError):
    """A run awaited to succeed ended otherwise (failed, cancelled, dead_letter). ``run`` is the
    run as it ended: its ``status`` and ``error`` say why."""

    def __init__(self, run: Run) -> None:
        why = f": {run.error}" if run.error else ""
        super().__init__(f"run {run.id} ended {run.status}{why}")
        self.run = run


class WaitTimeout(AgentrunError, TimeoutError):
    """A wait for a run ran out of time; the run goes on. Also a :class:`TimeoutError`."""

    def __init__(self, run_id: str, status: str, timeout: float) -> None:
        super().__init__(
            f"run {run_id} is still {status} after {timeout:g} s (the wait timed out; the run "
            "goes on)"
        )
        self.run_id = run_id
        self.status = status
        self.timeout = timeout
