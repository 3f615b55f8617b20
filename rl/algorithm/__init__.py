"""The RL objective as pure functions over tensors plus one loss module (see each module's docstring)."""

from rl.algorithm.advantages import (
    AdvantageResult,
    advantages_from_config,
    compute_advantages,
    group_advantages,
    zero_variance_groups,
)
from rl.algorithm.chains import Episode, Segment, TrainingSample, collate_samples, episodes_to_samples
from rl.algorithm.config import RLObjectiveConfig
from rl.algorithm.kl import kl_estimate, reward_to_go
from rl.algorithm.loss import (
    PolicyGradientLoss,
    aggregate_loss,
    importance_weight,
    mismatch_mask,
    token_logprobs,
)
from rl.algorithm.rewards import (
    episode_reward,
    length_measure,
    length_penalty,
    malformed_tool_calls,
    reasoning_in_code_comments,
    resolve_function,
    reward_term_name,
    shaped_reward,
    shaped_reward_from_config,
    single_tool_collapse,
    unfinished_todos,
)
from rl.algorithm.router_replay import replay_routing, routing_mismatch
from rl.algorithm.sampler import PromptSampler

__all__ = [
    "AdvantageResult", "advantages_from_config", "compute_advantages", "group_advantages", "zero_variance_groups",
    "Episode", "Segment", "TrainingSample", "collate_samples", "episodes_to_samples",
    "RLObjectiveConfig", "kl_estimate", "reward_to_go",
    "PolicyGradientLoss", "aggregate_loss", "importance_weight", "mismatch_mask", "token_logprobs",
    "episode_reward", "length_measure", "length_penalty", "malformed_tool_calls", "reasoning_in_code_comments",
    "resolve_function", "reward_term_name",
    "shaped_reward", "shaped_reward_from_config", "single_tool_collapse", "unfinished_todos",
    "replay_routing", "routing_mismatch", "PromptSampler",
]
