"""S3 fixtures: the run's moto server, a bucket per test, a fault proxy, a narrow link,
S3 volumes.

Everything talks HTTP to the loopback only: moto binds 127.0.0.1 (never
0.0.0.0; a second server, for IPv6 endpoints, [::1]), the proxy too, and the
environment holds fake credentials, no profile and no instance metadata
(tests/s3/server.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.mounts import CHEAP_KDF, VolumeEnv, daemon_pids, sealfs
from tests.prereq import require
from tests.s3.link import NarrowLink
from tests.s3.proxy import FaultProxy
from tests.s3.server import moto_endpoint, moto_endpoint_v6, new_bucket


@pytest.fixture(scope="session")
def moto() -> str:
    """The endpoint URL of the run's moto server (http://127.0.0.1:PORT)."""
    return moto_endpoint()


@pytest.fixture(scope="session")
def moto_v6(moto: str) -> str:
    """http://[::1]:PORT of a moto server on the IPv6 loopback (skips without one, and
    fails in CI, where a skip would count as a pass)."""
    endpoint = moto_endpoint_v6()
    require(endpoint is not None, "an IPv6 loopback (::1) for a second moto server")
    assert endpoint is not None
    return endpoint


@pytest.fixture
def bucket(moto: str) -> str:
    """A fresh, empty bucket on the moto server."""
    return new_bucket()


@pytest.fixture
def proxy(moto: str) -> Iterator[FaultProxy]:
    """A fault proxy in front of moto, injecting nothing until told to."""
    p = FaultProxy(moto, seed=1234).start()
    yield p
    p.stop()


@pytest.fixture
def narrow_link(moto: str) -> Iterator[NarrowLink]:
    """A link to moto whose uploads share 512 KiB/s (answers come at full speed)."""
    link = NarrowLink(moto, 512 << 10).start()
    yield link
    link.stop()


@dataclass
class S3VolumeEnv(VolumeEnv):
    """A volume at s3://BUCKET/vol reached through `endpoint`, and a mountpoint."""

    url: str = ""
    endpoint: str = ""
    extra_env: dict[str, str] = field(default_factory=dict)

    def _env(self) -> dict[str, str]:
        return {**os.environ, **self.extra_env}

    def init(self, *extra: str) -> Any:
        return sealfs(
            "init", self.url, "--s3-endpoint", self.endpoint, "--passphrase-file",
            str(self.passfile), "--recovery-key-file", str(self.recovery_file), *CHEAP_KDF,
            *extra, check=True, env=self._env(),
        )  # fmt: skip

    def mount(self, *extra: str, check: bool = True) -> Any:
        result = sealfs(
            "mount", self.url, str(self.mnt), "--s3-endpoint", self.endpoint,
            "--passphrase-file", str(self.passfile), "--log-file", str(self.log),
            "--cache-dir", str(self.cache), *extra, timeout=120, env=self._env(),
        )  # fmt: skip
        if check:
            assert result.returncode == 0, result.stderr + self.log_text()
        if result.returncode == 0:
            self._arm_watchdog()
        return result

    def umount(self, check: bool = True) -> Any:
        result = sealfs("umount", str(self.mnt), timeout=120)
        if check:
            assert result.returncode == 0, result.stdout + result.stderr + self.log_text()
        self._disarm_watchdog()
        return result

    def daemon_pids(self) -> list[int]:
        return daemon_pids(self.url)


@pytest.fixture
def s3_env(tmp_path: Path, bucket: str, proxy: FaultProxy) -> Iterator[S3VolumeEnv]:
    """An initialised volume at s3://BUCKET/vol, reached through the (quiet) proxy.

    Fails the test if it leaves a mount or a daemon behind.
    """
    env = S3VolumeEnv(tmp_path, url=f"s3://{bucket}/vol", endpoint=proxy.url)
    env.init()
    yield env
    assert not env.cleanup(), "the test left a mount or a daemon behind"
