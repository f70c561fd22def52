"""PKCS#11 keyslots: the master key wrapped by an AES key that never leaves a token.

Slot (kind "pkcs11"): params {"module": path of the PKCS#11 library,
"token": token label, "key": label of an AES secret key on the token,
"mech": "aes-gcm"}; nonce 12 random bytes; wrapped_key = AES-256-GCM
ciphertext || tag (48 bytes) of the master key, computed ON THE TOKEN
(C_Encrypt with CKM_AES_GCM) under the token key, with the usual keyslot AD
(volume id, slot id, kind, params; see sealfs.keys.slots). The token checks
the tag, so a slot copied from another volume or slot does not open.

The module path in the header is untrusted: loading a library runs its code.
A module named on the command line or in SEALFS_PKCS11_MODULE is trusted
as given; a module taken from the header is loaded only if it and every
directory above it belong to root (or this user) and are writable by no one
else. The PIN comes from the caller (a file, the environment, systemd
credentials, a prompt), never from argv.

python-pkcs11 is imported lazily, so builds without it still open every
other kind of slot.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from sealfs.crypto.subkeys import MASTER_KEY_SIZE
from sealfs.errors import ConfigError, FormatError, KeyUnavailableError, WrongKeyError
from sealfs.keys.header import Keyslot
from sealfs.keys.slots import KIND_PKCS11, SlotMaker, slot_associated_data

MECH_AES_GCM = "aes-gcm"
NONCE_SIZE = 12
TAG_BITS = 128
MAX_LABEL_LENGTH = 256
_PARAM_KEYS = frozenset({"module", "token", "key", "mech"})


@dataclass(frozen=True)
class TokenKey:
    """Where a wrapping key lives: library, token label, key label."""

    module: str
    token: str
    key: str

    def params(self) -> dict[str, str]:
        return {"module": self.module, "token": self.token, "key": self.key, "mech": MECH_AES_GCM}


@dataclass(frozen=True)
class Pin:
    value: bytes = field(repr=False)


def params_from_slot(slot: Keyslot) -> TokenKey:
    """Validate a pkcs11 slot's params and sizes (they come from the untrusted header)."""
    raw = slot.params
    ok = (
        set(raw) == _PARAM_KEYS
        and raw["mech"] == MECH_AES_GCM
        and all(
            isinstance(raw[k], str) and 0 < len(raw[k]) <= MAX_LABEL_LENGTH
            for k in ("module", "token", "key")
        )
        and len(slot.nonce) == NONCE_SIZE
        and len(slot.wrapped_key) == MASTER_KEY_SIZE + TAG_BITS // 8
    )
    if not ok:
        raise FormatError(f"pkcs11 keyslot {slot.slot_id} has malformed parameters")
    return TokenKey(raw["module"], raw["token"], raw["key"])


def check_trusted_module(path: str) -> str:
    """The path to load (symlinks resolved) if loading it is safe though a header named
    it; else KeyUnavailableError.

    Safe: absolute, a regular file, and it and every directory above it owned
    by root or by us and not writable by group or others. Those checks are of
    the resolved path, so the resolved path is what must be loaded: loading the
    path as named would follow its symlinks again, and a link in a directory
    others may write to (/tmp) could point elsewhere by then.
    """
    hint = "give --pkcs11-module PATH or set SEALFS_PKCS11_MODULE to load it anyway"
    if not os.path.isabs(path):
        raise KeyUnavailableError(f"PKCS#11 module {path!r} in the header is not absolute: {hint}")
    real = os.path.realpath(path)
    if not os.path.isfile(real):
        raise KeyUnavailableError(f"PKCS#11 module {path} not found: {hint}")
    current = real
    while True:
        st = os.stat(current)
        if st.st_uid not in (0, os.geteuid()) or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise KeyUnavailableError(
                f"PKCS#11 module {path} named by the volume header is not in a trusted"
                f" location ({current} is writable by others): {hint}"
            )
        parent = os.path.dirname(current)
        if parent == current:
            return real
        current = parent


def _pkcs11() -> Any:
    try:
        import pkcs11  # noqa: PLC0415
    except ImportError:
        raise KeyUnavailableError(
            "PKCS#11 support needs the python-pkcs11 package: pip install python-pkcs11"
        ) from None
    return pkcs11


@contextmanager
def _session(where: TokenKey, pin: Pin, *, rw: bool = False) -> Iterator[Any]:
    """A logged-in session on the token, with one-line errors naming the cause."""
    p11 = _pkcs11()
    exc_mod = p11.exceptions
    try:
        # Always by the resolved path: python-pkcs11 loads one library per process, and
        # the same one named through a symlink and without would count as two.
        lib = p11.lib(os.path.realpath(where.module))
    except (OSError, RuntimeError) as exc:
        raise KeyUnavailableError(
            f"cannot load PKCS#11 module {where.module}: {exc or type(exc).__name__}"
        ) from None
    try:
        token = lib.get_token(token_label=where.token)
    except exc_mod.NoSuchToken:
        raise KeyUnavailableError(
            f"PKCS#11 token {where.token!r} is not present (module {where.module})"
        ) from None
    except exc_mod.MultipleTokensReturned:
        raise KeyUnavailableError(
            f"more than one PKCS#11 token is labelled {where.token!r}"
        ) from None
    try:
        session = token.open(user_pin=pin.value.decode("utf-8", "surrogateescape"), rw=rw)
    except exc_mod.PinIncorrect:
        raise WrongKeyError(f"wrong PIN for PKCS#11 token {where.token!r}") from None
    except exc_mod.PinLocked:
        raise KeyUnavailableError(f"the PIN of PKCS#11 token {where.token!r} is locked") from None
    except (exc_mod.PinLenRange, exc_mod.ArgumentsBad):
        raise WrongKeyError(f"wrong PIN for PKCS#11 token {where.token!r} (bad length)") from None
    except exc_mod.PKCS11Error as exc:
        raise KeyUnavailableError(
            f"cannot open PKCS#11 token {where.token!r}: {type(exc).__name__}"
        ) from None
    try:
        yield session
    finally:
        session.close()


