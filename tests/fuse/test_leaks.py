"""Leak tests: names, contents, link targets, xattrs and secrets never reach the disk.

The threat model promises the store (and the local cache, which holds sealed
objects only) sees no file contents, names or key material. Every kind of
user data carries a canary string; after a session on a real mount with a
cache directory and debug logging, every byte under the store, the cache and
the daemon log is scanned for every canary in several encodings.
"""

from __future__ import annotations

import base64
import errno
import os
import random
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.mounts import PASSPHRASE, VolumeEnv, sealfs

pytestmark = pytest.mark.fuse

NAME = "CANARY-NAME-7f3a"
DIRNAME = "CANARY-DIR-91be"
TEXT = "CANARY-TEXT-c0de"
RANDOM = "CANARY-RAND-5e11"
SMALL = "CANARY-SMALL-0a0a"
LINK = "CANARY-LINK-d00d"
XNAME = "CANARY-XNAME-beef"
XVALUE = "CANARY-XVAL-f00d"
RENAMED = "CANARY-MOVED-4242"
CANARIES = [NAME, DIRNAME, TEXT, RANDOM, SMALL, LINK, XNAME, XVALUE, RENAMED, PASSPHRASE]

OBJECT_NAME = re.compile(r"^(c/([0-9a-f]{2})/\2[0-9a-f]{62}|l/\d{16}|s/\d{16}|sealfs\.vol)$")


def encodings(canary: str) -> list[bytes]:
    forms = {canary, canary.lower(), canary.upper()}
    out = []
    for form in forms:
        out += [form.encode(), form.encode("utf-16-le"), form.encode("utf-16-be")]
    return out


def files_under(*roots: Path) -> Iterator[Path]:
    for root in roots:
        for dirpath, _dirs, names in os.walk(root):
            for name in names:
                yield Path(dirpath) / name


def write_canaries(mnt: Path) -> None:
    """One of each kind of user data, each carrying its canary."""
    top = mnt / DIRNAME
    top.mkdir()
    (top / f"{NAME}.txt").write_bytes((TEXT + " compressible line\n").encode() * 60_000)
    rng = random.Random(3)
    blob = bytearray(rng.randbytes(3 << 20))
    for offset in (0, 1 << 20, (3 << 20) - 100):
        blob[offset : offset + len(RANDOM)] = RANDOM.encode()
    (top / "random.bin").write_bytes(bytes(blob))
    (mnt / "small").write_text(SMALL)
    (mnt / f"sub-{NAME}-dir").mkdir()
    (mnt / f"sub-{NAME}-dir" / f"{NAME}-inner").write_text("x")
    os.symlink(f"/target/{LINK}/file", mnt / "link")
    os.setxattr(mnt / "small", f"user.{XNAME}", XVALUE.encode())
    (mnt / "to-move").write_text("m")
    os.rename(mnt / "to-move", mnt / RENAMED)
    os.link(mnt / "small", mnt / f"hard-{NAME}")
    with open(mnt / "small", "rb") as f:
        os.fsync(f.fileno())


