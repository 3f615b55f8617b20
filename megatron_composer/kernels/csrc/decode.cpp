// The inference engine's fast path (megatron_composer/inference/fast_path.py) in C++: the same operations in
// the same order on the same fused weights, so results equal the Python path's to float rounding (RMSNorm and
// RoPE are hand loops; everything else is the same ATen call). Decoding a small batch is bound by per-operation
// overhead, not arithmetic; one call per forward pass instead of ~40 Python-dispatched operations per layer is
// the point. fast_path.py is the reference; tests/test_inference_fast_cpp.py compares the two.
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

template <typename T>
void rms_rows(const T* x, int64_t row_stride, const T* w, T* y, int64_t rows, int64_t D, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * row_stride;
    T* yr = y + r * D;
    double ss = 0.0;  // one accumulator in double: as accurate as torch's blocked float sums at any width
    for (int64_t i = 0; i < D; ++i) {
      const double v = static_cast<float>(xr[i]);
      ss += v * v;
    }
    const float rstd = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(D) + eps));
    for (int64_t i = 0; i < D; ++i) {
      // normalise in float32, cast back, then scale (the model's RMSNorm)
      T n = static_cast<T>(static_cast<float>(xr[i]) * rstd);
      yr[i] = static_cast<T>(static_cast<float>(n) * static_cast<float>(w[i]));
    }
  }
}

// RMSNorm over the last dim of x (rows may be strided, the last dim contiguous); returns a new contiguous tensor.
Tensor rms_norm(const Tensor& x, const Tensor& w, double eps) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "decode kernels run on CPU tensors only");
  const int64_t D = x.size(-1);
  Tensor x2 = x.stride(-1) == 1 ? x.reshape({-1, D}) : x.contiguous().reshape({-1, D});
  if (x2.stride(-1) != 1) x2 = x2.contiguous();
  Tensor y = at::empty({x2.size(0), D}, x.options());
  Tensor wc = w.contiguous().to(x.scalar_type());
  if (x.scalar_type() == at::kFloat) {
    rms_rows<float>(x2.data_ptr<float>(), x2.stride(0), wc.data_ptr<float>(), y.data_ptr<float>(), x2.size(0), D, eps);
  } else if (x.scalar_type() == at::kBFloat16) {
    rms_rows<at::BFloat16>(x2.data_ptr<at::BFloat16>(), x2.stride(0), wc.data_ptr<at::BFloat16>(),
                           y.data_ptr<at::BFloat16>(), x2.size(0), D, eps);
  } else {
    Tensor x32 = x.to(at::kFloat);
    Tensor r = at::rsqrt(x32.pow(2).mean(-1, true).add_(eps));
    return w * (x32 * r).to(x.scalar_type());
  }
  return y.view(x.sizes());
}

template <typename T>
void rope_rows(T* dst, int64_t dst_stride, const T* src, int64_t src_stride, const T* cos, const T* sin,
               int64_t rows, int64_t heads, int64_t head_stride_dst, int64_t head_stride_src, int64_t half,
               bool interleaved) {
  // rows = B*N positions; cos/sin [rows, half]. Interleaved pairs stay interleaved (as the Python fast path's
  // complex multiply leaves them); halves follow apply_rope (arithmetic in T, like torch's).
  for (int64_t r = 0; r < rows; ++r) {
    const T* c = cos + r * half;
    const T* s = sin + r * half;
    for (int64_t h = 0; h < heads; ++h) {
      const T* x = src + r * src_stride + h * head_stride_src;
      T* y = dst + r * dst_stride + h * head_stride_dst;
      if (interleaved) {
        for (int64_t i = 0; i < half; ++i) {
          float a = static_cast<float>(x[2 * i]), b = static_cast<float>(x[2 * i + 1]);
          float cc = static_cast<float>(c[i]), ss = static_cast<float>(s[i]);
          T re = static_cast<T>(a * cc - b * ss);
          T im = static_cast<T>(a * ss + b * cc);
          y[2 * i] = re;
          y[2 * i + 1] = im;
        }
      } else {
        for (int64_t i = 0; i < half; ++i) {
          T x1 = x[i], x2 = x[i + half];
          T a = static_cast<T>(x1 * c[i]), b = static_cast<T>(x2 * s[i]);
          T d = static_cast<T>(x2 * c[i]), e = static_cast<T>(x1 * s[i]);
          y[i] = static_cast<T>(a - b);
          y[i + half] = static_cast<T>(d + e);
        }
      }
    }
  }
}

// Rotate `heads` heads of `src` ([rows, ...], head h at h * head_stride_src, rope dim 2 * half) into dst.
void rope(Tensor& dst, int64_t dst_stride, int64_t dst_offset, const Tensor& src, int64_t src_stride,
          int64_t src_offset, const Tensor& cos, const Tensor& sin, int64_t rows, int64_t heads,
          int64_t head_stride_dst, int64_t head_stride_src, bool interleaved) {
  const int64_t half = cos.size(-1);
  if (dst.scalar_type() == at::kFloat) {
    rope_rows<float>(dst.data_ptr<float>() + dst_offset, dst_stride, src.data_ptr<float>() + src_offset, src_stride,
                     cos.data_ptr<float>(), sin.data_ptr<float>(), rows, heads, head_stride_dst, head_stride_src, half,
                     interleaved);
  } else {
    TORCH_CHECK(dst.scalar_type() == at::kBFloat16, "decode kernels support float32 and bfloat16");
    rope_rows<at::BFloat16>(dst.data_ptr<at::BFloat16>() + dst_offset, dst_stride,
                            src.data_ptr<at::BFloat16>() + src_offset, src_stride, cos.data_ptr<at::BFloat16>(),
                            sin.data_ptr<at::BFloat16>(), rows, heads, head_stride_dst, head_stride_src, half,
                            interleaved);
  }
}

