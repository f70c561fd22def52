"""Keyed chunk ids: HMAC-SHA256 of the plaintext under the chunk-id subkey.

A plain content hash would let whoever reads the store confirm that it holds a
known file; a keyed MAC still gives deduplication inside the volume without that.
The same key makes a chunk's similarity features, which stay in sealed metadata.
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


# Chunks shorter than this get no features and are never stored as a difference: a
# small chunk saves little, and looking up a base costs a store read.
MIN_SIMILAR_SIZE = 64 * 1024
FEATURE_WINDOW = 512  # bytes hashed at each end of a chunk
FEATURE_SIZE = 8  # bytes kept of each end's MAC
FEATURES_SIZE = 2 * FEATURE_SIZE
_FEATURE_DOMAIN = b"sealfs feature v1\x00"


def similarity_features(chunk_id_key: bytes, plaintext: bytes | bytearray | memoryview) -> bytes:
    """Keyed hashes of a chunk's first and last FEATURE_WINDOW bytes (8 bytes each), or
    b"" for a chunk shorter than MIN_SIMILAR_SIZE.

    An edit inside a chunk leaves both ends alone, and content-defined cuts
    fall where they fell before, so the new chunk shares an end with the one it
    replaces: that chunk is where a difference will be small. The domain prefix
    keeps a feature from equalling the chunk id of a 512-byte chunk.
    """
    if len(plaintext) < MIN_SIMILAR_SIZE:
        return b""
    out = b""
    for window in (plaintext[:FEATURE_WINDOW], plaintext[-FEATURE_WINDOW:]):
        mac = hmac.HMAC(chunk_id_key, hashes.SHA256())
        mac.update(_FEATURE_DOMAIN)
        mac.update(window)
        out += mac.finalize()[:FEATURE_SIZE]
    return out
