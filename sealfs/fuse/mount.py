"""Mounting: kernel session set-up, the trio main loop, and a clean shutdown.

prepare() runs before a daemon forks (so that a bad mountpoint is reported on
the terminal); serve() runs in the process that stays, and owns trio, the
worker threads and the commit loop. An unmount by the kernel (fusermount3
-u) or SIGTERM/SIGINT/SIGQUIT ends serve() after a final commit; SIGHUP does not end it
(logrotate's reopen signal: the caller decides what it does).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import re
import signal
import stat
import subprocess
from collections.abc import AsyncIterator, Callable
from typing import NamedTuple

import pyfuse3
import trio

from sealfs.errors import ConfigError, MountpointBusyError, SealfsError, first_leaf
from sealfs.fuse import conncaps
from sealfs.fuse.operations import Operations, stop_dropping_pages
from sealfs.volume.engine import Volume

log = logging.getLogger("sealfs.fuse")

READ_AHEAD_KB = 1024  # perf notes: 1.8-1.95x faster cold sequential reads than 128
# Seconds without a commit (or, read-only, a replayed one) before an idle daemon gives its
# freed heap memory back to the system (see trim_when_idle).
IDLE_TRIM_AFTER = 10.0
# Seconds an exit waits for a follower's page drop in the kernel before it frees the session.
DROP_WAIT = 5.0


# Each ends the daemon after a final commit: SIGQUIT too, which Ctrl-\ sends to a
# foreground mount and whose default action (a core dump, which sealfs forbids)
# lost what was not committed yet.
_ENDING = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)
# Their default action ends a process like a crash; sealfs has no use for them.
_IGNORED = (signal.SIGUSR1, signal.SIGUSR2)


def prepare(
    volume: Volume, mountpoint: str, *, allow_other: bool, log_file: str | None = None
) -> None:
    """Create the kernel mount. Raises ConfigError or MountpointBusyError naming the problem.

    log_file: the daemon's log (None: its stderr), which `sealfs status`, `sync` and
    `umount` name when they report a failure.
    """
    cleared = check_mountpoint(mountpoint, allow_other=allow_other, clear_dead_mount=True)
    bare = _open_bare(mountpoint) if cleared else None
    try:
        _mount(volume, mountpoint, allow_other=allow_other, log_file=log_file)
        if bare is not None:
            _say_what_the_mount_hides(bare, mountpoint)
    finally:
        if bare is not None:
            os.close(bare)


def _mount(volume: Volume, mountpoint: str, *, allow_other: bool, log_file: str | None) -> None:
    options = set(pyfuse3.default_options)
    options |= {f"fsname=sealfs:{volume.loaded.volume_id.hex()[:8]}", "subtype=sealfs", "noatime"}
    # Said, not left to libfuse's defaults: writes by other users do not clear the
    # set-user-ID and set-group-ID bits (docs/design.md), so they must never take effect.
    options |= {"nosuid", "nodev"}
    if allow_other:
        options.add("allow_other")
    if volume.read_only:
        options.add("ro")
    # The default action of these killed the process like a crash: no final commit, and
    # a dead mount left behind. serve() handles them; until then they are ignored.
    for signum in (signal.SIGHUP, signal.SIGQUIT, *_IGNORED):
        signal.signal(signum, signal.SIG_IGN)
    conncaps.decline_for(volume.read_only)
    try:
        pyfuse3.init(Operations(volume, log_file), mountpoint, options)
    except RuntimeError as exc:
        raise ConfigError(f"cannot mount on {mountpoint}: {exc}") from None
    try:
        conncaps.check_declined()
    except ConfigError:
        pyfuse3.close(unmount=True)
        raise


_held: list[int] = []  # ending signals met before serve() could handle them


def _hold(signum: int, frame: object) -> None:
    _held.append(signum)


def hold_ending_signals() -> None:
    """Hold SIGTERM, SIGINT and SIGQUIT until serve() handles them (a final commit, then
    an unmount); called before the work done between prepare() and serve().

    Claiming the writer commits to the store, seconds on S3, and a signal's default
    action there (`systemctl stop` during a slow start) killed the process at once:
    a dead mount nobody had used, and an empty log. One held is sent again once
    serve() listens, which then stops before the mount is ready; one met after
    serve() returned is dropped, its work done already.
    """
    for signum in _ENDING:
        signal.signal(signum, _hold)


def abandon() -> None:
    """Undo prepare() when the volume cannot be served after all."""
    pyfuse3.close(unmount=True)


class StoppedByBug(Exception):
    """serve() was stopped, after the mount was ready, by an error no code path expects
    (its __cause__): the mount is left dead (see serve), for the caller to report."""


def serve(
    volume: Volume,
    mountpoint: str,
    on_ready: Callable[[], None],
    on_hangup: Callable[[], None] = lambda: None,
) -> None:
    """Answer requests until unmounted or signalled; commit everything on the way out.

    on_hangup runs at each SIGHUP (a daemon reopens its log file for logrotate).

    Stopped, once on_ready returned, by anything but a SealfsError or an interrupt (a
    bug), it leaves the mount dead, as a crash does: every access then fails with
    ENOTCONN. Unmounted, the path led to the empty directory under it, and an agent
    that went on writing its checkpoints there wrote them in plaintext to local disk,
    with nothing to say that the volume was gone. `sealfs umount`, or the next
    `sealfs mount`, removes the dead mount. Raises StoppedByBug from that error then;
    an error before on_ready returned (nobody used the mount) unmounts and is raised
    as it is.
    """
    _tune_malloc()
    served = False

    def ready() -> None:
        nonlocal served
        on_ready()
        # Only once it is said: a report that failed (EPIPE, `sealfs mount` killed) told
        # nobody of the mount, which must not be left dead as a bug met serving it.
        served = True

    unmount = False
    try:
        trio.run(_main, volume, mountpoint, ready, on_hangup)
        unmount = True
    except (SealfsError, KeyboardInterrupt):
        unmount = True  # the final commit failed, or Ctrl-C outside trio's signal handling
        raise
    except Exception as exc:
        if isinstance(exc, ExceptionGroup):
            # The final commit failed (the store unreachable, fenced...): trio wraps it in
            # its nurseries' groups. Raise the error itself, for the caller to report.
            failures, rest = exc.split(SealfsError)
            if failures is not None and rest is None:
                unmount = True
                raise first_leaf(failures) from exc
        if served:
            raise StoppedByBug from exc
        raise
    finally:
        # Whatever ended the loop is what the caller must report: a failing close must
        # not replace it.
        stop_dropping_pages(DROP_WAIT)
        with contextlib.suppress(Exception):
            pyfuse3.close(unmount=unmount or not served)  # nobody used it yet


async def _main(
    volume: Volume,
    mountpoint: str,
    on_ready: Callable[[], None],
    on_hangup: Callable[[], None],
) -> None:
    # The receiver stays open until the final commit is done: closed after the first
    # SIGTERM or SIGINT, it gave a second one (Ctrl-C pressed again, a wrapper such as
    # timeout(1) forwarding it) the default action, which killed the daemon in the
    # middle of its final commit and lost what that commit carried.
    with trio.open_signal_receiver(*_ENDING, signal.SIGHUP, *_IGNORED) as signals:
        while _held:  # sent again, to the receiver now (see hold_ending_signals)
            signal.raise_signal(_held.pop(0))
        async with trio.open_nursery() as watching:
            watching.start_soon(_watch_signals, signals, on_hangup)
            async with volume.running(), trio.open_nursery() as nursery:
                nursery.start_soon(_ready_when_serving, mountpoint, on_ready)
                nursery.start_soon(trim_when_idle, volume, release_free_memory)
                await pyfuse3.main(min_tasks=4, max_tasks=64)
                nursery.cancel_scope.cancel()
            watching.cancel_scope.cancel()
    log.info("unmounted %s", mountpoint)


async def _watch_signals(signals: AsyncIterator[int], on_hangup: Callable[[], None]) -> None:
    terminating = False
    async for signum in signals:
        name = signal.Signals(signum).name
        if signum == signal.SIGHUP:
            on_hangup()
        elif signum in _IGNORED:
            log.info("received %s: ignored (sealfs gives it no meaning)", name)
        elif terminating:
            log.info("received %s: already committing and unmounting", name)
        else:
            log.info("received %s: committing and unmounting", name)
            pyfuse3.terminate()
            terminating = True


_OCTAL = re.compile(rb"\\([0-7]{3})")


class MountEntry(NamedTuple):
    source: str
    mountpoint: str
    kind: str  # the file system type
    options: tuple[str, ...]


def mount_table() -> list[MountEntry]:
    """Every mount this process sees, in order.

    From /proc/self/mounts, which writes space, tab, newline and backslash in
    paths as octal escapes (\\040 ...).
    """
    with open("/proc/self/mounts", "rb") as f:
        rows = [line.split() for line in f]
    return [
        MountEntry(_unescape(row[0]), _unescape(row[1]), row[2].decode(), _options(row[3]))
        for row in rows
        if len(row) > 3
    ]


def _options(field: bytes) -> tuple[str, ...]:
    return tuple(os.fsdecode(option) for option in field.split(b","))


def _unescape(field: bytes) -> str:
    return os.fsdecode(_OCTAL.sub(lambda m: bytes([int(m.group(1), 8)]), field))


def mounts() -> list[tuple[str, str]]:
    """(mountpoint, file system type) of every mount this process sees."""
    return [(entry.mountpoint, entry.kind) for entry in mount_table()]


def is_mounted(path: str) -> bool:
    """Whether something is mounted on path, per the mount table.

    os.path.ismount stats the path, and a mount whose daemon died answers
    ENOTCONN: it looked unmounted, so nothing could clean it up. Symlinks are
    resolved, as the kernel does: the table holds the real path, and a mountpoint
    named through one (a home under /var/home, a unit's /var/run/...) looked
    unmounted, so status, sync and umount refused it.
    """
    target = os.path.realpath(path)  # does not fail on a dead mount: takes it as it is
    return any(mountpoint == target for mountpoint, _ in mounts())


def sealfs_mount_above(path: str) -> str | None:
    """The sealfs mountpoint that path lies under (not on), if any."""
    target = os.path.realpath(path)
    for mountpoint, kind in mounts():
        if kind == "fuse.sealfs" and target.startswith(mountpoint.rstrip("/") + "/"):
            return mountpoint
    return None


def is_empty_dir(path: str) -> bool:
    """Whether path is a directory with no entries (without listing a large one)."""
    if not os.path.isdir(path):
        return False
    with os.scandir(path) as entries:
        return next(entries, None) is None


def _answers(mountpoint: str) -> bool:
    """False for a FUSE mount whose daemon is gone (every request fails ENOTCONN).

    statfs, not stat: the kernel may answer a stat of the root from its cache."""
    try:
        os.statvfs(mountpoint)
    except OSError as exc:
        return exc.errno != errno.ENOTCONN
    return True


def _topmost(mountpoint: str) -> MountEntry | None:
    """The mount on mountpoint that covers the others there, if any."""
    target = os.path.realpath(mountpoint)
    on_it = [entry for entry in mount_table() if entry.mountpoint == target]
    return on_it[-1] if on_it else None  # the table lists a mount after those it covers


def mount_kind(mountpoint: str) -> str | None:
    """The file system type of the topmost mount on mountpoint ("tmpfs", "fuse.sealfs"),
    or None if nothing is mounted there."""
    top = _topmost(mountpoint)
    return None if top is None else top.kind


def _is_sealfs_mount(mountpoint: str) -> bool:
    """Whether the topmost mount on mountpoint is one that sealfs made (see prepare())."""
    top = _topmost(mountpoint)
    return top is not None and top.kind == "fuse.sealfs" and top.source.startswith("sealfs:")


def sealfs_mount_owner(mountpoint: str) -> int | None:
    """The uid that made the topmost sealfs mount on mountpoint (its user_id= option),
    or None if there is none there."""
    top = _topmost(mountpoint)
    if top is None or top.kind != "fuse.sealfs":
        return None
    for option in top.options:
        if option.startswith("user_id=") and option[8:].isdigit():
            return int(option[8:])
    return None


def fusermount(mountpoint: str, *, lazy: bool) -> subprocess.CompletedProcess[str]:
    """Unmount with fusermount3 (lazily: detach now, even a mount whose daemon died)."""
    cmd = ["fusermount3", "-u", *(["-z"] if lazy else []), mountpoint]
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def _clear_dead_mount(mountpoint: str) -> None:
    """Lazily unmount a sealfs mount whose daemon died, so the mount about to be made can be.

    A killed daemon leaves its mount answering ENOTCONN: `sealfs mount` refused it
    and a service restarted on failure (systemd's Restart=on-failure) failed the same
    way forever, where `sealfs umount` would only have done this. What the dead daemon
    had not committed is lost already; the new mount replays what it had.
    """
    result = fusermount(mountpoint, lazy=True)
    if result.returncode != 0:
        raise MountpointBusyError(
            f"mountpoint {mountpoint} holds a sealfs mount whose daemon died and"
            f" fusermount3 could not remove it ({result.stderr.strip()}): run"
            f" 'sealfs umount {mountpoint}'"
        )
    log.warning(
        "removed the dead sealfs mount on %s (its daemon had died; data written after its"
        " last commit is lost)",
        mountpoint,
    )


def check_mountpoint(mountpoint: str, *, allow_other: bool, clear_dead_mount: bool) -> bool:
    """Refuse a mountpoint the kernel mount cannot use. Raises ConfigError or
    MountpointBusyError naming the problem and the fix. Returns whether it removed a
    dead sealfs mount there.

    `sealfs mount` calls it before the unlock as well as prepare() after it: a missing,
    busy or non-empty mountpoint was named only once the passphrase had been typed and
    Argon2 had run (and, with no passphrase source, not at all: "no passphrase").
    A dead sealfs mount there is removed only with clear_dead_mount, once the volume
    is unlocked: removed before an unlock that then failed, it left the plain
    directory under it for agents to write into.
    """
    # Resolved: the mount table holds the real path, and a mountpoint named through a
    # symlink (a unit's /var/run/..., a home under /var/home) kept its dead mount.
    # realpath does not fail on the dead mount: it takes the path as it is.
    real = os.path.realpath(mountpoint)
    cleared = _is_sealfs_mount(real) and not _answers(real)
    if cleared:
        if not clear_dead_mount:
            return False
        _clear_dead_mount(real)
    _check_mountpoint(mountpoint, may_hold_files=cleared)
    if os.geteuid() != 0:
        _check_user_may_mount(mountpoint, allow_other=allow_other)
    return cleared


def _check_mountpoint(mountpoint: str, *, may_hold_files: bool) -> None:
    """may_hold_files: a dead mount was just removed from it (see below)."""
    # Mounted first: a dead mount fails every stat, so it would look like no directory.
    if is_mounted(mountpoint):
        if not _answers(mountpoint):
            # Another FUSE file system's dead mount (gocryptfs) is not sealfs umount's.
            remove = "sealfs umount" if _is_sealfs_mount(mountpoint) else "fusermount3 -u"
            raise MountpointBusyError(
                f"mountpoint {mountpoint} holds a mount whose daemon died:"
                f" run '{remove} {mountpoint}' first"
            )
        raise MountpointBusyError(
            f"mountpoint {mountpoint} is busy (something is mounted there):"
            " unmount it first, or mount on another empty directory"
        )
    if not os.path.exists(mountpoint):
        raise ConfigError(f"mountpoint {mountpoint} does not exist: create it with mkdir")
    if not os.path.isdir(mountpoint):
        raise ConfigError(f"mountpoint {mountpoint} is not a directory: give an empty directory")
    # What was under the dead mount cannot be told from what a program wrote in the
    # moment since it went (an agent retrying `makedirs(state); write` does, at once):
    # refused, a service restarted on failure never came back, and the agent went on
    # writing its state in plaintext to the local disk. The mount says what it hides.
    if not may_hold_files and not is_empty_dir(mountpoint):
        raise ConfigError(
            f"mountpoint {mountpoint} is not empty: the mount would hide its files;"
            " use an empty directory"
        )


def _open_bare(mountpoint: str) -> int | None:
    """A descriptor of the directory under the mount-to-be, to count what the mount
    hides once made (None if it does not open: a user's mountpoint without read
    permission)."""
    try:
        return os.open(mountpoint, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None


def _say_what_the_mount_hides(bare: int, mountpoint: str) -> None:
    """Warn of entries in the bare directory (bare, a descriptor of it taken before the
    mount) now hidden by the mount: written there by a program while no mount was."""
    try:
        count = len(os.listdir(bare))
    except OSError:
        return
    if count:
        log.warning(
            "%d %s appeared in %s while it was being mounted (written there by a program"
            " while nothing was mounted): now hidden by the mount, in plaintext on the"
            " local disk; unmount, move them away, and mount again",
            count,
            "entry" if count == 1 else "entries",
            mountpoint,
        )


FUSE_CONF = "/etc/fuse.conf"


def _check_user_may_mount(mountpoint: str, *, allow_other: bool) -> None:
    """Refuse, in one line naming the fix, what fusermount3 would refuse a user other
    than root. libfuse printed its own line and pyfuse3 added only "cannot mount on
    MNT: fuse_session_mount failed", which named no cause when the line was lost."""
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        raise ConfigError(
            "cannot open /dev/fuse: only root may mount on this machine; ask an"
            " administrator to make /dev/fuse readable and writable by users (udev's"
            " rule gives it mode 0666)"
        )
    if _may_mount_directly():
        return  # libfuse calls mount(2) itself: fusermount3's rules do not apply
    st = os.stat(mountpoint)
    if st.st_mode & stat.S_ISVTX and st.st_uid != os.getuid():
        raise ConfigError(
            f"mountpoint {mountpoint} is a sticky directory of another user, on which"
            " fusermount3 refuses to mount: use a directory you own"
        )
    if not os.access(mountpoint, os.W_OK):
        raise ConfigError(
            f"mountpoint {mountpoint} is not writable by you, and fusermount3 mounts only"
            " on a directory its user may write: use a directory you own"
        )
    if allow_other and not _user_allow_other():
        raise ConfigError(
            f"--allow-other needs a line 'user_allow_other' in {FUSE_CONF} when a user"
            " other than root mounts: ask an administrator to add it, or drop --allow-other"
        )


def _user_allow_other() -> bool:
    """Whether fuse.conf lets users mount with allow_other, read as fusermount3 reads it:
    what follows a '#' is a comment, and blanks around a line's text do not count."""
    try:
        with open(FUSE_CONF, encoding="utf-8", errors="replace") as f:
            return any(line.partition("#")[0].strip() == "user_allow_other" for line in f)
    except OSError:
        return False


CAP_SYS_ADMIN = 21  # linux/capability.h


def _may_mount_directly() -> bool:
    """Whether this process holds CAP_SYS_ADMIN (a service given it by its unit, say).
    libfuse tries mount(2) first and falls back to fusermount3 only when refused, so
    such a process mounts as root does: on a directory it may not write, and with
    allow_other whatever fuse.conf says."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_SYS_ADMIN & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


async def _ready_when_serving(mountpoint: str, on_ready: Callable[[], None]) -> None:
    """Raise read-ahead once the kernel has processed FUSE_INIT's reply, then report ready.

    The kernel sets the mount's read-ahead from that reply (128 KiB), and a file
    takes the mount's read-ahead when it is opened: one opened as soon as the
    mount command returns would be read in 128 KiB requests, 8x as many as with
    1 MiB. Any request waits for INIT to finish, so once a stat of the mountpoint
    (answered by this loop) returns, a value written sticks.
    """
    try:
        # Abandoned if cancelled: a stop before the loop answered FUSE_INIT (SIGTERM at
        # start-up) left this stat waiting on the loop, and the loop, ended, on it.
        st = await trio.to_thread.run_sync(os.stat, mountpoint, abandon_on_cancel=True)
    except OSError as exc:
        log.warning("mount %s does not answer: %s", mountpoint, exc)
    else:
        _tune_read_ahead(st.st_dev)
    # In a thread: on_ready may wait (a readiness datagram to a full socket), and this
    # loop answers the mount's requests meanwhile.
    await trio.to_thread.run_sync(on_ready)


def _tune_read_ahead(device: int) -> None:
    """Ask the kernel for 1 MiB read-ahead on the mount's device (needs root; optional)."""
    try:
        with open(f"/sys/class/bdi/{os.major(device)}:{os.minor(device)}/read_ahead_kb", "w") as f:
            f.write(str(READ_AHEAD_KB))
    except OSError as exc:
        log.debug("could not raise read-ahead: %s", exc)


async def trim_when_idle(volume: Volume, trim: Callable[[], None]) -> None:
    """Call trim once the volume has gone idle: IDLE_TRIM_AFTER seconds without a new
    generation, after the mount's load or a burst of commits. Never while they come.

    _tune_malloc keeps up to 64 MiB free at the heap's top, so that 1 MiB request
    buffers are not faulted in again at every request, and freed buffers and
    compactions leave more free memory below it. Kept by an idle daemon, it added
    up: after a 25-minute agent soak whose files were then deleted, the idle writer
    held 302 MB (malloc: 58 MB in use, 137 MB free), its follower 155 MB; trimmed,
    205 and 107 MB.
    """
    trimmed: int | None = None
    while True:
        seen = volume.commits.generation
        await trio.sleep(IDLE_TRIM_AFTER)
        now = volume.commits.generation
        if now == seen and now != trimmed:
            trimmed = now
            trim()


def release_free_memory() -> None:
    """Give the heap's free pages back to the system (glibc's malloc_trim; a no-op
    where the C library has none)."""
    trim = _libc_function("malloc_trim")
    if trim is not None:
        trim(0)


def _tune_malloc() -> None:
    """Keep glibc from returning and re-faulting our 1 MiB buffers on every request.

    perf notes: this alone took the encrypting write path from 0.45x to 0.98x
    of a plain pyfuse3 passthrough.
    """
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    # 1 MiB request buffers stay in the heap (no fault-in per request); write
    # buffers that grow past 8 MiB get their own mappings, which mremap grows in
    # place and munmap returns, so they neither fragment the heap nor pin RSS.
    mallopt(m_trim_threshold, 64 << 20)
    mallopt(m_mmap_threshold, 8 << 20)


def _libc_function(name: str) -> Callable[..., int] | None:
    """A function of the C library the interpreter runs on, None where it has none.

    Not found by ctypes.util.find_library, which runs ldconfig in a subprocess: at
    each mount, and at each idle trim, on the event loop."""
    try:
        function: Callable[..., int] = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    return function
