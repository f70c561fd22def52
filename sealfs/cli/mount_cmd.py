"""`sealfs mount` and `sealfs umount`."""

from __future__ import annotations

import argparse
import contextlib
import errno
import gc
import json
import logging
import os
import pwd
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from sealfs.cli.allocator import limit_malloc_arenas
from sealfs.cli.commands import COMMANDS
from sealfs.cli.daemon import Report, daemonize, reopen_log, stopped_by
from sealfs.cli.exitcodes import BUG, BUSY, FAILURE, USAGE, exit_code
from sealfs.cli.keysource import unlocker_for_rekeys
from sealfs.cli.logs import setup_logging
from sealfs.cli.paths import (
    check_store_is_callers,
    inside,
    make_state_dirs,
    state_dir,
    user_path,
)
from sealfs.cli.sdnotify import notify_ready
from sealfs.cli.seen import SeenVolume, kept_current
from sealfs.cli.stdio import error_line
from sealfs.cli.units import format_time, parse_size, seconds
from sealfs.cli.unlock import (
    MOUNT_TIMEOUT_HELP,
    add_cache_options,
    add_unlock_options,
    unlock_seen,
)
from sealfs.errors import ConfigError, SealfsError
from sealfs.fuse import conncaps
from sealfs.fuse.mount import (
    StoppedByBug,
    abandon,
    check_mountpoint,
    fusermount,
    hold_ending_signals,
    is_mounted,
    mount_kind,
    mount_table,
    prepare,
    sealfs_mount_above,
    sealfs_mount_owner,
    serve,
)
from sealfs.fuse.operations import STATUS_XATTR
from sealfs.keys.header import HEADER_NAME
from sealfs.store.base import warn_if_versioned
from sealfs.store.url import (
    DEFAULT_STORE_TIMEOUT,
    cache_dir_for,
    is_local_url,
    local_path,
)
from sealfs.volume.engine import Volume
from sealfs.volume.loader import (
    Loaded,
    check_writer,
    claim_writer,
    collector_paused,
    pid_alive,
)
from sealfs.volume.options import VolumeOptions
from sealfs.wording import with_article

log = logging.getLogger("sealfs.cli")
# Shorter, an idle daemon spun on its commit (or follow) timer: --commit-interval 1e-9
# took 110 % of a core doing nothing. An fsync commits at once whatever the interval.
MIN_COMMIT_INTERVAL = 0.01


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("mount", help=COMMANDS["mount"].help)
    p.add_argument("store", help="the volume's store (directory, file:// or s3:// URL)")
    p.add_argument("mountpoint", type=user_path, help="an empty directory outside the store")
    # A longer default than a command's: the mount's fsyncs ride out an outage.
    add_unlock_options(p, store_timeout=DEFAULT_STORE_TIMEOUT, timeout_help=MOUNT_TIMEOUT_HELP)
    add_cache_options(p)
    p.add_argument(
        "--commit-interval",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="commit buffered writes at least this often; a read-only mount looks for the"
        " writer's new commits this often (default 1)",
    )
    p.add_argument("--sync-on-close", action="store_true", help="close(2) waits for a commit")
    p.add_argument("--read-only", action="store_true", help="mount without writing")
    p.add_argument("--allow-other", action="store_true", help="let other users access the mount")
    p.add_argument(
        "--takeover",
        action="store_true",
        help="take the volume from a writer on another host that crashed (if it still"
        " runs, it is fenced and loses what it had not committed)",
    )
    p.add_argument(
        "--accept-rollback",
        action="store_true",
        help="mount a store that holds an older generation than this host saw there"
        " (after restoring it from a backup on purpose)",
    )
    p.add_argument("--foreground", "-f", action="store_true", help="stay attached; log to stderr")
    p.add_argument(
        "--log-file",
        type=user_path,
        metavar="FILE",
        help="daemon log file (default $XDG_STATE_HOME/sealfs/sealfs.log,"
        " ~/.local/state/sealfs/sealfs.log without XDG_STATE_HOME)",
    )
    p.set_defaults(run=run_mount)  # fmt: skip

    s = sub.add_parser("sync", help=COMMANDS["sync"].help)
    s.add_argument("mountpoint", type=user_path)
    s.set_defaults(run=run_sync)

    u = sub.add_parser("umount", help=COMMANDS["umount"].help)
    u.add_argument("mountpoint", type=user_path)
    u.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="seconds to wait, once unmounted, for the daemon to exit (default 60)",
    )
    u.set_defaults(run=run_umount)


