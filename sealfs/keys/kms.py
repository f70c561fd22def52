"""AWS KMS keyslots: the master key encrypted by KMS under an encryption context.

Slot (kind "aws-kms"): nonce empty, wrapped_key = the KMS CiphertextBlob of
Encrypt(KeyId, Plaintext = master key, EncryptionContext = {"sealfs-volume":
volume id in hex, "sealfs-slot": slot id in decimal}). KMS binds the context
to the ciphertext, so a blob copied into another volume or slot fails to
decrypt (InvalidCiphertext). Unlock calls Decrypt with the same context: that
call is the authorization check, decided by the key policy and IAM.

Params (public, MACed with the rest of the header): "key_id" as the user
named the key (ARN, key id or alias), "key_arn" the key ARN KMS reported,
"region" the key's region. Decrypt passes KeyId = key_arn, or the key the
operator pinned (mount --kms-key-id), so KMS refuses a blob made under any
other key: without a pin, a store that swaps in a whole new volume whose
slot names the attacker's own key could be unlocked, if this host's
credentials may use that key (see docs/design.md).

boto3 is used here only, through an injectable client factory (tests pass
one for a moto server; the CLI builds one from --kms-endpoint or
AWS_ENDPOINT_URL_KMS / AWS_ENDPOINT_URL, region from the slot, the key ARN,
or the AWS environment and profile).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sealfs.crypto.subkeys import MASTER_KEY_SIZE
from sealfs.errors import (
    ConfigError,
    FormatError,
    KeyUnavailableError,
    WrongKeyError,
    without_userinfo,
)
from sealfs.keys.header import Keyslot
from sealfs.keys.slots import KIND_AWS_KMS, SlotMaker

CONTEXT_VOLUME = "sealfs-volume"
CONTEXT_SLOT = "sealfs-slot"
ENDPOINT_ENVS = ("AWS_ENDPOINT_URL_KMS", "AWS_ENDPOINT_URL")
MAX_PARAM_LENGTH = 2048
_PARAM_KEYS = frozenset({"key_id", "key_arn", "region"})
_REGION_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,31}$")
_ARN_RE = re.compile(r"^arn:[a-z-]+:kms:([a-z0-9-]+):\d{12}:(key|alias)/.+$")

# region (None: from the AWS environment/profile) -> a boto3 KMS client
ClientFactory = Callable[[str | None], Any]


def encryption_context(volume_id: bytes, slot_id: int) -> dict[str, str]:
    """The KMS encryption context that binds a wrapped key to its volume and slot."""
    return {CONTEXT_VOLUME: volume_id.hex(), CONTEXT_SLOT: str(slot_id)}


def region_of_arn(key_id: str) -> str | None:
    """The region named in a KMS key or alias ARN, else None."""
    m = _ARN_RE.match(key_id)
    return m.group(1) if m else None


def endpoint_from_env() -> str | None:
    """AWS_ENDPOINT_URL_KMS, else AWS_ENDPOINT_URL, else None (the AWS default)."""
    for name in ENDPOINT_ENVS:
        if os.environ.get(name):
            return os.environ[name]
    return None


def boto3_client_factory(endpoint_url: str | None = None) -> ClientFactory:
    """Clients from a fresh boto3 session: bounded timeouts and retries."""

    def make(region: str | None) -> Any:
        import boto3  # noqa: PLC0415 (keep boto3 off the import path of passphrase users)
        from botocore.config import Config  # noqa: PLC0415

        config = Config(
            connect_timeout=5,
            read_timeout=15,
            retries={"max_attempts": 4, "mode": "standard"},
        )
        session = boto3.session.Session()
        return session.client(
            "kms",
            region_name=region or session.region_name,
            endpoint_url=endpoint_url or endpoint_from_env(),
            config=config,
        )

    return make


class KmsClients:
    """One KMS client per region, made on first use; close() releases them."""

    def __init__(self, factory: ClientFactory | None = None) -> None:
        self._factory = factory or boto3_client_factory()
        self._clients: dict[str | None, Any] = {}

    def get(self, region: str | None) -> Any:
        if region not in self._clients:
            try:
                self._clients[region] = self._factory(region)
            except Exception as exc:
                raise _translate(exc, "AWS KMS", "client setup", region) from None
        return self._clients[region]

    def close(self) -> None:
        for client in self._clients.values():
            close = getattr(client, "close", None)
            if close is not None:
                close()
        self._clients.clear()

    def __enter__(self) -> KmsClients:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class KmsParams:
    key_id: str
    key_arn: str
    region: str


def params_from_slot(slot: Keyslot) -> KmsParams:
    """Validate an aws-kms slot's params (they come from the untrusted header)."""
    raw = slot.params
    ok = set(raw) == _PARAM_KEYS and all(
        isinstance(raw[k], str) and 0 < len(raw[k]) <= MAX_PARAM_LENGTH for k in _PARAM_KEYS
    )
    if not ok or not _REGION_RE.match(raw["region"]) or slot.nonce != b"":
        raise FormatError(f"aws-kms keyslot {slot.slot_id} has malformed parameters")
    return KmsParams(raw["key_id"], raw["key_arn"], raw["region"])


def _aws_message(exc: Any) -> str:
    text = str(exc.response.get("Error", {}).get("Message", "")).strip()
    return " ".join(text.split())[:200]