Tensor softmax_like(const Tensor& scores) {
  return scores.scalar_type() == at::kFloat ? at::softmax(scores, -1)
                                            : at::softmax(scores, -1, at::kFloat).to(scores.scalar_type());
}

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

// An MTP module's block input: eh_proj(cat[enorm(embedding), hnorm(previous hidden)]), the halves normed in place.
Tensor mtp_input(const Tensor& emb, const Tensor& h_prev, const Tensor& enorm_w, double enorm_eps,
                 const Tensor& hnorm_w, double hnorm_eps, const Tensor& eh_w) {
  c10::InferenceMode inference;
  const int64_t D = emb.size(-1);
  Tensor both = at::empty({emb.numel() / D, 2 * D}, emb.options());
  both.narrow(1, 0, D).copy_(rms_norm(emb, enorm_w, enorm_eps).reshape({-1, D}));
  both.narrow(1, D, D).copy_(rms_norm(h_prev, hnorm_w, hnorm_eps).reshape({-1, D}));
  auto sizes = emb.sizes().vec();
  sizes.back() = eh_w.size(0);
  return small_linear(both, eh_w, std::nullopt).view(sizes);
}

// ---- routed experts for a few tokens: AVX2/FMA dot products (x86-64 with those instructions, float32) ----------------
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
      for (int64_t i = 0; i < n8; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(W + j * n + i), _mm256_loadu_ps(x[r] + i), acc);
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
// w13 [2F, D] (gate rows, then up rows) and w2 [D, F] pointers; `pairs` lists (token, gate) per expert.
static void pair_experts(const Tensor& x_TD, const std::vector<const float*>& w13s, const std::vector<const float*>& w2s,
                         const std::vector<int64_t>& widths, const std::vector<std::vector<std::pair<int64_t, float>>>& pairs,
                         Tensor& out_TD) {
  const int64_t D = x_TD.size(1);
  const float* px = x_TD.data_ptr<float>();
  float* po = out_TD.data_ptr<float>();
  // first every pair's gate and up rows, then one vectorised silu(gate) * up, then the down projections
  std::vector<int64_t> offset(pairs.size() + 1, 0);
  for (size_t e = 0; e < pairs.size(); ++e) offset[e + 1] = offset[e] + static_cast<int64_t>(pairs[e].size()) * widths[e];
  Tensor gate = at::empty({offset.back()}, x_TD.options()), up = at::empty({offset.back()}, x_TD.options());
  float* pg = gate.data_ptr<float>();
  float* pu = up.data_ptr<float>();
  for (size_t e = 0; e < pairs.size(); ++e) {
    const int64_t F = widths[e], n = static_cast<int64_t>(pairs[e].size());
    for (int64_t i = 0; i < n; i += 2) {
      const float* xs[2] = {px + pairs[e][i].first * D, i + 1 < n ? px + pairs[e][i + 1].first * D : nullptr};
      const int64_t at_ = offset[e] + i * F;
      if (i + 1 < n) {
        dot_rows<2>(w13s[e], F, D, xs, pg + at_, F);
        dot_rows<2>(w13s[e] + F * D, F, D, xs, pu + at_, F);
      } else {
        dot_rows<1>(w13s[e], F, D, xs, pg + at_, F);
        dot_rows<1>(w13s[e] + F * D, F, D, xs, pu + at_, F);
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
          for (int64_t i = 0; i < X8; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + i), _mm256_loadu_ps(row + i), acc);
          float v = hsum8(acc);
          for (int64_t i = X8; i < X; ++i) v += qh[i] * row[i];
          out[h * L] = v * scale;
        }
      }
    }
  }
}

