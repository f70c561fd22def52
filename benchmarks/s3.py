"""sealfs on S3 (a moto server on loopback) beside sealfs on a local store.

    .venv/bin/python -m benchmarks.s3 [--size-mib 256] [--rounds 50] [--workdir DIR]

Figures, for each store, through a real mount made with the CLI:
- write: SIZE MiB of incompressible data written in 1 MiB pieces, then fsync;
- cold read: the same file after an unmount, dropped caches and (S3) an empty
  chunk cache, read sequentially;
- requests per checkpoint commit: a 1 MiB checkpoint written to a temp file,
  fsynced, renamed over the previous one, directory fsynced; the S3 store's
  request counters (from `sealfs status`) before and after, per method;
- commit latency: p50 and p99 of that checkpoint over ROUNDS rounds.

moto runs in its own process on 127.0.0.1, so its CPU is not the harness's;
but any figure here measures moto too (perf notes: about 200 requests per
second), so request counts are printed beside the times. Nothing but
127.0.0.1 is ever contacted: credentials are fake and instance metadata off.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.util import MiB, drop_caches, is_mounted, lazy_unmount, log, percentile
from sealfs.cli.mount_cmd import commit_mount
from tests.mounts import CHEAP_KDF, PASSPHRASE, abort_connection, sealfs
from tests.s3.server import fake_aws_environment

MOTO_SCRIPT = """
import sys, time
from moto.server import ThreadedMotoServer
from tests.s3.server import make_conditional_puts_atomic
make_conditional_puts_atomic()
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
while True:
    time.sleep(3600)
