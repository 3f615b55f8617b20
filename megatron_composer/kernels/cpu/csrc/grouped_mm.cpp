// Grouped matmuls of the mixture of experts on CPU (reference: megatron_composer/kernels/grouped_mm.py).
// Also the whole SwiGLU expert pass (gate and up from w1/w3 without concatenating them, silu * up, w2) with
// its backward, and the token <-> (token, slot) permutations around the experts.
//
// Tokens sorted by expert make one small matmul per expert (~T*K/E rows). Split across threads, each such
// matmul parallelises poorly; here the experts are the parallel tasks instead: every ATen thread takes the
// next largest expert from a shared counter and runs its whole matmul single-threaded (ATen runs ops inside a
// parallel region serially). Each matmul is the at::mm the Python loop makes, on the same rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#include "float_rows.h"
#include "softmax_rows.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <numeric>
#include <vector>

namespace {

using at::Tensor;
using namespace float_rows;
using namespace softmax_rows;

struct Groups {
  std::vector<int64_t> start, count, order;  // order: non-empty groups, largest first

  explicit Groups(const Tensor& offs) {
    const Tensor ends = offs.to(at::kLong).contiguous();
    const int64_t G = ends.numel();
    const int64_t* e = ends.data_ptr<int64_t>();
    start.resize(G);
    count.resize(G);
    int64_t prev = 0;
    for (int64_t g = 0; g < G; ++g) {
      start[g] = prev;
      count[g] = e[g] - prev;
      TORCH_CHECK(count[g] >= 0, "grouped_mm: offs must be non-decreasing cumulative counts");
      prev = e[g];
      if (count[g] > 0) order.push_back(g);
    }
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return count[a] > count[b]; });
  }

  template <typename Fn>
  void run(const Fn& fn) const {
    std::atomic<int64_t> next{0};
    const int64_t n = static_cast<int64_t>(order.size());
    const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
    at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
      at::AutoDispatchBelowADInplaceOrView below_autograd;  // plain matmuls into preallocated outputs
      for (int64_t t = next.fetch_add(1); t < n; t = next.fetch_add(1)) fn(order[t]);
    });
  }
};

// Rows of a in group g times b[g]: a [T, K], b [G, K, N] (any strides) -> [T, N].
Tensor mm_rows(const Tensor& a, const Tensor& b, const Tensor& offs) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 3 && a.size(1) == b.size(1) && offs.numel() == b.size(0),
              "grouped_mm rows: a [T, K], b [G, K, N], offs [G]");
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const Groups groups(offs);
  Tensor out = at::empty({a.size(0), b.size(2)}, a.options());
  groups.run([&](int64_t g) {
    Tensor rows = out.narrow(0, groups.start[g], groups.count[g]);
    at::mm_out(rows, a.narrow(0, groups.start[g], groups.count[g]), b[g]);
  });
  return out;
}

// Per group g: a[rows of g]^T b[rows of g]: a [T, M], b [T, N] -> [G, M, N] (zero for empty groups).
Tensor mm_outer(const Tensor& a, const Tensor& b, const Tensor& offs) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(0) == b.size(0), "grouped_mm outer: a [T, M], b [T, N]");
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const Groups groups(offs);
  const int64_t G = offs.numel();
  Tensor out = at::empty({G, a.size(1), b.size(1)}, a.options());
  for (int64_t g = 0; g < G; ++g)
    if (groups.count[g] == 0) out[g].zero_();
  groups.run([&](int64_t g) {
    Tensor dst = out[g];
    at::mm_out(dst, a.narrow(0, groups.start[g], groups.count[g]).t(), b.narrow(0, groups.start[g], groups.count[g]));
  });
  return out;
}

