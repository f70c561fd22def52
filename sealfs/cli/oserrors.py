"""One line for an OSError that reaches the top of a command or of the daemon."""

from __future__ import annotations

import errno
import resource


def describe_os_error(exc: OSError) -> str:
    """The error's own words and file, plus the way out where the error alone hides it.

    Out of descriptors, Python says only "Too many open files"; an operator who
    set a low limit (a unit's LimitNOFILE=, a shell's ulimit -n) needs to hear
    which limit and how to raise it.
    """
    if exc.errno == errno.EMFILE:
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        return (
            f"too many open files (this process may open {soft}): raise the limit"
            " (ulimit -n, or LimitNOFILE= in a systemd unit) and retry"
        )
    if exc.errno == errno.ENFILE:
        return "the system's table of open files is full: close files elsewhere and retry"
    return f"{exc.strerror or exc}: {exc.filename or ''}".rstrip(": ")
