"""Deterministic test data: random bytes and realistic JSON agent checkpoints.

A checkpoint is one JSON document whose records (agent memory entries: text,
tags, numbers, a short embedding) sit one per line, the way `json.dump` with
a small indent or a JSONL-ish writer lays out an agent's memory. Everything
derives from a seed, so two runs write the same bytes, and the dedup variants
are built by editing the list of record lines.
"""

from __future__ import annotations

import json
import random
import struct
from dataclasses import dataclass
from pathlib import Path

GENERATOR_VERSION = 1

_ONSETS = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v",
           "w", "br", "ch", "cl", "dr", "fr", "gr", "pl", "pr", "sh", "sp", "st", "th",
           "tr"]  # fmt: skip
_NUCLEI = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "ou", "io", "y"]
_CODAS = ["", "", "", "n", "r", "s", "t", "l", "nd", "st", "ng", "ck", "rt", "m", "x"]
_KINDS = ["observation", "reflection", "plan", "tool_result", "user_message", "summary"]
_TOOLS = ["web_search", "python", "shell", "read_file", "write_file", "browser", "sql", "none"]


def _vocabulary(rng: random.Random, size: int = 20000) -> tuple[list[str], list[float]]:
    """Pseudo-English words with Zipf weights (text compresses about as English does)."""
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < size:
        n = rng.choice((1, 1, 2, 2, 2, 3, 3, 4))
        word = "".join(rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS)
                       for _ in range(n))  # fmt: skip
        if word not in seen:
            seen.add(word)
            words.append(word)
    cum: list[float] = []
    total = 0.0
    for rank in range(1, size + 1):
        total += 1.0 / rank
        cum.append(total)
    return words, cum


class RecordMaker:
    """Makes memory records; record(i, rev) is a pure function of (seed, i, rev).

    Text is a slice of a long pool of words drawn once from the vocabulary,
    so making a record costs a few random numbers, not one per word.
    """

    POOL_WORDS = 1 << 22

    def __init__(self, seed: int) -> None:
        self.seed = seed
        rng = random.Random(seed)
        words, cum = _vocabulary(rng)
        self.tags = words[:400:7]
        pool = rng.choices(words, cum_weights=cum, k=self.POOL_WORDS)
        for k in range(0, len(pool), 11):
            j = k + rng.randrange(11)
            if j < len(pool):
                pool[j] += "."
                if j + 1 < len(pool):
                    pool[j + 1] = pool[j + 1].capitalize()
        self.pool = pool

    def _text(self, rng: random.Random, n: int) -> str:
        at = rng.randrange(len(self.pool) - n)
        text = " ".join(self.pool[at : at + n])
        return text[0].upper() + text[1:] + "."

    def record(self, i: int, rev: int = 0) -> bytes:
        """One record as compact JSON (formatted by hand: json.dumps of floats is slow)."""
        rng = random.Random((self.seed << 40) ^ (i << 8) ^ rev)
        bits = rng.getrandbits
        ts = 1_790_000_000 + i * 7 + rev * 86_400
        created = (
            f"2026-{1 + ts // 2_600_000 % 12:02d}-{1 + ts // 86_400 % 28:02d}T"
            f"{ts // 3600 % 24:02d}:{ts // 60 % 60:02d}:{ts % 60:02d}.{bits(10) % 1000:03d}Z"
        )
        embedding = ",".join(_FLOATS[v] for v in struct.unpack("24H", rng.randbytes(48)))
        tags = ",".join(f'"{t}"' for t in rng.sample(self.tags, 1 + bits(2)))
        text = json.dumps(self._text(rng, 40 + bits(8) % 150))
        return (
            f'{{"id":"mem-{i:09d}","uuid":"{bits(128):032x}","rev":{rev},'
            f'"kind":"{_KINDS[bits(8) % len(_KINDS)]}","created_at":"{created}",'
            f'"agent":"agent-{bits(4):02d}","session":"sess-{i // 500:06d}",'
            f'"importance":{bits(14) / 16384:.4f},"access_count":{bits(8) % 200},'
            f'"text":{text},"tags":[{tags}],"embedding":[{embedding}],'
            f'"source":{{"tool":"{_TOOLS[bits(3)]}","tokens":{20 + bits(12)},'
            f'"latency_ms":{bits(16) / 100:.1f},"ok":{"true" if bits(5) else "false"}}}}}'
        ).encode()


