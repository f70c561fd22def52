"""`sealfs rekey`: mounted and unmounted, killed and resumed, racing keyslot changes.

Afterwards every file reads back, no object in the store names the old key
epoch, the header holds no retired key, and secrets of the old epoch open nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sealfs.cli import rekey_cmd
from sealfs.cli.rekey_cmd import LiveMount, _check_daemon_takes_keys, _same_store
from sealfs.errors import ConfigError
from sealfs.keys.header import decode_header
from sealfs.store.s3 import S3Store
from tests.cli.test_bad_input import fingerprint, one_line
from tests.mounts import CHEAP_KDF, VolumeEnv, python_as_nobody, sealfs, write_secret

CONFIG_ERROR, BUSY = 2, 5


def epochs(store: Path) -> dict[str, int]:
    """Key epoch named by every sealed object of a local store (bytes 6-7 of the envelope)."""
    out = {}
    for prefix in ("c", "l", "s"):
        for path in (store / prefix).rglob("*"):
            if path.is_file() and not path.name.startswith("."):
                with path.open("rb") as f:
                    out[str(path.relative_to(store))] = int.from_bytes(f.read(8)[6:8], "big")
    return out


def wait_for_first_reseal(store: Path, alive: Callable[[], bool] = lambda: True) -> None:
    """Return once one of the first chunks (re-sealed first: the listing is sorted) is done.

    Watching a handful of files, not the whole store, leaves most of it to do.
    """
    first = sorted((store / "c").rglob("*"))
    first = [p for p in first if p.is_file()][:8]
    deadline = time.monotonic() + 60
    while not any(p.read_bytes()[6:8] != b"\0\0" for p in first):
        assert alive() and time.monotonic() < deadline, "the rekey never started"
        time.sleep(0.002)


def header(store: Path) -> object:
    return decode_header((store / "sealfs.vol").read_bytes())


def write_tree(root: Path, count: int, size: int, tag: str) -> dict[str, bytes]:
    root.mkdir(parents=True, exist_ok=True)
    files = {}
    for k in range(count):
        data = os.urandom(size) + tag.encode() * 64
        (root / f"{tag}{k}").write_bytes(data)
        files[f"{root.name}/{tag}{k}"] = data
    return files


def check_tree(mnt: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        assert (mnt / name).read_bytes() == data, name


@contextlib.contextmanager
def live_mount(path: Path) -> Iterator[LiveMount]:
    """path with its root held open, as `sealfs rekey` holds the mount it hands a key."""
    root = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield LiveMount(str(path), root)
    finally:
        os.close(root)


def rekey(env: VolumeEnv, *extra: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return sealfs(
        "rekey", str(env.store), "--passphrase-file", str(env.passfile), *extra, timeout=timeout
    )


def test_rekey_must_be_told_about_slots_it_cannot_carry(volume_env: VolumeEnv) -> None:
    before = fingerprint(volume_env.store)
    line = one_line(rekey(volume_env), CONFIG_ERROR)
    assert "keyslot 1 (recovery)" in line and "--drop-slot 1" in line
    line = one_line(rekey(volume_env, "--drop-slot", "7"), CONFIG_ERROR)
    assert "no such keyslot" in line
    assert fingerprint(volume_env.store) == before  # nothing written


def test_rekey_given_both_secrets_keeps_both_slots(volume_env: VolumeEnv) -> None:
    """`sealfs init` makes a passphrase and a recovery slot; given both secrets, a rekey
    keeps both. The recovery key unlocked and the passphrase was ignored: the rekey
    refused to keep its slot unless dropped. A passphrase beside it that does not open
    its slot is refused, before anything is written."""
    env = volume_env
    wrong = write_secret(env.root / "wrong", "not the passphrase at all\n")
    before = fingerprint(env.store)
    line = one_line(
        sealfs(
            "rekey", str(env.store), "--recovery-key-file", str(env.recovery_file),
            "--passphrase-file", str(wrong),
        ),
        CONFIG_ERROR,
    )  # fmt: skip
    assert "keyslot 0 (passphrase) does not open with the passphrase given" in line
    assert fingerprint(env.store) == before
    done = sealfs(
        "rekey", str(env.store), "--recovery-key-file", str(env.recovery_file),
        "--passphrase-file", str(env.passfile),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # a command's output, not a daemon's log lines
    summary = re.search(r"is gone; (\d+) (objects?) \(", done.stdout)
    assert summary and (summary[2] == "object") == (summary[1] == "1"), done.stdout  # "1 objects"
    rekeyed = header(env.store)
    assert rekeyed.data_epoch == 1 and rekeyed.retired is None  # type: ignore[attr-defined]
    assert sorted(slot.kind for slot in rekeyed.slots) == ["passphrase", "recovery"]  # type: ignore[attr-defined]
    for option, secret in (
        ("--passphrase-file", env.passfile),
        ("--recovery-key-file", env.recovery_file),
    ):
        opened = sealfs("status", str(env.store), option, str(secret), "--json")
        assert opened.returncode == 0, opened.stderr
    # A second passphrase slot opens with another passphrase than the one given: the
    # command takes one of each kind, so that slot is to be dropped and added again (or
    # the passphrase that opens it given).
    second = write_secret(env.root / "second", "a second passphrase\n")
    added = sealfs(
        "key", "add", str(env.store), "passphrase", "--passphrase-file", str(env.passfile),
        "--new-passphrase-file", str(second), *CHEAP_KDF,
    )  # fmt: skip
    assert added.returncode == 0, added.stderr
    line = one_line(rekey(env, "--recovery-key-file", str(env.recovery_file)), CONFIG_ERROR)
    assert "keyslot 2 (passphrase) does not open with the passphrase given" in line
    assert "--drop-slot 2" in line


def test_rekey_of_a_copy_made_under_a_live_mount_names_that_mount(
    mounted_env: VolumeEnv, tmp_path: Path
) -> None:
    """A copy of a store made while a mount writes (cp -a, rsync) keeps the writer
    record naming that mount's daemon. Regression: `sealfs rekey COPY` took that daemon
    for the copy's, wrote the copy's new header, then handed the key to the daemon of
    the original, which refused it: "Invalid argument: MNT" (exit 1), the copy's header
    changed, and the same again at every run until the original was unmounted."""
    env = mounted_env
    (env.mnt / "f").write_bytes(b"original")
    subprocess.run([sys.executable, "-m", "sealfs.cli.main", "sync", str(env.mnt)], check=True)
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-a", str(env.store), str(copy)], check=True)
    before = fingerprint(copy), fingerprint(env.store)
    result = sealfs("rekey", str(copy), "--passphrase-file", str(env.passfile), "--drop-slot", "1")
    line = one_line(result, BUSY)
    assert str(env.mnt) in line and "copy" in line
    assert (fingerprint(copy), fingerprint(env.store)) == before  # nothing written to either
    assert env.status()["key_epoch"] == 0
    env.umount()
    result = sealfs("rekey", str(copy), "--passphrase-file", str(env.passfile), "--drop-slot", "1")
    assert result.returncode == 0, result.stderr  # the copy's own rekey, here
    assert set(epochs(copy).values()) == {1} and set(epochs(env.store).values()) == {0}


@pytest.mark.parametrize(
    ("served", "ours", "same"),
    [
        ("b/vol/ at AWS S3 (eu-west-1)", "b/vol/ at AWS S3", True),
        ("b/vol/ at AWS S3 (eu-west-1)", "b/vol/ at AWS S3 (us-east-1)", True),
        ("b/vol/ at https://S3.example:443/", "b/vol/ at https://s3.example", True),
        ("b/vol/ at AWS S3 (cn-north-1)", "b/vol/ at AWS S3 (eu-west-1)", False),
        ("b/vol/ at https://s3.example", "b/copy/ at https://s3.example", False),
        ("b/vol/ at https://s3.example", "b/vol/ at https://s3.other", False),
        ("b/vol/ at https://s3.example", "b/vol/ at AWS S3", False),
        ("b/vol/ at http://s3.example", "b/vol/ at https://s3.example", False),
    ],
)
def test_the_same_s3_store_however_the_daemon_and_the_command_spell_the_service(
    served: str, ours: str, same: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon and `sealfs rekey` each take the service from their own flags and
    environment (a service unit's AWS_REGION, a slash after the endpoint). Regression:
    any difference in the text made the live mount of this very store look like the
    writer of another copy, and the rekey refused (exit 5) until it was unmounted."""
    for variable in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(variable, raising=False)
    served, ours = _s3_location(served), _s3_location(ours)
    assert _same_store(served, ours) is same
    assert _same_store(ours, served) is same


