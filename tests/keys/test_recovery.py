"""Recovery key text form: round trip, tolerance, typo detection."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sealfs.errors import FormatError
from sealfs.keys.recovery import (
    FORMAT_HINT,
    RecoveryKeyFormatError,
    format_recovery_key,
    generate_recovery_key,
    parse_recovery_key,
)

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
        f"\ufeff{GOLDEN_TEXT}\r\n",  # a file saved with a byte order mark
        GOLDEN_TEXT.replace("-", " - ").replace("ucq2", "UcQ2"),
    ],
)
def test_tolerant_parsing(text: str) -> None:
    assert parse_recovery_key(text) == KEY


def test_typo_is_detected() -> None:
    typo = GOLDEN_TEXT.replace("fi5e", "fi5f")
    with pytest.raises(RecoveryKeyFormatError, match=r"recovery key has a typo \(its checksum"):
        parse_recovery_key(typo)


def test_transposition_is_detected() -> None:
    with pytest.raises(FormatError, match="checksum"):
        parse_recovery_key(GOLDEN_TEXT.replace("ucq2", "uc2q"))


@pytest.mark.parametrize(
    "text",
    [
        GOLDEN_TEXT.replace("ucq2", "ucq1"),
        GOLDEN_TEXT.replace("ucq2", "ucq0"),
        GOLDEN_TEXT[:-1],
        GOLDEN_TEXT + "a",
        "",
        "correct horse battery staple",  # a passphrase given as the recovery key
    ],
)
def test_bad_text_is_named_without_quoting_it(text: str) -> None:
    """Regression: the message quoted the bad character and gave the text's length."""
    with pytest.raises(RecoveryKeyFormatError) as caught:
        parse_recovery_key(text)
    message = str(caught.value)
    assert message == f"recovery key is not in the recovery key format ({FORMAT_HINT})"
    assert caught.value.problem == message.removeprefix("recovery key ")
    assert "'" not in message  # no character of the text is quoted


def test_generate() -> None:
    assert len(generate_recovery_key()) == 32
    assert generate_recovery_key() != generate_recovery_key()
