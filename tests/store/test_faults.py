"""FaultyStore: rules fire when, where and as often as asked, reproducibly."""

from __future__ import annotations

import pytest

from sealfs.errors import NoSpaceError, StoreUnavailableError, TransientStoreError
from sealfs.store.faults import FaultRule, FaultyStore
from sealfs.store.memory import MemoryStore


def test_fail_next_fires_the_given_number_of_times_on_matching_calls() -> None:
    memory = MemoryStore()
    store = FaultyStore(memory)
    store.fail_next("put", "l/", "transient", times=2)
    store.put("c/ab/x", b"x")  # other prefix: untouched
    for _ in range(2):
        with pytest.raises(TransientStoreError):
            store.put("l/00000001", b"seg")
    store.put("l/00000001", b"seg")
    assert memory.get("l/00000001") == b"seg"
    assert store.injected == [("put", "l/00000001", "transient")] * 2


@pytest.mark.parametrize(
    ("fault", "error"), [("unavailable", StoreUnavailableError), ("nospace", NoSpaceError)]
)
def test_hard_faults(fault: str, error: type[Exception]) -> None:
    store = FaultyStore(MemoryStore())
    store.fail_next("*", "", fault)  # type: ignore[arg-type]
    with pytest.raises(error):
        store.list("")
    assert store.list("") == []


def test_transient_after_takes_effect_then_fails() -> None:
    memory = MemoryStore()
    store = FaultyStore(memory)
    store.fail_next("put_if_absent", "", "transient_after")
    with pytest.raises(TransientStoreError):
        store.put_if_absent("l/00000001", b"seg")
    assert memory.get("l/00000001") == b"seg"


def test_corrupt_flips_exactly_one_byte_of_get() -> None:
    memory = MemoryStore()
    memory.put("c/ab/x", bytes(64))
    store = FaultyStore(memory)
    store.fail_next("*", "c/", "corrupt")
    bad = store.get("c/ab/x")
    assert len(bad) == 64
    assert sum(b != 0 for b in bad) == 1
    assert store.get("c/ab/x") == bytes(64)
    assert store.stat("c/ab/x").size == 64  # "*" corrupt only touches get


def test_drop_loses_writes_silently() -> None:
    memory = MemoryStore()
    store = FaultyStore(memory)
    store.add_rule("put", "c/", "drop")
    store.put("c/ab/x", b"x")
    store.put("l/00000001", b"seg")
    assert memory.list("") == ["l/00000001"]


def test_probability_is_reproducible_with_a_seed() -> None:
    def run(seed: int) -> list[bool]:
        store = FaultyStore(
            MemoryStore(), [FaultRule("get", "", "transient", None, 0.3)], seed=seed
        )
        store.inner.put("c/ab/x", b"x")
        outcomes = []
        for _ in range(200):
            try:
                store.get("c/ab/x")
                outcomes.append(True)
            except TransientStoreError:
                outcomes.append(False)
        return outcomes

    first = run(1)
    assert first == run(1)
    assert first != run(2)
    assert 30 < first.count(False) < 90


def test_rules_are_checked() -> None:
    with pytest.raises(ValueError, match="unknown fault"):
        FaultRule("get", "", "explode")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="get only"):
        FaultRule("put", "", "corrupt")
    with pytest.raises(ValueError, match="writes only"):
        FaultRule("get", "", "drop")
    with pytest.raises(ValueError, match="sync only"):
        FaultRule("put", "", "flush_failed")
    with pytest.raises(ValueError, match="unknown store method"):
        FaultRule("fetch", "", "transient")
