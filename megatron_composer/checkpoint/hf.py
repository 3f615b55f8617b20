"""Hugging Face checkpoints <-> our model: DeepSeek-V3 / Kimi K2(.5) and Qwen3-MoE.

Import is by slices. `HFReader` opens a checkpoint directory (config.json and the safetensors headers only)
and returns any box of any of our full tensors, reading only those bytes (`safe_open(...).get_slice`);
`load_hf_shards` fills a model in any layout -- each rank only the pieces it holds -- after checking every
tensor name and shape against the model (a mismatch raises `CheckpointError` naming the tensor before any
weight is read). DeepSeek-style FP8 weights (float8_e4m3fn with a `weight_scale_inv` per 128x128 block) are
dequantised on the box. MTP layers that HF stores as extra decoder layers (`model.layers.{num_layers + k}`)
become `model.mtp[k]`.

Export writes the hub layout (per-expert tensors, MTP as extra layers, sharded with an index) and a
config.json that `transformers` loads, streaming: one gathered tensor at a time, each file written when full.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from ..model import ModelConfig, ModelConfigError, RopeScaling, Transformer
from ..model.moe import Router
from . import int4
from .errors import CheckpointError

logger = logging.getLogger(__name__)


SUPPORTED = ("deepseek_v3", "kimi_k2", "kimi_k25", "qwen3_moe")
FP8_BLOCK = 128


# ---- config translation -------------------------------------------------------------------------------
def _rope_from_hf(hf: dict) -> tuple[float, Optional[RopeScaling]]:
    params = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    params = {**legacy, **params}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    if kind != "yarn":
        raise CheckpointError(f"config.json rope type '{kind}' is not supported; supported: default, yarn")
    factor = params.get("factor")
    orig = params.get("original_max_position_embeddings", hf.get("max_position_embeddings"))
    if factor is None:
        factor = hf["max_position_embeddings"] / orig
    return theta, RopeScaling(
        factor=float(factor), original_max_position_embeddings=int(orig),
        beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"), mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"), truncate=bool(params.get("truncate", True)),
    )


def text_config(hf: dict) -> dict:
    """The language-model part of a config.json (Kimi K2.5 nests it under text_config)."""
    if hf.get("model_type") == "kimi_k25" or ("text_config" in hf and "hidden_size" not in hf):
        return hf["text_config"]
    return hf


def config_from_hf(hf: dict) -> ModelConfig:
    hf = text_config(hf)
    model_type = hf.get("model_type", "deepseek_v3")
    if model_type not in SUPPORTED:
        raise CheckpointError(f"config.json model_type '{model_type}' is not supported; supported: {list(SUPPORTED)}")
    theta, scaling = _rope_from_hf(hf)
    common = dict(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6), tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        num_heads=hf["num_attention_heads"], attention_bias=bool(hf.get("attention_bias", False)),
        rope_theta=theta, rope_scaling=scaling, max_position_embeddings=hf.get("max_position_embeddings", 4096),
        intermediate_size=hf["intermediate_size"], moe_intermediate_size=hf.get("moe_intermediate_size", 1),
        num_experts_per_tok=hf.get("num_experts_per_tok", 1), norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
    )
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"config.json hidden_act '{hf['hidden_act']}' is not supported; only silu")
    try:
        if model_type == "qwen3_moe":
            if hf.get("use_sliding_window"):
                raise CheckpointError("config.json use_sliding_window=true is not supported; set it to false")
            cfg = ModelConfig(
                **common, attention="gqa", num_kv_heads=hf.get("num_key_value_heads"), head_dim=hf.get("head_dim"),
                qk_norm=True, rope_interleave=False, num_experts=hf.get("num_experts", hf.get("num_local_experts", 0)),
                moe_layer_freq=hf.get("decoder_sparse_step", 1), dense_layers=list(hf.get("mlp_only_layers") or []),
                score_func="softmax",
            )
        else:
            scoring = hf.get("scoring_func", "sigmoid")
            topk_method = hf.get("topk_method", "noaux_tc")
            cfg = ModelConfig(
                **common, attention="mla", q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf["kv_lora_rank"],
                qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
                v_head_dim=hf["v_head_dim"], rope_interleave=bool(hf.get("rope_interleave", True)),
                num_experts=hf.get("n_routed_experts") or 0, num_shared_experts=hf.get("n_shared_experts") or 0,
                first_k_dense_replace=hf.get("first_k_dense_replace") or 0, moe_layer_freq=hf.get("moe_layer_freq", 1),
                score_func=scoring, n_group=hf.get("n_group") or 1, topk_group=hf.get("topk_group") or 1,
                expert_bias=topk_method == "noaux_tc",
                routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                num_mtp_layers=hf.get("num_nextn_predict_layers", 0) or 0,
            )
        return cfg.validate()
    except KeyError as e:
        raise CheckpointError(f"config.json lacks required field {e}") from None
    except ModelConfigError as e:
        raise CheckpointError(f"config.json describes an inconsistent model: {e}") from None


def config_to_hf(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    dtype_name = str(dtype).removeprefix("torch.")
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        rope = {"rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": s.factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
                "beta_fast": s.beta_fast, "beta_slow": s.beta_slow, "truncate": s.truncate}
        for key in ("mscale", "mscale_all_dim", "attention_factor"):
            if getattr(s, key) is not None:
                rope[key] = getattr(s, key)
    common = {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size, "num_experts_per_tok": cfg.num_experts_per_tok,
        "norm_topk_prob": cfg.norm_topk_prob, "rms_norm_eps": cfg.rms_norm_eps, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias, "rope_parameters": rope, "dtype": dtype_name,
        "initializer_range": cfg.init_std,
    }
    if cfg.attention == "gqa":
        _check_exportable(cfg.num_experts > 0, "Qwen3-MoE export needs num_experts > 0")
        _check_exportable(cfg.num_shared_experts == 0, "Qwen3-MoE has no shared experts; set num_shared_experts=0")
        _check_exportable(cfg.score_func == "softmax" and cfg.n_group == 1 and not cfg.expert_bias
                          and cfg.routed_scaling_factor == 1.0 and cfg.first_k_dense_replace == 0,
                          "Qwen3-MoE routing is plain softmax top-k (no groups, bias, scaling or dense prefix)")
        _check_exportable(cfg.qk_norm, "Qwen3-MoE always uses q/k norm; set qk_norm=true")
        _check_exportable(cfg.num_mtp_layers == 0, "Qwen3-MoE has no MTP layers")
        return {**common, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                "num_key_value_heads": cfg.num_kv_heads or cfg.num_heads, "head_dim": cfg.gqa_head_dim,
                "num_experts": cfg.num_experts, "decoder_sparse_step": cfg.moe_layer_freq,
                "mlp_only_layers": list(cfg.dense_layers), "use_sliding_window": False, "sliding_window": None}
    _check_exportable(cfg.score_func == "sigmoid", "DeepSeek-V3 routing scores with sigmoid; set score_func=sigmoid")
    _check_exportable(cfg.moe_layer_freq == 1 and not cfg.dense_layers,
                      "DeepSeek-V3 layers are dense only for the first first_k_dense_replace layers")
    _check_exportable(cfg.num_experts > 0 and cfg.num_shared_experts > 0,
                      "the transformers DeepSeek-V3 class needs routed and shared experts")
    return {**common, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
            "num_key_value_heads": cfg.num_heads, "q_lora_rank": cfg.q_lora_rank, "kv_lora_rank": cfg.kv_lora_rank,
            "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
            "v_head_dim": cfg.v_head_dim, "rope_interleave": cfg.rope_interleave,
            "n_routed_experts": cfg.num_experts, "n_shared_experts": cfg.num_shared_experts,
            "first_k_dense_replace": cfg.first_k_dense_replace, "n_group": cfg.n_group, "topk_group": cfg.topk_group,
            "routed_scaling_factor": cfg.routed_scaling_factor, "scoring_func": "sigmoid",
            "topk_method": "noaux_tc", "num_nextn_predict_layers": cfg.num_mtp_layers}


def _check_exportable(ok: bool, msg: str) -> None:
    if not ok:
        raise CheckpointError(f"cannot export to a transformers architecture: {msg}")


# ---- name mapping -------------------------------------------------------------------------------------
_ATTN = {"q_proj": "wq", "q_a_proj": "wq_a", "q_a_layernorm": "q_norm", "q_b_proj": "wq_b",
         "kv_a_proj_with_mqa": "wkv_a", "kv_a_layernorm": "kv_norm", "kv_b_proj": "wkv_b", "o_proj": "wo",
         "k_proj": "wk", "v_proj": "wv", "q_norm": "q_norm", "k_norm": "k_norm"}
_FFN = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_ATTN_INV = {"mla": {v: k for k, v in _ATTN.items() if k not in ("k_proj", "v_proj", "q_norm", "k_norm")},
             "gqa": {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj", "q_norm": "q_norm",
                     "k_norm": "k_norm"}}
_FFN_INV = {v: k for k, v in _FFN.items()}


@dataclass(frozen=True)
class Target:
    """Where an HF tensor goes: our parameter name, and for stacked experts the expert index and, for HF's
    fused gate_up tensor, which half."""

    name: str
    expert: Optional[int] = None
    fused_half: Optional[int] = None  # 0: gate (w1), 1: up (w3) of a fused [E, 2F, D] tensor
    shared_copy: bool = False  # MTP copies of the embedding/head: checked, not loaded


def _block_target(prefix: str, rest: str) -> Optional[Target]:
    m = re.fullmatch(r"(input_layernorm|post_attention_layernorm)\.weight", rest)
    if m:
        return Target(f"{prefix}.{'attention_norm' if m.group(1) == 'input_layernorm' else 'ffn_norm'}.weight")
    m = re.fullmatch(r"self_attn\.(\w+)\.(weight|bias)", rest)
    if m and m.group(1) in _ATTN:
        return Target(f"{prefix}.attention.{_ATTN[m.group(1)]}.{m.group(2)}")
    m = re.fullmatch(r"mlp\.(gate_proj|up_proj|down_proj)\.weight", rest)
    if m:
        return Target(f"{prefix}.feed_forward.{_FFN[m.group(1)]}.weight")
    m = re.fullmatch(r"mlp\.shared_experts?\.(gate_proj|up_proj|down_proj)\.weight", rest)
    if m:
        return Target(f"{prefix}.feed_forward.shared_experts.{_FFN[m.group(1)]}.weight")
    if rest == "mlp.gate.weight":
        return Target(f"{prefix}.feed_forward.router.weight")
    if rest == "mlp.gate.e_score_correction_bias":
        return Target(f"{prefix}.feed_forward.router.e_score_correction_bias")
    m = re.fullmatch(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", rest)
    if m:
        return Target(f"{prefix}.feed_forward.experts.{_FFN[m.group(2)]}", expert=int(m.group(1)))
    if rest == "mlp.experts.gate_up_proj":
        return Target(f"{prefix}.feed_forward.experts.w1+w3")
    if rest == "mlp.experts.down_proj":
        return Target(f"{prefix}.feed_forward.experts.w2")
    return None


def hf_to_ours(key: str, cfg: ModelConfig) -> Optional[Target]:
    """Map one HF tensor name to our parameter; None for names that belong to nothing of ours."""
    key = re.sub(r"^model\.language_model\.", "model.", key)
    key = re.sub(r"^language_model\.", "", key)
    if key == "model.embed_tokens.weight":
        return Target("tok_embeddings.weight")
    if key == "lm_head.weight":
        return Target("output.weight")
    if key == "model.norm.weight":
        return Target("norm.weight")
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", key)
    if not m:
        return None
    layer, rest = int(m.group(1)), m.group(2)
    if layer < cfg.num_layers:
        return _block_target(f"layers.{layer}", rest)
    k = layer - cfg.num_layers
    if k >= cfg.num_mtp_layers:
        return None
    if rest in ("enorm.weight", "hnorm.weight", "eh_proj.weight"):
        return Target(f"mtp.{k}.{rest}")
    if rest == "shared_head.norm.weight":
        return Target(f"mtp.{k}.norm.weight")
    if rest == "shared_head.head.weight":
        return Target("output.weight", shared_copy=True)
    if rest == "embed_tokens.weight":
        return Target("tok_embeddings.weight", shared_copy=True)
    return _block_target(f"mtp.{k}.block", rest)


def _is_ignorable(key: str) -> bool:
    """Tensors of a multimodal checkpoint that the text model does not use, and rotary caches."""
    return bool(re.match(r"^(vision_tower|mm_projector|multi_modal_projector|model\.vision_tower|"
                         r"model\.mm_projector)", key)) or key.endswith("rotary_emb.inv_freq")


# ---- reading ------------------------------------------------------------------------------------------
def _shard_files(path: Path) -> dict[str, Path]:
    """Tensor name -> shard file, from the index when present."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {k: path / v for k, v in weight_map.items()}
        missing = sorted({str(f) for f in files.values() if not f.is_file()})
        if missing:
            raise CheckpointError(f"{index} names shard files that do not exist: {missing[:3]}")
        return files
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"no *.safetensors files in {path}; expected a Hugging Face checkpoint directory")
    files = {}
    for shard in shards:
        with safe_open(str(shard), "pt") as f:
            for k in f.keys():
                files[k] = shard
    return files


_FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
_MTP_KEY = re.compile(r"^(?:model\.language_model\.|language_model\.)?model\.layers\.(\d+)\.eh_proj\.")
_FIX = "set model.preset / model.overrides to match the checkpoint's config.json"


def _dequant_fp8(w: torch.Tensor, scale_inv: torch.Tensor, rows: range, cols: range) -> torch.Tensor:
    """DeepSeek FP8 checkpoints: each element times the `weight_scale_inv` of its 128x128 block. `w` is the box
    rows x cols of the weight, `scale_inv` the blocks covering it (from block rows.start // 128, cols.start //
    128); edge blocks may be partial, boxes need not align with blocks."""
    r = torch.arange(rows.start, rows.stop) // FP8_BLOCK - rows.start // FP8_BLOCK
    c = torch.arange(cols.start, cols.stop) // FP8_BLOCK - cols.start // FP8_BLOCK
    return w.float() * scale_inv.float()[r][:, c]


def _ranges(box: tuple[slice, ...], shape) -> tuple[range, ...]:
    """A box (slices of step 1, None ends allowed, trailing dims may be left out) as ranges within shape."""
    box = tuple(box) + (slice(None),) * (len(shape) - len(box))
    if len(box) != len(shape):
        raise ValueError(f"box {box} has more dims than the tensor's shape {list(shape)}")
    out = []
    for s, n in zip(box, shape):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"box slice {s} has a step; boxes are contiguous")
        out.append(range(start, max(start, stop)))
    return tuple(out)


