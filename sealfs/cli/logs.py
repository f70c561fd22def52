"""Logging set-up for the CLI and the daemon: one line per event, never secrets."""

from __future__ import annotations

import logging
import os
import sys
import threading
import traceback
from types import TracebackType

from sealfs.cli.stdio import one_line

DEBUG_ENV = "SEALFS_DEBUG"  # =1: a bug's traceback in full, its messages included
# What stands for a bug's message, in the log and in a command's report of the bug.
WITHHELD = "(message withheld: it may quote names or data)"

ExcInfo = tuple[type[BaseException], BaseException, TracebackType | None]


class OneLineFormatter(logging.Formatter):
    """Each event on one line, whatever its message holds: a store path or an error
    text from the service with a newline in it split an entry in two, and what
    followed the newline read as an entry of its own. A traceback (of a bug) keeps
    its lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return one_line(super().formatMessage(record))

    def formatException(self, ei: ExcInfo | tuple[None, None, None]) -> str:
        """A bug's traceback: where each exception of the chain came from and its type,
        never its message.

        A filesystem request carries names, xattrs and file bytes, and a bug's
        message may quote them (a KeyError of a name, a UnicodeDecodeError of the
        bytes): the log must never hold plaintext (README, threat model). The frames
        are the code's own lines; with SEALFS_DEBUG=1 set, the messages are shown too.
        """
        exc = ei[1]
        if exc is None or os.environ.get(DEBUG_ENV) == "1":
            return super().formatException(ei)
        return "\n".join(_withheld_traceback(exc))


# As Python's own traceback prints a group: its first members, and so deep.
MAX_GROUP_WIDTH = 15
MAX_GROUP_DEPTH = 10


def _withheld_traceback(
    exc: BaseException, indent: str = "", shown: set[int] | None = None, depth: int = 0
) -> list[str]:
    """The lines of exc's traceback, causes first as Python prints them, messages out;
    a group's exceptions follow it, indented (the bug's own frames are in them).

    Each exception is shown once (shown: the ids of those shown so far, or being
    shown): one raised again while its group was handled has that group, which
    holds it, in its chain, and following it went round that loop until
    RecursionError, which logging raises on to the caller. A group shows its first
    MAX_GROUP_WIDTH exceptions, MAX_GROUP_DEPTH groups deep, as Python does.
    """
    shown = set() if shown is None else shown
    chain: list[BaseException] = []
    link: BaseException | None = exc
    while link is not None and id(link) not in shown and link not in chain:  # by identity
        chain.append(link)
        link = link.__cause__ or (None if link.__suppress_context__ else link.__context__)
    if not chain:
        return [f"{indent}{_type_name(exc)} (shown above)"]
    lines: list[str] = []
    for link in reversed(chain):
        if lines:
            lines.append(f"{indent}(the exception above led to the one below)")
        if id(link) in shown:  # a group above in this chain holds it
            lines.append(f"{indent}{_type_name(link)} (shown above)")
            continue
        shown.add(id(link))
        lines.append(f"{indent}Traceback (most recent call last):")
        for frame in traceback.format_tb(link.__traceback__):
            lines.extend(indent + line for line in frame.rstrip("\n").split("\n"))
        lines.append(f"{indent}{_type_name(link)} {WITHHELD}")
        if isinstance(link, BaseExceptionGroup):
            lines.extend(_group_members(link, indent, shown, depth))
    return lines


def _group_members(
    group: BaseExceptionGroup[BaseException], indent: str, shown: set[int], depth: int
) -> list[str]:
    """The withheld tracebacks of a group's first exceptions, indented under it."""
    count = len(group.exceptions)
    if depth >= MAX_GROUP_DEPTH:
        return [f"{indent}  (groups nested deeper than {MAX_GROUP_DEPTH} are not shown)"]
    lines: list[str] = []
    for number, inner in enumerate(group.exceptions[:MAX_GROUP_WIDTH], 1):
        lines.append(f"{indent}  in the group, {number} of {count}:")
        lines.extend(_withheld_traceback(inner, indent + "    ", shown, depth + 1))
    if count > MAX_GROUP_WIDTH:
        lines.append(f"{indent}  and {count - MAX_GROUP_WIDTH} more exceptions")
    return lines


def _type_name(exc: BaseException) -> str:
    """exc's type, and a group's exceptions' types (its first MAX_GROUP_WIDTH)."""
    name = _qualified(type(exc))
    if isinstance(exc, BaseExceptionGroup):
        inner = [_qualified(type(member)) for member in exc.exceptions[:MAX_GROUP_WIDTH]]
        if len(exc.exceptions) > MAX_GROUP_WIDTH:
            inner.append(f"{len(exc.exceptions) - MAX_GROUP_WIDTH} more")
        name += f" of {', '.join(inner)}"
    return name


def _qualified(kind: type[BaseException]) -> str:
    return (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )


# A log's line: when, how grave, which part of sealfs, which process.
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"


class TerminalFormatter(OneLineFormatter):
    """A command's warnings on a terminal read as its errors do ("sealfs: ..."): a
    timestamp, a logger's name and a pid in front of "passphrase file pass can be read
    by every user" are a log's, which someone at a prompt does not keep."""

    def __init__(self) -> None:
        super().__init__("%(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        grave = "" if record.levelno < logging.WARNING else f"{record.levelname.lower()}: "
        return f"sealfs: {grave}{super().formatMessage(record)}"


def setup_logging(*, verbose: bool, terminal: bool = False, command: bool = False) -> None:
    """Log to stderr (the daemon's stderr is its log file), and route what Python itself
    would print there (a thread's uncaught exception, one ignored in a finalizer)
    through the same formatter: Python's own hooks print the message and the
    object's repr, either of which may quote a name.

    terminal: a command run on a terminal (stderr one), as opposed to a log: lines as
    its errors are, without the log's fields.

    command: a command's run, whose output says what it did, rather than a daemon's log:
    warnings and errors only, unless verbose. Its INFO lines were a log's ("wrote
    snapshot ...", a rekey's start and end before the command's own "Rekey done").
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(TerminalFormatter() if terminal else OneLineFormatter(LOG_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.WARNING if command else logging.INFO)
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    threading.excepthook = _log_thread_exception
    sys.unraisablehook = _log_unraisable


_python_log = logging.getLogger("sealfs.python")


def _log_thread_exception(args: threading.ExceptHookArgs) -> None:
    """A thread ended by an exception: a bug, logged as one (threading's own hook
    printed the message)."""
    if args.exc_type is SystemExit:
        return  # ends a thread quietly, as threading's hook has it
    thread = args.thread.name if args.thread is not None else "(unknown)"
    _python_log.error(
        "thread %s stopped by an unexpected %s, a bug in sealfs (please report it)",
        thread,
        _qualified(args.exc_type),
        exc_info=args.exc_value,  # its traceback is the exception's own
    )


def _log_unraisable(unraisable: sys.UnraisableHookArgs) -> None:
    """An exception Python had to ignore (in __del__, a finalizer, a callback): named by
    the type of the object it was met in, never its repr (a file object's names its path)."""
    where = "" if unraisable.object is None else f" in a {type(unraisable.object).__qualname__}"
    _python_log.warning(
        "%s%s: %s",
        unraisable.err_msg or "exception ignored",
        where,
        _qualified(unraisable.exc_type),
        exc_info=unraisable.exc_value,
    )
