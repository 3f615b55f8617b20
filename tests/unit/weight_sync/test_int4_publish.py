"""Routed experts published in the form an INT4 engine serves them (WeightPublisher experts="int4"): every version's
packed words and group scales are, tensor for tensor, what the INT4 export writes for that version; deltas are
taken of those bytes; the rest is published in the engine's dtype."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from megatron_composer.checkpoint import int4
from megatron_composer.checkpoint.hf import save_hf_checkpoint
from megatron_composer.model import Transformer, get_preset
from megatron_composer.parallel.slices import Piece
from rl.weight_sync import ObjectStore, WeightPublisher, WeightSubscriber
from rl.weight_sync.codec import WeightSyncError


def _adamw_steps(model, opt, g, steps=1):
    for _ in range(steps):
        tokens = torch.randint(0, model.config.vocab_size, (2, 16), generator=g)
        out = model(tokens)
        logits = out.logits if hasattr(out, "logits") else out
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_int4_experts_published_equal_the_export_over_5_versions(tmp_path):
    torch.manual_seed(0)
    cfg = get_preset("tiny-qwen3-moe").replace(num_layers=2)
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    store = ObjectStore(str(tmp_path / "weights"))
    pub = WeightPublisher(store, snapshot_interval=3, dtype=torch.bfloat16, experts="int4", chunk_bytes=1 << 16)
    sub = WeightSubscriber(store)
    g = torch.Generator().manual_seed(1)
    deltas = 0
    for version in range(6):
        if version:
            _adamw_steps(model, opt, g)
        stats = pub.publish(model, version)
        deltas += stats.delta_bytes > 0
        got = sub.fetch()
        save_hf_checkpoint(model, tmp_path / f"export{version}", dtype=torch.bfloat16, quantize="int4-experts",
                           progress=False)
        exported = load_file(str(tmp_path / f"export{version}" / "model.safetensors"))
        experts = [n for n in model.state_dict() if int4.is_routed_expert(n)]
        assert experts and not any(n in got for n in experts)
        for name in experts:
            layer, w = name.split(".")[1], name.rsplit(".", 1)[1]
            proj = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}[w]
            for suffix in int4.SERVED_PARTS:
                part = got[name + suffix]
                assert part.dtype == int4.PART_DTYPES[suffix]
                for e in range(cfg.num_experts):
                    want = exported[f"model.layers.{layer}.mlp.experts.{e}.{proj}{suffix}"]
                    assert torch.equal(part[e], want), (version, name, suffix, e)
        for name, t in model.state_dict().items():
            if not int4.is_routed_expert(name):
                assert torch.equal(got[name], t.to(torch.bfloat16)), name
    assert deltas == 5  # every version after the first arrived as an XOR delta of the served bytes


def test_int4_parts_of_a_box_equal_the_whole_tensors():
    """A trainer rank quantises only its piece: any box of experts x rows x group-aligned columns gives the same
    words and scales as that box of the whole tensor's."""
    torch.manual_seed(0)
    w = torch.randn(4, 24, 128)
    whole = int4.served_parts(w)
    box = int4.served_parts(w[1:3, 5:20, 32:96])
    assert torch.equal(box[".weight_packed"], whole[".weight_packed"][1:3, 5:20, 4:12])
    assert torch.equal(box[".weight_scale"], whole[".weight_scale"][1:3, 5:20, 1:3])


def test_a_piece_cut_inside_an_int4_group_is_refused(tmp_path):
    w = torch.randn(4, 8, 64)
    pieces = [Piece(local=(slice(0, 4), slice(0, 8), slice(0, 48)), full=(slice(0, 4), slice(0, 8), slice(0, 48)))]
    with pytest.raises(WeightSyncError, match="not on INT4 groups of 32"):
        WeightPublisher._add_int4({}, {}, "layers.0.feed_forward.experts.w2", w, pieces, [4, 8, 96])
    with pytest.raises(WeightSyncError, match="experts='int8'"):
        WeightPublisher(ObjectStore(str(tmp_path / "weights")), experts="int8")


def test_a_staged_delta_keeps_only_the_changed_elements(tmp_path):
    """sparse_deltas: a delta update of an engine's boxes holds the positions and XOR bits of the elements that
    changed (where that is smaller than the box), and XORed onto the held version gives the new one exactly."""
    from megatron_composer.kernels.xor_apply import SparseXor, xor_apply_

    g = torch.Generator().manual_seed(0)
    v0 = {"a": torch.randn(64, 96, generator=g).to(torch.bfloat16), "b": torch.randn(16, 32, generator=g)}
    v1 = {k: t.clone() for k, t in v0.items()}
    few = torch.rand(64, 96, generator=g) < 0.02
    v1["a"][few] += 1
    v1["b"] += 1  # every element: kept dense
    store = ObjectStore(str(tmp_path / "weights"))
    pub = WeightPublisher(store, snapshot_interval=10)
    wants = {"a": (torch.bfloat16, [((0, 32), (0, 96)), ((32, 64), (0, 96))]),
             "b": (torch.float32, [((0, 16), (0, 32))])}
    sub = WeightSubscriber(store, wants, sparse_deltas=True)
    pub.publish(v0, 0)
    first = sub.prepare(0)
    held = {(n, box): first.read(n, tuple(slice(*r) for r in box)).clone() for n, (_, boxes) in wants.items()
            for box in boxes}
    first.commit()
    pub.publish(v1, 1)
    update = sub.prepare(1)
    assert update.delta
    for (name, box), base in held.items():
        delta = update.read(name, tuple(slice(*r) for r in box))
        assert isinstance(delta, SparseXor) == (name == "a")
        xor_apply_(base, delta)
        assert torch.equal(base, v1[name][tuple(slice(*r) for r in box)])
    changed = int(few.sum())
    assert update.staged_bytes == changed * (4 + 2) + 16 * 32 * 4
    with pytest.raises(WeightSyncError, match="sparse_deltas"):
        WeightSubscriber(store, sparse_deltas=True)
