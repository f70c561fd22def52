"""Daemonising with a readiness pipe, so `sealfs mount` returns once the mount is live.

The fork happens before trio.run and before any worker thread exists: only
the forking thread survives a fork. The child reports "ready" or one error
line through the pipe; the parent prints it and exits with the child's code.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable

from sealfs.cli.exitcodes import BUG, FAILURE, exit_code
from sealfs.cli.oserrors import describe_os_error
from sealfs.cli.sdnotify import notify_ready
from sealfs.cli.stdio import error_line
from sealfs.errors import SealfsError, first_leaf

log = logging.getLogger("sealfs.daemon")

Report = Callable[[int, str], None]  # (exit code, message); code 0 means ready


class CallerGoneError(SealfsError):
    """Nobody heard that the mount was ready: it is undone, as if it had failed."""


def daemonize(
    child: Callable[[Report], int], log_path: str, undo: Callable[[], None] = lambda: None
) -> int:
    """Run child(report) in a detached process; return the exit code the parent should use.

    undo runs in the detached process if it cannot start child (its log file does not
    open): what the caller prepared for child (the kernel mount) must not be left to
    nobody, a dead mount.
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid:
        os.close(write_end)
        return _wait_for_child(read_end, log_path, pid)
    os.close(read_end)
    os.setsid()
    # Out of the caller's directory: a daemon kept there for the life of the mount made
    # the file system holding it impossible to unmount. Every path it uses is absolute.
    _pin_path_variables()
    os.chdir("/")
    reported = False

    def report(code: int, message: str) -> None:
        nonlocal reported
        if reported:
            return
        reported = True
        try:
            os.write(write_end, f"{code} {message}".encode())
        except BrokenPipeError:
            if code == 0:  # the mount must not be left to nobody
                raise CallerGoneError(
                    "the 'sealfs mount' command that started this daemon ended (killed or"
                    " interrupted) before it heard that the mount was ready; unmounting"
                ) from None
            # An error nobody hears any more: it is in the log (see stopped_by).
        finally:
            os.close(write_end)

    try:
        _redirect_stdio(log_path)
        _close_inherited_fds(keep=write_end)
    except BaseException as exc:
        # Not logged: logging would still go to the caller's stderr, where the line came
        # twice (a bug's traceback too), above one sending the reader to an empty log.
        with contextlib.suppress(Exception):
            undo()
        if isinstance(exc, OSError):
            code, text = FAILURE, f"daemon failed: {describe_os_error(exc)}"
        else:
            code = BUG
            text = f"the daemon met an unexpected {type(exc).__name__}; this is a bug in sealfs"
        report(code, text)
        os._exit(code)
    try:
        code = child(report)
    except BaseException as exc:
        code, text = stopped_by(exc, log_path)
        report(code, text)
    if code == 0:
        # Ended well without ever saying "ready" (a SIGTERM or an unmount came first):
        # nothing is mounted. A 0 here read as "ready" to the caller, which exited 0
        # over an empty mountpoint; and to a caller gone, it raised CallerGoneError out
        # of this function, into the caller's own code the fork had copied.
        report(FAILURE, f"the daemon stopped before the mount was ready; see {log_path}")
    else:
        report(code, "daemon exited")
    os._exit(code)


def stopped_by(exc: BaseException, log_path: str) -> tuple[int, str]:
    """The exit code and the caller's line for what ended the daemon's child (or a
    foreground mount, whose log is stderr): logged too, as the caller's line is lost
    once the mount was reported ready.

    A bug's message is never quoted (it may name a file; README, threat model):
    it was "daemon failed: " and the message, with a failure's exit code. trio
    wraps what a task raised in its nursery's group: judged by its first error,
    unless the group holds one that is neither a SealfsError nor an OSError.
    """
    bug: BaseException | None = exc
    if isinstance(exc, BaseExceptionGroup):
        bug = exc.split((SealfsError, OSError))[1]
        exc = first_leaf(exc if bug is None else bug)
    if isinstance(exc, SealfsError):
        log.error("the daemon stopped: %s", exc)
        return exit_code(exc), str(exc)
    if isinstance(exc, OSError):
        log.error("the daemon stopped: %s", describe_os_error(exc))
        return FAILURE, f"daemon failed: {describe_os_error(exc)}"
    if not isinstance(exc, Exception):  # SystemExit, KeyboardInterrupt
        log.error("the daemon stopped: %s", type(exc).__name__)
        return FAILURE, f"daemon stopped by {type(exc).__name__}"
    log.critical(
        "the daemon stopped by an unexpected error, a bug in sealfs (please report it)",
        exc_info=bug,
    )
    return BUG, (
        f"the daemon met an unexpected {type(exc).__name__}; this is a bug in sealfs;"
        f" please report it (its traceback is in {log_path})"
    )


# Files named by the environment that libraries open after the fork: botocore when
# it makes a client (the daemon's S3 threads, a follower's fresh KMS client), OpenSSL
# when it loads trust roots. Given relative, they were looked for in / and the mount
# failed with "no usable AWS credentials" after unlocking with the same ones.
_PATH_VARIABLES = (
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_CONFIG_FILE",
    "AWS_CA_BUNDLE",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "SSL_CERT_FILE",
)


def _pin_path_variables() -> None:
    """Make relative paths in _PATH_VARIABLES absolute before leaving the caller's
    directory; ~ is left for botocore, which expands it."""
    for name in _PATH_VARIABLES:
        value = os.environ.get(name, "")
        if value and not value.startswith(("/", "~")):
            os.environ[name] = os.path.abspath(value)


def _wait_for_child(read_end: int, log_path: str, pid: int) -> int:
    chunks = []
    while chunk := os.read(read_end, 4096):
        chunks.append(chunk)
    os.close(read_end)
    text = b"".join(chunks).decode(errors="replace")
    if not text:
        error_line(f"the daemon died before the mount was ready; see {log_path}")
        return 1
    code_text, _, message = text.partition(" ")
    code = int(code_text) if code_text.isdigit() else 1
    if code:
        error_line(message)
    else:
        notify_ready(main_pid=pid)
    return code


def _close_inherited_fds(keep: int) -> None:
    """Close descriptors inherited from the caller (a shell's pipes would never see EOF).

    Keeps stdio, the readiness pipe and the FUSE device that pyfuse3.init opened.
    """
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd <= 2 or fd == keep:
            continue
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the descriptor of the listing itself, already gone
        if target != "/dev/fuse":
            with contextlib.suppress(OSError):
                os.close(fd)


def _redirect_stdio(log_path: str) -> None:
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.close(devnull)
    reopen_log(log_path)


def reopen_log(log_path: str) -> None:
    """Point stdout and stderr (the daemon's log) at log_path, created if missing.

    At SIGHUP too: logrotate moves the file away and creates a new one, and a
    daemon that kept its old descriptor wrote on into the rotated file forever.
    """
    sys.stderr.flush()
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
