"""Replaying log segments onto a MetaState, checking the hash chain."""

from __future__ import annotations

from sealfs.errors import IntegrityError
from sealfs.meta import ops
from sealfs.meta.codec import LoggedSegment
from sealfs.meta.model import MetaState


def replay_segment(state: MetaState, logged: LoggedSegment) -> None:
    """Apply one committed segment; IntegrityError if it does not extend the chain.

    A segment is applied whole or not at all by its caller's contract: the
    state after a crash is always a prefix of committed segments.
    """
    segment = logged.segment
    if segment.generation != state.generation + 1:
        raise IntegrityError(
            f"log generation {state.generation + 1} is missing (found {segment.generation} next):"
            " the store lost or hid a segment"
        )
    if segment.prev_hash != state.head_hash:
        raise IntegrityError(
            f"log segment {segment.generation} does not follow segment {state.generation}"
            " (hash chain broken): the store was rolled back or tampered with"
        )
    for op in segment.ops:
        ops.apply(state, op)
    state.generation = segment.generation
    state.head_hash = logged.digest
    state.committed_ns = segment.time_ns
