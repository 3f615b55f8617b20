"""torchrun worker: engines whose ranks load only their own slices (inference/loading.py), from each state-dict
source -- a Hugging Face directory (sharded safetensors), a training checkpoint (DCP), a weight-sync version
(a snapshot plus an XOR delta) -- against the one-rank engine of the full model.

Layout: ep = world size on 2 ranks, tp = 2 x ep = 2 on 4 (--layout). Per source and rank: every local tensor
equals its slices of the full tensors (parallel/slices.py's local_pieces); no read of the HF or weight-sync
source returns more than one local piece, and a weight-sync read of a routed expert tensor decodes only the
chunks of its own rows; the engine's greedy tokens, log-probs (within 1e-5) and routing equal the one-rank
engine's."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from common import init, run_cases  # noqa: E402
from inference_tp_worker import NEW_TOKENS, _compare, _prompts  # noqa: E402

from megatron_composer.checkpoint import hf as hf_checkpoint  # noqa: E402
from megatron_composer.checkpoint.dcp import save_checkpoint  # noqa: E402
from megatron_composer.inference import Engine  # noqa: E402
from megatron_composer.inference.loading import BoxWeights, CheckpointWeights, HFWeights, engine_model  # noqa: E402
from megatron_composer.model import Transformer, get_preset  # noqa: E402
from megatron_composer.parallel.dims import ParallelDims  # noqa: E402
from megatron_composer.parallel.slices import local_pieces, local_tensor  # noqa: E402
from rl.weight_sync import ObjectStore, WeightPublisher, WeightSubscriber  # noqa: E402

CHUNK_BYTES = 4096  # small compressed chunks, so a slice of a tensor is several of them


def _layout() -> ParallelDims:
    world = dist.get_world_size()
    return ParallelDims(world, tp=2, ep=2) if world == 4 else ParallelDims(world, ep=world)


def _reference(preset: str) -> Transformer:
    cfg = get_preset(preset).replace(num_layers=3)
    torch.manual_seed(0)
    return Transformer(cfg).eval()


def _slices_equal(par: torch.nn.Module, ref: torch.nn.Module) -> bool:
    full = ref.state_dict()
    ok = True
    for name, t in par.state_dict(keep_vars=True).items():
        local = local_tensor(t)
        for piece in local_pieces(t):
            ok &= torch.equal(local[piece.local], full[name][piece.full])
    return ok


class _Counting:
    """Wraps a box reader: the largest box it returned, in elements."""

    def __init__(self, read):
        self.inner, self.max_read = read, 0

    def __call__(self, name, box):
        t = self.inner(name, box)
        self.max_read = max(self.max_read, t.numel())
        return t


def _largest_piece(model: torch.nn.Module) -> int:
    return max(local_tensor(t)[p.local].numel() for t in model.state_dict(keep_vars=True).values()
               for p in local_pieces(t))


def load_case(preset: str, source: str):
    def run():
        groups = _layout().build()
        ref = _reference(preset)
        cfg = ref.config
        root = Path(ARGS.out) / f"{preset}_{source}"
        out = {}
        if source == "hf":
            if dist.get_rank() == 0:
                hf_checkpoint.save_hf_checkpoint(ref, root, max_shard_bytes=1 << 18, progress=False)
            dist.barrier()
            real_read = hf_checkpoint.HFReader.read
            counter = _Counting(None)

            def counted(self, name, box=()):
                counter.inner = lambda n, b: real_read(self, n, b)
                return counter(name, box)

            hf_checkpoint.HFReader.read = counted
            try:
                par = engine_model(cfg, HFWeights(root), groups)
            finally:
                hf_checkpoint.HFReader.read = real_read
            out["shards"] = len(list(root.glob("*.safetensors")))
            out["max_read_within_piece"] = counter.max_read <= _largest_piece(par)
        elif source == "dcp":
            ckpt = save_checkpoint(root, 1, ref, None, {}, {"model": {}})
            par = engine_model(cfg, CheckpointWeights(ckpt), groups)
        else:  # weight sync: version 1 a snapshot of other weights, version 2 (the reference's) a delta on it
            store = ObjectStore(str(root))
            if dist.get_rank() == 0:
                pub = WeightPublisher(store, snapshot_interval=10, chunk_bytes=CHUNK_BYTES)
                torch.manual_seed(1)
                pub.publish(Transformer(cfg).state_dict(), 1)
                pub.publish(ref.state_dict(), 2)
            dist.barrier()
            reader = WeightSubscriber(store).reader()
            out["version"] = reader.version
            out["parts"] = [part for _, part, _ in reader.parts]
            counter = _Counting(reader.read)
            expert_excess = []

            def read(name, box):
                before = reader.elements_decoded
                t = counter(name, box)
                if ".experts.w" in name:  # rows of this rank's experts: only their chunks (x2: snapshot + delta)
                    expert_excess.append((reader.elements_decoded - before) / 2 - t.numel())
                return t

            par = engine_model(cfg, BoxWeights(read), groups)
            out["max_read_within_piece"] = counter.max_read <= _largest_piece(par)
            # each edge of the span may reach into one partly used chunk
            out["expert_reads_own_chunks"] = max(expert_excess) <= 2 * CHUNK_BYTES // 4
        out["slices_equal"] = _slices_equal(par, ref)
        out["local_experts"] = par.moe_layers[0].feed_forward.experts.num_local_experts
        prompts = _prompts(cfg.vocab_size)
        one = Engine(ref).generate(prompts, max_new_tokens=NEW_TOKENS)
        out.update(_compare(one, Engine(par).generate(prompts, max_new_tokens=NEW_TOKENS)))
        return out
    return run


MLA, GQA = "tiny-deepseek-v3", "tiny-qwen3-moe"
CASES = {f"{p}_{s}": load_case(m, s) for p, m in (("mla", MLA), ("gqa", GQA)) for s in ("hf", "dcp", "weight_sync")}

if __name__ == "__main__":
    ARGS = init()
    run_cases(ARGS, CASES)
