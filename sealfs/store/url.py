"""Store URLs: turn what the user typed into a stacked ObjectStore.

Supported forms: a directory path or file:///abs/path (LocalStore behind
RetryingStore) and s3://bucket/prefix (S3Store behind RetryingStore). There
is no memory:// for the command line: init reported a volume created and
kept nothing (engine tests build a MemoryStore themselves). A CachingStore
goes on top when a cache directory is given; for S3 stores it is on by
default (under $XDG_CACHE_HOME/sealfs/<hash of the URL>, ~/.cache by
default), so that re-reading a hot file sends no request. Messages never
echo a URL beyond its scheme: URLs may carry credentials.

S3 settings come from the usual places: the endpoint from the s3_endpoint
argument (--s3-endpoint), else AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL
(which boto3 reads itself), the region from AWS_REGION, AWS_DEFAULT_REGION
or the profile, the credentials from boto3's default chain only
(environment, profile, instance role).
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from urllib.parse import unquote, unquote_to_bytes, urlsplit

from sealfs.errors import ConfigError
from sealfs.store.base import ObjectStore
from sealfs.store.cache import CachingStore
from sealfs.store.local import LocalStore
from sealfs.store.retry import RetryingStore

DEFAULT_CACHE_BYTES = 1 << 30  # 1 GiB of sealed chunks
DEFAULT_STORE_TIMEOUT = 300.0  # seconds a store request may keep failing before EIO
# An S3 request is retried until store_timeout runs out, not after a fixed count.
S3_RETRY_ATTEMPTS = 1_000_000
S3_MAX_BACKOFF = 5.0
SUPPORTED_FORMS = "a directory path, file:///absolute/path or s3://bucket/prefix"
_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# A scheme we know without its "//": taken for a relative path, "file:/x" made a
# directory named "file:" and a mistyped S3 URL a local volume.
_SLASHLESS_RE = re.compile(r"^(file|s3):(?!//)", re.IGNORECASE)


def _scheme(url: str) -> str:
    """The URL's scheme in lower case, or "" for a plain path."""
    if not url:
        raise ConfigError(f"empty store URL: give {SUPPORTED_FORMS}")
    if slashless := _SLASHLESS_RE.match(url):
        raise ConfigError(
            f"store URL {slashless.group(1)}: needs '//' ({SUPPORTED_FORMS}); for a"
            " directory of that name write ./ before it"
        )
    match = _SCHEME_RE.match(url)
    return match.group(1).lower() if match else ""


def is_local_url(url: str) -> bool:
    """Whether url names a local directory (plain path or file://). Raises ConfigError if empty."""
    return _scheme(url) in ("", "file")


def local_path(url: str) -> Path:
    """The absolute directory a local store URL names. Raises ConfigError for other URLs."""
    scheme = _scheme(url)
    if scheme == "":
        return Path(os.path.abspath(os.path.expanduser(url)))
    if scheme != "file":
        raise ConfigError(f"{scheme}:// is not a local store URL")
    parts = urlsplit(url)
    if parts.query or parts.fragment:
        raise ConfigError("file:// store URLs take no '?' or '#' part: escape them as %3F, %23")
    if parts.netloc not in ("", "localhost"):
        raise ConfigError("file:// store URLs must name a local path: file:///absolute/path")
    # The bytes the escapes name, as a path given directly: unquote() decoded them as
    # UTF-8 with replacement, so file:///srv/%FF named /srv/\ufffd, another directory.
    # The rest as argv had it: fsencode gives back bytes that are not UTF-8 (encoded
    # as UTF-8, their surrogates raised UnicodeEncodeError).
    path = os.fsdecode(unquote_to_bytes(os.fsencode(parts.path)))
    if not path.startswith("/"):
        raise ConfigError("file:// store URLs need an absolute path: file:///absolute/path")
    if "\0" in path:  # %00: no path holds one (open() raised ValueError: exit 70)
        raise ConfigError("file:// store URLs cannot name a NUL byte (%00)")
    return Path(os.path.normpath(path))


