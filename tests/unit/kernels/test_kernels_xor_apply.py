"""The XOR apply of weight updates: the Triton kernels (TRITON_INTERPRET=1 on CPU tensors) equal the reference bit
for bit on every dtype an engine holds, dense and sparse; a version XORed on its base gives the version; a sparse
delta holds only the changed elements."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from megatron_composer.kernels.xor_apply import (  # noqa: E402
    SparseXor,
    int_view,
    xor_apply_,
    xor_apply_reference_,
    xor_apply_triton_,
)

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")


def _versions(dtype, shape, changed=0.03, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        old = torch.randn(shape, generator=g).to(dtype)
        new = old.clone()
        mask = torch.rand(shape, generator=g) < changed
        new[mask] = torch.randn(int(mask.sum()), generator=g).to(dtype)
    else:
        old = torch.randint(-2**31, 2**31 - 1, shape, generator=g, dtype=torch.int64).to(dtype)
        new = old.clone()
        mask = torch.rand(shape, generator=g) < changed
        new[mask] = torch.randint(-100, 100, (int(mask.sum()),), generator=g, dtype=torch.int64).to(dtype)
    return old, new


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int32, torch.float16, torch.int8])
@pytest.mark.parametrize("sparse", [False, True])
def test_kernel_equals_reference_and_gives_the_new_version(dtype, sparse):
    old, new = _versions(dtype, (37, 129))  # not a multiple of the block: the masked tail is exercised
    bits = int_view(old) ^ int_view(new)
    delta = SparseXor.from_dense(bits) if sparse else bits
    ref, kern = old.clone(), old.clone()
    xor_apply_reference_(ref, delta)
    xor_apply_triton_(kern, delta, block=256)
    assert torch.equal(int_view(kern), int_view(ref))
    assert torch.equal(int_view(ref), int_view(new))
    if sparse:
        assert delta.positions.dtype == torch.int32
        assert delta.positions.numel() == int((bits != 0).sum()) < 0.1 * bits.numel()
        assert torch.equal(delta.dense(), bits)


def test_an_empty_delta_and_a_mismatched_one():
    base = torch.randn(8, 16).to(torch.bfloat16)
    before = base.clone()
    xor_apply_triton_(base, SparseXor.from_dense(torch.zeros(8, 16, dtype=torch.int16)))
    xor_apply_(base, torch.zeros(8, 16, dtype=torch.int16))
    assert torch.equal(base, before)
    with pytest.raises(ValueError, match="does not apply"):
        xor_apply_(base, torch.zeros(8, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="contiguous"):
        xor_apply_(base.t(), torch.zeros(16, 8, dtype=torch.int16))
