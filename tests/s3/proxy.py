"""A fault-injecting HTTP proxy on 127.0.0.1, between sealfs and the moto server.

On a seeded fraction of requests it fails the way networks and S3 fail:

- drop: close the connection without forwarding (the request never happened)
- drop_after: forward, then close without answering (it happened; nobody heard)
- error_after: forward, then answer 503 (it happened; the answer says it did not)
- 500, 503, slowdown: answer an S3 error document without forwarding
- delay: wait `delay` seconds, then forward
- cut: forward a GET, then send the headers and only half of the body

It can be closed (the port refuses connections and live connections are
dropped) and reopened on the same port, it can strip If-None-Match from
requests to play a service that ignores conditional creates, and it can refuse
requests that carry the checksum headers botocore sends since 1.36, as some
S3-compatible services do (Backblaze B2's answer).

Refusals, never in the default mix (set_faults(rate, [kind]) only): error
documents S3 answers with that are not a server's trouble, or not only that:
skewed (403 RequestTimeTooSkewed: this host's clock is off), incomplete
(400 IncompleteBody: the request's body was cut short in transit) and baddigest
(400 BadDigest: the body's checksum did not match, it was damaged in transit),
expired (400 ExpiredToken) and badtoken (400 InvalidToken: a session token that is
malformed, or given with keys it does not belong to), denied (403 AccessDenied:
a policy without the permission; with methods, one permission missing).
And flip:
forward a GET, then answer with one byte of its body changed (what the
object's checksum, not TCP's, catches).
"""

from __future__ import annotations

import collections
import contextlib
import http.client
import random
import socket
import threading
import time
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

FAULTS = ("drop", "drop_after", "error_after", "500", "503", "slowdown", "delay", "cut")
REFUSALS = ("skewed", "incomplete", "baddigest", "expired", "badtoken", "denied", "flip")
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer",
    "upgrade", "expect", "content-length",
})  # fmt: skip
ERROR_BODIES = {
    "500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "503": (503, "ServiceUnavailable", "Please reduce your request rate."),
    "slowdown": (503, "SlowDown", "Please reduce your request rate."),
    "skewed": (
        403,
        "RequestTimeTooSkewed",
        "The difference between the request time and the current time is too large.",
    ),
    "incomplete": (
        400,
        "IncompleteBody",
        "You did not provide the number of bytes specified by the Content-Length HTTP header",
    ),
    "baddigest": (
        400,
        "BadDigest",
        "The CRC32 you specified did not match the calculated checksum.",
    ),
    "expired": (400, "ExpiredToken", "The provided token has expired."),
    "denied": (403, "AccessDenied", "Access Denied"),
    "badtoken": (400, "InvalidToken", "The provided token is malformed or otherwise invalid."),
    "checksum": (
        400,
        "InvalidArgument",
        "Unsupported header 'x-amz-sdk-checksum-algorithm' received for this API call.",
    ),
}


class FaultProxy:
    """A threaded HTTP proxy in front of upstream (an http://127.0.0.1:PORT URL)."""

    def __init__(self, upstream: str, *, seed: int = 0) -> None:
        parts = urlsplit(upstream)
        assert parts.hostname == "127.0.0.1", "the proxy talks to loopback only"
        self.upstream = (parts.hostname, parts.port or 80)
        self.rate = 0.0
        self.kinds: tuple[str, ...] = FAULTS
        self.methods: frozenset[str] | None = None  # None: faults on every HTTP method
        self.delay = 0.3
        self.strip_if_none_match = False
        self.refuse_checksums = False
        self.injected: collections.Counter[str] = collections.Counter()
        self.seen: collections.Counter[str] = collections.Counter()
        self.continues = 0  # "100 Continue" answers: requests that waited a round trip more
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._sockets: set[socket.socket] = set()
        self.port = 0

    # -- control ------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
        """Listen (on a free port the first time, on the same port after close())."""
        server = _Server(("127.0.0.1", self.port), _Handler)
        server.proxy = self
        self.port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Refuse every connection from now on, and drop the live ones."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        with self._lock:
            live = list(self._sockets)
        for sock in live:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def reopen(self) -> None:
        """Accept connections again on the same port."""
        assert self._server is None, "the proxy is open"
        self.start()

    def stop(self) -> None:
        self.close()

    def set_faults(
        self, rate: float, kinds: Iterable[str] = FAULTS, methods: Iterable[str] | None = None
    ) -> None:
        """From now on fail this fraction of requests, picking among kinds."""
        kinds = tuple(kinds)
        assert all(k in FAULTS + REFUSALS for k in kinds), kinds
        with self._lock:
            self.rate, self.kinds = rate, kinds
            self.methods = frozenset(methods) if methods is not None else None

    def pick(self, method: str) -> str | None:
        with self._lock:
            self.seen[method] += 1
            if self.methods is not None and method not in self.methods:
                return None
            if self.rate <= 0 or self._rng.random() >= self.rate:
                return None
            fault = self._rng.choice(self.kinds)
            self.injected[fault] += 1
            return fault

    def track(self, sock: socket.socket, alive: bool) -> None:
        with self._lock:
            if alive:
                self._sockets.add(sock)
            else:
                self._sockets.discard(sock)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    proxy: FaultProxy