def _options(args: argparse.Namespace) -> VolumeOptions:
    if args.foreground and args.log_file:
        # Taken silently before, the file stayed empty while the log went to stderr.
        raise ConfigError(
            "--log-file is the daemon's log; with --foreground sealfs logs to stderr:"
            " redirect that (2>>FILE) or drop --foreground"
        )
    seconds(args.commit_interval, "--commit-interval", minimum=MIN_COMMIT_INTERVAL)
    seconds(args.store_timeout, "--store-timeout")
    return VolumeOptions(
        commit_interval=args.commit_interval,
        sync_on_close=args.sync_on_close,
        read_only=args.read_only,
    )


def run_mount(args: argparse.Namespace) -> int:
    conncaps.check_loaded()
    options = _options(args)
    if not options.read_only:
        check_store_is_callers(args.store)
    # Resolved: fusermount3 (a mount by a user other than root) refuses a mountpoint
    # that is a symlink, and the mount table holds the real path anyway.
    mountpoint = os.path.realpath(args.mountpoint)
    # The default cache of an S3 store too: made inside the mountpoint (a service user
    # whose home is the mountpoint), it left the mountpoint "not empty" for good.
    cache = cache_dir_for(args.store, Path(args.cache_dir) if args.cache_dir else None,
                          args.s3_endpoint)  # fmt: skip
    _check_paths(args.store, mountpoint, str(cache) if cache else None)  # before any is made
    if cache is None and args.cache_size is not None and parse_size(args.cache_size) != 0:
        # Taken silently before: the mount ran without the cache the user thought sized.
        raise ConfigError(
            f"--cache-size {args.cache_size} sizes a cache, and a local store has none"
            " unless --cache-dir names one: add --cache-dir DIR, or drop --cache-size"
        )
    # Before asking for a secret; a dead mount stays until the unlock has worked.
    check_mountpoint(mountpoint, allow_other=args.allow_other, clear_dead_mount=False)
    log_path, made_log = ("", False) if args.foreground else _log_path(args.log_file, mountpoint)
    limit_malloc_arenas()  # before the volume's load starts threads
    with _removed_on_failure(log_path if made_log else ""), collector_paused():
        loaded, seen, recorded, unlocked = unlock_seen(args, accepting=args.accept_rollback)
        seen.check_load(recorded, loaded)
        seen.warn_if_behind_elsewhere(loaded.live.generation, recorded, read_only=options.read_only)
        warn_if_versioned(loaded.store)
        if not options.read_only:
            check_writer(loaded, takeover=args.takeover)
        unlock_again = unlocker_for_rekeys(args, unlocked) if options.read_only else None
        volume = Volume(loaded, options, unlock_again)
        del unlocked  # nor its secret: the daemon keeps none (see unlocker_for_rekeys)
        prepare(volume, mountpoint, allow_other=args.allow_other, log_file=log_path or None)
        # The metadata just loaded lives as long as the mount: the collector can skip
        # it from now on, and the daemon forked next does not copy its pages to do so.
        gc.freeze()
    if args.foreground:
        setup_logging(verbose=args.verbose)  # a log from now on, on a terminal too: timed
        try:
            return _serve(loaded, volume, seen, mountpoint, _report_to_systemd, _log_on_stderr)
        except Exception as exc:
            # Logged as a daemon's child logs it: main saw trio's wrapper, and said
            # "unexpected ExceptionGroup", with no traceback in the journal.
            return stopped_by(exc, "stderr")[0]
    return daemonize(
        lambda report: _serve_daemon(
            loaded, volume, seen, mountpoint, report, log_path, verbose=args.verbose
        ),
        log_path,
        abandon,
    )


