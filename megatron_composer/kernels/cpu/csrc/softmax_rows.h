// Vectorised float32 softmax pieces shared by the CPU kernels (attention, cross-entropy, SwiGLU): a branch-free
// exp, 16-lane loads/stores, a row maximum and an exp-and-sum pass. Callers compile their row loops for several
// instruction sets with MC_MULTI_ISA and inline these into them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"  // the 64-byte vector helpers are always inlined: no call passes one
#endif

// The row loops are compiled for AVX-512 and AVX2 next to the baseline and picked at load time (the build
// uses no -march flag, so without this they would be SSE2 only).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define MC_MULTI_ISA __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define MC_MULTI_ISA
#endif
#if defined(__GNUC__)
#define MC_INLINE inline __attribute__((always_inline))
#else
#define MC_INLINE inline
#endif

namespace softmax_rows {

constexpr float kLog2e = 1.44269504088896341f;

// exp for float32 (Cephes expf: 2^n * e^r with |r| <= ln2/2, ~1 ulp), branch-free. Arguments are clamped to
// [-87, 88]: callers pass x <= ~0, and exp(-87) ~ 1.6e-38 is as good as 0 next to the row maximum's 1.
template <typename V, typename I>
MC_INLINE V exp_poly(V x) {
  const V lo = V{} - 87.0f, hi = V{} + 88.0f, shift = V{} + 12582912.0f;  // 1.5 * 2^23 rounds to integers
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const V n = (x * kLog2e + shift) - shift;
  V r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  I bits = (__builtin_convertvector(n, I) + 127) << 23;
  return p * (V)bits;  // same-size vector cast: reinterprets the bits
}

// float32 rows, 16 lanes at a time through GCC/Clang vector types (AVX-512: one register; AVX2: two).
typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;

MC_INLINE f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
MC_INLINE void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof v); }

// max over j of x[j] * scale
MC_INLINE float scaled_max(const float* x, int64_t n, float scale) {
  f32x16 acc = f32x16{} - std::numeric_limits<float>::infinity();
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const f32x16 v = load16(x + j) * scale;
    acc = v > acc ? v : acc;
  }
  float m = -std::numeric_limits<float>::infinity();
  for (int l = 0; l < kLanes; ++l) m = std::max(m, acc[l]);
  for (; j < n; ++j) m = std::max(m, x[j] * scale);
  return m;
}

// x[j] = exp(x[j] * scale - sub); returns the sum. The last partial vector goes through a padded copy (a
// scalar tail would cost as much as a whole row's vectors).
MC_INLINE float exp_store(float* x, int64_t n, float scale, float sub) {
  f32x16 acc = f32x16{};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const f32x16 e = exp_poly<f32x16, i32x16>(load16(x + j) * scale - sub);
    store16(x + j, e);
    acc += e;
  }
  if (j < n) {
    float tail[kLanes];
    const int64_t rest = n - j;
    for (int64_t l = 0; l < kLanes; ++l) tail[l] = l < rest ? x[j + l] * scale - sub : -100.0f;
    f32x16 e = exp_poly<f32x16, i32x16>(load16(tail));
    for (int64_t l = rest; l < kLanes; ++l) e[l] = 0.f;
    acc += e;
    for (int64_t l = 0; l < rest; ++l) x[j + l] = e[l];
  }
  float s = 0.f;
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  return s;
}

}  // namespace softmax_rows
