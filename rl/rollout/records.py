"""The rollout records and their file: what a rollout worker hands the trainer for one group.

A group (one prompt's G episodes) is a dict as `RolloutWorker.run_group` builds it:

    gid, prompt_index, attempt      the work item it answers
    task, kind, worker              task name, "single_turn" | "agent", the worker that ran it
    episodes                        G episodes, each:
        reward                          training reward (verifier reward + shaping terms)
        verifier_reward, reward_terms   its parts
        meta                            turns, tokens, stop_reason, verdict, transcript, error (when it
                                        ended in one: scored 0), ... (JSON)
        segments                        the episode's context windows (several when it summarised), each:
            prompt_ids       [P]        int   the window's prompt
            response_ids     [R]        int   every token after it: sampled (mask 1) and appended (mask 0)
            response_logprobs[R]        float behaviour log-prob of each sampled token (0 for appended ones)
            response_mask    [R]        0/1
            weight_versions  [sum mask] int   the weight version each sampled token came from
            routed_experts   [L, P+R, K] int  experts the engine chose per MoE layer and position, or None
    infra_faults, version_counts, min_weight_version, eval_version, seconds

On disk a group is one safetensors file: every segment array is a tensor named ``e{i}.s{j}.{field}`` (token ids
int32, log-probs float32, mask uint8, routing uint8 when the model has at most 256 experts, else int16) and
everything else is JSON in the file's metadata, together with each segment's lengths and trained-token count.
Nothing is unpickled when a record is read. `read_group_index` reads only the header: its segments are
`StoredSegment`s that read their arrays on `load()`, so a trainer rank reads only the samples it trains on.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

_ARRAYS = {"prompt_ids": torch.int32, "response_ids": torch.int32, "response_logprobs": torch.float32,
           "response_mask": torch.uint8, "weight_versions": torch.int32}
FORMAT = "megatron-composer/rollout-group/1"


class RecordError(ValueError):
    """A rollout record is malformed or its file is not one."""


class _ReadCounter:
    """Bytes this process read from record files (the data-path test and benchmark count them)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.bytes = 0

    def add(self, n: int) -> None:
        with self._lock:
            self.bytes += n


bytes_read = _ReadCounter()


def _routing_dtype(routing: torch.Tensor) -> torch.dtype:
    return torch.uint8 if routing.numel() == 0 or int(routing.max()) < 256 else torch.int16


def encode_group(group: dict) -> bytes:
    """The file bytes of a group (see the module docstring)."""
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    episodes = []
    for i, ep in enumerate(group["episodes"]):
        segs = []
        for j, seg in enumerate(ep["segments"]):
            where = f"group {group.get('gid')} episode {i} segment {j}"
            arrays = {}
            for name, dtype in _ARRAYS.items():
                values = seg.get(name)
                values = [] if values is None else values
                is_tensor = isinstance(values, torch.Tensor)
                arrays[name] = values.to(dtype) if is_tensor else torch.tensor(values, dtype=dtype)
            P, R = len(seg["prompt_ids"]), len(seg["response_ids"])
            if len(seg["response_mask"]) != R or len(seg["response_logprobs"]) != R:
                raise RecordError(f"{where}: response_mask and response_logprobs need one entry per response token "
                                  f"({R})")
            routing = seg.get("routed_experts")
            if routing is not None:
                if routing.dim() != 3 or routing.shape[1] != P + R:
                    raise RecordError(f"{where}: routed_experts must be [layers, {P + R}, top_k], got "
                                      f"{list(routing.shape)}")
                arrays["routed_experts"] = routing.to(_routing_dtype(routing))
            tensors.update({f"e{i}.s{j}.{name}": t.contiguous() for name, t in arrays.items()})
            segs.append({"prompt_len": P, "response_len": R, "loss_tokens": int(arrays["response_mask"].sum()),
                         "routing_shape": None if routing is None else list(routing.shape),
                         "nbytes": sum(t.numel() * t.element_size() for t in arrays.values())})
        episodes.append({k: v for k, v in ep.items() if k != "segments"} | {"segments": segs})
    header = {k: v for k, v in group.items() if k != "episodes"} | {"episodes": episodes}
    return save(tensors, metadata={"format": FORMAT, "group": json.dumps(header, default=_json_default)})


def _json_default(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON")


@dataclass
class StoredSegment:
    """A segment whose arrays stay in its record file until `load()` (what a trainer rank reads)."""

    path: str
    key: str  # "e{i}.s{j}"
    prompt_len: int
    response_len: int
    loss_tokens: int
    routing_shape: Optional[list[int]]
    nbytes: int  # of its arrays in the file (what `load` reads)

    def load(self) -> dict:
        from safetensors import safe_open

        out = {}
        with safe_open(self.path, framework="pt") as f:
            for name in list(_ARRAYS) + (["routed_experts"] if self.routing_shape is not None else []):
                t = f.get_tensor(f"{self.key}.{name}")
                bytes_read.add(t.numel() * t.element_size())
                out[name] = t
        seg = {name: out[name].tolist() for name in _ARRAYS}
        seg["routed_experts"] = out["routed_experts"].long() if self.routing_shape is not None else None
        return seg


def read_group_index(path: str | Path) -> dict:
    """A group file's record with `StoredSegment`s in place of the segment arrays (reads the header only)."""
    from safetensors import safe_open

    path = str(path)
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as e:  # safetensors raises its own error types for a truncated or foreign file
        raise RecordError(f"'{path}' is not a rollout group file ({e})") from None
    if meta.get("format") != FORMAT:
        raise RecordError(f"'{path}' is not a rollout group file of format {FORMAT} (got {meta.get('format')!r})")
    header = meta["group"]
    bytes_read.add(len(header))
    group = json.loads(header)
    for i, ep in enumerate(group["episodes"]):
        ep["segments"] = [StoredSegment(path, f"e{i}.s{j}", s["prompt_len"], s["response_len"], s["loss_tokens"],
                                        s["routing_shape"], s["nbytes"]) for j, s in enumerate(ep["segments"])]
    return group


def read_group(path: str | Path) -> dict:
    """A group file's whole record (every segment's arrays loaded)."""
    group = read_group_index(path)
    for ep in group["episodes"]:
        ep["segments"] = [seg.load() for seg in ep["segments"]]
    return group