def check_local_directory(url: str, *, existing: bool) -> None:
    """For a local store URL, ConfigError if the path is not a directory, or is missing
    when existing says it must be there. A file was reported as a failed write of an
    internal object, and a mistyped path as "not a sealfs volume". Other URLs pass."""
    if not is_local_url(url):
        return
    path = local_path(url)
    if path.is_symlink() and not path.exists():
        # init said "write l/0000000000000001 failed: File exists" (exit 1): mkdir of a
        # symlink whose target is missing. Its target is not made: a symlink to a disk
        # not mounted yet would put the volume on the disk below.
        raise ConfigError(
            f"store {path} is a symlink to {os.readlink(path)}, which does not exist:"
            " create that directory (or mount the disk that holds it), or give another path"
        )
    if path.exists() and not path.is_dir():
        raise ConfigError(f"store {path} is not a directory: give the volume's directory")
    if existing and not path.exists():
        raise ConfigError(
            f"store {path} does not exist: check the path (or create a volume there with"
            " 'sealfs init')"
        )


def is_s3_url(url: str) -> bool:
    """Whether url names an S3 store. Raises ConfigError if empty."""
    return _scheme(url) == "s3"


_BUCKET_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{2,254}$")
# S3's "safe characters" for key prefixes, one path component at a time.
_PREFIX_PART_RE = re.compile(r"^[A-Za-z0-9!_.*'()-]+$")


def validate_bucket(bucket: str) -> str:
    """Return bucket unchanged, or raise ConfigError if it cannot be an S3 bucket name."""
    if not _BUCKET_RE.match(bucket) or ".." in bucket:
        raise ConfigError(
            "invalid S3 bucket name: use 3-255 letters, digits, dots, hyphens and underscores"
            " (s3://BUCKET/PREFIX)"
        )
    return bucket


def normalize_key_prefix(prefix: str) -> str:
    """A volume's S3 key prefix without leading or trailing slashes. Raises ConfigError."""
    prefix = prefix.strip("/")
    if not prefix:
        return ""
    for part in prefix.split("/"):
        if part in (".", "..") or not _PREFIX_PART_RE.match(part):
            raise ConfigError(
                "invalid S3 key prefix: use letters, digits and !_.*'()- between slashes"
            )
    if len(prefix) > 512:
        raise ConfigError("S3 key prefix too long (at most 512 characters)")
    return prefix


def parse_s3_url(url: str) -> tuple[str, str]:
    """(bucket, key prefix) of s3://bucket/prefix. Raises ConfigError, never echoing the URL."""
    if _scheme(url) != "s3":
        raise ConfigError("not an s3:// store URL")
    parts = urlsplit(url)
    if "@" in parts.netloc:
        raise ConfigError(
            "s3:// URLs take no credentials: use the environment, a profile or an instance role"
        )
    if parts.query or parts.fragment or "?" in url or "#" in url:
        raise ConfigError("s3:// URLs take no query or fragment: give s3://bucket/prefix")
    if not parts.netloc:
        raise ConfigError("s3:// URL without a bucket: give s3://bucket/prefix")
    return validate_bucket(parts.netloc), normalize_key_prefix(unquote(parts.path))


def xdg_base_dir(variable: str, *default: str) -> Path:
    """An XDG base directory: $variable if it holds an absolute path, else ~/<default>.

    As the XDG base directory spec asks, an empty or relative value is ignored: taken
    as it was, it put the directory under whatever the working directory was (an
    empty XDG_STATE_HOME made the daemon log ./sealfs/sealfs.log there).
    """
    value = os.environ.get(variable, "")
    if os.path.isabs(value):
        return Path(value)
    home = os.path.expanduser("~")  # $HOME, else the user database
    if not os.path.isabs(home):
        # A container run as a uid the image does not know, without HOME: Path.home()
        # raised RuntimeError (exit 70), and "~" taken as it was is a relative path.
        raise ConfigError(
            f"cannot tell the home directory of uid {os.getuid()} (HOME is unset and the"
            f" user database has no entry for it): set HOME or {variable}"
        )
    if not os.path.isdir(home):
        # Made by mkdir -p, root's mount gave /nonexistent (a service user's home, which
        # must never exist) a .local/state for its log and records, and a .cache.
        raise ConfigError(
            f"the home directory {home} does not exist, and sealfs does not make it:"
            f" set {variable} to a directory for sealfs's files (or HOME to an existing one)"
        )
    return Path(home, *default)


def cache_dir_for(url: str, cache_dir: Path | None, s3_endpoint: str | None) -> Path | None:
    """The chunk cache a mount of url uses: cache_dir if given, else the default one of
    an S3 store (None for a local store: no cache). Raises ConfigError for a bad URL or
    when there is no home to put the default in."""
    if cache_dir is not None or _scheme(url) != "s3":
        return cache_dir
    bucket, prefix = parse_s3_url(url)
    env_endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    try:
        return default_cache_dir(f"s3://{bucket}/{prefix}", s3_endpoint or env_endpoint)
    except ConfigError as exc:
        raise ConfigError(f"{exc}, or pass --cache-dir DIR") from None


