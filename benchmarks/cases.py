"""The benchmarks. Each takes the run's Context and returns its Figures.

Every benchmark makes fresh filesystems (one per target), runs the targets
one after the other so only one daemon works at a time, and tears each down
in a finally block.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import random
import shutil
import sqlite3
import subprocess
import sysconfig
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import zstandard
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from benchmarks import data as D
from benchmarks.report import HIGHER, LOWER, Figure
from benchmarks.targets import (
    GOCRYPTFS,
    PLAIN,
    SEALFS,
    SealfsTarget,
    Target,
    make_target,
    store_bytes,
)
from benchmarks.util import (
    MB,
    GiB,
    MiB,
    RssSampler,
    drop_caches,
    log,
    median,
    percentile,
    proc_status,
    process_cpu,
    py_spy,
    timed,
    tree_bytes,
    tree_stats,
    warm,
)


@dataclass(frozen=True)
class Sizes:
    seq: int = GiB
    seq_repeats: int = 3  # single cold reads vary by about 20 % from run to run here
    fsync_count: int = 200
    fsync_size: int = MiB
    tree_files: int = 20_000
    tree_bytes: int = 300 * MB
    dedup: int = 256 * MiB
    mount_dirs: int = 100
    mount_files_per_dir: int = 1000
    mount_repeats: int = 3
    rss: int = 4 * GiB
    log_lines: int = 2000
    db_rows: int = 200_000
    db_transactions: int = 1000


QUICK = Sizes(
    seq=64 * MiB, seq_repeats=1, fsync_count=20, tree_files=1500, tree_bytes=20 * MB,
    dedup=16 * MiB, mount_dirs=10, mount_files_per_dir=100, mount_repeats=2, rss=512 * MiB,
    log_lines=200, db_rows=20_000, db_transactions=100,
)  # fmt: skip


@dataclass
class Context:
    workdir: Path
    sizes: Sizes
    targets: tuple[str, ...]
    seed: int = 1
    profile: bool = False
    live: list[Target] = field(default_factory=list)
    _random: dict[tuple[int, int], bytes] = field(default_factory=dict)
    _json: dict[int, D.Checkpoint] = field(default_factory=dict)

    @property
    def data_dir(self) -> Path:
        return self.workdir / "data"

    def random_bytes(self, size: int, seed: int | None = None) -> bytes:
        """Incompressible, deterministic bytes (AES-CTR keystream of the seed)."""
        key = (size, seed if seed is not None else self.seed)
        if key not in self._random:
            digest = hashlib.sha256(repr(key).encode()).digest()
            enc = Cipher(algorithms.AES(digest), modes.CTR(bytes(16))).encryptor()
            self._random[key] = enc.update(bytes(size))
        return self._random[key]

    def checkpoint(self, size: int) -> D.Checkpoint:
        if size not in self._json:
            log(f"preparing a {size / MiB:.0f} MiB JSON checkpoint (cached in {self.data_dir})")
            gc.disable()
            try:
                self._json[size] = D.cached_checkpoint(self.data_dir, self.seed, size)
            finally:
                gc.enable()
        return self._json[size]

    def forget_data(self) -> None:
        self._random.clear()
        self._json.clear()
        gc.collect()

    @contextmanager
    def target(self, name: str, bench: str) -> Iterator[Target]:
        t = make_target(name, self.workdir, bench)
        self.live.append(t)
        try:
            log(f"{bench}: setting up {name}")
            t.setup()
            yield t
        finally:
            if isinstance(t, SealfsTarget):
                for line in t.log_errors()[-5:]:
                    log(f"{bench}: sealfs daemon log: {line}")
            t.teardown()
            self.live.remove(t)

    @contextmanager
    def profiled(self, t: Target, label: str) -> Iterator[None]:
        out = None
        if self.profile and t.name == SEALFS:
            out = self.workdir / "profiles" / f"{label}.svg"
        with py_spy(t.daemon_pid(), out):
            yield


# -- file I/O primitives ----------------------------------------------------------------


def write_file(path: Path, data: bytes | memoryview, block: int = MiB, fsync: bool = True) -> float:
    """Write data in blocks, fsync, close; seconds from open to close."""
    view = memoryview(data)
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        pos = 0
        while pos < len(view):
            pos += os.write(fd, view[pos : pos + block])
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t


def read_file(path: Path, expect: bytes, block: int = MiB) -> float:
    """Read the whole file sequentially; seconds. Checks size and a sample of every block."""
    buf = bytearray(block)
    view = memoryview(buf)
    pos = 0
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            k = (pos // block * 7919) % max(1, n - 4096)  # a 4 KiB sample at a moving offset
            m = min(4096, n - k)
            if bytes(view[k : k + m]) != expect[pos + k : pos + k + m]:
                raise AssertionError(f"{path}: wrong data near offset {pos + k}")
            pos += n
    elapsed = time.perf_counter() - t
    if pos != len(expect):
        raise AssertionError(f"{path}: read {pos} bytes, expected {len(expect)}")
    return elapsed


def replace_file(directory: Path, name: str, data: bytes, block: int = MiB) -> float:
    """What agents do: write NAME.tmp fully, fsync it, rename it over NAME; seconds."""
    tmp = directory / (name + ".tmp")
    t = time.perf_counter()
    write_file(tmp, data, block)
    os.rename(tmp, directory / name)
    return time.perf_counter() - t


# -- 1. sequential write and cold read ---------------------------------------------------


def bench_seq(ctx: Context) -> list[Figure]:
    size = ctx.sizes.seq
    kinds: list[tuple[str, Callable[[], bytes]]] = [
        ("random", lambda: ctx.random_bytes(size)),
        ("JSON", lambda: ctx.checkpoint(size).to_bytes()),
    ]
    label = f"{size / GiB:g} GiB" if size >= GiB else f"{size / MiB:g} MiB"
    figures: dict[str, Figure] = {}
    payloads = {kind: make() for kind, make in kinds}  # prepared before any timing
    for kind, _ in kinds:
        figures[f"w-{kind}"] = Figure("sequential", f"write {label} {kind} + fsync", "MB/s",
                                      better=HIGHER)  # fmt: skip
        figures[f"r-{kind}"] = Figure("sequential", f"cold read {label} {kind}", "MB/s",
                                      better=HIGHER)  # fmt: skip
        figures[f"wc-{kind}"] = Figure("sequential", f"daemon CPU per GiB, write {kind}", "s",
                                       better=LOWER)  # fmt: skip
        figures[f"rc-{kind}"] = Figure("sequential", f"daemon CPU per GiB, cold read {kind}",
                                       "s", better=LOWER)  # fmt: skip
    samples: dict[tuple[str, str], list[float]] = {}  # (figure key, target) -> one per run
    # Targets take turns, so that a noisy minute hits each of them alike; each run gets a
    # fresh file system, since sealfs would dedup a second write of the same bytes.
    for _ in range(ctx.sizes.seq_repeats):
        for name in ctx.targets:
            with ctx.target(name, "seq") as t:
                for kind, _ in kinds:
                    for key, value in _seq_run(ctx, t, kind, payloads[kind]).items():
                        if value is not None:
                            samples.setdefault((f"{key}-{kind}", name), []).append(value)
    for (key, name), values in samples.items():
        figures[key].values[name] = median(values)
    del payloads
    ctx.forget_data()
    out = [figures[f"{k}-{kind}"] for kind, _ in kinds for k in ("w", "r", "wc", "rc")]
    for fig in out:
        if ctx.sizes.seq_repeats > 1:
            fig.note = f"median of {ctx.sizes.seq_repeats}"
        if fig.unit == "MB/s":
            fig.judge(lambda v: v[SEALFS] >= v[GOCRYPTFS], ">= gocryptfs")
    return out


def _seq_run(ctx: Context, t: Target, kind: str, payload: bytes) -> dict[str, float | None]:
    """Write the payload with a final fsync, then read it cold. Returns write and read
    MB/s ("w", "r") and the daemon's CPU seconds per GiB written and read ("wc", "rc")."""
    path = t.path / f"seq-{kind}.bin"
    write, write_cpu = _timed(ctx, t, f"seq-write-{kind}", len(payload),
                              lambda: write_file(path, payload))  # fmt: skip
    log(f"seq: {t.name} wrote {kind} at {write:.0f} MB/s")
    t.cold()
    read, read_cpu = _timed(ctx, t, f"seq-read-{kind}", len(payload),
                            lambda: read_file(path, payload))  # fmt: skip
    log(f"seq: {t.name} read {kind} cold at {read:.0f} MB/s")
    path.unlink()
    return {"w": write, "r": read, "wc": write_cpu, "rc": read_cpu}


