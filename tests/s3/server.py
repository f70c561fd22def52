"""One moto S3 server per test run, on 127.0.0.1, started on first use.

A second server on the IPv6 loopback [::1] serves the tests of bracketed IPv6
endpoints (moto keeps its state per process: both see the same buckets).

Used by the S3 fixtures (tests/s3/conftest.py) and by the S3 factory of the
store conformance suite (tests/store/conftest.py), which cannot take fixtures.
The environment gets fake credentials and no way to reach a real AWS: no
profile or config file, no instance metadata, no endpoint from the caller.
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import shutil
import socket
import tempfile
import threading
from typing import Any

import boto3
from botocore.config import Config

FAKE_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}
CLEARED_ENV = ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION")

_lock = threading.Lock()
_started: list[str] = []  # the endpoint, once the server runs
_started_v6: list[str | None] = []  # the [::1] endpoint, or None without IPv6 loopback


def fake_aws_environment() -> None:
    """Point boto3 (here and in every CLI subprocess) at fake credentials only."""
    os.environ.update(FAKE_ENV)
    for name in CLEARED_ENV:
        os.environ.pop(name, None)
    if "SEALFS_TEST_CACHE_HOME" not in os.environ:  # default S3 caches stay out of ~/.cache
        home = tempfile.mkdtemp(prefix="sealfs-test-cache-")
        atexit.register(shutil.rmtree, home, ignore_errors=True)  # every run left one in /tmp
        os.environ["SEALFS_TEST_CACHE_HOME"] = os.environ["XDG_CACHE_HOME"] = home


def make_conditional_puts_atomic() -> None:
    """Make moto's conditional PutObject atomic, as S3's is.

    moto 5 checks If-None-Match / If-Match and then stores the object without
    a lock, so two racing creates can both succeed, which real S3 never
    allows. The server runs in this process: serialise conditional PUTs.
    """
    from moto.s3.responses import S3Response  # noqa: PLC0415 - slow; S3 tests only

    original = S3Response.put_object
    if getattr(original, "sealfs_atomic", False):
        return
    lock = threading.Lock()

    def put_object(self: Any) -> Any:
        if self.headers.get("If-None-Match") or self.headers.get("If-Match"):
            with lock:
                return original(self)
        return original(self)

    put_object.sealfs_atomic = True  # type: ignore[attr-defined]
    S3Response.put_object = put_object  # type: ignore[method-assign]


def make_first_etag_safe() -> None:
    """Make moto compute an object's ETag under the object's lock, as it reads the body.

    moto computes an ETag once, on first use (the PUT's reply, a listing, a HEAD), by
    reading the object's body buffer from its start without the lock its body reads
    take; a GET racing that computation had the buffer's position moved under it and
    returned an empty body. A killed daemon's last PUT is still being answered while the
    crash tests copy the bucket, so such a copy held an empty log segment ("not a
    sealed object"), a failure no S3 shows.
    """
    from moto.s3.models import FakeKey  # noqa: PLC0415 - slow; S3 tests only

    original = FakeKey.etag
    if getattr(original.fget, "sealfs_locked", False):
        return

    def etag(self: Any) -> str:
        with self.lock:
            return str(original.fget(self))  # type: ignore[misc]

    etag.sealfs_locked = True  # type: ignore[attr-defined]
    FakeKey.etag = property(etag)  # type: ignore[method-assign,assignment]


def moto_endpoint() -> str:
    """http://127.0.0.1:PORT of the run's moto server (started now if need be)."""
    with _lock:
        if not _started:
            fake_aws_environment()
            make_conditional_puts_atomic()
            make_first_etag_safe()
            logging.getLogger("werkzeug").setLevel(logging.ERROR)
            _started.append(_start_moto("127.0.0.1"))
        return _started[0]


def moto_endpoint_v6() -> str | None:
    """http://[::1]:PORT of a moto server on the IPv6 loopback, None if it has none."""
    moto_endpoint()  # the environment, the patch of conditional PUTs
    with _lock:
        if not _started_v6:
            try:  # the server's thread would fail to bind, and start() wait for ever
                with socket.socket(socket.AF_INET6) as probe:
                    probe.bind(("::1", 0))
            except OSError:  # no IPv6 loopback on this host
                _started_v6.append(None)
            else:
                _started_v6.append(_start_moto("::1"))
        return _started_v6[0]


def _start_moto(address: str) -> str:
    """Start a moto server on the loopback address; its endpoint URL."""
    from moto.server import ThreadedMotoServer  # noqa: PLC0415 - slow; S3 tests only

    server = ThreadedMotoServer(ip_address=address, port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    assert host == address, host
    atexit.register(server.stop)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def client(endpoint: str | None = None) -> Any:
    """A plain boto3 S3 client on the moto server (for set-up and inspection)."""
    config = Config(s3={"addressing_style": "path"}, retries={"total_max_attempts": 3})
    return boto3.client("s3", endpoint_url=endpoint or moto_endpoint(), config=config)


def new_bucket() -> str:
    """Create a bucket with a fresh name and return the name."""
    name = f"sealfs-test-{secrets.token_hex(6)}"
    client().create_bucket(Bucket=name)
    return name


def all_objects(bucket: str, prefix: str = "") -> dict[str, bytes]:
    """Every key in the bucket (under the prefix) and its bytes."""
    c = client()
    out: dict[str, bytes] = {}
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            out[item["Key"]] = c.get_object(Bucket=bucket, Key=item["Key"])["Body"].read()
    return out
