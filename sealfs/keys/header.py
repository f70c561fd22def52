"""The volume header `sealfs.vol`: the one mutable object in the store.

Byte layout: magic (8) || format version (u16 BE) || body length (u32 BE) ||
body (msgpack map) || HMAC-SHA256 tag (32) over everything before it, keyed by
the header-mac subkey. The tag can only be checked after a keyslot yields the
master key, so decode_header parses without it and unlock verifies afterwards.
decode_header reads untrusted bytes: every field's type and size is checked,
and anything malformed raises FormatError (or UnsupportedVersionError).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, hmac

from sealfs.crypto.subkeys import VOLUME_ID_SIZE
from sealfs.errors import FormatError, IntegrityError, UnsupportedVersionError

FORMAT_VERSION = 1
HEADER_NAME = "sealfs.vol"
MAGIC = b"SEALFS\x00\x00"
MAC_SIZE = 32
MAX_BODY_SIZE = 1 << 20
MAX_SLOTS = 64
MAX_SLOT_ID = 0xFFFFFFFF
MAX_EPOCH = 0xFFFF
MAX_NONCE_SIZE = 64
MAX_WRAPPED_KEY_SIZE = 8192
MAX_PARAMS_DEPTH = 4

_PREFIX = struct.Struct(">8sHI")
# What every error about a header that does not parse or verify names as its fix.
_RESTORE = f"restore {HEADER_NAME} from a backup"
MAX_HEADER_SIZE = _PREFIX.size + MAX_BODY_SIZE + MAC_SIZE  # the largest header a reader takes
# Slot kinds are plain ASCII so that, in the keyslot AD, the kind bytes can
# never run into the msgpack map that follows them (msgpack maps start >= 0x80).
_KIND_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,31}$")
_BODY_KEYS = frozenset({"volume_id", "created_ns", "data_epoch", "slots"})
# Optional: written by every keyslot change, so that a removed slot's id is never reused.
_OPTIONAL_BODY_KEYS = frozenset({"next_slot_id", "retired"})
_RETIRED_KEYS = frozenset({"epoch", "nonce", "wrapped_key"})
RETIRED_NONCE_SIZE = 12
RETIRED_WRAPPED_SIZE = 48  # a 32-byte master key and a 16-byte GCM tag
_SLOT_KEYS = frozenset({"id", "kind", "params", "nonce", "wrapped_key"})


@dataclass(frozen=True)
class Keyslot:
    """One wrapping of the master key; params holds the kind's public parameters."""

    slot_id: int
    kind: str
    params: Mapping[str, Any]
    nonce: bytes
    wrapped_key: bytes


@dataclass(frozen=True)
class RetiredKey:
    """The master key of epoch `epoch`, AES-GCM-wrapped under the current one."""

    epoch: int
    nonce: bytes
    wrapped_key: bytes = field(repr=False)


@dataclass(frozen=True)
class VolumeHeader:
    """The decoded contents of sealfs.vol."""

    format_version: int
    volume_id: bytes
    created_ns: int
    slots: tuple[Keyslot, ...]
    data_epoch: int = 0
    # Lowest slot id never used; None in headers no keyslot change has touched
    # (then it is max(slot ids) + 1). See first_free_slot_id.
    next_slot_id: int | None = None
    # The previous epoch's master key, wrapped under this one, while a rekey
    # re-seals the objects of that epoch; None otherwise (see keys/rekey.py).
    retired: RetiredKey | None = None


def first_free_slot_id(header: VolumeHeader) -> int:
    """The id the next added keyslot gets: never one that any earlier slot had."""
    highest = max(s.slot_id for s in header.slots)
    return max(highest + 1, header.next_slot_id or 0)


def _canonical(value: Any) -> Any:
    """Return value with every map sorted by key, so equal data packs to equal bytes."""
    if isinstance(value, Mapping):
        return {k: _canonical(value[k]) for k in sorted(value)}
    if isinstance(value, list | tuple):
        return [_canonical(v) for v in value]
    return value