def _timed(
    ctx: Context, t: Target, label: str, size: int, step: Callable[[], float]
) -> tuple[float, float | None]:
    """Run a step that moves size bytes and returns its seconds; (MB/s, daemon CPU
    seconds per GiB moved, if the target has a daemon)."""
    c0 = process_cpu(t.daemon_pid())
    with ctx.profiled(t, label):
        secs = step()
    c1 = process_cpu(t.daemon_pid())
    cpu = (c1 - c0) * GiB / size if c0 is not None and c1 is not None else None
    return size / secs / MB, cpu


# -- 2. checkpoint write + fsync + rename latency ------------------------------------------


def bench_fsync(ctx: Context) -> list[Figure]:
    n, size = ctx.sizes.fsync_count, ctx.sizes.fsync_size
    blob = ctx.checkpoint(ctx.sizes.dedup).to_bytes()
    span = len(blob) - size
    payloads = [blob[(i * size) % span : (i * size) % span + size] for i in range(n)]
    p50 = Figure("checkpoint", f"{size / MiB:g} MiB write+fsync+rename, p50", "ms", better=LOWER)
    p99 = Figure("checkpoint", f"{size / MiB:g} MiB write+fsync+rename, p99", "ms", better=LOWER)
    mean = Figure("checkpoint", f"{size / MiB:g} MiB write+fsync+rename, mean", "ms",
                  better=LOWER)  # fmt: skip
    for name in ctx.targets:
        with ctx.target(name, "fsync") as t:
            lat = []
            with ctx.profiled(t, "fsync"):
                for payload in payloads:
                    lat.append(replace_file(t.path, "checkpoint.json", payload) * 1000)
            p50.values[name] = percentile(lat, 50)
            p99.values[name] = percentile(lat, 99)
            mean.values[name] = sum(lat) / len(lat)
            log(f"fsync: {name} p50 {p50.values[name]:.1f} ms, p99 {p99.values[name]:.1f} ms")
    p50.note = f"{n} times"
    p50.judge(lambda v: v[SEALFS] <= 2 * v[PLAIN], "<= 2x plain")
    return [p50, p99, mean]


