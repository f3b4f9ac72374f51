// quantbench::gemv16(x[K], w[N,K]) -> y[N]: one row times a 16-bit (bf16 or fp16) weight matrix, fp32 accumulation,
// AVX-512. Built and loaded by quantizers/rows8.py (measure.gemv=rows8); that file's docstring says why it exists.
//
// Why 8 rows at a time: a batch-1 decode step is a memory stream, and one core streams only as fast as it keeps
// cache-line misses in flight. Reading 8 weight rows side by side (16 accumulators, each x vector loaded once per
// 8 rows) keeps 8 independent streams going per core; one row at a time (ATen's GEMV) keeps one. Measured on
// AMD EPYC family 25 model 17 (Zen 4), 2 threads, every Llama-3.2-1B matrix once, fp16: 8 rows 46.8 GB/s,
// 4 rows 38.9, 1 row 37.3, ATen 39.1 (benchmarks/cpu_kernels.py --one-row has the side-by-side rows).
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <vector>
#include <immintrin.h>
#include <torch/library.h>
#include <torch/types.h>

namespace {

// 16 weights at p as 16 floats: fp16 through the F16C conversion, bf16 by moving its bits into a float's top half
template <bool BF16>
inline __m512 load16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if constexpr (BF16) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return _mm512_cvtph_ps(h);
  }
}

template <bool BF16>
inline float scalar(uint16_t v) {
  if constexpr (BF16) {
    uint32_t bits = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  } else {
    return _cvtsh_ss(v);
  }
}

// rows [n0, n0 + R) of W: R dot products with x, two accumulators per row (FMA latency)
template <bool BF16, int R>
inline void block(const float* x, const uint16_t* w, float* y, int64_t n0, int64_t K) {
  const int64_t K32 = K / 32 * 32;
  __m512 acc[R][2];
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  const uint16_t* row = w + n0 * K;
  for (int64_t k = 0; k < K32; k += 32) {
    const __m512 x0 = _mm512_loadu_ps(x + k), x1 = _mm512_loadu_ps(x + k + 16);
    for (int i = 0; i < R; ++i) {
      const uint16_t* p = row + i * K + k;
      acc[i][0] = _mm512_fmadd_ps(load16<BF16>(p), x0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(load16<BF16>(p + 16), x1, acc[i][1]);
    }
  }
  for (int i = 0; i < R; ++i) {
    float s = _mm512_reduce_add_ps(_mm512_add_ps(acc[i][0], acc[i][1]));
    for (int64_t k = K32; k < K; ++k) s += scalar<BF16>(row[i * K + k]) * x[k];
    y[n0 + i] = s;
  }
}

// bf16 on CPUs with AVX512_BF16: vdpbf16ps multiplies 32 bf16 pairs and adds them into 16 fp32 sums in one op
// (x is the layer's bf16 input, so nothing is rounded that was not already bf16)
template <int R>
__attribute__((target("avx512bf16"))) inline void block_dp(const uint16_t* xb, const uint16_t* w, float* y,
                                                             int64_t n0, int64_t K) {
  const int64_t K32 = K / 32 * 32;
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  const uint16_t* row = w + n0 * K;
  for (int64_t k = 0; k < K32; k += 32) {
    const __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + k);
    for (int i = 0; i < R; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512(row + i * K + k), xv);
  }
  for (int i = 0; i < R; ++i) {
    float s = _mm512_reduce_add_ps(acc[i]);
    for (int64_t k = K32; k < K; ++k) s += scalar<true>(row[i * K + k]) * scalar<true>(xb[k]);
    y[n0 + i] = s;
  }
}

