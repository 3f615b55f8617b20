"""torchrun worker: DCP checkpoints across parallel layouts, FSDP included.

Modes (--cases):
  save_load  every layout of PAIRS that saves and runs on this world size writes a checkpoint whose model and
             AdamW state are known full tensors (drawn per name from a seeded generator), then every layout of
             PAIRS that loads on this world size loads its sources (written here or, with --ckpt-dir, by the
             other world size) and checks each of its local pieces exactly against the same slice of the
             known full tensor. The local pieces are cut here independently of
             the checkpoint code (ShardSpec.take, then torch.chunk by the FSDP placements, as FSDP shards).
  resume     fsdp x ep2: 2 steps, an asynchronous save, 2 more steps; a fresh model loads the checkpoint and
             its 2 steps give the same losses.
"""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from common import init, reduce_max  # noqa: E402
from model_worker import batch, loss_terms, tiny_config  # noqa: E402

from megatron_composer.checkpoint.dcp import load_checkpoint, save_checkpoint  # noqa: E402
from megatron_composer.model import Transformer  # noqa: E402
from megatron_composer.parallel import collectives as C  # noqa: E402
from megatron_composer.parallel.data_parallel import DistributedAdamW  # noqa: E402
from megatron_composer.parallel.dims import ParallelDims  # noqa: E402
from megatron_composer.parallel.fsdp import apply_fsdp  # noqa: E402
from megatron_composer.parallel.layers import spec_of  # noqa: E402
from megatron_composer.parallel.parallelize import parallelize_model, shard_batch  # noqa: E402
from megatron_composer.training.core import finish_gradients  # noqa: E402

PRESET = "tiny-deepseek-v3"


def config():
    """The tiny model with sizes FSDP cannot split evenly: vocab 514 (257 rows per tp rank), the MLA ranks 62
    and 26 (+16 rope dims): uneven and padded chunks on every layout here."""
    return tiny_config(PRESET).replace(vocab_size=514, q_lora_rank=62, kv_lora_rank=26, num_layers=2)
META = {"model": {"preset": PRESET}}
# name -> layout; "world" is the number of ranks it runs on
LAYOUTS = {
    "one_rank": dict(world=1),
    "tp2": dict(world=2, tp=2),
    "ep2": dict(world=2, ep=2),
    "cp2": dict(world=2, cp=2),
    "dp2_zero1": dict(world=2, zero1=True),
    "fsdp2": dict(world=2, fsdp=True),
    "fsdp": dict(world=4, fsdp=True),
    "fsdp_tp2": dict(world=4, tp=2, fsdp=True),
    "fsdp_tp2_sp": dict(world=4, tp=2, sp=True, fsdp=True),
    "fsdp_cp2": dict(world=4, cp=2, fsdp=True),
    "fsdp_ep2": dict(world=4, ep=2, fsdp=True),
    "fsdp_tp2_ep2": dict(world=4, tp=2, ep=2, fsdp=True),
    "hsdp_ep2": dict(world=4, ep=2, fsdp=True, dp_replicate=2),
    "tp2_zero1": dict(world=4, tp=2, zero1=True),
    "ep4": dict(world=4, ep=4, zero1=False),
    "tp2_ep2": dict(world=4, tp=2, ep=2, zero1=True),
}
# (saved under, loaded under): every saver loads at least twice, with FSDP on and off, another tp and another
# ep; launches run on 1, then 4, then 2, then 1 rank(s), each loading what the earlier ones saved
PAIRS = [
    # loaded on 4 ranks
    ("one_rank", "fsdp_ep2"), ("one_rank", "fsdp_tp2"),
    ("fsdp", "fsdp_tp2_ep2"), ("fsdp", "ep4"),
    ("fsdp_tp2", "fsdp_tp2"), ("fsdp_tp2", "ep4"), ("fsdp_tp2", "fsdp_ep2"),
    ("fsdp_tp2_sp", "tp2_ep2"), ("fsdp_tp2_sp", "fsdp"),
    ("fsdp_cp2", "tp2_zero1"), ("fsdp_cp2", "fsdp_tp2_sp"),
    ("fsdp_ep2", "fsdp_ep2"), ("fsdp_ep2", "tp2_zero1"), ("fsdp_ep2", "ep4"), ("fsdp_ep2", "hsdp_ep2"),
    ("fsdp_ep2", "fsdp_tp2_ep2"), ("fsdp_tp2_ep2", "ep4"), ("hsdp_ep2", "tp2_ep2"),
    ("tp2_ep2", "fsdp_ep2"), ("tp2_ep2", "fsdp_tp2_ep2"), ("ep4", "hsdp_ep2"), ("tp2_zero1", "fsdp_cp2"),
    # loaded on 2 ranks
    ("one_rank", "tp2"), ("tp2", "ep2"), ("tp2", "fsdp2"), ("ep2", "tp2"), ("ep2", "cp2"), ("cp2", "fsdp2"),
    ("dp2_zero1", "tp2"), ("dp2_zero1", "fsdp2"), ("ep2", "fsdp2"), ("fsdp_tp2_sp", "cp2"), ("fsdp_cp2", "ep2"),
    ("fsdp_tp2_ep2", "dp2_zero1"),
    # loaded on 1 rank
    ("fsdp_ep2", "one_rank"), ("fsdp_tp2_ep2", "one_rank"), ("hsdp_ep2", "one_rank"), ("fsdp_tp2", "one_rank"),
    ("fsdp", "one_rank"), ("tp2", "one_rank"), ("ep2", "one_rank"), ("cp2", "one_rank"), ("dp2_zero1", "one_rank"),
    ("tp2_zero1", "one_rank"), ("ep4", "one_rank"),
]


