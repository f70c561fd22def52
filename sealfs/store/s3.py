"""S3Store: objects in an S3 bucket (AWS S3 or any S3-compatible service), over boto3.

Object "c/ab/xyz" is the key PREFIX/c/ab/xyz of the bucket; several volumes
can share a bucket under different prefixes. Nothing but the sealed bytes is
stored: no user metadata, no tags, no content type beyond the default.

Conditional writes carry the generation race and the header replacement:
put_if_absent is a PutObject with `If-None-Match: *`, put_if_match one with
`If-Match: ETAG`. A service that ignores those headers would silently let two
writers overwrite each other, so `sealfs init` probes for them
(probe_conditional_writes) and refuses such a service.

This module owns the mapping of S3 and HTTP failures to store errors; it never
retries (botocore's own retries are disabled: RetryingStore is the one retry
layer). A PUT that S3 acknowledged is durable, so sync() is a no-op.

Fork safety: the boto3 session and client are made lazily, per process (a
daemon forks after unlocking, and a forked child must never share the
parent's connection pool), and under a lock (creating a client is not
thread-safe; using one is). Clients left over from a parent process are kept
referenced, never closed or collected: their sockets' descriptors were closed
by the daemon and may since have been reused.
"""

from __future__ import annotations

import collections
import contextlib
import http.client
import os
import re
import secrets
import socket
import ssl
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import boto3
import botocore.exceptions as bex
import urllib3.exceptions
from botocore.config import Config

from sealfs.errors import (
    ConfigError,
    NoCredentialsError,
    ObjectExistsError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StoreError,
    TransientStoreError,
    without_userinfo,
)
from sealfs.store.base import (
    PROBE_PREFIX,
    ObjectInfo,
    ObjectStore,
    is_valid_name,
    refuse_too_large,
    validate_name,
    validate_prefix,
)
from sealfs.store.url import normalize_key_prefix, validate_bucket

T = TypeVar("T")

FREE_BYTES = 1 << 50  # S3 is unbounded for statfs purposes: report 1 PiB
CONNECT_TIMEOUT = 10.0
READ_TIMEOUT = 60.0

# Error codes (and HTTP statuses) worth retrying: throttling, server trouble, timeouts.
_TRANSIENT_CODES = frozenset({
    "SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling",
    "ThrottlingException", "ThrottledException", "RequestThrottled", "RequestLimitExceeded",
    "TooManyRequestsException", "BandwidthLimitExceeded", "OperationAborted",
    "ConditionalRequestConflict", "PriorRequestNotComplete", "RequestTimeoutException",
    "InternalServerError", "BadGateway", "GatewayTimeout", "500", "502", "503", "504",
    "IncompleteBody",  # 400: the request's body was cut short in transit
    "BadDigest",  # 400: the body's checksum did not match: it was damaged in transit
})  # fmt: skip
_TRANSIENT_STATUS = frozenset({429, 500, 502, 503, 504})
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NotFound", "404"})
_EXPIRED_CODES = frozenset({"ExpiredToken", "TokenRefreshRequired"})
_WRITES = frozenset({"put", "put_if_absent", "put_if_match", "delete"})  # store methods
_REGION_CODES = frozenset({"PermanentRedirect", "AuthorizationHeaderMalformed", "301"})

# Clients' transport failures that a later attempt may not meet.
_TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (
    bex.HTTPClientError,  # ConnectionClosedError, ReadTimeoutError, ResponseStreamingError
    bex.ConnectionError,  # EndpointConnectionError, ConnectTimeoutError
    bex.IncompleteReadError,
    bex.ResponseStreamingError,
    bex.FlexibleChecksumError,
    urllib3.exceptions.HTTPError,
    http.client.HTTPException,
    ConnectionError,
    socket.timeout,
)

# Transport failures that are a timeout: the service, or the link to it, too slow.
_TIMEOUT_ERRORS: tuple[type[BaseException], ...] = (
    bex.ReadTimeoutError,
    bex.ConnectTimeoutError,
    urllib3.exceptions.TimeoutError,
    TimeoutError,  # socket.timeout
)


class _TimedOut(TransientStoreError):
    """A request that ran out of time (transient, like any transport failure)."""


