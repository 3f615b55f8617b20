"""torchrun worker: sharded Hugging Face import and streaming export against one process and transformers.

Rank 0 writes a DeepSeek-V3 checkpoint with transformers, in DeepSeek's FP8 format (e4m3 projections with
128x128 `weight_scale_inv` blocks; hidden size 192, so tensor-parallel boxes end inside a block), sharded
over several files, plus its dequantised twin for transformers; and a Kimi K2.5-layout checkpoint whose routed
experts compressed-tensors packed in INT4 (the int4 case), with its DeepSeek-layout twin for transformers.
Per layout:
  load   -- training.core.build_model starts from the FP8 checkpoint (meta build, layout, each rank reading
            only its slices); every piece a rank holds equals the box of the one-process start
            (build_model without a layout), the pieces of all ranks cover every element; the one-process
            start equals load_hf_checkpoint's whole-model load and its logits equal transformers'
            (the MTP depth the checkpoint lacks keeps the seeded initialisation on both sides);
  export -- save_hf_checkpoint from the sharded model (collective, one gathered tensor at a time) writes the
            same tensors as the one-process export.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent))
from common import init, reduce_max, run_cases  # noqa: E402

from megatron_composer.checkpoint.hf import (  # noqa: E402
    load_hf_checkpoint,
    quantize_fp8_blockwise,
    read_hf_config,
    save_hf_checkpoint,
)
from megatron_composer.fp8 import FP8Config  # noqa: E402
from megatron_composer.parallel.dims import ParallelConfig  # noqa: E402
from megatron_composer.parallel.fsdp import is_fsdp  # noqa: E402
from megatron_composer.parallel.slices import full_shape, local_pieces, local_tensor, named_tensors  # noqa: E402
from megatron_composer.training.core import InitialWeights, build_model  # noqa: E402
from megatron_composer.training.layout import Layout  # noqa: E402

SEED = 11


def make_checkpoints(root: Path) -> None:
    """root/fp8 (what the ranks load) and root/deq (the same weights dequantised, for transformers)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    cfg = DeepseekV3Config(
        vocab_size=256, hidden_size=192, intermediate_size=320, moe_intermediate_size=144, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, n_group=2,
        topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48,
        qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, routed_scaling_factor=2.5,
        max_position_embeddings=256, initializer_range=0.1, num_nextn_predict_layers=1)
    ref = DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in ref.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    ref.save_pretrained(root / "hf")
    state = {}
    for file in (root / "hf").glob("*.safetensors"):
        state.update(load_file(file))
    fp8, deq = {}, {}
    for k, t in state.items():
        if t.dim() == 2 and k.endswith("proj.weight"):
            q, s = quantize_fp8_blockwise(t)
            fp8[k], fp8[k[: -len("weight")] + "weight_scale_inv"] = q, s
            deq[k] = q.float() * s.repeat_interleave(128, 0)[: t.shape[0]].repeat_interleave(128, 1)[:, : t.shape[1]]
        else:
            fp8[k] = deq[k] = t
    config = (root / "hf" / "config.json").read_text()
    for name, tensors in (("fp8", fp8), ("deq", deq)):
        out = root / name
        out.mkdir()
        keys = sorted(tensors)
        files = [keys[i::3] for i in range(3)]  # three shard files, tensors interleaved across them
        weight_map = {}
        for i, part in enumerate(files):
            fname = f"model-{i + 1:05d}-of-00003.safetensors"
            save_file({k: tensors[k].contiguous() for k in part}, str(out / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in part})
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        (out / "config.json").write_text(config)


