"""Where secrets come from: a file, an environment variable naming a file,
systemd's credentials directory, or a terminal prompt. Never argv, never logs.
"""

from __future__ import annotations

import contextlib
import errno
import locale
import logging
import os
import stat
import sys
import termios
import unicodedata
from collections.abc import Callable, Iterator
from pathlib import Path

from sealfs.cli.paths import user_path
from sealfs.errors import ConfigError, SealfsError

log = logging.getLogger(__name__)

PASSPHRASE_ENV = "SEALFS_PASSPHRASE_FILE"  # noqa: S105 - a variable name, not a secret
CREDENTIAL_NAME = "sealfs-passphrase"
NEW_PASSPHRASE_ENV = "SEALFS_NEW_PASSPHRASE_FILE"  # noqa: S105 - a variable name
NEW_PASSPHRASE_CREDENTIAL = "sealfs-new-passphrase"  # noqa: S105
# A passphrase a slot is made with: each guess costs an Argon2 run, but a handful of
# characters is still within reach of whoever holds a copy of the header.
MIN_NEW_PASSPHRASE_CHARS = 8
# Far above any passphrase, PIN or recovery key: a larger file is the wrong file.
MAX_SECRET_FILE_BYTES = 64 * 1024


def _cannot_read(what: str, where: str, exc: OSError) -> ConfigError:
    """Could not open or read a secret's file: the errno, and its fix where it has one
    (a path that does not exist said only "No such file or directory")."""
    fix = {
        errno.ENOENT: "check the path",
        errno.ENOTDIR: "check the path",
        errno.EACCES: f"make it readable by this user (uid {os.geteuid()})",
    }.get(exc.errno or 0)
    return ConfigError(
        f"cannot read {what} file {where}: {exc.strerror}{f': {fix}' if fix else ''}"
    )


def _not_regular(path: str | Path, what: str) -> ConfigError:
    return ConfigError(
        f"{what} file {path} is not a regular file (a pipe, device or directory):"
        f" put the {what} in a regular file"
    )


def _open_regular_file(path: str | Path, what: str, origin: str) -> int:
    """A read-only descriptor of path, which must be a regular file. Raises ConfigError.

    A device such as /dev/zero never ends, and opening a FIFO blocks until
    someone writes to it: neither is opened at all (the stat), and O_NONBLOCK
    keeps the open from hanging if path became a FIFO after the stat.
    """
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise _not_regular(f"{path}{origin}", what)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise _cannot_read(what, f"{path}{origin}", exc) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise _not_regular(f"{path}{origin}", what)
    if st.st_mode & stat.S_IROTH:
        # A warning, not a refusal: refusing would stop mounts that worked until now, at
        # boot. But every local user can read the secret that opens the volume.
        fix = f"chmod o-r {path}"
        if st.st_uid != os.geteuid():  # only its owner or root may change its mode
            fix += f" (as its owner, uid {st.st_uid}, or root)"
        log.warning("%s file %s can be read by every user of this machine: %s", what, path, fix)
    return fd


def _read_bounded(path: str | Path, what: str, origin: str) -> bytes:
    """The bytes of a regular file of at most MAX_SECRET_FILE_BYTES. Raises ConfigError."""
    fd = _open_regular_file(path, what, origin)
    try:
        with open(fd, "rb") as f:
            data = f.read(MAX_SECRET_FILE_BYTES + 1)  # one more: tells "too large" from "full"
    except OSError as exc:
        raise _cannot_read(what, f"{path}{origin}", exc) from None
    if len(data) > MAX_SECRET_FILE_BYTES:
        raise ConfigError(
            f"{what} file {path}{origin} is larger than {MAX_SECRET_FILE_BYTES // 1024} KiB:"
            f" give a file that holds only the {what}"
        )
    return data


def read_secret_file(path: str | Path, what: str, origin: str = "") -> bytes:
    """The file's bytes without one trailing newline. Raises ConfigError.

    Every secret the CLI reads from a file (passphrases, recovery keys, PINs)
    comes through here, so each is bounded and must be a regular file. origin
    follows the path in errors (see secret_origin).
    """
    data = _read_bounded(path, what, origin)
    if data.endswith(b"\r\n"):
        data = data[:-2]
    elif data.endswith(b"\n"):
        data = data[:-1]
    if not data:
        raise ConfigError(f"{what} file {path}{origin} is empty")
    return data


