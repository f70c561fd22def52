"""aws-kms keyslots against moto's KMS over HTTP: round trips, context binding, refusals."""

from __future__ import annotations

import dataclasses
import json
import socket
from typing import Any

import pytest

from sealfs.crypto.subkeys import derive_subkeys
from sealfs.errors import FormatError, IntegrityError, KeyUnavailableError, WrongKeyError
from sealfs.keys.edit import add_slot, remove_slot
from sealfs.keys.header import Keyslot, VolumeHeader, decode_header, encode_header
from sealfs.keys.kms import (
    KmsClients,
    KmsUnlocker,
    boto3_client_factory,
    encryption_context,
    kms_slot_maker,
)
from sealfs.keys.slots import (
    Passphrase,
    RecoveryKey,
    create_header,
    new_master_key,
    new_volume_id,
    unlock,
)
from sealfs.store.memory import MemoryStore
from sealfs.volume.engine import Volume
from sealfs.volume.loader import (
    check_writer,
    claim_writer,
    create_volume,
    open_volume,
)
from sealfs.volume.options import VolumeOptions
from tests.conftest import cheap_kdf
from tests.kms.conftest import REGION, key_id_of

RECOVERY = bytes(range(32))


def kms_volume(
    clients: KmsClients, key: str, *, passphrase: bytes | None = None
) -> tuple[bytes, bytes, bytes]:
    """(header bytes, master key, volume id) of a new volume with an aws-kms slot."""
    master, vid = new_master_key(), new_volume_id()
    kdf = cheap_kdf() if passphrase is not None else None
    data = create_header(master, vid, passphrase, kdf, RECOVERY, [kms_slot_maker(clients, key)])
    return data, master, vid


def mac_key(master: bytes, vid: bytes) -> bytes:
    return derive_subkeys(master, vid).header_mac_key


def with_slot(header: VolumeHeader, slot_id: int, **changes: Any) -> VolumeHeader:
    slots = tuple(
        dataclasses.replace(s, **changes) if s.slot_id == slot_id else s for s in header.slots
    )
    return dataclasses.replace(header, slots=slots)


def test_round_trip(clients: KmsClients, kms_key: str) -> None:
    data, master, _ = kms_volume(clients, kms_key)
    header = decode_header(data)
    assert [(s.slot_id, s.kind) for s in header.slots] == [(0, "recovery"), (1, "aws-kms")]
    slot = header.slots[1]
    assert slot.params == {"key_id": kms_key, "key_arn": kms_key, "region": REGION}
    assert slot.nonce == b"" and master not in slot.wrapped_key
    unlocked = unlock(data, KmsUnlocker(clients))
    assert (unlocked.master_key, unlocked.slot_id) == (master, 1)
    assert unlock(data, RecoveryKey(RECOVERY)).master_key == master


def test_alias_is_recorded_with_its_arn(clients: KmsClients, kms_admin: Any, kms_key: str) -> None:
    kms_admin.create_alias(AliasName="alias/sealfs-alias-test", TargetKeyId=kms_key)
    data, master, _ = kms_volume(clients, "alias/sealfs-alias-test")
    slot = decode_header(data).slots[1]
    assert slot.params["key_id"] == "alias/sealfs-alias-test"
    assert slot.params["key_arn"] == kms_key
    # A pin may name the key by its alias: KMS resolves it and checks the blob.
    pinned = KmsUnlocker(clients, "alias/sealfs-alias-test")
    assert unlock(data, pinned).master_key == master


def test_encryption_context_is_what_kms_saw(
    clients: KmsClients, kms_admin: Any, kms_key: str
) -> None:
    data, master, vid = kms_volume(clients, kms_key)
    slot = decode_header(data).slots[1]
    answer = kms_admin.decrypt(
        CiphertextBlob=slot.wrapped_key,
        EncryptionContext={"sealfs-volume": vid.hex(), "sealfs-slot": "1"},
    )
    assert answer["Plaintext"] == master
    assert encryption_context(vid, 1) == {"sealfs-volume": vid.hex(), "sealfs-slot": "1"}


def test_blob_from_another_volume_is_refused(clients: KmsClients, kms_key: str) -> None:
    # The attacker holds volume B's master key (so B's MAC is valid) and copies
    # A's KMS blob into B's slot: KMS refuses it on the encryption context.
    a_data, _, _ = kms_volume(clients, kms_key)
    b_data, b_master, b_vid = kms_volume(clients, kms_key)
    a_blob = decode_header(a_data).slots[1].wrapped_key
    forged = encode_header(
        with_slot(decode_header(b_data), 1, wrapped_key=a_blob), mac_key(b_master, b_vid)
    )
    with pytest.raises(WrongKeyError, match="encryption context mismatch"):
        unlock(forged, KmsUnlocker(clients))


