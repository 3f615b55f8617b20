"""Hugging Face checkpoints <-> our model: DeepSeek-V3 / Kimi K2(.5) and Qwen3-MoE.

Import streams tensor by tensor from safetensors shards into a model whose parameters are allocated once,
so host memory holds the model plus one tensor, never a second copy of the checkpoint. Before any weight is
read, the config is translated and every tensor name and shape in the shard headers is checked against the
model; a mismatch raises `CheckpointError` naming the key. DeepSeek-style FP8 weights (float8_e4m3fn with a
`weight_scale_inv` per 128x128 block) are dequantised on load. MTP layers that HF stores as extra decoder
layers (`model.layers.{num_layers + k}`) become `model.mtp[k]`.

Export writes the hub layout (per-expert tensors, MTP as extra layers, sharded with an index) and a
config.json that `transformers` loads.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from ..model import ModelConfig, ModelConfigError, RopeScaling, Transformer
from ..model.moe import Router


logger = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint does not match what is asked of it; the message names the file/key and the fix."""


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
                expert_bias=topk_method == "noaux_tc", routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
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


def _header_shapes(files: dict[str, Path]) -> dict[str, list[int]]:
    """Every tensor's shape from the shard headers, opening each shard once."""
    shapes: dict[str, list[int]] = {}
    for shard in sorted(set(files.values())):
        with safe_open(str(shard), "pt") as f:
            for k in f.keys():
                shapes[k] = list(f.get_slice(k).get_shape())
    return shapes


def _dequant_fp8(w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """DeepSeek FP8 checkpoints: w_fp8 * scale_inv broadcast over 128x128 blocks (edge blocks partial)."""
    rows, cols = w.shape
    s = scale_inv.float().repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :cols]
    return w.float() * s


def load_hf_weights(model: Transformer, path: str | Path, progress: bool = True) -> None:
    """Stream an HF checkpoint's tensors into `model` (already built with the matching config)."""
    path = Path(path)
    cfg = model.config
    files = _shard_files(path)
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))

    # Plan and validate everything from the headers before reading any tensor data.
    plan: list[tuple[str, Target]] = []
    filled: dict[str, set] = {}
    scales = {k for k in files if k.endswith(".weight_scale_inv")}
    shapes = _header_shapes(files)
    for key in sorted(files):
        if key in scales or _is_ignorable(key):
            continue
        target = hf_to_ours(key, cfg)
        if target is None:
            raise CheckpointError(
                f"{files[key].name}: tensor '{key}' has no place in a model with num_layers={cfg.num_layers}, "
                f"num_mtp_layers={cfg.num_mtp_layers}; the checkpoint does not match config.json")
        shape = shapes[key]
        if target.name.endswith("w1+w3"):
            base = target.name[:-len("w1+w3")]
            want = list(params[base + "w1"].shape)
            want = [want[0], 2 * want[1], want[2]]
        else:
            if target.name not in params:
                raise CheckpointError(f"{files[key].name}: tensor '{key}' maps to '{target.name}', which this "
                                      f"model does not have; check config.json against the weights")
            want = list(params[target.name].shape)
            if target.expert is not None:
                if target.expert >= want[0]:
                    raise CheckpointError(f"{files[key].name}: '{key}' is expert {target.expert} but the config has "
                                          f"{want[0]} experts (n_routed_experts / num_experts)")
                want = want[1:]
        if shape != want:
            raise CheckpointError(f"{files[key].name}: tensor '{key}' has shape {shape}, the model expects {want} "
                                  f"for '{target.name}'; config.json does not match the weights")
        plan.append((key, target))
        if not target.shared_copy:
            names = [target.name[:-len("w1+w3")] + "w1", target.name[:-len("w1+w3")] + "w3"] \
                if target.name.endswith("w1+w3") else [target.name]
            for n in names:
                filled.setdefault(n, set()).add(target.expert)
    tied = {"output.weight"} if cfg.tie_word_embeddings else set()
    optional = {n for n in params if n.endswith("e_score_correction_bias") or n == "rope.inv_freq"}
    for name, p in params.items():
        if name in tied or name in optional:
            continue
        got = filled.get(name)
        if got is None:
            raise CheckpointError(f"checkpoint {path} has no tensor for '{name}'; it is incomplete or of another "
                                  f"architecture")
        if None not in got and len(got) != p.shape[0]:
            lacking = sorted(set(range(p.shape[0])) - got)[:5]
            raise CheckpointError(f"checkpoint {path} lacks experts {lacking} of '{name}'")

    # Stream: one tensor at a time, shard by shard.
    by_file: dict[Path, list[tuple[str, Target]]] = {}
    for key, target in plan:
        by_file.setdefault(files[key], []).append((key, target))
    bar = tqdm(total=len(plan), desc="loading HF checkpoint", unit="tensor", disable=not progress)
    with torch.no_grad():
        for file, items in by_file.items():
            with safe_open(str(file), "pt") as f:
                for key, target in items:
                    t = f.get_tensor(key)
                    scale_key = key[:-len("weight")] + "weight_scale_inv" if key.endswith(".weight") else None
                    if scale_key in scales:
                        with safe_open(str(files[scale_key]), "pt") as fs:
                            t = _dequant_fp8(t, fs.get_tensor(scale_key))
                    elif t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                        raise CheckpointError(f"{file.name}: FP8 tensor '{key}' has no '{scale_key}'")
                    _copy_into(params, target, t)
                    bar.update(1)
    bar.close()