def _find_key(session: Any, where: TokenKey) -> Any:
    p11 = _pkcs11()
    try:
        return session.get_key(
            object_class=p11.ObjectClass.SECRET_KEY, key_type=p11.KeyType.AES, label=where.key
        )
    except p11.exceptions.NoSuchKey:
        raise KeyUnavailableError(
            f"no AES key labelled {where.key!r} on PKCS#11 token {where.token!r}"
        ) from None
    except p11.exceptions.MultipleObjectsReturned:
        raise KeyUnavailableError(
            f"more than one AES key is labelled {where.key!r} on token {where.token!r}"
        ) from None


def create_token_key(where: TokenKey, pin: Pin) -> None:
    """Generate a 256-bit AES key on the token: sensitive, never extractable, encrypt/decrypt only.

    Raises ConfigError if a key with that label exists.
    """
    p11 = _pkcs11()
    attr = p11.Attribute
    with _session(where, pin, rw=True) as session:
        try:
            _find_key(session, where)
        except KeyUnavailableError:
            pass
        else:
            raise ConfigError(f"token {where.token!r} already holds a key labelled {where.key!r}")
        try:
            session.generate_key(
                p11.KeyType.AES,
                256,
                label=where.key,
                store=True,
                template={
                    attr.SENSITIVE: True,
                    attr.EXTRACTABLE: False,
                    attr.ENCRYPT: True,
                    attr.DECRYPT: True,
                    attr.WRAP: False,
                    attr.UNWRAP: False,
                },
            )
        except p11.exceptions.PKCS11Error as exc:
            raise KeyUnavailableError(
                f"cannot create an AES key on token {where.token!r}: {type(exc).__name__}"
            ) from None


def _gcm(nonce: bytes, ad: bytes) -> dict[str, Any]:
    p11 = _pkcs11()
    return {
        "mechanism": p11.Mechanism.AES_GCM,
        "mechanism_param": p11.GCMParams(nonce, ad, TAG_BITS),
    }


class Pkcs11Unlocker:
    """Opens pkcs11 slots: AES-GCM decrypt on the token, which checks the tag and AD."""

    kind = KIND_PKCS11

    def __init__(self, pin: Pin, module: str | None = None) -> None:
        self.pin = pin
        self.module = module  # trusted local override of the header's module path

    def open_slot(self, slot: Keyslot, volume_id: bytes) -> bytes | None:
        where = params_from_slot(slot)
        module = self.module or check_trusted_module(where.module)
        where = TokenKey(module, where.token, where.key)
        ad = slot_associated_data(volume_id, slot.slot_id, slot.kind, slot.params)
        p11 = _pkcs11()
        with _session(where, self.pin) as session:
            key = _find_key(session, where)
            try:
                plain = key.decrypt(slot.wrapped_key, **_gcm(slot.nonce, ad))
            except (
                p11.exceptions.GeneralError,
                p11.exceptions.EncryptedDataInvalid,
                p11.exceptions.EncryptedDataLenRange,
            ):
                return None  # the tag did not verify: another key, volume or slot
            except p11.exceptions.PKCS11Error as exc:
                raise KeyUnavailableError(
                    f"pkcs11 keyslot {slot.slot_id}: the token refused to decrypt"
                    f" ({type(exc).__name__})"
                ) from None
        return bytes(plain)


def pkcs11_slot_maker(where: TokenKey, pin: Pin) -> SlotMaker:
    """A SlotMaker that wraps the master key on the token (and checks it unwraps)."""
    for name, value in (("--pkcs11-token", where.token), ("--pkcs11-key", where.key)):
        if not value or len(value) > MAX_LABEL_LENGTH:
            raise ConfigError(f"{name} must be a label of 1 to {MAX_LABEL_LENGTH} characters")
    if not os.path.isabs(where.module):
        raise ConfigError(f"--pkcs11-module must be an absolute path, not {where.module!r}")

    def make(slot_id: int, master_key: bytes, volume_id: bytes) -> Keyslot:
        params = where.params()
        ad = slot_associated_data(volume_id, slot_id, KIND_PKCS11, params)
        nonce = os.urandom(NONCE_SIZE)
        p11 = _pkcs11()
        with _session(where, pin) as session:
            key = _find_key(session, where)
            try:
                sealed = bytes(key.encrypt(master_key, **_gcm(nonce, ad)))
            except p11.exceptions.PKCS11Error as exc:
                raise KeyUnavailableError(
                    f"token key {where.key!r} cannot encrypt with AES-GCM ({type(exc).__name__})"
                ) from None
        slot = Keyslot(slot_id, KIND_PKCS11, params, nonce, sealed)
        if Pkcs11Unlocker(pin, where.module).open_slot(slot, volume_id) != master_key:
            raise KeyUnavailableError(f"token key {where.key!r} did not unwrap what it wrapped")
        return slot

    return make
