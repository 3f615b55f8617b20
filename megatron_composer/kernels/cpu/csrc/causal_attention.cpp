// Causal (document-aware) attention for CPU training, forward and backward: the C++ twin of
// megatron_composer/kernels/causal_attention.py, which stays the reference
// (tests/unit/kernels/test_kernels_attention.py compares the two). Same function, same blocking idea: a block of query
// rows is one matmul against exactly the keys it may see, a float32 (float64 for float64 inputs) softmax, one matmul
// with V; GQA heads sharing a K/V head are extra rows of the same matmul; the backward reuses saved probabilities when
// the caller allows it and otherwise recomputes them from the log-sum-exp.
//
// Why C++: the Python kernel issues ~10 small torch ops per block, which scale poorly past one thread. Here
// the work is split into tasks, one per (batch, kv head, run of query blocks), which the ATen threads take
// largest first from a shared counter; each task is single-threaded: matmuls through oneDNN's micro-kernel
// (at::native::cpublas::brgemm, row-major operands, so keys/values are transposed once per task and dK/dV
// are accumulated transposed), softmax and its gradient in vectorised loops.
//
// Documents: doc_ids label contiguous runs of tokens (model/attention.py::document_ids makes them so); a
// query sees the keys from the first token of its run up to itself.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/csrc/utils/pybind.h>

#include "softmax_rows.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <set>
#include <type_traits>
#include <vector>

namespace {

using at::Tensor;
using namespace softmax_rows;

// Scores [R, L] (ld L, unscaled q.k) -> probabilities in place; row i sees columns [lo[i], hi[i]) and every
// other column becomes 0. Writes each row's log-sum-exp of the scaled scores.
MC_MULTI_ISA void softmax_rows(float* s, int64_t R, int64_t L, const int64_t* lo, const int64_t* hi, float scale,
                               float* lse) {
  for (int64_t i = 0; i < R; ++i) {
    float* row = s + i * L;
    float* seen = row + lo[i];
    const int64_t n = hi[i] - lo[i];
    std::fill(row, seen, 0.f);
    std::fill(row + hi[i], row + L, 0.f);
    const float m = scaled_max(seen, n, scale);  // every row sees at least itself: finite
    const float denom = exp_store(seen, n, scale, m);
    const float inv = 1.f / denom;
    int64_t j = 0;
    for (; j + kLanes <= n; j += kLanes) store16(seen + j, load16(seen + j) * inv);
    for (; j < n; ++j) seen[j] *= inv;
    lse[i] = m + std::log(denom);
  }
}

// Backward, per row: p = exp(score * scale - lse) when p holds scores (recompute), then
// ds = (dp - delta) * p * scale into dp; columns outside [lo, hi) are 0 in both.
MC_MULTI_ISA void score_grads(float* p, float* dp, int64_t R, int64_t L, const int64_t* lo, const int64_t* hi,
                              const float* lse, const float* delta, float scale, bool recompute) {
  for (int64_t i = 0; i < R; ++i) {
    float* prow = p + i * L;
    float* drow = dp + i * L;
    const int64_t a = lo[i], n = hi[i] - lo[i];
    if (recompute) {
      std::fill(prow, prow + a, 0.f);
      std::fill(prow + a + n, prow + L, 0.f);
      exp_store(prow + a, n, scale, lse[i]);
    }
    std::fill(drow, drow + a, 0.f);
    std::fill(drow + a + n, drow + L, 0.f);
    const float d = delta[i];
    float* ps = prow + a;
    float* ds = drow + a;
    int64_t j = 0;
    for (; j + kLanes <= n; j += kLanes) store16(ds + j, (load16(ds + j) - d) * load16(ps + j) * scale);
    for (; j < n; ++j) ds[j] = (ds[j] - d) * ps[j] * scale;
  }
}

// float64 (the exactness check of the tests): the same steps, plain loops.
void softmax_rows(double* s, int64_t R, int64_t L, const int64_t* lo, const int64_t* hi, double scale,
                  double* lse) {
  for (int64_t i = 0; i < R; ++i) {
    double* row = s + i * L;
    std::fill(row, row + lo[i], 0.0);
    std::fill(row + hi[i], row + L, 0.0);
    double m = -std::numeric_limits<double>::infinity();
    for (int64_t j = lo[i]; j < hi[i]; ++j) m = std::max(m, row[j] * scale);
    double denom = 0;
    for (int64_t j = lo[i]; j < hi[i]; ++j) denom += (row[j] = std::exp(row[j] * scale - m));
    for (int64_t j = lo[i]; j < hi[i]; ++j) row[j] /= denom;
    lse[i] = m + std::log(denom);
  }
}
void score_grads(double* p, double* dp, int64_t R, int64_t L, const int64_t* lo, const int64_t* hi,
                 const double* lse, const double* delta, double scale, bool recompute) {
  for (int64_t i = 0; i < R; ++i) {
    double* prow = p + i * L;
    double* drow = dp + i * L;
    if (recompute) {
      std::fill(prow, prow + lo[i], 0.0);
      std::fill(prow + hi[i], prow + L, 0.0);
      for (int64_t j = lo[i]; j < hi[i]; ++j) prow[j] = std::exp(prow[j] * scale - lse[i]);
    }
    std::fill(drow, drow + lo[i], 0.0);
    std::fill(drow + hi[i], drow + L, 0.0);
    for (int64_t j = lo[i]; j < hi[i]; ++j) drow[j] = (drow[j] - delta[i]) * prow[j] * scale;
  }
}

// c[M, N] (+)= a[M, K] @ b[K, N], all row-major with leading dimensions. float32: oneDNN's batch-reduce GEMM
// micro-kernel through ATen (falls back to BLAS where oneDNN has none), cheaper per call than a dispatched
// op; float64: ATen's addmm on views.
// oneDNN compiles a micro-kernel per distinct (M, N, K, lda, ldb, ldc) and caches it per thread for good;
// packed documents make shapes data-dependent, so past kMaxKernelShapes distinct shapes the rest go through
// ATen's matmul (same result, more per-call overhead) and memory stays bounded.
constexpr size_t kMaxKernelShapes = 256;
bool micro_kernel_shape(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc) {
  static std::mutex mutex;
  static std::set<std::array<int64_t, 6>> seen;
  const std::array<int64_t, 6> key{M, N, K, lda, ldb, ldc};
  std::lock_guard<std::mutex> lock(mutex);
  if (seen.count(key)) return true;
  if (seen.size() >= kMaxKernelShapes) return false;
  seen.insert(key);
  return true;
}
void mm(int64_t M, int64_t N, int64_t K, const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
        int64_t ldc, bool accumulate) {
  if (micro_kernel_shape(M, N, K, lda, ldb, ldc)) {
    at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, accumulate, a, b, c, /*is_vnni=*/false);
    return;
  }
  const auto opts = at::TensorOptions().dtype(at::kFloat);
  Tensor cv = at::from_blob(c, {M, N}, {ldc, 1}, opts);
  at::addmm_out(cv, cv, at::from_blob(const_cast<float*>(a), {M, K}, {lda, 1}, opts),
                at::from_blob(const_cast<float*>(b), {K, N}, {ldb, 1}, opts), accumulate ? 1.0 : 0.0, 1.0);
}
void mm(int64_t M, int64_t N, int64_t K, const double* a, int64_t lda, const double* b, int64_t ldb, double* c,
        int64_t ldc, bool accumulate) {
  const auto opts = at::TensorOptions().dtype(at::kDouble);
  Tensor cv = at::from_blob(c, {M, N}, {ldc, 1}, opts);
  at::addmm_out(cv, cv, at::from_blob(const_cast<double*>(a), {M, K}, {lda, 1}, opts),
                at::from_blob(const_cast<double*>(b), {K, N}, {ldb, 1}, opts), accumulate ? 1.0 : 0.0, 1.0);
}

