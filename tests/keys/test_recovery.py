"""Recovery key text form: round trip, tolerance, typo detection."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sealfs.errors import FormatError
from sealfs.keys.recovery import format_recovery_key, generate_recovery_key, parse_recovery_key

KEY = bytes(range(0xA0, 0xC0))
GOLDEN_TEXT = "sfrk-ucq2-fi5e-uwtk-pkfj-vkv2-zlno-v6yl-dmvt-ws23-nn5y-xg5l-xpf5-x27q-b2i"


def test_golden_text() -> None:
    assert format_recovery_key(KEY) == GOLDEN_TEXT
    assert parse_recovery_key(GOLDEN_TEXT) == KEY


@given(key=st.binary(min_size=32, max_size=32))
def test_round_trip(key: bytes) -> None:
    text = format_recovery_key(key)
    assert text.startswith("sfrk-")
    assert parse_recovery_key(text) == key


@pytest.mark.parametrize(
    "text",
    [
        GOLDEN_TEXT.upper(),
        GOLDEN_TEXT.replace("-", " "),
        GOLDEN_TEXT.replace("-", ""),
        GOLDEN_TEXT[len("sfrk-") :],
        f"  {GOLDEN_TEXT}\n",
        GOLDEN_TEXT.replace("-", " - ").replace("ucq2", "UcQ2"),
    ],
)
def test_tolerant_parsing(text: str) -> None:
    assert parse_recovery_key(text) == KEY


def test_typo_is_detected() -> None:
    typo = GOLDEN_TEXT.replace("fi5e", "fi5f")
    with pytest.raises(FormatError, match="recovery key has a typo: checksum does not match"):
        parse_recovery_key(typo)


def test_transposition_is_detected() -> None:
    with pytest.raises(FormatError, match="checksum"):
        parse_recovery_key(GOLDEN_TEXT.replace("ucq2", "uc2q"))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (GOLDEN_TEXT.replace("ucq2", "ucq1"), "invalid character '1'"),
        (GOLDEN_TEXT.replace("ucq2", "ucq0"), "invalid character '0'"),
        (GOLDEN_TEXT[:-1], "54 characters, expected 55"),
        (GOLDEN_TEXT + "a", "56 characters"),
        ("", "0 characters"),
    ],
)
def test_bad_text(text: str, message: str) -> None:
    with pytest.raises(FormatError, match=message):
        parse_recovery_key(text)


def test_generate() -> None:
    assert len(generate_recovery_key()) == 32
    assert generate_recovery_key() != generate_recovery_key()
