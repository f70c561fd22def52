"""The one place tests choose KDF cost: the minimum sealfs accepts, so unlocks stay fast."""

from __future__ import annotations

import pytest

from sealfs.keys.kdf import MIN_ITERATIONS, MIN_MEMORY_KIB, Argon2Params
from tests.keys.softhsm import softhsm

FAST_KDF = Argon2Params(
    memory_kib=MIN_MEMORY_KIB, iterations=MIN_ITERATIONS, lanes=1, salt=bytes(range(16))
)


@pytest.fixture
def fast_kdf() -> Argon2Params:
    """Cheapest accepted Argon2id parameters, with a fixed salt so vectors are stable."""
    return FAST_KDF


__all__ = ["softhsm"]  # the SoftHSM2 tokens fixture, shared with tests/cli
