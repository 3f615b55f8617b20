"""Pretraining samples from megatron-core indexed datasets, through BlendedMegatronDatasetBuilder + GPTDataset.

Each sample is a packed sequence of `seq_length` tokens cut from the (shuffled, epoch-repeated) document
stream; `position_ids` restart after every end-of-document token, which the model uses to keep attention
inside each document. The order is a pure function of (seed, blend, split, seq_length), indices are cached
on disk, and sample `i` of the training split is always the same sequence, so resuming only needs the
number of samples consumed.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from megatron_composer.config import ConfigError
from megatron_composer.optional import require


@dataclass
class DataConfig:
    kind: Literal["pretrain", "sft"] = field(
        default="pretrain", metadata={"help": "pretrain: indexed token data; sft: chat JSONL"})
    tokenizer: str = field(
        default="", metadata={"help": "tokenizer file or directory (tools/train_tokenizer.py or an HF checkpoint dir)"})
    chat_format: str = field(
        default="auto",
        metadata={"help": "sft: auto (the tokenizer directory's chat template, else chatml), chatml, "
                          "or the template's tool-call family: kimi_k2, deepseek_v3, deepseek_v31, hermes"})
    paths: list[str] = field(
        default_factory=list,
        metadata={"help": "pretrain: indexed dataset prefixes (PREFIX.bin/.idx); sft: chat JSONL files"})
    weights: list[float] = field(
        default_factory=list, metadata={"help": "blend weights, one per path (empty: proportional to size)"})
    split: str = field(
        default="98,2,0", metadata={"help": "train,valid,test proportions of documents (conversations for SFT)"})
    seq_length: int = 256
    eod_mask_loss: bool = field(
        default=False, metadata={"help": "do not train on predicting the token after an end-of-document"})
    cache_dir: str = field(
        default="", metadata={"help": "where shuffled index files are cached; default <run.dir>/data_cache"})

    def validate(self) -> None:
        if not self.tokenizer:
            raise ConfigError("data.tokenizer is empty; set it to a tokenizer file or directory")
        if not self.paths:
            raise ConfigError("data.paths is empty; list indexed dataset prefixes (pretrain) or chat JSONL files (sft)")
        if self.weights and len(self.weights) != len(self.paths):
            raise ConfigError(f"data.weights has {len(self.weights)} entries for {len(self.paths)} data.paths; "
                              "give one weight per path or none")
        if self.seq_length < 2:
            raise ConfigError(f"data.seq_length={self.seq_length} is too small; use at least 2")
        from megatron_composer.data.chat_format import CHAT_FORMATS

        if self.chat_format not in CHAT_FORMATS:
            raise ConfigError(f"data.chat_format={self.chat_format!r} is not known; use one of {list(CHAT_FORMATS)}")


class DataError(ValueError):
    """A dataset file is missing, corrupt or does not fit the tokenizer/model."""


def check_indexed_dataset(prefix: str, vocab_size: int, eod: int) -> dict:
    """Check PREFIX.bin/.idx exist, are consistent, and were built with a tokenizer that fits; return meta."""
    IndexedDataset = require("megatron.core.datasets.indexed_dataset", "pretraining data (data.kind=pretrain)",
                             "megatron-core").IndexedDataset

    for suffix in (".bin", ".idx"):
        if not Path(prefix + suffix).is_file():
            raise DataError(f"dataset file '{prefix}{suffix}' is missing; "
                            f"build it with tools/preprocess_data.py --output-prefix {prefix}")
    try:
        ds = IndexedDataset(prefix, mmap=True)
        n_tokens = int(ds.sequence_lengths.sum())
        itemsize = ds.index.dtype_size
    except Exception as e:  # megatron-core raises AssertionError/ValueError on a corrupt index
        raise DataError(f"dataset '{prefix}' is corrupt ({type(e).__name__}: {e}); "
                        "rebuild it with tools/preprocess_data.py --overwrite") from None
    bin_bytes = Path(prefix + ".bin").stat().st_size
    if bin_bytes != n_tokens * itemsize:
        raise DataError(f"dataset '{prefix}.bin' has {bin_bytes} bytes but its index describes "
                        f"{n_tokens * itemsize}; rebuild it with tools/preprocess_data.py --overwrite")
    meta_path = Path(prefix + ".meta.json")
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    if meta.get("vocab_size", 0) > vocab_size:
        raise DataError(f"dataset '{prefix}' was tokenized with a {meta['vocab_size']}-token vocabulary "
                        f"but the tokenizer/model has {vocab_size}; use the same tokenizer")
    if "eod" in meta and meta["eod"] != eod:
        raise DataError(f"dataset '{prefix}' uses end-of-document id {meta['eod']} but the tokenizer's is {eod}; "
                        "use the tokenizer the data was built with")
    return meta


class _CoreTokenizerView:
    """The attributes megatron-core's GPTDataset reads from a tokenizer."""

    def __init__(self, tokenizer):
        self.vocab_size = tokenizer.vocab_size
        self.eod = tokenizer.eod
        self.eos = tokenizer.eod
        self.pad = tokenizer.pad
        self.special_tokens_dict = tokenizer.special_tokens_dict
        self.unique_identifiers = {"vocab_size": tokenizer.vocab_size, "eod": tokenizer.eod}


