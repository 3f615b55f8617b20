"""Train a byte-fallback sentencepiece BPE tokenizer on a corpus (JSONL files or directories of source files).

    python tools/train_tokenizer.py --input /usr/lib/python3.11 --output data/tok --vocab-size 4096

Writes OUTPUT/tokenizer.model (+ .vocab), loadable with megatron_composer.data.load_tokenizer(OUTPUT). The
chat template's markers are single tokens; indentation and newlines are preserved exactly.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqdm import tqdm  # noqa: E402

from megatron_composer.data.chat_template import SPECIAL_TOKENS  # noqa: E402
from megatron_composer.data.corpus import CorpusError, iter_documents, list_inputs  # noqa: E402
from megatron_composer.data.tokenizer import EOD_TOKEN, PAD_TOKEN, UNK_TOKEN, load_tokenizer  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", nargs="+", required=True, help="JSONL files and/or directories of source files")
    ap.add_argument("--output", required=True, help="output directory (gets tokenizer.model)")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--extensions", default=".py",
                    help="comma-separated source file extensions to read from directories")
    ap.add_argument("--json-key", default="text")
    ap.add_argument("--exclude", default="site-packages,test,tests,idlelib",
                    help="comma-separated directory names skipped inside input directories")
    ap.add_argument("--max-lines", type=int, default=2_000_000, help="lines sampled for training")
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args(argv)

    import sentencepiece as spm

    out = Path(args.output)
    if (out / "tokenizer.model").exists() and not args.overwrite:
        print(f"error: {out / 'tokenizer.model'} exists; pass --overwrite to replace it", file=sys.stderr)
        return 1
    try:
        files = list_inputs(args.input, tuple(args.extensions.split(",")), [x for x in args.exclude.split(",") if x])
        lines = []
        for doc in tqdm(iter_documents(files, args.json_key), desc="reading corpus", unit="doc"):
            lines.extend(line for line in doc.split("\n") if line.strip())
            if len(lines) >= args.max_lines:
                break
    except CorpusError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    out.mkdir(parents=True, exist_ok=True)
    print(f"training sentencepiece BPE (vocab {args.vocab_size}) on {len(lines)} lines from {len(files)} files")
    spm.SentencePieceTrainer.Train(
        sentence_iterator=iter(lines[: args.max_lines]),
        model_prefix=str(out / "tokenizer"),
        model_type="bpe",
        vocab_size=args.vocab_size,
        byte_fallback=True,
        character_coverage=0.9995,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        add_dummy_prefix=False,
        max_sentence_length=1 << 14,
        unk_id=0, unk_piece=UNK_TOKEN,
        pad_id=1, pad_piece=PAD_TOKEN,
        eos_id=2, eos_piece=EOD_TOKEN,
        bos_id=-1,
        user_defined_symbols=list(SPECIAL_TOKENS) + ["\n", "    "],
        num_threads=2,
        minloglevel=2,
    )
    tok = load_tokenizer(out)
    print(f"wrote {out / 'tokenizer.model'}: vocab_size={tok.vocab_size} eod={tok.eod} special={tok.special_tokens}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
