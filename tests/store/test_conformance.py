"""One behaviour for every ObjectStore: run over each backend in STORE_FACTORIES."""

from __future__ import annotations

import threading

import pytest

from sealfs.errors import (
    ConfigError,
    FormatError,
    ObjectExistsError,
    ObjectNotFoundError,
    PreconditionFailedError,
)
from sealfs.store.base import ObjectStore

INVALID_NAMES = [
    "",
    "../x",
    "c/../x",
    "/abs",
    "C/UPPER",
    "with space",
    "c/with space",
    "c//x",
    "c/",
    ".hidden",
    ".tmp-123",
    "c/ab/.tmp-x",
    "x" * 201,
]


def test_put_get_round_trip(store: ObjectStore) -> None:
    store.put("c/ab/abcdef", b"sealed bytes")
    assert store.get("c/ab/abcdef") == b"sealed bytes"


def test_put_overwrites(store: ObjectStore) -> None:
    store.put("sealfs.vol", b"one")
    store.put("sealfs.vol", b"two, longer")
    assert store.get("sealfs.vol") == b"two, longer"
    assert store.stat("sealfs.vol").size == len(b"two, longer")


def test_missing_get_and_stat_raise_not_found(store: ObjectStore) -> None:
    with pytest.raises(ObjectNotFoundError):
        store.get("c/ab/missing")
    with pytest.raises(ObjectNotFoundError):
        store.stat("l/00000001")


def test_stat_gives_size_and_stable_etag(store: ObjectStore) -> None:
    store.put("s/00000001", b"snapshot")
    info = store.stat("s/00000001")
    assert (info.name, info.size) == ("s/00000001", 8)
    assert info.etag == store.stat("s/00000001").etag
    store.put("s/00000001", b"other")
    assert store.stat("s/00000001").etag != info.etag


def test_empty_object(store: ObjectStore) -> None:
    store.put("c/00/empty", b"")
    assert store.get("c/00/empty") == b""
    assert store.stat("c/00/empty").size == 0
    assert store.list("c/") == ["c/00/empty"]


def test_five_mib_object(store: ObjectStore) -> None:
    data = bytes(range(256)) * (5 * 4096)
    store.put_if_absent("c/ff/big", data)
    assert store.get("c/ff/big") == data
    assert store.stat("c/ff/big").size == 5 << 20


def test_put_if_absent_creates_once(store: ObjectStore) -> None:
    store.put_if_absent("l/00000001", b"first")
    with pytest.raises(ObjectExistsError):
        store.put_if_absent("l/00000001", b"second")
    assert store.get("l/00000001") == b"first"


def test_put_without_replace_creates_but_never_replaces(store: ObjectStore) -> None:
    store.put("c/ab/chunk", b"first", replace=False)
    with pytest.raises(ObjectExistsError):
        store.put("c/ab/chunk", b"other", replace=False)
    assert store.get("c/ab/chunk") == b"first"
    assert store.list("c/") == ["c/ab/chunk"]  # no temp file or second object beside it
    store.put("c/ab/chunk", b"replaced")
    assert store.get("c/ab/chunk") == b"replaced"


