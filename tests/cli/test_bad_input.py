"""Bad input to the CLI: one clear line on stderr, the documented exit code, no change.

README: every error is one line on stderr naming the problem and the fix;
nothing is written to the store when a command fails; exit codes 2 (usage),
3 (wrong passphrase or recovery key), 4 (not a volume, damaged, unsupported),
5 (busy). Most cases share one initialised volume that no test changes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sealfs.keys.header import decode_header
from sealfs.keys.recovery import FORMAT_HINT, format_recovery_key
from tests.mounts import CHEAP_KDF, VolumeEnv, sealfs, write_secret
from tests.s3.server import FAKE_ENV
from tests.store.conftest import mounted_tmpfs

USAGE, WRONG_KEY, DAMAGED, BUSY = 2, 3, 4, 5


def fingerprint(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def one_line(result: subprocess.CompletedProcess[str], code: int | None) -> str:
    """The single stderr line of a failed command (checks the code, unless None)."""
    if code is None:
        assert result.returncode != 0, result
    else:
        assert result.returncode == code, (result.returncode, result.stderr)
    err = result.stderr.strip()
    assert err, "no message on stderr"
    assert "\n" not in err, f"more than one line on stderr:\n{err}"
    assert "Traceback" not in err
    return err


@pytest.fixture(scope="module")
def vol(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VolumeEnv]:
    """One initialised, unmounted volume shared by the tests that must not change it."""
    env = VolumeEnv(tmp_path_factory.mktemp("bad-input"))
    env.init()
    before = fingerprint(env.store)
    yield env
    assert not env.cleanup(), "a test left a mount or a daemon behind"
    assert fingerprint(env.store) == before, "a failed command changed the store"


def mount(
    vol: VolumeEnv, *extra: str, store: Path | None = None, **kw: Any
) -> subprocess.CompletedProcess[str]:
    return sealfs(
        "mount", str(store or vol.store), str(vol.mnt), "--log-file", str(vol.log), *extra, **kw
    )


def clean_env() -> dict[str, str]:
    """The environment without any passphrase source."""
    env = dict(os.environ)
    env.pop("SEALFS_PASSPHRASE_FILE", None)
    env.pop("CREDENTIALS_DIRECTORY", None)
    return env


def test_wrong_passphrase(vol: VolumeEnv, tmp_path: Path) -> None:
    wrong = tmp_path / "wrong"
    write_secret(wrong, "not the passphrase\n")
    err = one_line(mount(vol, "--passphrase-file", str(wrong)), WRONG_KEY)
    assert "passphrase" in err
    assert not vol.is_mounted()
    one_line(sealfs("status", str(vol.store), "--passphrase-file", str(wrong)), WRONG_KEY)
    # The log file the failed mount made, empty, is gone; one that was there stays.
    assert not vol.log.exists()
    vol.log.write_text("")
    one_line(mount(vol, "--passphrase-file", str(wrong)), WRONG_KEY)
    assert vol.log.exists()


def test_wrong_recovery_key_file(vol: VolumeEnv, tmp_path: Path) -> None:
    """Regression (the fix): it said "wrong recovery key: no keyslot opens with it" and no
    more, where the wrong passphrase's line names what to check and the other way in."""
    other = tmp_path / "other-key"
    write_secret(other, format_recovery_key(os.urandom(32)) + "\n")
    err = one_line(mount(vol, "--recovery-key-file", str(other)), WRONG_KEY)
    assert "wrong recovery key" in err
    assert "another volume's" in err and "or unlock with --passphrase-file" in err, err


@pytest.mark.parametrize(
    "command", [["mount"], ["status"], ["key", "list"], ["key", "remove"], ["rekey"]]
)
@pytest.mark.parametrize("secret", ["passphrase", "recovery key"])
def test_a_wrong_secret_names_the_volume(
    vol: VolumeEnv, tmp_path: Path, command: list[str], secret: str
) -> None:
    """Regression: "wrong passphrase" said not of which volume: on a host that mounts a
    volume per agent, or in a script that unlocks several, the reader had to guess."""
    wrong = tmp_path / "wrong"
    if secret == "passphrase":
        write_secret(wrong, "not the passphrase\n")
        unlock = ["--passphrase-file", str(wrong)]
    else:
        write_secret(wrong, format_recovery_key(os.urandom(32)) + "\n")
        unlock = ["--recovery-key-file", str(wrong)]
    if command == ["mount"]:
        result = mount(vol, *unlock)
    else:
        slot = ["0"] if command == ["key", "remove"] else []
        result = sealfs(*command, str(vol.store), *slot, *unlock)
    err = one_line(result, WRONG_KEY)
    assert f"volume at {vol.store}: wrong {secret}: no keyslot opens with it" in err, err
    assert not vol.is_mounted()


def test_recovery_key_typo_is_a_wrong_key_not_damage(vol: VolumeEnv, tmp_path: Path) -> None:
    """Regression: a mistyped recovery key exited 4 ("damaged volume") instead of 3."""
    text = vol.recovery_file.read_text().strip()
    at = 12  # a character of the key itself (the last one also carries padding bits)
    typo = tmp_path / "typo-key"
    write_secret(typo, text[:at] + ("a" if text[at] != "a" else "b") + text[at + 1 :] + "\n")
    err = one_line(mount(vol, "--recovery-key-file", str(typo)), WRONG_KEY)
    assert "typo" in err


