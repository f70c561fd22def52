"""Opening a store and unlocking its volume from command-line options."""

from __future__ import annotations

import argparse
from pathlib import Path

from sealfs.cli.secrets import get_passphrase, read_secret_file
from sealfs.cli.units import parse_size
from sealfs.keys.recovery import parse_recovery_key
from sealfs.keys.slots import Passphrase, RecoveryKey, Secret
from sealfs.store.base import ObjectStore
from sealfs.store.url import open_store
from sealfs.volume.loader import Loaded, open_volume, read_header


def add_unlock_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--passphrase-file", help="read the passphrase from this file")
    p.add_argument("--recovery-key-file", help="unlock with the recovery key in this file")


def add_cache_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cache-dir", help="keep a cache of sealed chunks here (off by default for local stores)"
    )
    p.add_argument(
        "--cache-size", default="1G", help="upper bound of the cache directory (default 1G)"
    )


def secret_from(args: argparse.Namespace) -> Secret:
    if args.recovery_key_file:
        text = read_secret_file(args.recovery_key_file, "recovery key").decode(errors="replace")
        return RecoveryKey(parse_recovery_key(text))
    return Passphrase(get_passphrase(args.passphrase_file, confirm=False))


def store_from(args: argparse.Namespace) -> ObjectStore:
    cache_dir = getattr(args, "cache_dir", None)
    size = parse_size(getattr(args, "cache_size", "1G"))
    return open_store(
        args.store, cache_dir=Path(cache_dir) if cache_dir else None, cache_bytes=size
    )


def unlock_store(args: argparse.Namespace) -> Loaded:
    """Open, unlock and load the volume the arguments name (errors are typed)."""
    store = store_from(args)
    read_header(store)  # "not a volume" before asking for a passphrase
    return open_volume(store, secret_from(args))