// bf16 weights re-laid in tiles of 4 rows, [N/4][K/32][4 rows][32] (quantizers/rows8.py, relayout16): each thread
// then reads one contiguous stream instead of 8 rows 4 KiB apart, and the hardware prefetcher keeps up with it.
// Measured on AMD EPYC family 25 model 17 (Zen 4), 2 threads, 1.2 GB of [N, 2048] bf16 on 2 MiB pages, standalone
// C++, best of 5: row-major 8 rows 49.6-50.2 GB/s (16 rows 50.9-52.3; a software prefetch 256 B-1 KiB ahead
// 47.3-48.5), tiles of 8 rows 59.5-59.9, of 4 rows 61.2-63.0, of 16 rows 56.6-57.0. Per row, the sums are those of
// block_dp (same chunks, same vdpbf16ps order, same reduction), so a row's value does not depend on the layout or on
// how many x rows share the pass (M, up to 4: a prompt's rows reuse the tile while it is in L1/L2).
template <int M>
__attribute__((target("avx512bf16"))) inline void tile16(const uint16_t* x, int64_t K, const uint16_t* wt,
                                                           c10::BFloat16* y, int64_t N, int64_t n0) {
  __m512 acc[M][4];
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < 4; ++i) acc[m][i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < K / 32; ++c) {
    const uint16_t* p = wt + c * 128;
    __m512bh w[4];
    for (int i = 0; i < 4; ++i) w[i] = (__m512bh)_mm512_loadu_si512(p + i * 32);
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + c * 32);
      for (int i = 0; i < 4; ++i) acc[m][i] = _mm512_dpbf16_ps(acc[m][i], w[i], xv);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < 4; ++i) y[m * N + n0 + i] = c10::BFloat16(_mm512_reduce_add_ps(acc[m][i]));  // round to nearest even, as .to(bf16)
}

template <bool BF16>
void gemv(const float* x, const uint16_t* w, float* y, int64_t N, int64_t K) {
  constexpr int R = 8;
  const int64_t blocks = N / R;
  // grain: at least ~256 KiB of weights per task, so small matrices do not pay for a second thread
  const int64_t grain = std::max<int64_t>(1, (256 << 10) / (R * K * 2));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) block<BF16, R>(x, w, y, b * R, K);
  });
  for (int64_t n = blocks * R; n < N; ++n) block<BF16, 1>(x, w, y, n, K);  // the last N % 8 rows
}

// int8 rows with one scale each (quantizers/int8pack.py's Int8PackLinear): y[n] = scale[n] * sum_k q[n,k] x[k]
template <int R>
inline void block8(const float* x, const int8_t* q, const float* scale, float* y, int64_t n0, int64_t K) {
  const int64_t K32 = K / 32 * 32;
  __m512 acc[R][2];
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  const int8_t* row = q + n0 * K;
  for (int64_t k = 0; k < K32; k += 32) {
    const __m512 x0 = _mm512_loadu_ps(x + k), x1 = _mm512_loadu_ps(x + k + 16);
    for (int i = 0; i < R; ++i) {
      const int8_t* p = row + i * K + k;
      const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
      const __m512 w1 =
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
      acc[i][0] = _mm512_fmadd_ps(w0, x0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(w1, x1, acc[i][1]);
    }
  }
  for (int i = 0; i < R; ++i) {
    float s = _mm512_reduce_add_ps(_mm512_add_ps(acc[i][0], acc[i][1]));
    for (int64_t k = K32; k < K; ++k) s += static_cast<float>(row[i * K + k]) * x[k];
    y[n0 + i] = s * scale[n0 + i];
  }
}

at::Tensor gemv8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.device().is_cpu() && q.scalar_type() == at::kChar,
              "gemv8: q must be a contiguous int8 CPU matrix");
  TORCH_CHECK(x.numel() == q.size(1) && scale.numel() == q.size(0), "gemv8: one row of ", q.size(1),
              " values and one scale per output row");
  const auto xf = x.reshape({-1}).to(at::kFloat).contiguous();
  const auto sf = scale.reshape({-1}).to(at::kFloat).contiguous();
  const int64_t N = q.size(0), K = q.size(1);
  auto y = at::empty({N}, xf.options());
  const float *xp = xf.data_ptr<float>(), *sp = sf.data_ptr<float>();
  const auto* qp = q.data_ptr<int8_t>();
  float* yp = y.data_ptr<float>();
  constexpr int R = 8;
  const int64_t blocks = N / R, grain = std::max<int64_t>(1, (256 << 10) / (R * K));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) block8<R>(xp, qp, sp, yp, b * R, K);
  });
  for (int64_t n = blocks * R; n < N; ++n) block8<1>(xp, qp, sp, yp, n, K);
  return y.to(x.scalar_type());
}

