"""Secret files: only small regular files are read, one clear error otherwise; a new
recovery key's file outlives a failed change unless its slot surely was not stored."""

from __future__ import annotations

import argparse
import logging
import os
import pty
import select
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from sealfs.cli.init_cmd import recovery_slot_stored
from sealfs.cli.keysource import MODULE_ENV, PIN_ENV, get_pin, module_override
from sealfs.cli.secrets import (
    MAX_SECRET_FILE_BYTES,
    NEW_PASSPHRASE_ENV,
    PASSPHRASE_ENV,
    get_passphrase,
    read_secret_file,
    secret_file_for_new_slot,
)
from sealfs.errors import ConfigError, SealfsError, StoreError, TransientStoreError
from sealfs.keys.hsm import Pin
from sealfs.store.base import ObjectStore
from sealfs.store.memory import MemoryStore
from tests.conftest import RECOVERY_KEY
from tests.mounts import CHEAP_KDF, PASSPHRASE, VolumeEnv
from tests.prereq import require
from tests.store.conftest import mounted_tmpfs


def test_reads_a_regular_file_without_its_trailing_newline(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_bytes(b"x" * (MAX_SECRET_FILE_BYTES - 1) + b"\n")  # exactly at the bound
    assert read_secret_file(path, "passphrase") == b"x" * (MAX_SECRET_FILE_BYTES - 1)


def test_a_file_over_the_bound_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_bytes(b"x" * (MAX_SECRET_FILE_BYTES + 1))
    with pytest.raises(ConfigError, match=f"passphrase file {path} is larger than 64 KiB"):
        read_secret_file(path, "passphrase")


@pytest.mark.parametrize(("mode", "warned"), [(0o644, True), (0o604, True), (0o640, False)])
def test_a_secret_file_every_user_can_read_is_read_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, mode: int, warned: bool
) -> None:
    path = tmp_path / "secret"
    path.write_text("pass\n")
    path.chmod(mode)
    with caplog.at_level(logging.WARNING):
        assert read_secret_file(path, "passphrase") == b"pass"
    expected = [
        f"passphrase file {path} can be read by every user of this machine: chmod o-r {path}"
    ]
    assert [r.getMessage() for r in caplog.records] == (expected if warned else [])


def test_the_warning_names_the_owner_when_the_file_is_someone_else_s(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`chmod o-r` alone is no fix for a user who does not own the file (root's, say)."""
    require(os.geteuid() == 0, "giving a file to another user needs root")
    path = tmp_path / "secret"
    path.write_text("pass\n")
    path.chmod(0o644)
    os.chown(path, 65534, 65534)
    with caplog.at_level(logging.WARNING):
        assert read_secret_file(path, "passphrase") == b"pass"
    assert [r.getMessage() for r in caplog.records] == [
        f"passphrase file {path} can be read by every user of this machine:"
        f" chmod o-r {path} (as its owner, uid 65534, or root)"
    ]


@pytest.mark.timeout(20)
def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match=r"recovery key file .* is not a regular file"):
        read_secret_file(fifo, "recovery key")


def test_a_device_is_refused_without_reading_it() -> None:
    with pytest.raises(ConfigError, match=f"PKCS#11 PIN file {os.devnull} is not a regular file"):
        read_secret_file(os.devnull, "PKCS#11 PIN")


def test_a_symlink_to_a_regular_file_is_read(tmp_path: Path) -> None:
    target = tmp_path / "secret"
    target.write_text("pass\n")
    (tmp_path / "link").symlink_to(target)
    assert read_secret_file(tmp_path / "link", "passphrase") == b"pass"


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_credential_that_is_not_a_file_is_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Regression: a sealfs-passphrase credential that was a directory or a FIFO was taken
    for no credential at all, and the error said "no passphrase"."""
    credential = tmp_path / "sealfs-passphrase"
    if kind == "directory":
        credential.mkdir()
    else:
        os.mkfifo(credential)
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path))
    monkeypatch.delenv("SEALFS_PASSPHRASE_FILE", raising=False)
    with pytest.raises(ConfigError, match=f"passphrase file {credential} is not a regular file"):
        get_passphrase(None, confirm=False)


def test_a_missing_credential_names_the_credential_sealfs_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: with $CREDENTIALS_DIRECTORY set (a systemd unit) but the credential
    loaded under another name, the error named only --passphrase-file, the variable and a
    terminal, and not the credential name sealfs reads."""
    (tmp_path / "passphrase").write_text("loaded under the wrong name\n")
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path))
    monkeypatch.delenv("SEALFS_PASSPHRASE_FILE", raising=False)
    monkeypatch.setattr("sys.stdin.isatty", lambda: False)
    with pytest.raises(ConfigError, match=f"{tmp_path} holds no sealfs-passphrase") as info:
        get_passphrase(None, confirm=False)
    assert "LoadCredential=sealfs-passphrase:FILE" in str(info.value)


