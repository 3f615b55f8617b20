"""Single-epoch prompt sampler: every prompt is used once, each with a fixed group of G samples.

The order is a seeded permutation of the prompt indices; the sampler's whole state is (seed, num_prompts,
position), so a resumed run continues with exactly the prompts the interrupted run had not drawn.
"""

from __future__ import annotations

from typing import Iterator

import torch


class PromptSampler:
    """Draws ``prompts_per_step`` new prompt indices per step from a seeded permutation, never repeating.

    ``next_batch()`` returns the prompt indices of one step; ``expand(indices)`` repeats each G times (the
    rollout order: group by group). A final batch smaller than ``prompts_per_step`` is returned unless
    ``drop_last``; after the last batch ``next_batch`` raises StopIteration.
    """

    def __init__(self, num_prompts: int, prompts_per_step: int, group_size: int, seed: int = 0,
                 drop_last: bool = False):
        if num_prompts <= 0:
            raise ValueError(f"the prompt set is empty (num_prompts={num_prompts}); "
                             "point the RL data at a non-empty file")
        if prompts_per_step <= 0:
            raise ValueError(f"prompts_per_step must be positive, got {prompts_per_step}")
        if group_size <= 0:
            raise ValueError(f"group_size must be positive, got {group_size}")
        self.num_prompts = num_prompts
        self.prompts_per_step = prompts_per_step
        self.group_size = group_size
        self.seed = seed
        self.drop_last = drop_last
        self.position = 0
        generator = torch.Generator().manual_seed(seed)
        self._order = torch.randperm(num_prompts, generator=generator).tolist()

    def __len__(self) -> int:
        """Number of batches left."""
        left = self.num_prompts - self.position
        return left // self.prompts_per_step if self.drop_last else -(-left // self.prompts_per_step)

    def next_batch(self) -> list[int]:
        if len(self) == 0:
            raise StopIteration
        batch = self._order[self.position: self.position + self.prompts_per_step]
        self.position += len(batch)
        return batch

    def __iter__(self) -> Iterator[list[int]]:
        while len(self) > 0:
            yield self.next_batch()

    def expand(self, prompt_indices: list[int]) -> list[int]:
        """[p0, p1] -> [p0] * G + [p1] * G."""
        return [p for p in prompt_indices for _ in range(self.group_size)]

    def state_dict(self) -> dict:
        return {"seed": self.seed, "num_prompts": self.num_prompts, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed or state["num_prompts"] != self.num_prompts:
            raise ValueError(
                f"sampler state is for seed={state['seed']}, num_prompts={state['num_prompts']} but this run has "
                f"seed={self.seed}, num_prompts={self.num_prompts}; resume with the same prompt set and train.seed")
        if not 0 <= state["position"] <= self.num_prompts:
            raise ValueError(f"sampler state position {state['position']} is outside 0..{self.num_prompts}")
        self.position = int(state["position"])
