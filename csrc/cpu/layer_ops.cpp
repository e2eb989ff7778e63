// CPU kernels of the decoder-layer building blocks: RMSNorm (+residual), SwiGLU and the fused
// QKV-split / RoPE / KV-cache write. Rows run in parallel; every row loop is at::vec vectorised in
// fp32, with one conversion in and one out for bf16 / fp16.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "poss/layer_args.h"
#include "poss/layer_math.h"

namespace poss {
namespace {

using Vec = at::vec::Vectorized<float>;

// Reads n elements as fp32: the source itself for fp32, else converted into buf.
template <typename scalar_t>
const float* load_f32(const scalar_t* src, float* buf, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return src;
  } else {
    at::vec::convert(src, buf, n);
    return buf;
  }
}

template <typename scalar_t>
void store_f32(const float* src, scalar_t* dst, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (src != dst) std::copy(src, src + n, dst);
  } else {
    at::vec::convert(src, dst, n);
  }
}

float sum_sq(const float* x, int64_t n) {
  return at::vec::map_reduce_all<float>([](Vec v) { return v * v; },
                                        [](Vec a, Vec b) { return a + b; }, x, n);
}

// out[i] = x[i] * r * w[i], written through a fp32 scratch row.
template <typename scalar_t>
void scale_row(const float* x, const float* w, float r, float* scratch, scalar_t* out, int64_t n) {
  const Vec rv(r);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    (Vec::loadu(x + i) * rv * Vec::loadu(w + i)).store(scratch + i);
  }
  for (; i < n; ++i) scratch[i] = x[i] * r * w[i];
  store_f32(scratch, out, n);
}

// Shared by rms_norm (residual == nullptr) and add_rms_norm.
template <typename scalar_t>
void rms_rows(const scalar_t* x, const scalar_t* residual, const scalar_t* weight, scalar_t* out,
              scalar_t* sum_out, int64_t rows, int64_t H, float eps) {
  std::vector<float> w32(H);
  at::vec::convert(weight, w32.data(), H);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> a(H), b(H), scratch(H);
    for (int64_t row = begin; row < end; ++row) {
      const float* xr = load_f32(x + row * H, a.data(), H);
      if (residual != nullptr) {
        const float* rr = load_f32(residual + row * H, b.data(), H);
        at::vec::map2([](Vec u, Vec v) { return u + v; }, scratch.data(), xr, rr, H);
        // The sum is rounded to the storage dtype first: the next layer reads that rounded value.
        store_f32(scratch.data(), sum_out + row * H, H);
        xr = load_f32(sum_out + row * H, a.data(), H);
      }
      scale_row(xr, w32.data(), rms_inv(sum_sq(xr, H), H, eps), scratch.data(), out + row * H, H);
    }
  });
}

at::Tensor rms_norm_cpu(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  check_rms_args(x_in, weight_in);
  const auto x = x_in.contiguous();
  const auto weight = weight_in.contiguous();
  auto out = at::empty_like(x);
  const int64_t H = x.size(-1), rows = H == 0 ? 0 : x.numel() / H;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_rows<scalar_t>(x.data_ptr<scalar_t>(), nullptr, weight.data_ptr<scalar_t>(),
                       out.data_ptr<scalar_t>(), nullptr, rows, H, static_cast<float>(eps));
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_cpu(const at::Tensor& x_in, const at::Tensor& res_in,
                                                    const at::Tensor& weight_in, double eps) {
  check_rms_args(x_in, weight_in);
  TORCH_CHECK(res_in.sizes() == x_in.sizes(), "residual must have x's shape ", shape_str(x_in),
              ", got ", shape_str(res_in));
  check_dtype(res_in, "residual", x_in.scalar_type());
  check_same_device(res_in, "residual", x_in, "x");
  const auto x = x_in.contiguous();
  const auto res = res_in.contiguous();
  const auto weight = weight_in.contiguous();
  auto out = at::empty_like(x);
  auto sum = at::empty_like(x);
  const int64_t H = x.size(-1), rows = H == 0 ? 0 : x.numel() / H;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    rms_rows<scalar_t>(x.data_ptr<scalar_t>(), res.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                       out.data_ptr<scalar_t>(), sum.data_ptr<scalar_t>(), rows, H,
                       static_cast<float>(eps));
  });
  return {out, sum};
}

at::Tensor swiglu_cpu(const at::Tensor& gate_up_in) {
  check_swiglu_args(gate_up_in);
  const auto gu = gate_up_in.contiguous();
  const int64_t F = gu.size(-1) / 2, rows = F == 0 ? 0 : gu.numel() / (2 * F);
  auto out_sizes = gu.sizes().vec();
  out_sizes.back() = F;
  auto out = at::empty(out_sizes, gu.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gu.scalar_type(), "swiglu", [&] {
    const scalar_t* src = gu.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> g(F), u(F), o(F);
      const Vec one(1.0f);
      for (int64_t row = begin; row < end; ++row) {
        const float* gr = load_f32(src + row * 2 * F, g.data(), F);
        const float* ur = load_f32(src + row * 2 * F + F, u.data(), F);
        at::vec::map2([&](Vec a, Vec b) { return a / (one + a.neg().exp()) * b; }, o.data(), gr, ur, F);
        store_f32(o.data(), dst + row * F, F);
      }
    });
  });
  return out;
}

