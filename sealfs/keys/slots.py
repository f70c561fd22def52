"""Keyslots: wrap the master key under a secret, and unlock a volume with one.

Each slot wraps the same random master key with AES-256-GCM under a key derived
from its secret (Argon2id for a passphrase, HKDF for a 32-byte recovery key).
The slot's identity (volume id, slot id, kind, params) is the associated data,
so a slot copied from another volume, renumbered or with edited params does not
open. After a slot opens, the header MAC is checked with a master-key subkey,
so any other edit of the header (a swapped slot, a lowered KDF cost) is refused.

Secrets that live outside sealfs (an AWS KMS key, a PKCS#11 token key) are
SlotOpeners: sealfs.keys.kms and sealfs.keys.hsm implement them, and unlock
tries every slot of the opener's kind. New slots come from SlotMakers.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias

from sealfs.crypto import aead
from sealfs.crypto.subkeys import (
    MASTER_KEY_SIZE,
    VOLUME_ID_SIZE,
    Subkeys,
    derive_subkeys,
    hkdf_sha256,
)
from sealfs.errors import (
    FormatError,
    IntegrityError,
    KeyUnavailableError,
    NoSlotOfKindError,
    WrongKeyError,
)
from sealfs.keys.header import (
    FORMAT_VERSION,
    Keyslot,
    VolumeHeader,
    decode_header,
    encode_header,
    pack_canonical,
    verify_header_mac,
)
from sealfs.keys.kdf import Argon2Params, check_params, derive_key

RECOVERY_KEY_SIZE = 32
KIND_PASSPHRASE = "passphrase"  # noqa: S105 (a slot kind name, not a password)
KIND_RECOVERY = "recovery"
KIND_AWS_KMS = "aws-kms"
KIND_PKCS11 = "pkcs11"
# The kinds this build can open; slots of other kinds decode but are never tried.
KNOWN_KINDS = frozenset({KIND_PASSPHRASE, KIND_RECOVERY, KIND_AWS_KMS, KIND_PKCS11})
SLOT_AD_PREFIX = b"sealfs/v1/keyslot"
RECOVERY_INFO = b"sealfs/v1/recovery-slot"
KDF_ARGON2ID = "argon2id"
_PASSPHRASE_PARAM_KEYS = frozenset({"kdf", "m", "t", "p", "salt"})


@dataclass(frozen=True)
class Passphrase:
    """A passphrase as bytes (the caller chooses the text encoding)."""

    value: bytes = field(repr=False)


@dataclass(frozen=True)
class RecoveryKey:
    """A raw 32-byte recovery key (parse the text form with parse_recovery_key)."""

    value: bytes = field(repr=False)


class SlotOpener(Protocol):
    """A secret held outside sealfs (a KMS key, a token key) that opens slots of one kind."""

    @property
    def kind(self) -> str:
        """The slot kind this opener tries."""
        ...

    def open_slot(self, slot: Keyslot, volume_id: bytes) -> bytes | None:
        """The unwrapped master key, or None if this slot does not open with this secret.

        Raises WrongKeyError (access denied, wrong PIN, wrong context) or
        KeyUnavailableError (key disabled, service or token unreachable), each
        with a one-line message naming the slot and the cause.
        """
        ...


# (slot id, master key, volume id) -> a new keyslot wrapping the master key.
SlotMaker: TypeAlias = Callable[[int, bytes, bytes], Keyslot]

Secret: TypeAlias = Passphrase | RecoveryKey | SlotOpener


@dataclass(frozen=True)
class Unlocked:
    """The result of a successful unlock: the verified header and the keys."""

    header: VolumeHeader
    master_key: bytes = field(repr=False)
    subkeys: Subkeys = field(repr=False)
    slot_id: int
    # What opened it, so that a rekey can wrap the new master key for the same secret.
    secret: Secret | None = field(default=None, repr=False, compare=False)


def new_master_key() -> bytes:
    """Return a fresh random 32-byte master key."""
    return os.urandom(MASTER_KEY_SIZE)


def new_volume_id() -> bytes:
    """Return a fresh random 16-byte volume id."""
    return os.urandom(VOLUME_ID_SIZE)


def slot_associated_data(
    volume_id: bytes, slot_id: int, kind: str, params: Mapping[str, Any]
) -> bytes:
    """AD binding a wrapped key to its volume, slot number, kind and parameters."""
    return (
        SLOT_AD_PREFIX
        + volume_id
        + slot_id.to_bytes(4, "big")
        + kind.encode("utf-8")
        + pack_canonical(params)
    )


def _argon2_params_to_slot(params: Argon2Params) -> dict[str, Any]:
    return {
        "kdf": KDF_ARGON2ID,
        "m": params.memory_kib,
        "t": params.iterations,
        "p": params.lanes,
        "salt": params.salt,
    }


def argon2_params_from_slot(slot: Keyslot) -> Argon2Params:
    """Read a passphrase slot's KDF params; FormatError if malformed, WeakKdfError if weak."""
    raw = slot.params
    if set(raw) != _PASSPHRASE_PARAM_KEYS or raw["kdf"] != KDF_ARGON2ID:
        raise FormatError(
            f"keyslot {slot.slot_id}: unsupported or malformed KDF parameters (sealfs.vol is"
            " damaged, or was written by a newer sealfs): restore sealfs.vol from a backup"
        )
    params = Argon2Params(raw["m"], raw["t"], raw["p"], raw["salt"])
    check_params(params)
    return params


