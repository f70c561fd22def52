"""Where secrets come from: a file, an environment variable naming a file,
systemd's credentials directory, or a terminal prompt. Never argv, never logs.
"""

from __future__ import annotations

import getpass
import os
import sys
import unicodedata
from pathlib import Path

from sealfs.errors import ConfigError

PASSPHRASE_ENV = "SEALFS_PASSPHRASE_FILE"  # noqa: S105 - a variable name, not a secret
CREDENTIAL_NAME = "sealfs-passphrase"


def read_secret_file(path: str | Path, what: str) -> bytes:
    """The file's bytes without one trailing newline. Raises ConfigError."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} file {path}: {exc.strerror}") from None
    if data.endswith(b"\r\n"):
        data = data[:-2]
    elif data.endswith(b"\n"):
        data = data[:-1]
    if not data:
        raise ConfigError(f"{what} file {path} is empty")
    return data


def passphrase_source(explicit_file: str | None) -> str | None:
    """The file to read the passphrase from, by precedence, or None for a prompt."""
    if explicit_file:
        return explicit_file
    if os.environ.get(PASSPHRASE_ENV):
        return os.environ[PASSPHRASE_ENV]
    creds = os.environ.get("CREDENTIALS_DIRECTORY")
    if creds and (Path(creds) / CREDENTIAL_NAME).is_file():
        return str(Path(creds) / CREDENTIAL_NAME)
    return None


def normalize_passphrase(raw: bytes) -> bytes:
    """UTF-8 text in Unicode NFC, so that one passphrase typed on two systems unlocks alike.

    Bytes that are not UTF-8 are used as they are.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw
    return unicodedata.normalize("NFC", text).encode("utf-8")


def get_passphrase(explicit_file: str | None, *, confirm: bool) -> bytes:
    """The passphrase, from a file or (on a terminal) a prompt. Raises ConfigError."""
    source = passphrase_source(explicit_file)
    if source is not None:
        return normalize_passphrase(read_secret_file(source, "passphrase"))
    if not sys.stdin.isatty():
        raise ConfigError(
            "no passphrase: give --passphrase-file FILE, set "
            f"{PASSPHRASE_ENV}=FILE, or run on a terminal to be asked"
        )
    first = getpass.getpass("Passphrase: ").encode()
    if not first:
        raise ConfigError("the passphrase must not be empty")
    if confirm and getpass.getpass("Passphrase (again): ").encode() != first:
        raise ConfigError("the two passphrases differ: nothing was created")
    return normalize_passphrase(first)


def write_new_secret_file(path: str, text: str) -> None:
    """Write a new secret (a recovery key) to a file only its owner can read.

    Refuses to overwrite: a recovery key that replaced another would lose it.
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ConfigError(
            f"{path} already exists: choose a new file for the recovery key"
        ) from None
    except OSError as exc:
        raise ConfigError(f"cannot create {path}: {exc.strerror}") from None
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
