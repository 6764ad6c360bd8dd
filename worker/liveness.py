"""What "a held run is making progress" means: the rule the heartbeat renews leases by.

A run progresses when it commits (every fenced write: a step, an effect, the prompt pin), and while
it is inside a model call or a tool call that is still within its own deadline: a long thinking
turn or a slow tool is work, not a stall. It is *stalled* once, for longer than the progress
budget, it has done neither: its task is wedged (a connection that died without a RST, an await
that never returns) or a call overran its deadline. A call that has no deadline of its own counts
as progress for one budget from its start. A run whose task has ended is never renewed.

The heartbeat renews only a run that progresses; a stalled one is abandoned with an error saying
why and its task is stopped, so another worker (or this one, once it is well) resumes it from its
last commit. /healthz fails while the worker holds runs and none of them progressed within the
budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

#: The default progress budget (AGENTRUN_PROGRESS_BUDGET, --progress-budget), in seconds: well
#: beyond any single commit; model and tool calls within their own deadlines never use it up.
DEFAULT_PROGRESS_BUDGET = 900.0


@dataclass(frozen=True)
class Activity:
    what: str  # "model call" | "tool NAME"
    started: float  # time.monotonic()
    deadline: float | None  # time.monotonic() by which the call must have ended, if it has one


@dataclass
class Progress:
    """One held run's progress clock (monotonic seconds)."""

    last: float = field(default_factory=time.monotonic)  # the claim, then every commit
    activity: Activity | None = None

    def committed(self) -> None:
        self.last = time.monotonic()

    def begin(self, what: str, deadline: float | None = None) -> None:
        """A model or tool call starts: progress until ``deadline`` (a monotonic time; None: one
        budget from now). Calls do not nest."""
        self.activity = Activity(what, time.monotonic(), deadline)

    def end(self) -> None:
        """The call ended. It was progress while it lasted (up to its deadline): the clock starts
        anew at its end, not at the commit before it."""
        a, self.activity = self.activity, None
        if a is not None:
            now = time.monotonic()
            self.last = max(self.last, now if a.deadline is None else min(now, a.deadline))

    @contextlib.contextmanager
    def working(self, what: str, deadline: float | None = None) -> Iterator[None]:
        """:meth:`begin` and :meth:`end` around a block."""
        self.begin(what, deadline)
        try:
            yield
        finally:
            self.end()

    def idle_for(self, now: float | None = None) -> float:
        """Seconds since the run last made progress (0 inside a call within its deadline)."""
        now = time.monotonic() if now is None else now
        good = self.last
        a = self.activity
        if a is not None:
            good = max(good, a.started if a.deadline is None else min(now, a.deadline))
        return max(0.0, now - good)

    def stalled(
        self, budget: float, task: asyncio.Task[None] | None, now: float | None = None
    ) -> str | None:
        """Why the run no longer earns a renewal (one line), or None while it progresses."""
        if task is not None and task.done():
            return "its task ended without letting the run go"
        idle = self.idle_for(now)
        if idle <= budget:
            return None
        a = self.activity
        where = (
            f"inside {a.what}, past its deadline" if a is not None and a.deadline is not None
            else f"inside {a.what}, which has no deadline" if a is not None
            else "since its last commit (its task is wedged: a dead connection, a hung await)"
        )
        return f"no progress for {idle:.0f}s, over the progress budget of {budget:g}s: {where}"