def _s3_location(spec: str) -> str:
    """The location of the S3 store "BUCKET/PREFIX at WHERE" names, WHERE being an
    endpoint URL or "AWS S3" with an optional "(REGION)", as a process sees it."""
    path, _, where = spec.partition(" at ")
    name, _, prefix = path.partition("/")
    bucket = f"bucket-{name}"  # a name S3 accepts (3 characters at least)
    if where.startswith("AWS S3"):
        region = where.partition("(")[2].rstrip(")") or None
        return S3Store(bucket, prefix, region=region).location()
    return S3Store(bucket, prefix, endpoint_url=where).location()


def test_rekey_while_mounted_and_written(mounted_env: VolumeEnv) -> None:
    env = mounted_env
    files = write_tree(env.mnt / "before", 40, 300_000, "b")
    os.sync()
    subprocess.run([sys.executable, "-m", "sealfs.cli.main", "sync", str(env.mnt)], check=True)
    assert set(epochs(env.store).values()) == {0}

    stop = threading.Event()
    written: dict[str, bytes] = {}

    def keep_writing() -> None:
        k = 0
        while not stop.is_set():
            written.update(write_tree(env.mnt / "during", 1, 50_000, f"d{k}-"))
            k += 1

    writer = threading.Thread(target=keep_writing)
    writer.start()
    try:
        result = rekey(env, "--drop-slot", "1")
    finally:
        stop.set()
        writer.join()
    assert result.returncode == 0, result.stderr + env.log_text()
    assert "Rekey done" in result.stdout
    status = env.status()
    assert status["key_epoch"] == 1 and status["rekey"]["finished"]
    assert written, "nothing was written during the rekey"
    check_tree(env.mnt, files | written)
    env.umount()

    assert set(epochs(env.store).values()) == {1}
    h = header(env.store)
    assert h.data_epoch == 1 and h.retired is None  # type: ignore[attr-defined]
    assert [s.kind for s in h.slots] == ["passphrase"]  # type: ignore[attr-defined]
    old_recovery = sealfs("status", str(env.store), "--recovery-key-file", str(env.recovery_file))
    assert old_recovery.returncode == 3, old_recovery.stderr
    env.mount()
    check_tree(env.mnt, files | written)
    env.umount()


