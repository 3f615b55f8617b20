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


def test_a_tensor_stored_with_another_shape_or_missing_is_refused_before_anything_loads(tmp_path):
    """The stored global shapes are checked against what the run loads: a mismatch or a missing tensor is one
    CheckpointError naming the tensor and both layouts, and the live weights stay as they were."""
    import torch

    from megatron_composer.checkpoint.dcp import load_checkpoint, save_checkpoint
    from megatron_composer.model import Transformer, get_preset

    cfg = get_preset("tiny-deepseek-v3").replace(num_layers=2, vocab_size=256)
    torch.manual_seed(0)
    saved = Transformer(cfg)
    save_checkpoint(tmp_path, 1, saved, torch.optim.AdamW(saved.parameters()), {"step": 1}, {"model": {}})
    ckpt = tmp_path / "checkpoints" / "step_1"
    assert json.loads((ckpt / "meta.json").read_text())["layout"] == "1 rank"

    other = Transformer(cfg.replace(vocab_size=320))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"saved under 1 rank\) stores 'model.tok_embeddings.weight' as "
                                              r"\(256, 128\), but this run \(1 rank\) needs the full tensor "
                                              r"\(320, 128\)"):
        load_checkpoint(ckpt, other, torch.optim.AdamW(other.parameters()))
    assert all(torch.equal(v, other.state_dict()[k]) for k, v in before.items())

    deeper = Transformer(cfg.replace(num_layers=3))
    with pytest.raises(CheckpointError, match=r"has no weights 'model.layers.2.attention_norm.weight'"):
        load_checkpoint(ckpt, deeper, None)
