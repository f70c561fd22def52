"""A read-only mount beside the writer's, as the programs reading it see it."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import time
from functools import partial

import pytest

from sealfs.store.local import DIRECT_FROM
from tests.mounts import (
    STATUS_XATTR,
    VolumeEnv,
    python_as_nobody,
    reached,
    read_only_mount,
    sealfs,
    wait_until,
)
from tests.store.conftest import cached_bytes, evict_from_page_cache

pytestmark = pytest.mark.fuse


def test_a_read_only_mount_shows_each_checkpoint_the_writer_commits(
    mounted_env: VolumeEnv,
) -> None:
    """design.md: read-only mounts follow new generations. Before, one showed the
    volume as it was when mounted, until remounted."""
    env = mounted_env
    ckpt = env.mnt / "ckpt.json"
    ckpt.write_text('{"step": 1}')
    assert sealfs("sync", str(env.mnt)).returncode == 0
    with read_only_mount(env, 0.2) as ro:
        assert (ro / "ckpt.json").read_text() == '{"step": 1}'
        held = (ro / "ckpt.json").open()
        # The agent's checkpoint: write a new file, fsync it, rename it over the old one.
        fresh = env.mnt / "ckpt.json.tmp"
        with fresh.open("w") as f:
            f.write('{"step": 2}')
            f.flush()
            os.fsync(f.fileno())
        fresh.rename(ckpt)
        (env.mnt / "runs").mkdir()
        assert sealfs("sync", str(env.mnt)).returncode == 0

        def caught_up() -> bool:
            return (ro / "ckpt.json").read_text() == '{"step": 2}' and (ro / "runs").is_dir()

        wait_until(caught_up, 15)
        assert held.read() == '{"step": 1}'  # the version replaced, open here, stays readable
        held.close()
        assert sorted(os.listdir(ro)) == ["ckpt.json", "runs"]
        followed = json.loads(os.getxattr(ro, STATUS_XATTR))
        assert followed["generation"] == env.status()["generation"]
        assert followed["read_only"] and followed["follow_stopped"] is None
    env.umount()


def test_a_reader_polling_a_checkpoint_the_writer_keeps_replacing_sees_whole_versions(
    mounted_env: VolumeEnv,
) -> None:
    """The agent pattern: the writer replaces ckpt.json (write, fsync, rename) again and
    again; a program on the read-only mount opens and reads it in a loop. Every read
    must be one whole version, newer or equal to the last, and no open may fail: the
    kernel's cached name may still lead to the version the writer just deleted."""
    env = mounted_env
    ckpt = env.mnt / "ckpt.json"
    ckpt.write_text(json.dumps({"step": 0, "pad": "x" * 5000}))
    assert sealfs("sync", str(env.mnt)).returncode == 0
    with read_only_mount(env, 0.05) as ro:
        seen = [0]
        failures: list[str] = []
        last_written = 0
        for step in range(1, 41):
            fresh = env.mnt / "ckpt.json.tmp"
            with fresh.open("w") as f:
                f.write(json.dumps({"step": step, "pad": "x" * 5000}))
                f.flush()
                os.fsync(f.fileno())
            fresh.rename(ckpt)
            last_written = step
            deadline = time.monotonic() + 0.1
            while time.monotonic() < deadline:
                try:
                    doc = json.loads((ro / "ckpt.json").read_text())
                except (OSError, ValueError) as exc:
                    failures.append(f"after step {step}: {exc!r}")
                    continue
                if doc["step"] < seen[-1]:
                    failures.append(f"step {doc['step']} read after step {seen[-1]}")
                seen.append(doc["step"])
        assert not failures, failures[:5]
        wait_until(lambda: json.loads((ro / "ckpt.json").read_text())["step"] == last_written, 15)
        assert len(set(seen)) > 5, "the reader hardly ever saw a new version"
    env.umount()


