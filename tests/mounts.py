"""Driving real mounts from tests: the CLI in subprocesses, cleanup, hang protection.

A VolumeEnv is one store plus one mountpoint. Every mount is made the way a
user makes it (the `sealfs` CLI, daemonised), and every teardown leaves no
mount and no daemon behind, even after a SIGKILL. A watchdog aborts the FUSE
connection if a test outlives its budget, so a hung filesystem call fails the
test (ENOTCONN) instead of hanging CI.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PASSPHRASE = "correct horse battery staple"
CHEAP_KDF = ["--kdf-memory", "64", "--kdf-iterations", "1"]
STATUS_XATTR = "user.sealfs.status"


def write_secret(path: Path, text: str | bytes) -> Path:
    """A secret file as users should keep one: readable by its owner only.

    A file other users can read makes every command warn (one more line on stderr).
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # never readable by others
    with os.fdopen(fd, "wb") as f:
        f.write(text.encode() if isinstance(text, str) else text)
    path.chmod(0o600)  # a file that existed keeps its mode through O_CREAT
    return path


_MODES_LOCK = "/tmp/sealfs-tests-modes.lock"
_modes_held: list[int] = []  # this process's open descriptors of it, outermost first


@contextlib.contextmanager
def modes_added(paths: set[str], bits: int) -> Iterator[None]:
    """Add mode bits to paths for a while, then give each its own mode back."""
    changed = {}
    # `timeout` ends a run with SIGTERM, which Python obeys at once without running any
    # finally: a run killed so left /dev/fuse 0606 and root's home o+x for good.
    terminated = signal.signal(signal.SIGTERM, _interrupt)
    # One holder at a time across test runs: a second run would find the bits set, note
    # nothing to give back, and lose them when the first run gave its modes back.
    lock = os.open(_MODES_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        if not _modes_held:  # nested in this process: already held (flock would wait)
            fcntl.flock(lock, fcntl.LOCK_EX)
        _modes_held.append(lock)
        for path in sorted(paths):
            mode = stat.S_IMODE(os.stat(path).st_mode)
            if mode & bits != bits:
                changed[path] = mode
                os.chmod(path, mode | bits)
        yield
    finally:
        for path, mode in changed.items():
            os.chmod(path, mode)
        if lock in _modes_held:
            _modes_held.remove(lock)
        os.close(lock)  # the outermost holder's close releases the lock
        signal.signal(signal.SIGTERM, terminated)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # as Ctrl-C: pytest tears fixtures down


def python_for_others(*paths: str | Path) -> contextlib.AbstractContextManager[None]:
    """For a while, let other users run this interpreter with sealfs, and reach paths:
    search permission (o+x, not read) on every directory leading to them (a virtualenv
    under root's 0700 home, a test's tmp_path)."""
    code = [sys.executable, *(p for p in sys.path if os.path.isdir(p)), *map(str, paths)]
    reachable = {"/"}
    for path in code:
        parent = os.path.dirname(os.path.realpath(os.path.join(path, "x")))
        while parent != os.path.dirname(parent):
            reachable.add(parent)
            parent = os.path.dirname(parent)
    return modes_added(reachable, 0o001)


def python_as_nobody(script: str, reach: Path) -> subprocess.CompletedProcess[str]:
    """Run a Python script as the user nobody, who may reach the paths under reach."""
    with python_for_others(reach):
        return subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
             sys.executable, "-c", script],
            capture_output=True, text=True, timeout=30, check=False,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, cwd="/",
        )  # fmt: skip


def sealfs(
    *args: str, timeout: float = 60, check: bool = False, **kw: Any
) -> subprocess.CompletedProcess[str]:
    """Run the CLI as users do; never waits forever."""
    command = [sys.executable, "-m", "sealfs.cli.main", *args]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, check=check,
        stdin=subprocess.DEVNULL, **kw,
    )  # fmt: skip


def mounted_sealfs() -> list[tuple[str, str]]:
    """(mountpoint, device) of every sealfs mount on the machine."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            fstype = fields[fields.index("-") + 1]
            if fstype == "fuse.sealfs":
                out.append((fields[4], fields[2]))
    return out


def force_unmount(mountpoint: str) -> None:
    subprocess.run(
        ["fusermount3", "-u", "-z", mountpoint], capture_output=True, check=False, timeout=30
    )


def abort_connection(mountpoint: str) -> None:
    """Make every pending and future request on the mount fail with ENOTCONN."""
    for mnt, dev in mounted_sealfs():
        if mnt == mountpoint:
            minor = dev.split(":")[1]
            with (
                contextlib.suppress(OSError),
                open(f"/sys/fs/fuse/connections/{minor}/abort", "w") as f,
            ):
                f.write("1")


def daemon_pids(store: Path | str) -> list[int]:
    """Pids of sealfs mount daemons serving this store, a path or an s3:// URL (found by
    their command line)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        cmd = _argv(int(entry.name))
        if b"sealfs.cli.main" in b" ".join(cmd) and b"mount" in cmd and str(store).encode() in cmd:
            pids.append(int(entry.name))
    return pids


