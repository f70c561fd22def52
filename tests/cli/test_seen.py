"""The host's record of the newest generation it saw of each volume, per store location."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sealfs.cli import seen as seen_module
from sealfs.cli import status_cmd
from sealfs.cli.main import parse
from sealfs.cli.paths import state_dir
from sealfs.cli.seen import SeenVolume, kept_current
from sealfs.errors import IntegrityError, RolledBackError
from sealfs.store.local import LocalStore
from sealfs.store.url import open_store
from tests.mounts import PASSPHRASE, VolumeEnv, sealfs

VOLUME = bytes(range(16))
OTHER_VOLUME = bytes(range(1, 17))


def check(seen: SeenVolume, generation: int) -> None:
    """What a mount does: the record as it is now, against the generation it loaded."""
    seen.check(seen.recorded(), generation, lambda _: None)


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    return tmp_path / "state" / "sealfs"


def test_a_store_behind_what_this_host_saw_is_refused(state: Path) -> None:
    seen = SeenVolume(VOLUME, "local store at /srv/agent")
    check(seen, 3)  # nothing recorded yet: nothing to compare
    seen.remember(7)
    check(seen, 7)
    check(seen, 9)
    with pytest.raises(RolledBackError) as refused:
        check(seen, 6)
    assert isinstance(refused.value, IntegrityError)  # exit 4, as for other tampering
    message = str(refused.value)
    assert "generation 6" in message and "generation 7" in message, message
    assert VOLUME.hex() in message and "/srv/agent" in message, message
    assert "--accept-rollback" in message and "\n" not in message, message


def test_the_record_never_goes_back_unless_told(state: Path) -> None:
    seen = SeenVolume(VOLUME, "local store at /srv/agent")
    seen.remember(7)
    seen.remember(5)  # a read-only mount that loaded earlier, say
    with pytest.raises(RolledBackError):
        check(seen, 6)
    accepting = SeenVolume(VOLUME, "local store at /srv/agent", accepting=True)
    check(accepting, 5)  # --accept-rollback
    with kept_current(accepting, lambda: (5, None), every=3600):
        pass
    check(seen, 5)  # the mount that accepted it lowered the record
    with pytest.raises(RolledBackError):
        check(seen, 4)


def test_temporary_files_a_power_cut_left_go_at_the_next_record(state: Path) -> None:
    """A cut between creating the temporary file and renaming it over the record left
    the file for good, one more at every such cut."""
    seen = SeenVolume(VOLUME, "local store at /srv/agent")
    seen.remember(7)
    left = [seen.path.with_name(f".{seen.path.name}.{t}") for t in ("0123456789abcdef", "f" * 16)]
    for path in left:
        path.write_bytes(b'{"generation": 9')  # torn
    others = [
        seen.path.with_name(f".{seen.path.name}.notatoken"),
        seen.path.with_name(".o." + "0" * 16),
    ]
    for path in others:
        path.write_bytes(b"not ours")
    seen.remember(8)
    assert not any(path.exists() for path in left)
    assert all(path.exists() for path in others)
    assert seen.recorded() is not None and seen.recorded()[0] == 8  # type: ignore[index]


def test_each_volume_and_location_has_its_own_record(state: Path) -> None:
    SeenVolume(VOLUME, "local store at /srv/agent").remember(7)
    check(SeenVolume(VOLUME, "local store at /backup/agent"), 2)  # a copy diverges legitimately
    check(SeenVolume(OTHER_VOLUME, "local store at /srv/agent"), 2)
    with pytest.raises(RolledBackError):
        check(SeenVolume(VOLUME, "local store at /srv/agent"), 2)


def test_the_record_is_the_owner_s_and_holds_no_secret(state: Path) -> None:
    seen = SeenVolume(VOLUME, "local store at /srv/agent")
    seen.remember(7)
    assert seen.path.parent == state / "seen"
    assert stat.S_IMODE(seen.path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(seen.path.stat().st_mode) == 0o600
    record = json.loads(seen.path.read_bytes())
    assert set(record) == {"volume_id", "store", "generation", "seen_at_ns"}
    assert record["generation"] == 7
    assert os.listdir(seen.path.parent) == [seen.path.name]  # no temporary file left


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"{",
        b"[7]",
        b'{"generation": "7", "seen_at_ns": 1}',
        b'{"generation": 7}',
        b"x" * 70000,
        b"[" * 60000,
    ],
    ids=["empty", "torn", "not an object", "wrong type", "incomplete", "huge", "deep"],
)
def test_a_damaged_record_is_ignored_with_a_warning_then_replaced(
    state: Path, content: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    seen = SeenVolume(VOLUME, "local store at /srv/agent")
    seen.path.parent.mkdir(parents=True)
    seen.path.write_bytes(content)
    with caplog.at_level(logging.WARNING):
        check(seen, 1)  # the record is a hint: never a reason not to mount
    assert "rollback not checked" in caplog.text
    seen.remember(4)
    with pytest.raises(RolledBackError):
        check(seen, 3)


def test_a_record_of_an_impossible_time_still_refuses_by_its_generation(state: Path) -> None:
    """Regression: a record whose time no clock shows ended the mount as a bug in sealfs
    (OverflowError from localtime, exit 70) instead of saying the store is behind."""
    seen = SeenVolume(VOLUME, "local store at /srv/agent")
    seen.path.parent.mkdir(parents=True)
    seen.path.write_text(json.dumps({"generation": 7, "seen_at_ns": 10**30}))
    with pytest.raises(RolledBackError) as refused:
        check(seen, 6)
    assert "generation 7 there (at an unknown time)" in str(refused.value)


def test_a_fifo_in_place_of_the_record_does_not_hang_the_mount(
    state: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: the record was opened as any file: a FIFO there blocked the mount in
    open() for good, before it asked for the store."""
    seen = SeenVolume(VOLUME, "local store at /srv/agent")
    seen.path.parent.mkdir(parents=True)
    os.mkfifo(seen.path)
    checking = threading.Thread(target=check, args=(seen, 1), daemon=True)
    with caplog.at_level(logging.WARNING):
        checking.start()
        checking.join(10)
    if checking.is_alive():  # let the thread go: open the FIFO's other end
        os.close(os.open(seen.path, os.O_WRONLY | os.O_NONBLOCK))
        checking.join(10)
        pytest.fail("check() blocked on a FIFO")
    assert "rollback not checked" in caplog.text
    seen.remember(4)  # and the FIFO makes way for a record
    with pytest.raises(RolledBackError):
        check(seen, 3)


