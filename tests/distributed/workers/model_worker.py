"""torchrun worker: parallel layouts of the tiny DeepSeek-V3 and Qwen3-MoE models against one process.

Per layout: loss and every parameter gradient after one step (each rank checks its shard against the slice of
the reference gradient), then 5 AdamW steps with global-norm clipping give the same loss sequence.
"""

from __future__ import annotations

import copy
import functools
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import compare_grads, init, reduce_max, run_cases  # noqa: E402

from megatron_composer.model import Transformer, get_preset  # noqa: E402
from megatron_composer.parallel import collectives as C  # noqa: E402
from megatron_composer.parallel.cost import StepPlan, activation_bytes, saved_tensor_bytes  # noqa: E402
from megatron_composer.parallel.data_parallel import DistributedAdamW  # noqa: E402
from megatron_composer.parallel.dims import ParallelDims  # noqa: E402
from megatron_composer.parallel.layers import full_state_dict  # noqa: E402
from megatron_composer.parallel.parallelize import parallelize_model, shard_batch  # noqa: E402
from megatron_composer.parallel.slices import load_full_state_dict  # noqa: E402
from megatron_composer.parallel.vocab_parallel import vocab_parallel_cross_entropy  # noqa: E402

B, S, MTP_WEIGHT, LR, CLIP = 4, 16, 0.3, 3e-3, 1.0


def tiny_config(preset: str):
    return get_preset(preset).replace(vocab_size=512, num_layers=3)


def batch(step: int, cfg, replay: bool):
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
    pos = torch.arange(S).repeat(B, 1)
    pos[1, 7:] = torch.arange(S - 7)  # row 1 packs two documents, the second starting at index 7
    pos[3, 9:] = torch.arange(S - 9)  # a document boundary that falls inside a cp chunk
    labels = F.pad(ids[:, 1:], (0, 1), value=-100)
    mtp_labels = F.pad(ids[:, 2:], (0, 2), value=-100)
    routed = None
    if replay:  # a routing the router would not pick itself: replay must override it
        L = len(cfg.moe_layer_ids)
        routed = torch.rand(L, B, S, cfg.num_experts, generator=g).argsort(-1)[..., :cfg.num_experts_per_tok]
    return ids, pos, labels, mtp_labels, routed


def loss_terms(logits, mtp_logits, labels, mtp_labels, tp_group, n_main, n_mtp):
    loss = vocab_parallel_cross_entropy(logits, labels, tp_group).sum() / n_main
    for ml in mtp_logits:
        loss = loss + MTP_WEIGHT * vocab_parallel_cross_entropy(ml, mtp_labels, tp_group).sum() / n_mtp
    return loss


