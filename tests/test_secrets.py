"""No part of a database password is ever printed (issue 12, F13).

Every error path that shows the connection string or libpq's words about it goes through
agentrun.config.redact_url / redact_message. A keyword-form password quoted with a space in it
(``password='se cret'``) used to leak its tail (``password=*** cret'``), and libpq's own errors
quote pieces of the string (``missing "=" after "cret"``). Each case runs the real CLI; the
password's pieces are distinctive words that must appear nowhere in its output.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from agentrun import logs
from agentrun.config import redact_message, redact_url, secret_pieces
from tests.conftest import run_cli

PIECES = ("alpha", "bravo")


def assert_no_secret(out: str) -> None:
    for piece in PIECES:
        assert piece not in out, out


def one_line_error(proc_stderr: str) -> str:
    lines = proc_stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc_stderr, proc_stderr
    return lines[0]


# (connection string, exit code, what the message says)
CASES = [
    # A quoted password with a space: the store cannot connect (nothing listens on port 1).
    ("host=127.0.0.1 port=1 user=u password='pw-alpha pw-bravo'", 3, "cannot connect"),
    ("host=127.0.0.1 port=1 user=u password = 'pw-alpha pw-bravo' dbname=d", 3, "cannot connect"),
    ("host=127.0.0.1 port=1 password = pw-alpha-bravo", 3, "cannot connect"),
    ("host=127.0.0.1 port=1 password='pw-alpha \\' pw-bravo'", 3, "cannot connect"),
    ("host=127.0.0.1 port=1 password=pw-alpha\\ pw-bravo", 3, "cannot connect"),
    ("postgresql://u:pw-alpha-bravo@127.0.0.1:1/db?sslmode=disable", 3, "cannot connect"),
    ("postgresql://u@127.0.0.1:1/db?password=pw-alpha-bravo", 3, "cannot connect"),
    # libpq percent-decodes a query key: these set the password too (they were printed whole).
    ("postgresql://u@127.0.0.1:1/db?pass%77ord=pw-alpha-bravo", 3, "cannot connect"),
    ("postgresql://u@127.0.0.1:1/db?%70assword=pw-alpha-bravo&sslmode=disable", 3,
     "cannot connect"),
    ("postgresql://u@127.0.0.1:1/db?sslpassword=pw-alpha-bravo", 3, "cannot connect"),
    ("host=127.0.0.1 port=1 dbname=postgresql://u:pw-alpha-bravo@127.0.0.1:1/db", 3,
     "cannot connect"),
    # Strings libpq refuses: its message quotes pieces of them.
    ("host=127.0.0.1 port=1 password=pw-alpha pw-bravo", 2, "malformed"),
    ("host=127.0.0.1 port=1 password=pw-alpha pw-bravo=1", 2, "malformed"),
    ("host=127.0.0.1 port=1 password='pw-alpha pw-bravo", 2, "malformed"),
    ("postgresql://u:pw-alpha%zzbravo@127.0.0.1:1/db", 2, "malformed"),
    ("postgresql://u:pw-alpha bravo@127.0.0.1:1/db", 2, "malformed"),
    ("postgresql://u:pw-alpha-bravo@[::1/db", 2, "malformed"),
    ("postgresql://u:pw-alpha-bravo@127.0.0.1:1/db?passwrd=x", 2, "malformed"),
    ("postgresql://u@127.0.0.1:1/db?pass%77ord=pw-alpha-bravo&bogus=1", 2, "malformed"),
    # Not a scheme at all: "://" inside a keyword-form password.
    ("host=127.0.0.1 port=1 password=pw-alpha://bravo", 3, "cannot connect"),
    # An unencoded / or @ in a URI's password: libpq still parses it, reading the password's
    # head as the port ("has port 'pw-alpha'") or its tail as the host ("failed to resolve host
    # 'pw-bravo@127.0.0.1'"), and both were printed (found by a review).
    (AT_IN_PASSWORD := "postgresql://u:pw-alpha@pw-bravo@127.0.0.1:1/db", 3, "cannot connect"),
    ("postgresql://u:pw-alpha/pw-bravo@127.0.0.1:1/db", 2, "percent-encode"),
]


@pytest.mark.parametrize(("url", "code", "says"), CASES)
def test_a_connection_error_shows_no_part_of_the_password(url: str, code: int, says: str) -> None:
    proc = run_cli("runs", env={"AGENTRUN_DATABASE_URL": url})
    assert_no_secret(proc.stdout + proc.stderr)
    assert proc.returncode == code, proc.stderr
    assert says in one_line_error(proc.stderr)


# The second: a log line quoting libpq's error as it is, masked by the log formatter alone.
@pytest.mark.parametrize("url", ["host=127.0.0.1 port=1 password='pw-alpha pw-bravo'",
                                 AT_IN_PASSWORD])
@pytest.mark.parametrize("log_format", ["text", "json"])
def test_the_worker_says_the_same(tmp_path: Path, url: str, log_format: str) -> None:
    """A worker waits for a database that does not answer (issue 19) and says why, redacted."""
    err = tmp_path / "stderr"
    env = {**os.environ, "ANTHROPIC_API_KEY": "test", "AGENTRUN_LOG_FORMAT": log_format,
           "AGENTRUN_DATABASE_URL": url}
    with err.open("w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "agentrun", "worker", "--health-port", "-1",
             "--control-port", "-1"],
            stdout=subprocess.DEVNULL, stderr=f, env=env, cwd=tempfile.gettempdir(),
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while "waiting for the database" not in err.read_text():
            assert proc.poll() is None, err.read_text()
            assert time.monotonic() < deadline, err.read_text()
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, err.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = err.read_text()
    assert_no_secret(out)
    assert "cannot connect" in out


def test_migrate_prints_the_url_without_its_password(empty_database_url: str) -> None:
    # The machine's PostgreSQL trusts local connections: the password is sent and ignored.
    url = f"{empty_database_url} password='pw-alpha pw-bravo'"
    proc = run_cli("migrate", env={"AGENTRUN_DATABASE_URL": url})
    assert proc.returncode == 0, proc.stderr
    assert "migrated" in proc.stdout and "password=***" in proc.stdout
    assert_no_secret(proc.stdout + proc.stderr)


@pytest.mark.parametrize("url", [url for url, _, _ in CASES])
def test_redaction_keeps_what_is_not_the_password(url: str) -> None:
    shown = redact_url(url)
    assert_no_secret(shown)
    assert "127.0.0.1" in shown or "::1" in shown


def test_a_message_keeps_libpq_words_and_the_host_but_not_the_password() -> None:
    url = "host=db.example port=5432 user=app password='pw-alpha pw-bravo'"
    message = (
        'connection to server at "db.example" (10.0.0.1), port 5432 failed: FATAL: password '
        'authentication failed for user "app"; pw-alpha pw-bravo; "pw-bravo"'
    )
    shown = redact_message(message, url)
    assert_no_secret(shown)
    assert '"db.example"' in shown and 'user "app"' in shown
    assert redact_message('missing "=" after "pw-bravo" in connection info string',
                          "host=h password=pw-alpha pw-bravo") == (
        'missing "=" after "***" in connection info string')


def test_log_lines_keep_the_words_a_password_is_made_of(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by a review: masked wherever it stood, a password that is a word garbled every log
    line ("connected to ***ql://***:***@db", "released for another ***") and showed which word
    it was. Masked where libpq shows such pieces, quoted; bare only a compound piece."""
    monkeypatch.setattr(logs, "_hidden", ())
    logs.hide_in_logs(secret_pieces("postgresql://worker:worker@db/agentrun"))
    assert logs.unsecret("released for another worker") == "released for another worker"
    assert logs.unsecret('password authentication failed for "worker"') == (
        'password authentication failed for "***"')
    monkeypatch.setattr(logs, "_hidden", ())
    logs.hide_in_logs(secret_pieces(AT_IN_PASSWORD))
    assert logs.unsecret("failed to resolve host pw-bravo@127.0.0.1: gone") == (
        "failed to resolve host ***: gone")