# -- 3. copying a source tree, then find, du, rm -----------------------------------------


def stage_tree(ctx: Context) -> Path:
    """A copy of a Python installation's lib directory, about the wanted files and bytes.

    Top-level entries of the standard library, then of site-packages, are
    taken in name order while they fit the byte budget, until there are
    enough files. The tree is kept in the work dir between runs.
    """
    want_files, want_bytes = ctx.sizes.tree_files, ctx.sizes.tree_bytes
    src = ctx.workdir / "data" / f"tree-{want_files}-{want_bytes}"
    if (src / ".complete").exists():
        return src
    shutil.rmtree(src, ignore_errors=True)
    lib = Path(sysconfig.get_paths()["stdlib"])
    site = lib / "site-packages"
    units = [p for p in sorted(lib.iterdir()) if p.name != "site-packages"]
    if site.is_dir():
        units += sorted(site.iterdir())
    budget = want_bytes * 1.1
    files = size = 0
    log(f"staging a tree of about {want_files} files / {want_bytes / MB:.0f} MB from {lib}")
    (src / "lib").mkdir(parents=True)
    for unit in units:
        if files >= want_files:
            break
        if unit.is_symlink() or not (unit.is_dir() or unit.is_file()):
            continue
        n, b = tree_stats(unit) if unit.is_dir() else (0, unit.stat().st_size)
        n += 1
        if size + b > budget:
            continue
        rel = "site-packages/" + unit.name if unit.parent == site else unit.name
        dst = src / "lib" / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["cp", "-a", str(unit), str(dst)], check=True)
        files += n
        size += b
    (src / ".complete").write_text(f"{files} {size}\n")
    return src


