"""Local paths that must not lie inside one another: a store, a mountpoint, a key file."""

from __future__ import annotations

import os
from pathlib import Path

from sealfs.errors import ConfigError
from sealfs.store.files import make_dirs
from sealfs.store.url import is_local_url, local_path, xdg_base_dir


def state_dir() -> Path:
    """sealfs's directory for host state (the default log, what each volume was seen at).

    Raises ConfigError if there is no home to put it in (and no XDG_STATE_HOME)."""
    # An unset, empty or relative XDG_STATE_HOME is ignored, as the XDG spec says.
    return xdg_base_dir("XDG_STATE_HOME", ".local", "state") / "sealfs"


def make_state_dirs(directory: Path) -> None:
    """mkdir -p of a directory under state_dir(), the owner's only from the XDG state
    base down, as the XDG spec asks of a base directory made for it: with parents=True
    alone, the base and sealfs's directory came out 0755 whatever the mode asked for
    (it holds the log, and the names of the volumes this host mounts)."""
    make_dirs(directory, root=state_dir().parent)


def user_path(text: str) -> str:
    """An option's path with a leading ~ or ~user expanded, as the store's already is.

    A shell expands neither --cache-dir=~/cache nor a systemd unit's ~: such a path
    made a directory named ~ in the working directory, and a key file there was
    reported missing under a name that looked right.
    """
    return os.path.expanduser(text)


def inside(path: str, directory: str) -> bool:
    """Whether path is directory or lies under it (symlinks resolved)."""
    real, top = os.path.realpath(path), os.path.realpath(directory)
    return os.path.commonpath([real, top]) == top


def check_key_file_outside_store(path: str | None, store: str) -> None:
    """Refuse a new key file inside a local store: whatever copies the store (a backup,
    rsync, a bucket sync) would copy the key that opens it along with it."""
    if path is None or not is_local_url(store):
        return
    root = str(local_path(store))
    if inside(path, root):  # resolved as open() will: abspath drops ".." before symlinks
        raise ConfigError(
            f"recovery key file {path} is inside the store {root}, which must never hold a"
            " key: write it outside the store (and keep it apart from the store's copies)"
        )
