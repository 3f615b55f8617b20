"""training.core.build_model on one process: the meta-device build with the layout-independent initialisation
equals torch.manual_seed(seed); Transformer(mc), any box of a tensor drawn alone equals that box of the whole
draw (across row-block edges), and a Hugging Face start fills the model from the checkpoint (a fresh MTP depth
keeps its seeded initialisation; a checkpoint of another architecture is a one-line error)."""

import pytest
import torch

from megatron_composer.checkpoint.dcp import CheckpointError
from megatron_composer.checkpoint.hf import save_hf_checkpoint
from megatron_composer.fp8 import FP8Config
from megatron_composer.model import Transformer, get_preset
from megatron_composer.model.init import InitRule, init_box, rows_per_block
from megatron_composer.parallel.dims import ParallelConfig
from megatron_composer.training.core import InitialWeights, build_model
from megatron_composer.training.layout import Layout


def _build(mc, seed=5, init=None):
    return build_model(mc, Layout(ParallelConfig(), distributed=False), torch.device("cpu"), FP8Config(), seed=seed,
                       init=init)


def _tiny(**kw):
    return get_preset("tiny-deepseek-v3").replace(num_layers=2, vocab_size=256, **kw)


def test_meta_build_equals_one_process_init():
    mc = _tiny()
    torch.manual_seed(5)
    ref = Transformer(mc)
    got = _build(mc, seed=5)
    a, b = ref.state_dict(), got.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(ref.rope.inv_freq, got.rope.inv_freq)
    assert not torch.equal(a["output.weight"], _build(mc, seed=6).state_dict()["output.weight"])
    ones = [k for k in a if k.endswith("norm.weight")]
    assert ones and all(bool((a[k] == 1).all()) for k in ones)
    assert abs(a["output.weight"].std().item() - mc.init_std) < 0.1 * mc.init_std


def test_a_box_drawn_alone_equals_the_whole_draw():
    shape = (5000, 300)
    assert rows_per_block(shape) < 5000  # several row blocks
    rule = InitRule("normal", 0.02)
    whole = init_box(rule, shape, 11, "w")
    box = (slice(3000, 4100), slice(10, 20))
    assert torch.equal(init_box(rule, shape, 11, "w", box), whole[box])
    assert not torch.equal(init_box(rule, shape, 11, "v", box), whole[box])  # each name its own stream


def test_hf_start_fills_the_model(tmp_path):
    mc = _tiny()
    torch.manual_seed(0)
    src = Transformer(mc.replace(num_mtp_layers=0))  # an export without MTP layers (as Qwen3 / Kimi K2 ship)
    save_hf_checkpoint(src, tmp_path / "hf", progress=False)
    got = _build(mc, seed=9, init=InitialWeights(hf=str(tmp_path / "hf")))
    fresh = _build(mc, seed=9)
    sd, src_sd, fresh_sd = got.state_dict(), src.state_dict(), fresh.state_dict()
    for k, v in sd.items():
        want = fresh_sd[k] if k.startswith("mtp.") else src_sd[k]
        assert torch.equal(v, want.to(v.dtype)), k
    with pytest.raises(CheckpointError, match="does not match the configured model"):
        _build(mc.replace(num_layers=3), init=InitialWeights(hf=str(tmp_path / "hf")))
