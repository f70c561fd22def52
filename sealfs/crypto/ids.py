"""Keyed chunk ids: HMAC-SHA256 of the plaintext under the chunk-id subkey.

A plain content hash would let whoever reads the store confirm that it holds a
known file; a keyed MAC still gives deduplication inside the volume without that.
The same key makes a chunk's similarity features (sealfs.chunking.similarity).
"""

from __future__ import annotations

from cryptography.hazmat.primitives import hashes, hmac

CHUNK_ID_SIZE = 32  # the one definition: envelope bindings and extents check against it


def chunk_id(chunk_id_key: bytes, plaintext: bytes | bytearray | memoryview) -> bytes:
    """Return the 32-byte id of a chunk (HMAC-SHA256(chunk_id_key, plaintext))."""
    if len(chunk_id_key) != 32:
        raise ValueError("chunk id key must be 32 bytes")
    mac = hmac.HMAC(chunk_id_key, hashes.SHA256())
    mac.update(plaintext)
    return mac.finalize()