def _copy_into(params: dict, target: Target, t: torch.Tensor) -> None:
    if target.shared_copy:
        return
    if target.name.endswith("w1+w3"):
        base = target.name[:-len("w1+w3")]
        F = params[base + "w1"].shape[1]
        params[base + "w1"].copy_(t[:, :F])
        params[base + "w3"].copy_(t[:, F:])
    elif target.expert is not None:
        params[target.name][target.expert].copy_(t)
    else:
        params[target.name].copy_(t)


def _checkpoint_dtype(path: Path, hf: dict) -> torch.dtype:
    name = hf.get("dtype") or hf.get("torch_dtype") or text_config(hf).get("dtype") or text_config(hf).get("torch_dtype")
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
    """Build our model from a Hugging Face checkpoint directory (config.json + safetensors, sharded or not)."""
    path = Path(path)
    hf, cfg = read_hf_config(path)
    dtype = dtype or _checkpoint_dtype(path, hf)
    files = _shard_files(path)
    # transformers drops MTP layers on save while keeping num_nextn_predict_layers: build the depths present.
    present = {int(m.group(1)) for k in files
               if (m := re.match(r"^(?:model\.language_model\.|language_model\.)?model\.layers\.(\d+)\.eh_proj\.", k))
               and int(m.group(1)) >= cfg.num_layers}
    if len(present) < cfg.num_mtp_layers:
        logger.warning("config.json declares %d MTP layers but the checkpoint holds %d; building %d",
                       cfg.num_mtp_layers, len(present), len(present))
        cfg = cfg.replace(num_mtp_layers=len(present))
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to_empty(device=device).to(dtype)
    for module in model.modules():
        if isinstance(module, Router):
            module.float()  # routing decisions stay in float32, as the reference keeps them
    model.rope.inv_freq.copy_(type(model.rope)(cfg).inv_freq)
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.zero_()
    load_hf_weights(model, path, progress=progress)
    return model