// One query block of one sequence: positions [s0, e) see keys [k0, e).
struct Block {
  int64_t s0, e, k0;
};

// The blocks of every batch row, and the offsets of their probabilities in the saved buffer (order: batch,
// kv head, block). A block's first key is rounded down so its key count is a multiple of kKeyQuantum (or
// reaches position 0): packed documents then give few distinct matmul shapes (each shape is a compiled
// micro-kernel); the extra keys are masked.
struct Plan {
  static constexpr int64_t kKeyQuantum = 32;
  int64_t B, KV, rep, S, nblk;
  std::vector<int64_t> start;        // [B, S] first position of each token's document
  std::vector<Block> blocks;         // [B, nblk]
  std::vector<int64_t> prob_offset;  // [B, KV, nblk]
  int64_t prob_elements = 0;

  Plan(int64_t B_, int64_t KV_, int64_t rep_, int64_t S_, int64_t rows, const std::optional<Tensor>& doc_ids)
      : B(B_), KV(KV_), rep(rep_), S(S_), nblk((S_ + rows - 1) / rows), start(B_ * S_, 0) {
    if (doc_ids.has_value()) {
      TORCH_CHECK(doc_ids->dim() == 2 && doc_ids->size(0) == B && doc_ids->size(1) == S,
                  "causal_attention: doc_ids must be [batch, seq] = [", B, ", ", S, "], got ", doc_ids->sizes());
      const Tensor d = doc_ids->to(at::kLong).contiguous();
      const int64_t* ids = d.data_ptr<int64_t>();
      for (int64_t b = 0; b < B; ++b)
        for (int64_t s = 1; s < S; ++s)
          start[b * S + s] = ids[b * S + s] == ids[b * S + s - 1] ? start[b * S + s - 1] : s;
    }
    blocks.reserve(B * nblk);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s0 = 0; s0 < S; s0 += rows) {
        const int64_t e = std::min(S, s0 + rows);
        const int64_t keys = (e - start[b * S + s0] + kKeyQuantum - 1) / kKeyQuantum * kKeyQuantum;
        blocks.push_back({s0, e, std::max<int64_t>(0, e - keys)});
      }
    prob_offset.resize(B * KV * nblk);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t g = 0; g < KV; ++g)
        for (int64_t i = 0; i < nblk; ++i) {
          const Block& blk = blocks[b * nblk + i];
          prob_offset[(b * KV + g) * nblk + i] = prob_elements;
          prob_elements += (blk.e - blk.s0) * rep * (blk.e - blk.k0);
        }
  }

  const Block& block(int64_t b, int64_t i) const { return blocks[b * nblk + i]; }
  int64_t cost(int64_t b, int64_t i) const {
    const Block& blk = block(b, i);
    return (blk.e - blk.s0) * (blk.e - blk.k0);
  }
  // Visible columns [lo, hi) of each matmul row (position, head within the group) of block (b, i).
  void row_ranges(int64_t b, int64_t i, int64_t* lo, int64_t* hi) const {
    const Block& blk = block(b, i);
    for (int64_t s = blk.s0; s < blk.e; ++s)
      for (int64_t r = 0; r < rep; ++r) {
        const int64_t row = (s - blk.s0) * rep + r;
        lo[row] = start[b * S + s] - blk.k0;
        hi[row] = s + 1 - blk.k0;
      }
  }
};

