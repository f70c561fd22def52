"""Real FUSE mounts on s3:// stores: faults, a crash, an unreachable store, leaks, economy.

Every mount goes through the fault proxy (tests/s3/proxy.py) to the moto
server, with the CLI run as a user runs it.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from sealfs.cli.exitcodes import FAILURE
from sealfs.cli.mount_cmd import commit_mount
from sealfs.crypto.envelope import FLAG_DELTA
from sealfs.volume.chunks import GAVE_UP_FRESH
from tests.checkpoints import edited, records
from tests.cli.test_bad_input import one_line
from tests.conftest import crashable_ext4
from tests.mounts import (
    CHEAP_KDF,
    PASSPHRASE,
    force_unmount,
    mounted_sealfs,
    sealfs,
    wait_until,
    write_secret,
)
from tests.s3.conftest import S3VolumeEnv
from tests.s3.proxy import FaultProxy
from tests.s3.server import all_objects, client, new_bucket

pytestmark = [pytest.mark.s3, pytest.mark.fuse]


def checkpoint(mnt: Path, name: str, data: bytes) -> None:
    """The atomic checkpoint idiom: write a temp file, fsync it, rename it, fsync the dir."""
    tmp = mnt / f".{name}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, mnt / name)
    commit_mount(str(mnt))


def assert_holds(mnt: Path, expected: dict[str, bytes]) -> None:
    for name, data in expected.items():
        got = (mnt / name).read_bytes()
        assert got == data, f"{name}: {len(got)} bytes, expected {len(data)}"


def fresh_cache(env: S3VolumeEnv) -> None:
    """Forget the disk cache, so that the next mount reads every chunk from the bucket."""
    shutil.rmtree(env.cache, ignore_errors=True)


def test_checkpoints_survive_faults_and_a_crash(s3_env: S3VolumeEnv, proxy: FaultProxy) -> None:
    env = s3_env
    proxy.delay = 0.2
    proxy.set_faults(0.1)  # a tenth of all requests fail, in every way the proxy knows
    env.mount()
    rng = random.Random(11)
    committed: dict[str, bytes] = {}

    def one_round(step: int) -> None:
        data = rng.randbytes(rng.choice([2_000, 400_000, 1_600_000]))
        checkpoint(env.mnt, f"step-{step}.bin", data)
        committed[f"step-{step}.bin"] = data
        latest = json.dumps({"step": step, "size": len(data)}).encode()
        checkpoint(env.mnt, "latest.json", latest)
        committed["latest.json"] = latest

    for step in range(4):
        one_round(step)
    (env.mnt / "unsynced.bin").write_bytes(b"written, never fsynced")
    env.kill()  # a crash, with faults still on
    fresh_cache(env)
    env.mount()
    assert_holds(env.mnt, committed)
    for step in range(4, 7):
        one_round(step)
    env.umount()
    proxy.set_faults(0.0)
    fresh_cache(env)
    env.mount()
    assert_holds(env.mnt, committed)
    assert sorted(p.name for p in env.mnt.iterdir() if p.name.startswith("step-")) == sorted(
        n for n in committed if n.startswith("step-")
    )
    env.umount()
    assert sum(proxy.injected.values()) >= 10, proxy.injected
    assert {"drop", "drop_after", "500", "503", "slowdown", "cut"} & set(proxy.injected)
    assert "Traceback" not in env.log_text()


def chunk_objects(bucket: str) -> dict[str, bytes]:
    return {key: body for key, body in all_objects(bucket).items() if key.startswith("vol/c/")}


def test_scattered_edits_are_stored_as_differences_and_read_back_from_the_bucket(
    s3_env: S3VolumeEnv, bucket: str, proxy: FaultProxy
) -> None:
    """Versions of a checkpoint with 1 % of the records changed, scattered: the chunks of
    later versions are differences from chunks of the first. Stored whole, each version
    cost what the first did. Read after a crash with the disk cache gone and faults
    on, a difference takes its base from the bucket too."""
    env = s3_env
    env.mount()
    versions = [records(21, 100_000)]
    versions += [edited(versions[-1], seed) for seed in (22, 23)]
    checkpoint(env.mnt, "state-0.json", b"".join(versions[0]))
    first = sum(len(body) for body in chunk_objects(bucket).values())
    for number, version in enumerate(versions[1:], start=1):
        checkpoint(env.mnt, f"state-{number}.json", b"".join(version))
    chunks = chunk_objects(bucket)
    added = sum(len(body) for body in chunks.values()) - first
    assert added < first, (added, first)  # 0.5-1 % of the file a version, in most runs
    assert sum(body[5] == FLAG_DELTA for body in chunks.values()) >= 2
    env.kill()
    fresh_cache(env)
    proxy.set_faults(0.1)
    env.mount()
    assert_holds(env.mnt, {f"state-{n}.json": b"".join(v) for n, v in enumerate(versions)})
    env.umount()
    assert sum(proxy.injected.values()) >= 1, proxy.injected
    assert "Traceback" not in env.log_text()


def test_a_power_cut_of_the_cache_disk_leaves_every_file_readable(
    s3_env: S3VolumeEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bucket keeps what fsync acknowledged; the disk cache and the host's seen
    record sit on a local disk that loses power. Cached chunks are never flushed (they
    can be fetched again), so the cut leaves them empty where a later journal commit
    kept their names: each must be dropped and fetched again, never read as EIO or as
    a file's bytes, and the volume must mount again at once."""
    env = s3_env
    with crashable_ext4(tmp_path / "ext4") as disk:
        try:
            monkeypatch.setenv("XDG_STATE_HOME", str(disk.path / "state"))
            env.cache = disk.path / "cache"
            env.mount()
            rng = random.Random(3)
            committed = {f"f{i}": rng.randbytes(rng.randrange(10, 2 << 20)) for i in range(8)}
            for name, data in committed.items():
                checkpoint(env.mnt, name, data)
            other = disk.path / "other"  # another program's fsync: a journal commit
            other.write_bytes(b"x")
            with open(other, "rb+") as f:
                os.fsync(f.fileno())
            disk.cut()
            env.kill()
            disk.remount()
            cached = [p for p in env.cache.rglob("*") if p.is_file()]
            assert cached, "the cut left no cached chunk at all"
            if all(p.stat().st_size for p in cached):
                # The kernel wrote every cached chunk back before the cut (its flusher
                # does under load, when the machine's dirty pages pile up): empty one
                # as the cut would have, so that the case this test is for is there.
                os.truncate(max(cached, key=lambda p: p.stat().st_mtime), 0)
            result = env.mount(check=False)
            assert result.returncode == 0, f"mount refused after a power cut: {result.stderr}"
            assert_holds(env.mnt, committed)
            env.umount()
        finally:
            env.cleanup()  # before the disk goes


