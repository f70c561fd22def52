"""`sealfs init STORE`: create a volume with a passphrase slot and a recovery slot."""

from __future__ import annotations

import argparse
import os
import sys

from sealfs.cli.secrets import get_passphrase
from sealfs.errors import ConfigError
from sealfs.keys.kdf import MIN_MEMORY_KIB, Argon2Params, calibrate
from sealfs.keys.recovery import format_recovery_key, generate_recovery_key
from sealfs.store.url import open_store
from sealfs.volume.loader import create_volume


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("init", help="create a new encrypted volume in a store")
    p.add_argument("store", help="local directory or file:// URL")
    p.add_argument("--passphrase-file", help="read the passphrase from this file")
    p.add_argument(
        "--recovery-key-file", help="write the recovery key to this new file instead of printing it"
    )
    p.add_argument(
        "--kdf-memory",
        type=int,
        metavar="MIB",
        help=f"Argon2id memory in MiB (at least {MIN_MEMORY_KIB // 1024}; default: calibrated)",
    )
    p.add_argument(
        "--kdf-iterations",
        type=int,
        metavar="N",
        help="Argon2id passes (default: calibrated to about 0.5 s)",
    )
    p.set_defaults(run=run)


def _kdf(args: argparse.Namespace) -> Argon2Params:
    if args.kdf_memory is not None and args.kdf_memory * 1024 < MIN_MEMORY_KIB:
        raise ConfigError(
            f"--kdf-memory {args.kdf_memory} is below the minimum of {MIN_MEMORY_KIB // 1024} MiB"
        )
    if args.kdf_memory is not None and args.kdf_iterations is not None:
        return Argon2Params(args.kdf_memory * 1024, args.kdf_iterations, 4, os.urandom(16))
    if args.kdf_memory is not None:
        return calibrate(memory_kib=args.kdf_memory * 1024)
    params = calibrate()
    if args.kdf_iterations is not None:
        return Argon2Params(params.memory_kib, args.kdf_iterations, params.lanes, params.salt)
    return params


def _write_new_file(path: str, text: str) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ConfigError(
            f"{path} already exists: choose a new file for the recovery key"
        ) from None
    except OSError as exc:
        raise ConfigError(f"cannot create {path}: {exc.strerror}") from None
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")


def run(args: argparse.Namespace) -> int:
    store = open_store(args.store)
    passphrase = get_passphrase(args.passphrase_file, confirm=True)
    kdf = _kdf(args)
    recovery = generate_recovery_key()
    text = format_recovery_key(recovery)
    if args.recovery_key_file:
        _write_new_file(args.recovery_key_file, text)  # before the volume: never lose it
    header = create_volume(store, passphrase, kdf, recovery)
    print(f"Created sealfs volume {header.volume_id.hex()} in {store.describe()}")
    print(f"Argon2id: {kdf.memory_kib // 1024} MiB, {kdf.iterations} passes, {kdf.lanes} lanes")
    if args.recovery_key_file:
        print(f"Recovery key written to {args.recovery_key_file}: keep it apart from the store.")
    else:
        print("\nRecovery key (shown once; store it apart from the volume, it opens the volume):")
        print(f"\n    {text}\n", file=sys.stdout)
    return 0
