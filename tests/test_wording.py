"""Counts and articles in messages, as every layer words them."""

from __future__ import annotations

import pytest

from sealfs.wording import counted, with_article


@pytest.mark.parametrize(
    ("n", "word", "text"),
    [
        (1, "chunk", "1 chunk"),
        (0, "chunk", "0 chunks"),
        (2, "pass", "2 passes"),
        (1, "pass", "1 pass"),
    ],
)
def test_a_count_of_one_is_singular(n: int, word: str, text: str) -> None:
    assert counted(n, word) == text


@pytest.mark.parametrize(
    ("kind", "text"),
    [("ext4", "an ext4"), ("tmpfs", "a tmpfs"), ("fuse.gocryptfs", "a fuse.gocryptfs"),
     ("overlay", "an overlay")],
)  # fmt: skip
def test_a_mount_type_takes_the_article_it_is_read_with(kind: str, text: str) -> None:
    assert with_article(kind) == text