// out[b, n * H + h, :C] = sum over visible l of probs[b, n * H + h, l] * cache[slot(b, l), :C].
__attribute__((target("avx2,fma"))) static void latent_values(const float* probs, const float* cache, int64_t X, int64_t C,
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
          for (int64_t l = 0; l < Lv; ++l) a = _mm256_fmadd_ps(_mm256_set1_ps(p[l]), _mm256_loadu_ps(cache + sl[l] * X + c), a);
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

// What one forward pass shares across layers: positions' rotation, cache slots, the additive mask.
struct Step {
  Tensor cos, sin;          // [B, N, half], contiguous, the model's dtype
  Tensor write_slots;       // [T] slots of the valid rows
  OptTensor rows;           // flat indices of the valid rows (None: every row)
  Tensor pos;               // [B, N] positions of the new tokens (int64, contiguous)
  Tensor read_slots;        // [B, L] cache slots to attend to (int64, rows may be strided)
  int64_t L = 0;
  at::ScalarType dtype = at::kFloat;

  // made on first use: the paged MLA kernels read slots and positions directly and need neither
  const Tensor& read_flat() const {
    if (!read_flat_.defined()) read_flat_ = read_slots.reshape({-1});
    return read_flat_;
  }
  // [B, N, L] additive mask (0 / -inf), the model's dtype
  const Tensor& bias() const {
    if (!bias_.defined()) {
      Tensor visible = at::arange(L, pos.options()) <= pos.unsqueeze(-1);
      bias_ = at::zeros(visible.sizes(), pos.options().dtype(dtype)).masked_fill_(visible.logical_not(), -INFINITY);
    }
    return bias_;
  }

  Tensor valid_rows(const Tensor& x_BN_) const {
    Tensor flat = x_BN_.reshape({-1, x_BN_.size(-1)});
    return rows.has_value() ? flat.index_select(0, *rows) : flat;
  }

 private:
  mutable Tensor read_flat_, bias_;
};

struct Block {
  // norms
  Tensor attn_norm, ffn_norm;
  double eps = 1e-6;
  // attention: "mla" or "gqa"
  bool mla = true;
  int64_t H = 0, Q = 0, C = 0, R = 0, Dn = 0, Dv = 0, KV = 0, Dh = 0;
  bool q_lora = false, q_folded = false, o_folded = false, interleave = false;
  Tensor w_down, w_q, w_uk, w_uv, w_o, kv_norm, w_qkv;
  OptTensor b_down, q_norm, b_o, b_qkv, k_norm;
  double q_eps = 1e-6, scale = 1.0;
  // feed-forward: dense SwiGLU (w13, w2) or MoE
  bool moe = false;
  Tensor w13, w2;                   // dense: [2F, D], [D, F]; MoE: routed experts [E, 2F, D], [E, D, F]
  OptTensor w13_all, w2_all, gate_init;  // every-expert form (few experts)
  OptTensor shared_w13, shared_w2;  // shared experts as one SwiGLU
  Tensor router_w;
  OptTensor router_bias;
  bool sigmoid = true, norm_topk = false;
  int64_t E = 0, top_k = 1, n_group = 1, topk_group = 1;
  double routed_scale = 1.0;
  std::vector<Tensor> cache;        // this block's KV cache tensors (the engine's, shared)

  Tensor swiglu(const Tensor& x, const Tensor& w13_, const Tensor& w2_) const {
    auto gu = small_linear(x, w13_, std::nullopt).chunk(2, -1);
    return small_linear(at::silu(gu[0]) * gu[1], w2_, std::nullopt);
  }

  Tensor attention_mla(const Tensor& x_BND, const Step& s, const Tensor& cache) const {
    const int64_t B = x_BND.size(0), N = x_BND.size(1);
    Tensor down = small_linear(x_BND, w_down, b_down);  // [B, N, Q + C + R]
    Tensor q_in = down.narrow(-1, 0, Q);
    if (q_lora) q_in = small_linear(rms_norm(q_in, *q_norm, q_eps), w_q, std::nullopt);
    Tensor c_kv = rms_norm(down.narrow(-1, Q, C), kv_norm, q_eps);  // [B, N, C] contiguous
    const int64_t X = C + R, rows = B * N;
    // score rows [B, N, H, C + R]: latent query, then the rotated rope query
    Tensor q_MX = at::empty({B, N, H, X}, x_BND.options());
    Tensor q_rope_src;
    int64_t q_stride, q_head_stride, q_rope_off;
    if (q_folded) {
      Tensor q = q_in.contiguous().view({B, N, H, X});
      q_MX.narrow(-1, 0, C).copy_(q.narrow(-1, 0, C));
      q_rope_src = q, q_stride = H * X, q_head_stride = X, q_rope_off = C;
    } else {
      Tensor q = q_in.contiguous().view({B, N, H, Dn + R});
      Tensor q_lat = at::bmm(q.narrow(-1, 0, Dn).reshape({rows, H, Dn}).transpose(0, 1), w_uk);  // [H, rows, C]
      q_MX.narrow(-1, 0, C).copy_(q_lat.transpose(0, 1).view({B, N, H, C}));
      q_rope_src = q, q_stride = H * (Dn + R), q_head_stride = Dn + R, q_rope_off = Dn;
    }
    rope(q_MX, H * X, C, q_rope_src, q_stride, q_rope_off, s.cos, s.sin, rows, H, X, q_head_stride, interleave);
    Tensor kv_new = at::empty({B, N, X}, x_BND.options());
    kv_new.narrow(-1, 0, C).copy_(c_kv);
    Tensor downc = down.contiguous();
    rope(kv_new, X, C, downc, Q + C + R, Q + C, s.cos, s.sin, rows, 1, 0, 0, interleave);
    Tensor vals = s.valid_rows(kv_new);
    cache.index_copy_(0, s.write_slots, vals.scalar_type() == cache.scalar_type() ? vals : vals.to(cache.scalar_type()));
    Tensor o_lat;  // [B, N * H, C]
#ifdef MC_PAIR_KERNEL
    if (N <= 4 && x_BND.scalar_type() == at::kFloat && cache.scalar_type() == at::kFloat && cache.is_contiguous() &&
        s.read_slots.stride(1) == 1 && cpu_has_avx2_fma()) {
      // a few new positions per request (decoding, verification): attend to the cache rows where they lie
      Tensor scores = at::empty({B, N * H, s.L}, x_BND.options());
      latent_scores(q_MX.data_ptr<float>(), cache.data_ptr<float>(), X, s.read_slots.data_ptr<int64_t>(),
                    s.read_slots.stride(0), s.pos.data_ptr<int64_t>(), B, N, H, s.L, static_cast<float>(scale),
                    scores.data_ptr<float>());
      Tensor probs = at::softmax(scores, -1);
      o_lat = at::empty({B, N * H, C}, x_BND.options());
      latent_values(probs.data_ptr<float>(), cache.data_ptr<float>(), X, C, s.read_slots.data_ptr<int64_t>(),
                    s.read_slots.stride(0), s.pos.data_ptr<int64_t>(), B, N, H, s.L, o_lat.data_ptr<float>());
    }
#endif
    if (!o_lat.defined()) {
      Tensor kv_BLX = cache.index_select(0, s.read_flat()).view({B, s.L, X});
      if (kv_BLX.scalar_type() != x_BND.scalar_type()) kv_BLX = kv_BLX.to(x_BND.scalar_type());
      Tensor bias = N == 1 ? s.bias() : s.bias().unsqueeze(2).expand({B, N, H, s.L}).reshape({B, N * H, s.L});
      Tensor scores = at::baddbmm(bias, q_MX.view({B, N * H, X}), kv_BLX.transpose(1, 2), 1.0, scale);
      Tensor probs = softmax_like(scores);
      o_lat = at::bmm(probs, kv_BLX.narrow(-1, 0, C));
    }
    Tensor out;
    if (o_folded) {
      out = small_linear(o_lat.view({B, N, H * C}), w_o, std::nullopt);
    } else {
      Tensor o = at::bmm(o_lat.view({rows, H, C}).transpose(0, 1), w_uv);  // [H, rows, Dv]
      out = small_linear(o.transpose(0, 1).reshape({B, N, H * Dv}), w_o, std::nullopt);
    }
    return b_o.has_value() ? out + *b_o : out;
  }

  Tensor attention_gqa(const Tensor& x_BND, const Step& s, const Tensor& k_cache, const Tensor& v_cache) const {
    const int64_t B = x_BND.size(0), N = x_BND.size(1), rep = H / KV, rows = B * N;
    Tensor qkv = small_linear(x_BND, w_qkv, b_qkv).view({B, N, H + 2 * KV, Dh});
    Tensor q = qkv.narrow(2, 0, H), k = qkv.narrow(2, H, KV), v = qkv.narrow(2, H + KV, KV);
    if (q_norm.has_value()) {
      q = rms_norm(q, *q_norm, q_eps);
      k = rms_norm(k, *k_norm, q_eps);
    } else {
      q = q.contiguous();
      k = k.contiguous();
    }
    Tensor qr = at::empty({B, N, H, Dh}, x_BND.options()), kr = at::empty({B, N, KV, Dh}, x_BND.options());
    rope(qr, H * Dh, 0, q, H * Dh, 0, s.cos, s.sin, rows, H, Dh, Dh, false);
    rope(kr, KV * Dh, 0, k, KV * Dh, 0, s.cos, s.sin, rows, KV, Dh, Dh, false);
    auto put = [&](const Tensor& cache, const Tensor& t) {
      Tensor vals = s.rows.has_value() ? t.reshape({rows, KV, Dh}).index_select(0, *s.rows) : t.reshape({rows, KV, Dh});
      cache.index_copy_(0, s.write_slots, vals.scalar_type() == cache.scalar_type() ? vals : vals.to(cache.scalar_type()));
    };
    put(k_cache, kr);
    put(v_cache, v);
    Tensor k_BLKD = k_cache.index_select(0, s.read_flat()).view({B, s.L, KV, Dh}).to(x_BND.scalar_type());
    Tensor v_BLKD = v_cache.index_select(0, s.read_flat()).view({B, s.L, KV, Dh}).to(x_BND.scalar_type());
    Tensor q_BKMD = qr.view({B, N, KV, rep, Dh}).permute({0, 2, 3, 1, 4}).reshape({B, KV, rep * N, Dh});
    Tensor bias = s.bias().unsqueeze(1).unsqueeze(1).expand({B, 1, rep, N, s.L}).reshape({B, 1, rep * N, s.L});
    Tensor scores = at::matmul(q_BKMD, k_BLKD.permute({0, 2, 3, 1})) * scale + bias;
    Tensor probs = at::softmax(scores, -1, at::kFloat).to(x_BND.scalar_type());
    Tensor o = at::matmul(probs, v_BLKD.transpose(1, 2));  // [B, KV, rep * N, Dh]
    o = o.view({B, KV, rep, N, Dh}).permute({0, 3, 1, 2, 4}).reshape({B, N, H * Dh});
    return small_linear(o, w_o, std::nullopt);
  }

  // The model's Router.forward (no replay): float32 scores, group-limited top-k on biased scores. The scores
  // are ATen's (vectorised sigmoid/softmax, bit for bit the model's); the selection is a loop over each token's
  // E scores instead of ~15 tiny tensor operations, making the same choices in the same order: torch.topk's CPU
  // kernel (ATen/native/TopKImpl.h) ranks (double score, index) pairs with std::nth_element (k * 64 > E) or
  // std::partial_sort, and the order of the chosen experts is the order it leaves them in.
  std::pair<Tensor, Tensor> route(const Tensor& x_TD) const {
    Tensor logits = small_linear(x_TD.to(at::kFloat), router_w.to(at::kFloat), std::nullopt);
    Tensor scores = (sigmoid ? logits.sigmoid() : logits.softmax(-1)).contiguous();
    const int64_t T = scores.size(0), K = top_k, G = n_group, per_group = E / n_group;
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
    return {indices, weights};
  }

  std::pair<Tensor, Tensor> feed_forward_moe(const Tensor& x_BND) const {
    const int64_t B = x_BND.size(0), N = x_BND.size(1), D = x_BND.size(2);
    Tensor x_TD = x_BND.reshape({-1, D});
    auto [indices_TK, weights_TK] = route(x_TD);
    const int64_t T = indices_TK.size(0), K = indices_TK.size(1);
    Tensor out;
    bool shared_done = false;
#ifdef MC_PAIR_KERNEL
    if (x_TD.scalar_type() == at::kFloat && T * K <= 16 * E && cpu_has_avx2_fma() && w13.is_contiguous() &&
        w2.is_contiguous() && (!shared_w13.has_value() || (shared_w13->is_contiguous() && shared_w2->is_contiguous()))) {
      // the chosen (token, expert) pairs only; the shared experts as one more expert every token takes with gate 1
      const int64_t F = w2.size(2), S = shared_w13.has_value() ? 1 : 0;
      std::vector<const float*> w13s(E + S), w2s(E + S);
      std::vector<int64_t> widths(E + S, F);
      for (int64_t e = 0; e < E; ++e) {
        w13s[e] = w13.data_ptr<float>() + e * 2 * F * D;
        w2s[e] = w2.data_ptr<float>() + e * D * F;
      }
      std::vector<std::vector<std::pair<int64_t, float>>> pairs(E + S);
      Tensor xc = x_TD.contiguous();
      const int64_t* pi = indices_TK.data_ptr<int64_t>();
      const float* pw = weights_TK.data_ptr<float>();
      for (int64_t t = 0; t < T; ++t)
        for (int64_t k = 0; k < K; ++k) pairs[pi[t * K + k]].push_back({t, pw[t * K + k]});
      if (S) {
        w13s[E] = shared_w13->data_ptr<float>();
        w2s[E] = shared_w2->data_ptr<float>();
        widths[E] = shared_w2->size(1);
        for (int64_t t = 0; t < T; ++t) pairs[E].push_back({t, 1.0f});
      }
      out = at::zeros_like(xc);
      pair_experts(xc, w13s, w2s, widths, pairs, out);
      return {out.view({B, N, D}), indices_TK.view({B, N, -1})};
    }
#endif
    if (w2_all.has_value() && E <= T * K && T * K <= 16 * E) {
      // every token through every expert (and the folded shared ones), unchosen experts gated 0
      const int64_t EA = w13_all->size(0);
      auto gu = at::linear(x_TD, w13_all->view({-1, D})).view({T, EA, -1}).chunk(2, -1);
      Tensor gates = gate_init->unsqueeze(0).expand({T, EA}).contiguous().scatter_(1, indices_TK,
                                                                                    weights_TK.to(x_TD.scalar_type()));
      out = at::linear(((at::silu(gu[0]) * gu[1]) * gates.unsqueeze(-1)).view({T, -1}), *w2_all);
      shared_done = EA > E;
    } else {
      // tokens sorted by expert, one matmul per expert that received tokens
      Tensor flat = indices_TK.reshape({-1});
      Tensor order = at::argsort(flat, /*stable=*/true);
      Tensor token_of_slot = at::floor_divide(order, K);
      Tensor x_SD = x_TD.index_select(0, token_of_slot);
      Tensor counts = at::bincount(flat, {}, E).contiguous();
      const int64_t* c = counts.data_ptr<int64_t>();
      Tensor h = at::empty({x_SD.size(0), w13.size(1)}, x_SD.options());
      int64_t start = 0;
      for (int64_t e = 0; e < E; ++e) {
        if (c[e]) {
          Tensor hs = h.narrow(0, start, c[e]);
          at::mm_out(hs, x_SD.narrow(0, start, c[e]), w13[e].t());
          start += c[e];
        }
      }
      auto gu = h.chunk(2, -1);
      Tensor act = at::silu(gu[0]) * gu[1];
      Tensor y_SD = at::empty_like(x_SD);
      start = 0;
      for (int64_t e = 0; e < E; ++e) {
        if (c[e]) {
          Tensor ys = y_SD.narrow(0, start, c[e]);
          at::mm_out(ys, act.narrow(0, start, c[e]), w2[e].t());
          start += c[e];
        }
      }
      y_SD = y_SD * weights_TK.reshape({-1}).index_select(0, order).unsqueeze(1).to(y_SD.scalar_type());
      out = at::zeros_like(x_TD).index_add_(0, token_of_slot, y_SD);
    }
    if (shared_w13.has_value() && !shared_done) out = out + swiglu(x_TD, *shared_w13, *shared_w2);
    return {out.view({B, N, D}), indices_TK.view({B, N, -1})};
  }

  // One transformer block over new tokens; returns (h, chosen experts [B, N, K] or an undefined tensor).
  std::pair<Tensor, Tensor> forward(const Tensor& h_BND, const Step& s, const std::vector<Tensor>& cache) const {
    Tensor x = rms_norm(h_BND, attn_norm, eps);
    Tensor attn = mla ? attention_mla(x, s, cache[0]) : attention_gqa(x, s, cache[0], cache[1]);
    Tensor h = h_BND + attn;
    x = rms_norm(h, ffn_norm, eps);
    if (moe) {
      auto [out, indices] = feed_forward_moe(x);
      return {h + out, indices};
    }
    return {h + swiglu(x, w13, w2), Tensor()};
  }
};

// Blocks [first, last) of `blocks` over h; caches[i] are block i's cache tensors. Returns (h, routes stacked over
// the MoE blocks [M, B, N, K], or an empty list).
// New tokens sit at positions pos_BN; RoPE tables and the causal mask over the L cached slots are made here as
// the model's RotaryEmbedding and the engine's _Batch.bias_BNL make them.
Step make_step(const Tensor& pos_BN, const Tensor& inv_freq, double attention_factor, at::ScalarType dtype,
               const Tensor& write_slots, const OptTensor& rows, const Tensor& read_slots_BL) {
  Step s;
  Tensor freqs = pos_BN.unsqueeze(-1).to(at::kFloat) * inv_freq.to(at::kFloat);
  s.cos = (freqs.cos() * attention_factor).to(dtype).contiguous();
  s.sin = (freqs.sin() * attention_factor).to(dtype).contiguous();
  s.write_slots = write_slots;
  s.rows = rows;
  s.pos = pos_BN.to(at::kLong).contiguous();
  s.read_slots = read_slots_BL.to(at::kLong);
  s.L = read_slots_BL.size(1);
  s.dtype = dtype;
  return s;
}

std::pair<Tensor, std::vector<Tensor>> run_blocks(const std::vector<Block*>& blocks, int64_t first, int64_t last,
                                                  const Tensor& h_BND, const Step& s) {
  Tensor h = h_BND;
  std::vector<Tensor> routes;
  for (int64_t i = first; i < last; ++i) {
    auto [out, indices] = blocks[i]->forward(h, s, blocks[i]->cache);
    h = out;
    if (indices.defined()) routes.push_back(indices);
  }
  return {h, routes};
}

std::pair<Tensor, std::vector<Tensor>> forward_blocks(const std::vector<Block*>& blocks, int64_t first, int64_t last,
                                                      const Tensor& h_BND, const Tensor& pos_BN,
                                                      const Tensor& inv_freq, double attention_factor,
                                                      const Tensor& write_slots, const OptTensor& rows,
                                                      const Tensor& read_slots_BL) {
  TORCH_CHECK(h_BND.device().is_cpu(), "decode kernels run on CPU tensors only");
  c10::InferenceMode inference;
  return run_blocks(blocks, first, last, h_BND,
                    make_step(pos_BN, inv_freq, attention_factor, h_BND.scalar_type(), write_slots, rows, read_slots_BL));
}

// The engine's _Batch in C++: new tokens tokens[b] at positions starts[b].. of sequences whose cache slots are the
// rows of table_BW. Rows past a sequence's tokens are padding (id 0, never written); rows of sequences marked in
// `scratch` write to the scratch slot 0.
struct Layout {
  Tensor ids, pos, write, read;  // [B, N], [B, N], [T] (valid rows), [B, L]
  OptTensor rows, last;          // flat indices of the valid rows and of each sequence's last one (None: all valid)
  int64_t N = 0;
};

Layout make_layout(const std::vector<std::vector<int64_t>>& tokens, const std::vector<int64_t>& starts,
                   const Tensor& table_BW, const std::vector<char>& scratch) {
  const int64_t B = static_cast<int64_t>(tokens.size()), W = table_BW.size(1);
  const int64_t* pt = table_BW.data_ptr<int64_t>();
  int64_t N = 0, L = 0, T = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = static_cast<int64_t>(tokens[b].size());
    TORCH_CHECK(n >= 1 && starts[b] + n <= W, "layout: every sequence needs new tokens inside its reserved slots");
    N = std::max(N, n);
    L = std::max(L, starts[b] + n);
    T += n;
  }
  const bool ragged = T != B * N;
  Tensor host = at::empty({2 * B * N + 2 * T + B}, table_BW.options());  // ids, positions, write slots, rows, last
  int64_t* ids = host.data_ptr<int64_t>();
  int64_t* pos = ids + B * N;
  int64_t* write = pos + B * N;
  int64_t* rows = write + T;
  int64_t* last = rows + T;
  int64_t t = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = static_cast<int64_t>(tokens[b].size());
    for (int64_t j = 0; j < N; ++j) {
      ids[b * N + j] = j < n ? tokens[b][j] : 0;
      pos[b * N + j] = starts[b] + j;
      if (j < n) {
        write[t] = !scratch.empty() && scratch[b] ? 0 : pt[b * W + starts[b] + j];
        rows[t++] = b * N + j;
      }
    }
    last[b] = b * N + n - 1;
  }
  Layout l;
  l.ids = host.narrow(0, 0, B * N).view({B, N});
  l.pos = host.narrow(0, B * N, B * N).view({B, N});
  l.write = host.narrow(0, 2 * B * N, T);
  if (ragged) {
    l.rows = host.narrow(0, 2 * B * N + T, T);
    l.last = host.narrow(0, 2 * B * N + 2 * T, B);
  }
  l.read = table_BW.narrow(1, 0, L);
  l.N = N;
  return l;
}

