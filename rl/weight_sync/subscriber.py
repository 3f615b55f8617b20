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
from .codec import (
    WeightSyncError,
    decode_chunk,
    dtype_from_name,
    from_bits,
    has_frame_checksum,
    int_view_dtype,
    to_bits,
)
from .store import ObjectStore, ObjectStoreError

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
        return self._replanning(version, "reconstruct", self._fetch)

    def _replanning(self, version: int | None, what: str, build):
        """build(target) for `version` (default: the latest), planned again when an object vanishes under it."""
        with self._lock:
            target = self.latest_version() if version is None else version
            if target is None:
                raise WeightSyncError(f"no weight version is published in {self.store.url} yet")
            last_error: Exception | None = None
            for _ in range(3):   # the publisher may garbage-collect a version while we read it: plan again
                try:
                    return build(target)
                except FileNotFoundError as e:
                    last_error = e
                    log.warning("weight sync: %s vanished while trying to %s version %d; planning again", e, what,
                                target)
            raise WeightSyncError(f"cannot {what} weight version {target} from {self.store.url}: "
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

    def _plan(self, head: dict, held: tuple[str | None, int | None] | None = None) -> tuple[dict | str, list[dict]]:
        """Cheapest way to ``head``: ("held" or a snapshot manifest, deltas to apply oldest first); `held`: the
        (id, version) held (default: this subscriber's)."""
        held_id, held_version = held if held is not None else (self._id, self._version)
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
            held_reachable = held_id is not None and base["version"] >= held_version
            if best is not None and not held_reachable:
                break   # going further back only adds deltas
            delta_cost += m["parts"]["delta"]["bytes"]
            if base["id"] == held_id:   # the base is what we hold (its manifest may already be collected)
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
                f"chain of deltas from the held version {held_version} is left in the store; raise keep_snapshots "
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
        def decode(chunk: list) -> torch.Tensor:
            shard, offset, length, _, n = chunk
            out = torch.empty(n, dtype=int_dtype)
            data = self._shard(manifest, part, shard)
            decode_chunk(memoryview(data)[offset:offset + length], n, int_dtype, None, out)
            self.elements_decoded += n
            return out
        return _piece_box_bits(chunks, piece_box, inter, int_dtype, decode)


def _span(piece_box: list, inter: list) -> tuple[int, int, list[int], list[int]]:
    """Box `inter` (full-tensor coordinates) inside a stored piece (its box `piece_box`, stored flat, row-major):
    the flat span [lo, hi) from its first to its last element, the piece's strides and the box's sizes."""
    pshape = [hi - lo for lo, hi in piece_box]
    strides = [1] * len(pshape)
    for d in range(len(pshape) - 2, -1, -1):
        strides[d] = strides[d + 1] * pshape[d + 1]
    local = [(lo - p, hi - p) for (lo, hi), (p, _) in zip(inter, piece_box)]
    lo = sum(a * st for (a, _), st in zip(local, strides))
    hi = sum((b - 1) * st for (_, b), st in zip(local, strides)) + 1
    return lo, hi, strides, [b - a for a, b in local]


def _span_chunks(chunks: list, lo: int, hi: int) -> list:
    """The chunks of a stored piece ([shard, offset, length, start, count]) holding elements of [lo, hi)."""
    return [c for c in chunks if max(lo, c[3]) < min(hi, c[3] + c[4])]


def _piece_box_bits(chunks: list, piece_box: list, inter: list, int_dtype: torch.dtype,
                    decode: Callable[[list], torch.Tensor]) -> torch.Tensor:
    """Bits of box `inter` from the chunks of one stored piece: only the chunks of the box's flat span, each
    decoded by decode(chunk) -> its `count` elements. A snapshot chunk is the bits themselves (XOR against
    zeros), a delta chunk the XOR to apply."""
    lo, hi, strides, sizes = _span(piece_box, inter)
    span = torch.zeros(hi - lo, dtype=int_dtype)
    for chunk in _span_chunks(chunks, lo, hi):
        s, n = chunk[3], chunk[4]
        a, b = max(lo, s), min(hi, s + n)
        span[a - lo:b - lo] = decode(chunk)[a - s:b - s]
    return span.as_strided(sizes, strides) if sizes else span.view(())


def _is_sharded(manifest: dict) -> bool:
    return any("pieces" in t for part in manifest["parts"].values() for t in part["tensors"])


def _pieces(entry: dict, shape: list[int]) -> list[tuple[list, list]]:
    """(box, chunks) of one tensor entry of a part: a sharded publish stores one piece per owned box, the
    single-writer publisher the whole tensor as one."""
    if "pieces" in entry:
        return [([tuple(r) for r in pc["box"]], pc["chunks"]) for pc in entry["pieces"]]
    return [([(0, n) for n in shape], entry["chunks"])]


# --- a rollout rank's subscriber: its own boxes only -------------------------------------------------------

Box = tuple[tuple[int, int], ...]


def box_key(box: tuple) -> Box:
    """A box given as slices (parallel/slices.py's Piece.full) or as (start, stop) pairs, as a hashable key."""
    return tuple((s.start, s.stop) if isinstance(s, slice) else (int(s[0]), int(s[1])) for s in box)


def model_boxes(model: torch.nn.Module) -> dict[str, tuple[torch.dtype, list[Box]]]:
    """Per tensor of a laid-out model: its dtype and the boxes of the full tensor this rank holds
    (parallel/slices.py's local_pieces, the same boxes Engine.update_weights reads)."""
    from megatron_composer.parallel.slices import local_pieces, named_tensors

    return {name: (t.dtype, [box_key(pc.full) for pc in local_pieces(t)]) for name, t in named_tensors(model)}


class BoxUpdate:
    """One version for one rank's boxes, ready to apply: a reader for Engine.update_weights (`names`,
    `shape(name)`, `read(name, box)`). `delta`: the bits are the XOR from the version the rank holds (`base_id`)
    to this one (apply with delta=True); otherwise they are the version's values. `bytes_read`: compressed
    bytes this rank fetched for it; `version_bytes`: the compressed bytes of the parts it was built from
    (what a whole-version reader downloads)."""

    def __init__(self, subscriber: "ShardSubscriber", version: int, vid: str, base_id: str | None, delta: bool,
                 meta: dict[str, tuple[torch.dtype, list[int]]], bits: dict[str, dict[Box, torch.Tensor]],
                 bytes_read: int, version_bytes: int, ranged_reads: int, whole_reads: int):
        self.subscriber, self.version, self.id, self.base_id, self.delta = subscriber, version, vid, base_id, delta
        self.meta, self.bits = meta, bits
        self.bytes_read, self.version_bytes = bytes_read, version_bytes
        self.ranged_reads, self.whole_reads = ranged_reads, whole_reads

    @property
    def names(self) -> list[str]:
        return list(self.bits)

    def shape(self, name: str) -> list[int]:
        return list(self.meta[name][1])

    def read(self, name: str, box: tuple) -> torch.Tensor:
        held = self.bits.get(name, {})
        key = box_key(box)
        # the engine reads its pieces whole or in row chunks: any box inside one prepared box
        outer = next((k for k in held if all(a <= c and d <= b for (a, b), (c, d) in zip(k, key))), None)
        if outer is None:
            raise WeightSyncError(f"weight version {self.version}: box {key} of '{name}' lies in none this rank "
                                  f"prepared ({sorted(held)}); the subscriber's boxes must be the engine's pieces")
        bits = held[outer][tuple(slice(c - a, d - a) for (a, _), (c, d) in zip(outer, key))]
        return bits if self.delta else from_bits(bits, self.meta[name][0], list(bits.shape))

    def commit(self) -> None:
        """The engine now holds this version: later updates are planned from it."""
        self.subscriber.commit(self)


class ShardSubscriber(WeightSubscriber):
    """A rollout rank's subscriber: it prepares each new version for the boxes its engine holds and nothing else.

    The engine's weights are the held version (the subscriber keeps no copy of them): an update from the held
    version is the XOR of the deltas on the way, over this rank's boxes, which the engine XORs into its own
    slices between two decode steps (Engine.update_weights(update, delta=True)); without a usable chain it is
    the values from the nearest snapshot plus deltas. For each part it reads, only the chunks overlapping its
    boxes are fetched: with `range_reads` the byte ranges of those chunks (merged where adjacent) by ranged
    reads, each chunk verified by its zstd frame checksum; an object whose every chunk is needed, or whose
    chunks carry no frame checksum, is read whole and verified by its sha256. A chunk failing verification is
    re-read `max_refetch` times, then the version is refused (WeightSyncChecksumError) and the engine keeps
    what it holds. `start()` prepares new versions in the background; `pop_ready()` hands the newest over;
    `commit(update)` (BoxUpdate.commit) records that the engine applied it.

    Args: `wants`: per tensor name its (engine dtype, boxes of the full tensor), `model_boxes(model)`; the
    others are WeightSubscriber's."""

    def __init__(self, store: ObjectStore, wants: dict[str, tuple[torch.dtype, list[Box]]], max_refetch: int = 3,
                 threads: int | None = None, range_reads: bool = True):
        super().__init__(store, max_refetch=max_refetch, threads=threads)
        if not wants:
            raise WeightSyncError("a ShardSubscriber needs the boxes of at least one tensor (model_boxes(model))")
        self.wants = {name: (dtype, [box_key(b) for b in boxes]) for name, (dtype, boxes) in wants.items()}
        self.range_reads = range_reads
        self._held_lock = threading.Lock()
        self._refused: int | None = None   # version refused for a corrupt object: not retried until a newer one
        self._ready_update: BoxUpdate | None = None   # prepared in the background, not yet popped
        self._prefetched: BoxUpdate | None = None     # the last one prepared in the background (popped or not)
        self.last_update: BoxUpdate | None = None     # the last one prepared (metrics)

    @classmethod
    def for_model(cls, store: ObjectStore, model: torch.nn.Module, **kw) -> "ShardSubscriber":
        return cls(store, model_boxes(model), **kw)

    def fetch(self, version: int | None = None):
        raise WeightSyncError("a ShardSubscriber holds no weights of its own (the engine does); use prepare() "
                              "and apply the BoxUpdate, or a WeightSubscriber for a whole state dict")

    def reader(self, version: int | None = None):
        self.fetch(version)

    # --- held version ------------------------------------------------------------------------------------
    def commit(self, update: BoxUpdate) -> None:
        with self._held_lock:
            if update.delta and update.base_id != self._id:
                raise WeightSyncError(f"weight version {update.version} was prepared as a delta on another version "
                                      f"than the one held (v{self._version}); prepare it again")
            self._version, self._id = update.version, update.id
            self.versions_fetched += 1
        with self._ready_lock:
            if self._ready_update is not None and self._ready_update.version <= update.version:
                self._ready_update = None

    @property
    def held_id(self) -> str | None:
        """Id of the version the engine holds (the last committed), None before the first."""
        return self._held()[0]

    def _held(self) -> tuple[str | None, int | None]:
        with self._held_lock:
            return self._id, self._version

    # --- preparing an update -----------------------------------------------------------------------------
    def prepare(self, version: int | None = None) -> BoxUpdate | None:
        """This rank's boxes of `version` (default: the latest) as an update from the held version; None if
        that version is already held. Nothing is committed (the caller applies, then commits)."""
        return self._replanning(version, "prepare", self._prepare)

    def _prepare(self, target: int) -> BoxUpdate | None:
        held = self._held()
        try:
            head = self._read_manifest(target)
        except FileNotFoundError:
            raise WeightSyncError(f"weight version {target} is not in {self.store.url} "
                                  f"(never published, not yet complete, or garbage-collected)") from None
        if head["id"] == held[0]:
            return None
        start, deltas = self._plan(head, held)
        delta = start == "held"
        parts = [(m, "delta") for m in deltas] if delta else [(start, "snapshot"), *((m, "delta") for m in deltas)]
        entries = [{t["name"]: t for t in m["parts"][name]["tensors"]} for m, name in parts]
        meta = self._check_meta(target, entries)

        # which chunks of which objects hold elements of this rank's boxes
        needed: dict[tuple[int, int], set[tuple[int, int]]] = {}   # (part, shard) -> {(offset, length)}
        for name, (_, boxes) in self.wants.items():
            shape = meta[name][1]
            for i, ent in enumerate(entries):
                for piece_box, chunks in _pieces(ent[name], shape):
                    for box in boxes:
                        inter = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(box, piece_box)]
                        if any(lo >= hi for lo, hi in inter):
                            continue
                        lo, hi, _, _ = _span(piece_box, inter)
                        for c in _span_chunks(chunks, lo, hi):
                            needed.setdefault((i, c[0]), set()).add((c[1], c[2]))
        downloaded0 = self.bytes_downloaded
        sources, ranged, whole = self._download(parts, needed)

        int_bits: dict[str, dict[Box, torch.Tensor]] = {}

        def assemble(name: str) -> None:
            dtype, shape = meta[name]
            int_dtype = int_view_dtype(dtype)
            decoded: dict[tuple[int, int, int], torch.Tensor] = {}   # this tensor's chunks, decoded once

            def decode(i: int, chunk: list) -> torch.Tensor:
                key = (i, chunk[0], chunk[1])
                if key not in decoded:
                    decoded[key] = sources[(i, chunk[0])].decode(chunk, int_dtype)
                return decoded[key]

            out: dict[Box, torch.Tensor] = {}
            for box in self.wants[name][1]:
                bits = torch.zeros([hi - lo for lo, hi in box], dtype=int_dtype)
                for i, ent in enumerate(entries):
                    for piece_box, chunks in _pieces(ent[name], shape):
                        inter = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(box, piece_box)]
                        if any(lo >= hi for lo, hi in inter):
                            continue
                        dst = bits[tuple(slice(lo - w, hi - w) for (lo, hi), (w, _) in zip(inter, box))]
                        dst.bitwise_xor_(_piece_box_bits(chunks, piece_box, inter, int_dtype,
                                                         lambda c, i=i: decode(i, c)))
                out[box] = bits if len(shape) else bits.view(())
            int_bits[name] = out

        with ThreadPoolExecutor(self.threads, thread_name_prefix="wsync-decode") as pool:
            for f in [pool.submit(assemble, name) for name in self.wants]:
                f.result()
        if not delta:
            self.snapshots_fetched += 1
        update = BoxUpdate(self, target, head["id"], held[0] if delta else None, delta, meta,
                           {name: int_bits[name] for name in self.wants}, self.bytes_downloaded - downloaded0,
                           sum(m["parts"][name]["bytes"] for m, name in parts), ranged, whole)
        self.last_update = update
        return update

    def _check_meta(self, target: int, entries: list[dict]) -> dict[str, tuple[torch.dtype, list[int]]]:
        meta: dict[str, tuple[torch.dtype, list[int]]] = {}
        for name, (dtype, boxes) in self.wants.items():
            for ent in entries:
                if name not in ent:
                    raise WeightSyncError(f"weight version {target} has no tensor '{name}' (or a version on the way to "
                                          f"it lacks it); the rollout model and the trainer's differ")
                m = (dtype_from_name(ent[name]["dtype"]), list(ent[name]["shape"]))
                if meta.setdefault(name, m) != m:
                    raise WeightSyncError(f"'{name}' changes dtype or shape between the versions on the way to "
                                          f"{target}; the store is inconsistent")
            if meta[name][0] != dtype:
                raise WeightSyncError(f"weight version {target} publishes '{name}' as {meta[name][0]}, the rollout "
                                      f"engine holds it in {dtype}: publish in the engine's dtype (weight_sync.dtype)")
            shape = meta[name][1]
            for box in boxes:
                if len(box) != len(shape) or any(not 0 <= lo <= hi <= n for (lo, hi), n in zip(box, shape)):
                    raise WeightSyncError(f"box {box} of '{name}' lies outside its published shape {shape}")
        return meta

    def _download(self, parts: list[tuple[dict, str]], needed: dict[tuple[int, int], set[tuple[int, int]]]):
        """Fetch the needed chunks, object by object in parallel: ranged reads of merged runs of needed chunks,
        or the whole object (every chunk needed, ranged reads off, or chunks without a frame checksum)."""
        ranged = whole = 0

        def fetch(key: tuple[int, int]) -> "_ChunkSource":
            nonlocal ranged, whole
            m, name = parts[key[0]]
            shard = m["parts"][name]["shards"][key[1]]
            spans = sorted(needed[key])
            if self.range_reads and sum(n for _, n in spans) < shard["bytes"]:
                runs: list[list[int]] = []
                for off, n in spans:
                    if runs and runs[-1][1] == off:
                        runs[-1][1] = off + n
                    else:
                        runs.append([off, off + n])
                src = _ChunkSource(self, m["version"], shard, {a: self._get_range(shard, a, b) for a, b in runs})
                if all(src.checksummed(off, n) for off, n in spans):
                    with self._ready_lock:
                        ranged += len(runs)
                    return src
                log.info("weight sync: chunks of %s carry no frame checksum; reading the object whole", shard["key"])
            with self._ready_lock:
                whole += 1
            return _ChunkSource(self, m["version"], shard, {0: self._get_verified(m["version"], shard)}, verified=True)

        with ThreadPoolExecutor(self.store.threads, thread_name_prefix="wsync-get") as pool:
            futures = {key: pool.submit(fetch, key) for key in needed}
            sources = {key: f.result() for key, f in futures.items()}
        return sources, ranged, whole

    def _get_range(self, shard: dict, start: int, end: int) -> bytes:
        try:
            data = self.store.get_range(shard["key"], start, end)
        except ObjectStoreError as e:
            if "shorter than its manifest" not in str(e):
                raise
            data = b""   # a truncated object: fails verification like any corrupt one
        with self._ready_lock:
            self.bytes_downloaded += len(data)
        return data

    # --- background prefetch -------------------------------------------------------------------------------
    def pop_ready(self) -> BoxUpdate | None:
        """The newest update prepared in the background that applies to what is held now, or None."""
        held_id, held_version = self._held()
        with self._ready_lock:
            ready = self._ready_update
            if ready is None or (held_version is not None and ready.version <= held_version) or \
                    (ready.delta and ready.base_id != held_id):
                return None   # stale: the prefetcher prepares the newest again from what is held
            self._ready_update = None
        return ready

    def _poll_loop(self, poll_seconds: float, on_ready: Callable[[int], None] | None) -> None:
        reported: int | None = None   # the version whose failure was last logged: one line per version
        while not self._stop.is_set():
            latest = None
            try:
                latest = self.latest_version()
                held_id, held_version = self._held()
                done = self._prefetched
                fresh = done is not None and done.version == latest and (not done.delta or done.base_id == held_id)
                if latest is not None and latest != held_version and not fresh and latest != self._refused:
                    update = self.prepare(latest)
                    if update is not None:
                        with self._ready_lock:
                            self._ready_update = self._prefetched = update
                        if on_ready is not None:
                            on_ready(latest)
            except Exception as e:   # an outage or a bad version must not kill the worker: log, count, poll on
                self.prefetch_errors += 1
                self.last_error = e
                if isinstance(e, WeightSyncChecksumError):
                    self._refused = latest   # corrupt in the store: re-reading it cannot help
                if latest != reported:
                    reported = latest
                    log.warning("weight sync: weight version %s not applied, the engine keeps v%s (%s: %s)", latest,
                                self._held()[1], type(e).__name__, e)
            self._stop.wait(poll_seconds)