def test_unreachable_store_makes_fsync_wait_then_succeed(
    s3_env: S3VolumeEnv, proxy: FaultProxy
) -> None:
    env = s3_env
    env.mount()
    first = os.urandom(300_000)
    checkpoint(env.mnt, "first.bin", first)
    proxy.close()
    second = os.urandom(700_000)
    outcome: dict[str, object] = {}

    def write_second() -> None:
        try:
            checkpoint(env.mnt, "second.bin", second)
            outcome["ok"] = time.monotonic()
        except OSError as exc:
            outcome["error"] = exc

    writer = threading.Thread(target=write_second)
    writer.start()
    writer.join(4.0)
    assert writer.is_alive(), f"fsync returned while the store was unreachable: {outcome}"
    reopened = time.monotonic()
    proxy.reopen()
    writer.join(90)
    assert not writer.is_alive()
    assert "ok" in outcome, outcome
    assert float(outcome["ok"]) - reopened < 30  # type: ignore[arg-type]
    env.umount()
    fresh_cache(env)
    env.mount()
    assert_holds(env.mnt, {"first.bin": first, "second.bin": second})
    env.umount()


@pytest.mark.parametrize("outage", ["refused", "stalled"])
def test_short_store_timeout_fails_fsync_with_eio_and_keeps_the_data(
    s3_env: S3VolumeEnv, proxy: FaultProxy, outage: str
) -> None:
    """stalled: regression. Each request could wait botocore's 60 s read timeout, so an
    fsync given --store-timeout 2 against a service that stopped answering waited it out
    (or, with a service that answered after 20 s, succeeded after 20 s)."""
    env = s3_env
    env.mount("--store-timeout", "2")
    data = os.urandom(300_000)
    if outage == "refused":
        proxy.close()
    else:
        proxy.delay = 20.0
        proxy.set_faults(1.0, ["delay"])  # every request waits 20 s before it is forwarded
    with open(env.mnt / "kept.bin", "wb") as f:
        f.write(data)
        f.flush()
        started = time.monotonic()
        with pytest.raises(OSError) as info:
            os.fsync(f.fileno())
        assert info.value.errno == errno.EIO
        assert time.monotonic() - started < 12
        if outage == "refused":
            proxy.reopen()
        else:
            proxy.set_faults(0.0)
        os.fsync(f.fileno())  # the data was kept: this commit carries it
    assert "unreachable" in env.log_text()
    env.umount()
    fresh_cache(env)
    env.mount()
    assert_holds(env.mnt, {"kept.bin": data})
    env.umount()


