"""The sealfs commands: each one's name, the module that defines it and its one-line help.

Kept free of imports on purpose: `sealfs --help` lists every command from this
table, and main imports only the module of the command being run, since the
others (rich for status, the keyslot editors for key) would slow every start,
a mount's included.
"""

from __future__ import annotations

from typing import NamedTuple


class Command(NamedTuple):
    module: str  # defines add_parsers(sub), which adds this command (and its module's others)
    help: str


COMMANDS: dict[str, Command] = {
    "init": Command("sealfs.cli.init_cmd", "create a new encrypted volume in a store"),
    "mount": Command("sealfs.cli.mount_cmd", "mount a volume as a directory"),
    "sync": Command("sealfs.cli.mount_cmd", "commit everything now (syncfs does not reach FUSE)"),
    "umount": Command("sealfs.cli.mount_cmd", "commit everything, then unmount"),
    "status": Command("sealfs.cli.status_cmd", "show generation, sizes and cache use"),
    "key": Command("sealfs.cli.key_cmd", "list, add, remove or change a volume's keyslots"),
    "rekey": Command(
        "sealfs.cli.rekey_cmd", "new master key; re-encrypts everything, drops the old"
    ),
}
