// Leaf kernels of inference on the CPU, behind the small interfaces of their Python callers (each one's reference
// is named at its definition and in the caller; tests/unit/inference/test_inference_fast_cpp.py and the kernels'
// tests compare):
//   argmax_rows, greedy_rows, small_linear   row kernels for the head and greedy selection (inference/engine.py)
//   route                                    the router's selection (model/moe.py Router.forward)
//   swiglu_rows, pair_swiglu                 SwiGLU experts over a few rows (kernels/grouped_mm.py few_rows_kernel)
//   paged_latent_attention                   MLA in the latent space over the paged cache (kernels/paged_attention.py)
// They exist for decoding, where a step's cost is per-call overhead on tiny shapes, not arithmetic: each one does
// in one call what takes several small ATen operations, and the AVX2/FMA dot products (x86-64) beat a BLAS call
// for a few rows.
#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
// argmax over the last dim of a 2-d tensor (the first of equal maxima, NaN counting as the largest, as
// torch.argmax): a vectorised max, then a scan for its first position (torch's argmax is a slow scalar
// reduction over long rows on CPU).
Tensor argmax_rows(const Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.device().is_cpu(), "argmax_rows takes [rows, vocab] CPU logits");
  Tensor x = logits.contiguous().to(at::kFloat);
  Tensor m = x.amax(-1).contiguous();
  const int64_t B = x.size(0), V = x.size(1);
  Tensor out = at::empty({B}, logits.options().dtype(at::kLong));
  const float* px = x.data_ptr<float>();
  const float* pm = m.data_ptr<float>();
  int64_t* po = out.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    const float* row = px + b * V;
    int64_t at = -1;
    if (!std::isnan(pm[b])) {
      for (int64_t i = 0; i < V; ++i) {
        if (row[i] == pm[b]) { at = i; break; }
      }
    }
    po[b] = at >= 0 ? at : at::argmax(x[b]).item<int64_t>();
  }
  return out;
}

Tensor small_linear(const Tensor& x, const Tensor& w, const OptTensor& b);

// ---- routed experts for a few tokens: AVX2/FMA dot products (x86-64 with those instructions, float32) -------
// At decode sizes each expert sees a handful of tokens: a matmul per expert pays per-call overhead on tiny shapes,
// and the every-expert form does E / K times the arithmetic. This computes exactly the chosen (token, expert) pairs,
// each weight row read once per pair of tokens. Elsewhere the ATen forms below run.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define MC_PAIR_KERNEL 1

__attribute__((target("avx2,fma"))) static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// out[r * ldo + j] = dot(W[j], x_r) for rows j < rows of W ([rows, n] contiguous) and NX (1 or 2) vectors x_r.
template <int NX>
__attribute__((target("avx2,fma"))) static void dot_rows(const float* W, int64_t rows, int64_t n, const float* const* x,
                                                         float* out, int64_t ldo) {
  const int64_t n8 = n & ~int64_t(7);
  int64_t j = 0;
  for (; j + 4 <= rows; j += 4) {
    __m256 acc[NX][4];
    for (int r = 0; r < NX; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_setzero_ps();
    const float* w0 = W + j * n;
    for (int64_t i = 0; i < n8; i += 8) {
      __m256 wv[4];
      for (int c = 0; c < 4; ++c) wv[c] = _mm256_loadu_ps(w0 + c * n + i);
      for (int r = 0; r < NX; ++r) {
        const __m256 xv = _mm256_loadu_ps(x[r] + i);
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_fmadd_ps(wv[c], xv, acc[r][c]);
      }
    }
    for (int r = 0; r < NX; ++r)
      for (int c = 0; c < 4; ++c) {
        float v = hsum8(acc[r][c]);
        for (int64_t i = n8; i < n; ++i) v += w0[c * n + i] * x[r][i];
        out[r * ldo + j + c] = v;
      }
  }
  for (; j < rows; ++j) {
    for (int r = 0; r < NX; ++r) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t i = 0; i < n8; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(W + j * n + i), _mm256_loadu_ps(x[r] + i), acc);
      float v = hsum8(acc);
      for (int64_t i = n8; i < n; ++i) v += W[j * n + i] * x[r][i];
      out[r * ldo + j] = v;
    }
  }
}

static bool cpu_has_avx2_fma() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}