@pytest.mark.parametrize("kind", ["passphrase", "bad character", "short"])
def test_recovery_key_format_error_quotes_nothing_of_the_file(
    vol: VolumeEnv, tmp_path: Path, kind: str
) -> None:
    """Regression: the error quoted the bad character, or gave the text's length."""
    key = vol.recovery_file.read_text().strip()
    text = {
        "passphrase": vol.passfile.read_text(),
        "bad character": key[:12] + "1" + key[13:],
        "short": key[:20],
    }[kind]
    secret = tmp_path / "secret"
    write_secret(secret, text)
    result = sealfs("status", str(vol.store), "--recovery-key-file", str(secret))
    err = one_line(result, WRONG_KEY)
    assert err == (
        f"sealfs: volume at {vol.store}: recovery key in {secret} is not in the recovery key"
        f" format ({FORMAT_HINT}): check the file"
    )


def test_recovery_key_file_opens_the_volume_readonly_status(vol: VolumeEnv) -> None:
    result = sealfs("status", str(vol.store), "--recovery-key-file", str(vol.recovery_file))
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("contents", ["empty", "random-files"])
def test_store_that_is_not_a_volume(vol: VolumeEnv, tmp_path: Path, contents: str) -> None:
    store = tmp_path / "not-a-volume"
    store.mkdir()
    if contents == "random-files":
        (store / "notes.txt").write_text("hello")
        (store / "c").mkdir()
        (store / "c" / "blob").write_bytes(os.urandom(100))
    before = fingerprint(store)
    err = one_line(mount(vol, "--passphrase-file", str(vol.passfile), store=store), DAMAGED)
    assert "sealfs init" in err
    assert "check the path" in err  # at boot, the disk holding the volume may not be there
    err = one_line(sealfs("status", str(store), "--passphrase-file", str(vol.passfile)), DAMAGED)
    assert "sealfs init" in err
    assert fingerprint(store) == before


def test_store_path_that_is_missing_or_a_file(vol: VolumeEnv, tmp_path: Path) -> None:
    """Regression: a mistyped path was "not a sealfs volume" (exit 4), and init on a file
    a failed write of l/0000000000000001 (exit 1)."""
    missing, afile = tmp_path / "typo", tmp_path / "afile"
    afile.write_text("not a directory")
    for command in (["status"], ["key", "list"]):
        result = sealfs(*command, str(missing), "--passphrase-file", str(vol.passfile))
        assert "does not exist: check the path" in one_line(result, USAGE)
    result = sealfs("init", str(afile), "--passphrase-file", str(vol.passfile), *CHEAP_KDF)
    assert "is not a directory" in one_line(result, USAGE)
    assert afile.read_text() == "not a directory" and not missing.exists()


def test_store_path_that_is_a_dangling_symlink(vol: VolumeEnv, tmp_path: Path) -> None:
    """Regression: init said "write l/0000000000000001 failed: File exists" (exit 1)."""
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone")
    result = sealfs("init", str(link), "--passphrase-file", str(vol.passfile), *CHEAP_KDF)
    assert "is a symlink to" in one_line(result, USAGE)
    result = sealfs("status", str(link), "--passphrase-file", str(vol.passfile))
    assert "is a symlink to" in one_line(result, USAGE)
    assert not (tmp_path / "gone").exists()


def test_init_on_an_existing_volume_is_refused(vol: VolumeEnv) -> None:
    result = sealfs("init", str(vol.store), "--passphrase-file", str(vol.passfile), *CHEAP_KDF)
    err = one_line(result, USAGE)
    assert "already" in err
    # README: every error names the fix, not the problem alone.
    assert "sealfs mount" in err and "empty directory" in err, err


def test_init_names_a_store_or_key_file_in_use_before_asking_for_a_passphrase(
    vol: VolumeEnv, tmp_path: Path
) -> None:
    """Regression: init asked for the new passphrase twice (and ran Argon2) before it
    said that the store already held a volume, or that the recovery key file existed;
    key add recovery unlocked first too. Without a passphrase source, they named the
    missing passphrase instead."""
    err = one_line(sealfs("init", str(vol.store), *CHEAP_KDF, env=clean_env()), USAGE)
    assert "already holds a sealfs volume" in err, err
    fresh, old_key = tmp_path / "fresh", tmp_path / "rk.txt"
    old_key.write_text("an older recovery key")
    result = sealfs("init", str(fresh), "--recovery-key-file", str(old_key), *CHEAP_KDF,
                    env=clean_env())  # fmt: skip
    assert f"{old_key} already exists" in one_line(result, USAGE)
    assert not fresh.exists()
    result = sealfs("key", "add", str(vol.store), "recovery", "--new-recovery-key-file",
                    str(old_key), env=clean_env())  # fmt: skip
    assert f"{old_key} already exists" in one_line(result, USAGE)
    assert old_key.read_text() == "an older recovery key"
    # Regression: /dev/stdout "already exists", which named no way to print the key.
    result = sealfs("init", str(fresh), "--recovery-key-file", "/dev/stdout", *CHEAP_KDF,
                    env=clean_env())  # fmt: skip
    err = one_line(result, USAGE)
    assert "/dev/stdout is not a regular file" in err and "leave the option out" in err, err
    assert not fresh.exists()


