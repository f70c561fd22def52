"""Subkeys derived from the master key with HKDF-SHA256 and readable labels.

One master key, one purpose per subkey: a key is never used for two jobs, and
deriving them all here keeps the label list in one place (docs/format.md
repeats it). The volume id is the HKDF salt, so two volumes that somehow share a
master key still get unrelated subkeys.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

MASTER_KEY_SIZE = 32
VOLUME_ID_SIZE = 16
SUBKEY_SIZE = 32
INFO_PREFIX = b"sealfs/v1/"

LABEL_CHUNK = b"chunk-encryption"
LABEL_CHUNK_ID = b"chunk-id"
LABEL_CHUNK_ID_BLAKE3 = b"chunk-id-blake3"
LABEL_METADATA = b"metadata"
LABEL_HEADER_MAC = b"header-mac"
LABEL_CHUNKER_SEED = b"chunker-seed"

# pyfastcdc takes the seed as an unsigned integer; 31 bits keeps it portable
# to any implementation that stores it in a signed 32-bit int.
CHUNKER_SEED_MASK = 0x7FFFFFFF


@dataclass(frozen=True)
class Subkeys:
    """The per-purpose keys of a volume. repr never shows them."""

    chunk_key: bytes = field(repr=False)
    # Keys similarity features (HMAC-SHA256); named chunks before sealfs 0.2.0.
    chunk_id_key: bytes = field(repr=False)
    # Keys chunk ids (BLAKE3): a key of its own, not the HMAC key used by another hash.
    chunk_id_blake3_key: bytes = field(repr=False)
    meta_key: bytes = field(repr=False)
    header_mac_key: bytes = field(repr=False)
    # Secret too: knowing it lets the store predict chunk boundaries.
    chunker_seed: int = field(repr=False)


def hkdf_sha256(key_material: bytes, salt: bytes, info: bytes, length: int) -> bytes:
    """HKDF-SHA256 (RFC 5869) extract-and-expand to length bytes."""
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=salt, info=info).derive(key_material)


def _derive(master_key: bytes, volume_id: bytes, label: bytes, length: int) -> bytes:
    return hkdf_sha256(master_key, volume_id, INFO_PREFIX + label, length)


def derive_subkeys(master_key: bytes, volume_id: bytes) -> Subkeys:
    """Derive every subkey of a volume. ValueError on bad key or volume id sizes."""
    if len(master_key) != MASTER_KEY_SIZE:
        raise ValueError(f"master key must be {MASTER_KEY_SIZE} bytes")
    if len(volume_id) != VOLUME_ID_SIZE:
        raise ValueError(f"volume id must be {VOLUME_ID_SIZE} bytes")
    seed = _derive(master_key, volume_id, LABEL_CHUNKER_SEED, 8)
    return Subkeys(
        chunk_key=_derive(master_key, volume_id, LABEL_CHUNK, SUBKEY_SIZE),
        chunk_id_key=_derive(master_key, volume_id, LABEL_CHUNK_ID, SUBKEY_SIZE),
        chunk_id_blake3_key=_derive(master_key, volume_id, LABEL_CHUNK_ID_BLAKE3, SUBKEY_SIZE),
        meta_key=_derive(master_key, volume_id, LABEL_METADATA, SUBKEY_SIZE),
        header_mac_key=_derive(master_key, volume_id, LABEL_HEADER_MAC, SUBKEY_SIZE),
        chunker_seed=int.from_bytes(seed, "big") & CHUNKER_SEED_MASK,
    )
