"""aws-kms through the CLI: init and headless mounts, the unlock rule, key add/rotate/remove,
and failures that name their cause in one line and change nothing."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from sealfs.keys.header import HEADER_NAME
from tests.cli.test_bad_input import fingerprint, one_line
from tests.cli.test_keys import cli, ok, write
from tests.kms.conftest import key_id_of
from tests.mounts import (
    CHEAP_KDF,
    STATUS_XATTR,
    VolumeEnv,
    force_unmount,
    mounted_sealfs,
    sealfs,
    wait_until,
)

WRONG_KEY, FAILURE, USAGE = 3, 1, 2


def init_kms(env: VolumeEnv, key: str, *extra: str) -> str:
    return ok(cli("init", str(env.store), "--recovery-key-file", str(env.recovery_file),
                  "--kms-key-id", key, *CHEAP_KDF, *extra))  # fmt: skip


def listing(
    vol: VolumeEnv, *args: str, env: dict[str, str | None] | None = None
) -> list[dict[str, Any]]:
    out = ok(cli("key", "list", str(vol.store), "--json", *args, env=env))
    return list(json.loads(out)["slots"])


def used(slots: list[dict[str, Any]]) -> int:
    return next(s["id"] for s in slots if s["unlocked_with"])


def test_init_with_kms_only_unlocks_headless(kms_env: str, kms_key: str, tmp_path: Path) -> None:
    env = VolumeEnv(tmp_path)
    out = init_kms(env, kms_key)
    assert "Keyslot 0: recovery" in out and "Keyslot 1: aws-kms" in out
    assert "Argon2id" not in out  # no passphrase source: no passphrase slot
    slots = listing(env)
    assert [(s["id"], s["kind"]) for s in slots] == [(0, "recovery"), (1, "aws-kms")]
    assert used(slots) == 1
    assert slots[1]["params"] == {"key_id": kms_key, "key_arn": kms_key, "region": "us-east-1"}
    text = ok(cli("key", "list", str(env.store)))
    assert f"KMS key {kms_key} (us-east-1)  (unlocked with this slot)" in text


@pytest.mark.fuse
def test_headless_fuse_mount(kms_env: str, kms_key: str, tmp_path: Path) -> None:
    env = VolumeEnv(tmp_path)
    init_kms(env, kms_key)
    try:
        for round_ in ("one", "two"):
            # The daemon's environment has the moto endpoint and no passphrase source.
            result = sealfs("mount", str(env.store), str(env.mnt), "--log-file", str(env.log))
            assert result.returncode == 0, result.stderr + env.log_text()
            if round_ == "one":
                (env.mnt / "checkpoint.json").write_text('{"step": 1}')
            else:
                assert (env.mnt / "checkpoint.json").read_text() == '{"step": 1}'
            env.umount()
        # Pinned to another key: KMS refuses, the mount fails in one line.
        pinned = sealfs("mount", str(env.store), str(env.mnt), "--log-file", str(env.log),
                        "--kms-key-id", "alias/aws/not-this-one")  # fmt: skip
        assert pinned.returncode != 0
        assert "aws-kms keyslot 1" in one_line(pinned, None)
    finally:
        assert not env.cleanup()


def test_unlock_rule(kms_env: str, kms_key: str, tmp_path: Path) -> None:
    env = VolumeEnv(tmp_path)
    init_kms(env, kms_key, "--passphrase-file", str(env.passfile))
    assert [s["kind"] for s in listing(env, "--kms")] == ["passphrase", "recovery", "aws-kms"]
    # Auto: no passphrase source configured, a KMS slot exists: KMS.
    assert used(listing(env)) == 2
    # A configured passphrase source wins in auto mode...
    passenv: dict[str, str | None] = {"SEALFS_PASSPHRASE_FILE": str(env.passfile)}
    assert used(listing(env, env=passenv)) == 0
    # ...unless KMS is asked for, by flag or environment.
    assert used(listing(env, "--kms", env=passenv)) == 2
    assert used(listing(env, env={**passenv, "SEALFS_UNLOCK": "kms"})) == 2
    assert used(listing(env, env={"SEALFS_UNLOCK": "passphrase", **passenv})) == 0
    assert used(listing(env, "--passphrase-file", str(env.passfile))) == 0
    assert used(listing(env, "--recovery-key-file", str(env.recovery_file))) == 1
    err = one_line(cli("key", "list", str(env.store), env={"SEALFS_UNLOCK": "tpm"}), USAGE)
    assert "SEALFS_UNLOCK=tpm is not one of" in err


def _deny_decrypt(kms_admin: Any, key: str) -> None:
    deny = {"Statement": [{"Effect": "Deny", "Principal": "*", "Action": "kms:Decrypt",
                           "Resource": "*"}]}  # fmt: skip
    kms_admin.put_key_policy(KeyId=key_id_of(key), PolicyName="default", Policy=json.dumps(deny))


def test_denied_disabled_pending_one_line_nothing_changed(
    kms_env: str, kms_admin: Any, tmp_path: Path
) -> None:
    cases = [
        ("deny", WRONG_KEY, "AWS KMS denied access to key"),
        ("disable", FAILURE, "is disabled"),
        ("delete", FAILURE, "pending deletion"),
    ]
    for i, (how, code, needle) in enumerate(cases):
        key = kms_admin.create_key()["KeyMetadata"]["Arn"]
        env = VolumeEnv(tmp_path / str(i))
        init_kms(env, key)
        before = fingerprint(env.store)
        if how == "deny":
            _deny_decrypt(kms_admin, key)
        elif how == "disable":
            kms_admin.disable_key(KeyId=key_id_of(key))
        else:
            kms_admin.schedule_key_deletion(KeyId=key_id_of(key), PendingWindowInDays=7)
        for args in (("list",), ("remove", "0"), ("add", "recovery")):
            err = one_line(cli("key", args[0], str(env.store), *args[1:]), code)
            assert err.startswith(f"sealfs: volume at {env.store}: aws-kms keyslot 1: "), err
            assert needle in err, err
        assert fingerprint(env.store) == before
        # The recovery key still opens the volume.
        assert used(listing(env, "--recovery-key-file", str(env.recovery_file))) == 0


def test_kms_failure_falls_back_to_a_configured_passphrase(
    kms_env: str, kms_admin: Any, kms_key: str, tmp_path: Path
) -> None:
    env = VolumeEnv(tmp_path)
    init_kms(env, kms_key, "--passphrase-file", str(env.passfile))
    kms_admin.disable_key(KeyId=key_id_of(kms_key))
    passenv: dict[str, str | None] = {"SEALFS_PASSPHRASE_FILE": str(env.passfile)}
    result = cli("key", "list", str(env.store), "--json", "--kms", env=passenv)
    assert result.returncode == 0, result.stderr
    assert (
        "is disabled" in result.stderr and "; unlocked with the passphrase instead" in result.stderr
    )
    # Both fail: the one line names both causes.
    wrong = write(tmp_path / "wrong", "nope")
    err = one_line(
        cli("key", "list", str(env.store), "--kms", env={"SEALFS_PASSPHRASE_FILE": str(wrong)}),
        WRONG_KEY,
    )
    assert "is disabled: " in err and "; then: wrong passphrase" in err


def test_add_rotate_remove_kms_slot(kms_env: str, kms_admin: Any, tmp_path: Path) -> None:
    env = VolumeEnv(tmp_path)
    ok(cli("init", str(env.store), "--passphrase-file", str(env.passfile),
           "--recovery-key-file", str(env.recovery_file), *CHEAP_KDF))  # fmt: skip
    old = kms_admin.create_key()["KeyMetadata"]["Arn"]
    new = kms_admin.create_key()["KeyMetadata"]["Arn"]
    kms_admin.create_alias(AliasName="alias/sealfs-rotate", TargetKeyId=new)
    pw = ("--passphrase-file", str(env.passfile))
    out = ok(cli("key", "add", str(env.store), "aws-kms", "--kms-key-id", old, *pw))
    assert out.startswith(f"Added keyslot 2 (aws-kms): KMS key {old}")
    assert used(listing(env, "--kms")) == 2
    # Rotate onto the alias of a new key; unlocked with KMS itself. No data touched.
    data_before = {k: v for k, v in fingerprint(env.store).items() if k != HEADER_NAME}
    ok(cli("key", "rotate", str(env.store), "2", "--kms-key-id", "alias/sealfs-rotate"))
    slot = listing(env, "--kms")[2]
    assert slot["params"]["key_id"] == "alias/sealfs-rotate" and slot["params"]["key_arn"] == new
    kms_admin.disable_key(KeyId=key_id_of(old))  # the old key no longer matters
    assert used(listing(env, "--kms")) == 2
    assert used(listing(env, "--kms-key-id", "alias/sealfs-rotate")) == 2
    # Rotate without a new key re-wraps under the slot's current key.
    ok(cli("key", "rotate", str(env.store), "2"))
    after = {k: v for k, v in fingerprint(env.store).items() if k != HEADER_NAME}
    assert after == data_before
    ok(cli("key", "remove", str(env.store), "2", *pw))
    err = one_line(cli("key", "list", str(env.store), "--kms", *()), WRONG_KEY)
    assert "has no aws-kms keyslot" in err


def test_init_with_a_bad_key_writes_nothing(kms_env: str, tmp_path: Path) -> None:
    env = VolumeEnv(tmp_path)
    result = cli("init", str(env.store), "--recovery-key-file", str(env.recovery_file),
                 "--kms-key-id", "alias/does-not-exist")  # fmt: skip
    err = one_line(result, FAILURE)
    assert "alias/does-not-exist was not found" in err
    assert not env.recovery_file.exists()
    assert not env.store.exists() or not any(env.store.iterdir())


def test_add_aws_kms_with_key_denied_changes_nothing(
    kms_env: str, kms_admin: Any, kms_key: str, tmp_path: Path
) -> None:
    # Encrypt allowed, Decrypt denied: no slot is made that could not be opened.
    env = VolumeEnv(tmp_path)
    ok(cli("init", str(env.store), "--passphrase-file", str(env.passfile),
           "--recovery-key-file", str(env.recovery_file), *CHEAP_KDF))  # fmt: skip
    _deny_decrypt(kms_admin, kms_key)
    before = fingerprint(env.store)
    err = one_line(cli("key", "add", str(env.store), "aws-kms", "--kms-key-id", kms_key,
                       "--passphrase-file", str(env.passfile)), WRONG_KEY)  # fmt: skip
    assert "denied access" in err
    assert fingerprint(env.store) == before


@pytest.mark.fuse
def test_a_read_only_mount_unlocked_by_kms_follows_a_rekey(
    kms_env: str, kms_key: str, tmp_path: Path
) -> None:
    """Its daemon asks KMS for the new header's key by itself: it keeps no secret, and
    `sealfs rekey` can hand a read-only mount nothing (the kernel refuses its setxattr)."""
    env = VolumeEnv(tmp_path)
    init_kms(env, kms_key)
    ro = tmp_path / "ro"
    ro.mkdir()
    try:
        ok(sealfs("mount", str(env.store), str(env.mnt), "--log-file", str(env.log)))
        (env.mnt / "before").write_text("sealed under the old key")
        ok(sealfs("sync", str(env.mnt)))
        ok(sealfs("mount", str(env.store), str(ro), "--read-only", "--commit-interval", "0.2",
                  "--log-file", str(tmp_path / "ro.log")))  # fmt: skip
        ok(sealfs("rekey", str(env.store), "--drop-slot", "0", timeout=180))
        (env.mnt / "after").write_text("sealed under the new key")
        ok(sealfs("sync", str(env.mnt)))
        wait_until((ro / "after").exists, 15)
        assert (ro / "after").read_text() == "sealed under the new key"
        assert (ro / "before").read_text() == "sealed under the old key"
        assert json.loads(os.getxattr(ro, STATUS_XATTR))["follow_stopped"] is None
        ok(sealfs("umount", str(ro)))
        env.umount()
    finally:
        if any(m == str(ro) for m, _ in mounted_sealfs()):
            force_unmount(str(ro))
        assert not env.cleanup()
    assert "ERROR" not in (tmp_path / "ro.log").read_text()
