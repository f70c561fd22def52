"""`sealfs key ...`: slot changes through the CLI, refusals that leave the volume unchanged,
concurrent changes, and changes while the volume is mounted (engine and FUSE)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import io
import json
import logging
import subprocess
import sys
import threading
import tracemalloc
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from sealfs.cli import init_cmd
from sealfs.cli.key_cmd import change_header
from sealfs.cli.main import main
from sealfs.errors import PreconditionFailedError
from sealfs.keys import kdf
from sealfs.keys.edit import add_slot, remove_slot, replace_slot
from sealfs.keys.header import HEADER_NAME, Keyslot, decode_header, encode_header
from sealfs.keys.slots import (
    Passphrase,
    RecoveryKey,
    passphrase_slot_maker,
    recovery_slot_maker,
    unlock,
)
from sealfs.store.local import LocalStore
from sealfs.store.memory import MemoryStore
from sealfs.volume.header_io import read_header_version, write_header
from sealfs.volume.loader import create_volume, open_volume
from tests.cli.test_bad_input import fingerprint, one_line
from tests.conftest import PASSPHRASE, RECOVERY_KEY, cheap_kdf, mounted
from tests.keys.softhsm import SoftHsm, softhsm  # noqa: F401 (a fixture, used by name)
from tests.mounts import CHEAP_KDF, VolumeEnv, sealfs, write_secret

USAGE, WRONG_KEY, DAMAGED, BUSY = 2, 3, 4, 5


def cli(*args: str, env: dict[str, str | None] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the CLI in this process (a subprocess costs seconds of imports on a busy machine).

    The environment changes apply to this call only; so do the CLI's logging handlers,
    and the hooks its logging set-up puts in place of Python's: left installed, they
    replaced pytest's own, which then saw no thread's or finalizer's exception in any
    later test of the session.
    """
    out, err = io.StringIO(), io.StringIO()
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(threading, "excepthook", threading.excepthook)
        mp.setattr(sys, "unraisablehook", sys.unraisablehook)
        for name, value in (env or {}).items():
            if value is None:
                mp.delenv(name, raising=False)
            else:
                mp.setenv(name, value)
        try:
            with redirect_stdout(out), redirect_stderr(err):
                code = main(list(args))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else USAGE
        finally:
            root.handlers[:], _ = saved[0], root.setLevel(saved[1])
    return subprocess.CompletedProcess(["sealfs", *args], code, out.getvalue(), err.getvalue())


def key(
    vol: VolumeEnv, *args: str, env: dict[str, str | None] | None = None
) -> subprocess.CompletedProcess[str]:
    return cli("key", args[0], str(vol.store), *args[1:], env=env)


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr
    return result.stdout