def bench_tree(ctx: Context) -> list[Figure]:
    src = stage_tree(ctx)
    entries, size = tree_stats(src / "lib")
    desc = f"{entries:,} entries, {size / MB:.0f} MB"
    cp = Figure("tree", f"cp -a ({desc})", "s", better=LOWER)
    rate = Figure("tree", "cp -a rate", "files/s", better=HIGHER)
    unmount = Figure("tree", "umount after cp (commit)", "s", better=LOWER)
    find = Figure("tree", "find (cold)", "s", better=LOWER)
    du = Figure("tree", "du -s (cold)", "s", better=LOWER)
    rm = Figure("tree", "rm -rf", "s", better=LOWER)
    for name in ctx.targets:
        with ctx.target(name, "tree") as t:
            warm(src)
            dst = t.path / "tree"
            with ctx.profiled(t, "tree-cp"):
                cp.values[name] = timed(["cp", "-a", str(src / "lib"), str(dst)])
            rate.values[name] = entries / cp.values[name]
            log(f"tree: {name} cp -a took {cp.values[name]:.1f} s")
            if t.is_fuse:
                unmount.values[name] = t.umount()
                t.mount()
            drop_caches()
            with ctx.profiled(t, "tree-find"):
                t0 = time.perf_counter()
                listing = subprocess.run(["find", str(dst)], capture_output=True, check=True)
                find.values[name] = time.perf_counter() - t0
            found = listing.stdout.count(b"\n") - 1
            if found != entries:
                raise AssertionError(f"{name}: find saw {found} entries, expected {entries}")
            # find has just read every directory and inode: cold again, or du would be
            # timed on the caches find filled (the figure says cold).
            t.cold()
            with ctx.profiled(t, "tree-du"):
                du.values[name] = timed(["du", "-s", str(dst)])
            with ctx.profiled(t, "tree-rm"):
                rm.values[name] = timed(["rm", "-rf", str(dst)])
            log(f"tree: {name} find {find.values[name]:.1f} s, du {du.values[name]:.1f} s, "
                f"rm {rm.values[name]:.1f} s")  # fmt: skip
    cp.judge(lambda v: v[SEALFS] <= v[GOCRYPTFS], "<= gocryptfs")
    return [cp, rate, unmount, find, du, rm]


# -- 4. deduplication of rewritten checkpoints ---------------------------------------------


