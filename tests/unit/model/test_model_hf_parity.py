"""Our model against transformers (the peer implementation): import, export and FP8 checkpoints."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

from megatron_composer.checkpoint.hf import (  # noqa: E402
    CheckpointError,
    load_hf_checkpoint,
    quantize_fp8_blockwise,
    save_hf_checkpoint,
)

TOL = 1e-4


def _deepseek(q_lora_rank, n_group, topk_group, first_k_dense, yarn, seed):
    torch.manual_seed(seed)
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if yarn:
        rope = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 8.0, "original_max_position_embeddings": 32,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.707}
    cfg = DeepseekV3Config(
        vocab_size=97, hidden_size=48, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, n_group=n_group,
        topk_group=topk_group, num_experts_per_tok=2, first_k_dense_replace=first_k_dense, kv_lora_rank=16,
        q_lora_rank=q_lora_rank, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=12, routed_scaling_factor=2.5,
        max_position_embeddings=256, rope_parameters=rope, initializer_range=0.1,
    )
    model = DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():  # a non-zero bias so the select-but-don't-weight rule is exercised
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    return model


def _qwen(seed, norm_topk_prob=True):
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=97, hidden_size=48, intermediate_size=80, moe_intermediate_size=24,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=8, num_experts_per_tok=3, norm_topk_prob=norm_topk_prob,
                         mlp_only_layers=[1], initializer_range=0.1)
    return Qwen3MoeForCausalLM(cfg).eval()


DEEPSEEK_CASES = [
    # q_lora_rank, n_group, topk_group, first_k_dense, yarn
    (24, 4, 2, 1, False),
    (None, 2, 1, 0, True),
    (24, 1, 1, 2, True),
    (None, 4, 3, 1, False),
]


def _compare(ref, ours, vocab, seq=40, batch=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    with torch.no_grad():
        want = ref(ids).logits
        got = ours(ids)
    assert got.shape == want.shape
    err = (got - want).abs().max().item()
    assert err <= TOL, f"max abs logits error {err}"


@pytest.mark.parametrize("case", DEEPSEEK_CASES)
def test_deepseek_import_and_export_match_transformers(tmp_path, case):
    ref = _deepseek(*case, seed=hash(case) % 1000)
    ref.save_pretrained(tmp_path / "hf")
    ours = load_hf_checkpoint(tmp_path / "hf", dtype=torch.float32, progress=False).eval()
    _compare(ref, ours, 97)
    # export -> transformers reload gives the same logits
    save_hf_checkpoint(ours, tmp_path / "out", progress=False)
    back = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    _compare(back, ours, 97, seed=1)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_import_and_export_match_transformers(tmp_path, norm_topk_prob):
    ref = _qwen(3, norm_topk_prob)
    ref.save_pretrained(tmp_path / "hf")
    ours = load_hf_checkpoint(tmp_path / "hf", dtype=torch.float32, progress=False).eval()
    assert not ours.layers[1].is_moe and ours.layers[0].is_moe
    _compare(ref, ours, 97)
    save_hf_checkpoint(ours, tmp_path / "out", progress=False, max_shard_bytes=200_000)
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()  # sharded export
    back = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    _compare(back, ours, 97, seed=2)


def test_sharded_import(tmp_path):
    ref = _qwen(4)
    ref.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    ours = load_hf_checkpoint(tmp_path / "hf", dtype=torch.float32, progress=False)
    _compare(ref, ours, 97)


def test_fp8_block_quantised_checkpoint_round_trip(tmp_path):
    """A DeepSeek-style FP8 checkpoint (e4m3 + 128x128 weight_scale_inv) loads to the dequantised reference."""
    ref = _deepseek(24, 4, 2, 1, False, seed=7)
    ref.save_pretrained(tmp_path / "hf")
    state = load_file(tmp_path / "hf" / "model.safetensors")
    fp8_state = {}
    for k, t in state.items():
        if t.dim() == 2 and k.endswith("proj.weight") and "layernorm" not in k:
            q, s = quantize_fp8_blockwise(t)
            fp8_state[k], fp8_state[k + "_scale_inv"] = q, s
            # the reference the FP8 checkpoint stands for
            state[k] = (q.float()
                        * s.repeat_interleave(128, 0)[: t.shape[0]].repeat_interleave(128, 1)[:, : t.shape[1]])
        else:
            fp8_state[k] = t
    fp8_dir = tmp_path / "fp8"
    fp8_dir.mkdir()
    save_file(fp8_state, str(fp8_dir / "model.safetensors"), metadata={"format": "pt"})
    (fp8_dir / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    deq_dir = tmp_path / "dequantised"
    deq_dir.mkdir()
    save_file(state, str(deq_dir / "model.safetensors"), metadata={"format": "pt"})
    (deq_dir / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    deq_ref = DeepseekV3ForCausalLM.from_pretrained(deq_dir, dtype=torch.float32).eval()
    ours = load_hf_checkpoint(fp8_dir, dtype=torch.float32, progress=False).eval()
    _compare(deq_ref, ours, 97)
    with torch.no_grad():  # and quantisation did change the weights (the test would notice a no-op dequant)
        ids = torch.randint(0, 97, (2, 16))
        assert (ref(ids).logits - deq_ref(ids).logits).abs().max() > 1e-4
    for k, t in fp8_state.items():
        if k.endswith("_scale_inv"):
            assert t.dtype == torch.float32
    assert any(t.dtype == torch.float8_e4m3fn for t in fp8_state.values())


def test_mtp_layers_map_to_mtp_modules(tmp_path):
    from megatron_composer.model import Transformer, get_preset

    torch.manual_seed(0)
    ours = Transformer(get_preset("tiny-deepseek-v3").replace(vocab_size=97, num_layers=2))
    save_hf_checkpoint(ours, tmp_path / "hf", progress=False)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1
    keys = load_file(tmp_path / "hf" / "model.safetensors").keys()
    assert "model.layers.2.eh_proj.weight" in keys and "model.layers.2.shared_head.norm.weight" in keys
    back = load_hf_checkpoint(tmp_path / "hf", progress=False)
    ids = torch.randint(0, 97, (2, 16))
    a, b = ours(ids, mtp=True), back(ids, mtp=True)
    assert torch.equal(a.logits, b.logits)
    assert torch.equal(a.mtp_logits[0], b.mtp_logits[0])
    # transformers ignores the MTP layer but loads the rest
    hf = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        assert (hf(ids).logits - a.logits).abs().max() <= TOL


def test_mismatched_checkpoint_fails_before_loading(tmp_path):
    ref = _deepseek(24, 4, 2, 1, False, seed=1)
    ref.save_pretrained(tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["kv_lora_rank"] = 20
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"has shape \[16\], the model expects \[20\]"):
        load_hf_checkpoint(tmp_path / "hf", progress=False)
    cfg["kv_lora_rank"] = 16
    cfg["num_hidden_layers"] = 2
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"model.layers.2.*num_layers=2"):
        load_hf_checkpoint(tmp_path / "hf", progress=False)
    cfg["num_hidden_layers"] = 3
    cfg["model_type"] = "llama"
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="model_type 'llama' is not supported"):
        load_hf_checkpoint(tmp_path / "hf", progress=False)
    with pytest.raises(CheckpointError, match="no config.json"):
        load_hf_checkpoint(tmp_path, progress=False)


def test_export_refuses_to_overwrite(tmp_path):
    from megatron_composer.model import Transformer, get_preset

    model = Transformer(get_preset("tiny-qwen3-moe").replace(vocab_size=64, num_layers=1))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("precious")
    with pytest.raises(CheckpointError, match="not empty"):
        save_hf_checkpoint(model, tmp_path / "out", progress=False)
    assert (tmp_path / "out" / "keep.txt").read_text() == "precious"
