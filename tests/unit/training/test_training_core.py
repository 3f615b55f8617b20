"""The training core's optimizer step on one rank: gradients accumulate over micro-batches, sums add up, a
non-finite step leaves the weights alone and too many in a row stop the run, a step without micro-batches
changes nothing, and a loss_fn that runs its own backward is stepped the same way."""

import dataclasses

import pytest
import torch

from megatron_composer.fp8 import FP8Config
from megatron_composer.model import get_preset
from megatron_composer.parallel.dims import ParallelConfig
from megatron_composer.training.core import TrainingCore
from megatron_composer.training.layout import Layout
from megatron_composer.training.optim import OptimizerConfig


def _core(max_skipped_steps: int = 2) -> TrainingCore:
    mc = dataclasses.replace(get_preset("tiny-deepseek-v3"), num_layers=1, num_mtp_layers=0, vocab_size=128).validate()
    optim = OptimizerConfig(lr=1e-2, min_lr=0.0, weight_decay=0.0, warmup_steps=0, grad_clip=1.0)
    return TrainingCore(mc, {}, Layout(ParallelConfig(), distributed=False), torch.device("cpu"), optim=optim,
                        fp8=FP8Config(), seed=3, max_skipped_steps=max_skipped_steps)


def _micro(seed: int) -> torch.Tensor:
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(seed))


def _loss(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def _weights(core) -> dict:
    return {k: v.detach().clone() for k, v in core.model.state_dict().items()}


def test_step_accumulates_micro_batches_and_sums_their_metrics():
    core, ref = _core(), _core()
    micro = [_micro(0), _micro(1)]

    def loss_fn(ids):
        loss = _loss(core.model, ids) / len(micro)
        return loss, {"loss": loss.detach(), "tokens": torch.tensor(float(ids.numel()))}

    metrics = core.step(loss_fn, micro, lr=1e-2)
    with torch.no_grad():
        want = sum(float(_loss(ref.model, ids)) / len(micro) for ids in micro)
    assert metrics["loss"] == pytest.approx(want, rel=1e-5) and metrics["tokens"] == 64.0
    assert metrics["skipped"] == 0 and metrics["lr"] == 1e-2 and metrics["grad_norm"] > 0
    # the same update as one backward of the summed loss, clipped to norm 1, then torch AdamW at lr 1e-2
    (sum(_loss(ref.model, ids) for ids in micro) / len(micro)).backward()
    torch.nn.utils.clip_grad_norm_(ref.model.parameters(), 1.0)
    for g in ref.optimizer.param_groups:
        g["lr"] = 1e-2
    ref.optimizer.step()
    for (name, p), q in zip(core.model.named_parameters(), ref.model.parameters()):
        torch.testing.assert_close(p, q, msg=name)
    assert all(p.grad is None for p in core.model.parameters())


def test_nonfinite_steps_are_skipped_and_too_many_in_a_row_stop():
    core = _core(max_skipped_steps=2)
    before = _weights(core)

    def poisoned(ids):
        loss = _loss(core.model, ids) * float("nan")
        return loss, {"loss": loss.detach()}

    for _ in range(2):
        assert core.step(poisoned, [_micro(0)], lr=1e-2)["skipped"] == 1
    assert all(torch.equal(v, before[k]) for k, v in core.model.state_dict().items())
    with pytest.raises(RuntimeError, match="3 consecutive steps had non-finite"):
        core.step(poisoned, [_micro(0)], lr=1e-2)
    core.skipped_in_a_row = 0
    assert core.step(lambda ids: (_loss(core.model, ids), {"loss": torch.tensor(1.0)}), [_micro(0)],
                     1e-2)["skipped"] == 0
    assert core.skipped_in_a_row == 0 and not torch.equal(core.model.output.weight, before["output.weight"])


def test_no_micro_batches_and_a_loss_fn_with_its_own_backward():
    core = _core()
    before = _weights(core)
    metrics = core.step(lambda _: (_ for _ in ()).throw(AssertionError("not called")), [], lr=1e-2)
    assert metrics["skipped"] == 0 and metrics["grad_norm"] == 0.0
    assert all(torch.equal(v, before[k]) for k, v in core.model.state_dict().items())

    def own_backward(ids):  # as the RL loss does: backward inside, metrics already reduced
        loss = _loss(core.model, ids)
        loss.backward()
        return None, {"loss": loss.item(), "mismatch_max": 0.5}

    metrics = core.step(own_backward, [_micro(2)], lr=1e-2, reduce=False)
    assert metrics["mismatch_max"] == 0.5 and metrics["skipped"] == 0
    assert not torch.equal(core.model.output.weight, before["output.weight"])
