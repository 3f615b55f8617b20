"""Learning-rate schedules and optimizer construction."""

import torch

from megatron_composer.training.optim import OptimizerConfig, build_optimizer, lr_at


def test_warmup_cosine():
    cfg = OptimizerConfig(lr=1.0, min_lr=0.1, warmup_steps=10, schedule="cosine")
    lrs = [lr_at(s, 100, cfg) for s in range(100)]
    assert lrs[0] == 0.1 and lrs[9] == 1.0
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert abs(lr_at(100, 100, cfg) - 0.1) < 1e-9 and abs(lrs[55] - 0.55) < 0.02


def test_wsd_holds_then_decays_linearly():
    cfg = OptimizerConfig(lr=1.0, min_lr=0.0, warmup_steps=5, schedule="wsd", decay_fraction=0.2)
    lrs = [lr_at(s, 100, cfg) for s in range(100)]
    assert all(lr == 1.0 for lr in lrs[5:80])
    assert lrs[80] < 1.0 and abs(lrs[99]) < 1e-9
    assert all(a > b for a, b in zip(lrs[80:], lrs[81:]))


def test_no_weight_decay_on_norms_and_vectors():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = build_optimizer(model, OptimizerConfig(weight_decay=0.1))
    decayed = {id(p) for p in opt.param_groups[0]["params"]}
    assert id(model[0].weight) in decayed
    assert id(model[0].bias) not in decayed and id(model[1].weight) not in decayed
