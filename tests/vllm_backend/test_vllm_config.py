"""rollout.backend=vllm is refused in one line, before any work, where it cannot run: without vLLM installed,
and with router replay of the engine's experts (R3), which the vLLM backend does not return."""

from __future__ import annotations

import importlib.util

import pytest

from megatron_composer.config import ConfigError, load_config


def _cfg(**over):
    from rl.config import RLConfig

    return load_config(RLConfig, None, [f"{k}={v}" for k, v in over.items()])


def test_router_replay_r3_is_refused_with_vllm():
    with pytest.raises(ConfigError, match="rl.router_replay=r3 .* rollout.backend=vllm"):
        _cfg(**{"rollout.backend": "vllm"}).validate()
    _cfg(**{"rollout.backend": "vllm", "rl.router_replay": "r2"}).validate()
    with pytest.raises(ConfigError, match="rollout.backend='sglang'"):
        _cfg(**{"rollout.backend": "sglang"}).validate()


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
