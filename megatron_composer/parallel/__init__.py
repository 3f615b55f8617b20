"""Parallelism on one device mesh: tensor (+sequence), expert, context and data parallel.

Process groups come from `ParallelDims.build()` and are passed explicitly; nothing is global.
"""

from megatron_composer.parallel.dims import ParallelConfig, ParallelDims, ParallelGroups
from megatron_composer.parallel.layers import (ColumnParallelLinear, RowParallelLinear, ShardSpec,
                                               VocabParallelEmbedding, spec_of)
from megatron_composer.parallel.vocab_parallel import (vocab_parallel_cross_entropy, vocab_parallel_kl,
                                                       vocab_parallel_log_softmax, vocab_parallel_logprobs,
                                                       vocab_parallel_logprobs_entropy)
from megatron_composer.parallel.data_parallel import DistributedAdamW

__all__ = ["ParallelConfig", "ParallelDims", "ParallelGroups", "ColumnParallelLinear", "RowParallelLinear",
           "ShardSpec", "VocabParallelEmbedding", "spec_of", "vocab_parallel_cross_entropy", "vocab_parallel_kl",
           "vocab_parallel_log_softmax", "vocab_parallel_logprobs", "vocab_parallel_logprobs_entropy",
           "DistributedAdamW"]
