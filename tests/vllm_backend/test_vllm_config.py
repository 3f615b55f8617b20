"""rollout.backend=vllm is refused in one line, before any work, where it cannot run: an unknown backend, vLLM not
installed, and an MLA model on a CPU without AMX (which vLLM's CPU build cannot serve). Router replay of the engine's
experts (R3) is accepted: the vLLM backend returns them."""

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
                  "data.tokenizer": rl_assets / "tok", "data.tasks": rl_assets / "tasks",
                  "model.preset": "tiny-qwen3-moe"})
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


def test_data_parallel_attention_is_one_process_per_gpu_each_a_worker():
    """vllm_layout=dp_attention: rollout.ep engine processes per engine, each its own worker (never a Lockstep
    follower); refused in one line with tp, dcp, fewer than 2 ranks or the project's engine."""
    from rl.rollout.launch import WorkerMode, worker_mode

    dp = {"rollout.backend": "vllm", "rollout.vllm_layout": "dp_attention", "rollout.ep": 2}
    cfg = _cfg(**dp).validate()
    assert cfg.rollout.engine_ranks == 2
    cfg.check_runnable(world=3)  # one trainer rank + one engine of 2 ranks
    assert [worker_mode(cfg, r, 3) for r in range(3)] == [WorkerMode.NONE, WorkerMode.PROCESS, WorkerMode.PROCESS]
    with pytest.raises(ConfigError, match="2 processes per engine does not divide"):
        _cfg(**dp).validate().check_runnable(world=2)
    for bad in ({"rollout.tp": 2}, {"rollout.dcp": 2}, {"rollout.ep": 1}, {"rollout.backend": "engine"}):
        with pytest.raises(ConfigError, match="vllm_layout=dp_attention is vLLM's data-parallel attention"):
            _cfg(**{**dp, **bad}).validate()
    with pytest.raises(ConfigError, match="rollout.vllm_layout='dp'"):
        _cfg(**{**dp, "rollout.vllm_layout": "dp"}).validate()


def test_mla_on_a_cpu_without_amx_is_refused_before_any_work(tmp_path, monkeypatch):
    """vLLM's CPU build serves MLA only with AMX tiles; without them it fails deep in its first decode step (and
    leaves its process-global state behind). The run stops first, in one line that says what works instead."""
    import torch

    from megatron_composer.inference import vllm_engine
    from megatron_composer.model import get_preset
    from rl.launch import run_rl
    from tests.rl_assets import write_rl_assets

    mla, gqa = get_preset("tiny-deepseek-v3"), get_preset("tiny-qwen3-moe")
    if torch.cuda.is_available():
        assert vllm_engine.cpu_serving_problem(mla, flags=set()) is None  # GPUs serve MLA
        return
    epyc = {"avx512f", "avx512_bf16", "avx512_vnni"}
    assert "AMX" in vllm_engine.cpu_serving_problem(mla, flags=epyc)
    assert vllm_engine.cpu_serving_problem(mla, flags=epyc | {"amx_tile", "amx_bf16"}) is None
    assert vllm_engine.cpu_serving_problem(gqa, flags=epyc) is None
    monkeypatch.setattr(vllm_engine, "cpu_flags", lambda: epyc)
    rl_assets = write_rl_assets(tmp_path, [("Say hi.", r"[\s\S]*hi[\s\S]*")])
    cfg = _cfg(**{"rollout.backend": "vllm", "run.dir": tmp_path / "run", "data.tokenizer": rl_assets / "tok",
                  "data.tasks": rl_assets / "tasks", "model.preset": "tiny-deepseek-v3"})
    with pytest.raises(ConfigError, match=r"rollout.backend=vllm: vLLM's CPU build serves MLA attention .* only on "
                                          r"CPUs with AMX .*model.preset=tiny-qwen3-moe") as e:
        run_rl(cfg)
    assert "\n" not in str(e.value) and not (tmp_path / "run").exists()


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    from megatron_composer.inference.vllm_engine import cpu_flags

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx512f amx_tile\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(str(info)) == {"fpu", "avx512f", "amx_tile"}
    assert cpu_flags(str(tmp_path / "missing")) is None
