"""Parallelism on one device mesh: tensor (+sequence), expert, context and data parallel.

Process groups come from `ParallelDims.build()` and are passed explicitly; nothing is global.
"""

from megatron_composer.parallel.context_parallel import cp_shift_left, shard_sequence, unshard_sequence
from megatron_composer.parallel.data_parallel import DistributedAdamW
from megatron_composer.parallel.dims import ParallelConfig, ParallelDims, ParallelGroups
from megatron_composer.parallel.expert_parallel import AllToAllDispatcher
from megatron_composer.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardSpec,
    VocabParallelEmbedding,
    full_state_dict,
    spec_of,
)
from megatron_composer.parallel.parallelize import parallelize_model, shard_batch, validate_layout
from megatron_composer.parallel.slices import load_full_state_dict
from megatron_composer.parallel.vocab_parallel import (
    vocab_parallel_argmax,
    vocab_parallel_cross_entropy,
    vocab_parallel_kl,
    vocab_parallel_log_softmax,
    vocab_parallel_logprobs,
    vocab_parallel_logprobs_entropy,
)

__all__ = [
    "ParallelConfig", "ParallelDims", "ParallelGroups", "ColumnParallelLinear", "RowParallelLinear", "ShardSpec",
    "VocabParallelEmbedding", "spec_of", "full_state_dict", "load_full_state_dict", "vocab_parallel_argmax",
    "vocab_parallel_cross_entropy", "vocab_parallel_kl", "vocab_parallel_log_softmax", "vocab_parallel_logprobs",
    "vocab_parallel_logprobs_entropy", "DistributedAdamW", "cp_shift_left", "shard_sequence", "unshard_sequence",
    "AllToAllDispatcher", "parallelize_model", "shard_batch", "validate_layout",
]