// Rotates one head of D elements from src into dst using per-frequency cos / sin.
template <typename scalar_t>
void rotate_head(const scalar_t* src, scalar_t* dst, const float* cs, const float* sn, int64_t D,
                 float* in_buf, float* out_buf) {
  const int64_t half = D / 2;
  const float* x = load_f32(src, in_buf, D);
  int64_t i = 0;
  for (; i + Vec::size() <= half; i += Vec::size()) {
    const Vec x1 = Vec::loadu(x + i), x2 = Vec::loadu(x + half + i);
    const Vec c = Vec::loadu(cs + i), s = Vec::loadu(sn + i);
    (x1 * c - x2 * s).store(out_buf + i);
    (x2 * c + x1 * s).store(out_buf + half + i);
  }
  for (; i < half; ++i) rope_rotate(x[i], x[half + i], cs[i], sn[i], out_buf[i], out_buf[half + i]);
  store_f32(out_buf, dst, D);
}

// cos / sin of every (row, frequency) angle of a call, [B*T, D/2] each. Every layer of a forward
// rotates by the same positions and frequencies, so the tables of the last call are kept and reused
// when both match by value (compared in full: a stale table is never used). Taking the 32 double
// cos/sin per row once per forward instead of once per layer saved ~3 us a layer at 8 rows, a third of
// the op (AVX512-BF16 EPYC, one thread).
struct RopeTables {
  std::vector<int64_t> positions;
  std::vector<float> inv_freq;
  std::vector<float> cos, sin;

  void fill(const int64_t* pos, int64_t rows, const float* freq, int64_t half) {
    if (static_cast<int64_t>(positions.size()) == rows && static_cast<int64_t>(inv_freq.size()) == half &&
        std::equal(pos, pos + rows, positions.begin()) && std::equal(freq, freq + half, inv_freq.begin())) {
      return;
    }
    positions.assign(pos, pos + rows);
    inv_freq.assign(freq, freq + half);
    cos.resize(rows * half);
    sin.resize(rows * half);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = 0; i < half; ++i) {
        const double a = rope_angle(pos[r], freq[i]);
        cos[r * half + i] = static_cast<float>(std::cos(a));
        sin[r * half + i] = static_cast<float>(std::sin(a));
      }
    }
  }
};

at::Tensor rope_qkv_cpu(const at::Tensor& qkv_in, const at::Tensor& positions_in,
                        const at::Tensor& inv_freq_in, at::Tensor& k_cache, at::Tensor& v_cache,
                        const at::Tensor& start_in, int64_t num_heads, int64_t num_kv_heads) {
  const int64_t D = check_rope_qkv_args(qkv_in, positions_in, inv_freq_in, k_cache, v_cache,
                                        start_in, num_heads, num_kv_heads);
  const auto qkv = qkv_in.contiguous();
  const auto positions = positions_in.contiguous();
  const auto inv_freq = inv_freq_in.contiguous();
  const auto start = start_in.contiguous();
  const int64_t B = qkv.size(0), T = qkv.size(1), S = k_cache.size(2), half = D / 2;
  const int32_t* st = start.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(st[b] >= 0 && st[b] + T <= S, "start[", b, "] + T must lie within the cache (S = ", S,
                "), got start = ", st[b], ", T = ", T);
  }
  auto q = at::empty({B, num_heads, T, D}, qkv.options());
  thread_local RopeTables tables;  // per calling thread: no locks, and a forward runs on one
  tables.fill(positions.data_ptr<int64_t>(), B * T, inv_freq.data_ptr<float>(), half);
  // The workers read the caller's tables: inside a lambda, `tables` would name their own.
  const float* cos_rows = tables.cos.data();
  const float* sin_rows = tables.sin.data();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_qkv", [&] {
    const scalar_t* src = qkv.data_ptr<scalar_t>();
    scalar_t* qo = q.data_ptr<scalar_t>();
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    const int64_t row = (num_heads + 2 * num_kv_heads) * D;
    at::parallel_for(0, B * T, 4, [&](int64_t begin, int64_t end) {
      std::vector<float> in_buf(D), out_buf(D);
      for (int64_t bt = begin; bt < end; ++bt) {
        const int64_t b = bt / T, t = bt % T;
        const float* cs = cos_rows + bt * half;
        const float* sn = sin_rows + bt * half;
        const scalar_t* r = src + bt * row;
        for (int64_t h = 0; h < num_heads; ++h) {
          rotate_head(r + h * D, qo + ((b * num_heads + h) * T + t) * D, cs, sn, D, in_buf.data(),
                      out_buf.data());
        }
        const int64_t slot = st[b] + t;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          const int64_t dst = ((b * num_kv_heads + h) * S + slot) * D;
          rotate_head(r + (num_heads + h) * D, kc + dst, cs, sn, D, in_buf.data(), out_buf.data());
          const scalar_t* v = r + (num_heads + num_kv_heads + h) * D;
          std::copy(v, v + D, vc + dst);
        }
      }
    });
  });
  return q;
}

}  // namespace

TORCH_LIBRARY_IMPL(poss, CPU, m) {
  m.impl("rms_norm", &rms_norm_cpu);
  m.impl("add_rms_norm", &add_rms_norm_cpu);
  m.impl("swiglu", &swiglu_cpu);
  m.impl("rope_qkv", &rope_qkv_cpu);
}

}  // namespace poss
