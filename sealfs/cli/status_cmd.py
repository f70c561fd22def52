"""`sealfs status MOUNTPOINT|STORE`: what a volume holds and how it is doing."""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from sealfs.cli.commands import COMMANDS
from sealfs.cli.mount_cmd import daemon_log_file, mounted_status, read_status
from sealfs.cli.paths import user_path
from sealfs.cli.units import format_size, format_time
from sealfs.cli.unlock import add_unlock_options, unlock_seen
from sealfs.errors import ConfigError, NotAVolumeError, SealfsError
from sealfs.fuse.mount import is_empty_dir, mount_kind, mount_table, sealfs_mount_above
from sealfs.keys.header import HEADER_NAME
from sealfs.store.url import is_local_url, local_path
from sealfs.volume.engine import Volume
from sealfs.volume.loader import Loaded, writer_alive
from sealfs.volume.options import VolumeOptions
from sealfs.volume.status import volume_status
from sealfs.wording import counted

COMMIT_NEWS_AFTER = 1.0  # seconds; a commit quicker than this is routine, not news


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("status", help=COMMANDS["status"].help)
    p.add_argument(
        "target",
        type=user_path,
        help="a mountpoint of a live mount, or a store (asks to unlock)",
    )
    add_unlock_options(p)
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(run=run)


def _gather(args: argparse.Namespace) -> dict[str, Any]:
    if _is_mount_to_ask(args.target):
        status = mounted_status(args.target)
        if status is None:
            raise SealfsError(  # exit 1, as sync and umount say it
                f"the daemon of {args.target} has died: run 'sealfs umount {args.target}'"
            )
        return status
    target = args.target
    # Local stores only: an s3:// or file:// URL, made absolute against the working
    # directory, lay "inside" the mount that status was run from.
    if is_local_url(target):
        local = local_path(target)
        above = sealfs_mount_above(str(local))
        if above is not None and not (local / HEADER_NAME).exists():
            # A plain directory of the mount was taken for a store: "not a volume: run init".
            raise ConfigError(
                f"{target} is inside the sealfs mount {above}: run 'sealfs status {above}'"
            )
    if _is_empty_dir(target):  # an unmounted mountpoint, likely
        raise NotAVolumeError(
            f"{target} is neither mounted nor a volume: give a live mountpoint or a store"
            f" (or create a volume there with 'sealfs init {target}')"
        )
    args.store = target
    loaded, _, recorded, _ = unlock_seen(args)  # the record as it was before the load
    status = volume_status(Volume(loaded, VolumeOptions(read_only=True)))
    status["pid"] = None
    status["seen_generation"] = None if recorded is None else recorded[0]
    status["writer"] = _writer(loaded)
    if status["writer"] is not None:
        # Only the writer's memory knows: 0 told an operator about to back up or shut
        # down that nothing was pending while 5 MiB was.
        status["pending_bytes"] = status["buffered_bytes"] = status["pending_records"] = None
    return status


def _writer(loaded: Loaded) -> dict[str, Any] | None:
    """The mount that holds the volume for writing, as the store names it (None once it
    released it): on this host, whether it runs and where it is mounted."""
    writer = loaded.live.writer
    if writer is None or writer.released:
        return None
    here = writer.host == socket.gethostname()
    alive = writer_alive(writer) if here else None
    return {
        "host": writer.host,
        "pid": writer.pid,
        "since_ns": writer.since_ns,
        "this_host": here,
        "alive": alive,
        "mountpoint": _mountpoint_of(loaded.volume_id, writer.pid) if alive else None,
    }


def _mountpoint_of(volume_id: bytes, pid: int) -> str | None:
    """Where the daemon pid serves the volume on this host, if this user can ask it."""
    source = f"sealfs:{volume_id.hex()[:8]}"
    for entry in mount_table():
        if entry.kind != "fuse.sealfs" or entry.source != source:
            continue
        try:
            if read_status(entry.mountpoint).get("pid") == pid:
                return entry.mountpoint
        except (OSError, ValueError):  # dead, another user's, or not answering as sealfs
            continue
    return None


