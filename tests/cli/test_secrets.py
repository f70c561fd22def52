"""Reading secrets from files: only small regular files, one clear error otherwise."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sealfs.cli.secrets import MAX_SECRET_FILE_BYTES, read_secret_file
from sealfs.errors import ConfigError


def test_reads_a_regular_file_without_its_trailing_newline(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_bytes(b"x" * (MAX_SECRET_FILE_BYTES - 1) + b"\n")  # exactly at the bound
    assert read_secret_file(path, "passphrase") == b"x" * (MAX_SECRET_FILE_BYTES - 1)


def test_a_file_over_the_bound_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_bytes(b"x" * (MAX_SECRET_FILE_BYTES + 1))
    with pytest.raises(ConfigError, match=f"passphrase file {path} is larger than 64 KiB"):
        read_secret_file(path, "passphrase")


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