def test_daemon_killed_during_rekey_resumes_at_next_mount(mounted_env: VolumeEnv) -> None:
    env = mounted_env
    files = write_tree(env.mnt / "t", 600, 20_000, "f")  # many small objects: a long rekey
    subprocess.run([sys.executable, "-m", "sealfs.cli.main", "sync", str(env.mnt)], check=True)
    (daemon,) = env.daemon_pids()
    command = [sys.executable, "-m", "sealfs.cli.main", "rekey", str(env.store),
               "--passphrase-file", str(env.passfile), "--drop-slot", "1", "--no-wait"]  # fmt: skip
    # Killed as soon as the daemon re-seals, not once the command has returned: on a fast
    # machine the daemon was done with the whole store before the command's exit.
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for_first_reseal(env.store, lambda: proc.poll() in (None, 0))
        os.kill(daemon, signal.SIGKILL)
    finally:
        proc.communicate(timeout=60)
    env.kill()
    left = sum(1 for e in epochs(env.store).values() if e == 0)
    assert left > 0, "the rekey finished before the kill: the test proves nothing"
    assert header(env.store).retired is not None  # type: ignore[attr-defined]

    env.mount()  # resumes by itself
    wait_for_the_rekey(env)
    check_tree(env.mnt, files)
    env.umount()
    assert set(epochs(env.store).values()) == {1}
    assert header(env.store).retired is None  # type: ignore[attr-defined]


