"""The ObjectStore protocol every backend implements, what backends and wrappers
share (optional methods, size bounds, StoreWrapper), and object-name rules.

Stores are synchronous and blocking: the volume engine calls them from worker
threads (trio.to_thread) so that a slow disk or network never stalls the FUSE
event loop. Implementations must be safe to call from several threads at once.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from typing import Protocol

from sealfs.errors import ConfigError, FormatError

log = logging.getLogger("sealfs.store")

# Names are a fixed, small alphabet so that every backend (POSIX paths, S3
# keys) can hold them verbatim and so that no name can escape the store root.
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*(/[a-z0-9][a-z0-9._-]*)*$")
MAX_NAME_LENGTH = 200


# Where init's check of an S3 store's conditional writes puts its object, deleted again
# (left only by an init cut short).
PROBE_PREFIX = "probe/"


def validate_name(name: str) -> str:
    """Return name unchanged, or raise ConfigError if it is not a valid object name."""
    if len(name) > MAX_NAME_LENGTH or not _NAME_RE.match(name) or ".." in name:
        raise ConfigError(f"invalid object name {name!r}")
    return name


def is_valid_name(name: str) -> bool:
    """Whether name is a valid object name: what a listing may return, as opposed to
    the temp files, lock file and strays beside the objects."""
    try:
        validate_name(name)
    except ConfigError:
        return False
    return True


# A list prefix is a name cut anywhere: same alphabet, may be empty or end in "/".
_PREFIX_RE = re.compile(r"^([a-z0-9][a-z0-9._-]*/)*([a-z0-9][a-z0-9._-]*)?$")


def validate_prefix(prefix: str) -> str:
    """Return prefix unchanged, or raise ConfigError if no valid name could start with it."""
    if len(prefix) > MAX_NAME_LENGTH or not _PREFIX_RE.match(prefix) or ".." in prefix:
        raise ConfigError(f"invalid object name prefix {prefix!r}")
    return prefix


def content_etag(data: bytes) -> str:
    """The etag the memory and local stores use: hex SHA-256 of the object's bytes.

    Callers must treat etags as opaque (an S3 store returns the server's ETag).
    """
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class ObjectInfo:
    """What a store can say about one object without reading it."""

    name: str
    size: int
    etag: str


class ObjectStore(Protocol):
    """A flat namespace of immutable-by-convention objects.

    Every method may raise TransientStoreError (worth retrying),
    StoreUnavailableError, NoSpaceError or another StoreError. None of them
    retries: the RetryingStore wrapper decides that, in one place.
    """

    def get(self, name: str, max_size: int | None = None) -> bytes:
        """Return the whole object. Raises ObjectNotFoundError.

        max_size: the most bytes an object of its kind can hold; a larger one is
        refused unread with FormatError (see object_too_large).
        """
        ...

    def stat(self, name: str) -> ObjectInfo:
        """Return size and etag. Raises ObjectNotFoundError."""
        ...

    def put(self, name: str, data: bytes, *, replace: bool = True) -> None:
        """Create or replace the object atomically: readers see old or new, never a mix.

        replace=False only creates it: an object already there is left as it is and
        ObjectExistsError raised. For chunks, whose name says what they hold: a writer
        that lost the volume to another must not overwrite what the other made of a
        chunk (a rekey re-seals chunks in place, under a key the loser lacks). Unlike
        put_if_absent, the bytes need not be durable before the next sync.
        """
        ...

    def put_if_absent(self, name: str, data: bytes) -> None:
        """Create the object only if no object has that name. Raises ObjectExistsError.

        This is the generation race: of two writers, exactly one succeeds.
        """
        ...

    def put_if_match(self, name: str, data: bytes, etag: str) -> None:
        """Replace the object only if its current etag is etag. Raises PreconditionFailedError.

        A missing object raises ObjectNotFoundError (as S3 answers 404 NoSuchKey).
        """
        ...

    def delete(self, name: str) -> None:
        """Delete the object; deleting a missing object is not an error."""
        ...

    def list(self, prefix: str, start_after: str = "") -> list[str]:
        """All names that start with prefix and sort after start_after, in sorted order."""
        ...

    def sync(self) -> None:
        """Make every earlier put durable (a local store syncs its file system; S3 is a no-op).

        The engine calls this after uploading chunks and before creating the log
        segment that refers to them, and again after the segment.
        """
        ...

    def free_bytes(self) -> int:
        """Space left for new objects, for statfs (a large constant where unbounded)."""
        ...

    def describe(self) -> str:
        """A short human description for messages (never includes credentials)."""
        ...

    def close(self) -> None:
        """Release connections and file descriptors."""
        ...


def request_counts(store: object) -> dict[str, int] | None:
    """Requests sent per method by store (or the store it wraps), or None if it keeps no count.

    Optional: a backend that counts (S3Store) and the wrappers define
    request_counts(); the others do not.
    """
    method = getattr(store, "request_counts", None)
    if method is None:
        return None
    counts: dict[str, int] | None = method()
    return counts


def versioned_bucket(store: object) -> str | None:
    """The bucket's name if store (or the store it wraps) is a bucket that keeps
    object versions, else None.

    Optional, as request_counts: S3Store and the wrappers define versioned_bucket().
    """
    method = getattr(store, "versioned_bucket", None)
    if method is None:
        return None
    bucket: str | None = method()
    return bucket


def warn_if_versioned(store: object) -> None:
    """Warn if store (or the store it wraps) is a bucket that keeps object versions.

    Every object sealfs replaces or deletes then stays readable as a noncurrent
    version: headers with a removed keyslot or an old passphrase's slot, objects a
    rekey re-sealed still under the old key. So "nothing the volume holds opens with
    the old key" would not hold, and the bucket would grow without bound; the
    versioned bucket was taken without a word.
    """
    bucket = versioned_bucket(store)
    if bucket is not None:
        log.warning(
            "bucket %s keeps object versions: what sealfs replaces or deletes stays"
            " readable (volume headers with removed keyslots or old passphrases, objects"
            " a rekey re-encrypted, under the old key) and the bucket grows without bound:"
            " suspend versioning, or expire noncurrent versions with a lifecycle rule"
            " (README, S3)",
            bucket,
        )


def store_location(store: ObjectStore) -> str:
    """Where store's objects are, the same however a command line or environment named
    them; its description where the backend gives nothing more exact.

    Optional, as request_counts: the local and S3 stores and the wrappers define
    location(). Two processes compare it to tell one store from a copy of it, and the
    host keys its record of the generations it saw by it (sealfs.cli.seen).
    """
    method = getattr(store, "location", None)
    return str(method()) if method is not None else store.describe()


def object_too_large(name: str, size: int, max_size: int, where: str) -> FormatError:
    """The error for an object larger than any that sealfs writes under its name.

    Whoever can write to the store (or the cache) could otherwise append junk without
    bound (a sparse file costs nothing) and have a reader take it all into memory:
    the mount daemon was killed for want of memory, losing what was not committed.
    """
    return FormatError(
        f"object {name} in {where} is {size} bytes, more than the {max_size} that an"
        " object of its kind can hold: restore it from a copy of the store"
    )


def refuse_too_large(name: str, size: int, max_size: int | None, where: str) -> None:
    """Raise object_too_large's error if size is over max_size (None: no bound)."""
    if max_size is not None and size > max_size:
        raise object_too_large(name, size, max_size, where)


def remove_crash_leftovers(store: object, older_than: float) -> int:
    """Remove what crashed writers left in store (or the store it wraps); how many went.

    Optional: a backend that writes through temporary files (LocalStore) and the
    wrappers define remove_crash_leftovers(); the others leave nothing behind.
    """
    method = getattr(store, "remove_crash_leftovers", None)
    if method is None:
        return 0
    removed: int = method(older_than)
    return removed


class StoreWrapper:
    """What every wrapper (retrying, caching, fault-injecting) passes through unchanged
    to the store it wraps.

    In one place so that an optional method the backends gain reaches through every
    wrapper at once (location() came late, and was added to each wrapper by hand): a
    wrapper without it would hide it from status and the host's record of generations.
    """

    inner: ObjectStore

    def free_bytes(self) -> int:
        """The inner store's free space (statfs is not worth retrying or faking)."""
        return self.inner.free_bytes()

    def request_counts(self) -> dict[str, int] | None:
        """The inner store's requests per method, if it counts them."""
        return request_counts(self.inner)

    def versioned_bucket(self) -> str | None:
        """The inner store's, if it is a bucket that keeps versions."""
        return versioned_bucket(self.inner)

    def remove_crash_leftovers(self, older_than: float) -> int:
        """The inner store's, if it leaves any."""
        return remove_crash_leftovers(self.inner, older_than)

    def location(self) -> str:
        """The inner store's location."""
        return store_location(self.inner)

    def describe(self) -> str:
        """The inner store's description: a wrapper is invisible to users."""
        return self.inner.describe()

    def close(self) -> None:
        """Close the inner store."""
        self.inner.close()
