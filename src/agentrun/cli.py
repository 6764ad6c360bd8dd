"""The ``agentrun`` command line.

Every command that touches the store finds the database through ``AGENTRUN_DATABASE_URL``, or the
embedded PostgreSQL when it is unset. Errors are one line on stderr and a non-zero exit:
2 for bad input or configuration, 3 when the database cannot be reached, 1 otherwise.
``agentrun wait`` and ``agentrun submit --wait`` also exit with the run's outcome
(:data:`WAIT_EXIT_CODES`, docs/cli.md): 0 when the awaited condition holds, 4 failed,
5 cancelled, 6 dead letter, 124 when ``--timeout`` ran out first.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import errno
import faulthandler
import io
import json
import logging
import os
import re
import secrets
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, NoReturn, TypeVar

import psycopg

from agentrun import __version__
from agentrun.cli_format import (
    age,
    describe_run,
    printable,
    run_to_json,
    short,
    step_line,
    step_to_json,
    summarize_payload,
    table,
    to_yaml,
)
from agentrun.config import (
    CONTROL_PORT_ENV,
    DATABASE_URL_ENV,
    DEFAULT_CONTROL_PORT,
    env_float,
    login_refused,
    redact_message,
    redact_url,
)
from agentrun.embedded import database_url
from agentrun.errors import (
    EXIT_INTERRUPTED,
    EXIT_TIMEOUT,
    AgentrunError,
    ConfigError,
    DatabaseUnavailable,
)
from agentrun.logs import POD_NAME_ENV, POOL_LOGGER, set_process_fields, setup_logging
from agentrun.manifests import load_manifests, one_run_per_key
from agentrun.migrations import migrate, schema_version
from agentrun.pricing import load_prices
from agentrun.schema import ensure_schema, open_store
from agentrun.store import (
    CHANNEL_RUN_CHANGED,
    CHANNEL_RUN_STEPS,
    DB_ERRORS,
    FOLLOWER_LEASE,
    MAX_LIST,
    ManifestName,
    Run,
    Store,
    check_connect,
    connect,
    parse_run_id,
)
from agentrun.tools import default_registry, load_tool_modules
from agentrun.vocabulary import RUN_STATUSES, TERMINAL, VERDICTS, RunStatus
from agentrun.waits import WaitRef
from agentrun.worker.settings import (
    WorkerSettings,
    check_settings,
    env_name,
    port_or_off,
)

# -- commands ------------------------------------------------------------------------------------


async def cmd_migrate(args: argparse.Namespace) -> int:
    url = database_url().url
    await check_connect(url)
    # No statement timeout: a migration may rewrite a big table (it holds an advisory lock).
    conn = await connect(url, statement_timeout=0)
    try:
        before = await schema_version(conn)
        result = await migrate(conn)
    finally:
        await conn.close()
    if result.applied:
        print(
            f"migrated {redact_url(url)} from version {before} to {result.version} "
            f"(applied {', '.join(f'{v:04d}' for v in result.applied)})"
        )
    else:
        print(f"schema already at version {result.version}; nothing to do")
    return 0


async def _open_store() -> Store:
    url, embedded = database_url(quiet=True)
    return await open_store(url, embedded=embedded, max_size=2)


async def cmd_runs(args: argparse.Namespace) -> int:
    if not 1 <= args.limit <= MAX_LIST:
        raise ConfigError(f"--limit {args.limit}: must be between 1 and {MAX_LIST} (default 100)")
    async with await _open_store() as store:
        runs = await store.list_runs(
            pool=args.pool, status=args.status, limit=args.limit, namespace=args.namespace
        )
    if args.output == "json":
        print(json.dumps([run_to_json(r) for r in runs], indent=2))
        return 0
    if args.output == "yaml":
        print(to_yaml([run_to_json(r) for r in runs]))
        return 0
    if args.output == "wide":
        wide = [
            [
                str(r.id),
                r.k8s_namespace or "-",
                r.k8s_name or "-",
                r.pool,
                r.status,
                str(r.next_seq),
                str(r.attempt),
                r.model,
                r.provider,
                f"{r.input_tokens}/{r.output_tokens}/{r.cache_read_tokens}/"
                f"{r.cache_write_tokens}",
                f"{r.cost_usd:.4f}",
                r.lease_owner or "-",
                age(r.created_at),
                short(r.wait_reason or r.error or r.result, 100),
            ]
            for r in runs
        ]
        headers = ["ID", "NAMESPACE", "NAME", "POOL", "STATUS", "STEP", "ATTEMPT", "MODEL",
                   "PROVIDER", "TOKENS(IN/OUT/CACHE-READ/CACHE-WRITE)", "COST(USD)", "WORKER",
                   "AGE", "MESSAGE"]
        print(table(headers, wide))
        return 0
    rows = [
        [
            str(r.id),
            r.k8s_name or "-",
            r.pool,
            r.status,
            str(r.next_seq),
            str(r.attempt),
            r.model,
            age(r.created_at),
            short(r.wait_reason or r.error or r.result, 50),
        ]
        for r in runs
    ]
    print(
        table(["ID", "NAME", "POOL", "STATUS", "STEP", "ATTEMPT", "MODEL", "AGE", "MESSAGE"], rows)
    )
    return 0


async def cmd_steps(args: argparse.Namespace) -> int:
    async with await _open_store() as store:
        run = await store.get_run(args.run)  # RunNotFound for an unknown id
        steps = await store.steps(run.id)
    if args.output == "json":
        print(json.dumps([step_to_json(s) for s in steps], indent=2))
        return 0
    if args.output == "yaml":
        print(to_yaml([step_to_json(s) for s in steps]))
        return 0
    wide = args.output == "wide"
    rows = [
        [
            str(s.seq),
            s.kind,
            s.created_at.strftime("%H:%M:%S.%f")[:-3],
            s.worker,
            str(s.lease_epoch),
            *([s.request_id or "-"] if wide else []),
            summarize_payload(s.payload),
        ]
        for s in steps
    ]
    print(f"run {run.id}: {run.status}, {len(steps)} steps, attempt {run.attempt}")
    headers = ["SEQ", "KIND", "TIME", "WORKER", "EPOCH", *(["REQUEST"] if wide else []), "SUMMARY"]
    print(table(headers, rows))
    if run.error and run.status != "succeeded":
        # Why it ended is not in any step (the worker records it on the run): said last, under
        # the steps that led to it; whole with -o wide.
        print(f"error: {printable(run.error) if wide else short(run.error, 300)}")
    return 0


# -- get, wait, logs ---------------------------------------------------------------------------

#: The exit code of ``agentrun wait`` / ``submit --wait`` for a run that ended otherwise than
#: awaited (the awaited end is 0), and for a ``--timeout`` that ran out (as coreutils timeout).
WAIT_EXIT_CODES: dict[RunStatus, int] = {"failed": 4, "cancelled": 5, "dead_letter": 6}
#: The values of ``--for``: "succeeded" (exit 0 only if the run succeeds) or "finished" (exit 0
#: whatever its end).
WAIT_FOR = ("succeeded", "finished")
#: After the LISTEN connection drops, how long before it is opened again (and the run re-read).
RELISTEN_DELAY = 1.0
#: ``logs -f`` hears of each new step by LISTEN on agentrun_run_steps, which an append notifies
#: only while the run has a follower (a NOTIFY in every append halves append throughput,
#: migrations 0001 and 0008): it registers itself in run_follower for FOLLOWER_LEASE seconds
#: (AGENTRUN_FOLLOW_LEASE), renews at a third of that, and deletes its row when it exits. It
#: also re-reads the log every FOLLOW_RESYNC seconds (AGENTRUN_FOLLOW_RESYNC) in case a
#: notification was lost: a step whose append began before the registration committed and
#: ended after the first read, or one committed while the LISTEN connection was down. The run's
#: end arrives on agentrun_run_changed.
FOLLOW_RESYNC_ENV = "AGENTRUN_FOLLOW_RESYNC"
FOLLOW_RESYNC = 5.0
FOLLOW_LEASE_ENV = "AGENTRUN_FOLLOW_LEASE"


def _print_run(
    run: Run, output: str, waited_on: dict[str, Any] | None = None, turns: int | None = None
) -> None:
    if output == "json":
        print(json.dumps(run_to_json(run), indent=2))
    elif output == "yaml":
        print(to_yaml(run_to_json(run)))
    else:
        print(describe_run(run, full=output == "wide", waited_on=waited_on, turns=turns))


async def cmd_get(args: argparse.Namespace) -> int:
    async with await _open_store() as store:
        run = await store.get_run(args.run)  # RunNotFound for an unknown id
        # The attempt `approve` would decide, as decide reads it (a wait may not name it).
        waited_on = await store.waited_on(run.id) if run.status == "waiting_approval" else None
        # What maxSteps counts, for the text views (-o json/yaml print the run's own columns).
        turns = await store.model_turns(run.id) if args.output in ("text", "wide") else None
    _print_run(run, args.output, waited_on, turns)
    return 0


#: Why :meth:`RunChanges.changed` woke: LISTEN was (re)established (anything may have changed),
#: the run changed (agentrun_run_changed), a step was appended (agentrun_run_steps).
Wake = Literal["listening", "run", "steps"]


class RunChanges:
    """Wakes whoever follows one run when it may have changed: once LISTEN on
    agentrun_run_changed is in place (and again after every reconnect: the re-check that covers
    what happened while nothing listened), and on every notification about the run. With
    ``steps``, it also listens on agentrun_run_steps (sent only for a followed run: see
    :meth:`Store.follow_run`)."""

    def __init__(self, store: Store, run_id: Any, *, steps: bool = False) -> None:
        self.store = store
        self.run_id = str(run_id)
        self.channels = [CHANNEL_RUN_CHANGED, *([CHANNEL_RUN_STEPS] if steps else [])]
        self._wake = asyncio.Event()
        self._why: set[Wake] = set()
        self._task: asyncio.Task[None] | None = None

    def _set(self, why: Wake) -> None:
        self._why.add(why)
        self._wake.set()

    async def __aenter__(self) -> RunChanges:
        self._task = asyncio.create_task(self._listen())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _listen(self) -> None:
        lost = False  # said once an outage, not at every attempt to listen again

        def listening() -> None:
            nonlocal lost
            lost = False
            self._set("listening")

        while True:
            try:
                async for n in self.store.listen(self.channels, on_listening=listening):
                    if n.channel == CHANNEL_RUN_STEPS:
                        if n.payload == self.run_id:
                            self._set("steps")
                        continue
                    payload = n.json()
                    if isinstance(payload, dict) and payload.get("id") == self.run_id:
                        self._set("run")
            except DB_ERRORS as exc:
                if not lost:
                    print(
                        f"agentrun: run {self.run_id}: lost the database's notifications "
                        f"({' '.join(str(exc).split())[:200]}); listening again",
                        file=sys.stderr,
                    )
                lost = True
            await asyncio.sleep(RELISTEN_DELAY)

    async def changed(self, within: float | None) -> frozenset[Wake]:
        """Wait up to ``within`` seconds (None: for ever) for a wake-up; what woke it (several
        at once if they came together), empty when nothing came in time."""
        assert self._task is not None, "use RunChanges as an async context manager"
        waiter = asyncio.ensure_future(self._wake.wait())
        try:
            done, _ = await asyncio.wait(
                {waiter, self._task}, timeout=within, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            waiter.cancel()
        if self._task in done:  # the listener died of something it does not retry
            self._task.result()
        if waiter not in done:
            return frozenset()
        self._wake.clear()  # before the caller re-reads: a change after this wakes it again
        why = frozenset(self._why)
        self._why.clear()
        return why


T = TypeVar("T")


class Rereads:
    """A follower's re-reads through a database restart: the pool hands out a connection the
    restart killed (once each), which ended `wait` and `logs -f` with exit 3 while the run went
    on. A failed read is said once and tried again soon; the LISTEN side reconnects by itself."""

    def __init__(self, run_id: Any) -> None:
        self.run_id = run_id
        self.failing = False

    def wait(self, wait: float | None) -> float | None:
        """How long to wait for a wake-up: no longer than a moment while reads fail."""
        return wait if not self.failing else min(wait or RELISTEN_DELAY, RELISTEN_DELAY)

    async def read(self, fn: Callable[[], Coroutine[Any, Any, T]]) -> tuple[bool, T | None]:
        """``fn()``'s value, or (False, None) when the database did not answer."""
        try:
            value = await fn()
        except BrokenPipeError:
            # The reader went away (`| head -1`): an OSError, so one of DB_ERRORS, and it was
            # "tried again" every few seconds for ever. main() exits 141 on it.
            raise
        except DB_ERRORS as exc:
            if not self.failing:
                print(f"agentrun: run {self.run_id}: cannot read it "
                      f"({' '.join(str(exc).split())[:200]}); trying again", file=sys.stderr)
            self.failing = True
            return False, None
        self.failing = False
        return True, value


