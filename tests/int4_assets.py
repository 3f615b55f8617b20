"""Tiny Kimi-K2.5-shaped checkpoints with INT4 experts, made by the peers: transformers writes the DeepSeek-V3
model, the compressed-tensors package quantises and packs its routed experts (its own compressor and scales,
not this project's code), and the config carries compressed-tensors' own quantization_config."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

EXPERT_KEY = ".mlp.experts."


def scheme(num_bits: int = 4, group_size: int = 32, symmetric: bool = True):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=num_bits, type="int", symmetric=symmetric, strategy="group",
                            group_size=group_size)
    return QuantizationScheme(targets=[r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"], weights=args)


def compress_expert(w: torch.Tensor, sch, pow2_scales: bool) -> dict[str, torch.Tensor]:
    """compressed-tensors' pack-quantized tensors of one expert weight: its min/max scales (calculate_qparams),
    or those rounded up to powers of two (every q * scale then exact in bf16, so a peer that dequantises in bf16
    holds the same values as one that does in float32)."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    g = w.float().reshape(w.shape[0], -1, sch.weights.group_size)
    scale, zero_point = calculate_qparams(g.amin(-1), g.amax(-1), sch.weights)
    if pow2_scales:
        scale = torch.exp2(torch.ceil(torch.log2(scale.float().clamp_min(2.0 ** -20))))
    state = {"weight": w, "weight_scale": scale.to(torch.bfloat16), "weight_zero_point": zero_point}
    return PackedQuantizationCompressor.compress(state, sch)


def deepseek_model(seed: int = 0, hidden: int = 64, moe_ffn: int = 64, layers: int = 3, vocab: int = 97):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=96, moe_intermediate_size=moe_ffn,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
        n_shared_experts=1, n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
        kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=12,
        routed_scaling_factor=2.5, max_position_embeddings=256, initializer_range=0.1)
    model = DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():  # a non-zero routing bias, so that selection without weighting is exercised
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    return model


def write_int4_checkpoint(out: Path, model=None, *, kimi_layout: bool = False, pow2_scales: bool = True,
                          sch=None) -> Path:
    """out/: `model` (default: deepseek_model()) saved by transformers, its routed experts replaced by
    compressed-tensors' pack-quantized INT4 tensors. kimi_layout: the multimodal release's layout, the language
    model under `language_model.` beside a vision tower, the text config under text_config of a kimi_k25 config."""
    from compressed_tensors.quantization import QuantizationConfig

    sch = sch or scheme()
    model = model if model is not None else deepseek_model()
    model.save_pretrained(out)
    state = {}
    for file in sorted(out.glob("*.safetensors")):
        state.update(load_file(file))
        file.unlink()
    (out / "model.safetensors.index.json").unlink(missing_ok=True)
    tensors = {}
    for key, t in state.items():
        if EXPERT_KEY in key and key.endswith("_proj.weight"):
            base = key[:-len("weight")]
            tensors.update({base + k: v for k, v in compress_expert(t, sch, pow2_scales).items()})
        else:
            tensors[key] = t
    hf = json.loads((out / "config.json").read_text())
    qc = QuantizationConfig(config_groups={"group_0": sch}, format="pack-quantized", quant_method="compressed-tensors",
                            ignore=["lm_head", r"re:.*self_attn.*", r"re:.*shared_experts.*"],
                            quantization_status="compressed").model_dump(mode="json")
    if kimi_layout:
        tensors = {f"language_model.{k}": v for k, v in tensors.items()}
        tensors["vision_tower.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 2)
        hf = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
              "text_config": {**hf, "model_type": "kimi_k2"}, "vision_config": {"hidden_size": 8},
              "quantization_config": qc}
    else:
        hf["quantization_config"] = qc
    keys = sorted(tensors)
    weight_map = {}
    for i in range(2):  # two shard files with an index, tensors interleaved across them
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: tensors[k].contiguous() for k in keys[i::2]}, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in keys[i::2]})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(hf, indent=1))
    return out


def transformers_float32(path: Path):
    """transformers' model of an INT4 checkpoint (dequantised through compressed-tensors, which leaves the experts
    in the scales' bf16), every parameter then in float32 so that it computes as our float32 model does."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if p.dtype != torch.float32:
                p.data = p.data.float()
    return model
