"""Rollout-worker side: find new weight versions, download and decode them (in the background), verify."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Callable

import torch

from . import manifest as mf
from .codec import WeightSyncError, decode_chunk, dtype_from_name, from_bits, int_view_dtype, to_bits
from .store import ObjectStore

log = logging.getLogger(__name__)


class WeightSyncChecksumError(WeightSyncError):
    """A shard kept failing its checksum after every re-fetch."""


class WeightSubscriber:
    """Reconstructs published versions bit-exactly from the nearest snapshot plus deltas.

    The subscriber keeps the bits of the last version it reconstructed, so a worker at version v-1 only
    downloads delta v. Returned tensors are never written to afterwards (each version is built in new memory).

    Args:
        store: where the publisher writes.
        max_refetch: a shard whose sha256 does not match is downloaded again this many times, then refused
            with WeightSyncChecksumError naming the shard.
        threads: decode threads (downloads use the store's own pool).
    """

    def __init__(self, store: ObjectStore, max_refetch: int = 3, threads: int | None = None):
        if max_refetch < 0:
            raise ValueError(f"max_refetch must be >= 0, got {max_refetch}")
        self.store = store
        self.max_refetch = max_refetch
        self.threads = threads or min(8, os.cpu_count() or 1)
        self._lock = threading.RLock()          # one reconstruction at a time (caller or prefetcher)
        self._version: int | None = None
        self._id: str | None = None
        self._bits: dict[str, torch.Tensor] = {}
        self._meta: dict[str, tuple[torch.dtype, list[int]]] = {}
        # metrics
        self.bytes_downloaded = 0
        self.checksum_failures = 0
        self.versions_fetched = 0
        self.snapshots_fetched = 0
        self.prefetch_errors = 0
        self.last_error: BaseException | None = None
        # prefetcher
        self._ready: tuple[int, dict[str, torch.Tensor]] | None = None
        self._ready_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def version(self) -> int | None:
        """The version last reconstructed (by fetch or by the prefetcher)."""
        return self._version

    def latest_version(self) -> int | None:
        """Newest version whose manifest is in the store; None if there is none."""
        versions = sorted((v for v in map(mf.parse_version_dir, self.store.list_dirs()) if v is not None),
                          reverse=True)
        for v in versions:
            if self.store.exists(mf.manifest_key(v)):
                return v
        return None

    # --- reconstruction ------------------------------------------------------------------------------------
    def fetch(self, version: int | None = None) -> dict[str, torch.Tensor]:
        """State dict of ``version`` (default: the latest), bit-exact to what the publisher was given."""
        with self._lock:
            target = self.latest_version() if version is None else version
            if target is None:
                raise WeightSyncError(f"no weight version is published in {self.store.url} yet")
            last_error: Exception | None = None
            for _ in range(3):   # the publisher may garbage-collect a version while we read it: plan again
                try:
                    return self._fetch(target)
                except FileNotFoundError as e:
                    last_error = e
                    log.warning("weight sync: %s vanished while reconstructing version %d; planning again", e, target)
            raise WeightSyncError(f"cannot reconstruct weight version {target} from {self.store.url}: "
                                  f"objects keep disappearing ({last_error})") from last_error

    def reader(self, version: int | None = None) -> "VersionReader":
        """Boxes of the full tensors of ``version`` (default: the latest), decoded chunk by chunk on demand
        (see VersionReader); holds nothing of the version in memory beyond the shards it last read."""
        with self._lock:
            target = self.latest_version() if version is None else version
            if target is None:
                raise WeightSyncError(f"no weight version is published in {self.store.url} yet")
            try:
                head = self._read_manifest(target)
            except FileNotFoundError:
                raise WeightSyncError(f"weight version {target} is not in {self.store.url} "
                                      f"(never published, not yet complete, or garbage-collected)") from None
            if head["id"] == self._id:
                return VersionReader(self, target, [], held=(self._bits, self._meta))
            start, deltas = self._plan(head)
            if start == "held":
                return VersionReader(self, target, deltas, held=(self._bits, self._meta))
            return VersionReader(self, target, [start, *deltas])

    def _read_manifest(self, version: int) -> dict:
        return mf.loads(self.store.get(mf.manifest_key(version)), version)

    def _fetch(self, target: int) -> dict[str, torch.Tensor]:
        try:
            head = self._read_manifest(target)
        except FileNotFoundError:
            raise WeightSyncError(f"weight version {target} is not in {self.store.url} "
                                  f"(never published, not yet complete, or garbage-collected)") from None
        if head["id"] == self._id:
            return self._state()
        start, deltas = self._plan(head)
        if any(_is_sharded(m) for m in (deltas if start == "held" else [start, *deltas])):
            # published by several owners: reconstructed box by box (one box per stored piece's reach)
            reader = (VersionReader(self, target, deltas, held=(self._bits, self._meta)) if start == "held"
                      else VersionReader(self, target, [start, *deltas]))
            bits = {name: to_bits(reader.read(name)) for name in reader.names}
            meta = dict(reader.meta)
            if start != "held":
                self.snapshots_fetched += 1
            self._bits, self._meta, self._version, self._id = bits, meta, target, head["id"]
            self.versions_fetched += 1
            return self._state()
        if start == "held":
            bits, meta = self._bits, self._meta
        else:
            bits, meta = self._decode_part(start, "snapshot", None, None)
            self.snapshots_fetched += 1
        for m in deltas:
            bits, meta = self._decode_part(m, "delta", bits, meta)
        self._bits, self._meta, self._version, self._id = bits, meta, target, head["id"]
        self.versions_fetched += 1
        return self._state()

    def _plan(self, head: dict) -> tuple[dict | str, list[dict]]:
        """Cheapest way to ``head``: ("held" or a snapshot manifest, deltas to apply oldest first)."""
        chain = [head]             # head, its base, its base's base, ...
        delta_cost = 0             # bytes of the deltas read so far along the chain
        best: tuple[int, dict | str, int] | None = None   # (bytes, start, number of chain deltas to apply)
        while True:
            m = chain[-1]
            if "snapshot" in m["parts"]:
                cost = delta_cost + m["parts"]["snapshot"]["bytes"]
                if best is None or cost < best[0]:
                    best = (cost, m, len(chain) - 1)
            base = m["base"]
            if base is None or "delta" not in m["parts"]:
                break
            held_reachable = self._id is not None and base["version"] >= self._version
            if best is not None and not held_reachable:
                break   # going further back only adds deltas
            delta_cost += m["parts"]["delta"]["bytes"]
            if base["id"] == self._id:   # the base is what we hold (its manifest may already be collected)
                if best is None or delta_cost < best[0]:
                    best = (delta_cost, "held", len(chain))
                break
            if best is not None and delta_cost >= best[0]:
                break
            try:
                prev = self._read_manifest(base["version"])
            except FileNotFoundError:
                break   # garbage-collected
            if prev["id"] != base["id"]:
                break   # base was republished by a restarted trainer
            chain.append(prev)
        if best is None:
            raise WeightSyncError(
                f"cannot reconstruct weight version {head['version']} from {self.store.url}: no snapshot and no "
                f"chain of deltas from the held version {self._version} is left in the store; raise keep_snapshots "
                f"or fetch more often")
        _, start, n = best
        return start, list(reversed(chain[:n]))

    def _decode_part(self, m: dict, part_name: str, base_bits: dict[str, torch.Tensor] | None,
                     base_meta: dict[str, tuple[torch.dtype, list[int]]] | None):
        part = m["parts"][part_name]
        meta = {t["name"]: (dtype_from_name(t["dtype"]), list(t["shape"])) for t in part["tensors"]}
        if base_meta is not None and meta != base_meta:
            raise WeightSyncError(f"delta of weight version {m['version']} describes other tensors than its base "
                                  f"version {m['base']['version']}; the store is inconsistent")
        out: dict[str, torch.Tensor] = {}
        by_shard: dict[int, list[tuple[str, list[int]]]] = {}
        for t in part["tensors"]:
            dtype, shape = meta[t["name"]]
            numel = 1
            for d in shape:
                numel *= d
            out[t["name"]] = torch.empty(numel, dtype=int_view_dtype(dtype))
            for chunk in t["chunks"]:
                by_shard.setdefault(chunk[0], []).append((t["name"], chunk))

        def decode(name: str, data: bytes, chunk: list[int]) -> None:
            _, offset, length, s, n = chunk
            base = None if base_bits is None else base_bits[name][s:s + n]
            decode_chunk(memoryview(data)[offset:offset + length], n, out[name].dtype, base, out[name][s:s + n])

        with ThreadPoolExecutor(self.store.threads, thread_name_prefix="wsync-get") as get_pool, \
                ThreadPoolExecutor(self.threads, thread_name_prefix="wsync-decode") as dec_pool:
            downloads = {get_pool.submit(self._get_verified, m["version"], part["shards"][i]): i
                         for i in range(len(part["shards"]))}
            decodes = []
            for f in as_completed(downloads):
                data = f.result()
                decodes += [dec_pool.submit(decode, name, data, chunk) for name, chunk in by_shard.get(downloads[f], [])]
            for f in decodes:
                f.result()
        return out, meta

    def _get_verified(self, version: int, shard: dict) -> bytes:
        for attempt in range(self.max_refetch + 1):
            data = self.store.get(shard["key"])
            with self._ready_lock:
                self.bytes_downloaded += len(data)
            digest = hashlib.sha256(data).hexdigest()
            if digest == shard["sha256"] and len(data) == shard["bytes"]:
                return data
            with self._ready_lock:
                self.checksum_failures += 1
            log.warning("weight sync: shard %s of version %d failed its sha256 check (attempt %d/%d); re-fetching",
                        shard["key"], version, attempt + 1, self.max_refetch + 1)
        raise WeightSyncChecksumError(
            f"shard '{self.store.path(shard['key'])}' of weight version {version} failed its sha256 check "
            f"{self.max_refetch + 1} times (expected {shard['sha256']}, {shard['bytes']} bytes; got {digest}, "
            f"{len(data)} bytes): the stored object is corrupt; republish it or delete the version")

    def _state(self) -> dict[str, torch.Tensor]:
        return {name: from_bits(b, *self._meta[name]) for name, b in self._bits.items()}

    # --- background prefetch -------------------------------------------------------------------------------
    def start(self, poll_seconds: float = 1.0, on_ready: Callable[[int], None] | None = None) -> None:
        """Poll the store every ``poll_seconds`` in a background thread; each new version is downloaded and
        decoded there, then offered by ``pop_ready()`` (and announced through ``on_ready(version)``)."""
        if self._thread is not None and self._thread.is_alive():
            raise WeightSyncError("the weight prefetcher is already running; call stop() first")
        if poll_seconds <= 0:
            raise ValueError(f"poll_seconds must be > 0, got {poll_seconds}")
        self._stop.clear()
        self._thread = threading.Thread(target=self._poll_loop, args=(poll_seconds, on_ready),
                                        name="weight-prefetch", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def pop_ready(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The newest version decoded in the background since the last call, or None. Older ready versions
        that were never popped are skipped: only the newest matters to a worker."""
        with self._ready_lock:
            ready, self._ready = self._ready, None
        return ready

    def _poll_loop(self, poll_seconds: float, on_ready: Callable[[int], None] | None) -> None:
        while not self._stop.is_set():
            try:
                latest = self.latest_version()
                if latest is not None and latest != self._version:
                    state = self.fetch(latest)
                    with self._ready_lock:
                        self._ready = (latest, state)
                    if on_ready is not None:
                        on_ready(latest)
            except Exception as e:   # an outage or a bad version must not kill the worker: log, count, poll on
                self.prefetch_errors += 1
                self.last_error = e
                log.warning("weight sync: background fetch failed (%s: %s)", type(e).__name__, e)
            self._stop.wait(poll_seconds)


class VersionReader:
    """Boxes of the full tensors of one published version, read without reconstructing the version.

    `read(name, box)` decodes only the compressed chunks that hold the box's elements: the chunks of the
    snapshot the version is planned from (or the subscriber's held bits), then the same element range of each
    delta on the way, XORed on. The format stores each tensor flattened, in independently compressed chunks
    of consecutive elements, so a box's cost is the flat span from its first to its last element: a box of
    leading rows (a routed expert, a column-parallel shard) is read alone; a box of columns spans nearly the
    whole tensor, which is then decoded one tensor at a time (bounded memory: one tensor's bits). Downloaded
    shard objects are kept while consecutive reads use them (the last two per part), so a rank downloads each
    shard once when it reads tensors in the published order. `names` are the version's tensors;
    `elements_decoded` counts decoded elements (for tests and logs)."""

    def __init__(self, subscriber: WeightSubscriber, version: int, parts: list[dict],
                 held: tuple[dict, dict] | None = None):
        self.subscriber, self.version, self.held = subscriber, version, held
        self.parts: list[tuple[dict, str, dict]] = []  # (manifest, part name, tensor entries by name)
        for i, m in enumerate(parts):
            name = "snapshot" if i == 0 and held is None else "delta"
            self.parts.append((m, name, {t["name"]: t for t in m["parts"][name]["tensors"]}))
        self.meta = dict(held[1]) if held is not None else {
            t["name"]: (dtype_from_name(t["dtype"]), list(t["shape"])) for t in self.parts[0][2].values()}
        self.names = list(self.meta)
        self.elements_decoded = 0
        self._shards: dict[tuple[int, int], bytes] = {}

    def _shard(self, manifest: dict, part: str, index: int) -> bytes:
        key = (manifest["version"], index)
        if key not in self._shards:
            if len(self._shards) >= 2 * len(self.parts):
                self._shards.pop(next(iter(self._shards)))
            self._shards[key] = self.subscriber._get_verified(manifest["version"], manifest["parts"][part]["shards"][index])
        return self._shards[key]

    def shape(self, name: str) -> list[int]:
        return list(self.meta[name][1])

    def read(self, name: str, box: tuple[slice, ...] = ()) -> torch.Tensor:
        """The box `box` (slices over the full tensor's dims; () for all of it) of tensor `name`."""
        if name not in self.meta:
            raise WeightSyncError(f"weight version {self.version} has no tensor '{name}'")
        dtype, shape = self.meta[name]
        box = tuple(box) + (slice(None),) * (len(shape) - len(box))
        want = []
        for s, n in zip(box, shape):
            r = range(*s.indices(n))
            if r.step != 1:
                raise WeightSyncError(f"read of '{name}': box {box} has a step; boxes are contiguous slices")
            want.append((r.start, max(r.start, r.stop)))
        sizes = [hi - lo for lo, hi in want]
        int_dtype = int_view_dtype(dtype)
        if 0 in sizes:
            return torch.empty(sizes, dtype=dtype)
        if self.held is not None:
            out = self.held[0][name].view(shape)[tuple(slice(lo, hi) for lo, hi in want)].clone()
        else:
            out = torch.zeros(sizes, dtype=int_dtype)
        for manifest, part, tensors in self.parts:
            for piece_box, chunks in _pieces(tensors[name], shape):
                inter = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(want, piece_box)]
                if any(lo >= hi for lo, hi in inter):
                    continue   # an object of another owner's box: not fetched
                dst = out[tuple(slice(lo - w, hi - w) for (lo, hi), (w, _) in zip(inter, want))]
                dst.bitwise_xor_(self._decode_box(manifest, part, chunks, piece_box, inter, int_dtype))
        return from_bits(out if len(shape) else out.view(()), dtype, sizes)

    def _decode_box(self, manifest: dict, part: str, chunks: list, piece_box: list, inter: list,
                    int_dtype: torch.dtype) -> torch.Tensor:
        """Bits of box `inter` (full-tensor coordinates) from the chunks of one stored piece (its box
        `piece_box`, stored flat, row-major): only the chunks of the flat span from its first to last element."""
        pshape = [hi - lo for lo, hi in piece_box]
        strides = [1] * len(pshape)
        for d in range(len(pshape) - 2, -1, -1):
            strides[d] = strides[d + 1] * pshape[d + 1]
        local = [(lo - p, hi - p) for (lo, hi), (p, _) in zip(inter, piece_box)]
        lo = sum(a * st for (a, _), st in zip(local, strides))
        hi = sum((b - 1) * st for (_, b), st in zip(local, strides)) + 1
        span = torch.zeros(hi - lo, dtype=int_dtype)
        for shard, offset, length, s, n in chunks:
            a, b = max(lo, s), min(hi, s + n)
            if a >= b:
                continue
            chunk = torch.empty(n, dtype=int_dtype)
            data = self._shard(manifest, part, shard)
            decode_chunk(memoryview(data)[offset:offset + length], n, int_dtype, None, chunk)
            self.elements_decoded += n
            # a snapshot chunk is the bits themselves (XOR against zeros), a delta chunk the XOR to apply
            span[a - lo:b - lo] = chunk[a - s:b - s]
        sizes = [b - a for a, b in local]
        return span.as_strided(sizes, strides) if sizes else span.view(())


def _is_sharded(manifest: dict) -> bool:
    return any("pieces" in t for part in manifest["parts"].values() for t in part["tensors"])


def _pieces(entry: dict, shape: list[int]) -> list[tuple[list, list]]:
    """(box, chunks) of one tensor entry of a part: a sharded publish stores one piece per owned box, the
    single-writer publisher the whole tensor as one."""
    if "pieces" in entry:
        return [([tuple(r) for r in pc["box"]], pc["chunks"]) for pc in entry["pieces"]]
    return [([(0, n) for n in shape], entry["chunks"])]