def bench_dedup(ctx: Context) -> list[Figure]:
    if SEALFS not in ctx.targets:
        return []
    base = ctx.checkpoint(ctx.sizes.dedup)
    maker = D.RecordMaker(ctx.seed)
    base_bytes = base.to_bytes()
    variants = [
        ("(i) 1% of records changed, one region", D.changed_in_region, 2.0),
        ("(ii) 1% of records appended", D.appended, 2.0),
        ("(iii) 1 KB inserted at the start", D.inserted_at_start, 2.0),
        ("(iv) 1% of records changed, scattered", D.changed_scattered, None),
    ]
    figures: list[Figure] = []
    label = f"{len(base_bytes) / MiB:.0f} MiB"
    with ctx.target(SEALFS, "dedup") as t:
        initial = tree_bytes(t.store)
        replace_file(t.path, "checkpoint.json", base_bytes)
        t.umount()
        before = tree_bytes(t.store)
        first = Figure("dedup", f"first write of the {label} checkpoint: stored", "MB",
                       values={SEALFS: (before - initial) / MB},
                       note=f"{(before - initial) / len(base_bytes):.1%} of file")  # fmt: skip
        figures.append(first)
        zstd3 = len(zstandard.ZstdCompressor(level=3).compress(base_bytes))
        for step, (title, edit, limit) in enumerate(variants, start=2):
            # A step of its own: the store keeps every earlier variant's chunks, and a
            # header alike would let this one reuse the first chunk of another.
            new = edit(maker, base, step=step).to_bytes()
            t.mount()
            with ctx.profiled(t, "dedup-" + title.split()[0].strip("()")):
                replace_file(t.path, "checkpoint.json", new)
            t.umount()
            after = tree_bytes(t.store)
            added = after - before
            share = added / len(new) * 100
            fig = Figure("dedup", f"{title}: added", "MB", values={SEALFS: added / MB},
                         better=LOWER, note=f"{share:.2f}% of file")  # fmt: skip
            if limit is not None:
                size = len(new)
                fig.judge(lambda v, n=size: v[SEALFS] * MB < n * 0.02, "< 2% of file")
            else:
                packed = len(zstandard.ZstdCompressor(level=3).compress(new))
                fig.judge(lambda v, p=packed: v[SEALFS] * MB <= p, "<= file zstd-compressed")
            figures.append(fig)
            log(f"dedup: {title}: added {added / MB:.1f} MB ({share:.2f}%)")
            # back to the base version, so that every variant starts from the same state
            t.mount()
            replace_file(t.path, "checkpoint.json", base_bytes)
            t.umount()
            before = tree_bytes(t.store)
    figures.append(Figure("dedup", f"reference: the {label} checkpoint with zstd -3", "MB",
                          values={SEALFS: zstd3 / MB},
                          note=f"{zstd3 / len(base_bytes):.1%} of file"))  # fmt: skip
    return figures


# -- 5. mount time of a volume with many files --------------------------------------------


def bench_mount(ctx: Context) -> list[Figure]:
    dirs, per = ctx.sizes.mount_dirs, ctx.sizes.mount_files_per_dir
    total = dirs * per
    create = Figure("mount", f"create {total:,} small files (Python loop)", "files/s",
                    better=HIGHER)  # fmt: skip
    commit = Figure("mount", "umount after creating them", "s", better=LOWER)
    mount = Figure("mount", f"mount with {total:,} files", "s", better=LOWER)
    first_ls = Figure("mount", "first ls of the root", "s", better=LOWER)
    # The daemon keeps all metadata in memory: what operators must allow (MemoryMax).
    rss = Figure("mount", f"daemon RSS after a find over {total:,} files", "MiB", better=LOWER)
    for name in ctx.targets:
        if name == PLAIN:
            continue
        with ctx.target(name, "mount") as t:
            t0 = time.perf_counter()
            with ctx.profiled(t, "mount-create"):
                for d in range(dirs):
                    dp = t.path / f"d{d:03d}"
                    dp.mkdir()
                    for f in range(per):
                        with open(dp / f"f{f:04d}.json", "wb") as fh:
                            fh.write(b'{"dir": %d, "file": %d, "note": "%s"}\n'
                                     % (d, f, b"x" * (f % 97)))  # fmt: skip
            create.values[name] = total / (time.perf_counter() - t0)
            log(f"mount: {name} created {total} files at {create.values[name]:.0f}/s")
            commit.values[name] = t.umount()
            mounts, lss = [], []
            for _ in range(ctx.sizes.mount_repeats):
                drop_caches()
                mounts.append(t.mount())
                t0 = time.perf_counter()
                out = subprocess.run(["ls", str(t.path)], capture_output=True, check=True)
                lss.append(time.perf_counter() - t0)
                shown = out.stdout.count(b"\n")
                if shown != dirs:
                    raise AssertionError(f"{name}: ls shows {shown} entries, expected {dirs}")
                pid = t.daemon_pid()
                if name not in rss.values and pid is not None:
                    subprocess.run(["find", str(t.path), "-type", "f"], capture_output=True,
                                   check=True)  # fmt: skip
                    rss.values[name] = (proc_status(pid, "VmRSS") or 0) / MiB
                t.umount()
            log(f"mount: {name} mounts took {', '.join(f'{m:.2f}' for m in mounts)} s")
            mount.values[name] = median(mounts)
            first_ls.values[name] = median(lss)
    mount.note = f"median of {ctx.sizes.mount_repeats}"
    mount.judge(lambda v: v[SEALFS] < 3.0, "< 3 s")
    return [create, commit, mount, first_ls, rss]


