"""The CLI run by a user other than root, as operators run it (a service account).

The suite runs as root, where libfuse mounts with mount(2) and the kernel lets
root do what a user may not. These tests switch to an unprivileged uid (with
setpriv) for the commands whose behaviour differs: a user mounts through the
setuid fusermount3, and only the user who made a mount can reach it. While
they run, the directories that lead to this interpreter and to sealfs get o+x
(search, not read: a virtualenv under root's 0700 home) and /dev/fuse gets the
0666 that udev gives it on Debian (a VM without udev keeps it 0600); both are
put back afterwards.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from sealfs.cli.paths import _created_as
from tests.cli.test_bad_input import fingerprint, one_line
from tests.mounts import VolumeEnv, modes_added, python_for_others, sealfs, write_secret
from tests.prereq import require

pytestmark = pytest.mark.fuse

NOBODY = 65534
USAGE = 2


def nobody_command(*args: str, caps: str = "") -> list[str]:
    """The command line that runs the CLI as uid and gid 65534, with no supplementary
    groups (and with the capabilities caps names, "+sys_admin" say)."""
    keep = [f"--inh-caps={caps}", f"--ambient-caps={caps}"] if caps else []
    return [
        "setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *keep, "--",
        sys.executable, "-m", "sealfs.cli.main", *args,
    ]  # fmt: skip


def as_nobody(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run the CLI as uid and gid 65534, with no supplementary groups."""
    return run_with_cli_env(nobody_command(*args), timeout=timeout)