// Runs fn(task, worker_scratch) for every task in `order` on the ATen thread pool; each thread takes the next
// task from a shared counter, so tasks listed largest first balance across threads.
template <typename Scratch, typename Fn>
void run_tasks(const std::vector<int64_t>& order, const std::function<Scratch()>& make_scratch, const Fn& fn) {
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(order.size());
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    at::AutoDispatchBelowADInplaceOrView no_autograd;
    Scratch scratch = make_scratch();
    for (int64_t t = next.fetch_add(1); t < n; t = next.fetch_add(1)) fn(order[t], scratch);
    at::native::cpublas::brgemm_release(/*is_vnni=*/false);
  });
}

std::vector<int64_t> largest_first(const std::vector<int64_t>& cost) {
  std::vector<int64_t> order(cost.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  return order;
}

#if defined(__GNUC__) && !defined(__clang__)
#define MC_FAST_TRANSPOSE 1
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

// float32 transpose (see transpose below) by 8 x 8 blocks in registers: three rounds of interleaving rows i and
// i + 4 turn 8 rows into 8 columns.
MC_MULTI_ISA void transpose_f32(const float* src, int64_t rows, int64_t cols, int64_t src_ld, float* dst,
                                int64_t dst_ld) {
  const i32x8 lo = {0, 8, 1, 9, 2, 10, 3, 11}, hi = {4, 12, 5, 13, 6, 14, 7, 15};
  int64_t r0 = 0;
  for (; r0 + 8 <= rows; r0 += 8) {
    int64_t c0 = 0;
    for (; c0 + 8 <= cols; c0 += 8) {
      f32x8 x[8], y[8];
      for (int i = 0; i < 8; ++i) std::memcpy(&x[i], src + (r0 + i) * src_ld + c0, sizeof(f32x8));
      for (int round = 0; round < 3; ++round) {
        for (int i = 0; i < 4; ++i) {
          y[2 * i] = __builtin_shuffle(x[i], x[i + 4], lo);
          y[2 * i + 1] = __builtin_shuffle(x[i], x[i + 4], hi);
        }
        for (int i = 0; i < 8; ++i) x[i] = y[i];
      }
      for (int j = 0; j < 8; ++j) std::memcpy(dst + (c0 + j) * dst_ld + r0, &x[j], sizeof(f32x8));
    }
    for (; c0 < cols; ++c0)
      for (int64_t r = r0; r < r0 + 8; ++r) dst[c0 * dst_ld + r] = src[r * src_ld + c0];
  }
  for (; r0 < rows; ++r0)
    for (int64_t c = 0; c < cols; ++c) dst[c * dst_ld + r0] = src[r0 * src_ld + c];
}
#endif

// dst[c * dst_ld + r] = src[r * src_ld + c] for a [rows, cols] source, converting the element type; 16 source
// rows at a time (they stay in L1) so every store run is contiguous.
template <typename src_t, typename dst_t>
void transpose(const src_t* src, int64_t rows, int64_t cols, int64_t src_ld, dst_t* dst, int64_t dst_ld) {
#ifdef MC_FAST_TRANSPOSE
  if constexpr (std::is_same_v<src_t, float> && std::is_same_v<dst_t, float>) {
    transpose_f32(src, rows, cols, src_ld, dst, dst_ld);
    return;
  }
#endif
  constexpr int64_t kB = 16;
  for (int64_t r0 = 0; r0 < rows; r0 += kB) {
    const int64_t r1 = std::min(rows, r0 + kB);
    for (int64_t c = 0; c < cols; ++c)
      for (int64_t r = r0; r < r1; ++r) dst[c * dst_ld + r] = static_cast<dst_t>(src[r * src_ld + c]);
  }
}

// The matmul rows (position, head within the K/V group) of heads g*rep .. g*rep+rep-1 of x [B, H, S, D]:
// read in place when x is in the compute type and those rows are evenly spaced (one head per group, or the
// heads of a group adjacent in a [B, S, H, D] layout with a single group), else copied into a dense tile.
template <typename in_t, typename T>
struct HeadRows {
  const Tensor& x;
  int64_t rep, D, ld = 0;
  bool in_place = false;

  HeadRows(const Tensor& x_, int64_t rep_) : x(x_), rep(rep_), D(x_.size(3)) {
    if (std::is_same_v<in_t, T> && x.stride(3) == 1) {
      if (rep == 1) ld = x.stride(2);
      else if (x.stride(2) == rep * x.stride(1)) ld = x.stride(1);
      in_place = ld >= D;
    }
  }
  in_t* at(int64_t b, int64_t g, int64_t s0) const {
    return x.data_ptr<in_t>() + b * x.stride(0) + g * rep * x.stride(1) + s0 * x.stride(2);
  }
  // Rows of positions [s0, e): a pointer and its row stride, copying into `tile` ([rows, D]) when needed.
  std::pair<const T*, int64_t> read(int64_t b, int64_t g, int64_t s0, int64_t e, T* tile) const {
    if (in_place) return {reinterpret_cast<const T*>(at(b, g, s0)), ld};
    const in_t* base = x.data_ptr<in_t>() + b * x.stride(0);
    const int64_t sh = x.stride(1), ss = x.stride(2), sd = x.stride(3);
    for (int64_t s = s0; s < e; ++s)
      for (int64_t r = 0; r < rep; ++r) {
        const in_t* src = base + (g * rep + r) * sh + s * ss;
        T* row = tile + ((s - s0) * rep + r) * D;
        for (int64_t d = 0; d < D; ++d) row[d] = static_cast<T>(src[d * sd]);
      }
    return {tile, D};
  }
  // Where a [rows, D] result for positions [s0, e) goes: in place, or `tile` to be stored by write().
  std::pair<T*, int64_t> target(int64_t b, int64_t g, int64_t s0, T* tile) const {
    if (in_place) return {reinterpret_cast<T*>(at(b, g, s0)), ld};
    return {tile, D};
  }
  void write(int64_t b, int64_t g, int64_t s0, int64_t e, const T* tile) const {
    if (in_place) return;
    in_t* base = x.data_ptr<in_t>() + b * x.stride(0);
    const int64_t sh = x.stride(1), ss = x.stride(2), sd = x.stride(3);
    for (int64_t s = s0; s < e; ++s)
      for (int64_t r = 0; r < rep; ++r) {
        in_t* dst = base + (g * rep + r) * sh + s * ss;
        const T* row = tile + ((s - s0) * rep + r) * D;
        for (int64_t d = 0; d < D; ++d) dst[d * sd] = static_cast<in_t>(row[d]);
      }
  }
};

// Keys or values (x [B, KV, S, D]) of one (batch, kv head) at positions [j0, j0 + n) as matmul rows: in place
// when x is in the compute type with unit last stride, else converted into `tile` ([n, D]).
template <typename in_t, typename T>
std::pair<const T*, int64_t> key_rows(const Tensor& x, int64_t b, int64_t g, int64_t j0, int64_t n, T* tile) {
  const in_t* src = x.data_ptr<in_t>() + b * x.stride(0) + g * x.stride(1) + j0 * x.stride(2);
  const int64_t D = x.size(3), sj = x.stride(2), sd = x.stride(3);
  if (std::is_same_v<in_t, T> && sd == 1 && sj >= D) return {reinterpret_cast<const T*>(src), sj};
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < D; ++d) tile[j * D + d] = static_cast<T>(src[j * sj + d * sd]);
  return {tile, D};
}
// Whether key_rows needs its tile.
template <typename in_t, typename T>
bool key_rows_copy(const Tensor& x) {
  return !(std::is_same_v<in_t, T> && x.stride(3) == 1 && x.stride(2) >= x.size(3));
}

