"""`sealfs key {list,add,remove,passwd,rotate}`: manage a volume's keyslots.

Each change unlocks the header with any existing secret, builds a new header
(sealfs.keys.edit: re-MACed, never without a slot that opens) and replaces
`sealfs.vol` only if it is still the version that was read (put_if_match on
its etag): of two concurrent changes one wins and the other is told to retry.
No data object is read or written, so this works while the volume is mounted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

from sealfs.cli import init_cmd
from sealfs.cli.commands import COMMANDS
from sealfs.cli.keysource import (
    add_new_key_options,
    kms_clients,
    kms_maker,
    token_slot_maker,
    unlock_header,
)
from sealfs.cli.paths import check_key_file_outside_store, check_store_is_callers, user_path
from sealfs.cli.secrets import check_new_key_file, get_passphrase, secret_file_for_new_slot
from sealfs.cli.stdio import check_recovery_key_shown, print_recovery_key
from sealfs.cli.unlock import add_unlock_options, store_from
from sealfs.errors import ConfigError, FormatError
from sealfs.keys.edit import add_slot, find_slot, remove_slot, replace_slot
from sealfs.keys.header import Keyslot, VolumeHeader, decode_header
from sealfs.keys.hsm import params_from_slot as token_params
from sealfs.keys.kdf import Argon2Params
from sealfs.keys.kms import params_from_slot as kms_params
from sealfs.keys.recovery import format_recovery_key, generate_recovery_key
from sealfs.keys.slots import (
    KIND_AWS_KMS,
    KIND_PASSPHRASE,
    KIND_PKCS11,
    KIND_RECOVERY,
    KNOWN_KINDS,
    Passphrase,
    SlotMaker,
    Unlocked,
    argon2_params_from_slot,
    opens_slot,
    passphrase_slot_maker,
    recovery_slot_maker,
)
from sealfs.store.base import ObjectStore
from sealfs.volume.header_io import HeaderVersion, read_header_version, write_header
from sealfs.volume.loader import read_header
from sealfs.wording import counted

ADD_KINDS = (KIND_PASSPHRASE, KIND_RECOVERY, KIND_AWS_KMS, KIND_PKCS11)


Edit = Callable[[Unlocked], bytes]


def change_header(
    store: ObjectStore, unlocker: Callable[[bytes], Unlocked], edit: Edit
) -> tuple[HeaderVersion, bytes]:
    """Read, unlock, edit and atomically replace the header; return (old, new)."""
    old = read_header_version(store)
    new = edit(unlocker(old.data))
    write_header(store, old, new)
    return old, new


# --- the commands


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    key = sub.add_parser("key", help=COMMANDS["key"].help)
    ksub = key.add_subparsers(dest="key_command", required=True, metavar="ACTION")

    p = ksub.add_parser("list", help="show the keyslots and their public parameters")
    _common(p)
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument(
        "--unverified",
        action="store_true",
        help="list without unlocking (the header's MAC is then not checked)",
    )
    p.set_defaults(run=run_list)

    p = ksub.add_parser("add", help="add a keyslot", conflict_handler="resolve")
    _common(p)
    p.add_argument("kind", choices=ADD_KINDS)
    _new_slot_options(p)
    p.set_defaults(run=run_add)

    p = ksub.add_parser("remove", help="remove a keyslot (never the last one)")
    _common(p)
    p.add_argument("slot", type=int, help="slot id (see 'sealfs key list')")
    p.set_defaults(run=run_remove)

    p = ksub.add_parser("passwd", help="set a new passphrase for a passphrase slot")
    _common(p)
    p.add_argument("slot", type=int, help="slot id (see 'sealfs key list')")
    _passphrase_options(p)
    p.set_defaults(run=run_passwd)

    p = ksub.add_parser(
        "rotate",
        help="re-wrap an aws-kms or pkcs11 slot under a new (or the current) key; no data touched",
        conflict_handler="resolve",
    )
    _common(p)
    p.add_argument("slot", type=int, help="slot id (see 'sealfs key list')")
    _rewrap_options(p)
    p.set_defaults(run=run_rotate)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", help="the volume's store (directory, file:// or s3:// URL)")
    add_unlock_options(p)  # --passphrase-file, --recovery-key-file, --kms, --pkcs11, ...


def _passphrase_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--new-passphrase-file",
        type=user_path,
        metavar="FILE",
        help="read the new passphrase from this file (or SEALFS_NEW_PASSPHRASE_FILE=FILE,"
        " or the sealfs-new-passphrase systemd credential; else asked twice)",
    )
    init_cmd.add_kdf_options(p)


def _new_slot_options(p: argparse.ArgumentParser) -> None:
    _passphrase_options(p)
    p.add_argument(
        "--new-recovery-key-file",
        type=user_path,
        metavar="FILE",
        help="write the new recovery key to this new file instead of printing it",
    )
    _rewrap_options(p)


def _rewrap_options(p: argparse.ArgumentParser) -> None:
    """Where an aws-kms or pkcs11 slot's key comes from (add, and rotate)."""
    p.add_argument(
        "--kms-key-id",
        metavar="ARN|ALIAS",
        help="the KMS key of the new aws-kms slot (rotate: default the slot's current key)",
    )
    add_new_key_options(p)


