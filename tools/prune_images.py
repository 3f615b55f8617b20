"""Free the task-image cache (MC_IMAGE_CACHE, default /var/cache/megatron-composer/images) of what no prepare will use.

    python tools/prune_images.py [--unused-days N] [--max-gb G] [--dry-run]

Always removed: Debian bases other than this host's current one, images built on another base or by older image
tools, and builds that stopped half-way. With --unused-days, also images no prepare has used for N days and build logs
as old; with --max-gb, the least recently used images until the cache holds at most G GB. An image whose layer a
running sandbox stacks is never removed (it is counted in use). Each removal is one line (folder, size, why), then the
total.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl.sandbox.base import SandboxError  # noqa: E402
from rl.sandbox.image import ImageBuilder  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", help="the image cache (default: MC_IMAGE_CACHE, else "
                                        "/var/cache/megatron-composer/images)")
    parser.add_argument("--unused-days", type=float, help="also remove images unused for this many days")
    parser.add_argument("--max-gb", type=float, help="then remove the least recently used images until the cache "
                                                         "holds at most this many GB")
    parser.add_argument("--dry-run", action="store_true", help="say what would go; remove nothing")
    args = parser.parse_args(argv)
    for name in ("unused_days", "max_gb"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            print(f"error: --{name.replace('_', '-')} must be 0 or more", file=sys.stderr)
            return 2
    try:
        removed = ImageBuilder(args.cache, progress=lambda _: None).prune(
            args.unused_days, dry_run=args.dry_run,
            max_bytes=None if args.max_gb is None else int(args.max_gb * 2**30))
    except (SandboxError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    verb = "would remove" if args.dry_run else "removed"
    for path, size, why in removed:
        print(f"{verb} {path} ({size / 2**20:.1f} MiB): {why}")
    print(f"{verb} {len(removed)} item(s), {sum(s for _, s, _ in removed) / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