void check_experts(const Tensor& x, const Tensor& w1, const Tensor& w3, const Tensor& w2, const Tensor& offs) {
  TORCH_CHECK(x.dim() == 2 && w1.dim() == 3 && w1.sizes() == w3.sizes() && w2.dim() == 3 &&
                  w1.size(0) == w2.size(0) && w1.size(2) == x.size(1) && w2.size(1) == x.size(1) &&
                  w2.size(2) == w1.size(1) && offs.numel() == w1.size(0),
              "grouped swiglu: x [T, D], w1 and w3 [E, F, D], w2 [E, D, F], offs [E]");
}

// w1[g] over w3[g]: [2F, D], built per group (in cache) so gate and up come from one matmul (in bfloat16 one
// [2F]-wide matmul beats two [F]-wide ones by more than the copy costs; in float32 the two matmuls write their
// halves of [gate | up] directly and win).
Tensor stacked_gate_up(const Tensor& w1, const Tensor& w3, int64_t g) {
  const int64_t F = w1.size(1);
  Tensor w13 = at::empty({2 * F, w1.size(2)}, w1.options());
  w13.narrow(0, 0, F).copy_(w1[g]);
  w13.narrow(0, F, F).copy_(w3[g]);
  return w13;
}

// ---- SwiGLU activation rows: float32 arithmetic, rounded to T where the Python path's torch ops round (silu,
// then the product), so bfloat16 results match it; 16 lanes at a time through softmax_rows' vector exp.
template <typename T>
MC_INLINE f32x16 load16_float(const T* p) {
  float v[kLanes];
  for (int64_t l = 0; l < kLanes; ++l) v[l] = to_float(p[l]);
  return load16(v);
}
MC_INLINE f32x16 sigmoid16(f32x16 x) { return 1.f / (1.f + exp_poly<f32x16, i32x16>(-x)); }

// act = silu(gate) * up over n columns (n a multiple of 16; padded tails go through swiglu_rows).
template <typename T>
MC_INLINE void act_cols(const T* gate, const T* up, T* act, int64_t n) {
  for (int64_t j = 0; j < n; j += kLanes) {
    const f32x16 g = load16_float(gate + j);
    float silu[kLanes], u[kLanes];
    store16(silu, g * sigmoid16(g));
    store16(u, load16_float(up + j));
    for (int64_t l = 0; l < kLanes; ++l) store(round_as(silu[l], T{}) * u[l], act[j + l]);
  }
}

// Backward of act = silu(gate) * up given d_act: d_gate, d_up, and act itself (for w2's gradient; may be null).
template <typename T>
MC_INLINE void act_grad_cols(const T* gate, const T* up, const T* dact, T* dgate, T* dup, T* act, int64_t n) {
  for (int64_t j = 0; j < n; j += kLanes) {
    const f32x16 g = load16_float(gate + j), s = sigmoid16(g);
    float silu[kLanes], u[kLanes], d[kLanes], dsilu_dg[kLanes];
    store16(silu, g * s);
    store16(dsilu_dg, s * (1.f + g * (1.f - s)));
    store16(u, load16_float(up + j));
    store16(d, load16_float(dact + j));
    for (int64_t l = 0; l < kLanes; ++l) {
      const float si = round_as(silu[l], T{});
      store(d[l] * si, dup[j + l]);
      store(round_as(d[l] * u[l], T{}) * dsilu_dg[l], dgate[j + l]);
      if (act) store(si * u[l], act[j + l]);
    }
  }
}