// Uninitialised scratch memory of one worker.
template <typename T>
struct Buf {
  std::unique_ptr<T[]> p;
  void resize(int64_t n) { p.reset(n > 0 ? new T[n] : nullptr); }
  T* data() { return p.get(); }
  T& operator[](int64_t i) { return p[i]; }
};

void check_inputs(const Tensor& q, const Tensor& k, const Tensor& v, int64_t rows) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "causal_attention: q, k, v must be [B, H, S, D], [B, KV, S, D], [B, KV, S, Dv]");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "causal_attention (C++): tensors must be on the CPU");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "causal_attention (C++): q, k, v must share one dtype");
  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0) && k.size(2) == q.size(2) &&
                  v.size(2) == q.size(2) && k.size(1) == v.size(1) && k.size(3) == q.size(3),
              "causal_attention: q, k, v shapes disagree (batch, sequence, K/V heads or q/k head dim)");
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "query heads (", q.size(1),
              ") must be a multiple of key/value heads (", k.size(1), ")");
  TORCH_CHECK(rows > 0, "causal_attention: rows per block must be positive");
}

// Tasks: each (batch, kv head) is one run of query blocks, or `chunks` runs of about equal cost when there are
// too few (batch, kv head) pairs to keep every thread busy. A task transposes the keys (and values) its run
// sees once, into its worker's scratch; in the backward it also owns the dK/dV sums of its run.
struct Runs {
  int64_t chunks;
  std::vector<int64_t> first;  // [B, chunks + 1] index of each run's first block; a run is [first[c], first[c+1])
  std::vector<int64_t> key0;   // [B, chunks] first key any block of the run sees
  std::vector<int64_t> cost;   // [B, chunks]

