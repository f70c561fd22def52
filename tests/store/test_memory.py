"""MemoryStore extras: request counting for tests of request economy."""

from __future__ import annotations

from sealfs.store.memory import MemoryStore


def test_counts_requests_per_method() -> None:
    store = MemoryStore()
    store.put("c/ab/x", b"x")
    store.get("c/ab/x")
    store.get("c/ab/x")
    store.list("c/")
    assert store.counts == {"put": 1, "get": 2, "list": 1}