// y_T D = sum over pairs (token t, expert e, gate g) of g * W2_e (silu(W1_e x_t) * W3_e x_t). Experts are given as
// w1, w3 [F, D] and w2 [D, F] pointers; `pairs` lists (token, gate) per expert.
static void pair_experts(const Tensor& x_TD, const std::vector<const float*>& w1s, const std::vector<const float*>& w3s,
                         const std::vector<const float*>& w2s,
                         const std::vector<int64_t>& widths,
                         const std::vector<std::vector<std::pair<int64_t, float>>>& pairs,
                         Tensor& out_TD) {
  const int64_t D = x_TD.size(1);
  const float* px = x_TD.data_ptr<float>();
  float* po = out_TD.data_ptr<float>();
  // first every pair's gate and up rows, then one vectorised silu(gate) * up, then the down projections
  std::vector<int64_t> offset(pairs.size() + 1, 0);
  for (size_t e = 0; e < pairs.size(); ++e)
    offset[e + 1] = offset[e] + static_cast<int64_t>(pairs[e].size()) * widths[e];
  Tensor gate = at::empty({offset.back()}, x_TD.options()), up = at::empty({offset.back()}, x_TD.options());
  float* pg = gate.data_ptr<float>();
  float* pu = up.data_ptr<float>();
  for (size_t e = 0; e < pairs.size(); ++e) {
    const int64_t F = widths[e], n = static_cast<int64_t>(pairs[e].size());
    for (int64_t i = 0; i < n; i += 2) {
      const float* xs[2] = {px + pairs[e][i].first * D, i + 1 < n ? px + pairs[e][i + 1].first * D : nullptr};
      const int64_t at_ = offset[e] + i * F;
      if (i + 1 < n) {
        dot_rows<2>(w1s[e], F, D, xs, pg + at_, F);
        dot_rows<2>(w3s[e], F, D, xs, pu + at_, F);
      } else {
        dot_rows<1>(w1s[e], F, D, xs, pg + at_, F);
        dot_rows<1>(w3s[e], F, D, xs, pu + at_, F);
      }
    }
  }
  at::silu_(gate).mul_(up);
  std::vector<float> y(2 * D);
  for (size_t e = 0; e < pairs.size(); ++e) {
    const int64_t F = widths[e], n = static_cast<int64_t>(pairs[e].size());
    for (int64_t i = 0; i < n; i += 2) {
      const bool two = i + 1 < n;
      const float* as[2] = {pg + offset[e] + i * F, two ? pg + offset[e] + (i + 1) * F : nullptr};
      if (two) dot_rows<2>(w2s[e], D, F, as, y.data(), D);
      else dot_rows<1>(w2s[e], D, F, as, y.data(), D);
      for (int r = 0; r < (two ? 2 : 1); ++r) {
        const auto [t, g] = pairs[e][i + r];
        float* o = po + t * D;
        for (int64_t d = 0; d < D; ++d) o[d] += g * y[r * D + d];
      }
    }
  }
}
// MLA attention of a few new positions straight from the paged latent cache (no gathered copy of the rows):
// scores[b, n * H + h, l] = scale * q[b, n, h] . cache[slot(b, l)] where l <= pos[b, n], -inf after.
__attribute__((target("avx2,fma"))) static void latent_scores(const float* q, const float* cache, int64_t X,
                                                              const int64_t* slots, int64_t slot_stride,
                                                              const int64_t* pos, int64_t B, int64_t N, int64_t H,
                                                              int64_t L, float scale, float* scores) {
  const int64_t X8 = X & ~int64_t(7);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t l = 0; l < L; ++l) {
      const float* row = cache + slots[b * slot_stride + l] * X;
      for (int64_t n = 0; n < N; ++n) {
        float* out = scores + (b * N + n) * H * L + l;
        const bool visible = l <= pos[b * N + n];
        for (int64_t h = 0; h < H; ++h) {
          if (!visible) {
            out[h * L] = -INFINITY;
            continue;
          }
          const float* qh = q + ((b * N + n) * H + h) * X;
          __m256 acc = _mm256_setzero_ps();
          for (int64_t i = 0; i < X8; i += 8)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + i), _mm256_loadu_ps(row + i), acc);
          float v = hsum8(acc);
          for (int64_t i = X8; i < X; ++i) v += qh[i] * row[i];
          out[h * L] = v * scale;
        }
      }
    }
  }
}

