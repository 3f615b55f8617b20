"""Collective traffic and per-rank memory of parallel layouts, measured on CPU ranks (torchrun + gloo).

For each layout one training step (forward, loss, backward, gradient sync, clipping, AdamW) of a tiny model
runs with torch.distributed's collectives wrapped to count payload bytes per collective. The measured bytes
are printed next to the analytic volume of megatron_composer.parallel.cost (baseline: the analytic model,
ratio = measured / analytic; the all-to-all uses the routing actually taken), and per-rank
parameter + gradient + optimizer bytes next to the single-process run of the same model (baseline: one process,
measured in the same run).

FSDP layouts (parallel.fsdp: megatron_composer.parallel.fsdp.apply_fsdp, torch AdamW over the shards) count
FSDP's own collectives apart ("fsdp all_gather": each block gathered for forward and again for backward,
"fsdp reduce_scatter": each block's gradient, "fsdp all_reduce": HSDP's replicas), with the number of calls,
and compare their per-rank parameter + gradient + optimizer bytes with a replicated (or ZeRO-1) layout of the
same run (baseline named per row, ratio about 1/dp). The last table sets FSDP against ZeRO-1 on pure data
parallelism with 1 and 4 micro-batches per step: collective calls, bytes and the step time, measured here.

    python benchmarks/parallel_comm.py            # all layouts on 2 and 4 ranks (about a minute on 2 cores)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAYOUTS = {
    2: [
        dict(name="tp2", preset="tiny-deepseek-v3", tp=2),
        dict(name="tp2+sp", preset="tiny-qwen3-moe", tp=2, sp=True),
        dict(name="ep2", preset="tiny-deepseek-v3", ep=2),
        dict(name="cp2", preset="tiny-deepseek-v3", cp=2),
        dict(name="cp2 gqa", preset="tiny-qwen3-moe", cp=2),
        dict(name="cp2 ring", preset="tiny-deepseek-v3", cp=2, cp_attention="ring"),
        dict(name="dp2", preset="tiny-deepseek-v3", zero1=False),
        dict(name="dp2 zero1", preset="tiny-deepseek-v3", zero1=True),
        dict(name="fsdp2", preset="tiny-deepseek-v3", fsdp=True, baseline=["dp2", "dp2 zero1"]),
    ],
    4: [
        dict(name="tp2 x cp2", preset="tiny-deepseek-v3", tp=2, cp=2),
        dict(name="tp2 x ep2", preset="tiny-qwen3-moe", tp=2, ep=2),
        dict(name="tp2 x cp2 ring", preset="tiny-qwen3-moe", tp=2, cp=2, cp_attention="ring"),
        dict(name="tp2+sp x cp2 x ep2 zero1", preset="tiny-deepseek-v3", tp=2, cp=2, ep=2, sp=True, zero1=True),
        dict(name="dp2 x tp2 x ep4 zero1", preset="tiny-qwen3-moe", tp=2, ep=4, zero1=True),
        dict(name="dp4", preset="tiny-deepseek-v3", zero1=False),
        dict(name="dp4 zero1", preset="tiny-deepseek-v3", zero1=True),
        dict(name="fsdp4", preset="tiny-deepseek-v3", fsdp=True, baseline=["dp4", "dp4 zero1"]),
        dict(name="hsdp 2x2", preset="tiny-deepseek-v3", fsdp=True, dp_replicate=2, baseline=["dp4", "dp4 zero1"]),
        dict(name="dp4 zero1 4 micro", preset="tiny-deepseek-v3", zero1=True, micro=4),
        dict(name="fsdp4 4 micro", preset="tiny-deepseek-v3", fsdp=True, micro=4, baseline=["dp4 zero1 4 micro"]),
        dict(name="ep2 dp4", preset="tiny-deepseek-v3", ep=2, zero1=False),
        dict(name="fsdp4 x ep2", preset="tiny-deepseek-v3", ep=2, fsdp=True, baseline=["ep2 dp4"]),
        dict(name="tp2 dp2", preset="tiny-qwen3-moe", tp=2, zero1=False),
        dict(name="fsdp2 x tp2", preset="tiny-qwen3-moe", tp=2, fsdp=True, baseline=["tp2 dp2"]),
    ],
}
B, S = 4, 32
TIMED_STEPS = 3  # after the counted step, for the FSDP rows and their baselines; the median is printed


class Counter:
    """Wraps torch.distributed's collectives; counts payload bytes (see megatron_composer.parallel.cost)."""

    def __init__(self, dist):
        self.dist, self.bytes, self.calls, self.active = dist, {}, {}, False
        self.orig = {}
        from megatron_composer.parallel import collectives as C

        for name, op, payload in (
            ("all_reduce", "all_reduce", lambda a, k: _nbytes(a[0])),
            (C.ALL_GATHER, "all_gather", lambda a, k: _nbytes(a[0])),
            (C.REDUCE_SCATTER, "reduce_scatter", lambda a, k: _nbytes(k["input"] if "input" in k else a[1])),
            ("all_to_all_single", "all_to_all", self._a2a_bytes),
        ):
            self.orig[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(name, op, payload))
        isend = dist.isend  # point-to-point (ring attention) goes through batch_isend_irecv
        self.orig["batch_isend_irecv"] = dist.batch_isend_irecv
        dist.batch_isend_irecv = self._wrap(
            "batch_isend_irecv", "send_recv",
            lambda a, k: sum(_nbytes(o.tensor) for o in a[0] if o.op is isend))

    def _a2a_bytes(self, args, kwargs):
        inp = args[1]
        splits = kwargs.get("input_split_sizes")
        group = kwargs.get("group")
        if not splits:
            n = self.dist.get_world_size(group)
            splits = [inp.shape[0] // n] * n
        me = self.dist.get_rank(group)
        row = _nbytes(inp) // max(inp.shape[0], 1)
        return (sum(splits) - splits[me]) * row

    def _wrap(self, name, op, payload):
        fn = self.orig[name]

        def wrapped(*args, **kwargs):
            if self.active:
                caller = sys._getframe(1).f_globals.get("__name__", "")
                key = ("fsdp " if caller.startswith("torch.distributed.fsdp") else "") + op
                self.bytes[key] = self.bytes.get(key, 0) + payload(args, kwargs)
                self.calls[key] = self.calls.get(key, 0) + 1
            return fn(*args, **kwargs)
        return wrapped


def _nbytes(t):
    return t.numel() * t.element_size()


def worker(layouts: list[dict], out: str) -> None:
    import torch
    import torch.distributed as dist

    counter = Counter(dist)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    import torch.nn.functional as F

    from megatron_composer.model import Transformer, get_preset
    from megatron_composer.parallel import collectives as C
    from megatron_composer.parallel.cost import (
        OPS,
        StepPlan,
        comm_per_step,
        fsdp_comm_per_microbatch,
        memory_per_rank,
        model_params,
    )
    from megatron_composer.parallel.data_parallel import DistributedAdamW
    from megatron_composer.parallel.dims import ParallelDims
    from megatron_composer.parallel.expert_parallel import AllToAllDispatcher
    from megatron_composer.parallel.fsdp import apply_fsdp, finish_fsdp_gradients
    from megatron_composer.parallel.parallelize import parallelize_model, shard_batch
    from megatron_composer.parallel.vocab_parallel import vocab_parallel_cross_entropy

    world, rank = dist.get_world_size(), dist.get_rank()
    results = []
    for spec in layouts:
        dims = ParallelDims(world, tp=spec.get("tp", 1), cp=spec.get("cp", 1), ep=spec.get("ep", 1),
                            sequence_parallel=spec.get("sp", False), dp_replicate=spec.get("dp_replicate", 1))
        groups = dims.build()
        cfg = get_preset(spec["preset"]).replace(vocab_size=512, num_layers=3)
        torch.manual_seed(0)
        full = Transformer(cfg)
        single_opt = torch.optim.AdamW(full.parameters(), lr=1e-3)
        o = full(torch.zeros(1, 4, dtype=torch.long), mtp=True)  # every parameter gets a gradient and state
        (o.logits.sum() + sum(m.sum() for m in o.mtp_logits)).backward()
        single_opt.step()
        single = {"params": sum(_nbytes(p) for p in full.parameters()),
                  "grads": sum(_nbytes(p.grad) for p in full.parameters() if p.grad is not None),
                  "optimizer": sum(_nbytes(t) for st in single_opt.state.values() for t in st.values() if t.ndim > 0)}
        cp_attention = spec.get("cp_attention", "allgather")
        model = parallelize_model(copy.deepcopy(full), groups, cp_attention=cp_attention)
        zero1, fsdp, micro = spec.get("zero1", True), spec.get("fsdp", False), spec.get("micro", 1)
        if fsdp:
            model = apply_fsdp(model, groups)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        else:
            opt = DistributedAdamW(model.named_parameters(), groups, lr=1e-3, zero1=zero1)
        offrank = [0]
        for m in model.modules():  # count the (token, expert) pairs each dispatch sends off-rank
            if isinstance(getattr(m, "dispatch", None), AllToAllDispatcher):
                disp = m.dispatch
                inner = disp.dispatch

                def counting(experts, x, idx, w, _inner=inner, _d=disp):
                    if counter.active:
                        offrank[0] += int((idx // _d.local_experts != C.group_rank(_d.ep_group)).sum())
                    return _inner(experts, x, idx, w)
                disp.dispatch = counting
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
        pos = torch.arange(S).repeat(B, 1)
        labels = F.pad(ids[:, 1:], (0, 1), value=-100)
        mtp_labels = F.pad(ids[:, 2:], (0, 2), value=-100)
        ids_l, pos_l, lab_l, mtp_l = shard_batch(groups, ids, pos, labels, mtp_labels)

        def train_step():
            for _ in range(micro):  # gradient accumulation over the same micro-batch
                o = model(ids_l, position_ids=pos_l, mtp=True)
                loss = vocab_parallel_cross_entropy(o.logits, lab_l, groups.tp_group).sum() / (labels != -100).sum()
                for ml in o.mtp_logits:
                    mtp_ce = vocab_parallel_cross_entropy(ml, mtp_l, groups.tp_group)
                    loss = loss + 0.3 * mtp_ce.sum() / (mtp_labels != -100).sum()
                loss.backward()
            if fsdp:
                finish_fsdp_gradients(model, groups, 1.0)
            else:
                opt.finish_grad_sync()
                opt.clip_grad_norm(1.0)
            opt.step()

        dist.barrier()
        counter.bytes, counter.calls, counter.active = {}, {}, True
        train_step()  # counted (gradients kept for the memory count)
        counter.active = False
        if fsdp:  # this rank's shards: parameters as stored (FSDP pads each to an equal size per rank)
            mem = {"params": sum(p.to_local().untyped_storage().nbytes() for p in model.parameters()),
                   "grads": sum(_nbytes(p.grad.to_local()) for p in model.parameters() if p.grad is not None),
                   "optimizer": sum(_nbytes(t.to_local()) for st in opt.state.values() for t in st.values()
                                    if t.ndim > 0)}
        else:
            mem = {"params": sum(_nbytes(p) for p in model.parameters()),
                   "grads": sum(_nbytes(p.grad) for p in model.parameters() if p.grad is not None),
                   "optimizer": opt.state_bytes()}
        times = []
        timed = fsdp or any(spec["name"] in other.get("baseline", ()) for other in layouts)
        for _ in range(TIMED_STEPS if timed else 0):
            opt.zero_grad()
            dist.barrier()
            t0 = time.perf_counter()
            train_step()
            dist.barrier()
            times.append(time.perf_counter() - t0)
        opt.zero_grad()
        lay = StepPlan(dims=dims, seq_len=S, micro_batch=B // dims.dp, zero1=zero1, mtp=True, cp_attention=cp_attention,
                     fsdp=fsdp, dp_replicate=spec.get("dp_replicate", 1), gather_bytes=4)
        params = model_params(cfg)
        n_moe = len(cfg.moe_layer_ids) + cfg.num_mtp_layers  # MTP blocks are MoE in these presets
        analytic = comm_per_step(cfg, lay, offrank_slots=offrank[0] / n_moe / micro, params=params, micro_batches=micro)
        mem_analytic = memory_per_rank(cfg, lay, params)
        measured = dict(counter.bytes)
        if fsdp:  # FSDP's collectives against the FSDP part of the analytic volume, the rest against the rest
            fsdp_part = fsdp_comm_per_microbatch(cfg, lay, params)
            for op in OPS:
                analytic[op] -= fsdp_part[op] * micro
                analytic["fsdp " + op] = fsdp_part[op] * micro
        keys = sorted(set(measured) | {k for k, v in analytic.items() if v} | set(OPS))
        calls = [float(counter.calls.get(k, 0)) for k in keys]
        vec = torch.tensor([float(measured.get(k, 0)) for k in keys] + [analytic.get(k, 0.0) for k in keys] + calls
                           + [mem[k] for k in ("params", "grads", "optimizer")]
                           + [mem_analytic[k] for k in ("params", "grads", "optimizer")]
                           + [statistics.median(times) if times else 0.0],
                           dtype=torch.float64)
        n = len(keys)
        key_lists = [None] * world
        dist.all_gather_object(key_lists, keys)
        assert all(k == keys for k in key_lists), "ranks saw different collectives"
        dist.all_reduce(vec)
        vec /= world  # mean per rank
        v = vec.tolist()
        results.append({"name": spec["name"], "measured": dict(zip(keys, v[0:n])),
                        "analytic": dict(zip(keys, v[n:2 * n])),
                        "calls": dict(zip(keys, v[2 * n:3 * n])),
                        "memory": dict(zip(("params", "grads", "optimizer"), v[3 * n:3 * n + 3])),
                        "memory_analytic": dict(zip(("params", "grads", "optimizer"), v[3 * n + 3:3 * n + 6])),
                        "step_s": v[3 * n + 6], "single": single, "baseline": spec.get("baseline"),
                        "fsdp": fsdp, "micro": micro, "shards": dims.dp * dims.cp // spec.get("dp_replicate", 1)})
        dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def launch(world: int, out: Path) -> list[dict]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-addr",
           "127.0.0.1", "--master-port", str(port), __file__, "--worker", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"torchrun on {world} ranks failed:\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, nargs="*", default=[2, 4], choices=[2, 4])
    args = ap.parse_args()
    if args.worker:
        import torch.distributed as dist  # noqa: F401  (the world size picks the layouts)

        worker(LAYOUTS[int(os.environ["WORLD_SIZE"])], args.out)
        return
    from tqdm import tqdm

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in tqdm(args.world, desc="torchrun launches"):
            rows += [(world, r) for r in launch(world, Path(tmp) / f"w{world}.json")]
    mb = 1 / 2**20
    print(f"\nCollective payload per rank per training step (B={B}, S={S}); baseline = analytic model "
          "(megatron_composer.parallel.cost); calls = collectives issued per rank")
    print(f"{'layout':34s} {'collective':20s} {'calls':>6s} {'measured MiB':>13s} {'analytic MiB':>13s} {'ratio':>7s}")
    worst = 0.0
    for world, r in rows:
        for op in r["measured"]:
            m, a = r["measured"][op], r["analytic"][op]
            if m == 0 and a == 0:
                continue
            ratio = m / a if a else float("inf")
            worst = max(worst, abs(ratio - 1))
            print(f"{r['name'] + f' ({world} ranks)':34s} {op:20s} {r['calls'][op]:6.0f} {m * mb:13.4f} {a * mb:13.4f} "
                  f"{ratio:7.4f}")
    print(f"largest |measured/analytic - 1| = {worst:.4f}")
    print("\nPer-rank memory (MiB); baseline = single process with the same model, measured in this run")
    print(f"{'layout':34s} {'params':>8s} {'grads':>8s} {'optim':>8s} {'optim/single':>13s} "
          f"{'p+g+o/single':>13s} {'analytic/measured':>18s}")
    for world, r in rows:
        m, s, a = r["memory"], r["single"], r["memory_analytic"]
        tot, stot, atot = sum(m.values()), sum(s.values()), sum(a.values())
        print(f"{r['name'] + f' ({world} ranks)':34s} {m['params'] * mb:8.3f} {m['grads'] * mb:8.3f} "
              f"{m['optimizer'] * mb:8.3f} {m['optimizer'] / s['optimizer']:13.3f} {tot / stot:13.3f} "
              f"{atot / tot:18.4f}")
    by_name = {(world, r["name"]): r for world, r in rows}
    print("\nFSDP against a replicated or ZeRO-1 layout of the same run (baseline: the named layout, measured here);\n"
          "p+g+o = per-rank parameter + gradient + optimizer bytes; shards = ranks one copy of a dense parameter is "
          "split over")
    print(f"{'layout':26s} {'baseline':20s} {'p+g+o MiB':>10s} {'base MiB':>9s} {'ratio':>7s} {'1/shards':>9s} "
          f"{'calls':>6s} {'base calls':>11s} {'MiB moved':>10s} {'base MiB':>9s} {'step s':>7s} {'base s':>7s} "
          f"{'time ratio':>11s}")
    for world, r, base in [(w, r, by_name[(w, b)]) for w, r in rows for b in (r["baseline"] or [])]:
        tot, btot = sum(r["memory"].values()), sum(base["memory"].values())
        shards = r["shards"]
        calls, bcalls = sum(r["calls"].values()), sum(base["calls"].values())
        moved, bmoved = sum(r["measured"].values()), sum(base["measured"].values())
        print(f"{r['name'] + f' ({world})':26s} {base['name']:20s} {tot * mb:10.3f} {btot * mb:9.3f} {tot / btot:7.3f} "
              f"{1 / shards:9.3f} {calls:6.0f} {bcalls:11.0f} {moved * mb:10.3f} {bmoved * mb:9.3f} "
              f"{r['step_s']:7.3f} {base['step_s']:7.3f} {r['step_s'] / base['step_s']:11.3f}")


if __name__ == "__main__":
    main()