def test_a_symlink_left_in_the_state_directory_is_never_written_through(
    state: Path, tmp_path: Path
) -> None:
    """Regression: the temporary file had a predictable name (the pid) and was opened
    following symlinks: one planted there (by whoever can write the directory: a user
    whose XDG_STATE_HOME a root mount used under sudo) had the record written over the
    file it named."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    seen = SeenVolume(VOLUME, "local store at /srv/agent")
    seen.path.parent.mkdir(parents=True)
    for name in (f".{seen.path.name}.{os.getpid()}", f".{seen.path.name}.tmp"):
        (seen.path.parent / name).symlink_to(victim)
    seen.remember(7)
    assert victim.read_bytes() == b"precious"
    assert json.loads(seen.path.read_bytes())["generation"] == 7


def test_no_usable_state_directory_is_a_warning_not_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    monkeypatch.setenv("XDG_STATE_HOME", str(blocker))  # a file where a directory must be
    seen = SeenVolume(VOLUME, "local store at /srv/agent")
    with caplog.at_level(logging.WARNING):
        seen.remember(7)
        check(seen, 1)
        seen.remember(8)  # every 30 s while a mount runs: warned once is enough
    assert "cannot record generation 7" in caplog.text
    assert "generation 8" not in caplog.text


def test_a_state_directory_made_for_sealfs_is_the_owner_s_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: mkdir(mode=0o700, parents=True) gives the mode to the last directory
    only: a missing XDG state base and sealfs's directory in it came out 0755 (they hold
    the default log, and the names of the volumes this host mounts). The XDG spec asks
    0700 of a base directory made for it; what lies above it is left as mkdir -p makes it."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "home" / "state"))
    old = os.umask(0o022)
    try:
        SeenVolume(VOLUME, "local store at /srv/agent").remember(7)
    finally:
        os.umask(old)
    modes = {
        path.name: stat.S_IMODE(path.stat().st_mode)
        for path in (tmp_path / "home", state_dir().parent, state_dir(), state_dir() / "seen")
    }
    assert modes == {"home": 0o755, "state": 0o700, "sealfs": 0o700, "seen": 0o700}


def test_a_relative_or_empty_state_home_is_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    home = Path.home() / ".local" / "state" / "sealfs"
    for value in ("", "relative/state"):
        monkeypatch.setenv("XDG_STATE_HOME", value)
        assert state_dir() == home  # the XDG spec: such a value is invalid
    monkeypatch.setenv("XDG_STATE_HOME", "/var/lib/agent")
    assert state_dir() == Path("/var/lib/agent/sealfs")


def test_a_running_mount_keeps_its_record_current(state: Path) -> None:
    seen = SeenVolume(VOLUME, "local store at /srv/agent")
    generation = [3]
    advanced = threading.Event()

    def committed() -> tuple[int, None]:
        generation[0] += 1
        if generation[0] >= 10:
            advanced.set()
        return generation[0], None

    with kept_current(seen, committed, every=0.01):
        assert advanced.wait(10)
        deadline = time.monotonic() + 10
        while json.loads(seen.path.read_bytes())["generation"] < 10:  # written while running
            assert time.monotonic() < deadline
            time.sleep(0.01)
    final = generation[0]
    assert json.loads(seen.path.read_bytes())["generation"] == final  # and once at the end


@pytest.mark.fuse
def test_a_store_named_through_a_symlink_has_the_same_record(volume_env: VolumeEnv) -> None:
    """Regression: the record was kept per path as given, so a store restored from an
    older copy mounted without a word through a symlink to its directory."""
    env = volume_env
    env.mount()
    (env.mnt / "first").write_text("1")
    env.umount()
    copy = env.root / "copy"
    shutil.copytree(env.store, copy)
    env.mount()
    (env.mnt / "second").write_text("2")
    env.umount()
    shutil.rmtree(env.store)
    copy.rename(env.store)  # rolled back
    link = env.root / "link"
    link.symlink_to(env.store)
    result = sealfs(
        "mount", str(link), str(env.mnt), "--passphrase-file", str(env.passfile),
        "--log-file", str(env.log),
    )  # fmt: skip
    if result.returncode == 0:
        env.umount()
    assert result.returncode == 4, result.stderr
    assert "rolled back" in result.stderr, result.stderr


def test_an_s3_store_has_one_record_however_it_is_named(
    state: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: the record was keyed by the store's description, which names the
    region when one is set (AWS_REGION in a unit, none in a shell) and the endpoint as
    typed: one store had several records, and a rollback went unnoticed by a mount
    that named it another way."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for variable in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(variable, raising=False)

    def record(url: str, endpoint: str | None = None) -> Path:
        store = open_store(url, s3_endpoint=endpoint)
        return SeenVolume.of(VOLUME, url, store).path

    aws = record("s3://agent-bucket/vol")
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    assert record("s3://agent-bucket/vol/") == aws
    monkeypatch.setenv("AWS_REGION", "cn-north-1")  # another partition: another bucket
    assert record("s3://agent-bucket/vol") != aws
    minio = record("s3://agent-bucket/vol", "http://minio.internal:9000")
    assert minio != aws
    assert record("s3://agent-bucket//vol", "http://MINIO.internal:9000/") == minio
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://minio.internal:9000")
    assert record("s3://agent-bucket/vol") == minio


# Run in a CLI process: the volume's log is listed, then (as a read-write mount of the
# volume on this host does, between that listing and the end of the load) another
# writer commits a generation and records it; then the command goes on.
_COMMIT_DURING_THE_LOAD = """
import sys
from sealfs.cli.seen import SeenVolume
from sealfs.keys.slots import Passphrase
from sealfs.store.url import open_store
from sealfs.volume import loader

