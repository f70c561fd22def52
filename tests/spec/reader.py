"""An independent reader of a sealfs local store, written from docs/format.md alone.

It exists to prove that the document is precise enough to re-implement the format:
it imports nothing from sealfs (only the standard library, `cryptography`,
`argon2-cffi` and `zstandard`; even msgpack is decoded here, by the rules of the
msgpack specification), and every check it makes is one that format.md states.
Given a store directory and a passphrase or recovery key it returns the volume's
tree as of the newest committed generation, and raises on anything the document
says a reader must refuse, so that a test comparing it with a real mount also
proves the authentication the document promises.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import stat
import struct
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zstandard
from argon2.low_level import Type, hash_secret_raw
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

# ---------------------------------------------------------------------------
# Errors, named as format.md names them.


class SpecError(Exception):
    """Base of every refusal of this reader."""


class FormatError(SpecError):
    """Malformed bytes: not what the format allows."""


class UnsupportedVersionError(SpecError):
    """A version (or an older build's chaining) this reader does not read."""


class IntegrityError(SpecError):
    """Authentication failed: tampered, swapped, forked or lost objects."""


class WrongKeyError(SpecError):
    """No keyslot opens with the given secret."""


class WeakKdfError(SpecError):
    """A passphrase slot whose Argon2 cost is below the minimum (a lowered cost)."""


# ---------------------------------------------------------------------------
# msgpack (https://github.com/msgpack/msgpack/blob/master/spec.md), the subset the
# format uses: nil, bool, int, str, bin, array, map. Floats and ext types are refused.


class _Unpacker:
    """Decodes one msgpack value from a buffer; str as `str`, bin as `bytes`."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def _take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.data):
            raise FormatError("msgpack: truncated")
        out = self.data[self.pos : end]
        self.pos = end
        return out

    def _uint(self, n: int) -> int:
        return int.from_bytes(self._take(n), "big")

    def _sint(self, n: int) -> int:
        return int.from_bytes(self._take(n), "big", signed=True)

    def _str(self, n: int) -> str:
        raw = self._take(n)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise FormatError("msgpack: str is not UTF-8") from exc

    def value(self, depth: int = 0) -> Any:
        if depth > 64:
            raise FormatError("msgpack: nested too deep")
        b = self._take(1)[0]
        if b <= 0x7F:
            return b
        if b >= 0xE0:
            return b - 0x100
        if 0x80 <= b <= 0x8F:
            return self._map(b & 0x0F, depth)
        if 0x90 <= b <= 0x9F:
            return self._array(b & 0x0F, depth)
        if 0xA0 <= b <= 0xBF:
            return self._str(b & 0x1F)
        simple: dict[int, Any] = {0xC0: None, 0xC2: False, 0xC3: True}
        if b in simple:
            return simple[b]
        sized = {
            0xC4: ("bin", 1), 0xC5: ("bin", 2), 0xC6: ("bin", 4),
            0xCC: ("uint", 1), 0xCD: ("uint", 2), 0xCE: ("uint", 4), 0xCF: ("uint", 8),
            0xD0: ("int", 1), 0xD1: ("int", 2), 0xD2: ("int", 4), 0xD3: ("int", 8),
            0xD9: ("str", 1), 0xDA: ("str", 2), 0xDB: ("str", 4),
            0xDC: ("array", 2), 0xDD: ("array", 4), 0xDE: ("map", 2), 0xDF: ("map", 4),
        }  # fmt: skip
        if b not in sized:
            raise FormatError(f"msgpack: type byte {b:#04x} is not allowed (float, ext, unused)")
        kind, width = sized[b]
        if kind == "uint":
            return self._uint(width)
        if kind == "int":
            return self._sint(width)
        n = self._uint(width)
        if kind == "bin":
            return self._take(n)
        if kind == "str":
            return self._str(n)
        if kind == "array":
            return self._array(n, depth)
        return self._map(n, depth)

    def _array(self, n: int, depth: int) -> list[Any]:
        if n > len(self.data) - self.pos:  # each element takes at least one byte
            raise FormatError("msgpack: array longer than its buffer")
        return [self.value(depth + 1) for _ in range(n)]

    def _map(self, n: int, depth: int) -> dict[Any, Any]:
        if 2 * n > len(self.data) - self.pos:
            raise FormatError("msgpack: map longer than its buffer")
        out: dict[Any, Any] = {}
        for _ in range(n):
            key = self.value(depth + 1)
            if isinstance(key, (list, dict)):
                raise FormatError("msgpack: unhashable map key")
            if key in out:
                raise FormatError("msgpack: duplicate map key")
            out[key] = self.value(depth + 1)
        return out


def unpackb(data: bytes) -> Any:
    """Decode exactly one msgpack value that fills data."""
    unpacker = _Unpacker(data)
    out = unpacker.value()
    if unpacker.pos != len(data):
        raise FormatError("msgpack: trailing bytes")
    return out


def canonical_packb(value: Any) -> bytes:
    """Canonical msgpack of format.md section 5: map keys sorted by code point, integers
    in their shortest encoding (the unsigned family for non-negative values), bytes as
    bin, text as str."""
    if value is None:
        return b"\xc0"
    if value is True:
        return b"\xc3"
    if value is False:
        return b"\xc2"
    if isinstance(value, int):
        return _pack_int(value)
    if isinstance(value, str):
        raw = value.encode("utf-8")
        return _pack_len(len(raw), 0xA0, 31, (0xD9, 0xDA, 0xDB)) + raw
    if isinstance(value, bytes):
        return _pack_len(len(value), None, 0, (0xC4, 0xC5, 0xC6)) + value
    if isinstance(value, list):
        items = b"".join(canonical_packb(v) for v in value)
        return _pack_len(len(value), 0x90, 15, (None, 0xDC, 0xDD)) + items
    if isinstance(value, dict):
        keys = sorted(value)
        items = b"".join(canonical_packb(k) + canonical_packb(value[k]) for k in keys)
        return _pack_len(len(value), 0x80, 15, (None, 0xDE, 0xDF)) + items
    raise FormatError(f"cannot encode {type(value).__name__} canonically")


def _pack_len(n: int, fix: int | None, fix_max: int, tags: tuple[int | None, int, int]) -> bytes:
    if fix is not None and n <= fix_max:
        return bytes([fix | n])
    for tag, width in zip(tags, (1, 2, 4), strict=True):
        if tag is not None and n < 1 << (8 * width):
            return bytes([tag]) + n.to_bytes(width, "big")
    raise FormatError("too long for msgpack")


def _pack_int(n: int) -> bytes:
    if 0 <= n <= 0x7F:
        return bytes([n])
    if -32 <= n < 0:
        return bytes([n & 0xFF])
    if n > 0:
        for tag, width in ((0xCC, 1), (0xCD, 2), (0xCE, 4), (0xCF, 8)):
            if n < 1 << (8 * width):
                return bytes([tag]) + n.to_bytes(width, "big")
    else:
        for tag, width in ((0xD0, 1), (0xD1, 2), (0xD2, 4), (0xD3, 8)):
            if n >= -(1 << (8 * width - 1)):
                return bytes([tag]) + n.to_bytes(width, "big", signed=True)
    raise FormatError("integer out of msgpack's range")


# ---------------------------------------------------------------------------
# Type checks: a bool is never an int here (format.md section 9).


def _int(value: Any, lo: int, hi: int, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise FormatError(f"{what}: not an int in {lo}..{hi}: {value!r}")
    return value


def _bin(value: Any, what: str, size: int | None = None) -> bytes:
    if not isinstance(value, bytes) or (size is not None and len(value) != size):
        raise FormatError(f"{what}: not a bin{'' if size is None else f' of {size} bytes'}")
    return value


def _list(value: Any, what: str, size: int | None = None) -> list[Any]:
    if not isinstance(value, list) or (size is not None and len(value) != size):
        raise FormatError(f"{what}: not an array{'' if size is None else f' of {size}'}")
    return value


def _map(value: Any, what: str) -> dict[Any, Any]:
    if not isinstance(value, dict):
        raise FormatError(f"{what}: not a map")
    return value


U16, U32, U64 = (1 << 16) - 1, (1 << 32) - 1, (1 << 64) - 1

# ---------------------------------------------------------------------------
# Keys (sections 1, 5, 6, 13).


def hkdf(ikm: bytes, salt: bytes, info: bytes, length: int) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=salt, info=info).derive(ikm)


@dataclass(frozen=True)
class Subkeys:
    """The subkeys of one key epoch (section 1); the chunker seed is not needed to read."""

    chunk_encryption: bytes
    chunk_id: bytes
    metadata: bytes
    header_mac: bytes

    @classmethod
    def derive(cls, master: bytes, volume_id: bytes) -> Subkeys:
        def sub(label: str) -> bytes:
            return hkdf(master, volume_id, b"sealfs/v1/" + label.encode(), 32)

        return cls(sub("chunk-encryption"), sub("chunk-id"), sub("metadata"), sub("header-mac"))


def passphrase_bytes(secret: bytes | str, *, from_file: bool) -> bytes:
    """The passphrase as Argon2 takes it (section 5): from a file, one final LF or CRLF
    removed; then UTF-8 NFC (bytes that are not UTF-8 are used as they are)."""
    raw = secret.encode("utf-8") if isinstance(secret, str) else secret
    if from_file:
        if raw.endswith(b"\r\n"):
            raw = raw[:-2]
        elif raw.endswith(b"\n"):
            raw = raw[:-1]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw
    return unicodedata.normalize("NFC", text).encode("utf-8")


_B32 = "abcdefghijklmnopqrstuvwxyz234567"


def parse_recovery_key(text: str) -> bytes:
    """The 32 raw bytes of a recovery key in its text form (section 6)."""
    text = text.strip().removeprefix("\ufeff").strip().lower()
    if text.startswith("sfrk") and len(text) > 4 and (text[4].isspace() or text[4] == "-"):
        text = text[4:]
    compact = "".join(c for c in text if not c.isspace() and c != "-")
    if len(compact) == 59 and compact.startswith("sfrk"):
        compact = compact[4:]
    if len(compact) != 55 or any(c not in _B32 for c in compact):
        raise FormatError("recovery key: wrong length or a character outside base32")
    raw = base64.b32decode(compact.upper() + "=" * 1)  # 55 characters + 1 pad = 34 bytes
    key, check = raw[:32], raw[32:]
    if hashlib.sha256(key).digest()[:2] != check:
        raise FormatError("recovery key has a typo: checksum does not match")
    return key


@dataclass(frozen=True)
class Header:
    """The verified volume header and the subkeys of every epoch the reader holds."""

    volume_id: bytes
    created_ns: int
    data_epoch: int
    retired_epoch: int | None
    keys: dict[int, Subkeys]


HEADER_MAGIC = b"SEALFS\0\0"
MAX_HEADER_BODY = 1 << 20


def _slot(raw: Any, volume_id: bytes) -> dict[str, Any]:
    slot = _map(raw, "keyslot")
    if set(slot) != {"id", "kind", "params", "nonce", "wrapped_key"}:
        raise FormatError(f"keyslot keys: {sorted(map(str, slot))}")
    _int(slot["id"], 0, U32, "slot id")
    kind = slot["kind"]
    if not isinstance(kind, str) or not kind or len(kind) > 32 or not kind.isascii():
        raise FormatError("slot kind")
    if not (kind[0].islower() or kind[0].isdigit()) or any(
        not (c.islower() or c.isdigit() or c == "-") for c in kind
    ):
        raise FormatError("slot kind")
    _check_params(_map(slot["params"], "slot params"), 0)
    if len(_bin(slot["nonce"], "slot nonce")) > 64:
        raise FormatError("slot nonce too long")
    if not 1 <= len(_bin(slot["wrapped_key"], "wrapped key")) <= 8192:
        raise FormatError("wrapped key length")
    return slot


def _check_params(value: Any, depth: int) -> None:
    """Params hold str-keyed maps, arrays and scalars, at most 4 containers deep."""
    if depth > 4:
        raise FormatError("keyslot params nested too deeply")
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise FormatError("keyslot params: a key that is not a str")
        for v in value.values():
            _check_params(v, depth + 1)
    elif isinstance(value, list):
        for v in value:
            _check_params(v, depth + 1)


def _argon2_params(params: dict[Any, Any]) -> tuple[int, int, int, bytes]:
    if set(params) != {"kdf", "m", "t", "p", "salt"} or params["kdf"] != "argon2id":
        raise FormatError("passphrase slot params")
    salt = _bin(params["salt"], "argon2 salt", 16)
    m = _int(params["m"], 0, 4194304, "argon2 m")
    t = _int(params["t"], 0, 1024, "argon2 t")
    p = _int(params["p"], 1, 64, "argon2 p")
    if m < 65536 or t < 1:  # after every FormatError check (section 5)
        raise WeakKdfError(f"Argon2 cost m={m} KiB, t={t} is below the minimum")
    return m, t, p, salt


def _unwrap(wrapping_key: bytes, slot: dict[str, Any], volume_id: bytes) -> bytes | None:
    ad = (
        b"sealfs/v1/keyslot"
        + volume_id
        + struct.pack(">I", slot["id"])
        + slot["kind"].encode("ascii")
        + canonical_packb(slot["params"])
    )
    nonce, wrapped = slot["nonce"], slot["wrapped_key"]
    if len(nonce) != 12 or len(wrapped) != 48:
        raise FormatError("passphrase/recovery slot: nonce 12 and wrapped key 48 bytes")
    try:
        master = AESGCM(wrapping_key).decrypt(nonce, wrapped, ad)
    except InvalidTag:
        return None
    return master


def read_header(
    data: bytes, *, passphrase: bytes | None = None, recovery_key: bytes | None = None
) -> Header:
    """Decode sealfs.vol, open a slot with the secret, verify the MAC, open `retired`.

    passphrase is already in the form Argon2 takes (see passphrase_bytes); recovery_key
    is the 32 raw bytes.
    """
    if len(data) > MAX_HEADER_BODY + 46 or len(data) < 14 or data[:8] != HEADER_MAGIC:
        raise FormatError("not a sealfs volume header")
    if struct.unpack(">H", data[8:10])[0] != 1:
        raise UnsupportedVersionError("header format version")
    (body_len,) = struct.unpack(">I", data[10:14])
    if body_len > MAX_HEADER_BODY or len(data) != 46 + body_len:
        raise FormatError("header length")
    body = _map(unpackb(data[14 : 14 + body_len]), "header body")
    required = {"volume_id", "created_ns", "data_epoch", "slots"}
    if not required <= set(body) or set(body) - required - {"next_slot_id", "retired"}:
        raise FormatError(f"header keys: {sorted(map(str, body))}")
    volume_id = _bin(body["volume_id"], "volume_id", 16)
    created_ns = _int(body["created_ns"], 0, (1 << 63) - 1, "created_ns")
    data_epoch = _int(body["data_epoch"], 0, U16, "data_epoch")
    slots = [_slot(s, volume_id) for s in _list(body["slots"], "slots")]
    ids = [s["id"] for s in slots]
    if not 1 <= len(slots) <= 64 or len(set(ids)) != len(ids):
        raise FormatError("slots: 1 .. 64 with unique ids")
    if "next_slot_id" in body:
        _int(body["next_slot_id"], max(ids) + 1, 1 << 32, "next_slot_id")
    retired = None
    if "retired" in body:
        retired = _map(body["retired"], "retired")
        if set(retired) != {"epoch", "nonce", "wrapped_key"}:
            raise FormatError("retired keys")
        _int(retired["epoch"], 0, data_epoch - 1, "retired epoch")
        _bin(retired["nonce"], "retired nonce", 12)
        _bin(retired["wrapped_key"], "retired wrapped key", 48)

    if passphrase is not None:
        kind = "passphrase"
        candidates = [s for s in slots if s["kind"] == kind]
        costs = [_argon2_params(s["params"]) for s in candidates]  # all checked first

        def wrapping_keys() -> Iterator[bytes]:
            for m, t, p, salt in costs:
                yield hash_secret_raw(passphrase, salt, t, m, p, 32, Type.ID, 0x13)
    elif recovery_key is not None:
        kind = "recovery"
        candidates = [s for s in slots if s["kind"] == kind]
        for s in candidates:
            if s["params"] != {}:
                raise FormatError("recovery slot params must be {}")

        def wrapping_keys() -> Iterator[bytes]:
            for _ in candidates:
                yield hkdf(recovery_key, volume_id, b"sealfs/v1/recovery-slot", 32)
    else:
        raise ValueError("give a passphrase or a recovery key")

    master = None
    for slot, key in zip(candidates, wrapping_keys(), strict=False):
        master = _unwrap(key, slot, volume_id)
        if master is not None:
            break
    if master is None:
        raise WrongKeyError(f"no {kind} slot opens with this secret")
    if len(master) != 32:
        raise FormatError("master key is not 32 bytes")
    current = Subkeys.derive(master, volume_id)
    mac = hmac.new(current.header_mac, data[: 14 + body_len], hashlib.sha256).digest()
    if not hmac.compare_digest(mac, data[14 + body_len :]):
        raise IntegrityError("header MAC mismatch")
    keys = {data_epoch: current}
    retired_epoch = None
    if retired is not None:
        retired_epoch = retired["epoch"]
        wrap = hkdf(master, volume_id, b"sealfs/v1/retired-key-wrap", 32)
        ad = b"sealfs/v1/retired-key" + volume_id + struct.pack(">H", retired_epoch)
        try:
            old = AESGCM(wrap).decrypt(retired["nonce"], retired["wrapped_key"], ad)
        except InvalidTag as exc:
            raise IntegrityError("retired key does not open") from exc
        keys[retired_epoch] = Subkeys.derive(old, volume_id)
    return Header(volume_id, created_ns, data_epoch, retired_epoch, keys)


# ---------------------------------------------------------------------------
# Sealed objects (sections 3, 8, 9).

CHUNK, SEGMENT, SNAPSHOT = 1, 2, 3
MAX_CHUNK = 4 << 20
MAX_METADATA = 1 << 31


DELTA = 0x02  # flag: the payload is a difference from a base chunk (section 8)


def open_envelope(sealed: bytes, header: Header, kind: int, binding: bytes) -> bytes:
    """Verify and open one sealed object; returns its payload, decompressed (a
    difference's payload as it is: see difference())."""
    if len(sealed) < 8 or sealed[:3] != b"SFS":
        raise FormatError("not a sealed object")
    if sealed[3] != 1:
        raise UnsupportedVersionError("envelope version")
    if sealed[4] not in (CHUNK, SEGMENT, SNAPSHOT) or sealed[5] & ~0x03:
        raise FormatError("unknown kind or reserved flag")
    if sealed[5] & DELTA and (sealed[5] != DELTA or sealed[4] != CHUNK):
        raise FormatError("difference flag with zstd's, or on metadata")
    if len(sealed) < 36:
        raise FormatError("sealed object shorter than its overhead")
    if sealed[4] != kind:
        raise IntegrityError(f"object of kind {sealed[4]} where {kind} was expected")
    epoch = struct.unpack(">H", sealed[6:8])[0]
    if epoch not in header.keys:
        raise IntegrityError(f"object sealed under key epoch {epoch}, not held")
    keys = header.keys[epoch]
    key = keys.chunk_encryption if kind == CHUNK else keys.metadata
    ad = sealed[:8] + header.volume_id + binding
    try:
        payload = AESGCM(key).decrypt(sealed[8:20], sealed[20:], ad)
    except InvalidTag as exc:
        raise IntegrityError("tag mismatch") from exc
    if sealed[5] & 0x01:
        payload = _decompress(payload, MAX_CHUNK if kind == CHUNK else MAX_METADATA)
    return payload


def _decompress(frame: bytes, limit: int, base: bytes | None = None) -> bytes:
    """One zstd frame, never more than limit bytes out (the claimed size checked first);
    base: the raw-content dictionary of a difference, whose window is at most 2^23."""
    try:
        params = zstandard.get_frame_parameters(frame)
    except zstandard.ZstdError as exc:
        raise FormatError(f"not a zstd frame: {exc}") from exc
    if params.content_size != zstandard.CONTENTSIZE_UNKNOWN and params.content_size > limit:
        raise FormatError("zstd frame claims more than the limit")
    if base is None:
        decompressor = zstandard.ZstdDecompressor()
    else:
        if params.window_size > 1 << 23:
            raise FormatError("a difference's window over 2^23 bytes")
        raw = zstandard.ZstdCompressionDict(base, dict_type=zstandard.DICT_TYPE_RAWCONTENT)
        decompressor = zstandard.ZstdDecompressor(dict_data=raw, max_window_size=1 << 23)
    reader = decompressor.stream_reader(frame, read_across_frames=False)
    try:
        out = reader.read(limit + 1)
        while len(out) <= limit:
            more = reader.read(limit + 1 - len(out))
            if not more:
                break
            out += more
    except zstandard.ZstdError as exc:
        raise FormatError(f"bad zstd frame: {exc}") from exc
    if len(out) > limit:
        raise FormatError("zstd frame decompresses past the limit")
    if params.content_size not in (zstandard.CONTENTSIZE_UNKNOWN, len(out)):
        raise FormatError("zstd frame shorter than it claims")
    return out


def read_object(path: Path, limit: int) -> bytes:
    """An object's bytes; anything but a regular file, or a file over limit, is refused
    before it is read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO must not block
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise FormatError(f"{path}: not a regular file")
        if st.st_size > limit:
            raise FormatError(f"{path}: {st.st_size} bytes, above {limit}")
        return f.read(limit + 1)


# ---------------------------------------------------------------------------
# Metadata state and replay (sections 9, 10, 11).

S_IFMT = 0o170000


@dataclass
class Inode:
    ino: int
    mode: int
    uid: int
    gid: int
    nlink: int
    size: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    rdev: int
    parent: int
    target: bytes
    xattrs: dict[bytes, bytes] = field(default_factory=dict)
    extents: list[tuple[int, int, bytes, int]] | None = None  # regular files
    entries: dict[bytes, int] | None = None  # directories

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def is_reg(self) -> bool:
        return stat.S_ISREG(self.mode)


_TIME = (-(1 << 63), U64)
_FIELD_RANGES = [
    (0, U64), (0, U32), (0, U32), (0, U32), (0, U64), (0, U64),
    _TIME, _TIME, _TIME, (0, U64), (0, U64),
]  # fmt: skip
_FIELD_NAMES = [
    "ino", "mode", "uid", "gid", "nlink", "size", "atime_ns", "mtime_ns", "ctime_ns", "rdev",
    "parent",
]  # fmt: skip


def _inode_fields(fields: list[Any]) -> Inode:
    v = [
        _int(value, lo, hi, name)
        for value, (lo, hi), name in zip(fields[:11], _FIELD_RANGES, _FIELD_NAMES, strict=True)
    ]
    return Inode(
        v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9], v[10],
        _bin(fields[11], "target"),
    )  # fmt: skip


def _extent_rows(rows: Any, what: str) -> list[tuple[int, int, bytes, int]]:
    out = []
    end = 0
    for row in _list(rows, what):
        start, length, chunk_id, offset = _list(row, "extent row", 4)
        start = _int(start, 0, U64, "extent start")
        length = _int(length, 1, MAX_CHUNK, "extent length")
        chunk_id = _bin(chunk_id, "extent chunk id", 32)
        offset = _int(offset, 0, MAX_CHUNK - length, "extent chunk offset")
        if start < end:
            raise FormatError(f"{what}: extent rows unsorted or overlapping")
        end = start + length
        out.append((start, length, chunk_id, offset))
    return out


def _cut(
    extents: list[tuple[int, int, bytes, int]], size: int
) -> list[tuple[int, int, bytes, int]]:
    out = []
    for start, length, cid, off in extents:
        if start >= size:
            continue
        out.append((start, min(length, size - start), cid, off))
    return out


def _replace(
    extents: list[tuple[int, int, bytes, int]],
    start: int,
    end: int,
    rows: list[tuple[int, int, bytes, int]],
) -> list[tuple[int, int, bytes, int]]:
    out = []
    for s, length, cid, off in extents:
        e = s + length
        if e <= start or s >= end:
            out.append((s, length, cid, off))
            continue
        if s < start:
            out.append((s, start - s, cid, off))
        if e > end:
            out.append((end, e - end, cid, off + end - s))
    for row in rows:
        if row[0] < start or row[0] + row[1] > end:
            raise FormatError("DATA row outside its range")
    out.extend(rows)
    out.sort(key=lambda r: r[0])
    return out


@dataclass
class State:
    """What replay builds: the inode table and the log position."""

    inodes: dict[int, Inode] = field(default_factory=dict)
    generation: int = 0
    head: bytes = bytes(32)
    next_ino: int = 2
    writer: list[Any] | None = None
    chunks: dict[bytes, tuple[int, int]] = field(default_factory=dict)

    def inode(self, ino: Any) -> Inode:
        ino = _int(ino, 0, U64, "inode number")
        if ino not in self.inodes:
            raise FormatError(f"reference to missing inode {ino}")
        return self.inodes[ino]

    def directory(self, ino: Any) -> Inode:
        node = self.inode(ino)
        if not node.is_dir or node.entries is None:
            raise FormatError(f"inode {ino} used as a directory")
        return node

    def apply(self, op: Any) -> None:
        op = _list(op, "record")
        if not op:
            raise FormatError("empty record")
        code, args = _int(op[0], 0, U64, "opcode"), op[1:]
        if code == 1:  # PUT_INODE
            new = _inode_fields(_list(args, "PUT_INODE", 12))
            old = self.inodes.get(new.ino)
            if old is None:
                if new.is_reg:
                    new.extents = []
                elif new.is_dir:
                    new.entries = {}
                self.inodes[new.ino] = new
                self.next_ino = max(self.next_ino, new.ino + 1)
                node = new
            else:
                if stat.S_IFMT(old.mode) != stat.S_IFMT(new.mode):
                    raise FormatError(f"PUT_INODE changes the type of inode {new.ino}")
                new.xattrs, new.extents, new.entries = old.xattrs, old.extents, old.entries
                self.inodes[new.ino] = node = new
                self.next_ino = max(self.next_ino, new.ino + 1)
            if node.extents is not None:
                node.extents = _cut(node.extents, node.size)
        elif code == 2:  # DEL_INODE: nothing if absent
            (ino,) = _list(args, "DEL_INODE", 1)
            self.inodes.pop(_int(ino, 0, U64, "inode number"), None)
        elif code == 3:  # LINK
            dir_ino, name, ino = _list(args, "LINK", 3)
            directory = self.directory(dir_ino)
            assert directory.entries is not None
            directory.entries[_bin(name, "LINK name")] = self.inode(ino).ino
        elif code == 4:  # UNLINK
            dir_ino, name = _list(args, "UNLINK", 2)
            directory = self.directory(dir_ino)
            assert directory.entries is not None
            directory.entries.pop(_bin(name, "UNLINK name"), None)
        elif code == 5:  # DATA
            ino, start, end, rows, size = _list(args, "DATA", 5)
            node = self.inode(ino)
            if node.extents is None:
                raise FormatError("DATA on a non-regular inode")
            start, end = _int(start, 0, U64, "DATA start"), _int(end, 0, U64, "DATA end")
            if end < start:
                raise FormatError("DATA range reversed")
            node.extents = _replace(node.extents, start, end, _extent_rows(rows, "DATA"))
            node.size = _int(size, 0, U64, "DATA size")
            node.extents = _cut(node.extents, node.size)
        elif code == 6:  # SET_XATTR
            ino, name, value = _list(args, "SET_XATTR", 3)
            self.inode(ino).xattrs[_bin(name, "xattr name")] = _bin(value, "xattr value")
        elif code == 7:  # DEL_XATTR
            ino, name = _list(args, "DEL_XATTR", 2)
            self.inode(ino).xattrs.pop(_bin(name, "xattr name"), None)
        elif code == 8:  # CHUNK
            cid, row = _chunk_row(args, "CHUNK")
            self.chunks[cid] = row
        elif code == 9:  # WRITER
            host, pid, mount_id, since, released = _list(args, "WRITER", 5)
            if not isinstance(host, str) or not isinstance(released, bool):
                raise FormatError("WRITER host or released")
            _int(pid, 0, U64, "pid")
            _bin(mount_id, "mount id")
            _int(since, 0, U64, "since_ns")
            self.writer = list(args)
        else:
            raise FormatError(f"unknown opcode {code}")


def _payload_map(payload: bytes, keys: list[tuple[str, type]], what: str) -> dict[str, Any]:
    out = _map(unpackb(payload), what)
    for key, typ in keys:
        if key not in out:
            raise FormatError(f"{what}: missing {key}")
        value = out[key]
        if typ is int and (not isinstance(value, int) or isinstance(value, bool)):
            raise FormatError(f"{what}: {key} is not an int")
        if not isinstance(value, typ):
            raise FormatError(f"{what}: {key} is not {typ.__name__}")
    return out


def load_snapshot(payload: bytes, gen: int) -> State:
    """The state a snapshot payload holds (section 9)."""
    snap = _payload_map(
        payload,
        [("gen", int), ("head", bytes), ("time", int), ("next_ino", int), ("inodes", list),
         ("chunks", list)],
        "snapshot",
    )  # fmt: skip
    if snap["gen"] != gen:
        raise FormatError(f"snapshot s/{gen} holds generation {snap['gen']}")
    state = State(generation=gen, head=_bin(snap["head"], "head", 32))
    writer = snap.get("writer")
    if writer is not None:
        state.apply([9, *_list(writer, "snapshot writer")])  # checked as a WRITER record
    state.next_ino = _int(snap["next_ino"], 0, U64, "next_ino")
    for raw in snap["inodes"]:
        row = _list(raw, "snapshot inode row", 14)
        node = _inode_fields(row[:12])
        node.xattrs = {
            _bin(k, "xattr name"): _bin(v, "xattr value")
            for k, v in _map(row[12], "xattrs").items()
        }
        body = row[13]
        if node.is_reg:
            node.extents = _extent_rows(body, "snapshot extents")
            if node.extents and node.extents[-1][0] + node.extents[-1][1] > node.size:
                raise FormatError("snapshot extents past the file's size")
        elif node.is_dir:
            node.entries = {
                _bin(k, "entry name"): _int(v, 0, U64, "entry ino")
                for k, v in _map(body, "directory").items()
            }
        elif body is not None:
            raise FormatError("snapshot body of a non-file, non-directory")
        if node.ino in state.inodes:
            raise FormatError(f"snapshot lists inode {node.ino} twice")
        state.inodes[node.ino] = node
    for node in state.inodes.values():
        for ino in (node.entries or {}).values():
            state.inode(ino)
    for raw in snap["chunks"]:
        cid, row = _chunk_row(raw, "snapshot chunk row")
        state.chunks[cid] = row
    return state


def _chunk_row(raw: Any, what: str) -> tuple[bytes, tuple[int, int, bytes, bytes]]:
    """A chunk table row (sections 9, 10): id, plain size, stored size, and optionally
    features (0 to 64 bytes, a multiple of 8) and base (0 or 32 bytes), both or neither."""
    row = _list(raw, what)
    if len(row) not in (3, 5):
        raise FormatError(f"{what}: {len(row)} fields")
    features = _bin(row[3], "features") if len(row) == 5 else b""
    base = _bin(row[4], "base") if len(row) == 5 else b""
    if len(features) % 8 or len(features) > 64 or len(base) not in (0, 32):
        raise FormatError(f"{what}: features or base of a wrong size")
    plain, stored = _int(row[1], 0, U64, "plain size"), _int(row[2], 0, U64, "stored size")
    return _bin(row[0], "chunk id", 32), (plain, stored, features, base)


def _generations(directory: Path) -> list[int]:
    if not directory.is_dir():
        return []
    out = []
    for name in os.listdir(directory):
        if name.startswith("."):
            continue
        if len(name) != 16 or not name.isdigit() or not name.isascii():
            raise FormatError(f"{directory.name}/{name}: not a generation name")
        out.append(int(name))
    return sorted(out)


def gen_name(gen: int) -> str:
    return f"{gen:016d}"


# ---------------------------------------------------------------------------
# The whole volume.


@dataclass(frozen=True)
class Node:
    """One path of the tree, as stat and read would show it."""

    ino: int
    mode: int
    uid: int
    gid: int
    nlink: int
    size: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    rdev: int
    target: bytes
    xattrs: dict[bytes, bytes]
    data: bytes | None  # a regular file's bytes


@dataclass
class Volume:
    """What read_volume returns."""

    volume_id: bytes
    data_epoch: int
    retired_epoch: int | None
    generation: int
    snapshot: int | None  # generation of the snapshot replay started from
    segments: list[int]  # generations replayed after it
    tree: dict[str, Node]
    opened: dict[str, int]  # every object opened (its name in the store): its key epoch


class Reader:
    """Reads one local store with one verified header."""

    def __init__(self, store: Path, header: Header) -> None:
        self.store = store
        self.header = header
        self.opened: dict[str, int] = {}
        self._chunks: dict[bytes, tuple[bytes, bool]] = {}  # plaintext, was a difference

    def _open(self, name: str, limit: int, kind: int, binding: bytes) -> tuple[bytes, bytes]:
        """(sealed bytes, payload) of the object called name."""
        sealed = read_object(self.store / name, limit)
        payload = open_envelope(sealed, self.header, kind, binding)
        self.opened[name] = struct.unpack(">H", sealed[6:8])[0]
        return sealed, payload

    def metadata(self, prefix: str, gen: int, kind: int) -> tuple[bytes, bytes]:
        binding = struct.pack(">Q", gen)
        return self._open(f"{prefix}/{gen_name(gen)}", MAX_METADATA + 36, kind, binding)

    def chunk(self, chunk_id: bytes, *, base: bool = False) -> bytes:
        """A chunk's plaintext; a difference is read with its base (section 8), which
        must itself be whole (base: this chunk is one)."""
        name = chunk_id.hex()
        cached = self._chunks.get(chunk_id)
        if cached is None:
            sealed, payload = self._open(f"c/{name[:2]}/{name}", MAX_CHUNK + 36, CHUNK, chunk_id)
            cached = (payload, bool(sealed[5] & DELTA))
        plain, difference = cached
        if base and difference:  # checked before its own base is read: no chains
            raise FormatError(f"chunk {name}, a base, is itself a difference")
        if chunk_id not in self._chunks:
            if difference:
                if len(plain) < 32:
                    raise FormatError(f"difference {name} too short for its base id")
                plain = _decompress(plain[32:], MAX_CHUNK, self.chunk(plain[:32], base=True))
            self._chunks[chunk_id] = (plain, difference)
        return plain

    def state(self) -> tuple[State, int | None, list[int]]:
        """Newest snapshot (if any), then every later segment, chained and applied."""
        state, snapshot = State(), None
        for _attempt in range(3):
            snaps = _generations(self.store / "s")
            if not snaps:
                break
            try:
                _, payload = self.metadata("s", snaps[-1], SNAPSHOT)
            except FileNotFoundError:
                continue  # deleted by a writer after two newer ones: list again
            state, snapshot = load_snapshot(payload, snaps[-1]), snaps[-1]
            break
        else:
            raise IntegrityError("the newest snapshot kept disappearing")
        segments = [g for g in _generations(self.store / "l") if g > state.generation]
        expected = list(range(state.generation + 1, state.generation + 1 + len(segments)))
        if segments != expected:
            raise IntegrityError(f"log gap after generation {state.generation}: {segments}")
        prev_sealed: bytes | None = None
        for gen in segments:
            sealed, payload = self.metadata("l", gen, SEGMENT)
            seg = _payload_map(
                payload, [("gen", int), ("prev", bytes), ("time", int), ("ops", list)], "segment"
            )
            if seg["gen"] != gen:
                raise FormatError(f"l/{gen_name(gen)} holds generation {seg['gen']}")
            prev = _bin(seg["prev"], "prev", 32)
            if prev != state.head:
                if prev_sealed is not None and prev == hashlib.sha256(prev_sealed).digest():
                    raise UnsupportedVersionError("log chained by sealed bytes (older build)")
                raise IntegrityError(f"l/{gen_name(gen)}: prev does not chain (rollback/fork)")
            for op in seg["ops"]:
                state.apply(op)
            state.generation, state.head, prev_sealed = (
                gen,
                hashlib.sha256(payload).digest(),
                sealed,
            )
        return state, snapshot, segments

    def file_bytes(self, node: Inode) -> bytes:
        out = bytearray(node.size)
        for start, length, cid, off in node.extents or []:
            if start + length > node.size:
                raise FormatError("extent past the file's size")
            plain = self.chunk(cid)
            if off + length > len(plain):
                raise FormatError(f"extent past the end of chunk {cid.hex()}")
            out[start : start + length] = plain[off : off + length]
        return bytes(out)

    def tree(self, state: State) -> dict[str, Node]:
        """Every path reachable from the root (inode 1), depth first."""
        out: dict[str, Node] = {}
        root = state.directory(1)
        stack: list[tuple[str, Inode]] = [("/", root)]
        seen_dirs = {1}
        while stack:
            path, node = stack.pop()
            out[path] = Node(
                node.ino, node.mode, node.uid, node.gid, node.nlink, node.size,
                node.atime_ns, node.mtime_ns, node.ctime_ns, node.rdev, node.target,
                dict(node.xattrs), self.file_bytes(node) if node.is_reg else None,
            )  # fmt: skip
            for name, ino in sorted((node.entries or {}).items()):
                if not name or b"/" in name or name in (b".", b".."):
                    raise FormatError(f"bad entry name {name!r}")
                child = state.inode(ino)
                if child.is_dir:
                    if ino in seen_dirs:
                        raise FormatError("a directory linked twice")
                    seen_dirs.add(ino)
                stack.append((path.rstrip("/") + "/" + os.fsdecode(name), child))
        return out


def read_volume(
    store: Path | str, *, passphrase: bytes | str | None = None, recovery_key: str | None = None
) -> Volume:
    """The tree of the volume in a local store. passphrase is the content of a
    passphrase file (one final line end is dropped); recovery_key its text form."""
    store = Path(store)
    data = read_object(store / "sealfs.vol", MAX_HEADER_BODY + 46)
    header = read_header(
        data,
        passphrase=None if passphrase is None else passphrase_bytes(passphrase, from_file=True),
        recovery_key=None if recovery_key is None else parse_recovery_key(recovery_key),
    )
    reader = Reader(store, header)
    state, snapshot, segments = reader.state()
    tree = reader.tree(state)
    return Volume(
        header.volume_id, header.data_epoch, header.retired_epoch, state.generation,
        snapshot, segments, tree, reader.opened,
    )  # fmt: skip
