"""Write a generated family of easy sandboxed agent tasks (Harbor folders) in named, disjoint splits.

    python tools/make_agent_tasks.py --output data/tiny/agent_tasks --splits sft=480 train=320 heldout=24 --seed 0

Kinds in four tiers (tools/task_family.py TIERS): 1 create an empty file; 2 write a word to a file; 3 make a
failing one-line unittest pass; 4 create a file with given content, rename / move a file, replace a word in a
file, run a command and write its output. Each kind's instances are shared among the splits in proportion to
their sizes, so no instance is in two of them. Check one: `python tools/check_task.py DIR/train/<task>
[--oracle]` (untouched 0, solution 1).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.task_family import KINDS, generate_splits  # noqa: E402


def parse_splits(items: list[str]) -> dict[str, int]:
    splits = {}
    for item in items:
        name, sep, n = item.partition("=")
        if not sep or not name or not n.isdigit() or int(n) < 1:
            raise SystemExit(f"error: split {item!r} must look like NAME=COUNT (e.g. train=320)")
        splits[name] = int(n)
    return splits


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output", required=True, help="folder that receives one sub-folder per split")
    ap.add_argument("--splits", nargs="+", default=["train=320", "heldout=24"], help="NAME=COUNT ...")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated subset of {','.join(KINDS)}")
    ap.add_argument("--force", action="store_true", help="replace existing split folders")
    args = ap.parse_args(argv)
    splits = parse_splits(args.splits)
    out = Path(args.output)
    for split in splits:
        if (out / split).exists():
            if not args.force:
                print(f"error: {out / split} exists; pass --force to replace it", file=sys.stderr)
                return 2
            shutil.rmtree(out / split)
    try:
        written = generate_splits(out, splits, args.seed, tuple(k for k in args.kinds.split(",") if k))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for split, dirs in written.items():
        print(f"{out / split}: {len(dirs)} tasks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
