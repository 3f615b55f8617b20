"""torchrun worker: FSDP2 layouts (and the meta-device build) of the tiny models against one process.

Per layout, both models come from training.core's build_model (the parallel one on the meta device, laid out,
allocated shard by shard and filled by the layout-independent initialisation):
  init  -- every piece a rank holds (parallel/slices.py) equals the one-process tensor's box, and the pieces
           of all ranks cover every full tensor;
  grads -- loss and every parameter's gradient after one backward (each piece of the local gradient shard
           against the box of the reference gradient) and the clipped global norm (finish_gradients);
  steps -- 5 optimizer steps through TrainingCore.step (2 micro-batches each) give the same loss sequence;
  state -- the trained shards gather (full_state_dict) to full tensors holding every rank's pieces, and load
           back piece by piece (load_full_state_dict).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).parent))
from common import init, max_rel_err, reduce_max, run_cases  # noqa: E402
from model_worker import batch, loss_terms, tiny_config  # noqa: E402

import megatron_composer.kernels.grouped_mm as G  # noqa: E402
from megatron_composer.fp8 import FP8Config, FP8GroupedMM, FP8Linear, FP8LinearFunction  # noqa: E402
from megatron_composer.kernels.cpu.grouped_mm import inference_kernel  # noqa: E402
from megatron_composer.parallel.dims import ParallelConfig  # noqa: E402
from megatron_composer.parallel.fsdp import is_fsdp  # noqa: E402
from megatron_composer.parallel.layers import full_state_dict  # noqa: E402
from megatron_composer.parallel.parallelize import shard_batch  # noqa: E402
from megatron_composer.parallel.slices import (  # noqa: E402
    full_shape,
    load_full_state_dict,  # noqa: E402
    local_pieces,
    local_tensor,
    named_tensors,
)
from megatron_composer.training.core import TrainingCore, finish_gradients  # noqa: E402
from megatron_composer.training.layout import Layout  # noqa: E402
from megatron_composer.training.optim import OptimizerConfig  # noqa: E402
from megatron_composer.training.qat import QATConfig  # noqa: E402
from pretrain.losses import lm_loss_sum_fused_head  # noqa: E402

LR, CLIP, SEED, MICRO = 3e-3, 1.0, 7, 2


def _optim():
    return OptimizerConfig(lr=LR, weight_decay=0.1, grad_clip=CLIP, warmup_steps=0, schedule="constant")


def _loss_fn(model, groups, n_main, n_mtp, use_mtp, step_batches, fused_head=False):
    tp_group = groups.tp_group if groups is not None and groups.dims.tp > 1 else None

    def loss_fn(k):
        ids, pos, labels, mtp_labels, _ = step_batches[k]
        if groups is not None:
            ids, pos, labels, mtp_labels = shard_batch(groups, ids, pos, labels, mtp_labels)
        if fused_head:  # the pretraining loss's head: the root's weight read outside the model's forward
            out = model(ids, position_ids=pos, logits=False)
            loss = lm_loss_sum_fused_head(out.hidden_states, model.output.weight, labels.clamp(min=0),
                                          (labels != -100).float()) / n_main
            return loss, {"loss": loss.detach()}
        out = model(ids, position_ids=pos, mtp=use_mtp)
        logits, mtp_logits = (out.logits, out.mtp_logits) if use_mtp else (out, [])
        loss = loss_terms(logits, mtp_logits, labels, mtp_labels, tp_group, n_main, n_mtp)
        return loss, {"loss": loss.detach()}
    return loss_fn


def _step_batches(step, cfg):
    bs = [batch(MICRO * step + k, cfg, False) for k in range(MICRO)]
    n_main = sum((b[2] != -100).sum() for b in bs)
    n_mtp = sum((b[3] != -100).sum() for b in bs)
    return bs, n_main, n_mtp


class _EveryOp(TorchFunctionMode):
    """Sees every torch function: the CPU kernels step aside under a torch function mode, so the experts run
    their reference loops (GroupedExperts.reference_forward)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _eval_loss(model, groups, cfg, use_mtp) -> float:
    """The first step's loss from a forward with no gradient (evaluation): few rows per expert."""
    bs, n_main, n_mtp = _step_batches(0, cfg)
    fn = _loss_fn(model, groups, n_main, n_mtp, use_mtp, bs)
    with torch.no_grad():
        loss = sum(fn(k)[0] for k in range(MICRO))
    if groups is not None:
        dist.all_reduce(loss, group=groups.group("dp_cp"))
    return loss.item()