def test_status_says_that_commits_fail_while_the_store_is_unreachable(
    s3_env: S3VolumeEnv, proxy: FaultProxy
) -> None:
    """An operator runs `sealfs status` during an outage. Regression: it showed the last
    commit's time and the bytes pending, exactly as for a mount that had merely been
    idle, and nothing of the commits failing: only the daemon's log said why."""
    env = s3_env
    env.mount("--store-timeout", "2")
    checkpoint(env.mnt, "before.bin", b"b" * 5000)
    proxy.close()
    with open(env.mnt / "during.bin", "wb") as f:
        f.write(b"d" * 5000)
        f.flush()
        with pytest.raises(OSError) as info:
            os.fsync(f.fileno())
        assert info.value.errno == errno.EIO
        failing = env.status()["commit_failure"]
        assert failing is not None and "unreachable" in failing["error"], failing
        table = sealfs("status", str(env.mnt))
        assert table.returncode == 0, table.stderr
        assert "commits failing" in table.stdout and "unreachable" in table.stdout, table.stdout
        # And sync and umount say why they failed, not only "Input/output error".
        for command in ("sync", "umount"):
            failed = sealfs(command, str(env.mnt))
            assert failed.returncode == FAILURE, failed.stderr
            assert "commit failed (Input/output error: " in failed.stderr, failed.stderr
            assert "unreachable" in failed.stderr, failed.stderr
        proxy.reopen()
        os.fsync(f.fileno())
    assert env.status()["commit_failure"] is None
    assert "commits failing" not in sealfs("status", str(env.mnt)).stdout
    env.umount()


def test_status_shows_a_commit_that_waits_for_an_unreachable_store(
    s3_env: S3VolumeEnv, proxy: FaultProxy
) -> None:
    """An operator runs `sealfs status` in the first minutes of an outage. Regression:
    until the first commit gave up, a whole --store-timeout (5 minutes by default),
    status showed an idle mount, while every fsync hung."""
    env = s3_env
    env.mount("--store-timeout", "120")
    proxy.close()
    (env.mnt / "during.bin").write_bytes(b"d" * 5000)
    outcome: list[object] = []

    def fsync() -> None:
        try:
            commit_mount(str(env.mnt))
            outcome.append("committed")
        except OSError as exc:
            outcome.append(exc)

    syncer = threading.Thread(target=fsync)
    syncer.start()
    try:
        deadline = time.monotonic() + 60
        table = ""
        while "commit running" not in table and time.monotonic() < deadline:
            time.sleep(0.2)
            shown = sealfs("status", str(env.mnt))
            assert shown.returncode == 0, shown.stderr
            table = shown.stdout
        assert "commit running" in table and "--store-timeout" in table, table
        status = env.status()
        assert status["commit_running_since_ns"] is not None
        assert status["commit_failure"] is None  # nothing has given up yet
        assert syncer.is_alive() and not outcome
    finally:
        proxy.reopen()  # else the fsync, and the unmount, wait the whole store timeout
        syncer.join(60)
    assert outcome == ["committed"]
    assert env.status()["commit_running_since_ns"] is None
    assert "commit running" not in sealfs("status", str(env.mnt)).stdout
    env.umount()


def test_a_cold_read_during_an_outage_waits_for_one_give_up_per_chunk(
    s3_env: S3VolumeEnv, proxy: FaultProxy
) -> None:
    """A file in no cache, read while the store is unreachable. Regression: the kernel
    asks again for a page whose read-ahead failed, and each fetch of the chunk waited the
    whole store timeout anew, so the read(2) failed after twice --store-timeout (ten
    minutes by default); so did a read that had waited for another's fetch of the same
    chunk. A chunk whose fetch just gave up fails its next fetch at once."""
    env = s3_env
    env.mount("--store-timeout", "3")
    data = os.urandom(6 << 20)
    checkpoint(env.mnt, "cold.bin", data)
    env.umount()
    fresh_cache(env)
    env.mount("--store-timeout", "3")
    proxy.close()
    with pytest.raises(OSError) as info:
        (env.mnt / "cold.bin").read_bytes()
    assert info.value.errno == errno.EIO
    fetched = re.findall(r"store get (c/\S+) failed \(attempt 1,", env.log_text())
    assert fetched, env.log_text()
    again = {name for name in fetched if fetched.count(name) > 1}
    assert not again, f"fetched anew after giving up: {again}"
    proxy.reopen()
    time.sleep(GAVE_UP_FRESH)  # a fetch begun within it fails with the give-up, by design
    assert (env.mnt / "cold.bin").read_bytes() == data
    env.umount()


