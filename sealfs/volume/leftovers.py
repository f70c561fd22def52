"""Clearing what a crashed writer left in the store, once per read-write mount.

A local store publishes each object by writing a hidden temp file and renaming
or linking it into place; a writer killed in between leaves the temp file for
ever. It holds sealed bytes only and no reader looks at it, but it takes space
and gets copied by every backup.
"""

from __future__ import annotations

import logging

import trio

from sealfs.errors import SealfsError
from sealfs.store.base import ObjectStore, remove_crash_leftovers

log = logging.getLogger(__name__)

# Older than any object write in progress: a younger temp file may be this mount's
# own, or that of a `sealfs key` command replacing the header right now. A temp file
# dated as far in the future is a leftover too, from before the clock was set back.
LEFTOVER_AGE = 3600.0


async def clear_crash_leftovers(store: ObjectStore, limiter: trio.CapacityLimiter) -> None:
    """Remove the store's crash leftovers in a worker thread; never fails the mount.

    Abandoned on unmount: the walk of a large store may take seconds, and what
    it has not reached yet waits for the next mount.
    """
    try:
        removed = await trio.to_thread.run_sync(
            remove_crash_leftovers, store, LEFTOVER_AGE, limiter=limiter, abandon_on_cancel=True
        )
    except SealfsError as exc:
        log.warning("could not remove the temp files a crash left in the store: %s", exc)
        return
    if removed:
        log.info("removed %d temp files a crash left in the store", removed)