def _quantised(model) -> bool:
    """Whether FP8 GEMMs are in place: FP8 dense layers, tensor-parallel layers' FP8 linear_fn, FP8 experts."""
    return any(isinstance(m, FP8Linear) or isinstance(getattr(m, "linear_fn", None), FP8LinearFunction)
               or isinstance(getattr(m, "grouped_mm", None), FP8GroupedMM) for m in model.modules())


def _expert_paths(model, ref, groups, cfg, use_mtp) -> tuple[dict, dict]:
    """Each expert kernel path against the one-process model, forced: the few-rows inference kernels (no
    gradient, few rows: pair_swiglu without expert parallelism, swiglu_rows behind the all-to-all with it), and
    the reference loops (under a torch function mode); quantised experts run their FP8 grouped GEMM in both.
    The gradient path is the step's backward. Returns the errors, how often the few-rows kernel was chosen and
    whether it should have been."""
    chosen = []
    few_rows = G.few_rows_kernel

    def counting(*args):
        kernel = few_rows(*args)
        chosen.append(kernel is not None)
        return kernel

    G.few_rows_kernel = counting
    try:
        got, want = _eval_loss(model, groups, cfg, use_mtp), _eval_loss(ref, None, cfg, use_mtp)
    finally:
        G.few_rows_kernel = few_rows
    errs = {"eval_few_rows": abs(got - want) / abs(want)}
    with _EveryOp():
        got, want = _eval_loss(model, groups, cfg, use_mtp), _eval_loss(ref, None, cfg, use_mtp)
    errs["eval_reference"] = abs(got - want) / abs(want)
    with torch.no_grad():  # the kernel needs AVX2; quantised experts (FP8) run their own grouped GEMM instead
        expected = inference_kernel(torch.zeros(1)) is not None and not _quantised(model)
    return errs, {"few_rows_chosen": sum(chosen), "few_rows_expected": expected}


def make_case(preset: str, overrides=None, steps=5, fused_head=False, fp8=None, qat="none", **parallel):
    def run():
        cfg = tiny_config(preset).replace(**(overrides or {}))
        use_mtp = cfg.num_mtp_layers > 0
        fp8_cfg, qat_cfg = FP8Config(**(fp8 or {})), QATConfig(experts=qat)
        core = TrainingCore(cfg, {}, Layout(ParallelConfig(**parallel)), torch.device("cpu"), optim=_optim(),
                            fp8=fp8_cfg, seed=SEED, qat=qat_cfg)
        ref = TrainingCore(cfg, {}, Layout(ParallelConfig(), distributed=False), torch.device("cpu"),
                           optim=_optim(), fp8=fp8_cfg, seed=SEED, qat=qat_cfg)
        groups = core.layout.groups
        errs = {"is_fsdp": float(is_fsdp(core.model) != bool(parallel.get("fsdp")))}
        if fp8:  # the FP8 GEMMs are in place
            errs["fp8_applied"] = float(not _quantised(core.model))
        if qat != "none":  # every experts module computes on the INT4 grid
            experts = [m for m in core.model.modules() if hasattr(m, "weight_transform")]
            errs["qat_applied"] = float(not experts or any(m.weight_transform is None for m in experts))
        # init: each piece equals the reference's box; the pieces of all ranks cover every element
        ref_t = dict(named_tensors(ref.model))
        for name, t in named_tensors(core.model):
            cover = torch.zeros(tuple(full_shape(t)))
            bad = 0.0
            for pc in local_pieces(t):
                bad = max(bad, float(not torch.equal(local_tensor(t)[pc.local], ref_t[name][pc.full])))
                cover[pc.full] += 1
            dist.all_reduce(cover)
            errs[f"init:{name}"] = bad + float(not bool((cover > 0).all()))
        # every expert kernel path under this layout, FSDP's root left gathered by the gradient-free forwards
        path_errs, paths = _expert_paths(core.model, ref.model, groups, cfg, use_mtp)
        errs.update(path_errs)
        # one backward: loss, every gradient piece, clipped norm
        bs, n_main, n_mtp = _step_batches(0, cfg)
        total = torch.zeros(())
        for model, g in ((ref.model, None), (core.model, groups)):
            fn = _loss_fn(model, g, n_main, n_mtp, use_mtp, bs, fused_head)
            loss = sum(fn(k)[0] for k in range(MICRO))
            loss.backward()
            if g is None:
                ref_loss = loss.item()
            else:
                total = loss.detach().clone()
                dist.all_reduce(total, group=groups.group("dp_cp"))
        errs["loss"] = abs(total.item() - ref_loss) / abs(ref_loss)
        ref_norm = finish_gradients(ref.model, ref.optimizer, CLIP)
        norm = finish_gradients(core.model, core.optimizer, CLIP)
        errs["grad_norm"] = abs(norm.item() - ref_norm.item()) / ref_norm.item()
        ref_p = dict(ref.model.named_parameters())
        n_params = 0
        for name, p in core.model.named_parameters():
            n_params += 1
            rg = ref_p[name].grad
            e = 0.0
            for pc in local_pieces(p):
                e = max(e, max_rel_err(local_tensor(p.grad)[pc.local], rg[pc.full], rg))
            errs[f"grad:{name}"] = e
        core.optimizer.zero_grad()
        ref.optimizer.zero_grad()
        # 5 optimizer steps through the training core
        losses, ref_losses = [], []
        for step in range(steps):
            bs, n_main, n_mtp = _step_batches(1 + step, cfg)
            ref_fn = _loss_fn(ref.model, None, n_main, n_mtp, use_mtp, bs, fused_head)
            ref_losses.append(ref.step(ref_fn, range(MICRO), LR)["loss"])
            losses.append(core.step(_loss_fn(core.model, groups, n_main, n_mtp, use_mtp, bs, fused_head),
                                   range(MICRO), LR)["loss"])
        for step in range(steps):
            errs[f"loss_{step}"] = abs(losses[step] - ref_losses[step]) / abs(ref_losses[step])
        # the trained shards gather to full tensors holding every rank's pieces, and load back piece by piece
        full, ref_sd = full_state_dict(core.model, groups), ref.model.state_dict()
        errs["state_dict_keys"] = float(set(full) != set(ref_sd)
                                        or any(full[k].shape != ref_sd[k].shape for k in ref_sd))
        errs["state_dict_gather"] = float(any(not torch.equal(local_tensor(t)[pc.local], full[name][pc.full])
                                              for name, t in named_tensors(core.model) for pc in local_pieces(t)))
        with torch.no_grad():
            for _, t in named_tensors(core.model):
                local_tensor(t).zero_()
        load_full_state_dict(core.model, full)
        errs["state_dict_reload"] = float(any(not torch.equal(local_tensor(t)[pc.local], full[name][pc.full])
                                              for name, t in named_tensors(core.model) for pc in local_pieces(t)))
        errs = reduce_max(errs)
        return {"max_err": max(errs.values()), "errs": errs, "losses": losses, "ref_losses": ref_losses,
                "n_params": n_params, "activation_analytic_over_measured": None, **paths}
    return run


