"""`python -m benchmarks.sync_threshold`: where LocalStore.sync should switch to syncfs(2).

Times one LocalStore.sync() after N puts (spread over the c/<ab> directories,
as a commit's chunks are, plus one log segment) flushed path by path, and the
same after one syncfs(2), for several N and object sizes; with --dirty MB,
another file on the same file system holds that much unflushed data while
syncing (what other programs leave there, which syncfs must write too).
Prints the median of --repeat runs in milliseconds. The crossover is what
sealfs.store.local.SYNCFS_ABOVE should be.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from pathlib import Path

from sealfs.store import local
from sealfs.store.local import LocalStore

KiB = 1024


def one_sync(root: Path, count: int, size: int, by_path: bool, dirty: int) -> float:
    """Seconds for one sync after count puts of size bytes into a warmed-up store."""
    store = LocalStore(root)
    for ab in range(256):  # directories exist and are durable, as in a store in use
        store.put(f"c/{ab:02x}/warm", b"w")
    store.put("l/0000000000000001", b"s")
    store.sync()
    data = os.urandom(size)
    for i in range(count):
        store.put(f"c/{i * 37 % 256:02x}/{i}", data)
    store.put("l/0000000000000002", data[:4096])
    if dirty:
        with open(root / "other-program", "wb") as f:
            f.write(os.urandom(dirty))
    local.SYNCFS_ABOVE = 1 << 30 if by_path else -1
    t = time.perf_counter()
    store.sync()
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sync_threshold", description=__doc__)
    p.add_argument("--workdir", default="/tmp/sealfs-sync-threshold")
    p.add_argument("--counts", default="1,4,16,32,64,128,256,512")
    p.add_argument("--sizes", default="4,64,1024", help="object sizes in KiB")
    p.add_argument("--dirty", type=int, default=0, help="MB of unrelated dirty data")
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    work = Path(args.workdir)
    print(f"load average {os.getloadavg()[0]:.2f}; ms per sync, median of {args.repeat}")
    print(f"{'objects':>8} {'KiB':>6} {'by path':>9} {'syncfs':>9}")
    for size in (int(s) * KiB for s in args.sizes.split(",")):
        for count in (int(c) for c in args.counts.split(",")):
            times: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(args.repeat):
                for by_path in (True, False):
                    shutil.rmtree(work, ignore_errors=True)
                    os.sync()  # start each run from a clean file system
                    times[by_path].append(one_sync(work, count, size, by_path, args.dirty << 20))
            fast, slow = (statistics.median(times[b]) * 1000 for b in (True, False))
            print(f"{count:>8} {size // KiB:>6} {fast:>9.1f} {slow:>9.1f}", flush=True)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
