"""torchrun worker: collectives, TP/SP layers, vocab-parallel losses and the data-parallel optimizer,
each checked against the same computation in one process."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import compare_grads, init, max_rel_err, reduce_max, run_cases  # noqa: E402

from megatron_composer.parallel import collectives as C  # noqa: E402
from megatron_composer.parallel.context_parallel import cp_shift_left, shard_sequence, sharded_sequence_balance_loss  # noqa: E402
from megatron_composer.parallel.data_parallel import DistributedAdamW  # noqa: E402
from megatron_composer.parallel.dims import ParallelDims  # noqa: E402
from megatron_composer.parallel.layers import (  # noqa: E402
    ColumnParallelLinear,
    RowParallelLinear,
    ShardSpec,
    VocabParallelEmbedding,
    full_state_dict,
    set_spec,
    spec_of,
)
from megatron_composer.parallel.vocab_parallel import (  # noqa: E402
    vocab_parallel_argmax,
    vocab_parallel_cross_entropy,
    vocab_parallel_kl,
    vocab_parallel_logprobs_entropy,
)

V, D, FF, B, S = 32, 16, 24, 4, 8


class TinyNet(nn.Module):
    """Embedding -> RMSNorm -> fused gate/up -> SwiGLU -> down (+bias) -> residual -> RMSNorm -> head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.norm1 = nn.RMSNorm(D)
        self.w13 = nn.Linear(D, 2 * FF, bias=False)
        self.w2 = nn.Linear(FF, D, bias=True)
        self.norm2 = nn.RMSNorm(D)
        self.head = nn.Linear(D, V, bias=False)
        with torch.no_grad():  # non-trivial norm weights so their gradients are tested meaningfully
            self.norm1.weight.uniform_(0.5, 1.5)
            self.norm2.weight.uniform_(0.5, 1.5)

    def forward(self, ids):
        h = self.emb(ids)
        g, u = self.w13(self.norm1(h)).chunk(2, dim=-1)
        h = h + self.w2(F.silu(g) * u)
        return self.head(self.norm2(h))


def parallelize_tiny(net: TinyNet, tp_group, sp: bool) -> TinyNet:
    net = copy.deepcopy(net)
    net.emb = VocabParallelEmbedding.from_embedding(net.emb, tp_group, sequence_parallel=sp)
    net.w13 = ColumnParallelLinear.from_linear(net.w13, tp_group, sequence_parallel=sp, blocks=2)
    net.w2 = RowParallelLinear.from_linear(net.w2, tp_group, sequence_parallel=sp)
    net.head = ColumnParallelLinear.from_linear(net.head, tp_group, sequence_parallel=sp)
    for norm in (net.norm1, net.norm2):
        set_spec(norm.weight, ShardSpec("tp_partial" if sp else "replicated"))
    return net


def data(seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, S), generator=g)
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[0, :2] = -100
    return ids, labels


def ref_loss(net, ids, labels):
    logits = net(ids)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum") / (
        labels != -100).sum()


def case_collectives():
    w, r = dist.get_world_size(), dist.get_rank()
    g = dist.group.WORLD
    errs = {}
    torch.manual_seed(0)
    x = torch.randn(w * 3, 5, requires_grad=True)  # same on all ranks
    # scatter then gather is the identity, and so is its gradient
    y = C.gather_from_parallel(C.scatter_to_parallel(x, 0, g), 0, g)
    (y * torch.arange(y.numel()).view_as(y)).sum().backward()
    errs["scatter_gather"] = max_rel_err(y, x) + max_rel_err(x.grad, torch.arange(x.numel()).view_as(x).float())
    # reduce-scatter of per-rank tensors equals the slice of their sum; its gradient all-gathers
    xs = [torch.randn(w * 2, 3, generator=torch.Generator().manual_seed(k)) for k in range(w)]
    mine = xs[r].clone().requires_grad_()
    out = C.reduce_scatter_to_parallel(mine, 0, g)
    errs["reduce_scatter"] = max_rel_err(out, sum(xs).chunk(w)[r])
    out.backward(torch.full_like(out, float(r + 1)))
    expect = torch.cat([torch.full((2, 3), float(k + 1)) for k in range(w)])
    errs["reduce_scatter_grad"] = max_rel_err(mine.grad, expect)
    # uneven all-to-all: rank r sends (r + k + 1) rows to rank k; round trip and gradient
    send = [r + k + 1 for k in range(w)]
    recv = C.exchange_splits(torch.tensor(send), g).tolist()
    errs["splits"] = float(recv != [k + r + 1 for k in range(w)])
    rows = torch.randn(sum(send), 4, generator=torch.Generator().manual_seed(10 + r)).requires_grad_()
    got = C.all_to_all_autograd(rows, recv, send, g)
    back = C.all_to_all_autograd(got * 2.0, send, recv, g)
    errs["a2a_roundtrip"] = max_rel_err(back, rows * 2.0)
    back.sum().backward()
    errs["a2a_grad"] = max_rel_err(rows.grad, torch.full_like(rows, 2.0))
    errs = reduce_max(errs)
    return {"max_err": max(errs.values()), "errs": errs}