def test_offline_rekey_killed_then_run_again(volume_env: VolumeEnv) -> None:
    env = volume_env
    env.mount()
    files = write_tree(env.mnt / "t", 600, 20_000, "f")
    env.umount()
    command = [sys.executable, "-m", "sealfs.cli.main", "rekey", str(env.store),
               "--passphrase-file", str(env.passfile), "--drop-slot", "1"]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for_first_reseal(env.store, lambda: proc.poll() is None)
        proc.send_signal(signal.SIGSTOP)  # holding the volume, half-way
        # A mount meanwhile is told what holds the volume: it was told to unmount the
        # mount of the rekey's pid, and no mount there was.
        refused = sealfs(*env.mount_args())
        assert refused.returncode == BUSY, refused.stderr
        assert f"being rekeyed by 'sealfs rekey' (pid {proc.pid})" in one_line(refused, BUSY)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.communicate(timeout=30)
    assert sum(1 for e in epochs(env.store).values() if e == 0) > 0, "finished before the kill"

    listed = sealfs("key", "list", str(env.store), "--passphrase-file", str(env.passfile))
    assert "key epoch 1 (rekey from epoch 0 unfinished: " in listed.stdout, listed.stderr
    shown = sealfs("status", str(env.store), "--passphrase-file", str(env.passfile),
                   env={**os.environ, "COLUMNS": "500"})  # one line per row  # fmt: skip
    assert "epoch 0 -> 1: unfinished; a writable mount or 'sealfs rekey'" in shown.stdout
    result = rekey(env)  # the header's slots already open the new key: nothing to drop
    assert result.returncode == 0, result.stderr
    assert "Resuming" in result.stdout and "Rekey done" in result.stdout
    assert set(epochs(env.store).values()) == {1}
    assert header(env.store).retired is None  # type: ignore[attr-defined]
    env.mount()
    check_tree(env.mnt, files)
    env.umount()


def test_keyslot_changes_racing_a_mounted_rekey_never_lose_the_header(
    mounted_env: VolumeEnv, tmp_path: Path
) -> None:
    env = mounted_env
    write_tree(env.mnt / "t", 300, 20_000, "f")
    subprocess.run([sys.executable, "-m", "sealfs.cli.main", "sync", str(env.mnt)], check=True)
    assert rekey(env, "--drop-slot", "1", "--no-wait").returncode == 0
    added: list[Path] = []
    refused = 0
    for k in range(6):  # each adds a recovery slot while the daemon may drop the retired key
        out = tmp_path / f"recovery-{k}"
        result = sealfs(
            "key", "add", str(env.store), "recovery", "--passphrase-file", str(env.passfile),
            "--new-recovery-key-file", str(out),
        )  # fmt: skip
        if result.returncode == 0:
            added.append(out)
        else:
            assert "changed meanwhile" in result.stderr, result.stderr
            refused += 1
    wait_for_the_rekey(env)
    env.umount()
    h = header(env.store)
    assert h.retired is None and h.data_epoch == 1  # type: ignore[attr-defined]
    assert len(h.slots) == 1 + len(added)  # type: ignore[attr-defined]
    for path in added:  # every added slot opens the volume at the new epoch
        result = sealfs("status", str(env.store), "--recovery-key-file", str(path))
        assert result.returncode == 0, result.stderr
    assert set(epochs(env.store).values()) == {1}


def test_only_the_owner_may_hand_the_daemon_a_key(volume_env: VolumeEnv) -> None:
    """The root's rekey attribute is refused to other users (the value is never stored).

    The other user must reach the daemon: the mount answers everyone (--allow-other),
    its root is writable by all (else the kernel refuses first, EACCES), and the user
    can run this interpreter. Before, none of that held, and the test passed on the
    interpreter's own "Permission denied"."""
    env = volume_env
    env.mount("--allow-other")
    try:
        env.mnt.chmod(0o777)
        script = f"import os; os.setxattr({str(env.mnt)!r}, 'user.sealfs.rekey', bytes(32))"
        result = python_as_nobody(script, env.mnt.parent)
        assert result.returncode != 0
        assert "PermissionError: [Errno 1] Operation not permitted" in result.stderr, result.stderr
        assert env.status()["key_epoch"] == 0
    finally:
        env.umount()