def slots(env: VolumeEnv, *unlock: str) -> list[dict[str, Any]]:
    out = ok(key(env, "list", "--json", *(unlock or ("--passphrase-file", str(env.passfile)))))
    return list(json.loads(out)["slots"])


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> VolumeEnv:
    for name in ("SEALFS_PASSPHRASE_FILE", "SEALFS_NEW_PASSPHRASE_FILE", "SEALFS_UNLOCK",
                 "CREDENTIALS_DIRECTORY"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    made = VolumeEnv(tmp_path)
    ok(cli("init", str(made.store), "--passphrase-file", str(made.passfile),
           "--recovery-key-file", str(made.recovery_file), *CHEAP_KDF))  # fmt: skip
    return made


def write(path: Path, text: str) -> Path:
    return write_secret(path, text + "\n")


def test_the_cli_run_in_this_process_leaves_pytest_its_hooks(tmp_path: Path) -> None:
    """Regression: a command run by cli() kept its logging's hooks installed for the rest
    of the session, where pytest's reported a thread's or a finalizer's exception. (No
    volume fixture: making one runs cli() before the hooks are looked at.)"""
    hooks = threading.excepthook, sys.unraisablehook
    assert cli("key", "list", str(tmp_path / "nowhere")).returncode == USAGE
    assert (threading.excepthook, sys.unraisablehook) == hooks


def test_list_shows_public_params_only(env: VolumeEnv) -> None:
    out = ok(key(env, "list", "--passphrase-file", str(env.passfile)))
    lines = out.splitlines()
    assert lines[1] == "key epoch 0"
    assert lines[2].split() == ["SLOT", "KIND", "DETAILS"]
    assert "0  passphrase  argon2id, 64 MiB, 1 pass, 4 lanes" in out
    assert "(unlocked with this slot)" in lines[3]
    assert "1  recovery    recovery key" in out
    header = decode_header((env.store / HEADER_NAME).read_bytes())
    for slot in header.slots:
        assert slot.wrapped_key.hex() not in out
    as_json = slots(env, "--recovery-key-file", str(env.recovery_file))
    assert [(s["id"], s["kind"], s["unlocked_with"]) for s in as_json] == [
        (0, "passphrase", False),
        (1, "recovery", True),
    ]
    assert "wrapped_key" not in json.dumps(as_json)


def test_add_passphrase_then_passwd_then_remove(env: VolumeEnv, tmp_path: Path) -> None:
    second = write(tmp_path / "second", "second passphrase")
    third = write(tmp_path / "third", "third passphrase")
    out = ok(key(env, "add", "passphrase", "--passphrase-file", str(env.passfile),
                 "--new-passphrase-file", str(second), *CHEAP_KDF))  # fmt: skip
    assert out.startswith("Added keyslot 2 (passphrase)")
    assert [s["unlocked_with"] for s in slots(env, "--passphrase-file", str(second))][2]

    # passwd with the given KDF cost: new salt, new passphrase; the old one stops working.
    before = next(s for s in slots(env) if s["id"] == 2)
    ok(key(env, "passwd", "2", "--passphrase-file", str(second), "--new-passphrase-file",
           str(third), "--kdf-memory", "64", "--kdf-iterations", "2"))  # fmt: skip
    after = next(s for s in slots(env) if s["id"] == 2)
    assert after["params"]["t"] == 2 and after["params"]["salt"] != before["params"]["salt"]
    assert slots(env, "--passphrase-file", str(third))[2]["unlocked_with"]
    refused = key(env, "list", "--passphrase-file", str(second))
    assert "wrong passphrase" in one_line(refused, WRONG_KEY)

    ok(key(env, "remove", "2", "--passphrase-file", str(third)))  # the slot we unlocked with
    assert [s["id"] for s in slots(env)] == [0, 1]
    one_line(key(env, "list", "--passphrase-file", str(third)), WRONG_KEY)


def test_a_passphrase_that_opens_a_slot_already_is_refused(env: VolumeEnv, tmp_path: Path) -> None:
    """Regression: `key add passphrase` with the volume's passphrase made a second slot for
    it, and a passwd to another slot's passphrase left two slots of one secret (a later
    passwd of one kept the old passphrase working through the other)."""
    before = fingerprint(env.store)
    same = key(env, "add", "passphrase", "--passphrase-file", str(env.passfile),
               "--new-passphrase-file", str(env.passfile), *CHEAP_KDF)  # fmt: skip
    assert "that passphrase already opens keyslot 0" in one_line(same, USAGE)
    assert fingerprint(env.store) == before
    second = write(tmp_path / "second", "second passphrase")
    ok(key(env, "add", "passphrase", "--passphrase-file", str(env.passfile),
           "--new-passphrase-file", str(second), *CHEAP_KDF))  # fmt: skip
    before = fingerprint(env.store)
    taken = key(env, "passwd", "2", "--passphrase-file", str(second),
                "--new-passphrase-file", str(env.passfile))  # fmt: skip
    assert "that passphrase already opens keyslot 0" in one_line(taken, USAGE)
    assert fingerprint(env.store) == before
    # A slot's own passphrase again is a new salt, not a second slot: still allowed.
    ok(key(env, "passwd", "2", "--passphrase-file", str(second), "--new-passphrase-file",
           str(second)))  # fmt: skip
    assert fingerprint(env.store) != before


def test_passwd_keeps_the_slot_s_cost_unless_told(env: VolumeEnv, tmp_path: Path) -> None:
    """Regression: passwd without --kdf-* took a slot made with --kdf-memory 64 (for a
    small host's MemoryMax) to the calibrated 256 MiB, without a word."""
    second = write(tmp_path / "second", "second passphrase")
    third = write(tmp_path / "third", "third passphrase")
    before = next(s for s in slots(env) if s["id"] == 0)
    ok(key(env, "passwd", "0", "--passphrase-file", str(env.passfile), "--new-passphrase-file",
           str(second)))  # fmt: skip
    after = next(s for s in slots(env, "--passphrase-file", str(second)) if s["id"] == 0)
    assert {k: after["params"][k] for k in "mtp"} == {k: before["params"][k] for k in "mtp"}
    assert after["params"]["salt"] != before["params"]["salt"]
    ok(key(env, "passwd", "0", "--passphrase-file", str(second), "--new-passphrase-file",
           str(third), "--kdf-iterations", "3"))  # fmt: skip
    told = next(s for s in slots(env, "--passphrase-file", str(third)) if s["id"] == 0)
    assert told["params"]["t"] == 3 and told["params"]["m"] == before["params"]["m"]


def test_new_passphrase_from_environment_and_credentials(env: VolumeEnv, tmp_path: Path) -> None:
    from_env = write(tmp_path / "from-env", "from the environment")
    creds = tmp_path / "creds"
    creds.mkdir()
    write(creds / "sealfs-new-passphrase", "from a credential")
    base = {"SEALFS_NEW_PASSPHRASE_FILE": str(from_env)}
    ok(key(env, "add", "passphrase", "--passphrase-file", str(env.passfile), *CHEAP_KDF,
           env=base))  # fmt: skip
    ok(key(env, "add", "passphrase", "--passphrase-file", str(env.passfile), *CHEAP_KDF,
           env={"CREDENTIALS_DIRECTORY": str(creds)}))  # fmt: skip
    # The unlock passphrase itself may also come from a credential.
    write(creds / "sealfs-passphrase", "from the environment")
    listed = ok(key(env, "list", env={"CREDENTIALS_DIRECTORY": str(creds)}))
    assert "2  passphrase" in listed and "(unlocked with this slot)" in listed
    got = slots(env, "--passphrase-file", str(creds / "sealfs-new-passphrase"))
    assert [s["id"] for s in got if s["unlocked_with"]] == [3]


def test_no_new_passphrase_source_without_terminal(env: VolumeEnv) -> None:
    before = fingerprint(env.store)
    err = one_line(key(env, "add", "passphrase", "--passphrase-file", str(env.passfile)), USAGE)
    assert "no new passphrase" in err
    assert fingerprint(env.store) == before


def test_add_recovery_key(env: VolumeEnv, tmp_path: Path) -> None:
    out_file = tmp_path / "second-recovery"
    ok(key(env, "add", "recovery", "--passphrase-file", str(env.passfile),
           "--new-recovery-key-file", str(out_file)))  # fmt: skip
    assert out_file.stat().st_mode & 0o777 == 0o600
    got = slots(env, "--recovery-key-file", str(out_file))
    assert [(s["id"], s["unlocked_with"]) for s in got] == [(0, False), (1, False), (2, True)]
    # Printed when no file is given; shown once, never stored.
    printed = ok(key(env, "add", "recovery", "--passphrase-file", str(env.passfile)))
    text = next(w for w in printed.split() if w.startswith("sfrk-"))
    assert len(slots(env, "--recovery-key-file", str(write(tmp_path / "rk3", text)))) == 4


def test_ids_never_reused_through_the_cli(env: VolumeEnv, tmp_path: Path) -> None:
    ok(key(env, "add", "recovery", "--passphrase-file", str(env.passfile),
           "--new-recovery-key-file", str(tmp_path / "rk2")))  # fmt: skip
    ok(key(env, "remove", "2", "--passphrase-file", str(env.passfile)))
    ok(key(env, "add", "recovery", "--passphrase-file", str(env.passfile),
           "--new-recovery-key-file", str(tmp_path / "rk3")))  # fmt: skip
    assert [s["id"] for s in slots(env)] == [0, 1, 3]
    err = one_line(key(env, "remove", "2", "--passphrase-file", str(env.passfile)), USAGE)
    assert "no keyslot 2 (its slots are 0, 1, 3)" in err


def test_last_slot_removal_refused_volume_unchanged(env: VolumeEnv) -> None:
    ok(key(env, "remove", "0", "--recovery-key-file", str(env.recovery_file)))
    before = fingerprint(env.store)
    header_before = (env.store / HEADER_NAME).read_bytes()
    err = one_line(key(env, "remove", "1", "--recovery-key-file", str(env.recovery_file)), USAGE)
    assert "last keyslot" in err
    assert (env.store / HEADER_NAME).read_bytes() == header_before
    assert fingerprint(env.store) == before


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        # Regression: "keyslot 1 is a aws-kms slot": the kind stands apart from the prose.
        (("rotate", "0"), USAGE, "keyslot 0 (passphrase) is not an aws-kms or pkcs11 slot"),
        (("passwd", "1"), USAGE, "keyslot 1 (recovery) is not a passphrase slot"),
        (("remove", "7"), USAGE, "no keyslot 7"),
        (("add", "aws-kms"), USAGE, "needs --kms-key-id"),
        (("add", "pkcs11"), USAGE, "needs --pkcs11-module"),
    ],
)
def test_bad_requests_leave_the_volume_unchanged(
    env: VolumeEnv, args: tuple[str, ...], code: int, needle: str
) -> None:
    before = fingerprint(env.store)
    err = one_line(key(env, *args, "--passphrase-file", str(env.passfile)), code)
    assert needle in err
    assert fingerprint(env.store) == before