async def wait_for_end(
    store: Store, run_id: Any, within: float | None, *, tick: float | None = None,
    on_tick: Callable[[], Coroutine[Any, Any, None]] | None = None,
) -> Run | None:
    """The run once it has ended, or None when ``within`` seconds passed first (None: no
    limit). The run is
    re-read when a notification about it arrives (and when LISTEN is (re)established), not on a
    poll; ``on_tick`` runs every ``tick`` seconds and after every re-read."""
    loop = asyncio.get_running_loop()
    deadline = None if within is None else loop.time() + within
    reads = Rereads(run_id)
    async with RunChanges(store, run_id) as changes:
        while True:
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return None
            wait = remaining if tick is None else min(tick, remaining or tick)
            woken = await changes.changed(reads.wait(wait))
            run = None
            if woken or reads.failing:
                _, run = await reads.read(lambda: store.get_run(run_id))
            if on_tick is not None:
                await on_tick()
            if run is not None and run.finished:
                return run


def _wait_code(run: Run | None, awaited: str) -> int:
    if run is None:
        return EXIT_TIMEOUT
    if run.status == "succeeded" or awaited == "finished":
        return 0
    return WAIT_EXIT_CODES[run.status]


def _end_line(run: Run) -> str:
    what = run.result if run.status == "succeeded" else run.error
    said = what and what != run.status  # not "cancelled: cancelled"
    return f"run {run.id} {run.status}" + (f": {short(what, 200)}" if said else "")


#: The longest a command waits on anything but a run (a drain, a decision through Kubernetes):
#: a week, as the longest tool timeout. Past what a clock or a socket takes, a huge or infinite
#: value was a traceback.
MAX_WAIT_SECONDS = 7 * 24 * 3600.0


def _check_seconds(what: str, value: float, low: float = 0.0,
                   high: float = MAX_WAIT_SECONDS) -> None:
    """``value`` (seconds, named ``what``) must be finite and in (low, high]: one line, exit 2,
    before anything is sent."""
    if not low < value <= high:  # NaN compares false
        sep = "" if what.endswith("=") else " "  # a flag's value, or a variable's
        raise ConfigError(f"{what}{sep}{value:g}: must be more than {low:g} and at most "
                          f"{high:g} seconds")


def _check_timeout(timeout: float | None) -> None:
    if timeout is not None and not timeout > 0:
        raise ConfigError(
            f"--timeout {timeout:g}: must be more than 0 seconds (leave it out to wait as long "
            "as the run takes)"
        )