def build(layout: dict, seed: int = 0):
    world = dist.get_world_size()
    assert world == layout["world"]
    dims = ParallelDims(world, tp=layout.get("tp", 1), cp=layout.get("cp", 1), ep=layout.get("ep", 1),
                        sequence_parallel=layout.get("sp", False), dp_replicate=layout.get("dp_replicate", 1))
    groups = dims.build() if world > 1 else None
    torch.manual_seed(seed)
    model = Transformer(config())
    if groups is not None:
        model = parallelize_model(model, groups)
    if layout.get("fsdp"):
        model = apply_fsdp(model, groups)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    elif groups is not None:
        opt = DistributedAdamW(model.named_parameters(), groups, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1,
                               zero1=layout.get("zero1", False))
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    return groups, model, opt


def evaluate(groups, model) -> None:
    """A forward with no backward, as validation runs before a save: FSDP's root unit stays gathered."""
    ids, pos, *_ = batch(0, config(), False)
    if groups is not None:
        ids, pos = shard_batch(groups, ids, pos)
    with torch.no_grad():
        model(ids, position_ids=pos)


def full_value(name: str, shape, key: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{key}".encode()))
    t = torch.randn(shape, generator=g)
    return t.abs() if key == "exp_avg_sq" else t


def full_shape(p) -> list[int]:
    spec = spec_of(p)
    shape = list(p.shape)  # an FSDP DTensor's shape is its tp/ep-local shape
    if spec.kind in ("tp_sharded", "expert") and spec.size > 1:
        shape[spec.dim] *= spec.size
    return shape


def local_of(full: torch.Tensor, p) -> torch.Tensor:
    """This rank's piece of `full` for parameter p: the ShardSpec's slice, then FSDP's chunk of it."""
    from torch.distributed.tensor import DTensor, Shard

    t = spec_of(p).take(full)
    if isinstance(p, DTensor):
        for mesh_dim, pl in enumerate(p.placements):
            if isinstance(pl, Shard):
                n, i = p.device_mesh.size(mesh_dim), p.device_mesh.get_local_rank(mesh_dim)
                chunks = torch.chunk(t, n, dim=pl.dim)
                t = chunks[i] if i < len(chunks) else t.narrow(pl.dim, 0, 0)
    return t


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def set_known_state(model, opt) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            local(p).copy_(local_of(full_value(n, full_shape(p), "param"), p))
    if isinstance(opt, DistributedAdamW):  # takes full (tp/ep-local) moments and keeps its shard
        moments = {n: {k: spec_of(p).take(full_value(n, full_shape(p), k)) for k in ("exp_avg", "exp_avg_sq")}
                   for n, p in model.named_parameters()}
        opt.load_named_param_states(moments, 3)
        return
    for n, p in model.named_parameters():
        st = opt.state[p]
        st["step"] = torch.tensor(3.0)
        for k in ("exp_avg", "exp_avg_sq"):
            st[k] = torch.zeros_like(p)
            local(st[k]).copy_(local_of(full_value(n, full_shape(p), k), p))


def state_mismatch(model, opt) -> dict:
    """Per tensor: 1.0 where this rank's piece differs from the known full tensor's slice."""
    bad = {}
    moments = opt.named_param_states(gather=True) if isinstance(opt, DistributedAdamW) else None
    for n, p in model.named_parameters():
        full = full_value(n, full_shape(p), "param")
        bad[f"param:{n}"] = float(not torch.equal(local(p.detach()), local_of(full, p)))
        for k in ("exp_avg", "exp_avg_sq"):
            if moments is not None:
                got, want = moments[n][k], spec_of(p).take(full_value(n, full_shape(p), k))
            else:
                got, want = local(opt.state[p][k]), local_of(full_value(n, full_shape(p), k), p)
            bad[f"{k}:{n}"] = float(not torch.equal(got, want))
        step = opt.step_count if moments is not None else float(opt.state[p]["step"])
        bad[f"step:{n}"] = float(step != 3)
    return bad


def save_load(args) -> dict:
    world = dist.get_world_size()
    here = Path(args.out) / "ckpts"
    roots = [here] + [Path(d) for d in args.ckpt_dir.split(",") if d]
    results, saved = {}, []
    for name in dict.fromkeys(src for src, _ in PAIRS):
        if LAYOUTS[name]["world"] != world:
            continue
        groups, model, opt = build(LAYOUTS[name], seed=1)
        set_known_state(model, opt)
        evaluate(groups, model)
        save_checkpoint(here / name, 1, model, opt, {"step": 1}, META, groups=groups)
        saved.append(name)
    for src, dst in PAIRS:
        ckpt = next((r / src / "checkpoints" / "step_1" for r in roots if (r / src / "latest").exists()), None)
        if LAYOUTS[dst]["world"] != world or ckpt is None:
            continue
        groups, model, opt = build(LAYOUTS[dst], seed=2)
        state = load_checkpoint(ckpt, model, opt, META, groups=groups)
        bad = state_mismatch(model, opt)
        bad = reduce_max(bad) if world > 1 else bad
        results[f"{src}->{dst}"] = {"wrong": sorted(k for k, v in bad.items() if v), "n": len(bad),
                                    "step": state["step"]}
    return {"saved": saved, "loads": results}


def resume(args) -> dict:
    layout = LAYOUTS["fsdp_ep2"]
    cfg = config()

    def train(groups, model, opt, steps):
        losses = []
        for step in steps:
            ids, pos, labels, mtp_labels, _ = batch(step, cfg, False)
            n_main, n_mtp = (labels != -100).sum(), (mtp_labels != -100).sum()
            ids_l, pos_l, labels_l, mtp_l = shard_batch(groups, ids, pos, labels, mtp_labels)
            o = model(ids_l, position_ids=pos_l, mtp=True)
            loss = loss_terms(o.logits, o.mtp_logits, labels_l, mtp_l, groups.tp_group, n_main, n_mtp)
            loss.backward()
            finish_gradients(model, opt, 1.0)
            opt.step()
            opt.zero_grad()
            losses.append(C.all_reduce(loss.detach().clone(), groups.group("dp_cp")).item())
        return losses

    groups, model, opt = build(layout)
    first = train(groups, model, opt, range(2))
    run = Path(args.out) / "resume"
    writer = dist.new_group(backend="gloo")  # the async writer's own collectives
    pending = save_checkpoint(run, 2, model, opt, {"step": 2}, META, groups=groups, async_save=True, async_group=writer)
    straight = first + train(groups, model, opt, range(2, 4))  # trains on while the shards are written
    invisible = not (run / "latest").exists()
    pending.finish()
    groups, model, opt = build(layout, seed=5)  # different weights until the checkpoint loads
    state = load_checkpoint(run / "checkpoints" / "step_2", model, opt, META, groups=groups)
    resumed = first + train(groups, model, opt, range(state["step"], 4))
    return {"straight": straight, "resumed": resumed, "invisible_until_finished": invisible}


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    args0, rest = ap.parse_known_args()
    sys.argv = [sys.argv[0]] + [a for a in rest if not a.startswith("--ckpt")]
    ckpt_dir = next((a.split("=", 1)[1] for a in rest if a.startswith("--ckpt-dir=")), "")
    args = init()
    args.ckpt_dir = ckpt_dir
    result = {"save_load": save_load, "resume": resume}[args.cases](args)
    if dist.get_rank() == 0:
        (Path(args.out) / "results.json").write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()