def secret_source(explicit: str | None, env: str, credential: str) -> str | None:
    """The file to read a secret from, by precedence: the option, the variable naming a
    file, systemd's credential; None for a prompt.

    The variable's path expands a leading ~ as the option's does (user_path): set by a
    systemd unit's Environment= or a quoted export, SEALFS_PASSPHRASE_FILE=~/pass was
    "cannot read passphrase file ~/pass", where --passphrase-file=~/pass worked."""
    if explicit:
        return explicit
    if os.environ.get(env):
        return user_path(os.environ[env])
    creds = os.environ.get("CREDENTIALS_DIRECTORY")
    # Present, not is_file(): a credential that is a directory or a FIFO is refused by
    # name when read, where it was taken for no credential ("no passphrase") before.
    if creds and os.path.lexists(Path(creds) / credential):
        return str(Path(creds) / credential)
    return None


def secret_origin(explicit: str | None, env: str) -> str:
    """Words that say where secret_source found the path, for its errors: " (named by
    VARIABLE)" when the environment gave it (a unit's Environment=, a profile), which
    the command line shows nothing of; "" for the option and the credential, whose
    paths say where they came from."""
    return f" (named by {env})" if not explicit and os.environ.get(env) else ""


def passphrase_source(explicit_file: str | None) -> str | None:
    """Where the passphrase of an unlock comes from, or None for a prompt."""
    return secret_source(explicit_file, PASSPHRASE_ENV, CREDENTIAL_NAME)


