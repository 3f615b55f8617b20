"""Sliced Hugging Face import (HFReader, load_hf_shards) and streaming export, in one process.

The multi-rank loads (tp x ep, fsdp x ep against a one-process load and transformers) are in
test_checkpoint_hf_dist.py.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_composer.checkpoint import hf as hf_mod
from megatron_composer.checkpoint.hf import (
    CheckpointError,
    HFReader,
    hub_entries,
    load_hf_checkpoint,
    load_hf_shards,
    quantize_fp8_blockwise,
    save_hf_checkpoint,
)
from megatron_composer.model import Transformer, get_preset


def _model(**kw):
    # dims over one 128-block, so boxes cross FP8 block edges and edge blocks are partial
    cfg = get_preset("tiny-deepseek-v3").replace(vocab_size=300, hidden_size=200, num_layers=2,
                                                 moe_intermediate_size=136, intermediate_size=264, **kw)
    torch.manual_seed(0)
    return Transformer(cfg)


def _dequant(q, s):
    return q.float() * s.repeat_interleave(128, 0)[: q.shape[0]].repeat_interleave(128, 1)[:, : q.shape[1]]


def _fp8_export(model, path):
    """Our float32 export with every 2-D projection in DeepSeek's FP8 format; returns the dequantised hub
    tensors (what the FP8 checkpoint stands for)."""
    save_hf_checkpoint(model, path, max_shard_bytes=300_000, progress=False)
    stands_for = {}
    for file in sorted(path.glob("*.safetensors")):
        state = load_file(file)
        out = {}
        for k, t in state.items():
            if t.dim() == 2 and k.endswith("proj.weight"):
                q, s = quantize_fp8_blockwise(t)
                out[k], out[k[: -len("weight")] + "weight_scale_inv"] = q, s
                stands_for[k] = _dequant(q, s)
            else:
                out[k] = stands_for[k] = t
        save_file(out, str(file), metadata={"format": "pt"})
    index = path / "model.safetensors.index.json"
    meta = json.loads(index.read_text())
    for k in list(meta["weight_map"]):
        if k in stands_for and k.endswith("proj.weight"):
            meta["weight_map"][k[: -len("weight")] + "weight_scale_inv"] = meta["weight_map"][k]
    index.write_text(json.dumps(meta))
    return stands_for


def _expected(model, hub_tensors):
    """Our full tensors assembled from hub tensors through the export's mapping (hub_entries)."""
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers())
    out = {n: t.detach().clone() for n, t in named.items()}
    for e in hub_entries(model.config, {n: tuple(t.shape) for n, t in named.items()}):
        if e.ours is None:
            continue
        if e.expert is None:
            out[e.ours] = hub_tensors[e.hub].float()
        else:
            out[e.ours][e.expert] = hub_tensors[e.hub].float()
    return out


def _random_box(shape, g):
    box = []
    for n in shape:
        a = int(torch.randint(0, n, (1,), generator=g))
        b = int(torch.randint(a + 1, n + 1, (1,), generator=g))
        box.append(slice(a, b))
    return tuple(box)


class _CountingOpen:
    """safe_open that records every slice read: (key, elements)."""

    def __init__(self, real):
        self.real, self.reads = real, []

    def __call__(self, *a, **kw):
        counter = self

        class File:
            def __init__(self):
                self.f = counter.real(*a, **kw)

            def __enter__(self):
                self.inner = self.f.__enter__()
                return self

            def __exit__(self, *exc):
                return self.f.__exit__(*exc)

            def keys(self):
                return self.inner.keys()

            def get_slice(self, key):
                sl = self.inner.get_slice(key)

                class Slice:
                    get_shape, get_dtype = sl.get_shape, sl.get_dtype

                    def __getitem__(self, box):
                        t = sl[box]
                        counter.reads.append((key, t.numel()))
                        return t
                return Slice()

            def get_tensor(self, key):
                t = self.inner.get_tensor(key)
                counter.reads.append((key, t.numel()))
                return t
        return File()


