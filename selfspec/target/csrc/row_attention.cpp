// Row attention: every query row attends over its own key sequence (a prefix of its cache row, then a list of
// slots), each row computed by the same arithmetic whatever else is in the call. Built at first use by
// selfspec/row_attention.py (torch.utils.cpp_extension), for this CPU (-march=native), AVX-512 only.
//
// One row r, query head h (K/V head h / group), keys j = 0 .. n-1 (slots 0 .. prefix-1, then extra[r, :count]):
//   s_j  = a 16-lane vector of q x k_j products accumulated over the head dimension's chunks in order (bf16 with
//          AVX512-BF16: dot-product instructions over 32-element chunks, then times the scale; else fused
//          multiply-adds of q*scale), then its lane sum by a fixed tree, 16 keys at a time (hsum16)
//   p_j  = exp(s_j - max s), 16 keys at a time (one polynomial for every lane)
//   out  = (sum_j p_j v_j, j in order) / (sum of p_j: 16 lanes in order, then a fixed lane sum)
// Nothing depends on which other rows share the call, where a row's keys sit in memory, or how work is split
// among threads: a row gets the same bits alone and in any pass, which is what the exact target pass needs.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <array>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ROWS_AVX512 1

namespace {

template <typename T> inline __m512 load16(const T* p, __mmask16 m);
template <> inline __m512 load16<float>(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
template <> inline __m512 load16<at::BFloat16>(const at::BFloat16* p, __mmask16 m) {
  const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
template <> inline __m512 load16<at::Half>(const at::Half* p, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}

// exp(x) for x <= 0 (Cephes' polynomial; the same operations in every lane)
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), r);
  y = _mm512_add_ps(y, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}

// Lane t of the result: the lane sum of a[t], by one fixed tree for every t (halves of 256 bits, then of 128, then
// lanes 2 apart, then 1 apart), whatever the other vectors hold: 15 adds and 30 shuffles for 16 sums.
inline __m512 hsum16(const __m512* a) {
  __m512 x[8], y[4], z[2];
  for (int u = 0; u < 8; ++u)
    x[u] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * u], a[2 * u + 1], 0x44), _mm512_shuffle_f32x4(a[2 * u], a[2 * u + 1], 0xEE));
  for (int w = 0; w < 4; ++w)
    y[w] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * w], x[2 * w + 1], 0x88), _mm512_shuffle_f32x4(x[2 * w], x[2 * w + 1], 0xDD));
  for (int v = 0; v < 2; ++v)
    z[v] = _mm512_add_ps(_mm512_unpacklo_ps(y[2 * v], y[2 * v + 1]), _mm512_unpackhi_ps(y[2 * v], y[2 * v + 1]));
  const __m512 f = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(z[0]), _mm512_castps_pd(z[1]))),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(z[0]), _mm512_castps_pd(z[1]))));
  // f's lane 4k + r holds a[4r + k]'s sum
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, f);
}

#if defined(__AVX512BF16__)
#define ROWS_DPBF16 1
#endif

// A query vector, as the score of one key is computed from it: bf16 pairs for a bf16 cache where the CPU has
// AVX512-BF16 (each score = dot-product instructions over 32-element chunks, then times the scale), else 16-lane
// float chunks already times the scale (each score = fused multiply-adds over the chunks).
template <typename T> struct Query {
  static constexpr bool pairs = false;
  __m512 c[16];
  void load(const T* q, int64_t D, float scale) {
    const int64_t C = (D + 15) / 16;
    for (int64_t k = 0; k < C; ++k) {
      const __mmask16 m = (k == C - 1 && D % 16) ? (__mmask16)((1u << (D % 16)) - 1) : (__mmask16)0xFFFF;
      c[k] = _mm512_mul_ps(load16(q + k * 16, m), _mm512_set1_ps(scale));
    }
  }
  // lane t: this query's score against keys[t] (t < n; lanes from n on are 0)
  __m512 scores(const T* const* keys, int n, int64_t D, float) const {
    const int64_t C = (D + 15) / 16;
    __m512 acc[16];
    for (int t = 0; t < 16; ++t) {
      acc[t] = _mm512_setzero_ps();
      if (t >= n) continue;
      for (int64_t k = 0; k < C; ++k) {
        const __mmask16 m = (k == C - 1 && D % 16) ? (__mmask16)((1u << (D % 16)) - 1) : (__mmask16)0xFFFF;
        acc[t] = _mm512_fmadd_ps(c[k], load16(keys[t] + k * 16, m), acc[t]);
      }
    }
    return hsum16(acc);
  }
};

