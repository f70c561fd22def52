"""Compaction: a new snapshot from the previous one plus the segments since.

Pure function over sealed bytes, so the writer can run it in a worker thread
while the live state keeps changing: it never looks at the live state, whose
sizes and records may run ahead of what is committed.
"""

from __future__ import annotations

from sealfs.crypto.keyring import KeyRing
from sealfs.meta.codec import LoggedSegment, SealKeys, decode_snapshot, encode_snapshot
from sealfs.meta.model import MetaState
from sealfs.meta.replay import replay_segment

Snapshot = tuple[int, bytes]  # generation and sealed bytes


def compact(
    ring: KeyRing,
    keys: SealKeys,
    volume_id: bytes,
    base: Snapshot | None,
    tail: list[LoggedSegment],
) -> Snapshot:
    """Replay tail onto base (read with ring) and seal the result under keys."""
    state = MetaState() if base is None else decode_snapshot(ring, volume_id, *base)
    for logged in tail:
        replay_segment(state, logged)
    return state.generation, encode_snapshot(keys, volume_id, state)
