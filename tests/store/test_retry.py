"""RetryingStore: what it retries, how long it waits, when it gives up. No real sleeping."""

from __future__ import annotations

import logging
import random

import pytest

from sealfs.errors import (
    NoSpaceError,
    ObjectExistsError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StoreUnavailableError,
)
from sealfs.store.faults import Fault, FaultyStore
from sealfs.store.memory import MemoryStore
from sealfs.store.retry import RetryingStore


class FakeClock:
    """A monotonic clock that only sleeping advances."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.now += seconds


def make(clock: FakeClock, **options: object) -> tuple[RetryingStore, FaultyStore, MemoryStore]:
    memory = MemoryStore()
    faulty = FaultyStore(memory)
    store = RetryingStore(
        faulty,
        sleep=clock.sleep,
        clock=clock,
        rng=random.Random(7),
        **options,  # type: ignore[arg-type]
    )
    return store, faulty, memory


def test_transient_then_success(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    store, faulty, memory = make(clock)
    memory.put("c/ab/x", b"secret payload")
    faulty.fail_next("get", "c/", "transient", times=2)
    with caplog.at_level(logging.DEBUG, logger="sealfs.store"):
        assert store.get("c/ab/x") == b"secret payload"
    assert memory.counts["get"] == 1  # the two failures never reached the store
    assert len(clock.sleeps) == 2
    retries = [r for r in caplog.records if "failed (attempt" in r.getMessage()]
    assert [r.levelno for r in retries] == [logging.WARNING, logging.DEBUG]  # seconds apart
    assert all("c/ab/x" in r.getMessage() for r in retries)
    assert all("secret payload" not in r.getMessage() for r in retries)


def test_a_request_that_keeps_failing_warns_once_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Regression: one warning per attempt, every second or two, for as long as the store
    was down: 45 lines in 88 s on the terminal of a command given a mistyped endpoint."""
    clock = FakeClock()
    store, faulty, _ = make(clock, attempts=1000, max_delay=2.0, deadline=100.0)
    faulty.fail_next("get", "", "transient", times=10_000)
    with (
        caplog.at_level(logging.WARNING, logger="sealfs.store"),
        pytest.raises(StoreUnavailableError),
    ):
        store.get("sealfs.vol")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(clock.sleeps) > 50
    assert 3 <= len(warnings) <= 4  # at 0 s, then about every 30 s of the 100


def test_gives_up_after_attempts_with_store_unavailable() -> None:
    clock = FakeClock()
    store, faulty, memory = make(clock, attempts=4)
    faulty.fail_next("put", "", "transient", times=100)
    with pytest.raises(StoreUnavailableError) as info:
        store.put("c/ab/x", b"x")
    message = str(info.value)
    assert message.startswith(
        "store memory store (with injected faults) unreachable after 4 attempts"
    )
    assert "injected transient fault: put c/ab/x" in message
    assert len(faulty.injected) == 4
    assert len(clock.sleeps) == 3
    assert memory.counts["put"] == 0


def test_one_attempt_is_said_in_the_singular() -> None:
    """Regression: "unreachable after 1 attempts" (a --store-timeout shorter than a try)."""
    store, faulty, _ = make(FakeClock(), attempts=1)
    faulty.fail_next("put", "", "transient", times=10)
    with pytest.raises(StoreUnavailableError, match="unreachable after 1 attempt over"):
        store.put("c/ab/x", b"x")


@pytest.mark.parametrize(
    ("method", "fault", "error"),
    [
        ("put_if_absent", None, ObjectExistsError),
        ("put_if_match", None, PreconditionFailedError),
        ("get", None, ObjectNotFoundError),
        ("put", "nospace", NoSpaceError),
        ("put", "unavailable", StoreUnavailableError),
    ],
)
def test_definite_answers_are_not_retried(
    method: str, fault: Fault | None, error: type[Exception]
) -> None:
    clock = FakeClock()
    store, faulty, memory = make(clock)
    memory.put("l/00000001", b"exists")
    memory.counts.clear()
    if fault is not None:
        faulty.fail_next(method, "", fault, times=5)
    with pytest.raises(error):
        if method == "put_if_absent":
            store.put_if_absent("l/00000001", b"mine")
        elif method == "put_if_match":
            store.put_if_match("l/00000001", b"mine", "stale")
        elif method == "get":
            store.get("c/ab/missing")
        else:
            store.put("c/ab/x", b"x")
    assert clock.sleeps == []
    assert sum(memory.counts.values()) + len(faulty.injected) == 1


def test_put_if_absent_own_write_after_transient_counts_as_success() -> None:
    clock = FakeClock()
    store, faulty, memory = make(clock)
    faulty.fail_next("put_if_absent", "l/", "transient_after")  # written, reply lost
    store.put_if_absent("l/00000007", b"segment 7")
    assert memory.get("l/00000007") == b"segment 7"
    assert memory.counts["put_if_absent"] == 2
    assert len(clock.sleeps) == 1


def test_put_if_absent_after_transient_still_loses_to_another_writer() -> None:
    clock = FakeClock()
    store, faulty, memory = make(clock)
    faulty.fail_next("put_if_absent", "l/", "transient")
    memory.put("l/00000007", b"the other writer")
    with pytest.raises(ObjectExistsError):
        store.put_if_absent("l/00000007", b"segment 7")
    assert memory.get("l/00000007") == b"the other writer"


def test_put_if_absent_without_transient_never_reads_back() -> None:
    clock = FakeClock()
    store, _faulty, memory = make(clock)
    memory.put("l/00000007", b"segment 7")
    with pytest.raises(ObjectExistsError):
        store.put_if_absent("l/00000007", b"segment 7")
    assert memory.counts["get"] == 0


def test_put_if_match_own_write_after_transient_counts_as_success() -> None:
    clock = FakeClock()
    store, faulty, memory = make(clock)
    memory.put("sealfs.vol", b"v1")
    etag = memory.stat("sealfs.vol").etag
    faulty.fail_next("put_if_match", "", "transient_after")
    store.put_if_match("sealfs.vol", b"v2", etag)
    assert memory.get("sealfs.vol") == b"v2"


def test_deadline_is_respected() -> None:
    clock = FakeClock()
    store, faulty, _memory = make(
        clock, attempts=1000, base_delay=1.0, max_delay=4.0, deadline=30.0
    )
    faulty.fail_next("list", "", "transient", times=10_000)
    with pytest.raises(StoreUnavailableError, match=r"over 30\.0 s"):
        store.list("l/")
    assert sum(clock.sleeps) == pytest.approx(30.0)
    assert len(faulty.injected) < 1000


def test_backoff_is_full_jitter_bounded_by_max_delay() -> None:
    clock = FakeClock()
    store, faulty, _memory = make(clock, attempts=40, base_delay=0.1, max_delay=2.0, deadline=None)
    faulty.fail_next("stat", "", "transient", times=39)
    with pytest.raises(ObjectNotFoundError):
        store.stat("c/ab/x")  # the 40th attempt reaches the store
    assert len(clock.sleeps) == 39
    for attempt, delay in enumerate(clock.sleeps, start=1):
        assert 0.0 <= delay <= min(2.0, 0.1 * 2 ** (attempt - 1))
    assert max(clock.sleeps) > 1.0  # it does grow towards max_delay
    assert len(set(clock.sleeps)) == len(clock.sleeps)  # jittered


def test_invalid_name_is_not_retried() -> None:
    clock = FakeClock()
    store, _faulty, _memory = make(clock)
    with pytest.raises(Exception, match="invalid object name"):
        store.get("../etc/passwd")
    assert clock.sleeps == []
