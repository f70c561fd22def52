"""The CLI's and the daemon's log: one line per event."""

from __future__ import annotations

import io
import logging
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from sealfs.cli.logs import DEBUG_ENV, setup_logging


@pytest.fixture
def log_lines(monkeypatch: pytest.MonkeyPatch) -> Iterator[io.StringIO]:
    """What setup_logging's handler writes to stderr. It replaces the root logger's
    handlers: pytest's are given back after."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    stderr = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    # setup_logging sets Python's hooks too: given back after, with the handlers.
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
    setup_logging(verbose=False)
    yield stderr
    root.handlers[:] = handlers
    root.setLevel(level)


def test_a_message_holding_a_newline_is_one_entry(log_lines: io.StringIO) -> None:
    """Regression: a store path (or an error text) holding a newline split an entry in
    two, and what followed the newline read as an entry of its own: here, a forged
    "ERROR" after a store named to look like one."""
    store = "/srv/a\n2026-11-30 00:00:00,000 ERROR sealfs.fuse[1]: forged\x1b[2J"
    logging.getLogger("sealfs.test").warning("serving local store at %s", store)
    lines = log_lines.getvalue().splitlines()
    assert len(lines) == 1, lines
    assert " WARNING sealfs.test[" in lines[0]
    assert lines[0].endswith(
        r"store at /srv/a\n2026-11-30 00:00:00,000 ERROR sealfs.fuse[1]: forged\x1b[2J"
    )


def test_a_bug_s_traceback_keeps_its_lines(
    log_lines: io.StringIO, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Escaping is for the message: a traceback that came out on one line could not be read."""
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    try:
        int("not a number")
    except ValueError:
        logging.getLogger("sealfs.test").exception("unexpected error")
    lines = log_lines.getvalue().splitlines()
    assert lines[0].endswith("unexpected error")
    assert lines[1] == "Traceback (most recent call last):"
    assert any('int("not a number")' in line for line in lines[2:-1]), lines  # the code's line
    assert lines[-1] == "ValueError (message withheld: it may quote names or data)"


SECRET_NAME = "canary-agent-api-key"


def _lookup(entries: dict[bytes, int], name: bytes) -> int:
    try:
        return entries[name]
    except KeyError as exc:
        raise RuntimeError(f"no entry {name!r} in {entries!r}") from exc


def test_a_bug_s_traceback_never_quotes_what_its_exceptions_say(
    log_lines: io.StringIO, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug's exception may quote a file name or bytes of a request (a KeyError of a
    name): the log names each exception of the chain and of a group and where it came
    from, never what it says, since the log must hold no plaintext."""
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    try:
        try:
            _lookup({b"other": 1}, SECRET_NAME.encode())
        except RuntimeError as exc:
            raise ExceptionGroup("in a nursery", [exc, ValueError(SECRET_NAME)]) from None
    except ExceptionGroup:
        logging.getLogger("sealfs.test").exception("unexpected error in a filesystem request")
    text = log_lines.getvalue()
    assert SECRET_NAME not in text, text
    withheld = "(message withheld: it may quote names or data)"
    lines = [line.strip() for line in text.splitlines()]
    group = lines.index(f"ExceptionGroup of RuntimeError, ValueError {withheld}")
    # Then the group's exceptions, each with its chain: where the bug really was.
    inner = lines[group:]
    assert inner.index("in the group, 1 of 2:") < inner.index(f"KeyError {withheld}")
    assert inner.index(f"KeyError {withheld}") < inner.index(f"RuntimeError {withheld}")
    assert "return entries[name]" in inner  # the cause's own line
    assert inner.index("in the group, 2 of 2:") < inner.index(f"ValueError {withheld}")


def test_sealfs_debug_shows_a_bug_s_messages(
    log_lines: io.StringIO, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With SEALFS_DEBUG=1 (a developer reproducing a bug) the log holds the messages."""
    monkeypatch.setenv(DEBUG_ENV, "1")
    try:
        _lookup({}, SECRET_NAME.encode())
    except RuntimeError:
        logging.getLogger("sealfs.test").exception("unexpected error")
    assert f"RuntimeError: no entry b'{SECRET_NAME}' in {{}}" in log_lines.getvalue()