  Runs(const Plan& plan, int64_t threads, int64_t max_chunks) {
    const int64_t B = plan.B, pairs = plan.B * plan.KV;
    chunks = std::max<int64_t>(1, std::min({plan.nblk, max_chunks, (4 * threads + pairs - 1) / pairs}));
    first.assign(B * (chunks + 1), plan.nblk);
    key0.assign(B * chunks, 0);
    cost.assign(B * chunks, 0);
    for (int64_t b = 0; b < B; ++b) {
      int64_t total = 0, acc = 0, c = 1;
      for (int64_t i = 0; i < plan.nblk; ++i) total += plan.cost(b, i);
      first[b * (chunks + 1)] = 0;
      for (int64_t i = 0; i < plan.nblk && c < chunks; ++i) {
        acc += plan.cost(b, i);
        while (c < chunks && acc * chunks >= total * c) first[b * (chunks + 1) + c++] = i + 1;
      }
      for (c = 0; c < chunks; ++c) {
        key0[b * chunks + c] = end(plan, b, c);
        for (int64_t i = begin(b, c); i < first[b * (chunks + 1) + c + 1]; ++i) {
          key0[b * chunks + c] = std::min(key0[b * chunks + c], plan.block(b, i).k0);
          cost[b * chunks + c] += plan.cost(b, i);
        }
      }
    }
  }
  int64_t begin(int64_t b, int64_t c) const { return first[b * (chunks + 1) + c]; }
  int64_t stop(int64_t b, int64_t c) const { return first[b * (chunks + 1) + c + 1]; }
  // one past the last key (= query position) of run c
  int64_t end(const Plan& plan, int64_t b, int64_t c) const {
    return stop(b, c) > begin(b, c) ? plan.block(b, stop(b, c) - 1).e : 0;
  }
  // Tasks (batch, kv head, run) largest first.
  std::vector<int64_t> order(int64_t KV) const {
    std::vector<int64_t> task_cost(cost.size() * KV);
    for (int64_t t = 0; t < static_cast<int64_t>(task_cost.size()); ++t)
      task_cost[t] = cost[(t / (chunks * KV)) * chunks + t % chunks];
    return largest_first(task_cost);
  }
};

template <typename T>
struct FwdScratch {
  Buf<T> q, o, s, kt, k, v;
  Buf<int64_t> lo, hi;
};

