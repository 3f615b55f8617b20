"""check_meta on a stage chain's rope: a stage that extends its weights' context (the tiny chain: no scaling at
128 -> YaRN factor 2 at 256 -> factor 8 at 1024) loads them; a rope that reaches less far than theirs, or
another architecture, is refused naming both."""

import json

import pytest

from megatron_composer.checkpoint.dcp import CheckpointError, check_meta


def _ckpt(tmp_path, rope):
    (tmp_path / "meta.json").write_text(json.dumps({"model": {"hidden_size": 128, "rope_scaling": rope}}))
    return tmp_path


def _yarn(factor, original):
    return {"factor": factor, "original_max_position_embeddings": original}


@pytest.mark.parametrize("saved,want", [(None, _yarn(2.0, 128)), (_yarn(2.0, 128), _yarn(8.0, 128))])
def test_a_stage_that_extends_the_weights_context_loads_them(tmp_path, saved, want):
    check_meta(_ckpt(tmp_path, saved), {"model": {"hidden_size": 128, "rope_scaling": want}})


def test_a_shorter_or_dropped_rope_and_another_architecture_are_refused(tmp_path):
    ckpt = _ckpt(tmp_path, _yarn(2.0, 32))
    with pytest.raises(CheckpointError, match="YaRN factor 2.0 over 32 .* YaRN factor 1.0 over 32"):
        check_meta(ckpt, {"model": {"hidden_size": 128, "rope_scaling": _yarn(1.0, 32)}})
    with pytest.raises(CheckpointError, match="YaRN factor 2.0 over 32 .* no rope scaling"):
        check_meta(ckpt, {"model": {"hidden_size": 128, "rope_scaling": None}})
    with pytest.raises(CheckpointError, match="hidden_size: checkpoint 128 vs config 64"):
        check_meta(ckpt, {"model": {"hidden_size": 64, "rope_scaling": _yarn(4.0, 32)}})
