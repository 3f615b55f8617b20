"""compressed-tensors "pack-quantized" INT4 weights (W4A16), the format Kimi K2.5 / K2 Thinking ship their routed
experts in: the format, its reference dequantisation on any box, and the quantiser our export and QAT use.

A quantised `X.weight` [out, in] is stored as three tensors:
    X.weight_packed  int32 [out, in/8]   eight signed 4-bit values q in [-8, 7] per word, stored as q + 8,
                                         element j of a row in bits 4*(j % 8) .. 4*(j % 8) + 3 of word j // 8
    X.weight_scale   bf16  [out, in/32]  one scale per group of 32 consecutive inputs (symmetric: no zero point)
    X.weight_shape   int32 [2]           [out, in]
and the weight is q * scale of its group. config.json's `quantization_config` names the scheme
(quant_method "compressed-tensors", format "pack-quantized", weights: 4-bit int, symmetric, strategy "group",
group_size 32) and an `ignore` list of modules kept in bf16 (attention, shared experts, the dense layers, the
head). Only that scheme is read or written here; any other is refused by name.

Our quantiser (`quantize`) keeps every group that is already on an INT4 grid -- ours or another quantiser's -- on
that grid exactly, and otherwise takes the smallest bf16 scale that clips nothing: an imported INT4 model computes
what was released under INT4 QAT (training/qat.py), and its export writes the values it computes with.
"""

from __future__ import annotations

import torch

from .errors import CheckpointError

GROUP = 32
BITS = 4
PER_WORD = 32 // BITS
SUFFIXES = (".weight_packed", ".weight_scale", ".weight_shape")
# tensors of other compressed-tensors schemes: their presence means a scheme this reader does not implement
OTHER_SUFFIXES = (".weight_zero_point", ".weight_g_idx", ".weight_global_scale", ".input_scale")
SUPPORTED = "compressed-tensors pack-quantized INT4 (4-bit int, symmetric, group 32: W4A16, as Kimi K2.5 ships)"


def quantization_config(hf: dict) -> dict | None:
    """config.json's quantization_config (at the top, or in a multimodal model's text_config)."""
    return hf.get("quantization_config") or (hf.get("text_config") or {}).get("quantization_config")


def read_scheme(hf: dict, where: str) -> dict | None:
    """A config.json's quantization_config once checked to be the INT4 scheme read here; None when it declares no
    quantization (or DeepSeek's FP8, which the reader handles by its tensors); a one-line CheckpointError naming
    any scheme it cannot read."""
    q = quantization_config(hf)
    if not q or q.get("quant_method") == "fp8":
        return None
    method, fmt = q.get("quant_method"), q.get("format")
    if method != "compressed-tensors" or fmt != "pack-quantized":
        raise CheckpointError(f"{where}: quantization {method!r} format {fmt!r} is not supported; supported: "
                              f"{SUPPORTED}, and DeepSeek's FP8 blocks")
    groups = q.get("config_groups") or {}
    for name, group in groups.items():
        w = group.get("weights") or {}
        scheme = (f"{w.get('num_bits')}-bit {w.get('type')}, {'symmetric' if w.get('symmetric') else 'asymmetric'}, "
                  f"strategy {w.get('strategy')}, group {w.get('group_size')}"
                  + (", dynamic" if w.get("dynamic") else "")
                  + (", quantised activations" if group.get("input_activations") else ""))
        ok = (w.get("num_bits") == BITS and w.get("type") == "int" and w.get("symmetric") is True
              and w.get("strategy") == "group" and w.get("group_size") == GROUP and not w.get("dynamic")
              and not w.get("actorder") and not group.get("input_activations"))
        if not ok:
            raise CheckpointError(f"{where}: quantization_config group {name!r} is {scheme}; supported: {SUPPORTED}")
    if not any(group.get("targets") for group in groups.values()):
        raise CheckpointError(f"{where}: quantization_config has no config_groups with targets; supported: {SUPPORTED}")
    return q


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """int32 words [..., W] -> the signed 4-bit values q [..., 8 W] (int8), element j in bits 4 (j % 8) of word
    j // 8."""
    shifts = torch.arange(0, 32, BITS, dtype=torch.int32, device=packed.device)
    nibbles = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF
    return (nibbles.flatten(-2) - 8).to(torch.int8)


