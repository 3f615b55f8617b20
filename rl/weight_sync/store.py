"""Object store for weight versions: a local directory by default, ``s3://bucket/prefix`` through s3fs.

Every key is written whole or not at all: on a local filesystem through a temporary file renamed into place,
on object stores by a single PUT (atomic per object). Transient failures (network, throttling, a flaky
filesystem) are retried with exponential backoff and counted; a missing key is an answer, not a failure.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, TypeVar

import fsspec

from megatron_composer.optional import require

log = logging.getLogger(__name__)
T = TypeVar("T")

# A missing key, or a directory where a file is expected, is a real answer: retrying cannot change it.
_PERMANENT_OS_ERRORS = (FileNotFoundError, IsADirectoryError, NotADirectoryError, FileExistsError)


def _transient_error_types() -> tuple[type[BaseException], ...]:
    kinds: list[type[BaseException]] = [OSError, ConnectionError, TimeoutError]
    try:
        from botocore.exceptions import BotoCoreError, ClientError
        kinds += [BotoCoreError, ClientError]
    except ImportError:
        pass
    try:
        from aiohttp import ClientError as AiohttpClientError
        kinds.append(AiohttpClientError)
    except ImportError:
        pass
    return tuple(kinds)


class ObjectStoreError(RuntimeError):
    """The store kept failing after every retry; the message names the operation and the key."""


class ObjectStore:
    """Keys are '/'-separated paths below ``url``.

    Args:
        url: local directory (created if missing) or ``s3://bucket/prefix`` (any fsspec protocol works).
        storage_options: passed to fsspec, e.g. ``{"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}``.
        max_retries: attempts after the first one for a transient failure.
        retry_base_seconds / retry_max_seconds: backoff is base * 2**attempt, capped, with +-25% jitter.
        threads: parallel transfers for ``put_many`` / ``get_many``.
    """

    def __init__(self, url: str, storage_options: dict | None = None, max_retries: int = 5,
                 retry_base_seconds: float = 0.5, retry_max_seconds: float = 30.0, threads: int = 8):
        if not url:
            raise ValueError("ObjectStore url is empty; give a local directory or s3://bucket/prefix")
        if max_retries < 0 or threads < 1:
            raise ValueError(f"ObjectStore needs max_retries >= 0 and threads >= 1, got {max_retries}, {threads}")
        self.url, self.storage_options = url, storage_options
        # A filesystem object of our own (fsspec shares instances by default): its caches and sessions are
        # not disturbed by other users of the same URL.
        if url.startswith(("s3://", "s3a://")):
            require("s3fs", f"the object store {url}")  # fsspec's own message would not say which feature
        self.fs, root = fsspec.core.url_to_fs(url, skip_instance_cache=True, **(storage_options or {}))
        self.root = root.rstrip("/")
        self.is_local = "file" in _protocols(self.fs)
        if self.is_local:
            self.fs.makedirs(self.root, exist_ok=True)
        self.max_retries = max_retries
        self.retry_base_seconds = retry_base_seconds
        self.retry_max_seconds = retry_max_seconds
        self.threads = threads
        self._transient = _transient_error_types()
        self._lock = threading.Lock()
        self.retries = 0   # transient failures retried over this store's life (a metric)

    def __repr__(self) -> str:
        return f"ObjectStore({self.url!r})"

    def __reduce__(self):
        # travels to another process (e.g. vLLM's workers) as its settings; that process opens its own
        return (ObjectStore, (self.url, self.storage_options, self.max_retries, self.retry_base_seconds,
                              self.retry_max_seconds, self.threads))

    def path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    # --- retry ---------------------------------------------------------------------------------------------
    def _retry(self, what: str, key: str, fn: Callable[[], T]) -> T:
        for attempt in range(self.max_retries + 1):
            try:
                return fn()
            except _PERMANENT_OS_ERRORS:
                raise
            except self._transient as e:
                if attempt == self.max_retries:
                    raise ObjectStoreError(
                        f"{what} '{self.path(key)}' failed {attempt + 1} times, last error: {type(e).__name__}: {e}; "
                        f"check that the store {self.url} is reachable and writable") from e
                delay = min(self.retry_max_seconds, self.retry_base_seconds * 2 ** attempt)
                delay *= random.uniform(0.75, 1.25)
                with self._lock:
                    self.retries += 1
                log.warning("object store: %s %s failed (%s: %s); retry %d/%d in %.2fs", what, key,
                            type(e).__name__, e, attempt + 1, self.max_retries, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    # --- single keys -----------------------------------------------------------------------------------------
    def put(self, key: str, data: bytes) -> None:
        """Write ``data`` to ``key`` atomically: readers see the old object, nothing, or all of ``data``."""
        path = self.path(key)

        def write() -> None:
            if self.is_local:
                self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
                tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
                try:
                    self.fs.pipe_file(tmp, data)
                    self.fs.mv(tmp, path)   # rename within one filesystem: atomic
                finally:
                    if self.fs.exists(tmp):
                        self.fs.rm_file(tmp)
            else:
                self.fs.pipe_file(path, data)   # one PUT: atomic per object

        self._retry("write", key, write)

    def get(self, key: str) -> bytes:
        """The whole object; FileNotFoundError if it does not exist."""
        return self._retry("read", key, lambda: self.fs.cat_file(self.path(key)))

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of an object: one ranged read (an HTTP `Range` GET on S3, a seek on a local file)."""
        if not 0 <= start < end:
            raise ValueError(f"get_range of '{key}': need 0 <= start < end, got [{start}, {end})")
        data = self._retry("read", key, lambda: self.fs.cat_file(self.path(key), start=start, end=end))
        if len(data) != end - start:   # past the end of the object: short, and a retry cannot lengthen it
            raise ObjectStoreError(f"range [{start}, {end}) of '{self.path(key)}' returned {len(data)} bytes; the "
                                   f"object is shorter than its manifest says")
        return data

    def exists(self, key: str) -> bool:
        def check() -> bool:
            self.fs.invalidate_cache(self.path(key))
            return self.fs.exists(self.path(key))
        return self._retry("stat", key, check)

    def list_dirs(self, prefix: str = "") -> list[str]:
        """Names of the immediate children of ``prefix`` (no recursion; one LIST on object stores)."""
        path = self.path(prefix)

        def ls() -> list[str]:
            self.fs.invalidate_cache(path)
            try:
                entries = self.fs.ls(path, detail=False)
            except FileNotFoundError:
                return []
            return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries})

        return self._retry("list", prefix, ls)

    def delete_prefix(self, prefix: str) -> None:
        """Remove everything below ``prefix``; a prefix that is already gone is fine."""
        path = self.path(prefix)

        def rm() -> None:
            try:
                self.fs.rm(path, recursive=True)
            except FileNotFoundError:
                pass
            self.fs.invalidate_cache(path)

        self._retry("delete", prefix, rm)

    def delete(self, key: str) -> None:
        def rm() -> None:
            try:
                self.fs.rm_file(self.path(key))
            except FileNotFoundError:
                pass
            self.fs.invalidate_cache(self.path(key))
        self._retry("delete", key, rm)

    # --- parallel transfers ------------------------------------------------------------------------------
    def put_many(self, items: Iterable[tuple[str, bytes]]) -> None:
        with ThreadPoolExecutor(self.threads, thread_name_prefix="store-put") as pool:
            for f in [pool.submit(self.put, k, d) for k, d in items]:
                f.result()

    def get_many(self, keys: list[str]) -> list[bytes]:
        with ThreadPoolExecutor(self.threads, thread_name_prefix="store-get") as pool:
            return list(pool.map(self.get, keys))


def _protocols(fs) -> tuple[str, ...]:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)
