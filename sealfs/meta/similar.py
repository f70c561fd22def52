"""Which stored chunk a new chunk's similarity features name: how a writer finds the
chunk to store a new one as a difference from (sealfs.volume.chunks).

Bounded, because per chunk it is the largest thing a volume of large files keeps in
memory: eight features in a dict take about 840 bytes a chunk, against about 180 for
the chunk's row (1 TiB of distinct data, some 840,000 chunks, would hold 700 MB).
A checkpoint is compared with its last version, which was written recently, so only
the features of the chunks stored last are kept: new ones go into one dict, and when
that holds half the bound it becomes the older one, and the older one's features are
dropped. A file not rewritten since the last 32,000-64,000 chunks with features were
stored (40-80 GiB of data) is then stored whole, as it was before differences.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from sealfs.chunking.similarity import FEATURE_SIZE, split_features

# Features that must name a chunk before a new chunk is compressed against it.
MIN_VOTES = 2
# Features kept, at most: about 40 MiB of dicts (measured with tracemalloc).
DEFAULT_LIMIT = 1 << 19


class FeatureIndex:
    """Each feature to the chunk a new chunk sharing it would be stored as a difference
    from: the feature's chunk's base, or that chunk where it has none (a difference is
    never taken from a difference). The chunk stored last with a feature wins.

    roots() runs in worker threads while the event loop adds: it reads each dict once,
    and a swap between those reads costs at most a feature not found (a difference not
    tried), never a chunk that is not in the table.
    """

    __slots__ = ("_half", "_newer", "_older", "limit")

    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        self.limit = limit
        self._half = max(1, limit // 2)
        self._newer: dict[bytes, bytes] = {}
        self._older: dict[bytes, bytes] = {}

    def add(self, features: bytes, root: bytes) -> None:
        """Index a chunk's features as naming root."""
        for feature in split_features(features):
            self._newer[feature] = root
        if len(self._newer) >= self._half:
            self._older, self._newer = self._newer, {}

    def fill(self, newest_first: Iterable[tuple[bytes, bytes]]) -> None:
        """Index (features, root) pairs, given newest first, into an empty index, as many
        as the bound holds: the newest, fewer than half the bound, in the newer half (as
        add leaves it), the ones before them in the older. It takes no more pairs than it
        keeps, so a writer's mount reads only the end of a long chunk table.
        """
        newer: list[tuple[bytes, bytes]] = []
        older: list[tuple[bytes, bytes]] = []
        held = 0
        for features, root in newest_first:
            held += len(features) // FEATURE_SIZE
            if not older and held < self._half:
                newer.append((features, root))
            elif held <= self.limit or not (older or newer):
                older.append((features, root))
            else:
                break
        for half, rows in ((self._older, older), (self._newer, newer)):
            for features, root in reversed(rows):
                for feature in split_features(features):
                    half[feature] = root

    def roots(self, features: bytes) -> list[bytes]:
        """The chunks a chunk with these features may be stored as a difference from: at
        most two, each named by MIN_VOTES features or more, the one most name first.

        One feature alone is one piece of a few KiB, and text repeats in passages that
        long: with pieces of 2-8 KiB, 40 chunks of the benchmark's fresh 1 GiB JSON
        checkpoint shared a piece with an earlier chunk of the same file, none of them
        anything more, and each such try cost a base read and a compression (0.65 s
        of CPU per GiB written).
        """
        newer, older = self._newer, self._older
        named = (newer.get(f) or older.get(f) for f in split_features(features))
        votes = Counter(root for root in named if root is not None)
        return [root for root, n in votes.most_common(2) if n >= MIN_VOTES]

    def __len__(self) -> int:
        return len(self._newer) + len(self._older)
