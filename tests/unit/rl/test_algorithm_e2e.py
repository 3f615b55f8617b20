"""A one-step-per-batch RL loop with the default objective raises the reward of a toy verifiable task.

Task: the prompt is [BOS, p, q] with p, q random content tokens; the response (RESPONSE_LEN sampled tokens)
earns the fraction of its positions that match the target pattern TARGET. The model is the project's MoE
Transformer (tiny-qwen3-moe shape, small vocab); rollouts record behaviour log-probs and routed experts as the
inference engine does, and training replays those experts (R3), applies mismatch masking, the k1-in-reward KL
to a frozen reference and the Dr. GRPO aggregation. Groups that reach equal rewards stop contributing (zero
advantage), so the reward plateaus below 1; the test asks for a clear rise, not for a solved task.
"""

import copy
import dataclasses

import torch

from megatron_composer.model import Transformer, get_preset
from rl.algorithm import (
    Episode,
    PolicyGradientLoss,
    PromptSampler,
    RLObjectiveConfig,
    Segment,
    collate_samples,
    episodes_to_samples,
    replay_routing,
    routing_mismatch,
    token_logprobs,
)

VOCAB, BOS, FIRST_CONTENT = 16, 1, 4
TARGET = (5, 7, 5, 7)
RESPONSE_LEN, GROUP_SIZE, PROMPTS_PER_STEP, STEPS = len(TARGET), 8, 2, 100


def make_model() -> Transformer:
    cfg = dataclasses.replace(get_preset("tiny-qwen3-moe"), vocab_size=VOCAB, num_layers=2, hidden_size=64,
                              intermediate_size=128, head_dim=16, moe_intermediate_size=32)
    return Transformer(cfg)


@torch.no_grad()
def rollout(model, prompts_BP: torch.Tensor, gen: torch.Generator):
    """Sample RESPONSE_LEN tokens at temperature 1, then record log-probs and routing of the whole sequence
    in one pass, as the inference engine reports them."""
    seq = prompts_BP
    for _ in range(RESPONSE_LEN):
        probs = torch.softmax(model(seq)[:, -1].float(), -1)
        seq = torch.cat([seq, torch.multinomial(probs, 1, generator=gen)], 1)
    out = model(seq, return_routing=True)
    return seq, token_logprobs(out.logits, seq), out.routed_experts


def run_loop(steps: int = STEPS, seed: int = 0) -> list[float]:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    policy = make_model()
    reference = copy.deepcopy(policy).requires_grad_(False)
    cfg = RLObjectiveConfig(loss_constant=float(RESPONSE_LEN))  # the recipe's defaults otherwise
    objective = PolicyGradientLoss(cfg)
    optimizer = torch.optim.Adam(policy.parameters(), lr=3e-3)
    prompt_set = torch.randint(FIRST_CONTENT, VOCAB, (steps * PROMPTS_PER_STEP, 2), generator=gen)
    sampler = PromptSampler(len(prompt_set), PROMPTS_PER_STEP, GROUP_SIZE, seed=seed)
    rewards_per_step = []
    for _ in range(steps):
        idx = sampler.expand(sampler.next_batch())
        prompts_BP = torch.cat([torch.full((len(idx), 1), BOS), prompt_set[idx]], 1)
        P = prompts_BP.shape[1]
        seq_BS, infer_logp_BS, routed_LBSK = rollout(policy, prompts_BP, gen)
        reward_B = (seq_BS[:, P:] == torch.tensor(TARGET)).float().mean(-1)
        rewards_per_step.append(reward_B.mean().item())

        episodes = [Episode([Segment(seq_BS[b, :P].tolist(), seq_BS[b, P:].tolist(),
                                     infer_logp_BS[b, P:].tolist(), routed_experts=routed_LBSK[:, b])],
                            reward_B[b].item()) for b in range(len(idx))]
        groups = [episodes[g * GROUP_SIZE:(g + 1) * GROUP_SIZE] for g in range(PROMPTS_PER_STEP)]
        samples, adv = episodes_to_samples(groups, cfg)
        batch = collate_samples(samples)

        routed = replay_routing(cfg.router_replay, inference_routed_experts=batch["routed_experts"])
        out = policy(batch["input_ids"], routed_experts=routed, return_routing=True)
        assert torch.equal(out.routed_experts, batch["routed_experts"])  # R3: the engine's experts were used
        with torch.no_grad():
            free = policy(batch["input_ids"], return_routing=True).routed_experts
            ref_logp = token_logprobs(reference(batch["input_ids"]), batch["input_ids"])
        # On-policy with identical weights and batch: routing without replay agrees with the engine's.
        mismatch = routing_mismatch(free, batch["routed_experts"], batch["loss_mask"])
        assert mismatch["routing_mismatch_token_fraction"] == 0
        logp = token_logprobs(out.logits, batch["input_ids"])
        loss, metrics = objective(logp, batch["loss_mask"], batch["advantages"], batch["behaviour_logp"],
                                  ref_logp=ref_logp, num_sequences=int(adv.metrics["num_episodes"]))
        assert torch.isfinite(loss) and metrics["mismatch_masked_fraction"] <= 0.05
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return rewards_per_step


def test_default_objective_raises_reward_on_toy_task(one_thread):
    rewards = run_loop()
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert first < 0.3, rewards[:10]
    assert last > first + 0.4, (first, last, rewards)
