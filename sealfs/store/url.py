"""Store URLs: turn what the user typed into a stacked ObjectStore.

Supported forms: a directory path or file:///abs/path (LocalStore behind
RetryingStore), memory:// (a fresh MemoryStore, for tests) and, later,
s3://bucket/prefix. A CachingStore goes on top when a cache directory is given.
Messages never echo a URL beyond its scheme: URLs may carry credentials.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

from sealfs.errors import ConfigError
from sealfs.store.base import ObjectStore
from sealfs.store.cache import CachingStore
from sealfs.store.local import LocalStore
from sealfs.store.memory import MemoryStore
from sealfs.store.retry import RetryingStore

DEFAULT_CACHE_BYTES = 1 << 30  # 1 GiB of sealed chunks
SUPPORTED_FORMS = "a directory path, file:///absolute/path, s3://bucket/prefix or memory://"
_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def _scheme(url: str) -> str:
    """The URL's scheme in lower case, or "" for a plain path."""
    if not url:
        raise ConfigError(f"empty store URL: give {SUPPORTED_FORMS}")
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
    if parts.netloc not in ("", "localhost"):
        raise ConfigError("file:// store URLs must name a local path: file:///absolute/path")
    path = unquote(parts.path)
    if not path.startswith("/"):
        raise ConfigError("file:// store URLs need an absolute path: file:///absolute/path")
    return Path(os.path.normpath(path))


def open_store(
    url: str, *, cache_dir: Path | None = None, cache_bytes: int = DEFAULT_CACHE_BYTES
) -> ObjectStore:
    """Open the store url names, wrapped for retries and, with cache_dir, a chunk cache.

    Raises ConfigError for an unsupported or malformed URL. Opens no connection
    and touches no file yet (but for creating cache_dir).
    """
    scheme = _scheme(url)
    store: ObjectStore
    if scheme in ("", "file"):
        store = RetryingStore(LocalStore(local_path(url)))
    elif scheme == "memory":
        store = MemoryStore()
    elif scheme == "s3":
        raise ConfigError("S3 stores are not supported yet")
    else:
        raise ConfigError(f"unsupported store URL scheme {scheme}://: give {SUPPORTED_FORMS}")
    if cache_dir is not None:
        store = CachingStore(store, cache_dir, cache_bytes)
    return store