def test_the_writer_reads_chunk_files_past_the_page_cache_and_a_follower_through_it(
    mounted_env: VolumeEnv,
) -> None:
    """A writable mount keeps the file's plaintext in the kernel's cache across opens,
    so a second copy of the chunk files there only costs (filling it took half of a
    cold read's CPU). A read-only mount drops its cache at every open: the chunk
    files' pages are the only cache its re-reads find beyond the daemon's."""
    env = mounted_env
    data = os.urandom(3 << 20)
    (env.mnt / "big").write_bytes(data)
    env.umount()  # the daemon keeps what it wrote: a new one must read the store
    chunks = [p for p in (env.store / "c").rglob("*") if p.stat().st_size >= DIRECT_FROM]
    assert chunks, "no large chunk stored"
    for path in chunks:
        evict_from_page_cache(path)
    env.mount()
    assert (env.mnt / "big").read_bytes() == data
    assert sum(cached_bytes(p) for p in chunks) == 0
    with read_only_mount(env, 0.2) as ro:
        assert (ro / "big").read_bytes() == data
        assert sum(cached_bytes(p) for p in chunks) >= len(data) // 2


def test_a_file_the_writer_grew_shows_its_new_size_once_replayed(mounted_env: VolumeEnv) -> None:
    """The kernel keeps a read-only mount's attributes for a second: without being told,
    a reader that had just looked at a log the writer appends to saw its old size, and
    read it cut there, for up to a second after the commit was replayed."""
    env = mounted_env
    log = env.mnt / "log.jsonl"
    log.write_text('{"line": 1}\n')
    assert sealfs("sync", str(env.mnt)).returncode == 0
    with read_only_mount(env, 0.02) as ro:
        wait_until(lambda: (ro / "log.jsonl").stat().st_size > 0, 15)
        misses = 0
        for line in range(2, 12):
            old = (ro / "log.jsonl").stat().st_size  # the kernel keeps this for a second
            with log.open("a") as f:
                f.write(json.dumps({"line": line}) + "\n")
                f.flush()
                os.fsync(f.fileno())
            generation = env.status()["generation"]
            started = time.monotonic()
            wait_until(partial(reached, ro, generation), 15)
            if time.monotonic() - started > 0.5:
                continue  # too slow to tell a told kernel from an expired second
            if (ro / "log.jsonl").stat().st_size == old:
                misses += 1
            assert (ro / "log.jsonl").read_text() == log.read_text()
        assert misses == 0, f"{misses} of 10 appends showed the old size after replay"
    env.umount()


def test_a_descriptor_open_on_the_reader_reads_what_the_writer_changed_in_place(
    mounted_env: VolumeEnv,
) -> None:
    """README: files the writer changed in place read as changed, even through a
    descriptor opened before the change."""
    env = mounted_env
    data = env.mnt / "data.bin"
    data.write_bytes(b"A" * 8192)
    assert sealfs("sync", str(env.mnt)).returncode == 0
    with read_only_mount(env, 0.02) as ro:
        fd = os.open(ro / "data.bin", os.O_RDONLY)
        try:
            assert os.pread(fd, 8192, 0) == b"A" * 8192  # now in the reader's page cache
            with data.open("r+b") as f:
                f.write(b"B" * 8192)
                f.flush()
                os.fsync(f.fileno())
            wait_until(partial(reached, ro, env.status()["generation"]), 15)
            assert os.pread(fd, 8192, 0) == b"B" * 8192
        finally:
            os.close(fd)
    env.umount()


def test_a_mapping_on_the_reader_shows_what_the_writer_changed_in_place(
    mounted_env: VolumeEnv,
) -> None:
    """Regression: pread through a descriptor opened before the change read the new
    bytes, but a mapping of it kept the old ones for good (numpy.memmap, LMDB, SQLite
    with mmap): the kernel drops a changed file's pages at its next read(2), and an
    access to a mapped page is none."""
    env = mounted_env
    data = env.mnt / "mapped.bin"
    data.write_bytes(b"C" * 8192)
    assert sealfs("sync", str(env.mnt)).returncode == 0
    with (
        read_only_mount(env, 0.02) as ro,
        open(ro / "mapped.bin", "rb") as f,
        mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m,
    ):
        assert m[:8192] == b"C" * 8192
        with data.open("r+b") as w:
            w.write(b"D" * 8192)
            w.flush()
            os.fsync(w.fileno())
        wait_until(partial(reached, ro, env.status()["generation"]), 15)
        wait_until(lambda: m[:8192] == b"D" * 8192, 5)
    env.umount()