class _Uploads:
    """How many PUT bodies may be on their way at once, and how long a PUT's answer may
    take, both adapted as TCP adapts its window and its retransmission timeout.

    A PUT's read timeout runs from the moment its body left this process, into
    socket buffers. Over a narrow link the bodies sent side by side drain
    together, each took longer than the timeout, and every retry sent them side
    by side again: six 256 KiB puts behind 512 KB/s (3 s of transfer, 1.5 s
    timeout) took 49 s and 94 requests; a commit of 8 MiB at 100 KB/s, each put
    cut after 60 s, never finished. So a timeout halves the window, and a
    window's worth of puts that succeed widens it by one. A put waits for room
    only while puts succeed: once none has for `patience` (a request's timeout)
    it goes anyway, so against a dead service, which times every put out, puts
    do not queue behind each other's timeouts past the store timeout.

    A timed-out body is not taken back either: the kernel still sends what it
    had buffered, and the next puts queue behind it. So a timeout also doubles
    the timeout of the next puts (`level`, up to half the store timeout, so
    that a dead service is still given up on about when it was), and a put
    answered within half the base timeout halves it again.
    """

    def __init__(self, most: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._most = most
        self.size = most
        self.level = 0  # the base timeout doubled this many times
        self._active = 0
        self._successes = 0
        self._progress = self._clock()  # when a put last succeeded
        # When the first put that timed out since the last success was sent: no put has
        # succeeded since then (None: none has timed out since the last success).
        self._failing_since: float | None = None
        self._cond = threading.Condition()

    def enter(self, patience: float) -> None:
        """Wait for room in the window, but not once no put has succeeded for patience.

        That clock runs from the last success, or from when the first put that timed
        out since was sent, never from this put's arrival: against a dead service each
        put that arrived while the window was shut waited patience (the store timeout,
        when it is under a minute) before its request, which took as long again, and
        puts that came later queued anew: an fsync given --store-timeout 12 failed
        after 36 s, the next after 49 s (24 s before the window).
        """
        arrived = self._clock()
        with self._cond:
            while self._active >= self.size:
                since = arrived if self._failing_since is None else self._failing_since
                left = patience - (self._clock() - max(self._progress, since))
                if left <= 0:
                    break
                self._cond.wait(left)
            self._active += 1

    def leave(self, timed_out: bool, quick: bool, level: int, top_level: int, sent: float) -> None:
        """A put sent (at monotonic time `sent`) with the timeout of `level` ended. Puts
        that time out together raise the level once, not once each (as TCP backs off
        once per loss)."""
        with self._cond:
            self._active -= 1
            if timed_out:
                self.size = max(1, self.size // 2)
                self._successes = 0
                if level == self.level:
                    self.level = min(top_level, self.level + 1)
                if self._failing_since is None or sent < self._failing_since:
                    self._failing_since = sent
            else:
                self._progress = self._clock()
                self._failing_since = None
                if quick:
                    self.level = max(0, self.level - 1)
                if self.size < self._most:
                    self._successes += 1
                    if self._successes >= self.size:
                        self.size += 1
                        self._successes = 0
            self._cond.notify_all()


# Every live S3Store, so that a fork can give each a fresh lock in the child.
_instances: weakref.WeakSet[S3Store] = weakref.WeakSet()


class _Sessions:
    """boto3 sessions per (pid, profile, region).

    A session caches the service model, which makes a second client ten times
    cheaper to create. Sessions are not thread-safe: clients are made from
    them only under the lock.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_key: dict[tuple[int, str | None, str | None], Any] = {}

    def reset_after_fork(self) -> None:
        self.lock = threading.Lock()  # the parent's may be held by a thread now gone
        self.by_key.clear()


_SESSIONS = _Sessions()


def _after_fork_in_child() -> None:
    _SESSIONS.reset_after_fork()
    for store in list(_instances):
        store._reset_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


# AWS partitions other than the main one, by region prefix: bucket names are unique
# within a partition only.
_PARTITIONS = (
    ("cn-", "aws-cn"),
    ("us-gov-", "aws-us-gov"),
    ("us-isob-", "aws-iso-b"),
    ("us-iso-", "aws-iso"),
    ("eu-isoe-", "aws-iso-e"),
    ("us-isof-", "aws-iso-f"),
)


def _strip_userinfo(url: str) -> str:
    """The endpoint URL without any user:password@ part, for messages."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


_DEFAULT_PORTS = {"http": 80, "https": 443}


def _endpoint_location(endpoint: str) -> str:
    """An endpoint URL as the client reaches it: scheme and host in any case, the
    default port given or not, a trailing slash or not."""
    parts = urlsplit(_strip_userinfo(endpoint))
    scheme = parts.scheme.lower()
    netloc = parts.netloc.lower()
    with contextlib.suppress(ValueError):  # a port that is no number: left as written
        if parts.port is not None and parts.port == _DEFAULT_PORTS.get(scheme):
            netloc = netloc.rsplit(":", 1)[0]
    return urlunsplit((scheme, netloc, parts.path.rstrip("/"), "", ""))


_BRACKETED_HOST_RE = re.compile(r"\[[^\[\]/@]+\](:[0-9]+)?")


def _check_endpoint(endpoint: str | None, source: str) -> None:
    """Raise ConfigError for an endpoint URL that names no HTTP service.

    botocore took a mistyped scheme ("htp://") or port (99999) and failed each
    request with "Custom endpoint ... was not a valid URI": exit 1, and no word
    of where the URL came from. The URL is not echoed: it may carry credentials.
    """
    if not endpoint:
        return
    try:
        parts = urlsplit(endpoint)
    except ValueError:  # a "[" not closed, or no IPv6 address in it
        parts = urlsplit("")
    try:
        port_ok = parts.port is None or parts.port > 0
    except ValueError:  # no number, or out of range
        port_ok = False
    host = endpoint.partition("://")[2].split("/", 1)[0].rpartition("@")[2]
    if "[" in host or "]" in host:
        if not _BRACKETED_HOST_RE.fullmatch(host) or not parts.hostname:
            # urlsplit raised ValueError ("Invalid IPv6 URL"): exit 70, "a bug in sealfs".
            raise ConfigError(
                f"the S3 endpoint in {source} has a malformed [address]: only an IPv6"
                " address goes in brackets, closed before the port: http://[ADDRESS]:PORT"
                " (e.g. http://[::1]:9000)"
            )
    elif host.count(":") > 1:
        # http://::1:9000 cannot tell the address from the port: urlsplit took "" for
        # the host, and the message named no bracket.
        raise ConfigError(
            f"the S3 endpoint in {source} holds an IPv6 address without brackets: write it"
            " as http://[ADDRESS]:PORT (e.g. http://[::1]:9000)"
        )
    if parts.scheme.lower() not in _DEFAULT_PORTS or not parts.hostname or not port_ok:
        raise ConfigError(
            f"the S3 endpoint in {source} is not a URL of an HTTP service: give"
            " http://HOST[:PORT] or https://HOST[:PORT]"
        )


def _check_no_bucket_in(endpoint: str | None, source: str, bucket: str) -> None:
    """Raise ConfigError for an endpoint whose path ends with the bucket's name: with
    path-style addressing every key then went under /BUCKET/BUCKET/..., and the volume
    read as "not a sealfs volume" (a path of a proxy in front of the service is kept)."""
    if not endpoint:
        return
    path = urlsplit(endpoint).path.strip("/")
    if path and path.rsplit("/", 1)[-1] == bucket:
        raise ConfigError(
            f"the S3 endpoint in {source} ends with the bucket's name (/{bucket}): the bucket"
            " goes in the store URL only (s3://BUCKET/PREFIX); give the endpoint without it"
        )


def _without_expect_continue(request: Any, **_: Any) -> None:
    """Send a PutObject's body with its headers, not after a "100 Continue".

    botocore asks every PutObject to wait for the server's "100 Continue"
    before it sends the body: one more round trip per PUT (up to 1 s, after
    which it sends anyway). Behind 50 ms of latency a PUT took 106 ms instead
    of 57, and the fsync of a 1 MiB checkpoint (a chunk, then the segment)
    222 ms instead of ~115. The wait only saves sending a body that the
    server refuses (a fenced segment create, a denied policy): rare for
    sealfs, and its objects are at most a few MiB. Expect is not signed, so
    dropping it here leaves the signature valid.
    """
    if "Expect" in request.headers:
        del request.headers["Expect"]


def _read_at_most(body: Any, limit: int) -> bytes:
    """The body's bytes, but no more than limit of them.

    Read until a read returns nothing (or limit is reached): that last read is
    where botocore checks the body's length and checksum, which a read of a byte
    count that the body fits in never reaches; it returned bytes changed in
    transit, which a chunk's open then took for damage in the store.
    """
    parts: list[bytes] = []
    size = 0
    while size < limit and (part := body.read(limit - size)):
        parts.append(part)
        size += len(part)
    return b"".join(parts)


class S3Store:
    """An ObjectStore in an S3 bucket under a key prefix. Thread-safe and fork-safe.

    Raises ObjectNotFoundError, ObjectExistsError, PreconditionFailedError,
    TransientStoreError (throttling, 5xx, timeouts, dropped connections, short
    bodies) or StoreError (permissions, missing bucket, bad credentials, each
    with a one-line fix). Never retries. `requests` counts the HTTP requests
    sent, per store method ("get", "put", "list", ...).
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        profile: str | None = None,
        max_pool: int = 16,
        connect_timeout: float = CONNECT_TIMEOUT,
        read_timeout: float = READ_TIMEOUT,
        max_read_timeout: float | None = None,
    ) -> None:
        """max_read_timeout: how far slow PUTs may stretch read_timeout (see _Uploads);
        by default twice it."""
        if max_pool < 1:
            raise ConfigError("the S3 connection pool needs at least one connection")
        self.bucket = validate_bucket(bucket)
        self.prefix = normalize_key_prefix(prefix)
        self._root = f"{self.prefix}/" if self.prefix else ""
        self.endpoint_url = endpoint_url or None
        # First: urlsplit raises ValueError for a malformed [IPv6 address].
        _check_endpoint(self._custom_endpoint(), self._endpoint_source())
        _check_no_bucket_in(self._custom_endpoint(), self._endpoint_source(), self.bucket)
        if endpoint_url and "@" in urlsplit(endpoint_url).netloc:
            raise ConfigError(
                "the S3 endpoint URL takes no credentials: use the environment, a profile"
                " or an instance role"
            )
        self.region = region or None
        self.profile = profile or None
        self.max_pool = max_pool
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        longest = max(read_timeout, max_read_timeout or 2 * read_timeout)
        self._top_level = 0  # doublings of read_timeout that stay within longest
        while read_timeout * 2 ** (self._top_level + 1) <= longest:
            self._top_level += 1
        self.requests: collections.Counter[str] = collections.Counter()
        self.list_page_size = 1000  # keys per ListObjectsV2 page (S3's maximum)
        self._lock = threading.Lock()
        self._clients: dict[int, Any] = {}  # by level: read_timeout doubled level times
        self._pid = 0
        self._stale_clients: list[Any] = []  # a parent's clients: never closed here (see above)
        self._uploads = _Uploads(max_pool)
        _instances.add(self)

    # -- clients, per process ---------------------------------------------------------

    def _reset_after_fork(self) -> None:
        """In a forked child: a fresh lock (the parent's may be held by a thread now gone)."""
        self._lock = threading.Lock()
        self._uploads = _Uploads(self.max_pool)  # its lock may be held by a gone thread
        self._stale_clients += self._clients.values()
        self._clients = {}

    def _get_client(self, level: int = 0) -> Any:
        """This process's client whose read timeout is read_timeout doubled level times."""
        pid = os.getpid()
        client = self._clients.get(level)
        if client is not None and self._pid == pid:
            return client
        with self._lock:
            if self._pid != pid:
                self._stale_clients += self._clients.values()
                self._clients, self._pid = {}, pid
            if level not in self._clients:
                self._clients[level] = self._make_client(self._read_timeout * 2**level)
            return self._clients[level]

    def _make_client(self, read_timeout: float) -> Any:
        with _SESSIONS.lock:
            key = (os.getpid(), self.profile, self._region())
            session = _SESSIONS.by_key.get(key)
            if session is None:
                try:
                    session = boto3.session.Session(profile_name=key[1], region_name=key[2])
                except bex.ProfileNotFound:
                    raise ConfigError(
                        "AWS profile not found: check AWS_PROFILE and ~/.aws/config"
                    ) from None
                _SESSIONS.by_key[key] = session
            return self._client_from(session, read_timeout)

    def _client_from(self, session: Any, read_timeout: float) -> Any:
        s3_config: dict[str, str] = {}
        style = self._addressing_style(session)
        if style:
            s3_config["addressing_style"] = style
        config = Config(
            retries={"mode": "standard", "total_max_attempts": 1},  # RetryingStore retries
            connect_timeout=self._connect_timeout,
            read_timeout=read_timeout,
            max_pool_connections=self.max_pool,
            tcp_keepalive=True,
            user_agent_extra="sealfs",
            s3=s3_config or None,
        )
        try:
            client = session.client("s3", endpoint_url=self.endpoint_url, config=config)
        except ValueError as exc:  # e.g. a malformed endpoint URL
            raise ConfigError(
                f"cannot set up the S3 client (check --s3-endpoint and the AWS_* settings):"
                f" {self._scrub(exc)}"
            ) from None
        except bex.PartialCredentialsError as exc:
            raise self._no_credentials(exc) from None
        except bex.BotoCoreError as exc:
            raise StoreError(f"cannot set up the S3 client: {self._scrub(exc)}") from None
        client.meta.events.register("before-send.s3.PutObject", _without_expect_continue)
        return client

    def _no_credentials(self, exc: Exception) -> NoCredentialsError:
        # botocore's message names the variable missing, never a value.
        return NoCredentialsError(
            f"{self.describe()}: no usable AWS credentials ({exc}): set AWS_ACCESS_KEY_ID and"
            " AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or run with an instance role"
        )

    def _region(self) -> str | None:
        """An explicit region, else AWS_REGION (boto3 reads AWS_DEFAULT_REGION, profiles)."""
        return self.region or os.environ.get("AWS_REGION") or None

    def _addressing_style(self, session: Any) -> str | None:
        """Path-style for a custom endpoint (MinIO, Ceph...) unless the profile says otherwise."""
        try:
            scoped = session._session.get_scoped_config()
            configured = (scoped.get("s3") or {}).get("addressing_style")
        except Exception:  # a config file boto3 cannot read is boto3's to report
            configured = None
        if configured:
            return str(configured)
        return "path" if self._custom_endpoint() else None

    def _scrub(self, error: BaseException) -> str:
        """The error's text without the endpoint URL's user:password@, which botocore
        quotes ('Could not connect to the endpoint URL: "http://user:pw@host/..."')."""
        return without_userinfo(str(error))

    def _endpoint_source(self) -> str:
        """Where the custom endpoint was given, for messages."""
        if self.endpoint_url:
            return "--s3-endpoint"
        return (
            "AWS_ENDPOINT_URL_S3" if os.environ.get("AWS_ENDPOINT_URL_S3") else "AWS_ENDPOINT_URL"
        )

    def _custom_endpoint(self) -> str | None:
        return (
            self.endpoint_url
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL")
            or None
        )

    # -- requests ---------------------------------------------------------------------

    def _key(self, name: str) -> str:
        return self._root + validate_name(name)

    def _count(self, method: str) -> None:
        with self._lock:
            self.requests[method] += 1

    def request_counts(self) -> dict[str, int]:
        """HTTP requests sent so far, per store method."""
        with self._lock:
            return dict(self.requests)

    def versioned_bucket(self) -> str | None:
        """The bucket's name if it keeps object versions (None too if this user may not
        ask); see sealfs.store.base.warn_if_versioned."""
        try:
            answer = self._call(
                "get_bucket_versioning", "", lambda c: c.get_bucket_versioning(Bucket=self.bucket)
            )
        except StoreError:
            return None
        return self.bucket if answer.get("Status") == "Enabled" else None

    def _call(
        self,
        method: str,
        name: str,
        call: Callable[[Any], T],
        on_client_error: Callable[[str, int], StoreError | None] | None = None,
        level: int = 0,
    ) -> T:
        """Send one request; map every failure to a store error."""
        client = self._get_client(level)
        self._count(method)
        try:
            return call(client)
        except bex.ClientError as exc:
            err = exc.response.get("Error", {}) or {}
            code = str(err.get("Code", ""))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            mapped = on_client_error(code, status) if on_client_error else None
            message = str(err.get("Message", ""))
            raise (mapped or self._client_error(method, name, code, status, message)) from None
        except StoreError:
            raise
        except (bex.NoCredentialsError, bex.PartialCredentialsError) as exc:
            raise self._no_credentials(exc) from None
        except bex.CredentialRetrievalError as exc:
            raise TransientStoreError(
                f"{self.describe()}: fetching credentials failed: {self._scrub(exc)}"
            ) from None
        except bex.SSLError as exc:
            raise self._tls_error(method, name, exc) from None
        except _TRANSPORT_ERRORS as exc:
            kind = _TimedOut if isinstance(exc, _TIMEOUT_ERRORS) else TransientStoreError
            raise kind(
                f"{self._what(method, name)}: {type(exc).__name__}: {self._scrub(exc)}"
            ) from None
        except bex.BotoCoreError as exc:
            raise StoreError(f"{self._what(method, name)}: {self._scrub(exc)}") from None

    def _upload(
        self,
        method: str,
        name: str,
        call: Callable[[Any], T],
        on_client_error: Callable[[str, int], StoreError | None] | None = None,
    ) -> T:
        """_call for a request with a body, within the upload window (see _Uploads)."""
        uploads = self._uploads
        level = uploads.level
        uploads.enter(self._read_timeout * 2**level)
        start = time.monotonic()
        timed_out = False
        try:
            return self._call(method, name, call, on_client_error, level)
        except _TimedOut:
            timed_out = True
            raise
        finally:
            quick = time.monotonic() - start < self._read_timeout / 2
            uploads.leave(timed_out, quick, level, self._top_level, start)

    def _tls_error(self, method: str, name: str, exc: bex.SSLError) -> StoreError:
        """A failed TLS handshake: a setting to fix, or a link that may do better."""
        text = str(exc)
        if "CERTIFICATE_VERIFY_FAILED" in text:
            return StoreError(
                f"{self.describe()}: the endpoint's TLS certificate does not verify:"
                " fix the endpoint URL or set AWS_CA_BUNDLE"
            )
        cause = exc.kwargs.get("error")
        inner = cause.args[0] if cause is not None and cause.args else None
        if "[X509:" in text or (isinstance(inner, OSError) and not isinstance(inner, ssl.SSLError)):
            # Loading the CA bundle failed, before any byte was sent: a missing file
            # or one holding no certificate stays so.
            # botocore's text quotes the request's URL, with any user:password@ in it.
            reason = (
                inner.strerror
                if isinstance(inner, OSError) and inner.strerror
                else self._scrub(exc)
            )
            return StoreError(
                f"{self.describe()}: the CA bundle cannot be loaded ({reason}): fix"
                " AWS_CA_BUNDLE (or ca_bundle in the profile) to name a PEM file of certificates"
            )
        if "WRONG_VERSION_NUMBER" in text:
            # The answer to the handshake was no TLS: it will not be next time either.
            return StoreError(
                f"{self.describe()}: the endpoint does not speak TLS: give it as http://,"
                " or the port where it serves https://"
            )
        return TransientStoreError(f"{self._what(method, name)}: {self._scrub(exc)}")

    def _what(self, method: str, name: str) -> str:
        return f"s3 {method} {name or '-'} in s3://{self.bucket}/{self.prefix}"

    def _client_error(
        self, method: str, name: str, code: str, status: int, message: str
    ) -> StoreError:
        what = self._what(method, name)
        bucket = self.bucket
        if code == "NoSuchBucket":
            return StoreError(
                f"bucket {bucket} does not exist at {self._where()}: create it first"
                f" (aws s3 mb s3://{bucket}) or fix the URL or --s3-endpoint"
            )
        if status == 404 and code in ("", "404") and method not in ("get", "stat"):
            # S3 names what is missing (NoSuchBucket, NoSuchKey); HEAD has no body, so
            # botocore gives its code as "404". A bare 404 to anything else is a web
            # server's: "object ... not found" misled, for an object just written.
            # botocore's code is "" for a body that parses as XML (an HTML page) and
            # the status, "404", for an empty body or any other text.
            return StoreError(
                f"{what}: the endpoint answered 404 without an S3 error: it is not an S3"
                " service, or not at that path or port: fix the endpoint (--s3-endpoint"
                " or AWS_ENDPOINT_URL)"
            )
        if code in _NOT_FOUND_CODES or (status == 404 and not code):
            return ObjectNotFoundError(f"object {name} not found in {self.describe()}")
        if code in _TRANSIENT_CODES or status in _TRANSIENT_STATUS:
            return TransientStoreError(f"{what}: {code or status}")
        if code == "InvalidAccessKeyId":
            return StoreError(
                f"{what}: the service does not know this access key: check"
                " AWS_ACCESS_KEY_ID, AWS_PROFILE or the endpoint"
            )
        if code == "SignatureDoesNotMatch":
            return StoreError(
                f"{what}: request signature rejected: check the secret access key and the region"
            )
        # Codes sent with 403 (RequestTimeTooSkewed; ExpiredToken, from some services)
        # are judged before that status: it stands for AccessDenied, a policy's fix.
        if code == "RequestTimeTooSkewed":
            return StoreError(f"{what}: this host's clock is off: synchronise it (NTP)")
        if code in _EXPIRED_CODES:
            # A mount's daemon resolved its credentials when it started: keys refreshed
            # in the shell never reach it; only a role, SSO or instance profile renews.
            return StoreError(
                f"{what}: the session token expired: refresh the credentials (a running"
                " mount keeps those it started with: remount it, or give it a profile whose"
                " role or SSO session renews itself)"
            )
        if code == "InvalidToken":
            # Malformed, or a stale AWS_SESSION_TOKEN beside long-term keys: a refresh
            # of the keys does not take it away.
            return StoreError(
                f"{what}: the session token is not valid for these keys: check"
                " AWS_SESSION_TOKEN (unset it for long-term keys) or refresh the credentials"
            )
        if code in ("AccessDenied", "AllAccessDisabled", "403") or status == 403:
            # Read-only credentials are a choice for a mount that only reads: the
            # operator whose writable mount they refused was not told of that way.
            read_only = (
                "; read-only credentials (s3:GetObject, s3:ListBucket) serve"
                " 'sealfs mount --read-only' and 'sealfs status'"
                if method in _WRITES
                else ""
            )
            return StoreError(
                f"{what}: access denied: the credentials need s3:GetObject, s3:PutObject,"
                f" s3:DeleteObject and s3:ListBucket on bucket {bucket}{read_only}"
            )
        if code in _REGION_CODES:
            return StoreError(
                f"{what}: bucket {bucket} is in another region: set AWS_REGION to its region"
            )
        if status in (400, 501) and "checksum" in message.lower():
            # botocore (since 1.36) sends a CRC32 with every upload and asks for one
            # with every download; some S3-compatible services refuse the headers.
            return StoreError(
                f"{what}: the service refuses the checksum headers boto3 sends"
                f" ({code}: {message}): set AWS_REQUEST_CHECKSUM_CALCULATION=when_required"
                " and AWS_RESPONSE_CHECKSUM_VALIDATION=when_required"
            )
        if code == "NotImplemented" or status == 501:
            return StoreError(
                f"{what}: the service does not implement this request ({code or status});"
                " sealfs needs PutObject with If-None-Match and If-Match"
            )
        said = f": {message}" if message else ""
        return StoreError(f"{what}: {code or 'HTTP'} ({status}){said}")

    # -- ObjectStore ------------------------------------------------------------------

    def get(self, name: str, max_size: int | None = None) -> bytes:
        """Return the whole object. Raises ObjectNotFoundError; a short body is transient."""
        key = self._key(name)

        def call(client: Any) -> bytes:
            response = client.get_object(Bucket=self.bucket, Key=key)
            body = response["Body"]
            expected = response.get("ContentLength")
            try:
                refuse_too_large(name, int(expected or 0), max_size, self.describe())
                data: bytes = body.read() if max_size is None else _read_at_most(body, max_size + 1)
                # No length was given, or it was not the body's:
                refuse_too_large(name, len(data), max_size, self.describe())
            finally:
                body.close()
            if expected is not None and len(data) != int(expected):
                raise TransientStoreError(
                    f"{self._what('get', name)}: body cut short ({len(data)} of {expected} bytes)"
                )
            return data

        return self._call("get", name, call)

    def stat(self, name: str) -> ObjectInfo:
        """Size and the server's ETag (opaque). Raises ObjectNotFoundError."""
        key = self._key(name)
        response = self._call("stat", name, lambda c: c.head_object(Bucket=self.bucket, Key=key))
        if "ETag" not in response:  # S3 always sends one: a web server took the request
            raise StoreError(
                f"{self.describe()} answered HeadObject without an ETag: it is not an S3"
                " service (a web page, a console's port?): fix the endpoint (--s3-endpoint"
                " or AWS_ENDPOINT_URL)"
            )
        return ObjectInfo(name=name, size=int(response["ContentLength"]), etag=response["ETag"])

    def put(self, name: str, data: bytes, *, replace: bool = True) -> None:
        """Create or replace the object (a single PutObject is atomic).

        replace=False sends If-None-Match: * as put_if_absent does.
        """
        if not replace:
            self._create_only("put", name, data)
            return
        key, body = self._key(name), bytes(data)
        self._upload("put", name, lambda c: c.put_object(Bucket=self.bucket, Key=key, Body=body))

    def put_if_absent(self, name: str, data: bytes) -> None:
        """PutObject with If-None-Match: *. Raises ObjectExistsError (412)."""
        self._create_only("put_if_absent", name, data)

    def _create_only(self, method: str, name: str, data: bytes) -> None:
        """PutObject with If-None-Match: *, counted as method. Raises ObjectExistsError (412).

        A 409 ConditionalRequestConflict (a concurrent conditional write still
        in flight) is transient: the retry then gets a definite answer.
        """
        key, body = self._key(name), bytes(data)

        def on_error(code: str, status: int) -> StoreError | None:
            if code == "PreconditionFailed" or status == 412:
                return ObjectExistsError(f"object {name} already exists in {self.describe()}")
            return None

        self._upload(
            method,
            name,
            lambda c: c.put_object(Bucket=self.bucket, Key=key, Body=body, IfNoneMatch="*"),
            on_error,
        )

    def put_if_match(self, name: str, data: bytes, etag: str) -> None:
        """PutObject with If-Match: etag. Raises PreconditionFailedError (412), or
        ObjectNotFoundError (404) if the object is missing."""
        key, body = self._key(name), bytes(data)

        def on_error(code: str, status: int) -> StoreError | None:
            if code == "PreconditionFailed" or status == 412:
                return PreconditionFailedError(f"object {name} changed since etag {etag[:14]}")
            return None

        self._upload(
            "put_if_match",
            name,
            lambda c: c.put_object(Bucket=self.bucket, Key=key, Body=body, IfMatch=etag),
            on_error,
        )

    def delete(self, name: str) -> None:
        """DeleteObject; S3 answers a missing key with success too."""
        key = self._key(name)
        self._call("delete", name, lambda c: c.delete_object(Bucket=self.bucket, Key=key))

    def list(self, prefix: str, start_after: str = "") -> list[str]:
        """ListObjectsV2 (every page) under prefix after start_after: names, sorted."""
        validate_prefix(prefix)
        kwargs: dict[str, Any] = {
            "Bucket": self.bucket,
            "Prefix": self._root + prefix,
            "MaxKeys": self.list_page_size,
        }
        if start_after:
            kwargs["StartAfter"] = self._root + start_after
        names: list[str] = []
        while True:
            page = self._call("list", prefix, lambda c: c.list_objects_v2(**kwargs))
            for item in page.get("Contents", ()):
                name = str(item["Key"])[len(self._root) :]
                if name.startswith(prefix) and name > start_after and is_valid_name(name):
                    names.append(name)
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                break
            kwargs["ContinuationToken"] = token
        names.sort()
        return names

    def sync(self) -> None:
        """Nothing to do: S3 acknowledges a PUT only once it is durable."""

    def free_bytes(self) -> int:
        """A large constant: a bucket has no fixed size."""
        return FREE_BYTES

    def _where(self) -> str:
        endpoint = self._custom_endpoint()
        if endpoint:
            return _strip_userinfo(endpoint)
        region = self._region() or os.environ.get("AWS_DEFAULT_REGION")
        return f"AWS S3 ({region})" if region else "AWS S3"

    def describe(self) -> str:
        """ "s3 store s3://bucket/prefix at ENDPOINT" (never credentials)."""
        return f"s3 store s3://{self.bucket}/{self.prefix} at {self._where()}"

    def location(self) -> str:
        """Where the objects are, however the command line and environment spelled it.

        describe() is for messages: it names the region, set or not by where the
        command runs (AWS_REGION under a service, none in a shell), and the endpoint
        as typed ("http://minio:9000/" and "http://MINIO:9000"). Keyed by it, one
        store had several host records (sealfs.cli.seen), and a rollback that one of
        them saw went unnoticed by the mounts that used another. A bucket's name is
        unique in its AWS partition, so only the partition counts, not the region.
        """
        endpoint = self._custom_endpoint()
        if endpoint:
            where = _endpoint_location(endpoint)
        else:
            region = self._region() or os.environ.get("AWS_DEFAULT_REGION") or ""
            partition = next((p for r, p in _PARTITIONS if region.startswith(r)), "")
            where = f"AWS S3 ({partition})" if partition else "AWS S3"
        return f"s3 store s3://{self.bucket}/{self.prefix} at {where}"

    def close(self) -> None:
        """Close this process's connection pool (a parent's is left alone)."""
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
            if self._pid != os.getpid():
                self._stale_clients += clients
                return
        for client in clients:
            client.close()


def probe_conditional_writes(store: ObjectStore) -> None:
    """Check that the service enforces If-None-Match (and If-Match) conditional writes.

    Creates a probe object under the volume prefix twice: the second create
    must fail. Then a replace with a wrong etag must fail. Deletes the probe.
    Raises ConfigError for a service that ignores the conditions, StoreError
    (or StoreUnavailableError) if the store cannot be reached.
    """
    name = f"{PROBE_PREFIX}{secrets.token_hex(8)}"
    store.put_if_absent(name, b"sealfs conditional-write probe: first")
    try:
        # Before the second create: a web server that is no S3 service answers every PUT
        # with 200 too, and was taken for a service that ignores the condition.
        etag = store.stat(name).etag
        try:
            store.put_if_absent(name, b"sealfs conditional-write probe: second")
        except ObjectExistsError:
            pass
        else:
            raise ConfigError(
                "this S3 service ignores If-None-Match conditional writes; sealfs needs them"
                " for single-writer safety (two writers could both commit the same"
                " generation): use AWS S3, a recent MinIO, Ceph RGW, R2 or another service"
                " that enforces them"
            )
        wrong = etag + "x"
        try:
            store.put_if_match(name, b"sealfs conditional-write probe: third", wrong)
        except PreconditionFailedError:
            pass
        else:
            raise ConfigError(
                "this S3 service ignores If-Match conditional writes; sealfs needs them so"
                " that two key changes cannot overwrite each other's volume header"
            )
    finally:
        _delete_probe(store, name)


def _delete_probe(store: ObjectStore, name: str) -> None:
    """Delete the probe, or say which object stays: init refuses a prefix that is not
    empty, and its message cannot tell a probe left behind from anything else."""
    try:
        store.delete(name)
    except StoreError as exc:
        raise StoreError(
            f"{exc}; the conditional-write probe {name} is left under the volume prefix:"
            " delete it before running init again"
        ) from None