def test_offline_rekey_stops_on_a_damaged_object(volume_env: VolumeEnv) -> None:
    volume_env.mount()
    write_tree(volume_env.mnt / "d", 2, 300_000, "x")
    volume_env.umount()
    damaged = sorted(p for p in (volume_env.store / "c").rglob("*") if p.is_file())[0]
    data = bytearray(damaged.read_bytes())
    data[40] ^= 1
    damaged.write_bytes(bytes(data))
    result = rekey(volume_env, "--drop-slot", "1", timeout=60)  # used to retry for ever
    assert result.returncode == 4, result.stderr  # tampered: exit 4, not a hang
    line = result.stderr.strip().splitlines()[-1]
    assert (
        line.startswith("sealfs: ")
        and "failed authentication" in line
        and "run 'sealfs rekey' again" in line
    )
    assert result.stderr.count("failed authentication") == 1  # said once, not logged too
    assert header(volume_env.store).retired is not None  # type: ignore[attr-defined]


def test_mounted_rekey_stops_on_a_damaged_object_and_resumes_after_a_repair(
    volume_env: VolumeEnv,
) -> None:
    volume_env.mount()
    files = write_tree(volume_env.mnt / "d", 2, 300_000, "x")
    volume_env.umount()
    damaged = sorted(p for p in (volume_env.store / "c").rglob("*") if p.is_file())[0]
    good = damaged.read_bytes()
    damaged.write_bytes(good[:40] + bytes([good[40] ^ 1]) + good[41:])
    volume_env.mount()
    try:
        result = rekey(volume_env, "--drop-slot", "1", timeout=60)  # used to wait for ever
        assert result.returncode == 1, result.stderr
        assert "stopped" in result.stderr and "failed authentication" in result.stderr
        assert volume_env.status()["rekey"]["stopped"]
        damaged.write_bytes(good)  # restored from a backup
        result = rekey(volume_env, timeout=60)
        assert result.returncode == 0, result.stderr + volume_env.log_text()
        check_tree(volume_env.mnt, files)
    finally:
        volume_env.umount()
    assert set(epochs(volume_env.store).values()) == {1}
    assert header(volume_env.store).retired is None  # type: ignore[attr-defined]


def test_the_key_probe_tells_a_daemon_that_keeps_the_attribute(volume_env: VolumeEnv) -> None:
    """sealfs upgraded under a running mount: a daemon older than rekeying on a mount
    kept the rekey attribute as an ordinary xattr of the root, holding the new master
    key (readable through the mount, logged under the key being retired), and started
    nothing, while `sealfs rekey` waited forever. The probe runs before the header
    changes. A directory of a live mount keeps user xattrs as such a daemon's root did;
    this build's root refuses the empty probe."""
    volume_env.mount()
    try:
        old_root = volume_env.mnt / "d"
        old_root.mkdir()
        with (
            live_mount(old_root) as live,
            pytest.raises(ConfigError, match="is older than rekeying on a mount") as info,
        ):
            _check_daemon_takes_keys(live)
        assert "sealfs umount" in str(info.value) and "nothing was changed" in str(info.value)
        assert os.listxattr(old_root) == []  # the probe does not stay behind
        with live_mount(volume_env.mnt) as live:
            _check_daemon_takes_keys(live)  # this build's daemon: no error
        assert os.listxattr(volume_env.mnt) == []
    finally:
        volume_env.umount()


def wait_for_the_rekey(env: VolumeEnv) -> None:
    """Wait until the mount's daemon says its re-encryption has finished."""
    deadline = time.monotonic() + 120
    while not (env.status()["rekey"] or {}).get("finished"):
        assert time.monotonic() < deadline, env.status()
        time.sleep(0.1)


def _waiting_for_flock(path: Path) -> bool:
    """Whether some process waits for a flock(2) on path (a blocked request in /proc/locks
    is marked "->")."""
    inode = f":{path.stat().st_ino} "
    with open("/proc/locks") as locks:
        return any("->" in line and "FLOCK" in line and inode in line for line in locks)


