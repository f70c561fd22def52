"""CachingStore: request economy, what it caches, eviction, and surviving cache failures."""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from pathlib import Path

import pytest

from sealfs.errors import ConfigError, ObjectNotFoundError
from sealfs.store.cache import CachingStore, get_stored
from sealfs.store.memory import MemoryStore
from tests.store.conftest import assert_owner_only_under


def cached_files(cache_dir: Path) -> dict[str, int]:
    return {
        p.relative_to(cache_dir).as_posix(): p.stat().st_size
        for p in cache_dir.rglob("*")
        if p.is_file()
    }


def disk_usage(directory: Path) -> int:
    """What the files under directory take on disk (as du counts them)."""
    return sum(p.stat().st_blocks * 512 for p in directory.rglob("*") if p.is_file())


def make(tmp_path: Path, max_bytes: int = 1 << 20) -> tuple[CachingStore, MemoryStore]:
    memory = MemoryStore()
    return CachingStore(memory, tmp_path / "cache", max_bytes), memory


def test_second_get_sends_no_request(tmp_path: Path) -> None:
    store, memory = make(tmp_path)
    memory.put("c/ab/x", b"sealed chunk")
    assert store.get("c/ab/x") == b"sealed chunk"
    assert store.get("c/ab/x") == b"sealed chunk"
    assert memory.counts["get"] == 1
    assert cached_files(store.cache_dir) == {"c/ab/x": 12}
    assert store.cache_bytes() == disk_usage(store.cache_dir)  # a whole block


def test_put_writes_through(tmp_path: Path) -> None:
    store, memory = make(tmp_path)
    store.put_if_absent("c/ab/x", b"chunk one")
    store.put("c/cd/y", b"chunk two")
    assert store.get("c/ab/x") == b"chunk one"
    assert store.get("c/cd/y") == b"chunk two"
    assert memory.counts["get"] == 0
    assert memory.get("c/ab/x") == b"chunk one"


def test_get_stored_reads_the_store_past_a_newer_cached_copy(tmp_path: Path) -> None:
    """A store restored from a backup holds an older copy than the cache: whoever acts
    on the store's copy (a rekey) gets that one, and the cache is left as it was."""
    store, memory = make(tmp_path)
    store.put("c/ab/x", b"re-sealed")
    memory.put("c/ab/x", b"restored")
    assert get_stored(store, "c/ab/x") == b"restored"
    assert store.get("c/ab/x") == b"re-sealed"
    assert get_stored(memory, "c/ab/x") == b"restored"  # no cache in front: the store


def test_header_segments_and_snapshots_are_not_cached(tmp_path: Path) -> None:
    store, memory = make(tmp_path)
    for name in ("sealfs.vol", "l/00000001", "s/00000001"):
        store.put(name, b"metadata")
        store.get(name)
        store.get(name)
    store.put_if_absent("l/00000002", b"segment")
    store.put_if_match("sealfs.vol", b"v2", memory.stat("sealfs.vol").etag)
    assert memory.counts["get"] == 6
    assert cached_files(store.cache_dir) == {}
    assert store.cache_bytes() == 0


def test_eviction_keeps_total_within_max_bytes_lru_first(tmp_path: Path) -> None:
    block = 4096  # each object fills a block
    store, memory = make(tmp_path, max_bytes=3 * block + 1000)
    for i in range(3):
        store.put(f"c/00/{i}", bytes(block))
    store.get("c/00/0")  # now the most recently used
    store.put("c/00/3", bytes(block))  # evicts c/00/1, the least recently used
    assert store.cache_bytes() == 3 * block
    assert set(cached_files(store.cache_dir)) == {"c/00/0", "c/00/2", "c/00/3"}
    for i in range(4, 20):
        store.put(f"c/00/{i}", bytes(block))
        assert store.cache_bytes() <= 3 * block + 1000
        assert disk_usage(store.cache_dir) <= 3 * block + 1000
    store.put("c/00/huge", bytes(5 * block))  # larger than the cache: not cached at all
    assert "c/00/huge" not in cached_files(store.cache_dir)
    assert store.get("c/00/1") == bytes(block)  # evicted, so fetched again
    assert memory.counts["get"] == 1


def test_small_chunks_keep_the_directory_within_max_bytes_on_disk(tmp_path: Path) -> None:
    """Regression: sizes were counted by length, but each file takes whole blocks. In an
    agent soak the chunks of small tool outputs (a few KiB each) made a cache under
    --cache-size 64M take 75 MB of disk; chunks of 100 bytes would take 40 times it."""
    store, memory = make(tmp_path, max_bytes=64 << 10)
    for i in range(200):
        store.put(f"c/00/{i}", bytes(100))
    assert 0 < disk_usage(store.cache_dir) <= 64 << 10
    assert store.cache_bytes() <= 64 << 10
    reopened = CachingStore(memory, tmp_path / "cache", max_bytes=32 << 10)
    assert 0 < disk_usage(reopened.cache_dir) <= 32 << 10


