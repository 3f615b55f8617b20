"""The RL learner on one rank: the FP8 recipe of pretraining trains an RL step (emulated MXFP8 GEMMs on CPU)
close to the high-precision step, and the step-level loss normalisation does not depend on micro-batching."""

from __future__ import annotations

import pytest
import torch

from megatron_composer.config import load_config


def _learner(rl_assets, tmp_path, **over):
    from megatron_composer.data.tokenizer import load_tokenizer
    from megatron_composer.training.layout import Layout
    from rl.config import RLConfig
    from rl.learner import PolicyLearner

    base = {"model.preset": "tiny-deepseek-v3", "model.overrides": "{num_layers: 2, num_mtp_layers: 0}",
            "data.tokenizer": rl_assets / "tok", "rollout.max_seq_len": 128, "train.seed": 3, "run.dir": tmp_path,
            "rl.mismatch_bound": 100.0, "checkpoint.init_from": "''"}
    base.update(over)
    cfg = load_config(RLConfig, None, [f"{k}={v}" for k, v in base.items()]).validate()
    return PolicyLearner(cfg, load_tokenizer(cfg.data.tokenizer), Layout(cfg.parallel, distributed=False),
                         torch.device("cpu"))


def _groups(mc, seed=0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    L, E, K = len(mc.moe_layer_ids), mc.num_experts, mc.num_experts_per_tok
    episodes = []
    for i in range(4):
        P, R = 6, 10 + i
        episodes.append({"reward": float(i % 2), "meta": {}, "segments": [{
            "prompt_ids": torch.randint(3, mc.vocab_size, (P,), generator=g).tolist(),
            "response_ids": torch.randint(3, mc.vocab_size, (R,), generator=g).tolist(),
            "response_logprobs": [-5.5] * R, "response_mask": [1] * R,
            "routed_experts": torch.rand(L, P + R, E, generator=g).argsort(-1)[..., :K]}]})
    return [{"episodes": episodes}]


def test_fp8_recipe_trains_an_rl_step(rl_assets, tmp_path):
    from megatron_composer.fp8.linear import FP8Linear

    ref = _learner(rl_assets, tmp_path / "ref")
    fp8 = _learner(rl_assets, tmp_path / "fp8",
                   **{"fp8.recipe": "mxfp8", "fp8.block_size": 16, "fp8.backend": "emulated"})
    assert sum(isinstance(m, FP8Linear) for m in fp8.model.modules()) > 0
    samples, _, n = ref.samples(_groups(ref.mc))
    loss_ref, loss_fp8 = ref.backward(samples, n)["loss"], fp8.backward(samples, n)["loss"]
    assert loss_fp8 != loss_ref  # the FP8 GEMMs ran
    # The policy-gradient loss is a near-cancelling sum of advantage-weighted terms, so compare what the step
    # uses, the gradient: the FP8 one points the same way with about the same size.
    grads = [{n: p.grad.flatten() for n, p in m.model.named_parameters() if p.grad is not None} for m in (ref, fp8)]
    assert grads[0].keys() == grads[1].keys() and grads[0]
    g_ref, g_fp8 = (torch.cat([g[n] for n in sorted(g)]) for g in grads)
    assert torch.nn.functional.cosine_similarity(g_ref, g_fp8, dim=0) > 0.98
    assert float(g_fp8.norm()) == pytest.approx(float(g_ref.norm()), rel=0.05)
    fp8.optimizer.zero_grad()
    before = {k: v.clone() for k, v in fp8.model.state_dict().items()}
    m = fp8.step(_groups(ref.mc), lr=1e-3)
    assert m["skipped"] == 0.0 and m["grad_norm"] > 0
    assert any(not torch.equal(before[k], v) for k, v in fp8.model.state_dict().items())


def test_step_loss_does_not_depend_on_micro_batching(rl_assets, tmp_path):
    one = _learner(rl_assets, tmp_path / "a", **{"train.micro_batch_size": 4})
    four = _learner(rl_assets, tmp_path / "b", **{"train.micro_batch_size": 1})
    samples, _, n = one.samples(_groups(one.mc, seed=1))
    a, b = one.backward(samples, n), four.backward(samples, n)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["train_tokens"] == b["train_tokens"] == 46
    for (name, p), q in zip(one.model.named_parameters(), four.model.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6 * float(p.grad.abs().max())), name
