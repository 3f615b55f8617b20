"""Every shipped stage config loads, and the real-size layouts fit their intended cluster and model."""

from pathlib import Path

import pytest

from megatron_composer.config import ConfigError, load_config
from megatron_composer.model import get_preset
from megatron_composer.parallel import ParallelDims, validate_layout
from pretrain.trainer import PretrainConfig

ROOT = Path(__file__).resolve().parents[3]
WORLD = {"kimi_k25": 512, "qwen3_30b_a3b": 64, "tiny": 2, "tiny/agent": 2}


@pytest.mark.parametrize("path", sorted(p for d in WORLD for p in (ROOT / "examples" / d).glob("*.yaml")
                                        if not p.name.startswith("rl")),
                         ids=lambda p: str(p.relative_to(ROOT / "examples")))
def test_stage_config_is_valid_for_its_cluster(path):
    cfg = load_config(PretrainConfig, path)
    mc = get_preset(cfg.model.preset)
    mc = mc.replace(vocab_size=cfg.model.vocab_size or mc.vocab_size, **cfg.model.overrides)
    dims = ParallelDims.from_config(cfg.parallel, WORLD[str(path.parent.relative_to(ROOT / "examples"))])
    validate_layout(dims, mc, seq_len=cfg.data.seq_length)
    global_seqs = cfg.train.global_batch_tokens // cfg.data.seq_length
    assert global_seqs % (cfg.train.micro_batch_size * dims.dp) == 0
    if cfg.model.yarn_original_length:
        assert cfg.data.seq_length / cfg.model.yarn_original_length >= 1


def test_long_context_stages_extend_with_yarn_and_context_parallel():
    for family in ("tiny", "kimi_k25", "qwen3_30b_a3b"):
        main = load_config(PretrainConfig, next((ROOT / "examples" / family).glob("pretrain*.yaml")))
        lc = load_config(PretrainConfig, next((ROOT / "examples" / family).glob("long_context*.yaml")))
        assert lc.data.seq_length > main.data.seq_length and lc.parallel.cp > 1
        assert lc.checkpoint.init_from == "previous"


def test_unknown_key_is_one_clear_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match="did you mean 'train.steps'"):
        load_config(PretrainConfig, bad)


def test_help_prints_the_schema():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, str(ROOT / "pretrain_composer.py"), "--help"], capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 0
    for key in ("run:", "dir:", "train:", "steps:", "seed:", "checkpoint:", "interval:", "parallel:", "tp:", "cp:",
                "ep:", "mtp:", "fp8:"):
        assert key in r.stdout, key
