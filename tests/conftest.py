"""Fixtures shared by every test layer.

Async tests are plain `async def test_...` functions run under trio by the
hook below. KDF parameters are the minimum sealfs accepts, through one
fixture, so that unlocking costs milliseconds in tests and never anywhere else.
"""

from __future__ import annotations

import fcntl
import functools
import inspect
import logging
import os
import shutil
import struct
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from sealfs.keys.kdf import Argon2Params
from sealfs.keys.slots import Passphrase
from sealfs.meta.codec import SEGMENT_PREFIX
from sealfs.store.base import ObjectStore
from sealfs.store.memory import MemoryStore
from sealfs.volume.engine import Volume
from sealfs.volume.follower import UnlockAgain
from sealfs.volume.loader import check_writer, claim_writer, create_volume, open_volume
from sealfs.volume.options import VolumeOptions
from tests.mounts import VolumeEnv, force_unmount, mounted_sealfs
from tests.prereq import require

PASSPHRASE = b"correct horse battery staple"
RECOVERY_KEY = bytes(range(32))


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Run `async def` tests under trio."""
    if not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    args = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    trio.run(functools.partial(pyfuncitem.obj, **args))
    return True


def cheap_kdf() -> Argon2Params:
    return Argon2Params(memory_kib=65536, iterations=1, lanes=1, salt=os.urandom(16))


@pytest.fixture
def kdf_params() -> Argon2Params:
    return cheap_kdf()


@pytest.fixture
def memory_store() -> ObjectStore:
    return MemoryStore()


class PowerCutStore(MemoryStore):
    """What a local store keeps through a power cut: an object put reaches the disk at
    the next sync of the process that put it, or that found it there when putting it
    create-only (sealfs.store.local, _create_only). Also notes each segment created
    while chunks were unsynced: a cut could keep the segment and lose its chunks."""

    def __init__(self) -> None:
        super().__init__()
        self.unsynced: set[str] = set()
        self.early_segments: list[str] = []
        self._mine: set[str] = set()

    def put(self, name: str, data: bytes, *, replace: bool = True) -> None:
        self._mine.add(name)
        super().put(name, data, replace=replace)
        self.unsynced.add(name)

    def put_if_absent(self, name: str, data: bytes) -> None:
        if name.startswith(SEGMENT_PREFIX) and any(n.startswith("c/") for n in self.unsynced):
            self.early_segments.append(name)
        super().put_if_absent(name, data)
        self._mine.add(name)
        self.unsynced.add(name)

    def sync(self) -> None:
        super().sync()
        self.unsynced -= self._mine
        self._mine.clear()

    def cut_power(self) -> None:
        for name in self.unsynced:
            self.delete(name)
        self.unsynced.clear()
        self._mine.clear()


VolumeFactory = Callable[..., Any]


class WrappedStore:
    """Base of the test stores that wrap another to intercept some of its calls: what a
    subclass does not define goes to the inner store."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@asynccontextmanager
async def mounted(
    store: ObjectStore,
    unlock_again: UnlockAgain | None = None,
    *,
    takeover: bool = False,
    **options: Any,
) -> AsyncIterator[Volume]:
    """Open, claim and run a volume on store; unmounts cleanly on exit. takeover: claim
    it from a writer that still holds it (`sealfs mount --takeover`)."""
    loaded = open_volume(store, Passphrase(PASSPHRASE))
    opts = VolumeOptions(**options)
    if not opts.read_only:
        check_writer(loaded, takeover=takeover)
        claim_writer(loaded)
    volume = Volume(loaded, opts, unlock_again)
    async with volume.running():
        yield volume


@pytest.fixture
def volume_store(memory_store: ObjectStore, kdf_params: Argon2Params) -> ObjectStore:
    """A memory store holding a freshly created, empty volume."""
    create_volume(memory_store, PASSPHRASE, kdf_params, RECOVERY_KEY)
    return memory_store


