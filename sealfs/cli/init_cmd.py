"""`sealfs init STORE`: create a volume with a passphrase slot and a recovery slot."""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from sealfs.cli.commands import COMMANDS
from sealfs.cli.keysource import add_init_key_options, init_slot_makers, passphrase_configured
from sealfs.cli.paths import check_key_file_outside_store, user_path
from sealfs.cli.secrets import check_new_key_file, get_passphrase, secret_file_for_new_slot
from sealfs.cli.stdio import check_recovery_key_shown, print_recovery_key
from sealfs.cli.units import seconds
from sealfs.cli.unlock import add_s3_options
from sealfs.errors import ConfigError, NotAVolumeError, WrongKeyError
from sealfs.keys.kdf import (
    MAX_ITERATIONS,
    MAX_MEMORY_KIB,
    MIN_ITERATIONS,
    MIN_MEMORY_KIB,
    Argon2Params,
    calibrate,
)
from sealfs.keys.recovery import format_recovery_key, generate_recovery_key
from sealfs.keys.slots import RecoveryKey, unlock
from sealfs.store.base import ObjectStore, warn_if_versioned
from sealfs.store.url import (
    check_local_directory,
    is_local_url,
    is_s3_url,
    local_path,
    open_store,
)
from sealfs.volume.loader import check_store_is_empty, create_volume, read_header


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("init", help=COMMANDS["init"].help)
    p.add_argument("store", help="local directory, file:// URL or s3://bucket/prefix")
    add_s3_options(p)
    p.add_argument(
        "--passphrase-file",
        type=user_path,
        metavar="FILE",
        help="read the passphrase from this file (or SEALFS_PASSPHRASE_FILE=FILE, or the"
        " sealfs-passphrase systemd credential; default: asked twice on the terminal)",
    )
    p.add_argument(
        "--recovery-key-file",
        type=user_path,
        metavar="FILE",
        help="write the recovery key to this new file instead of printing it",
    )
    add_kdf_options(p)
    add_init_key_options(p)  # --kms-key-id, --pkcs11-* (sealfs/cli/keysource.py)
    p.set_defaults(run=run)


def add_kdf_options(p: argparse.ArgumentParser) -> None:
    """Argon2id cost options, shared by init and the passphrase key commands."""
    p.add_argument(
        "--kdf-memory",
        type=int,
        metavar="MIB",
        help=f"Argon2id memory in MiB ({MIN_MEMORY_KIB // 1024} to {MAX_MEMORY_KIB // 1024};"
        " default: calibrated)",
    )
    p.add_argument(
        "--kdf-iterations",
        type=int,
        metavar="N",
        help=f"Argon2id passes ({MIN_ITERATIONS} to {MAX_ITERATIONS};"
        " default: calibrated to about 0.5 s)",
    )


def check_kdf_options(args: argparse.Namespace) -> None:
    """Refuse KDF options outside the limits kdf.check_params enforces. Raises ConfigError.

    Checked before any prompt, unlock or calibration: kdf.py would refuse the same
    values later, but as a weak or hostile volume header (exit 4, no option named),
    since there the parameters come from an untrusted store, not from the user.
    """
    low, high = MIN_MEMORY_KIB // 1024, MAX_MEMORY_KIB // 1024
    if args.kdf_memory is not None and not low <= args.kdf_memory <= high:
        raise ConfigError(
            f"--kdf-memory must be between {low} and {high} MiB, not {args.kdf_memory}"
        )
    if args.kdf_iterations is not None and not (
        MIN_ITERATIONS <= args.kdf_iterations <= MAX_ITERATIONS
    ):
        raise ConfigError(
            f"--kdf-iterations must be between {MIN_ITERATIONS} and {MAX_ITERATIONS},"
            f" not {args.kdf_iterations}"
        )


