"""Reading raw training text: JSONL files with a text field, or directory trees of source files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, Sequence


class CorpusError(ValueError):
    """An input path or record cannot be read as training text."""


def list_inputs(inputs: Sequence[str | Path], extensions: Sequence[str] = (".py",),
                exclude: Sequence[str] = ()) -> list[Path]:
    """Expand files and directories into a sorted, deterministic list of files to read.

    Directories contribute files with the given extensions (and .jsonl files), skipping any path that has a
    component listed in `exclude` (e.g. site-packages, tests).
    """
    files: list[Path] = []
    skip = set(exclude)
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            found = sorted(
                f for f in p.rglob("*")
                if (f.suffix in extensions or f.suffix == ".jsonl")
                and not skip.intersection(f.relative_to(p).parts) and f.is_file()
            )
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise CorpusError(f"input '{p}' does not exist; pass JSONL files or directories of source files")
    if not files:
        raise CorpusError(f"no input files under {list(map(str, inputs))} with extensions {list(extensions)} or .jsonl")
    return files


def iter_jsonl(path: Path | str, error: type[Exception] = CorpusError) -> Iterator[tuple[int, object]]:
    """(line number, record) of each non-blank line; a line that is not JSON raises `error` naming it."""
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise error(f"{path}:{lineno} is not valid JSON ({e.msg}); fix or remove the line") from None


def iter_documents(files: Sequence[Path], json_key: str = "text") -> Iterator[str]:
    """Yield one document per JSONL record (its `json_key` field) or per source file."""
    for f in files:
        if f.suffix in (".jsonl", ".json"):
            for lineno, record in iter_jsonl(f):
                text = record.get(json_key) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    raise CorpusError(f"{f}:{lineno} has no string field '{json_key}'; pass --json-key")
                yield text
        else:
            text = f.read_text(encoding="utf-8", errors="replace")
            if text.strip():
                yield text
