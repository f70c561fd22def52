"""AWS KMS over real HTTP: a moto server on 127.0.0.1, unmodified boto3 as the client.

moto enforces encryption contexts and the KeyId of Decrypt, but not a key's
state or a key policy's Deny for Decrypt. AWS does both (DisabledException,
KMSInvalidStateException for a key pending deletion, AccessDeniedException),
so the server side of this fixture adds those documented rules to moto's
backend. Nothing on the client side is mocked: sealfs talks HTTP to the server.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from moto.core.exceptions import JsonRESTError
from moto.kms.exceptions import AccessDeniedException
from moto.kms.models import KmsBackend
from moto.server import ThreadedMotoServer

from sealfs.keys.kms import KmsClients, boto3_client_factory

REGION = "us-east-1"


class DisabledException(JsonRESTError):
    def __init__(self, message: str) -> None:
        super().__init__("DisabledException", message)


class KMSInvalidStateException(JsonRESTError):
    def __init__(self, message: str) -> None:
        super().__init__("KMSInvalidStateException", message)


def key_id_of(arn: str) -> str:
    """The bare key id of a key ARN (moto's admin calls want it)."""
    return arn.rsplit("/", 1)[-1]


def _denies(policy: str | None, action: str) -> bool:
    """A Deny statement for action on every resource (as moto does for DescribeKey)."""
    try:
        statements = json.loads(policy or "{}").get("Statement", [])
    except ValueError:
        return False
    for st in statements:
        actions = st.get("Action", [])
        actions = [actions] if isinstance(actions, str) else actions
        if (
            st.get("Effect", "").lower() == "deny"
            and st.get("Resource") == "*"
            and any(a in ("kms:*", action) for a in actions)
        ):
            return True
    return False


def _check_key(backend: KmsBackend, key_id: str, action: str) -> None:
    try:
        key = backend.keys[backend.any_id_to_key_id(key_id)]
    except Exception:
        return  # moto's own code answers NotFound
    if key.key_state == "Disabled":
        raise DisabledException(f"{key.arn} is disabled.")
    if key.key_state == "PendingDeletion":
        raise KMSInvalidStateException(f"{key.arn} is pending deletion.")
    if _denies(key.policy, action):
        raise AccessDeniedException(
            f"User is not authorized to perform: {action} on resource: {key.arn}"
            " with an explicit deny in a resource-based policy"
        )


@pytest.fixture(scope="session")
def kms_url() -> Iterator[str]:
    real_encrypt, real_decrypt = KmsBackend.encrypt, KmsBackend.decrypt

    def encrypt(self: KmsBackend, key_id: str, *args: Any, **kw: Any) -> Any:
        _check_key(self, key_id, "kms:Encrypt")
        return real_encrypt(self, key_id, *args, **kw)

    def decrypt(self: KmsBackend, *args: Any, **kw: Any) -> Any:
        plaintext, arn = real_decrypt(self, *args, **kw)
        _check_key(self, arn, "kms:Decrypt")  # raised instead of returning the plaintext
        return plaintext, arn

    KmsBackend.encrypt = encrypt  # type: ignore[method-assign]
    KmsBackend.decrypt = decrypt  # type: ignore[method-assign]
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no request lines in CLI output
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    assert host == "127.0.0.1"
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()
        KmsBackend.encrypt = real_encrypt  # type: ignore[method-assign]
        KmsBackend.decrypt = real_decrypt  # type: ignore[method-assign]


@pytest.fixture
def kms_env(kms_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> str:
    """Fake credentials and the moto endpoint in the environment (CLI subprocesses inherit it)."""
    for name in list(os.environ):
        if name.startswith("AWS_") or name.startswith("SEALFS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_ENDPOINT_URL_KMS", kms_url)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    return kms_url


@pytest.fixture
def kms_admin(kms_env: str) -> Iterator[Any]:
    """The test's own KMS client: creates, disables and schedules keys."""
    client = boto3.client("kms", region_name=REGION, endpoint_url=kms_env)
    yield client
    client.close()


@pytest.fixture
def kms_key(kms_admin: Any) -> str:
    """The ARN of a fresh symmetric key."""
    return str(kms_admin.create_key(Description="sealfs test")["KeyMetadata"]["Arn"])


@pytest.fixture
def clients(kms_env: str) -> Iterator[KmsClients]:
    with KmsClients(boto3_client_factory(kms_env)) as made:
        yield made