// out[b, n * H + h, :C] = sum over visible l of probs[b, n * H + h, l] * cache[slot(b, l), :C].
__attribute__((target("avx2,fma"))) static void latent_values(const float* probs, const float* cache, int64_t X,
                                                              int64_t C,
                                                              const int64_t* slots, int64_t slot_stride,
                                                              const int64_t* pos, int64_t B, int64_t N, int64_t H,
                                                              int64_t L, float* out) {
  const int64_t C32 = C & ~int64_t(31), C8 = C & ~int64_t(7);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t* sl = slots + b * slot_stride;
    for (int64_t n = 0; n < N; ++n) {
      const int64_t Lv = std::min(L, pos[b * N + n] + 1);
      for (int64_t h = 0; h < H; ++h) {
        const float* p = probs + ((b * N + n) * H + h) * L;
        float* o = out + ((b * N + n) * H + h) * C;
        for (int64_t c = 0; c < C32; c += 32) {
          __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
          for (int64_t l = 0; l < Lv; ++l) {
            const float* row = cache + sl[l] * X + c;
            const __m256 pl = _mm256_set1_ps(p[l]);
            a0 = _mm256_fmadd_ps(pl, _mm256_loadu_ps(row), a0);
            a1 = _mm256_fmadd_ps(pl, _mm256_loadu_ps(row + 8), a1);
            a2 = _mm256_fmadd_ps(pl, _mm256_loadu_ps(row + 16), a2);
            a3 = _mm256_fmadd_ps(pl, _mm256_loadu_ps(row + 24), a3);
          }
          _mm256_storeu_ps(o + c, a0);
          _mm256_storeu_ps(o + c + 8, a1);
          _mm256_storeu_ps(o + c + 16, a2);
          _mm256_storeu_ps(o + c + 24, a3);
        }
        for (int64_t c = C32; c < C8; c += 8) {
          __m256 a = _mm256_setzero_ps();
          for (int64_t l = 0; l < Lv; ++l)
            a = _mm256_fmadd_ps(_mm256_set1_ps(p[l]), _mm256_loadu_ps(cache + sl[l] * X + c), a);
          _mm256_storeu_ps(o + c, a);
        }
        for (int64_t c = C8; c < C; ++c) {
          float a = 0.0f;
          for (int64_t l = 0; l < Lv; ++l) a += p[l] * cache[sl[l] * X + c];
          o[c] = a;
        }
      }
    }
  }
}
#endif

#ifdef MC_PAIR_KERNEL
// exp of x <= 0 (Cephes' expf: Cody-Waite reduction, degree-6 polynomial, ~1 ulp); below -87.3 it returns
// 2^-126 instead of underflowing, negligible next to the row maximum's term, 1.
__attribute__((target("avx2,fma"))) static inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.33654f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// One row: the first maximum's index and log-probability (x_max - max) - log(sum exp(x - max)), as log_softmax
// computes it. Returns false (the caller uses ATen) for rows holding NaN or infinities.
__attribute__((target("avx2,fma"))) static bool greedy_row(const float* x, int64_t V, int64_t* token, float* logp) {
  const int64_t V8 = V & ~int64_t(7);
  __m256 m = _mm256_set1_ps(-INFINITY), bad = _mm256_setzero_ps();
  for (int64_t i = 0; i < V8; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    m = _mm256_max_ps(m, v);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_sub_ps(v, v), _mm256_setzero_ps(), _CMP_NEQ_UQ));  // NaN or inf
  }
  float mx = -INFINITY;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  for (float l : lanes) mx = std::max(mx, l);
  for (int64_t i = V8; i < V; ++i) {
    if (!std::isfinite(x[i])) return false;
    mx = std::max(mx, x[i]);
  }
  if (_mm256_movemask_ps(bad) || !std::isfinite(mx)) return false;
  int64_t at = 0;
  while (x[at] != mx) ++at;
  const __m256 mv = _mm256_set1_ps(mx);
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= V8; i += 16) {
    s0 = _mm256_add_ps(s0, exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv)));
    s1 = _mm256_add_ps(s1, exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8), mv)));
  }
  for (; i < V8; i += 8) s0 = _mm256_add_ps(s0, exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv)));
  float sum = hsum8(_mm256_add_ps(s0, s1));
  for (int64_t j = V8; j < V; ++j) sum += std::exp(x[j] - mx);
  *token = at;
  *logp = (x[at] - mx) - std::log(sum);
  return true;
}
#endif

