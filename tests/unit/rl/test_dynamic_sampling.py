"""Dynamic sampling (rl.refill_groups): a step's groups whose rewards are all equal are replaced by newly drawn
groups, at most refill_groups more per step; replaced groups are released untrained and counted."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_composer.config import ConfigError
from rl.trainer import Trainer


class Orchestrator:
    def __init__(self, groups):
        self.groups, self.released = list(groups), []

    def next_groups(self, n, version, alive=None):
        out, self.groups = self.groups[:n], self.groups[n:]
        return out

    def step_trained(self, groups):
        self.released += groups


def _group(gid, rewards):
    return {"gid": gid, "episodes": [{"reward": r} for r in rewards]}


def _trainer(groups, per_step, refill):
    t = Trainer.__new__(Trainer)  # only what drawing a step's groups touches
    t.cfg = SimpleNamespace(train=SimpleNamespace(groups_per_step=per_step), rl=SimpleNamespace(refill_groups=refill))
    t.version, t.orchestrator, t.workers = 3, Orchestrator(groups), []
    return t


FLAT, MIXED = [0.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]


def test_equal_reward_groups_are_replaced_within_the_budget():
    t = _trainer([_group(0, FLAT), _group(1, MIXED), _group(2, [1.0] * 4), _group(3, FLAT), _group(4, MIXED),
                  _group(5, MIXED), _group(6, MIXED)], per_step=3, refill=3)
    got = t._draw_groups()
    # 0 and 2 replaced by 3 and 4; 3 is flat again and replaced by 5 (the budget of 3 draws is then spent)
    assert [g["gid"] for g in got] == [1, 4, 5]
    assert sorted(g["gid"] for g in t.orchestrator.released) == [0, 2, 3]
    assert t._refill == {"refilled_groups": 3.0, "equal_reward_groups_replaced": 3.0}
    assert [g["gid"] for g in t.orchestrator.groups] == [6]  # nothing drawn beyond the budget


def test_budget_spent_or_epoch_over_trains_what_there_is():
    t = _trainer([_group(0, FLAT), _group(1, FLAT), _group(2, FLAT)], per_step=2, refill=1)
    assert [g["gid"] for g in t._draw_groups()] == [1, 2]  # one replacement, itself flat: trained anyway
    t = _trainer([_group(0, FLAT), _group(1, MIXED)], per_step=2, refill=4)
    assert [g["gid"] for g in t._draw_groups()] == [0, 1]  # end of the epoch: nothing to draw
    assert t._refill == {"refilled_groups": 0.0, "equal_reward_groups_replaced": 0.0}
    t = _trainer([_group(0, FLAT), _group(1, MIXED)], per_step=2, refill=0)
    assert [g["gid"] for g in t._draw_groups()] == [0, 1]


def test_refill_groups_must_not_be_negative():
    from rl.algorithm.config import RLObjectiveConfig

    with pytest.raises(ConfigError, match="rl.refill_groups must be >= 0"):
        RLObjectiveConfig(refill_groups=-1).validate()