def kdf_params(args: argparse.Namespace) -> Argon2Params:
    """The Argon2id parameters the options of add_kdf_options ask for, once
    check_kdf_options has passed them (every command does so before it prompts)."""
    if args.kdf_memory is not None and args.kdf_iterations is not None:
        return Argon2Params(args.kdf_memory * 1024, args.kdf_iterations, 4, os.urandom(16))
    if args.kdf_memory is not None:  # the memory asked for; only the passes calibrated
        return calibrate(memory_kib=args.kdf_memory * 1024, fixed_memory=True)
    params = calibrate()
    if args.kdf_iterations is not None:
        return Argon2Params(params.memory_kib, args.kdf_iterations, params.lanes, params.salt)
    return params


def run(args: argparse.Namespace) -> int:
    check_kdf_options(args)  # before the store is touched or a passphrase asked for
    check_local_directory(args.store, existing=False)
    check_key_file_outside_store(args.recovery_key_file, args.store)
    check_recovery_key_shown(args.recovery_key_file, "--recovery-key-file")
    check_new_key_file(args.recovery_key_file)
    with _made_dirs_removed_on_failure(args.store):
        return _create(args)


def _create(args: argparse.Namespace) -> int:
    store = open_store(
        args.store,
        s3_endpoint=args.s3_endpoint,
        store_timeout=seconds(args.store_timeout, "--store-timeout"),
        default_cache=False,
    )
    check_store_is_empty(store)  # before any question, and before the probe writes to it
    if is_s3_url(args.store):
        from sealfs.store.s3 import probe_conditional_writes  # noqa: PLC0415 - boto3 is slow

        probe_conditional_writes(store)  # before any question: refuse an unsafe service at once
        warn_if_versioned(store)
    with init_slot_makers(args) as extra_slots:
        # With a KMS key or a token and no passphrase source: no passphrase slot.
        with_passphrase = not extra_slots or passphrase_configured(args)
        passphrase = get_passphrase(args.passphrase_file, confirm=True) if with_passphrase else None
        kdf = kdf_params(args) if with_passphrase else None
        recovery = generate_recovery_key()
        text = format_recovery_key(recovery)
        with secret_file_for_new_slot(
            args.recovery_key_file, text, lambda: recovery_slot_stored(store, recovery)
        ):
            header = create_volume(store, passphrase, kdf, recovery, extra_slots=extra_slots)
    print(f"Created sealfs volume {header.volume_id.hex()} in {store.describe()}")
    if kdf is not None:
        print(f"Argon2id: {kdf.memory_kib // 1024} MiB, {kdf.iterations} passes, {kdf.lanes} lanes")
    for slot in header.slots:
        print(f"Keyslot {slot.slot_id}: {slot.kind}")
    if args.recovery_key_file:
        print(f"Recovery key written to {args.recovery_key_file}: keep it apart from the store.")
    else:
        print_recovery_key(
            text,
            "Recovery key (shown once; store it apart from the volume, it opens the volume)",
            "--recovery-key-file",
        )
    return 0


@contextlib.contextmanager
def _made_dirs_removed_on_failure(url: str) -> Iterator[None]:
    """Remove the empty directories init made for a local store, if it fails.

    On a full disk init said "free space and retry", and left the store directory
    (with an empty l/) and the parents it had made for it: a path nobody asked for
    if the retry goes elsewhere. Only directories that did not exist before and are
    empty go; anything written in them (a header whose write may have landed) stays.
    """
    top = _highest_missing(local_path(url)) if is_local_url(url) else None
    try:
        yield
    except BaseException:
        if top is not None:
            for directory, _, _ in os.walk(top, topdown=False):
                with contextlib.suppress(OSError):  # not empty, or gone: left as it is
                    os.rmdir(directory)
        raise


def _highest_missing(path: Path) -> Path | None:
    """The topmost directory of path that does not exist yet; None if path exists."""
    top = None
    while not os.path.lexists(path) and path != path.parent:
        top, path = path, path.parent
    return top


def recovery_slot_stored(store: ObjectStore, recovery: bytes) -> bool:
    """Whether the store's header has a slot that this recovery key opens.

    Raises what reading the store raises: then nobody knows.
    """
    try:
        unlock(read_header(store), RecoveryKey(recovery))
    except (NotAVolumeError, WrongKeyError):
        return False
    return True
