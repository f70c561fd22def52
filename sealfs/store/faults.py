"""FaultyStore: a test double that injects store failures (kept in the package, as kopia does).

It wraps any ObjectStore and, by rule, makes calls fail the way real stores
fail: transient errors (before or after the request took effect), an
unreachable store, a full disk, corrupted reads, silently lost writes. Rules
fire a fixed number of times or with a probability drawn from a seeded random
source, so failures are reproducible. Engine and FUSE tests use it; production
code never builds one.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal, TypeVar, get_args

from sealfs.errors import (
    NoSpaceError,
    StoreError,
    StoreUnavailableError,
    SyncFailedError,
    TransientStoreError,
)
from sealfs.store.base import (
    ObjectInfo,
    ObjectStore,
    StoreWrapper,
)

T = TypeVar("T")

Fault = Literal[
    "transient",
    "transient_after",
    "unavailable",
    "nospace",
    "failed",
    "corrupt",
    "drop",
    "flush_failed",
]
"""transient: raise TransientStoreError without calling the inner store.
transient_after: call the inner store (the request took effect), then raise TransientStoreError.
unavailable: raise StoreUnavailableError. nospace: raise NoSpaceError.
failed: raise StoreError, a failure that is not retried (a local store refusing a write:
EACCES, EPERM, EROFS, EIO).
corrupt: get returns the object with one byte flipped.
drop: a write (put, put_if_absent, put_if_match, delete) returns success but does nothing.
flush_failed: sync raises SyncFailedError (the disk failed to write back what was put)."""

FAULTS: tuple[str, ...] = get_args(Fault)
METHODS = ("get", "stat", "put", "put_if_absent", "put_if_match", "delete", "list", "sync")
WRITES = frozenset({"put", "put_if_absent", "put_if_match", "delete"})


@dataclass
class FaultRule:
    """Fail calls of method ("*" for any) on names starting with prefix.

    times: how many more times the rule fires (None: no limit).
    probability: chance that a matching call fires the rule.
    """

    method: str
    prefix: str
    fault: Fault
    times: int | None = None
    probability: float = 1.0

    def __post_init__(self) -> None:
        if self.fault not in FAULTS:
            raise ValueError(f"unknown fault {self.fault!r}; use one of {', '.join(FAULTS)}")
        if self.method != "*" and self.method not in METHODS:
            raise ValueError(f"unknown store method {self.method!r}")
        if self.fault == "corrupt" and self.method not in ("*", "get"):
            raise ValueError("a corrupt fault applies to get only")
        if self.fault == "drop" and self.method != "*" and self.method not in WRITES:
            raise ValueError("a drop fault applies to writes only")
        if self.fault == "flush_failed" and self.method not in ("*", "sync"):
            raise ValueError("a flush_failed fault applies to sync only")

    def matches(self, method: str, name: str) -> bool:
        """Whether this rule can fire for a call of method on name."""
        if self.times is not None and self.times <= 0:
            return False
        if self.method not in ("*", method) or not name.startswith(self.prefix):
            return False
        if self.fault == "corrupt":
            return method == "get"
        if self.fault == "drop":
            return method in WRITES
        if self.fault == "flush_failed":
            return method == "sync"
        return True


class FaultyStore(StoreWrapper):
    """An ObjectStore that forwards to inner except where a rule injects a fault.

    Thread-safe. `injected` records (method, name, fault) for every fault fired.
    """

    def __init__(
        self, inner: ObjectStore, rules: Iterable[FaultRule] = (), *, seed: int = 0
    ) -> None:
        self.inner = inner
        self.rules: list[FaultRule] = list(rules)
        self.injected: list[tuple[str, str, str]] = []
        self._rng = random.Random(seed)  # noqa: S311 - reproducible test faults
        self._lock = threading.Lock()

    def add_rule(
        self,
        method: str,
        prefix: str,
        fault: Fault,
        *,
        times: int | None = None,
        probability: float = 1.0,
    ) -> FaultRule:
        """Append a rule (checked after earlier ones) and return it."""
        rule = FaultRule(method, prefix, fault, times, probability)
        with self._lock:
            self.rules.append(rule)
        return rule

    def fail_next(self, method: str, prefix: str, fault: Fault, times: int = 1) -> FaultRule:
        """Make the next `times` matching calls fail; checked before every other rule."""
        rule = FaultRule(method, prefix, fault, times)
        with self._lock:
            self.rules.insert(0, rule)
        return rule

    def clear(self) -> None:
        """Remove every rule."""
        with self._lock:
            self.rules.clear()

    def _pick(self, method: str, name: str) -> Fault | None:
        with self._lock:
            for rule in self.rules:
                if not rule.matches(method, name):
                    continue
                if rule.probability < 1.0 and self._rng.random() >= rule.probability:
                    continue
                if rule.times is not None:
                    rule.times -= 1
                self.injected.append((method, name, rule.fault))
                return rule.fault
        return None

    def _apply(self, fault: Fault | None, method: str, name: str, call: Callable[[], T]) -> T:
        what = f"{method} {name}".rstrip()
        if fault == "transient":
            raise TransientStoreError(f"injected transient fault: {what}")
        if fault == "unavailable":
            raise StoreUnavailableError(f"injected fault: store unreachable: {what}")
        if fault == "nospace":
            raise NoSpaceError(f"injected fault: store disk full: {what}")
        if fault == "failed":
            raise StoreError(f"injected fault: request refused: {what}")
        if fault == "flush_failed":
            raise SyncFailedError(f"injected fault: flush failed: {what}")
        result = call()
        if fault == "transient_after":
            raise TransientStoreError(f"injected transient fault after the request: {what}")
        return result

    def _write(self, method: str, name: str, call: Callable[[], None]) -> None:
        fault = self._pick(method, name)
        if fault == "drop":
            return
        self._apply(fault, method, name, call)

    def _corrupt(self, data: bytes) -> bytes:
        if not data:
            return b"\x00"
        with self._lock:
            pos = self._rng.randrange(len(data))
        flipped = bytearray(data)
        flipped[pos] ^= 0x01
        return bytes(flipped)

    def get(self, name: str, max_size: int | None = None) -> bytes:
        """Forward get, or inject a fault (corrupt flips one byte of the result)."""
        fault = self._pick("get", name)
        if fault == "corrupt":
            return self._corrupt(self.inner.get(name, max_size))
        return self._apply(fault, "get", name, lambda: self.inner.get(name, max_size))

    def stat(self, name: str) -> ObjectInfo:
        """Forward stat, or inject a fault."""
        return self._apply(self._pick("stat", name), "stat", name, lambda: self.inner.stat(name))

    def put(self, name: str, data: bytes, *, replace: bool = True) -> None:
        """Forward put, or inject a fault (drop loses it silently)."""
        self._write("put", name, lambda: self.inner.put(name, data, replace=replace))

    def put_if_absent(self, name: str, data: bytes) -> None:
        """Forward put_if_absent, or inject a fault."""
        self._write("put_if_absent", name, lambda: self.inner.put_if_absent(name, data))

    def put_if_match(self, name: str, data: bytes, etag: str) -> None:
        """Forward put_if_match, or inject a fault."""
        self._write("put_if_match", name, lambda: self.inner.put_if_match(name, data, etag))

    def delete(self, name: str) -> None:
        """Forward delete, or inject a fault."""
        self._write("delete", name, lambda: self.inner.delete(name))

    def list(self, prefix: str, start_after: str = "") -> list[str]:
        """Forward list (rules match the prefix argument), or inject a fault."""
        fault = self._pick("list", prefix)
        return self._apply(fault, "list", prefix, lambda: self.inner.list(prefix, start_after))

    def sync(self) -> None:
        """Forward sync, or inject a fault."""
        self._apply(self._pick("sync", ""), "sync", "", self.inner.sync)

    def describe(self) -> str:
        """Describe the inner store, marked as fault-injecting."""
        return f"{self.inner.describe()} (with injected faults)"
