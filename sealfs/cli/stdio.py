"""The standard descriptors a command finds: closed ones, and output the locale cannot encode."""

from __future__ import annotations

import fcntl
import io
import logging
import os
import sys

from sealfs.errors import ConfigError

log = logging.getLogger(__name__)


def standard_streams() -> None:
    """Make stdin, stdout and stderr safe to use, whatever the caller left of them.

    A descriptor the caller closed (`<&-`, `>&-`, `2>&-`) made Python set its stream to
    None: every command failed as a bug ("'NoneType' object has no attribute ..."),
    a mount's daemon died after the kernel mount was made, leaving it dead, and the
    next file opened took the number. Each closed one gets /dev/null: stdin reads
    nothing (no terminal to ask on), stderr discards, and stdout is opened read-only,
    so that output fails (EBADF) as on the closed descriptor instead of vanishing.

    Output names paths, which may hold bytes that are not UTF-8 (or characters the
    locale's encoding lacks): they are escaped, as on stderr, where a strict stdout
    (a UTF-8 locale such as en_US.UTF-8) raised UnicodeEncodeError once the command
    had done its work: init's recovery key was never shown.
    """
    for fd, flags in ((0, os.O_RDONLY), (1, os.O_RDONLY), (2, os.O_WRONLY)):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, flags)  # the lowest free number: fd itself
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            os.set_inheritable(fd, True)  # as a standard descriptor is
    if sys.stdin is None:
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's, never closed
    if sys.stdout is None:
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
    if sys.stderr is None:
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper) and stream.errors == "strict":
            stream.reconfigure(errors="backslashreplace")


def discard_stdout() -> None:
    """Point stdout at /dev/null: output it still holds (the flush at exit) would fail
    again on the pipe or descriptor that failed it."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, sys.stdout.fileno())
    os.close(null)


def stdout_writable() -> bool:
    """Whether output can be written to stdout (not closed, not opened for reading only)."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):  # no descriptor (a StringIO in-process): a stream as any
        return True
    try:
        mode = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
    except OSError:
        return False
    return mode in (os.O_WRONLY, os.O_RDWR)


def check_recovery_key_shown(key_file: str | None, option: str) -> None:
    """Refuse, before anything is made, a new recovery key that would be printed to a
    closed stdout: the slot was stored, and its key lost with the failed output."""
    if key_file is None and not stdout_writable():
        raise ConfigError(
            f"stdout is closed, where the new recovery key would be shown: give {option}"
            " FILE (nothing was changed)"
        )


def print_recovery_key(text: str, heading: str, option: str) -> None:
    """Show a new recovery key on stdout, under heading; warn (stderr) when stdout is no
    terminal: a pipe into a log or a CI job's output kept the key that opens the volume
    without a word."""
    if not sys.stdout.isatty():
        log.warning(
            "the new recovery key goes to stdout, which is not a terminal: whatever keeps"
            " that output (a log, a file) keeps the key; %s FILE writes it to a file of its"
            " own instead",
            option,
        )
    print(f"\n{heading}:")
    print(f"\n    {text}\n")


# Control characters (a newline or tab in a path) escaped as Python writes them.
# C1 too (U+0080-U+009F, in a UTF-8 path): U+009B is a terminal's CSI, as ESC [ is.
# And the line and paragraph separators (U+2028, U+2029), where str.splitlines and
# log tools that follow it end a line, and the bidirectional controls, which make a
# terminal show the text after them in another order than it is written: the
# embeddings, overrides and isolates, and the marks (LRM, RLM, ALM), which move
# the digits and punctuation around them.
_ESCAPED = (
    *range(0x20),
    *range(0x7F, 0xA0),
    0x061C,
    0x200E,
    0x200F,
    0x2028,
    0x2029,
    *range(0x202A, 0x202F),
    *range(0x2066, 0x206A),
)
_CONTROL = {c: repr(chr(c))[1:-1] if c < 0xA0 else f"\\u{c:04x}" for c in _ESCAPED}


def one_line(text: str) -> str:
    """text with its control characters escaped: a path holding a newline (a
    mountpoint, a store) split an error or a log entry in two, and could forge the
    line after it."""
    return text.translate(_CONTROL)


def error_line(message: str) -> None:
    """Print "sealfs: message" on stderr as one line (see one_line)."""
    print(f"sealfs: {one_line(message)}", file=sys.stderr)