def _raise_group(leaf: BaseException) -> None:
    raise ExceptionGroup("in a nursery", [leaf])


def _unwrapped(leaf: BaseException) -> BaseException:
    """leaf raised again while its group is handled: a common way to unwrap a nursery's
    group, which makes the group (holding leaf) leaf's context."""
    try:
        try:
            _raise_group(leaf)
        except ExceptionGroup as group:
            raise group.exceptions[0]  # noqa: B904 (the context is the point)
    except BaseException as exc:
        return exc
    raise AssertionError("unreachable")


def test_a_traceback_whose_exception_is_in_a_group_of_its_own_chain_is_logged(
    log_lines: io.StringIO, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: an exception whose context is a group that holds it (raised again
    while its group was handled) sent the withheld traceback round that loop until
    RecursionError, which logging raises on to the caller: the log line was lost, a
    request's bug (logged by the FUSE boundary) stopped the daemon, and the
    interpreter printed the chain with its messages. Each exception is shown once."""
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    try:
        {b"other": 1}[SECRET_NAME.encode()]
    except KeyError as exc:
        bug = _unwrapped(exc)
    logging.getLogger("sealfs.test").error("unexpected error", exc_info=bug)
    text = log_lines.getvalue()
    assert SECRET_NAME not in text, text
    withheld = "(message withheld: it may quote names or data)"
    lines = [line.strip() for line in text.splitlines()]
    assert lines.count(f"KeyError {withheld}") == 1, lines  # once, in its group
    assert lines[-1].startswith("KeyError (shown above"), lines


def test_a_huge_group_is_logged_in_part(
    log_lines: io.StringIO, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group of a thousand exceptions (a nursery of many tasks meeting one bug) is
    logged as Python prints one: its first exceptions and a count of the rest, not
    a thousand tracebacks and a thousand type names in the log."""
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    group = ExceptionGroup("many", [ValueError(SECRET_NAME) for _ in range(1000)])
    logging.getLogger("sealfs.test").error("unexpected error", exc_info=group)
    text = log_lines.getvalue()
    assert SECRET_NAME not in text
    assert "and 985 more exceptions" in text, text[-2000:]
    assert len(text) < 10_000, len(text)


def test_deeply_nested_groups_are_logged_in_part(
    log_lines: io.StringIO, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Groups nested deeper than the interpreter lets a recursion go raised
    RecursionError out of the log call; they are cut at a depth, as Python cuts them."""
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    group: BaseException = ValueError(SECRET_NAME)
    for _ in range(2000):
        group = ExceptionGroup("nested", [group])
    logging.getLogger("sealfs.test").error("unexpected error", exc_info=group)
    text = log_lines.getvalue()
    assert SECRET_NAME not in text
    assert "groups nested deeper" in text, text[-2000:]
    assert len(text) < 100_000, len(text)


# Python's own hooks, met in a process that set up sealfs's logging.
PYTHON_HOOKS = f"""
import threading
from sealfs.cli.logs import setup_logging

setup_logging(verbose=False)
NAME = "{SECRET_NAME}"  # not on a line a traceback shows

def lookup():
    raise KeyError(NAME)

worker = threading.Thread(target=lookup, name="sealfs-seen")
worker.start()
worker.join()

class Handle:
    def __del__(self):
        raise ValueError(NAME)

handle = Handle()
del handle
"""


def test_python_s_own_hooks_log_a_bug_as_sealfs_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: an exception that ended a thread, or one Python had to ignore (in a
    __del__), was printed by Python's own hooks into the log with its message and the
    object's repr, either of which may quote a name. They go through the log's formatter."""
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    result = subprocess.run(
        [sys.executable, "-c", PYTHON_HOOKS],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    text = result.stderr
    assert SECRET_NAME not in text, text
    assert " ERROR sealfs.python[" in text, text
    assert "thread sealfs-seen stopped by an unexpected KeyError, a bug in sealfs" in text
    assert "exception ignored in a function: ValueError" in text, text
    withheld = "(message withheld: it may quote names or data)"
    assert f"KeyError {withheld}" in text and f"ValueError {withheld}" in text
