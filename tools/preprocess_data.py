"""Tokenize a corpus into a megatron-core indexed dataset (PREFIX.bin / PREFIX.idx), one document per JSONL
record or source file, each followed by the end-of-document token.

    python tools/preprocess_data.py --input corpus.jsonl src_dir/ --tokenizer data/tok --output-prefix data/code

Also writes PREFIX.meta.json (tokenizer, vocab size, eod, counts) which training checks against the model.
An existing dataset is never replaced unless --overwrite is given; output is written under a temporary name
and renamed only when complete, so an interrupted run leaves nothing half-written.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from megatron_composer.data.corpus import CorpusError, iter_documents, list_inputs  # noqa: E402
from megatron_composer.data.tokenizer import TokenizerError, load_tokenizer  # noqa: E402

_worker_tokenizer = None


def _init_worker(tokenizer_path: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = load_tokenizer(tokenizer_path)


def _encode(text: str) -> tuple[list[int], int]:
    ids = _worker_tokenizer.encode(text)
    ids.append(_worker_tokenizer.eod)
    return ids, len(text.encode("utf-8"))


def write_indexed_dataset(prefix: Path, tokenizer, documents, inputs: list) -> dict:
    """Write PREFIX.bin/.idx/.meta.json from `documents`, an iterable of (token ids ending with EOD, source
    bytes); under a temporary name, renamed only when complete. Returns the meta (what training checks)."""
    from megatron_composer.optional import require

    indexed = require("megatron.core.datasets.indexed_dataset", "an indexed dataset", "megatron-core")
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(f"{prefix}.tmp{os.getpid()}")
    dtype = indexed.DType.optimal_dtype(tokenizer.vocab_size)
    builder = indexed.IndexedDatasetBuilder(f"{tmp}.bin", dtype=dtype)
    n_docs = n_tokens = n_bytes = 0
    try:
        for ids, nb in documents:
            builder.add_document(np.asarray(ids, dtype=dtype), [len(ids)])
            n_docs += 1
            n_tokens += len(ids)
            n_bytes += nb
        if n_docs == 0:
            raise CorpusError(f"no documents found in {inputs}")
        builder.finalize(f"{tmp}.idx")
        meta = {"tokenizer": tokenizer.describe(), "vocab_size": tokenizer.vocab_size, "eod": tokenizer.eod,
                "documents": n_docs, "tokens": n_tokens, "bytes": n_bytes, "inputs": [str(p) for p in inputs]}
        Path(f"{tmp}.meta.json").write_text(json.dumps(meta, indent=2))
        for suffix in (".bin", ".idx", ".meta.json"):
            os.replace(f"{tmp}{suffix}", f"{prefix}{suffix}")
    finally:
        for suffix in (".bin", ".idx", ".meta.json"):
            Path(f"{tmp}{suffix}").unlink(missing_ok=True)
    return meta


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", nargs="+", required=True, help="JSONL files and/or directories of source files")
    ap.add_argument("--tokenizer", required=True,
                    help="tokenizer file or directory (see megatron_composer.data.load_tokenizer)")
    ap.add_argument("--output-prefix", required=True, help="writes PREFIX.bin, PREFIX.idx, PREFIX.meta.json")
    ap.add_argument("--json-key", default="text")
    ap.add_argument("--exclude", default="site-packages,test,tests,idlelib",
                    help="comma-separated directory names skipped inside input directories")
    ap.add_argument("--extensions", default=".py", help="comma-separated source extensions read from directories")
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 1)))
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args(argv)

    from megatron_composer.optional import MissingDependency, require

    try:
        require("megatron.core.datasets.indexed_dataset", "tools/preprocess_data.py", "megatron-core")
    except MissingDependency as e:
        print(f"error: {e}", file=sys.stderr)
        return 1

    prefix = Path(args.output_prefix)
    outputs = [Path(f"{prefix}{s}") for s in (".bin", ".idx", ".meta.json")]
    existing = [str(p) for p in outputs if p.exists()]
    if existing and not args.overwrite:
        print(f"error: {existing[0]} exists; pass --overwrite to replace the dataset", file=sys.stderr)
        return 1
    try:
        tokenizer = load_tokenizer(args.tokenizer)
        files = list_inputs(args.input, tuple(args.extensions.split(",")), [x for x in args.exclude.split(",") if x])
    except (TokenizerError, CorpusError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    t0 = time.time()
    try:
        with multiprocessing.Pool(args.workers, initializer=_init_worker, initargs=(str(tokenizer.path),)) as pool:
            docs = iter_documents(files, args.json_key)
            meta = write_indexed_dataset(prefix, tokenizer, tqdm(pool.imap(_encode, docs, chunksize=16),
                                                                 desc="tokenizing", unit="doc"), args.input)
    except CorpusError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    n_docs, n_tokens, n_bytes = meta["documents"], meta["tokens"], meta["bytes"]
    dt = time.time() - t0
    print(
        f"wrote {prefix}.bin/.idx: {n_docs} documents, {n_tokens} tokens "
        f"({n_bytes / max(n_tokens, 1):.2f} bytes/token) "
        f"from {len(files)} files in {dt:.1f}s with {args.workers} workers"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