@dataclasses.dataclass
class HeldRekey:
    process: subprocess.Popen[str]
    err: str = ""  # its stderr, once it has ended


@contextlib.contextmanager
def rekey_held_before_its_header(env: VolumeEnv) -> Iterator[HeldRekey]:
    """`sealfs rekey` of env's store, running, held just before it writes the new header
    (the store's header lock, taken here, keeps it there): by then it has found the
    mount, and the slots are re-wrapped. Let go, and waited for, when the block ends."""
    lock_path = env.store / ".lock"
    lock = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        command = [sys.executable, "-m", "sealfs.cli.main", "rekey", str(env.store),
                   "--passphrase-file", str(env.passfile), "--drop-slot", "1"]  # fmt: skip
        with subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True,
        ) as running:  # fmt: skip
            try:
                deadline = time.monotonic() + 60
                while not _waiting_for_flock(lock_path):
                    assert running.poll() is None, running.communicate()
                    assert time.monotonic() < deadline, "the rekey never reached the header"
                    time.sleep(0.01)
                held = HeldRekey(running)
                yield held
                fcntl.flock(lock, fcntl.LOCK_UN)
                _, held.err = running.communicate(timeout=180)
            except BaseException:
                # Popen's exit waits for the command, which waits for the lock held here:
                # a failure (of the block, or of the command to end) hung until the
                # suite's timeout, and the rekey then ran on behind the failed test.
                running.kill()
                raise
    finally:
        os.close(lock)


def test_a_mount_unmounted_during_a_rekey_never_gets_the_key_on_local_disk(
    mounted_env: VolumeEnv,
) -> None:
    """Regression: the command handed the daemon the new master key as an xattr of the
    mountpoint, by path, seconds after it found the mount (re-wrapping every slot, an
    Argon2 run or a KMS call, comes between). Unmounted meanwhile, the path led to the
    plain directory under the mount: the key was stored in that directory's xattrs on
    local disk, where every user who could read the directory read it. The header lock,
    held here, keeps the command between the two; now its open root keeps the mount
    busy until the key is handed over."""
    env = mounted_env
    (env.mnt / "f").write_bytes(b"x")
    with rekey_held_before_its_header(env) as rekey:
        unmounted = sealfs("umount", str(env.mnt))  # by then the mount was found
    err = rekey.err
    if env.is_mounted():
        env.umount()
    assert REKEY_ATTRIBUTE not in os.listxattr(env.mnt), "the master key is on local disk"
    assert unmounted.returncode == BUSY, unmounted.stderr  # the mount waited for its key
    assert rekey.process.returncode == 0, err
    assert set(epochs(env.store).values()) == {1}


REKEY_ATTRIBUTE = "user.sealfs.rekey"


def test_a_mount_stopped_during_a_rekey_is_named_and_the_rekey_resumes(
    mounted_env: VolumeEnv,
) -> None:
    """A mount stopped (SIGTERM: systemctl stop) after the command found it, and so
    after the new header was written but before the key was handed over: the command
    fails naming the mount and what comes next (the next mount resumes the rekey). The
    handover through the open root said only "Transport endpoint is not connected"."""
    env = mounted_env
    (env.mnt / "f").write_bytes(b"x")
    (daemon,) = env.daemon_pids()
    with rekey_held_before_its_header(env) as rekey:
        os.kill(daemon, signal.SIGTERM)  # by then the mount was found
        env.wait_for_daemon_exit(60)
    err = rekey.err
    assert not env.is_mounted()
    assert REKEY_ATTRIBUTE not in os.listxattr(env.mnt), "the master key is on local disk"
    assert rekey.process.returncode == 1, err
    assert str(env.mnt) in err and "the next mount of the volume resumes the rekey" in err, err
    assert header(env.store).retired is not None  # type: ignore[attr-defined]
    env.mount()  # resumes by itself
    wait_for_the_rekey(env)
    assert (env.mnt / "f").read_bytes() == b"x"
    env.umount()
    assert set(epochs(env.store).values()) == {1}