# -- 6. peak memory of the daemon while writing a large file ------------------------------


def bench_rss(ctx: Context) -> list[Figure]:
    size = ctx.sizes.rss
    piece = 64 * MiB
    label = f"{size / GiB:g} GiB" if size >= GiB else f"{size / MiB:g} MiB"
    log(f"rss: preparing {label} of random data")
    pieces = [ctx.random_bytes(piece, seed=1000 + k) for k in range(size // piece)]
    ctx._random.clear()  # the list holds them; no second reference
    peak = Figure("memory", f"daemon peak RSS writing {label}", "MiB", better=LOWER)
    speed = Figure("memory", f"write {label} random + fsync", "MB/s", better=HIGHER)
    for name in ctx.targets:
        if name == PLAIN:
            continue
        with ctx.target(name, "rss") as t:
            pid = t.daemon_pid()
            if pid is None:
                raise RuntimeError(f"{name}: no daemon pid found")
            path = t.path / "big.bin"
            with RssSampler(pid) as sampler, ctx.profiled(t, "rss-write"):
                t0 = time.perf_counter()
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    for chunk in pieces:
                        view = memoryview(chunk)
                        for off in range(0, len(chunk), MiB):
                            os.write(fd, view[off : off + MiB])
                    os.fsync(fd)
                finally:
                    os.close(fd)
                secs = time.perf_counter() - t0
            hwm = proc_status(pid, "VmHWM") or 0
            peak.values[name] = max(hwm, sampler.peak) / MiB
            speed.values[name] = size / secs / MB
            log(f"rss: {name} peak {peak.values[name]:.0f} MiB (VmHWM {hwm / MiB:.0f}, polled "
                f"{sampler.peak / MiB:.0f}), {speed.values[name]:.0f} MB/s")  # fmt: skip
    del pieces
    gc.collect()
    peak.judge(lambda v: v[SEALFS] < 300, "< 300 MiB")
    return [peak, speed]


# -- 7. small overwrites and appends: what the store keeps per byte written --------------


def bench_append(ctx: Context) -> list[Figure]:
    """An agent's log fsynced line by line, and a SQLite database updated in small
    transactions: latency, and the bytes each store grows by per byte written. sealfs
    seals whole chunks and collects nothing yet, so both show its write amplification."""
    lines = _log_lines(ctx.seed, ctx.sizes.log_lines)
    appended = sum(len(line) for line in lines)
    n, rows = ctx.sizes.db_transactions, ctx.sizes.db_rows
    log_p50 = Figure("append", f"log: append+fsync of a {appended // len(lines)} B line, p50", "ms",
                     better=LOWER, note=f"{len(lines)} lines")  # fmt: skip
    log_growth = Figure("append", "log: store growth per byte appended", "x", better=LOWER)
    db_rate = Figure("append", "SQLite WAL: transactions of 5 updates", "tx/s", better=HIGHER,
                     note=f"{n} on {rows:,} rows")  # fmt: skip
    db_growth = Figure("append", "SQLite WAL: store growth per byte SQLite wrote", "x",
                       better=LOWER)  # fmt: skip
    for name in ctx.targets:
        with ctx.target(name, "append") as t:
            before = _committed_bytes(t)
            with ctx.profiled(t, "log"):
                lat = _append_lines(t.path / "agent.log", lines)
            log_p50.values[name] = percentile([s * 1000 for s in lat], 50)
            log_growth.values[name] = (_committed_bytes(t) - before) / appended
            db = t.path / "state.db"
            _fill_database(db, rows, ctx.seed)
            t.cold()  # every target updates from cold caches (the remount commits sealfs)
            before = store_bytes(t)
            with ctx.profiled(t, "sqlite"):
                secs, written = _update_database(db, rows, n, ctx.seed)
            db_rate.values[name] = n / secs
            db_growth.values[name] = (_committed_bytes(t) - before) / written
            log(f"append: {name} log p50 {log_p50.values[name]:.2f} ms, grew "
                f"{log_growth.values[name]:.1f}x; SQLite {db_rate.values[name]:.0f} tx/s, grew "
                f"{db_growth.values[name]:.2f}x")  # fmt: skip
    return [log_p50, log_growth, db_rate, db_growth]


def _log_lines(seed: int, count: int) -> list[bytes]:
    """JSON lines of about 750 bytes, as an agent logs tool calls."""
    rng = random.Random(seed)
    return [
        (
            json.dumps({"step": k, "tool": "search", "output": rng.randbytes(350).hex()}) + "\n"
        ).encode()
        for k in range(count)
    ]


def _committed_bytes(t: Target) -> int:
    """What the target's store holds once everything written is committed (a FUSE
    remount commits sealfs; the others write through)."""
    if isinstance(t, SealfsTarget):
        t.umount()
        t.mount()
    return store_bytes(t)


def _append_lines(path: Path, lines: list[bytes]) -> list[float]:
    """Append each line with O_APPEND and fsync it; seconds per line."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    lat = []
    try:
        for line in lines:
            t0 = time.perf_counter()
            os.write(fd, line)
            os.fsync(fd)
            lat.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
    return lat


def _fill_database(path: Path, rows: int, seed: int) -> None:
    rng = random.Random(seed)
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute("pragma journal_mode=wal")
        db.execute("create table state (id integer primary key, value blob)")
        with db:
            db.executemany("insert into state values (?, ?)",
                           ((k, rng.randbytes(200)) for k in range(rows)))  # fmt: skip
        db.execute("pragma wal_checkpoint(truncate)")


def _update_database(path: Path, rows: int, count: int, seed: int) -> tuple[float, int]:
    """count transactions of five random row updates (WAL mode, default checkpoints),
    then a final checkpoint; (seconds, bytes SQLite wrote)."""
    rng = random.Random(seed + 1)
    written = _bytes_written()
    t0 = time.perf_counter()
    with contextlib.closing(sqlite3.connect(path)) as db:
        for _ in range(count):
            with db:
                for _ in range(5):
                    db.execute("update state set value = ? where id = ?",
                               (rng.randbytes(200), rng.randrange(rows)))  # fmt: skip
        db.execute("pragma wal_checkpoint(truncate)")
    return time.perf_counter() - t0, _bytes_written() - written


def _bytes_written() -> int:
    """Bytes this process has passed to write(2) and friends so far."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no wchar line")


BENCHMARKS: dict[str, Callable[[Context], list[Figure]]] = {
    "seq": bench_seq,
    "fsync": bench_fsync,
    "tree": bench_tree,
    "dedup": bench_dedup,
    "mount": bench_mount,
    "rss": bench_rss,
    "append": bench_append,
}
