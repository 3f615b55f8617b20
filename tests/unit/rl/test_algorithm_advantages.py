"""Group advantages, zero-variance filtering, self-summarisation chains and the prompt sampler."""

import math

import pytest
import torch

from megatron_composer.config import ConfigError, load_config
from rl.algorithm import (
    Episode,
    PromptSampler,
    RLObjectiveConfig,
    Segment,
    advantages_from_config,
    collate_samples,
    compute_advantages,
    episodes_to_samples,
    group_advantages,
    zero_variance_groups,
)


def test_mean_baseline_hand_values():
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 2.0, 3.0]]))
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5], [-1.5, -0.5, 0.5, 1.5]])
    torch.testing.assert_close(adv, expected)


def test_leave_one_out_baseline_hand_values():
    # R = [0, 1, 2]: A_0 = 0 - (1 + 2)/2 = -1.5, A_1 = 1 - (0 + 2)/2 = 0, A_2 = 2 - (0 + 1)/2 = 1.5
    adv = group_advantages(torch.tensor([[0.0, 1.0, 2.0]]), baseline="leave_one_out")
    torch.testing.assert_close(adv, torch.tensor([[-1.5, 0.0, 1.5]]))


def test_std_normalize_uses_unbiased_group_std():
    # [1, 0, 0, 1]: unbiased var = 4 * 0.25 / 3 = 1/3, so A = +-0.5 / sqrt(1/3)
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), std_normalize=True, eps=0.0)
    a = 0.5 / math.sqrt(1 / 3)
    torch.testing.assert_close(adv, torch.tensor([[a, -a, -a, a]]))
    # [0, 1, 2]: unbiased std = 1, so normalisation leaves the centred rewards
    adv = group_advantages(torch.tensor([[0.0, 1.0, 2.0]]), std_normalize=True, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([[-1.0, 0.0, 1.0]]))
    # eps enters the denominator
    adv = group_advantages(torch.tensor([[0.0, 1.0, 2.0]]), std_normalize=True, eps=1.0)
    torch.testing.assert_close(adv, torch.tensor([[-0.5, 0.0, 0.5]]))


@pytest.mark.parametrize("std_normalize", [False, True])
@pytest.mark.parametrize("baseline", ["mean", "leave_one_out"])
def test_group_of_one_and_all_equal_give_zero(std_normalize, baseline):
    single = group_advantages(torch.tensor([[3.0], [5.0]]), std_normalize=std_normalize, baseline=baseline, eps=0.0)
    assert torch.equal(single, torch.zeros(2, 1))
    equal = group_advantages(torch.tensor([[0.1, 0.1, 0.1], [2.0, 2.0, 2.0]]), std_normalize=std_normalize,
                             baseline=baseline, eps=0.0)
    assert torch.equal(equal, torch.zeros(2, 3))


def test_zero_variance_groups_and_filter_metrics():
    rewards = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [0.5, 0.0]])
    assert zero_variance_groups(rewards).tolist() == [True, False, True, False]
    kept = compute_advantages(rewards, filter_zero_variance=True)
    assert kept.keep.tolist() == [[False, False], [True, True], [False, False], [True, True]]
    assert kept.metrics["zero_variance_group_fraction"] == 0.5
    assert kept.metrics["filtered_sample_fraction"] == 0.5
    assert kept.metrics["reward_mean"] == pytest.approx(3.5 / 8)
    unfiltered = compute_advantages(rewards)
    assert unfiltered.keep.all()
    assert unfiltered.metrics["zero_variance_group_fraction"] == 0.5
    assert unfiltered.metrics["filtered_sample_fraction"] == 0.0


def test_bad_rewards_raise():
    with pytest.raises(ValueError, match="num_groups, group_size"):
        group_advantages(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="NaN"):
        group_advantages(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="baseline"):
        group_advantages(torch.tensor([[1.0, 0.0]]), baseline="median")


def doubled_advantages(rewards, cfg):
    return 2 * (rewards - rewards.mean(dim=1, keepdim=True))


def test_advantages_from_config_and_hook():
    rewards = torch.tensor([[1.0, 0.0]])
    cfg = RLObjectiveConfig(advantage_baseline="leave_one_out")
    torch.testing.assert_close(advantages_from_config(rewards, cfg).advantages, torch.tensor([[1.0, -1.0]]))
    cfg = RLObjectiveConfig(advantage_fn=f"{__name__}:doubled_advantages").validate()
    torch.testing.assert_close(advantages_from_config(rewards, cfg).advantages, torch.tensor([[1.0, -1.0]]))
    with pytest.raises(ConfigError, match="no function"):
        load_config(RLObjectiveConfig, None, ["advantage_fn=rl.algorithm.advantages:nope"])


# ---- chains -----------------------------------------------------------------------------------------------

def _segment(prompt, response, logp=None, mask=None, routed=None):
    return Segment(prompt_ids=prompt, response_ids=response, response_logprobs=logp, response_mask=mask,
                   routed_experts=routed)