def pack(q: torch.Tensor) -> torch.Tensor:
    """The signed 4-bit values q [..., n] (n a multiple of 8, values in [-8, 7]) -> int32 words [..., n / 8]."""
    if q.shape[-1] % PER_WORD:
        raise ValueError(f"cannot pack {q.shape[-1]} values per row into int32 words of {PER_WORD}")
    nibbles = (q.to(torch.int64) + 8).view(*q.shape[:-1], -1, PER_WORD)
    shifts = torch.arange(0, 32, BITS, dtype=torch.int64, device=q.device)
    words = (nibbles << shifts).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)  # the bit pattern as int32


def dequantize_box(packed: torch.Tensor, scale: torch.Tensor, cols: range) -> torch.Tensor:
    """The columns `cols` (of the full [out, in] weight) of the rows whose words `packed` [rows, words covering
    cols] and group scales `scale` [rows, groups covering cols] were read, in float32: q * scale."""
    first_word, first_group = cols.start // PER_WORD, cols.start // GROUP
    q = unpack(packed)[:, cols.start - first_word * PER_WORD:cols.stop - first_word * PER_WORD]
    group = torch.arange(cols.start, cols.stop) // GROUP - first_group
    return q.float() * scale.float()[:, group]


def _bf16_at_least(x: torch.Tensor) -> torch.Tensor:
    """The smallest bf16 number >= x (x >= 0), as bf16."""
    b = x.to(torch.bfloat16)
    up = (b.view(torch.int16) + 1).view(torch.bfloat16)  # the next bf16 above a positive value
    return torch.where(b.float() < x, up, b)