def run_with_cli_env(
    command: list[str], *, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run command (one that switches to uid 65534) where the CLI finds its code."""
    env = {**os.environ, "HOME": "/nonexistent", "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, check=False,
        stdin=subprocess.DEVNULL, env=env, cwd="/",
    )  # fmt: skip


@pytest.fixture
def shared_env() -> Iterator[VolumeEnv]:
    """A volume in a directory an unprivileged user can reach (a test's tmp_path lies
    under root's 0700 directory); removed with whatever is mounted in it."""
    require(os.geteuid() == 0, "running commands as another user needs root")
    require(shutil.which("setpriv") is not None, "setpriv (util-linux) is needed")
    root = Path(tempfile.mkdtemp(prefix="sealfs-unprivileged-"))
    try:
        with python_for_others(), modes_added({"/dev/fuse"}, 0o006):
            root.chmod(0o755)
            env = VolumeEnv(root)
            probe = as_nobody("--version")
            assert probe.returncode == 0, f"uid {NOBODY} cannot run sealfs: {probe.stderr}"
            env.init()
            yield env
            assert not env.cleanup(), "the test left a mount or a daemon behind"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def give_to_nobody(env: VolumeEnv) -> None:
    for path in [env.root, env.passfile, env.mnt, *env.store.rglob("*"), env.store]:
        os.lchown(path, NOBODY, NOBODY)


def test_a_user_mounts_through_a_symlinked_mountpoint(shared_env: VolumeEnv) -> None:
    """Regression: fusermount3 refuses a mountpoint that is a symlink ("is not a
    directory or a regular file"), so a user's mount through one failed; root's worked."""
    env = shared_env
    give_to_nobody(env)
    link = env.root / "link"
    link.symlink_to(env.mnt)
    mounted = as_nobody(*env.mount_args(link))
    assert mounted.returncode == 0, mounted.stderr
    assert env.is_mounted()
    unmounted = as_nobody("umount", str(link))
    assert unmounted.returncode == 0, unmounted.stderr
    assert not env.is_mounted()


def test_another_user_s_mount_is_named_as_such(shared_env: VolumeEnv) -> None:
    """Regression: status, sync and umount of a mount made by another user (without
    --allow-other, so the kernel refuses everyone else) said "not a sealfs mount"."""
    env = shared_env
    env.mount()
    try:
        for command in ("status", "sync", "umount"):
            result = as_nobody(command, str(env.mnt))
            assert result.returncode == 2, (command, result.stderr)
            err = result.stderr.strip()
            assert "\n" not in err and "Traceback" not in err, err
            assert "is a sealfs mount of user root (uid 0)" in err, err
            assert "run this command as that user" in err, err
        assert env.is_mounted()
    finally:
        assert sealfs("umount", str(env.mnt)).returncode == 0


def mount_as_nobody(env: VolumeEnv, *extra: str) -> subprocess.CompletedProcess[str]:
    return as_nobody(*env.mount_args(), *extra)


def refused(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stderr
    err = result.stderr.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


def test_a_mountpoint_the_user_may_not_write_is_refused_in_one_line(
    shared_env: VolumeEnv,
) -> None:
    """Regression: fusermount3's line came with "cannot mount on MNT: fuse_session_mount
    failed", which named no cause."""
    env = shared_env
    give_to_nobody(env)
    os.chown(env.mnt, 0, 0)  # root's, mode 0755
    assert "is not writable by you" in refused(mount_as_nobody(env))
    env.mnt.chmod(0o1777)  # writable, but sticky and another user's (as /tmp is)
    assert "is a sticky directory of another user" in refused(mount_as_nobody(env))
    assert not env.is_mounted()


def test_allow_other_without_user_allow_other_is_refused_in_one_line(
    shared_env: VolumeEnv,
) -> None:
    with open("/etc/fuse.conf", encoding="utf-8") as f:
        allowed = any(line.partition("#")[0].strip() == "user_allow_other" for line in f)
    env = shared_env
    give_to_nobody(env)
    result = mount_as_nobody(env, "--allow-other")
    if allowed:  # this machine's administrator allows it: the mount works
        assert result.returncode == 0, result.stderr
        assert as_nobody("umount", str(env.mnt)).returncode == 0
    else:
        err = refused(result)
        assert "'user_allow_other' in /etc/fuse.conf" in err, err
    assert not env.is_mounted()


def test_a_cache_directory_the_user_may_not_write_is_refused(shared_env: VolumeEnv) -> None:
    """Regression: an existing cache directory of another user was taken, and every
    fill failed with a warning in the daemon's log (status showed "disk cache 0 B")."""
    env = shared_env
    give_to_nobody(env)
    env.cache.mkdir(mode=0o755)  # root's, as one left by an earlier `sudo sealfs mount`
    err = refused(mount_as_nobody(env, "--cache-dir", str(env.cache)))
    assert f"cache directory {env.cache} is not writable by you" in err, err
    assert not env.is_mounted()


def test_status_of_a_store_the_user_may_not_read_names_the_fix(shared_env: VolumeEnv) -> None:
    """Regression: it said only "sealfs: Permission denied: STORE", where mount says
    who may use the store."""
    env = shared_env
    give_to_nobody(env)
    os.chown(env.store, 0, 0)  # mode 0700: root's only, as a store made by `sudo sealfs init`
    result = as_nobody("status", str(env.store), "--passphrase-file", str(env.passfile))
    assert result.returncode == 1, result.stderr
    err = result.stderr.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert f"local store at {env.store}" in err, err
    assert "run sealfs as a user who may read the store" in err, err
    # Nor does a read-only mount help one who may not read: it is not offered as the fix.
    mounted = as_nobody(*env.mount_args(), "--read-only")
    assert mounted.returncode == 1, mounted.stderr
    err = mounted.stderr.strip()
    assert "may read the store" in err and "--read-only" not in err, err


def test_another_user_s_allow_other_mount_is_not_unmounted(shared_env: VolumeEnv) -> None:
    """Regression: umount committed, then fusermount3 (which unmounts only for the
    user who mounted) failed: "entry for MNT not found in /etc/mtab"."""
    env = shared_env
    env.mount("--allow-other")
    try:
        err = refused(as_nobody("umount", str(env.mnt)))
        assert "is a sealfs mount of user root (uid 0): only that user or root can" in err, err
        assert env.is_mounted()
        assert as_nobody("status", str(env.mnt)).returncode == 0  # it answers everyone
    finally:
        assert sealfs("umount", str(env.mnt)).returncode == 0


def test_user_allow_other_is_read_as_fusermount3_reads_it(shared_env: VolumeEnv) -> None:
    """Regression: a fuse.conf line "user_allow_other  # comment", which fusermount3
    takes, was not seen, and a user's --allow-other mount was refused. Run in a mount
    namespace of its own, where such a file is bind-mounted on /etc/fuse.conf."""
    require(shutil.which("unshare") is not None, "unshare (util-linux) is needed")
    env = shared_env
    give_to_nobody(env)
    result = with_fuse_conf(
        env,
        "# users may share their mounts\n  user_allow_other   # see fuse(8)\n",
        nobody_command(*env.mount_args(), "--allow-other"),
        f"grep -q ' {env.mnt} fuse.sealfs .*allow_other' /proc/self/mounts",
        nobody_command("umount", str(env.mnt)),
    )
    assert result.returncode == 0, result.stderr


def test_a_user_with_cap_sys_admin_mounts_as_root_does(shared_env: VolumeEnv) -> None:
    """Regression: the checks of what fusermount3 refuses a user ran for a service
    account given CAP_SYS_ADMIN (AmbientCapabilities= in its unit), which libfuse mounts
    with mount(2), never asking fusermount3: its mount on a directory of root's, with
    --allow-other and no user_allow_other, was refused ("not writable by you")."""
    env = shared_env
    give_to_nobody(env)
    os.chown(env.mnt, 0, 0)  # root's, mode 0755
    result = with_fuse_conf(
        env,
        "",  # no user_allow_other
        nobody_command(*env.mount_args(), "--allow-other", caps="+sys_admin"),
        f"grep -q ' {env.mnt} fuse.sealfs .*user_id={NOBODY},.*allow_other' /proc/self/mounts",
        nobody_command("umount", str(env.mnt), caps="+sys_admin"),
    )
    assert result.returncode == 0, result.stderr


def with_fuse_conf(
    env: VolumeEnv, conf_text: str, *steps: list[str] | str
) -> subprocess.CompletedProcess[str]:
    """Run steps (commands, or shell lines), stopping at the first failure, in a mount
    namespace of their own where a file holding conf_text is bound on /etc/fuse.conf."""
    conf = env.root / "fuse.conf"
    conf.write_text(conf_text)
    lines = [f"mount --bind {shlex.quote(str(conf))} /etc/fuse.conf"]
    lines += [step if isinstance(step, str) else shlex.join(step) for step in steps]
    return run_with_cli_env(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", " && ".join(lines)]
    )


MODES_ADDED_THEN_WAIT = """
import sys, time
from tests.mounts import modes_added
with modes_added({sys.argv[1]}, 0o001):
    print("changed", flush=True)
    time.sleep(60)
"""


def test_modes_are_given_back_when_the_run_is_terminated(tmp_path: Path) -> None:
    """Regression: a run ended by SIGTERM (`timeout`) left the modes the fixture added."""
    path = tmp_path / "dir"
    path.mkdir(mode=0o700)
    child = subprocess.Popen(
        [sys.executable, "-c", MODES_ADDED_THEN_WAIT, str(path)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "changed\n"
        assert path.stat().st_mode & 0o777 == 0o701
        child.terminate()
        child.wait(timeout=30)
    finally:
        child.kill()
    assert path.stat().st_mode & 0o777 == 0o700


def test_a_user_without_a_home_mounts_with_a_log_file(shared_env: VolumeEnv) -> None:
    """Regression: a uid the user database does not know, with HOME unset (a container
    run with --user 12345), made status and mount exit 70: "unexpected RuntimeError:
    Could not determine home directory", from the host's record of each volume, which
    is a hint whose loss is a warning."""
    env = shared_env
    stranger = 12345
    for path in [env.root, env.passfile, env.mnt, *env.store.rglob("*"), env.store]:
        os.lchown(path, stranger, stranger)
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("HOME", "XDG_"))}
    environ["PYTHONPATH"] = os.pathsep.join(sys.path)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        # With CAP_SYS_ADMIN, as a container's service would mount: fusermount3 refuses
        # a user it cannot name.
        caps = ["--inh-caps=+sys_admin", "--ambient-caps=+sys_admin"]
        command = [
            "setpriv", f"--reuid={stranger}", f"--regid={stranger}", "--clear-groups", *caps,
            "--", sys.executable, "-m", "sealfs.cli.main", *args,
        ]  # fmt: skip
        return subprocess.run(
            command, capture_output=True, text=True, timeout=60, check=False,
            stdin=subprocess.DEVNULL, env=environ, cwd="/",
        )  # fmt: skip

    status = run("status", str(env.store), "--passphrase-file", str(env.passfile))
    assert status.returncode == 0, status.stderr
    assert "HOME is unset" in status.stderr  # the warning: no rollback check
    err = refused(run(*env.mount_args(log=False)))
    assert "HOME" in err and "--log-file" in err, err
    mounted = run(*env.mount_args(), "--allow-other")
    assert mounted.returncode == 0, mounted.stderr
    assert env.is_mounted()
    # Unmounted by root (whom --allow-other lets in): fusermount3, which `sealfs umount`
    # runs, refuses a user it cannot name, as it refused the mount without CAP_SYS_ADMIN.
    assert sealfs("umount", str(env.mnt)).returncode == 0


def test_root_changes_no_store_another_user_owns(shared_env: VolumeEnv) -> None:
    """Regression: `sudo sealfs key passwd` (or key add and remove, a rekey, a mount) on a
    service user's store left sealfs.vol, segments or re-sealed chunks root's, mode 0600,
    and the service's next mount failed with "Permission denied"."""
    env = shared_env
    give_to_nobody(env)
    new = write_secret(env.root / "new-passphrase", "another passphrase\n")
    unlock = ["--passphrase-file", str(env.passfile)]
    before = fingerprint(env.store)
    for command in (
        ["key", "passwd", str(env.store), "0", "--new-passphrase-file", str(new), *unlock],
        ["key", "remove", str(env.store), "1", *unlock],
        ["rekey", str(env.store), *unlock],
        env.mount_args(),
    ):
        err = one_line(sealfs(*command), USAGE)
        assert f"the volume at {env.store} belongs to user nobody (uid {NOBODY})" in err, err
        assert "run it as nobody ('sudo -u nobody sealfs ...')" in err, err
    assert not env.is_mounted()
    # Reading changes nothing: a read-only mount and a status are root's to make.
    env.mount("--read-only")
    assert env.store_status()["files"] == 0
    env.umount()
    assert fingerprint(env.store) == before
    env.log.unlink()  # root's read-only mount made it
    mounted = as_nobody(*env.mount_args())  # and the owner still mounts it
    assert mounted.returncode == 0, mounted.stderr
    assert as_nobody("umount", str(env.mnt)).returncode == 0


def test_what_a_command_creates_in_a_store_is_looked_at_not_guessed(tmp_path: Path) -> None:
    """The refusal above is for files that would come out another user's; where the file
    system gives every file one owner (NFS squashing, say) the command goes on. The
    probe leaves nothing behind, and a store it may not create in is no refusal."""
    assert _created_as(tmp_path) == os.geteuid()
    assert list(tmp_path.iterdir()) == []
    assert _created_as(tmp_path / "missing") is None
