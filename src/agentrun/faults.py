"""Named fault points for crash tests. Off unless AGENTRUN_TEST_FAULTS is set.

``AGENTRUN_TEST_FAULTS="after_model_turn_commit@3,mid_model_stream@7"`` makes the process SIGKILL
itself at that point when the step's seq matches (``@*`` matches any seq; for the tool points the
seq is that of the model turn that asked for the call). Points:

* ``mid_model_stream``: the first event of a streamed model turn has arrived, nothing committed;
* ``after_model_turn_commit``: a model turn is committed, its tools not yet run (a pipelined
  pure turn's calls start once its append is sent: the point then fires once they have returned
  and the turn has landed, before its results' commit and the next model call, the same durable
  state, as pure calls leave nothing behind);
* ``after_intent_commit``: an irreversible call's intent (or an approved re-run's attempt) is
  committed, the tool not yet called;
* ``after_tool_return``: a tool returned, its result not yet recorded or committed (a pipelined
  pure turn's own append may still be in flight: sent, so it lands);
* ``after_tool_result_commit``: a tool_result step is committed (with overlap, the next turn's
  request may be out already; its turn is not committed).

With overlap (worker/executor.py) ``mid_model_stream`` waits, if need be, until the results before
that turn have landed, so it leaves the state it always did.
"""

from __future__ import annotations

import os
import signal

_ENV = "AGENTRUN_TEST_FAULTS"


def _armed() -> set[tuple[str, str]]:
    raw = os.environ.get(_ENV, "")
    out = set()
    for item in raw.split(","):
        item = item.strip()
        if item:
            point, _, seq = item.partition("@")
            out.add((point, seq or "*"))
    return out


_ARMED = _armed()


def armed(point: str, seq: int) -> bool:
    """Whether ``point`` is armed for ``seq`` (False in production)."""
    return bool(_ARMED) and ((point, str(seq)) in _ARMED or (point, "*") in _ARMED)


def crash_point(point: str, seq: int) -> None:
    """SIGKILL this process if ``point`` is armed for ``seq``. A no-op in production."""
    if armed(point, seq):
        os.kill(os.getpid(), signal.SIGKILL)