def test_init_that_fails_on_a_full_disk_leaves_no_directory_it_made(
    vol: VolumeEnv, tmp_path: Path
) -> None:
    """Regression: init on a full disk said "free space and retry" but left the store
    directory it had made, and its l/, and the parents it had made for it."""
    with mounted_tmpfs(tmp_path / "disk", "64k") as disk:
        (disk / "kept").mkdir()  # there before: stays
        ballast = disk / "ballast"
        with contextlib.suppress(OSError), open(ballast, "wb", buffering=0) as f:
            while f.write(bytes(4096)):
                pass
        for target in (disk / "vol", disk / "new" / "parent" / "vol", disk / "kept" / "vol"):
            result = sealfs("init", str(target), "--passphrase-file", str(vol.passfile),
                            *CHEAP_KDF)  # fmt: skip
            assert "store disk full" in one_line(result, 1)
            assert sorted(p.name for p in disk.iterdir()) == ["ballast", "kept"], target
            assert list((disk / "kept").iterdir()) == []
        ballast.unlink()
        result = sealfs("init", str(disk / "vol"), "--passphrase-file", str(vol.passfile),
                        *CHEAP_KDF)  # fmt: skip
        assert result.returncode == 0, result.stderr


def test_init_into_a_non_empty_directory_is_refused(vol: VolumeEnv, tmp_path: Path) -> None:
    target = tmp_path / "full"
    target.mkdir()
    (target / "precious.txt").write_text("do not touch")
    result = sealfs("init", str(target), "--passphrase-file", str(vol.passfile), *CHEAP_KDF)
    err = one_line(result, USAGE)
    assert "empty" in err
    assert fingerprint(target) == {"precious.txt": hashlib.sha256(b"do not touch").hexdigest()}


def test_a_recovery_key_file_inside_the_store_is_refused(vol: VolumeEnv, tmp_path: Path) -> None:
    """Regression: init and key add wrote the key that opens the volume into the store,
    where every backup or rsync of the store copied it (init said "not empty" instead)."""
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    result = sealfs(
        "init", str(fresh), "--passphrase-file", str(vol.passfile), *CHEAP_KDF,
        "--recovery-key-file", str(fresh / "rk.txt"),
    )  # fmt: skip
    assert "is inside the store" in one_line(result, USAGE)
    assert list(fresh.iterdir()) == []
    before = fingerprint(vol.store)
    result = sealfs(
        "key", "add", str(vol.store), "recovery", "--passphrase-file", str(vol.passfile),
        "--new-recovery-key-file", str(vol.store / "rk.txt"),
    )  # fmt: skip
    assert "is inside the store" in one_line(result, USAGE)
    assert fingerprint(vol.store) == before
    # A path through a symlink into the store, then "..": still inside it.
    (tmp_path / "link").symlink_to(vol.store / "l")
    result = sealfs(
        "key", "add", str(vol.store), "recovery", "--passphrase-file", str(vol.passfile),
        "--new-recovery-key-file", f"{tmp_path}/link/../rk.txt",
    )  # fmt: skip
    assert "is inside the store" in one_line(result, USAGE)
    assert fingerprint(vol.store) == before


@pytest.mark.parametrize("command", ["init", "key add"])
def test_a_recovery_key_file_that_cannot_be_made_is_named_with_the_fix(
    vol: VolumeEnv, tmp_path: Path, command: str
) -> None:
    """Regression: "cannot create /x/rk.txt: No such file or directory" said neither that
    the file was the recovery key's nor what to do, where an existing file's refusal did."""
    target = tmp_path / "no-such-dir" / "rk.txt"
    fresh = tmp_path / "fresh"
    if command == "init":
        result = sealfs(
            "init", str(fresh), "--passphrase-file", str(vol.passfile), *CHEAP_KDF,
            "--recovery-key-file", str(target),
        )  # fmt: skip
    else:
        result = sealfs(
            "key", "add", str(vol.store), "recovery", "--passphrase-file", str(vol.passfile),
            "--new-recovery-key-file", str(target),
        )  # fmt: skip
    err = one_line(result, USAGE)
    assert f"cannot create recovery key file {target}: No such file or directory" in err, err
    assert "choose a new file for the recovery key" in err, err
    assert not target.parent.exists()
    assert not fresh.exists() or list(fresh.iterdir()) == []


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
def test_output_into_a_closed_pipe_ends_quietly(vol: VolumeEnv, buffered: bool) -> None:
    """Regression: `sealfs status STORE --json | head -1` printed "sealfs: Broken pipe".
    Buffered stdout (the default for a pipe) was written only at exit, where the failed
    flush printed "Exception ignored ... BrokenPipeError" and exited 120."""
    command = [sys.executable, "-m", "sealfs.cli.main", "status", str(vol.store), "--json",
               "--passphrase-file", str(vol.passfile)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    proc.stdout.close()  # the reader is gone before the status is printed (unlocking first)
    _, err = proc.communicate(timeout=60)
    assert (proc.returncode, err) == (1, b"")


def test_status_of_an_unmounted_mountpoint(vol: VolumeEnv) -> None:
    """Regression: it said the empty directory was not a volume: run 'sealfs init'."""
    result = sealfs("status", str(vol.mnt), "--passphrase-file", str(vol.passfile))
    assert "is neither mounted nor a volume" in one_line(result, DAMAGED)


def test_a_short_new_passphrase_is_refused(vol: VolumeEnv, tmp_path: Path) -> None:
    """Regression: a one-character passphrase made a slot, which a copy of the header lets
    anyone guess offline in a few Argon2 runs."""
    short = tmp_path / "short"
    write_secret(short, "1234567\n")  # seven characters
    fresh = tmp_path / "fresh"
    result = sealfs("init", str(fresh), "--passphrase-file", str(short), *CHEAP_KDF)
    assert "passphrase is shorter than 8 characters" in one_line(result, USAGE)
    assert not fresh.exists() or list(fresh.iterdir()) == []
    result = sealfs(
        "key", "add", str(vol.store), "passphrase", "--passphrase-file", str(vol.passfile),
        "--new-passphrase-file", str(short), *CHEAP_KDF,
    )  # fmt: skip
    assert "new passphrase is shorter than 8 characters" in one_line(result, USAGE)


@pytest.mark.parametrize("command", ["status", "init"])
def test_an_unreachable_s3_endpoint_fails_a_command_by_its_store_timeout(
    tmp_path: Path, command: str
) -> None:
    """Regression: `status` (and init, key, rekey) retried a refused endpoint for 300 s,
    with no option to shorten it, printing a warning every second or two; init then
    showed the option but ignored it."""
    env = {**os.environ, **FAKE_ENV, "XDG_CACHE_HOME": str(tmp_path)}
    started = time.monotonic()
    result = sealfs(
        command, "s3://bucket/volume", "--s3-endpoint", "http://127.0.0.1:1",
        "--store-timeout", "3", "--passphrase-file", str(tmp_path / "none"), env=env,
    )  # fmt: skip
    assert time.monotonic() - started < 30
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) <= 2, lines  # one warning that it retries, then the error
    assert lines[-1].startswith("sealfs: store ") and "unreachable after" in lines[-1], lines
    assert lines[-1].endswith("--store-timeout sets how long sealfs keeps trying"), lines