// Rows of [gate | up] (ld 2F) -> act [n, F] (ld F), or with dact the gradients into d[gate | up] (ld 2F) and act.
template <typename T>
MC_INLINE void swiglu_rows(const T* gu, const T* dact, T* dgu, T* act, int64_t n, int64_t F) {
  const int64_t full = F / kLanes * kLanes, rest = F - full;
  for (int64_t i = 0; i < n; ++i) {
    const T* gate = gu + i * 2 * F;
    const T* up = gate + F;
    T* a = act ? act + i * F : nullptr;
    if (dact) {
      act_grad_cols(gate, up, dact + i * F, dgu + i * 2 * F, dgu + i * 2 * F + F, a, full);
    } else {
      act_cols(gate, up, a, full);
    }
    if (rest) {  // through padded copies
      T g[kLanes] = {}, u[kLanes] = {}, d[kLanes] = {}, o1[kLanes], o2[kLanes], o3[kLanes];
      std::copy(gate + full, gate + F, g);
      std::copy(up + full, up + F, u);
      if (dact) {
        std::copy(dact + i * F + full, dact + i * F + F, d);
        act_grad_cols(g, u, d, o1, o2, a ? o3 : nullptr, kLanes);
        std::copy(o1, o1 + rest, dgu + i * 2 * F + full);
        std::copy(o2, o2 + rest, dgu + i * 2 * F + F + full);
        if (a) std::copy(o3, o3 + rest, a + full);
      } else {
        act_cols(g, u, o3, kLanes);
        std::copy(o3, o3 + rest, a + full);
      }
    }
  }
}

MC_MULTI_ISA void swiglu_rows_f32(const float* gu, const float* dact, float* dgu, float* act, int64_t n, int64_t F) {
  swiglu_rows(gu, dact, dgu, act, n, F);
}
MC_MULTI_ISA void swiglu_rows_bf16(const c10::BFloat16* gu, const c10::BFloat16* dact, c10::BFloat16* dgu,
                                   c10::BFloat16* act, int64_t n, int64_t F) {
  swiglu_rows(gu, dact, dgu, act, n, F);
}

// act = silu(gate) * up for the rows of gate_up [n, 2F]; or the gradients (dgu, act) given dact.
void swiglu_act(const Tensor& gate_up, const Tensor& dact, const Tensor& dgu, const Tensor& act) {
  const int64_t n = gate_up.size(0), F = gate_up.size(1) / 2;
  if (gate_up.scalar_type() == at::kFloat)
    swiglu_rows_f32(gate_up.data_ptr<float>(), dact.defined() ? dact.data_ptr<float>() : nullptr,
                    dgu.defined() ? dgu.data_ptr<float>() : nullptr, act.defined() ? act.data_ptr<float>() : nullptr, n,
                    F);
  else
    swiglu_rows_bf16(gate_up.data_ptr<c10::BFloat16>(), dact.defined() ? dact.data_ptr<c10::BFloat16>() : nullptr,
                     dgu.defined() ? dgu.data_ptr<c10::BFloat16>() : nullptr,
                     act.defined() ? act.data_ptr<c10::BFloat16>() : nullptr, n, F);
}

// Per expert g on its rows: [gate | up] = x [w1[g]; w3[g]]^T, y = (silu(gate) * up) w2[g]^T; returns
// (y, [gate | up] [T, 2F]), the second being what the backward needs. The Python path's ops, per group.
std::vector<Tensor> swiglu_forward(const Tensor& x, const Tensor& w1, const Tensor& w3, const Tensor& w2,
                                   const Tensor& offs) {
  check_experts(x, w1, w3, w2, offs);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "grouped swiglu: float32 or bfloat16");
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const Groups groups(offs);
  const int64_t T = x.size(0), F = w1.size(1);
  TORCH_CHECK(offs.numel() == 0 ? T == 0 : offs[-1].item<int64_t>() == T,
              "grouped swiglu: offs must end at the number of rows of x");
  const Tensor xc = x.contiguous();
  Tensor gate_up = at::empty({T, 2 * F}, x.options());
  Tensor y = at::empty({T, w2.size(1)}, x.options());
  const bool split = x.scalar_type() == at::kFloat;
  groups.run([&](int64_t g) {
    const int64_t s = groups.start[g], n = groups.count[g];
    const Tensor xg = xc.narrow(0, s, n);
    Tensor gu = gate_up.narrow(0, s, n), yg = y.narrow(0, s, n);
    if (split) {
      Tensor gate = gu.narrow(1, 0, F), up = gu.narrow(1, F, F);
      at::mm_out(gate, xg, w1[g].t());
      at::mm_out(up, xg, w3[g].t());
    } else {
      at::mm_out(gu, xg, stacked_gate_up(w1, w3, g).t());
    }
    Tensor act = at::empty({n, F}, x.options());
    swiglu_act(gu, Tensor(), Tensor(), act);
    at::mm_out(yg, act, w2[g].t());
  });
  return {y, gate_up};
}