def test_reader_boxes_equal_the_tensors_fp8_blocks_unaligned(tmp_path):
    model = _model()
    stands_for = _fp8_export(model, tmp_path / "hf")
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 2
    reader = HFReader(tmp_path / "hf")
    expected = _expected(model, stands_for)
    assert any(reader.dtypes[k] == "F8_E4M3" for k in reader.shapes)
    g = torch.Generator().manual_seed(0)
    for name in reader.sources:
        full = expected[name]
        assert torch.equal(reader.read(name).float(), full), name
        for _ in range(3):
            box = _random_box(full.shape, g)
            assert torch.equal(reader.read(name, box).float(), full[box]), (name, box)
    # and the FP8 checkpoint did change the weights (a no-op dequantisation would be noticed)
    w = "layers.1.attention.wo.weight"
    assert not torch.equal(expected[w], model.get_parameter(w).detach())


def test_reader_reads_only_the_box(tmp_path, monkeypatch):
    model = _model()
    _fp8_export(model, tmp_path / "hf")
    reader = HFReader(tmp_path / "hf")
    counting = _CountingOpen(hf_mod.safe_open)
    monkeypatch.setattr(hf_mod, "safe_open", counting)
    box = (slice(2, 4), slice(5, 70), slice(130, 190))  # experts 2..3, cols inside the second 128-block
    got = reader.read("layers.1.feed_forward.experts.w1", box)
    assert got.shape == (2, 65, 60)
    keys = [k for k, _ in counting.reads]
    assert sorted(set(keys)) == [f"model.layers.1.mlp.experts.{e}.gate_proj.{w}" for e in (2, 3)
                                 for w in ("weight", "weight_scale_inv")]
    assert sum(n for k, n in counting.reads if k.endswith(".weight")) == 2 * 65 * 60
    assert all(n == 1 for k, n in counting.reads if k.endswith("scale_inv"))  # one block row, one block col
    counting.reads.clear()
    reader.read("tok_embeddings.weight", (slice(10, 20),))
    assert counting.reads == [("model.embed_tokens.weight", 10 * 200)]


def test_fused_gate_up_experts(tmp_path):
    """transformers' fused expert layout ([E, 2F, D] gate_up_proj, [E, D, F] down_proj) reads as w1/w3/w2."""
    model = _model(num_mtp_layers=0)
    save_hf_checkpoint(model, tmp_path / "hf", progress=False)
    state = load_file(tmp_path / "hf" / "model.safetensors")
    E = model.config.num_experts
    for i in (1,):
        p = f"model.layers.{i}.mlp.experts"
        gate = torch.stack([state.pop(f"{p}.{e}.gate_proj.weight") for e in range(E)])
        up = torch.stack([state.pop(f"{p}.{e}.up_proj.weight") for e in range(E)])
        state[f"{p}.down_proj"] = torch.stack([state.pop(f"{p}.{e}.down_proj.weight") for e in range(E)])
        state[f"{p}.gate_up_proj"] = torch.cat([gate, up], dim=1)
    save_file(state, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    reader = HFReader(tmp_path / "hf")
    g = torch.Generator().manual_seed(1)
    for w in ("w1", "w2", "w3"):
        name = f"layers.1.feed_forward.experts.{w}"
        full = model.get_parameter(name).detach()
        assert torch.equal(reader.read(name), full)
        box = _random_box(full.shape, g)
        assert torch.equal(reader.read(name, box), full[box])
    back = load_hf_checkpoint(tmp_path / "hf", progress=False)
    for name, t in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], t), name


def _break(path, fn):
    file = path / "model.safetensors"
    state = load_file(file)
    fn(state)
    save_file(state, str(file), metadata={"format": "pt"})


