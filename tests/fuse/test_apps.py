"""Real programs on a real mount: SQLite in WAL mode, git, cp -a and diff -r."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fuse.test_posix import manifest, remount
from tests.mounts import VolumeEnv
from tests.prereq import require

pytestmark = [pytest.mark.fuse, pytest.mark.timeout(90)]


def run(
    *command: str | Path, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [str(c) for c in command], capture_output=True, text=True, timeout=30, cwd=cwd, env=env,
        check=False, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert result.returncode == 0, f"{command}: {result.stdout}\n{result.stderr}"
    return result


# -- SQLite ------------------------------------------------------------------------------

ROWS = 5000


def row(k: int) -> tuple[int, str, bytes]:
    return k, f"name-{k}", random.Random(k).randbytes(100 + k % 400)


def expected_rows() -> dict[int, tuple[str, bytes]]:
    rows = {k: row(k)[1:] for k in range(ROWS)}
    for k in range(0, ROWS, 7):
        rows[k] = (f"updated-{k}", rows[k][1])
    for k in range(0, ROWS, 11):
        del rows[k]
    return rows


def check_database(path: Path) -> None:
    con = sqlite3.connect(path, timeout=10)
    try:
        assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert con.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        got = {k: (name, blob) for k, name, blob in con.execute("SELECT id, name, blob FROM t")}
        assert got == expected_rows()
    finally:
        con.close()


def test_sqlite_wal_database(mounted_env: VolumeEnv) -> None:
    path = mounted_env.mnt / "db" / "test.sqlite"
    path.parent.mkdir()
    con = sqlite3.connect(path, timeout=10)
    try:
        assert con.execute("PRAGMA journal_mode=WAL").fetchone()[0] == "wal"
        con.execute("PRAGMA synchronous=FULL")
        con.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, name TEXT NOT NULL, blob BLOB)")
        con.execute("CREATE INDEX t_name ON t (name)")
        con.commit()
        for start in range(0, ROWS, 500):
            with con:
                con.executemany(
                    "INSERT INTO t VALUES (?, ?, ?)", [row(k) for k in range(start, start + 500)]
                )
        assert (path.parent / "test.sqlite-wal").stat().st_size > 0
        with con:
            con.executemany(
                "UPDATE t SET name = ? WHERE id = ?",
                [(f"updated-{k}", k) for k in range(0, ROWS, 7)],
            )
        with con:
            con.executemany("DELETE FROM t WHERE id = ?", [(k,) for k in range(0, ROWS, 11)])
        busy, _, _ = con.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        assert busy == 0
        assert (path.parent / "test.sqlite-wal").stat().st_size == 0
        # A reader on a second connection sees the same data while the writer is open.
        check_database(path)
    finally:
        con.close()
    check_database(path)
    remount(mounted_env)
    check_database(path)


def test_sqlite_wal_survives_remount_without_checkpoint(mounted_env: VolumeEnv) -> None:
    """Committed transactions still in the -wal file (no checkpoint) are durable too."""
    path = mounted_env.mnt / "w.sqlite"
    con = sqlite3.connect(path, timeout=10)
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("PRAGMA wal_autocheckpoint=0")
    con.execute("CREATE TABLE kv (k INTEGER PRIMARY KEY, v TEXT)")
    with con:
        con.executemany("INSERT INTO kv VALUES (?, ?)", [(k, str(k) * 10) for k in range(2000)])
    # Copy the database and its WAL while the connection is open, as a crash would leave them.
    saved = {name: (mounted_env.mnt / name).read_bytes() for name in ("w.sqlite", "w.sqlite-wal")}
    con.close()
    remount(mounted_env)
    for name, data in saved.items():
        (mounted_env.mnt / ("copy-" + name.replace("w.", ""))).write_bytes(data)
    os.rename(mounted_env.mnt / "copy-sqlite", mounted_env.mnt / "c.sqlite")
    os.rename(mounted_env.mnt / "copy-sqlite-wal", mounted_env.mnt / "c.sqlite-wal")
    remount(mounted_env)
    for name in ("w.sqlite", "c.sqlite"):
        con = sqlite3.connect(mounted_env.mnt / name, timeout=10)
        try:
            assert con.execute("PRAGMA integrity_check").fetchone() == ("ok",)
            assert con.execute("SELECT count(*), sum(k) FROM kv").fetchone() == (
                2000,
                sum(range(2000)),
            )
        finally:
            con.close()


_SQLITE_WRITER = """
import sqlite3, sys
con = sqlite3.connect(sys.argv[1], timeout=60, isolation_level=None)
con.execute("PRAGMA busy_timeout=60000")
con.execute("PRAGMA synchronous=NORMAL")
for n in range(40):
    con.execute("BEGIN IMMEDIATE")
    con.execute("INSERT INTO t (writer, n) VALUES (?, ?)", (int(sys.argv[2]), n))
    con.execute("UPDATE total SET v = v + 1")
    con.execute("COMMIT")
