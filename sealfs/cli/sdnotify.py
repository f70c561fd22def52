"""Readiness for systemd's Type=notify services: one datagram to $NOTIFY_SOCKET.

Under Type=simple a unit that needs the mount (After=, Requires=) started as
soon as the daemon was spawned, before the volume was unlocked and mounted,
and found an empty directory. With Type=notify systemd waits for "READY=1",
sent once the kernel serves the mount.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)

NOTIFY_SOCKET = "NOTIFY_SOCKET"
# A datagram to a socket whose queue is full waits for room: bounded, so that a
# manager that does not read its socket cannot keep `sealfs mount` from returning.
SEND_TIMEOUT = 10.0


def notify_ready(main_pid: int | None = None) -> None:
    """Tell the service manager, if one asked, that the mount is live.

    main_pid names the daemon when the process systemd started (the one that
    forked it) is about to exit: systemd then watches the daemon instead.
    """
    address = os.environ.get(NOTIFY_SOCKET)
    if not address:
        return
    message = "READY=1" if main_pid is None else f"MAINPID={main_pid}\nREADY=1"
    try:
        _send(address, message.encode())
    except OSError as exc:
        # The mount works; the unit's start fails, systemd never being told. Say why.
        log.warning(
            "cannot tell systemd the mount is ready (%s=%s): %s", NOTIFY_SOCKET, address, exc
        )


def _send(address: str, message: bytes) -> None:
    # "@name" is a socket in the abstract namespace, as in sd_notify(3).
    target = "\0" + address[1:] if address.startswith("@") else address
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(SEND_TIMEOUT)
        sock.connect(target)
        sock.sendall(message)