# Run as `python -c THIS ARGS...`: python ARGS..., with SIGINT at its default action
# (execv keeps a default or ignored disposition, so it must be reset before it). Not a
# preexec_fn: Python code between fork and exec can deadlock beside the moto server's
# thread in this worker (ruff's PLW1509).
SIGINT_AT_DEFAULT_THEN_EXEC = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL);"
    " os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)


def test_ctrl_c_exits_130_with_one_line(tmp_path: Path) -> None:
    """Regression: an interrupted command exited 2, the code of a usage error."""
    env = {**os.environ, **FAKE_ENV, "XDG_CACHE_HOME": str(tmp_path)}
    # Started as a terminal starts it, with SIGINT at its default: a child inherits an
    # ignored SIGINT, and a test run started in the background (`./.ci/run &`) has it
    # ignored, so sealfs ignored the Ctrl-C as it should and retried for 60 s.
    command = [sys.executable, "-c", SIGINT_AT_DEFAULT_THEN_EXEC, "-m", "sealfs.cli.main",
               "status", "s3://bucket/volume", "--s3-endpoint", "http://127.0.0.1:1",
               "--store-timeout", "60"]  # fmt: skip
    proc = subprocess.Popen(
        command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=env,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()  # it retries the refused endpoint: busy, not done
        assert "retr" in first, first
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, (first, rest)
    assert rest.strip() == "sealfs: interrupted"


def test_kdf_memory_the_machine_cannot_give_is_an_error_not_a_bug(tmp_path: Path) -> None:
    """Regression: `sealfs init --kdf-memory 1024` (or unlocking such a slot) where the
    memory cannot be had (a small machine, ulimit -v) ended with "unexpected
    HashingError: Memory allocation error; this is a bug in sealfs", exit 70."""

    def little_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (700 << 20, 700 << 20))

    store, key_file = tmp_path / "store", tmp_path / "recovery-key"
    passfile = write_secret(tmp_path / "pass", "a passphrase of some length\n")
    result = sealfs(
        "init", str(store), "--passphrase-file", str(passfile), "--kdf-memory", "1024",
        "--recovery-key-file", str(key_file), preexec_fn=little_memory,
    )  # fmt: skip
    err = one_line(result, 1)
    assert "Argon2 could not stretch the passphrase with 1024 MiB" in err, err
    assert "ulimit -v" in err
    assert not store.exists() and not key_file.exists()


def test_missing_mountpoint(vol: VolumeEnv) -> None:
    result = sealfs(
        "mount", str(vol.store), str(vol.root / "nowhere"), "--passphrase-file", str(vol.passfile),
        "--log-file", str(vol.log),
    )  # fmt: skip
    err = one_line(result, USAGE)
    assert "does not exist" in err


def test_mountpoint_that_is_a_file(vol: VolumeEnv, tmp_path: Path) -> None:
    target = tmp_path / "afile"
    target.write_text("")
    result = sealfs(
        "mount", str(vol.store), str(target), "--passphrase-file", str(vol.passfile),
        "--log-file", str(vol.log),
    )  # fmt: skip
    err = one_line(result, USAGE)
    assert "not a directory" in err
    assert "empty directory" in err, err  # the fix, not the problem alone


def test_mountpoint_that_is_not_empty(vol: VolumeEnv, tmp_path: Path) -> None:
    """Regression: the mount hid the directory's files, silently."""
    target = tmp_path / "full"
    target.mkdir()
    (target / "f").write_text("hidden by a mount")
    result = sealfs(
        "mount", str(vol.store), str(target), "--passphrase-file", str(vol.passfile),
        "--log-file", str(vol.log),
    )  # fmt: skip
    assert "is not empty" in one_line(result, USAGE)
    assert not os.path.ismount(target)


@pytest.mark.parametrize("problem", ["does not exist", "is not a directory", "is not empty"])
def test_a_mountpoint_that_cannot_serve_is_named_before_asking_for_a_passphrase(
    vol: VolumeEnv, tmp_path: Path, problem: str
) -> None:
    """Regression: mount asked for the passphrase (and ran Argon2, some 0.5 s) before it
    looked at the mountpoint; without a passphrase source it said "no passphrase"."""
    target = tmp_path / "mnt"
    if problem == "is not a directory":
        target.write_text("")
    elif problem == "is not empty":
        target.mkdir()
        (target / "f").write_text("hidden by a mount")
    result = sealfs("mount", str(vol.store), str(target), "--log-file", str(vol.log),
                    env=clean_env())  # fmt: skip
    assert f"mountpoint {target} {problem}" in one_line(result, USAGE)