def test_chain_segments_share_episode_reward_and_group_advantage():
    chain = Episode(segments=[
        _segment([1, 2], [3, 4, 5], logp=[-0.1, -0.2, -0.3]),  # ends with the summary tokens 4, 5
        _segment([1, 4, 5], [6], logp=[-0.4]),  # context: system/task + previous summary
    ], reward=1.0)
    plain = Episode(segments=[_segment([1, 2], [7, 8], logp=[-0.5, -0.6], mask=[1, 0])], reward=0.0)
    empty = Episode(segments=[_segment([1, 2], [])], reward=0.0)
    same_a = Episode(segments=[_segment([9], [9])], reward=2.0)
    same_b = Episode(segments=[_segment([9], [8])], reward=2.0)
    groups = [[chain, plain, empty], [same_a, same_b, Episode(segments=[], reward=2.0)]]
    samples, result = episodes_to_samples(groups, RLObjectiveConfig())
    # group 0 rewards [1, 0, 0]: mean 1/3
    assert [(s.group, s.episode, s.segment) for s in samples] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 2, 0), (1, 0, 0), (1, 1, 0)]
    assert samples[0].advantage == pytest.approx(2 / 3) and samples[1].advantage == pytest.approx(2 / 3)
    assert samples[2].advantage == pytest.approx(-1 / 3) and samples[3].advantage == pytest.approx(-1 / 3)
    assert samples[4].advantage == 0.0 and samples[5].advantage == 0.0
    assert samples[0].reward == samples[1].reward == 1.0
    # summaries are trained: every sampled token of every segment is in the loss
    assert samples[0].input_ids == [1, 2, 3, 4, 5] and samples[0].loss_mask == [0, 0, 1, 1, 1]
    assert samples[1].input_ids == [1, 4, 5, 6] and samples[1].loss_mask == [0, 0, 0, 1]
    assert samples[1].behaviour_logprobs == [0.0, 0.0, 0.0, -0.4]
    assert samples[2].loss_mask == [0, 0, 1, 0]  # tool observation token masked out
    assert samples[3].loss_mask == [0, 0]  # empty response: no trained tokens
    assert result.metrics["num_episodes"] == 6 and result.metrics["num_segments"] == 6

    filtered, result = episodes_to_samples(groups, RLObjectiveConfig(filter_zero_variance_groups=True))
    assert [s.group for s in filtered] == [0, 0, 0, 0]
    assert result.metrics["zero_variance_group_fraction"] == 0.5


def test_chain_errors():
    with pytest.raises(ValueError, match="same number of episodes"):
        episodes_to_samples([[Episode([], 1.0)], [Episode([], 1.0), Episode([], 0.0)]], RLObjectiveConfig())
    with pytest.raises(ValueError, match="response_logprobs"):
        _segment([1], [2, 3], logp=[-0.1])
    with pytest.raises(ValueError, match="routed_experts"):
        _segment([1], [2], routed=torch.zeros(1, 3, 2, dtype=torch.long))


def test_collate_pads_and_routes():
    r1 = torch.tensor([[[0, 1], [2, 3], [1, 2]]])  # [layers=1, 3 tokens, top_k=2]
    r2 = torch.tensor([[[3, 1], [0, 2]]])
    groups = [[Episode([_segment([5], [6, 7], logp=[-1.0, -2.0], routed=r1)], 1.0),
               Episode([_segment([5], [8], logp=[-3.0], routed=r2)], 0.0)]]
    samples, _ = episodes_to_samples(groups, RLObjectiveConfig())
    batch = collate_samples(samples, pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [5, 8, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [0, 1, 0]]
    assert batch["behaviour_logp"].tolist() == [[0.0, -1.0, -2.0], [0.0, -3.0, 0.0]]
    assert batch["advantages"].tolist() == [0.5, -0.5]
    assert batch["routed_experts"].shape == (1, 2, 3, 2)
    assert batch["routed_experts"][0, 1].tolist() == [[3, 1], [0, 2], [0, 1]]
    assert torch.equal(batch["routed_experts"][0, 0], r1[0])


# ---- prompt sampler ---------------------------------------------------------------------------------------

def test_sampler_single_epoch_never_repeats():
    sampler = PromptSampler(num_prompts=10, prompts_per_step=4, group_size=3, seed=7)
    batches = list(sampler)
    assert [len(b) for b in batches] == [4, 4, 2]
    flat = [p for b in batches for p in b]
    assert sorted(flat) == list(range(10))
    with pytest.raises(StopIteration):
        sampler.next_batch()
    assert sampler.expand([4, 1]) == [4, 4, 4, 1, 1, 1]
    assert [len(b) for b in PromptSampler(10, 4, 3, seed=7, drop_last=True)] == [4, 4]
    assert list(PromptSampler(10, 4, 3, seed=7)) == batches  # seeded order is reproducible
    assert list(PromptSampler(10, 4, 3, seed=8)) != batches


def test_sampler_resumes_exactly():
    full = list(PromptSampler(23, 5, 2, seed=1))
    first = PromptSampler(23, 5, 2, seed=1)
    head = [first.next_batch(), first.next_batch()]
    state = first.state_dict()
    resumed = PromptSampler(23, 5, 2, seed=1)
    resumed.load_state_dict(state)
    assert head + list(resumed) == full
    with pytest.raises(ValueError, match="same prompt set"):
        PromptSampler(23, 5, 2, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="empty"):
        PromptSampler(0, 5, 2)
