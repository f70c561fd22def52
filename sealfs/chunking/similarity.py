"""Similarity features: what finds the chunk a new chunk is best stored as a
difference from (sealfs.volume.chunks).

An edit inside a chunk leaves its ends alone, and content-defined cuts fall
where they fell before, so a chunk that replaces another shares its first and
last bytes. Each end is cut again, finer and by content, into pieces of 1-4
KiB, and the four pieces nearest each edge are hashed: an edit changes the
piece it lands in, and the pieces after it (before it, at the tail) cut as
before. Features are keyed with the chunk-id key and kept only in sealed
metadata; a reader never needs them, and another writer's features (or none)
only find fewer differences (docs/format.md, section 4).
"""

from __future__ import annotations

from cryptography.hazmat.primitives import hashes, hmac
from pyfastcdc import FastCDC

# Chunks shorter than this get no features and are never stored as a difference: a
# small chunk saves little, and looking up a base costs a store read.
MIN_SIMILAR_SIZE = 64 * 1024
SPAN = 16 * 1024  # bytes at each end of a chunk that are cut into pieces
PIECES_PER_END = 4
FEATURE_SIZE = 8  # bytes kept of each piece's MAC
MAX_FEATURES = 2 * PIECES_PER_END
# FastCDC for the pieces: pyfastcdc cuts at min_size plus about avg_size (1-4 KiB here).
# Small pieces leave more of an end whole when edits are dense (1 % of 100-byte lines
# changed puts an edit in a third of 4 KiB pieces, in a sixth of 2 KiB ones), and two
# of them must name the same chunk before it is tried as a base (MIN_VOTES), which
# passages that recur by chance in text rarely do.
_AVG, _MIN, _MAX = 1024, 1024, 4096
_DOMAIN = b"sealfs feature v1\x00"


def similarity_features(chunk_id_key: bytes, plaintext: bytes | bytearray | memoryview) -> bytes:
    """The features of a chunk, FEATURE_SIZE bytes each, head's first; b"" for a chunk
    shorter than MIN_SIMILAR_SIZE.

    A piece of one byte repeated (zeros, in sparse and binary files) says
    nothing about the rest of its chunk and gives no feature.
    """
    if len(plaintext) < MIN_SIMILAR_SIZE:
        return b""
    head = _pieces(bytes(plaintext[:SPAN]))[:-1]  # the last is cut where the span ends
    tail = _pieces(bytes(plaintext[-SPAN:]))[1:]  # the first begins where the span does
    chosen = head[:PIECES_PER_END] + tail[-PIECES_PER_END:]
    return b"".join(_feature(chunk_id_key, p) for p in chosen if p.count(p[:1]) != len(p))


def _pieces(span: bytes) -> list[bytes]:
    cdc = FastCDC(_AVG, min_size=_MIN, max_size=_MAX, seed=0)
    out, at = [], 0
    for piece in cdc.cut_buf(span):
        out.append(span[at : at + piece.length])
        at += piece.length
    return out


def _feature(key: bytes, piece: bytes) -> bytes:
    mac = hmac.HMAC(key, hashes.SHA256())
    mac.update(_DOMAIN)
    mac.update(piece)
    return mac.finalize()[:FEATURE_SIZE]


def split_features(features: bytes) -> list[bytes]:
    """The single features in a row's features field."""
    return [features[k : k + FEATURE_SIZE] for k in range(0, len(features), FEATURE_SIZE)]