def _unlocker(args: argparse.Namespace, *, pin: bool) -> Callable[[bytes], Unlocked]:
    return lambda data: unlock_header(args, data, use_kms_pin=pin)


def _safe(text: object) -> str:
    """Header strings are untrusted: never let them drive the terminal."""
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in str(text))


def describe_slot(slot: Keyslot) -> str:
    """Public parameters only: never a secret or wrapped key."""
    p = slot.params
    try:
        if slot.kind == KIND_PASSPHRASE:
            passes, lanes = counted(p["t"], "pass"), counted(p["p"], "lane")
            return f"argon2id, {p['m'] // 1024} MiB, {passes}, {lanes}"
        if slot.kind == KIND_RECOVERY:
            return "recovery key"
        if slot.kind == KIND_AWS_KMS:
            kp = kms_params(slot)
            named = "" if kp.key_id == kp.key_arn else f"{_safe(kp.key_id)} = "
            return f"KMS key {named}{_safe(kp.key_arn)} ({_safe(kp.region)})"
        if slot.kind == KIND_PKCS11:
            tp = token_params(slot)
            return f"token {_safe(tp.token)!r}, key {_safe(tp.key)!r}, module {_safe(tp.module)}"
    except (KeyError, TypeError, ValueError, FormatError):
        return "malformed parameters"
    return "a kind this build cannot open"