def test_a_file_a_variable_names_expands_a_leading_tilde(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: --passphrase-file=~/pass was expanded, SEALFS_PASSPHRASE_FILE=~/pass
    (a systemd unit's Environment=, a quoted export) was not: "cannot read passphrase
    file ~/pass: No such file or directory", under a name that looked right. Each
    variable that names a file is the option's alternative and reads the same file."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    (tmp_path / "pass").write_text("correct horse battery staple\n")
    (tmp_path / "pin").write_text("1234\n")
    for name in ("pass", "pin"):
        (tmp_path / name).chmod(0o600)
    monkeypatch.setenv(PASSPHRASE_ENV, "~/pass")
    monkeypatch.setenv(NEW_PASSPHRASE_ENV, "~/pass")
    monkeypatch.setenv(PIN_ENV, "~/pin")
    monkeypatch.setenv(MODULE_ENV, "~/lib/libtoken.so")
    assert get_passphrase(None, confirm=False) == b"correct horse battery staple"
    assert get_passphrase(None, confirm=False, new=True) == b"correct horse battery staple"
    args = argparse.Namespace(pkcs11_pin_file=None, pkcs11_module=None)
    assert get_pin(args) == Pin(b"1234")
    assert module_override(args) == str(tmp_path / "lib" / "libtoken.so")


def test_no_pin_names_every_place_a_pin_is_read_from(monkeypatch: pytest.MonkeyPatch) -> None:
    """The systemd credential was left out of the list (the README gives it)."""
    monkeypatch.delenv(PIN_ENV, raising=False)
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    monkeypatch.setattr(sys.stdin, "isatty", lambda: False)
    with pytest.raises(ConfigError) as raised:
        get_pin(argparse.Namespace(pkcs11_pin_file=None))
    for source in ("--pkcs11-pin-file FILE", f"{PIN_ENV}=FILE", "sealfs-pkcs11-pin", "terminal"):
        assert source in str(raised.value), str(raised.value)


def _unknown() -> bool:
    raise TransientStoreError("the store does not answer")


@pytest.mark.parametrize(
    ("stored", "kept"), [(lambda: False, False), (lambda: True, True), (_unknown, True)]
)
def test_a_new_recovery_key_file_is_removed_only_if_its_slot_surely_was_not_stored(
    tmp_path: Path, stored: Callable[[], bool], kept: bool
) -> None:
    path = tmp_path / "recovery.txt"
    with (
        pytest.raises(StoreError) as raised,
        secret_file_for_new_slot(str(path), "the-key", stored),
    ):
        assert path.read_text() == "the-key\n" and path.stat().st_mode & 0o077 == 0
        raise StoreError("sync of sealfs.vol failed")
    assert path.exists() == kept
    message = str(raised.value)
    assert message.startswith("sync of sealfs.vol failed")
    assert (f"the new recovery key is kept in {path}" in message) == kept
    assert ("check with 'sealfs key list'" in message) == kept


def test_a_recovery_key_file_that_cannot_be_written_is_removed_and_nothing_stored(
    tmp_path: Path,
) -> None:
    """Regression: on a full disk the key file stayed behind empty (a retry was refused
    as "already exists") and the error was a bare "No space left on device"."""
    with mounted_tmpfs(tmp_path / "full", "64k") as disk:
        (disk / "ballast").write_bytes(bytes(60 << 10))
        with pytest.raises(OSError):
            (disk / "more").write_bytes(bytes(8 << 10))  # the disk is full now
        path = disk / "recovery.txt"
        stored = []
        with (
            pytest.raises(SealfsError, match=f"cannot write the recovery key to {path}: No space"),
            secret_file_for_new_slot(str(path), "the-key", lambda: False),
        ):
            stored.append(True)
        assert not stored
        assert not path.exists()


def test_whether_a_recovery_slot_is_stored(volume_store: ObjectStore) -> None:
    assert recovery_slot_stored(volume_store, RECOVERY_KEY)
    assert not recovery_slot_stored(volume_store, bytes(32))  # a volume, not this key's
    assert not recovery_slot_stored(MemoryStore(), RECOVERY_KEY)  # no volume at all


def _typed_on_a_terminal(typed: bytes, *, raw: bool = False, confirm: bool = False) -> str:
    """What the passphrase prompt makes of typed, in a child on a terminal of its own
    (raw: left in raw mode, as a program that crashed leaves it; confirm: asked as for a
    new keyslot)."""
    probe = (
        f"import tty; {'tty.setraw(0)' if raw else ''}\n"
        "from sealfs.cli.secrets import get_passphrase\n"
        "try:\n"
        f"    print('GOT', get_passphrase(None, confirm={confirm}))\n"
        "except Exception as exc:\n"
        "    print('ERROR', type(exc).__name__, exc)\n"
    )
    env = {
        k: v for k, v in os.environ.items() if k not in (PASSPHRASE_ENV, "CREDENTIALS_DIRECTORY")
    }
    out = _on_a_terminal([sys.executable, "-c", probe], env, (b"Passphrase: ", typed))
    return out.decode(errors="replace").split("Passphrase: ", 1)[1].strip()


def _on_a_terminal(argv: list[str], env: dict[str, str], *answers: tuple[bytes, bytes]) -> bytes:
    """All that argv writes, run on a terminal of its own (its controlling one, and its
    stdio); answers: (a prompt, what to type once it shows), in turn."""
    pid, fd = pty.fork()
    if pid == 0:
        os.execve(argv[0], argv, env)
    out = b""
    try:
        for k, (prompt, typed) in enumerate(answers):
            answered = sum(earlier == prompt for earlier, _ in answers[:k])
            while out.count(prompt) <= answered:  # this prompt's turn has come
                ready, _, _ = select.select([fd], [], [], 30)
                assert ready, f"no {prompt!r} came: {out!r}"
                out += os.read(fd, 4096)
            os.write(fd, typed)
        while True:
            ready, _, _ = select.select([fd], [], [], 30)
            assert ready, f"the child did not end: {out!r}"
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(fd)
        os.waitpid(pid, 0)
    return out


@pytest.mark.parametrize(
    ("typed", "secret"),
    [
        ("café horse\n".encode(), repr("café horse".encode())),
        # A Latin-1 terminal under a UTF-8 locale: the bytes as sent, as from a file.
        (b"caf\xe9 horse\n", repr(b"caf\xe9 horse")),
    ],
)
def test_a_typed_secret_is_the_bytes_the_terminal_sent(typed: bytes, secret: str) -> None:
    """Regression: getpass decoded the typed line strictly, and bytes that are not UTF-8
    (docs/format.md: used as they are) ended the command as a bug: UnicodeDecodeError."""
    assert _typed_on_a_terminal(typed) == f"GOT {secret}"


def test_end_of_input_at_a_prompt_is_no_secret() -> None:
    """Regression: Ctrl-D at the passphrase prompt was "unexpected EOFError" (exit 70)."""
    assert _typed_on_a_terminal(b"\x04") == (
        "ERROR ConfigError no passphrase: the input ended (Ctrl-D) before one was typed"
    )


def test_a_new_passphrase_too_short_is_refused_before_it_is_asked_again() -> None:
    """Regression: init asked for the passphrase twice, then refused it as too short."""
    said = _typed_on_a_terminal(b"short\n", confirm=True)
    assert said.startswith("ERROR ConfigError the passphrase is shorter than 8"), said
    assert "(again)" not in said, said


def test_a_mistyped_passphrase_is_asked_for_again(tmp_path: Path) -> None:
    """Regression: one typo at the prompt ended the command (exit 3), where sudo and
    cryptsetup ask again."""
    env = VolumeEnv(tmp_path)
    env.init()
    clean = {
        k: v for k, v in os.environ.items() if k not in (PASSPHRASE_ENV, "CREDENTIALS_DIRECTORY")
    }
    argv = [sys.executable, "-m", "sealfs.cli.main", "status", str(env.store), "--json"]
    typo, right = b"not the passphrase\n", PASSPHRASE.encode() + b"\n"
    out = _on_a_terminal(argv, clean, (b"Passphrase: ", typo), (b"Passphrase: ", right))
    said = out.decode(errors="replace")
    assert said.count("wrong passphrase: try again") == 1, said
    assert '"generation"' in said, said  # unlocked at the second try
    out = _on_a_terminal(argv, clean, *[(b"Passphrase: ", typo)] * 3)
    said = out.decode(errors="replace")
    assert said.count("try again") == 2 and "no keyslot opens with it" in said, said


def test_a_terminal_left_raw_still_ends_the_line_at_enter() -> None:
    """Regression: on a terminal a program had left raw, Enter sends a carriage return
    and no newline, and the prompt waited for a newline for good; Ctrl-C and Ctrl-D
    could not end it either."""
    assert _typed_on_a_terminal(b"horse\r", raw=True) == f"GOT {b'horse'!r}"


SIGNAL_AS_ECHO_GOES_OFF = """
import termios
from sealfs.cli import secrets
from sealfs.cli.secrets import get_passphrase

before = termios.tcgetattr(0)
real = termios.tcsetattr
calls = []


def interrupted(fd, when, attributes):
    # Ctrl-C landing as the switch to quiet mode returns: Python raises
    # KeyboardInterrupt once the call is done, the new mode already set.
    real(fd, when, attributes)
    calls.append(attributes)
    if len(calls) == 1:
        raise KeyboardInterrupt


secrets.termios.tcsetattr = interrupted
try:
    get_passphrase(None, confirm=False)
except KeyboardInterrupt:
    pass
print("RESTORED" if termios.tcgetattr(0) == before else "LEFT QUIET", flush=True)
"""


def test_an_interrupt_as_echo_goes_off_still_restores_the_terminal() -> None:
    """Regression: the prompt switched echo off before its try block, so a Ctrl-C whose
    KeyboardInterrupt came as that switch returned (ISIG is now on even on a terminal
    left raw; TCSAFLUSH first waits for pending output) skipped the restore: the shell
    was left with echo off."""
    out = _on_a_terminal([sys.executable, "-c", SIGNAL_AS_ECHO_GOES_OFF], dict(os.environ))
    assert b"RESTORED" in out, out


def test_a_command_s_warning_on_a_terminal_reads_as_its_errors_do(tmp_path: Path) -> None:
    """On a terminal the warning came as a log line: a timestamp, WARNING, the logger's
    name and a pid before the words a user at a prompt needed."""
    passfile = tmp_path / "pass"
    passfile.write_text("correct horse battery staple\n")
    passfile.chmod(0o644)  # every user can read it: the command warns
    env = {k: v for k, v in os.environ.items() if k != PASSPHRASE_ENV}
    argv = [sys.executable, "-m", "sealfs.cli.main", "init", str(tmp_path / "store"),
            "--passphrase-file", str(passfile), "--recovery-key-file", str(tmp_path / "rk"),
            *CHEAP_KDF]  # fmt: skip
    out = _on_a_terminal(argv, env).decode(errors="replace")
    lines = out.replace("\r\n", "\n").strip().splitlines()
    assert lines[0] == (
        f"sealfs: warning: passphrase file {passfile} can be read by every user of this"
        f" machine: chmod o-r {passfile}"
    ), out
    assert lines[1].startswith("Created sealfs volume"), out
