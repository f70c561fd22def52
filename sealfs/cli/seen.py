"""What this host has seen of each volume: the newest generation, per store location.

The threat model lets the store roll back: delete the newest log segments, or
put back an older copy of every object. What is left is authentic, so nothing
in the store can reveal it; only a record kept apart from the store can. Each
mount remembers the newest generation it saw committed, per volume and store
location (a copy at another path or prefix diverges legitimately and has a
record of its own), and the next mount that finds the store behind that
refuses unless told the restore was meant (--accept-rollback).

The record is a hint kept in the state directory, never needed to open a
volume: a host that lost it (or never had it) checks nothing, so a failure to
read or write it is a warning, not an error. It holds the volume id, the
store's location and a generation number, all of which the store, the host or
the command line shows anyway; no key material and nothing of the volume's content.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from sealfs.cli.paths import make_state_dirs, state_dir
from sealfs.cli.units import format_time
from sealfs.errors import ConfigError, RolledBackError
from sealfs.store.base import (
    ObjectStore,
    store_location,
)
from sealfs.store.files import (
    FileTooLargeError,
    NotARegularFileError,
    read_regular_file,
    write_all,
)
from sealfs.store.url import is_local_url
from sealfs.volume.loader import Loaded, segment_digest

log = logging.getLogger(__name__)

# (generation, when it was recorded in ns since the epoch, the SHA-256 of that generation's
# segment payload: None in records written before it was kept)
Recorded = tuple[int, int, bytes | None]
Committed = tuple[int, bytes | None]  # a generation and its segment payload's SHA-256

_MAX_RECORD = 64 * 1024  # a record is about 200 bytes; anything larger is not one
RECORD_INTERVAL = 30.0  # seconds between records while a mount runs (one small fsync)
LOCK_WAIT = 10.0  # seconds to wait for another writer of a record before giving up


@dataclass
class SeenVolume:
    """The record of one volume at one store location."""

    volume_id: bytes
    location: str  # a local store's real path and host, or an S3 bucket, prefix, endpoint
    accepting: bool = False  # --accept-rollback: the store may be behind, the record goes back
    _warned: bool = field(default=False, repr=False)  # one warning per process, not per 30 s

    @classmethod
    def of(
        cls, volume_id: bytes, url: str, store: ObjectStore, *, accepting: bool = False
    ) -> SeenVolume:
        """The record of the volume in the store that url opened.

        A local store is known by its real path: named through a symlink (or the
        symlink by the path it points to), one store directory had two records, and a
        rollback went unnoticed by the mount that used the other name. And by this
        host's name: a home shared between hosts (NFS, a container's state volume)
        holds their records side by side, and two hosts each with its own store at one
        path refused each other's as rolled back.
        """
        location = store_location(store)
        if is_local_url(url):
            location += f" on {socket.gethostname()}"
        return cls(volume_id, location, accepting)

    @property
    def path(self) -> Path:
        where = hashlib.sha256(self.location.encode("utf-8", "surrogateescape")).hexdigest()
        return state_dir() / "seen" / f"{self.volume_id.hex()}-{where[:16]}.json"

    def _where(self) -> Path | None:
        """The record's path; None, with one warning, if there is no state directory."""
        try:
            return self.path
        except ConfigError as exc:
            if not self._warned:
                log.warning("%s: a rollback of the store will not be detected", exc)
            self._warned = True
            return None

    def check_load(self, recorded: Recorded | None, loaded: Loaded) -> None:
        """check() of what was just loaded: its generation, and the store's segments."""
        self.check(recorded, loaded.live.generation, partial(segment_digest, loaded))

    def check(
        self,
        recorded: Recorded | None,
        generation: int,
        digest_at: Callable[[int], bytes | None],
    ) -> None:
        """Raise RolledBackError if recorded (this host's record at this location) is
        newer than generation, or if the store's segment of the recorded generation is
        not the one recorded (digest_at: its payload's SHA-256 in the loaded store, None
        if unreadable), unless accepting.

        recorded is the record as read before the store's log was listed (see
        unlock_seen): a record read after it may hold a generation that a mount of the
        volume on this host committed since, and takes the store for rolled back.

        A copy of the volume (a backup, mounted and written elsewhere) shares its id and
        keys: past the generation where it diverged, its log chains onto the same
        history, every object authentic. A store that served its branch in place of
        this host's, once the copy had passed the recorded generation, mounted it with
        the copy's files and without this host's, had only the generation been kept."""
        if recorded is None or self.accepting:
            return
        newest, at_ns, digest = recorded
        if generation < newest:
            raise self._behind(generation, newest, at_ns)
        if digest is not None and digest_at(newest) != digest:
            raise self._another_branch(generation, newest, at_ns)

    def _behind(self, generation: int, newest: int, at_ns: int) -> RolledBackError:
        return RolledBackError(
            f"the {self.location} holds generation {generation} of volume"
            f" {self.volume_id.hex()}, but this host saw generation {newest} there"
            f" ({format_time(at_ns)}):"
            f" the store was rolled back or restored from an older copy, and what was"
            f" committed after generation {generation} is not in it. If you restored it on"
            f" purpose, mount once with --accept-rollback"
        )

    def _another_branch(self, generation: int, newest: int, at_ns: int) -> RolledBackError:
        return RolledBackError(
            f"the {self.location} holds generation {generation} of volume"
            f" {self.volume_id.hex()}, but its generation {newest} is not the one this"
            f" host saw there ({format_time(at_ns)}): the store holds another copy of the"
            " volume, written separately (a backup mounted elsewhere), or lost that"
            f" segment, and what was committed here up to generation {newest} may not"
            " all be in it. If you restored that copy on purpose, mount once with"
            " --accept-rollback"
        )

    def warn_if_behind_elsewhere(
        self, generation: int, recorded: Recorded | None, *, read_only: bool = False
    ) -> None:
        """Warn if, since this host last recorded this location (recorded, as read before
        the load), it saw the volume at another location at a newer generation.

        A copy of a volume (a store moved to S3 or back, a backup) mounts as a
        volume of its own and diverges without harm, so this is no refusal. But
        after a move, mounting the old location by mistake (a unit not yet
        changed) wrote to a copy left behind without a word, and what the
        agents wrote there never reached the copy in use. Generations of copies
        that diverged do not say which is the volume, so once this location has
        been used since (a copy mounted for a restore drill, then the original
        again), this says nothing: it told the user to retire the live original
        at every mount until that overtook the drill's generation.
        """
        since_ns = -1 if recorded is None else recorded[1]
        ahead = [seen for seen in self._elsewhere() if seen[0] > generation and seen[1] > since_ns]
        if not ahead:
            return
        newer, at_ns, location = max(ahead)
        saw = (
            f"this host saw volume {self.volume_id.hex()} at generation {newer} at the"
            f" {location} ({format_time(at_ns)}), since it last used the {self.location},"
            f" which holds generation {generation}"
        )
        if read_only:
            log.warning(
                "%s: this copy may be out of date (the volume moved there, or this is a"
                " backup), and this read-only mount shows it as of generation %d",
                saw, generation,
            )  # fmt: skip
            return
        log.warning(
            "%s: if the volume moved there, this copy is out of date and what is written"
            " here never reaches that one: unmount this one and mount that one (README,"
            ' "Moving a volume to another store"); if that one is a copy made for a test'
            " or a restore, carry on",
            saw,
        )

    def _elsewhere(self) -> Iterator[tuple[int, int, str]]:
        """(generation, when recorded, location) of each of this volume's records at
        other locations; unusable ones are skipped (this is a hint on a hint)."""
        try:
            directory = self.path.parent
            paths = sorted(directory.glob(f"{self.volume_id.hex()}-*.json"))
        except (ConfigError, OSError):
            return
        for path in paths:
            if path == self.path:
                continue
            try:
                parsed = _parse_record(read_regular_file(path, _MAX_RECORD))
            except OSError:  # unreadable, too large, not a regular file
                continue
            if parsed is None:
                continue
            generation, at_ns, record = parsed
            location = record.get("store")
            if (
                isinstance(location, str)
                and record.get("volume_id") == self.volume_id.hex()
                and location != self.location
            ):
                yield generation, at_ns, location

    def remember(
        self, generation: int, digest: bytes | None = None, *, replace: bool = False
    ) -> None:
        """Record generation (and its segment payload's SHA-256) as seen, unless a newer
        one is (replace: record it anyway)."""
        if self._where() is None:
            return
        try:
            with self._locked() as directory:
                seen = self.recorded()
                if seen is not None and seen[0] >= generation and not replace:
                    return
                self._write(generation, digest, directory)
        except OSError as exc:
            if not self._warned:
                log.warning(
                    "cannot record generation %d in %s (%s): a rollback of the store to"
                    " before it will not be detected (set XDG_STATE_HOME to a directory"
                    " this user can write)",
                    generation,
                    self.path,
                    exc.strerror or exc,
                )
            self._warned = True

    @contextlib.contextmanager
    def _locked(self) -> Iterator[int]:
        """The record's directory, open and locked: one writer of the record at a time
        (a read-only and a read-write mount of the same volume both keep it), so that a
        slower one never lowers it."""
        directory = self.path.parent
        make_state_dirs(directory)
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            _lock_within(fd, LOCK_WAIT)
            yield fd
        finally:
            os.close(fd)

    def recorded(self) -> Recorded | None:
        """The record as it is now: (generation, when it was recorded in ns), or None if
        there is no usable record."""
        path = self._where()
        if path is None:
            return None
        try:
            # Only a regular file, opened without waiting and read up to a bound: a FIFO
            # put there hung the mount in open(), before it even asked for the store.
            raw = read_regular_file(path, _MAX_RECORD)
        except FileNotFoundError:
            return None
        except (FileTooLargeError, NotARegularFileError, IsADirectoryError):
            raw = b""  # not a record: warned about below
        except OSError as exc:  # the record cannot be written either: remember() warns
            log.debug("cannot read %s (%s): rollback not checked", self.path, exc.strerror)
            return None
        parsed = _parse_record(raw)
        if parsed is not None:
            return parsed[0], parsed[1], _digest_of(parsed[2])
        log.warning("%s is not a sealfs record; rollback not checked", self.path)
        return None

    def _write(self, generation: int, digest: bytes | None, directory: int) -> None:
        """Replace the record atomically and durably (directory: its directory, open):
        a record lost to a power cut weakens the check, a torn one would be ignored,
        and neither blocks a mount."""
        record = {
            "volume_id": self.volume_id.hex(),
            "store": self.location,
            "generation": generation,
            "seen_at_ns": time.time_ns(),
        }
        if digest is not None:
            record["digest"] = digest.hex()
        data = json.dumps(record, ensure_ascii=True).encode() + b"\n"
        self._remove_leftovers()
        # A new file of a name no one could guess: a symlink left in the directory under
        # the name used before (the pid) had the record written into the file it named,
        # truncating it, as whoever mounted (root, with a user's XDG_STATE_HOME under sudo).
        temporary = self.path.with_name(f"{self._temporary_prefix}{secrets.token_hex(8)}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(temporary, flags, 0o600)
        try:
            write_all(fd, data)
            os.fsync(fd)
            os.replace(temporary, self.path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
        finally:
            os.close(fd)
        os.fsync(directory)

    @property
    def _temporary_prefix(self) -> str:
        return f".{self.path.name}."

    def _remove_leftovers(self) -> None:
        """Remove this record's temporary files that a crash or a power cut left (one
        per mount that recorded as it happened; the record's lock is held, so no
        writer is using one now)."""
        prefix = self._temporary_prefix
        with contextlib.suppress(OSError), os.scandir(self.path.parent) as entries:
            for entry in entries:
                token = entry.name.removeprefix(prefix)
                if (
                    token != entry.name
                    and _is_token(token)
                    and entry.is_file(follow_symlinks=False)
                ):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)


def _parse_record(raw: bytes) -> tuple[int, int, dict[str, object]] | None:
    """(generation, when it was recorded in ns, the whole record) of a record's bytes;
    None if they are not one."""
    try:
        record = json.loads(raw)
        generation, at_ns = record.get("generation"), record.get("seen_at_ns")
    # Not JSON, not an object, or nested deeper than the parser goes (RecursionError,
    # which ended the mount as a bug in sealfs: exit 70).
    except (ValueError, AttributeError, RecursionError):
        return None
    if type(generation) is int and type(at_ns) is int and generation > 0:
        return generation, at_ns, record
    return None


def _digest_of(record: dict[str, object]) -> bytes | None:
    """The segment digest a record holds; None if it holds none that could be one."""
    digest = record.get("digest")
    if not isinstance(digest, str) or len(digest) != 64:
        return None
    try:
        return bytes.fromhex(digest)
    except ValueError:
        return None


def _is_token(text: str) -> bool:
    """Whether text is what secrets.token_hex(8) makes."""
    return len(text) == 16 and all(c in "0123456789abcdef" for c in text)


def _lock_within(fd: int, seconds: float) -> None:
    """flock(fd) exclusively, or raise OSError(EWOULDBLOCK) after seconds.

    A record is held locked for two small writes; a lock held longer belongs to
    something else (any process of this user may flock the directory), and waiting
    on it for good hung the mount command before the mount was reported ready.
    """
    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise BlockingIOError(
                    errno.EWOULDBLOCK, f"another process has held its lock for {seconds:.0f} s"
                ) from None
            time.sleep(0.05)
        else:
            return


@contextlib.contextmanager
def kept_current(
    seen: SeenVolume, committed: Callable[[], Committed], every: float = RECORD_INTERVAL
) -> Iterator[None]:
    """Record the committed generation once the mount serves, every so often while it
    does, and once more at the end: a daemon killed after weeks leaves a record of
    weeks, not of the day it mounted. In the daemon: a warning that the record cannot
    be kept goes to its log, once, not into the one line of a mount that fails."""
    seen.remember(*committed(), replace=seen.accepting)
    stop = threading.Event()

    def keep() -> None:
        while not stop.wait(every):
            seen.remember(*committed())

    keeper = threading.Thread(target=keep, name="sealfs-seen", daemon=True)
    keeper.start()
    try:
        yield
    finally:
        stop.set()
        keeper.join()
        seen.remember(*committed())
