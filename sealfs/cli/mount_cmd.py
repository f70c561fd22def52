"""`sealfs mount` and `sealfs umount`."""

from __future__ import annotations

import argparse
import errno
import gc
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from sealfs.cli.allocator import limit_malloc_arenas
from sealfs.cli.commands import COMMANDS
from sealfs.cli.daemon import Report, daemonize
from sealfs.cli.exitcodes import BUSY, FAILURE, USAGE, exit_code
from sealfs.cli.logs import setup_logging
from sealfs.cli.unlock import add_cache_options, add_unlock_options, unlock_store
from sealfs.errors import ConfigError, SealfsError
from sealfs.fuse.mount import abandon, prepare, serve
from sealfs.fuse.operations import STATUS_XATTR
from sealfs.store.url import DEFAULT_STORE_TIMEOUT
from sealfs.volume.engine import Volume
from sealfs.volume.loader import Loaded, check_writer, claim_writer, collector_paused, pid_alive
from sealfs.volume.options import VolumeOptions

log = logging.getLogger("sealfs.cli")


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("mount", help=COMMANDS["mount"].help)
    p.add_argument("store")
    p.add_argument("mountpoint")
    add_unlock_options(p)
    add_cache_options(p)
    p.add_argument(
        "--commit-interval",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="commit buffered writes at least this often (default 1)",
    )
    p.add_argument("--sync-on-close", action="store_true", help="close(2) waits for a commit")
    p.add_argument(
        "--store-timeout",
        type=float,
        default=DEFAULT_STORE_TIMEOUT,
        metavar="SECONDS",
        help="how long fsync waits for an unreachable store before failing with EIO"
        f" (default {DEFAULT_STORE_TIMEOUT:.0f}); commits resume when it is back",
    )
    p.add_argument("--read-only", action="store_true", help="mount without writing")
    p.add_argument("--allow-other", action="store_true", help="let other users access the mount")
    p.add_argument(
        "--takeover",
        action="store_true",
        help="take the volume from a writer on another host that crashed",
    )
    p.add_argument("--foreground", "-f", action="store_true", help="stay attached; log to stderr")
    p.add_argument("--log-file", help="daemon log file (default ~/.local/state/sealfs/sealfs.log)")
    p.set_defaults(run=run_mount)  # fmt: skip

    s = sub.add_parser("sync", help=COMMANDS["sync"].help)
    s.add_argument("mountpoint")
    s.set_defaults(run=run_sync)

    u = sub.add_parser("umount", help=COMMANDS["umount"].help)
    u.add_argument("mountpoint")
    u.add_argument(
        "--timeout", type=float, default=60.0, help="seconds to wait for the daemon to exit"
    )
    u.set_defaults(run=run_umount)


def _options(args: argparse.Namespace) -> VolumeOptions:
    if args.commit_interval <= 0:
        raise ConfigError("--commit-interval must be positive")
    if args.store_timeout <= 0:
        raise ConfigError("--store-timeout must be positive")
    return VolumeOptions(
        commit_interval=args.commit_interval,
        sync_on_close=args.sync_on_close,
        read_only=args.read_only,
    )


def run_mount(args: argparse.Namespace) -> int:
    options = _options(args)
    limit_malloc_arenas()  # before the volume's load starts threads
    with collector_paused():
        loaded = unlock_store(args)
        if not options.read_only:
            check_writer(loaded, takeover=args.takeover)
        mountpoint = os.path.abspath(args.mountpoint)
        volume = Volume(loaded, options)
        prepare(volume, mountpoint, allow_other=args.allow_other)
        # The metadata just loaded lives as long as the mount: the collector can skip
        # it from now on, and the daemon forked next does not copy its pages to do so.
        gc.freeze()
    if args.foreground:
        return _serve(loaded, volume, mountpoint, lambda code, msg: None)
    log_path = args.log_file or _default_log_path()
    return daemonize(
        lambda report: _serve_daemon(loaded, volume, mountpoint, report, log_path), log_path
    )


def _serve_daemon(
    loaded: Loaded, volume: Volume, mountpoint: str, report: Report, log_path: str
) -> int:
    setup_logging(log_path=None, verbose=False)  # stderr is the log file now
    return _serve(loaded, volume, mountpoint, report)


