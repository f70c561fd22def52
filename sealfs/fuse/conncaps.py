"""Declining FUSE connection capabilities that libfuse asks for by default.

pyfuse3 gives no way to; the small library built from conncaps.c does, and says
why. It must be in the process's global lookup scope before pyfuse3 is imported
(Python binds an extension's references to libfuse when it loads it), so
sealfs.fuse loads it first thing, and mount.py checks at mount time that it served.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
from pathlib import Path

from sealfs.errors import ConfigError


def _load() -> ctypes.CDLL | str:
    """The library, or why there is none."""
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"_conncaps{suffix}"
        if path.exists():
            try:
                return ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            except OSError as exc:
                # Left from another build (an upgrade without a rebuild, a libfuse
                # changed since): the loader's error alone named no fix.
                return f"sealfs's FUSE helper library cannot be loaded: {exc}"
    return "sealfs was installed without its FUSE helper library (sealfs/fuse/_conncaps)"


_library = _load()


def check_loaded() -> None:
    """ConfigError unless the library is there to serve a mount: said before a mount
    asks for a secret and runs Argon2, not after."""
    _loaded()


def _loaded() -> ctypes.CDLL:
    if isinstance(_library, str):
        raise ConfigError(
            f"{_library}: install it again with ./scripts/setup (or pip install), which builds it"
        )
    return _library


def decline_for(read_only: bool) -> None:
    """Before pyfuse3.init: the capabilities the next session must not ask for.

    A writable mount declines both: every change to it goes through its kernel,
    whose page cache therefore stays right, and a truncating open then goes
    through SETATTR, ordered with writes. A read-only mount follows a writer
    elsewhere and needs auto_inval_data to drop the pages of files that changed
    (see Operations._file_info); it writes nothing, so it keeps the defaults.
    """
    _loaded().sealfs_decline_for_writes(not read_only)


def check_declined() -> None:
    """After pyfuse3.init: ConfigError unless libfuse's session came through the
    library (pyfuse3 imported before sealfs.fuse, or a libfuse that names the
    function otherwise), where the mount would keep the races conncaps.c names."""
    if not _loaded().sealfs_interposed():
        raise ConfigError(
            "cannot decline FUSE capabilities: pyfuse3 did not create its session through"
            " sealfs's helper library (was pyfuse3 imported before sealfs.fuse?)"
        )
