"""The one small tree of exceptions that every layer raises.

Errors become errno values only in the FUSE adapter and exit codes only in the
CLI; below those boundaries code raises these types. Every message is a single
line that names the problem and, where there is one, the fix.
"""

from __future__ import annotations

import errno as _errno
import re

# user:password@ in a URL, up to its last @ before the path (a password may hold one).
_USERINFO_RE = re.compile(r"(?<=://)[^/\s\"']*@")


def without_userinfo(text: str) -> str:
    """text with any URL's user:password@ taken out, for a message.

    botocore quotes the endpoint it failed to reach or set up, and AWS_ENDPOINT_URL
    (boto3's to read, so S3 and KMS errors alike) may carry credentials.
    """
    return _USERINFO_RE.sub("", text)


class SealfsError(Exception):
    """Root of every error sealfs raises on purpose."""


class FormatError(SealfsError):
    """Bytes that do not parse as the object they claim to be."""


class MetadataTooLargeError(FormatError):
    """A snapshot larger than a reader accepts (codec.MAX_METADATA_SIZE): never written."""


class UnsupportedVersionError(FormatError):
    """An object written by a format version this build does not read."""


class IntegrityError(SealfsError):
    """Authentication failed: the object was tampered with, swapped or corrupted."""


class NewerEpochError(IntegrityError):
    """An object sealed under a key epoch newer than the keys held: the volume was
    rekeyed since its header was read (or the object's epoch was forged)."""

    def __init__(self, message: str, epoch: int) -> None:
        super().__init__(message)
        self.epoch = epoch


class RetiredEpochError(IntegrityError):
    """An object sealed under a key epoch older than the keys held: one a rekey retired,
    written by a writer that had lost the volume after the rekey had re-sealed the rest
    (or the object's epoch was forged)."""


class RolledBackError(IntegrityError):
    """The store holds an older generation than this host saw committed there."""


class WrongKeyError(SealfsError):
    """No keyslot opened with the secret that was given."""


class NoSlotOfKindError(WrongKeyError):
    """The volume has no keyslot of the given secret's kind at all: asking for the
    secret again cannot help."""


class WeakKdfError(SealfsError):
    """KDF parameters below the minimum sealfs accepts (possibly lowered by an attacker)."""


class KeyUnavailableError(SealfsError):
    """A key service or token needed to open a keyslot could not be used (cause in the message).

    KMS key disabled, pending deletion or not found, KMS unreachable, no AWS
    credentials, PKCS#11 module or token missing. A denial or a wrong secret
    (KMS AccessDenied, a wrong PIN) is a WrongKeyError instead.
    """


class NotAVolumeError(SealfsError):
    """The store holds no sealfs volume header."""


class VolumeExistsError(SealfsError):
    """init was asked to create a volume where one already exists."""


class ConfigError(SealfsError):
    """A bad option, URL or setting given by the user."""


class VolumeChangedError(SealfsError):
    """The volume changed under a command that was loading it (a rekey): run it again."""


class WriterConflictError(SealfsError):
    """Another writer holds the volume (named in the message)."""


class MountpointBusyError(SealfsError):
    """Something is already mounted on the mountpoint."""


class WriterStoppedError(SealfsError):
    """This mount can commit nothing more: it turned read-only (reason in the message)."""


class FencedError(WriterStoppedError):
    """This writer lost the generation race: another writer committed first."""


class VolumeGoneError(WriterStoppedError):
    """The store no longer holds the log this writer committed: emptied or replaced
    under the mount."""


class StoreError(SealfsError):
    """A store operation failed."""


class NoCredentialsError(StoreError, ConfigError):
    """No usable credentials for the store: a setting to fix (exit 2, as a missing
    profile), and a store failure to the code that retries or reports those (a mount
    whose credentials went away keeps its data pending)."""


class ObjectNotFoundError(StoreError):
    """The named object does not exist in the store."""


class ObjectExistsError(StoreError):
    """A create-if-absent found the object already there."""


class PreconditionFailedError(StoreError):
    """A replace-if-match found a different version of the object."""


class TransientStoreError(StoreError):
    """A failure worth retrying (timeout, throttling, connection reset, 5xx)."""


class StoreUnavailableError(StoreError):
    """The store stayed unreachable after retrying for the configured limit."""


class NoSpaceError(StoreError):
    """The disk under a local store or cache is full."""


class SyncFailedError(StoreError, WriterStoppedError):
    """The store's disk failed to flush written objects to stable storage.

    After a failed writeback Linux may drop the data, and reports the error
    once: a later flush that succeeds proves nothing (PostgreSQL's "fsyncgate").
    So no later commit of this mount may count those objects durable.
    """


class FsError(SealfsError):
    """A POSIX-level failure of a filesystem operation, carrying its errno."""

    def __init__(self, errno: int, message: str | None = None) -> None:
        self.errno = errno
        super().__init__(message or _errno.errorcode.get(errno, str(errno)))


def first_leaf(exc: BaseException) -> BaseException:
    """The first error inside an exception group, however deep (exc itself if no group).

    trio wraps a task's error in its nursery's group, and nested nurseries nest
    groups; callers that handle one typed error (the commit loop, fsync, the
    mount's final commit) want that error itself.
    """
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc
