"""Quantised linear and grouped expert GEMMs (autograd), and `apply_fp8` to put them into a model.

Each GEMM of a linear layer Y = X W^T quantises its operands along its own reduction dimension, each orientation
separately from the high-precision tensor:

    forward  Y  = X W^T      X blocked along K (per token: activation scales never span tokens), W along K
    dgrad    dX = dY W       dY blocked along N (per token), W^T blocked along N
    wgrad    dW = dY^T X     dY^T and X^T blocked along the tokens (tokens zero-padded to the block length)

The two orientations of X (and of dY, and of W) come from one fused read. With `wgrad_bf16` the weight gradient
is a high-precision matmul instead. The grouped version does the same per expert; for the weight gradient each
expert's token group is zero-padded to a multiple of the block length so no block mixes two experts' tokens.
Zero padding leaves every product unchanged.

Error bound (tested): with random Gaussian data, outputs and gradients of the FP8 layer agree with the
high-precision layer to a relative Frobenius error below FP8_REL_ERR_BOUND = 0.08 (E4M3 keeps 3 mantissa bits:
at most 2^-4 relative error per element, about 2.5% RMS, for each of the two quantised operands).

Feature dimensions (in/out features, expert hidden sizes) must be multiples of the block length: `apply_fp8`
rejects layers that are not, naming them, and the fix is to keep them in high precision by config.
"""

from __future__ import annotations

import fnmatch
import logging

import torch
import torch.nn as nn

from megatron_composer.fp8.backends import operand_specs, select_backend
from megatron_composer.fp8.config import FP8Config
from megatron_composer.fp8.formats import check_blocked_dim

log = logging.getLogger(__name__)

FP8_REL_ERR_BOUND = 0.08


class FP8Ops:
    """A backend plus the recipe's operand specs: everything a quantised GEMM needs."""

    def __init__(self, cfg: FP8Config, backend=None):
        cfg.validate()
        self.cfg = cfg
        self.backend = backend if backend is not None else select_backend(cfg)
        self.act, self.weight = operand_specs(cfg)
        self.wgrad_bf16 = cfg.wgrad_bf16

    @property
    def block(self) -> int:
        return self.act.block_k

    def check_weight(self, rows: int, cols: int, what: str) -> None:
        """A weight [rows, cols] feeds reductions over cols (forward) and rows (dgrad)."""
        tile = max(self.weight.block[0], self.block)
        check_blocked_dim(cols, tile, f"{what} reduction dim (in features)")
        check_blocked_dim(rows, tile, f"{what} output dim (out features, reduced in the input gradient)")


def _pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = (-x.shape[0]) % multiple
    return x if pad == 0 else torch.cat([x, x.new_zeros(pad, *x.shape[1:])])


def _no_autocast(fn):
    """Our GEMMs define their own precision: run the autograd bodies outside any autocast region."""
    def wrapped(ctx, *args):
        with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
            return fn(ctx, *args)
    return wrapped


class _FP8LinearFn(torch.autograd.Function):
    @staticmethod
    @_no_autocast
    def forward(ctx, x, w, ops: FP8Ops):
        K = x.shape[-1]
        x2 = x.reshape(-1, K).contiguous()
        M = x2.shape[0]
        be, act, wt = ops.backend, ops.act, ops.weight
        wgrad_fp8 = w.requires_grad and not ops.wgrad_bf16
        x_q = _pad_rows(x2, act.block_k) if wgrad_fp8 else x2
        qx, sx, qxt, sxt = be.quantize(x_q, act, rowwise=True, colwise=wgrad_fp8)
        qw, sw, qwt, swt = be.quantize(w.contiguous(), wt, rowwise=True, colwise=x.requires_grad)
        y = be.mm(qx, sx, qw, sw, act, wt, x.dtype)[:M]
        ctx.ops, ctx.M, ctx.x_shape, ctx.wgrad_fp8 = ops, M, x.shape, wgrad_fp8
        ctx.w_dtype = w.dtype
        ctx.save_for_backward(qxt, sxt, qwt, swt, None if wgrad_fp8 else x2)
        return y.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    @_no_autocast
    def backward(ctx, dy):
        qxt, sxt, qwt, swt, x2 = ctx.saved_tensors
        ops, M = ctx.ops, ctx.M
        be, act, wt = ops.backend, ops.act, ops.weight
        N = dy.shape[-1]
        dy2 = dy.reshape(-1, N).contiguous()
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dy_q = _pad_rows(dy2, act.block_k) if (need_dw and ctx.wgrad_fp8) else dy2
        qdy, sdy, qdyt, sdyt = be.quantize(dy_q, act, rowwise=need_dx, colwise=need_dw and ctx.wgrad_fp8)
        dx = dw = None
        if need_dx:
            # W^T along N: the colwise output uses the same tile shape on the transposed tensor
            dx = be.mm(qdy, sdy, qwt, swt, act, wt, dy.dtype)[:M].reshape(ctx.x_shape)
        if need_dw:
            if ctx.wgrad_fp8:
                dw = be.mm(qdyt, sdyt, qxt, sxt, act, act, ctx.w_dtype)
            else:
                dw = (dy2.t() @ x2.to(dy2.dtype)).to(ctx.w_dtype)
        return dx, dw, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, ops: FP8Ops, bias: torch.Tensor | None = None):
    """y = x @ weight^T (+ bias) with FP8 GEMMs in forward and backward."""
    y = _FP8LinearFn.apply(x, weight, ops)
    return y if bias is None else y + bias.to(y.dtype)


