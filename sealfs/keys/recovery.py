"""Recovery keys: 32 random bytes, written out in a form a person can type.

Text form: "sfrk-" then base32 (RFC 4648 alphabet, lowercase, no padding) of
key || first 2 bytes of SHA-256(key), in dash-separated groups of 4. The
checksum catches typos before a slow, confusing "wrong key" answer.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re

from sealfs.errors import FormatError

KEY_SIZE = 32
CHECKSUM_SIZE = 2
PREFIX = "sfrk"
GROUP = 4
_ALPHABET = frozenset("abcdefghijklmnopqrstuvwxyz234567")
# 34 bytes = 272 bits = 55 base32 characters (54 full ones and 2 bits in the last).
_TEXT_CHARS = 55
_SEPARATORS = re.compile(r"[\s\-]+")
_PREFIX_RE = re.compile(r"^sfrk[\s\-]")
FORMAT_HINT = f"{PREFIX}- then {_TEXT_CHARS} letters a-z and digits 2-7, in groups of {GROUP}"


class RecoveryKeyFormatError(FormatError):
    """A recovery key text that does not parse.

    problem completes "recovery key ...", so that a caller can say where the
    key came from; neither it nor the message quotes the text or its length.
    """

    def __init__(self, problem: str) -> None:
        super().__init__(f"recovery key {problem}")
        self.problem = problem


def generate_recovery_key() -> bytes:
    """Return a fresh random 32-byte recovery key."""
    return os.urandom(KEY_SIZE)


def _checksum(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()[:CHECKSUM_SIZE]


def format_recovery_key(key: bytes) -> str:
    """Render key as "sfrk-xxxx-xxxx-...". ValueError if key is not 32 bytes."""
    if len(key) != KEY_SIZE:
        raise ValueError(f"recovery key must be {KEY_SIZE} bytes")
    text = base64.b32encode(key + _checksum(key)).decode("ascii").rstrip("=").lower()
    groups = [text[i : i + GROUP] for i in range(0, len(text), GROUP)]
    return "-".join([PREFIX, *groups])


def parse_recovery_key(text: str) -> bytes:
    """Parse a typed recovery key; tolerant of case, whitespace and dashes.

    Raises RecoveryKeyFormatError naming the problem: not the format (a
    character outside the alphabet, the wrong length) or a checksum mismatch
    (a typo). The message never quotes the text: it may be, or be close to, a
    secret (a passphrase file given as the recovery key file, a mistyped key).
    """
    # A byte order mark (a file saved by a Windows editor) is no part of any key.
    text = text.strip().removeprefix("\ufeff").strip().lower()
    # The prefix is optional. Base32 may itself start with "sfrk", so without
    # a separator after it only the length tells whether it is the prefix.
    if _PREFIX_RE.match(text):
        text = text[len(PREFIX) :]
    compact = _SEPARATORS.sub("", text)
    if len(compact) == len(PREFIX) + _TEXT_CHARS and compact.startswith(PREFIX):
        compact = compact[len(PREFIX) :]
    if len(compact) != _TEXT_CHARS or not set(compact) <= _ALPHABET:
        raise RecoveryKeyFormatError(f"is not in the recovery key format ({FORMAT_HINT})")
    raw = base64.b32decode(compact.upper() + "=")
    key, checksum = raw[:KEY_SIZE], raw[KEY_SIZE:]
    if checksum != _checksum(key):
        raise RecoveryKeyFormatError("has a typo (its checksum does not match)")
    return key