def case_tp(sp: bool):
    def run():
        dims = ParallelDims(dist.get_world_size(), tp=dist.get_world_size(), sequence_parallel=sp)
        groups = dims.build()
        torch.manual_seed(0)
        ref = TinyNet()
        par = parallelize_tiny(ref, groups.tp_group, sp)
        full = full_state_dict(par, groups)  # fused gate/up (two interleaved blocks) regrouped correctly
        gather_err = float(any(not torch.equal(full[k], v) for k, v in ref.state_dict().items()))
        ids, labels = data()
        loss_ref = ref_loss(ref, ids, labels)
        loss_ref.backward()
        logits = par(ids)
        ce = vocab_parallel_cross_entropy(logits, labels, groups.tp_group)
        loss = ce.sum() / (labels != -100).sum()
        loss.backward()
        opt = DistributedAdamW(par.named_parameters(), groups, zero1=False)
        opt.finish_grad_sync()
        errs = compare_grads(dict(par.named_parameters()), dict(ref.named_parameters()))
        errs["loss"] = abs(loss.item() - loss_ref.item()) / abs(loss_ref.item())
        errs["state_dict_gather"] = gather_err
        errs = reduce_max(errs)
        return {"max_err": max(errs.values()), "errs": errs}
    return run


def case_vocab_losses():
    g = dist.group.WORLD
    w, r = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(3)
    full = (torch.randn(6, 5, 4 * w) * 3).requires_grad_()
    full_q = torch.randn(6, 5, 4 * w).requires_grad_()
    target = torch.randint(0, 4 * w, (6, 5))
    target[0, 0] = -100
    errs = {}
    # cross-entropy
    ref_ce = F.cross_entropy(full.flatten(0, 1), target.flatten(), ignore_index=-100, reduction="none").view(6, 5)
    wts = torch.rand(6, 5, generator=torch.Generator().manual_seed(4))
    (ref_ce * wts).sum().backward()
    local = full.detach().chunk(w, -1)[r].clone().requires_grad_()
    ce = vocab_parallel_cross_entropy(local, target, g)
    (ce * wts).sum().backward()
    errs["ce"] = max_rel_err(ce, ref_ce)
    errs["ce_grad"] = max_rel_err(local.grad, full.grad.chunk(w, -1)[r], full.grad)
    # log-probs and entropy (RL), and KL between two sharded heads (MTP self-distillation)
    full.grad = None
    t = target.clamp(min=0)
    logp_full = full.log_softmax(-1)
    ref_lp = logp_full.gather(-1, t.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(logp_full.exp() * logp_full).sum(-1)
    ref_kl = (logp_full.exp() * (logp_full - full_q.log_softmax(-1))).sum(-1)
    (ref_lp * wts + ref_ent * wts.flip(0) + ref_kl * wts.flip(1)).sum().backward()
    local = full.detach().chunk(w, -1)[r].clone().requires_grad_()
    local_q = full_q.detach().chunk(w, -1)[r].clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs_entropy(local, t, g)
    kl = vocab_parallel_kl(local, local_q, g)
    (lp * wts + ent * wts.flip(0) + kl * wts.flip(1)).sum().backward()
    errs["logp"] = max_rel_err(lp, ref_lp)
    errs["entropy"] = max_rel_err(ent, ref_ent)
    errs["kl"] = max_rel_err(kl, ref_kl)
    errs["lp_ent_kl_grad"] = max_rel_err(local.grad, full.grad.chunk(w, -1)[r], full.grad)
    errs["kl_q_grad"] = max_rel_err(local_q.grad, full_q.grad.chunk(w, -1)[r], full_q.grad)
    tied = full.detach().clone()
    tied[0, :, :] = 1.0  # ties across shards resolve to the lowest index, as torch.argmax does
    errs["argmax"] = float(not torch.equal(vocab_parallel_argmax(tied.chunk(w, -1)[r].contiguous(), g),
                                           tied.argmax(-1)))
    errs = reduce_max(errs)
    return {"max_err": max(errs.values()), "errs": errs}


def case_cp_shift():
    """cp_shift_left on head-tail shards equals shifting the full sequence, values and gradients."""
    g = dist.group.WORLD
    cp, r = dist.get_world_size(), dist.get_rank()
    S = 4 * cp
    full = torch.randn(2, S, 3, generator=torch.Generator().manual_seed(5)).requires_grad_()
    wts = torch.randn(2, S, 3, generator=torch.Generator().manual_seed(6))
    errs = {}
    for k in (1, 2):
        ref = torch.cat([full[:, k:], torch.zeros(2, k, 3)], dim=1)
        (ref * wts).sum().backward()
        local = shard_sequence(full.detach(), 1, cp, r).clone().requires_grad_()
        got = cp_shift_left(local, k, 1, g)
        (got * shard_sequence(wts, 1, cp, r)).sum().backward()
        errs[f"shift{k}"] = max_rel_err(got, shard_sequence(ref, 1, cp, r), ref)
        errs[f"shift{k}_grad"] = max_rel_err(local.grad, shard_sequence(full.grad, 1, cp, r), full.grad)
        full.grad = None
    errs = reduce_max(errs)
    return {"max_err": max(errs.values()), "errs": errs}


def case_balance_loss():
    """The sequence-wise balance loss over head-tail shards equals the full-sequence loss (value and grads)."""
    from megatron_composer.model.moe import sequence_balance_loss
    g = dist.group.WORLD
    n, r = dist.get_world_size(), dist.get_rank()
    Bn, S, E, K = 3, 8 * n, 8, 2
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(Bn, S, E, generator=gen).requires_grad_()
    idx = torch.rand(Bn, S, E, generator=gen).argsort(-1)[..., :K]
    ref = sequence_balance_loss(logits.sigmoid(), idx, E)
    ref.backward()
    local = shard_sequence(logits.detach(), 1, n, r).clone().requires_grad_()
    loss = sharded_sequence_balance_loss(local.sigmoid(), shard_sequence(idx, 1, n, r), E, g, S)
    loss.backward()
    total = C.all_reduce(loss.detach().clone(), g)
    errs = {"value": abs(total.item() - ref.item()) / abs(ref.item()),
            "grad": max_rel_err(local.grad, shard_sequence(logits.grad, 1, n, r), logits.grad)}
    errs = reduce_max(errs)
    return {"max_err": max(errs.values()), "errs": errs}


def case_capacity():
    """Expert-parallel dispatch with a capacity factor equals dispatching, in one process, each rank's tokens
    with the same per-rank capacity rule over all experts; a large factor is dropless."""
    from megatron_composer.model.moe import GroupedExperts
    from megatron_composer.parallel.expert_parallel import AllToAllDispatcher
    g = dist.group.WORLD
    ep, r = dist.get_world_size(), dist.get_rank()
    E, K, T, Dm, Fm = 4 * ep, 2, 24, 8, 6
    torch.manual_seed(0)
    full = GroupedExperts(E, Dm, Fm)
    for w in (full.w1, full.w2, full.w3):
        torch.nn.init.normal_(w, std=0.3)
    local = GroupedExperts(E // ep, Dm, Fm)
    with torch.no_grad():
        for name in ("w1", "w2", "w3"):
            getattr(local, name).copy_(getattr(full, name).chunk(ep)[r])
    gen = torch.Generator().manual_seed(20 + r)  # each rank has its own tokens, skewed towards expert 0
    x = torch.randn(T, Dm, generator=gen).requires_grad_()
    idx = torch.stack([torch.zeros(T, dtype=torch.long), torch.randint(1, E, (T,), generator=gen)], 1)
    w = torch.rand(T, K, generator=gen).requires_grad_()
    errs, dropped = {}, {}
    for cf in (0.5, 100.0):
        ref_x, ref_w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        ref_out = AllToAllDispatcher(None, E, capacity_factor=cf)(full, ref_x, idx, ref_w)
        (ref_out * torch.arange(Dm)).sum().backward()
        out = AllToAllDispatcher(g, E, capacity_factor=cf)(local, x, idx, w)
        (out * torch.arange(Dm)).sum().backward()
        errs[f"out_{cf}"] = max_rel_err(out, ref_out)
        errs[f"dx_{cf}"] = max_rel_err(x.grad, ref_x.grad)
        errs[f"dw_{cf}"] = max_rel_err(w.grad, ref_w.grad)
        for name in ("w1", "w2", "w3"):
            g_full = C.all_reduce(getattr(full, name).grad.clone(), g)  # every rank's tokens reach all experts
            errs[f"{name}_{cf}"] = max_rel_err(getattr(local, name).grad, g_full.chunk(ep)[r], g_full)
        dropped[cf] = float((w.grad == 0).sum())
        for t in (x, w, *full.parameters(), *local.parameters()):
            t.grad = None
    free = AllToAllDispatcher(g, E)(local, x, idx, w)  # dropless equals a capacity nothing hits
    errs["dropless"] = max_rel_err(free, AllToAllDispatcher(g, E, capacity_factor=100.0)(local, x, idx, w))
    errs = reduce_max(errs)
    return {"max_err": max(errs.values()), "errs": errs, "dropped_small_cf": dropped[0.5],
            "dropped_large_cf": dropped[100.0]}


def case_bf16_master(zero1: bool):
    """bf16 parameters: DistributedAdamW keeps an fp32 master; fed the same gradients, the master follows an
    fp32 AdamW exactly and the bf16 parameters are its rounding (tiny updates are not lost)."""
    def run():
        groups = ParallelDims(dist.get_world_size()).build()
        torch.manual_seed(0)
        net = TinyNet().to(torch.bfloat16)
        ref = copy.deepcopy(net).float()
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
                                    foreach=False)
        opt = DistributedAdamW(net.named_parameters(), groups, lr=1e-4, zero1=zero1, bucket_mb=0.001)
        errs = {}
        for step in range(3):
            ids, labels = data(seed=200 + step)
            n, r = dist.get_world_size(), dist.get_rank()
            ids, labels = ids.chunk(n)[r], labels.chunk(n)[r]
            F.cross_entropy(net(ids).float().flatten(0, 1), labels.flatten(), ignore_index=-100).backward()
            opt.finish_grad_sync()
            refp = dict(ref.named_parameters())
            for fam, b in opt._all_buckets():  # the reduced fp32 gradient the update uses
                flat = C.all_gather(b.grad_shard, 0, opt.family_group[fam][0]) if zero1 else opt._flat_grads(b)
                off = 0
                for n, p in b.params:
                    refp[n].grad = flat[off:off + p.numel()].view(p.shape).clone()
                    off += p.numel()
            ref_opt.step()
            opt.step()
            opt.zero_grad()
        for (name, p), q in zip(net.named_parameters(), ref.parameters()):
            errs[f"bf16:{name}"] = float(not torch.equal(p, q.detach().to(torch.bfloat16)))
        masters = torch.cat([b.master.float() for _, b in opt._all_buckets()])
        ref_flat = torch.cat([q.detach().reshape(-1) for q in ref.parameters()])
        if zero1:  # this rank holds a slice of each bucket's master
            ref_flat = torch.cat([torch.nn.functional.pad(torch.cat([q.detach().reshape(-1) for _, q in
                                  zip(b.params, [dict(ref.named_parameters())[n] for n, _ in b.params])]),
                                  (0, b.padded - b.numel))[b.lo:b.hi] for _, b in opt._all_buckets()])
        errs["master"] = max_rel_err(masters, ref_flat)
        moved = (masters != torch.cat([b.master for _, b in opt._all_buckets()]).bfloat16().float()).any()
        errs["master_finer_than_bf16"] = float(not bool(moved))
        errs = reduce_max(errs)
        return {"max_err": max(errs.values()), "errs": errs}
    return run


def case_train(tp: int, sp: bool, zero1: bool, steps: int = 5, wd: float = 0.1, clip: float = 0.5):
    """tp x dp training of TinyNet: grads after sync and the loss sequence match one process."""
    def run():
        world = dist.get_world_size()
        dims = ParallelDims(world, tp=tp, sequence_parallel=sp)
        groups = dims.build()
        torch.manual_seed(0)
        ref = TinyNet()
        par = parallelize_tiny(ref, groups.tp_group, sp) if tp > 1 else copy.deepcopy(ref)
        decay = [p for p in ref.parameters() if p.ndim >= 2]
        nodecay = [p for p in ref.parameters() if p.ndim < 2]
        ref_opt = torch.optim.AdamW([{"params": decay, "weight_decay": wd}, {"params": nodecay, "weight_decay": 0.0}],
                                    lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)
        opt = DistributedAdamW(par.named_parameters(), groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                               weight_decay=wd, zero1=zero1, bucket_mb=0.001)  # tiny buckets: several per family
        dp_rank, dp = groups.dp_rank, dims.dp
        ref_losses, losses, errs = [], [], {}
        for step in range(steps):
            ids, labels = data(seed=100 + step)
            ref_opt.zero_grad()
            lr_ = ref_loss(ref, ids, labels)
            lr_.backward()
            ref_losses.append(lr_.item())
            n_tokens = (labels != -100).sum()
            my_ids, my_labels = ids.chunk(dp)[dp_rank], labels.chunk(dp)[dp_rank]
            logits = par(my_ids)
            ce = vocab_parallel_cross_entropy(logits, my_labels, groups.tp_group)
            loss = ce.sum() / n_tokens
            loss.backward()
            losses.append(C.all_reduce(loss.detach().clone(), groups.group("dp_cp")).item())
            opt.finish_grad_sync()
            if step == 0 and not zero1:  # reduced gradients, before clipping scales them
                errs.update({f"grad:{k}": v for k, v in compare_grads(dict(par.named_parameters()),
                                                                      dict(ref.named_parameters())).items()})
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            norm = opt.clip_grad_norm(clip)
            errs[f"grad_norm_{step}"] = abs(norm.item() - ref_norm.item()) / ref_norm.item()
            ref_opt.step()
            opt.step()
            opt.zero_grad()
        for step in range(steps):
            errs[f"loss_{step}"] = abs(losses[step] - ref_losses[step]) / abs(ref_losses[step])
        errs.update({f"param:{k}": v for k, v in compare_grads_params(par, ref).items()})
        errs = reduce_max(errs)
        ref_state = sum(s.numel() * s.element_size() for st in ref_opt.state.values() for s in st.values()
                        if torch.is_tensor(s) and s.ndim > 0)
        return {"max_err": max(errs.values()), "errs": errs, "losses": losses, "ref_losses": ref_losses,
                "opt_state_bytes": opt.state_bytes(), "ref_opt_state_bytes": ref_state}
    return run


def compare_grads_params(par, ref) -> dict:
    refp = dict(ref.named_parameters())
    return {n: max_rel_err(p.detach(), spec_of(p).take(refp[n].detach()), refp[n].detach())
            for n, p in par.named_parameters()}


CASES_2 = {
    "collectives": case_collectives,
    "tp2": case_tp(sp=False),
    "tp2_sp": case_tp(sp=True),
    "vocab_losses": case_vocab_losses,
    "cp_shift": case_cp_shift,
    "balance_loss": case_balance_loss,
    "ep2_capacity": case_capacity,
    "dp2_allreduce_train": case_train(tp=1, sp=False, zero1=False),
    "dp2_zero1_train": case_train(tp=1, sp=False, zero1=True),
    "dp2_bf16_master": case_bf16_master(zero1=False),
    "dp2_bf16_master_zero1": case_bf16_master(zero1=True),
}
CASES_4 = {
    "collectives4": case_collectives,
    "cp4_shift": case_cp_shift,
    "balance_loss4": case_balance_loss,
    "tp2_sp_dp2_zero1_train": case_train(tp=2, sp=True, zero1=True),
    "tp2_dp2_allreduce_train": case_train(tp=2, sp=False, zero1=False),
}

if __name__ == "__main__":
    args = init()
    run_cases(args, CASES_2 if dist.get_world_size() == 2 else CASES_4)
