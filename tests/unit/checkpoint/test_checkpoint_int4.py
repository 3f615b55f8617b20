"""Kimi K2.5's INT4 experts (compressed-tensors pack-quantized W4A16) in and out, against the peers: checkpoints
made by the compressed-tensors package itself are imported (only the boxes read, dequantised on the box) to
transformers' logits; our INT4 export re-imports exactly, re-exports the same bytes and loads in transformers;
schemes we do not read fail in one line naming them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
ct = pytest.importorskip("compressed_tensors")

from int4_assets import deepseek_model, scheme, transformers_float32, write_int4_checkpoint  # noqa: E402

from megatron_composer.checkpoint import int4  # noqa: E402
from megatron_composer.checkpoint.hf import CheckpointError, HFReader, load_hf_checkpoint, save_hf_checkpoint  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
TOL = 1e-5


def _logits(model, vocab=97, seed=0):
    ids = torch.randint(0, vocab, (3, 30), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        out = model(ids)
    return getattr(out, "logits", out)


def test_packing_is_compressed_tensors_packing():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    q = torch.randint(-8, 8, (5, 96), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    packed = int4.pack(q)
    assert torch.equal(packed, pack_to_int32(q, 4)) and torch.equal(int4.unpack(packed), q)
    assert torch.equal(unpack_from_int32(packed, 4, torch.Size([5, 96])), q)


def test_quantisation_is_idempotent_and_any_box_dequantises_exactly():
    w = torch.randn(6, 128, generator=torch.Generator().manual_seed(1)) * 0.05
    w[0, :32] = 0.0  # an all-zero group
    q, scale = int4.quantize(w)
    on_grid = int4.fake_quantize(w)
    assert int(q.min()) >= -8 and int(q.max()) <= 7 and (on_grid - w).abs().max() <= scale.float().max() / 2
    q2, scale2 = int4.quantize(on_grid)  # a model on the grid quantises to itself
    assert torch.equal(q2, q) and torch.equal(scale2, scale) and torch.equal(int4.fake_quantize(on_grid), on_grid)
    packed = int4.pack(q)
    for c0, c1 in ((0, 128), (13, 20), (31, 33), (64, 127), (5, 5)):
        words = packed[:, c0 // 8: -(-c1 // 8)]
        groups = scale[:, c0 // 32: -(-c1 // 32)]
        assert torch.equal(int4.dequantize_box(words, groups, range(c0, c1)), on_grid[:, c0:c1])


@pytest.mark.parametrize("kimi_layout", [False, True], ids=["deepseek-layout", "kimi-k25-layout"])
def test_a_compressed_tensors_int4_checkpoint_imports_to_transformers_logits(tmp_path, kimi_layout):
    """The experts' scales are powers of two here, so that transformers (which dequantises into the scales'
    bf16) and our float32 import hold the same values; the Kimi K2.5 layout (language_model., a vision tower,
    text_config) imports to the same model as the plain one."""
    plain = write_int4_checkpoint(tmp_path / "plain")
    ours = load_hf_checkpoint(plain, dtype=torch.float32, progress=False).eval()
    err = (_logits(ours) - _logits(transformers_float32(plain)).float()).abs().max().item()
    assert err <= TOL, err
    if kimi_layout:
        kimi = write_int4_checkpoint(tmp_path / "kimi", kimi_layout=True)
        reader = HFReader(kimi)
        assert reader.int4 is not None and any(t == "INT4" for t in reader.dtypes.values())
        assert torch.equal(_logits(load_hf_checkpoint(kimi, dtype=torch.float32, progress=False).eval()),
                           _logits(ours))


def test_min_max_scales_dequantise_as_compressed_tensors_does(tmp_path):
    """With compressed-tensors' own min/max scales: every expert weight we import equals its decompression (after
    the bf16 rounding it applies), and every box of it equals the same box of the whole."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from safetensors.torch import load_file

    path = write_int4_checkpoint(tmp_path / "minmax", pow2_scales=False)
    reader = HFReader(path)
    stored = {}
    for f in path.glob("*.safetensors"):
        stored.update(load_file(f))
    sch = scheme()
    name = "layers.1.feed_forward.experts.w2"
    full = reader.read(name)
    for e in range(full.shape[0]):
        base = f"model.layers.1.mlp.experts.{e}.down_proj."
        packed = {k: stored[base + k] for k in ("weight_packed", "weight_scale", "weight_shape")}
        theirs = PackedQuantizationCompressor.decompress(packed, sch)
        assert torch.equal(full[e].to(theirs["weight"].dtype), theirs["weight"])
    assert torch.equal(reader.read(name, (slice(2, 5), slice(3, 40), slice(17, 50))), full[2:5, 3:40, 17:50])


