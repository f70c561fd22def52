"""How a read-only mount's daemon unlocks the header of a later rekey by itself."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from sealfs.cli.keysource import unlocker_for_rekeys
from sealfs.errors import WrongKeyError
from sealfs.keys.hsm import Pkcs11Unlocker
from sealfs.keys.recovery import format_recovery_key
from sealfs.keys.slots import Passphrase, RecoveryKey, unlock
from sealfs.store.base import ObjectStore
from sealfs.volume.header_io import read_header_version
from tests.conftest import PASSPHRASE, RECOVERY_KEY
from tests.keys.softhsm import SoftHsm, softhsm  # noqa: F401 (a fixture, used by name)
from tests.keys.test_hsm import token_volume
from tests.mounts import write_secret
from tests.volume.test_rekey import start_rekey


@pytest.fixture(autouse=True)
def no_secret_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SEALFS_PASSPHRASE_FILE", raising=False)
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)


def test_a_passphrase_file_is_read_again_by_its_absolute_path_at_the_rekey(
    volume_store: ObjectStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon runs in /: a file given as a relative path must still be found."""
    monkeypatch.chdir(tmp_path)
    write_secret(tmp_path / "pass", PASSPHRASE.decode() + "\n")
    args = argparse.Namespace(passphrase_file="pass")
    mounted = unlock(read_header_version(volume_store).data, Passphrase(PASSPHRASE))
    again = unlocker_for_rekeys(args, mounted)
    assert again is not None
    start_rekey(volume_store)
    monkeypatch.chdir("/")
    unlocked = again(read_header_version(volume_store).data)
    assert unlocked.header.data_epoch == mounted.header.data_epoch + 1
    assert unlocked.master_key != mounted.master_key


def test_the_file_is_read_when_the_rekey_comes_not_kept_from_the_mount(
    volume_store: ObjectStore, tmp_path: Path
) -> None:
    passfile = write_secret(tmp_path / "pass", PASSPHRASE.decode() + "\n")
    args = argparse.Namespace(passphrase_file=str(passfile))
    mounted = unlock(read_header_version(volume_store).data, Passphrase(PASSPHRASE))
    again = unlocker_for_rekeys(args, mounted)
    assert again is not None
    start_rekey(volume_store)
    passfile.write_text("another passphrase\n")
    with pytest.raises(WrongKeyError, match="wrong passphrase"):
        again(read_header_version(volume_store).data)


def test_a_recovery_key_file_is_read_again(volume_store: ObjectStore, tmp_path: Path) -> None:
    keyfile = write_secret(tmp_path / "rk", format_recovery_key(RECOVERY_KEY) + "\n")
    args = argparse.Namespace(recovery_key_file=str(keyfile), passphrase_file=None)
    mounted = unlock(read_header_version(volume_store).data, RecoveryKey(RECOVERY_KEY))
    again = unlocker_for_rekeys(args, mounted)
    assert again is not None
    start_rekey(volume_store, recovery=RECOVERY_KEY)
    assert again(read_header_version(volume_store).data).header.data_epoch == 1


def test_a_passphrase_typed_on_the_terminal_cannot_be_read_again(
    volume_store: ObjectStore,
) -> None:
    args = argparse.Namespace(passphrase_file=None)
    mounted = unlock(read_header_version(volume_store).data, Passphrase(PASSPHRASE))
    assert unlocker_for_rekeys(args, mounted) is None


def test_the_systemd_credential_is_read_again(
    volume_store: ObjectStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_secret(tmp_path / "sealfs-passphrase", PASSPHRASE.decode())
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path))
    args = argparse.Namespace(passphrase_file=None)
    mounted = unlock(read_header_version(volume_store).data, Passphrase(PASSPHRASE))
    again = unlocker_for_rekeys(args, mounted)
    assert again is not None
    start_rekey(volume_store)
    assert again(read_header_version(volume_store).data).header.data_epoch == 1


def test_a_token_module_named_by_a_relative_path_is_found_from_the_daemons_directory(
    softhsm: SoftHsm,  # noqa: F811 (the fixture imported above)
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--pkcs11-module (or SEALFS_PKCS11_MODULE) relative to where `sealfs mount` ran: the
    daemon, in /, looked for the module there, and the mount stopped following at the
    rekey ("cannot load PKCS#11 module")."""
    where = softhsm.new_key()
    data, master, _ = token_volume(softhsm, where)
    monkeypatch.chdir(os.path.dirname(softhsm.module))
    local_module = os.path.basename(softhsm.module)
    mounted = unlock(data, Pkcs11Unlocker(softhsm.pin(), local_module))
    again = unlocker_for_rekeys(argparse.Namespace(pkcs11_pin_file=str(softhsm.pin_file)), mounted)
    assert again is not None
    monkeypatch.chdir("/")
    assert again(data).master_key == master