def _is_mount_to_ask(target: str) -> bool:
    """Whether target names a mount whose daemon to ask, rather than a store.

    A store on a disk of its own, a bind mount or NFS is a mountpoint as well: such a
    store was refused as "an ext4 mount, not a sealfs mount". Any other mount there is
    still taken for a mountpoint given by mistake, and said to be one.
    """
    kind = mount_kind(target)
    if kind is None:
        return False
    return kind == "fuse.sealfs" or not os.path.exists(os.path.join(target, HEADER_NAME))


def _is_empty_dir(target: str) -> bool:
    """is_empty_dir, but False for a directory this user may not list: a store of
    another user, about which opening it says what is wrong and what to do (this
    said only "Permission denied: STORE")."""
    try:
        return is_empty_dir(target)
    except PermissionError:
        return False


def run(args: argparse.Namespace) -> int:
    status = _gather(args)
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    table = Table(title="sealfs status", show_header=False)
    table.add_column()
    table.add_column(overflow="fold")  # wrap a long path or URL; cut, it names nothing
    for label, value in _rows(status):
        table.add_row(label, value)
    # Values are plain text: a path holding "[/]" was taken for markup (MarkupError, exit
    # 70), "[red]" vanished from the path shown, and ":thumbs_up:" became an emoji.
    Console(markup=False, emoji=False).print(table)
    return 0


def _rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    logical, unique, stored = s["logical_bytes"], s["unique_bytes"], s["stored_bytes"]
    # A daemon started before an upgrade sends no data_bytes: its ratio counts holes.
    data = s.get("data_bytes", logical)
    when = format_time(s["last_commit_ns"])
    rows = [
        ("store", s["store"]),
        ("volume id", s["volume_id"]),
        ("generation", str(s["generation"])),
        *_seen(s),
        ("last commit", when),
        ("pending", _pending(s)),
        *_writer_rows(s),
        *_running(s),
        *_failing(s),
        ("files", f"{s['files']} ({s['inodes']} inodes)"),
        ("logical size", f"{format_size(logical)} ({format_size(data)} {_outside(s)})"),
        ("after dedup", f"{format_size(unique)} ({_ratio(data, unique)})"),
        ("stored", f"{format_size(stored)} ({_ratio(unique, stored)} compression)"),
        ("chunks", str(s["chunks"])),
    ]
    if s.get("store_chunk_bytes") is not None:  # a daemon older than the field sends none
        rows.append(("chunks in store", _store_chunks(s)))
    rows.append(("memory cache", format_size(s["memory_cache_bytes"])))
    rows.append(("key epoch", str(s.get("key_epoch", 0))))
    rekey = s.get("rekey")
    if rekey:
        state = "done" if rekey["finished"] else f"{rekey['checked']}/{rekey['listed']} objects"
        halt = "stopped (run 'sealfs rekey' again once fixed)" if rekey.get("stopped") else "paused"
        detail = f"; {halt}: {rekey['error']}" if rekey.get("error") else ""
        rows.append(("rekey", f"epoch {rekey['from_epoch']} -> {rekey['to_epoch']}: {state}"
                              f", {rekey['resealed']} re-encrypted{detail}"))  # fmt: skip
    elif s.get("retired_epoch") is not None:  # a store, or a read-only mount: nothing runs it
        rows.append(("rekey", f"epoch {s['retired_epoch']} -> {s.get('key_epoch', 0)}: unfinished;"
                              " a writable mount or 'sealfs rekey' finishes it"))  # fmt: skip
    if s.get("disk_cache_bytes") is not None:
        rows.append(("disk cache", format_size(s["disk_cache_bytes"])))
    if s.get("store_requests"):
        counts = sorted(s["store_requests"].items())
        rows.append(("store requests", ", ".join(f"{method} {n}" for method, n in counts)))
    if s.get("pid"):
        mode = "read-only" if s["read_only"] else "read-write"
        state = ", FENCED" if s["fenced"] else ", STOPPED" if s.get("stopped") else ""
        rows.append(("daemon", f"pid {s['pid']}, {mode}{state}"))
        log_file = daemon_log_file(s)
        where = "not known (a daemon of an older sealfs)" if log_file is None else log_file
        rows.append(("daemon log", where or "its stderr (--foreground)"))
        if s.get("stopped") and not s["fenced"]:
            rows.append(("stopped", str(s["stopped"])))
        if s.get("follow_stopped"):
            rows.append(("not following", f"{s['follow_stopped']}; remount to see later changes"))
    return rows