#ifdef ROWS_DPBF16
template <> struct Query<at::BFloat16> {
  static constexpr bool pairs = true;
  __m512bh c[8];
  static __mmask32 mask(int64_t k, int64_t C, int64_t D) {
    return (k == C - 1 && D % 32) ? (__mmask32)((1ull << (D % 32)) - 1) : (__mmask32)0xFFFFFFFFu;
  }
  void load(const at::BFloat16* q, int64_t D, float) {
    const int64_t C = (D + 31) / 32;
    for (int64_t k = 0; k < C; ++k) c[k] = (__m512bh)_mm512_maskz_loadu_epi16(mask(k, C, D), q + k * 32);
  }
  __m512 scores(const at::BFloat16* const* keys, int n, int64_t D, float scale) const {
    const int64_t C = (D + 31) / 32;
    __m512 acc[16];
    for (int t = 0; t < 16; ++t) {
      acc[t] = _mm512_setzero_ps();
      if (t >= n) continue;
      for (int64_t k = 0; k < C; ++k)
        acc[t] = _mm512_dpbf16_ps(acc[t], c[k], (__m512bh)_mm512_maskz_loadu_epi16(mask(k, C, D), keys[t] + k * 32));
    }
    return _mm512_mul_ps(hsum16(acc), _mm512_set1_ps(scale));
  }
};
#endif

// The rows [r0, r1) of one cache row (entry) and one K/V head: their `group` query heads each. Row r's keys are
// j = 0 .. prefix + count[r] - 1: slot j below the prefix, then its extra slots; scores come 16 keys at a time
// (key j in lane j % 16 of block j / 16), so a score's arithmetic depends on its query, its key and j % 16 alone.
template <typename T>
void attend_task(const T* q, const T* k, const T* v, T* out, const int64_t* extra, const int64_t* count,
                 int64_t r0, int64_t r1, int64_t entry, int64_t prefix, int64_t kvh, int64_t H, int64_t group,
                 int64_t D, int64_t E, int64_t sk0, int64_t sk1, int64_t sk2, int64_t sv0, int64_t sv1, int64_t sv2,
                 float scale) {
  const int64_t C = (D + 15) / 16, rows = r1 - r0, m = rows * group;
  const __mmask16 tail = (D % 16) ? (__mmask16)((1u << (D % 16)) - 1) : (__mmask16)0xFFFF;
  auto mask = [&](int64_t c) { return c == C - 1 ? tail : (__mmask16)0xFFFF; };
  int64_t most = 0;
  for (int64_t r = r0; r < r1; ++r) most = std::max(most, count[r]);
  const int64_t width = (prefix + most + 15) / 16 * 16;
  std::vector<Query<T>> qv(m);
  std::vector<__m512> acc(m * C);
  std::vector<float> scores(m * width);
  for (int64_t i = 0; i < m; ++i)  // query vector i: row r0 + i / group, head kvh * group + i % group
    qv[i].load(q + ((r0 + i / group) * H + kvh * group + i % group) * D, D, scale);
  const T* kb = k + entry * sk0 + kvh * sk1;
  const T* vb = v + entry * sv0 + kvh * sv1;
  const T* keys[16];
  for (int64_t j0 = 0; j0 < prefix + most; j0 += 16) {
    if (j0 + 16 <= prefix) {  // all in the prefix: every row's queries against the same 16 keys
      for (int t = 0; t < 16; ++t) keys[t] = kb + (j0 + t) * sk2;
      for (int64_t i = 0; i < m; ++i) _mm512_storeu_ps(scores.data() + i * width + j0, qv[i].scores(keys, 16, D, scale));
      continue;
    }
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t n = std::min<int64_t>(16, prefix + count[r] - j0);
      if (n <= 0) continue;
      for (int t = 0; t < n; ++t) {
        const int64_t j = j0 + t;
        keys[t] = kb + (j < prefix ? j : extra[r * E + j - prefix]) * sk2;
      }
      for (int64_t i = (r - r0) * group; i < (r - r0 + 1) * group; ++i)
        _mm512_storeu_ps(scores.data() + i * width + j0, qv[i].scores(keys, (int)n, D, scale));
    }
  }
  std::vector<float> total(m);
  for (int64_t i = 0; i < m; ++i) {  // scores -> exp(s - max), in place; the sum of each row's weights
    float* s = scores.data() + i * width;
    const int64_t n = prefix + count[r0 + i / group];
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; ++j) mx = std::max(mx, s[j]);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 live = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1);
      const __m512 p = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), _mm512_set1_ps(mx))));
      _mm512_storeu_ps(s + j, p);
      sum = _mm512_add_ps(sum, p);
    }
    total[i] = _mm512_reduce_add_ps(sum);
    for (int64_t c = 0; c < C; ++c) acc[i * C + c] = _mm512_setzero_ps();
  }
  __m512 vc[16];
  auto weigh = [&](const T* vj, int64_t i0, int64_t i1, int64_t j) {
    for (int64_t c = 0; c < C; ++c) vc[c] = load16(vj + c * 16, mask(c));
    for (int64_t i = i0; i < i1; ++i) {
      const __m512 p = _mm512_set1_ps(scores[i * width + j]);
      for (int64_t c = 0; c < C; ++c) acc[i * C + c] = _mm512_fmadd_ps(p, vc[c], acc[i * C + c]);
    }
  };
  for (int64_t j = 0; j < prefix; ++j) weigh(vb + j * sv2, 0, m, j);
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t t = 0; t < count[r]; ++t) weigh(vb + extra[r * E + t] * sv2, (r - r0) * group, (r - r0 + 1) * group, prefix + t);
  float row[16 * 16];
  for (int64_t i = 0; i < m; ++i) {
    const __m512 norm = _mm512_set1_ps(total[i]);
    for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(row + c * 16, _mm512_div_ps(acc[i * C + c], norm));
    T* o = out + ((r0 + i / group) * H + kvh * group + i % group) * D;
    for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(row[d]);
  }
}

}  // namespace
#endif

