"""The rekey header: a new master key, slots re-made for it, the old key wrapped under it."""

from __future__ import annotations

import dataclasses
import os

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from sealfs.errors import ConfigError, FormatError, IntegrityError, WrongKeyError
from sealfs.keys import header as h
from sealfs.keys.header import RetiredKey, decode_header, encode_header
from sealfs.keys.rekey import begin_rekey, end_rekey, open_retired, wrap_retired
from sealfs.keys.slots import (
    Passphrase,
    RecoveryKey,
    create_header,
    passphrase_slot_maker,
    recovery_slot_maker,
    unlock,
)
from tests.conftest import PASSPHRASE, RECOVERY_KEY, cheap_kdf

MASTER = bytes(range(64, 96))
VOLUME_ID = bytes(range(16))


def fresh() -> bytes:
    return create_header(MASTER, VOLUME_ID, PASSPHRASE, cheap_kdf(), RECOVERY_KEY)


def test_begin_then_end_rekey() -> None:
    unlocked = unlock(fresh(), Passphrase(PASSPHRASE))
    new_recovery = os.urandom(32)
    data, master = begin_rekey(
        unlocked,
        {0: passphrase_slot_maker(PASSPHRASE, cheap_kdf()), 1: recovery_slot_maker(new_recovery)},
    )
    assert master != MASTER
    header = decode_header(data)
    assert header.data_epoch == 1 and header.retired is not None and header.retired.epoch == 0
    assert [s.slot_id for s in header.slots] == [0, 1]
    again = unlock(data, Passphrase(PASSPHRASE))
    assert again.master_key == master  # the kept slots open the new key
    retired = open_retired(again.header, master)
    assert retired is not None and retired == (0, unlocked.subkeys)
    with pytest.raises(WrongKeyError):
        unlock(data, RecoveryKey(RECOVERY_KEY))  # the old recovery key was not carried over
    with pytest.raises(ConfigError, match="still in progress"):
        begin_rekey(again, {0: passphrase_slot_maker(PASSPHRASE, cheap_kdf())})
    done = end_rekey(data, again.subkeys, 1)
    assert done is not None and decode_header(done).retired is None
    assert unlock(done, RecoveryKey(new_recovery)).master_key == master
    assert end_rekey(done, again.subkeys, 1) is None  # nothing left to drop
    with pytest.raises(IntegrityError):
        end_rekey(data, unlocked.subkeys, 1)  # the old epoch's keys do not verify the header


def test_rekey_must_keep_a_slot_and_drops_the_others() -> None:
    unlocked = unlock(fresh(), Passphrase(PASSPHRASE))
    with pytest.raises(ConfigError, match="at least one keyslot"):
        begin_rekey(unlocked, {})
    data, _ = begin_rekey(unlocked, {0: passphrase_slot_maker(PASSPHRASE, cheap_kdf())})
    header = decode_header(data)
    assert [s.slot_id for s in header.slots] == [0] and header.next_slot_id == 2  # ids not reused


def test_retired_key_is_bound_to_volume_and_epoch() -> None:
    unlocked = unlock(fresh(), Passphrase(PASSPHRASE))
    data, master = begin_rekey(unlocked, {0: passphrase_slot_maker(PASSPHRASE, cheap_kdf())})
    header = decode_header(data)
    assert header.retired is not None
    moved = dataclasses.replace(header, retired=dataclasses.replace(header.retired, epoch=0))
    assert open_retired(moved, master) is not None
    other = wrap_retired(master, bytes(16), 0, MASTER)  # wrapped for another volume
    with pytest.raises(IntegrityError):
        open_retired(dataclasses.replace(header, retired=other), master)
    with pytest.raises(IntegrityError):
        open_retired(header, MASTER)  # only the new key opens it


@pytest.mark.parametrize(
    "retired",
    [
        RetiredKey(1, bytes(12), bytes(48)),  # not below the data epoch
        RetiredKey(0, bytes(11), bytes(48)),
        RetiredKey(0, bytes(12), bytes(47)),
    ],
)
def test_malformed_retired_entries_are_refused(retired: RetiredKey) -> None:
    header = dataclasses.replace(decode_header(fresh()), data_epoch=1, retired=retired)
    with pytest.raises(ValueError):  # encode refuses what decode would refuse
        encode_header(header, bytes(32))
    with pytest.raises(FormatError):
        decode_header(_forced(header))


def _forced(header: h.VolumeHeader) -> bytes:
    """Encode without the encoder's own check, as a hostile store could write it."""
    assert header.retired is not None
    body = h.pack_canonical({
        "volume_id": header.volume_id, "created_ns": header.created_ns,
        "data_epoch": header.data_epoch, "slots": [h._slot_body(s) for s in header.slots],
        "retired": {"epoch": header.retired.epoch, "nonce": header.retired.nonce,
                    "wrapped_key": header.retired.wrapped_key},
    })  # fmt: skip
    return h._PREFIX.pack(h.MAGIC, h.FORMAT_VERSION, len(body)) + body + bytes(h.MAC_SIZE)


GOLDEN_WRAPPED = bytes.fromhex(
    "5d27d43e3b65d6c4fd74243e294da2947fd60d20f4f52a8e41365aa2978fe021"
    "20f8b698ca804d25dcd444913970f907"
)


def test_retired_key_golden_vector_matches_an_independent_computation() -> None:
    """format.md section 13, computed here with cryptography's primitives directly."""
    new, old, vid, nonce = (
        bytes(range(32, 64)),
        bytes(range(64, 96)),
        bytes(range(16)),
        bytes(range(12)),
    )
    wrapping = HKDF(
        algorithm=hashes.SHA256(), length=32, salt=vid, info=b"sealfs/v1/retired-key-wrap"
    ).derive(new)
    ad = b"sealfs/v1/retired-key" + vid + (3).to_bytes(2, "big")
    independent = AESGCM(wrapping).encrypt(nonce, old, ad)
    retired = wrap_retired(new, vid, 3, old, nonce=nonce)
    assert retired.nonce == nonce
    assert retired.wrapped_key == independent == GOLDEN_WRAPPED
