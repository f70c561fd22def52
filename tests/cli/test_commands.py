"""The CLI commands as users run them: init, mount options, status, umount, takeover."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sealfs.cli.mount_cmd import _daemon_log, _say_if_rekey_unfinished
from sealfs.cli.status_cmd import _rows
from tests.fuse.test_crash import mount_with_a_bug
from tests.mounts import CHEAP_KDF, VolumeEnv, sealfs, write_secret

pytestmark = pytest.mark.fuse

FAILURE, USAGE, BUSY = 1, 2, 5


def one_line(result: subprocess.CompletedProcess[str], code: int) -> str:
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    err = result.stderr.strip()
    assert err and "\n" not in err and "Traceback" not in err, err
    return err


def status_json(*args: str) -> dict[str, Any]:
    result = sealfs("status", *args, "--json")
    assert result.returncode == 0, result.stderr
    return dict(json.loads(result.stdout))


def test_init_prints_a_recovery_key_that_unlocks(tmp_path: Path) -> None:
    env = VolumeEnv(tmp_path)
    result = sealfs("init", str(env.store), "--passphrase-file", str(env.passfile), *CHEAP_KDF)
    assert result.returncode == 0, result.stderr
    keys = re.findall(r"sfrk(?:-[a-z2-7]{1,4}){14}", result.stdout)
    assert len(keys) == 1, result.stdout
    # Captured here (a pipe), as a log or a CI job would keep it: said, on stderr.
    assert "the new recovery key goes to stdout, which is not a terminal" in result.stderr
    assert "--recovery-key-file FILE writes it to a file of its own" in result.stderr
    assert keys[0] not in result.stderr
    write_secret(env.recovery_file, keys[0] + "\n")
    try:
        mounted = sealfs(
            "mount", str(env.store), str(env.mnt), "--recovery-key-file", str(env.recovery_file),
            "--log-file", str(env.log),
        )  # fmt: skip
        assert mounted.returncode == 0, mounted.stderr
        (env.mnt / "hello").write_text("unlocked with the printed key")
        env.umount()
        env.mount()  # and the passphrase still opens it
        assert (env.mnt / "hello").read_text() == "unlocked with the printed key"
        env.umount()
        assert keys[0] not in env.log_text()
    finally:
        assert not env.cleanup()


def test_status_of_a_mount_and_of_a_store(mounted_env: VolumeEnv) -> None:
    env = mounted_env
    sizes = {"a": 0, "b": 12_345, "c": 2_500_000}
    (env.mnt / "dir").mkdir()
    for name, size in sizes.items():
        (env.mnt / "dir" / name).write_bytes(os.urandom(size))
    os.symlink("dir/a", env.mnt / "link")
    live = status_json(str(env.mnt))
    assert live["files"] == len(sizes)
    assert live["logical_bytes"] == sum(sizes.values())
    assert live["pid"] == env.status()["pid"] and live["read_only"] is False
    assert isinstance(live["generation"], int) and live["generation"] >= 2
    assert live["log_file"] == str(env.log)  # what a failed sync or umount points to
    table = sealfs("status", str(env.mnt))
    assert table.returncode == 0 and "generation" in table.stdout, table.stderr
    assert "…" not in table.stdout  # long paths wrap in the table; cut, they named nothing
    wide = sealfs("status", str(env.mnt), env={**os.environ, "COLUMNS": "500"})
    assert str(env.log) in wide.stdout
    inner = one_line(sealfs("status", str(env.mnt / "dir")), USAGE)
    assert f"inside the sealfs mount {env.mnt}: run 'sealfs status {env.mnt}'" in inner
    env.umount()
    stored = status_json(str(env.store), "--passphrase-file", str(env.passfile))
    assert stored["files"] == len(sizes)
    assert stored["logical_bytes"] == sum(sizes.values())
    assert stored["generation"] > live["generation"]  # data commits and the release
    assert stored["pid"] is None and stored["pending_bytes"] == 0
    assert 0 < int(stored["stored_bytes"]) <= sum(sizes.values()) + 36 * int(stored["chunks"])


def test_status_of_a_store_a_mount_writes_names_it_and_does_not_say_nothing_is_pending(
    volume_env: VolumeEnv,
) -> None:
    """Regression: with 5 MiB written and not committed, status of the store said "0 B
    not committed" and named no writer: an operator checking before a backup or a
    shutdown was told that nothing was pending."""
    env = volume_env
    env.mount("--commit-interval", "3600")
    try:
        (env.mnt / "f").write_bytes(os.urandom(5 << 20))
        stored = status_json(str(env.store), "--passphrase-file", str(env.passfile))
        assert stored["pending_bytes"] is None and stored["pending_records"] is None
        (pid,) = env.daemon_pids()
        writer = stored["writer"]
        assert writer["pid"] == pid and writer["this_host"] and writer["alive"]
        assert writer["mountpoint"] == str(env.mnt)
        table = sealfs("status", str(env.store), "--passphrase-file", str(env.passfile),
                       env={**os.environ, "COLUMNS": "500"})  # fmt: skip
        assert table.returncode == 0, table.stderr
        assert "not known from the store" in table.stdout, table.stdout
        assert f"pid {pid} on this host, mounted at {env.mnt}" in table.stdout, table.stdout
        assert f"'sealfs status {env.mnt}' shows what it has not committed" in table.stdout
        live = env.status()
        assert live["pending_bytes"] >= 5 << 20  # where it is known
        # Sizes count committed data: "5.0 MiB (0 B outside holes)" read as holes.
        assert dict(_rows(live))["logical size"] == "5.0 MiB (0 B committed outside holes)"
    finally:
        env.umount()
    released = env.store_status()
    assert released["writer"] is None
    assert dict(_rows(released))["logical size"] == "5.0 MiB (5.0 MiB outside holes)"
    env.mount()
    (crashed,) = env.daemon_pids()
    env.kill()
    gone = env.store_status()["writer"]
    assert gone["pid"] == crashed
    assert gone["this_host"] and gone["alive"] is False and gone["mountpoint"] is None
    table = sealfs("status", str(env.store), "--passphrase-file", str(env.passfile),
                   env={**os.environ, "COLUMNS": "500"})  # fmt: skip
    assert "gone, without unmounting" in table.stdout, table.stdout


def test_status_of_a_store_url_run_from_inside_a_mount(mounted_env: VolumeEnv) -> None:
    """Regression: status took its target for a path under the working directory, so a
    file:// or s3:// URL given from inside a mount was refused as "inside the sealfs
    mount", and the store could not be asked from there."""
    env = mounted_env
    (env.mnt / "dir").mkdir()
    result = sealfs(
        "status", f"file://{env.store}", "--passphrase-file", str(env.passfile), "--json",
        cwd=env.mnt / "dir",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["pid"] is None  # the store's status, not the mount's
    inner = one_line(sealfs("status", f"file://{env.mnt / 'dir'}"), USAGE)
    assert f"inside the sealfs mount {env.mnt}" in inner  # a URL into the mount still is


def test_the_daemon_leaves_the_directory_it_was_started_from(volume_env: VolumeEnv) -> None:
    """Regression: the daemon kept the caller's working directory for the life of the
    mount, so the file system holding it could not be unmounted. Relative paths given
    to mount must still work."""
    env = volume_env
    result = sealfs(
        "mount", "store", "mnt", "--passphrase-file", "passphrase", "--log-file", "daemon.log",
        "--cache-dir", "cache", cwd=env.root,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr + env.log_text()
    try:
        assert os.readlink(f"/proc/{env.status()['pid']}/cwd") == "/"
        (env.mnt / "kept").write_bytes(b"through relative paths")
        assert sealfs("sync", str(env.mnt)).returncode == 0
        assert any(env.cache.rglob("*")), "the relative cache directory is used"
    finally:
        env.umount()
    env.mount()
    assert (env.mnt / "kept").read_bytes() == b"through relative paths"
    env.umount()


def test_umount_of_a_directory_that_is_not_mounted(tmp_path: Path) -> None:
    err = one_line(sealfs("umount", str(tmp_path)), USAGE)
    assert "not mounted" in err


def test_a_mount_whose_daemon_died_is_cleared_by_umount(mounted_env: VolumeEnv) -> None:
    """Regression: a mount whose daemon died answers ENOTCONN, which os.path.ismount took
    for "not mounted": umount and sync said so, mount said the mountpoint did not exist,
    and nothing of sealfs could clear it."""
    env = mounted_env
    (env.mnt / "kept").write_text("committed")
    assert sealfs("sync", str(env.mnt)).returncode == 0
    kill_daemons(env)
    assert "has died" in one_line(sealfs("sync", str(env.mnt)), FAILURE)
    assert "has died" in one_line(sealfs("status", str(env.mnt)), FAILURE)
    assert "removed the stale mount" in one_line(sealfs("umount", str(env.mnt)), FAILURE)
    assert not env.is_mounted()
    env.mount()
    assert (env.mnt / "kept").read_text() == "committed"


def kill_daemons(env: VolumeEnv) -> None:
    """SIGKILL the mount's daemon and wait until it is gone, leaving its dead mount."""
    for pid in env.daemon_pids():
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while env.daemon_pids() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert env.is_mounted() and not env.daemon_pids()


def test_mount_replaces_a_sealfs_mount_whose_daemon_died(mounted_env: VolumeEnv) -> None:
    """Regression: mount refused a dead sealfs mount ("run 'sealfs umount' first"), so a
    service restarted on failure (systemd Restart=on-failure) failed the same way forever
    after a crash, and never came back without a human."""
    env = mounted_env
    (env.mnt / "kept").write_text("committed")
    assert sealfs("sync", str(env.mnt)).returncode == 0
    kill_daemons(env)
    again = env.mount()
    assert "removed the dead sealfs mount" in one_line(again, 0)
    assert (env.mnt / "kept").read_text() == "committed"
    live = sealfs(
        "mount", str(env.store), str(env.mnt), "--passphrase-file", str(env.passfile),
        "--log-file", str(env.log), "--read-only",
    )  # fmt: skip
    assert "busy" in one_line(live, BUSY)  # a live mount stays
    assert (env.mnt / "kept").read_text() == "committed"
    env.umount()


def test_a_mount_that_fails_to_unlock_leaves_a_dead_mount_in_place(
    mounted_env: VolumeEnv,
) -> None:
    """The dead mount goes only once the volume is unlocked: removed before, a restart
    that cannot unlock (a wrong passphrase, KMS unreachable) left the plain directory
    for agents to write their checkpoints into, in plaintext."""
    env = mounted_env
    kill_daemons(env)
    wrong = write_secret(env.root / "wrong", "not the passphrase")
    failed = sealfs("mount", str(env.store), str(env.mnt), "--passphrase-file", str(wrong),
                    "--log-file", str(env.log))  # fmt: skip
    assert "wrong passphrase" in one_line(failed, 3)
    assert env.is_mounted() and not env.daemon_pids()  # still dead: writes there fail
    assert "removed the dead sealfs mount" in one_line(env.mount(), 0)
    env.umount()


# An agent that retries on errors makes its state directory again and writes there in
# the moment between the lazy unmount of the dead mount and the new mount, when the
# mountpoint is a bare directory of the local disk.
AGENT_IN_THE_GAP = """
import os
from sealfs.fuse import mount

unmount = mount.fusermount

def fusermount(mountpoint, *, lazy):
    result = unmount(mountpoint, lazy=lazy)
    os.makedirs(os.path.join(mountpoint, "agent"), exist_ok=True)
    with open(os.path.join(mountpoint, "agent", "ckpt"), "w") as f:
        f.write("step 2")
    return result

mount.fusermount = fusermount
"""


def test_a_dead_mount_is_replaced_even_if_an_agent_wrote_under_it_meanwhile(
    mounted_env: VolumeEnv, tmp_path: Path
) -> None:
    """Regression: an agent retrying `os.makedirs(state); write` wrote into the bare
    mountpoint in the moment between the removal of the dead mount and the new mount
    (hit on the first try with a 1 ms retry loop), and `sealfs mount` then refused the
    mountpoint as not empty, as did every restart after it: the service never came back
    by itself, and the agent went on writing its checkpoints in plaintext to the local
    disk. The mount is made, and says what it hides and where."""
    env = mounted_env
    (env.mnt / "kept").write_text("committed")
    assert sealfs("sync", str(env.mnt)).returncode == 0
    kill_daemons(env)
    again = mount_with_a_bug(env, tmp_path, AGENT_IN_THE_GAP, check=False)
    said = again.stderr + env.log_text()
    assert again.returncode == 0, said
    assert "removed the dead sealfs mount" in said
    assert f"1 entry appeared in {env.mnt} while it was being mounted" in said, said
    assert (env.mnt / "kept").read_text() == "committed"
    assert not (env.mnt / "agent").exists()  # hidden by the mount
    env.umount()
    assert (env.mnt / "agent" / "ckpt").read_text() == "step 2"
    shutil.rmtree(env.mnt / "agent")


def test_mount_through_a_symlink_replaces_a_dead_mount(mounted_env: VolumeEnv) -> None:
    """Regression: the dead mount was looked up under the mountpoint as given, and the
    mount table holds the real path: named through a symlink (a unit's /var/run/...),
    the dead mount stayed and mount failed with "Transport endpoint is not connected"."""
    env = mounted_env
    (env.mnt / "kept").write_text("committed")
    assert sealfs("sync", str(env.mnt)).returncode == 0
    kill_daemons(env)
    link = env.root / "link"
    link.symlink_to(env.mnt)
    again = sealfs(*env.mount_args(link))
    assert again.returncode == 0, again.stderr + env.log_text()
    assert "removed the dead sealfs mount" in env.log_text() + again.stderr
    assert (env.mnt / "kept").read_text() == "committed"
    env.umount()


def test_a_mount_named_through_a_symlinked_directory(volume_env: VolumeEnv) -> None:
    """Regression: status, sync and umount compared the path as given with the mount
    table, which holds the real path: a home under a symlink (/home -> /var/home) made
    `sealfs umount ~/state` say "not mounted" and status call the mount "not a volume"."""
    env = volume_env
    (env.root / "via").symlink_to(env.root)
    mnt = env.root / "via" / "mnt"
    mounted = sealfs(*env.mount_args(mnt))
    assert mounted.returncode == 0, mounted.stderr
    (mnt / "f").write_text("through the link")
    assert sealfs("sync", str(mnt)).returncode == 0
    assert status_json(str(mnt))["files"] == 1
    result = sealfs("umount", str(mnt))
    assert result.returncode == 0, result.stderr
    assert not env.is_mounted()


def test_the_daemon_log_is_the_owner_s_only(volume_env: VolumeEnv) -> None:
    """Regression: the log file was created with open()'s 0666 less the umask: 0644, or
    0666 (any user could rewrite it) under umask 0, and its default directory too."""
    env = volume_env
    state = env.root / "state"
    result = sealfs(
        *env.mount_args(log=False),
        env={**os.environ, "XDG_STATE_HOME": str(state)},
        preexec_fn=lambda: os.umask(0),
    )
    assert result.returncode == 0, result.stderr
    env.umount()
    assert (state / "sealfs").stat().st_mode & 0o777 == 0o700
    assert (state / "sealfs" / "sealfs.log").stat().st_mode & 0o777 == 0o600
    assert "serving" in (state / "sealfs" / "sealfs.log").read_text()


def test_a_default_log_directory_that_cannot_be_made_is_one_line(volume_env: VolumeEnv) -> None:
    """Regression: a service account whose home is missing or not its own said only
    "sealfs: Permission denied: /nonexistent" (exit 1), naming neither cause nor fix."""
    env = volume_env
    (env.root / "file").write_text("")
    state = env.root / "file" / "state"  # cannot be created, even by root
    result = sealfs(*env.mount_args(log=False), env={**os.environ, "XDG_STATE_HOME": str(state)})
    err = one_line(result, USAGE)
    assert f"cannot create the log directory {state / 'sealfs'}" in err, err
    assert "--log-file" in err, err
    assert not env.is_mounted()


def test_a_home_that_does_not_exist_is_not_made(volume_env: VolumeEnv) -> None:
    """Regression: run by root with HOME=/nonexistent (the home of a service user, which
    must never exist), mount made /nonexistent/.local/state/sealfs for its log, and
    status made it for its record of the volume: root may make any directory."""
    env = volume_env
    home = env.root / "nonexistent"
    environ = {k: v for k, v in os.environ.items() if not k.startswith("XDG_")}
    environ["HOME"] = str(home)
    err = one_line(sealfs(*env.mount_args(log=False), env=environ), USAGE)
    assert f"the home directory {home} does not exist" in err, err
    assert "XDG_STATE_HOME" in err and "--log-file" in err, err
    status = sealfs("status", str(env.store), "--passphrase-file", str(env.passfile), env=environ)
    assert status.returncode == 0, status.stderr
    assert "a rollback of the store will not be detected" in status.stderr
    assert not home.exists()


DEAD_FUSE = """
import sys, pyfuse3, trio
options = set(pyfuse3.default_options) | {"fsname=sealfs:00000000", "subtype=other"}
pyfuse3.init(pyfuse3.Operations(), sys.argv[1], options)
trio.run(pyfuse3.main)
"""


def test_mount_refuses_a_dead_mount_of_another_file_system(volume_env: VolumeEnv) -> None:
    """Only a dead mount that sealfs made is removed by mount: another FUSE file system's
    is its owner's to clear, even when its name mimics sealfs's."""
    env = volume_env
    other = subprocess.Popen([sys.executable, "-c", DEAD_FUSE, str(env.mnt)])
    try:
        deadline = time.monotonic() + 10
        while str(env.mnt) not in Path("/proc/self/mounts").read_text():
            assert time.monotonic() < deadline and other.poll() is None
            time.sleep(0.02)
        other.kill()
        other.wait(timeout=10)
        # Not "run 'sealfs umount'", which then unmounted it and said sealfs data was lost.
        assert f"run 'fusermount3 -u {env.mnt}'" in one_line(env.mount(check=False), BUSY)
        for command in ("umount", "status", "sync"):
            err = one_line(sealfs(command, str(env.mnt)), USAGE)
            assert f"{env.mnt} is a fuse.other mount whose daemon died, not a sealfs" in err
            assert f"remove it with 'fusermount3 -u {env.mnt}'" in err
        assert str(env.mnt) in Path("/proc/self/mounts").read_text()
    finally:
        other.kill()
        subprocess.run(["fusermount3", "-u", "-z", str(env.mnt)], capture_output=True, check=False)


def test_sighup_reopens_the_log_file_and_keeps_serving(volume_env: VolumeEnv) -> None:
    """Regression: SIGHUP (logrotate's postrotate 'kill -HUP') killed the daemon with its
    default action: no final commit, a dead mount, and what was not committed lost."""
    env = volume_env
    env.mount("--commit-interval", "60")
    (pid,) = env.daemon_pids()
    (env.mnt / "pending").write_text("not committed yet")
    rotated = env.log.with_name("daemon.log.1")
    env.log.rename(rotated)  # logrotate's create mode: move, then signal
    os.kill(pid, signal.SIGHUP)
    deadline = time.monotonic() + 10
    while "reopened log file" not in env.log_text():
        assert time.monotonic() < deadline, rotated.read_text()
        time.sleep(0.02)
    assert env.daemon_pids() == [pid]
    assert (env.mnt / "pending").read_text() == "not committed yet"
    env.umount()
    assert "unmounted" in env.log_text() and "unmounted" not in rotated.read_text()
    env.mount()
    assert (env.mnt / "pending").read_text() == "not committed yet"
    env.umount()


def test_sigquit_commits_and_user_signals_are_ignored(volume_env: VolumeEnv) -> None:
    """Regression: SIGQUIT (Ctrl-\\ on a foreground mount), SIGUSR1 and SIGUSR2 killed the
    daemon by their default action: no final commit, a dead mount, pending writes lost."""
    env = volume_env
    env.mount("--commit-interval", "60")
    (pid,) = env.daemon_pids()
    (env.mnt / "pending").write_text("not committed yet")
    for ignored in (signal.SIGUSR1, signal.SIGUSR2):
        os.kill(pid, ignored)
        deadline = time.monotonic() + 10
        while f"received {ignored.name}: ignored" not in env.log_text():
            assert time.monotonic() < deadline, env.log_text()
            time.sleep(0.02)
    assert env.daemon_pids() == [pid] and env.is_mounted()
    os.kill(pid, signal.SIGQUIT)
    deadline = time.monotonic() + 30
    while env.daemon_pids():
        assert time.monotonic() < deadline, env.log_text()
        time.sleep(0.02)
    assert not env.is_mounted(), env.log_text()
    assert "received SIGQUIT: committing and unmounting" in env.log_text()
    env.mount()
    assert (env.mnt / "pending").read_text() == "not committed yet"
    env.umount()


def test_verbose_holds_for_the_daemon_s_log(volume_env: VolumeEnv) -> None:
    """Regression: `sealfs --verbose mount` logged debug detail only until the fork: the
    daemon set its log level back to INFO, so its log file never held a debug line
    (only a --foreground mount honoured --verbose)."""
    env = volume_env
    result = sealfs(
        "--verbose", "mount", str(env.store), str(env.mnt), "--passphrase-file", str(env.passfile),
        "--log-file", str(env.log),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr + env.log_text()
    (env.mnt / "f").write_text("x")
    env.umount()
    assert " DEBUG " in env.log_text(), env.log_text()
    # And without --verbose, none.
    env.log.unlink()
    env.mount()
    (env.mnt / "f").read_text()
    env.umount()
    assert " DEBUG " not in env.log_text(), env.log_text()


def test_a_second_sigterm_during_the_final_commit_does_not_kill_it(
    volume_env: VolumeEnv,
) -> None:
    """Regression: once the first SIGTERM was handled, a second one (Ctrl-C pressed
    again, a wrapper forwarding the signal) killed the daemon in the middle of its final
    commit: what was pending was lost and the mount left dead."""
    env = volume_env
    env.mount("--commit-interval", "60")
    (pid,) = env.daemon_pids()
    data = os.urandom(24 << 20)  # enough that the final commit takes a while
    (env.mnt / "pending").write_bytes(data)
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while "committing and unmounting" not in env.log_text():
        assert time.monotonic() < deadline, env.log_text()
        time.sleep(0.005)
    os.kill(pid, signal.SIGTERM)
    while env.daemon_pids():
        assert time.monotonic() < deadline + 20, env.log_text()
        time.sleep(0.02)
    assert not env.is_mounted(), env.log_text()
    assert "already committing" in env.log_text()
    env.mount()
    assert (env.mnt / "pending").read_bytes() == data
    env.umount()


def test_sync_of_a_mount_that_is_not_sealfs_is_refused(tmp_path: Path) -> None:
    """Regression: `sealfs sync` on another file system's mount returned 0, silently;
    then it, umount and status said "is not a sealfs mount: No data available" (the
    errno of a missing extended attribute), naming neither the mount nor the fix."""
    target = tmp_path / "tmpfs"
    target.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(target)], check=True)
    try:
        for command in ("sync", "umount", "status"):
            err = one_line(sealfs(command, str(target)), USAGE)
            assert f"{target} is a tmpfs mount, not a sealfs mount:" in err, err
            assert "give the mountpoint of a sealfs mount" in err, err
        assert os.path.ismount(target)
    finally:
        subprocess.run(["umount", str(target)], check=True)


def test_status_of_a_store_that_is_a_mountpoint(tmp_path: Path) -> None:
    """Regression: a store on a disk of its own (or a bind mount, or NFS) is a mountpoint,
    and status refused it as "a ext4 mount, not a sealfs mount" while init, mount and
    key list took it."""
    env = VolumeEnv(tmp_path)
    env.store.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(env.store)], check=True)
    try:
        env.init()
        env.mount()
        (env.mnt / "kept").write_text("kept")
        env.umount()
        stored = env.store_status()
        assert stored["files"] == 1 and stored["pid"] is None
        assert os.path.ismount(env.store)
    finally:
        leaked = env.cleanup()
        subprocess.run(["umount", str(env.store)], check=True)
    assert not leaked