@pytest.mark.parametrize("where", ["missing-dir", "inside-mountpoint"])
def test_log_file_that_cannot_serve_is_refused_before_mounting(
    vol: VolumeEnv, tmp_path: Path, where: str
) -> None:
    """Regression: the daemon opened its log after the kernel mount existed. A log in a
    missing directory left a dead mount and two lines; one inside the mountpoint made
    the daemon wait on its own mount, and `sealfs mount` never returned."""
    log = tmp_path / "no-such-dir" / "log" if where == "missing-dir" else vol.mnt / "log"
    result = mount(vol, "--passphrase-file", str(vol.passfile), "--log-file", str(log))
    err = one_line(result, USAGE)
    assert ("cannot open log file" if where == "missing-dir" else "inside the mountpoint") in err
    assert not os.path.ismount(vol.mnt) and not log.exists()


def test_a_log_file_that_cannot_be_opened_names_the_fix(vol: VolumeEnv, tmp_path: Path) -> None:
    """Regression: "cannot open log file /x: Is a directory" (or "No such file or
    directory") named no fix."""
    for log, why in ((tmp_path, "Is a directory"), (tmp_path / "gone" / "log", "No such file")):
        result = mount(vol, "--passphrase-file", str(vol.passfile), "--log-file", str(log))
        err = one_line(result, USAGE)
        assert f"cannot open log file {log}: {why}" in err, err
        assert "choose another file with --log-file, or mount with --foreground" in err, err
        assert not os.path.ismount(vol.mnt)


def test_mountpoint_inside_the_store_is_refused(vol: VolumeEnv) -> None:
    """Regression: it mounted, and the plaintext view lay inside the store's directory,
    where a backup or rsync of the store copied it."""
    inner = vol.store / "view"
    inner.mkdir()
    try:
        result = sealfs(
            "mount", str(vol.store), str(inner), "--passphrase-file", str(vol.passfile),
            "--log-file", str(vol.log),
        )  # fmt: skip
        if os.path.ismount(inner):
            sealfs("umount", str(inner))
        assert "inside the store" in one_line(result, USAGE)
    finally:
        inner.rmdir()


def test_cache_dir_inside_the_mountpoint_is_refused_before_creating_it(vol: VolumeEnv) -> None:
    """Regression: the cache directory was made inside the mountpoint first, so the mount
    failed with "not empty", and so did every later mount there."""
    cache = vol.mnt / "cache"
    result = mount(vol, "--passphrase-file", str(vol.passfile), "--cache-dir", str(cache))
    try:
        assert "inside the mountpoint" in one_line(result, USAGE)
        assert list(vol.mnt.iterdir()) == []
    finally:
        if os.path.ismount(vol.mnt):
            sealfs("umount", str(vol.mnt))
        shutil.rmtree(cache, ignore_errors=True)


def test_a_cache_size_without_a_cache_for_a_local_store_is_refused(vol: VolumeEnv) -> None:
    """Regression: `mount STORE MNT --cache-size 512M` on a local store mounted without a
    cache, and without a word: the README says the cache is off there by default, and
    a user took the size for what turns it on."""
    result = mount(vol, "--passphrase-file", str(vol.passfile), "--cache-size", "512M")
    err = one_line(result, USAGE)
    assert "--cache-size" in err and "add --cache-dir DIR" in err, err
    assert not os.path.ismount(vol.mnt)


def test_mountpoint_inside_the_cache_dir_is_refused(vol: VolumeEnv, tmp_path: Path) -> None:
    """Regression: a mount at CACHE/c wrote the cache's copy of each chunk through itself,
    and the first `sealfs sync` deadlocked in the kernel: the fsync of the root held the
    root's lock while the commit's cache write looked a name up under it. Nothing could
    be killed; only aborting the FUSE connection freed the processes."""
    cache = tmp_path / "cache"
    target = cache / "c"
    target.mkdir(parents=True)
    result = sealfs(
        "mount", str(vol.store), str(target), "--passphrase-file", str(vol.passfile),
        "--log-file", str(vol.log), "--cache-dir", str(cache),
    )  # fmt: skip
    try:
        assert "inside the cache directory" in one_line(result, USAGE)
    finally:
        if os.path.ismount(target):  # nothing written: unmounts without a cache write
            subprocess.run(["fusermount3", "-u", str(target)], check=False, timeout=60)
            time.sleep(1)


@pytest.mark.parametrize("where", ["the store", "inside the store", "a copy of the store"])
def test_cache_dir_in_a_store_is_refused(tmp_path: Path, where: str) -> None:
    """Regression: the cache keeps chunks as a local store does (c/<ab>/<id>) and deletes
    them past --cache-size. `--cache-dir STORE` deleted the store's committed chunks as
    the mount started, and files read EIO; a backup copy given as the cache lost its."""
    env = VolumeEnv(tmp_path / "vol")
    env.init()
    try:
        env.mount()
        (env.mnt / "data").write_bytes(os.urandom(3 << 20))
        env.umount()
        copy = tmp_path / "copy"
        shutil.copytree(env.store, copy)
        cache = {"the store": env.store, "inside the store": env.store / "cache"}.get(where, copy)
        before = fingerprint(env.store), fingerprint(copy)
        result = sealfs(*env.mount_args(), "--cache-dir", str(cache), "--cache-size", "1M")
        err = one_line(result, USAGE)
        assert "store" in err and "put it outside" in err
        assert (fingerprint(env.store), fingerprint(copy)) == before
        assert not os.path.ismount(env.mnt)
    finally:
        if env.is_mounted():
            env.umount(check=False)
        assert not env.cleanup(), "a mount or a daemon was left behind"


