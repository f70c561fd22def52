"""The xattr rules alone, without a volume: what an ACL stands for, and ext4's limits."""

from __future__ import annotations

import errno
import struct

import pytest

from sealfs.errors import FsError
from sealfs.volume import xattrs
from tests.acls import NAMED_USER_ACL, mode_acl


def test_an_acl_of_owner_group_and_other_stands_for_its_mode() -> None:
    for mode in range(0o1000):
        assert xattrs.mode_of_acl(mode_acl(mode)) == mode, oct(mode)


def test_an_acl_that_says_more_than_a_mode_stands_for_none() -> None:
    assert xattrs.mode_of_acl(NAMED_USER_ACL) is None
    other_version = struct.pack("<I", 3) + mode_acl(0o644)[4:]
    assert xattrs.mode_of_acl(other_version) is None
    assert xattrs.mode_of_acl(mode_acl(0o644)[:-1]) is None


@pytest.mark.parametrize(
    ("name", "code"),
    [(b"", errno.ERANGE), (b"user." + b"n" * 251, errno.ERANGE), (b"user.", errno.EINVAL)],
)
def test_names_linux_refuses(name: bytes, code: int) -> None:
    with pytest.raises(FsError) as info:
        xattrs.check_name(name)
    assert info.value.errno == code


def test_a_file_s_xattrs_stop_at_the_total_bound_but_a_smaller_value_still_fits() -> None:
    value = b"v" * xattrs.XATTR_SIZE_MAX
    held = {f"user.{k:02}".encode(): value for k in range(15)}  # 15 of the 16 that fit
    with pytest.raises(FsError) as info:
        xattrs.check_set(held, b"user.more", value, 0)
    assert info.value.errno == errno.ENOSPC
    xattrs.check_set(held, b"user.more", b"small", 0)
    xattrs.check_set(held, b"user.00", b"smaller", xattrs.XATTR_REPLACE)