async def cmd_wait(args: argparse.Namespace) -> int:
    _check_timeout(args.timeout)
    rid = parse_run_id(args.run)
    async with await _open_store() as store:
        await store.get_run(rid)  # RunNotFound at once, not at the timeout
        run = await wait_for_end(store, rid, args.timeout)
        turns = await store.model_turns(rid) if run is not None and args.output == "wide" else None
    if run is None:
        print(
            f"agentrun: error: run {rid} has not ended after {args.timeout:g}s (--timeout)",
            file=sys.stderr,
        )
        return EXIT_TIMEOUT
    if args.output == "text":
        print(_end_line(run))
    else:
        _print_run(run, args.output, turns=turns)
    return _wait_code(run, args.awaited)


@contextlib.asynccontextmanager
async def _following(store: Store, run_id: Any, lease: float) -> AsyncIterator[None]:
    """Registered as a follower of the run (so its appends notify) for as long as the block
    runs: renewed at a third of ``lease``, deleted at the end."""
    follower = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"

    async def renew() -> None:
        failing = False  # said once an outage, not at every renewal
        while True:
            await asyncio.sleep(lease / 3)
            try:
                await store.follow_run(run_id, follower, lease)
                failing = False
            except DB_ERRORS as exc:
                if not failing:  # steps still come, from the re-read every FOLLOW_RESYNC
                    print(
                        f"agentrun: run {run_id}: cannot renew the follow of its steps "
                        f"({' '.join(str(exc).split())[:200]}); trying again",
                        file=sys.stderr,
                    )
                failing = True

    task: asyncio.Task[None] | None = None
    try:
        # Inside the try: a SIGTERM may cancel this while the registration's answer is on its
        # way, after the row committed (CI saw that row left behind).
        await store.follow_run(run_id, follower, lease)
        task = asyncio.create_task(renew())
        yield
    finally:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        # Left behind (the database is down, or a SIGKILL): it expires after ``lease``. Not
        # waited for longer than UNFOLLOW_WAIT: with the database down, the pool's wait for a
        # connection (30 s) held a Ctrl-C or a SIGTERM that long (found by a review).
        with contextlib.suppress(psycopg.Error, OSError, TimeoutError):
            async with asyncio.timeout(UNFOLLOW_WAIT):
                await store.unfollow_run(run_id, follower)


#: How long a follower ending (its run over, a signal) tries to take its row back, in seconds.
UNFOLLOW_WAIT = 1.0


def follow_settings() -> tuple[float, float]:
    """(resync, lease) of a follower, from the environment, checked: a tiny resync re-read the
    log in a busy loop, an infinite lease was a traceback."""
    resync = env_float(FOLLOW_RESYNC_ENV, FOLLOW_RESYNC)
    lease = env_float(FOLLOW_LEASE_ENV, FOLLOWER_LEASE)
    _check_seconds(f"{FOLLOW_RESYNC_ENV}=", resync, low=0.05, high=24 * 3600.0)
    _check_seconds(f"{FOLLOW_LEASE_ENV}=", lease, low=1.0, high=24 * 3600.0)
    return resync, lease


async def _follow(
    store: Store, run_id: Any, more: Callable[[], Coroutine[Any, Any, None]]
) -> Run:
    """Print the run's steps as they commit (``more``) until it ends; the run at its end."""
    resync, lease = follow_settings()
    reads = Rereads(run_id)
    async with _following(store, run_id, lease), RunChanges(store, run_id, steps=True) as ch:
        while True:
            why = await ch.changed(reads.wait(resync))
            if why == {"steps"} and not reads.failing:  # only new steps: the run is still live
                await reads.read(more)
                continue
            # The run read before the steps: none come after its end.
            read, run = await reads.read(lambda: store.get_run(run_id))
            if read and (await reads.read(more))[0] and run is not None and run.finished:
                return run


async def cmd_logs(args: argparse.Namespace) -> int:
    rid = parse_run_id(args.run)
    if args.follow:
        follow_settings()  # a bad setting is said before anything is read

    def show(steps: Sequence[Any]) -> None:
        for s in steps:
            if args.output == "json":  # JSON Lines: one step an object a line, as it commits
                print(json.dumps(step_to_json(s)))  # ASCII, as every -o json: valid in any encoding
            else:
                print(step_line(s, wide=args.output == "wide"))
        sys.stdout.flush()

    async with await _open_store() as store:
        await store.get_run(rid)  # RunNotFound
        printed = 0

        async def more() -> None:
            nonlocal printed
            steps = await store.steps_from(rid, printed)
            if steps:
                show(steps)
                printed = steps[-1].seq + 1

        await more()
        if not args.follow:
            return 0
        # SIGTERM ends the follow as Ctrl-C does, through the finally blocks that delete the
        # follower row.
        run = await _cancelled_by_sigterm(_follow(store, rid, more))
        if run is None:
            return EXIT_SIGTERM
    print(_end_line(run), file=sys.stderr)
    return 0


#: The exit code of a command SIGTERM ended (as a shell reports a process killed by it).
EXIT_SIGTERM = 128 + signal.SIGTERM


async def _cancelled_by_sigterm(work: Coroutine[Any, Any, T]) -> T | None:
    """``work``'s value, or None when SIGTERM came first: it cancels ``work`` as Ctrl-C does
    (asyncio.run cancels the task on SIGINT by itself), so its clean-up runs."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    terminated = False

    def on_sigterm() -> None:
        nonlocal terminated
        terminated = True
        task.cancel()

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    try:
        return await work
    except asyncio.CancelledError:
        if not terminated:
            raise
        return None
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


def _talks_to_kubernetes(args: argparse.Namespace) -> bool:
    return bool(args.kube or args.namespace or args.kubeconfig or args.context)


async def _decide_in_kubernetes(args: argparse.Namespace, wait: WaitRef) -> int:
    """``approve``/``reject`` as an AgentRunApproval: RUN is the AgentRun's name, the approver
    the user the API server authenticates the kubeconfig's credentials as."""
    from agentrun.kubeapprovals import AsyncKubeApprovals

    if args.by:
        raise ConfigError(
            "--by: with --kube the approver is the user the API server authenticates (your "
            "kubeconfig's credentials), not a name given here; drop --by")
    if getattr(args, "abort", False):
        raise ConfigError("--abort is not available with --kube: reject it without --abort, "
                          "or cancel the AgentRun (agentrun.dev/cancel) to end it")
    # Before anything is created: a bad one made the approval, then exited 124 or crashed.
    _check_seconds("--timeout", args.timeout)
    decision: Literal["approve", "reject"] = "approve" if args.command == "approve" else "reject"
    async with AsyncKubeApprovals(kubeconfig=args.kubeconfig, context=args.context,
                                  namespace=args.namespace) as kube:
        outcome = await kube.decide(args.run, wait, decision, reason=args.reason,
                                    timeout=args.timeout)
    print(f"agentrunapproval/{outcome.name} in {outcome.namespace}: {outcome.phase}: "
          f"{printable(outcome.message)}")
    return 0


def unreachable(exc: psycopg.OperationalError) -> bool:
    """Whether ``exc`` says the database could not be reached or went away: no SQLSTATE (libpq
    failed to connect, or lost the connection), class 08 (connection exception) or 57P01-57P03
    (the server shutting down or starting). psycopg raises other server errors of the same
    class too: a program limit (class 54), a query cancelled by statement_timeout (57014)."""
    state = exc.sqlstate
    return state is None or state.startswith("08") or state in ("57P01", "57P02", "57P03")