"""
BUCKET = "sealfs-bench"
LOCAL, S3 = "local", "s3 (moto)"


@contextlib.contextmanager
def moto_process() -> Any:
    """A moto server in a child process on 127.0.0.1; yields its endpoint URL."""
    proc = subprocess.Popen(
        [sys.executable, "-c", MOTO_SCRIPT],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


class Volume:
    """One sealfs volume (local or S3) and its mountpoint, driven through the CLI."""

    def __init__(self, root: Path, kind: str, endpoint: str | None = None) -> None:
        self.root, self.kind, self.endpoint = root, kind, endpoint
        root.mkdir(parents=True)
        self.mnt = root / "mnt"
        self.mnt.mkdir()
        self.passfile = root / "passphrase"
        self.passfile.write_text(PASSPHRASE + "\n")
        self.log_file = root / "daemon.log"
        self.cache = root / "cache"
        self.url = str(root / "store") if kind == LOCAL else f"s3://{BUCKET}/bench"

    def _s3_args(self) -> list[str]:
        return ["--s3-endpoint", self.endpoint] if self.endpoint else []

    def init(self) -> None:
        self._run("init", self.url, *self._s3_args(), "--passphrase-file", str(self.passfile),
                  "--recovery-key-file", str(self.root / "recovery"), *CHEAP_KDF)  # fmt: skip

    def mount(self, *, empty_cache: bool = False) -> float:
        if empty_cache:
            shutil.rmtree(self.cache, ignore_errors=True)
        cache = ["--cache-dir", str(self.cache)] if self.kind == S3 else []
        t = time.perf_counter()
        self._run("mount", self.url, str(self.mnt), *self._s3_args(), "--passphrase-file",
                  str(self.passfile), "--log-file", str(self.log_file), *cache)  # fmt: skip
        return time.perf_counter() - t

    def umount(self) -> None:
        self._run("umount", str(self.mnt), "--timeout", "1800", timeout=1900)

    def requests(self) -> dict[str, int]:
        status = json.loads(os.getxattr(self.mnt, "user.sealfs.status"))
        return dict(status.get("store_requests") or {})

    def emergency_unmount(self) -> None:
        if is_mounted(self.mnt):
            abort_connection(str(self.mnt))
            lazy_unmount(self.mnt)

    def _run(self, *args: str, timeout: float = 600) -> None:
        result = sealfs(*args, timeout=timeout)
        if result.returncode != 0:
            tail = self.log_file.read_text()[-2000:] if self.log_file.exists() else ""
            raise RuntimeError(f"sealfs {args[0]} failed: {result.stderr}{tail}")


def checkpoint(mnt: Path, data: bytes) -> None:
    tmp = mnt / "ckpt.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, mnt / "ckpt.bin")
    commit_mount(str(mnt))


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {m: after[m] - before.get(m, 0) for m in sorted(after) if after[m] != before.get(m, 0)}


def bench(vol: Volume, size: int, rounds: int) -> dict[str, Any]:
    """Every figure for one volume; leaves it unmounted."""
    out: dict[str, Any] = {}
    data = memoryview(os.urandom(size))  # incompressible and never repeated: no dedup
    vol.init()
    out["mount_s"] = vol.mount()
    log(f"{vol.kind}: writing {size // MiB} MiB")
    before = vol.requests()
    t = time.perf_counter()
    with open(vol.mnt / "big.bin", "wb") as f:
        for offset in range(0, size, MiB):
            f.write(data[offset : offset + MiB])
        f.flush()
        os.fsync(f.fileno())
    out["write_mbs"] = size / MiB / (time.perf_counter() - t)
    out["write_requests"] = delta(before, vol.requests())
    vol.umount()
    with contextlib.suppress(OSError):
        drop_caches()
    out["remount_s"] = vol.mount(empty_cache=True)
    log(f"{vol.kind}: cold read")
    before = vol.requests()
    t = time.perf_counter()
    with open(vol.mnt / "big.bin", "rb", buffering=0) as f:
        while f.read(MiB):
            pass
    out["read_mbs"] = size / MiB / (time.perf_counter() - t)
    out["read_requests"] = delta(before, vol.requests())
    del data
    log(f"{vol.kind}: {rounds} checkpoint commits of 1 MiB")
    checkpoint(vol.mnt, os.urandom(MiB))  # the first replaces nothing
    latencies, per_commit = [], []
    for _ in range(rounds):
        data = os.urandom(MiB)
        before = vol.requests()
        t = time.perf_counter()
        checkpoint(vol.mnt, data)
        latencies.append(time.perf_counter() - t)
        per_commit.append(delta(before, vol.requests()))
    out["p50_ms"] = percentile(latencies, 50) * 1000
    out["p99_ms"] = percentile(latencies, 99) * 1000
    out["commit_requests"] = per_commit
    vol.umount()
    return out


def describe_requests(counts: dict[str, int] | None) -> str:
    if not counts:
        return "n/a (not counted)"
    return ", ".join(f"{m} {n}" for m, n in counts.items())


def mean_requests(per_commit: list[dict[str, int]]) -> dict[str, float]:
    methods = sorted({m for c in per_commit for m in c})
    return {m: sum(c.get(m, 0) for c in per_commit) / len(per_commit) for m in methods}


def report(results: dict[str, dict[str, Any]], size: int, rounds: int) -> None:
    local, s3 = results[LOCAL], results[S3]
    table = Table(title=f"sealfs: local store vs S3 (moto on 127.0.0.1), {size // MiB} MiB file")
    table.add_column("figure")
    table.add_column(LOCAL, justify="right")
    table.add_column(S3, justify="right")
    table.add_column("s3 / local", justify="right")

    def row(name: str, key: str, unit: str) -> None:
        a, b = local[key], s3[key]
        table.add_row(f"{name} ({unit})", f"{a:.1f}", f"{b:.1f}", f"{b / a:.2f}x" if a else "-")

    row("write + fsync", "write_mbs", "MiB/s")
    row("cold read", "read_mbs", "MiB/s")
    row("1 MiB checkpoint commit p50", "p50_ms", "ms")
    row("1 MiB checkpoint commit p99", "p99_ms", "ms")
    row("mount (fresh volume)", "mount_s", "s")
    row(f"remount with {size // MiB} MiB file", "remount_s", "s")
    per = mean_requests(s3["commit_requests"])
    table.add_row(
        "requests per checkpoint commit", "n/a",
        ", ".join(f"{m} {n:.2f}" for m, n in per.items()), "",
    )  # fmt: skip
    table.add_row("requests for the write", "n/a", describe_requests(s3["write_requests"]), "")
    table.add_row("requests for the cold read", "n/a", describe_requests(s3["read_requests"]), "")
    Console(width=120).print(table)
    print(
        f"Checkpoint: write 1 MiB to a temp file, fsync, rename over the last one, fsync the"
        f" directory; {rounds} rounds. S3 figures include moto's own CPU (same 2-core host)."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args(argv)
    size = args.size_mib * MiB
    fake_aws_environment()
    work = Path(tempfile.mkdtemp(prefix="sealfs-bench-s3-", dir=args.workdir))
    results: dict[str, dict[str, Any]] = {}
    volumes: list[Volume] = []
    try:
        with moto_process() as endpoint:
            import boto3  # noqa: PLC0415 - only to create the bucket

            boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
            for kind in (LOCAL, S3):
                vol = Volume(work / kind.split()[0], kind, endpoint if kind == S3 else None)
                volumes.append(vol)
                results[kind] = bench(vol, size, args.rounds)
    finally:
        for vol in volumes:
            vol.emergency_unmount()
        shutil.rmtree(work, ignore_errors=True)
    report(results, size, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