# ---- writing ------------------------------------------------------------------------------------------
def hf_state_items(model: Transformer) -> Iterator[tuple[str, torch.Tensor]]:
    """Our parameters under hub names, one tensor at a time (experts split per expert)."""
    cfg = model.config
    params = dict(model.named_parameters(remove_duplicate=False))
    params.update(dict(model.named_buffers()))
    yield "model.embed_tokens.weight", params["tok_embeddings.weight"]
    yield "model.norm.weight", params["norm.weight"]
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", params["output.weight"]

    def block(ours: str, hf: str) -> Iterator[tuple[str, torch.Tensor]]:
        attn_inv = _ATTN_INV[cfg.attention]
        for name, t in params.items():
            if not name.startswith(ours + "."):
                continue
            rest = name[len(ours) + 1:]
            if rest == "attention_norm.weight":
                yield f"{hf}.input_layernorm.weight", t
            elif rest == "ffn_norm.weight":
                yield f"{hf}.post_attention_layernorm.weight", t
            elif rest.startswith("attention."):
                mod, kind = rest[len("attention."):].rsplit(".", 1)
                yield f"{hf}.self_attn.{attn_inv[mod]}.{kind}", t
            elif rest.startswith("feed_forward.experts."):
                w = rest.rsplit(".", 1)[1]
                for e in range(t.shape[0]):
                    yield f"{hf}.mlp.experts.{e}.{_FFN_INV[w]}.weight", t[e]
            elif rest.startswith("feed_forward.shared_experts."):
                yield f"{hf}.mlp.shared_experts.{_FFN_INV[rest.split('.')[2]]}.weight", t
            elif rest == "feed_forward.router.weight":
                yield f"{hf}.mlp.gate.weight", t
            elif rest == "feed_forward.router.e_score_correction_bias":
                yield f"{hf}.mlp.gate.e_score_correction_bias", t
            elif rest.startswith("feed_forward."):
                yield f"{hf}.mlp.{_FFN_INV[rest.split('.')[1]]}.weight", t
            else:
                raise CheckpointError(f"no hub name for parameter '{name}'")

    for i in range(cfg.num_layers):
        yield from block(f"layers.{i}", f"model.layers.{i}")
        if cfg.attention == "mla" and cfg.is_moe_layer(i) and model.layers[i].feed_forward.router.e_score_correction_bias is None:
            yield f"model.layers.{i}.mlp.gate.e_score_correction_bias", torch.zeros(cfg.num_experts)
    for k in range(cfg.num_mtp_layers):
        hf = f"model.layers.{cfg.num_layers + k}"
        for part in ("enorm", "hnorm", "eh_proj"):
            yield f"{hf}.{part}.weight", params[f"mtp.{k}.{part}.weight"]
        yield f"{hf}.shared_head.norm.weight", params[f"mtp.{k}.norm.weight"]
        yield f"{hf}.shared_head.head.weight", params["output.weight"]
        yield f"{hf}.embed_tokens.weight", params["tok_embeddings.weight"]
        yield from block(f"mtp.{k}.block", hf)


def save_hf_checkpoint(model: Transformer, path: str | Path, max_shard_bytes: int = 4 << 30,
                       dtype: Optional[torch.dtype] = None, progress: bool = True, overwrite: bool = False) -> None:
    """Write a checkpoint directory that `transformers` loads (config.json, safetensors shards, index)."""
    path = Path(path)
    if path.exists() and any(path.iterdir()) and not overwrite:
        raise CheckpointError(f"{path} exists and is not empty; choose a new directory or pass overwrite=True")
    cfg = model.config
    dtype = dtype or next(model.parameters()).dtype
    hf_cfg = config_to_hf(cfg, dtype)
    tmp = path.with_name(path.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    sizes = [0]
    total = 0
    router_keys = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")
    for name, t in hf_state_items(model):
        keep_fp32 = cfg.attention == "mla" and name.endswith(router_keys)
        t = t.detach().to("cpu", torch.float32 if keep_fp32 else dtype).contiguous().clone()
        nbytes = t.numel() * t.element_size()
        if sizes[-1] and sizes[-1] + nbytes > max_shard_bytes:
            shards.append({})
            sizes.append(0)
        shards[-1][name] = t
        sizes[-1] += nbytes
        total += nbytes
    weight_map = {}
    n = len(shards)
    for i, shard in enumerate(tqdm(shards, desc="writing HF shards", disable=not progress)):
        fname = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file(shard, str(tmp / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    if n > 1:
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    if path.exists():
        for old in path.iterdir():
            old.unlink()
        path.rmdir()
    tmp.rename(path)


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