async def cmd_decide(args: argparse.Namespace) -> int:
    wait = WaitRef.parse(args.seq, "WAIT")
    if _talks_to_kubernetes(args):
        return await _decide_in_kubernetes(args, wait)
    decision = VERDICTS["approve" if args.command == "approve" else "reject"]
    by = args.by or os.environ.get("USER") or "cli"
    abort = bool(getattr(args, "abort", False))
    async with await _open_store() as store:
        call = await store.decide(
            args.run, wait, decision, decided_by=by, reason=args.reason, abort=abort
        )
    rid = parse_run_id(args.run)  # as the store read it, not as typed (urn:uuid:..., {...})
    # --by is anyone's text: escaped on this one line (its newlines too), as every other view of
    # a run shows it; raw, it could clear the screen or forge a line of this output.
    by = printable(by).replace("\n", "\\n").replace("\t", "\\t")
    decided = WaitRef.of(call)  # the wait as the store recorded it, also for a bare seq
    if abort:
        print(
            f"run {rid}: {call['tool']} (step {decided.seq} call {decided.call}) rejected by "
            f"{by}; the run rolls back its compensable effects and fails"
        )
        return 0
    stage = str(call["stage"]).replace("_", " ")
    if call["stage"] == "outcome_unknown":  # each decision is about one attempt of the call
        stage += f", attempt {int(call['attempt'])}"  # the one decide recorded
    print(
        f"run {rid}: {call['tool']} (step {decided.seq} call {decided.call}, {stage}) "
        f"{decision} by {by}; the run resumes on the next claim"
    )
    return 0


async def cmd_cancel(args: argparse.Namespace) -> int:
    async with await _open_store() as store:
        if args.rollback:
            run, changed = await store.request_rollback(args.run, "cancelled", args.reason)
        else:
            run, changed = await store.cancel(args.run, reason=args.reason)
    if changed and args.rollback:
        # The end the run's rollback stored: cancelled, unless this request resumed an earlier
        # rollback an older worker had parked behind an approval (that one's end stands).
        print(f"run {run.id}: rollback requested; its compensations run, then it ends "
              f"{run.rollback_end or 'cancelled'}")
        return 0
    if changed:
        print(f"run {run.id} cancelled")
        return 0
    if run.rolling_back and args.rollback:
        print(
            f"run {run.id} is rolling back already ({printable(run.rollback_reason or '')}); "
            f"its compensations run, then it ends {run.rollback_end or 'failed'}; this request "
            "was not recorded",
            file=sys.stderr,
        )
        return 1
    if run.rolling_back:
        print(
            f"run {run.id} is rolling back ({printable(run.rollback_reason or '')}); a cancel "
            "does not interrupt a rollback: its compensations run, then it ends",
            file=sys.stderr,
        )
        return 1
    if args.rollback and run.status == "dead_letter":
        print(
            f"run {run.id} was dead-lettered in the middle of its rollback "
            f"({printable(run.rollback_reason)}); `agentrun retry {run.id}` resumes it"
            if run.rollback_reason is not None
            else f"run {run.id} was dead-lettered with nothing to roll back (no compensable "
            "effect of it is left undone)",
            file=sys.stderr,
        )
        return 1
    print(f"run {run.id} already finished ({run.status}); nothing to cancel", file=sys.stderr)
    return 1


# -- retry, restart, prune (issue 14) -------------------------------------------------------------


async def cmd_retry(args: argparse.Namespace) -> int:
    async with await _open_store() as store:
        run = await store.retry(args.run, reason=args.reason)  # ConfigError: refused, exit 2
    # The reasons are people's and tools' text: escaped, as every other view of a run shows them.
    print(printable(f"run {run.id}: retry {run.retries} ({run.retry_reason or 'no reason given'}); "
                    f"{run.retried_as()}"))
    return 0


async def cmd_restart(args: argparse.Namespace) -> int:
    async with await _open_store() as store:
        run = await store.restart(args.run)
    print(run.id)  # the new run's id, alone on its line (scripts read it)
    return 0


_DURATION = re.compile(r"(\d+)([smhdw])")
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> timedelta:
    """``90s``, ``15m``, ``12h``, ``30d``, ``2w`` or a sum of them (``1d12h``)."""
    parts = _DURATION.findall(text)
    if not text or "".join(n + u for n, u in parts) != text:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration: a number and a unit s, m, h, d or w (e.g. 30d, 12h)"
        )
    seconds = sum(int(n) * _DURATION_UNITS[u] for n, u in parts)
    # Bounded by the calendar: anything older than year 1 is no cutoff (it was a traceback).
    if seconds > MAX_DURATION.total_seconds():
        raise argparse.ArgumentTypeError(
            f"{text!r} is too long: at most {MAX_DURATION.days // 7}w (about 1,000 years)")
    return timedelta(seconds=seconds)


#: The longest duration the CLI takes: a cutoff that far back is still a date.
MAX_DURATION = timedelta(weeks=52_000)


#: Runs per prune batch: 100 runs of 1,000 steps delete in about 0.8 s here, far inside the
#: statement timeout, and a longer log per run still fits.
PRUNE_BATCH = 100
#: The most runs a prune batch takes: short batches are the point (each is one transaction).
MAX_PRUNE_BATCH = 10_000

#: The statuses agentrun prune deletes by default: every finished one.
PRUNABLE = TERMINAL


async def cmd_prune(args: argparse.Namespace) -> int:
    if not 1 <= args.batch <= MAX_PRUNE_BATCH:  # past a bigint, a database error's traceback
        raise ConfigError(f"--batch {args.batch}: must be between 1 and {MAX_PRUNE_BATCH} "
                          f"(default {PRUNE_BATCH})")
    statuses = args.status or list(PRUNABLE)
    cutoff = datetime.now(UTC) - args.older_than
    what = f"{'/'.join(statuses)} runs finished before {cutoff.isoformat(timespec='seconds')}"
    async with await _open_store() as store:
        if args.dry_run:
            runs, steps = await store.prune_preview(cutoff, statuses)
            print(f"dry run: would delete {runs} {what}, with {steps} steps")
            return 0
        totals = [0, 0, 0, 0]
        n = 0
        while True:
            done = await store.prune_batch(cutoff, statuses, args.batch)
            if done.runs == 0:
                break
            n += 1
            for i, v in enumerate((done.runs, done.steps, done.effects, done.approvals)):
                totals[i] += v
            print(
                f"batch {n}: deleted {done.runs} runs, {done.steps} steps, {done.effects} "
                f"effects, {done.approvals} approvals ({totals[0]} runs so far)",
                flush=True,
            )
    print(
        f"pruned {totals[0]} {what}: {totals[1]} steps, {totals[2]} effects, "
        f"{totals[3]} approvals in {n} batches"
    )
    return 0


#: The namespace of a run submitted from a manifest that names none (as kubectl apply does in a
#: context without one).


async def cmd_submit(args: argparse.Namespace) -> int:
    _check_timeout(args.timeout)
    if args.timeout is not None and not args.wait:
        raise ConfigError("--timeout: only with --wait (how long to wait for the runs to end)")
    resolved = load_manifests(args.filename)
    one_run_per_key(resolved, args.idempotency_key, "--idempotency-key")
    async with await _open_store() as store:
        created: list[tuple[str, Run]] = []
        for r in resolved:
            run, _ = await store.create_run(
                r.task,
                r.agent,
                pool=r.pool,
                max_steps=r.max_steps,
                max_attempts=r.max_attempts,
                external_key=args.idempotency_key,
                name=ManifestName.of(r.namespace, r.name),
            )
            created.append((r.name, run))
            if args.output == "json" and not args.wait:
                print(json.dumps({"name": r.name, "id": str(run.id), "pool": run.pool}))
            elif args.output == "id":
                print(run.id, flush=True)  # at once: a script reads it while the run goes on
        if not args.wait:
            return 0
        loop = asyncio.get_running_loop()
        deadline = None if args.timeout is None else loop.time() + args.timeout
        code = 0
        for name, run in created:  # one deadline for them all
            left = None if deadline is None else max(deadline - loop.time(), 0.001)
            ended = await wait_for_end(store, run.id, left)
            this = _wait_code(ended, args.awaited)
            code = code or this
            if args.output == "json":
                out = run_to_json(ended or await store.get_run(run.id))
                print(json.dumps({"name": name, "id": str(run.id), "pool": run.pool,
                                  **{k: out[k] for k in ("status", "result", "error")}}))
            if ended is None:
                print(f"agentrun: error: run {run.id} has not ended after {args.timeout:g}s "
                      "(--timeout)", file=sys.stderr)
            elif args.output == "id":
                print(_end_line(ended), file=sys.stderr)
    return code


