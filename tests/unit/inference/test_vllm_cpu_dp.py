"""The DP + EP pieces given to vLLM's CPU build (inference/vllm_cpu_dp.py), against their definitions on 2 gloo
ranks: the uneven all-gather is every rank's rows in rank order, the uneven reduce-scatter each rank's rows of the
sum; a token's choices of other ranks' experts get weight 0 and its own choices their local ids."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_composer.inference.vllm_cpu_dp import all_gatherv, local_choices, reduce_scatterv


def _rank(rank: int, world: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    comm = SimpleNamespace(world_size=world, device_group=dist.group.WORLD, rank_in_group=rank)
    rows = [2, 3]  # uneven, as DP ranks with different batch sizes
    mine = torch.arange(rows[rank] * 4, dtype=torch.float32).view(rows[rank], 4) + 100 * rank
    ids = torch.full((rows[rank], 2), rank, dtype=torch.int32)
    gathered = all_gatherv(comm, [mine, ids], dim=0, sizes=rows)
    inferred = all_gatherv(comm, mine, dim=0)  # sizes exchanged when not given
    full = torch.randn(sum(rows), 4, generator=torch.Generator().manual_seed(rank))
    reduced = reduce_scatterv(comm, full, dim=0, sizes=rows)
    torch.save({"gathered": gathered, "inferred": inferred, "full": full, "reduced": reduced}, f"{out}.{rank}")
    dist.destroy_process_group()


def test_uneven_gather_and_reduce_scatter_on_two_ranks(tmp_path):
    out = str(tmp_path / "r")
    mp.spawn(_rank, args=(2, f"file://{tmp_path}/init", out), nprocs=2)
    got = [torch.load(f"{out}.{r}") for r in range(2)]
    rows = [2, 3]
    want = torch.cat([torch.arange(n * 4, dtype=torch.float32).view(n, 4) + 100 * r for r, n in enumerate(rows)])
    total = got[0]["full"] + got[1]["full"]
    for r in range(2):
        assert torch.equal(got[r]["gathered"][0], want) and torch.equal(got[r]["inferred"], want)
        assert got[r]["gathered"][1].tolist() == [[0, 0]] * 2 + [[1, 1]] * 3
        start = sum(rows[:r])
        assert torch.allclose(got[r]["reduced"], total[start:start + rows[r]])


def test_choices_of_other_ranks_experts_weigh_nothing():
    expert_map = torch.tensor([-1, -1, 0, 1])  # this rank holds experts 2 and 3 of 4
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3]])
    ids = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    w, local = local_choices(weights, ids, expert_map)
    assert torch.equal(w, torch.tensor([[0.6, 0.0], [0.0, 0.3]])) and local.tolist() == [[0, 0], [0, 1]]
    assert local.dtype == torch.int32
