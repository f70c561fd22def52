"""Standard descriptors a command may find: closed ones, and a stdout that cannot
encode every path (bytes that are not UTF-8, under a UTF-8 locale's strict output).

README: every error is one line on stderr, with the documented exit code; init
prints the recovery key once, so an output that cannot show it must not cost it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sealfs.cli.stdio import one_line
from tests.mounts import CHEAP_KDF, VolumeEnv

USAGE = 2


def run_with(
    redirect: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """The CLI, run by a shell with redirect applied (`>&-` closes stdout)."""
    command = [sys.executable, "-m", "sealfs.cli.main", *args]
    return subprocess.run(
        ["sh", "-c", f'exec "$@" {redirect}', "sh", *command],
        capture_output=True, text=True, timeout=120, check=False, env=env,
    )  # fmt: skip


def test_init_at_a_path_that_is_not_utf8_shows_the_recovery_key(tmp_path: Path) -> None:
    """Regression: under a UTF-8 locale (stdout strict, as with en_US.UTF-8), init made
    the volume, then "Created ... in local store at <path>" raised UnicodeEncodeError
    (exit 70) before the recovery key, shown nowhere else, was printed."""
    store = os.fsdecode(os.fsencode(str(tmp_path)) + b"/st\xffore")
    passfile = VolumeEnv(tmp_path).passfile
    env = dict(os.environ, PYTHONIOENCODING="utf-8")  # strict, as a UTF-8 locale makes it
    result = run_with("", "init", store, "--passphrase-file", str(passfile), *CHEAP_KDF, env=env)
    assert result.returncode == 0, result.stderr
    assert "sfrk-" in result.stdout  # the recovery key
    assert "st\\udcffore" in result.stdout  # the path, escaped
    status = run_with("", "status", store, "--passphrase-file", str(passfile), env=env)
    assert status.returncode == 0, status.stderr
    assert "volume id" in status.stdout


def test_init_refuses_to_show_the_recovery_key_on_a_closed_stdout(tmp_path: Path) -> None:
    """Regression: `sealfs init STORE >&-` made the volume, printed its recovery key to
    nothing and exited 70 ("'NoneType' object has no attribute 'flush'")."""
    store = tmp_path / "store"
    passfile = VolumeEnv(tmp_path).passfile
    result = run_with(">&-", "init", str(store), "--passphrase-file", str(passfile), *CHEAP_KDF)
    assert result.returncode == USAGE, result.stderr
    assert "--recovery-key-file" in result.stderr.strip()
    assert "\n" not in result.stderr.strip()
    assert not store.exists()
    result = run_with(
        ">&-", "init", str(store), "--passphrase-file", str(passfile), *CHEAP_KDF,
        "--recovery-key-file", str(tmp_path / "rk"),
    )  # fmt: skip
    # Made, with its key in the file; the output it could not write is a failure to say.
    assert (result.returncode, result.stderr) == (
        1,
        "sealfs: cannot write the output: stdout is closed\n",
    )
    assert (store / "sealfs.vol").exists() and (tmp_path / "rk").exists()


def test_a_closed_stdin_is_no_terminal(tmp_path: Path) -> None:
    """Regression: with stdin closed, a command with no passphrase source exited 70
    ("'NoneType' object has no attribute 'isatty'") instead of naming the sources."""
    env = VolumeEnv(tmp_path)
    env.init()
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in ("SEALFS_PASSPHRASE_FILE", "CREDENTIALS_DIRECTORY")
    }
    result = run_with("<&-", "status", str(env.store), env=clean)
    assert result.returncode == USAGE, result.stderr
    assert result.stderr.startswith("sealfs: no passphrase: give --passphrase-file")


@pytest.mark.fuse
def test_mount_with_stderr_closed_serves(volume_env: VolumeEnv) -> None:
    """Regression: `sealfs mount ... 2>&-` exited 1: the daemon, pointing its closed
    stderr at the log file, failed ("'NoneType' object has no attribute 'flush'") after
    the kernel mount was made, and left it dead. `sealfs status MNT >&-` exited 70."""
    env = volume_env
    result = run_with("2>&-", *env.mount_args())
    assert result.returncode == 0, env.log_text()
    try:
        (env.mnt / "f").write_bytes(b"data")
        status = run_with(">&-", "status", str(env.mnt))
        assert (status.returncode, status.stderr) == (
            1,
            "sealfs: cannot write the output: stdout is closed\n",
        )
        assert run_with(">&-", "sync", str(env.mnt)).returncode == 0
    finally:
        env.umount()


@pytest.mark.parametrize("option", ["--version", "--help"])
def test_help_and_version_into_a_closed_stdout_are_one_line(option: str) -> None:
    """argparse prints them and exits: the output must fail where main reports it, not
    in Python's flush at exit ("Exception ignored ...", exit 120)."""
    result = run_with(">&-", option)
    assert (result.returncode, result.stderr) == (
        1,
        "sealfs: cannot write the output: stdout is closed\n",
    )


def test_an_error_naming_a_path_with_a_newline_is_one_line(tmp_path: Path) -> None:
    """Regression: the newline of a path (a store, a mountpoint) split the error line in
    two; it is escaped as Python writes it, as are tabs and other control characters."""
    store = tmp_path / "a\nb\tc"
    result = run_with("", "status", str(store), "--passphrase-file", str(tmp_path / "p"))
    assert result.returncode == USAGE, result.stderr
    assert result.stderr.startswith(f"sealfs: store {tmp_path}/a\\nb\\tc does not exist")
    assert result.stderr.count("\n") == 1


def test_an_error_naming_a_path_with_c1_controls_escapes_them(tmp_path: Path) -> None:
    """U+009B is CSI to a terminal, as ESC [ is: a path holding it could move the
    cursor or recolour the terminal through an error line."""
    store = tmp_path / "a\u009b31mb"
    result = run_with("", "status", str(store), "--passphrase-file", str(tmp_path / "p"))
    assert result.returncode == USAGE, result.stderr
    assert "\u009b" not in result.stderr
    assert f"store {tmp_path}/a\\x9b31mb does not exist" in result.stderr


@pytest.mark.parametrize(
    "char", ["\u2028", "\u2029", "\u202e", "\u2067", "\x85", "\u200e", "\u200f", "\u061c"]
)
def test_one_line_escapes_what_ends_a_line_or_reorders_it(char: str) -> None:
    """A line separator ends a line for str.splitlines (and log tools built on it); a
    bidirectional override makes a terminal show what follows reversed: a store path
    holding either could forge or disguise the log entry it appears in."""
    text = one_line(f"store /srv/a{char}ERROR sealfs: forged")
    assert char not in text
    assert len(text.splitlines()) == 1
    assert f"\\u{ord(char):04x}" in text or f"\\x{ord(char):02x}" in text
