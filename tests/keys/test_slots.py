"""Keyslots and unlock: the secret opens the GOLDEN_V1, and nothing else does."""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

import msgpack
import pytest

from sealfs.crypto.subkeys import derive_subkeys
from sealfs.errors import (
    FormatError,
    IntegrityError,
    NoSlotOfKindError,
    WeakKdfError,
    WrongKeyError,
)
from sealfs.keys.header import (
    MAGIC,
    Keyslot,
    VolumeHeader,
    decode_header,
    encode_header,
    pack_canonical,
)
from sealfs.keys.kdf import Argon2Params
from sealfs.keys.slots import (
    Passphrase,
    RecoveryKey,
    create_header,
    make_passphrase_slot,
    make_recovery_slot,
    new_master_key,
    new_volume_id,
    slot_associated_data,
    unlock,
)

MASTER_KEY = bytes(range(0x40, 0x60))
VOLUME_ID = bytes(range(16))
RECOVERY = bytes(range(0xA0, 0xC0))
PASSPHRASE = b"correct horse battery staple"

# A format v1 header: slot 0 passphrase (fast KDF), slot 1 recovery, fixed
# nonces and creation time. Every later build must still unlock it.
GOLDEN_V1 = bytes.fromhex(
    "5345414c4653000000010000015184aa637265617465645f6e73cf17979cfe362a0000aa64617461"
    "5f65706f636800a5736c6f74739285a2696400a46b696e64aa70617373706872617365a56e6f6e63"
    "65c40c010101010101010101010101a6706172616d7385a36b6466a86172676f6e326964a16dce00"
    "010000a17001a473616c74c410000102030405060708090a0b0c0d0e0fa17401ab77726170706564"
    "5f6b6579c43035c7e712ac032cc279514036ad99afb6d13cbe4206226c060eb6df2c505eca2c3e9d"
    "742a677c821b35ef992536e5e11185a2696401a46b696e64a87265636f76657279a56e6f6e6365c4"
    "0c020202020202020202020202a6706172616d7380ab777261707065645f6b6579c4300ad7aba312"
    "934edb3f65bd09d26ef527625693f5098cdd2745239af79312c7e0969796000950de5c0edd7d7c57"
    "e27cefa9766f6c756d655f6964c410000102030405060708090a0b0c0d0e0fab86cd7b394ca2dd00"
    "eb51a44c5298815c13bd43d7359dc441fe34515501d290"
)
MAC_KEY = derive_subkeys(MASTER_KEY, VOLUME_ID).header_mac_key


def _reencode(data: bytes, header: VolumeHeader, mac_key: bytes | None = None) -> bytes:
    """Re-encode an edited header: MACed with mac_key, or carrying the old MAC if None."""
    if mac_key is not None:
        return encode_header(header, mac_key)
    fresh = encode_header(header, bytes(32))
    return fresh[:-32] + data[-32:]


def _replace_slot(header: VolumeHeader, index: int, slot: Keyslot) -> VolumeHeader:
    slots = list(header.slots)
    slots[index] = slot
    return dataclasses.replace(header, slots=tuple(slots))


def test_golden_v1_still_opens(fast_kdf: Argon2Params) -> None:
    expected_slot = make_passphrase_slot(
        0, MASTER_KEY, VOLUME_ID, PASSPHRASE, fast_kdf, nonce=bytes([1]) * 12
    )
    recovery_slot = make_recovery_slot(1, MASTER_KEY, VOLUME_ID, RECOVERY, nonce=bytes([2]) * 12)
    header = VolumeHeader(1, VOLUME_ID, 1_700_000_000_000_000_000, (expected_slot, recovery_slot))
    assert encode_header(header, MAC_KEY) == GOLDEN_V1

    unlocked = unlock(GOLDEN_V1, Passphrase(PASSPHRASE))
    assert (unlocked.master_key, unlocked.slot_id) == (MASTER_KEY, 0)
    assert unlocked.subkeys == derive_subkeys(MASTER_KEY, VOLUME_ID)
    assert unlocked.header == header


def test_recovery_key_unlocks() -> None:
    unlocked = unlock(GOLDEN_V1, RecoveryKey(RECOVERY))
    assert (unlocked.master_key, unlocked.slot_id) == (MASTER_KEY, 1)