def test_blob_from_another_slot_is_refused(clients: KmsClients, kms_key: str) -> None:
    data, master, vid = kms_volume(clients, kms_key)
    unlocked = unlock(data, KmsUnlocker(clients))
    data2, _ = add_slot(unlocked, kms_slot_maker(clients, kms_key))  # slot 2
    header = decode_header(data2)
    blob1, blob2 = header.slots[1].wrapped_key, header.slots[2].wrapped_key
    swapped = with_slot(with_slot(header, 1, wrapped_key=blob2), 2, wrapped_key=blob1)
    forged = encode_header(swapped, mac_key(master, vid))
    with pytest.raises(WrongKeyError, match=r"keyslot 1: .*InvalidCiphertext.*keyslot 2: "):
        unlock(forged, KmsUnlocker(clients))


def test_key_of_another_volume_is_refused(
    clients: KmsClients, kms_admin: Any, kms_key: str
) -> None:
    # Volume B's slot claims B's key, but its blob was made under A's key
    # (e.g. by a store that swapped slots): KMS refuses the mismatch.
    other_key = kms_admin.create_key()["KeyMetadata"]["Arn"]
    a_data, _, _ = kms_volume(clients, other_key)
    b_data, b_master, b_vid = kms_volume(clients, kms_key)
    a_slot = decode_header(a_data).slots[1]
    forged = encode_header(
        with_slot(decode_header(b_data), 1, wrapped_key=a_slot.wrapped_key),
        mac_key(b_master, b_vid),
    )
    with pytest.raises(WrongKeyError):
        unlock(forged, KmsUnlocker(clients))
    # And a volume made under another key does not open when this key is pinned.
    with pytest.raises(WrongKeyError, match="denied access"):
        unlock(a_data, KmsUnlocker(clients, kms_key))


def test_slot_from_another_volume_with_attacker_key_fails_mac(
    clients: KmsClients, kms_admin: Any, kms_key: str
) -> None:
    # A store-side attacker replaces the KMS slot with one wrapping their own
    # master key under this volume id and slot id: it decrypts, but the MAC
    # (keyed from the real master key) refuses the header.
    data, _, vid = kms_volume(clients, kms_key)
    forged_slot = kms_slot_maker(clients, kms_key)(1, new_master_key(), vid)
    forged = encode_header(
        with_slot(decode_header(data), 1, wrapped_key=forged_slot.wrapped_key), bytes(32)
    )
    forged = forged[:-32] + data[-32:]
    with pytest.raises(IntegrityError, match="MAC mismatch"):
        unlock(forged, KmsUnlocker(clients))


def test_access_denied_by_key_policy(clients: KmsClients, kms_admin: Any, kms_key: str) -> None:
    data, _, _ = kms_volume(clients, kms_key)
    deny = {
        "Version": "2012-10-17",
        "Statement": [
            {"Effect": "Deny", "Principal": "*", "Action": "kms:Decrypt", "Resource": "*"}
        ],
    }
    kms_admin.put_key_policy(
        KeyId=key_id_of(kms_key), PolicyName="default", Policy=json.dumps(deny)
    )
    with pytest.raises(WrongKeyError, match=r"keyslot 1: AWS KMS denied access .*AccessDenied"):
        unlock(data, KmsUnlocker(clients))
    assert unlock(data, RecoveryKey(RECOVERY))  # the other slot still opens


def test_disabled_key(clients: KmsClients, kms_admin: Any, kms_key: str) -> None:
    data, _, _ = kms_volume(clients, kms_key)
    kms_admin.disable_key(KeyId=key_id_of(kms_key))
    with pytest.raises(KeyUnavailableError, match=r"keyslot 1: KMS key .* is disabled"):
        unlock(data, KmsUnlocker(clients))


def test_key_pending_deletion(clients: KmsClients, kms_admin: Any, kms_key: str) -> None:
    data, _, _ = kms_volume(clients, kms_key)
    kms_admin.schedule_key_deletion(KeyId=key_id_of(kms_key), PendingWindowInDays=7)
    with pytest.raises(KeyUnavailableError, match="pending deletion"):
        unlock(data, KmsUnlocker(clients))