def normalize_passphrase(raw: bytes) -> bytes:
    """UTF-8 text in Unicode NFC, so that one passphrase typed on two systems unlocks alike.

    Bytes that are not UTF-8 are used as they are.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw
    return unicodedata.normalize("NFC", text).encode("utf-8")


def get_passphrase(explicit_file: str | None, *, confirm: bool, new: bool = False) -> bytes:
    """The passphrase, from a file or (on a terminal) a prompt. Raises ConfigError.

    new: the passphrase a keyslot change sets (its own option, variable and
    credential; always asked twice). One a slot is made with (confirm or new)
    must have at least MIN_NEW_PASSPHRASE_CHARS characters: a typed one is
    refused before it is asked for again (refused after, it was typed twice for
    nothing).
    """
    made = confirm or new
    what = "new passphrase" if new else "passphrase"
    flag, env, credential = (
        ("--new-passphrase-file", NEW_PASSPHRASE_ENV, NEW_PASSPHRASE_CREDENTIAL)
        if new
        else ("--passphrase-file", PASSPHRASE_ENV, CREDENTIAL_NAME)
    )
    source = secret_source(explicit_file, env, credential)
    if source is not None:
        passphrase = normalize_passphrase(
            read_secret_file(source, what, secret_origin(explicit_file, env))
        )
        if made:
            _check_length(passphrase, new=new)
        return passphrase
    if not sys.stdin.isatty():
        raise _no_secret(what, flag, env, credential)
    prompt = what.capitalize()
    first = prompt_secret(f"{prompt}: ", what)
    if not first:
        raise ConfigError("the passphrase must not be empty")
    passphrase = normalize_passphrase(first)
    if made:
        _check_length(passphrase, new=new)
        if prompt_secret(f"{prompt} (again): ", what) != first:
            raise ConfigError(
                f"the two passphrases differ: nothing was {'changed' if new else 'created'}"
            )
    return passphrase


def _check_length(passphrase: bytes, *, new: bool) -> None:
    if len(passphrase.decode(errors="replace")) < MIN_NEW_PASSPHRASE_CHARS:
        raise ConfigError(
            f"the {'new ' if new else ''}passphrase is shorter than {MIN_NEW_PASSPHRASE_CHARS}"
            " characters: choose a longer one (the store's copies can be attacked offline)"
        )


def prompt_secret(prompt: str, what: str) -> bytes:
    """One line typed on the terminal, not echoed, without its newline. Raises ConfigError
    at the end of input (Ctrl-D).

    Text in the locale's encoding comes back as UTF-8, as getpass gave it; bytes that
    are not in that encoding (a Latin-1 terminal under a UTF-8 locale) come back as
    they are, as from a file. getpass decoded them strictly: UnicodeDecodeError, and
    Ctrl-D an EOFError, each reported as a bug in sealfs (exit 70).
    """
    with contextlib.ExitStack() as stack:
        try:
            fd = out = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
            stack.callback(os.close, fd)
        except OSError:  # no controlling terminal: stdin is one (the caller checked)
            fd, out = sys.stdin.fileno(), sys.stderr.fileno()
        old = termios.tcgetattr(fd)
        quiet = list(old)
        # A line, as a terminal in its usual mode gives one, even from a terminal a
        # program left raw: there Enter sent "\r" and no newline, and the prompt
        # waited for good (Ctrl-C and Ctrl-D, raw too, could not end it).
        quiet[0] |= termios.ICRNL
        quiet[3] = (quiet[3] | termios.ICANON | termios.ISIG) & ~termios.ECHO
        try:
            # Echo off first, as getpass does: TCSAFLUSH drops what was typed before it.
            # Inside the try: a Ctrl-C whose KeyboardInterrupt comes as this returns (it
            # first waits for pending output to drain) left the terminal without echo.
            termios.tcsetattr(fd, termios.TCSAFLUSH, quiet)
            sys.stderr.flush()
            os.write(out, prompt.encode(errors="replace"))
            line = b""
            while not line.endswith(b"\n") and len(line) <= MAX_SECRET_FILE_BYTES:
                chunk = os.read(fd, 4096)
                if not chunk:
                    break
                line += chunk
        finally:
            termios.tcsetattr(fd, termios.TCSAFLUSH, old)
            os.write(out, b"\n")
    if not line:
        raise ConfigError(f"no {what}: the input ended (Ctrl-D) before one was typed")
    raw = line.removesuffix(b"\n")
    try:
        return raw.decode(locale.getpreferredencoding(False)).encode()
    except (UnicodeError, LookupError):
        return raw


def _no_secret(what: str, flag: str, env: str, credential: str) -> ConfigError:
    """The error when no source gives the secret and no terminal can ask for it.

    Under systemd, the usual cause is a credential loaded under another name: say
    which name sealfs looks for, and where.
    """
    creds = os.environ.get("CREDENTIALS_DIRECTORY")
    if creds:
        return ConfigError(
            f"no {what}: the credentials directory {creds} holds no {credential}"
            f" (use LoadCredential={credential}:FILE), and neither {flag} nor {env} is given"
        )
    return ConfigError(
        f"no {what}: give {flag} FILE, set {env}=FILE, load the systemd credential"
        f" {credential}, or run on a terminal to be asked"
    )


def _key_file_exists(path: str) -> ConfigError:
    if not os.path.isfile(path) and os.path.exists(path):
        # /dev/stdout "already exists", which named neither why it was refused nor the
        # way to print the key.
        return ConfigError(
            f"{path} is not a regular file: give a new file for the recovery key, or leave"
            " the option out to have the key printed"
        )
    return ConfigError(f"{path} already exists: choose a new file for the recovery key")


def check_new_key_file(path: str | None) -> None:
    """Refuse, before any prompt or unlock, a recovery key file that already exists.

    write_new_secret_file refuses it too, but only once the passphrase was typed (twice,
    for init) and Argon2 had run: the user then typed it all again for the new name.
    """
    if path is not None and os.path.lexists(path):
        raise _key_file_exists(path)


def write_new_secret_file(path: str, text: str) -> None:
    """Write a new secret (a recovery key) to a file only its owner can read.

    Refuses to overwrite: a recovery key that replaced another would lose it.
    A write that fails (a full disk) removes the file again: left empty or cut
    short, it would pass for the key, and refuse the retry as already existing.
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise _key_file_exists(path) from None
    except OSError as exc:
        raise ConfigError(
            f"cannot create recovery key file {path}: {exc.strerror}: choose a new file for"
            " the recovery key, in a directory that exists and that you may write"
        ) from None
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())  # on disk before the slot it opens can be
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise SealfsError(
            f"cannot write the recovery key to {path}: {exc.strerror}; nothing was stored:"
            " free space there (or choose another file) and retry"
        ) from None


@contextlib.contextmanager
def secret_file_for_new_slot(
    path: str | None, text: str, slot_stored: Callable[[], bool]
) -> Iterator[None]:
    """Write the secret of a keyslot about to be stored; keep it unless the slot surely is not.

    The file comes first, so that no slot is ever stored whose secret was
    lost. If storing the slot fails, the file is removed only when
    slot_stored() says the store does not hold it. When it may (a reply lost,
    a sync that failed, a store that no longer answers) the file stays and the
    error says so: a removed file whose slot lives on would leave a working key
    in the disk's free blocks, and its owner without it.
    """
    if path is None:
        yield
        return
    write_new_secret_file(path, text)
    try:
        yield
    except BaseException as exc:
        try:
            stored: bool | None = slot_stored()
        except Exception:  # the store does not answer: the outcome is unknown
            stored = None
        if stored is False:
            os.unlink(path)
            raise
        if not isinstance(exc, SealfsError):
            raise
        kept = (
            f"{exc}; the new recovery key is kept in {path}, since the store may hold its"
            " keyslot: check with 'sealfs key list' before trying again"
        )
        raise type(exc)(kept) from None