// The embedding, the final norm, the output layer, and the first MTP module's input projection and norms.
struct Heads {
  Tensor embed_w;               // [V, D]
  Tensor norm_w;                // the model's final norm
  double norm_eps = 1e-6;
  Tensor out_w;                 // [V, D], shared by the MTP module
  OptTensor out_b;
  Tensor enorm_w, hnorm_w, eh_w, mtp_norm_w;
  double enorm_eps = 1e-6, hnorm_eps = 1e-6, mtp_norm_eps = 1e-6;
};

// The first MTP module (blocks[index]) over (token, previous hidden) pairs, then at each sequence's last pair
// (last_T: flat row indices, or the last column when every row is valid) the module's norm, the head and the
// argmax. Returns (block output [B, D], logits [B, V], argmax [B]).
std::tuple<Tensor, Tensor, Tensor> mtp_draft_step(const std::vector<Block*>& blocks, int64_t index, const Heads& m,
                                                  const Tensor& ids_BN, const Tensor& h_prev_BND,
                                                  const OptTensor& last_T, const Step& s) {
  Tensor x = mtp_input(at::embedding(m.embed_w, ids_BN), h_prev_BND, m.enorm_w, m.enorm_eps, m.hnorm_w, m.hnorm_eps,
                       m.eh_w);
  Tensor h = run_blocks(blocks, index, index + 1, x, s).first;
  const int64_t D = h.size(-1);
  Tensor x_last = last_T.has_value() ? h.reshape({-1, D}).index_select(0, *last_T) : h.select(1, h.size(1) - 1).contiguous();
  Tensor logits = small_linear(rms_norm(x_last, m.mtp_norm_w, m.mtp_norm_eps), m.out_w, m.out_b);
  return {x_last, logits, argmax_rows(logits)};
}

