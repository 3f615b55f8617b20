"""One rank of a world that does not exist: torch's fake process group (backend "fake": every collective returns
at once), so a layout of N ranks can be built and measured in one process (the dry runs, the cost model)."""

from __future__ import annotations

import contextlib
import os

import torch.distributed as dist


@contextlib.contextmanager
def fake_rank(world_size: int, rank: int = 0):
    """Join the fake process group as `rank` of `world_size` with the Python kernel paths (the ones a GPU takes;
    MEGATRON_COMPOSER_CPP=0), and leave it afterwards."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a fake world runs its own process group; call it outside torch.distributed")
    old_cpp = os.environ.get("MEGATRON_COMPOSER_CPP")
    os.environ["MEGATRON_COMPOSER_CPP"] = "0"
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        if old_cpp is None:
            os.environ.pop("MEGATRON_COMPOSER_CPP", None)
        else:
            os.environ["MEGATRON_COMPOSER_CPP"] = old_cpp