def _serve_daemon(
    loaded: Loaded,
    volume: Volume,
    seen: SeenVolume,
    mountpoint: str,
    report: Report,
    log_path: str,
    *,
    verbose: bool,
) -> int:
    # stderr is the log file now. --verbose holds for the daemon too: set back to INFO
    # here, `sealfs --verbose mount` logged debug detail only until the fork.
    setup_logging(verbose=verbose)

    def reopen() -> None:
        try:
            reopen_log(log_path)
        except OSError as exc:  # the old file stays in use
            log.error("received SIGHUP: cannot reopen log file %s: %s", log_path, exc.strerror)
            return
        log.info("received SIGHUP: reopened log file %s", log_path)

    return _serve(loaded, volume, seen, mountpoint, report, reopen)


def _report_to_systemd(code: int, message: str) -> None:
    """In the foreground there is no caller waiting on a pipe; a service manager may be."""
    if code == 0:
        notify_ready()


def _log_on_stderr() -> None:
    log.info("received SIGHUP: logging to stderr, no log file to reopen")


def _serve(
    loaded: Loaded,
    volume: Volume,
    seen: SeenVolume,
    mountpoint: str,
    report: Report,
    on_hangup: Callable[[], None],
) -> int:
    hold_ending_signals()
    try:
        if not volume.read_only:
            claim_writer(loaded)  # by the process that writes, so its pid is the one recorded
    except SealfsError as exc:
        abandon()
        return _failed_before_ready(mountpoint, exc, report)
    except BaseException:
        # A bug (or an OSError) before anyone was told of the mount: ending without
        # abandon left it dead (ENOTCONN) until the next mount or umount. serve()
        # unmounts for an error met before it reports ready; so does this. The
        # caller (daemonize, or main in the foreground) reports it.
        abandon()
        raise
    log.info(
        "serving %s on %s (generation %d)",
        loaded.store.describe(),
        mountpoint,
        loaded.live.generation,
    )
    ready = False

    def report_ready() -> None:
        nonlocal ready
        report(0, "ready")
        ready = True

    try:
        with kept_current(seen, lambda: volume.commits.head):
            serve(volume, mountpoint, report_ready, on_hangup)
    except SealfsError as exc:
        if not ready:  # nobody was told of the mount, so nobody wrote to it
            return _failed_before_ready(mountpoint, exc, report)
        # Unmounted (SIGTERM, SIGINT, a plain fusermount3 -u) but the final commit failed:
        # the mount is gone, and with it whatever that commit would have carried.
        log.error(
            "unmounted %s without its final commit: %s. Data written after the last"
            " commit (%s) is lost.",
            mountpoint,
            exc,
            _last_commit(volume),
        )
        return exit_code(exc)
    except StoppedByBug as stopped:
        # The daemon ended without a word in its log, its mount gone, and the directory
        # under it took what agents wrote next (see serve). Met after the kernel had
        # unmounted (sealfs umount, fusermount3 -u), there is no dead mount to remove.
        if is_mounted(mountpoint):
            left = (
                f"{mountpoint} is left as a dead mount, so that nothing is written to the"
                " directory under it"
            )
            then = f" Run 'sealfs umount {mountpoint}', then mount again."
        else:
            left, then = f"{mountpoint} was unmounted already, so no dead mount is left", ""
        log.critical(
            "stopped by an unexpected error, a bug in sealfs (please report it): %s. Data"
            " written after the last commit (%s) is lost.%s",
            left,
            _last_commit(volume),
            then,
            exc_info=stopped.__cause__,
        )
        return BUG
    return 0


def _failed_before_ready(mountpoint: str, exc: SealfsError, report: Report) -> int:
    """Report exc to the caller waiting for "ready", and log it: the caller heard only
    "daemon exited" when it came as an exit code, and one gone (killed while it
    waited) hears nothing, so the log must say it."""
    log.error("the mount of %s failed before it was ready: %s", mountpoint, exc)
    report(exit_code(exc), str(exc))
    return exit_code(exc)


