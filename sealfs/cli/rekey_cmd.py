"""`sealfs rekey STORE`: a new master key, every object re-sealed, the old key dropped.

For a suspected compromise of the master key or of a slot's secret: keyslot
changes cannot revoke those (whoever held one may have kept the master key).
This command writes the header of a new key epoch (a new random master key,
re-wrapped in every keyslot it keeps, the old one wrapped under it), then the
volume's writer re-seals every object of the old epoch and drops the old key
(sealfs.volume.rekey). The writer is the mount daemon when the volume is
mounted on this host (the command hands it the new key through the mount's
root and follows its progress), else this command itself. Run again after a
crash, it resumes; so does the next mount.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Iterator

import trio
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from sealfs.cli.keysource import (
    get_pin,
    kms_clients,
    module_override,
    passphrase_configured,
    recovery_secret,
    unlock_header,
)
from sealfs.cli.mount_cmd import read_status
from sealfs.cli.paths import check_store_is_callers
from sealfs.cli.secrets import get_passphrase
from sealfs.cli.seen import SeenVolume, kept_current
from sealfs.cli.stdio import error_line
from sealfs.cli.units import format_size
from sealfs.cli.unlock import add_unlock_options, store_from
from sealfs.crypto.subkeys import derive_subkeys
from sealfs.errors import ConfigError, SealfsError, WriterConflictError
from sealfs.fuse.mount import mounts
from sealfs.fuse.operations import REKEY_XATTR, TAKE_KEY_XATTR
from sealfs.keys.header import Keyslot, VolumeHeader, decode_header
from sealfs.keys.hsm import TokenKey, check_trusted_module, pkcs11_slot_maker
from sealfs.keys.hsm import params_from_slot as token_params
from sealfs.keys.kms import KmsClients, kms_slot_maker
from sealfs.keys.kms import params_from_slot as kms_params
from sealfs.keys.rekey import begin_rekey
from sealfs.keys.slots import (
    KIND_AWS_KMS,
    KIND_PASSPHRASE,
    KIND_PKCS11,
    KIND_RECOVERY,
    Passphrase,
    RecoveryKey,
    SlotMaker,
    Unlocked,
    argon2_params_from_slot,
    opens_slot,
    passphrase_slot_maker,
    recovery_slot_maker,
)
from sealfs.store.base import ObjectStore, store_location
from sealfs.volume.engine import Volume
from sealfs.volume.header_io import HeaderVersion, read_header_version, write_header
from sealfs.volume.loader import (
    Loaded,
    check_writer,
    claim_writer,
    load_unlocked,
    writer_alive,
)
from sealfs.volume.options import VolumeOptions
from sealfs.volume.rekey import PROGRESS_NEWS, RekeyProgress
from sealfs.wording import counted

POLL_SECONDS = 0.25
# What the error of a stopped rekey adds, whether it ran on a mount or here.
RERUN = "the old key stays until the rekey finishes: fix the cause, then run 'sealfs rekey' again"


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "rekey",
        help="new master key; re-encrypts everything, drops the old",
    )
    p.add_argument("store", help="the volume's store (directory, file:// or s3:// URL)")
    add_unlock_options(p)
    p.add_argument(
        "--drop-slot",
        type=int,
        action="append",
        default=[],
        metavar="SLOT",
        help="do not carry this keyslot over to the new key (a secret that may have leaked, or"
        " a passphrase or recovery slot whose secret you do not give); repeatable",
    )
    p.add_argument(
        "--no-wait",
        action="store_true",
        help="when mounted: return once the daemon uses the new key; it re-encrypts in the"
        " background ('sealfs status' shows progress)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    check_store_is_callers(args.store)
    store = store_from(args)
    version = read_header_version(store)
    unlocked = unlock_header(args, version.data)
    # Checked as a mount checks (the record read before the load, see unlock_seen): the
    # rekey commits its own generations, after which no mount could tell a rollback, and
    # the commits the store had dropped were lost without a word.
    seen = SeenVolume.of(unlocked.header.volume_id, args.store, store)
    recorded = seen.recorded()
    loaded = load_unlocked(store, unlocked)
    seen.check_load(recorded, loaded)
    with contextlib.ExitStack() as held:
        live = _live_mountpoint(loaded)
        if live is not None:
            held.callback(os.close, live.root)
            _check_daemon_takes_keys(live)  # before the header changes
        master, header = _new_epoch(args, unlocked, store, version)
        if live is not None:
            _hand_over(live, master)
    _report_followers(loaded, header.data_epoch)  # they read both epochs while it runs
    if live is not None:
        if args.no_wait:
            print(f"The daemon of {live.path} re-encrypts in the background.")
            return 0
        progress = _follow_mount(live.path)
    else:
        if loaded.keys.retired_epoch is None:  # started just now: same state, new keys
            loaded.keys.advance(header.data_epoch, derive_subkeys(master, header.volume_id))
            loaded.header = header
        check_writer(loaded, takeover=False)
        claim_writer(loaded)
        # It re-seals chunks, and stores none new: no index to find similar ones.
        volume = Volume(loaded, VolumeOptions(index_similar=False))
        with kept_current(seen, lambda: volume.commits.head):  # its commits, as a mount's
            progress = trio.run(_rekey_here, volume)
    print(
        f"Rekey done: key epoch {progress.from_epoch} is gone;"
        f" {counted(progress.resealed, 'object')} ({format_size(progress.resealed_bytes)})"
        f" re-encrypted in {progress.seconds():.1f} s."
    )
    return 0


def _report_followers(loaded: Loaded, epoch: int) -> None:
    """Have each read-only mount of the volume on this host take the new key, and say
    whether it did.

    Each unlocks the new header by itself if it can (sealfs.volume.follower), but only
    when it meets the rekey: at the writer's next commit, or at its first read of a
    re-sealed file. One that cannot stops following and must be remounted, which the
    command's output did not say: its reads told, some time later.
    """
    for mountpoint in _sealfs_mounts():
        if _follower_status(loaded, mountpoint) is None:
            continue
        try:
            status = json.loads(os.getxattr(mountpoint, TAKE_KEY_XATTR.decode()))
        except OSError as exc:
            if exc.errno == errno.EPERM:  # another user's mount (--allow-other let us see it)
                said = (
                    "belongs to another user, and only they or root may have it take the new"
                    " key now: it takes it by itself when it meets the rekey, if it can"
                )
            else:  # a daemon older than this request (ENODATA), which stops at a rekey
                said = f"cannot be asked to take the new key ({exc.strerror}): remount it"
        else:
            stopped, held = status.get("follow_stopped"), status.get("key_epoch")
            if stopped:
                said = f"not following ({stopped}): remount it"
            elif isinstance(held, int) and held >= epoch:
                said = "follows under the new key"
            else:  # the store or key service did not answer: it tries again by itself
                where = status.get("log_file") or "its stderr"
                said = f"has not taken the new key yet: its log ({where}) says why"
        print(f"Read-only mount {mountpoint}: {said}.")


def _follower_status(loaded: Loaded, mountpoint: str) -> dict[str, object] | None:
    """The status of the mount at mountpoint if it is a read-only mount of this volume
    and store, else None (another volume, a writer, a mount gone meanwhile)."""
    try:
        status = read_status(mountpoint)
    except OSError:
        return None
    if not status.get("read_only") or status.get("volume_id") != loaded.volume_id.hex():
        return None
    if not _same_store(status.get("store_location"), store_location(loaded.store)):
        return None
    return status


def _new_epoch(
    args: argparse.Namespace, unlocked: Unlocked, store: ObjectStore, version: HeaderVersion
) -> tuple[bytes, VolumeHeader]:
    """The new master key and the header naming its epoch: written now, or (a rekey
    that was stopped) the one the store holds already."""
    header = unlocked.header
    if header.retired is not None:
        print(f"Resuming the rekey to key epoch {header.data_epoch}.")
        return unlocked.master_key, header  # its slots already open the new key
    with kms_clients(args) as clients:
        makers = _slot_makers(args, unlocked, clients)
        data, master = begin_rekey(unlocked, makers)
    write_header(store, version, data)
    header = decode_header(data)
    dropped = sorted(s.slot_id for s in unlocked.header.slots if s.slot_id not in makers)
    print(f"Key epoch {header.data_epoch}: new master key written to the header.", end="")
    print(f" Dropped keyslots: {', '.join(map(str, dropped))}." if dropped else "")
    return master, header


def _hand_over(live: LiveMount, master: bytes) -> None:
    """Give the live mount's daemon the new master key, through the root held open
    (never by path: see LiveMount). Raises SealfsError naming the mount if it fails.

    The header names the new epoch by then: a daemon stopped meanwhile (systemctl
    stop unmounts lazily, whatever holds the root) leaves the rekey to the next
    mount, which resumes it. The OSError alone said "Transport endpoint is not
    connected: 3", the descriptor's number where a path was, and not what to do.
    """
    try:
        os.setxattr(live.root, REKEY_XATTR.decode(), master)
    except OSError as exc:
        raise SealfsError(
            f"the mount on {live.path} did not take the new key ({exc.strerror}). The"
            " header names the new key epoch already: the next mount of the volume resumes"
            " the rekey (or run 'sealfs rekey' again)"
        ) from None


def _slot_makers(
    args: argparse.Namespace, unlocked: Unlocked, clients: KmsClients
) -> dict[int, SlotMaker]:
    """How each kept slot is re-made for the new master key; ConfigError for one that can't be."""
    slots = unlocked.header.slots
    unknown = set(args.drop_slot) - {s.slot_id for s in slots}
    if unknown:
        ids = ", ".join(str(s.slot_id) for s in slots)
        raise ConfigError(f"--drop-slot {min(unknown)}: no such keyslot (the slots are {ids})")
    makers: dict[int, SlotMaker] = {}
    for slot in slots:
        if slot.slot_id in args.drop_slot:
            continue
        maker = _carry(args, unlocked, slot, clients)
        if maker is None:
            raise ConfigError(
                f"keyslot {slot.slot_id} ({slot.kind}) can only be re-made with its own secret:"
                f" give it too ({_SECRET_OPTION.get(slot.kind, 'its secret')}), or --drop-slot"
                f" {slot.slot_id} and add it again after the rekey ('sealfs key add')"
            )
        makers[slot.slot_id] = maker
    return makers


