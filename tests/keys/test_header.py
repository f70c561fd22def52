"""sealfs.vol encoding: golden bytes, MAC, and hostile input that only raises FormatError."""

from __future__ import annotations

import contextlib
import struct
from typing import Any

import msgpack
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from sealfs.errors import FormatError, IntegrityError, UnsupportedVersionError
from sealfs.keys.header import (
    FORMAT_VERSION,
    MAGIC,
    Keyslot,
    VolumeHeader,
    decode_header,
    encode_header,
    pack_canonical,
    verify_header_mac,
)

MAC_KEY = bytes(32)
HEADER = VolumeHeader(
    format_version=1,
    volume_id=bytes(16),
    created_ns=5,
    slots=(Keyslot(7, "recovery", {}, bytes(12), bytes(48)),),
    data_epoch=2,
)
GOLDEN = bytes.fromhex(
    "5345414c465300000001000000a984aa637265617465645f6e7305aa646174615f65706f636802a5"
    "736c6f74739185a2696407a46b696e64a87265636f76657279a56e6f6e6365c40c00000000000000"
    "0000000000a6706172616d7380ab777261707065645f6b6579c43000000000000000000000000000"
    "0000000000000000000000000000000000000000000000000000000000000000000000a9766f6c75"
    "6d655f6964c41000000000000000000000000000000000f9429631fbe71d5a6f4246efd2e2a5b238"
    "e01b92f7cc718b64fc549b87dcebec"
)


def _raw_header(body: bytes, version: int = FORMAT_VERSION, mac: bytes = bytes(32)) -> bytes:
    return MAGIC + struct.pack(">HI", version, len(body)) + body + mac


def _body(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "volume_id": bytes(16),
        "created_ns": 5,
        "data_epoch": 2,
        "slots": [
            {"id": 7, "kind": "recovery", "params": {}, "nonce": bytes(12), "wrapped_key": b"k"}
        ],
    }
    body.update(overrides)
    return body


def test_golden_encoding() -> None:
    assert encode_header(HEADER, MAC_KEY) == GOLDEN
    assert decode_header(GOLDEN) == HEADER
    verify_header_mac(GOLDEN, MAC_KEY)


def test_golden_layout() -> None:
    assert GOLDEN[:8] == b"SEALFS\x00\x00"
    version, body_len = struct.unpack(">HI", GOLDEN[8:14])
    assert (version, body_len, len(GOLDEN)) == (1, 169, 14 + 169 + 32)
    body = msgpack.unpackb(GOLDEN[14:-32])
    assert sorted(body) == ["created_ns", "data_epoch", "slots", "volume_id"]


def test_round_trip_with_params() -> None:
    slot = Keyslot(3, "aws-kms", {"key": "arn:x", "ctx": {"b": [1, b"2", None, True]}}, b"", b"w")
    header = VolumeHeader(1, bytes(range(16)), 10**18, (slot, *HEADER.slots), 65535)
    data = encode_header(header, MAC_KEY)
    assert decode_header(data) == header
    # Maps are packed with sorted keys: equal headers give equal bytes.
    assert pack_canonical({"b": 1, "a": 2}) == pack_canonical({"a": 2, "b": 1})


def test_mac_detects_every_flipped_byte() -> None:
    for position in range(len(GOLDEN)):
        tampered = bytearray(GOLDEN)
        tampered[position] ^= 0x01
        with pytest.raises((FormatError, IntegrityError)):
            decode_header(bytes(tampered))
            verify_header_mac(bytes(tampered), MAC_KEY)


def test_mac_wrong_key_message() -> None:
    with pytest.raises(IntegrityError, match=r"MAC mismatch\): restore sealfs.vol"):
        verify_header_mac(GOLDEN, bytes([1]) * 32)


def test_unsupported_version() -> None:
    with pytest.raises(UnsupportedVersionError, match="version 2"):
        decode_header(_raw_header(pack_canonical(_body()), version=2))


