// Float32 arithmetic on float32 or bfloat16 rows, shared by the CPU kernels' row loops.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace float_rows {

// Row loops compiled for AVX-512, AVX2 and plain x86-64, chosen at load time (no -march flags in the build).
#define ROW_LOOP __attribute__((target_clones("avx512f", "avx2", "default")))

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
// Stored in a T tensor: round to nearest even, as c10::BFloat16(float); NaN stays NaN.
inline void store(float v, float& out) { out = v; }
inline void store(float v, c10::BFloat16& out) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  const uint16_t rounded = static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
  out.x = v != v ? uint16_t(0x7fc0) : rounded;
}
// Rounded to T and back: what storing a float32 result in a T tensor does.
inline float round_as(float v, float) { return v; }
inline float round_as(float v, c10::BFloat16) {
  c10::BFloat16 stored;
  store(v, stored);
  return v != v ? v : to_float(stored);
}

}  // namespace float_rows
