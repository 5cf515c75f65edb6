// The decoder loop's small per-row operations (selfspec/target/decoder.py), one call each instead of the 5-10 torch
// operators the model's modules run for them. Built at first use by selfspec/target/row_ops.py.
//
// Every row is computed by the same scalar code in the same order whatever else is in the call, so a row gets the
// same bits alone and in any pass (what the exact target pass needs); the work is split by rows, never within one.
// Each operation rounds where transformers' modules round (a 16-bit result per torch operator):
//   rms_norm       y = x * rsqrt(mean(x^2) + eps) in float32, rounded, then times the weight, rounded (the sum of
//                  squares in 16 lanes, a fixed order: its last float bit may differ from torch's sum)
//   add_rms_norm_  h = h + d (rounded, in place), then rms_norm(h)
//   rope_          x * cos + rotate_half(x) * sin, each product rounded, then their sum: torch's bits
//   silu_mul       silu(g) rounded, times u, rounded (exp by a polynomial of its own: silu's last bit may differ)

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t GRAIN = 16;  // rows per task

// to float and back (nearest even), bf16 by its bits so that loops over them vectorize (c10's bits exactly)
template <typename T> inline float f(T v) { return static_cast<float>(v); }
template <> inline float f<at::BFloat16>(at::BFloat16 v) {
  const uint32_t u = static_cast<uint32_t>(v.x) << 16;
  float out;
  std::memcpy(&out, &u, 4);
  return out;
}
template <typename T> inline T r(float v) { return static_cast<T>(v); }
template <> inline at::BFloat16 r<at::BFloat16>(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  u = v != v ? 0x7FC00000u : u + 0x7FFFu + ((u >> 16) & 1u);
  return at::BFloat16(static_cast<uint16_t>(u >> 16), at::BFloat16::from_bits());
}

// exp(x) by Cephes' polynomial in plain arithmetic (the loops calling it vectorize; the C library's does not)
inline float exp_poly(float x) {
  x = std::min(std::max(x, -87.f), 88.f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float t = x - n * 0.693359375f;
  t = t - n * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * t + 1.3981999507e-3f;
  y = y * t + 8.3334519073e-3f;
  y = y * t + 4.1665795894e-2f;
  y = y * t + 1.6666665459e-1f;
  y = y * t + 5.0000001201e-1f;
  y = y * (t * t) + t + 1.f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return y * scale;
}

constexpr int LANES = 16;  // the sum of squares: element i adds into lane i % 16, the lanes summed in order after

template <typename T>
void norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  float lane[LANES] = {};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int l = 0; l < LANES; ++l) lane[l] += f(x[i + l]) * f(x[i + l]);
  for (; i < n; ++i) lane[i % LANES] += f(x[i]) * f(x[i]);
  float sum = 0.f;
  for (int l = 0; l < LANES; ++l) sum += lane[l];
  const float scale = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (i = 0; i < n; ++i) out[i] = r<T>(f(w[i]) * f(r<T>(f(x[i]) * scale)));
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && x.dim() == 2, name, ": a contiguous 2-D CPU tensor");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, "x");
  auto out = at::empty_like(x);
  const int64_t n = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* px = x.data_ptr<scalar_t>();
    const scalar_t* pw = w.data_ptr<scalar_t>();
    scalar_t* po = out.data_ptr<scalar_t>();
    at::parallel_for(0, x.size(0), GRAIN, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) norm_row(px + i * n, pw, po + i * n, n, static_cast<float>(eps));
    });
  });
  return out;
}

at::Tensor add_rms_norm_(at::Tensor& h, const at::Tensor& d, const at::Tensor& w, double eps) {
  check_rows(h, "h");
  check_rows(d, "d");
  auto out = at::empty_like(h);
  const int64_t n = h.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "add_rms_norm_", [&] {
    scalar_t* ph = h.data_ptr<scalar_t>();
    const scalar_t* pd = d.data_ptr<scalar_t>();
    const scalar_t* pw = w.data_ptr<scalar_t>();
    scalar_t* po = out.data_ptr<scalar_t>();
    at::parallel_for(0, h.size(0), GRAIN, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        scalar_t* row = ph + i * n;
        for (int64_t j = 0; j < n; ++j) row[j] = r<scalar_t>(f(row[j]) + f(pd[i * n + j]));
        norm_row(row, pw, po + i * n, n, static_cast<float>(eps));
      }
    });
  });
  return out;
}

// x: (rows, row_stride) with each row's heads x head_dim values first; cos, sin: (rows, head_dim)
void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t head_dim) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1 && x.size(1) >= heads * head_dim,
              "x: (rows, >= heads * head_dim), rows of unit stride");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  const int64_t half = head_dim / 2, stride = x.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope_", [&] {
    scalar_t* px = x.data_ptr<scalar_t>();
    const scalar_t* pc = cos.data_ptr<scalar_t>();
    const scalar_t* ps = sin.data_ptr<scalar_t>();
    at::parallel_for(0, x.size(0), GRAIN, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        const scalar_t* c = pc + i * head_dim;
        const scalar_t* s = ps + i * head_dim;
        for (int64_t h = 0; h < heads; ++h) {
          scalar_t* v = px + i * stride + h * head_dim;
          for (int64_t j = 0; j < half; ++j) {
            const float a = f(v[j]), b = f(v[j + half]);
            const scalar_t lo_c = r<scalar_t>(a * f(c[j])), lo_s = r<scalar_t>(-b * f(s[j]));
            const scalar_t hi_c = r<scalar_t>(b * f(c[j + half])), hi_s = r<scalar_t>(a * f(s[j + half]));
            v[j] = r<scalar_t>(f(lo_c) + f(lo_s));
            v[j + half] = r<scalar_t>(f(hi_c) + f(hi_s));
          }
        }
      }
    });
  });
}

// g, u: (rows, n) each (rows of unit stride: slices of one fused projection too): silu(g) * u -> (rows, n)
at::Tensor silu_mul(const at::Tensor& g, const at::Tensor& u) {
  TORCH_CHECK(g.dim() == 2 && u.dim() == 2 && g.stride(1) == 1 && u.stride(1) == 1 && g.sizes() == u.sizes(),
              "g, u: (rows, n) each, rows of unit stride");
  const int64_t n = g.size(1);
  auto out = at::empty({g.size(0), n}, g.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, g.scalar_type(), "silu_mul", [&] {
    const scalar_t* pg = g.data_ptr<scalar_t>();
    const scalar_t* pu = u.data_ptr<scalar_t>();
    scalar_t* po = out.data_ptr<scalar_t>();
    const int64_t sg = g.stride(0), su = u.stride(0);
    at::parallel_for(0, g.size(0), GRAIN, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        for (int64_t j = 0; j < n; ++j) {
          const float x = f(pg[i * sg + j]);
          po[i * n + j] = r<scalar_t>(f(r<scalar_t>(x / (1.f + exp_poly(-x)))) * f(pu[i * su + j]));
        }
      }
    });
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm_", &add_rms_norm_);
  m.def("rope_", &rope_);
  m.def("silu_mul", &silu_mul);
}