def test_no_canary_reaches_store_cache_or_log(volume_env: VolumeEnv) -> None:
    env = volume_env
    result = sealfs(
        "--verbose", "mount", str(env.store), str(env.mnt), "--passphrase-file", str(env.passfile),
        "--log-file", str(env.log), "--cache-dir", str(env.cache),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    try:
        write_canaries(env.mnt)
        # Read everything back so the cache fills from reads as well as writes.
        for path in files_under(env.mnt):
            if not path.is_symlink():
                path.read_bytes()
        assert (env.mnt / "small").read_text() == SMALL
    finally:
        env.umount()
    # Remount and read through the cache once more (the cache is warm now).
    result = sealfs(
        "--verbose", "mount", str(env.store), str(env.mnt), "--passphrase-file", str(env.passfile),
        "--log-file", str(env.log), "--cache-dir", str(env.cache),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    try:
        assert os.readlink(env.mnt / "link") == f"/target/{LINK}/file"
        assert os.getxattr(env.mnt / "small", f"user.{XNAME}") == XVALUE.encode()
        assert (env.mnt / DIRNAME / "random.bin").read_bytes()[1 << 20 :][:16] == RANDOM.encode()
    finally:
        env.umount()

    cached = list(files_under(env.cache))
    assert cached, "the cache directory holds nothing: the test checked nothing there"
    scanned = [*files_under(env.store, env.cache), env.log]
    for path in scanned:
        data = path.read_bytes()
        for canary in CANARIES:
            assert canary.lower() not in str(path).lower(), f"{canary!r} in the file name {path}"
            for form in encodings(canary):
                assert form not in data, f"{canary!r} ({form!r}) found in {path}"


def test_store_holds_only_well_named_objects(mounted_env: VolumeEnv) -> None:
    env = mounted_env
    write_canaries(env.mnt)
    env.umount()
    names = sorted(p.relative_to(env.store).as_posix() for p in files_under(env.store))
    odd = [n for n in names if not OBJECT_NAME.match(n)]
    assert not odd, f"unexpected objects in the store: {odd}"
    assert any(n.startswith("c/") for n in names)
    assert any(n.startswith("l/") for n in names)
    assert "sealfs.vol" in names
    for dirpath, dirs, _ in os.walk(env.store):
        rel = Path(dirpath).relative_to(env.store).as_posix()
        for d in dirs:
            sub = d if rel == "." else f"{rel}/{d}"
            assert re.match(r"^(c|l|s|c/[0-9a-f]{2})$", sub), f"unexpected directory {sub}"


# Failure paths: canaries that are not ASCII, or not UTF-8 at all, as names.
FAIL_NAME = "CANARY-ÉCHEC-жж-6b6b"
BAD_NAME = b"CANARY-BAD-\xff\xfe-7c7c"
FAIL_DATA = "CANARY-FAILDATA-8d8d"
FAIL_XNAME = "CANARY-FXNAME-Ω-9e9e"
WRONG_PASSPHRASE = "CANARY-WRONG-ø-0f0f"


def failure_forms(canary: bytes) -> list[bytes]:
    """canary as a log line, a repr, hex or base64 could spell it (base64 at each of
    the three alignments, without the characters the neighbours change)."""
    text = canary.decode(errors="replace")
    forms = [canary, canary.lower(), text.encode(), text.encode("utf-16-le")]
    forms += [repr(canary)[2:-1].encode(), ascii(text)[1:-1].encode(), canary.hex().encode()]
    forms += [base64.b64encode(bytes(i) + canary)[4:-4] for i in range(3)]
    return forms


def expect_errno(call: object, *args: object) -> int:
    try:
        call(*args)  # type: ignore[operator]
    except OSError as exc:
        return exc.errno or 0
    return 0


def test_no_canary_leaks_on_failure_paths(volume_env: VolumeEnv) -> None:
    """Errors with canary names (missing, too long, not UTF-8), a tampered chunk read,
    a wrong passphrase: the daemon's debug log, the commands' output, the store and
    the cache hold none of the canaries, in any spelling a message could give them."""
    env = volume_env
    mount = [*env.mount_args(), "--cache-dir", str(env.cache)]
    assert sealfs("--verbose", *mount).returncode == 0
    outputs = []
    try:
        mnt = os.fsencode(env.mnt)
        (env.mnt / FAIL_NAME).write_text(FAIL_DATA * 100)
        with open(mnt + b"/" + BAD_NAME, "wb") as f:
            f.write(FAIL_DATA.encode())
        os.setxattr(env.mnt / FAIL_NAME, f"user.{FAIL_XNAME}", FAIL_DATA.encode())
        missing = env.mnt / f"{FAIL_NAME}-missing"
        assert expect_errno(os.rename, missing, env.mnt / FAIL_NAME) == errno.ENOENT
        assert expect_errno(os.unlink, mnt + b"/" + BAD_NAME + b"-missing") == errno.ENOENT
        assert expect_errno(os.mkdir, env.mnt / (FAIL_NAME + "x" * 255)) == errno.ENAMETOOLONG
        assert expect_errno(os.getxattr, env.mnt / FAIL_NAME, f"user.{FAIL_XNAME}-x") == (
            errno.ENODATA
        )
        assert expect_errno(os.setxattr, env.mnt / FAIL_NAME, f"bad.{FAIL_XNAME}", b"v") == (
            errno.EOPNOTSUPP
        )
        outputs.append(sealfs("status", str(env.mnt)))
    finally:
        env.umount()
    for chunk in (p for p in files_under(env.store / "c") if not p.name.startswith(".")):
        sealed = bytearray(chunk.read_bytes())
        sealed[len(sealed) // 2] ^= 1
        chunk.write_bytes(sealed)
    for cached in files_under(env.cache):
        cached.unlink()
    assert sealfs("--verbose", *mount).returncode == 0
    try:
        assert expect_errno((env.mnt / FAIL_NAME).read_bytes) == errno.EIO
        with open(mnt + b"/" + BAD_NAME, "rb") as f:
            assert expect_errno(f.read) == errno.EIO
    finally:
        env.umount()
    wrong = env.root / "wrong-passphrase"
    wrong.write_text(WRONG_PASSPHRASE)
    wrong.chmod(0o600)
    refused = sealfs("--verbose", *env.mount_args(), "--passphrase-file", str(wrong))
    assert refused.returncode == 3, refused.stderr
    outputs.append(refused)
    assert "failed authentication" in env.log_text()  # the tampered reads were logged
    said = "".join(o.stdout + o.stderr for o in outputs).encode()
    canaries = [FAIL_NAME.encode(), BAD_NAME, FAIL_DATA.encode(), FAIL_XNAME.encode(),
                WRONG_PASSPHRASE.encode(), PASSPHRASE.encode()]  # fmt: skip
    for path in [*files_under(env.store, env.cache), env.log]:
        data = path.read_bytes() + os.fsencode(path)
        for canary in canaries:
            for form in failure_forms(canary):
                assert form not in data, f"{canary!r} ({form!r}) in {path}"
    for canary in canaries:
        assert not any(form in said for form in failure_forms(canary)), canary
