"""Logging set-up for the CLI and the daemon: one line per event, never secrets."""

from __future__ import annotations

import logging
import os
import sys
import traceback
from types import TracebackType

from sealfs.cli.stdio import one_line

DEBUG_ENV = "SEALFS_DEBUG"  # =1: a bug's traceback in full, its messages included

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


def _withheld_traceback(exc: BaseException, indent: str = "") -> list[str]:
    """The lines of exc's traceback, causes first as Python prints them, messages out;
    a group's exceptions follow it, indented (the bug's own frames are in them)."""
    chain: list[BaseException] = []
    link: BaseException | None = exc
    while link is not None and all(link is not seen for seen in chain):
        chain.append(link)
        link = link.__cause__ or (None if link.__suppress_context__ else link.__context__)
    lines: list[str] = []
    for link in reversed(chain):
        if lines:
            lines.append(f"{indent}(the exception above led to the one below)")
        lines.append(f"{indent}Traceback (most recent call last):")
        for frame in traceback.format_tb(link.__traceback__):
            lines.extend(indent + line for line in frame.rstrip("\n").split("\n"))
        lines.append(f"{indent}{_type_name(link)} (message withheld: it may quote names or data)")
        if isinstance(link, BaseExceptionGroup):
            for number, inner in enumerate(link.exceptions, 1):
                lines.append(f"{indent}  in the group, {number} of {len(link.exceptions)}:")
                lines.extend(_withheld_traceback(inner, indent + "    "))
    return lines


def _type_name(exc: BaseException) -> str:
    kind = type(exc)
    name = (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )
    if isinstance(exc, BaseExceptionGroup):
        name += f" of {', '.join(_type_name(inner) for inner in exc.exceptions)}"
    return name


def setup_logging(*, verbose: bool) -> None:
    """Log to stderr (the daemon's stderr is its log file)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        OneLineFormatter("%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
