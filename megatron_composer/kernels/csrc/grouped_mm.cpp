// Grouped matmuls of the mixture of experts on CPU (reference: megatron_composer/kernels/grouped_mm.py).
//
// Tokens sorted by expert make one small matmul per expert (~T*K/E rows). Split across threads, each such
// matmul parallelises poorly; here the experts are the parallel tasks instead: every ATen thread takes the
// next largest expert from a shared counter and runs its whole matmul single-threaded (ATen runs ops inside a
// parallel region serially). Each matmul is the at::mm the Python loop makes, on the same rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <numeric>
#include <vector>

namespace {

using at::Tensor;

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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("mm_rows", &mm_rows, "rows of a in group g times b[g]");
  m.def("mm_outer", &mm_outer, "per group: a[rows]^T b[rows]");
}
