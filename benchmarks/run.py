"""`python -m benchmarks.run`: sealfs against a plain directory and gocryptfs, side by side.

Prints the command line and machine facts, runs the selected benchmarks
(each on fresh filesystems), then one table of every figure with its ratio
to the plain directory and to gocryptfs and, where sealfs has a target,
PASS or MISS. Figures also go to WORKDIR/results-<time>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path

from rich.markup import escape

from benchmarks.cases import BENCHMARKS, QUICK, Context, Sizes
from benchmarks.report import Figure, console, save, table
from benchmarks.targets import GOCRYPTFS, ORDER, SEALFS
from benchmarks.util import is_mounted, lazy_unmount, log, machine_facts, pids_matching


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__)
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run of a few minutes")
    p.add_argument(
        "--only", action="append", default=[], metavar="NAME",
        help=f"run only these benchmarks (repeat or comma-separate): {', '.join(BENCHMARKS)}",
    )  # fmt: skip
    p.add_argument(
        "--targets", default=",".join(ORDER),
        help=f"filesystems to compare (default {','.join(ORDER)})",
    )  # fmt: skip
    p.add_argument("--workdir", default="/tmp/sealfs-bench", help="where volumes and data go")
    p.add_argument("--seed", type=int, default=1, help="seed of the generated data")
    p.add_argument(
        "--profile", action="store_true",
        help="record py-spy flame graphs of the sealfs daemon into WORKDIR/profiles",
    )  # fmt: skip
    args = p.parse_args(argv)
    names = [n.strip() for item in args.only for n in item.split(",") if n.strip()]
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        p.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    args.selected = names or list(BENCHMARKS)
    args.target_list = tuple(t for t in ORDER if t in args.targets.split(","))
    if SEALFS not in args.target_list:
        p.error("--targets must include sealfs")
    return args


def preflight(workdir: Path, targets: tuple[str, ...]) -> None:
    if os.geteuid() != 0:
        log("WARNING: not root: cannot drop the page cache, so 'cold' reads are not cold")
    for tool in ("fusermount3", "cp", "find", "du"):
        if shutil.which(tool) is None:
            raise SystemExit(f"benchmarks: {tool} is required")
    if GOCRYPTFS in targets and shutil.which("gocryptfs") is None:
        raise SystemExit("benchmarks: gocryptfs is not installed (scripts/bench installs it)")
    clear_leftovers(workdir)


def clear_leftovers(workdir: Path) -> None:
    """Unmount and kill whatever an interrupted earlier run left under the work dir."""
    targets = workdir / "targets"
    if not targets.is_dir():
        return
    for root in targets.iterdir():
        mnt = root / "mnt"
        if is_mounted(mnt):
            log(f"removing a stale mount at {mnt}")
            lazy_unmount(mnt)
        for needle in (str(root / "store"), str(root / "cipher")):
            for pid in pids_matching(needle):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _terminate)
    con = console()
    exe = os.path.relpath(sys.executable) if not sys.executable.startswith("/usr") else "python3"
    command = shlex.join([exe, "-m", "benchmarks.run", *argv])
    facts = machine_facts(workdir)
    con.print(f"[bold]sealfs benchmarks[/]  {time.strftime('%Y-%m-%d %H:%M:%S')}")
    con.print(f"command: {command}")
    for key, value in facts.items():
        con.print(f"  {key:>20}: {escape(value)}")
    con.print(f"  {'load average':>20}: {_loadavg()}")
    sizes = QUICK if args.quick else Sizes()
    con.print(f"  {'sizes':>20}: {sizes}")
    con.print(f"  {'benchmarks':>20}: {', '.join(args.selected)}; targets: "
              f"{', '.join(args.target_list)}")  # fmt: skip
    if os.environ.pop("PYTHONDONTWRITEBYTECODE", None):
        # An installed sealfs has compiled bytecode; without it every `sealfs mount` would
        # compile its modules again and the mount-time figure would measure the compiler.
        con.print(f"  {'note':>20}: PYTHONDONTWRITEBYTECODE unset for the sealfs commands")
    preflight(workdir, args.target_list)
    ctx = Context(workdir, sizes, args.target_list, seed=args.seed, profile=args.profile)
    figures: list[Figure] = []
    failures: list[str] = []
    started = time.monotonic()
    try:
        for name in args.selected:
            log(f"=== {name} (load average {_loadavg().split()[0]})")
            t0 = time.monotonic()
            try:
                got = BENCHMARKS[name](ctx)
            except KeyboardInterrupt:
                raise
            except Exception as exc:
                failures.append(f"{name}: {exc}")
                log(f"{name} FAILED: {exc}")
                traceback.print_exc(file=sys.stdout)
                continue
            finally:
                for t in list(ctx.live):  # a benchmark that died left these
                    t.teardown()
                    ctx.live.remove(t)
            figures += got
            log(f"=== {name} done in {time.monotonic() - t0:.0f} s")
            con.print(table(got, f"{name}"))
    except KeyboardInterrupt:
        log("interrupted: tearing down")
        failures.append("interrupted")
    finally:
        for t in list(ctx.live):
            t.teardown()
        clear_leftovers(workdir)
    results = workdir / f"results-{time.strftime('%Y%m%d-%H%M%S')}.json"
    save(figures, facts, [command], results)
    con.print()
    kind = "quick" if args.quick else "full-size"
    minutes = (time.monotonic() - started) / 60
    title = f"sealfs vs plain directory vs gocryptfs ({kind} run, {minutes:.0f} min)"
    con.print(table(figures, title))
    con.print("ratios are sealfs's figure divided by the other's (↑ higher is better, "
              "↓ lower is better); sizes in MB = 10^6 bytes, MiB = 2^20 bytes")  # fmt: skip
    if args.quick:
        con.print("quick run: sizes are reduced, so absolute targets are only indicative")
    missed = [f for f in figures if f.passed is False]
    con.print(f"targets: {sum(f.passed is True for f in figures)} PASS, {len(missed)} MISS"
              + "".join(f"\n  MISS: {f.bench}: {f.name} ({f.target})" for f in missed))  # fmt: skip
    for failure in failures:
        con.print(f"[bold red]FAILED[/] {failure}")
    con.print(f"results saved to {results}")
    return 1 if failures else 0


def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return f.read().strip()


if __name__ == "__main__":
    sys.exit(main())