bool row_attention_available() {
#ifdef ROWS_AVX512
  return true;
#else
  return false;
#endif
}

// q (R, H, D) contiguous; k, v (B, KV, S, D) with unit last stride; rows of one entry adjacent, each row's
// entry, prefix (slots 0..prefix-1 first), extra (R, E) slots and count (how many of them) as int64.
torch::Tensor row_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor entry,
                            torch::Tensor prefix, torch::Tensor extra, torch::Tensor count, double scale) {
#ifdef ROWS_AVX512
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.dim() == 4, "row_attention: q (R, H, D), k and v (B, KV, S, D)");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "row_attention: K and V need a unit last stride");
  TORCH_CHECK(q.size(2) <= 256, "row_attention: head_dim above 256");
  q = q.contiguous();
  auto out = torch::empty_like(q);
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2), KV = k.size(1), E = extra.size(1);
  const int64_t group = H / KV;
  const int64_t* en = entry.data_ptr<int64_t>();
  const int64_t* pre = prefix.data_ptr<int64_t>();
  const int64_t* ex = extra.data_ptr<int64_t>();
  const int64_t* cnt = count.data_ptr<int64_t>();
  std::vector<std::array<int64_t, 3>> tasks;  // (first row, end row, K/V head): at most 8 rows of one entry each
  for (int64_t r = 0; r < R;) {
    int64_t z = r + 1;
    while (z < R && z - r < 8 && en[z] == en[r] && pre[z] == pre[r]) ++z;
    for (int64_t h = 0; h < KV; ++h) tasks.push_back({r, z, h});
    r = z;
  }
  auto run = [&](auto* qp) {
    using scalar_t = std::remove_const_t<std::remove_pointer_t<decltype(qp)>>;
    const scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* vp = v.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, (int64_t)tasks.size(), 1, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const auto& task = tasks[t];
        attend_task<scalar_t>(qp, kp, vp, op, ex, cnt, task[0], task[1], en[task[0]], pre[task[0]], task[2], H,
                              group, D, E, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
                              v.stride(2), (float)scale);
      }
    });
  };
  switch (q.scalar_type()) {
    case at::kBFloat16: run(q.data_ptr<at::BFloat16>()); break;
    case at::kHalf: run(q.data_ptr<at::Half>()); break;
    case at::kFloat: run(q.data_ptr<float>()); break;
    default: TORCH_CHECK(false, "row_attention: bfloat16, float16 or float32 only");
  }
  return out;
#else
  TORCH_CHECK(false, "row_attention: built without AVX-512");
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("row_attention", &row_attention, "each query row over its own keys, bits independent of the call");
  m.def("row_attention_available", &row_attention_available, "whether this build has the AVX-512 kernel");
}