def test_store_and_mountpoint_swapped(vol: VolumeEnv) -> None:
    """Regression: `sealfs mount MNT STORE` said the empty mountpoint was not a volume and
    to run 'sealfs init' there."""
    result = sealfs(
        "mount", str(vol.mnt), str(vol.store), "--passphrase-file", str(vol.passfile),
        "--log-file", str(vol.log),
    )  # fmt: skip
    assert "the store comes first" in one_line(result, USAGE)
    assert list(vol.mnt.iterdir()) == []


@pytest.mark.parametrize(
    "option",
    [["--commit-interval", "nan"], ["--commit-interval", "inf"], ["--store-timeout", "nan"]],
)
def test_seconds_that_are_not_finite_are_refused(vol: VolumeEnv, option: list[str]) -> None:
    """Regression: NaN passed the `<= 0` check; --commit-interval nan wedged the mount."""
    result = mount(vol, "--passphrase-file", str(vol.passfile), *option)
    assert f"{option[0]} must be a positive number of seconds" in one_line(result, USAGE)
    assert not os.path.ismount(vol.mnt)


def test_a_commit_interval_too_short_to_rest_between_commits_is_refused(vol: VolumeEnv) -> None:
    """Regression: --commit-interval 1e-9 was taken, and the idle daemon spun on its
    commit timer (110 % of a core; a read-only mount's follow timer, 80 %)."""
    result = mount(vol, "--passphrase-file", str(vol.passfile), "--commit-interval", "1e-9")
    err = one_line(result, USAGE)
    assert "--commit-interval must be at least 0.01 seconds, not 1e-09" in err
    assert not os.path.ismount(vol.mnt)


def test_a_log_file_with_foreground_is_refused(vol: VolumeEnv) -> None:
    """Regression: the file was taken and stayed empty; the log went to stderr."""
    result = mount(vol, "--passphrase-file", str(vol.passfile), "--foreground")
    assert "with --foreground sealfs logs to stderr" in one_line(result, USAGE)
    assert not os.path.ismount(vol.mnt)


def test_umount_timeout_must_be_a_number_of_seconds(vol: VolumeEnv) -> None:
    result = sealfs("umount", str(vol.mnt), "--timeout", "nan")
    assert "--timeout must be a non-negative number of seconds" in one_line(result, USAGE)


@pytest.mark.parametrize("url", ["memory://", "file:{dir}/vol", "s3:/bucket/vol"])
def test_store_urls_that_would_keep_nothing_or_land_elsewhere(
    vol: VolumeEnv, tmp_path: Path, url: str
) -> None:
    """Regression: memory:// made a volume that vanished with the command, and a scheme
    without '//' was a relative path (a directory named 'file:' in the current one)."""
    result = sealfs(
        "init", url.format(dir=tmp_path), "--passphrase-file", str(vol.passfile), *CHEAP_KDF,
        cwd=tmp_path,
    )  # fmt: skip
    one_line(result, USAGE)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.fuse
def test_busy_mountpoint_and_second_writer(volume_env: VolumeEnv, tmp_path: Path) -> None:
    """Regression (busy mountpoint): it exited 2, while the README documents 5."""
    env = volume_env
    env.mount()
    try:
        pid = env.status()["pid"]
        # The same volume again on the same (now busy) mountpoint, read-only.
        result = sealfs(
            "mount", str(env.store), str(env.mnt), "--passphrase-file", str(env.passfile),
            "--read-only", "--log-file", str(env.log),
        )  # fmt: skip
        err = one_line(result, BUSY)
        assert "busy" in err
        assert "unmount it" in err and "another empty directory" in err, err  # the fix
        # A second read-write mount of the mounted volume elsewhere names the writer.
        other = tmp_path / "other-mnt"
        other.mkdir()
        before = fingerprint(env.store / "l")
        result = sealfs(
            "mount", str(env.store), str(other), "--passphrase-file", str(env.passfile),
            "--log-file", str(env.log),
        )  # fmt: skip
        err = one_line(result, BUSY)
        assert str(pid) in err, err
        assert not os.path.ismount(other)
        assert fingerprint(env.store / "l") == before
        assert (env.mnt / ".").exists()  # the first mount still answers
    finally:
        env.umount()


@pytest.mark.fuse
def test_sync_and_umount_inside_a_mount_name_its_mountpoint(volume_env: VolumeEnv) -> None:
    """Regression: `sealfs sync .` (or umount) run from a directory of the mount said the
    directory "is not mounted", as if the volume were not, where status named the
    mountpoint to give instead."""
    env = volume_env
    env.mount()
    try:
        (env.mnt / "work").mkdir()
        for command in ("sync", "umount"):
            err = one_line(sealfs(command, str(env.mnt / "work")), USAGE)
            expected = f"{env.mnt}/work is inside the sealfs mount {env.mnt}"
            assert f"{expected}: run 'sealfs {command} {env.mnt}'" in err, err
        assert env.is_mounted()
    finally:
        env.umount()


def test_sync_and_umount_of_a_path_that_does_not_exist_say_so(tmp_path: Path) -> None:
    """It said "is not mounted", which sent users to mount a mistyped path."""
    for command in ("sync", "umount", "status"):
        err = one_line(sealfs(command, str(tmp_path / "mnnt")), USAGE)
        assert f"{tmp_path}/mnnt does not exist" in err, err