#: Where the servers bind: the worker's health server (WorkerSettings.health_host), the
#: operator's (OperatorSettings.health_host) and prometheus_client's start_http_server.
LISTEN_HOST = "0.0.0.0"


def check_ports(ports: Sequence[tuple[str, str, int | None]], host: str = LISTEN_HOST) -> None:
    """Bind each (option, env var, port) as its server will, then let it go.

    A taken port used to surface only once the server started: a traceback (the worker, kopf's
    liveness endpoint) or, for the operator's metrics, a startup handler that kopf retried every
    minute while the operator handled nothing. Checked first, it is one line and exit 2 before
    anything starts. None (-1, off) and 0 (any free port) cannot be taken."""
    seen: dict[int, str] = {}
    for option, env, port in ports:
        if not port:
            continue
        setting = f"{option} {port} ({env})"
        if port in seen:
            raise ConfigError(f"{setting} is also {seen[port]}; choose another port")
        seen[port] = option
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            # As aiohttp and http.server do: a port left in TIME_WAIT by a previous process is
            # free to them, so it must not count as taken here.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
                sock.listen(1)
            except OverflowError:
                raise ConfigError(
                    f"{setting} is not a port; choose 1-65535, 0 for any, -1 to turn it off"
                ) from None
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise ConfigError(
                        f"{setting} is already in use on {host}; free it or choose another "
                        "port (-1 turns it off)"
                    ) from None
                reason = os.strerror(exc.errno).lower() if exc.errno else str(exc)
                raise ConfigError(
                    f"{setting}: cannot listen on {host} ({reason}); choose another port "
                    "(-1 turns it off)"
                ) from None


#: ``agentrun worker``'s flags that override a WorkerSettings field of the same name (the rest
#: are handled by hand in worker_settings).
_WORKER_FLAGS = ("pool", "concurrency", "lease_ttl", "poll_interval", "idle_interval",
                 "drain_grace", "liveness_threshold", "progress_budget", "tool_timeout",
                 "worker_id", "model_transport")


def worker_settings(args: argparse.Namespace) -> WorkerSettings:
    """WorkerSettings.from_env (the defaults and AGENTRUN_*), with what the flags given say."""
    settings = WorkerSettings.from_env()
    overrides: dict[str, Any] = {
        name: getattr(args, name) for name in _WORKER_FLAGS if getattr(args, name) is not None
    }
    for name in ("health_port", "control_port"):
        if getattr(args, name) is not None:
            overrides[name] = port_or_off(getattr(args, name))
    if args.model_retries is not None or args.model_deadline is not None:
        overrides["retry"] = dataclasses.replace(
            settings.retry,
            **{k: v for k, v in (("max_retries", args.model_retries),
                                 ("deadline", args.model_deadline)) if v is not None},
        )
    if args.prices is not None:
        overrides["prices"] = load_prices(args.prices)
    if args.tools is not None:
        overrides["tools"] = tuple(args.tools)
    return dataclasses.replace(settings, **overrides)


async def cmd_worker(args: argparse.Namespace) -> int:
    from agentrun.worker.process import (
        CONTROL_HOST,
        Worker,
        exit_past_lingering_threads,
        until_store,
    )
    from agentrun.worker.providers import (
        Providers,
        freeze_startup_objects,
        import_sdk_in_background,
    )
    from agentrun.worker.tracing import setup_tracing, shutdown_tracing

    setup_logging(args.log_format, args.log_level)
    # kill -USR1 <pid> prints every thread's stack: for a worker that seems stuck.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    settings = worker_settings(args)
    # Every line from here on says which worker, pool and pod it came from (JSON fields).
    set_process_fields(
        worker=settings.worker_id, pool=settings.pool, pod=os.environ.get(POD_NAME_ENV)
    )
    # Before the tools, the database and the first claim: a bad setting or a taken port stops
    # nothing midway.
    check_settings(settings)
    check_ports([("--health-port", "AGENTRUN_HEALTH_PORT", settings.health_port)])
    check_ports([("--control-port", CONTROL_PORT_ENV, settings.control_port)], host=CONTROL_HOST)
    loaded = load_tool_modules(settings.tools)
    tracer_provider = setup_tracing(worker_id=settings.worker_id)  # None unless OTEL_* ask
    # Each provider's client is made when a run first needs it (a bedrock-only pool needs no
    # Anthropic key).
    client = Providers(traced=tracer_provider is not None, transport=settings.model_transport)
    # About 2 s of CPU to import the SDK: in a thread, off the way to the first claim
    # (worker/providers.py). Started once this process's own imports are done (they share one
    # GIL): it runs while the worker waits on the database, and a run claimed before it ends
    # waits only for the rest of it. Then its objects are frozen, on this loop's thread.
    loop = asyncio.get_running_loop()

    def imported() -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: the worker is gone
            loop.call_soon_threadsafe(freeze_startup_objects)

    import_sdk_in_background(imported)
    url, embedded = database_url()

    def open_store() -> Coroutine[Any, Any, Store]:
        # Store.open's own connection check is the start-up's one: a refused connection is
        # the same one line (exit 3), a refused login exit 2.
        return Store.open(url, max_size=settings.concurrency + 3, lease_ttl=settings.lease_ttl)

    # The embedded server was started by database_url(): it answers, or that is an error at
    # once. Any other may start after us (a fresh install): wait for it.
    store = await open_store() if embedded else await until_store(open_store)
    if store is None:
        return 0  # SIGTERM while waiting
    if loaded:
        logging.getLogger("agentrun.worker").info("tools: %s", ", ".join(loaded))
    try:
        if embedded:  # nobody else migrates it; any other database the worker waits for
            await ensure_schema(url, auto=True)  # (alive and not ready: Worker.serve)
        worker = Worker(store, client, default_registry, settings,
                        tracer_provider=tracer_provider)
        worker.install_signal_handlers()
        await worker.serve()
    finally:
        await store.pool.close(timeout=5)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(client.close(), 5)
        # The last spans (the drain's releases) are exported before the process exits; bounded,
        # so an unreachable collector cannot hold a drained worker past its grace period.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.to_thread(shutdown_tracing, tracer_provider), 5)
    await exit_past_lingering_threads(0)
    return 0


async def cmd_drain_local(args: argparse.Namespace) -> int:
    """The worker pod's preStop hook, run inside the container: ask this pod's worker to drain
    over its loopback-only control port and wait for the answer (sent once no run is held)."""
    from agentrun.worker.process import CONTROL_HOST

    if not 1 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port}: must be the worker's --control-port, between 1 "
                          f"and 65535 ({CONTROL_PORT_ENV})")
    _check_seconds("--timeout", args.timeout)
    url = f"http://{CONTROL_HOST}:{args.port}/drain"
    try:
        status, body = await asyncio.to_thread(_post, url, args.timeout)
    except TimeoutError:
        raise AgentrunError(
            f"{url}: no answer within {args.timeout:g}s (--timeout); the worker is still "
            "draining or is stuck"
        ) from None
    except OSError as exc:
        reason = getattr(exc, "reason", exc)
        raise AgentrunError(
            f"cannot reach the worker's drain endpoint {url} ({reason}); is a worker running "
            f"here with --control-port {args.port} ({CONTROL_PORT_ENV})?"
        ) from None
    if status != 200:
        raise AgentrunError(f"{url} answered {status}: {body}")
    print(f"drained: {json.loads(body).get('released', 0)} run(s) handed back")
    return 0


def _post(url: str, timeout: float) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