def test_wrong_secret_changes_nothing(env: VolumeEnv, tmp_path: Path) -> None:
    before = fingerprint(env.store)
    wrong = write(tmp_path / "wrong", "not it")
    err = one_line(key(env, "remove", "1", "--passphrase-file", str(wrong)), WRONG_KEY)
    assert "wrong passphrase" in err
    assert fingerprint(env.store) == before


def _tamper(env: VolumeEnv, edit: Any) -> None:
    """Rewrite the header with an edit, keeping its (now wrong) MAC."""
    path = env.store / HEADER_NAME
    data = path.read_bytes()
    edited = edit(decode_header(data))
    path.write_bytes(encode_header(edited, bytes(32))[:-32] + data[-32:])


@pytest.mark.parametrize("tamper", ["lowered-cost", "swapped-slots"])
def test_tampered_header_is_refused(env: VolumeEnv, tmp_path: Path, tamper: str) -> None:
    second = write(tmp_path / "second", "second passphrase")
    ok(key(env, "add", "passphrase", "--passphrase-file", str(env.passfile),
           "--new-passphrase-file", str(second), *CHEAP_KDF))  # fmt: skip

    def edit(h: Any) -> Any:
        if tamper == "lowered-cost":
            weak = dataclasses.replace(h.slots[2], params={**h.slots[2].params, "m": 1024})
            return dataclasses.replace(h, slots=(*h.slots[:2], weak))
        return dataclasses.replace(h, slots=(h.slots[2], h.slots[0], h.slots[1]))

    _tamper(env, edit)
    before = fingerprint(env.store)
    if tamper == "lowered-cost":
        err = one_line(key(env, "list", "--passphrase-file", str(second)), DAMAGED)
        assert "below the minimum" in err
    else:
        err = one_line(key(env, "list", "--passphrase-file", str(env.passfile)), DAMAGED)
        assert "MAC mismatch" in err
    err = one_line(key(env, "remove", "1", "--recovery-key-file", str(env.recovery_file)), DAMAGED)
    assert fingerprint(env.store) == before


