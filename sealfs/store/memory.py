"""MemoryStore: an in-process ObjectStore for engine tests (no URL opens one).

It owns a dict of name -> bytes behind one lock and counts requests per method
so that tests can check request economy (a cache hit sends no request). It does
no I/O, never fails on its own and never retries.
"""

from __future__ import annotations

import collections
import threading

from sealfs.errors import ObjectExistsError, ObjectNotFoundError, PreconditionFailedError
from sealfs.store.base import (
    ObjectInfo,
    content_etag,
    refuse_too_large,
    validate_name,
    validate_prefix,
)


class MemoryStore:
    """A thread-safe ObjectStore held in memory; etag = hex SHA-256 of the data."""

    def __init__(self) -> None:
        self._objects: dict[str, bytes] = {}
        self._lock = threading.Lock()
        # Requests per method name ("get", "put", ...), for tests of request economy.
        self.counts: collections.Counter[str] = collections.Counter()
        self.fetched: collections.Counter[str] = collections.Counter()  # gets per name

    def _count(self, method: str) -> None:
        self.counts[method] += 1

    def get(self, name: str, max_size: int | None = None) -> bytes:
        """Return the object. Raises ObjectNotFoundError."""
        validate_name(name)
        with self._lock:
            self._count("get")
            self.fetched[name] += 1
            try:
                data = self._objects[name]
            except KeyError:
                raise ObjectNotFoundError(f"object {name} not found in {self.describe()}") from None
        refuse_too_large(name, len(data), max_size, self.describe())
        return data

    def stat(self, name: str) -> ObjectInfo:
        """Return size and etag. Raises ObjectNotFoundError."""
        validate_name(name)
        with self._lock:
            self._count("stat")
            data = self._objects.get(name)
        if data is None:
            raise ObjectNotFoundError(f"object {name} not found in {self.describe()}")
        return ObjectInfo(name=name, size=len(data), etag=content_etag(data))

    def put(self, name: str, data: bytes, *, replace: bool = True) -> None:
        """Create or replace the object (replace=False: create only)."""
        validate_name(name)
        data = bytes(data)
        with self._lock:
            self._count("put")
            if not replace and name in self._objects:
                raise ObjectExistsError(f"object {name} already exists in {self.describe()}")
            self._objects[name] = data

    def put_if_absent(self, name: str, data: bytes) -> None:
        """Create the object only if absent. Raises ObjectExistsError."""
        validate_name(name)
        data = bytes(data)
        with self._lock:
            self._count("put_if_absent")
            if name in self._objects:
                raise ObjectExistsError(f"object {name} already exists in {self.describe()}")
            self._objects[name] = data

    def put_if_match(self, name: str, data: bytes, etag: str) -> None:
        """Replace the object if its etag matches. Raises PreconditionFailedError."""
        validate_name(name)
        data = bytes(data)
        with self._lock:
            self._count("put_if_match")
            current = self._objects.get(name)
            if current is None:
                raise ObjectNotFoundError(f"object {name} not found in {self.describe()}")
            if content_etag(current) != etag:
                raise PreconditionFailedError(f"object {name} changed since etag {etag[:12]}")
            self._objects[name] = data

    def delete(self, name: str) -> None:
        """Delete the object; a missing object is not an error."""
        validate_name(name)
        with self._lock:
            self._count("delete")
            self._objects.pop(name, None)

    def list(self, prefix: str, start_after: str = "") -> list[str]:
        """Sorted names that start with prefix and sort after start_after."""
        validate_prefix(prefix)
        with self._lock:
            self._count("list")
            names = [n for n in self._objects if n.startswith(prefix) and n > start_after]
        return sorted(names)

    def sync(self) -> None:
        """Nothing to make durable."""
        with self._lock:
            self._count("sync")

    def free_bytes(self) -> int:
        """Unbounded: report 1 PiB."""
        return 1 << 50

    def describe(self) -> str:
        """Return "memory store"."""
        return "memory store"

    def close(self) -> None:
        """Nothing to release."""