def test_fsync_behind_a_failing_background_commit_fails_within_the_store_timeout(
    s3_env: S3VolumeEnv, proxy: FaultProxy
) -> None:
    """An fsync that comes while the interval commit is already retrying must not wait
    for that commit to time out and then for a whole store timeout more of its own."""
    env = s3_env
    env.mount("--store-timeout", "8", "--commit-interval", "0.5")
    proxy.close()
    with open(env.mnt / "late.bin", "wb") as f:
        f.write(b"x" * 5000)
        f.flush()
        time.sleep(5)  # the interval commit has started and keeps failing
        started = time.monotonic()
        with pytest.raises(OSError) as info:
            os.fsync(f.fileno())
        waited = time.monotonic() - started
        assert info.value.errno == errno.EIO
        assert waited < 8, f"fsync failed only after {waited:.1f} s (--store-timeout 8)"
        proxy.reopen()
        os.fsync(f.fileno())
    env.umount()
    env.mount()
    assert_holds(env.mnt, {"late.bin": b"x" * 5000})
    env.umount()


def test_a_writer_blocked_behind_a_commit_that_gave_up_fails_with_that_give_up(
    s3_env: S3VolumeEnv, proxy: FaultProxy
) -> None:
    """A writer blocked at the buffer limit while a commit was storing its file's earlier
    bytes. Regression: it waited for that commit to give up on the store, then for an
    early flush of its own to give up again, twice --store-timeout (ten minutes by
    default) inside a write(2) that not even SIGKILL ends. The commit's give-up is the
    writer's: no upload may begin between the first give-up and the writer's error."""
    env = s3_env
    env.mount("--store-timeout", "3", "--commit-interval", "60")
    block = os.urandom(1 << 20)
    written = 0
    fd = os.open(env.mnt / "stream.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for _ in range(4):  # below the flush threshold: only a commit takes these
            written += os.write(fd, block)
        puts = proxy.seen["PUT"]
        proxy.set_faults(1.0, ["503"])  # every request answered 503 until the timeout
        commit_errors: list[int | None] = []

        def commit() -> None:
            try:
                commit_mount(str(env.mnt))
            except OSError as exc:
                commit_errors.append(exc.errno)

        committer = threading.Thread(target=commit)
        committer.start()
        deadline = time.monotonic() + 60
        while proxy.seen["PUT"] == puts and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proxy.seen["PUT"] > puts, "the commit never began to upload"
        with pytest.raises(OSError) as info:
            for _ in range(300):  # far past the 64 MiB buffer limit
                written += os.write(fd, block)
        assert info.value.errno == errno.EIO
        committer.join(60)
        assert commit_errors == [errno.EIO]
        log = env.log_text()
        given_up = log.index("unreachable after")  # the first give-up's line
        refused = log.index("writes past the buffer limit fail with EIO")
        began = log[given_up:refused].count("(attempt 1,")  # each request's first failure
        assert began == 0, f"the writer waited for {began} more uploads to give up"
        proxy.set_faults(0.0)
        os.fsync(fd)  # nothing written was dropped: this commit carries it all
    finally:
        os.close(fd)
    env.umount()
    fresh_cache(env)
    env.mount()
    assert (env.mnt / "stream.bin").read_bytes() == block * (written >> 20)
    env.umount()


def test_sigterm_whose_final_commit_fails_says_what_is_lost(
    s3_env: S3VolumeEnv, proxy: FaultProxy
) -> None:
    """SIGTERM (a shutdown) unmounts after a final commit; if the store is down, that
    commit fails and the data since the last commit is gone: the log must say so (the
    daemon used to exit without a word, and --foreground called it a bug, exit 70)."""
    env = s3_env
    env.mount("--store-timeout", "2", "--commit-interval", "60")
    checkpoint(env.mnt, "kept.bin", b"k" * 1000)
    proxy.close()
    (env.mnt / "unsaved.bin").write_bytes(b"u" * 3000)
    (pid,) = env.daemon_pids()
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while env.daemon_pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not env.daemon_pids()
    env._disarm_watchdog()
    proxy.reopen()
    log = env.log_text()
    assert "without its final commit" in log and "is lost" in log, log[-2000:]
    assert "Traceback" not in log
    env.mount()
    assert_holds(env.mnt, {"kept.bin": b"k" * 1000})
    assert not (env.mnt / "unsaved.bin").exists()
    env.umount()


def test_a_default_cache_inside_the_mountpoint_is_refused_before_it_is_made(
    s3_env: S3VolumeEnv,
) -> None:
    """A service user whose home (so ~/.cache) is the mountpoint. Regression: the check
    covered a --cache-dir only, so the default cache directory was made inside the
    mountpoint, the mount failed with "not empty", and so did every later one."""
    env = s3_env
    cache_home = env.mnt / ".cache"
    result = sealfs(
        "mount", env.url, str(env.mnt), "--s3-endpoint", env.endpoint,
        "--passphrase-file", str(env.passfile), "--log-file", str(env.log),
        env={**os.environ, "XDG_CACHE_HOME": str(cache_home)}, timeout=120,
    )  # fmt: skip
    try:
        assert result.returncode == 2, result.stderr
        assert "inside the mountpoint" in result.stderr and "--cache-dir" in result.stderr
        assert list(env.mnt.iterdir()) == []
    finally:
        if env.is_mounted():
            env.umount(check=False)


def test_a_relative_aws_credentials_file_still_serves_the_daemon(s3_env: S3VolumeEnv) -> None:
    """Regression: AWS_SHARED_CREDENTIALS_FILE=creds (relative, as a shell sets it in
    the directory holding it) unlocked and mounted, but the daemon runs in / and its
    clients found no credentials there: every commit failed."""
    env = s3_env
    (env.root / "creds").write_text(
        "[default]\naws_access_key_id = testing\naws_secret_access_key = testing\n"
    )
    keys = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
    daemon_env = {k: v for k, v in os.environ.items() if k not in keys}
    result = sealfs(
        "mount", env.url, str(env.mnt), "--s3-endpoint", env.endpoint,
        "--passphrase-file", str(env.passfile), "--log-file", str(env.log),
        "--cache-dir", str(env.cache), "--store-timeout", "5",
        env={**daemon_env, "AWS_SHARED_CREDENTIALS_FILE": "creds"}, cwd=env.root, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr + env.log_text()
    try:
        fd = os.open(env.mnt / "f", os.O_WRONLY | os.O_CREAT)
        try:
            os.write(fd, b"committed")
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        env.umount()
    assert "NoCredentials" not in env.log_text() and "credentials" not in env.log_text()


def test_missing_or_partial_credentials_are_a_configuration_error(s3_env: S3VolumeEnv) -> None:
    """No usable credentials exit 2 with the fix, as a missing AWS_PROFILE did: partial
    ones (a key id without its secret) said only "cannot set up the S3 client" with
    exit 1, and none at all exit 1, which reads as the store having failed."""
    env = s3_env
    secrets = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
    partial = {k: v for k, v in os.environ.items() if k != "AWS_SECRET_ACCESS_KEY"}
    none = {k: v for k, v in os.environ.items() if k not in secrets}
    for variables in (partial, none):
        result = sealfs(
            "status", env.url, "--s3-endpoint", env.endpoint, "--passphrase-file",
            str(env.passfile), "--store-timeout", "3", env=variables,
        )  # fmt: skip
        line = one_line(result, 2)
        assert "no usable AWS credentials" in line and "AWS_SECRET_ACCESS_KEY" in line, line


def test_hot_reads_send_no_request_and_status_counts_requests(s3_env: S3VolumeEnv) -> None:
    env = s3_env
    env.mount()
    data = os.urandom(3 << 20)
    checkpoint(env.mnt, "model.bin", data)
    before = env.status()
    checkpoint(env.mnt, "ckpt.bin", os.urandom(1 << 20))  # a 1 MiB checkpoint commit
    after = env.status()
    old, new = before["store_requests"], after["store_requests"]
    spent = {m: new[m] - old.get(m, 0) for m in new if new[m] != old.get(m)}
    assert spent.keys() <= {"put", "put_if_absent"}, spent  # no read, list or stat
    assert spent["put"] == after["chunks"] - before["chunks"] >= 1  # one PUT per new chunk
    assert spent["put_if_absent"] == 2  # a segment for the file's fsync, one for the rename's
    table = sealfs("status", str(env.mnt))
    assert "store requests" in table.stdout, table.stdout + table.stderr
    env.umount()
    env.mount()  # same disk cache: every chunk was written through to it
    before = env.status()["store_requests"]
    for _ in range(2):
        assert (env.mnt / "model.bin").read_bytes() == data
    assert env.status()["store_requests"] == before  # not one request
    env.umount()
    offline = sealfs(
        "status", env.url, "--s3-endpoint", env.endpoint, "--passphrase-file", str(env.passfile),
        "--json",
    )  # fmt: skip
    assert offline.returncode == 0, offline.stderr
    status = json.loads(offline.stdout)
    assert status["files"] == 2
    assert status["store"] == f"s3 store {env.url.removesuffix('/vol')}/vol at {env.endpoint}"
    assert status["store_requests"]["get"] >= 2  # the header and the log


CANARIES = [
    "CANARY-NAME-7f3a", "CANARY-DIR-91be", "CANARY-TEXT-c0de", "CANARY-LINK-d00d",
    "CANARY-XNAME-beef", "CANARY-XVAL-f00d", PASSPHRASE,
]  # fmt: skip
OBJECT_KEY = re.compile(r"^vol/(c/([0-9a-f]{2})/\2[0-9a-f]{62}|l/\d{16}|s/\d{16}|sealfs\.vol)$")


def encodings(canary: str) -> list[bytes]:
    forms = {canary, canary.lower(), canary.upper()}
    return [f.encode(e) for f in forms for e in ("utf-8", "utf-16-le", "utf-16-be")]


def test_no_canary_in_any_key_or_body_of_the_bucket(s3_env: S3VolumeEnv, bucket: str) -> None:
    env = s3_env
    result = sealfs(
        "--verbose", "mount", env.url, str(env.mnt), "--s3-endpoint", env.endpoint,
        "--passphrase-file", str(env.passfile), "--log-file", str(env.log),
        "--cache-dir", str(env.cache),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    env._arm_watchdog()
    name, dirname, text, link, xname, xvalue = CANARIES[:6]
    (env.mnt / dirname).mkdir()
    (env.mnt / dirname / f"{name}.txt").write_bytes((text + " line\n").encode() * 50_000)
    (env.mnt / "small").write_text(text)
    os.symlink(f"/target/{link}", env.mnt / "link")
    os.setxattr(env.mnt / "small", f"user.{xname}", xvalue.encode())
    commit_mount(str(env.mnt))
    env.umount()
    objects = all_objects(bucket)
    assert objects, "nothing reached the bucket"
    bad_keys = [k for k in objects if not OBJECT_KEY.match(k)]
    assert not bad_keys, bad_keys
    for canary in CANARIES:
        for form in encodings(canary):
            assert not any(form in key.encode() for key in objects), canary
            assert not any(form in body for body in objects.values()), canary
            for path in env.cache.rglob("*"):
                assert not path.is_file() or form not in path.read_bytes(), (canary, path)
            assert form not in env.log.read_bytes(), canary


def init_through(proxy: FaultProxy, bucket: str, tmp_path: Path) -> Any:
    """`sealfs init` of s3://BUCKET/vol through the proxy, its recovery key to a file."""
    passfile = tmp_path / "pass"
    write_secret(passfile, PASSPHRASE + "\n")
    return sealfs(
        "init", f"s3://{bucket}/vol", "--s3-endpoint", proxy.url, "--passphrase-file",
        str(passfile), "--recovery-key-file", str(tmp_path / "recovery"), *CHEAP_KDF,
    )  # fmt: skip


@pytest.mark.parametrize("via_env", [False, True])
@pytest.mark.parametrize("endpoint", ["http://::1:9000", "http://[::1:9000"])
def test_init_with_an_ipv6_endpoint_without_brackets_is_a_one_line_config_error(
    tmp_path: Path, via_env: bool, endpoint: str
) -> None:
    # "http://[::1:9000" ended "unexpected ValueError ... a bug in sealfs" (exit 70);
    # "http://::1:9000" named no bracket.
    passfile = tmp_path / "pass"
    write_secret(passfile, PASSPHRASE + "\n")
    option = [] if via_env else ["--s3-endpoint", endpoint]
    env = {**os.environ, "AWS_ENDPOINT_URL": endpoint} if via_env else None
    result = sealfs(
        "init", "s3://bucket/vol", *option, "--passphrase-file", str(passfile),
        "--recovery-key-file", str(tmp_path / "recovery"), *CHEAP_KDF, env=env,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert "http://[ADDRESS]:PORT" in result.stderr
    assert ("AWS_ENDPOINT_URL" if via_env else "--s3-endpoint") in result.stderr


def test_init_and_status_through_a_bracketed_ipv6_endpoint(
    tmp_path: Path, bucket: str, moto_v6: str
) -> None:
    env = S3VolumeEnv(tmp_path, url=f"s3://{bucket}/vol", endpoint=moto_v6)
    env.init()
    result = sealfs(
        "status", env.url, "--s3-endpoint", moto_v6, "--passphrase-file", str(env.passfile),
        "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["store"] == f"s3 store {env.url} at {moto_v6}"


def test_init_refuses_a_service_that_ignores_if_none_match(
    tmp_path: Path, bucket: str, proxy: FaultProxy
) -> None:
    proxy.strip_if_none_match = True
    result = init_through(proxy, bucket, tmp_path)
    assert result.returncode == 2, result.stderr
    assert "ignores If-None-Match conditional writes" in result.stderr
    assert result.stderr.count("\n") == 1
    assert all_objects(bucket) == {}
    assert not (tmp_path / "recovery").exists()


def test_init_against_a_service_refusing_checksum_headers_names_the_setting(
    tmp_path: Path, bucket: str, proxy: FaultProxy
) -> None:
    """Since botocore 1.36 every upload carries a CRC32 header, which some S3-compatible
    services refuse (400 InvalidArgument); the error named neither cause nor fix."""
    proxy.refuse_checksums = True
    result = init_through(proxy, bucket, tmp_path)
    assert result.returncode != 0
    assert "refuses the checksum headers" in result.stderr, result.stderr
    assert "AWS_REQUEST_CHECKSUM_CALCULATION=when_required" in result.stderr
    assert "Unsupported header" in result.stderr  # the service's own words
    assert result.stderr.count("\n") == 1, result.stderr
    assert all_objects(bucket) == {}
    assert not (tmp_path / "recovery").exists()


def test_a_volume_works_on_a_service_refusing_checksum_headers_with_the_setting(
    tmp_path: Path, bucket: str, proxy: FaultProxy
) -> None:
    """The setting the error names is boto3's own: sealfs must not override it."""
    proxy.refuse_checksums = True
    env = S3VolumeEnv(
        tmp_path,
        url=f"s3://{bucket}/vol",
        endpoint=proxy.url,
        extra_env={
            "AWS_REQUEST_CHECKSUM_CALCULATION": "when_required",
            "AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required",
        },
    )
    try:
        env.init()
        env.mount()
        files = {"a.json": b'{"step": 1}' * 1000, "b.bin": os.urandom(3 << 20)}
        for name, data in files.items():
            checkpoint(env.mnt, name, data)
        env.umount()
        fresh_cache(env)
        env.mount()
        assert_holds(env.mnt, files)
        env.umount()
    finally:
        leftovers = env.cleanup()
    assert not leftovers, "the test left a mount or a daemon behind"
    assert proxy.seen["PUT"] > 0


def test_rekey_of_a_mounted_s3_volume_through_faults(
    s3_env: S3VolumeEnv, proxy: FaultProxy, bucket: str
) -> None:
    """Every object in the bucket and in the daemon's cache ends under the new epoch."""
    env = s3_env
    env.mount()
    rng = random.Random(5)
    files = {f"f{k}.bin": rng.randbytes(rng.choice([3_000, 300_000, 1_500_000])) for k in range(12)}
    for name, data in files.items():
        checkpoint(env.mnt, name, data)
    proxy.set_faults(0.1)
    result = sealfs(
        "rekey", env.url, "--s3-endpoint", env.endpoint, "--passphrase-file", str(env.passfile),
        "--drop-slot", "1", timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr + env.log_text()
    assert_holds(env.mnt, files)
    env.umount()
    proxy.set_faults(0.0)
    epochs = {
        key: int.from_bytes(body[6:8], "big")
        for key, body in all_objects(bucket).items()
        if not key.endswith("sealfs.vol")
    }
    assert epochs and set(epochs.values()) == {1}, epochs
    cached = [p for p in env.cache.rglob("*") if p.is_file() and not p.name.startswith(".")]
    assert cached and {int.from_bytes(p.read_bytes()[6:8], "big") for p in cached} == {1}
    fresh_cache(env)
    env.mount()
    assert_holds(env.mnt, files)
    env.umount()
    assert sum(proxy.injected.values()) > 0, proxy.injected


def test_rekey_of_a_mounted_s3_volume_whose_endpoint_is_spelled_otherwise(
    s3_env: S3VolumeEnv,
) -> None:
    """The daemon started with --s3-endpoint URL (a service unit), the rekey run with
    AWS_ENDPOINT_URL=URL/ from a shell. Regression: the two descriptions of the same
    store differed by that slash, so the rekey took the live mount for the writer of
    another copy and refused (exit 5, "this store is a copy"), where it is the mount's."""
    env = s3_env
    env.mount()
    try:
        checkpoint(env.mnt, "f.bin", b"f" * 5000)
        result = sealfs(
            "rekey", env.url, "--passphrase-file", str(env.passfile), "--drop-slot", "1",
            env={**os.environ, "AWS_ENDPOINT_URL": env.endpoint + "/"}, timeout=300,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr + env.log_text()
        assert env.status()["key_epoch"] == 1
        assert_holds(env.mnt, {"f.bin": b"f" * 5000})
    finally:
        env.umount()


def test_a_read_only_mount_follows_the_writer_through_a_shared_cache(s3_env: S3VolumeEnv) -> None:
    """A reader on the writer's host shares its default cache directory: chunks the
    writer cached and chunks the reader fetches must both read back as written."""
    env = s3_env
    env.mount()
    ro = env.root / "ro"
    ro.mkdir()
    first = os.urandom(3 << 20)
    (env.mnt / "state.bin").write_bytes(first)
    assert sealfs("sync", str(env.mnt)).returncode == 0
    mounted = sealfs(
        "mount", env.url, str(ro), "--s3-endpoint", env.endpoint, "--passphrase-file",
        str(env.passfile), "--log-file", str(env.root / "ro.log"), "--cache-dir", str(env.cache),
        "--read-only", "--commit-interval", "0.2", timeout=120, env=env._env(),
    )  # fmt: skip
    assert mounted.returncode == 0, mounted.stderr
    try:
        assert (ro / "state.bin").read_bytes() == first
        second = bytearray(first)
        second[1 << 20 : (1 << 20) + 4096] = os.urandom(4096)
        with (env.mnt / "state.bin").open("r+b") as f:
            f.seek(1 << 20)
            f.write(second[1 << 20 : (1 << 20) + 4096])
            f.flush()
            os.fsync(f.fileno())
        (env.mnt / "notes.txt").write_text("step 2")
        assert sealfs("sync", str(env.mnt)).returncode == 0
        wait_until((ro / "notes.txt").exists, 15)
        if (ro / "state.bin").read_bytes() != second:
            pytest.fail("the reader's state.bin differs from what the writer committed")
        assert (ro / "notes.txt").read_text() == "step 2"
    finally:
        done = sealfs("umount", str(ro), timeout=120)
        if any(m == str(ro) for m, _ in mounted_sealfs()):
            force_unmount(str(ro))
    assert done.returncode == 0, done.stderr
    env.umount()


def test_a_bucket_that_keeps_versions_is_warned_about(
    tmp_path: Path, bucket: str, moto: str
) -> None:
    """Regression: a versioned bucket was taken without a word, where every header a key
    change replaced (a removed keyslot, an old passphrase's) and every object a rekey
    re-sealed stays readable as a noncurrent version, under the old key."""
    client().put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    env = S3VolumeEnv(tmp_path / "versioned", url=f"s3://{bucket}/vol", endpoint=moto)
    made = env.init()
    assert f"bucket {bucket} keeps object versions" in made.stderr, made.stderr
    assert "expire noncurrent versions" in made.stderr
    assert made.stderr.count("keeps object versions") == 1, made.stderr  # asked once
    mounted = env.mount()
    try:
        assert f"bucket {bucket} keeps object versions" in mounted.stderr, mounted.stderr
    finally:
        env.umount()
    plain = S3VolumeEnv(tmp_path / "plain", url=f"s3://{new_bucket()}/vol", endpoint=moto)
    assert "versions" not in plain.init().stderr