// ---- int4: quantbench::gemv4 (quantizers/int4rows.py's Int4RowsLinear) ----
// torchao's int4 weights, w = (q - 8) * s + z with q in 0..15 and a bf16 scale s and zero z per group of gs weights,
// re-laid as one stream per tile of 16 rows: packed[N/16, G, gs/8 * 64 + 64]. A group of a tile is gs/8 chunks of
// 64 bytes (byte 4r + j of a chunk holds q[row r][k0 + j] in its low nibble, q[row r][k0 + 4 + j] in its high one),
// then the 16 rows' s, then their z (bf16): scales inside the stream, not in two more streams beside it (that cost
// ~30% here).
//
// Why integer dot products: widening int4 to fp32 costs ~3 AVX-512 ops per 16 weights, and ATen's int4 kernel is
// compute-bound at ~21 GB/s on 2 Zen 4 cores, below the memory stream. vpdpbusd multiplies 64 u8 x s8 pairs into
// 16 int32 sums in one op: the nibbles are the u8 side, x the s8 side. Each group of 32 x is written as a 24-bit
// fixed-point number v = round(x / dx) (dx = max|x| / 8355711) split in three int8 pieces, v = 65536 h + 256 c + l,
// so three vpdpbusd give sum q v exactly. Why 24 bits: every bf16 value down to 2^-15 of its group's largest is
// then exact (bf16 keeps 8 bits, at any exponent), so x enters as x, not rounded again: a first version with 15 bits
// (two pieces) was coarser than bf16 for values 2^-7 below the group's largest, and small differences of x between
// eager and compiled steps (inductor rounds the norms differently) moved the outputs several times more than
// torchao's kernel does: an 8B greedy generation then left the eager one at a near-tie 5 ulps deep. Per group:
// sum w x = s dx sum q v + (z - 8 s) sum x.
struct XPrep {  // one input row in the form the integer kernels read
  std::vector<int8_t> h, c, l;  // v = 65536 h + 256 c + l
  std::vector<float> dx, sum;
  float vsum = 0.f;  // sum over k of dx v: x as the kernel sees it, summed (gemv8t's offset correction)
};

inline void prep4(const float* x, int64_t K, int64_t gs, XPrep& p) {  // gs: a multiple of 16
  const int64_t G = K / gs;
  p.h.resize(K), p.c.resize(K), p.l.resize(K), p.dx.resize(G), p.sum.resize(G);
  p.vsum = 0.f;
  const __m512i c128 = _mm512_set1_epi32(128), c255 = _mm512_set1_epi32(255), vmax = _mm512_set1_epi32(8355711);
  for (int64_t g = 0; g < G; ++g) {
    const float* xg = x + g * gs;
    __m512 mx = _mm512_setzero_ps(), sm = _mm512_setzero_ps();
    for (int64_t i = 0; i < gs; i += 16) {
      const __m512 v = _mm512_loadu_ps(xg + i);
      mx = _mm512_max_ps(mx, _mm512_abs_ps(v)), sm = _mm512_add_ps(sm, v);
    }
    const float m = _mm512_reduce_max_ps(mx);
    p.dx[g] = m / 8355711.f, p.sum[g] = _mm512_reduce_add_ps(sm);  // 8355711 = 127 (65536 + 256 + 1): pieces fit
    const __m512 inv = _mm512_set1_ps(m > 0.f ? 8355711.f / m : 0.f);
    __m512i vs = _mm512_setzero_si512();
    for (int64_t i = 0; i < gs; i += 16) {
      // rounded to nearest; clamped, as x * (8355711 / m) for x = m can round up to 8355712 in fp32
      const __m512i v = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xg + i), inv)),
                                                          vmax), _mm512_sub_epi32(_mm512_setzero_si512(), vmax));
      vs = _mm512_add_epi32(vs, v);
      const __m512i lo = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(v, c128), c255), c128);  // -128..127
      const __m512i r = _mm512_srai_epi32(_mm512_sub_epi32(v, lo), 8);
      const __m512i mid = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(r, c128), c255), c128);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p.l.data() + g * gs + i), _mm512_cvtepi32_epi8(lo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p.c.data() + g * gs + i), _mm512_cvtepi32_epi8(mid));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p.h.data() + g * gs + i),
                       _mm512_cvtepi32_epi8(_mm512_srai_epi32(_mm512_sub_epi32(r, mid), 8)));
    }
    p.vsum += p.dx[g] * static_cast<float>(_mm512_reduce_add_epi32(vs));
  }
}

