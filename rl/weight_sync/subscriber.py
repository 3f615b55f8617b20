"""Rollout side: find new weight versions, download and decode them (in the background), verify.

One WeightSubscriber asks for whole tensors or for boxes of them:

* whole tensors (no `wants`): it holds the bits of the last version it reconstructed; `fetch()` returns the
  state dict, the prefetcher's `pop_ready()` (version, state dict); `reader()` reads boxes of any version lazily.
* boxes (`wants`, or `for_model(store, model)`: the boxes a rank's engine holds): the engine holds the weights;
  `prepare()` returns a BoxUpdate (the XOR from the held version, or values), the engine applies it and commits
  it; the prefetcher's `pop_ready()` returns a BoxUpdate.

Both plan the cheapest way from the held version (a chain of deltas, or the nearest snapshot plus deltas), fetch
only the chunks overlapping the wanted boxes and assemble them by boxes.assemble (whole tensors are the boxes
covering their full shape).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from megatron_composer.kernels.xor_apply import SparseXor

from . import manifest as mf
from .boxes import Box, assemble, box_key, full_box, model_boxes, needed_chunks
from .codec import WeightSyncError, decode_chunk, dtype_from_name, from_bits, has_frame_checksum, int_view_dtype
from .readers import BoxUpdate, VersionReader
from .store import ObjectStore, ObjectStoreError

log = logging.getLogger(__name__)


class WeightSyncChecksumError(WeightSyncError):
    """A shard kept failing its checksum after every re-fetch."""


class WeightSubscriber:
    """Reconstructs published versions bit-exactly, for whole tensors or for the boxes a rollout rank holds.

    Whole tensors: the subscriber keeps the bits of the last version it reconstructed, so a worker at version
    v-1 only downloads delta v; returned tensors are never written to afterwards (each version is built in new
    memory). Boxes: the engine's weights are the held version (the subscriber keeps no copy of them); an update
    from the held version is the XOR of the deltas on the way over the wanted boxes, which the engine XORs into
    its own slices between two decode steps (Engine.update_weights(update, delta=True)); without a usable chain
    it is the values from the nearest snapshot plus deltas.

    For each part it reads, only the chunks overlapping the wanted boxes are fetched: with `range_reads` the
    byte ranges of those chunks (merged where adjacent) by ranged reads, each chunk verified by its zstd frame
    checksum; an object whose every chunk is needed, or whose chunks carry no frame checksum, is read whole and
    verified by its sha256. A chunk or object failing verification is read again `max_refetch` times, then the
    version is refused (WeightSyncChecksumError, naming the object) and what is held stays. `start()` prepares
    new versions in the background, `pop_ready()` hands the newest over, `commit(update)` (BoxUpdate.commit)
    records that it was applied.

    Args:
        store: where the publisher writes.
        wants: None (whole tensors), or per tensor name its (engine dtype, boxes of the full tensor), e.g.
            `model_boxes(model)` (see `for_model`).
        max_refetch: re-reads of a chunk or object that fails its checksum before the version is refused.
        threads: decode threads (downloads use the store's own pool).
        range_reads: fetch the needed chunks of an object by ranged reads (False: whole objects).
        sparse_deltas: (boxes only) a delta update keeps each box as a SparseXor (the changed elements' positions
            and XOR bits, kernels/xor_apply.py) once it is decoded, where that is smaller than its dense bits: what
            an engine that holds its own base stages on the host is then a few percent of the version's raw bytes
            at the RL learning rate. A box read whole is returned as is.
    """

    def __init__(self, store: ObjectStore, wants: dict[str, tuple[torch.dtype, list]] | None = None,
                 max_refetch: int = 3, threads: int | None = None, range_reads: bool = True,
                 sparse_deltas: bool = False):
        if max_refetch < 0:
            raise ValueError(f"max_refetch must be >= 0, got {max_refetch}")
        if wants is not None and not wants:
            raise WeightSyncError("a subscriber of boxes needs the boxes of at least one tensor (model_boxes(model))")
        if sparse_deltas and wants is None:
            raise WeightSyncError("sparse_deltas is for a subscriber of boxes (an engine holding its own base)")
        self.sparse_deltas = sparse_deltas
        self.store, self.max_refetch, self.range_reads = store, max_refetch, range_reads
        self.threads = threads or min(8, os.cpu_count() or 1)
        self.wants = None if wants is None else {
            name: (dtype, [box_key(b) for b in boxes]) for name, (dtype, boxes) in wants.items()}
        self._lock = threading.RLock()          # one plan at a time (caller or prefetcher)
        self._held_lock = threading.Lock()
        self._version: int | None = None        # the held version (the last committed) and its id
        self._id: str | None = None
        self._bits: dict[str, torch.Tensor] = {}   # whole tensors: the held version's bits and (dtype, shape)
        self._meta: dict[str, tuple[torch.dtype, list[int]]] = {}
        # metrics
        self.bytes_downloaded = 0
        self.checksum_failures = 0
        self.versions_fetched = 0
        self.snapshots_fetched = 0
        self.prefetch_errors = 0
        self.last_error: BaseException | None = None
        # prefetcher
        self._ready = None   # not yet popped: (version, state dict) for whole tensors, else a BoxUpdate
        self._prefetched: BoxUpdate | None = None     # the last update prepared in the background (popped or not)
        self._refused: int | None = None   # version refused for a corrupt object: not retried until a newer one
        self._ready_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_model(cls, store: ObjectStore, model: torch.nn.Module, **kw) -> "WeightSubscriber":
        """A subscriber of the boxes `model` (a rank's shard of a laid-out model) holds."""
        return cls(store, model_boxes(model), **kw)

    @property
    def version(self) -> int | None:
        """The version held (the last reconstructed or committed)."""
        return self._version

    @property
    def held_id(self) -> str | None:
        """Id of the version held (the last committed), None before the first."""
        return self._held()[0]

    def _held(self) -> tuple[str | None, int | None]:
        with self._held_lock:
            return self._id, self._version

    def latest_version(self) -> int | None:
        """Newest version whose manifest is in the store; None if there is none."""
        versions = sorted((v for v in map(mf.parse_version_dir, self.store.list_dirs()) if v is not None),
                          reverse=True)
        for v in versions:
            if self.store.exists(mf.manifest_key(v)):
                return v
        return None

    # --- whole tensors -------------------------------------------------------------------------------------
    def fetch(self, version: int | None = None) -> dict[str, torch.Tensor]:
        """State dict of ``version`` (default: the latest), bit-exact to what the publisher was given."""
        if self.wants is not None:
            raise WeightSyncError("a subscriber of boxes keeps no weights of its own (its engine does): prepare() "
                                  "an update, apply it and commit it; fetch() is for a subscriber of whole tensors")
        with self._lock:
            update = self.prepare(version)
            if update is not None:
                update.commit()
            return self._state()

    def _state(self) -> dict[str, torch.Tensor]:
        with self._held_lock:
            bits, meta = self._bits, self._meta
        return {name: from_bits(b, *meta[name]) for name, b in bits.items()}

    def reader(self, version: int | None = None) -> VersionReader:
        """Boxes of the full tensors of ``version`` (default: the latest), decoded chunk by chunk on demand
        (see VersionReader), on top of the held whole tensors where that is cheaper; holds nothing of the
        version in memory beyond the objects it last read."""
        with self._lock:
            head = self._head(self._target(version))
            with self._held_lock:
                held = (self._id, self._version) if self.wants is None else (None, None)
                bits = (self._bits, self._meta)
            if head["id"] == held[0]:
                return VersionReader(self, head["version"], [], held=bits)
            start, deltas = self._plan(head, held)
            if start == "held":
                return VersionReader(self, head["version"], deltas, held=bits)
            return VersionReader(self, head["version"], [start, *deltas])

    # --- updates -----------------------------------------------------------------------------------------
    def prepare(self, version: int | None = None) -> BoxUpdate | None:
        """The wanted boxes of `version` (default: the latest) as an update from the held version; None if
        that version is already held. Nothing is committed (the caller applies, then commits)."""
        return self._replanning(version, "prepare", self._prepare)

    def commit(self, update: BoxUpdate) -> None:
        """`update` is applied (by the engine; for whole tensors: to the subscriber's own bits, here): later
        updates are planned from it."""
        with self._held_lock:
            if update.delta and update.base_id != self._id:
                raise WeightSyncError(f"weight version {update.version} was prepared as a delta on another version "
                                      f"than the one held (v{self._version}); prepare it again")
            if self.wants is None:
                if update.delta and update.meta != self._meta:
                    raise WeightSyncError(f"delta of weight version {update.version} describes other tensors than "
                                          f"its base version {self._version}; the store is inconsistent")
                self._bits = {name: self._bits[name] ^ b if update.delta else b
                              for name, boxes in update.bits.items() for b in boxes.values()}
                self._meta = dict(update.meta)
            self._version, self._id = update.version, update.id
            self.versions_fetched += 1
        with self._ready_lock:
            if isinstance(self._ready, BoxUpdate) and self._ready.version <= update.version:
                self._ready = None

    def _target(self, version: int | None) -> int:
        target = self.latest_version() if version is None else version
        if target is None:
            raise WeightSyncError(f"no weight version is published in {self.store.url} yet")
        return target

    def _head(self, target: int) -> dict:
        try:
            return mf.loads(self.store.get(mf.manifest_key(target)), target)
        except FileNotFoundError:
            raise WeightSyncError(f"weight version {target} is not in {self.store.url} "
                                  f"(never published, not yet complete, or garbage-collected)") from None

    def _replanning(self, version: int | None, what: str, build):
        """build(target) for `version` (default: the latest), planned again when an object vanishes under it."""
        with self._lock:
            target = self._target(version)
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

    def _plan(self, head: dict, held: tuple[str | None, int | None]) -> tuple[dict | str, list[dict]]:
        """Cheapest way to ``head``: ("held" or a snapshot manifest, deltas to apply oldest first); `held`: the
        (id, version) held."""
        held_id, held_version = held
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
                prev = mf.loads(self.store.get(mf.manifest_key(base["version"])), base["version"])
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

    def _prepare(self, target: int) -> BoxUpdate | None:
        held = self._held()
        head = self._head(target)
        if head["id"] == held[0]:
            return None
        start, deltas = self._plan(head, held)
        delta = start == "held"
        parts = [(m, "delta") for m in deltas] if delta else [(start, "snapshot"), *((m, "delta") for m in deltas)]
        entries = [{t["name"]: t for t in m["parts"][name]["tensors"]} for m, name in parts]
        wants = self.wants if self.wants is not None else {
            name: (dtype_from_name(t["dtype"]), [full_box(t["shape"])]) for name, t in entries[-1].items()}
        meta = _check_meta(target, wants, entries)
        needed: dict[tuple[int, int], set[tuple[int, int]]] = {}   # (part, shard) -> {(offset, length)}
        for name, (_, boxes) in wants.items():
            for box in boxes:
                for i, c in needed_chunks(box, [ent[name] for ent in entries]):
                    needed.setdefault((i, c[0]), set()).add((c[1], c[2]))
        downloaded0 = self.bytes_downloaded
        sources, ranged, whole = self._download(parts, needed)
        bits = self._assemble(wants, meta, entries, sources, sparse=delta and self.sparse_deltas)
        if not delta:
            self.snapshots_fetched += 1
        return BoxUpdate(self, target, head["id"], held[0] if delta else None, delta, meta, bits,
                         self.bytes_downloaded - downloaded0, sum(m["parts"][name]["bytes"] for m, name in parts),
                         ranged, whole)

    def _assemble(self, wants: dict, meta: dict, entries: list[dict], sources: dict,
                  sparse: bool = False) -> dict[str, dict]:
        """Bits of every wanted box, tensor by tensor on `threads` threads; each needed chunk decoded once; with
        `sparse` each box is kept as a SparseXor as soon as it is assembled."""
        def tensor(name: str) -> dict[Box, torch.Tensor]:
            int_dtype = int_view_dtype(meta[name][0])
            decoded: dict[tuple[int, int, int], torch.Tensor] = {}

            def decode(i: int, chunk: list) -> torch.Tensor:
                key = (i, chunk[0], chunk[1])
                if key not in decoded:
                    decoded[key] = sources[(i, chunk[0])].decode(chunk, int_dtype)
                return decoded[key]

            ents = [ent[name] for ent in entries]
            out = {}
            for box in wants[name][1]:
                bits = assemble(torch.zeros([hi - lo for lo, hi in box], dtype=int_dtype), box, ents, decode)
                out[box] = SparseXor.compact(bits) if sparse else bits
            return out

        with ThreadPoolExecutor(self.threads, thread_name_prefix="wsync-decode") as pool:
            futures = {name: pool.submit(tensor, name) for name in wants}
            return {name: f.result() for name, f in futures.items()}

    # --- downloads -----------------------------------------------------------------------------------------
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
            return _ChunkSource(self, m["version"], shard, {0: self.get_verified(m["version"], shard)}, verified=True)

        with ThreadPoolExecutor(self.store.threads, thread_name_prefix="wsync-get") as pool:
            futures = {key: pool.submit(fetch, key) for key in needed}
            sources = {key: f.result() for key, f in futures.items()}
        return sources, ranged, whole

    def get_verified(self, version: int, shard: dict) -> bytes:
        """A whole shard object of `version`, its checksum verified (refetched up to max_refetch times)."""
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

    def pop_ready(self):
        """Whole tensors: (version, state dict) of the newest version reconstructed in the background since the
        last call (older ones never popped are skipped: only the newest matters to a worker). Boxes: the newest
        BoxUpdate prepared in the background that applies to what is held now. None if there is none."""
        held_id, held_version = self._held()
        with self._ready_lock:
            ready, self._ready = self._ready, None
        if isinstance(ready, BoxUpdate) and not ready.applies_to(held_id, held_version):
            return None   # stale: the prefetcher prepares the newest again from what is held
        return ready

    def _poll_loop(self, poll_seconds: float, on_ready: Callable[[int], None] | None) -> None:
        reported: object = object()   # the version whose failure was last logged: one line per version
        while not self._stop.is_set():
            latest = None
            try:
                latest = self.latest_version()
                held_id, held_version = self._held()
                done = self._prefetched
                fresh = done is not None and done.version == latest and done.applies_to(held_id, None)
                if latest is not None and latest != held_version and not fresh and latest != self._refused:
                    ready = self.prepare(latest) if self.wants is not None else (latest, self.fetch(latest))
                    if ready is not None:
                        with self._ready_lock:
                            self._ready = ready
                            self._prefetched = ready if self.wants is not None else None
                        if on_ready is not None:
                            on_ready(latest)
            except Exception as e:   # an outage or a bad version must not kill the worker: log, count, poll on
                self.prefetch_errors += 1
                self.last_error = e
                if isinstance(e, WeightSyncChecksumError):
                    self._refused = latest   # corrupt in the store: re-reading it cannot help
                if latest != reported:
                    reported = latest
                    log.warning("weight sync: weight version %s not applied, the %s keeps v%s (%s: %s)", latest,
                                "subscriber" if self.wants is None else "engine", self._held()[1],
                                type(e).__name__, e)
            self._stop.wait(poll_seconds)


def _check_meta(target: int, wants: dict, entries: list[dict]) -> dict[str, tuple[torch.dtype, list[int]]]:
    """(dtype, full shape) of every wanted tensor, the same in every part on the way to `target`; refuses boxes
    outside it and an engine dtype other than the published one."""
    meta: dict[str, tuple[torch.dtype, list[int]]] = {}
    for name, (dtype, boxes) in wants.items():
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


class _ChunkSource:
    """The fetched bytes of one object: the whole verified object, or ranged runs of its chunks (each chunk
    verified by its frame checksum when decoded, and re-read on failure)."""

    def __init__(self, subscriber: WeightSubscriber, version: int, shard: dict, runs: dict[int, bytes],
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