@pytest.fixture
def no_errors_logged(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Fail the test if sealfs logged a warning or error it did not expect."""
    caplog.set_level(logging.WARNING, logger="sealfs")
    yield
    bad = [
        r for r in caplog.records if r.name.startswith("sealfs") and r.levelno >= logging.WARNING
    ]
    assert not bad, [r.getMessage() for r in bad]


@pytest.fixture
def volume_env(tmp_path: Path) -> Iterator[VolumeEnv]:
    """An initialised local volume and a mountpoint; fails the test if it leaks a mount."""
    env = VolumeEnv(tmp_path)
    env.init()
    yield env
    assert not env.cleanup(), "the test left a mount or a daemon behind"


@pytest.fixture
def mounted_env(volume_env: VolumeEnv) -> Iterator[VolumeEnv]:
    """volume_env, mounted; unmounted cleanly (and checked) at the end."""
    volume_env.mount()
    yield volume_env
    if volume_env.is_mounted():
        volume_env.umount()


@pytest.fixture(autouse=True, scope="session")
def host_state_of_this_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """What mounts record about the volumes they saw goes under this run's temporary
    directory (here and in every CLI subprocess), not into the home directory."""
    state = tmp_path_factory.mktemp("xdg-state")
    saved = os.environ.get("XDG_STATE_HOME")
    os.environ["XDG_STATE_HOME"] = str(state)
    yield state
    if saved is None:
        del os.environ["XDG_STATE_HOME"]
    else:
        os.environ["XDG_STATE_HOME"] = saved


@pytest.fixture(autouse=True, scope="session")
def no_mount_left_behind(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """After the whole run, no sealfs mount made by this run may remain."""
    base = str(tmp_path_factory.getbasetemp())
    yield
    left = [mnt for mnt, _ in mounted_sealfs() if mnt.startswith(base)]
    for mnt in left:
        force_unmount(mnt)
    assert not left, f"mounts left behind: {left}"


# ioctl(FS_IOC_SHUTDOWN / EXT4_IOC_SHUTDOWN) with EXT4_GOING_FLAGS_NOLOGFLUSH: the file
# system stops writing at once, neither writing back dirty pages nor committing its
# journal, as if the power had failed (xfstests' "godown").
_FS_IOC_SHUTDOWN = 0x8004587D
_GOING_NOLOGFLUSH = 2


class CrashableDisk:
    """A small ext4 file system on a loop device whose power can be cut (root only).

    The loop device stays attached across cuts, so the file system comes back with the
    same device number, as a disk that lost power and came back under the same name
    does: a process that looks at the store's directory sees the same directory.
    """

    def __init__(self, image: Path, path: Path, device: str) -> None:
        self.image = image
        self.path = path
        self.device = device

    def mount(self) -> None:
        # A long journal commit interval: nothing becomes durable unless flushed.
        _run("mount", "-t", "ext4", "-o", "commit=600", self.device, str(self.path))

    def cut(self) -> None:
        """Lose everything not flushed: every later call on the file system fails (EIO)."""
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.ioctl(fd, _FS_IOC_SHUTDOWN, struct.pack("I", _GOING_NOLOGFLUSH))
        finally:
            os.close(fd)

    def remount(self) -> None:
        """Unmount the file system and mount it again (replaying its journal)."""
        _run("umount", str(self.path))
        self.mount()

    def cut_power(self) -> None:
        """Lose everything not flushed, then unmount and mount again (replaying the journal)."""
        self.cut()
        self.remount()


def _run(*command: str) -> str:
    result = subprocess.run(command, capture_output=True, text=True, check=False, timeout=60)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {result.stderr.strip()}")
    return result.stdout


@contextmanager
def crashable_ext4(tmp_path: Path, size: int = 64 << 20) -> Iterator[CrashableDisk]:
    """An empty ext4 file system of size bytes mounted at tmp_path / "disk"; unmounted
    and its loop device detached afterwards, whatever the test left."""
    require(os.geteuid() == 0, "a loop-mounted ext4 needs root")
    require(shutil.which("mkfs.ext4") is not None, "mkfs.ext4 (e2fsprogs) is needed")
    image, path = tmp_path / "ext4.img", tmp_path / "disk"
    tmp_path.mkdir(parents=True, exist_ok=True)
    with open(image, "wb") as f:
        f.truncate(size)
    _run("mkfs.ext4", "-q", "-F", str(image))
    path.mkdir()
    try:
        device = _run("losetup", "--find", "--show", str(image)).strip()
    except RuntimeError as exc:
        require(False, f"cannot attach a loop device here: {exc}")
        raise
    try:
        disk = CrashableDisk(image, path, device)
        try:
            disk.mount()
        except RuntimeError as exc:
            require(False, f"cannot mount an ext4 loop device here: {exc}")
        try:
            yield disk
        finally:
            subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)
    finally:
        subprocess.run(["losetup", "-d", device], check=False, capture_output=True)


@pytest.fixture
def crashable_disk(tmp_path: Path) -> Iterator[CrashableDisk]:
    """An empty ext4 file system mounted at tmp_path / "disk" that a test can crash."""
    with crashable_ext4(tmp_path) as disk:
        yield disk
