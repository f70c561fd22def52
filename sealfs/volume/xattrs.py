"""Extended attributes as ext4 takes them: names, namespaces, sizes and access ACLs.

The kernel leaves every one of these rules to a FUSE daemon: it checks neither a
name's length nor its namespace, nor how much one file holds, and passes ACLs on as
opaque values. Programs that copy xattrs (cp -a, rsync -X, tar --xattrs) were
written against ext4's answers, so these are ext4's.
"""

from __future__ import annotations

import errno
import struct
from collections.abc import Mapping

from sealfs.errors import FsError

XATTR_NAME_MAX = 255
XATTR_SIZE_MAX = 65536
XATTR_LIST_MAX = 65536  # the most listxattr(2) returns: every name, NUL-terminated
# Names and values of one file together. Every snapshot and the daemon's memory hold
# them all: without a bound, one file took 128 MiB (2,000 values of 64 KiB).
XATTR_TOTAL_MAX = 1 << 20
XATTR_CREATE = 1
XATTR_REPLACE = 2
# ACLs are not stored: one stored but not applied would be taken as applied (cp -a sets
# modes through it) while the mode bits, which the kernel checks, stay unchanged. An
# access ACL that only restates the mode is applied as a chmod, as ext4 does.
POSIX_ACL_ACCESS = b"system.posix_acl_access"
POSIX_ACL_XATTRS = (POSIX_ACL_ACCESS, b"system.posix_acl_default")
# The namespaces Linux file systems store; any other name (system.*, which the kernel
# leaves wholly to a FUSE daemon, or no known namespace) gets EOPNOTSUPP, as on ext4.
# Stored, a system.* name could be set and removed by any user who could see the file,
# owner or not: the kernel checks no permission for that namespace.
XATTR_NAMESPACES = (b"user.", b"trusted.", b"security.")
XATTR_TRUSTED = b"trusted."  # listed only to CAP_SYS_ADMIN
# The kernel's ACL xattr encoding: a version, then (tag, permissions, id) per entry, in
# tag order. Owner, group and other entries alone are exactly the mode's 0o777 bits.
_ACL_HEADER = struct.Struct("<I")
_ACL_ENTRY = struct.Struct("<HHI")
_ACL_VERSION = 2
_ACL_MODE_TAGS = (0x01, 0x04, 0x20)  # ACL_USER_OBJ, ACL_GROUP_OBJ, ACL_OTHER


def check_name(name: bytes) -> None:
    """Refuse a name as Linux does: ERANGE if empty or too long, EINVAL if a namespace
    has nothing after it ("user.")."""
    if not name or len(name) > XATTR_NAME_MAX:
        raise FsError(errno.ERANGE)
    _, dot, rest = name.partition(b".")
    if dot and not rest:
        raise FsError(errno.EINVAL)


def check_set(xattrs: Mapping[bytes, bytes], name: bytes, value: bytes, flags: int) -> None:
    """Refuse setting name to value among a file's xattrs as ext4 would. An access ACL
    is the caller's to apply (mode_of_acl) before it asks."""
    if name in POSIX_ACL_XATTRS or not is_supported(name):
        raise FsError(errno.EOPNOTSUPP)
    if flags & XATTR_CREATE and name in xattrs:
        raise FsError(errno.EEXIST)
    if flags & XATTR_REPLACE and name not in xattrs:
        raise FsError(errno.ENODATA)
    if name not in xattrs and _names_size(xattrs) + len(name) + 1 > XATTR_LIST_MAX:
        # Past this, listxattr fails with E2BIG and cp -a or rsync -X drop every xattr.
        raise FsError(errno.ENOSPC)
    old = xattrs.get(name)
    grows = len(value) - len(old) if old is not None else len(name) + len(value)
    if grows > 0 and _xattrs_size(xattrs) + grows > XATTR_TOTAL_MAX:
        raise FsError(errno.ENOSPC)  # as a full ext4 inode says; a smaller value still fits


def no_such(name: bytes) -> FsError:
    """The error for a name a file does not have: ENODATA, or EOPNOTSUPP for a name
    outside the namespaces stored (as ext4 answers)."""
    return FsError(errno.ENODATA if is_supported(name) else errno.EOPNOTSUPP)


def is_supported(name: bytes) -> bool:
    """Whether ext4 would take the name (an ACL is taken, though never stored)."""
    return name.startswith(XATTR_NAMESPACES) or name in POSIX_ACL_XATTRS


def mode_of_acl(value: bytes) -> int | None:
    """The permission bits an ACL xattr stands for, if it holds only the owner, group and
    other entries; None for any other ACL."""
    if len(value) != _ACL_HEADER.size + len(_ACL_MODE_TAGS) * _ACL_ENTRY.size:
        return None
    if _ACL_HEADER.unpack_from(value)[0] != _ACL_VERSION:
        return None
    bits = 0
    for k, tag in enumerate(_ACL_MODE_TAGS):
        e_tag, perm, _ = _ACL_ENTRY.unpack_from(value, _ACL_HEADER.size + k * _ACL_ENTRY.size)
        if e_tag != tag or perm > 0o7:
            return None
        bits = bits << 3 | perm
    return bits


def _names_size(xattrs: Mapping[bytes, bytes]) -> int:
    """Bytes listxattr(2) would return: each name with its NUL."""
    return sum(len(name) + 1 for name in xattrs)


def _xattrs_size(xattrs: Mapping[bytes, bytes]) -> int:
    """Bytes a file's xattrs take in metadata: names and values."""
    return sum(len(name) + len(value) for name, value in xattrs.items())