async def cmd_operator(args: argparse.Namespace) -> int:
    import dataclasses

    import kopf

    from agentrun.operator.handlers import build_registry
    from agentrun.operator.settings import OperatorSettings, load_pools

    setup_logging(args.log_format, args.log_level)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # The database URL comes after the port check: resolving it may start the embedded server.
    settings = OperatorSettings.from_env(database_url="")
    overrides: dict[str, Any] = {}
    if args.pools_file:
        overrides["pools"] = load_pools(args.pools_file)
    if args.namespace:
        overrides["namespaces"] = args.namespace
    if args.no_migrate:
        overrides["migrate"] = False
    if args.metrics_port is not None:
        overrides["metrics_port"] = None if args.metrics_port < 0 else args.metrics_port
    if args.health_port is not None:
        overrides["health_port"] = None if args.health_port < 0 else args.health_port
    settings = dataclasses.replace(settings, **overrides)
    # Before kopf starts (it binds the health port, the startup handler the metrics port) and
    # before anything reaches Kubernetes or PostgreSQL.
    check_ports(
        [
            ("--health-port", "AGENTRUN_HEALTH_PORT", settings.health_port),
            ("--metrics-port", "AGENTRUN_METRICS_PORT", settings.metrics_port),
        ]
    )
    settings = dataclasses.replace(settings, database_url=database_url().url)
    log = logging.getLogger("agentrun.operator")
    log.info(
        "operator: %s, pools %s, database %s",
        f"namespaces {', '.join(settings.namespaces)}" if settings.namespaces else "all namespaces",
        ", ".join(f"{p.pool}->{p.namespace}/{p.deployment}" for p in settings.pools) or "none",
        redact_url(settings.database_url),
    )
    # The health port (/healthz, /readyz) is served by the operator itself (operator/health.py),
    # not by kopf's liveness endpoint, which has one path and knows nothing of readiness.
    settings = dataclasses.replace(settings, health_host=LISTEN_HOST)
    # One replica, standalone (no kopf peering): see docs/operator.md for the trade-off.
    try:
        await kopf.operator(
            registry=build_registry(settings),
            standalone=True,
            clusterwide=not settings.namespaces,
            namespaces=settings.namespaces,
        )
    except Exception as exc:
        # A startup handler that turns a ConfigError (the metrics port taken since the check)
        # into kopf.PermanentError stops kopf with ActivityError <- PermanentError <-
        # ConfigError: that is still one line and exit 2, not kopf's traceback.
        cause: BaseException | None = exc
        while cause is not None and not isinstance(cause, ConfigError):
            cause = cause.__cause__
        if cause is None:
            raise
        raise cause from None
    return 0


#: ``agentrun demo --timeout``: the whole demo's deadline (it takes about 30 s).
DEMO_TIMEOUT = 300.0


async def cmd_demo(args: argparse.Namespace) -> int:
    from agentrun.demo import run_demo

    if not args.timeout > 0:
        raise ConfigError(f"--timeout {args.timeout:g}: must be more than 0 seconds")
    # SIGTERM (kill, timeout(1), a cancelled CI job) stops its workers and removes its files as
    # Ctrl-C does; it once left a worker running for ever and the temporary directory behind.
    code = await _cancelled_by_sigterm(run_demo(model=args.model, deadline=args.timeout))
    return EXIT_SIGTERM if code is None else code


def cmd_fake_anthropic(argv: list[str]) -> int:
    from agentrun.fake_anthropic import main as fake_main

    return fake_main(argv)


# -- wiring --------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """A parser whose errors are one line (argparse's message, which lists the valid values of
    a choice, and where the help is), exit 2: not the usage block and then the message."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {one_line(message)}; see {self.prog} --help\n")


