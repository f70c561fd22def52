"""Fixtures shared by every test layer.

Async tests are plain `async def test_...` functions run under trio by the
hook below. KDF parameters are the minimum sealfs accepts, through one
fixture, so that unlocking costs milliseconds in tests and never anywhere else.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from sealfs.keys.kdf import Argon2Params
from sealfs.keys.slots import Passphrase
from sealfs.store.base import ObjectStore
from sealfs.store.memory import MemoryStore
from sealfs.volume.engine import Volume
from sealfs.volume.loader import check_writer, claim_writer, create_volume, open_volume
from sealfs.volume.options import VolumeOptions
from tests.mounts import VolumeEnv, force_unmount, mounted_sealfs

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


VolumeFactory = Callable[..., Any]


@asynccontextmanager
async def mounted(store: ObjectStore, **options: Any) -> AsyncIterator[Volume]:
    """Open, claim and run a volume on store; unmounts cleanly on exit."""
    loaded = open_volume(store, Passphrase(PASSPHRASE))
    opts = VolumeOptions(**options)
    if not opts.read_only:
        check_writer(loaded, takeover=False)
        claim_writer(loaded)
    volume = Volume(loaded, opts)
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