class _BodyCutShort(Exception):
    """A request's body ended before its declared length: its client went away."""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.server.proxy.track(self.connection, alive=True)

    def finish(self) -> None:
        self.server.proxy.track(self.connection, alive=False)
        with contextlib.suppress(OSError):
            super().finish()

    def log_message(self, format: str, *args: object) -> None:
        """Quiet."""

    def handle_expect_100(self) -> bool:
        """Answer "Expect: 100-continue" as S3 does, counting it (a round trip more)."""
        with self.server.proxy._lock:
            self.server.proxy.continues += 1
        return super().handle_expect_100()

    def do_GET(self) -> None:
        self._handle()

    def do_HEAD(self) -> None:
        self._handle()

    def do_PUT(self) -> None:
        self._handle()

    def do_POST(self) -> None:
        self._handle()

    def do_DELETE(self) -> None:
        self._handle()

    # -- one request -----------------------------------------------------------------------

    def _handle(self) -> None:
        proxy = self.server.proxy
        try:
            body = self._read_body()
        except _BodyCutShort:  # the client died mid-body: S3 would store nothing
            self._drop()
            return
        fault = proxy.pick(self.command)
        if proxy.refuse_checksums and any(
            name.lower().startswith(("x-amz-checksum-", "x-amz-sdk-checksum-"))
            for name in self.headers
        ):
            fault = "checksum"
        if fault == "drop":
            self._drop()
            return
        if fault in ERROR_BODIES:
            self._error(fault)
            return
        if fault == "delay":
            time.sleep(proxy.delay)
        try:
            status, headers, data = self._forward(body)
        except (OSError, http.client.HTTPException):
            self._drop()
            return
        if fault == "drop_after":
            self._drop()
            return
        if fault == "error_after":
            self._error("503")
            return
        if fault == "cut" and self.command == "GET" and len(data) >= 2:
            self._send_head(status, headers, len(data))
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self._drop()
            return
        if fault == "flip" and self.command == "GET" and data:
            data = bytes([data[0] ^ 0x01]) + data[1:]
        length = len(data)
        if self.command == "HEAD":
            length = int({k.lower(): v for k, v in headers}.get("content-length") or 0)
        self._send_head(status, headers, length)
        if self.command != "HEAD" and data:
            self.wfile.write(data)

    def _read_body(self) -> bytes:
        """The request's whole body; _BodyCutShort if the connection ended before it did.

        Forwarding what came, with its own length, would turn a daemon killed mid-PUT
        into a complete PUT of a shorter object, which no S3 stores (it answers
        IncompleteBody, or never hears the end of the request)."""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            parts = []
            while True:
                line = self.rfile.readline()
                if not line.endswith(b"\n"):
                    raise _BodyCutShort
                size = int(line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while (trailer := self.rfile.readline()) not in (b"\r\n", b"\n"):
                        if not trailer:
                            raise _BodyCutShort
                    return b"".join(parts)
                parts.append(self._read_exactly(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length", "0") or 0)
        return self._read_exactly(length)

    def _read_exactly(self, size: int) -> bytes:
        data = self.rfile.read(size) if size else b""
        if len(data) != size:
            raise _BodyCutShort
        return data

    def _forward(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        if self.server.proxy.strip_if_none_match:
            headers = {k: v for k, v in headers.items() if k.lower() != "if-none-match"}
        if body or self.command in ("PUT", "POST"):
            headers["Content-Length"] = str(len(body))
        host, port = self.server.proxy.upstream
        upstream = http.client.HTTPConnection(host, port, timeout=60)  # one per request:
        try:  # a reused connection gone stale could make us send a PUT twice
            upstream.request(self.command, self.path, body=body or None, headers=headers)
            response = upstream.getresponse()
            return response.status, response.getheaders(), response.read()
        finally:
            upstream.close()

    def _send_head(self, status: int, headers: list[tuple[str, str]], length: int) -> None:
        self.send_response_only(status)
        for name, value in headers:
            if name.lower() not in HOP_BY_HOP:
                self.send_header(name, value)
        self.send_header("Content-Length", str(length))
        self.end_headers()

    def _error(self, kind: str) -> None:
        status, code, message = ERROR_BODIES[kind]
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{message}</Message>"
            "<RequestId>proxy</RequestId></Error>"
        ).encode()
        self.send_response_only(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body) if self.command != "HEAD" else 0))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _drop(self) -> None:
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.wfile.flush()
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)