def test_index_is_rebuilt_on_start_in_mtime_order(tmp_path: Path) -> None:
    store, memory = make(tmp_path)
    block = 4096  # each object fills a block
    for i in range(4):
        store.put(f"c/00/{i}", bytes(block))
        stamp = 1_700_000_000 + (3 - i) * 10  # c/00/3 is the oldest
        os.utime(tmp_path / "cache" / "c" / "00" / str(i), (stamp, stamp))
    (tmp_path / "cache" / "c" / "00" / ".tmp-leftover").write_bytes(b"half")
    reopened = CachingStore(memory, tmp_path / "cache", max_bytes=2 * block + 1000)
    assert reopened.cache_bytes() == 2 * block
    kept = {n for n in cached_files(reopened.cache_dir) if ".tmp-" not in n}
    assert kept == {"c/00/0", "c/00/1"}
    assert reopened.get("c/00/0") == bytes(block)
    assert memory.counts["get"] == 0


def test_rebuild_removes_temp_files_dated_far_from_now_either_way(tmp_path: Path) -> None:
    """Regression: a temp file a crash left while the clock ran ahead (dated in the
    future once the clock was set back) stayed in the cache until the clock caught up."""
    store, memory = make(tmp_path)
    store.put("c/00/x", bytes(10))
    directory = tmp_path / "cache" / "c" / "00"
    now = time.time()
    stamps = {"ahead": now + 86400, "behind": now - 7200, "near": now + 600, "recent": now - 600}
    for label, stamp in stamps.items():
        path = directory / f".tmp-{label}"
        path.write_bytes(b"half")
        os.utime(path, (stamp, stamp))
    reopened = CachingStore(memory, tmp_path / "cache", max_bytes=1 << 20)
    assert sorted(p.name for p in directory.glob(".tmp-*")) == [".tmp-near", ".tmp-recent"]
    assert reopened.get("c/00/x") == bytes(10)
    assert memory.counts["get"] == 0


def test_delete_and_discard_drop_the_cached_copy(tmp_path: Path) -> None:
    store, memory = make(tmp_path)
    store.put("c/ab/x", b"x")
    store.put("c/ab/y", b"y")
    store.delete("c/ab/x")
    with pytest.raises(ObjectNotFoundError):
        store.get("c/ab/x")
    store.discard("c/ab/y")
    assert store.get("c/ab/y") == b"y"
    assert memory.counts["get"] == 2
    assert store.cache_bytes() == disk_usage(store.cache_dir)  # c/ab/y's block


def test_a_fetch_that_a_replace_overlaps_does_not_fill_the_cache(tmp_path: Path) -> None:
    """Regression: a miss fetched the old bytes, a replace (a rekey re-sealing the chunk)
    cached the new ones, and the miss then cached the old bytes over them."""
    fetched, replaced = threading.Event(), threading.Event()

    class Gated(MemoryStore):
        def get(self, name: str, max_size: int | None = None) -> bytes:
            data = super().get(name, max_size)
            fetched.set()
            assert replaced.wait(10)
            return data

    inner = Gated()
    store = CachingStore(inner, tmp_path / "cache", 1 << 20)
    inner.put("c/ab/x", b"old sealed bytes")
    reader = threading.Thread(target=store.get, args=("c/ab/x",))
    reader.start()
    assert fetched.wait(10)
    store.put("c/ab/x", b"NEW sealed bytes")
    replaced.set()
    reader.join(10)
    assert not reader.is_alive()
    assert (store.cache_dir / "c/ab/x").read_bytes() == b"NEW sealed bytes"
    assert store.get("c/ab/x") == b"NEW sealed bytes"


