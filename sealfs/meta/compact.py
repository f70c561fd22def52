"""Compaction: a new snapshot from the previous one plus the segments since.

Pure function over sealed bytes, so the writer can run it in a worker thread
while the live state keeps changing: it never looks at the live state, whose
sizes and records may run ahead of what is committed.
"""

from __future__ import annotations

from sealfs.meta.codec import Segment, decode_snapshot, encode_snapshot
from sealfs.meta.model import MetaState
from sealfs.meta.replay import replay_segment

Snapshot = tuple[int, bytes]  # generation and sealed bytes
SealedSegment = tuple[Segment, bytes]


def compact(
    meta_key: bytes, volume_id: bytes, base: Snapshot | None, tail: list[SealedSegment]
) -> Snapshot:
    """Replay tail onto base and seal the result as a snapshot of the last generation."""
    state = MetaState() if base is None else decode_snapshot(meta_key, volume_id, *base)
    for segment, sealed in tail:
        replay_segment(state, segment, sealed)
    return state.generation, encode_snapshot(meta_key, volume_id, state)