store, passphrase = sys.argv[1], sys.argv[2].encode()
fetch = loader._fetch_in_order
done = []

def fetch_after_a_commit(listed_from, names):
    if not done:
        done.append(True)
        writer = loader.open_volume(open_store(store), Passphrase(passphrase))
        loader.claim_writer(writer)
        SeenVolume.of(writer.volume_id, store, writer.store).remember(writer.live.generation)
    return fetch(listed_from, names)

loader._fetch_in_order = fetch_after_a_commit
from sealfs.cli.main import main
sys.exit(main(sys.argv[3:]))
"""


def _commit_during_the_load(env: VolumeEnv, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-c", _COMMIT_DURING_THE_LOAD, str(env.store), PASSPHRASE]
    return subprocess.run(
        [*command, *args],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def test_a_commit_during_the_load_does_not_make_status_say_rolled_back(
    volume_env: VolumeEnv,
) -> None:
    """Regression: status read the record after loading the volume; a mount on this
    host that committed (and recorded it) in between made a whole store "behind"."""
    result = _commit_during_the_load(
        volume_env, "status", str(volume_env.store), "--passphrase-file",
        str(volume_env.passfile), "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert status["seen_generation"] is None or status["seen_generation"] <= status["generation"]
    # The in-process path agrees, and the record does hold the newer generation now.
    args = parse(["status", str(volume_env.store), "--passphrase-file", str(volume_env.passfile)])
    assert status_cmd._gather(args)["seen_generation"] == status["generation"] + 1


@pytest.mark.fuse
def test_a_commit_during_the_load_does_not_refuse_a_read_only_mount(
    volume_env: VolumeEnv,
) -> None:
    """Regression: the mount read the record after loading the volume: a read-write
    mount of it on this host that committed and recorded the generation meanwhile (at
    its start, every 30 s, at its end) made a read-only mount of the whole store fail
    as rolled back (exit 4)."""
    env = volume_env
    result = _commit_during_the_load(env, *env.mount_args(), "--read-only")
    if result.returncode == 0:
        env.umount()
    assert result.returncode == 0, result.stderr + env.log_text()


def test_a_local_store_s_record_is_this_host_s(
    state: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A home shared between hosts (NFS) holds every host's records: two hosts, each
    with its own store at one path, refused each other's as rolled back."""
    url = str(tmp_path / "store")
    store = LocalStore(tmp_path / "store")
    monkeypatch.setattr(socket, "gethostname", lambda: "alpha")
    alpha = SeenVolume.of(VOLUME, url, store)
    monkeypatch.setattr(socket, "gethostname", lambda: "beta")
    beta = SeenVolume.of(VOLUME, url, store)
    alpha.remember(9)
    check(beta, 2)  # beta's own store, at the same path
    assert alpha.path != beta.path and "on alpha" in alpha.location