def test_an_imported_int4_model_stays_on_its_grid_and_re_exports_the_released_bytes(tmp_path):
    """compressed-tensors' min/max scales are not ours, yet every group of the imported experts is kept on its own
    grid: INT4 QAT starts from exactly the released model, and the export writes compressed-tensors' packed words,
    scales and shapes byte for byte."""
    from safetensors.torch import load_file

    path = write_int4_checkpoint(tmp_path / "released", pow2_scales=False)
    model = load_hf_checkpoint(path, dtype=torch.float32, progress=False)
    for name, p in model.named_parameters():
        if ".experts.w" in name:
            assert torch.equal(int4.fake_quantize(p.detach()), p), name
    save_hf_checkpoint(model, tmp_path / "again", quantize="int4-experts", progress=False)
    released, again = {}, {}
    for f in path.glob("*.safetensors"):
        released.update(load_file(f))
    again.update(load_file(tmp_path / "again" / "model.safetensors"))
    packed = [k for k in released if k.endswith(int4.SUFFIXES)]
    assert len(packed) == 3 * 3 * 8 * 2 and all(torch.equal(released[k], again[k]) for k in packed)


@pytest.mark.parametrize("change, named", [
    (lambda q: q["config_groups"]["group_0"]["weights"].update(symmetric=False), "asymmetric"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=128), "group 128"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=8), "8-bit int"),
    (lambda q: q.update(format="float-quantized"), "format 'float-quantized'"),
    (lambda q: q.update(quant_method="awq"), "quantization 'awq'"),
])
def test_a_scheme_we_do_not_read_fails_in_one_line_naming_it(tmp_path, change, named):
    path = write_int4_checkpoint(tmp_path / "ckpt")
    hf = json.loads((path / "config.json").read_text())
    change(hf["quantization_config"])
    (path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match=named) as e:
        HFReader(path)
    assert "\n" not in str(e.value) and "supported: compressed-tensors pack-quantized INT4" in str(e.value)


def test_int4_export_round_trips_bit_exactly_and_transformers_reads_it(tmp_path):
    """Our export of a model (float32): the experts come back as their INT4 grid values exactly, a re-export of
    the re-imported model writes the same bytes, the rest of the model is untouched, and transformers with
    compressed-tensors computes the re-imported model's logits."""
    model = load_hf_checkpoint(_bf16_checkpoint(tmp_path), dtype=torch.float32, progress=False).eval()
    out = tmp_path / "int4"
    save_hf_checkpoint(model, out, quantize="int4-experts", progress=False)
    hf = json.loads((out / "config.json").read_text())
    assert hf["quantization_config"]["format"] == "pack-quantized"
    back = load_hf_checkpoint(out, dtype=torch.float32, progress=False).eval()
    for name, t in model.state_dict().items():
        want = int4.fake_quantize(t) if ".experts.w" in name else t
        assert torch.equal(back.state_dict()[name], want), name
    again = tmp_path / "again"
    save_hf_checkpoint(back, again, quantize="int4-experts", progress=False)
    assert (out / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()
    assert (out / "config.json").read_text() == (again / "config.json").read_text()
    peer = transformers_float32(out)
    with torch.no_grad():  # transformers holds the dequantised experts in bf16: compare on the same values
        for name, p in back.named_parameters():
            if ".experts.w" in name:
                p.copy_(p.bfloat16().float())
    err = (_logits(back) - _logits(peer).float()).abs().max().item()
    assert err <= TOL, err
    with pytest.raises(CheckpointError, match="quantize='int8' is not an export format"):
        save_hf_checkpoint(model, tmp_path / "bad", quantize="int8", progress=False)


def test_convert_hf_check_reads_an_int4_checkpoint(tmp_path):
    path = write_int4_checkpoint(tmp_path / "ckpt", kimi_layout=False)
    res = subprocess.run([sys.executable, "tools/convert_hf.py", str(path), "--check"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:] + res.stdout[-2000:]


def _bf16_checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "bf16"
    deepseek_model(seed=3).save_pretrained(path)
    return path


def test_convert_hf_rewrites_int4_to_bf16_and_back_without_building_the_model(tmp_path):
    """HF -> HF tensor by tensor: the INT4 checkpoint dequantised to bf16 holds the grid values (exact in bf16
    with power-of-two scales), and quantising that again gives back the INT4 checkpoint's own tensors."""
    from safetensors.torch import load_file

    src = write_int4_checkpoint(tmp_path / "src")
    for args in ([str(src), "--out", str(tmp_path / "bf16"), "--dtype", "bfloat16"],
                 [str(tmp_path / "bf16"), "--out", str(tmp_path / "int4"), "--quantize", "int4-experts"]):
        res = subprocess.run([sys.executable, "tools/convert_hf.py", *args], cwd=REPO, capture_output=True,
                             text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
    reader, again = HFReader(src), HFReader(tmp_path / "int4")
    assert "quantization_config" in json.loads((tmp_path / "int4" / "config.json").read_text())
    for name in reader.sources:
        if ".experts.w" in name:
            assert torch.equal(again.read(name), reader.read(name)), name
    stored = load_file(next((tmp_path / "bf16").glob("*.safetensors")))
    assert not any(k.endswith("weight_packed") for k in stored)
