"""Keyslot changes: a new header from an unlocked (MAC-verified) one.

Every function takes the Unlocked result of opening the current header, so a
change is only ever made by someone holding a valid secret, and returns the
new header bytes, re-MACed with the master key's header-mac subkey. The
master key, the volume id and every other slot stay as they were: no data is
touched. Writing the bytes back (atomically, if the header did not change
meanwhile) is the caller's job.

Rules: slot ids are never reused (the header's next_slot_id remembers the
highest ever given); the last slot cannot be removed, nor the last one of a
kind this build can open.
"""

from __future__ import annotations

import dataclasses

from sealfs.errors import ConfigError
from sealfs.keys.header import (
    MAX_SLOT_ID,
    MAX_SLOTS,
    Keyslot,
    VolumeHeader,
    encode_header,
    first_free_slot_id,
)
from sealfs.keys.slots import KNOWN_KINDS, SlotMaker, Unlocked


def find_slot(header: VolumeHeader, slot_id: int) -> Keyslot:
    """The slot with this id. Raises ConfigError naming the ids there are."""
    for slot in header.slots:
        if slot.slot_id == slot_id:
            return slot
    ids = ", ".join(str(s.slot_id) for s in header.slots)
    raise ConfigError(f"the volume has no keyslot {slot_id} (its slots are {ids})")


def _encode(unlocked: Unlocked, header: VolumeHeader) -> bytes:
    return encode_header(header, unlocked.subkeys.header_mac_key)


def add_slot(unlocked: Unlocked, maker: SlotMaker) -> tuple[bytes, Keyslot]:
    """Append a slot made by maker under a never-used id; return (header bytes, slot)."""
    header = unlocked.header
    if len(header.slots) >= MAX_SLOTS:
        raise ConfigError(f"the volume already has {MAX_SLOTS} keyslots: remove one first")
    slot_id = first_free_slot_id(header)
    if slot_id > MAX_SLOT_ID:
        raise ConfigError("keyslot ids are exhausted")
    slot = maker(slot_id, unlocked.master_key, header.volume_id)
    if slot.slot_id != slot_id:
        raise ValueError("the slot maker changed the slot id")
    new = dataclasses.replace(header, slots=(*header.slots, slot), next_slot_id=slot_id + 1)
    return _encode(unlocked, new), slot


def remove_slot(unlocked: Unlocked, slot_id: int) -> bytes:
    """The header without slot slot_id. Raises ConfigError if that would lock everyone out."""
    header = unlocked.header
    find_slot(header, slot_id)
    remaining = tuple(s for s in header.slots if s.slot_id != slot_id)
    if not remaining:
        raise ConfigError(
            f"keyslot {slot_id} is the volume's last keyslot: removing it would leave a volume"
            " that nothing opens; add another slot first"
        )
    if not any(s.kind in KNOWN_KINDS for s in remaining):
        raise ConfigError(
            f"removing keyslot {slot_id} would leave only slots this build cannot open"
            f" ({', '.join(sorted({s.kind for s in remaining}))}); add another slot first"
        )
    new = dataclasses.replace(header, slots=remaining, next_slot_id=first_free_slot_id(header))
    return _encode(unlocked, new)


def replace_slot(unlocked: Unlocked, slot_id: int, maker: SlotMaker) -> tuple[bytes, Keyslot]:
    """Re-make slot slot_id in place (same id and position): a new passphrase, a new KMS key."""
    header = unlocked.header
    find_slot(header, slot_id)
    slot = maker(slot_id, unlocked.master_key, header.volume_id)
    if slot.slot_id != slot_id:
        raise ValueError("the slot maker changed the slot id")
    slots = tuple(slot if s.slot_id == slot_id else s for s in header.slots)
    new = dataclasses.replace(header, slots=slots, next_slot_id=first_free_slot_id(header))
    return _encode(unlocked, new), slot