_SECRET_OPTION = {KIND_PASSPHRASE: "--passphrase-file", KIND_RECOVERY: "--recovery-key-file"}


def _carry(
    args: argparse.Namespace, unlocked: Unlocked, slot: Keyslot, clients: KmsClients
) -> SlotMaker | None:
    secret = (
        unlocked.secret if slot.slot_id == unlocked.slot_id else _given_for(args, unlocked, slot)
    )
    if isinstance(secret, Passphrase):
        params = argon2_params_from_slot(slot)  # same cost, new salt
        return passphrase_slot_maker(secret.value, dataclasses.replace(params, salt=os.urandom(16)))
    if isinstance(secret, RecoveryKey):
        return recovery_slot_maker(secret.value)
    if slot.kind == KIND_AWS_KMS:
        kp = kms_params(slot)
        return kms_slot_maker(clients, kp.key_id, kp.region)
    if slot.kind == KIND_PKCS11:
        tp = token_params(slot)
        module = module_override(args) or check_trusted_module(tp.module)
        return pkcs11_slot_maker(TokenKey(module, tp.token, tp.key), get_pin(args, tp.token))
    return None


def _given_for(
    args: argparse.Namespace, unlocked: Unlocked, slot: Keyslot
) -> Passphrase | RecoveryKey | None:
    """The secret given for a passphrase or recovery slot other than the one that
    unlocked: --recovery-key-file, or the passphrase (its file, variable or credential,
    or asked for on a terminal). Given both, the recovery key unlocks, and the
    passphrase was ignored: the rekey refused to keep the passphrase slot unless
    dropped, which a volume made by `sealfs init` (a passphrase and a recovery slot)
    always met. None if no such secret was given; ConfigError if it does not open the
    slot."""
    secret: Passphrase | RecoveryKey
    if slot.kind == KIND_RECOVERY and args.recovery_key_file:
        secret, option = recovery_secret(args.recovery_key_file), "--recovery-key-file"
    elif slot.kind == KIND_PASSPHRASE and isinstance(unlocked.secret, Passphrase):
        secret, option = unlocked.secret, "the passphrase given"
    elif slot.kind == KIND_PASSPHRASE and (passphrase_configured(args) or sys.stdin.isatty()):
        if sys.stdin.isatty() and not passphrase_configured(args):
            print(f"Keyslot {slot.slot_id} is a passphrase slot: to keep it,", file=sys.stderr)
        secret = Passphrase(get_passphrase(args.passphrase_file, confirm=False))
        option = "the passphrase given"
    else:
        return None
    if opens_slot(slot, unlocked.header, secret):
        return secret
    raise ConfigError(
        f"keyslot {slot.slot_id} ({slot.kind}) does not open with {option} (a rekey takes one"
        f" passphrase and one recovery key): give the one that opens it, or --drop-slot"
        f" {slot.slot_id} and add it again after the rekey ('sealfs key add')"
    )