def _serve(loaded: Loaded, volume: Volume, mountpoint: str, report: Report) -> int:
    try:
        if not volume.read_only:
            claim_writer(loaded)  # by the process that writes, so its pid is the one recorded
    except SealfsError as exc:
        report(exit_code(exc), str(exc))
        abandon()
        return exit_code(exc)
    log.info(
        "serving %s on %s (generation %d)",
        loaded.store.describe(),
        mountpoint,
        loaded.live.generation,
    )
    serve(volume, mountpoint, lambda: report(0, "ready"))
    return 0


def _default_log_path() -> str:
    state = Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state")) / "sealfs"
    state.mkdir(parents=True, exist_ok=True)
    return str(state / "sealfs.log")


def read_status(mountpoint: str) -> dict[str, object]:
    """Ask a live mount for its status. Raises OSError (ENOTCONN for a dead daemon)."""
    return dict(json.loads(os.getxattr(mountpoint, STATUS_XATTR.decode())))


def commit_mount(mnt: str) -> None:
    """fsync the mount's root: the engine then commits everything. Raises OSError."""
    fd = os.open(mnt, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def run_sync(args: argparse.Namespace) -> int:
    mnt = os.path.abspath(args.mountpoint)
    if not os.path.ismount(mnt):
        raise ConfigError(f"{mnt} is not mounted")
    try:
        commit_mount(mnt)
    except OSError as exc:
        print(f"sealfs: commit failed ({exc.strerror}); see the daemon log", file=sys.stderr)
        return FAILURE
    return 0


def run_umount(args: argparse.Namespace) -> int:
    mnt = os.path.abspath(args.mountpoint)
    if not os.path.ismount(mnt):
        raise ConfigError(f"{mnt} is not mounted")
    try:
        status = read_status(mnt)
        pid = int(str(status["pid"]))
    except OSError as exc:
        if exc.errno != errno.ENOTCONN:
            raise ConfigError(f"{mnt} is not a sealfs mount: {exc.strerror}") from None
        _fusermount(mnt, lazy=True)
        print(f"sealfs: the daemon of {mnt} had died; removed the stale mount."
              " Data written after its last commit is lost.", file=sys.stderr)  # fmt: skip
        return FAILURE
    if status.get("fenced") or status.get("stopped"):  # no commit can succeed: don't try
        if (code := _fusermount(mnt, lazy=False)) != 0:
            return code
        _wait_for_exit(pid, args.timeout)
        if status.get("fenced"):
            print(f"sealfs: {mnt} was taken over by another writer (fenced); unmounted it."
                  " Data written there after the takeover is lost.", file=sys.stderr)  # fmt: skip
        else:
            cause = status["stopped"]
            print(f"sealfs: {mnt} had stopped committing; unmounted it. Data written after"
                  f" its last commit is lost. Cause: {cause}", file=sys.stderr)  # fmt: skip
        return FAILURE
    try:
        commit_mount(mnt)
    except OSError as exc:
        print(f"sealfs: commit failed ({exc.strerror}); {mnt} stays mounted, see the daemon log",
              file=sys.stderr)  # fmt: skip
        return FAILURE
    if (code := _fusermount(mnt, lazy=False)) != 0:
        return code
    return _wait_for_exit(pid, args.timeout)


def _fusermount(mnt: str, *, lazy: bool) -> int:
    cmd = ["fusermount3", "-u", "-z", mnt] if lazy else ["fusermount3", "-u", mnt]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode == 0:
        return 0
    if "busy" in result.stderr:
        print(f"sealfs: {mnt} is busy (a process has files open there or works in it): "
              "close them and retry", file=sys.stderr)  # fmt: skip
        return BUSY
    print(f"sealfs: fusermount3 failed: {result.stderr.strip()}", file=sys.stderr)
    return USAGE


def _wait_for_exit(pid: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return 0
        time.sleep(0.05)
    print(f"sealfs: unmounted, but daemon pid {pid} is still committing after {timeout:.0f} s",
          file=sys.stderr)  # fmt: skip
    return FAILURE
