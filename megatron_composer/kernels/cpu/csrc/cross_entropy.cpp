// One pass of the cross-entropy over a block of float32 logits rows, in place: the C++ twin of the row work
// in megatron_composer/kernels/linear_cross_entropy.py (log_softmax, gather at the target, exp, subtract one
// at the target, scale by the token weight), which stays the reference the tests compare it with.
//
// Why C++: torch makes four passes over the block for this (log_softmax, exp_, scatter_add_, mul_), two of
// them computing exp of every element; here each row is read for its maximum, turned into exp(x - max) while
// summing, and scaled once: one exp per element and the row stays in cache between the passes.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <cstdint>

#include "softmax_rows.h"

namespace {

using at::Tensor;
using namespace softmax_rows;

// Rows [r0, r1) of x [R, V]: logp[r] = log softmax(x[r])[target[r]]; with grad, x[r] becomes
// weight[r] * (softmax(x[r]) - onehot(target[r])), the gradient of weight . -logp with respect to x[r].
MC_MULTI_ISA void rows_f32(float* x, int64_t V, const int64_t* target, const float* weight, float* logp, int64_t r0,
                           int64_t r1, bool grad) {
  for (int64_t r = r0; r < r1; ++r) {
    float* row = x + r * V;
    const int64_t t = target[r];
    const float at_target = row[t];
    const float m = scaled_max(row, V, 1.f);
    const float sum = exp_store(row, V, 1.f, m);  // row = exp(x - m)
    logp[r] = at_target - m - std::log(sum);
    if (!grad) continue;
    const float w = weight[r], scale = w / sum;
    int64_t j = 0;
    for (; j + kLanes <= V; j += kLanes) store16(row + j, load16(row + j) * scale);
    for (; j < V; ++j) row[j] *= scale;
    row[t] -= w;
  }
}

// logits [R, V] float32 contiguous, overwritten by the gradient when grad (else by scratch); returns logp [R].
Tensor log_softmax_grad_rows(Tensor logits, const Tensor& target, const Tensor& weight, bool grad) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous() &&
                  logits.device().is_cpu(),
              "cross-entropy rows: logits must be a contiguous float32 CPU matrix [R, V]");
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0, "cross-entropy rows: empty vocabulary");
  const Tensor t = target.to(at::kLong).contiguous();
  const Tensor w = weight.to(at::kFloat).contiguous();
  TORCH_CHECK(t.numel() == R && w.numel() == R, "cross-entropy rows: target and weight need one entry per row");
  const int64_t* tp = t.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(tp[r] >= 0 && tp[r] < V, "cross-entropy rows: target ", tp[r], " outside the vocabulary [0, ", V, ")");
  Tensor logp = at::empty({R}, logits.options());
  float* x = logits.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* lp = logp.data_ptr<float>();
  at::parallel_for(0, R, std::max<int64_t>(1, (1 << 15) / V), [&](int64_t r0, int64_t r1) {
    rows_f32(x, V, tp, wp, lp, r0, r1, grad);
  });
  return logp;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("log_softmax_grad_rows", &log_softmax_grad_rows,
        "per row: log-softmax at the target; with grad, the rows become weight * (softmax - onehot(target))");
}
