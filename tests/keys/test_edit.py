"""Header edits: re-MACed, ids never reused, never a volume without a slot that opens."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from sealfs.errors import ConfigError, FormatError, IntegrityError, WeakKdfError, WrongKeyError
from sealfs.keys.edit import add_slot, find_slot, remove_slot, replace_slot
from sealfs.keys.header import (
    MAX_SLOTS,
    Keyslot,
    decode_header,
    encode_header,
    first_free_slot_id,
)
from sealfs.keys.kdf import Argon2Params
from sealfs.keys.slots import (
    Passphrase,
    RecoveryKey,
    Unlocked,
    create_header,
    new_master_key,
    new_volume_id,
    passphrase_slot_maker,
    recovery_slot_maker,
    unlock,
)
from tests.keys.test_slots import GOLDEN_V1, MAC_KEY

RECOVERY = bytes(range(0xA0, 0xC0))
OTHER_RECOVERY = bytes(range(32))


@pytest.fixture
def unlocked(fast_kdf: Argon2Params) -> Unlocked:
    data = create_header(new_master_key(), new_volume_id(), b"pw", fast_kdf, RECOVERY)
    return unlock(data, Passphrase(b"pw"))


def test_add_slot_round_trip(unlocked: Unlocked, fast_kdf: Argon2Params) -> None:
    data, slot = add_slot(unlocked, passphrase_slot_maker(b"second", fast_kdf))
    header = decode_header(data)
    assert slot.slot_id == 2 and header.slots[-1] == slot
    assert header.next_slot_id == 3
    assert header.slots[:2] == unlocked.header.slots  # the others untouched
    again = unlock(data, Passphrase(b"second"))
    assert (again.master_key, again.slot_id) == (unlocked.master_key, 2)
    assert unlock(data, Passphrase(b"pw")).slot_id == 0


def test_ids_are_never_reused(unlocked: Unlocked) -> None:
    data, slot = add_slot(unlocked, recovery_slot_maker(OTHER_RECOVERY))
    assert slot.slot_id == 2
    data = remove_slot(unlock(data, RecoveryKey(RECOVERY)), 2)  # the highest id goes
    header = decode_header(data)
    assert [s.slot_id for s in header.slots] == [0, 1] and header.next_slot_id == 3
    with pytest.raises(WrongKeyError):
        unlock(data, RecoveryKey(OTHER_RECOVERY))
    data, slot = add_slot(unlock(data, RecoveryKey(RECOVERY)), recovery_slot_maker(OTHER_RECOVERY))
    assert slot.slot_id == 3


def test_remove_the_slot_used_to_unlock(unlocked: Unlocked) -> None:
    data = remove_slot(unlocked, unlocked.slot_id)
    assert [s.kind for s in decode_header(data).slots] == ["recovery"]
    assert unlock(data, RecoveryKey(RECOVERY)).master_key == unlocked.master_key
    with pytest.raises(WrongKeyError):
        unlock(data, Passphrase(b"pw"))


def test_last_slot_cannot_be_removed(unlocked: Unlocked) -> None:
    data = remove_slot(unlocked, 0)
    only = unlock(data, RecoveryKey(RECOVERY))
    with pytest.raises(ConfigError, match="last keyslot"):
        remove_slot(only, 1)


def test_last_known_kind_cannot_be_removed(unlocked: Unlocked) -> None:
    alien = Keyslot(0, "tpm2", {"pcrs": [7]}, b"n", b"w")
    header = dataclasses.replace(unlocked.header, slots=(unlocked.header.slots[1], alien))
    data = encode_header(header, unlocked.subkeys.header_mac_key)
    with pytest.raises(ConfigError, match=r"only slots this build cannot open \(tpm2\)"):
        remove_slot(unlock(data, RecoveryKey(RECOVERY)), 1)


def test_unknown_slot_id(unlocked: Unlocked) -> None:
    with pytest.raises(ConfigError, match=r"no keyslot 9 \(its slots are 0, 1\)"):
        remove_slot(unlocked, 9)
    with pytest.raises(ConfigError, match="no keyslot 9"):
        find_slot(unlocked.header, 9)


def test_replace_slot_keeps_id_and_position(unlocked: Unlocked, fast_kdf: Argon2Params) -> None:
    new_kdf = Argon2Params(fast_kdf.memory_kib, 2, 1, bytes(16))
    data, slot = replace_slot(unlocked, 0, passphrase_slot_maker(b"new", new_kdf))
    header = decode_header(data)
    assert [s.slot_id for s in header.slots] == [0, 1] and header.slots[0] == slot
    assert slot.params["t"] == 2 and slot.params["salt"] == bytes(16)
    assert unlock(data, Passphrase(b"new")).master_key == unlocked.master_key
    with pytest.raises(WrongKeyError):
        unlock(data, Passphrase(b"pw"))


def test_slot_limit(unlocked: Unlocked) -> None:
    data = b""
    current = unlocked
    for _ in range(MAX_SLOTS - 2):
        data, _slot = add_slot(current, recovery_slot_maker(OTHER_RECOVERY))
        current = dataclasses.replace(current, header=decode_header(data))
    with pytest.raises(ConfigError, match="already has 64 keyslots"):
        add_slot(current, recovery_slot_maker(OTHER_RECOVERY))
    assert unlock(data, RecoveryKey(OTHER_RECOVERY)).slot_id == 2


def test_edited_header_is_refused_after_a_change(
    unlocked: Unlocked, fast_kdf: Argon2Params
) -> None:
    """A changed header is as tamper-evident as a new one: lowered cost, swapped slots,
    rolled-back next_slot_id."""
    data, _ = add_slot(unlocked, passphrase_slot_maker(b"second", fast_kdf))
    header = decode_header(data)

    def with_old_mac(edited: object) -> bytes:
        return encode_header(edited, bytes(32))[:-32] + data[-32:]  # type: ignore[arg-type]

    lowered = dataclasses.replace(header.slots[2], params={**header.slots[2].params, "m": 8192})
    with pytest.raises(WeakKdfError):
        unlock(
            with_old_mac(dataclasses.replace(header, slots=(*header.slots[:2], lowered))),
            Passphrase(b"second"),
        )
    swapped = dataclasses.replace(header, slots=(header.slots[2], *header.slots[:2]))
    with pytest.raises(IntegrityError, match="MAC mismatch"):
        unlock(with_old_mac(swapped), Passphrase(b"pw"))
    rolled = dataclasses.replace(header, next_slot_id=None)
    with pytest.raises(IntegrityError, match="MAC mismatch"):
        unlock(with_old_mac(rolled), RecoveryKey(RECOVERY))


def test_next_slot_id_must_be_above_every_id() -> None:
    header = decode_header(GOLDEN_V1)
    assert header.next_slot_id is None and first_free_slot_id(header) == 2
    ok = encode_header(dataclasses.replace(header, next_slot_id=7), MAC_KEY)
    assert decode_header(ok).next_slot_id == 7
    assert first_free_slot_id(decode_header(ok)) == 7
    for bad in (1, 0, 1 << 40):
        with pytest.raises(ValueError, match="next_slot_id"):
            encode_header(dataclasses.replace(header, next_slot_id=bad), MAC_KEY)


def test_golden_headers_stay_byte_identical() -> None:
    """Headers that no slot change touched are encoded exactly as before."""
    assert encode_header(decode_header(GOLDEN_V1), MAC_KEY) == GOLDEN_V1


@pytest.mark.parametrize("value", ["5", None, True, -1, 1, 1 << 33])
def test_bad_next_slot_id_is_format_error(value: object) -> None:
    body = msgpack.unpackb(GOLDEN_V1[14:-32])
    body["next_slot_id"] = value
    packed = msgpack.packb(body, use_bin_type=True)
    data = GOLDEN_V1[:10] + len(packed).to_bytes(4, "big") + packed + bytes(32)
    with pytest.raises(FormatError, match="next_slot_id"):
        decode_header(data)


def test_next_slot_id_encoding_golden() -> None:
    """format.md 5: the optional field is one more entry of the body map, sorted in."""
    header = dataclasses.replace(decode_header(GOLDEN_V1), next_slot_id=5)
    data = encode_header(header, MAC_KEY)
    body = data[14:-32]
    assert len(body) == 337 + 14  # fixstr(12) "next_slot_id" + fixint 5
    assert body[0] == 0x85  # a map of 5
    assert b"\xacnext_slot_id\x05" in body
    assert body.index(b"next_slot_id") < body.index(b"slots")
    assert msgpack.unpackb(body)["next_slot_id"] == 5
