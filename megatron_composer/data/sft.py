"""SFT data: chat JSONL conversations rendered by the shared chat template, packed into fixed-length rows.

Each JSONL line is {"messages": [...]} (or a bare list of messages) in the schema of
megatron_composer.data.chat_template. Every rendered segment is tokenized separately so the trainable flag
of each token is exact; a token carries loss only when it is part of an assistant turn (its content, tool
calls and closing <|im_end|>). Conversations are packed greedily into rows of seq_length+1 tokens;
position_ids restart at every conversation so attention stays inside it, and padding carries no loss.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from megatron_composer.data.chat_template import ChatFormatError, render_segments
from megatron_composer.data.corpus import iter_jsonl
from megatron_composer.data.pretrain_data import DataError


def tokenize_conversation(messages: list[dict], tokenizer) -> tuple[list[int], list[bool]]:
    """Token ids of a rendered conversation and, per token, whether it is trained on; ends with EOD."""
    ids: list[int] = []
    trainable: list[bool] = []
    for text, train in render_segments(messages):
        piece = tokenizer.encode(text)
        ids.extend(piece)
        trainable.extend([train] * len(piece))
    ids.append(tokenizer.eod)
    trainable.append(False)
    return ids, trainable


def read_conversations(paths: list[str]) -> list[list[dict]]:
    conversations = []
    for path in paths:
        if not Path(path).is_file():
            raise DataError(f"SFT data file '{path}' is missing; data.paths must list chat JSONL files")
        for lineno, record in iter_jsonl(path, DataError):
            messages = record.get("messages") if isinstance(record, dict) else record
            if not isinstance(messages, list) or not messages:
                raise DataError(f"{path}:{lineno} needs a non-empty 'messages' list")
            conversations.append(messages)
    if not conversations:
        raise DataError(f"no conversations in {paths}")
    return conversations


def pack_conversations(tokenized: list[tuple[list[int], list[bool]]], seq_length: int, pad_id: int) -> dict[str, np.ndarray]:
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

    def __init__(self, conversations: list[list[dict]], tokenizer, seq_length: int, seed: int):
        tokenized = []
        for i, conv in enumerate(conversations):
            try:
                tokenized.append(tokenize_conversation(conv, tokenizer))
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
    conversations = read_conversations(cfg.paths)
    parts = [float(x) for x in cfg.split.replace("/", ",").split(",")]
    perm = np.random.default_rng(seed).permutation(len(conversations))
    n_valid = int(round(len(conversations) * parts[1] / sum(parts))) if len(parts) > 1 else 0
    if parts[1:2] and parts[1] > 0:
        n_valid = max(1, n_valid)
    if n_valid >= len(conversations):
        raise DataError(f"only {len(conversations)} conversations: too few for data.split='{cfg.split}'; add data or lower the valid share")
    valid_convs = [conversations[i] for i in perm[:n_valid]]
    train_convs = [conversations[i] for i in perm[n_valid:]]
    train = PackedSFTDataset(train_convs, tokenizer, cfg.seq_length, seed)
    valid = PackedSFTDataset(valid_convs, tokenizer, cfg.seq_length, seed + 1) if valid_convs else None
    return train, valid
