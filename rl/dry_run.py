"""Dry run of one RL trainer step at full size on one CPU: one trainer rank of a world of N, measured.

`simulate_rl(cfg, world_size)` builds the RL learner exactly as a trainer rank does (rl/learner.py:
PolicyLearner over the training core, in `cfg.parallel`'s layout with `cfg.fp8`'s recipe, the reference
policy when rl.kl_coef > 0) as one rank of `world_size` on torch's fake process group and fake tensors
(megatron_composer/training/dry_run.py), and runs one optimizer step of the learner's own code on this
rank's share of a step: `PolicyLearner.backward` (the old-policy pass with the reference log-probs when the
step needs it, the update forward with router replay, the free-routing forward that measures the routing
mismatch, the policy-gradient loss with its importance ratios, mismatch filter and KL term, backward), then
the gradient reduction and clipping and the optimizer step, under torch's memory tracker. It returns the
rank's peak bytes by kind; the reference policy's shards are the kind "reference".

A tensor without values cannot decide anything that depends on data, so the run assumes (and lists):

- routing is balanced (the replayed experts are random ids; each expert receives an equal share of rows);
- every position of a sample is a generated token (loss mask 1): a boolean-mask selection selects every
  element, the largest shape it can have;
- host reads: booleans read False, a lone integer 0, a floating-point value 0.0 -- they choose logged
  statistics and the mismatch threshold's value, not a tensor's shape;
- the step is taken (loss and gradient norm finite);
- the rank runs `micro_batches` of its real micro-batches (default 2: the second runs with every gradient
  shard of the first accumulated, as every later one does); the inputs and old-policy outputs the other
  micro-batches of the step keep on the device for the whole step (PolicyLearner moves every micro-batch's
  tensors to the device and runs the old-policy pass over all of them before the first update) are the
  measured bytes of one micro-batch's, times their number, added as the kind "step_inputs";
- a first step on short samples creates the gradients and the optimizer state, so the measured step is a
  steady-state one.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from megatron_composer.config import ConfigError
from megatron_composer.data.tokenizer import Tokenizer
from megatron_composer.parallel.fake_world import fake_rank
from megatron_composer.training.dry_run import (
    DryRunResult,
    HostReads,
    by_kind,
    check_sim_layers,
    extrapolate,
    fsdp_unit_numels,
    measure_peak,
    require_fsdp,
    storage_bytes,
)
from rl.config import RLConfig


class _VocabularyOnly(Tokenizer):
    """The tokenizer as the trainer's model sees it (its vocabulary size and pad id), when the run's tokenizer
    files are not on this machine: the dry run feeds token ids, it encodes no text."""

    def __init__(self, vocab_size: int, source: str):
        self.vocab_size, self.eod, self.pad, self.special_tokens = vocab_size, 0, 0, {}
        self.path = f"{source} (vocabulary size only)"


def _tokenizer(cfg: RLConfig) -> Tokenizer:
    from megatron_composer.data.tokenizer import load_tokenizer

    if Path(cfg.data.tokenizer).exists():
        return load_tokenizer(cfg.data.tokenizer)
    if not cfg.model.vocab_size:
        raise ConfigError(f"data.tokenizer '{cfg.data.tokenizer}' is not on this machine and model.vocab_size is 0; "
                          "set model.vocab_size for the dry run")
    return _VocabularyOnly(cfg.model.vocab_size, cfg.data.tokenizer)


def policy_model_config(cfg: RLConfig):
    """The policy's ModelConfig as the trainer builds it (rl/model.py), without reading its weights."""
    from rl.model import build_model_meta

    return build_model_meta(dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, init_from="")),
                            _tokenizer(cfg))[0]