class _SubParser(_Parser):
    """A command's parser: its help says every option's default and valid values."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

AsyncCommand = Callable[[argparse.Namespace], Coroutine[Any, Any, int]]


def build_parser(worker_env: WorkerSettings | None = None) -> argparse.ArgumentParser:
    """``worker_env``: what ``agentrun worker`` would use without flags (default: read now, so a
    malformed AGENTRUN_* setting is a one-line error whatever the command)."""
    if worker_env is None:
        worker_env = WorkerSettings.from_env(prices=False)
    p = _Parser(
        prog="agentrun",
        description="Durable execution for long-running LLM agents. The database is "
        "AGENTRUN_DATABASE_URL, or an embedded PostgreSQL when it is unset.",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"agentrun {__version__}")
    sub = p.add_subparsers(
        dest="command", metavar="COMMAND", required=True, parser_class=_SubParser
    )

    s = sub.add_parser("migrate", help="create or upgrade the schema (safe to run concurrently)")
    s.set_defaults(func=cmd_migrate)

    s = sub.add_parser("runs", help="list runs, newest first")
    s.add_argument("-o", "--output", choices=LIST_OUTPUTS, default="table", help=OUTPUT_HELP)
    s.add_argument("--pool", help="only runs of this worker pool")
    s.add_argument("--status", choices=RUN_STATUSES, help="only runs in this status")
    s.add_argument(
        "--namespace",
        help="only runs of this namespace (the AgentRun's, or the submitted manifest's)",
    )
    s.add_argument("--limit", type=int, default=100, help=f"list at most this many (1-{MAX_LIST})")
    s.set_defaults(func=cmd_runs)

    s = sub.add_parser("steps", help="show a run's step log")
    s.add_argument("run", help="run id")
    s.add_argument("-o", "--output", choices=LIST_OUTPUTS, default="table", help=OUTPUT_HELP)
    s.set_defaults(func=cmd_steps)

    s = sub.add_parser(
        "get", help="show one run: status, error, pending approval, tokens, attempt, worker"
    )
    s.add_argument("run", help="run id")
    s.add_argument(
        "-o", "--output", choices=GET_OUTPUTS, default="text",
        help="text: one field a line; wide: the same with the task, result and error whole",
    )
    s.set_defaults(func=cmd_get)

    s = sub.add_parser(
        "wait",
        help="wait for a run to end; exit 0 when it ends as awaited, 4 failed, 5 cancelled, "
        f"6 dead letter, {EXIT_TIMEOUT} on --timeout",
    )
    s.add_argument("run", help="run id")
    _wait_options(s)
    s.add_argument(
        "-o", "--output", choices=GET_OUTPUTS, default="text",
        help="text: one line with the result or error; else the run, as agentrun get prints it",
    )
    s.set_defaults(func=cmd_wait)

    s = sub.add_parser(
        "logs", help="print a run's steps; with -f follow them as they commit until it ends"
    )
    s.add_argument("run", help="run id")
    s.add_argument(
        "-f", "--follow", action="store_true",
        help="keep printing steps as they are committed; return when the run ends",
    )
    s.add_argument(
        "-o", "--output", choices=("text", "wide", "json"), default="text",
        help="text: a summary a step; wide: the whole payload; json: JSON Lines",
    )
    s.set_defaults(func=cmd_logs)

    s = sub.add_parser(
        "completion", help="print a shell completion script: source <(agentrun completion bash)"
    )
    s.add_argument("shell", choices=("bash",), help="the shell (zsh: load bashcompinit first)")
    s.set_defaults(func=cmd_completion)

    s = sub.add_parser("submit", help="create runs from AgentRun (and Agent) manifests")
    s.add_argument(
        "-f",
        "--filename",
        action="append",
        required=True,
        help="manifest file; repeat to pass the Agent an AgentRun refers to",
    )
    s.add_argument("--idempotency-key", help="create the run only once for this key")
    s.add_argument(
        "-o", "--output", choices=["id", "json"], default="id",
        help="id: each run's id a line; json: an object a line (with --wait: once it ends, "
        "with its status, result and error)",
    )
    s.add_argument(
        "--wait", action="store_true",
        help="then wait for the runs to end, and exit as agentrun wait does",
    )
    _wait_options(s)
    s.set_defaults(func=cmd_submit)

    s = sub.add_parser("worker", help="run a worker process")
    # Each flag only overrides: WorkerSettings.from_env owns the defaults and the variables
    # (worker_settings). The help shows what the worker would use without the flag.
    w = worker_env

    def flag(name: str, value: object, help: str, **kwargs: Any) -> None:
        shown = "-1 (off)" if value is None else f"{value:g}" if isinstance(value, float) else value
        s.add_argument(name, default=None, help=f"{help} (default: {shown}; ${env_name(name)})",
                       **kwargs)

    flag("--pool", w.pool, "the pool whose runs this worker claims")
    flag("--concurrency", w.concurrency, "runs held at once", type=int)
    s.add_argument(
        "--tools",
        action="append",
        default=None,
        metavar="MODULE",
        help="module or .py file defining @tool functions; repeatable; replaces "
             f"${env_name('--tools')} (comma-separated)",
    )
    flag("--lease-ttl", w.lease_ttl,
         "seconds a claim lasts unless renewed: how soon a dead worker's runs resume", type=float)
    flag("--poll-interval", w.poll_interval,
         "seconds between claims while the worker is not listening for notifications "
         "(its listener reconnects)", type=float)
    flag("--idle-interval", w.idle_interval,
         "the longest an idle worker waits between claims while it listens: new runs wake "
         "it, and it wakes by itself when another worker's lease runs out", type=float)
    flag("--drain-grace", w.drain_grace,
         "seconds a draining worker (SIGTERM) lets its runs reach a step boundary", type=float)
    flag("--liveness-threshold", w.liveness_threshold,
         "/healthz fails after this many seconds without progress", type=float)
    flag("--progress-budget", w.progress_budget,
         "seconds a held run may go without a commit outside a model or tool call within "
         "its deadline; then its lease is no longer renewed and it is abandoned", type=float)
    flag("--health-port", w.health_port,
         "port of /healthz, /readyz, /metrics (0: any free port, -1: off)", type=int)
    flag("--control-port", w.control_port,
         "loopback-only port of POST /drain, for agentrun drain-local (-1: off)", type=int)
    flag("--model-retries", w.retry.max_retries,
         "retries of one model call after a transient failure", type=int)
    flag("--model-deadline", w.retry.deadline,
         "seconds one model call may take in all (a transient failure past it)", type=float)
    flag("--model-transport", w.model_transport,
         "HTTP transport to the Anthropic API: aiohttp (the SDK's aiohttp client, a third less "
         "CPU per step) or httpx (the SDK's default)")
    flag("--tool-timeout", w.tool_timeout,
         "seconds a tool call may take, for tools that declare no @tool(timeout=...)",
         type=float)
    flag("--prices", os.environ.get(env_name("--prices")) or "built in",
         "JSON price table for cost estimates and budgets (docs/worker.md#prices)",
         metavar="FILE")
    flag("--worker-id", "host name and pid",
         "this worker's name in leases and steps")
    _log_options(s)
    s.set_defaults(func=cmd_worker)

    s = sub.add_parser(
        "drain-local",
        help="drain the worker running in this container (the pod's preStop hook): it stops "
        "claiming and hands its runs back; returns once it holds none",
    )
    s.add_argument(
        "--port",
        type=int,
        default=-1 if worker_env.control_port is None else worker_env.control_port,
        help=f"the worker's --control-port (default: ${CONTROL_PORT_ENV}, else "
        f"{DEFAULT_CONTROL_PORT})",
    )
    s.add_argument(
        "--timeout",
        type=float,
        # The drain takes up to the worker's grace, then aborts what is left: a margin on top.
        default=worker_env.drain_grace + 15,
        help="seconds to wait for the drain's answer (default: the drain grace + 15)",
    )
    s.set_defaults(func=cmd_drain_local)

    s = sub.add_parser("operator", help="the Kubernetes operator (kopf)")
    s.add_argument(
        "--namespace",
        action="append",
        help="watch this namespace (repeatable; default: $AGENTRUN_WATCH_NAMESPACES, else all)",
    )
    s.add_argument("--pools-file", help="worker pools to scale (default: $AGENTRUN_POOLS_FILE)")
    s.add_argument(
        "--no-migrate", action="store_true", help="do not run the migrations at start-up"
    )
    s.add_argument("--metrics-port", type=int, help="/metrics port (default 9090; -1: off)")
    s.add_argument("--health-port", type=int,
                   help="/healthz and /readyz port (default 8080; -1: off)")
    _log_options(s)
    s.set_defaults(func=cmd_operator)

    s = sub.add_parser("demo", help="the whole story on one machine: a run survives SIGKILL")
    s.add_argument("--model", help="use the real API with this model (needs ANTHROPIC_API_KEY)")
    s.add_argument(
        "--timeout", type=float, default=DEMO_TIMEOUT, metavar="SECONDS",
        help=f"give up after this long, exit {EXIT_TIMEOUT}, saying what is left behind",
    )
    s.set_defaults(func=cmd_demo)

    sub.add_parser(
        "fake-anthropic", help="the scripted Messages API server (see docs)", add_help=False
    )

    for name in ("approve", "reject"):
        s = sub.add_parser(name, help=f"{name} the tool call a waiting run is stopped on")
        s.add_argument("run", help="run id; with --kube, the AgentRun's name")
        s.add_argument(
            "seq", metavar="WAIT",
            help="the wait decided, <seq>.<call> (or <seq>.<call>.<attempt> after an unknown "
            "outcome), as `agentrun get` shows it; a bare <seq> only until the step's first "
            "decision",
        )
        s.add_argument("--reason", help="why, recorded with the decision")
        s.add_argument("--by", help="who decides (default: $USER; not with --kube)")
        s.add_argument(
            "--kube", action="store_true",
            help="decide through Kubernetes: create an AgentRunApproval with your kubeconfig's "
            "credentials (approver: the user the API server names) and wait for the operator",
        )
        s.add_argument("-n", "--namespace",
                       help="the AgentRun's namespace (implies --kube; default: the context's)")
        s.add_argument("--kubeconfig", help="kubeconfig file (implies --kube; default: "
                       "$KUBECONFIG, else ~/.kube/config)")
        s.add_argument("--context", help="kubeconfig context (implies --kube; default: the "
                       "current one)")
        s.add_argument(
            "--timeout", type=float, default=60.0, metavar="SECONDS",
            help=f"with --kube: how long to wait for the operator (default: 60; exit "
            f"{EXIT_TIMEOUT} after)",
        )
        if name == "reject":
            s.add_argument(
                "--abort",
                action="store_true",
                help="end the run: compensate what it did (saga), then fail",
            )
        s.set_defaults(func=cmd_decide)

    s = sub.add_parser("cancel", help="cancel a run (stops an in-flight model call)")
    s.add_argument("run", help="run id")
    s.add_argument("--reason", help="why, recorded as the run's error")
    s.add_argument(
        "--rollback",
        action="store_true",
        help="first undo what the run did (compensations, newest first)",
    )
    s.set_defaults(func=cmd_cancel)

    s = sub.add_parser(
        "retry",
        help="continue a failed or dead-lettered run from its step log, with a fresh budget",
    )
    s.add_argument("run", help="run id")
    s.add_argument("--reason", help="why (recorded on the run)")
    s.set_defaults(func=cmd_retry)

    s = sub.add_parser("restart", help="start a new run with a run's spec; prints the new id")
    s.add_argument("run", help="run id")
    s.set_defaults(func=cmd_restart)

    s = sub.add_parser(
        "prune", help="delete finished runs and their steps, in batches (never live runs)"
    )
    s.add_argument(
        "--older-than",
        type=parse_duration,
        required=True,
        metavar="DURATION",
        help="runs that finished at least this long ago: 30d, 12h, 15m, 90s, 2w, 1d12h",
    )
    s.add_argument(
        "--status",
        action="append",
        choices=PRUNABLE,
        help="only runs that ended so; repeat for more (default: every finished status)",
    )
    s.add_argument(
        "--batch",
        type=int,
        default=PRUNE_BATCH,
        help=f"runs per transaction (default {PRUNE_BATCH})",
    )
    s.add_argument("--dry-run", action="store_true", help="count what would go; delete nothing")
    s.set_defaults(func=cmd_prune)

    return p


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMATS = ("text", "json")


def _one_of(values: tuple[str, ...], env: str, fold: Callable[[str], str]) -> Callable[[str], str]:
    """An argparse type: ``values`` only, from the flag or from $``env`` (argparse checks a
    default from the environment against no ``choices``: AGENTRUN_LOG_LEVEL=bogus was a
    traceback at start-up, AGENTRUN_LOG_FORMAT=bogus silently text)."""
    def check(value: str) -> str:
        if fold(value) not in values:
            raise argparse.ArgumentTypeError(
                f"{value!r}: must be {', '.join(values[:-1])} or {values[-1]} (${env})")
        return fold(value)
    return check


def _log_options(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        "--log-format", type=_one_of(LOG_FORMATS, "AGENTRUN_LOG_FORMAT", str.lower),
        default=_env("LOG_FORMAT", "text"),
        help="text or json: one object a line, for a log collector ($AGENTRUN_LOG_FORMAT)",
    )
    s.add_argument(
        "--log-level", type=_one_of(LOG_LEVELS, "AGENTRUN_LOG_LEVEL", str.upper),
        default=_env("LOG_LEVEL", "INFO"),
        help="DEBUG, INFO, WARNING or ERROR ($AGENTRUN_LOG_LEVEL)",
    )


#: ``-o`` of runs and steps, and of get and wait.
LIST_OUTPUTS = ("table", "wide", "json", "yaml")
GET_OUTPUTS = ("text", "wide", "json", "yaml")
OUTPUT_HELP = "table; wide: more columns; json or yaml: every field"


def _wait_options(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        "--for", dest="awaited", choices=WAIT_FOR, default="succeeded",
        help="succeeded: exit 0 only if the run succeeds; finished: exit 0 however it ends",
    )
    s.add_argument(
        "--timeout", type=float, metavar="SECONDS",
        help=f"give up after this long, exit {EXIT_TIMEOUT} (default: wait as long as it takes)",
    )


class _HelpFormatter(argparse.HelpFormatter):
    """Every option's help says its default (when it has one) and lists its valid values."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = (action.help or "").strip()
        choices = action.choices
        if choices is not None and not isinstance(action, argparse._SubParsersAction):
            if not all(re.search(rf"\b{re.escape(str(c))}\b", text) for c in choices):
                valid = ", ".join(str(c) for c in choices)
                text = f"{text}; one of: {valid}" if text else f"one of: {valid}"
        shown = action.default not in (None, False, argparse.SUPPRESS, [])
        if shown and action.option_strings and "default" not in text:
            text += " (default: %(default)s)"
        return text