inline __m512 bf16x16(const uint8_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// the three pieces' sums as one fp32: (256 h + c) is exact in int32 (and below 2^24 for int4), then one rounding
__attribute__((target("avx512vnni"))) inline __m512 join3(__m512i h, __m512i c, __m512i l) {
  const __m512 hc = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(h, 8), c));
  return _mm512_fmadd_ps(hc, _mm512_set1_ps(256.f), _mm512_cvtepi32_ps(l));
}

inline __m512i bcast4(const int8_t* p) {  // 4 int8 values into every 32-bit lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// T tiles of 16 rows side by side (T streams) times M input rows x[0..M)
template <int T, int M>
__attribute__((target("avx512vnni"))) inline void tiles4(const uint8_t* w, const XPrep* x, float* y, int64_t N,
                                                         int64_t t0, int64_t K, int64_t gs) {
  const int64_t G = K / gs, gbytes = gs * 8 + 64, tbytes = G * gbytes;
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  __m512 out[T][M];
  for (int t = 0; t < T; ++t)
    for (int m = 0; m < M; ++m) out[t][m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i ah[T][M], ac[T][M], al[T][M];
    for (int t = 0; t < T; ++t)
      for (int m = 0; m < M; ++m) ah[t][m] = ac[t][m] = al[t][m] = _mm512_setzero_si512();
    for (int64_t c = 0; c < gs / 8; ++c) {
      const int64_t k = g * gs + c * 8;
      for (int t = 0; t < T; ++t) {
        const __m512i v = _mm512_loadu_si512(w + (t0 + t) * tbytes + g * gbytes + c * 64);
        const __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        for (int m = 0; m < M; ++m) {
          ah[t][m] = _mm512_dpbusd_epi32(ah[t][m], lo, bcast4(x[m].h.data() + k));
          ac[t][m] = _mm512_dpbusd_epi32(ac[t][m], lo, bcast4(x[m].c.data() + k));
          al[t][m] = _mm512_dpbusd_epi32(al[t][m], lo, bcast4(x[m].l.data() + k));
          ah[t][m] = _mm512_dpbusd_epi32(ah[t][m], hi, bcast4(x[m].h.data() + k + 4));
          ac[t][m] = _mm512_dpbusd_epi32(ac[t][m], hi, bcast4(x[m].c.data() + k + 4));
          al[t][m] = _mm512_dpbusd_epi32(al[t][m], hi, bcast4(x[m].l.data() + k + 4));
        }
      }
    }
    for (int t = 0; t < T; ++t) {
      const uint8_t* sz = w + (t0 + t) * tbytes + g * gbytes + gs * 8;
      const __m512 sc = bf16x16(sz), zq = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), sc, bf16x16(sz + 32));  // z - 8 s
      for (int m = 0; m < M; ++m) {
        const __m512 q = join3(ah[t][m], ac[t][m], al[t][m]);
        out[t][m] = _mm512_fmadd_ps(q, _mm512_mul_ps(sc, _mm512_set1_ps(x[m].dx[g])), out[t][m]);
        out[t][m] = _mm512_fmadd_ps(zq, _mm512_set1_ps(x[m].sum[g]), out[t][m]);
      }
    }
  }
  for (int t = 0; t < T; ++t)
    for (int m = 0; m < M; ++m) _mm512_storeu_ps(y + m * N + (t0 + t) * 16, out[t][m]);
}

template <int T>
void one_row4(const uint8_t* w, const XPrep* x, float* y, int64_t N, int64_t K, int64_t gs) {
  const int64_t blocks = N / 16 / T, grain = std::max<int64_t>(1, (256 << 10) / (T * 8 * K));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) tiles4<T, 1>(w, x, y, N, b * T, K, gs);
  });
  for (int64_t t = blocks * T; t < N / 16; ++t) tiles4<1, 1>(w, x, y, N, t, K, gs);
}

