"""Prerequisites of tests: skipped on a developer's machine, a failure in CI.

scripts/setup installs everything the suite needs, so in CI (CI=true) a
missing tool is a broken set-up, and a skip there would count as a pass.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def require(ok: bool, reason: str) -> None:
    """Skip (or, in CI, fail) the calling test unless ok."""
    if ok:
        return
    if os.environ.get("CI"):
        pytest.fail(f"missing in CI: {reason} (scripts/setup should provide it)")
    pytest.skip(reason)


def require_module(name: str, reason: str) -> ModuleType:
    """Import name, or skip (fail in CI) with reason."""
    try:
        return importlib.import_module(name)
    except ImportError:
        require(False, reason)
        raise