def race_put_if_absent(store: ObjectStore, name: str) -> dict[int, str]:
    """Two threads put_if_absent name at once; return who won and who lost."""
    barrier = threading.Barrier(2)
    outcome: dict[int, str] = {}

    def race(who: int) -> None:
        barrier.wait()
        try:
            store.put_if_absent(name, f"writer {who}".encode())
            outcome[who] = "won"
        except ObjectExistsError:
            outcome[who] = "lost"

    threads = [threading.Thread(target=race, args=(who,)) for who in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcome


def test_put_if_absent_race_has_exactly_one_winner(store: ObjectStore) -> None:
    for round_ in range(20):
        name = f"l/{round_:08d}"
        outcome = race_put_if_absent(store, name)
        assert sorted(outcome.values()) == ["lost", "won"], outcome
        winner = next(who for who, result in outcome.items() if result == "won")
        assert store.get(name) == f"writer {winner}".encode()


def test_put_if_match_replaces_when_etag_matches(store: ObjectStore) -> None:
    store.put("sealfs.vol", b"header v1")
    etag = store.stat("sealfs.vol").etag
    store.put_if_match("sealfs.vol", b"header v2", etag)
    assert store.get("sealfs.vol") == b"header v2"


def test_put_if_match_with_stale_etag_fails(store: ObjectStore) -> None:
    store.put("sealfs.vol", b"header v1")
    stale = store.stat("sealfs.vol").etag
    store.put_if_match("sealfs.vol", b"header v2", stale)
    with pytest.raises(PreconditionFailedError):
        store.put_if_match("sealfs.vol", b"header v3", stale)
    assert store.get("sealfs.vol") == b"header v2"


def test_put_if_match_on_missing_object_raises_not_found(store: ObjectStore) -> None:
    with pytest.raises(ObjectNotFoundError):
        store.put_if_match("sealfs.vol", b"header", "0" * 64)


def test_delete_is_idempotent(store: ObjectStore) -> None:
    store.put("c/ab/x", b"x")
    store.delete("c/ab/x")
    store.delete("c/ab/x")
    store.delete("c/cd/never-existed")
    with pytest.raises(ObjectNotFoundError):
        store.get("c/ab/x")
    assert store.list("c/") == []


def test_list_with_prefix_and_start_after(store: ObjectStore) -> None:
    names = ["c/ab/1", "c/ab/2", "c/cd/1", "l/00000001", "l/00000002", "l/00000010", "sealfs.vol"]
    for name in reversed(names):
        store.put(name, name.encode())
    assert store.list("") == names
    assert store.list("c/") == names[:3]
    assert store.list("c/ab/") == ["c/ab/1", "c/ab/2"]
    assert store.list("c/a") == ["c/ab/1", "c/ab/2"]
    assert store.list("l/") == ["l/00000001", "l/00000002", "l/00000010"]
    assert store.list("l/", start_after="l/00000001") == ["l/00000002", "l/00000010"]
    assert store.list("l/0000001") == ["l/00000010"]
    assert store.list("c/", start_after="c/ab/2") == ["c/cd/1"]
    assert store.list("c/", start_after="c/ab") == names[:3]
    assert store.list("", start_after="l/00000010") == ["sealfs.vol"]
    assert store.list("s/") == []
    assert store.list("x/y/") == []
    assert store.list("sealfs") == ["sealfs.vol"]


@pytest.mark.parametrize("name", INVALID_NAMES)
def test_invalid_names_are_rejected(store: ObjectStore, name: str) -> None:
    with pytest.raises(ConfigError):
        store.put(name, b"x")
    with pytest.raises(ConfigError):
        store.put_if_absent(name, b"x")
    with pytest.raises(ConfigError):
        store.get(name)
    with pytest.raises(ConfigError):
        store.stat(name)
    with pytest.raises(ConfigError):
        store.delete(name)
    with pytest.raises(ConfigError):
        store.put_if_match(name, b"x", "0")


@pytest.mark.parametrize("prefix", ["../", "/c", "C/", "a b", "c//"])
def test_invalid_prefixes_are_rejected(store: ObjectStore, prefix: str) -> None:
    with pytest.raises(ConfigError):
        store.list(prefix)


def test_sync_and_describe(store: ObjectStore) -> None:
    store.sync()  # on an empty store, too
    store.put("c/ab/x", b"x")
    store.sync()
    description = store.describe()
    assert description
    assert "\n" not in description


def test_get_refuses_an_object_larger_than_its_kind_can_be(store: ObjectStore) -> None:
    # A reader names the most an object of its kind holds (a sealed chunk: 4 MiB and
    # its envelope), so that junk appended in the store is never read into memory.
    store.put("c/00/x", b"12345")
    assert store.get("c/00/x", 5) == b"12345"
    with pytest.raises(FormatError, match=r"c/00/x .* 5 bytes, more than the 4"):
        store.get("c/00/x", 4)
    assert store.get("c/00/x") == b"12345"  # no bound given: any size
