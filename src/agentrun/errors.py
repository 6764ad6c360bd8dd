"""Errors that cross module boundaries. Each message is one line a user can act on."""

from __future__ import annotations


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


class DuplicateStep(AgentrunError):
    """(run_id, seq) already exists: another writer got there first."""

    def __init__(self, run_id: str, seq: int) -> None:
        super().__init__(f"run {run_id}: step {seq} already exists")
        self.run_id = run_id
        self.seq = seq