def _translate(exc: Exception, what: str, key: str, region: str | None) -> Exception:
    """One line naming the cause, as WrongKeyError (denied) or KeyUnavailableError."""
    from botocore import exceptions as bce  # noqa: PLC0415

    where = f" in region {region}" if region else ""
    if isinstance(exc, bce.ClientError):
        code = str(exc.response.get("Error", {}).get("Code", "Unknown"))
        msg = _aws_message(exc)
        if code == "AccessDeniedException":
            return WrongKeyError(
                f"{what}: AWS KMS denied access to key {key} (AccessDenied): check the key"
                " policy and this host's IAM permissions, or unlock with another secret"
            )
        if code == "IncorrectKeyException":
            return WrongKeyError(f"{what}: the wrapped key was not made with KMS key {key}")
        if code == "InvalidCiphertextException":
            return WrongKeyError(
                f"{what}: KMS refused the wrapped key (InvalidCiphertext): it was made for"
                " another volume or keyslot (encryption context mismatch) or was altered"
            )
        if code == "DisabledException":
            return KeyUnavailableError(
                f"{what}: KMS key {key} is disabled: enable it, or unlock with another secret"
            )
        if code == "KMSInvalidStateException":
            return KeyUnavailableError(
                f"{what}: KMS key {key} cannot be used in its current state ({msg or code}):"
                " if it is pending deletion, cancel the deletion; or unlock with another secret"
            )
        if code == "NotFoundException":
            return KeyUnavailableError(f"{what}: KMS key {key} was not found{where}")
        if code in {"UnrecognizedClientException", "InvalidSignatureException"}:
            return KeyUnavailableError(f"{what}: AWS rejected the credentials ({code}): {msg}")
        return KeyUnavailableError(f"{what}: AWS KMS failed ({code}): {msg}")
    if isinstance(exc, bce.NoRegionError):
        return ConfigError(
            f"{what}: no AWS region: use a key ARN, give --kms-region or set AWS_REGION"
        )
    if isinstance(exc, bce.NoCredentialsError | bce.PartialCredentialsError):
        return KeyUnavailableError(
            f"{what}: no AWS credentials for KMS (set them in the environment, a profile"
            " or an instance role)"
        )
    if isinstance(exc, bce.ConnectionError | bce.HTTPClientError):
        return KeyUnavailableError(
            f"{what}: cannot reach AWS KMS{where}: {without_userinfo(str(exc))}: check the"
            " network and the endpoint (--kms-endpoint, AWS_ENDPOINT_URL_KMS), or unlock with"
            " another secret"
        )
    if isinstance(exc, bce.BotoCoreError | ValueError):
        return KeyUnavailableError(f"{what}: AWS KMS client error: {without_userinfo(str(exc))}")
    raise exc


def _call(client: Any, op: str, what: str, key: str, region: str | None, **kw: Any) -> Any:
    try:
        return getattr(client, op)(**kw)
    except Exception as exc:
        raise _translate(exc, what, key, region) from None


class KmsUnlocker:
    """Opens aws-kms slots by calling KMS Decrypt with the slot's encryption context."""

    kind = KIND_AWS_KMS

    def __init__(self, clients: KmsClients, pinned_key_id: str | None = None) -> None:
        self.clients = clients
        self.pinned_key_id = pinned_key_id

    def open_slot(self, slot: Keyslot, volume_id: bytes) -> bytes | None:
        params = params_from_slot(slot)
        what = f"aws-kms keyslot {slot.slot_id}"
        key = self.pinned_key_id or params.key_arn
        client = self.clients.get(params.region)
        response = _call(
            client,
            "decrypt",
            what,
            key,
            params.region,
            CiphertextBlob=slot.wrapped_key,
            EncryptionContext=encryption_context(volume_id, slot.slot_id),
            KeyId=key,
            EncryptionAlgorithm="SYMMETRIC_DEFAULT",
        )
        plaintext = bytes(response["Plaintext"])
        if len(plaintext) != MASTER_KEY_SIZE:
            raise WrongKeyError(f"{what}: KMS returned a key of the wrong size")
        return plaintext


def kms_slot_maker(clients: KmsClients, key_id: str, region: str | None = None) -> SlotMaker:
    """A SlotMaker that encrypts the master key with KMS key key_id (ARN, id or alias).

    Region: the key ARN's, else region, else the AWS environment's. The new
    slot is decrypted once before it is returned, so a key this host may
    encrypt with but not decrypt with never makes a slot.
    """
    if not key_id or len(key_id) > MAX_PARAM_LENGTH:
        raise ConfigError("--kms-key-id must name a KMS key (ARN, key id or alias)")
    if region is not None and not _REGION_RE.match(region):
        raise ConfigError(f"{region!r} is not an AWS region name")

    def make(slot_id: int, master_key: bytes, volume_id: bytes) -> Keyslot:
        use_region = region_of_arn(key_id) or region
        client = clients.get(use_region)
        what = f"aws-kms keyslot {slot_id}"
        response = _call(
            client,
            "encrypt",
            what,
            key_id,
            use_region,
            KeyId=key_id,
            Plaintext=master_key,
            EncryptionContext=encryption_context(volume_id, slot_id),
            EncryptionAlgorithm="SYMMETRIC_DEFAULT",
        )
        arn = str(response["KeyId"])
        key_region = region_of_arn(arn) or use_region or str(client.meta.region_name)
        slot = Keyslot(
            slot_id,
            KIND_AWS_KMS,
            {"key_id": key_id, "key_arn": arn, "region": key_region},
            b"",
            bytes(response["CiphertextBlob"]),
        )
        if KmsUnlocker(clients).open_slot(slot, volume_id) != master_key:
            raise KeyUnavailableError(f"{what}: KMS did not give back the key it encrypted")
        return slot

    return make