def test_a_read_only_mount_follows_the_writer_through_a_rekey(mounted_env: VolumeEnv) -> None:
    """It unlocks the new header by itself, with its passphrase file read again. Before,
    it stopped following at the rekey, and every read of what the rekey re-sealed failed
    with EIO until it was remounted."""
    env = mounted_env
    before = os.urandom(300_000)
    (env.mnt / "before").write_bytes(before)
    assert sealfs("sync", str(env.mnt)).returncode == 0
    with read_only_mount(env, 0.2) as ro:
        assert (ro / "before").stat().st_size == len(before)  # not read: nothing cached
        rekey = sealfs(
            "rekey", str(env.store), "--passphrase-file", str(env.passfile), "--drop-slot", "1",
            timeout=180,
        )  # fmt: skip
        assert rekey.returncode == 0, rekey.stderr
        assert f"Read-only mount {ro}: follows under the new key." in rekey.stdout
        (env.mnt / "after").write_text("sealed under the new key")
        assert sealfs("sync", str(env.mnt)).returncode == 0
        wait_until(partial(reached, ro, env.status()["generation"]), 15)
        assert (ro / "after").read_text() == "sealed under the new key"
        if (ro / "before").read_bytes() != before:
            pytest.fail("a file re-sealed by the rekey reads other bytes on the follower")
        followed = json.loads(os.getxattr(ro, STATUS_XATTR))
        assert followed["follow_stopped"] is None and followed["key_epoch"] == 1
    assert "ERROR" not in (env.root / "ro.log").read_text()
    env.umount()


def test_a_rekey_names_the_read_only_mount_that_cannot_take_the_new_key(
    mounted_env: VolumeEnv,
) -> None:
    """It was unlocked with the recovery key, whose slot the rekey drops: `sealfs rekey`
    says to remount it, at once (the mount itself would have met the rekey only at the
    writer's next commit, or at its first read of a re-sealed file, and stopped then)."""
    env = mounted_env
    with read_only_mount(env, 3600, "--recovery-key-file", str(env.recovery_file)) as ro:
        rekey = sealfs(
            "rekey", str(env.store), "--passphrase-file", str(env.passfile), "--drop-slot", "1",
            timeout=180,
        )  # fmt: skip
        assert rekey.returncode == 0, rekey.stderr
        said = next(line for line in rekey.stdout.splitlines() if line.startswith("Read-only"))
        assert said.startswith(f"Read-only mount {ro}: not following (stays at generation ")
        # Not "wrong recovery key", which sent users to check a key that was right.
        gone = "the volume has no recovery keyslot (its keyslots: 0 passphrase)"
        assert "could not unlock its new key" in said and gone in said
        assert said.endswith("): remount it.")
        stopped = json.loads(os.getxattr(ro, STATUS_XATTR))["follow_stopped"]
        assert stopped is not None and gone in stopped
    env.umount()


def test_only_the_owner_may_have_a_read_only_mount_unlock_a_new_key(
    mounted_env: VolumeEnv,
) -> None:
    """Each such request may cost an Argon2id run: other users get EPERM."""
    env = mounted_env
    with read_only_mount(env, 3600, "--allow-other") as ro:
        script = f"import os; os.getxattr({str(ro)!r}, 'user.sealfs.take-new-key')"
        result = python_as_nobody(script, ro.parent)
        assert "PermissionError: [Errno 1] Operation not permitted" in result.stderr, result.stderr
        assert json.loads(os.getxattr(ro, "user.sealfs.take-new-key"))["key_epoch"] == 0  # root
    env.umount()