// Greedy decoding's per-row result: argmax (the first of equal maxima, as torch.argmax) and its log-probability
// under log_softmax, without writing the [rows, vocab] log-softmax (equal to it to float rounding).
std::pair<Tensor, Tensor> greedy_rows(const Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.device().is_cpu(), "greedy_rows takes [rows, vocab] CPU logits");
  c10::InferenceMode inference;
  Tensor x = logits.to(at::kFloat).contiguous();
  const int64_t R = x.size(0), V = x.size(1);
  Tensor token = at::empty({R}, x.options().dtype(at::kLong));
  Tensor logp = at::empty({R}, x.options());
  int64_t* pt = token.data_ptr<int64_t>();
  float* pl = logp.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) {
#ifdef MC_PAIR_KERNEL
    if (V > 0 && cpu_has_avx2_fma() && greedy_row(x.data_ptr<float>() + r * V, V, pt + r, pl + r)) continue;
#endif
    Tensor row = x[r];
    pt[r] = argmax_rows(row.unsqueeze(0)).item<int64_t>();
    pl[r] = at::log_softmax(row, -1)[pt[r]].item<float>();
  }
  return {token, logp};
}


// x @ w.T (+ b) for at most 4 rows of x (decoding a request or two): there a matmul's cost is MKL's per-call setup
// and packing, not arithmetic, and AVX2 dot products over the weight rows are about twice as fast (from 16 rows
// on MKL is faster). Equal to at::linear to float rounding; at::linear elsewhere (more rows, other dtypes, no AVX2).
Tensor small_linear(const Tensor& x, const Tensor& w, const OptTensor& b) {
#ifdef MC_PAIR_KERNEL
  const int64_t n = x.size(-1), rows = w.size(0), T = n ? x.numel() / n : 0;
  if (T >= 1 && T <= 4 && x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && w.dim() == 2 &&
      w.is_contiguous() && (!b.has_value() || b->scalar_type() == at::kFloat) && cpu_has_avx2_fma()) {
    Tensor xc = x.reshape({T, n}).contiguous();
    Tensor out = at::empty({T, rows}, x.options());
    const float* px = xc.data_ptr<float>();
    const float* pw = w.data_ptr<float>();
    float* po = out.data_ptr<float>();
    int64_t t = 0;
    for (; t + 2 <= T; t += 2) {
      const float* xs[2] = {px + t * n, px + (t + 1) * n};
      dot_rows<2>(pw, rows, n, xs, po + t * rows, rows);
    }
    if (t < T) {
      const float* xs[2] = {px + t * n, nullptr};
      dot_rows<1>(pw, rows, n, xs, po + t * rows, rows);
    }
    if (b.has_value()) out.add_(*b);
    auto sizes = x.sizes().vec();
    sizes.back() = rows;
    return out.view(sizes);
  }
#endif
  return at::linear(x, w, b);
}

#ifdef MC_PAIR_KERNEL
// The SwiGLU experts over rows sorted by expert (GroupedExperts.forward's interface; its reference is
// GroupedExperts.reference_forward): y[r] = w2_e (silu(w1_e x_r) * w3_e x_r) for the rows r of expert e,
// offs cumulative row counts. For a few rows per expert (decoding): each weight row is read once per pair of
// rows by AVX2 dot products, where a matmul per expert pays its per-call cost on tiny shapes.
Tensor swiglu_rows(const Tensor& x_SD, const Tensor& w1, const Tensor& w3, const Tensor& w2, const Tensor& offs) {
  TORCH_CHECK(x_SD.scalar_type() == at::kFloat && w1.scalar_type() == at::kFloat && w1.is_contiguous() &&
              w3.is_contiguous() && w2.is_contiguous() && cpu_has_avx2_fma(), "swiglu_rows takes float32 CPU tensors");
  c10::InferenceMode inference;
  Tensor x = x_SD.contiguous();
  Tensor ends = offs.to(at::kLong).contiguous();
  const int64_t E = w1.size(0), F = w1.size(1), D = w1.size(2), S = x.size(0);
  Tensor gate = at::empty({S, F}, x.options()), up = at::empty({S, F}, x.options());
  Tensor y = at::empty({S, D}, x.options());
  const float* px = x.data_ptr<float>();
  const int64_t* pe = ends.data_ptr<int64_t>();
  float* pg = gate.data_ptr<float>();
  float* pu = up.data_ptr<float>();
  auto each_pair = [&](auto&& fn) {
    int64_t start = 0;
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t r = start; r < pe[e]; r += 2) fn(e, r, r + 1 < pe[e]);
      start = pe[e];
    }
  };
  each_pair([&](int64_t e, int64_t r, bool two) {
    const float* xs[2] = {px + r * D, two ? px + (r + 1) * D : nullptr};
    if (two) {
      dot_rows<2>(w1.data_ptr<float>() + e * F * D, F, D, xs, pg + r * F, F);
      dot_rows<2>(w3.data_ptr<float>() + e * F * D, F, D, xs, pu + r * F, F);
    } else {
      dot_rows<1>(w1.data_ptr<float>() + e * F * D, F, D, xs, pg + r * F, F);
      dot_rows<1>(w3.data_ptr<float>() + e * F * D, F, D, xs, pu + r * F, F);
    }
  });
  at::silu_(gate).mul_(up);
  each_pair([&](int64_t e, int64_t r, bool two) {
    const float* as[2] = {pg + r * F, two ? pg + (r + 1) * F : nullptr};
    if (two) dot_rows<2>(w2.data_ptr<float>() + e * D * F, D, F, as, y.data_ptr<float>() + r * D, D);
    else dot_rows<1>(w2.data_ptr<float>() + e * D * F, D, F, as, y.data_ptr<float>() + r * D, D);
  });
  return y;
}

