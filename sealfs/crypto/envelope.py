"""The sealed-object envelope shared by chunks, log segments and snapshots.

Layout: an 8-byte header (magic, version, kind, flags, key epoch), then the
AES-256-GCM nonce, ciphertext and tag. The header and the object's identity
(its binding: volume id plus chunk id or generation) form the associated data,
so the store can neither edit the header nor move an object to another name,
kind or volume without the open failing. Compression is the caller's job; this
module only records it in a flag.
"""

from __future__ import annotations

import enum
import struct
from typing import NamedTuple

from sealfs.crypto import aead
from sealfs.crypto.ids import CHUNK_ID_SIZE
from sealfs.crypto.subkeys import VOLUME_ID_SIZE
from sealfs.errors import FormatError, IntegrityError, UnsupportedVersionError

MAGIC = b"SFS"
VERSION = 1
HEADER_SIZE = 8
ENVELOPE_OVERHEAD = HEADER_SIZE + aead.NONCE_SIZE + aead.TAG_SIZE

FLAG_ZSTD = 0x01
# A chunk's payload is a base chunk's id and a zstd frame made with that chunk's
# plaintext as dictionary (sealfs.volume.chunks): never with FLAG_ZSTD, never in metadata.
FLAG_DELTA = 0x02
_KNOWN_FLAGS = FLAG_ZSTD | FLAG_DELTA
MAX_EPOCH = 0xFFFF

_HEADER = struct.Struct(">3sBBBH")


class ObjectKind(enum.IntEnum):
    """What a sealed object is; part of the header and so of the associated data."""

    CHUNK = 1
    SEGMENT = 2
    SNAPSHOT = 3


# Bindings have a fixed size per kind, so a caller that forgets the identity
# (an empty binding would silently allow swaps) fails loudly instead.
_BINDING_SIZE = {
    ObjectKind.CHUNK: VOLUME_ID_SIZE + CHUNK_ID_SIZE,
    ObjectKind.SEGMENT: VOLUME_ID_SIZE + 8,
    ObjectKind.SNAPSHOT: VOLUME_ID_SIZE + 8,
}


class _Header(NamedTuple):
    raw: bytes
    kind: ObjectKind
    flags: int
    epoch: int


def chunk_binding(volume_id: bytes, chunk_id: bytes) -> bytes:
    """Identity of a chunk: volume_id (16) || chunk_id (32). ValueError on bad sizes."""
    if len(volume_id) != VOLUME_ID_SIZE or len(chunk_id) != CHUNK_ID_SIZE:
        raise ValueError("chunk binding needs a 16-byte volume id and a 32-byte chunk id")
    return volume_id + chunk_id


def generation_binding(volume_id: bytes, generation: int) -> bytes:
    """Identity of a log segment or snapshot: volume_id (16) || generation (u64 BE)."""
    if len(volume_id) != VOLUME_ID_SIZE:
        raise ValueError("generation binding needs a 16-byte volume id")
    if not 0 <= generation < 1 << 64:
        raise ValueError(f"generation {generation} does not fit in 64 bits")
    return volume_id + generation.to_bytes(8, "big")


def _check_binding(kind: ObjectKind, binding: bytes) -> None:
    if len(binding) != _BINDING_SIZE[kind]:
        raise ValueError(
            f"{kind.name} binding must be {_BINDING_SIZE[kind]} bytes, got {len(binding)}"
        )


