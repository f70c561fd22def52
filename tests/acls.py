"""POSIX ACLs as the kernel hands them to a FUSE daemon (system.posix_acl_* xattr values)."""

from __future__ import annotations

import struct

USER_OBJ, USER, GROUP_OBJ, MASK, OTHER = 0x01, 0x02, 0x04, 0x10, 0x20
UNDEFINED_ID = 0xFFFFFFFF


def acl_xattr(*entries: tuple[int, int] | tuple[int, int, int]) -> bytes:
    """Version 2, then (tag, permissions[, id]) entries, in the order the kernel requires."""
    rows = (entry if len(entry) == 3 else (*entry, UNDEFINED_ID) for entry in entries)
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *row) for row in rows)


def mode_acl(mode: int) -> bytes:
    """What setfacl and cp -a write for a mode: owner, group and other entries only."""
    return acl_xattr((USER_OBJ, mode >> 6 & 7), (GROUP_OBJ, mode >> 3 & 7), (OTHER, mode & 7))


# An owner, a named user, the group, a mask and others: more than a mode can say.
NAMED_USER_ACL = acl_xattr((USER_OBJ, 6), (USER, 4, 1000), (GROUP_OBJ, 4), (MASK, 4), (OTHER, 0))
