"""English for messages, as every layer words them: counts and articles.

Its own module, below the layers: the store's retry messages and the committer's log
each spelled their own plural ("after 1 attempts"), which the CLI's counted() already
got right.
"""

from __future__ import annotations


def counted(n: int, word: str) -> str:
    """n and word, with an s unless n is 1: "1 chunks" and "1 passes" read as slips."""
    if n == 1:
        return f"1 {word}"
    return f"{n} {word}es" if word.endswith("s") else f"{n} {word}s"


def with_article(noun: str) -> str:
    """noun after "a" or "an", as it is spoken for the words a mount table holds
    ("an ext4", "a fuse.gocryptfs"): "is a ext4 mount" read as a slip."""
    return f"an {noun}" if noun[:1].lower() in ("a", "e", "i", "o") else f"a {noun}"