@dataclasses.dataclass(frozen=True)
class LiveMount:
    """The live mount of the volume's writer: its path, and its root, held open.

    The new master key goes to the daemon as an xattr of the mount's root. Set
    by path, it went wherever the path led by then: a mount unmounted meanwhile
    (the slot re-wrapping, an Argon2 run or a KMS call, takes seconds) left
    the key in the xattrs of the plain directory under it, on local disk, where
    every user who can read that directory could read it. A descriptor of the
    root always reaches the mount (ENOTCONN once its daemon is gone), and while
    it is open a plain unmount fails as busy.
    """

    path: str
    root: int


def _live_mountpoint(loaded: Loaded) -> LiveMount | None:
    """The live writer's mount on this host, its root held open (the caller closes it);
    None if no writer is live."""
    w = loaded.live.writer
    if w is None or w.released:
        return None
    if w.host != socket.gethostname():
        raise WriterConflictError(
            f"volume is mounted read-write by host {w.host} pid {w.pid}: run 'sealfs rekey'"
            " there, or unmount it first"
        )
    if not writer_alive(w):
        return None  # that writer crashed: this command takes over
    for mountpoint in _sealfs_mounts():
        root = _open_root(mountpoint)
        if root is None:
            continue
        try:
            if _writer_serves(loaded, root, mountpoint):
                return LiveMount(mountpoint, root)
        except BaseException:
            os.close(root)
            raise
        os.close(root)
    raise WriterConflictError(
        f"volume is mounted read-write by pid {w.pid} on this host, but none of this"
        " namespace's sealfs mounts is it: run 'sealfs rekey' where it is mounted"
    )


