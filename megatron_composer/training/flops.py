"""Training FLOPs of MoE / MLA transformers and the peak they are measured against (MFU)."""

from __future__ import annotations

import time

import torch


def training_flops_per_token(cfg, seq_length: int, include_mtp: bool = True) -> float:
    """Forward+backward FLOPs per trained token: 6 x active matmul parameters plus causal attention scores.

    Active parameters count only the routed experts a token is sent to (num_experts_per_tok of them), the
    shared experts, MLA's low-rank projections and the output head; the embedding lookup is free. Attention
    adds 2 x heads x (qk_dim + v_dim) x context per layer forward, with context ~ seq/2 under a causal mask.
    """
    from megatron_composer.model import count_parameters

    counts = count_parameters(cfg, include_mtp=include_mtp)
    matmul_params = counts["active"] - cfg.vocab_size * cfg.hidden_size  # embedding is a lookup
    if cfg.attention == "mla":
        qk, v = cfg.qk_head_dim, cfg.v_head_dim
    else:
        qk = v = cfg.gqa_head_dim
    layers = cfg.num_layers + (cfg.num_mtp_layers if include_mtp else 0)
    attn = 2 * cfg.num_heads * (qk + v) * (seq_length / 2) * layers
    return 6 * matmul_params + 3 * attn


_KNOWN_PEAKS_BF16 = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "B200": 2250e12, "B300": 2250e12, "A100": 312e12,
                     "GH200": 989e12}


def measure_matmul_peak(device: torch.device, dtype: torch.dtype, seconds: float = 1.0, n: int = 1024) -> float:
    """FLOP/s of an n x n x n matmul on random data on this device: the same-machine baseline MFU is quoted against.

    On CUDA the products are timed with device events in batches (median batch; launches queue ahead of the
    device, so a host clock would measure the queue); on CPU with the host clock for about `seconds`."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        per_product = max(start.elapsed_time(end) / 1e3, 1e-6)
        batch = max(1, min(100, int(seconds / 10 / per_product)))  # ten batches in about `seconds`
        times = []
        for _ in range(10):
            start.record()
            for _ in range(batch):
                a @ b
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / batch)
        return 2 * n**3 / sorted(times)[len(times) // 2]
    iters, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        iters += 1
    return 2 * n**3 * iters / (time.perf_counter() - t0)


def peak_flops(device: torch.device, dtype: torch.dtype, configured: float = 0.0) -> tuple[float, str]:
    """(peak FLOP/s per device, where it came from): the configured value, a known GPU's datasheet, or a measurement."""
    if configured > 0:
        return configured, "configured"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in _KNOWN_PEAKS_BF16.items():
            if key in name:
                return value, f"{key} bf16 dense datasheet"
    return measure_matmul_peak(device, dtype), f"measured {dtype} matmul on {device.type}"