def test_create_header_round_trip(fast_kdf: Argon2Params) -> None:
    master_key, volume_id = new_master_key(), new_volume_id()
    data = create_header(master_key, volume_id, b"pw", fast_kdf, RECOVERY)
    header = decode_header(data)
    assert [(s.slot_id, s.kind) for s in header.slots] == [(0, "passphrase"), (1, "recovery")]
    assert header.volume_id == volume_id
    assert header.data_epoch == 0
    assert unlock(data, Passphrase(b"pw")).master_key == master_key
    assert unlock(data, RecoveryKey(RECOVERY)).master_key == master_key


def test_wrong_passphrase() -> None:
    with pytest.raises(WrongKeyError, match="wrong passphrase: no keyslot opens with it"):
        unlock(GOLDEN_V1, Passphrase(b"Correct horse battery staple"))


def test_wrong_recovery_key() -> None:
    with pytest.raises(WrongKeyError, match="wrong recovery key"):
        unlock(GOLDEN_V1, RecoveryKey(bytes(32)))


def test_repr_hides_secrets() -> None:
    unlocked = unlock(GOLDEN_V1, RecoveryKey(RECOVERY))
    for obj in (unlocked, Passphrase(PASSPHRASE), RecoveryKey(RECOVERY)):
        text = repr(obj)
        assert MASTER_KEY.hex() not in text and repr(MASTER_KEY) not in text
        assert "correct horse" not in text and repr(RECOVERY) not in text


def _edit_kdf(**changes: Any) -> VolumeHeader:
    header = decode_header(GOLDEN_V1)
    slot = header.slots[0]
    return _replace_slot(header, 0, dataclasses.replace(slot, params={**slot.params, **changes}))


@pytest.mark.parametrize("mac", ["old", "garbage"])
@pytest.mark.parametrize("changes", [{"m": 8}, {"t": 0}, {"m": 1024, "t": 1}])
def test_lowered_kdf_cost_is_weak_before_argon2(mac: str, changes: dict[str, int]) -> None:
    edited = _edit_kdf(**changes)
    data = _reencode(GOLDEN_V1, edited) if mac == "old" else encode_header(edited, bytes(32))
    with pytest.raises(WeakKdfError, match="below the minimum"):
        unlock(data, Passphrase(PASSPHRASE))


def test_absurd_kdf_cost_is_refused_without_running() -> None:
    edited = _edit_kdf(m=100 * 1024 * 1024)  # 100 GiB
    with pytest.raises(FormatError, match="exceeds the limit"):
        unlock(_reencode(GOLDEN_V1, edited), Passphrase(PASSPHRASE))


def test_edited_kdf_params_do_not_open() -> None:
    # Any accepted edit (here a different salt) changes the slot's AD.
    edited = _edit_kdf(salt=bytes(16))
    with pytest.raises(WrongKeyError):
        unlock(_reencode(GOLDEN_V1, edited), Passphrase(PASSPHRASE))


def test_edited_passphrase_slot_refused_via_recovery() -> None:
    # Another slot still opens, so the MAC check is what refuses the edit.
    edited = _edit_kdf(m=131072)
    with pytest.raises(IntegrityError, match="MAC mismatch"):
        unlock(_reencode(GOLDEN_V1, edited), RecoveryKey(RECOVERY))


def test_unknown_kdf_name() -> None:
    edited = _edit_kdf(kdf="pbkdf2")
    with pytest.raises(FormatError, match="KDF"):
        unlock(_reencode(GOLDEN_V1, edited), Passphrase(PASSPHRASE))


def test_slot_from_another_volume_does_not_open(fast_kdf: Argon2Params) -> None:
    # The attacker knows another volume's passphrase and copies its slot in.
    other = make_passphrase_slot(0, new_master_key(), new_volume_id(), b"attacker", fast_kdf)
    data = _reencode(GOLDEN_V1, _replace_slot(decode_header(GOLDEN_V1), 0, other))
    with pytest.raises(WrongKeyError):
        unlock(data, Passphrase(b"attacker"))


