"""The CLI's and the daemon's log: one line per event."""

from __future__ import annotations

import io
import logging
import sys
from collections.abc import Iterator

import pytest

from sealfs.cli.logs import setup_logging


@pytest.fixture
def log_lines(monkeypatch: pytest.MonkeyPatch) -> Iterator[io.StringIO]:
    """What setup_logging's handler writes to stderr. It replaces the root logger's
    handlers: pytest's are given back after."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    stderr = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
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


def test_a_bug_s_traceback_keeps_its_lines(log_lines: io.StringIO) -> None:
    """Escaping is for the message: a traceback that came out on one line could not be read."""
    try:
        int("not a number")
    except ValueError:
        logging.getLogger("sealfs.test").exception("unexpected error")
    lines = log_lines.getvalue().splitlines()
    assert lines[0].endswith("unexpected error")
    assert lines[1] == "Traceback (most recent call last):"
    assert lines[-1] == "ValueError: invalid literal for int() with base 10: 'not a number'"