def make_int4_checkpoints(root: Path) -> None:
    """root/int4: Kimi K2.5's release layout with INT4 experts packed by compressed-tensors; root/int4_plain:
    the same tensors in DeepSeek-V3's layout, which transformers loads."""
    sys.path.insert(0, str(Path(__file__).parents[2]))
    from int4_assets import deepseek_model, write_int4_checkpoint

    write_int4_checkpoint(root / "int4", deepseek_model(seed=4, hidden=96, moe_ffn=64), kimi_layout=True)
    write_int4_checkpoint(root / "int4_plain", deepseek_model(seed=4, hidden=96, moe_ffn=64))


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def make_case(root: Path, ckpt: str = "fp8", **parallel):
    def run():
        _, hub = read_hf_config(root / ckpt)
        mc = hub.replace(num_mtp_layers=1)  # the checkpoint holds no MTP layer (transformers drops it)
        init_hf = InitialWeights(hf=str(root / ckpt))
        layout = Layout(ParallelConfig(**parallel))
        model = build_model(mc, layout, torch.device("cpu"), FP8Config(), seed=SEED, init=init_hf)
        ref = build_model(mc, Layout(ParallelConfig(), distributed=False), torch.device("cpu"), FP8Config(),
                          seed=SEED, init=init_hf)
        errs = {"is_fsdp": float(is_fsdp(model) != bool(parallel.get("fsdp")))}
        ref_t = dict(named_tensors(ref))
        for name, t in named_tensors(model):
            cover = torch.zeros(tuple(full_shape(t)))
            bad = 0.0
            for pc in local_pieces(t):
                bad = max(bad, float(not torch.equal(local_tensor(t)[pc.local], ref_t[name][pc.full])))
                cover[pc.full] += 1
            dist.all_reduce(cover)
            errs[f"load:{name}"] = bad + float(not bool((cover > 0).all()))
        out = root / ("export_" + ckpt + "_".join(f"{k}{v}" for k, v in parallel.items()))
        save_hf_checkpoint(model, out, max_shard_bytes=150_000, progress=False, groups=layout.groups)
        if dist.get_rank() == 0:
            # the one-process start is the whole-model load, with transformers' logits
            whole = load_hf_checkpoint(root / ckpt, dtype=torch.float32, progress=False).state_dict()
            for name, t in ref.state_dict().items():  # the MTP depth: only in ref, from the initialisation
                errs[f"whole:{name}"] = float(name in whole and not torch.equal(t, whole[name])
                                              or name not in whole and not name.startswith("mtp."))
            if ckpt == "fp8":
                from transformers import DeepseekV3ForCausalLM

                peer = DeepseekV3ForCausalLM.from_pretrained(root / "deq", dtype=torch.float32).eval()
            else:  # transformers dequantises the INT4 experts through compressed-tensors
                from int4_assets import transformers_float32

                peer = transformers_float32(root / "int4_plain")
            ids = torch.randint(0, mc.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                errs["logits_vs_transformers"] = (ref.eval()(ids) - peer(ids).logits).abs().max().item()
            # the sharded export holds the one-process export's tensors, over several files with an index
            save_hf_checkpoint(ref, root / f"export_ref_{ckpt}", max_shard_bytes=150_000, progress=False,
                               overwrite=True)
            got, want = _tensors(out), _tensors(root / f"export_ref_{ckpt}")
            errs["export_keys"] = float(sorted(got) != sorted(want))
            errs["export_files"] = float(len(list(out.glob("*.safetensors"))) < 3
                                         or not (out / "model.safetensors.index.json").is_file())
            errs["export_values"] = float(any(not torch.equal(got[k], want[k]) for k in want if k in got))
        else:
            errs.update({k: 0.0 for k in ("logits_vs_transformers", "export_keys", "export_files", "export_values")})
            errs.update({f"whole:{name}": 0.0 for name in ref.state_dict()})
        errs = reduce_max(errs)
        return {"max_err": max(errs.values()), "errs": errs}
    return run


if __name__ == "__main__":
    args = init()
    root = Path(args.out)
    if dist.get_rank() == 0:
        make_checkpoints(root)
        make_int4_checkpoints(root)
    dist.barrier()
    run_cases(args, {
        "tp2_ep2": make_case(root, tp=2, ep=2),
        "fsdp_ep2": make_case(root, fsdp=True, ep=2),
        "fsdp_tp2_ep2": make_case(root, fsdp=True, tp=2, ep=2),
        "int4_fsdp_ep2": make_case(root, "int4", fsdp=True, ep=2),
    })
