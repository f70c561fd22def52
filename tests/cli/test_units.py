"""Sizes as the CLI reads and prints them."""

from __future__ import annotations

import pytest

from sealfs.cli.units import format_size, parse_size, seconds
from sealfs.errors import ConfigError


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (5 << 30, "5.0 GiB"),
        (3 << 50, "3.0 PiB"),
        # The largest file FUSE allows: `sealfs status` printed "8388608.0 TiB".
        ((1 << 63) - 1, "8.0 EiB"),
        (1 << 70, "1024.0 EiB"),
    ],
)
def test_sizes_are_printed_in_the_largest_unit_that_fits(n: int, text: str) -> None:
    assert format_size(n) == text


@pytest.mark.parametrize(
    ("text", "n"), [("1048576", 1 << 20), ("512M", 512 << 20), ("2g", 2 << 30), ("1.5KiB", 1536)]
)
def test_sizes_are_read_in_binary_units(text: str, n: int) -> None:
    assert parse_size(text) == n


def test_a_size_that_is_not_one_names_the_units() -> None:
    with pytest.raises(ConfigError, match="use a number with an optional K, M, G or T"):
        parse_size("lots")


@pytest.mark.parametrize(
    ("value", "shown"), [(0.0, "0"), (-1.0, "-1"), (float("nan"), "nan"), (1e-9, "1e-09")]
)
def test_seconds_refused_are_shown_as_typed(value: float, shown: str) -> None:
    """Regression: --commit-interval 0 was refused as "not 0.0"."""
    with pytest.raises(ConfigError, match=f"not {shown}$"):
        seconds(value, "--commit-interval", minimum=0.01)


def test_seconds_at_the_minimum_are_taken() -> None:
    assert seconds(0.01, "--commit-interval", minimum=0.01) == 0.01
    assert seconds(0.0, "--timeout", zero=True) == 0.0