// MLA attention in the latent space over a paged cache (kernels/paged_attention.py latent_attention; its reference
// is latent_attention_reference there): q [B, N * H, X] score rows ordered (position, head), cache [slots, X]
// rows (latent C, then rope key), slots_BL the cache slot of every position of each sequence, row (b, n) seeing
// positions 0..pos[b, n]. Reads the rows where they lie instead of gathering a copy. Returns [B, N * H, C].
Tensor paged_latent_attention(const Tensor& q, const Tensor& cache, const Tensor& slots_BL, const Tensor& pos_BN,
                              double scale, int64_t C) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat && cache.scalar_type() == at::kFloat,
              "paged_latent_attention takes float32 CPU tensors");
  TORCH_CHECK(cpu_has_avx2_fma(), "paged_latent_attention needs AVX2/FMA (check has_avx2() first)");
  c10::InferenceMode inference;
  const int64_t B = pos_BN.size(0), N = pos_BN.size(1), X = cache.size(1), H = q.size(1) / N, L = slots_BL.size(1);
  Tensor qc = q.contiguous(), cc = cache.contiguous();
  Tensor slots = slots_BL.to(at::kLong);
  if (slots.stride(1) != 1) slots = slots.contiguous();
  Tensor pos = pos_BN.to(at::kLong).contiguous();
  Tensor scores = at::empty({B, N * H, L}, q.options());
  latent_scores(qc.data_ptr<float>(), cc.data_ptr<float>(), X, slots.data_ptr<int64_t>(), slots.stride(0),
                pos.data_ptr<int64_t>(), B, N, H, L, static_cast<float>(scale), scores.data_ptr<float>());
  Tensor probs = at::softmax(scores, -1);
  Tensor out = at::empty({B, N * H, C}, q.options());
  latent_values(probs.data_ptr<float>(), cc.data_ptr<float>(), X, C, slots.data_ptr<int64_t>(), slots.stride(0),
                pos.data_ptr<int64_t>(), B, N, H, L, out.data_ptr<float>());
  return out;
}