def _last_commit(volume: Volume) -> str:
    """The last commit, as the lines naming what a failed stop lost give it."""
    return f"generation {volume.commits.generation}, {format_time(volume.commits.last_commit_ns)}"


def _check_paths(store: str, mountpoint: str, cache_dir: str | None) -> None:
    """Refuse, before unlocking or creating anything, paths that cannot work together.

    A mountpoint inside a local store put the plaintext view inside the store's
    directory, where a backup or rsync of the store copied it. A cache directory
    inside the mountpoint was created there first, so the mount then failed with
    "not empty" and every later mount too. Arguments in the wrong order said the
    mountpoint was "not a sealfs volume: run 'sealfs init'".
    """
    if cache_dir is not None and inside(cache_dir, mountpoint):
        raise ConfigError(
            f"cache directory {os.path.abspath(cache_dir)} is inside the mountpoint:"
            " put it elsewhere (--cache-dir; an S3 store's default is under"
            " $XDG_CACHE_HOME, else ~/.cache)"
        )
    if cache_dir is not None and inside(mountpoint, cache_dir):
        # The cache's files (cache_dir/c/...) then lay in the mount: an fsync of its root
        # (sealfs sync, umount) holds the root's lock while the commit it waits for
        # writes a chunk's copy there, whose lookup waits for that lock. Unkillable.
        raise ConfigError(
            f"mountpoint {mountpoint} is inside the cache directory"
            f" {os.path.abspath(cache_dir)}: the daemon would write its cache through its"
            " own mount and hang; put them apart"
        )
    if cache_dir is not None:
        _check_cache_outside_stores(cache_dir)
    if not is_local_url(store):
        return
    root = str(local_path(store))
    if inside(mountpoint, root):
        raise ConfigError(
            f"mountpoint {mountpoint} is inside the store {root}: the store would hold the"
            " plaintext view; mount it outside the store"
        )
    if not os.path.exists(os.path.join(root, HEADER_NAME)) and os.path.isfile(
        os.path.join(mountpoint, HEADER_NAME)
    ):
        raise ConfigError(
            f"{root} is not a volume but {mountpoint} is: the store comes first"
            " ('sealfs mount STORE MOUNTPOINT')"
        )


def _check_cache_outside_stores(cache_dir: str) -> None:
    """Refuse a cache directory that is, or lies inside, a local store (one holding a
    header): this volume's or any other's (a backup copy, another volume).

    The cache keeps chunk c/<ab>/<id> as the file c/<ab>/<id>, as a local store does,
    and deletes files past --cache-size. Given the store itself, the mount deleted its
    committed chunks at once (evicting down to the cache size) and files read EIO.
    """
    what = "cache directory " + os.path.abspath(cache_dir)
    directory = os.path.realpath(cache_dir)
    while True:
        if os.path.isfile(os.path.join(directory, HEADER_NAME)):
            raise ConfigError(
                f"{what} is inside the sealfs store {directory} (it holds {HEADER_NAME}):"
                " the cache would delete that volume's chunks to keep within its size;"
                " put it outside every store"
            )
        parent = os.path.dirname(directory)
        if parent == directory:
            return
        directory = parent