def _wrap(
    wrapping_key: bytes,
    master_key: bytes,
    volume_id: bytes,
    *,
    slot_id: int,
    kind: str,
    params: Mapping[str, Any],
    nonce: bytes | None,
) -> Keyslot:
    if len(master_key) != MASTER_KEY_SIZE or len(volume_id) != VOLUME_ID_SIZE:
        raise ValueError("master key must be 32 bytes and volume id 16 bytes")
    ad = slot_associated_data(volume_id, slot_id, kind, params)
    sealed = aead.seal(wrapping_key, master_key, ad, nonce)
    return Keyslot(slot_id, kind, params, sealed[: aead.NONCE_SIZE], sealed[aead.NONCE_SIZE :])


def _unwrap(wrapping_key: bytes, slot: Keyslot, volume_id: bytes) -> bytes | None:
    """Return the master key, or None if this slot does not open with the key."""
    if len(slot.nonce) != aead.NONCE_SIZE or len(slot.wrapped_key) != MASTER_KEY_SIZE + 16:
        raise FormatError(f"keyslot {slot.slot_id}: wrapped key has the wrong size")
    ad = slot_associated_data(volume_id, slot.slot_id, slot.kind, slot.params)
    try:
        return aead.open_sealed(wrapping_key, slot.nonce + slot.wrapped_key, ad)
    except IntegrityError:
        return None


def _recovery_wrapping_key(recovery_key: bytes, volume_id: bytes) -> bytes:
    if len(recovery_key) != RECOVERY_KEY_SIZE:
        raise ValueError("recovery key must be 32 bytes")
    return hkdf_sha256(recovery_key, volume_id, RECOVERY_INFO, aead.KEY_SIZE)


def make_passphrase_slot(
    slot_id: int,
    master_key: bytes,
    volume_id: bytes,
    passphrase: bytes,
    params: Argon2Params,
    *,
    nonce: bytes | None = None,
) -> Keyslot:
    """Wrap master_key under Argon2id(passphrase). Runs the KDF (slow by design).

    Raises WeakKdfError/FormatError for unacceptable params. nonce is for
    golden tests only.
    """
    wrapping_key = derive_key(passphrase, params)
    return _wrap(
        wrapping_key,
        master_key,
        volume_id,
        slot_id=slot_id,
        kind=KIND_PASSPHRASE,
        params=_argon2_params_to_slot(params),
        nonce=nonce,
    )


def make_recovery_slot(
    slot_id: int,
    master_key: bytes,
    volume_id: bytes,
    recovery_key: bytes,
    *,
    nonce: bytes | None = None,
) -> Keyslot:
    """Wrap master_key under HKDF(recovery_key). nonce is for golden tests only."""
    wrapping_key = _recovery_wrapping_key(recovery_key, volume_id)
    return _wrap(
        wrapping_key,
        master_key,
        volume_id,
        slot_id=slot_id,
        kind=KIND_RECOVERY,
        params={},
        nonce=nonce,
    )


def passphrase_slot_maker(passphrase: bytes, params: Argon2Params) -> SlotMaker:
    """A SlotMaker for a passphrase slot (runs Argon2id when called)."""

    def make(slot_id: int, master_key: bytes, volume_id: bytes) -> Keyslot:
        return make_passphrase_slot(slot_id, master_key, volume_id, passphrase, params)

    return make


def recovery_slot_maker(recovery_key: bytes) -> SlotMaker:
    """A SlotMaker for a recovery-key slot."""

    def make(slot_id: int, master_key: bytes, volume_id: bytes) -> Keyslot:
        return make_recovery_slot(slot_id, master_key, volume_id, recovery_key)

    return make


def create_header(
    master_key: bytes,
    volume_id: bytes,
    passphrase: bytes | None,
    kdf: Argon2Params | None,
    recovery_key: bytes,
    extra_slots: Sequence[SlotMaker] = (),
) -> bytes:
    """Return the encoded header of a new volume.

    Slots, numbered from 0 in this order: passphrase (unless passphrase is
    None), recovery, then extra_slots (KMS, PKCS#11). A maker that fails
    raises before anything is returned.
    """
    makers: list[SlotMaker] = []
    if passphrase is not None:
        if kdf is None:
            raise ValueError("a passphrase slot needs KDF parameters")
        makers.append(passphrase_slot_maker(passphrase, kdf))
    makers += [recovery_slot_maker(recovery_key), *extra_slots]
    slots = tuple(make(i, master_key, volume_id) for i, make in enumerate(makers))
    header = VolumeHeader(FORMAT_VERSION, volume_id, time.time_ns(), slots)
    return encode_header(header, derive_subkeys(master_key, volume_id).header_mac_key)