// The absorbed MLA attention of new positions over the paged cache, with the cache write (reference:
// kernels/paged_attention.py absorbed_attention over latent_attention): stores the new rows' [latent | rope key]
// at their slots, forms the latent queries q_nope W_uk per head, attends in the latent space
// (paged_latent_attention) and expands the result by W_uv. q [B, N, H, Dn + R] (rope applied), kv_new [B, N, C + R],
// w_kv [H, Dn + Dv, C] (a view of wkv_b's weight). Returns [B, N, H * Dv]. For a few new positions (N <= 4).
Tensor absorbed_attention(const Tensor& q, const Tensor& kv_new, const Tensor& w_kv, Tensor& cache,
                          const Tensor& write_slots, const OptTensor& rows, const Tensor& slots_BL,
                          const Tensor& pos_BN, double scale) {
  c10::InferenceMode inference;
  const int64_t B = q.size(0), N = q.size(1), H = q.size(2), X = kv_new.size(-1), C = w_kv.size(2);
  const int64_t Dn = q.size(3) - (X - C), Dv = w_kv.size(1) - Dn;
  Tensor vals = kv_new.reshape({B * N, X});
  if (rows.has_value()) vals = vals.index_select(0, *rows);
  cache.index_copy_(0, write_slots, vals);
  Tensor q_lat = at::bmm(q.narrow(-1, 0, Dn).reshape({B * N, H, Dn}).transpose(0, 1), w_kv.narrow(1, 0, Dn));
  Tensor q_MX = at::cat({q_lat.transpose(0, 1).view({B, N, H, C}), q.narrow(-1, Dn, X - C)}, -1).view({B, N * H, X});
  Tensor o_lat = paged_latent_attention(q_MX, cache, slots_BL, pos_BN, scale, C);
  Tensor o = at::bmm(o_lat.view({B * N, H, C}).transpose(0, 1), w_kv.narrow(1, Dn, Dv).transpose(1, 2));
  return o.transpose(0, 1).reshape({B, N, H * Dv});
}
#endif

bool has_avx2() {
#ifdef MC_PAIR_KERNEL
  return cpu_has_avx2_fma();
#else
  return false;
#endif
}

// The model's Router.forward (no replay; reference: model/moe.py Router.forward): float32 scores, group-limited
// top-k on biased scores. The scores are ATen's (vectorised sigmoid/softmax, bit for bit the model's); the
// selection is a loop over each token's E scores instead of ~15 tiny tensor operations, making the same choices
// in the same order: torch.topk's CPU kernel (ATen/native/TopKImpl.h) ranks (double score, index) pairs with
// std::nth_element (k * 64 > E) or std::partial_sort, and the order of the chosen experts is the order it leaves
// them in.
std::tuple<Tensor, Tensor, Tensor> route(const Tensor& x_TD, const Tensor& router_w, const OptTensor& router_bias,
                                         bool sigmoid, bool norm_topk, int64_t top_k, int64_t n_group,
                                         int64_t topk_group, double routed_scale) {
  c10::InferenceMode inference;
  Tensor logits = small_linear(x_TD.to(at::kFloat), router_w.to(at::kFloat).contiguous(), std::nullopt);
  Tensor scores = (sigmoid ? logits.sigmoid() : logits.softmax(-1)).contiguous();
  const int64_t T = scores.size(0), E = scores.size(1), K = top_k, G = n_group, per_group = E / n_group;
  Tensor indices = at::empty({T, K}, scores.options().dtype(at::kLong));
  Tensor weights = at::empty({T, K}, scores.options());
  Tensor bias = router_bias.has_value() ? router_bias->to(at::kFloat).contiguous() : Tensor();
  const float* pb = bias.defined() ? bias.data_ptr<float>() : nullptr;
  const float* ps = scores.data_ptr<float>();
  int64_t* pi = indices.data_ptr<int64_t>();
  float* pw = weights.data_ptr<float>();
  using Elem = std::pair<double, int64_t>;
  auto larger = [](const Elem& a, const Elem& b) {
    return (std::isnan(a.first) && !std::isnan(b.first)) || a.first > b.first;
  };
  auto top = [&](std::vector<Elem>& q, int64_t k, bool sorted) {  // torch.topk's CPU selection
    if (k * 64 <= static_cast<int64_t>(q.size())) {
      std::partial_sort(q.begin(), q.begin() + k, q.end(), larger);
    } else {
      std::nth_element(q.begin(), q.begin() + k - 1, q.end(), larger);
      if (sorted) std::sort(q.begin(), q.begin() + k - 1, larger);
    }
  };
  std::vector<float> choice(E);
  std::vector<Elem> q(E), gq(G), inq(per_group);
  std::vector<char> keep(G);
  for (int64_t t = 0; t < T; ++t) {
    const float* st = ps + t * E;
    for (int64_t e = 0; e < E; ++e) choice[e] = pb ? st[e] + pb[e] : st[e];
    if (G > 1) {
      for (int64_t g = 0; g < G; ++g) {  // a group's score: the sum of its two best (topk(2).values.sum())
        for (int64_t j = 0; j < per_group; ++j) inq[j] = {choice[g * per_group + j], j};
        top(inq, 2, true);
        gq[g] = {static_cast<float>(static_cast<float>(inq[0].first) + static_cast<float>(inq[1].first)), g};
      }
      top(gq, topk_group, false);
      std::fill(keep.begin(), keep.end(), 0);
      for (int64_t g = 0; g < topk_group; ++g) keep[gq[g].second] = 1;
      for (int64_t e = 0; e < E; ++e)
        if (!keep[e / per_group]) choice[e] = -INFINITY;
    }
    for (int64_t e = 0; e < E; ++e) q[e] = {choice[e], e};
    top(q, K, false);
    float sum = 0.0f;
    for (int64_t k = 0; k < K; ++k) {
      pi[t * K + k] = q[k].second;
      pw[t * K + k] = st[q[k].second];
      sum += pw[t * K + k];
    }
    if (norm_topk) {
      const float denom = sum + static_cast<float>(sigmoid ? 1e-20 : 0.0);
      for (int64_t k = 0; k < K; ++k) pw[t * K + k] = pw[t * K + k] / denom;
    }
    const float scale = static_cast<float>(routed_scale);
    for (int64_t k = 0; k < K; ++k) pw[t * K + k] = pw[t * K + k] * scale;
  }
  return {indices, weights, scores};
}


