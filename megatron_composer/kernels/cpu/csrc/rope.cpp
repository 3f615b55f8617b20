// Rotary embedding of the last R dims of each head, the leading dims copied through, forward and backward in
// one pass (reference: apply_rope in megatron_composer/model/rope.py, with torch.cat for the copied part):
//   out[..., :P] = x[..., :P],  out[..., P:] = [x1 c - x2 s, x2 c + x1 s]
// with (x1, x2) the even/odd (interleaved) or first/second halves of x[..., P:], c/s the position's
// cos/sin. Products are rounded to the dtype as the reference's separate multiplies round them (and never
// fused into FMAs), so float32 results equal the reference's bit for bit.
#pragma GCC optimize("fp-contract=off")
#include <ATen/ATen.h>
#include "float_rows.h"
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#include <cstring>
#include <vector>

namespace {

using at::Tensor;

using namespace float_rows;

// rows r0..r1 of H heads each: x [rows, H, P + R], cs [rows, R/2] cos and sin. Forward: out as above.
// Backward (inverse = true): the rotation by -angle, which is the gradient of the forward.
template <typename T>
inline void rotate_rows(const T* x, const T* cos, const T* sin, T* out, int64_t r0, int64_t r1, int64_t H, int64_t P,
                        int64_t R, bool interleaved, bool inverse) {
  const int64_t D = P + R, h2 = R / 2;
  const int64_t step = interleaved ? 2 : 1, second = interleaved ? 1 : h2;
  for (int64_t r = r0; r < r1; ++r) {
    const T* c = cos + r * h2;
    const T* s = sin + r * h2;
    for (int64_t h = 0; h < H; ++h) {
      const T* xr = x + (r * H + h) * D;
      T* o = out + (r * H + h) * D;
      for (int64_t i = 0; i < P; ++i) o[i] = xr[i];
      const T* xt = xr + P;
      T* ot = o + P;
      if (!inverse) {
        for (int64_t i = 0; i < h2; ++i) {
          const float x1 = to_float(xt[i * step]), x2 = to_float(xt[i * step + second]);
          const float ci = to_float(c[i]), si = to_float(s[i]);
          store(round_as(x1 * ci, T()) - round_as(x2 * si, T()), ot[i]);
          store(round_as(x2 * ci, T()) + round_as(x1 * si, T()), ot[h2 + i]);
        }
      } else {  // x holds d_out in halves layout; out gets d_x in x's layout
        for (int64_t i = 0; i < h2; ++i) {
          const float g1 = to_float(xt[i]), g2 = to_float(xt[h2 + i]);
          const float ci = to_float(c[i]), si = to_float(s[i]);
          store(round_as(g1 * ci, T()) + round_as(g2 * si, T()), ot[i * step]);
          store(round_as(g2 * ci, T()) - round_as(g1 * si, T()), ot[i * step + second]);
        }
      }
    }
  }
}

ROW_LOOP void rotate_f32(const float* x, const float* c, const float* s, float* o, int64_t r0, int64_t r1, int64_t H,
                         int64_t P, int64_t R, bool interleaved, bool inverse) {
  rotate_rows(x, c, s, o, r0, r1, H, P, R, interleaved, inverse);
}
ROW_LOOP void rotate_bf16(const c10::BFloat16* x, const c10::BFloat16* c, const c10::BFloat16* s, c10::BFloat16* o,
                          int64_t r0, int64_t r1, int64_t H, int64_t P, int64_t R, bool interleaved, bool inverse) {
  rotate_rows(x, c, s, o, r0, r1, H, P, R, interleaved, inverse);
}

// x [..., H, P + R] with cos/sin [..., R / 2] over the same leading dims -> like x (contiguous).
Tensor rotate(const Tensor& x, const Tensor& cos, const Tensor& sin, int64_t rope_dim, bool interleaved,
              bool inverse) {
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rope: x, cos and sin all float32 or all bfloat16");
  TORCH_CHECK(x.dim() >= 2 && rope_dim % 2 == 0 && rope_dim > 0 && rope_dim <= x.size(-1),
              "rope: x [..., H, D] with an even rope_dim <= D");
  const int64_t H = x.size(-2), D = x.size(-1), R = rope_dim, P = D - R;
  const int64_t rows = H && D ? x.numel() / (H * D) : 0;
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(-1) == R / 2 && cos.numel() == rows * (R / 2),
              "rope: cos and sin [..., rope_dim / 2] over x's leading dims");
  const Tensor xc = x.contiguous(), c = cos.contiguous(), s = sin.contiguous();
  Tensor out = at::empty(x.sizes(), x.options());
  at::parallel_for(0, rows, std::max<int64_t>(1, 8192 / std::max<int64_t>(H * D, 1)), [&](int64_t r0, int64_t r1) {
    if (x.scalar_type() == at::kFloat)
      rotate_f32(xc.data_ptr<float>(), c.data_ptr<float>(), s.data_ptr<float>(), out.data_ptr<float>(), r0, r1, H, P,
                 R, interleaved, inverse);
    else
      rotate_bf16(xc.data_ptr<c10::BFloat16>(), c.data_ptr<c10::BFloat16>(), s.data_ptr<c10::BFloat16>(),
                  out.data_ptr<c10::BFloat16>(), r0, r1, H, P, R, interleaved, inverse);
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rotate", &rotate, "rope on the last rope_dim dims of each head (inverse: its gradient)");
}
