"""A session of SoftHSM2 tokens for pkcs11 keyslot tests (skipped where SoftHSM2 is missing).

Debian: apt-get install softhsm2; PyPI: python-pkcs11.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from sealfs.keys.hsm import Pin, TokenKey, create_token_key
from tests.mounts import write_secret
from tests.prereq import require, require_module

SOFTHSM_MODULE_PATHS = (
    "/usr/lib/softhsm/libsofthsm2.so",
    "/usr/lib/x86_64-linux-gnu/softhsm/libsofthsm2.so",
    "/usr/lib/aarch64-linux-gnu/softhsm/libsofthsm2.so",
)
TOKEN = "sealfs-a"
OTHER_TOKEN = "sealfs-b"
PIN_TOKEN = "sealfs-pin"  # for wrong-PIN tests, so the main token's PIN is never tried wrong
USER_PIN = "4711-user"
SO_PIN = "0815-so"


@dataclass(frozen=True)
class SoftHsm:
    module: str
    conf: Path
    pin_file: Path
    token: str = TOKEN
    other_token: str = OTHER_TOKEN
    pin_token: str = PIN_TOKEN

    def pin(self) -> Pin:
        return Pin(USER_PIN.encode())

    def new_key(self, token: str = TOKEN) -> TokenKey:
        """A fresh AES key on the token, with a unique label."""
        where = TokenKey(self.module, token, f"k-{uuid.uuid4().hex[:12]}")
        create_token_key(where, self.pin())
        return where


_MADE: dict[str, SoftHsm] = {}


@pytest.fixture(scope="session")
def softhsm(tmp_path_factory: pytest.TempPathFactory) -> SoftHsm:
    """Three initialised SoftHSM2 tokens in a private directory (SOFTHSM2_CONF is set for
    the whole session: SoftHSM reads it once, when the library is first loaded)."""
    if "made" in _MADE:  # imported into two test packages: pytest may ask twice
        return _MADE["made"]
    require_module("pkcs11", "python-pkcs11 is not installed")
    module = next((m for m in SOFTHSM_MODULE_PATHS if os.path.exists(m)), None)
    require(
        module is not None and shutil.which("softhsm2-util") is not None,
        "SoftHSM2 is not installed (apt-get install softhsm2)",
    )
    root = tmp_path_factory.mktemp("softhsm")
    (root / "tokens").mkdir()
    conf = root / "softhsm2.conf"
    conf.write_text(
        f"directories.tokendir = {root / 'tokens'}\nobjectstore.backend = file\nlog.level = ERROR\n"
    )
    os.environ["SOFTHSM2_CONF"] = str(conf)
    for label in (TOKEN, OTHER_TOKEN, PIN_TOKEN):
        subprocess.run(
            ["softhsm2-util", "--init-token", "--free", "--label", label,
             "--pin", USER_PIN, "--so-pin", SO_PIN],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
    pin_file = root / "pin"
    write_secret(pin_file, USER_PIN + "\n")
    _MADE["made"] = SoftHsm(module, conf, pin_file)
    return _MADE["made"]
