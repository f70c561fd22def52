"""FastCDC cut points for sealfs's data path.

Sizes are part of format v1: every writer of a volume must cut alike or dedup
across writers and versions is lost. About 1 MiB on average suits S3 (few
requests) while keeping the bytes added by a clustered edit small. The gear
table is seeded from a volume key so that chunk lengths do not fingerprint
known plaintext to someone who can see object sizes.
"""

from __future__ import annotations

from pyfastcdc import FastCDC

MIN_CHUNK = 256 * 1024
AVG_CHUNK = 1024 * 1024  # pyfastcdc's average is this plus MIN_CHUNK
MAX_CHUNK = 4 * 1024 * 1024


class Chunker:
    """Finds chunk boundaries in buffers; holds no data between calls."""

    def __init__(self, seed: int) -> None:
        self._seed = seed

    def reseed(self, seed: int) -> None:
        """Cut with another secret seed from now on (a rekey's new epoch)."""
        self._seed = seed

    def cut(self, data: bytes | bytearray | memoryview) -> list[int]:
        """Return the lengths of the chunks that data splits into (they sum to len(data)).

        A fresh FastCDC object per call keeps this safe to call from several
        worker threads at once (pyfastcdc instances are not).
        """
        if not data:
            return []
        cdc = FastCDC(AVG_CHUNK, min_size=MIN_CHUNK, max_size=MAX_CHUNK, seed=self._seed)
        return [chunk.length for chunk in cdc.cut_buf(data)]
