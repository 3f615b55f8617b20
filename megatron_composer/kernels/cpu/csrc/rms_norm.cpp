// RMSNorm forward and backward on CPU, one pass over each row (reference: _RMSNormFunction in
// megatron_composer/model/norms.py, which this follows operation by operation, roundings included):
//   y = w * (x * rstd).to(dtype),  rstd = rsqrt(mean(x^2) + eps) in float32,
// instead of the reference's ~6 elementwise passes and float32 temporaries each way. Rows are split over the
// ATen threads; the weight gradient is summed per thread (in float64), then over threads.
#include <ATen/ATen.h>
#include "float_rows.h"
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <cstring>
#include <vector>

namespace {

using at::Tensor;

using namespace float_rows;

constexpr int64_t kLanes = 16;  // independent partial sums, so reductions vectorise without -ffast-math

template <typename T>
inline float mean_square(const T* x, int64_t n) {
  float part[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) {
      const float v = to_float(x[i + j]);
      part[j] += v * v;
    }
  double s = 0;
  for (; i < n; ++i) s += double(to_float(x[i])) * to_float(x[i]);
  for (int64_t j = 0; j < kLanes; ++j) s += part[j];
  return static_cast<float>(s / n);
}

template <typename T>
inline void forward_rows(const T* x, const T* w, T* y, float* rstd, int64_t r0, int64_t r1, int64_t n, float eps) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * n;
    T* yr = y + r * n;
    const float s = 1.f / std::sqrt(mean_square(xr, n) + eps);
    rstd[r] = s;
    for (int64_t i = 0; i < n; ++i) store(to_float(w[i]) * round_as(to_float(xr[i]) * s, T()), yr[i]);
  }
}

// dx = (dn - n * mean(dn * n)) * rstd with n = x * rstd, dn = (dy * w) as T; dw_acc += dy * n as T.
template <typename T>
inline void backward_rows(const T* dy, const T* x, const float* rstd, const T* w, T* dx, double* dw_acc,
                          float* dn, int64_t r0, int64_t r1, int64_t n) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * n;
    const T* dyr = dy + r * n;
    const float s = rstd[r];
    float part[kLanes] = {};
    int64_t i = 0;
    for (; i < n; ++i) dn[i] = round_as(to_float(dyr[i]) * to_float(w[i]), T());
    for (i = 0; i + kLanes <= n; i += kLanes)
      for (int64_t j = 0; j < kLanes; ++j) part[j] += dn[i + j] * (to_float(xr[i + j]) * s);
    double c = 0;
    for (; i < n; ++i) c += dn[i] * (to_float(xr[i]) * s);
    for (int64_t j = 0; j < kLanes; ++j) c += part[j];
    const float mean = static_cast<float>(c / n);
    if (dx) {
      T* dxr = dx + r * n;
      for (i = 0; i < n; ++i) store((dn[i] - (to_float(xr[i]) * s) * mean) * s, dxr[i]);
    }
    if (dw_acc)
      for (i = 0; i < n; ++i) dw_acc[i] += round_as(to_float(dyr[i]) * round_as(to_float(xr[i]) * s, T()), T());
  }
}

ROW_LOOP void forward_f32(const float* x, const float* w, float* y, float* rstd, int64_t r0, int64_t r1, int64_t n,
                          float eps) {
  forward_rows(x, w, y, rstd, r0, r1, n, eps);
}
ROW_LOOP void forward_bf16(const c10::BFloat16* x, const c10::BFloat16* w, c10::BFloat16* y, float* rstd, int64_t r0,
                           int64_t r1, int64_t n, float eps) {
  forward_rows(x, w, y, rstd, r0, r1, n, eps);
}
ROW_LOOP void backward_f32(const float* dy, const float* x, const float* rstd, const float* w, float* dx,
                           double* dw_acc, float* dn, int64_t r0, int64_t r1, int64_t n) {
  backward_rows(dy, x, rstd, w, dx, dw_acc, dn, r0, r1, n);
}
ROW_LOOP void backward_bf16(const c10::BFloat16* dy, const c10::BFloat16* x, const float* rstd,
                            const c10::BFloat16* w, c10::BFloat16* dx, double* dw_acc, float* dn, int64_t r0,
                            int64_t r1, int64_t n) {
  backward_rows(dy, x, rstd, w, dx, dw_acc, dn, r0, r1, n);
}

void check(const Tensor& x, const Tensor& w) {
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && w.scalar_type() == x.scalar_type(),
              "rms_norm: x and weight both float32 or both bfloat16");
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 1 && x.size(-1) == w.size(0), "rms_norm: x [..., D], weight [D]");
}

int64_t grain(int64_t n) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)); }

// (y like x, rstd [rows] float32)
std::vector<Tensor> rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  check(x, weight);
  const Tensor xc = x.contiguous(), w = weight.contiguous();
  const int64_t n = x.size(-1), rows = n ? xc.numel() / n : 0;
  Tensor y = at::empty_like(xc), rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  at::parallel_for(0, rows, grain(n), [&](int64_t r0, int64_t r1) {
    if (x.scalar_type() == at::kFloat)
      forward_f32(xc.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), rstd.data_ptr<float>(), r0, r1, n,
                  static_cast<float>(eps));
    else
      forward_bf16(xc.data_ptr<c10::BFloat16>(), w.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(),
                   rstd.data_ptr<float>(), r0, r1, n, static_cast<float>(eps));
  });
  return {y, rstd};
}

// (dx or undefined, dweight or undefined)
std::vector<Tensor> rms_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& rstd, const Tensor& weight,
                                      bool need_dx, bool need_dw) {
  check(x, weight);
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.scalar_type() == x.scalar_type(), "rms_norm backward: dy like x");
  const Tensor xc = x.contiguous(), dyc = dy.contiguous(), w = weight.contiguous(), s = rstd.contiguous();
  const int64_t n = x.size(-1), rows = n ? xc.numel() / n : 0;
  TORCH_CHECK(s.numel() == rows && s.scalar_type() == at::kFloat, "rms_norm backward: rstd [rows] float32");
  Tensor dx = need_dx ? at::empty_like(xc) : Tensor();
  const int64_t threads = at::get_num_threads();
  Tensor dw_parts = need_dw ? at::zeros({threads, n}, x.options().dtype(at::kDouble)) : Tensor();
  at::parallel_for(0, rows, grain(n), [&](int64_t r0, int64_t r1) {
    std::vector<float> dn(n);
    double* acc = need_dw ? dw_parts.data_ptr<double>() + at::get_thread_num() * n : nullptr;
    if (x.scalar_type() == at::kFloat)
      backward_f32(dyc.data_ptr<float>(), xc.data_ptr<float>(), s.data_ptr<float>(), w.data_ptr<float>(),
                   need_dx ? dx.data_ptr<float>() : nullptr, acc, dn.data(), r0, r1, n);
    else
      backward_bf16(dyc.data_ptr<c10::BFloat16>(), xc.data_ptr<c10::BFloat16>(), s.data_ptr<float>(),
                    w.data_ptr<c10::BFloat16>(), need_dx ? dx.data_ptr<c10::BFloat16>() : nullptr, acc, dn.data(),
                    r0, r1, n);
  });
  Tensor dw = need_dw ? dw_parts.sum(0).to(weight.scalar_type()) : Tensor();
  return {dx, dw};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm forward: (y, rstd)");
  m.def("rms_norm_backward", &rms_norm_backward, "RMSNorm backward: (dx, dweight)");
}