class FP8LinearFunction:
    """Drop-in for F.linear(x, weight, bias) in FP8: what `apply_fp8` puts into a module's `linear_fn` attribute
    (the tensor-parallel column/row layers call `self.linear_fn(x, self.weight, self.bias)`)."""

    def __init__(self, ops: FP8Ops):
        self.ops = ops

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return fp8_linear(x, weight, self.ops, bias)

    def __repr__(self) -> str:
        return f"FP8LinearFunction({self.ops.cfg.recipe}/{self.ops.backend.name})"


class FP8Linear(nn.Linear):
    """An nn.Linear whose GEMMs run in FP8; holds the original Parameters (state dict unchanged)."""

    def __init__(self, linear: nn.Linear, ops: FP8Ops):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.ops, self.bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", fp8={self.ops.cfg.recipe}/{self.ops.backend.name}"


class TELinear(nn.Module):
    """A dense layer run by TransformerEngine's Linear under fp8_autocast with the matching recipe
    (MXFP8BlockScaling or Float8BlockScaling). Parameters stay ours (state dict unchanged); TE's module is kept
    out of the module tree so it does not register them twice. TE chooses its own scale rounding."""

    def __init__(self, linear: nn.Linear, ops: FP8Ops):
        super().__init__()
        import transformer_engine.pytorch as te
        from transformer_engine.common import recipe

        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.ops = ops
        te_linear = te.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                              params_dtype=self.weight.dtype, device=self.weight.device)
        te_linear.weight = self.weight
        if self.bias is not None:
            te_linear.bias = self.bias
        object.__setattr__(self, "_te_linear", te_linear)
        self._te = te
        self._recipe = recipe.MXFP8BlockScaling() if ops.cfg.recipe == "mxfp8" else recipe.Float8BlockScaling()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self._te.fp8_autocast(enabled=True, fp8_recipe=self._recipe):
            return self._te_linear(x)


