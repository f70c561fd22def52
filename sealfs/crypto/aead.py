"""AES-256-GCM seal and open: the only authenticated cipher sealfs uses.

Every other module that encrypts goes through these two functions, so there is
exactly one place where nonces are chosen and one place where an authentication
failure becomes IntegrityError.
"""

from __future__ import annotations

import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from sealfs.errors import FormatError, IntegrityError

KEY_SIZE = 32
NONCE_SIZE = 12
TAG_SIZE = 16

Buffer = bytes | bytearray | memoryview


def _cipher(key: bytes) -> AESGCM:
    # A wrong key length is a bug in the caller, not bad input from the store.
    if len(key) != KEY_SIZE:
        raise ValueError(f"AES-256-GCM key must be {KEY_SIZE} bytes, got {len(key)}")
    return AESGCM(key)


def seal(
    key: bytes,
    plaintext: Buffer,
    associated_data: bytes,
    nonce: bytes | None = None,
    *,
    prefix: bytes = b"",
) -> bytes:
    """Encrypt and authenticate plaintext; return prefix || nonce || ciphertext || tag.

    The nonce is 96 random bits unless given (tests pin it for golden vectors;
    production code must leave it None). The prefix (an envelope's header,
    which the caller binds through associated_data) is joined in the one copy
    that frames the ciphertext: prefix + seal(...) copied every chunk twice.
    Raises ValueError on a bad key or nonce length (caller bugs). Never retries.
    """
    cipher = _cipher(key)
    if nonce is None:
        nonce = os.urandom(NONCE_SIZE)
    elif len(nonce) != NONCE_SIZE:
        raise ValueError(f"nonce must be {NONCE_SIZE} bytes, got {len(nonce)}")
    return b"".join((prefix, nonce, cipher.encrypt(nonce, plaintext, associated_data)))


def open_sealed(key: bytes, sealed: bytes | memoryview, associated_data: bytes) -> bytes:
    """Authenticate and decrypt the output of seal(); return the plaintext.

    Raises FormatError if sealed is too short to hold a nonce and a tag, and
    IntegrityError if authentication fails (wrong key, wrong associated data or
    any modified byte). Never returns unauthenticated bytes.
    """
    cipher = _cipher(key)
    if len(sealed) < NONCE_SIZE + TAG_SIZE:
        raise FormatError(
            f"sealed data is {len(sealed)} bytes, shorter than nonce and tag "
            f"({NONCE_SIZE + TAG_SIZE})"
        )
    view = memoryview(sealed)
    try:
        return cipher.decrypt(view[:NONCE_SIZE], view[NONCE_SIZE:], associated_data)
    except InvalidTag:
        raise IntegrityError(
            "authentication failed: data was modified or the key is wrong"
        ) from None