# Replaces ckpt (write a temporary file, fsync, rename it over) and flips `latest` (a new
# symlink renamed over it), fsyncing the directory, for SECONDS, as fast as it can.
REPLACER = r"""
import os, sys, time
d, seconds = sys.argv[1], float(sys.argv[2])
end, i = time.monotonic() + seconds, 0
while time.monotonic() < end:
    i += 1
    with open(f"{d}/ckpt.tmp", "w") as f:
        f.write(f"step {i}\n" * 100)
        f.flush()
        os.fsync(f.fileno())
    os.rename(f"{d}/ckpt.tmp", f"{d}/ckpt")
    os.symlink(f"target-{i}", f"{d}/l.tmp")
    os.rename(f"{d}/l.tmp", f"{d}/latest")
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(fd)
    os.close(fd)
"""


def test_a_checkpoint_replaced_many_times_a_second_reads_by_name_without_estale(
    mounted_env: VolumeEnv,
) -> None:
    """An agent reading the newest checkpoint by name on a follower while the writer
    replaced it as fast as it could: readlink and open met ESTALE (98 in 7 s). The
    kernel looks a name up again once after ESTALE, and the inode it found then was
    often replaced by the next replayed commit before its request came."""
    env = mounted_env
    d = env.mnt / "a"
    d.mkdir()
    (d / "ckpt").write_text("step 0\n")
    os.symlink("target-0", d / "latest")
    assert sealfs("sync", str(env.mnt)).returncode == 0
    with read_only_mount(env, 0.2) as ro:
        writer = subprocess.Popen([sys.executable, "-c", REPLACER, str(d), "5"])
        errors: dict[str, int] = {}
        end = time.monotonic() + 4
        while time.monotonic() < end:
            for what, call in (
                ("readlink", partial(os.readlink, ro / "a" / "latest")),
                ("open", (ro / "a" / "ckpt").read_bytes),
            ):
                try:
                    call()
                except OSError as exc:
                    errors[f"{what}: {exc.strerror}"] = errors.get(f"{what}: {exc.strerror}", 0) + 1
        assert writer.wait(timeout=30) == 0
        assert not errors, errors
        # Listings taken while the writer created segments left some out: it stopped.
        wait_until(partial(reached, ro, env.status()["generation"]), 15)
        assert json.loads(os.getxattr(ro, STATUS_XATTR))["follow_stopped"] is None
    env.umount()


# Rewrites f in place for SECONDS, alternating 80 KiB of "A" and 4 KiB of "B" (ftruncate
# to 0, write, fsync), as an agent compacting its log in place does.
SHRINKER = r"""
import os, sys, time
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT, 0o600)
end, n = time.monotonic() + float(sys.argv[2]), 0
while time.monotonic() < end:
    n += 1
    os.ftruncate(fd, 0)
    os.pwrite(fd, b"A" * 81920 if n % 2 else b"B" * 4096, 0)
    os.fsync(fd)
    time.sleep(0.02)
"""


def test_a_file_the_writer_shrinks_never_reads_zeros_on_a_follower(
    mounted_env: VolumeEnv,
) -> None:
    """A read the kernel sent for the old size, answered after the replay of a shrink,
    came back short; the kernel zero-filled the rest and kept the old size, so read(2)
    gave the new bytes and then zeros up to the old size (4 of 9 s of reads): bytes no
    generation holds."""
    env = mounted_env
    with read_only_mount(env, 0.2) as ro:
        writer = subprocess.Popen([sys.executable, "-c", SHRINKER, str(env.mnt / "f"), "7"])
        wait_until((ro / "f").exists, 15)
        zeros = reads = 0
        end = time.monotonic() + 6
        while time.monotonic() < end:
            reads += 1
            zeros += b"\0" in (ro / "f").read_bytes()
        assert writer.wait(timeout=30) == 0
        assert zeros == 0, f"{zeros} of {reads} reads held zero bytes"
    env.umount()