def _argv(pid: int) -> list[bytes]:
    """A process's arguments; none once it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []


@dataclass
class VolumeEnv:
    """One volume in a local store and one mountpoint, under a test's tmp_path."""

    root: Path
    store: Path = field(init=False)
    mnt: Path = field(init=False)
    passfile: Path = field(init=False)
    recovery_file: Path = field(init=False)
    log: Path = field(init=False)
    cache: Path = field(init=False)
    watchdog_seconds: float = 240.0
    _watchdog: threading.Timer | None = None

    def __post_init__(self) -> None:
        self.store = self.root / "store"
        self.mnt = self.root / "mnt"
        self.passfile = self.root / "passphrase"
        self.recovery_file = self.root / "recovery-key"
        self.log = self.root / "daemon.log"
        self.cache = self.root / "cache"
        self.mnt.mkdir(parents=True, exist_ok=True)
        write_secret(self.passfile, PASSPHRASE + "\n")

    def init(self, *extra: str) -> subprocess.CompletedProcess[str]:
        return sealfs(
            "init", str(self.store), "--passphrase-file", str(self.passfile),
            "--recovery-key-file", str(self.recovery_file), *CHEAP_KDF, *extra, check=True,
        )  # fmt: skip

    def mount_args(self, mountpoint: Path | None = None, *, log: bool = True) -> list[str]:
        """The arguments of `sealfs mount` for this volume (at mnt unless told otherwise)."""
        args = ["mount", str(self.store), str(mountpoint or self.mnt)]
        args += ["--passphrase-file", str(self.passfile)]
        return [*args, "--log-file", str(self.log)] if log else args

    def mount(self, *extra: str, check: bool = True, **kw: Any) -> subprocess.CompletedProcess[str]:
        result = sealfs(*self.mount_args(), *extra, **kw)
        if check:
            assert result.returncode == 0, result.stderr + self.log_text()
        if result.returncode == 0:
            self._arm_watchdog()
        return result

    def umount(self, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = sealfs("umount", str(self.mnt))
        if check:
            assert result.returncode == 0, result.stdout + result.stderr + self.log_text()
        self._disarm_watchdog()
        return result

    def status(self) -> dict[str, Any]:
        return dict(json.loads(os.getxattr(self.mnt, STATUS_XATTR)))

    def store_status(self) -> dict[str, Any]:
        """`sealfs status STORE --json` of the unmounted volume."""
        out = sealfs("status", str(self.store), "--passphrase-file", str(self.passfile), "--json")
        assert out.returncode == 0, out.stderr
        return dict(json.loads(out.stdout))

    def daemon_pids(self) -> list[int]:
        """Pids of the mount daemons serving this volume."""
        return daemon_pids(self.store)

    def wait_for_daemon_exit(self, seconds: float = 30) -> None:
        """Wait until no daemon serves this volume; fail the test if one is still there
        after seconds (a daemon that should stop on its own)."""
        deadline = time.monotonic() + seconds
        while self.daemon_pids():
            assert time.monotonic() < deadline, "the daemon never stopped"
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL the daemon (a crash), then clear the dead mount as an operator would.

        Only the daemon of mnt: a read-only mount of the volume elsewhere lives on."""
        for pid in self._mnt_daemon_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while self._mnt_daemon_pids() and time.monotonic() < deadline:
            time.sleep(0.02)
        force_unmount(str(self.mnt))
        self._disarm_watchdog()

    def _mnt_daemon_pids(self) -> list[int]:
        return [pid for pid in self.daemon_pids() if str(self.mnt).encode() in _argv(pid)]

    def is_mounted(self) -> bool:
        return any(m == str(self.mnt) for m, _ in mounted_sealfs())

    def log_text(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def cleanup(self) -> bool:
        """Remove whatever is left; True if something was (the test leaked a mount)."""
        leaked = self.is_mounted() or bool(self.daemon_pids())
        if self.is_mounted():
            abort_connection(str(self.mnt))
            force_unmount(str(self.mnt))
        for pid in self.daemon_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._disarm_watchdog()
        return leaked

    def _arm_watchdog(self) -> None:
        self._disarm_watchdog()
        self._watchdog = threading.Timer(self.watchdog_seconds, abort_connection, [str(self.mnt)])
        self._watchdog.daemon = True
        self._watchdog.start()

    def _disarm_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None


def wait_until(check: Callable[[], bool], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"not seen within {seconds} s"
        time.sleep(0.05)


def reached(mountpoint: Path, generation: int) -> bool:
    """Whether the mount at mountpoint has replayed up to generation."""
    return bool(json.loads(os.getxattr(mountpoint, STATUS_XATTR))["generation"] >= generation)


@contextlib.contextmanager
def read_only_mount(env: VolumeEnv, interval: float, *extra: str) -> Iterator[Path]:
    """A read-only mount of env's volume beside its writer, following every interval;
    unmounted on leaving (the test fails if that fails)."""
    ro = env.root / "ro"
    ro.mkdir()
    mounted = sealfs(
        *env.mount_args(ro, log=False), "--read-only", "--commit-interval", str(interval),
        "--log-file", str(env.root / "ro.log"), *extra,
    )  # fmt: skip
    assert mounted.returncode == 0, mounted.stderr
    try:
        yield ro
    finally:
        done = sealfs("umount", str(ro))
        if any(m == str(ro) for m, _ in mounted_sealfs()):
            force_unmount(str(ro))
    assert done.returncode == 0, done.stderr


@contextlib.contextmanager
def scratch_volume(
    root: Path, mount_options: tuple[str, ...], *, follower: bool = False
) -> Iterator[tuple[VolumeEnv, Path | None]]:
    """A new volume under root, mounted, with a read-only mount following it if asked;
    everything unmounted on leaving. For exploratory runs outside pytest."""
    env = VolumeEnv(root)
    env.init()
    env.mount(*mount_options)
    try:
        with contextlib.ExitStack() as stack:
            yield env, stack.enter_context(read_only_mount(env, 0.05)) if follower else None
    finally:
        if env.is_mounted():
            env.umount(check=False)
        env.cleanup()