def test_disabled_key_cannot_make_a_slot(clients: KmsClients, kms_admin: Any, kms_key: str) -> None:
    kms_admin.disable_key(KeyId=key_id_of(kms_key))
    with pytest.raises(KeyUnavailableError, match="disabled"):
        kms_volume(clients, kms_key)


def test_nonexistent_key(clients: KmsClients) -> None:
    with pytest.raises(KeyUnavailableError, match="alias/no-such-key was not found"):
        kms_volume(clients, "alias/no-such-key")


def test_unreachable_kms(kms_env: str) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed once the block ends: nothing listens
    # With credentials in the URL, as AWS_ENDPOINT_URL may hold them: never quoted (botocore
    # names the URL it could not reach, and the message reached the terminal and the log).
    dead = KmsClients(boto3_client_factory(f"http://agent:hunter2@127.0.0.1:{port}"))
    with dead, pytest.raises(KeyUnavailableError, match="cannot reach AWS KMS") as info:
        kms_volume(dead, "alias/whatever")
    assert "hunter2" not in str(info.value) and "127.0.0.1" in str(info.value)
    fix = "check the network and the endpoint (--kms-endpoint, AWS_ENDPOINT_URL_KMS)"
    assert str(info.value).endswith(f"{fix}, or unlock with another secret")


def test_volume_without_kms_slot(clients: KmsClients) -> None:
    data = create_header(new_master_key(), new_volume_id(), b"pw", cheap_kdf(), RECOVERY)
    with pytest.raises(WrongKeyError, match="has no aws-kms keyslot"):
        unlock(data, KmsUnlocker(clients))


@pytest.mark.parametrize(
    "params",
    [
        {"key_id": "k", "key_arn": "k"},
        {"key_id": "k", "key_arn": "k", "region": "evil.example.com/"},
        {"key_id": "k", "key_arn": 5, "region": REGION},
    ],
)
def test_malformed_params_are_format_errors(
    clients: KmsClients, kms_key: str, params: dict[str, Any]
) -> None:
    data, master, vid = kms_volume(clients, kms_key)
    forged = encode_header(with_slot(decode_header(data), 1, params=params), mac_key(master, vid))
    with pytest.raises(FormatError, match="malformed parameters"):
        unlock(forged, KmsUnlocker(clients))


def test_add_then_remove_kms_slot(clients: KmsClients, kms_key: str) -> None:
    master, vid = new_master_key(), new_volume_id()
    data = create_header(master, vid, b"pw", cheap_kdf(), RECOVERY)
    unlocked = unlock(data, Passphrase(b"pw"))
    data, slot = add_slot(unlocked, kms_slot_maker(clients, kms_key))
    assert slot.slot_id == 2 and unlock(data, KmsUnlocker(clients)).slot_id == 2
    data = remove_slot(unlock(data, KmsUnlocker(clients)), 0)  # the passphrase slot
    with pytest.raises(WrongKeyError):
        unlock(data, Passphrase(b"pw"))
    assert unlock(data, KmsUnlocker(clients)).master_key == master


async def test_headless_volume_on_the_engine(clients: KmsClients, kms_key: str) -> None:
    """init with KMS only (no passphrase), write, remount headless: the data is there."""
    store = MemoryStore()
    header = create_volume(
        store, None, None, RECOVERY, extra_slots=[kms_slot_maker(clients, kms_key)]
    )
    assert [s.kind for s in header.slots] == ["recovery", "aws-kms"]
    loaded = open_volume(store, KmsUnlocker(clients))
    check_writer(loaded, takeover=False)
    claim_writer(loaded)
    volume = Volume(loaded, VolumeOptions())
    async with volume.running():
        fh, attr = await volume.create(1, b"state.json", 0o644, 0, 0, 0)
        await volume.write(fh, 0, b'{"step": 1}')
        await volume.release(fh)
        await volume.fsync()
    again = Volume(open_volume(store, KmsUnlocker(clients, kms_key)), VolumeOptions(read_only=True))
    async with again.running():
        attr = await again.lookup(1, b"state.json")
        fh = await again.open(attr.ino, 0)
        assert await again.read(fh, 0, 100) == b'{"step": 1}'
        await again.release(fh)


def test_keyslot_shape_is_public(clients: KmsClients, kms_key: str) -> None:
    """Nothing in an aws-kms slot is the master key or derived from it without KMS."""
    data, master, _ = kms_volume(clients, kms_key)
    assert master not in data and master.hex().encode() not in data
    slot: Keyslot = decode_header(data).slots[1]
    assert set(slot.params) == {"key_id", "key_arn", "region"}