def make_case(preset: str, tp=1, cp=1, ep=1, sp=False, zero1=False, replay=False, ac="none", steps=5,
              cp_attention="allgather"):
    def run():
        world = dist.get_world_size()
        dims = ParallelDims(world, tp=tp, cp=cp, ep=ep, sequence_parallel=sp)
        groups = dims.build()
        cfg = tiny_config(preset)
        torch.manual_seed(0)
        ref = Transformer(cfg)
        par = parallelize_model(copy.deepcopy(ref), groups, activation_checkpointing=ac, cp_attention=cp_attention)
        ref.train()
        par.train()
        # gathering the shards gives back the full model's tensors exactly
        gathered, ref_sd = full_state_dict(par, groups), ref.state_dict()
        errs = {"state_dict_gather": float(set(gathered) != set(ref_sd)
                                           or any(not torch.equal(gathered[k], ref_sd[k]) for k in ref_sd))}
        decay = [p for p in ref.parameters() if p.ndim >= 2]
        nodecay = [p for p in ref.parameters() if p.ndim < 2]
        ref_opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": nodecay, "weight_decay": 0.0}],
                                    lr=LR, betas=(0.9, 0.95), eps=1e-8, foreach=False)
        opt = DistributedAdamW(par.named_parameters(), groups, lr=LR, betas=(0.9, 0.95), eps=1e-8,
                               weight_decay=0.1, zero1=zero1)
        use_mtp = cfg.num_mtp_layers > 0
        losses, ref_losses = [], []
        for step in range(steps):
            ids, pos, labels, mtp_labels, routed = batch(step, cfg, replay)
            n_main, n_mtp = (labels != -100).sum(), (mtp_labels != -100).sum()
            ref_opt.zero_grad()
            out = ref(ids, position_ids=pos, routed_experts=routed, return_routing=True, mtp=use_mtp)
            ref_loss = loss_terms(out.logits, out.mtp_logits, labels, mtp_labels, None, n_main, n_mtp)
            ref_loss.backward()
            ref_losses.append(ref_loss.item())

            ids_l, pos_l, labels_l, mtp_l = shard_batch(groups, ids, pos, labels, mtp_labels)
            routed_l = None
            if routed is not None:
                (routed_l,) = shard_batch(groups, routed, seq_dim=2, batch_dim=1)
            def forward():
                o = par(ids_l, position_ids=pos_l, routed_experts=routed_l, return_routing=True, mtp=use_mtp)
                return o, loss_terms(o.logits, o.mtp_logits, labels_l, mtp_l, groups.tp_group, n_main, n_mtp)
            if step == 0 and ac == "none":  # activation memory against the analytic model
                for m in par.modules():  # measure the grouped-matmul expert path GPUs run, not a CPU padding path
                    if hasattr(m, "grouped_mm"):
                        m.grouped_mm = functools.partial(m.grouped_mm)
                saved, (pout, loss) = saved_tensor_bytes(forward, list(par.parameters()))
                saved += sum(t.numel() * t.element_size() for t in [pout.logits, *pout.mtp_logits])
                lay = StepPlan(dims, seq_len=S, micro_batch=B // dims.dp, mtp=use_mtp, packed=True,
                             cp_attention=cp_attention)
                ratio = activation_bytes(cfg, lay)["none"] / saved
                act_ratio = C.all_reduce(torch.tensor([ratio, saved], dtype=torch.float64),
                                         groups.group("world")).div(world).tolist()
            elif step == 0:
                act_ratio = None
            if not (step == 0 and ac == "none"):
                pout, loss = forward()
            loss.backward()
            losses.append(C.all_reduce(loss.detach().clone(), groups.group("dp_cp")).item())
            if step == 0:
                if routed is not None:  # the replayed experts were used and are reported back
                    errs["replay_routing"] = float(not torch.equal(pout.routed_experts, routed_l))
                opt.finish_grad_sync()
                opt.gather_grads()
                errs.update({f"grad:{k}": v for k, v in compare_grads(dict(par.named_parameters()),
                                                                      dict(ref.named_parameters())).items()})
            else:
                opt.finish_grad_sync()
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
            norm = opt.clip_grad_norm(CLIP)
            if step == 0:  # later steps compound rounding through Adam; their losses are compared below
                errs["grad_norm"] = abs(norm.item() - ref_norm.item()) / ref_norm.item()
            ref_opt.step()
            opt.step()
            opt.zero_grad()
        for step in range(steps):
            errs[f"loss_{step}"] = abs(losses[step] - ref_losses[step]) / abs(ref_losses[step])
        # the trained shards, gathered to full tensors, load back exactly into a freshly parallelised model
        full = full_state_dict(par, groups)
        fresh = parallelize_model(Transformer(cfg), groups)
        load_full_state_dict(fresh, full)
        errs["state_dict_reload"] = float(any(not torch.equal(a, b) for a, b in zip(fresh.state_dict().values(),
                                                                                    par.state_dict().values())))
        errs = reduce_max(errs)
        return {"max_err": max(errs.values()), "errs": errs, "losses": losses, "ref_losses": ref_losses,
                "n_params": len([k for k in errs if k.startswith("grad:")]),
                "activation_analytic_over_measured": act_ratio}
    return run


DS, QW = "tiny-deepseek-v3", "tiny-qwen3-moe"
CASES_2 = {
    "tp2": make_case(DS, tp=2),
    "tp2_sp": make_case(QW, tp=2, sp=True),
    "tp2_sp_mla_full_ac": make_case(DS, tp=2, sp=True, ac="full", steps=2),
    "ep2": make_case(DS, ep=2),
    "ep2_replay": make_case(QW, ep=2, replay=True),
    "cp2": make_case(DS, cp=2),
    "cp2_gqa_selective_ac": make_case(QW, cp=2, ac="selective", steps=2),
    "cp2_ring": make_case(DS, cp=2, cp_attention="ring", steps=3),
    "dp2_zero1": make_case(DS, zero1=True),
}
CASES_4 = {
    "tp2_cp2": make_case(DS, tp=2, cp=2),
    "tp2_ep2": make_case(QW, tp=2, ep=2),
    "cp4_ring_gqa": make_case(QW, cp=4, cp_attention="ring", steps=3),
    "tp2_sp_cp2_ep2_zero1": make_case(DS, tp=2, cp=2, ep=2, sp=True, zero1=True, replay=True),
    "dp2_tp2_ep4_zero1": make_case(QW, tp=2, ep=4, zero1=True),
}

if __name__ == "__main__":
    args = init()
    run_cases(args, CASES_2 if dist.get_world_size() == 2 else CASES_4)
