"""parallel/slices.py: for every rank of a layout (ShardSpec cut, then FSDP Shard placements with torch.chunk
semantics), the pieces tile the full tensor exactly once across ranks, and filling a local tensor from its
pieces reproduces ShardSpec.take followed by FSDP's chunking. fill_local on a model whose parameters carry
ShardSpecs reproduces ShardSpec.take. No processes needed: each rank's spec and mesh coordinate is built here."""

import itertools

import pytest
import torch
import torch.nn as nn

from megatron_composer.parallel.layers import ShardSpec, set_spec
from megatron_composer.parallel.slices import assemble, fill_local, local_pieces, pieces_for


def fsdp_local(t: torch.Tensor, shards) -> torch.Tensor:
    for d, n, k in shards:
        chunks = t.chunk(n, dim=d)
        t = chunks[k] if k < len(chunks) else t.narrow(d, 0, 0)
    return t


# (full shape, spec kind, spec dim, blocks, spec size, FSDP shards as (dim, size) outermost first)
LAYOUTS = [
    ((12, 5), "replicated", 0, 1, 1, [(0, 4)]),
    ((10, 3), "replicated", 0, 1, 1, [(0, 4)]),             # uneven: 3, 3, 3, 1
    ((5, 3), "replicated", 0, 1, 1, [(0, 4)]),              # 2, 2, 1, 0: an empty tail shard
    ((7,), "tp_partial", 0, 1, 2, [(0, 3)]),
    ((16, 6), "tp_sharded", 0, 1, 2, [(0, 2)]),             # column parallel
    ((16, 6), "tp_sharded", 0, 2, 2, [(0, 3)]),             # fused gate/up, FSDP chunk crossing the block edge
    ((8, 12), "tp_sharded", 1, 1, 2, [(0, 3)]),             # row parallel: spec on dim 1, FSDP on dim 0
    ((24, 4), "tp_sharded", 0, 3, 2, [(0, 5)]),
    ((8, 6, 4), "expert", 0, 1, 2, [(0, 2)]),               # 4 local experts over 2 shards
    ((4, 6, 4), "expert", 0, 1, 2, [(1, 4)]),               # shards outnumber local experts: dim 1
    ((8, 6, 4), "expert", 0, 1, 4, []),                     # expert parallel alone
    ((16, 6), "tp_sharded", 0, 2, 2, [(0, 2), (0, 2)]),     # nested cut of one dim
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=[str(i) for i in range(len(LAYOUTS))])
def test_pieces_tile_and_match_take(layout):
    shape, kind, dim, blocks, size, shard_dims = layout
    full = torch.randn(shape)
    cover = torch.zeros(shape, dtype=torch.int64)
    for r in range(size):
        spec = ShardSpec(kind, dim=dim, blocks=blocks, rank=r, size=size)
        for coords in itertools.product(*[range(n) for _, n in shard_dims]):
            shards = [(d, n, k) for (d, n), k in zip(shard_dims, coords)]
            expected = fsdp_local(spec.take(full), shards)
            pieces = pieces_for(shape, spec, shards)
            local = torch.full_like(expected, float("nan"))
            for pc in pieces:
                local[pc.local] = full[pc.full]
                cover[pc.full] += 1
            assert torch.equal(local, expected), (r, shards)
            assert sum(torch.zeros(shape)[pc.full].numel() for pc in pieces) == expected.numel()
    replicas = size if kind in ("replicated", "tp_partial") else 1
    assert torch.equal(cover, torch.full(shape, replicas)), "pieces do not tile the full tensor exactly once"


def test_assemble_rejects_gaps():
    spec = ShardSpec("tp_sharded", dim=0, rank=0, size=2)
    pieces = pieces_for((4, 2), spec)
    with pytest.raises(ValueError, match="cover"):
        assemble((4, 2), spec, [(pieces, torch.zeros(2, 2))])


def test_fill_local_reproduces_take():
    fulls = {"a": torch.randn(16, 6), "b": torch.randn(8, 12), "c": torch.randn(8, 3, 2), "d": torch.randn(5)}
    specs = {"a": ShardSpec("tp_sharded", dim=0, blocks=2, rank=1, size=2),
             "b": ShardSpec("tp_sharded", dim=1, rank=0, size=2),
             "c": ShardSpec("expert", dim=0, rank=3, size=4), "d": ShardSpec("replicated")}
    m = nn.Module()
    for k, spec in specs.items():
        p = nn.Parameter(torch.zeros_like(spec.take(fulls[k])))
        set_spec(p, spec)
        m.register_parameter(k, p)
    m.register_buffer("buf", torch.zeros(3))
    m.register_buffer("scratch", torch.zeros(2), persistent=False)
    fulls["buf"] = torch.arange(3.0)
    reads = []

    def read(name, box):
        reads.append(name)
        return fulls[name][box]

    fill_local(m, read)
    for k, spec in specs.items():
        assert torch.equal(getattr(m, k), spec.take(fulls[k])), k
        assert sum(pc.full[spec.dim].stop - pc.full[spec.dim].start for pc in local_pieces(getattr(m, k))) \
            == getattr(m, k).shape[spec.dim]
    assert torch.equal(m.buf, fulls["buf"]) and "scratch" not in reads