// out [B, S, H, Dv] in q's dtype, lse [B, KV, S, rep] in the compute type, probabilities (empty unless kept).
template <typename in_t, typename T>
std::vector<Tensor> forward_impl(const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                                 const std::optional<Tensor>& doc_ids, int64_t rows, int64_t saved_prob_elements) {
  const at::ScalarType ct = c10::CppTypeToScalarType<T>::value;
  const int64_t B = q.size(0), H = q.size(1), S = q.size(2), Dqk = q.size(3);
  const int64_t KV = k.size(1), Dv = v.size(3), rep = H / KV;
  const Plan plan(B, KV, rep, S, rows, doc_ids);
  const Runs runs(plan, at::get_num_threads(), plan.nblk);
  Tensor out = at::empty({B, S, H, Dv}, q.options());
  Tensor lse = at::empty({B, KV, S, rep}, q.options().dtype(ct));
  const bool keep = plan.prob_elements <= saved_prob_elements;
  Tensor probs = at::empty({keep ? plan.prob_elements : 0}, q.options().dtype(ct));
  const Tensor out_BHSD = out.transpose(1, 2);
  const HeadRows<in_t, T> q_rows(q, rep), out_rows(out_BHSD, rep);

  const int64_t R = rows * rep, chunks = runs.chunks;
  std::function<FwdScratch<T>()> make = [&] {
    FwdScratch<T> w;
    w.q.resize(R * Dqk);
    w.o.resize(R * Dv);
    w.s.resize(keep ? 0 : R * S);
    w.kt.resize(Dqk * S);
    w.k.resize(key_rows_copy<in_t, T>(k) ? S * Dqk : 0);
    w.v.resize(key_rows_copy<in_t, T>(v) ? S * Dv : 0);
    w.lo.resize(R);
    w.hi.resize(R);
    return w;
  };
  run_tasks(runs.order(KV), make, [&](int64_t t, FwdScratch<T>& w) {
    const int64_t c = t % chunks, g = (t / chunks) % KV, b = t / (chunks * KV), bg = b * KV + g;
    const int64_t key0 = runs.key0[b * chunks + c], n = runs.end(plan, b, c) - key0;
    const auto [kp, ldk] = key_rows<in_t, T>(k, b, g, key0, n, w.k.data());
    const auto [vp, ldv] = key_rows<in_t, T>(v, b, g, key0, n, w.v.data());
    transpose(kp, n, Dqk, ldk, w.kt.data(), n);  // keys as columns [Dqk, n]
    for (int64_t i = runs.begin(b, c); i < runs.stop(b, c); ++i) {
      const Block& blk = plan.block(b, i);
      const int64_t Rb = (blk.e - blk.s0) * rep, L = blk.e - blk.k0;
      const auto [qp, ldq] = q_rows.read(b, g, blk.s0, blk.e, w.q.data());
      T* p = keep ? probs.data_ptr<T>() + plan.prob_offset[bg * plan.nblk + i] : w.s.data();
      mm(Rb, L, Dqk, qp, ldq, w.kt.data() + (blk.k0 - key0), n, p, L, false);  // scores = q k^T
      plan.row_ranges(b, i, w.lo.data(), w.hi.data());
      T* lse_rows = lse.data_ptr<T>() + (bg * S + blk.s0) * rep;
      softmax_rows(p, Rb, L, w.lo.data(), w.hi.data(), static_cast<T>(scale), lse_rows);
      const auto [op, ldo] = out_rows.target(b, g, blk.s0, w.o.data());
      mm(Rb, Dv, L, p, L, vp + (blk.k0 - key0) * ldv, ldv, op, ldo, false);  // out = p v
      out_rows.write(b, g, blk.s0, blk.e, w.o.data());
    }
  });
  return {out, lse, probs};
}

template <typename T>
struct BwdScratch {
  Buf<T> q, q_t, dout, dout_t, o, dq, p, dp, delta, k, v, kt, vt, dk_t, dv_t;
  Buf<int64_t> lo, hi;
};