@pytest.mark.parametrize(
    "body",
    [
        _body(volume_id=bytes(15)),
        _body(volume_id="x" * 16),
        _body(created_ns=-1),
        _body(created_ns=True),
        _body(data_epoch=1 << 16),
        _body(slots=[]),
        _body(slots={}),
        _body(extra=1),
        {k: v for k, v in _body().items() if k != "slots"},
        _body(slots=[_body()["slots"][0]] * 2),  # duplicate slot id
        _body(slots=[{**_body()["slots"][0], "id": 1 << 32}]),
        _body(slots=[{**_body()["slots"][0], "kind": "Bad Kind"}]),
        _body(slots=[{**_body()["slots"][0], "kind": ""}]),
        _body(slots=[{**_body()["slots"][0], "params": []}]),
        _body(slots=[{**_body()["slots"][0], "params": {"f": 1.5}}]),
        _body(slots=[{**_body()["slots"][0], "params": {"n": {b"k": 1}}}]),
        _body(slots=[{**_body()["slots"][0], "params": {"d": [[[[[[1]]]]]]}}]),
        _body(slots=[{**_body()["slots"][0], "nonce": "x"}]),
        _body(slots=[{**_body()["slots"][0], "wrapped_key": b""}]),
        _body(slots=[{**_body()["slots"][0], "extra": 1}]),
        [1, 2, 3],
    ],
)
def test_malformed_bodies(body: Any) -> None:
    with pytest.raises(FormatError):
        decode_header(_raw_header(pack_canonical(body)))


@pytest.mark.parametrize(
    "data",
    [
        b"",
        GOLDEN[:45],
        GOLDEN[:-1],
        GOLDEN + b"\x00",
        b"NOTSEAL\x00" + GOLDEN[8:],
        _raw_header(b"\xc1"),  # never-used msgpack byte
        _raw_header(b"\x81\xa1"),  # truncated
        _raw_header(pack_canonical(_body()) + b"\x00"),  # trailing data
        _raw_header(b"\xd6\xff\x00\x00\x00\x00"),  # msgpack timestamp ext
        _raw_header(b"\x81\xa1a\xa2\xff\xfe"),  # invalid utf-8 string
        _raw_header(b"\x81\x01\x02"),  # int map key
        MAGIC + struct.pack(">HI", 1, 0xFFFFFFFF) + bytes(64),
    ],
)
def test_malformed_bytes(data: bytes) -> None:
    with pytest.raises(FormatError):
        decode_header(data)


@given(data=st.binary(max_size=512))
def test_arbitrary_bytes_only_raise_format_error(data: bytes) -> None:
    with pytest.raises(FormatError):
        decode_header(data)


@given(data=st.binary(max_size=512))
def test_arbitrary_body_only_raises_format_error(data: bytes) -> None:
    with contextlib.suppress(FormatError):
        decode_header(_raw_header(data))


_int64 = st.integers(-(1 << 63), (1 << 64) - 1)
_leaf = st.none() | st.booleans() | _int64 | st.binary(max_size=20) | st.text(max_size=10)
_values = st.recursive(
    _leaf | st.floats(),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=12,
)


_params = st.dictionaries(
    st.text(max_size=5),
    st.recursive(
        _leaf,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
        max_leaves=6,
    ),
    max_size=4,
)
_valid_slot = st.fixed_dictionaries(
    {
        "id": st.integers(0, (1 << 32) - 1),
        "kind": st.from_regex(r"[a-z0-9][a-z0-9-]{0,31}", fullmatch=True),
        "params": _params,
        "nonce": st.binary(max_size=64),
        "wrapped_key": st.binary(min_size=1, max_size=80),
    }
)
_valid_body = st.fixed_dictionaries(
    {
        "volume_id": st.binary(min_size=16, max_size=16),
        "created_ns": st.integers(0, (1 << 63) - 1),
        "data_epoch": st.integers(0, 0xFFFF),
        "slots": st.lists(_valid_slot, min_size=1, max_size=3, unique_by=lambda s: s["id"]),
    }
)
_FIELDS = ["volume_id", "created_ns", "data_epoch", "slots"]
_SLOT_FIELDS = ["id", "kind", "params", "nonce", "wrapped_key"]
_wild = _values | st.integers(-2, 2) | st.integers((1 << 16) - 2, (1 << 16) + 2) | st.binary()


@given(
    body=_valid_body,
    corruption=st.none() | st.tuples(st.sampled_from(_FIELDS + _SLOT_FIELDS), _wild),
)
def test_structured_bodies_decode_or_raise_format_error(
    body: dict[str, Any], corruption: tuple[str, Any] | None
) -> None:
    if corruption is not None:
        name, value = corruption
        (body if name in _FIELDS else body["slots"][0])[name] = value
    data = _raw_header(msgpack.packb(body, use_bin_type=True))
    try:
        header = decode_header(data)
    except FormatError:
        event("refused")
        return
    event("decoded")
    # Whatever decodes must re-encode (no value that encode would refuse).
    encode_header(header, MAC_KEY)


def test_encode_refuses_what_decode_would_refuse() -> None:
    with pytest.raises(ValueError, match="volume id"):
        encode_header(VolumeHeader(1, bytes(3), 0, HEADER.slots), MAC_KEY)
    with pytest.raises(ValueError, match="version"):
        encode_header(VolumeHeader(2, bytes(16), 0, HEADER.slots), MAC_KEY)
