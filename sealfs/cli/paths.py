"""Local paths that must not lie inside one another: a store, a mountpoint, a key file."""

from __future__ import annotations

import os
import pwd
import tempfile
from pathlib import Path

from sealfs.errors import ConfigError
from sealfs.keys.header import HEADER_NAME
from sealfs.store.files import make_dirs
from sealfs.store.local import TEMP_PREFIX
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


def check_store_is_callers(store: str) -> None:
    """Refuse to change a local store whose volume another user owns.

    Every file sealfs writes is its writer's, mode 0600: run as root on a service
    user's store (`sudo sealfs key passwd`, a rekey, a mount), a command left the
    header, segments or re-sealed chunks root's, and the service's next mount failed
    with "Permission denied", often only at the next restart. A store that is no
    volume (yet), or S3, is not checked; nor one where what this process creates
    comes out the volume owner's anyway (NFS squashing root or every user, a file
    system that shows one owner for all).
    """
    if not is_local_url(store):
        return
    root = local_path(store)
    try:
        owner = os.stat(root / HEADER_NAME).st_uid
    except OSError:
        return  # no header there: opening the store says what is wrong
    if owner == os.geteuid() or _created_as(root) in (owner, None):
        return
    try:
        user = pwd.getpwuid(owner).pw_name
    except KeyError:
        user = str(owner)
    raise ConfigError(
        f"the volume at {root} belongs to user {user} (uid {owner}): files this command"
        f" wrote there would be this user's, and lock {user} out of it; run it as {user}"
        f" ('sudo -u {user} sealfs ...'), or give the store to this user first (chown -R)"
    )


def _created_as(root: Path) -> int | None:
    """The owner a file this process creates in root comes out with; None if it may
    create none there (the command then fails on that, saying so)."""
    try:
        fd, path = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=root)
    except OSError:
        return None
    try:
        return os.fstat(fd).st_uid
    finally:
        os.close(fd)
        os.unlink(path)