// Gradients of swiglu_forward: (dx or undefined, dw1, dw3, dw2), weight gradients zero for empty experts
// (undefined when need_dw is false). silu(gate) * up is recomputed per group from the saved [gate | up].
std::vector<Tensor> swiglu_backward(const Tensor& dy, const Tensor& x, const Tensor& gate_up, const Tensor& w1,
                                    const Tensor& w3, const Tensor& w2, const Tensor& offs, bool need_dx,
                                    bool need_dw) {
  check_experts(x, w1, w3, w2, offs);
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.scalar_type() == x.scalar_type(),
              "grouped swiglu backward: gate_up as swiglu_forward returned it");
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const Groups groups(offs);
  const int64_t G = offs.numel(), F = w1.size(1);
  const Tensor xc = x.contiguous();
  Tensor dx = need_dx ? at::empty_like(x, at::MemoryFormat::Contiguous) : Tensor();
  Tensor dw1, dw3, dw2;
  if (need_dw) {
    dw1 = at::empty(w1.sizes(), w1.options());
    dw3 = at::empty(w3.sizes(), w3.options());
    dw2 = at::empty(w2.sizes(), w2.options());
    for (int64_t g = 0; g < G; ++g)
      if (groups.count[g] == 0) {
        dw1[g].zero_();
        dw3[g].zero_();
        dw2[g].zero_();
      }
  }
  const bool split = x.scalar_type() == at::kFloat;
  groups.run([&](int64_t g) {
    const int64_t s = groups.start[g], n = groups.count[g];
    const Tensor xg = xc.narrow(0, s, n), dyg = dy.narrow(0, s, n);
    const Tensor dact = at::mm(dyg, w2[g]);
    Tensor dgu = at::empty({n, 2 * F}, x.options());
    Tensor act = need_dw ? at::empty({n, F}, x.options()) : Tensor();
    swiglu_act(gate_up.narrow(0, s, n), dact, dgu, act);
    const Tensor dgate = dgu.narrow(1, 0, F), dup = dgu.narrow(1, F, F);
    if (need_dw) {
      Tensor d2 = dw2[g], d1 = dw1[g], d3 = dw3[g];
      at::mm_out(d2, dyg.t(), act);
      if (split) {
        at::mm_out(d1, dgate.t(), xg);
        at::mm_out(d3, dup.t(), xg);
      } else {
        const Tensor dw13 = at::mm(dgu.t(), xg);
        d1.copy_(dw13.narrow(0, 0, F));
        d3.copy_(dw13.narrow(0, F, F));
      }
    }
    if (need_dx) {
      Tensor dxg = dx.narrow(0, s, n);
      if (split) {
        at::mm_out(dxg, dgate, w1[g]);
        dxg.addmm_(dup, w3[g]);
      } else {
        at::mm_out(dxg, dgu, stacked_gate_up(w1, w3, g));
      }
    }
  });
  return {dx, dw1, dw3, dw2};
}

// ---- row loops of combine: float32 arithmetic on float32 or bfloat16 rows, compiled for AVX-512, AVX2 and
// plain x86-64 and chosen at load time (the extension is built without -march flags).

template <typename T>
inline void axpy(float* acc, const T* src, float w, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += w * to_float(src[i]);
}
template <typename T>
inline void scale_to(T* dst, const float* src, float w, int64_t n) {
  for (int64_t i = 0; i < n; ++i) store(w * src[i], dst[i]);
}
template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  constexpr int64_t L = 16;  // independent partial sums, so the reduction vectorises without -ffast-math
  float part[L] = {};
  int64_t i = 0;
  for (; i + L <= n; i += L)
    for (int64_t j = 0; j < L; ++j) part[j] += a[i + j] * to_float(b[i + j]);
  float s = 0;
  for (; i < n; ++i) s += a[i] * to_float(b[i]);
  for (int64_t j = 0; j < L; ++j) s += part[j];
  return s;
}