def test_a_failing_block_ends_the_held_rekey_instead_of_waiting_for_it(
    volume_env: VolumeEnv,
) -> None:
    """Regression (tests): a block of rekey_held_before_its_header that failed (a daemon
    that never stopped, say) left the command waiting for the header lock the helper
    still held, and Popen's exit waited for the command: the test hung until the
    suite's timeout, which then let the rekey loose behind it. The command is killed,
    and the block's own failure is what the test reports."""
    with (
        pytest.raises(AssertionError, match="the block failed"),
        rekey_held_before_its_header(volume_env) as rekey,
    ):
        raise AssertionError("the block failed")
    assert rekey.process.returncode == -signal.SIGKILL
    assert header(volume_env.store).retired is None  # type: ignore[attr-defined]


def test_a_read_only_mount_of_another_user_is_not_said_to_need_a_remount(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only its owner or root may have it take the key (EPERM): it takes it by itself
    when it meets the rekey, if it can. 'remount it' sent the user to unmount another
    user's mount that would have followed."""

    def refused(path: str, name: str) -> bytes:
        raise PermissionError(errno.EPERM, os.strerror(errno.EPERM))

    monkeypatch.setattr(rekey_cmd, "_sealfs_mounts", lambda: ["/srv/theirs"])
    monkeypatch.setattr(rekey_cmd, "_follower_status", lambda loaded, mnt: {"read_only": True})
    monkeypatch.setattr(rekey_cmd.os, "getxattr", refused)
    rekey_cmd._report_followers(None, 1)  # type: ignore[arg-type]
    said = capsys.readouterr().out
    assert said.startswith("Read-only mount /srv/theirs: belongs to another user")
    assert "remount" not in said


def test_an_offline_rekey_refuses_a_store_rolled_back_behind_this_host_s_record(
    volume_env: VolumeEnv,
) -> None:
    """The rekey commits generations (its claim, its release), so the next mount finds
    the store at or past this host's record and can no longer tell a rollback: the
    commits the store dropped were lost without a word. The rekey checks the record
    as a mount does, before it writes anything."""
    env = volume_env
    env.mount()
    (env.mnt / "kept").write_bytes(b"committed before the cut")
    env.umount()
    older = {p.relative_to(env.store) for p in env.store.glob("[ls]/*")}
    env.mount()
    (env.mnt / "dropped").write_bytes(b"committed, then dropped by the store")
    env.umount()
    newer = sorted(p for p in env.store.glob("l/*") if p.relative_to(env.store) not in older)
    assert len(newer) == 3  # the claim, the file's commit, the release
    for path in newer[1:]:  # two generations dropped: the rekey's claim and release refill them
        path.unlink()
    before = fingerprint(env.store)
    result = rekey(env, "--drop-slot", "1", timeout=60)
    line = one_line(result, 4)
    assert "rolled back" in line and "--accept-rollback" in line, line
    assert fingerprint(env.store) == before, "a refused rekey changed the store"
    refused = env.mount(check=False)  # the host still tells, as before the rekey
    assert refused.returncode == 4 and "rolled back" in refused.stderr, refused.stderr


def test_a_store_put_back_as_it_was_before_an_offline_rekey_is_refused_as_rolled_back(
    volume_env: VolumeEnv, tmp_path: Path
) -> None:
    """Each object of the copy is authentic under the old key, the very key the rekey
    was run to revoke: only this host's record of the rekey's own commits tells."""
    env = volume_env
    env.mount()
    (env.mnt / "f").write_bytes(b"written before the rekey")
    env.umount()
    before_rekey = tmp_path / "before-rekey"
    shutil.copytree(env.store, before_rekey)
    assert rekey(env, "--drop-slot", "1", timeout=60).returncode == 0
    shutil.rmtree(env.store)
    shutil.copytree(before_rekey, env.store)
    refused = env.mount(check=False)
    if refused.returncode == 0:  # the failure this test is for: leave no mount behind
        env.umount()
    assert refused.returncode == 4 and "rolled back" in refused.stderr, refused.stderr
