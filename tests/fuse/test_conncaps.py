"""The helper library that declines libfuse's default capabilities, in a real session."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sealfs.fuse import conncaps

# Mounts nothing a request reaches: init creates the session (and the kernel mount),
# which is all the library takes part in, then says whether it did and unmounts.
SESSION = """
import sys
if sys.argv[2] == "pyfuse3 first":
    import pyfuse3
from sealfs.errors import ConfigError
from sealfs.fuse import conncaps
import pyfuse3
conncaps.decline_for(read_only=False)
pyfuse3.init(pyfuse3.Operations(), sys.argv[1], set(pyfuse3.default_options))
try:
    conncaps.check_declined()
    print("declined")
except ConfigError as exc:
    print(exc)
finally:
    pyfuse3.close(unmount=True)
"""


@pytest.mark.parametrize(
    ("order", "said"),
    [
        ("sealfs.fuse first", "declined"),
        ("pyfuse3 first", "cannot decline FUSE capabilities: pyfuse3 did not create its session"),
    ],
)
def test_the_session_is_created_through_the_library_only_if_it_was_loaded_first(
    tmp_path: Path, order: str, said: str
) -> None:
    """Python binds pyfuse3's references to libfuse when it imports it: a library loaded
    later cannot take part, and a mount that would keep libfuse's defaults says so."""
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", SESSION, str(mountpoint), order],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(said), done.stdout
    assert str(mountpoint) not in Path("/proc/self/mounts").read_text()


def test_a_library_that_cannot_be_loaded_is_one_line_naming_the_rebuild(tmp_path: Path) -> None:
    """Regression: a helper library left from another build (an upgrade without a
    rebuild) failed every mount with the loader's "undefined symbol: ..." and no fix."""
    package = Path(conncaps.__file__).parent.parent
    copy = tmp_path / "sealfs"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (built,) = copy.glob("fuse/_conncaps*.so")
    built.write_bytes(b"not a shared library")
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "sealfs.cli.main", "mount", str(tmp_path / "store"),
         str(mountpoint)],
        capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)}, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    err = done.stderr.strip()
    assert done.returncode != 0 and "\n" not in err and "Traceback" not in err, err
    assert "sealfs's FUSE helper library cannot be loaded" in err, err
    assert "install it again with ./scripts/setup" in err, err
    assert str(mountpoint) not in Path("/proc/self/mounts").read_text()