def test_forged_slot_for_this_volume_fails_mac(fast_kdf: Argon2Params) -> None:
    # An attacker-made slot that wraps their own key for this volume id opens,
    # but the header MAC (keyed from the real master key) refuses it.
    forged = make_passphrase_slot(0, new_master_key(), VOLUME_ID, b"attacker", fast_kdf)
    data = _reencode(GOLDEN_V1, _replace_slot(decode_header(GOLDEN_V1), 0, forged))
    with pytest.raises(IntegrityError, match="MAC mismatch"):
        unlock(data, Passphrase(b"attacker"))


def test_renumbered_slot_does_not_open() -> None:
    header = decode_header(GOLDEN_V1)
    moved = dataclasses.replace(header.slots[1], slot_id=5)
    with pytest.raises(WrongKeyError):
        unlock(
            _reencode(GOLDEN_V1, _replace_slot(header, 1, moved), MAC_KEY), RecoveryKey(RECOVERY)
        )


def test_slot_kind_relabelled_does_not_open() -> None:
    header = decode_header(GOLDEN_V1)
    relabelled = dataclasses.replace(header.slots[1], kind="passphrase", params={})
    data = _reencode(GOLDEN_V1, _replace_slot(header, 1, relabelled), MAC_KEY)
    with pytest.raises(WrongKeyError):
        unlock(data, RecoveryKey(RECOVERY))


def test_header_mac_tamper_after_unwrap() -> None:
    header = decode_header(GOLDEN_V1)
    for edited in (
        dataclasses.replace(header, data_epoch=1),
        dataclasses.replace(header, created_ns=0),
    ):
        with pytest.raises(IntegrityError):
            unlock(_reencode(GOLDEN_V1, edited), RecoveryKey(RECOVERY))


def test_removed_recovery_slot() -> None:
    header = decode_header(GOLDEN_V1)
    only_passphrase = dataclasses.replace(header, slots=header.slots[:1])
    with pytest.raises(WrongKeyError):
        unlock(_reencode(GOLDEN_V1, only_passphrase, MAC_KEY), RecoveryKey(RECOVERY))


@pytest.mark.parametrize(
    ("kept", "secret", "said"),
    [
        (
            1,
            Passphrase(PASSPHRASE),
            "the volume has no passphrase keyslot (its keyslots: 1 recovery)",
        ),
        (
            0,
            RecoveryKey(RECOVERY),
            "the volume has no recovery keyslot (its keyslots: 0 passphrase)",
        ),
    ],
)
def test_a_secret_of_a_kind_the_volume_has_no_slot_of_says_so(
    kept: int, secret: Passphrase | RecoveryKey, said: str
) -> None:
    """Regression: once the last passphrase slot was removed, the right passphrase was
    "wrong", and the operator hunted for a typo."""
    header = decode_header(GOLDEN_V1)
    one_kind = dataclasses.replace(header, slots=(header.slots[kept],))
    with pytest.raises(NoSlotOfKindError) as raised:
        unlock(_reencode(GOLDEN_V1, one_kind, MAC_KEY), secret)
    assert str(raised.value) == f"{said}: unlock with one of those"


def test_wrapped_key_of_wrong_size() -> None:
    header = decode_header(GOLDEN_V1)
    short = dataclasses.replace(header.slots[1], wrapped_key=b"x" * 40)
    with pytest.raises(FormatError, match="wrong size"):
        unlock(
            _reencode(GOLDEN_V1, _replace_slot(header, 1, short), MAC_KEY), RecoveryKey(RECOVERY)
        )


def test_slot_ad_layout() -> None:
    params = {"t": 1, "m": 2}
    ad = slot_associated_data(VOLUME_ID, 258, "passphrase", params)
    assert ad == (
        b"sealfs/v1/keyslot"
        + VOLUME_ID
        + b"\x00\x00\x01\x02"
        + b"passphrase"
        + msgpack.packb({"m": 2, "t": 1}, use_bin_type=True)
    )
    assert ad.endswith(pack_canonical({"t": 1, "m": 2}))


def test_malformed_header_is_format_error() -> None:
    with pytest.raises(FormatError):
        unlock(MAGIC + struct.pack(">HI", 1, 1) + b"\xc1" + bytes(32), Passphrase(b"x"))