def pack_canonical(value: Any) -> bytes:
    """msgpack with sorted map keys and bin type for bytes (deterministic output)."""
    packed: bytes = msgpack.packb(_canonical(value), use_bin_type=True)
    return packed


def _mac(data: bytes, header_mac_key: bytes) -> bytes:
    mac = hmac.HMAC(header_mac_key, hashes.SHA256())
    mac.update(data)
    return mac.finalize()


def _slot_body(slot: Keyslot) -> dict[str, Any]:
    return {
        "id": slot.slot_id,
        "kind": slot.kind,
        "params": dict(slot.params),
        "nonce": slot.nonce,
        "wrapped_key": slot.wrapped_key,
    }


def encode_header(header: VolumeHeader, header_mac_key: bytes) -> bytes:
    """Serialise header and append its MAC. ValueError if header is not valid v1."""
    if header.format_version != FORMAT_VERSION:
        raise ValueError(f"can only encode format version {FORMAT_VERSION}")
    fields: dict[str, Any] = {
        "volume_id": header.volume_id,
        "created_ns": header.created_ns,
        "data_epoch": header.data_epoch,
        "slots": [_slot_body(s) for s in header.slots],
    }
    if header.next_slot_id is not None:
        fields["next_slot_id"] = header.next_slot_id
    if header.retired is not None:
        r = header.retired
        fields["retired"] = {"epoch": r.epoch, "nonce": r.nonce, "wrapped_key": r.wrapped_key}
    body = pack_canonical(fields)
    data = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(body)) + body
    # Refuse to write what we would refuse to read.
    try:
        decode_header(data + bytes(MAC_SIZE))
    except FormatError as exc:
        raise ValueError(f"invalid header: {exc}") from None
    return data + _mac(data, header_mac_key)


def _split(data: bytes) -> bytes:
    """Check the fixed prefix and sizes; return the msgpack body."""
    if len(data) < _PREFIX.size + MAC_SIZE:
        raise FormatError(f"volume header is {len(data)} bytes, too short: {_RESTORE}")
    magic, version, body_len = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise FormatError(f"{HEADER_NAME} is not a sealfs volume header (bad magic): {_RESTORE}")
    if version != FORMAT_VERSION:
        raise UnsupportedVersionError(
            f"volume format version {version} is not supported by this build "
            f"(reads version {FORMAT_VERSION}): use a sealfs that reads it"
        )
    if body_len > MAX_BODY_SIZE or len(data) != _PREFIX.size + body_len + MAC_SIZE:
        raise FormatError(
            f"volume header is damaged (its length does not match its body length {body_len}):"
            f" {_RESTORE}"
        )
    return data[_PREFIX.size : _PREFIX.size + body_len]


def _unpack(body: bytes) -> Any:
    try:
        # unpackb bounds every container length by len(body), itself <= MAX_BODY_SIZE.
        return msgpack.unpackb(body, raw=False, use_list=True, strict_map_key=True)
    except (ValueError, OverflowError, msgpack.UnpackException) as exc:
        raise FormatError(
            f"volume header body is not valid msgpack ({type(exc).__name__}): {_RESTORE}"
        ) from None


def _require(cond: bool, what: str) -> None:
    if not cond:
        raise FormatError(f"volume header: {what}: {_RESTORE}")