con.close()
"""


def test_sqlite_wal_written_by_several_processes_at_once(mounted_env: VolumeEnv) -> None:
    """Processes sharing one WAL database (its -shm mapped by each, POSIX locks between
    them, busy_timeout) lose no transaction."""
    path = mounted_env.mnt / "shared.sqlite"
    con = sqlite3.connect(path)
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("CREATE TABLE t (writer INTEGER, n INTEGER, PRIMARY KEY (writer, n))")
    con.execute("CREATE TABLE total (v INTEGER)")
    con.execute("INSERT INTO total VALUES (0)")
    con.commit()
    con.close()
    writers = [
        subprocess.Popen([sys.executable, "-c", _SQLITE_WRITER, str(path), str(w)])
        for w in range(3)
    ]
    assert [w.wait(60) for w in writers] == [0] * 3
    check_every_transaction(path)
    remount(mounted_env)
    check_every_transaction(path)


def check_every_transaction(path: Path) -> None:
    con = sqlite3.connect(path)
    try:
        assert con.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert con.execute("SELECT count(*), (SELECT v FROM total) FROM t").fetchone() == (120, 120)
    finally:
        con.close()


# -- git ---------------------------------------------------------------------------------


def git_env(home: Path) -> dict[str, str]:
    home.mkdir(exist_ok=True)
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
        "GIT_AUTHOR_DATE": "2020-01-01T00:00:00Z",
        "GIT_COMMITTER_DATE": "2020-01-01T00:00:00Z",
        "LC_ALL": "C",
    }


def test_git_repository(mounted_env: VolumeEnv, tmp_path: Path) -> None:
    require(shutil.which("git") is not None, "git is not installed")
    env = git_env(tmp_path / "home")
    repo = mounted_env.mnt / "repo"

    def git(*args: str) -> str:
        return run("git", "-c", "user.name=t", "-c", "user.email=t@t", *args, cwd=repo, env=env)\
            .stdout  # fmt: skip

    repo.mkdir()
    git("init", "-q", "-b", "main")
    rnd = random.Random(5)
    (repo / "src").mkdir()
    for k in range(40):
        (repo / "src" / f"mod{k}.py").write_text(f"value = {k}\n" * (k + 1))
    (repo / "blob.bin").write_bytes(rnd.randbytes(2 << 20))
    (repo / "run.sh").write_text("#!/bin/sh\necho hi\n")
    os.chmod(repo / "run.sh", 0o755)
    os.symlink("src/mod1.py", repo / "link")
    git("add", "-A")
    git("commit", "-q", "-m", "first")
    git("switch", "-q", "-c", "feature")
    (repo / "src" / "mod3.py").write_text("changed\n")
    os.unlink(repo / "src" / "mod4.py")
    (repo / "new.txt").write_text("new\n")
    git("add", "-A")
    git("commit", "-q", "-m", "on feature")
    git("switch", "-q", "main")
    assert (repo / "src" / "mod4.py").exists()
    assert not (repo / "new.txt").exists()
    git("merge", "-q", "--no-ff", "-m", "merge feature", "feature")
    git("gc", "-q")  # packs objects: renames, fsyncs and a lot of small files
    log = git("log", "--first-parent", "--format=%s", "main")
    assert log.splitlines() == ["merge feature", "first"]
    assert git("log", "--format=%s", "feature").splitlines() == ["on feature", "first"]
    branches = git("branch", "--format=%(refname:short)").split()
    assert branches == ["feature", "main"]
    git("fsck", "--full", "--strict", "--no-progress")
    assert git("status", "--porcelain") == ""
    head = git("rev-parse", "HEAD")
    mode = os.stat(repo / "run.sh").st_mode
    remount(mounted_env)
    git("fsck", "--full", "--strict", "--no-progress")
    assert git("log", "--first-parent", "--format=%s", "main") == log
    assert git("rev-parse", "HEAD") == head
    assert git("status", "--porcelain") == ""
    assert os.stat(repo / "run.sh").st_mode == mode
    assert os.readlink(repo / "link") == "src/mod1.py"
    assert git("cat-file", "-p", "HEAD:src/mod3.py") == "changed\n"


# -- copying trees -----------------------------------------------------------------------


def source_tree(tmp_path: Path) -> Path:
    """A few hundred real files (a package from the venv) plus links, modes and times."""
    spec = next((Path(p) / "pygments" for p in sys.path if (Path(p) / "pygments").is_dir()), None)
    src = tmp_path / "src"
    if spec is not None:
        shutil.copytree(spec, src / "pkg", symlinks=True)
    else:
        shutil.copytree(Path(os.__file__).parent / "json", src / "pkg")
    (src / "extra").mkdir()
    (src / "extra" / "exec").write_bytes(b"#!/bin/sh\n")
    os.chmod(src / "extra" / "exec", 0o750)
    os.symlink("../pkg", src / "extra" / "up")
    os.symlink("missing", src / "extra" / "dangling")
    (src / "extra" / "hard1").write_bytes(b"hard")
    os.link(src / "extra" / "hard1", src / "extra" / "hard2")
    (src / "extra" / "empty").write_bytes(b"")
    (src / "extra" / "big").write_bytes(random.Random(7).randbytes(3 << 20))
    os.utime(src / "extra" / "big", ns=(1_000_000_000_123_456_789, 1_100_000_000_987_654_321))
    return src


def tree_digest(root: Path) -> dict[bytes, tuple[int, str]]:
    out = {}
    for rel, entry in manifest(root, ctime=False).items():
        if stat.S_ISREG(entry["mode"]):
            out[rel] = (entry["size"], entry["sha256"])
    return out


def test_cp_a_tree_in_and_out(mounted_env: VolumeEnv, tmp_path: Path) -> None:
    src = source_tree(tmp_path / "in")
    count = sum(len(files) for _, _, files in os.walk(src))
    assert count >= 200
    dst = mounted_env.mnt / "copy"
    run("cp", "-a", src, dst)
    run("diff", "-r", "--no-dereference", src, dst)
    want = manifest(src, ctime=False)
    got = manifest(dst, ctime=False)
    # cp -a keeps modes, owners, mtimes to the ns, symlinks and hard links (atimes are
    # the source's as cp read them, which relatime may have moved since; a directory's
    # size is its file system's own business).
    for entries in (want, got):
        for entry in entries.values():
            del entry["atime_ns"]
            if stat.S_ISDIR(entry["mode"]):
                del entry["size"]
    assert got == want
    remount(mounted_env)
    run("diff", "-r", "--no-dereference", src, dst)
    assert tree_digest(dst) == tree_digest(src)
    out = tmp_path / "out"
    run("cp", "-a", dst, out)
    run("diff", "-r", "--no-dereference", src, out)
    big = (src / "extra" / "big").read_bytes()
    assert hashlib.sha256((out / "extra" / "big").read_bytes()).digest() == (
        hashlib.sha256(big).digest()
    )
    # A copy inside the mount (copy_file_range falls back to reads and writes).
    run("cp", dst / "extra" / "big", dst / "extra" / "big2")
    assert (dst / "extra" / "big2").read_bytes() == big
    # rm -rf of the whole tree leaves nothing behind, not even orphaned inodes.
    run("rm", "-rf", dst)
    assert os.listdir(mounted_env.mnt) == []
    remount(mounted_env)
    assert os.listdir(mounted_env.mnt) == []
    assert mounted_env.status()["inodes"] == 1