DS, QW = "tiny-deepseek-v3", "tiny-qwen3-moe"
CASES_4 = {
    # meta-device build and layout-independent initialisation without FSDP
    "tp2": make_case(DS, steps=2, tp=2, zero1=False),
    "ep2": make_case(QW, steps=2, ep=2, zero1=False),
    # FSDP layouts
    "fsdp": make_case(DS, fsdp=True),
    "fsdp_ep2_expert_dim1": make_case(QW, {"num_experts": 2, "num_experts_per_tok": 1, "norm_topk_prob": False},
                                      fsdp=True, ep=2),
    "fsdp_ep2_fused_head": make_case(QW, steps=3, fused_head=True, fsdp=True, ep=2),
    # MXFP8 dense and grouped GEMMs quantise the gathered weights (weight gradients in high precision, so
    # the token split across ranks does not change their rounding)
    "fsdp_tp2_mxfp8": make_case(QW, steps=2, fp8={"recipe": "mxfp8", "wgrad_bf16": True}, fsdp=True, tp=2),
    "fsdp_tp2_sp": make_case(QW, fsdp=True, tp=2, sequence_parallel=True),
    "fsdp_cp2_selective_ac": make_case(DS, fsdp=True, cp=2, activation_checkpointing="selective"),
    "fsdp_tp2_ep2": make_case(DS, fsdp=True, tp=2, ep=2),
    # INT4 QAT of the experts on each rank's experts of the gathered unit, under MXFP8 grouped GEMMs
    "fsdp_ep2_int4_qat_mxfp8": make_case(QW, steps=2, fp8={"recipe": "mxfp8", "wgrad_bf16": True}, qat="int4",
                                         fsdp=True, ep=2),
    "hsdp_ep2_full_ac": make_case(DS, fsdp=True, dp_replicate=2, ep=2, activation_checkpointing="full"),
}

if __name__ == "__main__":
    args = init()
    run_cases(args, CASES_4)
