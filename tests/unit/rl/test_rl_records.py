"""Rollout group records on disk (rl/rollout/records.py): a round trip keeps every field, routing is stored as
uint8/int16, the header alone gives each segment's sizes, a segment's arrays are read only on load, and a file
that is not a record fails in one line without unpickling anything."""

from __future__ import annotations

import io

import pytest
import torch

from rl.rollout import records


def _group(experts: int, gid: int = 3) -> dict:
    g = torch.Generator().manual_seed(gid)
    segs = []
    for P, R in ((4, 6), (3, 5)):
        mask = [1, 1, 0, 0, 1, 1][:R]
        segs.append({"prompt_ids": torch.randint(0, 1000, (P,), generator=g).tolist(),
                     "response_ids": torch.randint(0, 1000, (R,), generator=g).tolist(),
                     "response_logprobs": [-0.25 * i if m else 0.0 for i, m in enumerate(mask)],
                     "response_mask": mask, "weight_versions": [7] * sum(mask),
                     "routed_experts": torch.randint(0, experts, (2, P + R, 4), generator=g)})
    return {"gid": gid, "prompt_index": 1, "attempt": 0, "task": "t", "kind": "agent", "worker": "w0",
            "episodes": [{"reward": 0.5, "verifier_reward": 1.0, "reward_terms": {"length_penalty": -0.5},
                          "meta": {"turns": 2, "transcript": [{"role": "user", "content": "hi «x»"}]},
                          "segments": segs},
                         {"reward": 0.0, "verifier_reward": 0.0, "reward_terms": {}, "meta": {}, "segments": []}],
            "infra_faults": 0, "version_counts": {7: 6}, "min_weight_version": 7, "eval_version": None,
            "seconds": 1.5}


@pytest.mark.parametrize("experts,dtype", [(64, torch.uint8), (384, torch.int16)])
def test_round_trip_keeps_every_field_and_routing_is_narrow(tmp_path, experts, dtype):
    group = _group(experts)
    path = tmp_path / "g.group"
    path.write_bytes(records.encode_group(group))
    back = records.read_group(path)
    for key in ("gid", "prompt_index", "task", "kind", "worker", "infra_faults", "min_weight_version", "seconds"):
        assert back[key] == group[key]
    assert back["version_counts"] == {"7": 6}  # JSON keys; readers take int(v)
    for ep, want in zip(back["episodes"], group["episodes"]):
        assert (ep["reward"] == want["reward"] and ep["meta"] == want["meta"]
                and ep["reward_terms"] == want["reward_terms"])
        for seg, w in zip(ep["segments"], want["segments"]):
            for k in ("prompt_ids", "response_ids", "response_logprobs", "response_mask", "weight_versions"):
                assert seg[k] == w[k], k
            assert torch.equal(seg["routed_experts"], w["routed_experts"])
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        assert f.get_tensor("e0.s0.routed_experts").dtype == dtype


def test_the_header_gives_sizes_and_arrays_are_read_on_load(tmp_path):
    path = tmp_path / "g.group"
    path.write_bytes(records.encode_group(_group(64)))
    before = records.bytes_read.bytes
    index = records.read_group_index(path)
    header = records.bytes_read.bytes - before
    seg = index["episodes"][0]["segments"][1]
    assert (seg.prompt_len, seg.response_len, seg.loss_tokens, seg.routing_shape) == (3, 5, 3, [2, 8, 4])
    assert header < path.stat().st_size
    before = records.bytes_read.bytes
    loaded = seg.load()
    assert records.bytes_read.bytes - before == seg.nbytes == 3 * 4 + 5 * 4 + 5 * 4 + 5 + 3 * 4 + 2 * 8 * 4
    assert loaded["response_mask"] == [1, 1, 0, 0, 1]


def test_bad_records_and_foreign_files_fail_in_one_line(tmp_path):
    bad = _group(64)
    bad["episodes"][0]["segments"][0]["response_mask"] = [1]
    with pytest.raises(records.RecordError, match="one entry per response token"):
        records.encode_group(bad)
    bad = _group(64)
    bad["episodes"][0]["segments"][0]["routed_experts"] = torch.zeros(2, 3, 4, dtype=torch.long)
    with pytest.raises(records.RecordError, match=r"routed_experts must be \[layers, 10, top_k\]"):
        records.encode_group(bad)
    pickled = tmp_path / "old.pt"
    buf = io.BytesIO()
    torch.save(_group(64), buf)  # the former format: a pickle, which a record reader never loads
    pickled.write_bytes(buf.getvalue())
    with pytest.raises(records.RecordError, match="is not a rollout group file"):
        records.read_group_index(pickled)
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(records.RecordError, match="not a rollout group file of format"):
        records.read_group_index(tmp_path / "other.safetensors")