at::Tensor gemv4(const at::Tensor& x, const at::Tensor& w, int64_t gs) {
  TORCH_CHECK(__builtin_cpu_supports("avx512vnni"), "gemv4 needs AVX512_VNNI");
  TORCH_CHECK(w.dim() == 3 && w.is_contiguous() && w.device().is_cpu() && w.scalar_type() == at::kByte &&
              gs % 16 == 0 && w.size(2) == gs * 8 + 64, "gemv4: w must be contiguous uint8 [N/16, K/gs, gs*8 + 64]");
  const int64_t N = w.size(0) * 16, K = w.size(1) * gs;
  TORCH_CHECK(x.size(-1) == K, "gemv4: x must have ", K, " columns");
  const auto xf = x.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t rows = xf.size(0);
  auto y = at::empty({rows, N}, xf.options());
  const auto* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  std::vector<XPrep> prep(rows);
  for (int64_t r = 0; r < rows; ++r) prep4(xf.data_ptr<float>() + r * K, K, gs, prep[r]);
  if (rows == 1) {
    // a decode step: tiles side by side as streams; 1 for K <= 2048, else 4 (Zen 4, 2 threads, every matrix of
    // Llama-3.2-1B / -3.1-8B once: T=1 28.7 / 25.6 GB/s, T=4 25.4 / 29.1; ATen's int4 kernel 21.5 / 22.5)
    if (K <= 2048) one_row4<1>(wp, prep.data(), yp, N, K, gs);
    else one_row4<4>(wp, prep.data(), yp, N, K, gs);
  } else {
    // a prompt: each tile, read once from memory, times every row, 4 rows per pass (the tile stays in L2)
    at::parallel_for(0, N / 16, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        int64_t r = 0;
        for (; r + 4 <= rows; r += 4) tiles4<1, 4>(wp, prep.data() + r, yp + r * N, N, t, K, gs);
        if (rows - r == 3) tiles4<1, 3>(wp, prep.data() + r, yp + r * N, N, t, K, gs);
        if (rows - r == 2) tiles4<1, 2>(wp, prep.data() + r, yp + r * N, N, t, K, gs);
        if (rows - r == 1) tiles4<1, 1>(wp, prep.data() + r, yp + r * N, N, t, K, gs);
      }
    });
  }
  auto shape = x.sizes().vec();  // x's leading dimensions, N outputs
  shape.back() = N;
  return y.to(x.scalar_type()).view(shape);
}

// ---- int8: quantbench::gemv8t (quantizers/vnni.py's Int8RowsLinear) ----
// Symmetric int8 rows with one scale each (quantizers/int8pack.py's values), re-laid in tiles of 16 rows for the same
// integer dot products as gemv4: w[N/16, K/4, 64], byte 4r + j = q[row r][k0 + j] + 128 (vpdpbusd's unsigned side;
// the 128 comes back out as 128 sum x). x as in gemv4 (24-bit fixed point in groups of 32). y[n] = scale[n] (sum_k (q + 128) v dx -
// 128 sum_k v dx). Three vpdpbusd per 64 weights, where widening int8 to fp32 (gemv8) costs ~3 ops per 16.
template <int T, int M>
__attribute__((target("avx512vnni"))) inline void tiles8(const uint8_t* w, const uint16_t* scale, const XPrep* x,
                                                         float* y, int64_t N, int64_t t0, int64_t K) {
  const int64_t tbytes = K * 16;
  __m512 out[T][M];
  for (int t = 0; t < T; ++t)
    for (int m = 0; m < M; ++m) out[t][m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < K / 32; ++g) {
    __m512i ah[T][M], ac[T][M], al[T][M];
    for (int t = 0; t < T; ++t)
      for (int m = 0; m < M; ++m) ah[t][m] = ac[t][m] = al[t][m] = _mm512_setzero_si512();
    for (int64_t k = g * 32; k < g * 32 + 32; k += 4) {
      for (int t = 0; t < T; ++t) {
        const __m512i v = _mm512_loadu_si512(w + (t0 + t) * tbytes + k * 16);
        for (int m = 0; m < M; ++m) {
          ah[t][m] = _mm512_dpbusd_epi32(ah[t][m], v, bcast4(x[m].h.data() + k));
          ac[t][m] = _mm512_dpbusd_epi32(ac[t][m], v, bcast4(x[m].c.data() + k));
          al[t][m] = _mm512_dpbusd_epi32(al[t][m], v, bcast4(x[m].l.data() + k));
        }
      }
    }
    for (int t = 0; t < T; ++t)
      for (int m = 0; m < M; ++m) {
        const __m512 q = join3(ah[t][m], ac[t][m], al[t][m]);
        out[t][m] = _mm512_fmadd_ps(q, _mm512_set1_ps(x[m].dx[g]), out[t][m]);
      }
  }
  for (int t = 0; t < T; ++t) {
    const __m512 sc = bf16x16(reinterpret_cast<const uint8_t*>(scale + (t0 + t) * 16));
    for (int m = 0; m < M; ++m)
      _mm512_storeu_ps(y + m * N + (t0 + t) * 16,
                       _mm512_mul_ps(_mm512_sub_ps(out[t][m], _mm512_set1_ps(128.f * x[m].vsum)), sc));
  }
}

