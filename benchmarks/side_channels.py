"""`python -m benchmarks.side_channels`: what the store learns from sizes and dedup.

Prints, for a volume on an in-memory store, the sizes of the objects each
commit adds, as anyone who can read the store (or its listing) sees them:

- a compression oracle: one file holding a secret and text an attacker
  chose (a page an agent fetched): the sealed chunk shrinks when the guess
  shares a prefix with the secret;
- sealed sizes of incompressible single-chunk files (exact: plaintext + 36);
- the log segment of one create, by the length of a random name;
- dedup: whether content the attacker gets written is already in the volume;
- chunk ids of the same file in two volumes made with the same passphrase.

docs/design.md ("What the store learns") quotes these figures.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from sealfs.keys.kdf import Argon2Params
from sealfs.keys.slots import Passphrase
from sealfs.store.memory import MemoryStore
from sealfs.volume.engine import Volume
from sealfs.volume.loader import check_writer, claim_writer, create_volume, open_volume
from sealfs.volume.options import VolumeOptions

PASSPHRASE = b"side channels"
ENVELOPE = 36  # header, nonce and tag of a sealed object (docs/format.md section 3)


def new_store() -> MemoryStore:
    store = MemoryStore()
    params = Argon2Params(memory_kib=65536, iterations=1, lanes=1, salt=os.urandom(16))
    create_volume(store, PASSPHRASE, params, os.urandom(32))
    return store


@asynccontextmanager
async def mounted(store: MemoryStore) -> AsyncIterator[Volume]:
    loaded = open_volume(store, Passphrase(PASSPHRASE))
    check_writer(loaded, takeover=False)
    claim_writer(loaded)
    volume = Volume(loaded, VolumeOptions())
    async with volume.running():
        yield volume


def sizes(store: MemoryStore) -> dict[str, int]:
    return {name: store.stat(name).size for name in store.list("")}


def added(store: MemoryStore, before: dict[str, int], prefix: str) -> list[int]:
    return sorted(
        n for name, n in sizes(store).items() if name not in before and name.startswith(prefix)
    )


async def commit_file(volume: Volume, name: bytes, data: bytes) -> None:
    fh, _ = await volume.create(1, name, 0o100644, os.O_WRONLY, 0, 0)
    await volume.write(fh, 0, data)
    await volume.release(fh)
    await volume.fsync()


async def compression_oracle() -> None:
    secret = "sk-" + secrets.token_hex(16)
    guesses = [
        ("none", "sk-" + secrets.token_hex(16)),
        ("half", secret[:19] + secrets.token_hex(8)),
        ("full", secret),
    ]
    store = new_store()
    async with mounted(store) as volume:
        for i, (match, guess) in enumerate(guesses):
            page = f"attacker page: {guess}"
            doc = json.dumps({"api_key": secret, "notes": ["lorem ipsum " * 80, page]}).encode()
            before = sizes(store)
            await commit_file(volume, f"checkpoint-{i}".encode(), doc)
            chunk = added(store, before, "c/")
            print(f"  guess sharing {match:4} of the secret: {len(doc)} B file -> chunk {chunk}")


async def exact_sizes() -> None:
    store = new_store()
    async with mounted(store) as volume:
        for n in (1000, 12345, 100000):
            before = sizes(store)
            await commit_file(volume, f"f{n}".encode(), os.urandom(n))
            print(f"  incompressible file of {n} B -> chunk {added(store, before, 'c/')}")
        for length in (1, 8, 50, 100, 255):
            before = sizes(store)
            await commit_file(volume, secrets.token_hex(length)[:length].encode(), b"")
            print(
                f"  empty file, random name of {length} B -> segment {added(store, before, 'l/')}"
            )


async def dedup() -> None:
    store = new_store()
    async with mounted(store) as volume:
        victim = os.urandom(700_000)
        await commit_file(volume, b"victim", victim)
        for label, data in (("the same content", victim), ("other content", os.urandom(700_000))):
            before = sizes(store)
            await commit_file(volume, label.encode(), data)
            print(f"  attacker's file with {label}: {len(added(store, before, 'c/'))} new chunks")


async def across_volumes() -> None:
    data, names = os.urandom(300_000), []
    for _ in range(2):
        store = new_store()
        async with mounted(store) as volume:
            await commit_file(volume, b"same", data)
        names.append({n for n in sizes(store) if n.startswith("c/")})
    print(
        f"  same file, two volumes, same passphrase: {len(names[0] & names[1])} shared chunk names"
    )


async def main() -> None:
    print("compression oracle (secret and attacker text in one file):")
    await compression_oracle()
    print(f"sizes (sealed = payload + {ENVELOPE} B):")
    await exact_sizes()
    print("dedup within a volume:")
    await dedup()
    print("dedup across volumes:")
    await across_volumes()


if __name__ == "__main__":
    trio.run(main)