def _try_slots(header: VolumeHeader, secret: Passphrase | RecoveryKey) -> tuple[int, bytes] | None:
    """Return (slot id, master key) from the first matching slot that opens.

    NoSlotOfKindError, naming the slots there are, if none is of the secret's kind:
    once `key remove` or a rekey's --drop-slot took the last one, a right passphrase
    was said to be wrong, and the operator hunted for a typo."""
    kind = _kind_of(secret)
    slots = [s for s in header.slots if s.kind == kind]
    if not slots:
        held = ", ".join(f"{slot.slot_id} {slot.kind}" for slot in header.slots)
        raise NoSlotOfKindError(
            f"the volume has no {kind} keyslot (its keyslots: {held}): unlock with one of those"
        )
    if isinstance(secret, Passphrase):
        for slot in slots:  # every slot's cost validated before Argon2 runs on any of them
            argon2_params_from_slot(slot)
    for slot in slots:
        master_key = _open_slot(slot, header.volume_id, secret)
        if master_key is not None:
            return slot.slot_id, master_key
    return None


def opens_slot(slot: Keyslot, header: VolumeHeader, secret: Passphrase | RecoveryKey) -> bool:
    """Whether secret opens this one slot (an Argon2 run for a passphrase): a rekey re-makes
    a slot only from the secret that opens it, a second one given beside the one that
    unlocked included, never from a mistyped one that would lock its owner out."""
    return slot.kind == _kind_of(secret) and _open_slot(slot, header.volume_id, secret) is not None


def _kind_of(secret: Passphrase | RecoveryKey) -> str:
    return KIND_PASSPHRASE if isinstance(secret, Passphrase) else KIND_RECOVERY


def _open_slot(slot: Keyslot, volume_id: bytes, secret: Passphrase | RecoveryKey) -> bytes | None:
    """The master key slot (of the secret's kind) wraps, or None if secret does not open it."""
    if isinstance(secret, Passphrase):
        wrapping_key = derive_key(secret.value, argon2_params_from_slot(slot))
    else:
        wrapping_key = _recovery_wrapping_key(secret.value, volume_id)
    return _unwrap(wrapping_key, slot, volume_id)


def _try_opener(header: VolumeHeader, opener: SlotOpener) -> tuple[int, bytes]:
    """Try every slot of the opener's kind in order; the first that opens wins.

    If none opens, re-raise the cause (one slot) or all causes on one line.
    """
    slots = [s for s in header.slots if s.kind == opener.kind]
    if not slots:
        raise WrongKeyError(f"the volume has no {opener.kind} keyslot")
    errors: list[WrongKeyError | KeyUnavailableError] = []
    for slot in slots:
        try:
            master_key = opener.open_slot(slot, header.volume_id)
        except (WrongKeyError, KeyUnavailableError) as exc:
            errors.append(exc)
            continue
        if master_key is None:
            continue
        if len(master_key) != MASTER_KEY_SIZE:
            raise IntegrityError(f"keyslot {slot.slot_id}: unwrapped key has the wrong size")
        return slot.slot_id, master_key
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise type(errors[0])("; ".join(str(e) for e in errors))
    raise WrongKeyError(f"no {opener.kind} keyslot opens with this key")


def unlock(header_bytes: bytes, secret: Secret) -> Unlocked:
    """Open the volume header with secret and verify it; return the keys.

    Raises FormatError/UnsupportedVersionError (malformed header), WeakKdfError
    (a passphrase slot's KDF cost is below the minimum; checked before any
    Argon2 run), WrongKeyError (no slot of the secret's kind opens with it),
    KeyUnavailableError (a KMS key or token could not be used) and
    IntegrityError (a slot opened but the header MAC does not match).
    """
    header = decode_header(header_bytes)
    if isinstance(secret, Passphrase | RecoveryKey):
        opened = _try_slots(header, secret)
        if opened is None:
            if isinstance(secret, Passphrase):
                raise WrongKeyError(
                    # A damaged slot fails as a wrong passphrase does; only a slot that
                    # opens can check the header's MAC, which the recovery key's then does.
                    "wrong passphrase: no keyslot opens with it (check the passphrase or its file,"
                    " or unlock with --recovery-key-file, which also tells whether sealfs.vol"
                    " is damaged)"
                )
            raise WrongKeyError(
                "wrong recovery key: no keyslot opens with it (is it another volume's? check"
                " the file, or unlock with --passphrase-file)"
            )
    else:
        opened = _try_opener(header, secret)
    slot_id, master_key = opened
    subkeys = derive_subkeys(master_key, header.volume_id)
    verify_header_mac(header_bytes, subkeys.header_mac_key)
    return Unlocked(header, master_key, subkeys, slot_id, secret)
