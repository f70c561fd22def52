"""`python -m benchmarks.unlock`: how long unlocking a volume header takes, per keyslot kind.

- passphrase: Argon2id at the cost `sealfs init` calibrates on this machine
  (about 0.5 s by design), or at --kdf-memory/--kdf-iterations;
- recovery: HKDF and one AES-GCM open;
- aws-kms: one KMS Decrypt over HTTP to a moto server on 127.0.0.1 (a real
  AWS round trip adds the network latency to the region), with a warm client
  and with a new client (what one `sealfs mount` pays: boto3 client set-up);
- pkcs11: log in to a SoftHSM2 token and AES-GCM decrypt on it (skipped if
  SoftHSM2 or python-pkcs11 is missing).

Each figure is the median of --repeat unlocks of the same header (the MAC check
included), after one warm-up.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import boto3
from moto.server import ThreadedMotoServer

from sealfs.keys.hsm import Pin, Pkcs11Unlocker, TokenKey, create_token_key, pkcs11_slot_maker
from sealfs.keys.kdf import Argon2Params, calibrate
from sealfs.keys.kms import KmsClients, KmsUnlocker, boto3_client_factory, kms_slot_maker
from sealfs.keys.slots import (
    Passphrase,
    RecoveryKey,
    Secret,
    create_header,
    new_master_key,
    new_volume_id,
    unlock,
)

PASSPHRASE = b"benchmark passphrase"
RECOVERY = os.urandom(32)
SOFTHSM_MODULES = (
    "/usr/lib/softhsm/libsofthsm2.so",
    "/usr/lib/x86_64-linux-gnu/softhsm/libsofthsm2.so",
    "/usr/lib/aarch64-linux-gnu/softhsm/libsofthsm2.so",
)


def median_seconds(fn: Callable[[], object], repeat: int) -> tuple[float, float, float]:
    """(median, min, max) seconds of fn over repeat runs, after one warm-up run."""
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), min(times), max(times)


def bench_unlock(header: bytes, secret: Callable[[], Secret], repeat: int) -> tuple[float, ...]:
    return median_seconds(lambda: unlock(header, secret()), repeat)


def passphrase_case(kdf: Argon2Params, repeat: int) -> tuple[str, tuple[float, ...]]:
    header = create_header(new_master_key(), new_volume_id(), PASSPHRASE, kdf, RECOVERY)
    label = f"passphrase (Argon2id {kdf.memory_kib // 1024} MiB, t={kdf.iterations}, p={kdf.lanes})"
    return label, bench_unlock(header, lambda: Passphrase(PASSPHRASE), repeat)


def recovery_case(repeat: int) -> tuple[str, tuple[float, ...]]:
    header = create_header(new_master_key(), new_volume_id(), None, None, RECOVERY)
    return "recovery key", bench_unlock(header, lambda: RecoveryKey(RECOVERY), repeat)


def kms_cases(repeat: int) -> list[tuple[str, tuple[float, ...]]]:
    for name, value in {
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        os.environ[name] = value
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        url = f"http://{host}:{port}"
        admin = boto3.client("kms", endpoint_url=url)
        key = admin.create_key()["KeyMetadata"]["Arn"]
        factory = boto3_client_factory(url)
        with KmsClients(factory) as clients:
            maker = kms_slot_maker(clients, key)
            header = create_header(new_master_key(), new_volume_id(), None, None, RECOVERY, [maker])
            warm = bench_unlock(header, lambda: KmsUnlocker(clients), repeat)

        def cold() -> None:
            with KmsClients(factory) as fresh:
                unlock(header, KmsUnlocker(fresh))

        cold_figures = median_seconds(cold, max(3, repeat // 4))
        admin.close()
    finally:
        server.stop()
    return [
        ("aws-kms on moto, warm client (one Decrypt)", warm),
        ("aws-kms on moto, new client (as a mount does)", cold_figures),
    ]


def pkcs11_case(repeat: int) -> tuple[str, tuple[float, ...]] | str:
    if importlib.util.find_spec("pkcs11") is None:
        return "skipped: python-pkcs11 is not installed"
    module = next((m for m in SOFTHSM_MODULES if os.path.exists(m)), None)
    if module is None or shutil.which("softhsm2-util") is None:
        return "skipped: SoftHSM2 is not installed (apt-get install softhsm2)"
    root = Path(tempfile.mkdtemp(prefix="sealfs-bench-hsm-"))
    try:
        (root / "tokens").mkdir()
        conf = root / "softhsm2.conf"
        conf.write_text(f"directories.tokendir = {root / 'tokens'}\nobjectstore.backend = file\n")
        os.environ["SOFTHSM2_CONF"] = str(conf)
        subprocess.run(
            ["softhsm2-util", "--init-token", "--free", "--label", "bench",
             "--pin", "1234", "--so-pin", "5678"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        pin = Pin(b"1234")
        where = TokenKey(module, "bench", "wrap")
        create_token_key(where, pin)
        header = create_header(
            new_master_key(), new_volume_id(), None, None, RECOVERY, [pkcs11_slot_maker(where, pin)]
        )
        figures = bench_unlock(header, lambda: Pkcs11Unlocker(pin, module), repeat)
        return "pkcs11 on SoftHSM2 (login + AES-GCM decrypt)", figures
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.unlock", description=__doc__)
    p.add_argument("--repeat", type=int, default=20, help="unlocks per figure (default 20)")
    p.add_argument("--kdf-memory", type=int, metavar="MIB", help="default: calibrated")
    p.add_argument("--kdf-iterations", type=int, metavar="N", help="default: calibrated")
    args = p.parse_args(argv)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request lines
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"{os.cpu_count()} CPUs, load average {load} (figures grow with the load)")
    if args.kdf_memory and args.kdf_iterations:
        kdf = Argon2Params(args.kdf_memory * 1024, args.kdf_iterations, 4, os.urandom(16))
    else:
        kdf = calibrate()
    rows: list[tuple[str, tuple[float, ...] | str]] = []
    rows.append(passphrase_case(kdf, max(3, args.repeat // 4)))
    rows.append(recovery_case(args.repeat * 10))
    rows.extend(kms_cases(args.repeat))
    hsm = pkcs11_case(args.repeat)
    rows.append(("pkcs11", hsm) if isinstance(hsm, str) else hsm)
    print(f"{'keyslot kind':<52} {'median':>10} {'min':>10} {'max':>10}")
    for label, figures in rows:
        if isinstance(figures, str):
            print(f"{label:<52} {figures}")
            continue
        med, lo, hi = (f"{x * 1000:.2f} ms" for x in figures)
        print(f"{label:<52} {med:>10} {lo:>10} {hi:>10}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