@pytest.mark.fuse
def test_too_few_file_descriptors_names_the_limit_to_raise(volume_env: VolumeEnv) -> None:
    """Regression: it said only "daemon failed: [Errno 24] Too many open files"."""
    env = volume_env

    def eight_descriptors() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (8, 8))

    result = sealfs(
        "mount", str(env.store), str(env.mnt), "--passphrase-file", str(env.passfile),
        "--log-file", str(env.log), preexec_fn=eight_descriptors,
    )  # fmt: skip
    err = one_line(result, 1)
    assert "too many open files (this process may open 8)" in err, err
    assert "ulimit -n" in err and "LimitNOFILE=" in err
    assert not env.is_mounted()


def test_unsupported_format_version(vol: VolumeEnv, tmp_path: Path) -> None:
    store = tmp_path / "store"
    shutil.copytree(vol.store, store)
    header = bytearray((store / "sealfs.vol").read_bytes())
    assert header[8:10] == b"\x00\x01"
    header[8:10] = b"\x00\x02"  # docs/format.md section 5: u16 BE at offset 8
    (store / "sealfs.vol").write_bytes(bytes(header))
    before = fingerprint(store)
    err = one_line(mount(vol, "--passphrase-file", str(vol.passfile), store=store), DAMAGED)
    assert "version 2" in err and "not supported" in err, err
    assert fingerprint(store) == before


@pytest.mark.parametrize("command", ["status", "mount"])
def test_a_header_without_metadata_is_refused(vol: VolumeEnv, tmp_path: Path, command: str) -> None:
    """Regression: a store holding sealfs.vol but neither s/ nor l/ (a copy that missed
    them, a cleanup gone wrong) loaded as generation 0, which has no root directory.
    status showed an empty volume and exited 0; mount exited 0 on a mountpoint that said
    "No such file or directory", which `sealfs umount` called "not a sealfs mount", and
    it wrote a new l/0000000000000001 into the store."""
    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    shutil.copy2(vol.store / "sealfs.vol", store / "sealfs.vol")
    before = fingerprint(store)
    unlock = ["--passphrase-file", str(vol.passfile)]
    try:
        if command == "mount":
            result = mount(vol, *unlock, store=store)
        else:
            result = sealfs("status", str(store), *unlock)
        err = one_line(result, DAMAGED)
        assert f"{store} holds a volume header but no metadata" in err, err
        assert "restore s/ and l/ from a backup" in err, err  # the fix
        assert not vol.is_mounted()
    finally:
        vol.cleanup()
    assert fingerprint(store) == before


def test_a_damaged_passphrase_slot_points_to_the_recovery_key_which_names_the_damage(
    vol: VolumeEnv, tmp_path: Path
) -> None:
    """Regression: a flipped bit in the passphrase's keyslot read "wrong passphrase" and
    no more, sending a user sure of the passphrase to check it. A damaged slot cannot be
    told from a wrong secret; the recovery key's slot opens and its MAC check tells."""
    store = tmp_path / "store"
    shutil.copytree(vol.store, store)
    header = bytearray((store / "sealfs.vol").read_bytes())
    (slot,) = [s for s in decode_header(bytes(header)).slots if s.kind == "passphrase"]
    at = bytes(header).index(slot.wrapped_key)
    header[at] ^= 1
    (store / "sealfs.vol").write_bytes(bytes(header))
    before = fingerprint(store)
    err = one_line(sealfs("status", str(store), "--passphrase-file", str(vol.passfile)), WRONG_KEY)
    assert "--recovery-key-file, which also tells whether sealfs.vol is damaged" in err, err
    result = sealfs("status", str(store), "--recovery-key-file", str(vol.recovery_file))
    assert "restore sealfs.vol from a backup" in one_line(result, DAMAGED)
    assert fingerprint(store) == before


def test_a_keyslot_with_unknown_kdf_parameters_names_the_fix(
    vol: VolumeEnv, tmp_path: Path
) -> None:
    """Regression: "keyslot 0: unsupported or malformed KDF parameters" named no fix."""
    store = tmp_path / "store"
    shutil.copytree(vol.store, store)
    header = (store / "sealfs.vol").read_bytes()
    assert header.count(b"argon2id") == 1
    (store / "sealfs.vol").write_bytes(header.replace(b"argon2id", b"argon2ix"))
    result = sealfs("status", str(store), "--passphrase-file", str(vol.passfile))
    err = one_line(result, DAMAGED)
    assert "malformed KDF parameters" in err and "restore sealfs.vol from a backup" in err, err


@pytest.mark.parametrize("damage", ["empty", "10 bytes", "zeroed", "body not msgpack"])
def test_a_damaged_header_names_the_fix(vol: VolumeEnv, tmp_path: Path, damage: str) -> None:
    """Regression: "volume header is 10 bytes, too short", "sealfs.vol is not a sealfs
    volume header (bad magic)" and the like named no fix, where a header of the wrong
    length said to restore sealfs.vol from a backup."""
    store = tmp_path / "store"
    shutil.copytree(vol.store, store)
    header = (store / "sealfs.vol").read_bytes()
    body_end = len(header) - 32  # docs/format.md section 5: prefix, body, 32-byte MAC
    (store / "sealfs.vol").write_bytes(
        {
            "empty": b"",
            "10 bytes": header[:10],
            "zeroed": bytes(len(header)),
            "body not msgpack": header[:14] + b"\xc1" * (body_end - 14) + header[body_end:],
        }[damage]
    )
    before = fingerprint(store)
    for command in (["status"], ["key", "list"]):
        result = sealfs(*command, str(store), "--passphrase-file", str(vol.passfile))
        assert "restore sealfs.vol from a backup" in one_line(result, DAMAGED)
    assert fingerprint(store) == before