def _exact(g: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Per group: every value is q * s with an integer q in [-8, 7]."""
    q = torch.round(g / s.unsqueeze(-1))
    return ((q * s.unsqueeze(-1) == g) & (q >= -8) & (q <= 7)).all(-1)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., in] (in a multiple of 32) -> (q int8 [..., in], scale bf16 [..., in / 32]).

    Each group's scale is the smallest bf16 number s >= need = max(max(w) / 7, -min(w) / 8) (so nothing clips)
    at which the group is exactly q * s, if there is one, else the smallest bf16 number >= need. So a group on any
    INT4 grid -- ours, or another quantiser's such as compressed-tensors' min/max calibration -- keeps its values
    (a model imported from an INT4 checkpoint, exported or trained with QAT, computes what was released), and
    quantising is idempotent. Only the candidates an on-grid group can have are tried (its extreme divided by 1..8),
    after a per-group test of both extremes, so weights on no grid cost one extra pass."""
    if w.shape[-1] % GROUP:
        raise ValueError(f"INT4 groups of {GROUP} do not divide the input dimension {w.shape[-1]}")
    g = w.float().reshape(*w.shape[:-1], -1, GROUP)
    top, bottom = g.amax(-1).clamp_min(0), (-g.amin(-1)).clamp_min(0)
    need = torch.maximum(top / 7, bottom / 8)
    scale = _bf16_at_least(need).float()
    done = _exact(g, torch.where(scale > 0, scale, 1.0)) | (need == 0)
    if not bool(done.all()):
        steps = torch.arange(1, 9, dtype=torch.float32, device=w.device)
        cands = torch.cat([top.unsqueeze(-1) / steps[:7], bottom.unsqueeze(-1) / steps], -1)  # [..., G, 15]
        ok = (cands > 0) & (cands >= need.unsqueeze(-1)) & (cands.to(torch.bfloat16).float() == cands)
        for extreme in (top, bottom):  # both extremes whole multiples: a per-group test before any full one
            ratio = extreme.unsqueeze(-1) / torch.where(ok, cands, 1.0)
            ok &= torch.round(ratio) == ratio
        cands = torch.where(ok & ~done.unsqueeze(-1), cands, float("inf")).sort(-1).values
        for j in range(cands.shape[-1]):
            s = cands[..., j]
            try_ = torch.isfinite(s) & ~done
            if not bool(try_.any()):
                break
            hit = try_.clone()
            hit[try_] = _exact(g[try_], s[try_])
            scale = torch.where(hit, s, scale)
            done |= hit
    s = scale.unsqueeze(-1)
    q = torch.where(s > 0, torch.round(g / torch.where(s > 0, s, 1.0)), 0.0).clamp(-8, 7)
    return q.reshape(w.shape).to(torch.int8), scale.to(torch.bfloat16)


PART_DTYPES = {".weight_packed": torch.int32, ".weight_scale": torch.bfloat16, ".weight_shape": torch.int64}


def hub_parts(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """One matrix w [out, in] as its pack-quantized checkpoint tensors, by suffix (SUFFIXES), in PART_DTYPES."""
    parts = {**served_parts(w), ".weight_shape": torch.tensor(list(w.shape), dtype=torch.int64)}
    return {k: t.to(PART_DTYPES[k]) for k, t in parts.items()}


def fake_quantize(w: torch.Tensor) -> torch.Tensor:
    """w on the INT4 grid (q * scale, in w's dtype) -- the weight an INT4 server computes with."""
    q, scale = quantize(w)
    groups = q.float().reshape(*w.shape[:-1], -1, GROUP) * scale.float().unsqueeze(-1)
    return groups.reshape(w.shape).to(w.dtype)


# A routed expert tensor as an engine serving INT4 experts holds it, and as a rollout version carries it: the packed
# words and the group scales of every expert (the shape part is constant and not sent).
SERVED_PARTS = (".weight_packed", ".weight_scale")


def is_routed_expert(name: str) -> bool:
    """Our name of a stacked routed-expert tensor [E, out, in] (`...feed_forward.experts.w1|w2|w3`)."""
    parts = name.split(".")
    return len(parts) >= 3 and parts[-3:-1] == ["feed_forward", "experts"]


def served_shape(shape, suffix: str) -> list[int]:
    """The shape of a served part (SERVED_PARTS) of a weight of `shape` [..., in]: in / 8 words, or in / 32
    scales."""
    per = {".weight_packed": PER_WORD, ".weight_scale": GROUP}[suffix]
    if shape[-1] % GROUP:
        raise ValueError(f"INT4 groups of {GROUP} do not divide the input dimension {shape[-1]}")
    return [*shape[:-1], shape[-1] // per]


def served_parts(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """w [..., in] (any box whose input columns start and end on a group boundary) as its served parts, by
    suffix: what `hub_parts` gives for each matrix of it, so a box of a stacked expert tensor quantised on its
    own equals the same box of the whole tensor's export."""
    q, scale = quantize(w)
    return {".weight_packed": pack(q), ".weight_scale": scale}


def served_tensors(tensors) -> dict[str, torch.Tensor]:
    """A state dict (our names, full tensors) with every routed-expert tensor replaced by its served parts."""
    out = {}
    for name, t in tensors.items():
        if is_routed_expert(name):
            out.update({name + suffix: part for suffix, part in served_parts(t).items()})
        else:
            out[name] = t
    return out


EXPERTS_TARGET = r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"


def quantization_config_for_experts() -> dict:
    """The config.json quantization_config of an export whose routed experts (and only they) are INT4."""
    weights = {"num_bits": BITS, "type": "int", "symmetric": True, "group_size": GROUP, "strategy": "group",
               "dynamic": False, "actorder": None, "block_structure": None, "observer": "minmax"}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": [EXPERTS_TARGET], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}


__all__ = ["EXPERTS_TARGET", "GROUP", "OTHER_SUFFIXES", "SERVED_PARTS", "SUFFIXES", "SUPPORTED",
           "dequantize_box", "fake_quantize", "is_routed_expert", "pack", "quantization_config",
           "quantization_config_for_experts", "quantize", "read_scheme", "served_parts", "served_shape",
           "served_tensors", "unpack"]
