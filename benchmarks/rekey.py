"""`python -m benchmarks.rekey`: how fast `sealfs rekey` re-encrypts a volume on a local store.

Builds a volume holding --size-mib MiB of random data in one file plus
--files small files (so both the bytes and the per-object cost show), then
times, with the page cache dropped before each run:
- an offline rekey (`sealfs rekey STORE`, nothing mounted: the command re-seals);
- a mounted rekey (the daemon re-seals; the command follows its progress).
Each prints seconds, MB/s of sealed bytes re-written and objects/s. The
passphrase slot uses the minimum Argon2 cost so the KDF (run once per rekey to
re-make the slot) does not blur the figure.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.util import drop_caches, log, run

PASSPHRASE = "benchmark passphrase\n"


def sealfs(*args: str, timeout: float = 3600) -> str:
    return run([sys.executable, "-m", "sealfs.cli.main", *args], timeout=timeout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, default=1024, help="random data in one file")
    p.add_argument("--files", type=int, default=2000, help="small files of 16 KiB")
    p.add_argument("--workdir", type=Path, default=None)
    args = p.parse_args()
    base = args.workdir or Path(tempfile.mkdtemp(prefix="sealfs-bench-rekey-"))
    base.mkdir(parents=True, exist_ok=True)
    store, mnt, passfile = base / "store", base / "mnt", base / "pass"
    mnt.mkdir(exist_ok=True)
    passfile.write_text(PASSPHRASE)
    unlock = ["--passphrase-file", str(passfile)]
    sealfs("init", str(store), *unlock, "--recovery-key-file", str(base / "rk"),
           "--kdf-memory", "64", "--kdf-iterations", "1")  # fmt: skip
    sealfs("mount", str(store), str(mnt), *unlock)
    try:
        log(f"writing {args.size_mib} MiB and {args.files} small files")
        run(["dd", "if=/dev/urandom", f"of={mnt / 'big'}", "bs=1M", f"count={args.size_mib}",
             "conv=fsync", "status=none"])  # fmt: skip
        (mnt / "small").mkdir()
        for k in range(args.files):
            (mnt / "small" / f"f{k}").write_bytes(os.urandom(16384))
    finally:
        sealfs("umount", str(mnt))
    objects, stored = sealed_objects(store)
    print(f"store: {objects} objects, {stored / 1e6:.1f} MB  (load {os.getloadavg()[0]:.2f})")

    drop_caches()
    t = time.perf_counter()
    sealfs("rekey", str(store), *unlock, "--drop-slot", "1")
    report("offline rekey (command re-seals)", time.perf_counter() - t, objects, stored)

    sealfs("mount", str(store), str(mnt), *unlock)
    try:
        drop_caches()
        t = time.perf_counter()
        sealfs("rekey", str(store), *unlock)
        report("mounted rekey (daemon re-seals)", time.perf_counter() - t, objects, stored)
    finally:
        sealfs("umount", str(mnt))


def sealed_objects(store: Path) -> tuple[int, int]:
    """(count, bytes) of the sealed objects a rekey rewrites: chunks, segments, snapshots."""
    files = [f for prefix in ("c", "l", "s") for f in (store / prefix).rglob("*") if f.is_file()]
    return len(files), sum(f.stat().st_size for f in files)


def report(what: str, seconds: float, objects: int, stored: int) -> None:
    print(
        f"{what:34s} {seconds:7.2f} s  {stored / 1e6 / seconds:7.1f} MB/s"
        f"  {objects / seconds:8.0f} objects/s  (load {os.getloadavg()[0]:.2f})"
    )


if __name__ == "__main__":
    main()