#ifdef MC_PAIR_KERNEL
// MoE.dispatch's work for a few tokens (reference: model/moe.py local_dispatch): out[t] = sum_k gate[t, k] *
// SwiGLU_{e(t, k)}(x[t]), computing exactly the chosen (token, expert) pairs with no sort or permutation.
Tensor pair_swiglu(const Tensor& x_TD, const Tensor& indices_TK, const Tensor& weights_TK, const Tensor& w1,
                   const Tensor& w3, const Tensor& w2) {
  TORCH_CHECK(x_TD.scalar_type() == at::kFloat && w1.scalar_type() == at::kFloat && w1.is_contiguous() &&
              w3.is_contiguous() && w2.is_contiguous() && cpu_has_avx2_fma(), "pair_swiglu takes float32 CPU tensors");
  c10::InferenceMode inference;
  const int64_t E = w1.size(0), F = w1.size(1), D = w1.size(2);
  Tensor x = x_TD.contiguous();
  Tensor idx = indices_TK.to(at::kLong).contiguous();
  Tensor gates = weights_TK.to(at::kFloat).contiguous();
  const int64_t T = idx.size(0), K = idx.size(1);
  std::vector<const float*> w1s(E), w3s(E), w2s(E);
  std::vector<int64_t> widths(E, F);
  for (int64_t e = 0; e < E; ++e) {
    w1s[e] = w1.data_ptr<float>() + e * F * D;
    w3s[e] = w3.data_ptr<float>() + e * F * D;
    w2s[e] = w2.data_ptr<float>() + e * D * F;
  }
  std::vector<std::vector<std::pair<int64_t, float>>> pairs(E);
  const int64_t* pi = idx.data_ptr<int64_t>();
  const float* pw = gates.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) {
      TORCH_CHECK(pi[t * K + k] >= 0 && pi[t * K + k] < E, "pair_swiglu: expert index out of range");
      pairs[pi[t * K + k]].push_back({t, pw[t * K + k]});
    }
  Tensor out = at::zeros_like(x);
  pair_experts(x, w1s, w3s, w2s, widths, pairs, out);
  return out;
}
#endif

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("has_avx2", &has_avx2, "whether the AVX2/FMA kernels run on this CPU");
  m.def("small_linear", &small_linear, "x @ w.T (+ b) for a few rows of x (decode sizes)", pybind11::arg("x"),
        pybind11::arg("w"), pybind11::arg("b") = pybind11::none());
  m.def("argmax_rows", &argmax_rows, "argmax over the last dim of [rows, vocab] (first of equal maxima)");
  m.def("greedy_rows", &greedy_rows, "per row of [rows, vocab] logits: argmax and its log_softmax log-probability");
  m.def("route", &route, "the router's scores and group-limited top-k selection (Router.forward without replay)");
#ifdef MC_PAIR_KERNEL
  m.def("swiglu_rows", &swiglu_rows, "SwiGLU experts over a few rows sorted by expert (AVX2 dot products)");
  m.def("pair_swiglu", &pair_swiglu, "the gated SwiGLU experts of each token's chosen (token, expert) pairs");
  m.def("absorbed_attention", &absorbed_attention,
        "MLA's absorbed attention of new positions over a paged cache, writing it");
  m.def("paged_latent_attention", &paged_latent_attention, "MLA latent attention of new positions over a paged cache");
#endif
}
