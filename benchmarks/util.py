"""Small helpers shared by the benchmarks: timing, caches, sizes, processes, facts."""

from __future__ import annotations

import contextlib
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

MiB = 1 << 20
GiB = 1 << 30
MB = 1_000_000

_t0 = time.monotonic()


def log(message: str) -> None:
    """A timestamped progress line (the run may take half an hour)."""
    elapsed = time.monotonic() - _t0
    print(f"[{time.strftime('%H:%M:%S')} +{elapsed:6.0f}s] {message}", flush=True)


def run(cmd: list[str], *, timeout: float = 600, check: bool = True, **kw: object) -> str:
    """Run a command, return its stdout; raise with stderr on failure."""
    result = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, check=False,
        stdin=subprocess.DEVNULL, **kw,  # type: ignore[arg-type]
    )  # fmt: skip
    if check and result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd)} failed ({result.returncode}): {result.stderr.strip()[-2000:]}"
        )
    return result.stdout


def timed(cmd: list[str], *, timeout: float = 3600) -> float:
    """Seconds a command takes (its output discarded); raises if it fails."""
    t = time.perf_counter()
    result = subprocess.run(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=timeout,
        stdin=subprocess.DEVNULL, check=False,
    )  # fmt: skip
    elapsed = time.perf_counter() - t
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {result.stderr.strip()[-2000:]}")
    return elapsed


def drop_caches() -> None:
    """Write back and drop the page cache, dentries and inodes (needs root)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def tree_bytes(root: Path) -> int:
    """Apparent size of every file under root (what a store holds)."""
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def tree_stats(root: Path) -> tuple[int, int]:
    """(entries below root, bytes of regular files)."""
    entries = size = 0
    for dirpath, dirs, files in os.walk(root):
        entries += len(dirs) + len(files)
        for name in files:
            st = os.lstat(os.path.join(dirpath, name))
            if not os.path.islink(os.path.join(dirpath, name)):
                size += st.st_size
    return entries, size


def warm(root: Path) -> None:
    """Read every file under root once, so that a copy does not measure the source disk."""
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                continue
            with contextlib.suppress(OSError), open(path, "rb", buffering=0) as f:
                while f.read(MiB):
                    pass


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100): the smallest value with at least p % of
    the values at or below it. ceil, not round(x + 0.5): Python rounds halves to even,
    so whenever p % of the count was an odd whole number (p99 of 100, p50 of 30) that
    took the next value up."""
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, math.ceil(p * len(ordered) / 100) - 1))
    return ordered[k]


def median(values: list[float]) -> float:
    return statistics.median(values)


def proc_status(pid: int, key: str) -> int | None:
    """A kB field of /proc/PID/status (VmRSS, VmHWM) in bytes, or None if gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def process_cpu(pid: int | None) -> float | None:
    """CPU seconds (user + system, all threads) a process has used so far, or None."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class RssSampler:
    """Polls a process's VmRSS in a thread; peak is the largest value seen."""

    def __init__(self, pid: int, interval: float = 0.05) -> None:
        self.pid = pid
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = proc_status(self.pid, "VmRSS")
            if rss is not None:
                self.peak = max(self.peak, rss)
            self._stop.wait(self.interval)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def pids_matching(*needles: str) -> list[int]:
    """Pids whose command line contains every needle (exact argv items or substrings)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if cmd and all(n in cmd for n in needles):
            out.append(int(entry.name))
    return out


def wait_gone(pids: list[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(Path(f"/proc/{p}").exists() for p in pids):
            return True
        time.sleep(0.05)
    return False


def is_mounted(path: Path) -> bool:
    target = str(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == target for line in f)


def lazy_unmount(path: Path) -> None:
    subprocess.run(["fusermount3", "-u", "-z", str(path)], capture_output=True, check=False,
                   timeout=60)  # fmt: skip


@contextlib.contextmanager
def py_spy(pid: int | None, out: Path | None) -> Iterator[None]:
    """Record a py-spy flame graph of pid while the block runs (when out is given)."""
    if pid is None or out is None or (shutil.which("py-spy") is None and not _venv_py_spy()):
        yield
        return
    exe = shutil.which("py-spy") or _venv_py_spy()
    assert exe is not None
    out.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [exe, "record", "--pid", str(pid), "--nonblocking", "--threads", "-r", "50",
         "-o", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        yield
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log(f"py-spy profile: {out}")


def _venv_py_spy() -> str | None:
    candidate = Path(sys.executable).parent / "py-spy"
    return str(candidate) if candidate.exists() else None


def machine_facts(workdir: Path) -> dict[str, str]:
    def first_line(cmd: list[str]) -> str:
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False)
            return (out.stdout or out.stderr).strip().splitlines()[0]
        except (OSError, IndexError, subprocess.TimeoutExpired):
            return "?"

    cpu = "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    mem = proc_meminfo("MemTotal")
    fstype = "?"
    with contextlib.suppress(Exception):
        fstype = first_line(["stat", "-f", "-c", "%T", str(workdir)])
    thp = "?"
    with contextlib.suppress(OSError):
        thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    try:
        import pyfuse3  # noqa: PLC0415 - only to report its version, if present

        pyfuse3_version = getattr(pyfuse3, "__version__", "?")
    except ImportError:
        pyfuse3_version = "missing"
    commit = first_line(["git", "-C", str(Path(__file__).resolve().parents[1]), "rev-parse",
                         "--short", "HEAD"])  # fmt: skip
    return {
        "nproc": str(os.cpu_count()),
        "cpu": cpu,
        "memory": f"{(mem or 0) / GiB:.1f} GiB",
        "kernel": platform.release(),
        "python": sys.version.split()[0] + f" ({sys.executable})",
        "pyfuse3": pyfuse3_version,
        "fuse": first_line(["fusermount3", "-V"]),
        "gocryptfs": first_line(["gocryptfs", "-version"]),
        "workdir": f"{workdir} ({fstype})",
        "transparent_hugepage": thp,
        "sealfs commit": commit,
    }


def proc_meminfo(key: str) -> int | None:
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return None
