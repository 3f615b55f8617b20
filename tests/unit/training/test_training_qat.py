"""INT4 quantisation-aware training of the routed experts (qat.experts=int4): the experts compute with their INT4
grid values, gradients pass straight through to the float masters, and the INT4 export of a trained model
computes exactly what the trained model computes."""

import pytest
import torch
import torch.nn.functional as F

from megatron_composer.checkpoint import int4
from megatron_composer.checkpoint.hf import load_hf_checkpoint, save_hf_checkpoint
from megatron_composer.config import ConfigError
from megatron_composer.fp8 import FP8Config
from megatron_composer.model import Transformer, get_preset
from megatron_composer.parallel.dims import ParallelConfig
from megatron_composer.training.core import TrainingCore
from megatron_composer.training.layout import Layout
from megatron_composer.training.optim import OptimizerConfig
from megatron_composer.training.qat import QATConfig, apply_qat

CFG = get_preset("tiny-deepseek-v3").replace(num_layers=3, vocab_size=256)


def _batch(seed, n=2, s=24):
    ids = torch.randint(0, CFG.vocab_size, (n, s + 1), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1], ids[:, 1:]


def _loss(model, seed):
    ids, labels = _batch(seed)
    return F.cross_entropy(model(ids).flatten(0, 1), labels.flatten())


def test_qat_experts_compute_on_the_int4_grid_with_straight_through_gradients():
    torch.manual_seed(0)
    qat = apply_qat(Transformer(CFG), QATConfig(experts="int4"))
    torch.manual_seed(0)
    grid = Transformer(CFG)
    with torch.no_grad():  # the same model with its experts' weights replaced by their grid values
        for name, p in grid.named_parameters():
            if ".experts.w" in name:
                p.copy_(int4.fake_quantize(p))
    loss_qat, loss_grid = _loss(qat, 1), _loss(grid, 1)
    assert torch.equal(loss_qat, loss_grid)
    loss_qat.backward()
    loss_grid.backward()
    compared = 0
    for (name, p), q in zip(qat.named_parameters(), grid.parameters()):
        if p.grad is None:  # the MTP heads: not in this loss
            assert q.grad is None, name
            continue
        compared += ".experts.w" in name
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7), name  # the gradient passes straight through
    assert compared >= 6
    assert any(".experts.w" in n and not torch.equal(p, int4.fake_quantize(p)) for n, p in qat.named_parameters())


def test_a_model_trained_with_qat_exports_to_int4_that_computes_what_it_trained(tmp_path):
    core = TrainingCore(CFG, {}, Layout(ParallelConfig(), distributed=False), torch.device("cpu"),
                        optim=OptimizerConfig(lr=3e-3, warmup_steps=0, schedule="constant"), fp8=FP8Config(), seed=3,
                        qat=QATConfig(experts="int4"))
    losses = [core.step(lambda seed: (_loss(core.model, seed), {}), [step], 3e-3) for step in range(4)]
    assert all(m["skipped"] == 0 for m in losses)
    model = core.model.eval()
    save_hf_checkpoint(model, tmp_path / "int4", quantize="int4-experts", progress=False)
    served = load_hf_checkpoint(tmp_path / "int4", dtype=torch.float32, progress=False).eval()
    ids, _ = _batch(9)
    with torch.no_grad():
        assert torch.equal(served(ids), model(ids))


def test_qat_refuses_experts_whose_inputs_do_not_split_into_int4_groups():
    with pytest.raises(ConfigError, match="not a multiple of the INT4 group size 32"):
        apply_qat(Transformer(CFG.replace(moe_intermediate_size=48)), QATConfig(experts="int4"))
    with pytest.raises(ConfigError, match="qat.experts='int8'"):
        QATConfig(experts="int8").validate()