def _open_root(mountpoint: str) -> int | None:
    """A descriptor of mountpoint's root; None if it cannot be opened (a dead mount)."""
    try:
        return os.open(mountpoint, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None


def _writer_serves(loaded: Loaded, root: int, mountpoint: str) -> bool:
    """Whether the mount whose root is open as root is the volume's live writer.

    Raises WriterConflictError if it is, but serves another copy of the store."""
    w = loaded.live.writer
    assert w is not None
    try:
        status = read_status(root)
    except OSError:
        return False
    if status.get("pid") != w.pid or status.get("volume_id") != loaded.volume_id.hex():
        return False
    served = str(status.get("store", ""))
    if not _same_store(status.get("store_location"), store_location(loaded.store)):
        # A copy of the volume made while that mount wrote (rsync, cp -a) keeps
        # its writer record. Handed over, the key failed the daemon's check of
        # its own header (EINVAL) after this store's header had changed.
        raise WriterConflictError(
            f"this store's writer record names pid {w.pid}, which serves another"
            f" copy of the volume ({served}) on {mountpoint}: this store is a copy"
            f" made while that mount wrote; unmount {mountpoint} first, then run"
            " 'sealfs rekey' again"
        )
    return True


def _same_store(served: object, ours: str) -> bool:
    """Whether a daemon's store (the location its status gives) is this command's: the
    same location, or for local stores the same directory (a bind mount, say).

    A daemon older than the field gives none: taken for this store's, as before."""
    if served is None or served == ours:
        return True
    prefix = "local store at "
    if not (isinstance(served, str) and served.startswith(prefix) and ours.startswith(prefix)):
        return False
    try:
        return os.path.samefile(served[len(prefix) :], ours[len(prefix) :])
    except OSError:
        return False


def _check_daemon_takes_keys(live: LiveMount) -> None:
    """Raise ConfigError unless the daemon of the live mount can be handed a new key.

    A daemon started by a build older than rekeying on a mount (sealfs upgraded under a
    running mount) takes the root's rekey attribute for an ordinary one: it stored the
    new master key in the volume's metadata, where anyone who can read the mount's root
    reads it, started no rekey, and this command waited for one forever. An empty value
    tells them apart before anything is written: a daemon that knows the request refuses
    it (EINVAL), an older one stores it, and is asked to drop it again.
    """
    name, mountpoint = REKEY_XATTR.decode(), live.path
    try:
        os.setxattr(live.root, name, b"")
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return
        if exc.errno == errno.EROFS:
            raise ConfigError(
                f"{mountpoint} takes no new key: its daemon stopped committing or is read-only"
                f" (see 'sealfs status {mountpoint}'); nothing was changed"
            ) from None
        raise ConfigError(
            f"{mountpoint} refused the new key ({exc.strerror}); nothing was changed"
        ) from None
    try:
        os.removexattr(live.root, name)
    except OSError as exc:
        error_line(f"could not remove the probe attribute {name} from {mountpoint}: {exc.strerror}")
    raise ConfigError(
        f"the daemon of {mountpoint} is older than rekeying on a mount and cannot take the new"
        f" key: unmount it ('sealfs umount {mountpoint}'), run 'sealfs rekey' again, then mount"
        " it with this version; nothing was changed"
    )


def _sealfs_mounts() -> list[str]:
    return [mountpoint for mountpoint, kind in mounts() if kind == "fuse.sealfs"]


def _bar() -> Progress:
    return Progress(
        TextColumn("re-encrypting"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("objects"),
        TimeElapsedColumn(),
        TextColumn("{task.description}", markup=False),  # an error, which may name a path
        disable=not sys.stdout.isatty(),
    )


def _follow_mount(mountpoint: str) -> RekeyProgress:
    with _bar() as bar:
        task = bar.add_task("", total=None)
        while True:
            try:
                raw = read_status(mountpoint).get("rekey")
            except OSError as exc:
                raise ConfigError(
                    f"{mountpoint} stopped answering ({exc.strerror}): the rekey resumes at the"
                    " next mount, or run 'sealfs rekey' again"
                ) from None
            if isinstance(raw, dict):
                progress = RekeyProgress.from_dict(raw)
                bar.update(task, total=progress.listed, completed=progress.checked,
                           description=progress.error or "")  # fmt: skip
                if progress.finished:
                    return progress
                if progress.stopped:
                    raise SealfsError(
                        f"the rekey of {mountpoint} stopped: {progress.error}; {RERUN}"
                    )
            time.sleep(POLL_SECONDS)


class _StopsSaidOnce(logging.Filter):
    """Drops the rekey's lines that its progress says too (PROGRESS_NEWS) while this
    command runs it. Written for a daemon's log, they said each stop twice here: a pause
    shows in the progress bar, and a stop is the command's error."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(getattr(record, name, False) for name in PROGRESS_NEWS)


async def _rekey_here(volume: Volume) -> RekeyProgress:
    with _filtered(logging.getLogger("sealfs.volume"), _StopsSaidOnce()):
        return await _rekey_with_bar(volume)


@contextlib.contextmanager
def _filtered(logger: logging.Logger, kept_out: logging.Filter) -> Iterator[None]:
    logger.addFilter(kept_out)
    try:
        yield
    finally:
        logger.removeFilter(kept_out)


async def _rekey_with_bar(volume: Volume) -> RekeyProgress:
    async with volume.running():
        rekey = volume.rekey
        assert rekey is not None
        with _bar() as bar:
            task = bar.add_task("", total=None)
            while not rekey.ended.is_set():
                p = rekey.progress
                bar.update(task, total=p.listed, completed=p.checked, description=p.error or "")
                with trio.move_on_after(POLL_SECONDS):
                    await rekey.ended.wait()
            bar.update(task, total=rekey.progress.listed, completed=rekey.progress.checked)
    if not rekey.progress.finished:  # stopped: say why, once the volume is released
        failure = rekey.failure or SealfsError(f"the rekey stopped: {rekey.progress.error}")
        raise type(failure)(f"{failure}; {RERUN}")
    return rekey.progress