def _parse_header(data: bytes | memoryview) -> _Header:
    """Parse and validate the 8-byte header; raise FormatError/UnsupportedVersionError."""
    if len(data) < HEADER_SIZE:
        raise FormatError(f"sealed object is {len(data)} bytes, too short for a header")
    raw = bytes(data[:HEADER_SIZE])
    magic, version, kind, flags, epoch = _HEADER.unpack(raw)
    if magic != MAGIC:
        raise FormatError("not a sealfs object (bad magic)")
    if version != VERSION:
        raise UnsupportedVersionError(
            f"sealed object has format version {version}; this build reads version {VERSION}"
        )
    try:
        object_kind = ObjectKind(kind)
    except ValueError:
        raise FormatError(f"sealed object has unknown kind {kind}") from None
    if flags & ~_KNOWN_FLAGS:
        raise FormatError(f"sealed object has reserved flag bits set (flags=0x{flags:02x})")
    if flags & FLAG_DELTA and (flags != FLAG_DELTA or object_kind is not ObjectKind.CHUNK):
        raise FormatError(f"sealed {object_kind.name.lower()} has flags 0x{flags:02x}")
    return _Header(raw, object_kind, flags, epoch)


def read_envelope_epoch(data: bytes | memoryview) -> int:
    """Return the key epoch of a sealed object so the reader can pick the key.

    The epoch is not authenticated until open_object succeeds with epoch=...
    Raises FormatError or UnsupportedVersionError on a malformed header.
    """
    return _parse_header(data).epoch


def seal_object(
    key: bytes,
    kind: ObjectKind,
    binding: bytes,
    plaintext: bytes | bytearray | memoryview,
    *,
    flags: int = 0,
    epoch: int = 0,
    nonce: bytes | None = None,
) -> bytes:
    """Seal plaintext as an object of the given kind bound to its identity.

    Returns header || nonce || ciphertext || tag. Raises ValueError on caller
    bugs (unknown flags, epoch out of range, binding of the wrong size).
    """
    kind = ObjectKind(kind)
    _check_binding(kind, binding)
    if flags & ~_KNOWN_FLAGS:
        raise ValueError(f"unknown envelope flags 0x{flags:x}")
    if flags & FLAG_DELTA and (flags != FLAG_DELTA or kind is not ObjectKind.CHUNK):
        raise ValueError(f"envelope flags 0x{flags:x} on a {kind.name.lower()}")
    if not 0 <= epoch <= MAX_EPOCH:
        raise ValueError(f"key epoch {epoch} does not fit in 16 bits")
    header = _HEADER.pack(MAGIC, VERSION, kind, flags, epoch)
    return aead.seal(key, plaintext, header + binding, nonce, prefix=header)


def open_object(
    key: bytes,
    kind: ObjectKind,
    binding: bytes,
    data: bytes | memoryview,
    *,
    epoch: int | None = None,
) -> tuple[int, bytes]:
    """Authenticate and decrypt a sealed object; return (flags, plaintext).

    Raises FormatError (bad magic, truncated, unknown kind, reserved flags),
    UnsupportedVersionError (another format version), IntegrityError (the
    object is of another kind or epoch than expected, or fails authentication:
    tampered, swapped, or sealed with another key). Never retries.
    """
    kind = ObjectKind(kind)
    _check_binding(kind, binding)
    header = _parse_header(data)
    if len(data) < ENVELOPE_OVERHEAD:
        raise FormatError(f"sealed object is {len(data)} bytes, truncated")
    if header.kind != kind:
        raise IntegrityError(f"expected a {kind.name} object, found a {header.kind.name}")
    if epoch is not None and header.epoch != epoch:
        raise IntegrityError(f"object has key epoch {header.epoch}, expected {epoch}")
    body = memoryview(data)[HEADER_SIZE:]
    return header.flags, aead.open_sealed(key, body, header.raw + binding)


def reseal(
    old_key: bytes,
    new_key: bytes,
    new_epoch: int,
    kind: ObjectKind,
    binding: bytes,
    data: bytes | memoryview,
) -> bytes:
    """The same payload (flags and all, so nothing is recompressed) sealed under a new epoch.

    Raises what open_object raises for data: a damaged object is never re-sealed.
    """
    flags, body = open_object(old_key, kind, binding, data)
    return seal_object(new_key, kind, binding, body, flags=flags, epoch=new_epoch)