# --- atomic replacement and concurrency (on the stores themselves) -----------------------


def _s3_store() -> Any:
    """The stack `sealfs key` uses on s3:// (retries over S3), on the run's moto server."""
    from sealfs.store.url import open_store  # noqa: PLC0415
    from tests.s3 import server  # noqa: PLC0415 - starts moto only for the tests that need it

    url = f"s3://{server.new_bucket()}/vol"
    return open_store(url, s3_endpoint=server.moto_endpoint(), default_cache=False)


@pytest.fixture(params=["memory", "local", pytest.param("s3", marks=pytest.mark.s3)])
def vstore(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """A volume on a store whose put_if_match decides header races (S3: If-Match)."""
    if request.param == "s3":
        store = _s3_store()
    elif request.param == "memory":
        store = MemoryStore()
    else:
        store = LocalStore(tmp_path / "store")
    create_volume(store, PASSPHRASE, cheap_kdf(), RECOVERY_KEY)
    return store


def _unlocker(data: bytes) -> Any:
    return unlock(data, RecoveryKey(RECOVERY_KEY))


def test_two_concurrent_changes_one_wins(vstore: Any) -> None:
    first = read_header_version(vstore)
    second = read_header_version(vstore)
    a = add_slot(_unlocker(first.data), recovery_slot_maker(bytes(32)))[0]
    b = remove_slot(_unlocker(second.data), 0)
    write_header(vstore, first, a)
    with pytest.raises(PreconditionFailedError, match=r"changed meanwhile.*retry"):
        write_header(vstore, second, b)
    now = vstore.get(HEADER_NAME)
    assert now == a  # the winner's header, valid and whole
    assert unlock(now, Passphrase(PASSPHRASE)).slot_id == 0
    assert unlock(now, RecoveryKey(bytes(32))).slot_id == 2


def test_racing_threads_never_lose_the_header(vstore: Any) -> None:
    results: list[str] = []
    barrier = threading.Barrier(6)

    def change(i: int) -> None:
        def edit(u: Any) -> bytes:
            barrier.wait(timeout=30)
            return add_slot(u, recovery_slot_maker(bytes([i]) * 32))[0]

        try:
            change_header(vstore, _unlocker, edit)
            results.append("won")
        except PreconditionFailedError as exc:
            assert "retry" in str(exc)
            results.append("retry")

    threads = [threading.Thread(target=change, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results.count("won") >= 1 and len(results) == 6
    final = vstore.get(HEADER_NAME)
    header = decode_header(final)
    assert len(header.slots) == 2 + results.count("won")
    assert unlock(final, Passphrase(PASSPHRASE)).master_key  # MAC valid, still opens


def test_retried_write_that_had_landed_is_not_an_error(vstore: Any) -> None:
    old = read_header_version(vstore)
    new = add_slot(_unlocker(old.data), recovery_slot_maker(bytes(32)))[0]
    write_header(vstore, old, new)
    write_header(vstore, old, new)  # as a store retry after a lost reply would
    assert vstore.get(HEADER_NAME) == new


async def test_slot_change_while_mounted_on_the_engine() -> None:
    store = MemoryStore()
    create_volume(store, PASSPHRASE, cheap_kdf(), RECOVERY_KEY)
    async with mounted(store) as volume:
        fh, _ = await volume.create(1, b"before", 0o644, 0, 0, 0)
        await volume.write(fh, 0, b"one")
        await volume.release(fh)
        await volume.fsync()
        change_header(
            store,
            _unlocker,
            lambda u: replace_slot(u, 0, passphrase_slot_maker(b"new secret", cheap_kdf()))[0],
        )
        fh, _ = await volume.create(1, b"after", 0o644, 0, 0, 0)
        await volume.write(fh, 0, b"two")
        await volume.release(fh)
        await volume.fsync()  # commits go on: the header is not part of them
    loaded = open_volume(store, Passphrase(b"new secret"))
    names = {name for name in loaded.live.inodes[1].entries}
    assert {b"before", b"after"} <= names
    with pytest.raises(Exception, match="wrong passphrase"):
        open_volume(store, Passphrase(PASSPHRASE))


@pytest.mark.fuse
def test_passwd_while_mounted_with_fuse(volume_env: VolumeEnv, tmp_path: Path) -> None:
    env = volume_env
    env.mount()
    (env.mnt / "a.txt").write_text("first")
    new = write(tmp_path / "new-pass", "a new passphrase")
    ok(key(env, "passwd", "0", "--passphrase-file", str(env.passfile),
           "--new-passphrase-file", str(new), *CHEAP_KDF))  # fmt: skip
    (env.mnt / "b.txt").write_text("second")
    ok(cli("sync", str(env.mnt)))
    env.umount()
    refused = env.mount(check=False)
    assert "wrong passphrase" in one_line(refused, WRONG_KEY)
    env.passfile.write_text("a new passphrase\n")
    env.mount()
    assert (env.mnt / "a.txt").read_text() == "first"
    assert (env.mnt / "b.txt").read_text() == "second"
    env.umount()


# --- pkcs11 through the CLI (SoftHSM2) ---------------------------------------------------


@pytest.mark.fuse
def test_pkcs11_init_headless_mount_rotate(
    softhsm: SoftHsm,  # noqa: F811 (the fixture imported above)
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first, second = softhsm.new_key(), softhsm.new_key()
    env = VolumeEnv(tmp_path)
    monkeypatch.setenv("SEALFS_PKCS11_PIN_FILE", str(softhsm.pin_file))
    out = ok(cli("init", str(env.store), "--recovery-key-file", str(env.recovery_file),
                 "--pkcs11-module", softhsm.module, "--pkcs11-token", softhsm.token,
                 "--pkcs11-key", first.key))  # fmt: skip
    assert "Keyslot 0: recovery" in out and "Keyslot 1: pkcs11" in out
    assert "passphrase" not in out  # no passphrase source: no passphrase slot
    # Headless: no passphrase source, a pkcs11 slot and a PIN source.
    listed = ok(cli("key", "list", str(env.store)))
    assert f"token 'sealfs-a', key '{first.key}'" in listed
    assert (
        "(unlocked with this slot)" in listed.splitlines()[4]
    )  # after volume, epoch, heading, slot 0
    ok(cli("key", "rotate", str(env.store), "1", "--pkcs11-key", second.key))
    listed = ok(cli("key", "list", str(env.store), "--pkcs11"))
    assert second.key in listed and first.key not in listed
    # A wrong PIN: one line, exit 3; a missing token key: exit 1.
    bad_pin = write(tmp_path / "bad-pin", "0000")
    err = one_line(
        cli("key", "list", str(env.store), "--pkcs11", "--pkcs11-pin-file", str(bad_pin)),
        WRONG_KEY,
    )
    assert "wrong PIN" in err
    err = one_line(cli("key", "rotate", str(env.store), "1", "--pkcs11-key", "gone"), 1)
    assert "no AES key labelled 'gone'" in err
    result = sealfs("mount", str(env.store), str(env.mnt), "--log-file", str(env.log))
    try:
        assert result.returncode == 0, result.stderr + env.log_text()
        (env.mnt / "x").write_text("token-unlocked")
        env.umount()
        result = sealfs("mount", str(env.store), str(env.mnt), "--log-file", str(env.log))
        assert result.returncode == 0, result.stderr + env.log_text()
        assert (env.mnt / "x").read_text() == "token-unlocked"
        env.umount()
    finally:
        env.cleanup()


def test_list_json_with_nested_binary_params(env: VolumeEnv) -> None:
    """A slot of a kind this build does not know may nest bin values in its params."""
    data = (env.store / HEADER_NAME).read_bytes()
    unlocked = unlock(data, Passphrase(PASSPHRASE))
    future = Keyslot(5, "tpm2", {"pcrs": [0, 7], "blob": {"pub": b"\x01\x02"}}, b"", b"x")
    header = dataclasses.replace(
        unlocked.header, slots=(*unlocked.header.slots, future), next_slot_id=6
    )
    (env.store / HEADER_NAME).write_bytes(encode_header(header, unlocked.subkeys.header_mac_key))
    listed = slots(env)
    assert listed[-1]["kind"] == "tpm2" and not listed[-1]["supported"]
    assert listed[-1]["params"] == {"pcrs": [0, 7], "blob": {"pub": "0102"}}


def test_kdf_memory_given_alone_is_the_memory_of_the_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: --kdf-memory without --kdf-iterations (init, key add, key passwd) went
    through the calibration that halves memory until a pass takes 0.5 s: asked for
    1024 MiB, a slot got 128 MiB, and only the summary line showed it."""

    def slow(params: kdf.Argon2Params) -> float:
        return params.memory_kib / 65536  # 1 s per 64 MiB: every size is "too slow"

    monkeypatch.setattr(init_cmd, "calibrate", functools.partial(kdf.calibrate, timer=slow))
    args = argparse.Namespace(kdf_memory=1024, kdf_iterations=None)
    params = init_cmd.kdf_params(args)
    assert (params.memory_kib, params.iterations) == (1024 * 1024, 1)


def test_a_header_grown_meanwhile_is_refused_without_reading_it(tmp_path: Path) -> None:
    """Regression: after a lost race, write_header read the header it lost to whole,
    however large someone with access to the store had made it (a sparse file)."""
    store = LocalStore(tmp_path / "store")
    create_volume(store, PASSPHRASE, cheap_kdf(), RECOVERY_KEY)
    old = read_header_version(store)
    new = add_slot(_unlocker(old.data), recovery_slot_maker(bytes(32)))[0]
    with open(tmp_path / "store" / HEADER_NAME, "r+b") as f:
        f.truncate(256 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(PreconditionFailedError, match="changed meanwhile"):
            write_header(store, old, new)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20