// dq [B, H, S, Dqk], dk [B, KV, S, Dqk], dv [B, KV, S, Dv], each in its input's dtype.
template <typename in_t, typename T>
std::vector<Tensor> backward_impl(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                  const Tensor& out_BSHD, const Tensor& lse, const Tensor& probs, double scale,
                                  const std::optional<Tensor>& doc_ids, int64_t rows) {
  const at::ScalarType ct = c10::CppTypeToScalarType<T>::value;
  const int64_t B = q.size(0), H = q.size(1), S = q.size(2), Dqk = q.size(3);
  const int64_t KV = k.size(1), Dv = v.size(3), rep = H / KV;
  const Plan plan(B, KV, rep, S, rows, doc_ids);
  // several runs per (batch, kv head) need a dK/dV slot each: at most ~2^26 elements of them
  const Runs runs(plan, at::get_num_threads(), (int64_t(1) << 26) / std::max<int64_t>(1, B * KV * S * (Dqk + Dv)));
  const bool saved = probs.numel() > 0;
  TORCH_CHECK(!saved || probs.numel() == plan.prob_elements, "causal_attention backward: saved probabilities "
              "do not match the blocking (rows per block or doc_ids changed between forward and backward)");
  const Tensor dout_c = dout.scalar_type() == q.scalar_type() ? dout : dout.to(q.scalar_type());
  const Tensor out_BHSD = out_BSHD.transpose(1, 2);
  Tensor dq = at::empty({B, S, H, Dqk}, q.options());
  Tensor dk = at::empty({B, KV, S, Dqk}, k.options()), dv = at::empty({B, KV, S, Dv}, v.options());
  const Tensor dq_BHSD = dq.transpose(1, 2);
  const HeadRows<in_t, T> q_rows(q, rep), dout_rows(dout_c, rep), out_rows(out_BHSD, rep), dq_rows(dq_BHSD, rep);

  // With one run per (batch, kv head) a task's dK/dV sums are final; with several, each run's sums go to its own
  // slot [keys, D] and are added in run order afterwards.
  const int64_t chunks = runs.chunks;
  std::vector<int64_t> part_off(B * KV * chunks + 1, 0);
  if (chunks > 1)
    for (int64_t x = 0; x < B * KV * chunks; ++x) {
      const int64_t b = x / (KV * chunks), c = x % chunks;
      part_off[x + 1] = part_off[x] + runs.end(plan, b, c) - runs.key0[b * chunks + c];
    }
  Tensor part_dk = at::empty({part_off.back() * Dqk}, q.options().dtype(ct));
  Tensor part_dv = at::empty({part_off.back() * Dv}, q.options().dtype(ct));

  const int64_t R = rows * rep;
  std::function<BwdScratch<T>()> make = [&] {
    BwdScratch<T> w;
    w.q.resize(R * Dqk);
    w.q_t.resize(R * Dqk);
    w.dout.resize(R * Dv);
    w.dout_t.resize(R * Dv);
    w.o.resize(R * Dv);
    w.dq.resize(R * Dqk);
    w.p.resize(saved ? 0 : R * S);
    w.dp.resize(R * S);
    w.delta.resize(R);
    w.k.resize(key_rows_copy<in_t, T>(k) ? S * Dqk : 0);
    w.v.resize(key_rows_copy<in_t, T>(v) ? S * Dv : 0);
    w.kt.resize(Dqk * S);
    w.vt.resize(Dv * S);
    w.dk_t.resize(Dqk * S);
    w.dv_t.resize(Dv * S);
    w.lo.resize(R);
    w.hi.resize(R);
    return w;
  };
  run_tasks(runs.order(KV), make, [&](int64_t t, BwdScratch<T>& w) {
    const int64_t c = t % chunks, g = (t / chunks) % KV, b = t / (chunks * KV), bg = b * KV + g;
    const int64_t key0 = runs.key0[b * chunks + c], n = runs.end(plan, b, c) - key0;
    const auto [kp, ldk] = key_rows<in_t, T>(k, b, g, key0, n, w.k.data());
    const auto [vp, ldv] = key_rows<in_t, T>(v, b, g, key0, n, w.v.data());
    // keys and values of the run as columns, and dK/dV accumulated transposed ([D, n]): each block adds
    // (q^T ds) and (dout^T p), whose left factors are its small [D, rows] tiles, so no [rows, keys] tile is
    // ever transposed
    transpose(kp, n, Dqk, ldk, w.kt.data(), n);
    transpose(vp, n, Dv, ldv, w.vt.data(), n);
    std::fill(w.dk_t.data(), w.dk_t.data() + Dqk * n, T(0));
    std::fill(w.dv_t.data(), w.dv_t.data() + Dv * n, T(0));
    for (int64_t i = runs.begin(b, c); i < runs.stop(b, c); ++i) {
      const Block& blk = plan.block(b, i);
      const int64_t Rb = (blk.e - blk.s0) * rep, L = blk.e - blk.k0, j0 = blk.k0 - key0;
      const auto [qp, ldq] = q_rows.read(b, g, blk.s0, blk.e, w.q.data());
      const auto [dop, lddo] = dout_rows.read(b, g, blk.s0, blk.e, w.dout.data());
      const auto [op, ldo] = out_rows.read(b, g, blk.s0, blk.e, w.o.data());
      transpose(qp, Rb, Dqk, ldq, w.q_t.data(), Rb);
      transpose(dop, Rb, Dv, lddo, w.dout_t.data(), Rb);
      for (int64_t row = 0; row < Rb; ++row) {  // delta = rowsum(dout * out)
        T acc = 0;
        for (int64_t d = 0; d < Dv; ++d) acc += dop[row * lddo + d] * op[row * ldo + d];
        w.delta[row] = acc;
      }
      plan.row_ranges(b, i, w.lo.data(), w.hi.data());
      T* p = saved ? probs.data_ptr<T>() + plan.prob_offset[bg * plan.nblk + i] : w.p.data();
      T* ds = w.dp.data();
      if (!saved) mm(Rb, L, Dqk, qp, ldq, w.kt.data() + j0, n, p, L, false);  // scores = q k^T
      mm(Rb, L, Dv, dop, lddo, w.vt.data() + j0, n, ds, L, false);             // dp = dout v^T
      const T* lse_rows = lse.data_ptr<T>() + (bg * S + blk.s0) * rep;
      score_grads(p, ds, Rb, L, w.lo.data(), w.hi.data(), lse_rows, w.delta.data(), static_cast<T>(scale), !saved);
      mm(Dv, L, Rb, w.dout_t.data(), Rb, p, L, w.dv_t.data() + j0, n, true);  // dv^T += dout^T p
      const auto [dqp, lddq] = dq_rows.target(b, g, blk.s0, w.dq.data());
      mm(Rb, Dqk, L, ds, L, kp + j0 * ldk, ldk, dqp, lddq, false);  // dq = ds k
      dq_rows.write(b, g, blk.s0, blk.e, w.dq.data());
      mm(Dqk, L, Rb, w.q_t.data(), Rb, ds, L, w.dk_t.data() + j0, n, true);  // dk^T += q^T ds
    }
    if (chunks == 1) {  // the run covers every key of (b, g): key0 = 0, n = S
      transpose(w.dk_t.data(), Dqk, n, n, dk.data_ptr<in_t>() + bg * S * Dqk, Dqk);
      transpose(w.dv_t.data(), Dv, n, n, dv.data_ptr<in_t>() + bg * S * Dv, Dv);
    } else {
      const int64_t x = bg * chunks + c;
      transpose(w.dk_t.data(), Dqk, n, n, part_dk.data_ptr<T>() + part_off[x] * Dqk, Dqk);
      transpose(w.dv_t.data(), Dv, n, n, part_dv.data_ptr<T>() + part_off[x] * Dv, Dv);
    }
  });
  if (chunks > 1) {  // dk/dv = the runs' sums, added in run order
    at::parallel_for(0, B * KV, 1, [&](int64_t begin, int64_t end) {
      std::vector<T> acc_k(S * Dqk), acc_v(S * Dv);
      for (int64_t bg = begin; bg < end; ++bg) {
        std::fill(acc_k.begin(), acc_k.end(), T(0));
        std::fill(acc_v.begin(), acc_v.end(), T(0));
        const int64_t b = bg / KV;
        for (int64_t c = 0; c < chunks; ++c) {
          const int64_t x = bg * chunks + c, j0 = runs.key0[b * chunks + c], n = part_off[x + 1] - part_off[x];
          const T* pk = part_dk.data_ptr<T>() + part_off[x] * Dqk;
          const T* pv = part_dv.data_ptr<T>() + part_off[x] * Dv;
          for (int64_t j = 0; j < n * Dqk; ++j) acc_k[j0 * Dqk + j] += pk[j];
          for (int64_t j = 0; j < n * Dv; ++j) acc_v[j0 * Dv + j] += pv[j];
        }
        in_t* dkx = dk.data_ptr<in_t>() + bg * S * Dqk;
        in_t* dvx = dv.data_ptr<in_t>() + bg * S * Dv;
        for (int64_t j = 0; j < S * Dqk; ++j) dkx[j] = static_cast<in_t>(acc_k[j]);
        for (int64_t j = 0; j < S * Dv; ++j) dvx[j] = static_cast<in_t>(acc_v[j]);
      }
    });
  }
  return {dq_BHSD, dk, dv};
}

