"""FP8 linear and grouped expert GEMMs: gradients within the stated bound of high precision, backends agreeing,
apply_fp8 on the model, config and bad-input errors."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from megatron_composer.config import ConfigError, from_dict  # noqa: E402
from megatron_composer.fp8 import FP8Config, FP8Ops, apply_fp8, fp8_linear  # noqa: E402
from megatron_composer.fp8.backends import EmulatedBackend, TritonBackend  # noqa: E402
from megatron_composer.fp8.linear import FP8_REL_ERR_BOUND, FP8GroupedMM, FP8Linear  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

RECIPES = [FP8Config(recipe="mxfp8", block_size=32), FP8Config(recipe="mxfp8", block_size=16, rounding="floor"),
           FP8Config(recipe="blockwise"), FP8Config(recipe="blockwise", pow2_scale=True)]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def linear_grads(fn, x, w, dy):
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    y = fn(x, w)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def data(dtype=torch.float32, tokens=(2, 45), K=128, N=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*tokens, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype)
    dy = torch.randn(*tokens, N, generator=g).to(dtype)
    return x, w, dy


@pytest.mark.parametrize("cfg", RECIPES, ids=lambda c: f"{c.recipe}-{c.block}-{c.rounding}-{c.pow2_scale}")
def test_fp8_linear_within_bound_of_bf16(cfg):
    """Tokens (90) are not a multiple of the block: the weight-gradient GEMM pads them."""
    x, w, dy = data(torch.bfloat16)
    ref = linear_grads(lambda a, b: a @ b.t(), x, w, dy)                      # bf16 layer
    exact = linear_grads(lambda a, b: a @ b.t(), x.double(), w.double(), dy.double())
    ops = FP8Ops(cfg.replace(backend="emulated"))
    got = linear_grads(lambda a, b: fp8_linear(a, b, ops), x, w, dy)
    for g, r, e in zip(got, ref, exact):
        assert g.dtype == r.dtype and g.shape == r.shape
        assert rel(g, r) < FP8_REL_ERR_BOUND
        assert rel(g, e) > rel(r, e)  # FP8 is really in the loop: coarser than bf16


@pytest.mark.parametrize("cfg", RECIPES[:3], ids=lambda c: f"{c.recipe}-{c.block}")
def test_triton_backend_matches_emulated(cfg):
    x, w, dy = data(torch.float32, tokens=(1, 72))
    cfg = cfg.replace(backend="emulated")
    em = linear_grads(lambda a, b: fp8_linear(a, b, FP8Ops(cfg, EmulatedBackend())), x, w, dy)
    tr = linear_grads(lambda a, b: fp8_linear(a, b, FP8Ops(cfg, TritonBackend())), x, w, dy)
    for a, b in zip(tr, em):
        assert rel(a, b) < 1e-5  # identical quantisation; only FP32 summation order differs


def test_autocast_does_not_change_fp8_gemms():
    x, w, dy = data(torch.bfloat16)
    ops = FP8Ops(FP8Config(recipe="mxfp8", backend="emulated"))
    plain = linear_grads(lambda a, b: fp8_linear(a, b, ops), x, w.float(), dy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = linear_grads(lambda a, b: fp8_linear(a, b, ops), x, w.float(), dy)
    for a, b in zip(plain, auto):
        assert torch.equal(a, b)


def test_wgrad_in_high_precision():
    x, w, dy = data(torch.float32)
    ops = FP8Ops(FP8Config(recipe="mxfp8", backend="emulated", wgrad_bf16=True))
    _, _, dw = linear_grads(lambda a, b: fp8_linear(a, b, ops), x, w, dy)
    ref = dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
    assert rel(dw, ref) < 1e-6


def grouped_reference(x, w, offs):
    bounds = list(zip([0, *offs[:-1].tolist()], offs.tolist()))
    return torch.cat([x[lo:hi] @ w[e].t() for e, (lo, hi) in enumerate(bounds)])


@pytest.mark.parametrize("cfg", [RECIPES[0], RECIPES[2]], ids=["mxfp8", "blockwise"])
def test_fp8_grouped_mm_within_bound_and_backends_agree(cfg):
    g = torch.Generator().manual_seed(1)
    T, E, F, D = 70, 4, 128, 256
    offs = torch.tensor([33, 33, 50, 70], dtype=torch.int32)  # one expert without tokens, groups not block-aligned
    x = torch.randn(T, D, generator=g)
    w = torch.randn(E, F, D, generator=g) / D ** 0.5
    dy = torch.randn(T, F, generator=g)
    exact = linear_grads(lambda a, b: grouped_reference(a, b, offs), x.double(), w.double(), dy.double())
    results = {}
    for backend in (EmulatedBackend(), TritonBackend()):
        mm = FP8GroupedMM(FP8Ops(cfg.replace(backend="emulated"), backend))
        results[backend.name] = linear_grads(lambda a, b: mm(a, b, offs), x, w, dy)
    for got, ref, tr in zip(results["emulated"], exact, results["triton"]):
        assert rel(got, ref) < FP8_REL_ERR_BOUND
        assert rel(tr, got) < 1e-5
    assert (results["emulated"][2][1] == 0).all()  # expert without tokens gets a zero gradient


def tiny_model(preset, **changes):
    from megatron_composer.model import Transformer, get_preset
    torch.manual_seed(0)
    return Transformer(get_preset(preset).replace(**changes))


def test_apply_fp8_to_model():
    model = tiny_model("tiny-qwen3-moe")
    ref_model = tiny_model("tiny-qwen3-moe")
    keys = list(model.state_dict())
    apply_fp8(model, FP8Config(recipe="mxfp8", backend="emulated"))
    assert list(model.state_dict()) == keys
    assert type(model.output) is nn.Linear and type(model.tok_embeddings) is nn.Embedding
    assert isinstance(model.layers[0].attention.wq, FP8Linear)
    moe = [m for m in model.modules() if hasattr(m, "grouped_mm") and hasattr(m, "w1")]
    assert moe and all(isinstance(m.grouped_mm, FP8GroupedMM) for m in moe)
    ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))

    # replay the reference model's routing: FP8 noise may flip near-tied expert choices, which changes
    # gradients discontinuously and says nothing about the quantised arithmetic
    routed = ref_model(ids, return_routing=True).routed_experts

    def loss_of(m):
        logits = m(ids, routed_experts=routed, return_routing=True).logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    loss, ref_loss = loss_of(model), loss_of(ref_model)
    loss.backward()
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 0.02 * ref_loss.item()
    for (n, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        if q.grad is not None and q.grad.norm() > 0:  # per-layer errors compound through 4 layers
            assert rel(p.grad, q.grad) < 0.3, n
            assert torch.nn.functional.cosine_similarity(p.grad.flatten(), q.grad.flatten(), 0) > 0.95, n


def test_apply_fp8_rejects_indivisible_layers_by_name():
    model = tiny_model("tiny-deepseek-v3", kv_lora_rank=32, qk_rope_head_dim=16)  # wkv_a: 32 + 16 = 48 outputs
    with pytest.raises(ValueError, match=r"wkv_a.*output dim.*size 48, not divisible by the FP8 block size 32"):
        apply_fp8(model, FP8Config(recipe="mxfp8", backend="emulated"))
    assert not any(isinstance(m, FP8Linear) for m in model.modules())  # nothing changed
    cfg = FP8Config(recipe="mxfp8", backend="emulated", keep_high_precision=["output", "router", "*wkv_a"])
    apply_fp8(model, cfg)
    assert isinstance(model.layers[0].attention.wq_a, FP8Linear)
    assert type(model.layers[0].attention.wkv_a) is nn.Linear


class ShardedLinear(nn.Module):
    """Shape of the tensor-parallel layers: computes through a swappable `linear_fn`."""

    def __init__(self, out_features, in_features):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_features, in_features) / in_features ** 0.5)
        self.bias = None
        self.linear_fn = torch.nn.functional.linear

    def forward(self, x):
        return self.linear_fn(x, self.weight, self.bias)


def test_apply_fp8_sets_linear_fn_of_parallel_layers():
    model = nn.Sequential(ShardedLinear(64, 128), nn.ReLU(), ShardedLinear(32, 64))
    cfg = FP8Config(recipe="mxfp8", backend="emulated")
    x = torch.randn(5, 128)
    apply_fp8(model, cfg)
    ops = model[0].linear_fn.ops
    expected = fp8_linear(torch.relu(fp8_linear(x, model[0].weight, ops)), model[2].weight, ops)
    assert torch.equal(model(x), expected)
    with pytest.raises(ValueError, match=r"'0'.*size 48"):
        apply_fp8(nn.Sequential(ShardedLinear(48, 128)), cfg)


def test_linear_rejects_indivisible_reduction_dim():
    ops = FP8Ops(FP8Config(recipe="mxfp8", backend="emulated"))
    with pytest.raises(ValueError, match="size 40, not divisible by the FP8 block size 32"):
        fp8_linear(torch.randn(4, 40), torch.randn(64, 40), ops)


def test_config_and_backend_errors():
    cfg = from_dict(FP8Config, {"recipe": "mxfp8", "block_size": 16, "rounding": "floor", "backend": "emulated"})
    assert cfg.block == 16 and cfg.enabled
    assert from_dict(FP8Config, {"recipe": "blockwise"}).block == 128
    with pytest.raises(ConfigError, match="block_size"):
        from_dict(FP8Config, {"recipe": "mxfp8", "block_size": 64}).validate()
    with pytest.raises(ConfigError, match="choose one of"):
        from_dict(FP8Config, {"backend": "cutlass"})
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match=r"'scaled_mm' is unavailable here \(needs a CUDA GPU\); "
                                               r"available backends: emulated, triton"):
            FP8Ops(FP8Config(recipe="blockwise", backend="scaled_mm"))
        assert FP8Ops(FP8Config(recipe="mxfp8", backend="auto")).backend.name == "emulated"
    model = nn.Sequential(nn.Linear(32, 32))
    assert apply_fp8(model, FP8Config()) is model and type(model[0]) is nn.Linear  # recipe none: untouched