// One drafting forward of the first MTP module over the pairs at positions pos_BN (FastForward.mtp_draft).
std::tuple<Tensor, Tensor, Tensor> mtp_draft(const std::vector<Block*>& blocks, int64_t index, const Heads& m,
                                             const Tensor& ids_BN, const Tensor& h_prev_BND, const OptTensor& last_T,
                                             const Tensor& pos_BN, const Tensor& inv_freq, double attention_factor,
                                             const Tensor& write_slots, const OptTensor& rows,
                                             const Tensor& read_slots_BL) {
  c10::InferenceMode inference;
  return mtp_draft_step(blocks, index, m, ids_BN, h_prev_BND, last_T,
                        make_step(pos_BN, inv_freq, attention_factor, h_prev_BND.scalar_type(), write_slots, rows,
                                  read_slots_BL));
}

// A greedy speculative step, as the engine's _verify followed by _draft for greedy requests: the main model over
// each sequence's newest token and its drafts (inputs[b] at positions starts[b].., cache slots from table_BW, the
// sequences' slot table), the head's argmax and log-probability at every position, acceptance (drafts equal to the
// argmax), then the MTP module over the emitted tokens' positions and its first draft at the last one, and the
// further drafts (num_drafts[b] in all) recurrently, the MTP output standing in for the main hidden state. A
// sequence that reaches its length limit (limits[b] tokens) finishes now and drafts no more: its MTP rows go to the
// scratch slot 0, so the cache holds what the engine's Python path leaves. Returns (routes [B, N, K] per MoE block,
// argmax [B, N], log-probability [B, N], drafts [B, max num_drafts]).
std::tuple<std::vector<Tensor>, Tensor, Tensor, Tensor> verify_draft(
    const std::vector<Block*>& blocks, int64_t num_layers, const Heads& m,
    const std::vector<std::vector<int64_t>>& inputs, const std::vector<int64_t>& starts,
    const std::vector<int64_t>& limits, const std::vector<int64_t>& num_drafts, const Tensor& table_BW,
    const Tensor& inv_freq, double attention_factor) {
  c10::InferenceMode inference;
  const int64_t B = static_cast<int64_t>(inputs.size());
  TORCH_CHECK(static_cast<int64_t>(starts.size()) == B && static_cast<int64_t>(limits.size()) == B &&
                  static_cast<int64_t>(num_drafts.size()) == B,
              "verify_draft: one start, limit and draft count per sequence");
  Tensor table = table_BW.to(at::kLong).contiguous();
  const Layout main = make_layout(inputs, starts, table, {});
  const int64_t N = main.N;
  const auto dtype = m.embed_w.scalar_type();
  const Step s = make_step(main.pos, inv_freq, attention_factor, dtype, main.write, main.rows, main.read);
  auto [h, routes] = run_blocks(blocks, 0, num_layers, at::embedding(m.embed_w, main.ids), s);
  Tensor hn = rms_norm(h, m.norm_w, m.norm_eps);
  auto [best, logp] = greedy_rows(small_linear(hn, m.out_w, m.out_b).view({B * N, -1}));
  // accepted drafts per sequence; position start + j then pairs the main hidden there with the token emitted after it
  const int64_t* pb = best.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> emitted(B);
  std::vector<char> finished(B);
  int64_t N2 = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t D = static_cast<int64_t>(inputs[b].size()) - 1;
    int64_t n = 0;
    while (n < D && inputs[b][n + 1] == pb[b * N + n]) ++n;
    emitted[b].assign(pb + b * N, pb + b * N + n + 1);
    finished[b] = n + 1 >= limits[b];
    N2 = std::max(N2, n + 1);
  }
  const Layout mtp = make_layout(emitted, starts, table, finished);
  Step s2;  // the main step's rotations, for the first N2 positions
  s2.cos = N2 == N ? s.cos : s.cos.narrow(1, 0, N2).contiguous();
  s2.sin = N2 == N ? s.sin : s.sin.narrow(1, 0, N2).contiguous();
  s2.write_slots = mtp.write;
  s2.rows = mtp.rows;
  s2.pos = mtp.pos;
  s2.read_slots = mtp.read;
  s2.L = mtp.read.size(1);
  s2.dtype = dtype;
  auto [x_prev, first_logits, first] = mtp_draft_step(blocks, num_layers, m, mtp.ids, hn.narrow(1, 0, N2), mtp.last, s2);
  const int64_t max_drafts = *std::max_element(num_drafts.begin(), num_drafts.end());
  Tensor drafts = at::zeros({B, max_drafts}, best.options());
  int64_t* pd = drafts.data_ptr<int64_t>();
  const int64_t* pf = first.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) pd[b * max_drafts] = pf[b];
  for (int64_t j = 1; j < max_drafts; ++j) {
    std::vector<int64_t> active;
    for (int64_t b = 0; b < B; ++b)
      if (!finished[b] && num_drafts[b] > j) active.push_back(b);
    if (active.empty()) break;
    const int64_t A = static_cast<int64_t>(active.size());
    std::vector<std::vector<int64_t>> tokens(A);
    std::vector<int64_t> at_pos(A);
    for (int64_t a = 0; a < A; ++a) {
      const int64_t b = active[a];
      tokens[a] = {pd[b * max_drafts + j - 1]};
      at_pos[a] = starts[b] + static_cast<int64_t>(emitted[b].size()) - 1 + j;  // the previous draft's position
    }
    const bool every = A == B;
    Tensor idx = every ? Tensor() : at::tensor(active, table.options());
    const Layout l = make_layout(tokens, at_pos, every ? table : table.index_select(0, idx).contiguous(), {});
    const Step sj = make_step(l.pos, inv_freq, attention_factor, dtype, l.write, l.rows, l.read);
    Tensor h_prev = (every ? x_prev : x_prev.index_select(0, idx)).unsqueeze(1);
    auto [x_new, logits_j, drafts_j] = mtp_draft_step(blocks, num_layers, m, l.ids, h_prev, l.last, sj);
    x_prev = every ? x_new : x_prev.index_copy(0, idx, x_new);
    const int64_t* pj = drafts_j.data_ptr<int64_t>();
    for (int64_t a = 0; a < A; ++a) pd[active[a] * max_drafts + j] = pj[a];
  }
  return {routes, best.view({B, N}), logp.view({B, N}), drafts};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim (float32 statistics, cast back, then scale)");
  m.def("small_linear", &small_linear, "x @ w.T (+ b) for a few rows of x (decode sizes)", pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("b") = pybind11::none());
  m.def("argmax_rows", &argmax_rows, "argmax over the last dim of [rows, vocab] (first of equal maxima)");
  m.def("greedy_rows", &greedy_rows, "per row of [rows, vocab] logits: argmax and its log_softmax log-probability");
  m.def("mtp_input", &mtp_input, "an MTP module's block input from the embedding and the previous hidden state");
  namespace py = pybind11;
  // no Python objects are touched after the arguments are converted: other threads (the HTTP server's) run
  m.def("forward_blocks", &forward_blocks, "blocks [first, last) over new tokens with cached attention",
        py::call_guard<py::gil_scoped_release>());
  m.def("mtp_draft", &mtp_draft, "one drafting forward of the first MTP module: block output, logits and argmax at the last pairs",
        py::call_guard<py::gil_scoped_release>());
  m.def("verify_draft", &verify_draft, "a greedy speculative step: verification, acceptance, MTP catch-up and all drafts",
        py::call_guard<py::gil_scoped_release>());
  py::class_<Heads>(m, "Heads")
      .def(py::init<>())