at::Tensor gemv8t(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  TORCH_CHECK(__builtin_cpu_supports("avx512vnni"), "gemv8t needs AVX512_VNNI");
  TORCH_CHECK(w.dim() == 3 && w.size(2) == 64 && w.size(1) % 8 == 0 && w.is_contiguous() && w.device().is_cpu() &&
              w.scalar_type() == at::kByte, "gemv8t: w must be contiguous uint8 [N/16, K/4, 64], K a multiple of 32");
  const int64_t N = w.size(0) * 16, K = w.size(1) * 4;
  TORCH_CHECK(x.size(-1) == K && scale.numel() == N && scale.is_contiguous() && scale.scalar_type() == at::kBFloat16,
              "gemv8t: x must have ", K, " columns and scale ", N, " bf16 values");
  const auto xf = x.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t rows = xf.size(0);
  auto y = at::empty({rows, N}, xf.options());
  const auto* wp = w.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scale.data_ptr());
  float* yp = y.data_ptr<float>();
  std::vector<XPrep> prep(rows);
  for (int64_t r = 0; r < rows; ++r) prep4(xf.data_ptr<float>() + r * K, K, 32, prep[r]);
  if (rows == 1) {
    constexpr int T = 2;
    const int64_t blocks = N / 16 / T, grain = std::max<int64_t>(1, (256 << 10) / (T * 16 * K));
    at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) tiles8<T, 1>(wp, sp, prep.data(), yp, N, b * T, K);
    });
    for (int64_t t = blocks * T; t < N / 16; ++t) tiles8<1, 1>(wp, sp, prep.data(), yp, N, t, K);
  } else {
    at::parallel_for(0, N / 16, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        int64_t r = 0;
        for (; r + 4 <= rows; r += 4) tiles8<1, 4>(wp, sp, prep.data() + r, yp + r * N, N, t, K);
        if (rows - r == 3) tiles8<1, 3>(wp, sp, prep.data() + r, yp + r * N, N, t, K);
        if (rows - r == 2) tiles8<1, 2>(wp, sp, prep.data() + r, yp + r * N, N, t, K);
        if (rows - r == 1) tiles8<1, 1>(wp, sp, prep.data() + r, yp + r * N, N, t, K);
      }
    });
  }
  auto shape = x.sizes().vec();
  shape.back() = N;
  return y.to(x.scalar_type()).view(shape);
}

