// Fused CPU kernels for the small operations of a decoder layer (see cpu_ops.py).
//
// A decode step streams every weight matrix through the caches, which evicts the interpreter's
// and the dispatcher's working set; each small torch op after a matrix product then costs
// 5-40 us instead of 1-2. These kernels do in one call what takes torch 2 to 9 calls: RMSNorm
// (with the residual add before it), SiLU(gate) * up, and RoPE on q and k in place.
//
// Every row is computed alone, in an order that does not depend on how many rows a call holds,
// so results are batch-invariant. Elementwise steps round to the tensor's dtype exactly where
// torch's eager ops do (the build uses -ffp-contract=off, so no multiply-add is fused behind our
// back); only the RMSNorm sum and SiLU's exp are computed in another order than torch's.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

namespace {

using at::BFloat16;

template <typename T>
inline float load(const T* p, int64_t i) {
  return static_cast<float>(p[i]);
}

// x rounded to T, returned as float: what a torch op producing a T tensor hands the next op.
template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

constexpr int kLanes = 16;  // float32 lanes of one AVX-512 register; fixes the summation order

// Sum of squares of one row, in float32: 16 running sums over the row, then added in order.
template <typename T>
inline float sum_of_squares(const T* x, int64_t n) {
  float acc[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
    for (int j = 0; j < kLanes; j++) {
      float v = load(x, i + j);
      acc[j] += v * v;
    }
  }
  float sum = 0.0f;
  for (int j = 0; j < kLanes; j++) sum += acc[j];
  for (; i < n; i++) sum += load(x, i) * load(x, i);
  return sum;
}

// out = weight * T(x * rsqrt(mean(x^2) + eps)), normalised in float32 as transformers does.
template <typename T>
inline void rms_norm_row(const T* x, const T* weight, T* out, int64_t n, float eps) {
  const float inv = 1.0f / std::sqrt(sum_of_squares(x, n) / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; i++) out[i] = static_cast<T>(load(weight, i) * round_to<T>(load(x, i) * inv));
}

template <typename T>
void rms_norm_rows(const T* x, const T* weight, T* out, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, 32, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++) rms_norm_row(x + r * n, weight, out + r * n, n, eps);
  });
}

template <typename T>
void add_rms_norm_rows(T* residual, const T* x, const T* weight, T* out, int64_t rows, int64_t n,
                       float eps) {
  at::parallel_for(0, rows, 32, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++) {
      T* res = residual + r * n;
      const T* xr = x + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; i++) res[i] = static_cast<T>(load(res, i) + load(xr, i));
      rms_norm_row(res, weight, out + r * n, n, eps);
    }
  });
}

// out = T(silu(gate)) * up, where each row of gate_up is [gate | up].
template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++) {
      const T* gate = gate_up + r * 2 * n;
      const T* up = gate + n;
      T* o = out + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; i++) {
        const float g = load(gate, i);
        o[i] = static_cast<T>(round_to<T>(g / (1.0f + std::exp(-g))) * load(up, i));
      }
    }
  });
}

// Rotate the first `heads` heads of each row in place: x * cos + rotate_half(x) * sin, with
// rotate_half(x) = [-x2, x1], each product and the sum rounded to T as torch's ops round them.
template <typename T>
void rope_rows(T* x, const T* cos, const T* sin, int64_t rows, int64_t row_stride, int64_t heads,
               int64_t head_dim) {
  const int64_t half = head_dim / 2;
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++) {
      const T* c = cos + r * head_dim;
      const T* s = sin + r * head_dim;
      for (int64_t h = 0; h < heads; h++) {
        T* v = x + r * row_stride + h * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < half; i++) {
          const float x1 = load(v, i), x2 = load(v, i + half);
          const float lo = round_to<T>(x1 * load(c, i)) + round_to<T>(-x2 * load(s, i));
          const float hi = round_to<T>(x2 * load(c, i + half)) + round_to<T>(x1 * load(s, i + half));
          v[i] = static_cast<T>(lo);
          v[i + half] = static_cast<T>(hi);
        }
      }
    }
  });
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.dim() == 2, name, " must be 2-D [rows, features]");
  TORCH_CHECK(t.stride(1) == 1, name, "'s rows must be contiguous");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16");
}

void check_like(const torch::Tensor& t, const torch::Tensor& like, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), name, " must be contiguous on the CPU");
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, " must have the input's dtype");
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous");
  check_like(weight, x, "weight");
  TORCH_CHECK(weight.numel() == x.size(1), "weight must have one entry per feature");
  auto out = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                  x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

torch::Tensor add_rms_norm_(torch::Tensor& residual, const torch::Tensor& x,
                            const torch::Tensor& weight, double eps) {
  check_rows(residual, "residual");
  TORCH_CHECK(residual.is_contiguous(), "residual must be contiguous");
  check_like(x, residual, "x");
  check_like(weight, residual, "weight");
  TORCH_CHECK(x.sizes() == residual.sizes(), "x must have the residual's shape");
  TORCH_CHECK(weight.numel() == x.size(1), "weight must have one entry per feature");
  auto out = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "add_rms_norm_", [&] {
    add_rms_norm_rows(residual.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(),
                      weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0),
                      x.size(1), static_cast<float>(eps));
  });
  return out;
}

torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.is_contiguous(), "gate_up must be contiguous");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must hold gate and up halves");
  const int64_t n = gate_up.size(1) / 2;
  auto out = torch::empty({gate_up.size(0), n}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, gate_up.scalar_type(), "silu_mul", [&] {
    silu_mul_rows(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), gate_up.size(0), n);
  });
  return out;
}

void rope_(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, int64_t heads,
           int64_t head_dim) {
  check_rows(x, "x");
  check_like(cos, x, "cos");
  check_like(sin, x, "sin");
  TORCH_CHECK(head_dim % 2 == 0 && heads * head_dim <= x.size(1), "heads do not fit the rows");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == x.size(0) && cos.size(1) == head_dim &&
                  sin.sizes() == cos.sizes(),
              "cos and sin must be [rows, head_dim]");
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rope_", [&] {
    rope_rows(x.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(),
              x.size(0), x.stride(0), heads, head_dim);
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "weight * RMSNorm(x), per row");
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x in place; weight * RMSNorm(residual)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up for rows [gate | up]");
  m.def("rope_", &rope_, "rotate the first `heads` heads of each row in place");
}
