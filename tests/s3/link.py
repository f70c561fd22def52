"""A narrow link on 127.0.0.1: a TCP proxy that caps the bandwidth towards the server.

The fault proxy (tests/s3/proxy.py) reads a whole request before it forwards it;
this one passes bytes on as they come, in 16 KiB pieces, no faster than the cap
(shared by every connection, as on one link), so a client's body leaves its
socket at once and then drains slowly, as over a real congested link. Bytes
from the server pass at full speed.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from urllib.parse import urlsplit

PIECE = 16 << 10


class NarrowLink:
    """A threaded TCP proxy in front of upstream (http://127.0.0.1:PORT), capping uploads."""

    def __init__(self, upstream: str, bytes_per_second: float) -> None:
        parts = urlsplit(upstream)
        assert parts.hostname == "127.0.0.1", "the link talks to loopback only"
        self.upstream = (parts.hostname, parts.port or 80)
        self.rate = bytes_per_second
        self._link = threading.Lock()  # one piece on the wire at a time
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = int(self._listener.getsockname()[1])
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> NarrowLink:
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def stop(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            live = list(self._sockets)
        for sock in live:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            with self._lock:
                self._sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, narrow: bool) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(PIECE):
                if narrow:
                    with self._link:
                        time.sleep(len(data) / self.rate)
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