// One token of combine: out = sum_k w[k] rows[pos[k]]; acc has n floats of scratch.
template <typename T>
inline void combine_token(T* out, const T* rows, const int64_t* pos, const float* w, int64_t K, int64_t n,
                          float* acc) {
  std::fill(acc, acc + n, 0.f);
  for (int64_t k = 0; k < K; ++k) axpy(acc, rows + pos[k] * n, w ? w[k] : 1.f, n);
  scale_to(out, acc, 1.f, n);
}
// One token of combine's backward: d_rows[pos[k]] = w[k] g, d_w[k] = <g, rows[pos[k]]>; g has n floats.
template <typename T>
inline void combine_token_backward(const T* dout, const T* rows, const int64_t* pos, const float* w, int64_t K,
                                   int64_t n, T* drows, float* dw, float* g) {
  for (int64_t i = 0; i < n; ++i) g[i] = to_float(dout[i]);
  for (int64_t k = 0; k < K; ++k) {
    if (drows) scale_to(drows + pos[k] * n, g, w[k], n);
    if (dw) dw[k] = dot(g, rows + pos[k] * n, n);
  }
}

ROW_LOOP void combine_rows_f32(float* out, const float* rows, const int64_t* pos, const float* w, int64_t t0,
                               int64_t t1, int64_t K, int64_t n, float* acc) {
  for (int64_t t = t0; t < t1; ++t) combine_token(out + t * n, rows, pos + t * K, w ? w + t * K : nullptr, K, n, acc);
}
ROW_LOOP void combine_rows_bf16(c10::BFloat16* out, const c10::BFloat16* rows, const int64_t* pos, const float* w,
                                int64_t t0, int64_t t1, int64_t K, int64_t n, float* acc) {
  for (int64_t t = t0; t < t1; ++t) combine_token(out + t * n, rows, pos + t * K, w ? w + t * K : nullptr, K, n, acc);
}
ROW_LOOP void combine_backward_f32(const float* dout, const float* rows, const int64_t* pos, const float* w,
                                   int64_t t0, int64_t t1, int64_t K, int64_t n, float* drows, float* dw, float* g) {
  for (int64_t t = t0; t < t1; ++t)
    combine_token_backward(dout + t * n, rows, pos + t * K, w + t * K, K, n, drows, dw ? dw + t * K : nullptr, g);
}
ROW_LOOP void combine_backward_bf16(const c10::BFloat16* dout, const c10::BFloat16* rows, const int64_t* pos,
                                    const float* w, int64_t t0, int64_t t1, int64_t K, int64_t n,
                                    c10::BFloat16* drows, float* dw, float* g) {
  for (int64_t t = t0; t < t1; ++t)
    combine_token_backward(dout + t * n, rows, pos + t * K, w + t * K, K, n, drows, dw ? dw + t * K : nullptr, g);
}

void check_pos(const Tensor& pos, int64_t S) {
  TORCH_CHECK(pos.dim() == 2 && pos.scalar_type() == at::kLong, "combine: pos [T, K] int64");
  if (pos.numel())
    TORCH_CHECK(pos.min().item<int64_t>() >= 0 && pos.max().item<int64_t>() < S, "combine: pos out of range of rows");
}

