"""Which wait a human decision answers.

A run stops for a human on one call of one step, at one stage: before an irreversible call
(``before_call``), or after one whose outcome is unknown (``outcome_unknown``, one wait per
execution attempt). A step may hold several such calls, and a call may wait more than once, so
the step number alone does not say which wait a decision was meant for: a second approver's
``approve=3``, set a moment after the first one's was taken, decided the step's NEXT call (or
the re-run of a call whose outcome was unknown) with nobody having looked at it.

A decision therefore names its wait as ``<seq>.<call>`` (before the call) or
``<seq>.<call>.<attempt>`` (the outcome-unknown wait on that attempt), the token
``.status.pendingApproval.decide``, ``agentrun get`` and the waiting Event show. A bare
``<seq>`` is still accepted while it cannot be a late decision: only until a decision on that
step is recorded (until then the run waits on the first wait it met on the step, whichever way
anyone looked at it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from agentrun.errors import ConfigError

#: Step numbers are bounded as the AgentRunApproval's seq is.
MAX_SEQ = 10**9
#: ASCII digits only: ``\d`` also matches other scripts' digits, which int() reads as numbers.
_TOKEN = re.compile(r"([0-9]{1,10})(?:\.([0-9]{1,10})(?:\.([0-9]{1,10}))?)?")


@dataclass(frozen=True)
class WaitRef:
    """A decision's target: step ``seq``; the call's index in that step's model turn (None: not
    named, a bare seq); the outcome-unknown attempt (None: the wait before the call)."""

    seq: int
    call: int | None = None
    attempt: int | None = None

    def __post_init__(self) -> None:
        if self.attempt is not None and self.call is None:
            raise ValueError("an attempt is named only with its call")

    @classmethod
    def parse(cls, text: str, what: str) -> WaitRef:
        """``<seq>``, ``<seq>.<call>`` or ``<seq>.<call>.<attempt>``; ConfigError naming
        ``what`` (the field or argument it came from) otherwise."""
        m = _TOKEN.fullmatch(text.strip())
        seq, call, attempt = (None, None, None) if m is None else (
            int(g) if g is not None else None for g in m.groups())
        if seq is None or any(p is not None and p > MAX_SEQ for p in (seq, call, attempt)) or (
                attempt is not None and attempt < 1):
            raise ConfigError(
                f"{what} must name the wait the run is stopped on as <seq>.<call> (or "
                f"<seq>.<call>.<attempt> after an unknown outcome), as .status.pendingApproval"
                f".decide and `agentrun get` show it, not {text!r}")
        return cls(seq, call, attempt)

    @classmethod
    def named_by(cls, value: int | str | WaitRef, what: str) -> WaitRef:
        """The wait ``value`` names: a WaitRef, a bare step number, or its text (parsed, a bad
        one refused naming ``what``)."""
        if isinstance(value, WaitRef):
            return value
        if isinstance(value, str):
            return cls.parse(value, what)
        # bool is an int: approve(run, True) reached the database as a step number.
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEQ:
            raise ConfigError(f"{what} must be a step number from 0 to {MAX_SEQ}, the wait's "
                              f"text (<seq>.<call>) or a WaitRef, not {value!r}")
        return cls(value)

    @classmethod
    def of(cls, pending: dict[str, Any]) -> WaitRef:
        """The wait a run's pending call (``Store.waited_on``) stands for."""
        unknown = pending.get("stage") == "outcome_unknown"
        # A wait always names its call (the executor's); 0 only for a hand-made pending call.
        return cls(int(pending["seq"]), int(pending.get("call_index") or 0),
                   int(pending.get("attempt") or 1) if unknown else None)

    @property
    def named(self) -> bool:
        """Whether the call is named (not a bare step number)."""
        return self.call is not None

    def answers(self, pending: dict[str, Any]) -> bool:
        """Whether this decision is about ``pending`` (Store.waited_on's call): its step, and,
        when named, its call, stage and attempt. A bare step number answers any wait of the step
        (Store.decide refuses it once the step had a decision)."""
        return self.seq == int(pending["seq"]) and (not self.named or self == WaitRef.of(pending))

    def __str__(self) -> str:
        return ".".join(str(p) for p in (self.seq, self.call, self.attempt) if p is not None)


def describe_wait(pending: dict[str, Any]) -> str:
    """``3.1 (send_email, before call)``: a pending call, as a refusal names it."""
    stage = str(pending.get("stage", "")).replace("_", " ")
    return f"{WaitRef.of(pending)} ({pending.get('tool')}, {stage})"