@dataclass(frozen=True)
class _Source:
    """Where one of our full tensors lives in the hub checkpoint: one hub tensor (`keys[0]`; `half` 0/1 for the
    gate/up halves along dim 1 of a fused [E, 2F, D] gate_up tensor), or one 2-D tensor per expert (`stacked`:
    our dim 0 indexes `keys`, "" for an expert the checkpoint lacks)."""

    keys: tuple[str, ...]
    stacked: bool = False
    half: Optional[int] = None


class HFReader:
    """Boxes of our full tensors, read from a Hugging Face checkpoint directory one slice at a time.

    Opening reads only config.json and the shard headers. `check(expected)` validates every name and shape
    against a model before any weight is read. `read(name, box)` returns exactly that box (a tuple of slices
    over our full tensor's dims) of our tensor `name`, reading only its bytes with `safe_open(...).get_slice`:
    a box over stacked routed experts reads only those experts' hub tensors; FP8 weights are dequantised on
    the box with the scales of the 128x128 blocks it touches. A shard file is opened per read, so nothing
    stays mapped (and resident) between reads. `cfg` is the model the names map to (default: the
    checkpoint's own, `config`, with the MTP depths it holds)."""

    def __init__(self, path: str | Path, cfg: Optional[ModelConfig] = None):
        self.path = Path(path)
        self.hf_config, hub_cfg = read_hf_config(self.path)
        self.files = _shard_files(self.path)
        self.shapes: dict[str, list[int]] = {}
        self.dtypes: dict[str, str] = {}
        for shard in sorted(set(self.files.values())):
            with safe_open(str(shard), "pt") as f:
                for k in f.keys():
                    sl = f.get_slice(k)
                    self.shapes[k], self.dtypes[k] = list(sl.get_shape()), sl.get_dtype()
        absent = sorted(k for k in self.files if k not in self.shapes)
        if absent:
            raise CheckpointError(f"{self.path}: the index names '{absent[0]}' but its shard does not hold it")
        self._add_int4_weights()
        # transformers drops MTP layers on save while keeping num_nextn_predict_layers: count the depths present
        self.mtp_depths = len({int(m.group(1)) for k in self.files
                               if (m := _MTP_KEY.match(k)) and int(m.group(1)) >= hub_cfg.num_layers})
        if self.mtp_depths < hub_cfg.num_mtp_layers:
            logger.warning("config.json declares %d MTP layers but the checkpoint holds %d; using %d",
                           hub_cfg.num_mtp_layers, self.mtp_depths, self.mtp_depths)
            hub_cfg = hub_cfg.replace(num_mtp_layers=self.mtp_depths)
        self.config = hub_cfg
        self.bind(cfg or hub_cfg)

    def _add_int4_weights(self) -> None:
        """Each pack-quantized INT4 weight (`X.weight_packed` + `X.weight_scale` + `X.weight_shape`) becomes the
        logical `X.weight` [out, in] of dtype "INT4", dequantised on the box when read (checkpoint/int4.py)."""
        where = str(self.path / "config.json")
        self.int4 = int4.read_scheme(self.hf_config, where)
        packed = [k for k in self.shapes if k.endswith(".weight_packed")]
        other = next((k for k in self.shapes if k.endswith(int4.OTHER_SUFFIXES)), None)
        if other is not None and (packed or self.int4 is not None):
            raise CheckpointError(f"{self._where(other)} belongs to a quantization scheme this reader does not "
                                  f"support (zero points, activation order or activation scales); supported: "
                                  f"{int4.SUPPORTED}")
        if packed and self.int4 is None:
            raise CheckpointError(f"{self._where(packed[0])} is pack-quantized but {where} declares no "
                                  f"quantization_config; supported: {int4.SUPPORTED}")
        for key in packed:
            base = key[:-len("_packed")]
            scale = base + "_scale"
            if scale not in self.shapes or self.dtypes[key] != "I32" or len(self.shapes[key]) != 2:
                raise CheckpointError(f"{self._where(key)} must be a 2-D int32 tensor with '{scale}' group scales "
                                      f"next to it; supported: {int4.SUPPORTED}")
            rows, words = self.shapes[key]
            groups = self.shapes[scale]
            cols = words * int4.PER_WORD
            if groups != [rows, cols // int4.GROUP] or cols % int4.GROUP:
                raise CheckpointError(f"{self._where(scale)} has shape {groups}, expected {[rows, cols // int4.GROUP]} "
                                      f"(one scale per {int4.GROUP} inputs of a [{rows}, {cols}] weight)")
            self.files[base], self.shapes[base], self.dtypes[base] = self.files[key], [rows, cols], "INT4"

    def bind(self, cfg: ModelConfig) -> "HFReader":
        """Map the checkpoint's names to a model of config `cfg` (headers only; raises for a hub tensor that
        has no place in it)."""
        self.cfg = cfg
        self.sources: dict[str, _Source] = {}
        self._plan: list[tuple[str, Target]] = []
        experts: dict[str, dict[int, str]] = {}
        for key in sorted(self.files):
            if key.endswith((".weight_scale_inv", *int4.SUFFIXES)) or _is_ignorable(key):
                continue
            target = hf_to_ours(key, self.cfg)
            if target is None:
                raise CheckpointError(
                    f"{self._where(key)} has no place in a model with num_layers={self.cfg.num_layers}, "
                    f"num_mtp_layers={self.cfg.num_mtp_layers}; the checkpoint does not match the model config "
                    f"({_FIX})")
            self._plan.append((key, target))
            if target.shared_copy:
                continue
            if target.name.endswith("w1+w3"):
                base = target.name[:-len("w1+w3")]
                self.sources[base + "w1"] = _Source((key,), half=0)
                self.sources[base + "w3"] = _Source((key,), half=1)
            elif target.expert is not None:
                experts.setdefault(target.name, {})[target.expert] = key
            else:
                self.sources[target.name] = _Source((key,))
        for name, by_index in experts.items():
            keys = tuple(by_index.get(e, "") for e in range(max(by_index) + 1))
            self.sources[name] = _Source(keys, stacked=True)
        return self

    def _where(self, key: str) -> str:
        return f"{self.files[key].name}: tensor '{key}'"

    # -- validation -------------------------------------------------------------------------------------
    def fresh(self, name: str) -> bool:
        """Our tensors a checkpoint may lack, which then keep their initialisation: MTP depths it does not
        hold (learned by self-distillation), the aux-loss-free routing bias (zero), rotary caches, a tied
        head."""
        m = re.match(r"mtp\.(\d+)\.", name)
        return bool(m and int(m.group(1)) >= self.mtp_depths) or name.endswith("e_score_correction_bias") \
            or name == "rope.inv_freq" or (name == "output.weight" and self.cfg.tie_word_embeddings)

    def check(self, expected: dict[str, tuple[int, ...]]) -> None:
        """Every hub tensor has a place among `expected` (our name -> full shape) with that shape, and every
        expected tensor is in the checkpoint unless `fresh`; reads no weight. Raises a one-line CheckpointError
        naming the tensor and the fix."""
        for key, target in self._plan:
            name = target.name[:-len("w1+w3")] + "w1" if target.name.endswith("w1+w3") else target.name
            if name not in expected:
                raise CheckpointError(f"{self._where(key)} maps to '{name}', which this model does not have; {_FIX}")
            want = list(expected[name])
            if target.name.endswith("w1+w3"):
                want = [want[0], 2 * want[1], *want[2:]]
            elif target.expert is not None:
                if target.expert >= want[0]:
                    raise CheckpointError(f"{self._where(key)} is expert {target.expert} but the model has "
                                          f"{want[0]} experts (num_experts); {_FIX}")
                want = want[1:]
            shape = self.shapes[key]
            if shape != want:
                raise CheckpointError(f"{self._where(key)} has shape {shape}, the model expects {want} for "
                                      f"'{target.name}'; {_FIX}")
            if self.dtypes[key] in _FP8_DTYPES:
                scale = key[:-len("weight")] + "weight_scale_inv"
                if len(shape) != 2 or scale not in self.shapes:
                    raise CheckpointError(f"{self._where(key)} is FP8 ({self.dtypes[key]}) but not a 2-D weight with "
                                          f"'{scale}' block scales; dequantise the checkpoint first")
                blocks = [math.ceil(n / FP8_BLOCK) for n in shape]
                if self.shapes[scale] != blocks:
                    raise CheckpointError(f"{self._where(scale)} has shape {self.shapes[scale]}, expected {blocks} "
                                          f"({FP8_BLOCK}x{FP8_BLOCK} blocks of {shape})")
        for name, shape in expected.items():
            if self.fresh(name) and name not in self.sources:
                continue
            src = self.sources.get(name)
            if src is None:
                raise CheckpointError(f"checkpoint {self.path} has no tensor for '{name}'; it is incomplete or of "
                                      f"another architecture ({_FIX})")
            if src.stacked and (len(src.keys) != shape[0] or "" in src.keys):
                lacking = [e for e in range(shape[0]) if e >= len(src.keys) or not src.keys[e]][:5]
                raise CheckpointError(f"checkpoint {self.path} lacks experts {lacking} of '{name}'")

    # -- reading ----------------------------------------------------------------------------------------
    def full_shape(self, name: str) -> list[int]:
        """The shape of our full tensor `name` as the checkpoint holds it."""
        src = self.sources[name]
        if src.stacked:
            return [len(src.keys), *self.shapes[src.keys[0]]]
        shape = list(self.shapes[src.keys[0]])
        if src.half is not None:
            shape[1] //= 2
        return shape

    def _read_key(self, key: str, box: tuple[range, ...]) -> torch.Tensor:
        if self.dtypes[key] == "INT4":
            return self._read_int4(key, *box)
        with safe_open(str(self.files[key]), "pt") as f:
            t = f.get_slice(key)[tuple(slice(r.start, r.stop) for r in box)]
        if self.dtypes[key] in _FP8_DTYPES:
            rows, cols = box
            scale = key[:-len("weight")] + "weight_scale_inv"
            blocks = (slice(rows.start // FP8_BLOCK, -(-rows.stop // FP8_BLOCK)),
                      slice(cols.start // FP8_BLOCK, -(-cols.stop // FP8_BLOCK)))
            with safe_open(str(self.files[scale]), "pt") as f:
                t = _dequant_fp8(t, f.get_slice(scale)[blocks], rows, cols)
        return t

    def _read_int4(self, key: str, rows: range, cols: range) -> torch.Tensor:
        """The box rows x cols of a pack-quantized weight, dequantised in float32: only the words and group
        scales that cover it are read."""
        words = slice(cols.start // int4.PER_WORD, -(-cols.stop // int4.PER_WORD))
        groups = slice(cols.start // int4.GROUP, -(-cols.stop // int4.GROUP))
        with safe_open(str(self.files[key + "_packed"]), "pt") as f:
            packed = f.get_slice(key + "_packed")[rows.start:rows.stop, words]
        with safe_open(str(self.files[key + "_scale"]), "pt") as f:
            scale = f.get_slice(key + "_scale")[rows.start:rows.stop, groups]
        return int4.dequantize_box(packed, scale, cols)

    def read(self, name: str, box: tuple[slice, ...] = ()) -> torch.Tensor:
        """The box `box` of our full tensor `name` (() for all of it), in the checkpoint's dtype (float32 for
        dequantised FP8 and INT4)."""
        src = self.sources.get(name)
        if src is None:
            raise CheckpointError(f"checkpoint {self.path} has no tensor for '{name}'")
        ranges = _ranges(box, self.full_shape(name))
        if src.stacked:
            parts = [self._read_key(src.keys[e], ranges[1:]) for e in ranges[0]]
            return torch.stack(parts) if parts else torch.empty([0, *map(len, ranges[1:])])
        if src.half is not None:
            offset = src.half * self.full_shape(name)[1]
            ranges = (ranges[0], range(ranges[1].start + offset, ranges[1].stop + offset), *ranges[2:])
        return self._read_key(src.keys[0], ranges)


def load_hf_shards(model: torch.nn.Module, path: str | Path | HFReader, progress: bool = True,
                   init: Optional[Callable[[str, tuple[slice, ...]], torch.Tensor]] = None) -> HFReader:
    """Fill this rank's shards of `model` -- any layout: tensor/expert-parallel pieces, FSDP DTensors, or the
    whole model -- from a Hugging Face checkpoint, reading only the slices this rank holds. Names and full
    shapes are checked before any weight is read. Tensors the checkpoint may lack (`HFReader.fresh`: MTP
    depths it does not hold, a missing routing bias) get `init(name, box)` when given, else keep their values.
    Host memory: the shards plus one slice at a time. Returns the reader (`config`: the checkpoint's model)."""
    from ..parallel import slices

    reader = path.bind(model.config) if isinstance(path, HFReader) else HFReader(path, model.config)
    named = dict(slices.named_tensors(model))
    reader.check({name: tuple(slices.full_shape(t)) for name, t in named.items()})
    filled = named if init is not None else [name for name in named if name in reader.sources]
    with torch.no_grad():
        for name in tqdm(filled, desc="loading HF checkpoint", unit="tensor", disable=not progress):
            local = slices.local_tensor(named[name])
            read = reader.read if name in reader.sources else init  # else: `fresh`, check() said so
            for piece in slices.local_pieces(named[name]):
                dst, src = local[piece.local], read(name, piece.full)
                if dst.shape != src.shape:
                    raise CheckpointError(f"{name}: read {list(src.shape)} for box {piece.full}, the local piece "
                                          f"is {list(dst.shape)}")
                dst.copy_(src)
    return reader


def load_hf_weights(model: Transformer, path: str | Path, progress: bool = True) -> None:
    """Stream an HF checkpoint's tensors into `model` (built with the matching config, any layout)."""
    load_hf_shards(model, path, progress=progress)


def checkpoint_dtype(hf: dict) -> torch.dtype:
    """The dtype a model loaded from a checkpoint with this config.json gets: the one it declares (bfloat16 for
    FP8 weights, which are dequantised), float32 when it declares none."""
    name = (hf.get("dtype") or hf.get("torch_dtype")
            or text_config(hf).get("dtype") or text_config(hf).get("torch_dtype"))
    if name in ("float8_e4m3fn", None):
        return torch.bfloat16 if name else torch.float32
    dtype = getattr(torch, str(name), None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def read_hf_config(path: str | Path) -> tuple[dict, ModelConfig]:
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path} has no config.json; expected a Hugging Face checkpoint directory")
    try:
        hf = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON: {e}") from None
    return hf, config_from_hf(hf)


def load_hf_checkpoint(path: str | Path, dtype: Optional[torch.dtype] = None, device: str | torch.device = "cpu",
                       progress: bool = True) -> Transformer:
    """Our whole model (one process) from a Hugging Face checkpoint directory (config.json + safetensors,
    sharded or not), built on the meta device and allocated once, then filled tensor by tensor."""
    reader = HFReader(path)
    dtype = dtype or checkpoint_dtype(reader.hf_config)
    with torch.device("meta"):
        model = Transformer(reader.config)
    model = model.to_empty(device=device).to(dtype)
    for module in model.modules():
        if isinstance(module, Router):
            module.float()  # routing decisions stay in float32, as the reference keeps them
    model.reset_parameters()  # what the checkpoint may lack: the routing bias (zero), the rotary cache
    load_hf_shards(model, reader, progress=progress)
    return model


# ---- writing ------------------------------------------------------------------------------------------
QUANTIZE = (None, "int4-experts")  # what an export may quantise: nothing, or the routed experts to INT4


@dataclass(frozen=True)
class HubEntry:
    """One tensor of the hub layout: its name, our tensor it comes from (None: zeros of `shape`), for stacked
    experts which expert, and for an INT4 expert which of its three tensors (int4.SUFFIXES: packed, scale,
    shape)."""

    hub: str
    ours: Optional[str]
    shape: tuple[int, ...]
    expert: Optional[int] = None
    int4_part: Optional[str] = None


def hub_entries(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], quantize: Optional[str] = None) -> list[HubEntry]:
    """The hub layout of a model with these (full) tensors, in file order: experts split per expert (with
    quantize="int4-experts" each as its pack-quantized weight_packed, weight_scale and weight_shape), MTP as
    extra decoder layers with copies of the embedding and head, a zero routing bias where DeepSeek-V3 needs
    one and we have none."""
    out: list[HubEntry] = []

    def put(hub: str, ours: str) -> None:
        out.append(HubEntry(hub, ours, tuple(shapes[ours])))

    put("model.embed_tokens.weight", "tok_embeddings.weight")
    put("model.norm.weight", "norm.weight")
    if not cfg.tie_word_embeddings:
        put("lm_head.weight", "output.weight")
    attn_inv = _ATTN_INV[cfg.attention]

    def block(ours: str, hf: str) -> None:
        for name, shape in shapes.items():
            if not name.startswith(ours + "."):
                continue
            rest = name[len(ours) + 1:]
            if rest == "attention_norm.weight":
                put(f"{hf}.input_layernorm.weight", name)
            elif rest == "ffn_norm.weight":
                put(f"{hf}.post_attention_layernorm.weight", name)
            elif rest.startswith("attention."):
                mod, kind = rest[len("attention."):].rsplit(".", 1)
                put(f"{hf}.self_attn.{attn_inv[mod]}.{kind}", name)
            elif rest.startswith("feed_forward.experts."):
                w = rest.rsplit(".", 1)[1]
                for e in range(shape[0]):
                    hub = f"{hf}.mlp.experts.{e}.{_FFN_INV[w]}.weight"
                    if quantize is None:
                        out.append(HubEntry(hub, name, tuple(shape[1:]), e))
                        continue
                    rows, cols = shape[1:]
                    for suffix, part_shape in zip(int4.SUFFIXES, ((rows, cols // int4.PER_WORD),
                                                                  (rows, cols // int4.GROUP), (2,))):
                        out.append(HubEntry(hub + suffix[len(".weight"):], name, part_shape, e, suffix))
            elif rest.startswith("feed_forward.shared_experts."):
                put(f"{hf}.mlp.shared_experts.{_FFN_INV[rest.split('.')[2]]}.weight", name)
            elif rest == "feed_forward.router.weight":
                put(f"{hf}.mlp.gate.weight", name)
            elif rest == "feed_forward.router.e_score_correction_bias":
                put(f"{hf}.mlp.gate.e_score_correction_bias", name)
            elif rest.startswith("feed_forward."):
                put(f"{hf}.mlp.{_FFN_INV[rest.split('.')[1]]}.weight", name)
            else:
                raise CheckpointError(f"no hub name for parameter '{name}'")
        bias = f"{ours}.feed_forward.router.e_score_correction_bias"
        if cfg.attention == "mla" and f"{ours}.feed_forward.router.weight" in shapes and bias not in shapes:
            out.append(HubEntry(f"{hf}.mlp.gate.e_score_correction_bias", None, (cfg.num_experts,)))

    for i in range(cfg.num_layers):
        block(f"layers.{i}", f"model.layers.{i}")
    for k in range(cfg.num_mtp_layers):
        hf = f"model.layers.{cfg.num_layers + k}"
        for part in ("enorm", "hnorm", "eh_proj"):
            put(f"{hf}.{part}.weight", f"mtp.{k}.{part}.weight")
        put(f"{hf}.shared_head.norm.weight", f"mtp.{k}.norm.weight")
        put(f"{hf}.shared_head.head.weight", "output.weight")
        put(f"{hf}.embed_tokens.weight", "tok_embeddings.weight")
        block(f"mtp.{k}.block", hf)
    return out


def write_hf_checkpoint(path: str | Path, cfg: ModelConfig, shapes: dict[str, tuple[int, ...]],
                        tensor: Callable[[str], torch.Tensor], dtype: torch.dtype, max_shard_bytes: int = 4 << 30,
                        progress: bool = True, overwrite: bool = False, main: bool = True,
                        quantize: Optional[str] = None) -> None:
    """Write a checkpoint directory that `transformers` loads (config.json, safetensors shards, index) for a
    model of config `cfg` with these full tensors (our name -> shape). `tensor(name)` gives our full tensor
    `name`; it is called for one tensor at a time, in the same order on every rank (it may be a collective
    gather). The files are planned from the shapes alone, so each is written (by the `main` process) the moment
    its last tensor arrives: memory holds one shard file's tensors plus one of our tensors. quantize=
    "int4-experts" writes the routed experts pack-quantized in INT4 (checkpoint/int4.py), with the
    quantization_config the released Kimi K2.5 checkpoints carry; everything else stays in `dtype`."""
    if quantize not in QUANTIZE:
        raise CheckpointError(f"quantize={quantize!r} is not an export format; choose one of {list(QUANTIZE)}")
    path = Path(path)
    if path.exists() and any(path.iterdir()) and not overwrite:
        raise CheckpointError(f"{path} exists and is not empty; choose a new directory or pass overwrite=True")
    if quantize and cfg.moe_intermediate_size % int4.GROUP or quantize and cfg.hidden_size % int4.GROUP:
        raise CheckpointError(f"INT4 groups of {int4.GROUP} must divide hidden_size ({cfg.hidden_size}) and "
                              f"moe_intermediate_size ({cfg.moe_intermediate_size}) to export quantize={quantize!r}")
    entries = hub_entries(cfg, shapes, quantize)
    router_keys = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")

    def dtype_of(entry: HubEntry) -> torch.dtype:
        if entry.int4_part is not None:
            return int4.PART_DTYPES[entry.int4_part]
        return torch.float32 if cfg.attention == "mla" and entry.hub.endswith(router_keys) else dtype

    quantized: dict = {}  # the last expert matrix quantised: (name, expert) -> its three hub tensors

    def int4_tensor(entry: HubEntry, w: torch.Tensor) -> torch.Tensor:
        key = (entry.ours, entry.expert)
        if key not in quantized:
            quantized.clear()
            quantized[key] = int4.hub_parts(w)
        return quantized[key][entry.int4_part]

    file_of, sizes = [], [0]
    for entry in entries:
        nbytes = math.prod(entry.shape) * dtype_of(entry).itemsize
        if sizes[-1] and sizes[-1] + nbytes > max_shard_bytes:
            sizes.append(0)
        file_of.append(len(sizes) - 1)
        sizes[-1] += nbytes
    n = len(sizes)
    names = ["model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    tmp = path.with_name(path.name + ".tmp")
    if main:
        tmp.mkdir(parents=True, exist_ok=True)
    shard: dict[str, torch.Tensor] = {}
    current_name, current = None, None
    bar = tqdm(total=len(entries), desc="writing HF checkpoint", unit="tensor", disable=not (progress and main))
    for i, entry in enumerate(entries):
        if entry.ours is None:
            t = torch.zeros(entry.shape)
        else:
            if entry.ours != current_name:
                current_name, current = None, None  # drop the last tensor before fetching the next
                current, current_name = tensor(entry.ours), entry.ours
            t = current if entry.expert is None else current[entry.expert]
            if entry.int4_part is not None:
                t = int4_tensor(entry, t)
        if main:
            shard[entry.hub] = t.detach().to("cpu", dtype_of(entry)).contiguous().clone()
            if i + 1 == len(entries) or file_of[i + 1] != file_of[i]:
                save_file(shard, str(tmp / names[file_of[i]]), metadata={"format": "pt"})
                shard = {}
        bar.update(1)
    bar.close()
    if not main:
        return
    if n > 1:
        weight_map = {e.hub: names[f] for e, f in zip(entries, file_of)}
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}, indent=2))
    hf_config = config_to_hf(cfg, dtype)
    if quantize == "int4-experts":
        hf_config["quantization_config"] = int4.quantization_config_for_experts()
    (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
    if path.exists():
        for old in path.iterdir():
            old.unlink()
        path.rmdir()
    tmp.rename(path)


def save_hf_checkpoint(model: torch.nn.Module, path: str | Path, max_shard_bytes: int = 4 << 30,
                       dtype: Optional[torch.dtype] = None, progress: bool = True, overwrite: bool = False,
                       groups=None, quantize: Optional[str] = None) -> None:
    """Write `model` (any layout) as a Hugging Face checkpoint directory (`write_hf_checkpoint`; quantize=
    "int4-experts": routed experts in Kimi K2.5's pack-quantized INT4). Collective over the model's ranks when
    `groups` (its ParallelGroups) is given or its parameters are FSDP DTensors: each tensor is gathered whole on
    its own (`parallel.layers.full_tensor`) and rank 0 writes."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from ..parallel import slices
    from ..parallel.layers import full_tensor

    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers())
    dtype = dtype or slices.local_tensor(next(iter(model.parameters()))).dtype
    collective = groups is not None or any(isinstance(t, DTensor) for t in named.values())
    main = not collective or dist.get_rank() == 0
    if main and Path(path).exists() and any(Path(path).iterdir()) and not overwrite:
        raise CheckpointError(f"{path} exists and is not empty; choose a new directory or pass overwrite=True")
    write_hf_checkpoint(path, model.config, {name: tuple(slices.full_shape(t)) for name, t in named.items()},
                        lambda name: full_tensor(named[name], groups), dtype, max_shard_bytes, progress,
                        overwrite=True, main=main, quantize=quantize)
    if collective:
        dist.barrier()


def convert_hf_checkpoint(src: str | Path, out: str | Path, dtype: Optional[torch.dtype] = None,
                          max_shard_bytes: int = 4 << 30, progress: bool = True, overwrite: bool = False,
                          quantize: Optional[str] = None) -> ModelConfig:
    """Rewrite a Hugging Face checkpoint in our export's layout (e.g. FP8 or INT4 to bf16, fused experts to
    per-expert tensors, or with quantize="int4-experts" its routed experts to INT4) one tensor at a time, without
    building the model: memory holds one output shard plus one tensor. Returns the model config."""
    reader = HFReader(src)
    cfg = reader.config
    dtype = dtype or checkpoint_dtype(reader.hf_config)
    with torch.device("meta"):  # the shapes the config implies, to check the checkpoint against
        model = Transformer(cfg)
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers())
    shapes = {name: tuple(t.shape) for name, t in named.items() if name != "rope.inv_freq"}
    reader.check({name: shapes[name] for name in dict(model.named_parameters()) | dict(model.named_buffers())
                  if name in shapes})
    tied = {"output.weight": "tok_embeddings.weight"} if cfg.tie_word_embeddings else {}

    def tensor(name: str) -> torch.Tensor:
        name = tied.get(name, name)
        return reader.read(name) if name in reader.sources else torch.zeros(shapes[name])  # a missing routing bias

    write_hf_checkpoint(out, cfg, shapes, tensor, dtype, max_shard_bytes, progress, overwrite, quantize=quantize)
    return cfg


def quantize_fp8_blockwise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's FP8 checkpoint format for a 2-D weight: e4m3 values and a float32 `weight_scale_inv`
    per 128x128 block (amax / 448), the inverse of `_dequant_fp8`."""
    rows, cols = w.shape
    br, bc = math.ceil(rows / FP8_BLOCK), math.ceil(cols / FP8_BLOCK)
    padded = torch.zeros(br * FP8_BLOCK, bc * FP8_BLOCK, dtype=torch.float32)
    padded[:rows, :cols] = w.float()
    blocks = padded.view(br, FP8_BLOCK, bc, FP8_BLOCK)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12)
    scale = amax / 448.0
    q = (blocks / scale[:, None, :, None]).view_as(padded)[:rows, :cols].to(torch.float8_e4m3fn)
    return q, scale