// quantbench::gemv16t(x[..., K] bf16, w [N/4, K/32, 128] bf16 tiles) -> y[..., N] bf16; any number of x rows, 4 per pass
at::Tensor gemv16t(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(__builtin_cpu_supports("avx512bf16"), "gemv16t needs AVX512_BF16");
  TORCH_CHECK(w.dim() == 3 && w.size(2) == 128 && w.is_contiguous() && w.device().is_cpu() &&
              w.scalar_type() == at::kBFloat16, "gemv16t: w must be contiguous bf16 [N/4, K/32, 128]");
  const int64_t N = w.size(0) * 4, K = w.size(1) * 32;
  TORCH_CHECK(x.size(-1) == K && x.scalar_type() == at::kBFloat16, "gemv16t: x must be bf16 with ", K, " columns");
  const auto xb = x.reshape({-1, K}).contiguous();
  const int64_t rows = xb.size(0);
  auto y = at::empty({rows, N}, xb.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  auto* yp = y.data_ptr<c10::BFloat16>();
  // grain: at least ~256 KiB of weights per task, so small matrices do not pay for a second thread
  const int64_t grain = std::max<int64_t>(1, (256 << 10) / (4 * K * 2));
  at::parallel_for(0, N / 4, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint16_t* wt = wp + t * 4 * K;
      int64_t r = 0;
      for (; r + 4 <= rows; r += 4) tile16<4>(xp + r * K, K, wt, yp + r * N, N, t * 4);
      if (rows - r == 3) tile16<3>(xp + r * K, K, wt, yp + r * N, N, t * 4);
      if (rows - r == 2) tile16<2>(xp + r * K, K, wt, yp + r * N, N, t * 4);
      if (rows - r == 1) tile16<1>(xp + r * K, K, wt, yp + r * N, N, t * 4);
    }
  });
  auto shape = x.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

at::Tensor gemv16(const at::Tensor& x, const at::Tensor& w, bool dp) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.device().is_cpu(), "gemv16: w must be a contiguous CPU matrix");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kHalf, "gemv16: w must be bf16 or fp16");
  TORCH_CHECK(x.numel() == w.size(1), "gemv16: x must hold one row of ", w.size(1), " values");
  const auto xf = x.reshape({-1}).to(at::kFloat).contiguous();
  auto y = at::empty({w.size(0)}, xf.options());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  if (w.scalar_type() == at::kBFloat16 && x.scalar_type() == at::kBFloat16 && dp && __builtin_cpu_supports("avx512bf16")) {
    const auto xb = x.reshape({-1}).contiguous();
    const auto* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr());
    float* yp = y.data_ptr<float>();
    const int64_t N = w.size(0), K = w.size(1), blocks = N / 8, grain = std::max<int64_t>(1, (256 << 10) / (8 * K * 2));
    at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) block_dp<8>(xp, wp, yp, b * 8, K);
    });
    for (int64_t n = blocks * 8; n < N; ++n) block_dp<1>(xp, wp, yp, n, K);
  } else if (w.scalar_type() == at::kBFloat16) {
    gemv<true>(xf.data_ptr<float>(), wp, y.data_ptr<float>(), w.size(0), w.size(1));
  } else {
    gemv<false>(xf.data_ptr<float>(), wp, y.data_ptr<float>(), w.size(0), w.size(1));
  }
  return y.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY(quantbench, m) {
  m.def("gemv16(Tensor x, Tensor w, bool dp=True) -> Tensor");
  m.def("gemv8(Tensor x, Tensor q, Tensor scale) -> Tensor");
  m.def("gemv4(Tensor x, Tensor w, int gs) -> Tensor");
  m.def("gemv8t(Tensor x, Tensor w, Tensor scale) -> Tensor");
  m.def("gemv16t(Tensor x, Tensor w) -> Tensor");
}
TORCH_LIBRARY_IMPL(quantbench, CPU, m) {
  m.impl("gemv16", &gemv16);
  m.impl("gemv8", &gemv8);
  m.impl("gemv4", &gemv4);
  m.impl("gemv8t", &gemv8t);
  m.impl("gemv16t", &gemv16t);
}
// inference only: no gradient, and no warning when a caller holds weights that require one
TORCH_LIBRARY_IMPL(quantbench, Autograd, m) {
  m.impl("gemv16", torch::CppFunction::makeFallthrough());
  m.impl("gemv8", torch::CppFunction::makeFallthrough());
  m.impl("gemv4", torch::CppFunction::makeFallthrough());
  m.impl("gemv8t", torch::CppFunction::makeFallthrough());
  m.impl("gemv16t", torch::CppFunction::makeFallthrough());
}
