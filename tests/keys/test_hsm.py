"""pkcs11 keyslots against SoftHSM2 tokens the tests initialise (no mocks)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest

from sealfs.crypto.subkeys import derive_subkeys
from sealfs.errors import ConfigError, FormatError, KeyUnavailableError, WrongKeyError
from sealfs.keys.edit import add_slot, replace_slot
from sealfs.keys.header import VolumeHeader, decode_header, encode_header
from sealfs.keys.hsm import (
    Pin,
    Pkcs11Unlocker,
    TokenKey,
    check_trusted_module,
    create_token_key,
    pkcs11_slot_maker,
)
from sealfs.keys.kdf import Argon2Params
from sealfs.keys.slots import (
    Passphrase,
    RecoveryKey,
    create_header,
    new_master_key,
    new_volume_id,
    unlock,
)
from tests.keys.softhsm import SoftHsm
from tests.prereq import require, require_module

RECOVERY = bytes(range(32))


def token_volume(hsm: SoftHsm, where: TokenKey) -> tuple[bytes, bytes, bytes]:
    master, vid = new_master_key(), new_volume_id()
    data = create_header(master, vid, None, None, RECOVERY, [pkcs11_slot_maker(where, hsm.pin())])
    return data, master, vid


def with_slot(header: VolumeHeader, slot_id: int, **changes: Any) -> VolumeHeader:
    slots = tuple(
        dataclasses.replace(s, **changes) if s.slot_id == slot_id else s for s in header.slots
    )
    return dataclasses.replace(header, slots=slots)


def mac_key(master: bytes, vid: bytes) -> bytes:
    return derive_subkeys(master, vid).header_mac_key


def test_round_trip(softhsm: SoftHsm) -> None:
    where = softhsm.new_key()
    data, master, _ = token_volume(softhsm, where)
    slot = decode_header(data).slots[1]
    assert slot.kind == "pkcs11"
    assert slot.params == {
        "module": softhsm.module,
        "token": softhsm.token,
        "key": where.key,
        "mech": "aes-gcm",
    }
    assert len(slot.nonce) == 12 and len(slot.wrapped_key) == 48
    # With the module named locally, and with the header's (root-owned) module.
    for module in (softhsm.module, None):
        unlocked = unlock(data, Pkcs11Unlocker(softhsm.pin(), module))
        assert (unlocked.master_key, unlocked.slot_id) == (master, 1)


def test_token_key_never_leaves_the_token(softhsm: SoftHsm) -> None:
    pkcs11 = require_module("pkcs11", "python-pkcs11 is not installed")
    where = softhsm.new_key()
    lib = pkcs11.lib(os.path.realpath(softhsm.module))  # as sealfs loads it: one per process
    with lib.get_token(token_label=softhsm.token).open(user_pin=softhsm.pin().value.decode()) as s:
        key = s.get_key(object_class=pkcs11.ObjectClass.SECRET_KEY, label=where.key)
        assert key[pkcs11.Attribute.SENSITIVE] is True
        assert key[pkcs11.Attribute.EXTRACTABLE] is False
        assert key[pkcs11.Attribute.NEVER_EXTRACTABLE] is True
        with pytest.raises(pkcs11.exceptions.AttributeSensitive):
            key[pkcs11.Attribute.VALUE]


def test_wrong_pin(softhsm: SoftHsm) -> None:
    where = TokenKey(softhsm.module, softhsm.pin_token, "k")
    create_token_key(where, softhsm.pin())
    data, _, _ = token_volume(softhsm, where)
    with pytest.raises(WrongKeyError, match=f"wrong PIN for PKCS#11 token '{softhsm.pin_token}'"):
        unlock(data, Pkcs11Unlocker(Pin(b"0000"), softhsm.module))
    assert unlock(data, Pkcs11Unlocker(softhsm.pin(), softhsm.module))  # not locked out


def test_token_missing(softhsm: SoftHsm) -> None:
    where = softhsm.new_key()
    data, master, vid = token_volume(softhsm, where)
    params = {**decode_header(data).slots[1].params, "token": "unplugged"}
    # (The slot's AD changes too, but the token is looked for first.)
    edited = encode_header(with_slot(decode_header(data), 1, params=params), mac_key(master, vid))
    with pytest.raises(KeyUnavailableError, match="token 'unplugged' is not present"):
        unlock(edited, Pkcs11Unlocker(softhsm.pin(), softhsm.module))


def test_key_missing(softhsm: SoftHsm) -> None:
    with pytest.raises(KeyUnavailableError, match="no AES key labelled 'nope'"):
        token_volume(softhsm, TokenKey(softhsm.module, softhsm.token, "nope"))


def test_create_key_twice_is_refused(softhsm: SoftHsm) -> None:
    where = softhsm.new_key()
    with pytest.raises(ConfigError, match="already holds a key"):
        create_token_key(where, softhsm.pin())


def test_slot_from_another_volume_does_not_open(softhsm: SoftHsm) -> None:
    where = softhsm.new_key()
    a_data, _, _ = token_volume(softhsm, where)
    b_data, b_master, b_vid = token_volume(softhsm, where)
    a_slot = decode_header(a_data).slots[1]
    forged = encode_header(
        with_slot(decode_header(b_data), 1, nonce=a_slot.nonce, wrapped_key=a_slot.wrapped_key),
        mac_key(b_master, b_vid),
    )
    with pytest.raises(WrongKeyError, match="no pkcs11 keyslot opens"):
        unlock(forged, Pkcs11Unlocker(softhsm.pin(), softhsm.module))


def test_key_of_another_token_does_not_open(softhsm: SoftHsm) -> None:
    # Same label on another token: the slot names the first token, so the
    # header is edited to point at the second; its key cannot open the blob.
    label = "shared-label"
    create_token_key(TokenKey(softhsm.module, softhsm.token, label), softhsm.pin())
    create_token_key(TokenKey(softhsm.module, softhsm.other_token, label), softhsm.pin())
    data, master, vid = token_volume(softhsm, TokenKey(softhsm.module, softhsm.token, label))
    header = decode_header(data)
    params = {**header.slots[1].params, "token": softhsm.other_token}
    edited = encode_header(with_slot(header, 1, params=params), mac_key(master, vid))
    with pytest.raises(WrongKeyError):
        unlock(edited, Pkcs11Unlocker(softhsm.pin(), softhsm.module))


def test_untrusted_module_in_header_is_not_loaded(softhsm: SoftHsm, tmp_path: Path) -> None:
    where = softhsm.new_key()
    data, master, vid = token_volume(softhsm, where)
    evil = tmp_path / "evil.so"
    evil.write_bytes(b"not a library")
    tmp_path.chmod(0o777)  # a directory anyone may write to
    header = decode_header(data)
    for module, cause in ((str(evil), "not in a trusted location"), ("lib.so", "not absolute")):
        params = {**header.slots[1].params, "module": module}
        edited = encode_header(with_slot(header, 1, params=params), mac_key(master, vid))
        with pytest.raises(KeyUnavailableError, match=cause):
            unlock(edited, Pkcs11Unlocker(softhsm.pin()))
    assert check_trusted_module(softhsm.module) == os.path.realpath(softhsm.module)


def test_malformed_params(softhsm: SoftHsm) -> None:
    data, master, vid = token_volume(softhsm, softhsm.new_key())
    header = decode_header(data)
    bad = {**header.slots[1].params, "mech": "des"}
    edited = encode_header(with_slot(header, 1, params=bad), mac_key(master, vid))
    with pytest.raises(FormatError, match="malformed parameters"):
        unlock(edited, Pkcs11Unlocker(softhsm.pin(), softhsm.module))


def test_add_and_rotate(softhsm: SoftHsm, fast_kdf: Argon2Params) -> None:
    master, vid = new_master_key(), new_volume_id()
    data = create_header(master, vid, b"pw", fast_kdf, RECOVERY)
    first, second = softhsm.new_key(), softhsm.new_key()
    data, slot = add_slot(unlock(data, Passphrase(b"pw")), pkcs11_slot_maker(first, softhsm.pin()))
    assert slot.slot_id == 2
    opener = Pkcs11Unlocker(softhsm.pin(), softhsm.module)
    data, rotated = replace_slot(unlock(data, opener), 2, pkcs11_slot_maker(second, softhsm.pin()))
    assert rotated.params["key"] == second.key and rotated.slot_id == 2
    assert unlock(data, opener).master_key == master
    assert unlock(data, RecoveryKey(RECOVERY)).master_key == master
    assert os.path.isabs(rotated.params["module"])


def test_trusted_module_is_loaded_by_its_resolved_path(tmp_path: Path) -> None:
    """The checks are of the resolved path: a symlink on the way (here in a directory
    anyone may write to) could be re-pointed between the check and the load."""
    target = os.path.realpath(os.__file__)  # a root-owned file of the Python install
    link = tmp_path / "lnk"
    link.symlink_to(os.path.dirname(target))
    tmp_path.chmod(0o777)
    named = str(link / os.path.basename(target))
    try:
        checked = check_trusted_module(named)
    except KeyUnavailableError:
        checked = ""
    require(checked != "", "the Python install is in a trusted location (root-owned)")
    assert checked == target