class _ChunkSource:
    """The fetched bytes of one object: the whole verified object, or ranged runs of its chunks (each chunk
    verified by its frame checksum when decoded, and re-read on failure)."""

    def __init__(self, subscriber: ShardSubscriber, version: int, shard: dict, runs: dict[int, bytes],
                 verified: bool = False):
        self.subscriber, self.version, self.shard, self.verified = subscriber, version, shard, verified
        self.runs = runs   # start offset -> bytes
        self.reread: dict[int, bytes] = {}   # chunk offset -> its bytes read again after a failed check

    def _bytes(self, offset: int, length: int) -> memoryview:
        if offset in self.reread:
            return memoryview(self.reread[offset])
        for start, data in self.runs.items():
            if start <= offset and offset + length <= start + len(data):
                return memoryview(data)[offset - start:offset - start + length]
        return memoryview(b"")   # a truncated range: fails verification

    def checksummed(self, offset: int, length: int) -> bool:
        return has_frame_checksum(self._bytes(offset, length)[:5])

    def decode(self, chunk: list, int_dtype: torch.dtype) -> torch.Tensor:
        _, offset, length, _, n = chunk
        out = torch.empty(n, dtype=int_dtype)
        sub = self.subscriber
        for attempt in range(sub.max_refetch + 1):
            try:
                decode_chunk(self._bytes(offset, length), n, int_dtype, None, out)
                return out
            except Exception as e:   # zstd: checksum mismatch or corrupt frame; WeightSyncError: wrong size
                if self.verified:    # the object matched its sha256: the publisher wrote a bad chunk
                    raise WeightSyncError(f"chunk at {offset} of '{self.shard['key']}' (weight version "
                                          f"{self.version}) does not decode ({e}); republish the version") from e
                with sub._ready_lock:
                    sub.checksum_failures += 1
                if attempt == sub.max_refetch:
                    raise WeightSyncChecksumError(
                        f"chunk [{offset}, {offset + length}) of '{sub.store.path(self.shard['key'])}' of weight "
                        f"version {self.version} failed its checksum {sub.max_refetch + 1} times ({e}): the stored "
                        f"object is corrupt; republish it or delete the version") from e
                log.warning("weight sync: chunk at %d of %s (version %d) failed its checksum (attempt %d/%d); "
                            "re-reading it", offset, self.shard["key"], self.version, attempt + 1, sub.max_refetch + 1)
                self.reread[offset] = sub._get_range(self.shard, offset, offset + length)
        raise AssertionError("unreachable")
