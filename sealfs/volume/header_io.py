"""Reading and replacing sealfs.vol atomically, for keyslot changes and rekeys.

The header is the one object whose content ever changes (a rekey re-seals
other objects in place, with the same payload). Every change reads it
with its etag and writes the new bytes with put_if_match, so of two
concurrent changes (a `sealfs key` command, a mounted writer finishing a
rekey) one wins and the other re-reads: none is lost.
"""

from __future__ import annotations

from dataclasses import dataclass

from sealfs.errors import FormatError, ObjectNotFoundError, PreconditionFailedError
from sealfs.keys.header import HEADER_NAME, MAX_HEADER_SIZE
from sealfs.store.base import ObjectStore
from sealfs.volume.loader import read_header

READ_ATTEMPTS = 5


@dataclass(frozen=True)
class HeaderVersion:
    """The header's bytes and the etag of exactly that version."""

    data: bytes
    etag: str


def read_header_version(store: ObjectStore) -> HeaderVersion:
    """Read the header with its etag (stat, get, stat: retried if it changed in between)."""
    for _ in range(READ_ATTEMPTS):
        try:
            before = store.stat(HEADER_NAME).etag
        except ObjectNotFoundError:
            read_header(store)  # NotAVolumeError, unless it appeared meanwhile
            continue
        data = read_header(store)
        try:
            after = store.stat(HEADER_NAME).etag
        except ObjectNotFoundError:
            continue
        if before == after:
            return HeaderVersion(data, after)
    raise PreconditionFailedError("the volume header keeps changing: retry later")


def write_header(store: ObjectStore, old: HeaderVersion, new: bytes) -> None:
    """Replace the header if still old, then make it durable. PreconditionFailedError: retry."""
    try:
        store.put_if_match(HEADER_NAME, new, old.etag)
    except PreconditionFailedError:
        try:
            current = store.get(HEADER_NAME, MAX_HEADER_SIZE)
        except (ObjectNotFoundError, FormatError):  # gone, or grown past any header
            current = b""
        if current != new:  # (equal: a retried request of ours had already landed)
            raise PreconditionFailedError(
                "the volume header changed meanwhile (another key change?):"
                " nothing was written; retry"
            ) from None
    store.sync()
