"""Keeping key material out of core dumps.

A mount daemon holds the master key for as long as it lives, and every
command that unlocks holds it for a while. A crash dump (a core file, or
systemd-coredump and apport, which store dumps on local disk) would write it
there, where the threat model says key material never goes. A process that
is not dumpable also cannot be ptraced by other processes of its user; root
still can, so debuggers run as root keep working.
"""

from __future__ import annotations

import ctypes
import logging
import resource

log = logging.getLogger("sealfs")

PR_SET_DUMPABLE = 4  # from <linux/prctl.h>


def forbid_core_dumps() -> None:
    """Make this process (and the daemons it forks) write no core dump of any kind.

    RLIMIT_CORE 0 stops core files; only PR_SET_DUMPABLE 0 stops dumps piped
    to a handler (core_pattern "|..."), which the kernel runs whatever the limit.
    """
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        log.warning("could not turn off core dumps: errno %d", ctypes.get_errno())
