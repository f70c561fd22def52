"""The key epochs a volume holds: one it seals with, and at most one it still reads.

A rekey starts a new epoch while objects of the old one are still in the
store; every sealed object names its epoch, so readers pick the key by it.
The ring also counts the seals in flight per epoch, so that the re-sealer
can wait until nothing can still write under the old epoch before it lists
what is left to re-seal (a seal that began before the switch would otherwise
land after the listing and be missed).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from sealfs.crypto.envelope import read_envelope_epoch
from sealfs.crypto.subkeys import Subkeys
from sealfs.errors import NewerEpochError, RetiredEpochError


class KeyRing:
    """Epoch -> subkeys. Thread-safe: worker threads seal while the loop switches epochs."""

    def __init__(self, epoch: int, keys: Subkeys, retired: tuple[int, Subkeys] | None = None):
        self._lock = threading.Lock()
        self._epoch = epoch
        self._keys = {epoch: keys}
        self._retired: int | None = None
        if retired is not None:
            self._retired = retired[0]
            self._keys[retired[0]] = retired[1]
        self._in_use: dict[int, int] = {}

    @property
    def epoch(self) -> int:
        """The epoch new objects are sealed under."""
        return self._epoch

    @property
    def current(self) -> Subkeys:
        return self._keys[self._epoch]

    @property
    def retired_epoch(self) -> int | None:
        """The older epoch still readable (a rekey in progress), or None."""
        return self._retired

    def keys(self, epoch: int) -> Subkeys:
        """The subkeys of epoch; NewerEpochError or RetiredEpochError if the volume holds
        none for it (newer or older than the current one)."""
        keys = self._keys.get(epoch)
        if keys is None and epoch > self._epoch:
            raise NewerEpochError(
                f"object is sealed under key epoch {epoch}, newer than this volume's {self._epoch}",
                epoch,
            )
        if keys is None:
            raise RetiredEpochError(
                f"object is sealed under key epoch {epoch}, which this volume does not hold"
                f" (it is at epoch {self._epoch})"
            )
        return keys

    def keys_for(self, sealed: bytes | memoryview) -> tuple[int, Subkeys]:
        """The epoch a sealed object names and its subkeys (FormatError if no envelope)."""
        epoch = read_envelope_epoch(sealed)
        return epoch, self.keys(epoch)

    @contextlib.contextmanager
    def sealing(self) -> Iterator[tuple[int, Subkeys]]:
        """The current epoch and keys, counted as in use until the object is stored."""
        with self._lock:
            epoch = self._epoch
            self._in_use[epoch] = self._in_use.get(epoch, 0) + 1
        try:
            yield epoch, self._keys[epoch]
        finally:
            with self._lock:
                self._in_use[epoch] -= 1

    def in_use(self, epoch: int) -> int:
        """Seals under epoch that have started and not yet finished."""
        with self._lock:
            return self._in_use.get(epoch, 0)

    def advance(self, epoch: int, keys: Subkeys) -> None:
        """Seal under a new epoch from now on; the current one becomes the retired one."""
        with self._lock:
            if self._retired is not None:
                raise ValueError("a retired epoch is still held")
            if epoch != self._epoch + 1:
                raise ValueError(f"epoch {epoch} does not follow {self._epoch}")
            self._retired, self._keys[epoch] = self._epoch, keys
            self._epoch = epoch

    def follow(self, epoch: int, keys: Subkeys, retired: tuple[int, Subkeys] | None) -> None:
        """Hold exactly the epochs a newer header names (a read-only mount, which seals
        nothing): its current one, and the retired one while a rekey re-seals.

        A read-only mount may meet a header one rekey ahead, or several (it had
        stopped, or looked rarely); whatever it held before opens none of the
        objects left once those rekeys end.
        """
        with self._lock:
            if epoch <= self._epoch:
                raise ValueError(f"epoch {epoch} is not newer than {self._epoch}")
            self._keys = {epoch: keys}
            self._epoch, self._retired = epoch, None
            if retired is not None:
                self._retired = retired[0]
                self._keys[retired[0]] = retired[1]

    def drop_retired(self) -> None:
        """Forget the retired epoch's keys: its objects no longer open."""
        with self._lock:
            if self._retired is not None:
                del self._keys[self._retired]
                self._retired = None