def default_cache_dir(url: str, endpoint: str | None = None) -> Path:
    """~/.cache/sealfs/<first 16 hex digits of SHA-256 of the URL (and endpoint, if any)>."""
    base = xdg_base_dir("XDG_CACHE_HOME", ".cache")
    key = url if not endpoint else f"{url} at {endpoint}"
    return Path(base) / "sealfs" / hashlib.sha256(key.encode()).hexdigest()[:16]


def private_cache_root(cache_dir: Path) -> Path:
    """The highest directory a cache makes the owner's only: the XDG cache base for a
    cache under its sealfs directory (the default's place), else the cache itself.

    Made with the umask, ~/.cache/sealfs came out 0755, so every user could list which
    volumes (one directory per store URL) this account mounts."""
    try:
        base = xdg_base_dir("XDG_CACHE_HOME", ".cache")
    except ConfigError:
        return cache_dir
    return base if (base / "sealfs") in cache_dir.parents else cache_dir


def open_store(
    url: str,
    *,
    cache_dir: Path | None = None,
    cache_bytes: int = DEFAULT_CACHE_BYTES,
    s3_endpoint: str | None = None,
    store_timeout: float = DEFAULT_STORE_TIMEOUT,
    default_cache: bool = True,
    direct_reads: bool = True,
) -> ObjectStore:
    """Open the store url names, wrapped for retries and, with cache_dir, a chunk cache.

    store_timeout: how long one store request may keep failing transiently
    before it fails for good (StoreUnavailableError, EIO in the mount).
    default_cache: for S3 stores, cache chunks under default_cache_dir() when no
    cache_dir is given (init passes False: it reads no chunk). cache_bytes 0 turns
    the cache off: there was no other way to say so, and a cache of no bytes still
    made its directory and looked in it before every fetch, keeping nothing.
    direct_reads: a local store reads large objects past the page cache
    (LocalStore says when not to).
    Raises ConfigError for an unsupported or malformed URL. Opens no connection
    and touches no file yet (but for creating the cache directory).
    """
    if store_timeout <= 0:
        raise ConfigError("the store timeout must be positive")
    scheme = _scheme(url)
    store: ObjectStore
    if scheme in ("", "file"):
        if s3_endpoint:
            # Ignored, it let `init my-bucket/agents --s3-endpoint URL` (s3:// forgotten)
            # create a local volume in ./my-bucket/agents, and say it was made.
            raise ConfigError(
                f"--s3-endpoint is for s3:// stores, and {url} is a local directory:"
                " give the store as s3://BUCKET/PREFIX, or drop --s3-endpoint"
            )
        store = RetryingStore(
            LocalStore(local_path(url), direct_reads=direct_reads), deadline=store_timeout
        )
    elif scheme == "s3":
        from sealfs.store.s3 import (  # noqa: PLC0415 - boto3 is slow to import
            CONNECT_TIMEOUT,
            READ_TIMEOUT,
            S3Store,
        )

        bucket, prefix = parse_s3_url(url)
        endpoint = s3_endpoint or None
        store = RetryingStore(
            # No single request may outlast the whole wait (botocore's 60 s read timeout
            # held an fsync given --store-timeout 5 for a minute against a stalled service).
            S3Store(
                bucket,
                prefix,
                endpoint_url=endpoint,
                connect_timeout=min(CONNECT_TIMEOUT, store_timeout),
                read_timeout=min(READ_TIMEOUT, store_timeout),
                # Slow PUTs stretch it up to half the wait: a dead service still
                # fails an fsync about store_timeout after it stopped answering.
                max_read_timeout=store_timeout / 2,
            ),
            attempts=S3_RETRY_ATTEMPTS,
            max_delay=S3_MAX_BACKOFF,
            deadline=store_timeout,
        )
        if cache_dir is None and default_cache:
            cache_dir = cache_dir_for(url, None, s3_endpoint)
    else:
        raise ConfigError(f"unsupported store URL scheme {scheme}://: give {SUPPORTED_FORMS}")
    if cache_dir is not None and cache_bytes > 0:
        store = CachingStore(store, cache_dir, cache_bytes, private_cache_root(cache_dir))
    return store