#define MC_DISPATCH(dtype, NAME, ...)                                                          \
  switch (dtype) {                                                                             \
    case at::kFloat: return NAME<float, float>(__VA_ARGS__);                                   \
    case at::kDouble: return NAME<double, double>(__VA_ARGS__);                                \
    case at::kBFloat16: return NAME<at::BFloat16, float>(__VA_ARGS__);                         \
    case at::kHalf: return NAME<at::Half, float>(__VA_ARGS__);                                 \
    default: TORCH_CHECK(false, "causal_attention (C++): unsupported dtype ", dtype,           \
                         "; use float32, float64, bfloat16 or float16");                       \
  }

std::vector<Tensor> forward(const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                            const std::optional<Tensor>& doc_ids, int64_t rows, int64_t saved_prob_elements) {
  check_inputs(q, k, v, rows);
  MC_DISPATCH(q.scalar_type(), forward_impl, q, k, v, scale, doc_ids, rows, saved_prob_elements)
}

std::vector<Tensor> backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& out_BSHD, const Tensor& lse, const Tensor& probs, double scale,
                             const std::optional<Tensor>& doc_ids, int64_t rows) {
  check_inputs(q, k, v, rows);
  MC_DISPATCH(q.scalar_type(), backward_impl, dout, q, k, v, out_BSHD, lse, probs, scale, doc_ids, rows)
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Causal document-aware attention for CPU training (reference: kernels/causal_attention.py)";
  m.def("forward", &forward, "out [B,S,H,Dv], lse [B,KV,S,H/KV], saved probabilities (or empty)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("scale"), py::arg("doc_ids"), py::arg("rows"),
        py::arg("saved_prob_elements"), py::call_guard<py::gil_scoped_release>());
  m.def("backward", &backward, "dq [B,H,S,Dqk], dk [B,KV,S,Dqk], dv [B,KV,S,Dv]", py::arg("dout"), py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("probs"), py::arg("scale"),
        py::arg("doc_ids"), py::arg("rows"), py::call_guard<py::gil_scoped_release>());
}