def samples_per_rank(cfg: RLConfig, dp: int) -> int:
    """The trainer's samples per data-parallel rank in one step: every episode of the step's groups is one
    sample of at most data.seq_length tokens (one segment), split over dp ranks as rl/learner.py:dp_share does."""
    return -(-cfg.train.groups_per_step * cfg.rollout.group_size // dp)


def _samples(n: int, seq_len: int, vocab: int, moe_layers: int, top_k: int, num_experts: int) -> list:
    from rl.algorithm import TrainingSample

    out = []
    for i in range(n):
        routed = torch.randint(0, num_experts, (moe_layers, seq_len, top_k)) if moe_layers else None
        out.append(TrainingSample(input_ids=[(7 * j + i) % vocab for j in range(seq_len)],
                                  loss_mask=[1] * seq_len, behaviour_logprobs=[-1.0] * seq_len,
                                  advantage=1.0 if i % 2 else -1.0, reward=float(i % 2), group=0, episode=i, segment=0,
                                  routed_experts=routed))
    return out


def _record_held_bytes(learner, observed: dict) -> None:
    """Record in observed["held"] the device bytes of every micro-batch's tensors that live through the whole
    step: its inputs as PolicyLearner._micro_batches puts them on the device and the old-policy pass's outputs
    (log-probs, routing, reference log-probs)."""
    micro_batches, old_policy_pass = learner._micro_batches, learner._old_policy_pass

    def nbytes(dicts):
        return sum(t.nbytes for d in dicts for t in d.values() if isinstance(t, torch.Tensor))

    def recorded_micro_batches(samples):
        micro = micro_batches(samples)
        observed["held"] += nbytes(d for _, _, local, full in micro for d in (local, full))
        return micro

    def recorded_old_policy_pass(micro):
        old = old_policy_pass(micro)
        observed["held"] += nbytes(old)
        return old

    learner._micro_batches, learner._old_policy_pass = recorded_micro_batches, recorded_old_policy_pass


def _model_tensors(model) -> list[torch.Tensor]:
    """Every parameter storage a frozen model holds now: its FSDP shards and whatever is still gathered (the
    learner reshards the reference's root unit after each of its forwards, so normally nothing)."""
    from torch.distributed.fsdp import FSDPModule

    out = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    for m in model.modules():
        if isinstance(m, FSDPModule) and (group := m._get_fsdp_state()._fsdp_param_group) is not None:
            out += [fp._sharded_param_data for fp in group.fsdp_params]
    return out


def simulate_rl(cfg: RLConfig, world_size: int, *, micro_batches: int = 2, seq_len: int | None = None,
                rank: int = 0) -> DryRunResult:
    """Measured peak memory of trainer `rank` (of `world_size`) in one RL step of `cfg` (module docstring).
    Raises ConfigError (one line) for a layout that does not divide."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_composer.parallel.expert_parallel import assume_balanced_routing
    from megatron_composer.training.core import finish_gradients
    from megatron_composer.training.layout import Layout
    from rl.learner import PolicyLearner

    pcfg = dataclasses.replace(cfg.parallel)
    require_fsdp(pcfg, world_size)
    if pcfg.fsdp_param_dtype == "auto":
        pcfg.fsdp_param_dtype = "bfloat16"  # what "auto" picks on a GPU
    fp8 = cfg.fp8
    if fp8.enabled and fp8.backend in ("auto", "emulated"):
        # the GPU kernels' allocations (their launches skip fake tensors); the emulated backend reads group
        # offsets on the host and dequantises whole operands to fp32, which no GPU run does
        fp8 = dataclasses.replace(fp8, backend="triton")
    cfg = dataclasses.replace(cfg, parallel=pcfg, fp8=fp8,
                              checkpoint=dataclasses.replace(cfg.checkpoint, init_from=""))
    seq_len = seq_len or cfg.data.seq_length
    tokenizer = _tokenizer(cfg)
    t0 = time.perf_counter()
    rl = cfg.rl
    with fake_rank(world_size, rank):
        layout = Layout(pcfg)
        device = torch.device("cpu")
        with FakeTensorMode(allow_non_fake_inputs=True), HostReads(metrics=True):
            learner = PolicyLearner(cfg, tokenizer, layout, device)
            mc = learner.mc
            layout.validate(mc, seq_len)
            for model in (learner.model, learner.ref_model):
                if model is not None and mc.num_experts:
                    assume_balanced_routing(model)
            moe_layers = mc.num_layers - mc.first_k_dense_replace if mc.num_experts else 0
            per_rank = samples_per_rank(cfg, layout.dp_size)
            n_micro = -(-per_rank // cfg.train.micro_batch_size)
            if micro_batches > n_micro:
                raise ConfigError(f"micro_batches {micro_batches} is more than the step's {n_micro} per rank")
            mb = cfg.train.micro_batch_size

            def make(n, length):
                return _samples(n, length, mc.vocab_size, moe_layers, mc.num_experts_per_tok or 0, mc.num_experts)

            observed = {"forwards": {}, "without_grad": None, "held": 0}

            def one_step(samples, record=False):
                # what PolicyLearner.step does around backward (rl/learner.py): the core's step, the step taken
                learner.backward(samples, num_episodes=cfg.train.groups_per_step * cfg.rollout.group_size)
                if record:  # the parameters the RL loss reached (FSDP's sharded gradients, before the step)
                    observed["without_grad"] = [n for n, p in learner.model.named_parameters() if p.grad is None]
                finish_gradients(learner.model, learner.optimizer, learner.core.grad_clip)
                learner.optimizer.step()
                learner.optimizer.zero_grad()

            # dp_share gives this rank its contiguous run of the step's samples: a step of dp x n samples
            short = 2 * pcfg.cp * max(pcfg.tp, 1) * 2
            one_step(make(layout.dp_size * mb, short))  # gradients, optimizer state
            units = fsdp_unit_numels(learner.model) if pcfg.fsdp else {}
            step_samples = make(layout.dp_size * micro_batches * mb, seq_len)
            hooks = [m.register_forward_pre_hook(lambda mod, args, name=name: observed["forwards"].__setitem__(
                name, observed["forwards"].get(name, 0) + 1))
                for name, m in (("policy", learner.model), ("reference", learner.ref_model)) if m is not None]
            # the reference policy's storages live through the step (the tracker follows the policy only)
            reference = storage_bytes(_model_tensors(learner.ref_model)) if learner.ref_model is not None else 0
            _record_held_bytes(learner, observed)
            raw = measure_peak(learner.model, learner.optimizer, pcfg.fsdp,
                               lambda: one_step(step_samples, record=True))
            for h in hooks:
                h.remove()
    held = observed["held"] // micro_batches * (n_micro - micro_batches)
    kinds = by_kind(raw)
    kinds["reference"], kinds["step_inputs"] = reference, held
    on = [f"rl.{k}={getattr(rl, k)}" for k in ("pg_loss", "kl_coef", "kl_estimator", "kl_placement", "router_replay",
                                              "mismatch_mask", "mismatch_quantile", "mismatch_bound")]
    assumptions = [
        "routing balanced: every expert receives an equal share of the (token, expert) rows (replayed ids are random)",
        "every position is a generated token (loss mask 1): boolean-mask selections select every element",
        "host reads: booleans False, a lone integer 0, floating-point values 0.0 (statistics, the mismatch "
        "threshold's value)",
        "the step is taken (loss and gradient norm finite)",
        "kernels: the Python paths a GPU takes (MEGATRON_COMPOSER_CPP=0)",
        f"parameters gathered in {pcfg.fsdp_param_dtype} (fsdp_param_dtype auto on a GPU), FP8 recipe "
        f"{cfg.fp8.recipe}" + (f" with the {cfg.fp8.backend} backend's allocations (quantised operands saved for "
                               "backward, GEMM outputs; kernel launches skipped on fake tensors)"
                               if cfg.fp8.enabled else ""),
        "exact tensor bytes: no CUDA allocator rounding or fragmentation, no NCCL or cuBLAS workspaces",
        f"{micro_batches} of the rank's {n_micro} micro-batches of {mb} x {seq_len} tokens run; the other "
        f"{n_micro - micro_batches} micro-batches' device inputs and old-policy outputs held through the step "
        "(step_inputs: the measured bytes of one micro-batch's, times their number)",
        "samples are single segments of data.seq_length tokens (no summarisation chains: no KL tails)",
        "the RL loss: " + ", ".join(on),
    ]
    return DryRunResult(peak_bytes=raw["Total"] + reference + held, by_kind=kinds, assumptions=assumptions,
                        seconds=time.perf_counter() - t0, tracker_kinds=raw, units=units,
                        extra={"without_grad": observed["without_grad"], "forwards": observed["forwards"],
                               "parameters": [n for n, _ in learner.model.named_parameters()],
                               "micro_batches_per_step": n_micro, "samples_per_rank": per_rank})


def simulate_rl_scaled(cfg: RLConfig, world_size: int, *, layers: int, **kw) -> DryRunResult:
    """`simulate_rl` of the policy with `layers` and `layers + 1` transformer layers, extrapolated affinely to its
    own depth, as pretrain/dry_run.py:simulate_scaled (whose docstring says when that is exact): every term
    the RL step adds -- the reference policy's shards, the replayed routing (one [S, top_k] per MoE layer), the
    held inputs -- is itself affine in the number of MoE layers."""
    mc = policy_model_config(cfg)
    check_sim_layers(mc, layers)

    def at(n):
        model = dataclasses.replace(cfg.model, overrides={**cfg.model.overrides, "num_layers": n})
        return simulate_rl(dataclasses.replace(cfg, model=model), world_size, **kw)

    return extrapolate(at(layers), at(layers + 1), mc.num_layers - layers,
                       f"extrapolated linearly from {layers}- and {layers + 1}-layer runs to {mc.num_layers} layers "
                       "(+{per_layer:.3f} GiB per layer)")


__all__ = ["policy_model_config", "samples_per_rank", "simulate_rl", "simulate_rl_scaled"]