def test_wrong_length_cache_file_falls_back_to_store(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store, memory = make(tmp_path)
    store.put("c/ab/x", b"the sealed chunk")
    (store.cache_dir / "c" / "ab" / "x").write_bytes(b"the sealed")  # truncated
    with caplog.at_level(logging.WARNING, logger="sealfs.store"):
        assert store.get("c/ab/x") == b"the sealed chunk"
    assert memory.counts["get"] == 1
    assert "c/ab/x" in caplog.text
    assert (store.cache_dir / "c" / "ab" / "x").read_bytes() == b"the sealed chunk"
    assert store.get("c/ab/x") == b"the sealed chunk"
    assert memory.counts["get"] == 1


def test_vanished_cache_file_falls_back_to_store(tmp_path: Path) -> None:
    store, memory = make(tmp_path)
    store.put("c/ab/x", b"chunk")
    (store.cache_dir / "c" / "ab" / "x").unlink()
    assert store.get("c/ab/x") == b"chunk"
    assert memory.counts["get"] == 1


def test_full_cache_disk_does_not_fail_get_or_put(
    tiny_tmpfs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    memory = MemoryStore()
    store = CachingStore(memory, tiny_tmpfs, max_bytes=100 << 20)
    chunks = {f"c/0{i}/chunk": bytes([i]) * (300 << 10) for i in range(6)}
    with caplog.at_level(logging.WARNING, logger="sealfs.store"):
        for name, data in list(chunks.items())[:3]:
            store.put(name, data)
        for name, data in list(chunks.items())[3:]:
            memory.put(name, data)
        for name, data in chunks.items():
            assert store.get(name) == data
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"cache disk full at {tiny_tmpfs}; continuing without caching"]
    assert sum(cached_files(tiny_tmpfs).values()) == store.cache_bytes() <= 1 << 20
    assert not [p for p in tiny_tmpfs.rglob(".tmp-*")]
    for name, data in chunks.items():
        assert memory.get(name) == data


def test_cache_dir_that_cannot_be_created_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(
        ConfigError, match=r"cannot create cache directory .* another with --cache-dir"
    ):
        CachingStore(MemoryStore(), tmp_path / "file" / "cache", 1000)


@pytest.mark.parametrize("mode", [0o644, 0o755])
def test_cache_dir_that_is_a_file_is_a_config_error(tmp_path: Path, mode: int) -> None:
    """Not "not writable by you: chown it" (a file's mode), nor a mount that caches
    nothing, with a warning in its log (a file the owner may write and search)."""
    (tmp_path / "file").write_bytes(b"")
    (tmp_path / "file").chmod(mode)
    with pytest.raises(ConfigError, match=r"cannot create cache directory .*: File exists"):
        CachingStore(MemoryStore(), tmp_path / "file", 1000)


def test_the_cache_s_directories_are_the_owner_s_only(tmp_path: Path) -> None:
    """As the local store's (design.md, "Local store"): they followed the umask, so
    under the usual 022 any local user could list which chunks a mount reads."""
    old = os.umask(0)
    try:
        memory = MemoryStore()
        memory.put("c/ab/x", b"sealed chunk")
        store = CachingStore(memory, tmp_path / "parent" / "cache", 1 << 20)
        assert store.get("c/ab/x") == b"sealed chunk"
    finally:
        os.umask(old)

    assert_owner_only_under(tmp_path / "parent", "cache")


def test_a_cache_made_before_that_is_made_owner_only(tmp_path: Path) -> None:
    """A cache from an older build kept its 0755 directories, which make_dirs leaves
    as they are; the next mount makes those under the root the owner's only (the
    root lists only c/). Files stay 0600."""
    store, memory = make(tmp_path)
    memory.put("c/ab/x", b"sealed chunk")
    assert store.get("c/ab/x") == b"sealed chunk"
    directories = [tmp_path / "cache" / "c", tmp_path / "cache" / "c" / "ab"]
    for directory in [tmp_path / "cache", *directories]:
        directory.chmod(0o755)
    make(tmp_path)
    modes = [stat.S_IMODE(d.stat().st_mode) for d in directories]
    assert modes == [0o700] * 2
    assert stat.S_IMODE((tmp_path / "cache" / "c" / "ab" / "x").stat().st_mode) == 0o600
    assert os.listdir(tmp_path / "cache") == ["c"]


def test_a_shared_directory_given_as_the_cache_keeps_its_mode(tmp_path: Path) -> None:
    """Regression: --cache-dir ~ made the home directory 0700, and as root --cache-dir
    /tmp would have made /tmp 0700 for the whole system."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    memory = MemoryStore()
    memory.put("c/ab/x", b"sealed chunk")
    for _ in range(2):  # a first mount, then one that finds the cache
        store = CachingStore(memory, shared, 1 << 20)
        assert store.get("c/ab/x") == b"sealed chunk"
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777
    assert stat.S_IMODE((shared / "c").stat().st_mode) == 0o700


def test_a_fifo_in_the_cache_is_never_served(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Whoever can write to the cache directory may put a FIFO at a chunk's name. Opening
    # it blocked until a writer came (a mount hung for good), and then served its bytes.
    store, memory = make(tmp_path)
    store.put("c/ab/x", b"the sealed chunk")
    cached = store.cache_dir / "c" / "ab" / "x"
    cached.unlink()
    os.mkfifo(cached)
    spare = tmp_path / "fifo"
    os.link(cached, spare)  # to let the writer go once the cache has dropped its name
    writer = threading.Thread(target=lambda: spare.write_bytes(b"forged chunk 16b"))
    writer.start()
    try:
        with caplog.at_level(logging.WARNING, logger="sealfs.store"):
            assert store.get("c/ab/x") == b"the sealed chunk"
        assert memory.counts["get"] == 1
        assert "c/ab/x" in caplog.text
        assert cached.read_bytes() == b"the sealed chunk"  # a regular file again
    finally:
        fd = os.open(spare, os.O_RDONLY | os.O_NONBLOCK)
        writer.join()
        os.close(fd)