def _public(value: Any) -> Any:
    """Params as JSON: bytes as hex at every depth (a kind this build does not know, or
    an unverified header, may nest them)."""
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dict):
        return {k: _public(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_public(v) for v in value]
    return value


def _slot_json(slot: Keyslot, used: int | None) -> dict[str, Any]:
    return {
        "id": slot.slot_id,
        "kind": slot.kind,
        "params": _public(dict(slot.params)),
        "supported": slot.kind in KNOWN_KINDS,
        "unlocked_with": slot.slot_id == used,
    }


def run_list(args: argparse.Namespace) -> int:
    store = store_from(args)
    data = read_header(store)
    used: int | None = None
    if args.unverified:
        header: VolumeHeader = decode_header(data)
    else:
        unlocked = unlock_header(args, data)
        header, used = unlocked.header, unlocked.slot_id
    if args.json:
        out = {
            "volume_id": header.volume_id.hex(),
            "verified": not args.unverified,
            "key_epoch": header.data_epoch,
            "rekey_from_epoch": None if header.retired is None else header.retired.epoch,
            "slots": [_slot_json(s, used) for s in header.slots],
        }
        print(json.dumps(out, indent=2))
        return 0
    print(f"volume {header.volume_id.hex()}" + ("  (UNVERIFIED)" if args.unverified else ""))
    rekey = (
        ""
        if header.retired is None
        else f" (rekey from epoch {header.retired.epoch} unfinished: a writable mount or"
        " 'sealfs rekey' finishes it)"
    )
    print(f"key epoch {header.data_epoch}{rekey}")
    print(f"{'SLOT':>4}  {'KIND':<10}  DETAILS")
    for slot in header.slots:
        mark = "  (unlocked with this slot)" if slot.slot_id == used else ""
        print(f"{slot.slot_id:>4}  {_safe(slot.kind):<10}  {describe_slot(slot)}{mark}")
    return 0


def _kdf_maker(
    args: argparse.Namespace,
    header: VolumeHeader,
    params: Argon2Params | None = None,
    replacing: int | None = None,
) -> SlotMaker:
    """A passphrase slot's maker, for the new passphrase; params: its Argon2 cost, else
    the --kdf-* options' (or the calibrated default).

    ConfigError if the new passphrase already opens another passphrase slot (one
    Argon2 run per such slot): a second slot for it added nothing but a slot to keep
    track of, and a passwd of one left the old passphrase working through the other.
    """
    passphrase = get_passphrase(args.new_passphrase_file, confirm=True, new=True)
    for slot in header.slots:
        if slot.slot_id != replacing and opens_slot(slot, header, Passphrase(passphrase)):
            raise ConfigError(
                f"that passphrase already opens keyslot {slot.slot_id}: nothing was changed"
                " (choose another passphrase)"
            )
    return passphrase_slot_maker(passphrase, params or init_cmd.kdf_params(args))


def _passwd_params(args: argparse.Namespace, slot: Keyslot) -> Argon2Params:
    """The cost of a slot passwd makes: the old slot's, with a new salt, unless --kdf-*
    says otherwise. The calibrated default took a slot made with --kdf-memory 64 (for a
    small host's MemoryMax) to 256 MiB without a word, as rekey never does."""
    if args.kdf_memory is not None:
        return init_cmd.kdf_params(args)
    old = argon2_params_from_slot(slot)
    passes = old.iterations if args.kdf_iterations is None else args.kdf_iterations
    return dataclasses.replace(old, iterations=passes, salt=os.urandom(16))


def run_add(args: argparse.Namespace) -> int:
    check_store_is_callers(args.store)
    init_cmd.check_kdf_options(args)  # before the unlock: a bad option fails at once
    if args.kind == KIND_RECOVERY:
        check_key_file_outside_store(args.new_recovery_key_file, args.store)
        check_recovery_key_shown(args.new_recovery_key_file, "--new-recovery-key-file")
        check_new_key_file(args.new_recovery_key_file)
    store = store_from(args)
    unlocker = _unlocker(args, pin=False)
    if args.kind == KIND_RECOVERY:
        recovery = generate_recovery_key()
        text = format_recovery_key(recovery)
        with secret_file_for_new_slot(
            args.new_recovery_key_file, text, lambda: init_cmd.recovery_slot_stored(store, recovery)
        ):
            _, new = change_header(
                store, unlocker, lambda u: add_slot(u, recovery_slot_maker(recovery))[0]
            )
        slot = decode_header(new).slots[-1]
        print(f"Added keyslot {slot.slot_id} (recovery).")
        if args.new_recovery_key_file:
            print(f"Recovery key written to {args.new_recovery_key_file}: keep it apart.")
        else:
            print_recovery_key(
                text,
                "Recovery key (shown once; store it apart from the volume)",
                "--new-recovery-key-file",
            )
        return 0
    with kms_clients(args) as clients:
        maker: SlotMaker | None = None

        def edit(unlocked: Unlocked) -> bytes:
            nonlocal maker
            if maker is None:  # asked after the unlock: a wrong secret fails first
                if args.kind == KIND_PASSPHRASE:
                    maker = _kdf_maker(args, unlocked.header)
                elif args.kind == KIND_AWS_KMS:
                    maker = kms_maker(clients, args.kms_key_id, args.kms_region)
                else:
                    maker = token_slot_maker(args)
            return add_slot(unlocked, maker)[0]

        _, new = change_header(store, unlocker, edit)
    slot = decode_header(new).slots[-1]
    print(f"Added keyslot {slot.slot_id} ({slot.kind}): {describe_slot(slot)}")
    return 0


def run_remove(args: argparse.Namespace) -> int:
    check_store_is_callers(args.store)
    store = store_from(args)
    removed: list[Keyslot] = []

    def edit(unlocked: Unlocked) -> bytes:
        removed.append(find_slot(unlocked.header, args.slot))
        return remove_slot(unlocked, args.slot)

    change_header(store, _unlocker(args, pin=True), edit)
    print(f"Removed keyslot {args.slot} ({removed[0].kind}).")
    return 0


def run_passwd(args: argparse.Namespace) -> int:
    check_store_is_callers(args.store)
    init_cmd.check_kdf_options(args)  # before the unlock: a bad option fails at once
    store = store_from(args)

    def edit(unlocked: Unlocked) -> bytes:
        slot = find_slot(unlocked.header, args.slot)
        if slot.kind != KIND_PASSPHRASE:
            raise ConfigError(
                f"keyslot {args.slot} ({_safe(slot.kind)}) is not a passphrase slot: passwd"
                " changes passphrase slots (use 'sealfs key rotate' for aws-kms and pkcs11"
                " slots)"
            )
        maker = _kdf_maker(args, unlocked.header, _passwd_params(args, slot), args.slot)
        return replace_slot(unlocked, args.slot, maker)[0]

    _, new = change_header(store, _unlocker(args, pin=True), edit)
    slot = find_slot(decode_header(new), args.slot)
    print(f"New passphrase set for keyslot {args.slot}: {describe_slot(slot)}")
    return 0


def run_rotate(args: argparse.Namespace) -> int:
    check_store_is_callers(args.store)
    store = store_from(args)
    with kms_clients(args) as clients:

        def edit(unlocked: Unlocked) -> bytes:
            slot = find_slot(unlocked.header, args.slot)
            if slot.kind == KIND_AWS_KMS:
                old = kms_params(slot)
                key_id = args.kms_key_id or old.key_id
                region = args.kms_region or (None if args.kms_key_id else old.region)
                maker = kms_maker(clients, key_id, region)
            elif slot.kind == KIND_PKCS11:
                maker = token_slot_maker(args, default=token_params(slot))
            else:
                raise ConfigError(
                    f"keyslot {args.slot} ({_safe(slot.kind)}) is not an aws-kms or pkcs11 slot:"
                    " rotate re-wraps those (use 'sealfs key passwd' for a passphrase, or add"
                    " a new recovery slot and remove the old one)"
                )
            return replace_slot(unlocked, args.slot, maker)[0]

        _, new = change_header(store, _unlocker(args, pin=False), edit)
    slot = find_slot(decode_header(new), args.slot)
    print(f"Rotated keyslot {args.slot}: {describe_slot(slot)}")
    return 0
