"""open_store and local URL helpers."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from sealfs.errors import ConfigError
from sealfs.store.cache import CachingStore
from sealfs.store.local import LocalStore
from sealfs.store.retry import RetryingStore
from sealfs.store.s3 import S3Store
from sealfs.store.url import default_cache_dir, is_local_url, local_path, open_store


def test_plain_path_opens_a_retrying_local_store(tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "vol"))
    assert isinstance(store, RetryingStore)
    assert isinstance(store.inner, LocalStore)
    assert store.inner.root == tmp_path / "vol"
    store.put("c/ab/x", b"x")
    assert (tmp_path / "vol" / "c" / "ab" / "x").read_bytes() == b"x"


def test_file_url_with_cache(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}/my%20vol", cache_dir=tmp_path / "cache", cache_bytes=99)
    assert isinstance(store, CachingStore)
    assert store.max_bytes == 99
    assert isinstance(store.inner, RetryingStore)
    assert isinstance(store.inner.inner, LocalStore)
    assert store.inner.inner.root == tmp_path / "my vol"


@pytest.mark.parametrize("url", ["my-bucket/agents", "file:///srv/vol"])
def test_an_s3_endpoint_for_a_local_store_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    """Regression: ignored, it let `sealfs init my-bucket/agents --s3-endpoint URL` (the
    s3:// forgotten) create a local volume in ./my-bucket/agents and report success."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"--s3-endpoint is for s3:// stores.*s3://BUCKET"):
        open_store(url, s3_endpoint="http://127.0.0.1:9000")
    assert list(tmp_path.iterdir()) == []


def test_memory_url_is_refused() -> None:
    """Regression: `sealfs init memory://` reported a volume created and kept nothing."""
    with pytest.raises(ConfigError, match="unsupported store URL scheme memory://"):
        open_store("memory://")


@pytest.mark.parametrize("url", ["file:/tmp/vol", "s3:/bucket/x", "S3:bucket"])
def test_a_known_scheme_without_its_slashes_is_refused(url: str) -> None:
    """Regression: such a URL was taken for a relative path (a directory named 'file:')."""
    with pytest.raises(ConfigError, match="needs '//'"):
        open_store(url)


def test_a_file_url_with_a_query_or_fragment_is_refused(tmp_path: Path) -> None:
    """Regression: the '?x#y' of a file URL was dropped silently."""
    with pytest.raises(ConfigError, match="no '\\?' or '#' part"):
        local_path(f"file://{tmp_path}/a?x#y")
    assert local_path(f"file://{tmp_path}/a%3Fx%23y") == tmp_path / "a?x#y"


def test_a_file_url_names_the_bytes_of_its_escapes() -> None:
    """Regression: %FF named /srv/\ufffd (unquote's replacement character), another
    directory than /srv/\xff, and %00 ended the command as a bug (ValueError, exit 70)."""
    assert os.fsencode(local_path("file:///srv/%FF%20v%C3%A9")) == b"/srv/\xff v\xc3\xa9"
    with pytest.raises(ConfigError, match="NUL"):
        local_path("file:///srv/a%00b")


def test_a_file_url_given_in_bytes_that_are_not_utf8_names_those_bytes() -> None:
    """Regression: a URL from argv holding a byte that is not UTF-8 (a surrogate once
    decoded) ended every command as a bug (UnicodeEncodeError, exit 70): the escapes
    were decoded from the URL's UTF-8 form, which such a URL lacks."""
    url = "file:///srv/caf" + os.fsdecode(b"\xe9") + "%20x"
    assert os.fsencode(local_path(url)) == b"/srv/caf\xe9 x"


def test_s3_url_opens_a_retrying_s3_store_with_a_default_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    store = open_store("s3://bucket/vol/one/", s3_endpoint="http://127.0.0.1:1", store_timeout=7)
    assert isinstance(store, CachingStore)
    assert store.cache_dir.parent == tmp_path / "xdg" / "sealfs"
    assert isinstance(store.inner, RetryingStore)
    s3 = store.inner.inner
    assert isinstance(s3, S3Store)
    assert (s3.bucket, s3.prefix, s3.endpoint_url) == ("bucket", "vol/one", "http://127.0.0.1:1")
    assert store.describe() == "s3 store s3://bucket/vol/one at http://127.0.0.1:1"
    assert store.request_counts() == {}
    uncached = open_store("s3://bucket/vol", default_cache=False)
    assert isinstance(uncached, RetryingStore)
    for no_cache in (
        open_store("s3://bucket/vol", cache_bytes=0),
        open_store("s3://bucket/vol", cache_dir=tmp_path / "given", cache_bytes=0),
    ):
        assert isinstance(no_cache, RetryingStore)  # --cache-size 0: no cache at all
    assert not (tmp_path / "given").exists()


@pytest.mark.parametrize("value", ["", "relative/cache"])
def test_an_empty_or_relative_xdg_cache_home_is_ignored(
    value: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: a relative XDG_CACHE_HOME put the default cache under the working
    directory of each mount; the XDG spec says to ignore it, as an empty one."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    monkeypatch.setenv("XDG_CACHE_HOME", value)
    monkeypatch.chdir(tmp_path)
    assert default_cache_dir("s3://b/p").parent == tmp_path / "home" / ".cache" / "sealfs"


def test_a_home_that_does_not_exist_holds_no_default_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: with HOME=/nonexistent, root's mount of an S3 store made
    /nonexistent/.cache for its cache, giving a home to an account meant to have none."""
    monkeypatch.setenv("HOME", str(tmp_path / "nonexistent"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    with pytest.raises(ConfigError) as info:
        default_cache_dir("s3://b/p")
    assert f"the home directory {tmp_path / 'nonexistent'} does not exist" in str(info.value)
    assert "XDG_CACHE_HOME" in str(info.value)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir("s3://b/p").parent == tmp_path / "xdg" / "sealfs"


@pytest.mark.parametrize("xdg", [False, True])
def test_the_default_cache_and_the_base_it_makes_are_the_owners_only(
    xdg: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: ~/.cache/sealfs came out 0755 (only the cache under it was private),
    so any user could list which volumes this account mounts, one directory per URL."""
    (tmp_path / "home").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    base = tmp_path / "xdg" if xdg else tmp_path / "home" / ".cache"
    if xdg:
        monkeypatch.setenv("XDG_CACHE_HOME", str(base))
    else:
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    old_umask = os.umask(0o022)
    try:
        store = open_store("s3://bucket/vol", s3_endpoint="http://127.0.0.1:1")
        given = open_store("s3://bucket/vol", cache_dir=tmp_path / "given" / "cache")
    finally:
        os.umask(old_umask)
    assert isinstance(store, CachingStore)
    assert store.cache_dir.parent.parent == base
    for made in (base, base / "sealfs", store.cache_dir, tmp_path / "given" / "cache"):
        assert stat.S_IMODE(made.stat().st_mode) == 0o700, made
    assert isinstance(given, CachingStore)
    assert stat.S_IMODE((tmp_path / "given").stat().st_mode) == 0o755  # not the cache's


def test_unknown_scheme_names_the_forms_without_echoing_the_url() -> None:
    with pytest.raises(ConfigError) as info:
        open_store("ftp://user:hunter2@host/vol")
    message = str(info.value)
    assert "hunter2" not in message
    assert "ftp://" in message
    assert "file:///" in message
    assert "s3://" in message


@pytest.mark.parametrize("url", ["", "file://otherhost/vol", "file://relative"])
def test_bad_urls_are_config_errors(url: str) -> None:
    with pytest.raises(ConfigError):
        open_store(url)


def test_local_path_and_is_local_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert local_path("vol") == tmp_path / "vol"
    assert local_path("/srv/../srv/vol") == Path("/srv/vol")
    assert local_path("file:///srv/vol") == Path("/srv/vol")
    assert local_path("file://localhost/srv/vol") == Path("/srv/vol")
    assert is_local_url("/srv/vol")
    assert is_local_url("file:///srv/vol")
    assert not is_local_url("s3://bucket")
    with pytest.raises(ConfigError):
        local_path("s3://bucket")