# 16-bit values as embedding components, roughly normal, pre-formatted.
_FLOATS = [f"{(((v >> 8) + (v & 255)) - 255) / 300:.4f}" for v in range(65536)]


@dataclass
class Checkpoint:
    """A checkpoint as a header, record lines and a footer; bytes() joins them."""

    header: bytes
    lines: list[bytes]
    footer: bytes = b"\n]}\n"

    def to_bytes(self) -> bytes:
        return self.header + b",\n".join(self.lines) + self.footer

    def copy(self) -> Checkpoint:
        return Checkpoint(self.header, list(self.lines), self.footer)


def header(step: int, notes: str = "") -> bytes:
    head = {"format": "agent-checkpoint/1", "agent": "agent-00", "step": step}
    if notes:
        head["notes"] = notes
    text = json.dumps(head, separators=(",", ":"))
    return text[:-1].encode() + b',"records":[\n'


def make_checkpoint(maker: RecordMaker, size: int, first: int = 0) -> Checkpoint:
    """Records first, first+1, ... until the document reaches size bytes."""
    ck = Checkpoint(header(step=1), [])
    total = len(ck.header) + len(ck.footer)
    i = first
    while total < size:
        line = maker.record(i)
        ck.lines.append(line)
        total += len(line) + 2
        i += 1
    return ck


def cached_checkpoint(cache_dir: Path, seed: int, size: int) -> Checkpoint:
    """make_checkpoint, kept on disk between runs (generating 1 GiB takes a while)."""
    path = cache_dir / f"ckpt-v{GENERATOR_VERSION}-s{seed}-{size}.json"
    if path.exists():
        raw = path.read_bytes()
        head, _, rest = raw.partition(b"\n")
        body = rest[: -len(b"\n]}\n")]
        return Checkpoint(head + b"\n", body.split(b",\n"))
    ck = make_checkpoint(RecordMaker(seed), size)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(ck.to_bytes())
    tmp.rename(path)
    return ck


def random_bytes(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


# -- the four rewrites of the dedup benchmark ------------------------------------------
# Each takes the step its header records: the benchmark gives every variant its own, so
# that no variant's first chunk is one an earlier variant already stored (with the same
# step, (ii) and (iv) began with the very chunk (i) had added, and (ii) was not charged
# for it).


def changed_in_region(
    maker: RecordMaker, ck: Checkpoint, fraction: float = 0.01, *, step: int
) -> Checkpoint:
    """(i) 1 % of the records, one contiguous run in the middle, get a new revision."""
    out = ck.copy()
    n = max(1, int(len(ck.lines) * fraction))
    start = len(ck.lines) // 2
    for i in range(start, start + n):
        out.lines[i] = maker.record(i, rev=1)
    out.header = header(step=step)
    return out


def appended(
    maker: RecordMaker, ck: Checkpoint, fraction: float = 0.01, *, step: int
) -> Checkpoint:
    """(ii) 1 % more records at the end."""
    out = ck.copy()
    n = max(1, int(len(ck.lines) * fraction))
    base = len(ck.lines)
    out.lines.extend(maker.record(base + k) for k in range(n))
    out.header = header(step=step)
    return out


def inserted_at_start(
    maker: RecordMaker, ck: Checkpoint, nbytes: int = 1000, *, step: int
) -> Checkpoint:
    """(iii) about 1 KB inserted at the start (a notes field in the header)."""
    out = ck.copy()
    rng = random.Random(maker.seed + 3)
    notes = maker._text(rng, 400)[: nbytes - 10]
    out.header = header(step=step, notes=notes)
    return out


def changed_scattered(
    maker: RecordMaker, ck: Checkpoint, fraction: float = 0.01, *, step: int
) -> Checkpoint:
    """(iv) 1 % of the records, chosen at random across the file, get a new revision."""
    out = ck.copy()
    n = max(1, int(len(ck.lines) * fraction))
    rng = random.Random(maker.seed + 4)
    for i in rng.sample(range(len(ck.lines)), n):
        out.lines[i] = maker.record(i, rev=1)
    out.header = header(step=step)
    return out
