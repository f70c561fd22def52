"""RetryingStore: the one place in sealfs that retries store operations.

It retries only TransientStoreError, with exponential backoff and full jitter,
until the attempts or the deadline run out; then it raises StoreUnavailableError
naming the store and the last error. Definite answers (ObjectNotFoundError,
ObjectExistsError, PreconditionFailedError, NoSpaceError, any other StoreError)
pass through at once. The clock, sleep and random source are injectable so that
tests never really sleep. Each retry is logged with the object name and the
reason, never the data: at WARNING at most once per WARN_EVERY seconds of one
request, at DEBUG otherwise.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

from sealfs.errors import (
    ObjectExistsError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StoreUnavailableError,
    TransientStoreError,
)
from sealfs.store.base import (
    ObjectInfo,
    ObjectStore,
    StoreWrapper,
)
from sealfs.wording import counted

T = TypeVar("T")
log = logging.getLogger("sealfs.store")

WARN_EVERY = 30.0  # seconds between warnings about one request that keeps failing


class RetryingStore(StoreWrapper):
    """Wrap an ObjectStore so that transient failures are retried with backoff.

    Every method raises what the inner store raises, except that a
    TransientStoreError that outlasts the limits becomes StoreUnavailableError.
    """

    def __init__(
        self,
        inner: ObjectStore,
        *,
        attempts: int = 8,
        base_delay: float = 0.1,
        max_delay: float = 10.0,
        deadline: float | None = 300.0,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        if attempts < 1:
            raise ValueError("attempts must be at least 1")
        self.inner = inner
        self._attempts = attempts
        self._base_delay = base_delay
        self._max_delay = max_delay
        self._deadline = deadline
        self._sleep = sleep
        self._clock = clock
        self._rng = rng or random.Random()  # noqa: S311 - jitter, not secrets

    def _backoff(self, attempt: int) -> float:
        """Full jitter: uniform in [0, min(max_delay, base_delay * 2**(attempt-1))]."""
        cap = min(self._max_delay, self._base_delay * 2 ** min(attempt - 1, 60))
        return self._rng.uniform(0.0, cap)

    def _run(self, op: str, name: str, call: Callable[[], T]) -> T:
        start = self._clock()
        warned = -WARN_EVERY
        for attempt in range(1, self._attempts + 1):
            try:
                return call()
            except TransientStoreError as exc:
                last = exc
            delay = self._next_delay(attempt, start)
            if delay is None:
                break
            elapsed = self._clock() - start
            # A store that is down fails every attempt, seconds apart: one warning per
            # WARN_EVERY says so without burying the log (or a command's terminal).
            level = logging.WARNING if elapsed - warned >= WARN_EVERY else logging.DEBUG
            if level == logging.WARNING:
                warned = elapsed
            log.log(
                level,
                "store %s %s failed (attempt %d, %.0f s so far): %s; retrying in %.2f s",
                op, name or "-", attempt, elapsed, last, delay,
            )  # fmt: skip
            self._sleep(delay)
        elapsed = self._clock() - start
        raise StoreUnavailableError(
            f"store {self.inner.describe()} unreachable after {counted(attempt, 'attempt')}"
            f" over {elapsed:.1f} s: {last}: check the network and the store's address;"
            " --store-timeout sets how long sealfs keeps trying"
        ) from last

    def _next_delay(self, attempt: int, start: float) -> float | None:
        """The pause before the next attempt, or None when the limits are spent."""
        if attempt >= self._attempts:
            return None
        delay = self._backoff(attempt)
        if self._deadline is None:
            return delay
        remaining = self._deadline - (self._clock() - start)
        if remaining <= 0:
            return None
        return min(delay, remaining)

    def get(self, name: str, max_size: int | None = None) -> bytes:
        """Retrying get. Raises ObjectNotFoundError, or FormatError if too large, at once."""
        return self._run("get", name, lambda: self.inner.get(name, max_size))

    def stat(self, name: str) -> ObjectInfo:
        """Retrying stat. Raises ObjectNotFoundError at once."""
        return self._run("stat", name, lambda: self.inner.stat(name))

    def put(self, name: str, data: bytes, *, replace: bool = True) -> None:
        """Retrying put (idempotent, so always safe to repeat).

        replace=False raises ObjectExistsError at once, except where a transient error
        hid an earlier attempt that wrote these very bytes (as put_if_absent).
        """
        if replace:
            self._run("put", name, lambda: self.inner.put(name, data))
            return
        write = _ConditionalWrite(
            self.inner, name, data, lambda: self.inner.put(name, data, replace=False)
        )
        self._run("put", name, write)

    def put_if_absent(self, name: str, data: bytes) -> None:
        """Retrying put_if_absent. Raises ObjectExistsError at once.

        A transient error may hide a write that took effect; if a later attempt
        then finds the object, identical bytes count as our own write (success).
        Bytes identical to ours are indistinguishable from ours, so this is safe.
        """
        write = _ConditionalWrite(
            self.inner, name, data, lambda: self.inner.put_if_absent(name, data)
        )
        self._run("put_if_absent", name, write)

    def put_if_match(self, name: str, data: bytes, etag: str) -> None:
        """Retrying put_if_match. Raises PreconditionFailedError at once.

        As for put_if_absent: after a transient error, a precondition failure on
        an object that already holds exactly data is our own earlier write.
        """
        write = _ConditionalWrite(
            self.inner, name, data, lambda: self.inner.put_if_match(name, data, etag)
        )
        self._run("put_if_match", name, write)

    def delete(self, name: str) -> None:
        """Retrying delete (idempotent)."""
        self._run("delete", name, lambda: self.inner.delete(name))

    def list(self, prefix: str, start_after: str = "") -> list[str]:
        """Retrying list."""
        return self._run("list", prefix, lambda: self.inner.list(prefix, start_after))

    def sync(self) -> None:
        """Retrying sync."""
        self._run("sync", "", self.inner.sync)


class _ConditionalWrite:
    """One conditional write across attempts; remembers whether a transient error hid a send."""

    def __init__(
        self, inner: ObjectStore, name: str, data: bytes, write: Callable[[], None]
    ) -> None:
        self._inner = inner
        self._name = name
        self._data = data
        self._write = write
        self._maybe_sent = False

    def __call__(self) -> None:
        try:
            self._write()
        except TransientStoreError:
            self._maybe_sent = True
            raise
        except (ObjectExistsError, PreconditionFailedError):
            if not (self._maybe_sent and self._holds_our_data()):
                raise
            log.info("store %s: an earlier attempt had already written it", self._name)

    def _holds_our_data(self) -> bool:
        try:
            return self._inner.get(self._name) == self._data
        except ObjectNotFoundError:
            return False