@pytest.mark.parametrize("case", ["missing", "shape", "unexpected", "expert", "fp8_scale"])
def test_bad_checkpoint_one_line_before_any_weight_is_read(tmp_path, monkeypatch, case):
    model = _model()
    save_hf_checkpoint(model, tmp_path / "hf", progress=False)
    target = model
    if case == "missing":
        _break(tmp_path / "hf", lambda s: s.pop("model.layers.0.self_attn.o_proj.weight"))
        match = r"no tensor for 'layers.0.attention.wo.weight'.*model.overrides"
    elif case == "shape":
        with torch.device("meta"):
            target = Transformer(model.config.replace(moe_intermediate_size=128))
        match = (r"model.safetensors: tensor 'model.layers.1.mlp.experts.0.down_proj.weight' has shape \[200, 136\], "
                 r"the model expects \[200, 128\].*model.preset / model.overrides")
    elif case == "unexpected":
        _break(tmp_path / "hf", lambda s: s.__setitem__("model.layers.1.mlp.bogus.weight", torch.zeros(2)))
        match = r"tensor 'model.layers.1.mlp.bogus.weight' has no place"
    elif case == "expert":
        _break(tmp_path / "hf", lambda s: s.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
        match = r"lacks experts \[3\] of 'layers.1.feed_forward.experts.w3'"
    else:
        def fp8_without_scale(s):
            name = "model.layers.0.self_attn.o_proj.weight"
            s[name] = s[name].to(torch.float8_e4m3fn)
        _break(tmp_path / "hf", fp8_without_scale)
        match = r"o_proj.weight' is FP8 \(F8_E4M3\) but not a 2-D weight with .*weight_scale_inv"
    counting = _CountingOpen(hf_mod.safe_open)
    monkeypatch.setattr(hf_mod, "safe_open", counting)
    with pytest.raises(CheckpointError, match=match) as err:
        load_hf_shards(target, tmp_path / "hf", progress=False)
    assert "\n" not in str(err.value)
    assert counting.reads == []  # headers only


def test_training_start_from_hf_keeps_fresh_mtp_and_checks_architecture(tmp_path):
    from megatron_composer.fp8 import FP8Config
    from megatron_composer.parallel.dims import ParallelConfig
    from megatron_composer.training.core import InitialWeights, build_model
    from megatron_composer.training.layout import Layout

    source = _model(num_mtp_layers=0)
    save_hf_checkpoint(source, tmp_path / "hf", progress=False, max_shard_bytes=400_000)
    mc = source.config.replace(num_mtp_layers=1)
    layout = Layout(ParallelConfig(), distributed=False)
    model = build_model(mc, layout, torch.device("cpu"), FP8Config(), seed=5,
                        init=InitialWeights(hf=str(tmp_path / "hf")))
    torch.manual_seed(5)
    fresh = Transformer(mc)
    for name, t in model.state_dict().items():
        want = fresh.state_dict()[name] if name.startswith("mtp.") else source.state_dict()[name]
        assert torch.equal(t, want), name
    with pytest.raises(CheckpointError, match=r"does not match the configured model \(hidden_size"):
        build_model(mc.replace(hidden_size=256), layout, torch.device("cpu"), FP8Config(), seed=5,
                    init=InitialWeights(hf=str(tmp_path / "hf")))


def test_export_writes_each_file_once_within_the_shard_size(tmp_path, monkeypatch):
    model = _model()
    written = []
    real = hf_mod.save_file

    def recording(tensors, file, metadata=None):
        written.append((file.rsplit("/", 1)[1], sum(t.numel() * t.element_size() for t in tensors.values())))
        real(tensors, file, metadata=metadata)
    monkeypatch.setattr(hf_mod, "save_file", recording)
    save_hf_checkpoint(model, tmp_path / "hf", max_shard_bytes=500_000, progress=False)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert [f for f, _ in written] == files and len(files) > 3
    assert all(n <= 500_000 for _, n in written)
    assert index["metadata"]["total_size"] == sum(n for _, n in written)
    back = load_hf_checkpoint(tmp_path / "hf", progress=False)
    for name, t in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], t), name


def test_convert_tool_streams_hf_to_hf(tmp_path, monkeypatch):
    """tools/convert_hf.py HF_DIR --out: an FP8 checkpoint rewritten tensor by tensor (no model allocated)
    holds the dequantised weights, over several shard files; an existing output is a one-line error."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("convert_hf", Path(__file__).parents[3] / "tools" / "convert_hf.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    model = _model()
    stands_for = _fp8_export(model, tmp_path / "fp8")
    built = []
    monkeypatch.setattr(hf_mod.Transformer, "__init__", _recording_init(hf_mod.Transformer.__init__, built))
    assert tool.main([str(tmp_path / "fp8"), "--out", str(tmp_path / "bf16"), "--dtype", "float32",
                      "--shard-gb", "0.0003"]) == 0
    assert built == ["meta"]  # only the meta model the shapes are checked against
    monkeypatch.undo()
    got = load_hf_checkpoint(tmp_path / "bf16", progress=False)
    want = _expected(model, stands_for)
    for name, t in got.state_dict().items():
        assert torch.equal(t, want[name]), name
    assert len(list((tmp_path / "bf16").glob("*.safetensors"))) > 2
    assert tool.main([str(tmp_path / "fp8"), "--out", str(tmp_path / "bf16")]) == 2  # exists: one-line error


def _recording_init(init, built):
    def record(self, cfg):
        built.append(torch.empty(0).device.type)
        init(self, cfg)
    return record
