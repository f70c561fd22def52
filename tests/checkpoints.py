"""Checkpoint-like data for tests: JSON lines, and versions of them with scattered edits."""

import random


def records(seed: int, count: int) -> list[bytes]:
    """JSON lines of a few random words each: text that compresses as checkpoints do."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(3000)]
    return [
        b'{"id": %d, "text": "%s"}\n' % (i, " ".join(rng.choices(words, k=12)).encode())
        for i in range(count)
    ]


def edited(lines: list[bytes], seed: int, share: float = 0.01) -> list[bytes]:
    """lines with a share of them, scattered, replaced by lines of another length."""
    rng = random.Random(seed)
    out = list(lines)
    for i in rng.sample(range(len(lines)), int(len(lines) * share)):
        out[i] = b'{"id": %d, "text": "revised %d"}\n' % (i, rng.randrange(10**9))
    return out