def test_a_lock_held_by_another_process_is_given_up_on(
    state: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: the record's directory was locked with a blocking flock, and the
    daemon records once before it reports the mount ready: any process of the user
    holding that lock (a backup tool, a stuck sealfs) hung `sealfs mount` for good."""
    monkeypatch.setattr(seen_module, "LOCK_WAIT", 0.3)
    seen = SeenVolume(VOLUME, "local store at /srv/agent")
    seen.path.parent.mkdir(parents=True)
    hold = "import fcntl, os, sys, time; fcntl.flock(os.open(sys.argv[1], 0), 2); time.sleep(60)"
    holder = subprocess.Popen([sys.executable, "-c", hold, str(seen.path.parent)])
    try:
        deadline = time.monotonic() + 10
        while not _locked_elsewhere(seen.path.parent) and time.monotonic() < deadline:
            time.sleep(0.05)
        recording = threading.Thread(target=seen.remember, args=(5,), daemon=True)
        with caplog.at_level(logging.WARNING):
            recording.start()
            recording.join(10)
        assert not recording.is_alive(), "remember() waited on the lock for good"
        assert "cannot record generation 5" in caplog.text
        assert "held its lock" in caplog.text
        assert seen.recorded() is None
    finally:
        holder.kill()
        holder.wait()
    seen.remember(6)  # the lock free again: recorded as ever
    recorded = seen.recorded()
    assert recorded is not None and recorded[0] == 6


def _locked_elsewhere(directory: Path) -> bool:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_a_copy_behind_what_this_host_saw_elsewhere_is_named(
    state: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: after a volume moved (local to S3, say), mounting the old copy by
    mistake wrote to it without a word, while the moved copy went on diverging."""
    old = SeenVolume(VOLUME, "local store at /srv/agent on alpha")
    moved = SeenVolume(VOLUME, "s3 store s3://bucket/agent at https://s3.example")
    old.remember(7)
    moved.remember(12)
    SeenVolume(OTHER_VOLUME, "s3 store s3://bucket/other at https://s3.example").remember(40)
    with caplog.at_level(logging.WARNING, logger="sealfs.cli.seen"):
        moved.warn_if_behind_elsewhere(12, moved.recorded())  # the newest copy: nothing to say
        assert not caplog.records
        old.warn_if_behind_elsewhere(7, old.recorded())
    [record] = caplog.records
    message = record.getMessage()
    assert "s3://bucket/agent" in message and "generation 12" in message, message
    assert "generation 7" in message and VOLUME.hex() in message, message
    assert "s3://bucket/other" not in message and "\n" not in message, message
    assert "this copy is out of date" in message and "unmount this one" in message, message


def test_a_copy_used_again_since_the_other_went_ahead_is_not_warned_about(
    state: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: after a restore drill (a copy mounted and written, then the original
    again), every mount of the original said to retire it, until its generation passed
    the drill's: generations of copies that diverged do not say which is the volume."""
    original = SeenVolume(VOLUME, "local store at /srv/agent on alpha")
    drill = SeenVolume(VOLUME, "local store at /tmp/drill on alpha")
    original.remember(7)
    drill.remember(12)
    original.remember(8)  # the original mounted (and so written) again since
    with caplog.at_level(logging.WARNING, logger="sealfs.cli.seen"):
        original.warn_if_behind_elsewhere(8, original.recorded())
    assert not caplog.records


def test_a_read_only_mount_of_an_older_copy_is_told_it_only_shows_it(
    state: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: a read-only mount of a backup (how the README checks one) was told to
    unmount and retire it, as if it wrote there."""
    SeenVolume(VOLUME, "local store at /srv/agent on alpha").remember(12)
    backup = SeenVolume(VOLUME, "local store at /backup/agent on alpha")
    with caplog.at_level(logging.WARNING, logger="sealfs.cli.seen"):
        backup.warn_if_behind_elsewhere(9, backup.recorded(), read_only=True)
    [record] = caplog.records
    message = record.getMessage()
    assert "read-only mount shows it as of generation 9" in message, message
    assert "retire" not in message and "unmount" not in message, message


def test_mounting_the_old_copy_of_a_moved_volume_warns(volume_env: VolumeEnv) -> None:
    """The old store, mounted after the volume moved and was written at its new place,
    mounts (a copy is a volume of its own) but says which copy is ahead of it."""
    env = volume_env
    env.mount()
    (env.mnt / "first").write_text("1")
    env.umount()
    moved = env.root / "moved"
    shutil.copytree(env.store, moved)
    args = ["--passphrase-file", str(env.passfile), "--log-file", str(env.log)]
    first = sealfs("mount", str(moved), str(env.mnt), *args)
    assert first.returncode == 0, first.stderr
    (env.mnt / "second").write_text("2")
    env.umount()
    assert "out of date" not in first.stderr, first.stderr  # it was not behind
    result = env.mount()
    env.umount()
    assert "out of date" in result.stderr and str(moved) in result.stderr, result.stderr
    # Used again since (a drill's copy, say): said once, not at every mount after.
    again = env.mount()
    env.umount()
    assert "out of date" not in again.stderr, again.stderr


def test_a_store_whose_recorded_generation_is_another_segment_is_refused(state: Path) -> None:
    seen = SeenVolume(VOLUME, "local store at /srv/agent")
    ours, theirs = bytes(32), bytes(range(32))
    seen.remember(7, ours)
    recorded = seen.recorded()
    assert recorded is not None and recorded[2] == ours
    asked: list[int] = []

    def digest_at(generation: int) -> bytes:
        asked.append(generation)
        return ours

    seen.check(recorded, 9, digest_at)
    assert asked == [7]  # the recorded generation, in the loaded store
    for found in (theirs, None):  # a copy's branch, or the segment gone
        with pytest.raises(RolledBackError) as refused:
            seen.check(recorded, 9, lambda _: found)  # noqa: B023 (called at once)
        message = str(refused.value)
        assert "generation 7 is not the one" in message and "another copy" in message, message
        assert "--accept-rollback" in message and "\n" not in message, message
    accepting = SeenVolume(VOLUME, "local store at /srv/agent", accepting=True)
    accepting.check(accepting.recorded(), 9, lambda _: theirs)  # --accept-rollback