#define FIELD(name) .def_readwrite(#name, &Heads::name)
      FIELD(embed_w) FIELD(norm_w) FIELD(norm_eps) FIELD(out_w) FIELD(out_b) FIELD(enorm_w) FIELD(hnorm_w) FIELD(eh_w)
      FIELD(mtp_norm_w) FIELD(enorm_eps) FIELD(hnorm_eps) FIELD(mtp_norm_eps);
#undef FIELD
  py::class_<Block>(m, "Block")
      .def(py::init<>())
#define FIELD(name) .def_readwrite(#name, &Block::name)
      FIELD(attn_norm) FIELD(ffn_norm) FIELD(eps) FIELD(mla) FIELD(H) FIELD(Q) FIELD(C) FIELD(R) FIELD(Dn) FIELD(Dv)
      FIELD(KV) FIELD(Dh) FIELD(q_lora) FIELD(q_folded) FIELD(o_folded) FIELD(interleave) FIELD(w_down) FIELD(w_q)
      FIELD(w_uk) FIELD(w_uv) FIELD(w_o) FIELD(kv_norm) FIELD(w_qkv) FIELD(b_down) FIELD(q_norm) FIELD(b_o)
      FIELD(b_qkv) FIELD(k_norm) FIELD(q_eps) FIELD(scale) FIELD(moe) FIELD(w13) FIELD(w2) FIELD(w13_all)
      FIELD(w2_all) FIELD(gate_init) FIELD(shared_w13) FIELD(shared_w2) FIELD(router_w) FIELD(router_bias)
      FIELD(sigmoid) FIELD(norm_topk) FIELD(E) FIELD(top_k) FIELD(n_group) FIELD(topk_group) FIELD(routed_scale)
      FIELD(cache);
#undef FIELD
}