def test_kdf_memory_below_minimum_is_refused(vol: VolumeEnv, tmp_path: Path) -> None:
    target = tmp_path / "weak"
    result = sealfs(
        "init", str(target), "--passphrase-file", str(vol.passfile), "--kdf-memory", "32",
        "--kdf-iterations", "1",
    )  # fmt: skip
    err = one_line(result, USAGE)
    assert "--kdf-memory" in err
    assert not target.exists() or not any(target.iterdir())


@pytest.mark.parametrize(
    ("option", "value", "limits"),
    [
        ("--kdf-iterations", "0", "between 1 and 1024"),
        ("--kdf-iterations", "99999999", "between 1 and 1024"),
        ("--kdf-memory", "4000000000", "between 64 and 4096 MiB"),
    ],
)
def test_kdf_option_out_of_range_is_a_usage_error(
    vol: VolumeEnv, tmp_path: Path, option: str, value: str, limits: str
) -> None:
    """Regression: kdf.py refused these as a weak or hostile header: exit 4, option unnamed."""
    target = tmp_path / "new"
    kdf = {"--kdf-memory": "64", "--kdf-iterations": "1", option: value}
    options = [word for pair in kdf.items() for word in pair]
    result = sealfs("init", str(target), "--passphrase-file", str(vol.passfile), *options)
    err = one_line(result, USAGE)
    assert f"{option} must be {limits}" in err, err
    assert not target.exists() or not any(target.iterdir())
    result = sealfs(
        "key", "passwd", str(vol.store), "0", "--passphrase-file", str(vol.passfile),
        "--new-passphrase-file", str(vol.passfile), *options,
    )  # fmt: skip
    err = one_line(result, USAGE)
    assert f"{option} must be {limits}" in err, err


def test_empty_passphrase_file_is_refused(vol: VolumeEnv, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    write_secret(empty, "\n")
    target = tmp_path / "new"
    err = one_line(sealfs("init", str(target), "--passphrase-file", str(empty), *CHEAP_KDF), USAGE)
    assert "empty" in err
    assert not target.exists() or not any(target.iterdir())
    err = one_line(mount(vol, "--passphrase-file", str(empty)), USAGE)
    assert "empty" in err


def secret_file_kinds(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Files no secret may be read from, each with the words its refusal must use."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # no writer: a plain open() blocks forever
    large = tmp_path / "large"
    write_secret(large, b"x" * (64 * 1024 + 1))
    return {
        "fifo": (fifo, "not a regular file"),
        "device": (Path(os.devnull), "not a regular file"),
        "directory": (tmp_path, "not a regular file"),
        "too large": (large, "larger than 64 KiB"),
    }


@pytest.mark.parametrize("kind", ["fifo", "device", "directory", "too large"])
@pytest.mark.parametrize(
    "option", ["--passphrase-file", "--recovery-key-file", "--new-passphrase-file"]
)
def test_secret_file_must_be_a_small_regular_file(
    vol: VolumeEnv, tmp_path: Path, option: str, kind: str
) -> None:
    """Regression: /dev/zero was read until MemoryError (a traceback), a FIFO blocked forever."""
    path, words = secret_file_kinds(tmp_path)[kind]
    unlock = ["--passphrase-file", str(vol.passfile)]
    if option == "--new-passphrase-file":  # read after the unlock, before the header is written
        args = ["key", "passwd", str(vol.store), "0", *unlock, *CHEAP_KDF, option, str(path)]
    else:
        args = ["status", str(vol.store), option, str(path)]
    err = one_line(sealfs(*args, timeout=30), USAGE)
    assert f"file {path} is {words}" in err, err


@pytest.mark.parametrize("given_by", ["option", "variable", "new passphrase variable"])
def test_a_missing_secret_file_names_where_its_path_came_from(
    vol: VolumeEnv, tmp_path: Path, given_by: str
) -> None:
    """Regression: "cannot read passphrase file /x: No such file or directory" named no
    fix, and a path set in the environment (a unit's Environment=), not on the command
    line, left the reader to find where it came from."""
    missing = tmp_path / "typo"
    env = clean_env()
    if given_by == "option":
        args, named = ["status", str(vol.store), "--passphrase-file", str(missing)], ""
    elif given_by == "variable":
        env["SEALFS_PASSPHRASE_FILE"] = str(missing)
        args, named = ["status", str(vol.store)], " (named by SEALFS_PASSPHRASE_FILE)"
    else:
        env["SEALFS_NEW_PASSPHRASE_FILE"] = str(missing)
        args = ["key", "passwd", str(vol.store), "0", "--passphrase-file", str(vol.passfile)]
        named = " (named by SEALFS_NEW_PASSPHRASE_FILE)"
    what = "new passphrase" if given_by.startswith("new") else "passphrase"
    err = one_line(sealfs(*args, env=env), USAGE)
    assert err.endswith(
        f"cannot read {what} file {missing}{named}: No such file or directory: check the path"
    ), err


def test_no_passphrase_source_and_no_terminal(vol: VolumeEnv, tmp_path: Path) -> None:
    err = one_line(mount(vol, env=clean_env()), USAGE)  # stdin is /dev/null
    assert "--passphrase-file" in err
    target = tmp_path / "new"
    err = one_line(sealfs("init", str(target), *CHEAP_KDF, env=clean_env()), USAGE)
    assert "--passphrase-file" in err
    assert not target.exists() or not any(target.iterdir())