#: Options whose value is a file or a Python file (completed as file names).
_FILE_OPTIONS = frozenset({"--filename", "--tools", "--pools-file"})


def bash_completion(parser: argparse.ArgumentParser) -> str:
    """A bash completion script for ``agentrun``, generated from its argparse tree: the
    commands, each command's options, and the valid values of options that have choices."""
    (subs,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    commands = list(subs.choices)
    top = [o for a in parser._actions for o in a.option_strings]
    cases: list[str] = []
    for name, sp in subs.choices.items():
        options: list[str] = []
        values: list[str] = []
        positional: list[str] = []
        for a in sp._actions:
            if not a.option_strings:
                if a.choices:
                    positional.extend(str(c) for c in a.choices)
                continue
            options.extend(a.option_strings)
            pattern = "|".join(a.option_strings)
            if a.choices:
                words = " ".join(str(c) for c in a.choices)
                values.append(f'                {pattern}) COMPREPLY=($(compgen -W "{words}" -- '
                              '"$cur")); return ;;')
            elif _FILE_OPTIONS.intersection(a.option_strings):
                values.append(f'                {pattern}) COMPREPLY=($(compgen -f -- "$cur")); '
                              "return ;;")
            elif a.nargs != 0:  # a value nobody can list (a number, a name): complete nothing
                values.append(f"                {pattern}) COMPREPLY=(); return ;;")
        words = " ".join(options + positional)
        cases.append(
            f"        {name})\n"
            + ("            case \"$prev\" in\n" + "\n".join(values) + "\n            esac\n"
               if values else "")
            + f'            COMPREPLY=($(compgen -W "{words}" -- "$cur")) ;;'
        )
    body = "\n".join(cases)
    return f"""# bash completion for agentrun (generated by: agentrun completion bash)
# Load it now with: source <(agentrun completion bash)
_agentrun() {{
    local cur prev cmd i
    cur="${{COMP_WORDS[COMP_CWORD]}}"
    prev="${{COMP_WORDS[COMP_CWORD-1]}}"
    cmd=""
    for ((i = 1; i < COMP_CWORD; i++)); do
        case "${{COMP_WORDS[i]}}" in
            -*) ;;
            *) cmd="${{COMP_WORDS[i]}}"; break ;;
        esac
    done
    if [[ -z "$cmd" ]]; then
        COMPREPLY=($(compgen -W "{' '.join(commands + top)}" -- "$cur"))
        return
    fi
    case "$cmd" in
{body}
    esac
}}
complete -o default -F _agentrun agentrun"""


async def cmd_completion(args: argparse.Namespace) -> int:
    print(bash_completion(build_parser()))
    return 0


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def one_line(message: str) -> str:
    """An error message as one line: a newline or NUL from the input (a manifest's name, a task)
    shown as its escape, and the bidirectional controls that would reorder the line around them
    (an earlier decider's name in a refusal is anyone's text) as printable shows them."""
    return printable(_CONTROL.sub(lambda m: repr(m.group())[1:-1], message))


def _env(name: str, default: str) -> str:
    return os.environ.get(f"AGENTRUN_{name}", default)


#: The exit code when whoever reads stdout closes it first (``agentrun runs | head -1``): a
#: process killed by SIGPIPE exits so (128 + 13) in a shell, as ``seq 100000 | head -1`` does.
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE


def _reader_went_away() -> int:
    """Stdout's reader is gone: exit quietly (no traceback), as a Unix filter does. Stdout is
    pointed at /dev/null first, or the interpreter's own flush at exit fails again, noisily."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_BROKEN_PIPE


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["fake-anthropic"]:
        return cmd_fake_anthropic(argv[1:])
    try:
        parser = build_parser()  # reads AGENTRUN_* defaults: a bad value is a one-line error
    except ConfigError as exc:
        print(f"agentrun: error: {exc}", file=sys.stderr)
        return exc.exit_code
    args = parser.parse_args(argv)
    func: AsyncCommand = args.func
    # psycopg_pool says each connection it drops or fails to open, in records of several lines
    # (Python's last-resort handler, as a command sets no logging up): an outage filled stderr,
    # beside the command's own line on it. A worker and the operator set their logging up and
    # keep them (setup_logging).
    logging.getLogger(POOL_LOGGER).setLevel(logging.CRITICAL)
    # A run's text may hold what no terminal encoding can show (a lone surrogate): escaped, not
    # a UnicodeEncodeError in the middle of a table.
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(errors="backslashreplace")
    try:
        code = asyncio.run(func(args))
        sys.stdout.flush()  # here, not at exit: a closed pipe is then handled below
        return code
    except BrokenPipeError:
        return _reader_went_away()
    except AgentrunError as exc:
        print(f"agentrun: error: {one_line(str(exc))}", file=sys.stderr)
        return exc.exit_code
    except psycopg.OperationalError as exc:
        raw = " ".join(str(exc).split())
        reason = redact_message(raw, os.environ.get(DATABASE_URL_ENV))
        err: AgentrunError = DatabaseUnavailable(f"database error: {reason}")
        if not unreachable(exc):
            # The server answered and refused the statement (a program limit, a statement
            # timeout): not "cannot be reached", exit 1.
            err = AgentrunError(f"database error: {reason}")
        if login_refused(raw):  # e.g. the password changed after the first connection
            err = ConfigError(
                f"database error: {reason}; check the user, password and database in "
                f"{DATABASE_URL_ENV}"
            )
        print(f"agentrun: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