def _seen(s: dict[str, Any]) -> list[tuple[str, str]]:
    """For a store: the newest generation this host saw there, if it saw one."""
    seen = s.get("seen_generation")
    if seen is None:
        return []
    behind = seen > s["generation"]
    return [("seen on this host", f"generation {seen}" + (" (the store is behind it: rolled"
             " back or restored; a mount needs --accept-rollback)" if behind else ""))]  # fmt: skip


def _outside(s: dict[str, Any]) -> str:
    """What the bytes outside holes count: committed ones only (the sizes and ratios come
    from the sealed extents). Right after the quick start's echo, "12 B (0 B outside
    holes)" read as a file of holes."""
    return "committed outside holes" if s["pending_bytes"] else "outside holes"


def _writer_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """For a store: the mount holding it for writing, and where to ask it."""
    writer = s.get("writer")
    if writer is None:
        return []
    since = format_time(writer["since_ns"])
    who = f"pid {writer['pid']}"
    if not writer["this_host"]:
        state = "not released: mounted there, or crashed without unmounting"
        return [("writer", f"host {writer['host']} {who}, since {since} ({state})")]
    if not writer["alive"]:
        state = (
            "gone, without unmounting (what it had not committed is lost; the next mount"
            " takes the volume over)"
        )
        return [("writer", f"{who} on this host, since {since}: {state}")]
    where = writer["mountpoint"]
    if where is None:  # another user's mount, which this one cannot ask
        return [("writer", f"{who} on this host, since {since}")]
    ask = f"'sealfs status {where}' shows what it has not committed"
    return [("writer", f"{who} on this host, mounted at {where}, since {since}; {ask}")]


def _failing(s: dict[str, Any]) -> list[tuple[str, str]]:
    """The commits failing since the last one succeeded, or a read-only mount's looks or
    new key, and why (a daemon older than the fields sends none)."""
    rows = []
    failure = s.get("commit_failure")
    if failure:
        rows.append((
            "commits failing",
            f"{_since(failure)}; nothing written is dropped, retried until the store takes"
            f" it): {failure['error']}",
        ))  # fmt: skip
    for failure in s.get("follow_failing", []):
        rows.append(("following", f"{failure['what']} failing {_since(failure)}; retried):"
                                  f" {failure['error']}"))  # fmt: skip
    return rows


def _since(failure: dict[str, Any]) -> str:
    return f"since {format_time(failure['since_ns'])} ({counted(failure['attempts'], 'attempt')}"


def _running(s: dict[str, Any]) -> list[tuple[str, str]]:
    """A commit running for more than COMMIT_NEWS_AFTER: during an outage the first
    commit waits the whole --store-timeout before it fails, and status looked like an
    idle mount's until then (a daemon older than the field sends none)."""
    since = s.get("commit_running_since_ns")
    if since is None:
        return []
    running = (time.time_ns() - since) / 1e9
    if running < COMMIT_NEWS_AFTER:
        return []
    return [
        (
            "commit running",
            f"for {running:.0f} s, since {format_time(since)}; fsync, sync and umount wait"
            " for it (one that cannot reach the store gives up after --store-timeout)",
        )
    ]


def _pending(s: dict[str, Any]) -> str:
    """What a crash now would lose; how much of it is still in memory (a daemon started
    before an upgrade sends no buffered_bytes)."""
    if s["pending_bytes"] is None:  # a store that a writer holds
        return "not known from the store: only the writer's mount holds it (see writer)"
    text = f"{format_size(s['pending_bytes'])} not committed"
    if s.get("buffered_bytes") is not None:
        text += f" ({format_size(s['buffered_bytes'])} in memory)"
    return f"{text}, {s['pending_records']} records"


def _store_chunks(s: dict[str, Any]) -> str:
    """All chunks stored: nothing is collected yet, so those of deleted and overwritten
    data stay in the store, which "stored" (today's files only) leaves out."""
    unreferenced = s["store_chunk_bytes"] - s["stored_bytes"]
    return (
        f"{format_size(s['store_chunk_bytes'])} in {counted(s['store_chunks'], 'chunk')}"
        f" ({format_size(unreferenced)} no longer referenced)"
    )


def _ratio(a: int, b: int) -> str:
    return f"{a / b:.2f}x" if b else "n/a"
