"""Rekey: a new master key for a new key epoch, the old one kept until it is unused.

Slot changes never touch the master key, so they cannot revoke a secret that
may have leaked: whoever held it may have kept the master key. A rekey makes
a new random master key (epoch N+1), re-wraps it in the slots the operator
keeps, and stores the epoch-N master key wrapped under the new one, so that
objects sealed under epoch N stay readable while they are re-sealed. Once no
object of epoch N is left, the wrapped old key is dropped from the header and
nothing the volume holds opens with it any more.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from sealfs.crypto import aead
from sealfs.crypto.subkeys import INFO_PREFIX, Subkeys, derive_subkeys, hkdf_sha256
from sealfs.errors import ConfigError, IntegrityError
from sealfs.keys.header import (
    MAX_EPOCH,
    RetiredKey,
    VolumeHeader,
    decode_header,
    encode_header,
    first_free_slot_id,
    verify_header_mac,
)
from sealfs.keys.slots import KNOWN_KINDS, SlotMaker, Unlocked, new_master_key

RETIRED_WRAP_INFO = INFO_PREFIX + b"retired-key-wrap"
RETIRED_AD_PREFIX = b"sealfs/v1/retired-key"


def _retired_ad(volume_id: bytes, epoch: int) -> bytes:
    return RETIRED_AD_PREFIX + volume_id + epoch.to_bytes(2, "big")


def _wrapping_key(master_key: bytes, volume_id: bytes) -> bytes:
    return hkdf_sha256(master_key, volume_id, RETIRED_WRAP_INFO, aead.KEY_SIZE)


def wrap_retired(
    master_key: bytes,
    volume_id: bytes,
    old_epoch: int,
    old_master_key: bytes,
    *,
    nonce: bytes | None = None,
) -> RetiredKey:
    """The old epoch's master key sealed under the current one, bound to volume and epoch.

    nonce is for golden tests only.
    """
    sealed = aead.seal(
        _wrapping_key(master_key, volume_id),
        old_master_key,
        _retired_ad(volume_id, old_epoch),
        nonce,
    )
    return RetiredKey(old_epoch, sealed[: aead.NONCE_SIZE], sealed[aead.NONCE_SIZE :])


def open_retired(header: VolumeHeader, master_key: bytes) -> tuple[int, Subkeys] | None:
    """The retired epoch and its subkeys, or None when no rekey is in progress.

    Raises IntegrityError if the wrapped key does not open (the header MAC,
    checked at unlock, makes that a bug or a forged header).
    """
    retired = header.retired
    if retired is None:
        return None
    old = aead.open_sealed(
        _wrapping_key(master_key, header.volume_id),
        retired.nonce + retired.wrapped_key,
        _retired_ad(header.volume_id, retired.epoch),
    )
    return retired.epoch, derive_subkeys(old, header.volume_id)


def begin_rekey(
    unlocked: Unlocked, makers: Mapping[int, SlotMaker], new_master: bytes | None = None
) -> tuple[bytes, bytes]:
    """A header for epoch N+1: slots in `makers` re-made for a new master key, the rest gone.

    Returns (header bytes, new master key). Raises ConfigError when a rekey
    is still in progress, when epochs are exhausted, or when no slot this
    build can open would be left.
    """
    header = unlocked.header
    if header.retired is not None:
        raise ConfigError(
            f"a rekey to key epoch {header.data_epoch} is still in progress: run 'sealfs rekey'"
            " again to finish it"
        )
    if header.data_epoch >= MAX_EPOCH:
        raise ConfigError("the volume has used every key epoch: copy it to a new volume")
    kept = [s for s in header.slots if s.slot_id in makers]
    if not any(s.kind in KNOWN_KINDS for s in kept):
        raise ConfigError("a rekey must keep at least one keyslot this build can open")
    master = new_master or new_master_key()
    vid = header.volume_id
    new = dataclasses.replace(
        header,
        data_epoch=header.data_epoch + 1,
        slots=tuple(makers[s.slot_id](s.slot_id, master, vid) for s in kept),
        next_slot_id=first_free_slot_id(header),
        retired=wrap_retired(master, vid, header.data_epoch, unlocked.master_key),
    )
    return encode_header(new, derive_subkeys(master, vid).header_mac_key), master


def end_rekey(header_bytes: bytes, subkeys: Subkeys, epoch: int) -> bytes | None:
    """The header without its retired key, re-MACed; None if it holds none already.

    subkeys are epoch `epoch`'s: the header must verify under them and be at
    that epoch (else IntegrityError: another rekey or a forged header).
    """
    verify_header_mac(header_bytes, subkeys.header_mac_key)
    header = decode_header(header_bytes)
    if header.data_epoch != epoch:
        raise IntegrityError(f"the volume header is at key epoch {header.data_epoch}, not {epoch}")
    if header.retired is None:
        return None
    new = dataclasses.replace(header, retired=None)
    return encode_header(new, subkeys.header_mac_key)