// out[t] = sum_k w[t, k] * rows[pos[t, k]] (w = 1 when absent), summed in float32: rows [S, D] float32 or
// bfloat16, pos [T, K] int64 (row of each (token, slot) pair), w [T, K] -> [T, D] in rows' dtype.
Tensor combine(const Tensor& rows, const Tensor& pos, const c10::optional<Tensor>& weights) {
  TORCH_CHECK(rows.dim() == 2 && (rows.scalar_type() == at::kFloat || rows.scalar_type() == at::kBFloat16),
              "combine: rows [S, D] float32 or bfloat16");
  check_pos(pos, rows.size(0));
  const Tensor r = rows.contiguous(), p = pos.contiguous();
  const int64_t T = p.size(0), K = p.size(1), D = r.size(1);
  Tensor w;
  if (weights.has_value() && weights->defined()) {
    TORCH_CHECK(weights->sizes() == p.sizes(), "combine: weights [T, K] like pos");
    w = weights->to(at::kFloat).contiguous();
  }
  const float* wp = w.defined() ? w.data_ptr<float>() : nullptr;
  Tensor out = at::empty({T, D}, r.options());
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    std::vector<float> acc(D);
    if (r.scalar_type() == at::kFloat)
      combine_rows_f32(out.data_ptr<float>(), r.data_ptr<float>(), p.data_ptr<int64_t>(), wp, t0, t1, K, D, acc.data());
    else
      combine_rows_bf16(out.data_ptr<c10::BFloat16>(), r.data_ptr<c10::BFloat16>(), p.data_ptr<int64_t>(), wp, t0, t1,
                        K, D, acc.data());
  });
  return out;
}

// Gradients of combine with weights: d_rows[pos[t, k]] = w[t, k] * d_out[t] (rows no pair points at stay zero)
// and d_w[t, k] = <d_out[t], rows[pos[t, k]]> (float32).
std::vector<Tensor> combine_backward(const Tensor& dout, const Tensor& rows, const Tensor& pos,
                                     const Tensor& weights, bool need_drows, bool need_dw) {
  TORCH_CHECK(rows.dim() == 2 && (rows.scalar_type() == at::kFloat || rows.scalar_type() == at::kBFloat16) &&
                  dout.scalar_type() == rows.scalar_type(),
              "combine backward: rows and d_out float32 or bfloat16");
  check_pos(pos, rows.size(0));
  const Tensor dO = dout.contiguous(), r = rows.contiguous(), p = pos.contiguous();
  const Tensor w = weights.to(at::kFloat).contiguous();
  const int64_t T = p.size(0), K = p.size(1), D = r.size(1);
  TORCH_CHECK(dO.size(0) == T && dO.size(1) == D && w.sizes() == p.sizes(), "combine backward: shapes");
  Tensor drows = need_drows ? (p.numel() == r.size(0) ? at::empty_like(r) : at::zeros_like(r)) : Tensor();
  Tensor dw = need_dw ? at::empty({T, K}, w.options()) : Tensor();
  float* dwp = need_dw ? dw.data_ptr<float>() : nullptr;
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    std::vector<float> g(D);
    if (r.scalar_type() == at::kFloat)
      combine_backward_f32(dO.data_ptr<float>(), r.data_ptr<float>(), p.data_ptr<int64_t>(), w.data_ptr<float>(), t0,
                           t1, K, D, need_drows ? drows.data_ptr<float>() : nullptr, dwp, g.data());
    else
      combine_backward_bf16(dO.data_ptr<c10::BFloat16>(), r.data_ptr<c10::BFloat16>(), p.data_ptr<int64_t>(),
                            w.data_ptr<float>(), t0, t1, K, D,
                            need_drows ? drows.data_ptr<c10::BFloat16>() : nullptr, dwp, g.data());
  });
  return {drows, dw};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("mm_rows", &mm_rows, "rows of a in group g times b[g]");
  m.def("mm_outer", &mm_outer, "per group: a[rows]^T b[rows]");
  m.def("swiglu_forward", &swiglu_forward, "grouped SwiGLU experts: (y, [gate | up])");
  m.def("swiglu_backward", &swiglu_backward, "gradients of swiglu_forward: (dx, dw1, dw3, dw2)");
  m.def("combine", &combine, "out[t] = sum_k w[t, k] rows[pos[t, k]]", pybind11::arg("rows"), pybind11::arg("pos"),
        pybind11::arg("weights") = pybind11::none());
  m.def("combine_backward", &combine_backward, "gradients of combine: (d_rows, d_weights)");
}
