"""Layers, not copies: what a fork, the verifier's frozen snapshot and an idle sandbox cost, against the image's size
and the stack's depth.

For each image (the host's system; a built image; the same image with a large layer added) and each depth of
prepared-task snapshots stacked on it (1, 4, 16: a snapshot of a fork of a snapshot ...):
  - fork: `backend.fork(snapshot)` until the sandbox exists (a new upper layer and its mount);
  - start: fork and its first command (the episode's namespaces, its init, one command);
  - verifier entry: `enter_verifier()` after an agent step that wrote a few files (freeze, commit the episode's
    writes, the verifier's overlay, namespaces and cgroup);
each against the named baseline "copy": the same sandbox's root copied whole (`cp -a` of the merged root, what a
fork cost before layers), measured in the same run. (Memory per idle sandbox: benchmarks/sandbox_throughput.py.)

    python benchmarks/sandbox_layers.py [--samples 20] [--copies 3] [--large-mb 300] [--depths 1 4 16]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl.sandbox.image import ImageBuilder, build_problem  # noqa: E402
from rl.sandbox.layers import overlay_problem  # noqa: E402
from rl.sandbox.local import LocalBackend, bwrap_problem  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def stack(backend: LocalBackend, tree: Path, image, depth: int):
    """A snapshot `depth` layers deep over `image`: each a fork of the last, one file written, snapshotted."""
    sandbox = backend.create(tree, image=image)
    snapshots = []
    try:
        for level in range(depth):
            sandbox.exec(f"echo {level} > /app/level-{level}")
            snapshots.append(sandbox.snapshot())
            sandbox.close()
            sandbox = backend.fork(snapshots[-1])
    finally:
        sandbox.close()
    return snapshots


def measure(backend: LocalBackend, snapshot, samples: int, copies: int) -> dict[str, list[float]]:
    out = {"fork": [], "start": [], "verifier entry": [], "copy": []}
    for i in range(samples):
        t0 = time.perf_counter()
        sandbox = backend.fork(snapshot)
        out["fork"].append(time.perf_counter() - t0)
        try:
            sandbox.exec("true")
            out["start"].append(time.perf_counter() - t0)
            sandbox.exec("mkdir -p /app/out && for i in 1 2 3 4 5 6 7 8; do echo $i > /app/out/$i; done; "
                         "echo note > ~/.note")
            t0 = time.perf_counter()
            sandbox.enter_verifier()
            out["verifier entry"].append(time.perf_counter() - t0)
            if i >= copies:  # the baseline copies the whole root: seconds each, and steady
                continue
            with tempfile.TemporaryDirectory(prefix="mc-bench-copy-") as tmp:  # the baseline: a copy of the root
                t0 = time.perf_counter()
                subprocess.run(["cp", "-a", f"{sandbox.fs_root}/.", tmp], check=True, capture_output=True)
                out["copy"].append(time.perf_counter() - t0)
        finally:
            sandbox.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--large-mb", type=int, default=300, help="size of the large image's extra layer")
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--copies", type=int, default=3, help="samples of the copy baseline (the whole root each)")
    args = ap.parse_args()
    if bwrap_problem():
        print(f"cannot benchmark LocalSandbox: {bwrap_problem()}")
        return 1
    print(f"layers: {'overlayfs' if overlay_problem() is None else 'copies (' + overlay_problem() + ')'}")
    backend = LocalBackend()
    images = {"host system": None}
    if build_problem() is None:
        builder = ImageBuilder(progress=lambda _: None)
        images["built image"] = builder.build(
            "benchmarks/sandbox_layers.py small v1",
            lambda root: root.exec("mkdir -p /opt/tool && echo 1 > /opt/tool/version", timeout=300), what="bench")
        images[f"image +{args.large_mb} MB"] = builder.build(
            f"benchmarks/sandbox_layers.py large {args.large_mb} v1",
            lambda root: root.exec(f"mkdir -p /opt/big && for i in $(seq {args.large_mb}); do "
                                   "head -c 1048576 /dev/urandom > /opt/big/f$i; done", timeout=600), what="bench")
    else:
        print(f"(no built images here: {build_problem()})")
    copies = max(1, min(args.copies, args.samples))
    rows = []
    with tempfile.TemporaryDirectory(prefix="mc-bench-tree-") as tmp:
        tree = Path(tmp)
        (tree / "main.py").write_text("print('hi')\n")
        for name, image in images.items():
            for depth in args.depths:
                snapshots = stack(backend, tree, image, depth)
                try:
                    res = measure(backend, snapshots[-1], args.samples, copies)
                finally:
                    for s in reversed(snapshots):
                        s.discard()
                rows.append((name, depth, {k: 1e3 * pct(v, 0.5) for k, v in res.items()}))
    print(f"\np50 latency in ms over {args.samples} samples (baseline: copy = cp -a of the sandbox's merged root, "
          f"over {copies})")
    print(f"{'image':<18}{'depth':>6}{'fork':>9}{'start':>9}{'verifier':>10}{'copy':>9}{'copy/fork':>11}")
    for name, depth, r in rows:
        print(f"{name:<18}{depth:>6}{r['fork']:>9.1f}{r['start']:>9.1f}{r['verifier entry']:>10.1f}"
              f"{r['copy']:>9.1f}{r['copy'] / r['fork']:>11.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
