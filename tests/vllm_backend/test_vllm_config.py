"""rollout.backend=vllm is refused in one line, before any work, where it cannot run: an unknown backend, and
vLLM not installed. Router replay of the engine's experts (R3) is accepted: the vLLM backend returns them."""

from __future__ import annotations

import importlib.util

import pytest

from megatron_composer.config import ConfigError, load_config


def _cfg(**over):
    from rl.config import RLConfig

    return load_config(RLConfig, None, [f"{k}={v}" for k, v in over.items()])


def test_vllm_backend_config():
    for replay in ("r3", "r2", "'off'"):
        _cfg(**{"rollout.backend": "vllm", "rl.router_replay": replay}).validate()
    with pytest.raises(ConfigError, match="rollout.backend='sglang'"):
        _cfg(**{"rollout.backend": "sglang"}).validate()
    # vLLM's own layout knobs: cache split over dcp GPUs, INT4 experts
    _cfg(**{"rollout.backend": "vllm", "rollout.ep": 8, "rollout.dcp": 8,
            "rollout.quantize_experts": "int4"}).validate()
    with pytest.raises(ConfigError, match="rollout.dcp=3 must divide the engine's tp x ep = 8 GPUs"):
        _cfg(**{"rollout.backend": "vllm", "rollout.ep": 8, "rollout.dcp": 3}).validate()
    with pytest.raises(ConfigError, match="rollout.quantize_experts='fp4'"):
        _cfg(**{"rollout.backend": "vllm", "rollout.quantize_experts": "fp4"}).validate()
    with pytest.raises(ConfigError, match="rollout.dcp and rollout.quantize_experts are vLLM's"):
        _cfg(**{"rollout.dcp": 2, "rollout.tp": 2}).validate()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_missing_vllm_is_one_line(tmp_path):
    from rl.launch import run_rl
    from tests.rl_assets import write_rl_assets

    rl_assets = write_rl_assets(tmp_path, [("Say hi.", r"[\s\S]*hi[\s\S]*")])

    cfg = _cfg(**{"rollout.backend": "vllm", "rl.router_replay": "r2", "run.dir": tmp_path / "run",
                  "data.tokenizer": rl_assets / "tok", "data.tasks": rl_assets / "tasks"})
    with pytest.raises(ConfigError, match="needs vLLM: .*make test-vllm") as e:
        run_rl(cfg)
    assert "\n" not in str(e.value)


def test_a_vllm_engine_is_one_launched_process():
    """vLLM starts its own tp x ep workers: a launch needs one rollout process per engine, not tp x ep."""
    vllm_ep8 = {"rollout.backend": "vllm", "rollout.ep": 8}
    _cfg(**vllm_ep8).check_runnable(world=2)            # one trainer rank + one vLLM rollout process
    _cfg(role="rollout", **vllm_ep8).check_runnable(world=3)
    with pytest.raises(ConfigError, match="8 processes per engine does not divide"):
        _cfg(**{"rollout.ep": 8}).check_runnable(world=2)  # the project's engine: 8 processes per engine