def test_umount_with_an_open_file_is_busy_on_stderr_then_succeeds(mounted_env: VolumeEnv) -> None:
    """Regression: umount printed its errors (busy, commit failed) on stdout."""
    env = mounted_env
    (env.mnt / "held").write_text("still here")
    with open(env.mnt / "held") as f:
        err = one_line(sealfs("umount", str(env.mnt)), BUSY)
        assert "busy" in err
        assert env.is_mounted()
        assert f.read() == "still here"
    env.umount()
    assert not env.is_mounted()


def test_umount_with_a_mount_inside_names_that_mount(mounted_env: VolumeEnv) -> None:
    """Regression: it said "a process has files open there", sending users looking for
    one, when another file system was mounted inside the mount."""
    env = mounted_env
    nest = env.mnt / "nest"
    nest.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(nest)], check=True)
    try:
        err = one_line(sealfs("umount", str(env.mnt)), BUSY)
        assert f"{env.mnt} is busy: {nest} is mounted inside it: unmount that first" in err
        assert env.is_mounted()
    finally:
        subprocess.run(["umount", str(nest)], check=True)
    env.umount()


def test_umount_says_when_it_stopped_a_rekey_before_its_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Regression: an unmount during `sealfs rekey --no-wait` stopped the rekey between
    objects without a word; only `key list` showed the retired key still there."""
    running = {"rekey": {"to_epoch": 2, "checked": 9, "listed": 16, "finished": False}}
    with caplog.at_level(logging.WARNING, logger="sealfs.cli"):
        _say_if_rekey_unfinished(running)
        _say_if_rekey_unfinished({"rekey": {**running["rekey"], "finished": True}})
        _say_if_rekey_unfinished({"rekey": None})
    [said] = [r.getMessage() for r in caplog.records]
    assert said.startswith("the rekey to key epoch 2 was not finished (9 of 16 objects")
    assert "the next read-write mount, or 'sealfs rekey', finishes it" in said


def test_read_only_mount_refuses_writes(volume_env: VolumeEnv) -> None:
    env = volume_env
    env.mount()
    (env.mnt / "kept").write_text("kept")
    env.umount()
    env.mount("--read-only")
    try:
        assert (env.mnt / "kept").read_text() == "kept"
        for attempt in (
            lambda: os.open(env.mnt / "kept", os.O_WRONLY),
            lambda: os.open(env.mnt / "new", os.O_WRONLY | os.O_CREAT),
            (env.mnt / "newdir").mkdir,
            (env.mnt / "kept").unlink,
            lambda: os.setxattr(env.mnt / "kept", "user.x", b"1"),
        ):
            with pytest.raises(OSError) as info:
                attempt()
            assert info.value.errno == errno.EROFS
        assert env.status()["read_only"] is True
    finally:
        env.umount()


def test_sync_on_close_makes_close_durable(volume_env: VolumeEnv) -> None:
    env = volume_env
    env.mount("--sync-on-close", "--commit-interval", "3600")  # only close() can commit
    data = os.urandom(300_000)
    with open(env.mnt / "closed", "wb") as f:
        f.write(data)
    with open(env.mnt / "closed-too", "wb") as f:  # every close commits, not just the first
        f.write(data[:1000])
    env.kill()
    # Same host, writer killed: its pid is dead, so a plain mount (no --takeover) works.
    env.mount()
    try:
        assert (env.mnt / "closed").read_bytes() == data
        assert (env.mnt / "closed-too").read_bytes() == data[:1000]
    finally:
        env.umount()


def foreign_mount(env: VolumeEnv, host: str, *extra: str) -> subprocess.CompletedProcess[str]:
    """Mount as if from another machine: the same CLI under another UTS hostname."""
    command = [
        sys.executable, "-m", "sealfs.cli.main", "mount", str(env.store), str(env.mnt),
        "--passphrase-file", str(env.passfile), "--log-file", str(env.log), *extra,
    ]  # fmt: skip
    script = f"hostname {host} && exec {shlex.join(command)}"
    return subprocess.run(
        ["unshare", "--uts", "sh", "-c", script],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL, check=False,
    )  # fmt: skip


def test_takeover_of_a_crashed_writer_on_another_host(volume_env: VolumeEnv) -> None:
    env = volume_env
    result = foreign_mount(env, "sealfs-other-host")
    assert result.returncode == 0, result.stderr
    (env.mnt / "one").write_text("1")
    with open(env.mnt / "one") as f:
        os.fsync(f.fileno())
    env.kill()
    # Its pid means nothing here: a plain mount refuses and names the writer.
    err = one_line(env.mount(check=False), BUSY)
    assert "sealfs-other-host" in err and "--takeover" in err, err
    assert not env.is_mounted()
    env.mount("--takeover")
    try:
        assert (env.mnt / "one").read_text() == "1"
    finally:
        env.umount()


def test_takeover_of_a_live_writer_on_this_host_is_refused(
    mounted_env: VolumeEnv, tmp_path: Path
) -> None:
    """Regression: --takeover fenced a live mount on the same host, whose acknowledged
    writes since its last commit were then lost: the way a forgotten mount is lost."""
    env = mounted_env
    second = tmp_path / "second"
    second.mkdir()
    result = sealfs(
        "mount", str(env.store), str(second), "--passphrase-file", str(env.passfile),
        "--log-file", str(env.log), "--takeover",
    )  # fmt: skip
    if os.path.ismount(second):
        sealfs("umount", str(second))
    err = one_line(result, BUSY)
    assert "on this host" in err and "--takeover is for a writer on another host" in err, err
    with open(env.mnt / "still-the-writer", "w") as f:
        f.write("kept")
        f.flush()
        os.fsync(f.fileno())  # not fenced
    assert env.status()["fenced"] is False


@pytest.mark.slow
def test_takeover_fences_a_live_writer_and_umount_of_a_fenced_mount_works(
    volume_env: VolumeEnv, tmp_path: Path
) -> None:
    """Regression (umount): a fenced mount could never be unmounted with `sealfs umount`
    (its commit always fails, and a failed commit kept it mounted)."""
    env = volume_env
    first = foreign_mount(env, "sealfs-other-host")  # alive, but out of this host's sight
    assert first.returncode == 0, first.stderr
    second = tmp_path / "second"
    second.mkdir()
    try:
        result = sealfs(
            "mount", str(env.store), str(second), "--passphrase-file", str(env.passfile),
            "--log-file", str(env.log), "--takeover",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        # The old writer's next commit loses the generation race: it turns read-only.
        with pytest.raises(OSError) as info, open(env.mnt / "late", "w") as f:
            f.write("from the fenced writer")
            f.flush()
            os.fsync(f.fileno())
        assert info.value.errno in (errno.EROFS, errno.EIO)
        assert env.status()["fenced"] is True
        (second / "fresh").write_text("from the new writer")
        err = one_line(sealfs("umount", str(env.mnt)), 1)
        assert "taken over" in err, err
        assert not env.is_mounted()
    finally:
        sealfs("umount", str(second))
        assert not os.path.ismount(second)
    env.mount()
    try:
        assert (env.mnt / "fresh").read_text() == "from the new writer"
        assert not (env.mnt / "late").exists()
    finally:
        env.umount()


@contextlib.contextmanager
def taken_over(env: VolumeEnv, second: Path) -> Iterator[None]:
    """env mounted "from another host", committing only when asked, then taken over by a
    mount of second on this host that has not committed since; both unmounted after."""
    second.mkdir()
    first = foreign_mount(env, "sealfs-other-host", "--commit-interval", "3600")
    assert first.returncode == 0, first.stderr
    try:
        (env.mnt / "kept").write_text("committed by the first writer")
        sealfs("sync", str(env.mnt), check=True)
        result = sealfs(
            "mount", str(env.store), str(second), "--passphrase-file", str(env.passfile),
            "--log-file", str(env.log), "--takeover", "--commit-interval", "3600",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        (env.mnt / "late").write_text("x" * 5000)  # buffered: the fence shows at a commit
        yield
    finally:
        sealfs("umount", str(env.mnt))
        sealfs("umount", str(second))
        assert not os.path.ismount(second)


@pytest.mark.slow
def test_umount_whose_own_commit_finds_the_mount_fenced_unmounts_it(
    volume_env: VolumeEnv, tmp_path: Path
) -> None:
    """Regression: the takeover showed first at umount's own commit, which failed: umount
    said "commit failed (Read-only file system); ... stays mounted", though no commit
    could ever land there, and left the mount up for good."""
    env = volume_env
    with taken_over(env, tmp_path / "second"):
        generation = env.status()["generation"]
        assert env.status()["fenced"] is False  # not known yet
        err = one_line(sealfs("umount", str(env.mnt)), 1)
        assert not env.is_mounted(), err
        assert "taken over by another writer" in err, err
        assert f"generation {generation}" in err, err  # the last commit that landed
        assert "5000 bytes" in err, err  # what was lost
        assert "stays mounted" not in err, err


@pytest.mark.slow
def test_sync_of_a_fenced_mount_says_why_and_umount_names_the_last_commit(
    volume_env: VolumeEnv, tmp_path: Path
) -> None:
    """Regression: sync said only "commit failed (Read-only file system)" and sent the
    user to the log: a stopped writer has no commit failure in its status, only the
    reason it stopped."""
    env = volume_env
    with taken_over(env, tmp_path / "second"):
        generation = env.status()["generation"]
        for _ in range(2):  # the sync whose commit finds the fence, then one after it
            err = one_line(sealfs("sync", str(env.mnt)), 1)
            assert "taken over" in err and "unmount it" in err, err
        err = one_line(sealfs("umount", str(env.mnt)), 1)
        assert not env.is_mounted(), err
        assert "taken over by another writer" in err and f"generation {generation}" in err, err


BUSY_WRITER = """
import os, sys, time
path = sys.argv[1]
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    try:
        with open(path, "w") as f:
            f.write(str(time.time()))
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        sys.exit(0)  # fenced: the takeover happened
    time.sleep(0.05)
