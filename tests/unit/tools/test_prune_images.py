"""tools/prune_images.py: the image cache keeps the current base and the images built on it by the current tools;
stale bases and images go always, unused images and old logs only past --unused-days."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from rl.sandbox.image import IMAGE_LAYOUT, TOOLS_DIGEST, ImageBuilder

REPO = Path(__file__).resolve().parents[3]


def _entry(cache: Path, name: str, meta: dict, age_days: float = 0.0) -> Path:
    folder = cache / name
    (folder / "rootfs" / "usr").mkdir(parents=True)
    (folder / "rootfs" / "usr" / "data").write_bytes(b"x" * 4096)
    (folder / "image.json").write_text(json.dumps(meta))
    then = time.time() - age_days * 86400
    os.utime(folder / "image.json", (then, then))
    return folder


def test_stale_and_unused_entries_go_and_current_ones_stay(tmp_path):
    cache = tmp_path / "images"
    builder = ImageBuilder(cache, suite="bookworm", progress=lambda _: None)
    current = {"base": builder.base_key, "tools": TOOLS_DIGEST, "layout": IMAGE_LAYOUT}
    keep_base = _entry(cache, f"base-{builder.base_key}", {"suite": "bookworm"}, age_days=90)
    old_base = _entry(cache, "base-0123456789abcdef", {"suite": "bookworm"})
    fresh = _entry(cache, "a" * 24, current, age_days=1)
    unused = _entry(cache, "b" * 24, current, age_days=40)
    old_tools = _entry(cache, "c" * 24, {**current, "tools": "older"})
    before_layouts = _entry(cache, "d" * 24, {"base": builder.base_key})  # images older code built record no tools
    (cache / "logs").mkdir()
    (cache / "logs" / "old.log").write_text("x")
    os.utime(cache / "logs" / "old.log", (time.time() - 50 * 86400,) * 2)

    dry = subprocess.run([sys.executable, "tools/prune_images.py", "--cache", str(cache), "--dry-run"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert dry.returncode == 0 and "would remove 3 item(s)" in dry.stdout, dry.stdout + dry.stderr
    assert old_base.exists() and old_tools.exists()  # a dry run removes nothing

    removed = builder.prune()
    assert {p for p, _, _ in removed} == {old_base, old_tools, before_layouts}
    assert all(size > 0 and why for _, size, why in removed)
    assert keep_base.exists() and fresh.exists() and unused.exists()

    res = subprocess.run([sys.executable, "tools/prune_images.py", "--cache", str(cache), "--unused-days", "30"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "not used for 30 days" in res.stdout and "build log" in res.stdout, res.stdout
    assert not unused.exists() and not (cache / "logs" / "old.log").exists()
    assert keep_base.exists() and fresh.exists()  # the current base stays however old its record
    assert builder.lookup("never-built") is None


def test_max_gb_evicts_the_least_recently_used_and_never_a_layer_in_use(tmp_path):
    """Over --max-gb the oldest-used images go first until the cache fits; an image whose layer a running sandbox
    stacks (a mounted overlay lists it) stays whatever its age."""
    from rl.sandbox.layers import mount_overlay, overlay_problem, unmount

    cache = tmp_path / "images"
    builder = ImageBuilder(cache, suite="bookworm", progress=lambda _: None)
    current = {"base": builder.base_key, "tools": TOOLS_DIGEST, "layout": IMAGE_LAYOUT}
    base = _entry(cache, f"base-{builder.base_key}", {"suite": "bookworm"})
    images = {age: _entry(cache, f"{age:02d}" + "e" * 22, current, age_days=age) for age in (1, 2, 3, 4)}
    for folder in images.values():  # each 1 MiB more, as a layer
        (folder / "rootfs").rename(folder / "layer")
        (folder / "layer" / "blob").write_bytes(b"x" * (1 << 20))
    mounted = None
    if overlay_problem() is None:  # the oldest is stacked by a sandbox: it stays
        mounted = tmp_path / "merged"
        mounted.mkdir()
        mount_overlay([images[4] / "layer", base / "rootfs"], mounted)
    try:
        fits = 2.6 * 2**20 / 2**30  # about two images and the base
        res = subprocess.run([sys.executable, "tools/prune_images.py", "--cache", str(cache), "--max-gb", str(fits)],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0 and "least recently used" in res.stdout, res.stdout + res.stderr
        kept = sorted(age for age, folder in images.items() if folder.exists())
        assert kept == ([1, 4] if mounted else [1, 2]), res.stdout
    finally:
        if mounted is not None:
            unmount(mounted)
    bad = subprocess.run([sys.executable, "tools/prune_images.py", "--cache", str(cache), "--max-gb", "-1"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--max-gb must be 0 or more" in bad.stderr
