"""The output head fused with the weighted cross-entropy sum, computed by blocks of rows, with its reference
next to it.

    linear_cross_entropy_sum(h [N, D], weight [V, D], target [N], token_weight [N]) -> float32 scalar
        = sum_t token_weight[t] * -log softmax(h[t] @ weight^T)[target[t]]

The unfused path materialises the [N, V] logits and then their [N, V] gradient: on a CPU each is a fresh
allocation of tokens x vocab x 4 bytes (32 MiB for 1k tokens of an 8k vocabulary), too large for the
allocator to recycle, so both are page-faulted in on every step, and each crosses memory several times
(head matmul, cross-entropy forward, softmax backward, the two matmuls of the head's backward). Here each
block of rows makes its logits in one reused float32 buffer, turns them in place into the log-softmax, then
into the gradient (softmax minus one at the target, times the token weight), and feeds that straight into
the two backward matmuls while it is still in cache: dh for those rows, and dW accumulated over blocks.
Because the loss is a weighted *sum* (the trainer's form: masked sum, divided by global counts outside),
the gradient with respect to it is a scalar and the backward only scales the saved dh and dW; no [N, V]
tensor is ever made. Same FLOPs as the unfused path.

On CPU the row work of each block (log-softmax at the target, softmax minus one-hot, times the token weight)
is one C++ pass, csrc/cross_entropy.cpp, when it builds; the torch ops below stay its reference.

This is a training-loss kernel: it works out the gradients in the forward whenever autograd will want them
(grad mode on and an input requiring grad), and only the loss otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_composer.kernels.cpu import cpp

# float32 logits of one block of rows: on CPU 16 MiB (under glibc's 32 MiB ceiling for recycling freed
# blocks; 512 rows of an 8k vocabulary, where the head's matmuls with its short inner dimension run ~10% faster
# than at 256 rows); on accelerators ~1 GiB, where the point is only never to hold the whole logits and their
# gradient
_BLOCK_ELEMENTS = {"cpu": 1 << 22}
_DEVICE_BLOCK_ELEMENTS = 1 << 28
_MIN_ROWS = 16


def _rows_per_block(vocab: int, device: torch.device) -> int:
    return max(_MIN_ROWS, _BLOCK_ELEMENTS.get(device.type, _DEVICE_BLOCK_ELEMENTS) // max(vocab, 1))


def _rows_kernel(device: torch.device):
    return cpp.load("cross_entropy") if device.type == "cpu" else None


class _LinearCrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_ND, w_VD, target_N, token_weight_N, compute_dtype, want_grads):
        N, V = h_ND.shape[0], w_VD.shape[0]
        device = h_ND.device
        hc_ND, wc_VD = h_ND.to(compute_dtype), w_VD.to(compute_dtype)
        tw_N = token_weight_N.to(device=device, dtype=torch.float32)
        target_N1 = target_N.to(device=device, dtype=torch.long)[:, None]
        rows = min(N, _rows_per_block(V, device))
        buf_RV = torch.empty(rows, V, dtype=torch.float32, device=device)
        logp_N1 = torch.empty(N, 1, dtype=torch.float32, device=device)
        need_dh, need_dw = want_grads
        dh_ND = torch.empty(N, h_ND.shape[1], dtype=compute_dtype, device=device) if need_dh else None
        dw_VD = (torch.empty if N else torch.zeros)(V, w_VD.shape[1], dtype=torch.float32, device=device) \
            if need_dw else None
        rows_kernel = _rows_kernel(device)
        grad = need_dh or need_dw
        for a in range(0, N, rows):
            b = min(N, a + rows)
            x_RV = buf_RV[: b - a]
            if compute_dtype == torch.float32:
                torch.mm(hc_ND[a:b], wc_VD.t(), out=x_RV)
            else:
                x_RV.copy_(hc_ND[a:b] @ wc_VD.t())
            # d loss / d logits = token_weight * (softmax - onehot(target)), in place of the logits
            if rows_kernel is not None:
                logp_N1[a:b, 0] = rows_kernel.log_softmax_grad_rows(x_RV, target_N1[a:b, 0], tw_N[a:b], grad)
            else:
                torch.log_softmax(x_RV, dim=-1, out=x_RV)
                torch.gather(x_RV, 1, target_N1[a:b], out=logp_N1[a:b])
                if grad:
                    x_RV.exp_().scatter_add_(1, target_N1[a:b], x_RV.new_full((b - a, 1), -1.0)).mul_(tw_N[a:b, None])
            if not grad:
                continue
            g_RV = x_RV if compute_dtype == torch.float32 else x_RV.to(compute_dtype)
            if need_dh:
                torch.mm(g_RV, wc_VD, out=dh_ND[a:b])
            if need_dw:  # the first block writes dW, later ones add to it
                if compute_dtype == torch.float32:
                    if a == 0:
                        torch.mm(g_RV.t(), hc_ND[a:b], out=dw_VD)
                    else:
                        dw_VD.addmm_(g_RV.t(), hc_ND[a:b])
                else:
                    part_VD = g_RV.t() @ hc_ND[a:b]
                    if a == 0:
                        dw_VD.copy_(part_VD)
                    else:
                        dw_VD.add_(part_VD)
        ctx.save_for_backward(dh_ND, dw_VD)
        ctx.dtypes = (h_ND.dtype, w_VD.dtype)
        return -(logp_N1.squeeze(1) * tw_N).sum()

    @staticmethod
    def backward(ctx, grad):
        dh_ND, dw_VD = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        dh = None if dh_ND is None else (dh_ND * grad).to(h_dtype)
        dw = None if dw_VD is None else (dw_VD * grad).to(w_dtype)
        return dh, dw, None, None, None, None


def linear_cross_entropy_sum(h_ND: torch.Tensor, weight_VD: torch.Tensor, target_N: torch.Tensor,
                             token_weight_N: torch.Tensor) -> torch.Tensor:
    """sum_t token_weight[t] * cross_entropy(h[t] @ weight^T, target[t]) in float32.

    Under autocast the head's matmuls run in the autocast dtype, as an autocast F.linear would.
    Targets of tokens with weight 0 are not read (any id, e.g. -100, may stand there).
    """
    N, D = h_ND.shape if h_ND.dim() == 2 else (None, None)
    if h_ND.dim() != 2 or weight_VD.dim() != 2 or weight_VD.shape[1] != D or target_N.shape != (N,) \
            or token_weight_N.shape != (N,):
        raise ValueError(f"linear_cross_entropy_sum takes h [N, D], weight [V, D], target [N], token_weight [N]; "
                         f"got {tuple(h_ND.shape)}, {tuple(weight_VD.shape)}, {tuple(target_N.shape)}, "
                         f"{tuple(token_weight_N.shape)}")
    device_type = h_ND.device.type
    if torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)
    else:
        compute_dtype = torch.promote_types(h_ND.dtype, weight_VD.dtype)
    target_N = torch.where(token_weight_N != 0, target_N, 0)
    grad_on = torch.is_grad_enabled()
    want_grads = (grad_on and h_ND.requires_grad, grad_on and weight_VD.requires_grad)
    with torch.autocast(device_type, enabled=False):
        return _LinearCrossEntropySum.apply(h_ND, weight_VD, target_N, token_weight_N, compute_dtype, want_grads)


def reference_linear_cross_entropy_sum(h_ND: torch.Tensor, weight_VD: torch.Tensor, target_N: torch.Tensor,
                                       token_weight_N: torch.Tensor) -> torch.Tensor:
    """The same contract unfused: F.linear, then F.cross_entropy in float32, weighted and summed."""
    logits_NV = F.linear(h_ND, weight_VD).float()
    safe_N = torch.where(token_weight_N != 0, target_N, 0)
    return (F.cross_entropy(logits_NV, safe_N, reduction="none") * token_weight_N.float()).sum()


__all__ = ["linear_cross_entropy_sum", "reference_linear_cross_entropy_sum"]
