"""Readiness for systemd Type=notify units, received on a socket as systemd would."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.mounts import VolumeEnv, force_unmount, mounted_sealfs, sealfs


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """A bound datagram socket and the NOTIFY_SOCKET value that names it."""
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(60)
        yield sock, str(path)


def _mount_env(address: str) -> dict[str, str]:
    return {**os.environ, "NOTIFY_SOCKET": address}


def _foreground_mount(volume_env: VolumeEnv, address: str) -> subprocess.Popen[bytes]:
    """`sealfs mount --foreground` as a Type=notify unit runs it (stderr to a pipe)."""
    command = [sys.executable, "-m", "sealfs.cli.main", *volume_env.mount_args(log=False)]
    return subprocess.Popen(
        [*command, "--foreground"],
        env=_mount_env(address),
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _receive(sock: socket.socket) -> dict[str, str]:
    message = sock.recv(4096).decode()
    return dict(line.split("=", 1) for line in message.splitlines())


def test_a_foreground_mount_says_ready_once_it_serves(
    volume_env: VolumeEnv, notify_socket: tuple[socket.socket, str]
) -> None:
    sock, address = notify_socket
    with _foreground_mount(volume_env, address) as daemon:
        try:
            fields = _receive(sock)
            # Whoever systemd starts after READY=1 finds the volume, not an empty directory.
            assert os.path.ismount(volume_env.mnt)
            (volume_env.mnt / "seen").write_text("by a dependent unit")
            assert fields == {"READY": "1"}
        finally:
            sealfs("umount", str(volume_env.mnt))
            _, stderr = daemon.communicate(timeout=60)
    assert daemon.returncode == 0, stderr.decode()


def test_a_daemonised_mount_hands_systemd_the_daemons_pid(
    volume_env: VolumeEnv, notify_socket: tuple[socket.socket, str]
) -> None:
    """The process systemd started exits once the mount is live; MAINPID names the one
    that stays, so the unit stays active and `systemctl stop` signals the daemon."""
    sock, address = notify_socket
    result = sealfs(*volume_env.mount_args(), env=_mount_env(address))
    assert result.returncode == 0, result.stderr
    try:
        fields = _receive(sock)
        assert fields["READY"] == "1"
        assert [int(fields["MAINPID"])] == volume_env.daemon_pids()
    finally:
        volume_env.umount()


def test_an_abstract_notify_socket_is_reached(volume_env: VolumeEnv) -> None:
    """systemd may name a socket in the abstract namespace, written with a leading '@'."""
    name = f"sealfs-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(60)
        result = sealfs(*volume_env.mount_args(), env=_mount_env("@" + name))
        assert result.returncode == 0, result.stderr
        try:
            assert _receive(sock)["READY"] == "1"
        finally:
            volume_env.umount()


def test_an_unreachable_notify_socket_leaves_the_mount_working(
    volume_env: VolumeEnv, tmp_path: Path
) -> None:
    result = sealfs(*volume_env.mount_args(), env=_mount_env(str(tmp_path / "nobody")))
    try:
        assert result.returncode == 0, result.stderr
        assert "cannot tell systemd the mount is ready" in result.stderr
        (volume_env.mnt / "file").write_text("still written")
    finally:
        volume_env.umount()


@pytest.fixture
def full_notify_socket(tmp_path: Path) -> Iterator[str]:
    """A datagram socket that nobody reads, its queue full: a blocking send to it waits
    for ever (a service manager that does not read its socket)."""
    path = str(tmp_path / "full")
    with (
        socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock,
        socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as filler,
    ):
        sock.bind(path)
        filler.connect(path)
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:
                filler.send(b"X")
        yield path


def test_a_foreground_mount_serves_when_the_notification_cannot_go(
    volume_env: VolumeEnv, full_notify_socket: str
) -> None:
    """Regression: the send blocked trio's loop, so the mount answered nothing (and no
    SIGTERM), for as long as the socket's queue stayed full."""
    with _foreground_mount(volume_env, full_notify_socket) as daemon:
        try:
            # From the mount table: a stat would wait on a mount that does not answer.
            while str(volume_env.mnt) not in [mnt for mnt, _ in mounted_sealfs()]:
                assert daemon.poll() is None, daemon.communicate()[1].decode()
                time.sleep(0.05)
            # In a child: a mount that does not answer leaves it waiting, not this test.
            written = subprocess.run(
                ["sh", "-c", f"echo served > {volume_env.mnt}/file"], timeout=60, check=False
            )
            assert written.returncode == 0
            assert sealfs("umount", str(volume_env.mnt)).returncode == 0
            _, stderr = daemon.communicate(timeout=60)
        finally:
            if daemon.poll() is None:
                daemon.kill()
                daemon.wait()
            force_unmount(str(volume_env.mnt))
    assert daemon.returncode == 0, stderr.decode()
    assert "cannot tell systemd the mount is ready" in stderr.decode()


def test_a_daemonised_mount_returns_when_the_notification_cannot_go(
    volume_env: VolumeEnv, full_notify_socket: str
) -> None:
    """Regression: `sealfs mount` waited in the send for ever, its daemon serving."""
    try:
        result = sealfs(*volume_env.mount_args(), env=_mount_env(full_notify_socket))
        assert result.returncode == 0, result.stderr
        assert "cannot tell systemd the mount is ready" in result.stderr
        (volume_env.mnt / "file").write_text("served")
    finally:
        if volume_env.daemon_pids():
            volume_env.umount()
