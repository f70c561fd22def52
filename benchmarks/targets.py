"""The three filesystems compared: a plain directory, sealfs and gocryptfs.

Each target lives in its own directory under the work dir. `path` is where
a benchmark puts its files; `cold()` makes the next read come from disk
(unmount and remount a FUSE target, then drop the kernel's caches);
`teardown()` never leaves a mount behind, whatever state it finds.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from pathlib import Path

from benchmarks.util import (
    drop_caches,
    is_mounted,
    lazy_unmount,
    log,
    pids_matching,
    run,
    tree_bytes,
    wait_gone,
)
from tests.mounts import CHEAP_KDF, PASSPHRASE, abort_connection, daemon_pids, sealfs

PLAIN, SEALFS, GOCRYPTFS = "plain", "sealfs", "gocryptfs"
ORDER = (SEALFS, PLAIN, GOCRYPTFS)


class Target:
    name = ""
    is_fuse = True

    def __init__(self, root: Path) -> None:
        self.root = root
        self.mounted = False

    @property
    def path(self) -> Path:
        raise NotImplementedError

    def store_dir(self) -> Path | None:
        return None

    def daemon_pid(self) -> int | None:
        return None

    def setup(self) -> None:
        """Create an empty filesystem and mount it."""
        if self.root.exists():
            self.teardown()
        self.root.mkdir(parents=True)
        self._create()
        self.mount()

    def _create(self) -> None:
        raise NotImplementedError

    def mount(self) -> float:
        """Mount; returns the seconds the mount command took."""
        return 0.0

    def umount(self) -> float:
        return 0.0

    def cold(self) -> None:
        """Make the next accesses miss every cache: remount (FUSE) and drop caches."""
        if self.is_fuse:
            self.umount()
        drop_caches()
        if self.is_fuse:
            self.mount()

    def emergency_unmount(self) -> None:
        """Whatever happened, leave no mount and no daemon."""

    def teardown(self) -> None:
        try:
            if self.mounted:
                self.umount()
        except Exception as exc:
            log(f"{self.name}: clean unmount failed ({exc}); forcing it")
        finally:
            self.emergency_unmount()
            self.mounted = False
            shutil.rmtree(self.root, ignore_errors=True)


class PlainTarget(Target):
    name = PLAIN
    is_fuse = False

    @property
    def path(self) -> Path:
        return self.root / "dir"

    def _create(self) -> None:
        self.path.mkdir()

    def store_dir(self) -> Path | None:
        return self.path


class SealfsTarget(Target):
    """A sealfs volume in a local store, mounted with the CLI as a user would."""

    name = SEALFS

    def __init__(self, root: Path, *, default_kdf: bool = False) -> None:
        """default_kdf: unlock with what `sealfs init` calibrates (about 0.5 s), as a
        user's mount does, instead of the cheapest parameters, which spare the other
        benchmarks that cost at each of their many mounts."""
        super().__init__(root)
        self.store = root / "store"
        self.mnt = root / "mnt"
        self.passfile = root / "passphrase"
        self.log_file = root / "daemon.log"
        self.kdf_options = () if default_kdf else CHEAP_KDF
        self._pid: int | None = None

    @property
    def path(self) -> Path:
        return self.mnt

    def store_dir(self) -> Path | None:
        return self.store

    def daemon_pid(self) -> int | None:
        return self._pid

    def _create(self) -> None:
        self.mnt.mkdir()
        self.passfile.write_text(PASSPHRASE + "\n")
        self.passfile.chmod(0o600)  # as users should keep it (sealfs warns otherwise)
        result = sealfs(
            "init", str(self.store), "--passphrase-file", str(self.passfile),
            "--recovery-key-file", str(self.root / "recovery-key"), *self.kdf_options,
            timeout=120,
        )  # fmt: skip
        if result.returncode != 0:
            raise RuntimeError(f"sealfs init failed: {result.stderr}")

    def mount(self) -> float:
        t = time.perf_counter()
        result = sealfs(
            "mount", str(self.store), str(self.mnt), "--passphrase-file", str(self.passfile),
            "--log-file", str(self.log_file), timeout=600,
        )  # fmt: skip
        elapsed = time.perf_counter() - t
        if result.returncode != 0:
            raise RuntimeError(f"sealfs mount failed: {result.stderr}{self._log_tail()}")
        self.mounted = True
        pids = daemon_pids(self.store)
        self._pid = pids[0] if pids else None
        return elapsed

    def umount(self) -> float:
        t = time.perf_counter()
        result = sealfs("umount", str(self.mnt), "--timeout", "1800", timeout=1900)
        elapsed = time.perf_counter() - t
        if result.returncode != 0:
            raise RuntimeError(
                f"sealfs umount failed: {result.stdout}{result.stderr}{self._log_tail()}"
            )
        self.mounted = False
        self._pid = None
        return elapsed

    def emergency_unmount(self) -> None:
        if is_mounted(self.mnt):
            abort_connection(str(self.mnt))
            lazy_unmount(self.mnt)
        for pid in daemon_pids(self.store):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _log_tail(self) -> str:
        if not self.log_file.exists():
            return ""
        return "\n--- daemon log (tail) ---\n" + "\n".join(
            self.log_file.read_text(errors="replace").splitlines()[-30:]
        )

    def log_errors(self) -> list[str]:
        if not self.log_file.exists():
            return []
        return [ln for ln in self.log_file.read_text(errors="replace").splitlines()
                if " ERROR " in ln or "Traceback" in ln or "WARNING" in ln]  # fmt: skip


class GocryptfsTarget(Target):
    """gocryptfs with its defaults (AES-256-GCM, scrypt N=2^16), torn down with fusermount3."""

    name = GOCRYPTFS

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.cipher = root / "cipher"
        self.mnt = root / "mnt"
        self.passfile = root / "passphrase"
        self._pid: int | None = None

    @property
    def path(self) -> Path:
        return self.mnt

    def store_dir(self) -> Path | None:
        return self.cipher

    def daemon_pid(self) -> int | None:
        return self._pid

    def _create(self) -> None:
        self.cipher.mkdir()
        self.mnt.mkdir()
        self.passfile.write_text(PASSPHRASE + "\n")
        run(["gocryptfs", "-init", "-q", "-passfile", str(self.passfile), str(self.cipher)])

    def mount(self) -> float:
        t = time.perf_counter()
        run(["gocryptfs", "-q", "-passfile", str(self.passfile), str(self.cipher), str(self.mnt)])
        elapsed = time.perf_counter() - t
        self.mounted = True
        pids = pids_matching("gocryptfs", str(self.cipher))
        self._pid = pids[0] if pids else None
        return elapsed

    def umount(self) -> float:
        pids = pids_matching("gocryptfs", str(self.cipher))
        t = time.perf_counter()
        run(["fusermount3", "-u", str(self.mnt)])
        wait_gone(pids, 120)
        self.mounted = False
        self._pid = None
        return time.perf_counter() - t

    def emergency_unmount(self) -> None:
        if is_mounted(self.mnt):
            lazy_unmount(self.mnt)
        for pid in pids_matching("gocryptfs", str(self.cipher)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def make_target(name: str, workdir: Path, bench: str) -> Target:
    root = workdir / "targets" / f"{bench}-{name}"
    if name == SEALFS:
        # Mount time is a figure of its own: it pays for unlocking as users do (gocryptfs
        # runs with its default scrypt cost too).
        return SealfsTarget(root, default_kdf=bench == "mount")
    cls = {PLAIN: PlainTarget, GOCRYPTFS: GocryptfsTarget}[name]
    return cls(root)


def store_bytes(target: Target) -> int:
    store = target.store_dir()
    assert store is not None
    return tree_bytes(store)
