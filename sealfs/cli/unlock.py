"""Opening a store and unlocking its volume from command-line options."""

from __future__ import annotations

import argparse
from pathlib import Path

from sealfs.cli.keysource import add_headless_options, unlock_header
from sealfs.cli.paths import user_path
from sealfs.cli.seen import Recorded, SeenVolume
from sealfs.cli.units import parse_size, seconds
from sealfs.keys.header import decode_header
from sealfs.keys.slots import Unlocked
from sealfs.store.base import ObjectStore
from sealfs.store.url import check_local_directory, open_store
from sealfs.volume.loader import Loaded, load_unlocked, read_header

# A command someone waits for gives up on an unreachable store sooner than a mount,
# whose fsyncs ride out an outage (a mistyped endpoint kept `status` busy for 5 minutes).
COMMAND_STORE_TIMEOUT = 30.0


# What --store-timeout bounds: a command gives up; a mount's fsync fails and it goes on.
COMMAND_TIMEOUT_HELP = "how long to wait for an unreachable store before failing"
MOUNT_TIMEOUT_HELP = (
    "how long the mount, and then each fsync, waits for an unreachable store before"
    " failing (an fsync with EIO; commits resume when the store is back)"
)


def add_unlock_options(
    p: argparse.ArgumentParser,
    *,
    store_timeout: float = COMMAND_STORE_TIMEOUT,
    timeout_help: str = COMMAND_TIMEOUT_HELP,
) -> None:
    p.add_argument(
        "--passphrase-file",
        type=user_path,
        metavar="FILE",
        help="read the passphrase from this file (or SEALFS_PASSPHRASE_FILE=FILE, or the"
        " sealfs-passphrase systemd credential; default: ask on the terminal)",
    )
    p.add_argument(
        "--recovery-key-file",
        type=user_path,
        metavar="FILE",
        help="unlock with the recovery key in this file",
    )
    add_headless_options(p)  # --kms, --kms-key-id, --pkcs11, ... (rule: cli/keysource.py)
    add_s3_options(p, store_timeout=store_timeout, timeout_help=timeout_help)


def add_s3_options(
    p: argparse.ArgumentParser,
    *,
    store_timeout: float = COMMAND_STORE_TIMEOUT,
    timeout_help: str = COMMAND_TIMEOUT_HELP,
) -> None:
    """--store-timeout (a mount's default and meaning differ) and --s3-endpoint."""
    p.add_argument(
        "--store-timeout",
        type=float,
        default=store_timeout,
        metavar="SECONDS",
        help=f"{timeout_help} (default %(default).0f)",
    )
    p.add_argument(
        "--s3-endpoint",
        metavar="URL",
        help="S3 service URL for s3:// stores (default: AWS_ENDPOINT_URL_S3,"
        " AWS_ENDPOINT_URL, else AWS S3);"
        " credentials come only from the environment, a profile or an instance role",
    )


DEFAULT_CACHE_SIZE = "1G"


def add_cache_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cache-dir",
        type=user_path,
        metavar="DIR",
        help="keep a cache of sealed chunks here (default: off for local stores;"
        " for S3 stores $XDG_CACHE_HOME/sealfs/<hash of the URL and endpoint>,"
        " ~/.cache without XDG_CACHE_HOME)",
    )
    p.add_argument(
        "--cache-size",
        metavar="SIZE",
        help="upper bound of the cache directory, in bytes or with K, M, G or T (binary)"
        f" (default {DEFAULT_CACHE_SIZE}; 0 turns the cache off)",
    )


def store_from(args: argparse.Namespace) -> ObjectStore:
    check_local_directory(args.store, existing=True)
    cache_dir = getattr(args, "cache_dir", None)
    size = parse_size(getattr(args, "cache_size", None) or DEFAULT_CACHE_SIZE)
    return open_store(
        args.store,
        cache_dir=Path(cache_dir) if cache_dir else None,
        cache_bytes=size,
        s3_endpoint=getattr(args, "s3_endpoint", None),
        store_timeout=seconds(args.store_timeout, "--store-timeout"),
        direct_reads=not getattr(args, "read_only", False),
    )


def unlock_seen(
    args: argparse.Namespace, *, accepting: bool = False
) -> tuple[Loaded, SeenVolume, Recorded | None, Unlocked]:
    """Open, unlock and load the volume the arguments name (errors are typed), with
    the volume's record at that store as read BEFORE the log is listed.

    A mount of the volume on this host (read-write, while a read-only mount or
    'status STORE' loads) commits, then records that generation. Read after the
    listing, the record could hold a generation committed since, which the load did
    not see: a store that is whole was refused as rolled back (exit 4), or shown as
    "behind". A record read first holds only generations committed before the
    listing, all of which the listing sees in a store that is whole.
    """
    store = store_from(args)
    header = read_header(store)  # "not a volume" before asking for a passphrase
    volume_id = decode_header(header).volume_id  # the bytes that unlock authenticates
    seen = SeenVolume.of(volume_id, args.store, store, accepting=accepting)
    recorded = seen.recorded()
    unlocked = unlock_header(args, header)
    return load_unlocked(store, unlocked), seen, recorded, unlocked
