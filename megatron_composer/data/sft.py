"""SFT data: chat JSONL conversations rendered by the run's chat format (`data.chat_format`: the model's own
template or the project's ChatML), packed into fixed-length rows.

Each JSONL line is {"messages": [...], "tools": [...]} (tools optional, OpenAI function schemas; or a bare
list of messages) in the OpenAI message schema. Every rendered segment is tokenized separately so the trainable
flag of each token is exact; a token carries loss only when it is part of an assistant turn (what the model
writes after its generation prompt: reasoning, content, tool calls and the closing end of turn). A template that
renders earlier turns differently later (drops their reasoning) gives one sample per such turn (see
`ChatFormat.render_segments`). Samples are packed greedily into rows of seq_length+1 tokens; position_ids
restart at every sample so attention stays inside it, and padding carries no loss.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from megatron_composer.data.chat_format import ChatFormat, ChatMLFormat, load_chat_format
from megatron_composer.data.chat_template import ChatFormatError
from megatron_composer.data.corpus import iter_jsonl
from megatron_composer.data.pretrain_data import DataError


def tokenize_conversation(messages: list[dict], tokenizer, chat_format: ChatFormat | None = None,
                          tools: list[dict] | None = None) -> list[tuple[list[int], list[bool]]]:
    """The SFT samples of a conversation: token ids and, per token, whether it is trained on; each ends with EOD."""
    samples = []
    for segments in (chat_format or ChatMLFormat()).render_segments(messages, tools=tools):
        ids: list[int] = []
        trainable: list[bool] = []
        for text, train in segments:
            piece = tokenizer.encode(text)
            ids.extend(piece)
            trainable.extend([train] * len(piece))
        ids.append(tokenizer.eod)
        trainable.append(False)
        samples.append((ids, trainable))
    return samples


def read_conversations(paths: list[str]) -> list[dict]:
    """{"messages", "tools"} records of chat JSONL files."""
    conversations = []
    for path in paths:
        if not Path(path).is_file():
            raise DataError(f"SFT data file '{path}' is missing; data.paths must list chat JSONL files")
        for lineno, record in iter_jsonl(path, DataError):
            messages = record.get("messages") if isinstance(record, dict) else record
            if not isinstance(messages, list) or not messages:
                raise DataError(f"{path}:{lineno} needs a non-empty 'messages' list")
            tools = record.get("tools") if isinstance(record, dict) else None
            if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
                raise DataError(f"{path}:{lineno}: 'tools' must be a list of function schemas")
            conversations.append({"messages": messages, "tools": tools or None})
    if not conversations:
        raise DataError(f"no conversations in {paths}")
    return conversations


def pack_conversations(tokenized: list[tuple[list[int], list[bool]]], seq_length: int,
                       pad_id: int) -> dict[str, np.ndarray]:
    """Greedy packing into rows of seq_length+1 tokens; returns arrays tokens/trainable/position_ids [N, L+1]."""
    row_len = seq_length + 1
    rows_tok, rows_train, rows_pos = [], [], []
    cur_tok: list[int] = []
    cur_train: list[bool] = []
    cur_pos: list[int] = []

    def flush():
        pad = row_len - len(cur_tok)
        rows_tok.append(cur_tok + [pad_id] * pad)
        rows_train.append(cur_train + [False] * pad)
        rows_pos.append(cur_pos + list(range(pad)))

    for ids, train in tokenized:
        ids, train = ids[:row_len], train[:row_len]  # over-long conversations are truncated
        if len(cur_tok) + len(ids) > row_len and cur_tok:
            flush()
            cur_tok, cur_train, cur_pos = [], [], []
        cur_tok += ids
        cur_train += train
        cur_pos += list(range(len(ids)))
    if cur_tok:
        flush()
    return {
        "tokens": np.asarray(rows_tok, dtype=np.int64),
        "trainable": np.asarray(rows_train, dtype=bool),
        "position_ids": np.asarray(rows_pos, dtype=np.int64),
    }


class PackedSFTDataset:
    """Packed rows, reshuffled each epoch with a seed-determined permutation; index i is stable across runs."""

    def __init__(self, conversations: list, tokenizer, seq_length: int, seed: int,
                 chat_format: ChatFormat | None = None):
        """conversations: {"messages", "tools"} records or bare message lists."""
        tokenized = []
        for i, conv in enumerate(conversations):
            record = conv if isinstance(conv, dict) else {"messages": conv}
            try:
                tokenized += tokenize_conversation(record["messages"], tokenizer, chat_format, record.get("tools"))
            except ChatFormatError as e:
                raise DataError(f"conversation {i}: {e}") from None
        self.truncated = sum(len(ids) > seq_length + 1 for ids, _ in tokenized)
        self.rows = pack_conversations(tokenized, seq_length, tokenizer.pad)
        self.seed = seed
        self.num_rows = len(self.rows["tokens"])

    def __len__(self) -> int:
        return self.num_rows

    def _row(self, i: int) -> int:
        epoch, j = divmod(i, self.num_rows)
        perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)
        return int(perm[j])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        r = self._row(i)
        tokens = torch.from_numpy(self.rows["tokens"][r])
        trainable = torch.from_numpy(self.rows["trainable"][r])
        position_ids = torch.from_numpy(self.rows["position_ids"][r])
        # loss at position t is for predicting token t+1: trained iff token t+1 is an assistant token
        return {
            "tokens": tokens[:-1].clone(),
            "labels": tokens[1:].clone(),
            "loss_mask": trainable[1:].float(),
            "position_ids": position_ids[:-1].clone(),
        }


def build_sft_datasets(cfg, tokenizer, seed: int):
    """Split conversations by cfg.split (train, valid fractions) with a seeded shuffle, then pack each side."""
    try:
        chat_format = load_chat_format(cfg.chat_format, tokenizer)
    except ChatFormatError as e:
        raise DataError(f"data.chat_format: {e}") from None
    conversations = read_conversations(cfg.paths)
    parts = [float(x) for x in cfg.split.replace("/", ",").split(",")]
    perm = np.random.default_rng(seed).permutation(len(conversations))
    n_valid = int(round(len(conversations) * parts[1] / sum(parts))) if len(parts) > 1 else 0
    if parts[1:2] and parts[1] > 0:
        n_valid = max(1, n_valid)
    if n_valid >= len(conversations):
        raise DataError(f"only {len(conversations)} conversations: too few for data.split='{cfg.split}'; "
                        "add data or lower the valid share")
    valid_convs = [conversations[i] for i in perm[:n_valid]]
    train_convs = [conversations[i] for i in perm[n_valid:]]
    train = PackedSFTDataset(train_convs, tokenizer, cfg.seq_length, seed, chat_format)
    valid = PackedSFTDataset(valid_convs, tokenizer, cfg.seq_length, seed + 1, chat_format) if valid_convs else None
    return train, valid