"""


@pytest.mark.slow
def test_takeover_of_a_writer_that_commits_all_the_time(
    volume_env: VolumeEnv, tmp_path: Path
) -> None:
    """Regression: a takeover lost the generation race to a writer that committed between
    the mount's load and its claim (4 of 4 takeovers of one fsyncing every 0.6 s)."""
    env = volume_env
    first = foreign_mount(env, "sealfs-other-host")  # alive, but out of this host's sight
    assert first.returncode == 0, first.stderr
    second = tmp_path / "second"
    second.mkdir()
    busy = subprocess.Popen([sys.executable, "-c", BUSY_WRITER, str(env.mnt / "tick")])
    try:
        time.sleep(0.5)
        assert busy.poll() is None, "the busy writer stopped before the takeover"
        result = sealfs(
            "mount", str(env.store), str(second), "--passphrase-file", str(env.passfile),
            "--log-file", str(env.log), "--takeover",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert busy.wait(timeout=30) == 0  # its next fsync failed: fenced
        (second / "fresh").write_text("from the new writer")
    finally:
        busy.kill()
        busy.wait()
        sealfs("umount", str(env.mnt))
        sealfs("umount", str(second))
        assert not os.path.ismount(second)
    env.mount()
    try:
        assert (env.mnt / "fresh").read_text() == "from the new writer"
    finally:
        env.umount()


# What a daemon of a build before the status's log_file (f64f767) answers; a daemon
# started before an upgrade keeps answering so after it.
OLD_DAEMON_STATUS: dict[str, Any] = {
    "volume_id": "07efe4e01647d87dda5c375bd23c77e8", "store": "local store at /srv/store",
    "generation": 2, "last_commit_ns": 1796060118653058754, "pending_bytes": 3588901,
    "pending_records": 15, "files": 3, "inodes": 6, "logical_bytes": 3588901,
    "unique_bytes": 0, "stored_bytes": 0, "chunks": 0, "memory_cache_bytes": 0,
    "disk_cache_bytes": None, "store_requests": None, "read_only": False, "fenced": False,
    "commit_interval": 1.0, "key_epoch": 0, "rekey": None,
}  # fmt: skip


def test_an_older_daemon_s_log_file_is_named_not_taken_for_stderr(tmp_path: Path) -> None:
    """Its status sends no log_file: status said it logged to its stderr (--foreground)
    and a failed sync pointed there, while it wrote to its log file. That file is its
    stderr, as daemonised; a daemon whose stderr is no file is not known."""
    log = tmp_path / "daemon.log"
    with log.open("ab") as f, subprocess.Popen(["sleep", "60"], stderr=f) as daemon:
        try:
            status = OLD_DAEMON_STATUS | {"pid": daemon.pid}
            assert dict(_rows(status))["daemon log"] == str(log)
            assert _daemon_log(status) == f"the daemon log {log} (its lines marked [{daemon.pid}])"
        finally:
            daemon.kill()
    with subprocess.Popen(["sleep", "60"], stderr=subprocess.PIPE) as daemon:
        try:
            status = OLD_DAEMON_STATUS | {"pid": daemon.pid}
            assert "older sealfs" in dict(_rows(status))["daemon log"]
            assert "older sealfs" in _daemon_log(status)
        finally:
            daemon.kill()
    foreground = OLD_DAEMON_STATUS | {"pid": os.getpid(), "log_file": None}  # a new daemon
    assert dict(_rows(foreground))["daemon log"] == "its stderr (--foreground)"
    assert _daemon_log(foreground) == "the daemon's stderr"


def test_a_failure_names_the_daemon_s_lines_in_a_shared_log() -> None:
    """Every mount started without --log-file logs to the one default file, and a
    host running a volume per agent has ten daemons writing there: "see the daemon
    log FILE" did not say which of its lines were this mount's. They carry its pid."""
    status = OLD_DAEMON_STATUS | {"pid": 4242, "log_file": "/var/log/sealfs.log"}
    assert _daemon_log(status) == "the daemon log /var/log/sealfs.log (its lines marked [4242])"


def test_status_shows_paths_as_they_are(tmp_path: Path) -> None:
    """Regression: status printed its rows as rich markup: a store path holding "[/]"
    ended the command as a bug (MarkupError, exit 70), "[red]" vanished from the path
    shown (another path), and ":thumbs_up:" was shown as an emoji."""
    for name in ("a[/]b", "a[red]b:thumbs_up:"):
        env = VolumeEnv(tmp_path / name)
        env.init()
        result = sealfs(
            "status", str(env.store), "--passphrase-file", str(env.passfile),
            env={**os.environ, "COLUMNS": "500"},  # no row folded
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert f"local store at {env.store} " in result.stdout, result.stdout