def build_pretrain_datasets(cfg: DataConfig, tokenizer, num_train_samples: int, num_valid_samples: int, seed: int,
                            cache_dir: str):
    """Return (train, valid) GPTDataset-like objects: len() and [i] -> dict of tokens/labels/loss_mask/position_ids."""
    for p in cfg.paths:
        check_indexed_dataset(p, tokenizer.vocab_size, tokenizer.eod)
    feature = "pretraining data (data.kind=pretrain)"
    BlendedMegatronDatasetBuilder = require("megatron.core.datasets.blended_megatron_dataset_builder", feature,
                                            "megatron-core").BlendedMegatronDatasetBuilder
    gpt_dataset = require("megatron.core.datasets.gpt_dataset", feature, "megatron-core")
    GPTDataset, GPTDatasetConfig = gpt_dataset.GPTDataset, gpt_dataset.GPTDatasetConfig
    logging.getLogger("megatron.core").setLevel(logging.WARNING)
    private_group = not torch.distributed.is_initialized()
    if private_group:
        # megatron-core's BlendedDataset calls torch.distributed.get_rank() unconditionally while building its
        # indices; a private single-rank group (removed again below) lets tools and tests build blends.
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    core_cfg = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=cfg.seq_length,
        blend=(list(cfg.paths), list(cfg.weights) if cfg.weights else None),
        split=cfg.split,
        path_to_cache=cache_dir,
        tokenizer=_CoreTokenizerView(tokenizer),
        reset_position_ids=True,
        reset_attention_mask=False,
        eod_mask_loss=cfg.eod_mask_loss,
        create_attention_mask=False,
        mmap_bin_files=True,
    )
    sizes = [num_train_samples, num_valid_samples, 0]
    if not cfg.weights:
        sizes = [num_train_samples, num_valid_samples, None]
    try:
        train, valid, _ = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, core_cfg).build()
    except AssertionError as e:
        raise DataError(f"cannot build datasets from {cfg.paths} with split '{cfg.split}': "
                        f"{e or 'a split is empty'}; use more data or a different data.split") from None
    finally:
        if private_group:
            torch.distributed.destroy_process_group()
    if train is None or len(train) == 0:
        raise DataError(f"training split of {cfg.paths} is empty; "
                        "use more data or raise the first number of data.split")
    if num_valid_samples and (valid is None or len(valid) == 0):
        raise DataError(f"validation split of {cfg.paths} is empty; "
                        f"raise the second number of data.split='{cfg.split}'")
    return train, valid


def collate(samples: list[dict]) -> dict[str, torch.Tensor]:
    keys = ("tokens", "labels", "loss_mask", "position_ids")
    return {k: torch.stack([s[k] for s in samples]) for k in keys}