@contextlib.contextmanager
def _removed_on_failure(new_log: str) -> Iterator[None]:
    """Remove new_log (made by this command, "" for none) if the mount fails while it
    is still empty: a wrong passphrase left an empty log file that named no error."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):
            if new_log and os.path.getsize(new_log) == 0:
                os.unlink(new_log)
        raise


def _log_path(given: str | None, mountpoint: str) -> tuple[str, bool]:
    """The daemon's log file, opened once here, and whether this made it: the daemon
    opens it after the kernel mount exists, where a failure left a dead mount behind,
    and a log file inside the mountpoint made the daemon wait on its own mount forever."""
    if given is None:
        try:
            state = state_dir()
        except ConfigError as exc:
            raise ConfigError(f"{exc}, pass --log-file FILE, or mount with --foreground") from None
        try:
            # 0700, as the XDG base directory spec asks of a directory it creates.
            make_state_dirs(state)
        except OSError as exc:
            # A service account's home is often missing or not its own (/nonexistent):
            # this said only "Permission denied: /nonexistent" (exit 1).
            raise ConfigError(
                f"cannot create the log directory {state}: {exc.strerror}; pass"
                " --log-file FILE (or set XDG_STATE_HOME), or mount with --foreground"
            ) from None
        given = str(state / "sealfs.log")
    path = os.path.abspath(given)
    if inside(path, mountpoint):
        raise ConfigError(f"log file {path} is inside the mountpoint: put it elsewhere")
    flags = os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC
    try:
        try:
            # The owner's only, as reopen_log makes it: created here first, with open()'s
            # 0666 less the umask, it was readable by every user (writable under umask 0).
            os.close(os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600))
        except FileExistsError:  # (or a symlink: its target is made as before)
            os.close(os.open(path, flags | os.O_CREAT, 0o600))
            return path, False
    except OSError as exc:
        raise ConfigError(
            f"cannot open log file {path}: {exc.strerror}: choose another file with"
            " --log-file, or mount with --foreground"
        ) from None
    return path, True


def read_status(mountpoint: str | int) -> dict[str, object]:
    """Ask a live mount (its path, or a descriptor of its root) for its status. Raises
    OSError (ENOTCONN for a dead daemon)."""
    return dict(json.loads(os.getxattr(mountpoint, STATUS_XATTR.decode())))


def commit_mount(mnt: str) -> None:
    """fsync the mount's root: the engine then commits everything. Raises OSError."""
    fd = os.open(mnt, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def live_status(mnt: str, command: str) -> dict[str, object] | None:
    """The status of the sealfs mount on mnt, or None if its daemon has died.

    Raises ConfigError if nothing is mounted there or the mount is not sealfs. A
    directory of a sealfs mount (`sealfs sync .` run in one) is told the mountpoint
    to give the command: "is not mounted" read as if the volume were not.
    """
    if not is_mounted(mnt):
        above = sealfs_mount_above(mnt)
        if above is not None:
            raise ConfigError(
                f"{mnt} is inside the sealfs mount {above}: run 'sealfs {command} {above}'"
            )
        if not os.path.lexists(mnt):  # a typo: "is not mounted" sent users to mount it
            raise ConfigError(f"{mnt} does not exist: give the mountpoint of a sealfs mount")
        raise ConfigError(f"{mnt} is not mounted")
    return mounted_status(mnt)


def mounted_status(mnt: str) -> dict[str, object] | None:
    """live_status of a path known to be a mountpoint."""
    try:
        return read_status(mnt)
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:
            kind = mount_kind(mnt)
            if kind is not None and kind != "fuse.sealfs":
                # Taken for a dead sealfs mount, a dead gocryptfs mount was unmounted by
                # `sealfs umount`, which then said data written to it was lost.
                raise ConfigError(
                    f"{mnt} is {with_article(kind)} mount whose daemon died, not a sealfs"
                    f" mount: remove it with 'fusermount3 -u {mnt}'"
                ) from None
            return None
        owner = sealfs_mount_owner(mnt) if exc.errno == errno.EACCES else None
        if owner is not None and owner != os.getuid():
            # The kernel lets only the user who mounted it (not even root) reach a FUSE
            # mount made without allow_other; "not a sealfs mount" sent them looking.
            raise ConfigError(
                f"{mnt} is a sealfs mount of {_user_name(owner)}, which only that user can"
                " reach (it was mounted without --allow-other): run this command as that user"
            ) from None
        kind = mount_kind(mnt)
        if kind is not None and kind != "fuse.sealfs":
            # Said "is not a sealfs mount: No data available", the errno of the missing
            # status attribute: what is mounted there, and what to give, say more.
            raise ConfigError(
                f"{mnt} is {with_article(kind)} mount, not a sealfs mount: give the"
                " mountpoint of a sealfs mount"
            ) from None
        raise ConfigError(f"{mnt} is not a sealfs mount: {exc.strerror}") from None


def _user_name(uid: int) -> str:
    try:
        return f"user {pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def run_sync(args: argparse.Namespace) -> int:
    mnt = os.path.realpath(args.mountpoint)  # as the mount table holds it
    status = live_status(mnt, "sync")
    if status is None:
        error_line(f"the daemon of {mnt} has died: run 'sealfs umount {mnt}'")
        return FAILURE
    try:
        commit_mount(mnt)
    except OSError as exc:
        error_line(f"{_commit_failed(mnt, exc)}; see {_daemon_log(status)}")
        return FAILURE
    return 0


def _commit_failed(mnt: str, exc: OSError) -> str:
    """ "commit failed" and why, as the daemon's status has it: the fsync's errno alone
    ("Input/output error") sent the operator to the log to learn that the store was
    unreachable, or full, or (a stopped mount, which has no failing commits to show,
    only the reason it stopped) that the mount had been taken over."""
    try:
        status = read_status(mnt)
    except OSError:
        status = {}
    if stopped := status.get("stopped"):
        return (
            f"commit failed ({exc.strerror}): the mount has stopped committing for good"
            f" (its last commit: {_last_commit_of(status)}): {stopped}"
        )
    failure = status.get("commit_failure")
    why = failure.get("error") if isinstance(failure, dict) else None
    return f"commit failed ({exc.strerror}{f': {why}' if why else ''})"


def _daemon_log(status: dict[str, object]) -> str:
    """Where the daemon's log lines are, as the failure messages name it: in a log file,
    by its pid too, since the default log file is every mount's (a host running a
    volume per agent has ten daemons writing there)."""
    log_file = daemon_log_file(status)
    if log_file is None:
        return "the daemon's log file (its daemon, of an older sealfs, does not say which)"
    if not log_file:
        return "the daemon's stderr"
    return f"the daemon log {log_file} (its lines marked [{status.get('pid')}])"


def daemon_log_file(status: dict[str, object]) -> str | None:
    """The log file of the daemon whose live status this is: "" if it logs to its
    stderr (--foreground), None if that cannot be told.

    A daemon started by a build older than the status's log_file (sealfs upgraded
    under a running mount) sends none, which read as --foreground: its stderr is the
    log file it was started with, which /proc shows its owner (and root).
    """
    if "log_file" in status:
        return str(status["log_file"] or "")
    try:
        target = os.readlink(f"/proc/{int(str(status['pid']))}/fd/2")
    except (KeyError, ValueError, OSError):
        return None
    if not target.startswith("/") or target.endswith(" (deleted)"):
        return None  # a pipe or socket: not a file to point to
    try:
        return target if stat.S_ISREG(os.stat(target).st_mode) else ""  # a terminal: stderr
    except OSError:
        return None


def run_umount(args: argparse.Namespace) -> int:
    mnt = os.path.realpath(args.mountpoint)  # as the mount table holds it
    seconds(args.timeout, "--timeout", zero=True)
    status = live_status(mnt, "umount")
    if status is None:
        _fusermount(mnt, lazy=True)
        error_line(
            f"the daemon of {mnt} had died; removed the stale mount."
            " Data written after its last commit is lost."
        )
        return FAILURE
    owner = None if os.getuid() == 0 else sealfs_mount_owner(mnt)  # root may unmount any
    if owner is not None and owner != os.getuid():
        # An --allow-other mount answers everyone, but fusermount3 unmounts only for the
        # user who mounted it: it committed, then said "entry ... not found in /etc/mtab".
        raise ConfigError(
            f"{mnt} is a sealfs mount of {_user_name(owner)}: only that user or root can unmount it"
        )
    pid = int(str(status["pid"]))
    if status.get("fenced") or status.get("stopped"):  # no commit can succeed: don't try
        return _unmount_stopped(mnt, pid, status, args.timeout)
    try:
        commit_mount(mnt)
    except OSError as exc:
        # This very commit may be the one that found the mount taken over (or its store
        # losing writes): it failed, and so would every later one. Kept mounted, as for
        # an outage that a retry may outlast, the mount could never be unmounted.
        after = mounted_status(mnt)
        if after is not None and (after.get("fenced") or after.get("stopped")):
            return _unmount_stopped(mnt, pid, after, args.timeout)
        error_line(
            f"{_commit_failed(mnt, exc)}; {mnt} stays mounted (its last commit:"
            f" {_last_commit_of(after or status)}), see {_daemon_log(status)}"
        )
        return FAILURE
    if _rekey_unfinished(status):
        # Asked again only then: a status sums every file, and the rekey may have ended.
        status = mounted_status(mnt) or status
    if (code := _fusermount(mnt, lazy=False)) != 0:
        return code
    code = _wait_for_exit(pid, args.timeout)
    _say_if_rekey_unfinished(status)
    return code


def _rekey_unfinished(status: dict[str, object]) -> dict[str, object] | None:
    """The daemon's rekey progress, if it runs one not finished yet."""
    rekey = status.get("rekey")
    return rekey if isinstance(rekey, dict) and not rekey.get("finished") else None


def _say_if_rekey_unfinished(status: dict[str, object]) -> None:
    """An unmount stops the daemon's rekey (`sealfs rekey --no-wait`) between objects,
    and said nothing: only `key list` or a status of the store showed the retired key
    still in the header."""
    rekey = _rekey_unfinished(status)
    if rekey is None:
        return
    log.warning(
        "the rekey to key epoch %s was not finished (%s of %s objects checked): the next"
        " read-write mount, or 'sealfs rekey', finishes it",
        rekey.get("to_epoch"), rekey.get("checked"), rekey.get("listed"),
    )  # fmt: skip


def _unmount_stopped(mnt: str, pid: int, status: dict[str, object], timeout: float) -> int:
    """Unmount a mount that stopped committing (fenced, or its store lost writes) and
    say what that lost: no commit can land, so waiting or retrying cannot save it."""
    if (code := _fusermount(mnt, lazy=False)) != 0:
        return code
    _wait_for_exit(pid, timeout)
    lost = f"{_lost(status)} after its last commit ({_last_commit_of(status)}) is lost"
    if status.get("fenced"):
        error_line(
            f"{mnt} was taken over by another writer (fenced), so nothing more could be"
            f" committed there; unmounted it. {lost}."
        )
    else:
        error_line(
            f"{mnt} had stopped committing; unmounted it. {lost}. Cause: {status['stopped']}"
        )
    return FAILURE


def _last_commit_of(status: dict[str, object]) -> str:
    """The mount's last commit as a live status has it: generation and time."""
    at = status.get("last_commit_ns")
    when = format_time(at) if isinstance(at, int) else "at an unknown time"
    return f"generation {status.get('generation')}, {when}"


def _lost(status: dict[str, object]) -> str:
    """What a mount that can commit no more holds uncommitted, as far as its status says."""
    size, records = status.get("pending_bytes"), status.get("pending_records")
    if not isinstance(size, int) or not isinstance(records, int):
        return "Whatever was written"
    if size == 0 and records == 0:
        return "Nothing written"
    return f"What was written ({size} bytes of file data, {records} metadata records)"


def _fusermount(mnt: str, *, lazy: bool) -> int:
    result = fusermount(mnt, lazy=lazy)
    if result.returncode == 0:
        return 0
    if "busy" in result.stderr:
        under = mnt.rstrip("/") + "/"  # mnt is a real path, as the table's are
        inner = [entry.mountpoint for entry in mount_table() if entry.mountpoint.startswith(under)]
        if inner:
            # Said "a process has files open there", which sent users looking for one.
            error_line(f"{mnt} is busy: {inner[0]} is mounted inside it: unmount that first")
        else:
            error_line(
                f"{mnt} is busy (a process has files open there or works in it): close them"
                " and retry"
            )
        return BUSY
    error_line(f"fusermount3 failed: {result.stderr.strip()}")
    return USAGE


def _wait_for_exit(pid: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return 0
        time.sleep(0.05)
    error_line(f"unmounted, but daemon pid {pid} is still committing after {timeout:.0f} s")
    return FAILURE
