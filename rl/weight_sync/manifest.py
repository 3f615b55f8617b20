"""Store layout and manifest format of published weight versions.

    <url>/v000000000042/manifest.json                       written last: a version without it does not exist
    <url>/v000000000042/delta-<id8>-r<rank5>-<n5>.zst       a publishing rank's XOR against the base, zstd
    <url>/v000000000042/snapshot-<id8>-r<rank5>-<n5>.zst    a rank's full bits (snapshot versions only)

manifest.json:
    {"format": FORMAT, "version": 42, "id": "<uuid hex>", "base": {"version": 41, "id": "..."} | null,
     "codec": {"transform": "xor-byteshuffle", "compressor": "zstd", "level": 1},
     "full_bytes": raw bytes of the full state dict, "owners": number of publishing ranks,
     "parts": {"delta": PART, "snapshot": PART}            (each optional, at least one present)}
    PART = {"bytes": compressed bytes,
            "shards": [{"key": "v.../delta-....zst", "bytes": n, "sha256": hex}, ...],
            "tensors": [{"name", "dtype", "shape": full shape,
                         "pieces": [{"box": [[start, stop], ...], "chunks": [[shard, offset, length, start, count],
                                                                             ...]}]}]}

Each piece is a box of the full tensor written by the rank owning it (one piece covering the tensor when one
process publishes), stored flat (row-major) in independently compressed chunks (boxes.py reads them). A delta's
``base.id`` must equal the id of the state it is applied to: a trainer that restarts from a checkpoint starts a
new lineage (new ids), and subscribers holding the old one fall back to a snapshot.
"""

from __future__ import annotations

import json
import re

FORMAT = "megatron-composer-weight-sync/1"
MANIFEST = "manifest.json"
_VERSION_DIR = re.compile(r"^v(\d{12})$")


def version_dir(version: int) -> str:
    if version < 0:
        raise ValueError(f"weight versions are non-negative integers, got {version}")
    return f"v{version:012d}"


def manifest_key(version: int) -> str:
    return f"{version_dir(version)}/{MANIFEST}"


def parse_version_dir(name: str) -> int | None:
    m = _VERSION_DIR.match(name)
    return int(m.group(1)) if m else None


def dumps(manifest: dict) -> bytes:
    return json.dumps(manifest, separators=(",", ":")).encode()


def loads(data: bytes, version: int) -> dict:
    from .codec import WeightSyncError
    try:
        manifest = json.loads(data)
    except ValueError as e:
        raise WeightSyncError(f"manifest of weight version {version} is not valid JSON ({e})") from e
    if manifest.get("format") != FORMAT or manifest.get("version") != version:
        raise WeightSyncError(f"manifest of weight version {version} has format {manifest.get('format')!r} "
                              f"version {manifest.get('version')!r}; expected {FORMAT!r} version {version}")
    if any("pieces" not in t for part in manifest.get("parts", {}).values() for t in part["tensors"]):
        raise WeightSyncError(f"manifest of weight version {version} stores whole tensors without pieces (written "
                              f"by a publisher before pieces were the one format); publish the version again")
    return manifest
