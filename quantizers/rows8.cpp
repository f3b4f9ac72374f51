// quantbench::gemv16(x[K], w[N,K]) -> y[N]: one row times a 16-bit (bf16 or fp16) weight matrix, fp32 accumulation,
// AVX-512. Built and loaded by quantizers/rows8.py (measure.gemv=rows8); that file's docstring says why it exists.
//
// Why 8 rows at a time: a batch-1 decode step is a memory stream, and one core streams only as fast as it keeps
// cache-line misses in flight. Reading 8 weight rows side by side (16 accumulators, each x vector loaded once per
// 8 rows) keeps 8 independent streams going per core; one row at a time (ATen's GEMV) keeps one. Measured on
// AMD EPYC family 25 model 17 (Zen 4), 2 threads, every Llama-3.2-1B matrix once, fp16: 8 rows 46.8 GB/s,
// 4 rows 38.9, 1 row 37.3, ATen 39.1 (benchmarks/cpu_kernels.py --one-row has the side-by-side rows).
#include <ATen/Parallel.h>
#include <cstring>
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
}
TORCH_LIBRARY_IMPL(quantbench, CPU, m) {
  m.impl("gemv16", &gemv16);
  m.impl("gemv8", &gemv8);
}
// inference only: no gradient, and no warning when a caller holds weights that require one
TORCH_LIBRARY_IMPL(quantbench, Autograd, m) {
  m.impl("gemv16", torch::CppFunction::makeFallthrough());
  m.impl("gemv8", torch::CppFunction::makeFallthrough());
}