def _is_int(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _check_param_value(value: Any, depth: int) -> None:
    """Params may hold only plain msgpack types (no ext types, floats or deep nesting)."""
    _require(depth <= MAX_PARAMS_DEPTH, "keyslot params nested too deeply")
    if isinstance(value, dict):
        _require(all(isinstance(k, str) for k in value), "keyslot params have a non-string key")
        for v in value.values():
            _check_param_value(v, depth + 1)
    elif isinstance(value, list):
        for v in value:
            _check_param_value(v, depth + 1)
    else:
        _require(
            value is None or isinstance(value, str | bytes | bool | int),
            f"keyslot params hold an unsupported value type {type(value).__name__}",
        )


def _parse_slot(raw: Any) -> Keyslot:
    _require(isinstance(raw, dict) and set(raw) == _SLOT_KEYS, "malformed keyslot")
    slot_id, kind, params = raw["id"], raw["kind"], raw["params"]
    nonce, wrapped = raw["nonce"], raw["wrapped_key"]
    _require(_is_int(slot_id, 0, MAX_SLOT_ID), "keyslot id is not a u32")
    _require(isinstance(kind, str) and bool(_KIND_RE.match(kind)), "malformed keyslot kind")
    _require(isinstance(params, dict), "keyslot params are not a map")
    _check_param_value(params, 0)
    _require(isinstance(nonce, bytes) and len(nonce) <= MAX_NONCE_SIZE, "bad keyslot nonce")
    _require(
        isinstance(wrapped, bytes) and 0 < len(wrapped) <= MAX_WRAPPED_KEY_SIZE,
        "bad keyslot wrapped key",
    )
    return Keyslot(slot_id, kind, params, nonce, wrapped)


def _parse_body(raw: Any) -> VolumeHeader:
    _require(
        isinstance(raw, dict) and _BODY_KEYS <= set(raw) <= _BODY_KEYS | _OPTIONAL_BODY_KEYS,
        "body has missing or unknown fields",
    )
    volume_id, created_ns, epoch, raw_slots = (
        raw["volume_id"],
        raw["created_ns"],
        raw["data_epoch"],
        raw["slots"],
    )
    _require(isinstance(volume_id, bytes) and len(volume_id) == VOLUME_ID_SIZE, "bad volume id")
    _require(_is_int(created_ns, 0, (1 << 63) - 1), "bad creation time")
    _require(_is_int(epoch, 0, MAX_EPOCH), "bad data epoch")
    _require(isinstance(raw_slots, list) and 0 < len(raw_slots) <= MAX_SLOTS, "bad keyslot list")
    slots = tuple(_parse_slot(s) for s in raw_slots)
    _require(len({s.slot_id for s in slots}) == len(slots), "duplicate keyslot id")
    next_id = raw.get("next_slot_id")
    _require(
        "next_slot_id" not in raw
        or (_is_int(next_id, 0, MAX_SLOT_ID + 1) and next_id > max(s.slot_id for s in slots)),
        "next_slot_id is not above every keyslot id",
    )
    retired = _parse_retired(raw["retired"], epoch) if "retired" in raw else None
    return VolumeHeader(FORMAT_VERSION, volume_id, created_ns, slots, epoch, next_id, retired)


def _parse_retired(raw: Any, epoch: int) -> RetiredKey:
    _require(isinstance(raw, dict) and set(raw) == _RETIRED_KEYS, "malformed retired key")
    old, nonce, wrapped = raw["epoch"], raw["nonce"], raw["wrapped_key"]
    _require(
        _is_int(old, 0, MAX_EPOCH) and old < epoch, "retired key epoch is not below the data epoch"
    )
    _require(isinstance(nonce, bytes) and len(nonce) == RETIRED_NONCE_SIZE, "bad retired key nonce")
    _require(
        isinstance(wrapped, bytes) and len(wrapped) == RETIRED_WRAPPED_SIZE,
        "bad retired wrapped key",
    )
    return RetiredKey(old, nonce, wrapped)


def decode_header(data: bytes) -> VolumeHeader:
    """Parse sealfs.vol WITHOUT checking its MAC (unlock does that with the key).

    Raises FormatError on any malformed input and UnsupportedVersionError on
    another format version; never anything else, whatever the bytes.
    """
    return _parse_body(_unpack(_split(bytes(data))))


def verify_header_mac(data: bytes, header_mac_key: bytes) -> None:
    """Raise IntegrityError unless the trailing MAC matches (FormatError if too short)."""
    if len(data) < _PREFIX.size + MAC_SIZE:
        raise FormatError(f"volume header is {len(data)} bytes, too short: {_RESTORE}")
    mac = hmac.HMAC(header_mac_key, hashes.SHA256())
    mac.update(data[:-MAC_SIZE])
    try:
        mac.verify(bytes(data[-MAC_SIZE:]))
    except InvalidSignature:
        raise IntegrityError(f"volume header was modified (MAC mismatch): {_RESTORE}") from None