def _padded_groups(offs: torch.Tensor, T: int, block: int):
    """Destination row of each token when every group is padded to a multiple of `block` (no host sync), the
    padded group ends, and an upper bound on the padded row count."""
    offs = offs.to(torch.int64)
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    padded_ends = ((counts + block - 1) // block * block).cumsum(0)
    starts, padded_starts = offs - counts, padded_ends - (counts + block - 1) // block * block
    t = torch.arange(T, device=offs.device)
    group = torch.searchsorted(offs, t, right=True).clamp_max(offs.numel() - 1)
    dest = t - starts[group] + padded_starts[group]
    rows = (T + offs.numel() * (block - 1) + block - 1) // block * block
    return dest, padded_ends.to(torch.int32), rows


def _scatter_rows(x: torch.Tensor, dest: torch.Tensor, rows: int) -> torch.Tensor:
    out = x.new_zeros(rows, x.shape[1])
    out[dest] = x
    return out


class _FP8GroupedMMFn(torch.autograd.Function):
    @staticmethod
    @_no_autocast
    def forward(ctx, x_TD, w_EFD, offs, ops: FP8Ops):
        be, act, wt = ops.backend, ops.act, ops.weight
        x_TD = x_TD.contiguous()
        qx, sx, _, _ = be.quantize(x_TD, act, rowwise=True)
        qw, sw, qwt, swt = be.quantize(w_EFD.contiguous(), wt, rowwise=True, colwise=x_TD.requires_grad)
        y_TF = be.grouped_mm(qx, sx, qw, sw, offs, act, wt, x_TD.dtype)
        ctx.ops, ctx.w_dtype = ops, w_EFD.dtype
        ctx.save_for_backward(x_TD, qwt, swt, offs)
        return y_TF

    @staticmethod
    @_no_autocast
    def backward(ctx, dy_TF):
        x_TD, qwt, swt, offs = ctx.saved_tensors
        ops = ctx.ops
        be, act, wt = ops.backend, ops.act, ops.weight
        dy_TF = dy_TF.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            qdy, sdy, _, _ = be.quantize(dy_TF, act, rowwise=True)
            dx = be.grouped_mm(qdy, sdy, qwt, swt, offs, act, wt, dy_TF.dtype)
        if ctx.needs_input_grad[1]:
            if ops.wgrad_bf16:
                dw = torch.stack([(dy_TF[lo:hi].t() @ x_TD[lo:hi].to(dy_TF.dtype)).to(ctx.w_dtype)
                                  for lo, hi in zip([0, *offs[:-1].tolist()], offs.tolist())])
            else:
                dest, k_offs, rows = _padded_groups(offs, x_TD.shape[0], act.block_k)
                _, _, qdyt, sdyt = be.quantize(_scatter_rows(dy_TF, dest, rows), act, rowwise=False, colwise=True)
                _, _, qxt, sxt = be.quantize(_scatter_rows(x_TD, dest, rows), act, rowwise=False, colwise=True)
                dw = be.k_grouped_mm(qdyt, sdyt, qxt, sxt, k_offs, act, ctx.w_dtype)
        return dx, dw, None, None


class FP8GroupedMM:
    """Drop-in for GroupedExperts.grouped_mm: y[t] = x[t] @ w[e(t)]^T per expert token group, in FP8."""

    def __init__(self, ops: FP8Ops):
        self.ops = ops

    def __call__(self, x_TD: torch.Tensor, w_EFD: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return _FP8GroupedMMFn.apply(x_TD, w_EFD, offs, self.ops)

    def __repr__(self) -> str:
        return f"FP8GroupedMM({self.ops.cfg.recipe}/{self.ops.backend.name})"


def keeps_high_precision(name: str, patterns) -> bool:
    parts = name.split(".")
    return any(fnmatch.fnmatchcase(name, p) or any(fnmatch.fnmatchcase(part, p) for part in parts)
               for p in patterns)


def _is_grouped_experts(module: nn.Module) -> bool:
    return hasattr(module, "grouped_mm") and all(isinstance(getattr(module, w, None), nn.Parameter)
                                                 for w in ("w1", "w2", "w3"))


def _has_linear_fn(module: nn.Module) -> bool:
    return callable(getattr(module, "linear_fn", None)) and isinstance(getattr(module, "weight", None), nn.Parameter)


def apply_fp8(model: nn.Module, cfg: FP8Config, backend=None) -> nn.Module:
    """Swap the model's nn.Linear modules (except those kept high precision) for FP8Linear, give modules that
    compute through a `linear_fn(x, weight, bias)` attribute (tensor-parallel layers) an FP8 one, and give every
    grouped-experts module an FP8 `grouped_mm`. In place; returns the model. Apply it after parallelising, so the
    local weight shards are checked. Raises, before changing anything, if a layer's dimensions do not split into
    FP8 blocks (naming each such layer)."""
    if not cfg.enabled:
        return model
    ops = FP8Ops(cfg, backend)
    linears, linear_fns, experts, problems = [], [], [], []
    for name, module in model.named_modules():
        if keeps_high_precision(name, cfg.keep_high_precision):
            continue
        try:
            if isinstance(module, nn.Linear) and not isinstance(module, (FP8Linear, TELinear)):
                ops.check_weight(module.out_features, module.in_features, f"'{name}'")
                linears.append(name)
            elif _has_linear_fn(module):
                ops.check_weight(module.weight.shape[0], module.weight.shape[1], f"'{name}'")
                linear_fns.append(name)
            elif _is_grouped_experts(module):
                E, F, D = module.w1.shape
                ops.check_weight(F, D, f"'{name}.w1/w3'")
                ops.check_weight(D, F, f"'{name}.w2'")
                experts.append(name)
        except ValueError as e:
            problems.append(str(e))
    if problems:
        raise ValueError(f"fp8.recipe={cfg.recipe} cannot quantise {len(problems)} layer(s): " + "; ".join(problems)
                         + ". Add them to fp8.keep_high_precision" + (" or use fp8.block_size=16" if cfg.recipe ==
                                                                      "mxfp8" and cfg.block_size == 32 else ""))
    dense_cls = TELinear if ops.backend.name == "te" else FP8Linear
    for name in linears:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, dense_cls(getattr(parent, child), ops))
    for name in linear_fns:
        model.get_submodule(name).linear_fn = FP8LinearFunction(ops)
    for name in experts:
        model.get_submodule(name).grouped_mm = FP8GroupedMM(ops)
    log.info("fp8 %s via %s backend: %d linear layers and %d expert groups quantised", cfg.recipe, ops.backend.name,
             len(linears) + len(linear_fns), len(experts))
    return model
