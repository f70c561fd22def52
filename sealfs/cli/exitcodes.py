"""The one place where errors become process exit codes (documented in the README)."""

from __future__ import annotations

from sealfs.errors import (
    ConfigError,
    FormatError,
    IntegrityError,
    MountpointBusyError,
    NotAVolumeError,
    SealfsError,
    VolumeExistsError,
    WeakKdfError,
    WriterConflictError,
    WrongKeyError,
)

FAILURE = 1  # the store failed, or the operation did (message says which)
USAGE = 2  # bad arguments, options or configuration
WRONG_KEY = 3  # no keyslot opens with the secret given
DAMAGED = 4  # not a volume, tampered, corrupt or unsupported objects
BUSY = 5  # another writer holds the volume, or the mountpoint is busy
BUG = 70  # an unexpected exception: a bug in sealfs (EX_SOFTWARE of sysexits.h)
INTERRUPTED = 130  # Ctrl-C: 128 + SIGINT, as shells report a command killed by it

_CODES: list[tuple[type[SealfsError], int]] = [
    (WrongKeyError, WRONG_KEY),
    (WeakKdfError, DAMAGED),
    (IntegrityError, DAMAGED),
    (FormatError, DAMAGED),
    (NotAVolumeError, DAMAGED),
    (WriterConflictError, BUSY),
    (MountpointBusyError, BUSY),
    (VolumeExistsError, USAGE),
    (ConfigError, USAGE),
]


def exit_code(exc: SealfsError) -> int:
    for kind, code in _CODES:
        if isinstance(exc, kind):
            return code
    return FAILURE
