// Decode attention straight from the paged KV cache, with the log-sum-exp of every query head.
//
// The torch path gathers each sequence's keys and values into a contiguous copy per layer, transposes it for the
// flash kernel, and runs a kernel tiled for long query blocks on one query row per head. This reads the cache once:
// one task per (sequence, KV head) scores its group of query heads against the sequence's keys block by block,
// then sums the values weighted by the softmax. Built and loaded by pdserve/kernels/__init__.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "convert.h"
#include "ops.h"
#include "exp_nonpositive.h"

namespace {

using pdserve_kernels::exp_nonpositive;
using pdserve_kernels::from_f;
using pdserve_kernels::raw;
using pdserve_kernels::storage_t;
using pdserve_kernels::to_f;

// fp8 K/V: M mantissa bits (3: e4m3, bias 7; 2: e5m2, bias 15). The byte's sign, exponent and mantissa go into a
// float's bit positions, which reads as the value times 2^-(127 - bias); fp8_unbias<M> undoes that. Shifts, ors and
// a multiply: the compiler vectorises them on AVX2 and AVX-512 alike (no lookup-table gather).
template <int M>
constexpr float fp8_unbias = M == 3 ? 0x1p120f : 0x1p112f;

template <int M>
inline float fp8_to_f(uint8_t b) {
  const uint32_t u = (static_cast<uint32_t>(b & 0x80u) << 24) | (static_cast<uint32_t>(b & 0x7Fu) << (23 - M));
  return std::bit_cast<float>(u) * fp8_unbias<M>;
}

// How the kernel reads one token's head row of the cache: as float, converted once for the group's G query heads
// (a conversion costs more than the FMA), and the (block, KV head) scale that multiplies it.
template <typename T>
struct ModelDtypeRows {  // the cache in the model's dtype: no scale; float rows are read in place
  using E = storage_t<T>;
  static const float* row(const E* src, float* buf, int64_t D) {
    if constexpr (std::is_same_v<T, float>) {
      return src;
    } else {
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) buf[d] = to_f<T>(src[d]);
      return buf;
    }
  }
};

template <int M>
struct Fp8Rows {  // an 8-bit cache with one scale per (block, KV head) (pdserve/engine/kv_quant.py)
  using E = uint8_t;
  static const float* row(const E* src, float* buf, int64_t D) {
    int64_t d = 0;
#if defined(__AVX2__) && defined(__F16C__)
    // Through half precision: e5m2 is a half's high byte, e4m3 a half scaled by 2^-8. fp8 subnormals become half
    // subnormals, which vcvtph2ps converts at full speed; the float route above makes float subnormals, and every
    // multiply of one took a microcode assist (e4m3 decode attention 10-20% slower than bf16's).
    for (; d + 16 <= D; d += 16) {
      const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d)));
      __m256i h;
      if constexpr (M == 3)
        h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7),
                            _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8));
      else
        h = _mm256_slli_epi16(w, 8);
      const __m256 unbias = _mm256_set1_ps(M == 3 ? 0x1p8f : 1.f);
      _mm256_storeu_ps(buf + d, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), unbias));
      _mm256_storeu_ps(buf + d + 8, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), unbias));
    }
#endif
    for (; d < D; ++d) buf[d] = fp8_to_f<M>(src[d]);
    return buf;
  }
};

// A (sequence, KV head) task's query rows in and its outputs and LSE out, shared by both kernels below: the G
// query heads of KV head h are rows b * Hq + h * G + g of q, out and lse.
template <typename T>
struct GroupIO {
  using S = storage_t<T>;
  const S* q;
  S* out;
  float* lse;
  int64_t Hq, G, D;

  GroupIO(const at::Tensor& qt, at::Tensor& o, at::Tensor& l, int64_t groups)
      : q(raw(qt.data_ptr<T>())),
        out(raw(o.data_ptr<T>())),
        lse(l.data_ptr<float>()),
        Hq(qt.size(1)),
        G(groups),
        D(qt.size(2)) {}

  int64_t row(int64_t b, int64_t h, int64_t g) const { return b * Hq + h * G + g; }

  // Task `item` = (sequence b, KV head h), Hkv tasks per sequence: its keys [start, ctx) (the window's), with the
  // group's q rows loaded into qf times the softmax scale sc; or false, its outputs empty, where there are none.
  struct Task {
    int64_t b, h, start, ctx;
  };
  bool begin(int64_t item, int64_t Hkv, const int64_t* ctx_lens, int64_t window, float sc, float* qf,
             Task& t) const {
    t.b = item / Hkv, t.h = item % Hkv, t.ctx = ctx_lens[t.b];
    t.start = window > 0 ? std::max<int64_t>(0, t.ctx - window) : 0;
    if (t.ctx - t.start <= 0) {
      empty(t.b, t.h);
      return false;
    }
    load_q(t.b, t.h, sc, qf);
    return true;
  }

  // A rank that holds none of the sequence's keys contributes nothing: zeros, LSE -inf.
  void empty(int64_t b, int64_t h) const {
    for (int64_t g = 0; g < G; ++g) {
      S* o = out + row(b, h, g) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = from_f<T>(0.f);
      lse[row(b, h, g)] = -std::numeric_limits<float>::infinity();
    }
  }

  // qf [G, D]: the group's query rows as float, times the softmax scale.
  void load_q(int64_t b, int64_t h, float sc, float* qf) const {
    for (int64_t g = 0; g < G; ++g) {
      const S* qg = q + row(b, h, g) * D;
      for (int64_t d = 0; d < D; ++d) qf[g * D + d] = to_f<T>(qg[d]) * sc;
    }
  }

  // The value sums acc [G, D] over their softmax sums, and each head's LSE from its running max mx.
  void store(int64_t b, int64_t h, const float* acc, const float* mx, const float* sum) const {
    for (int64_t g = 0; g < G; ++g) {
      S* o = out + row(b, h, g) * D;
      const float inv = 1.f / sum[g];
      for (int64_t d = 0; d < D; ++d) o[d] = from_f<T>(acc[g * D + d] * inv);
      lse[row(b, h, g)] = mx[g] + std::log(sum[g]);
    }
  }
};

// HD > 0: the head size known at compile time (fully unrolled loops); 0: read from q. Rows: ModelDtypeRows or
// Fp8Rows. ks / vs: float32 [blocks, KV heads] scales, or null (scale 1). Scores are (q . k_row) * k_scale and the
// value sum weighs v_row by p * v_scale, so nothing is dequantised outside registers.
template <typename T, typename Rows, int64_t HD>
void decode_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const float* ksp, const float* vsp,
                   const at::Tensor& tables, const at::Tensor& ctx_lens, int64_t window, double scale, at::Tensor& out,
                   at::Tensor& lse) {
  const int64_t B = q.size(0), Hq = q.size(1), D = HD > 0 ? HD : q.size(2);
  const int64_t bs = k.size(1), Hkv = k.size(2);
  const int64_t G = Hq / Hkv, W = tables.size(1);
  using E = typename Rows::E;
  const GroupIO<T> io(q, out, lse, G);
  const E* kp = static_cast<const E*>(k.data_ptr());
  const E* vp = static_cast<const E*>(v.data_ptr());
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* cp = ctx_lens.data_ptr<int64_t>();
  const int64_t tok_stride = Hkv * D, blk_stride = bs * Hkv * D;
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), s, row_buf(D);
    for (int64_t item = begin; item < end; ++item) {
      typename GroupIO<T>::Task task;
      if (!io.begin(item, Hkv, cp, window, sc, qf.data(), task)) continue;
      const auto [b, h, start, ctx] = task;
      const int64_t n = ctx - start;
      s.resize(G * n);
      const int64_t* table = tp + b * W;
      std::vector<float> mx(G, -std::numeric_limits<float>::infinity());
      // Walk the keys block by block: no division per key (64-bit idiv costs tens of cycles).
      for (int64_t blk = start / bs, t = start; t < ctx; ++blk) {
        const int64_t stop = std::min(ctx, (blk + 1) * bs);
        const float kscale = ksp ? ksp[table[blk] * Hkv + h] : 1.f;
        const E* kt = kp + table[blk] * blk_stride + (t - blk * bs) * tok_stride + h * D;
        for (; t < stop; ++t, kt += tok_stride) {
          const float* __restrict__ row = Rows::row(kt, row_buf.data(), D);
          for (int64_t g = 0; g < G; ++g) {
            const float* qv = qf.data() + g * D;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qv[d] * row[d];
            dot *= kscale;
            s[g * n + (t - start)] = dot;
            mx[g] = std::max(mx[g], dot);
          }
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::vector<float> sum(G, 0.f);
      for (int64_t g = 0; g < G; ++g) {
        float* sg = s.data() + g * n;
        const float m = mx[g];
        float tot = 0.f;
#pragma omp simd reduction(+ : tot)
        for (int64_t i = 0; i < n; ++i) {
          sg[i] = exp_nonpositive(sg[i] - m);
          tot += sg[i];
        }
        sum[g] = tot;
      }
      for (int64_t blk = start / bs, t = start; t < ctx; ++blk) {
        const int64_t stop = std::min(ctx, (blk + 1) * bs);
        const float vscale = vsp ? vsp[table[blk] * Hkv + h] : 1.f;
        const E* vt = vp + table[blk] * blk_stride + (t - blk * bs) * tok_stride + h * D;
        for (; t < stop; ++t, vt += tok_stride) {
          const float* __restrict__ row = Rows::row(vt, row_buf.data(), D);
          for (int64_t g = 0; g < G; ++g) {
            const float p = s[g * n + (t - start)] * vscale;
            float* __restrict__ a = acc.data() + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += p * row[d];
          }
        }
      }
      io.store(b, h, acc.data(), mx.data(), sum.data());
    }
  });
}

// Wide rows for query groups of a multiple of 4 heads (MLA's heads over one latent row): one task per
// (sequence, KV head) walks the keys in chunks of CHUNK rows, scoring 4 heads x 3 rows and summing 4 heads x NV
// vectors of values in registers with a softmax kept online (running max and sum rescaled per chunk), so each row
// is converted once and read from L2 twice; the one-head-at-a-time loops above reload q or the sums per row.
using v8 = float __attribute__((vector_size(32)));

inline v8 load8(const float* p) {
  v8 x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

inline void store8(float* p, v8 x) { std::memcpy(p, &x, sizeof x); }

inline float hsum8(v8 x) {
  const float a = (x[0] + x[4]) + (x[1] + x[5]), b = (x[2] + x[6]) + (x[3] + x[7]);
  return a + b;
}

constexpr int64_t CHUNK = 64;

// s[g * CHUNK + i] = q_g . row_i for 4 heads (q rows of D floats) and R rows.
template <int R>
inline void score_tile(const float* q, int64_t D, const float* const* rows, float* s) {
  v8 a[4][R] = {};
  for (int64_t d = 0; d < D; d += 8) {
    v8 r[R];
    for (int i = 0; i < R; ++i) r[i] = load8(rows[i] + d);
    for (int g = 0; g < 4; ++g) {
      const v8 qv = load8(q + g * D + d);
      for (int i = 0; i < R; ++i) a[g][i] += qv * r[i];
    }
  }
  for (int g = 0; g < 4; ++g)
    for (int i = 0; i < R; ++i) s[g * CHUNK + i] = hsum8(a[g][i]);
}

// acc[g * D + d0 ..] += sum_i p[g * CHUNK + i] * row_i[d0 ..] for 4 heads and NV vectors of 8 columns.
template <int NV>
inline void value_tile(const float* p, int64_t n, const float* const* rows, int64_t d0, int64_t D, float* acc) {
  v8 a[4][NV];
  for (int g = 0; g < 4; ++g)
    for (int j = 0; j < NV; ++j) a[g][j] = load8(acc + g * D + d0 + 8 * j);
  for (int64_t i = 0; i < n; ++i) {
    v8 r[NV];
    for (int j = 0; j < NV; ++j) r[j] = load8(rows[i] + d0 + 8 * j);
    for (int g = 0; g < 4; ++g) {
      const float pg = p[g * CHUNK + i];
      for (int j = 0; j < NV; ++j) a[g][j] += pg * r[j];
    }
  }
  for (int g = 0; g < 4; ++g)
    for (int j = 0; j < NV; ++j) store8(acc + g * D + d0 + 8 * j, a[g][j]);
}

// Same contract as decode_kernel; needs G % 4 == 0 and D % 16 == 0 (tiled_fits adds where it wins).
template <typename T, typename Rows>
void decode_tiled(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const float* ksp, const float* vsp,
                  const at::Tensor& tables, const at::Tensor& ctx_lens, int64_t window, double scale, at::Tensor& out,
                  at::Tensor& lse) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t bs = k.size(1), Hkv = k.size(2);
  const int64_t G = Hq / Hkv, W = tables.size(1);
  using E = typename Rows::E;
  const GroupIO<T> io(q, out, lse, G);
  const E* kp = static_cast<const E*>(k.data_ptr());
  const E* vp = static_cast<const E*>(v.data_ptr());
  const bool shared_kv = kp == vp && ksp == vsp;  // MLA: K and V are the same latent rows
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* cp = ctx_lens.data_ptr<int64_t>();
  const int64_t tok_stride = Hkv * D, blk_stride = bs * Hkv * D;
  const float sc = static_cast<float>(scale);
  constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), s(G * CHUNK), kbuf(CHUNK * D), vbuf(CHUNK * D);
    std::vector<float> mx(G), sum(G), kscl(CHUNK), vscl(CHUNK);
    std::vector<const float*> krow(CHUNK), vrow(CHUNK);
    for (int64_t item = begin; item < end; ++item) {
      typename GroupIO<T>::Task task;
      if (!io.begin(item, Hkv, cp, window, sc, qf.data(), task)) continue;
      const auto [b, h, start, ctx] = task;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(mx.begin(), mx.end(), NEG_INF);
      std::fill(sum.begin(), sum.end(), 0.f);
      const int64_t* table = tp + b * W;
      for (int64_t c0 = start; c0 < ctx; c0 += CHUNK) {
        const int64_t n = std::min(CHUNK, ctx - c0);
        int64_t blk = c0 / bs, off = c0 - blk * bs;
        for (int64_t i = 0; i < n; ++i) {
          const int64_t at = table[blk] * blk_stride + off * tok_stride + h * D;
          krow[i] = Rows::row(kp + at, kbuf.data() + i * D, D);
          vrow[i] = shared_kv ? krow[i] : Rows::row(vp + at, vbuf.data() + i * D, D);
          kscl[i] = ksp ? ksp[table[blk] * Hkv + h] : 1.f;
          vscl[i] = vsp ? vsp[table[blk] * Hkv + h] : 1.f;
          if (++off == bs) off = 0, ++blk;
        }
        for (int64_t g = 0; g < G; g += 4) {
          const float* qg = qf.data() + g * D;
          float* sg = s.data() + g * CHUNK;
          int64_t i = 0;
          for (; i + 3 <= n; i += 3) score_tile<3>(qg, D, krow.data() + i, sg + i);
          for (; i < n; ++i) score_tile<1>(qg, D, krow.data() + i, sg + i);
        }
        for (int64_t g = 0; g < G; ++g) {
          float* sg = s.data() + g * CHUNK;
          float m = mx[g];
          for (int64_t i = 0; i < n; ++i) m = std::max(m, sg[i] *= kscl[i]);
          const float alpha = exp_nonpositive(mx[g] - m);  // exp(-inf) = 0 on the first chunk
          float tot = 0.f;
#pragma omp simd reduction(+ : tot)
          for (int64_t i = 0; i < n; ++i) {
            const float e = exp_nonpositive(sg[i] - m);
            tot += e;
            sg[i] = e * vscl[i];
          }
          sum[g] = sum[g] * alpha + tot;
          mx[g] = m;
          if (alpha != 1.f) {
            float* a = acc.data() + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
          }
        }
        const bool three = D % 24 == 0;
        for (int64_t g = 0; g < G; g += 4)
          for (int64_t d0 = 0; d0 < D; d0 += three ? 24 : 16) {
            if (three)
              value_tile<3>(s.data() + g * CHUNK, n, vrow.data(), d0, D, acc.data() + g * D);
            else
              value_tile<2>(s.data() + g * CHUNK, n, vrow.data(), d0, D, acc.data() + g * D);
          }
      }
      io.store(b, h, acc.data(), mx.data(), sum.data());
    }
  });
}

// One (sequence, KV head) task's K and V rows, fetched a chunk ahead of the chunk being converted: a task reads one
// head's slice of each token row of scattered blocks, a pattern the hardware prefetchers do not follow (2x on
// SmolLM2's heads at 8K keys; nothing on MLA's latent, whose whole rows stream: docs/performance.md "Attention").
template <typename E>
struct RowPrefetch {
  const E *k, *v;
  const int64_t* table;
  int64_t bs, blk_stride, tok_stride, col, elems, ctx, t, blk, off;

  RowPrefetch(const E* k_, const E* v_, const int64_t* table_, int64_t bs_, int64_t blk_stride_, int64_t tok_stride_,
              int64_t col_, int64_t elems_, int64_t ctx_, int64_t start)
      : k(k_), v(v_), table(table_), bs(bs_), blk_stride(blk_stride_), tok_stride(tok_stride_), col(col_),
        elems(elems_), ctx(ctx_), t(start), blk(start / bs_), off(start - start / bs_ * bs_) {}

  void next() {
    if (t >= ctx) return;
    const int64_t at = table[blk] * blk_stride + off * tok_stride + col;
    pdserve_kernels::prefetch_rows(k + at, elems);
    pdserve_kernels::prefetch_rows(v + at, elems);
    ++t;
    if (++off == bs) off = 0, ++blk;
  }
};

#if defined(__AVX2__) && defined(__FMA__)
// Heads of 64 or 128 columns (Llama-style GQA and MQA). The one-head loop (decode_kernel) sums each (head, row) dot
// to a scalar (a horizontal sum per dot) and converts every row twice; here one task per (sequence, KV head) walks
// the keys in chunks (64 rows of 64 columns: K and V converted once into L1), scores 8 rows per head at a time into
// one vector (8 accumulators, one transposing sum), keeps the softmax online, and sums values with the head's whole
// row of sums in registers.
inline __m256 sum8_each(const __m256* a) {  // [hsum(a[0]), ..., hsum(a[7])]
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

template <typename T, typename Rows, int64_t HD>
void decode_rows8(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const float* ksp, const float* vsp,
                  const at::Tensor& tables, const at::Tensor& ctx_lens, int64_t window, double scale, at::Tensor& out,
                  at::Tensor& lse) {
  constexpr int64_t NV = HD / 8, R = 4096 / HD;  // vectors per row; rows per chunk (16 KB of float per plane)
  const int64_t B = q.size(0), Hq = q.size(1);
  const int64_t bs = k.size(1), Hkv = k.size(2);
  const int64_t G = Hq / Hkv, W = tables.size(1);
  using E = typename Rows::E;
  const GroupIO<T> io(q, out, lse, G);
  const E* kp = static_cast<const E*>(k.data_ptr());
  const E* vp = static_cast<const E*>(v.data_ptr());
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* cp = ctx_lens.data_ptr<int64_t>();
  const int64_t tok_stride = Hkv * HD, blk_stride = bs * Hkv * HD;
  const float sc = static_cast<float>(scale);
  constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * HD), acc(G * HD), s(G * R), kbuf(R * HD), vbuf(R * HD);
    std::vector<float> mx(G), sum(G), alpha(G), kscl(R + 8), vscl(R);
    std::vector<const float*> krow(R + 8), vrow(R);
    for (int64_t item = begin; item < end; ++item) {
      typename GroupIO<T>::Task task;
      if (!io.begin(item, Hkv, cp, window, sc, qf.data(), task)) continue;
      const auto [b, h, start, ctx] = task;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(mx.begin(), mx.end(), NEG_INF);
      std::fill(sum.begin(), sum.end(), 0.f);
      const int64_t* table = tp + b * W;
      RowPrefetch<E> ahead{kp, vp, table, bs, blk_stride, tok_stride, h * HD, HD, ctx, start};
      for (int64_t i = 0; i < R; ++i) ahead.next();
      for (int64_t c0 = start; c0 < ctx; c0 += R) {
        const int64_t n = std::min(R, ctx - c0), n8 = (n + 7) / 8 * 8;
        int64_t blk = c0 / bs, off = c0 - blk * bs;
        for (int64_t i = 0; i < n; ++i) {
          ahead.next();
          const int64_t at = table[blk] * blk_stride + off * tok_stride + h * HD;
          krow[i] = Rows::row(kp + at, kbuf.data() + i * HD, HD);
          vrow[i] = Rows::row(vp + at, vbuf.data() + i * HD, HD);
          kscl[i] = ksp ? ksp[table[blk] * Hkv + h] : 1.f;
          vscl[i] = vsp ? vsp[table[blk] * Hkv + h] : 1.f;
          if (++off == bs) off = 0, ++blk;
        }
        for (int64_t i = n; i < n8; ++i) krow[i] = krow[0], kscl[i] = 0.f;  // a last partial 8: scored, not used
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * HD;
          float* sg = s.data() + g * R;
          __m256 m8 = _mm256_set1_ps(mx[g]);
          for (int64_t i = 0; i < n8; i += 8) {
            __m256 a[8];
            for (int r = 0; r < 8; ++r) a[r] = _mm256_mul_ps(_mm256_loadu_ps(qg), _mm256_loadu_ps(krow[i + r]));
            for (int64_t j = 1; j < NV; ++j) {
              const __m256 qv = _mm256_loadu_ps(qg + 8 * j);
              for (int r = 0; r < 8; ++r) a[r] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(krow[i + r] + 8 * j), a[r]);
            }
            const __m256 sv = _mm256_mul_ps(sum8_each(a), _mm256_loadu_ps(kscl.data() + i));
            _mm256_storeu_ps(sg + i, sv);
            if (i + 8 <= n) m8 = _mm256_max_ps(m8, sv);
          }
          float m = mx[g];
          for (int lane = 0; lane < 8; ++lane) m = std::max(m, m8[lane]);
          for (int64_t i = n / 8 * 8; i < n; ++i) m = std::max(m, sg[i]);
          alpha[g] = exp_nonpositive(mx[g] - m);  // exp(-inf) = 0 on the first chunk
          float tot = 0.f;
#pragma omp simd reduction(+ : tot)
          for (int64_t i = 0; i < n; ++i) {
            const float e = exp_nonpositive(sg[i] - m);
            tot += e;
            sg[i] = e * vscl[i];
          }
          sum[g] = sum[g] * alpha[g] + tot;
          mx[g] = m;
        }
        for (int64_t g = 0; g < G; ++g) {
          const float* pg = s.data() + g * R;
          float* ag = acc.data() + g * HD;
          const __m256 al = _mm256_set1_ps(alpha[g]);
          __m256 a[NV];
          for (int64_t j = 0; j < NV; ++j) a[j] = _mm256_mul_ps(_mm256_loadu_ps(ag + 8 * j), al);
          for (int64_t i = 0; i < n; ++i) {
            const __m256 p = _mm256_set1_ps(pg[i]);
            for (int64_t j = 0; j < NV; ++j) a[j] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vrow[i] + 8 * j), a[j]);
          }
          for (int64_t j = 0; j < NV; ++j) _mm256_storeu_ps(ag + 8 * j, a[j]);
        }
      }
      io.store(b, h, acc.data(), mx.data(), sum.data());
    }
  });
}
#endif

// Where the tiles win: rows wider than 128 columns (MLA's 576-wide latent), whose q and value sums outgrow L1, so
// the one-head loop reloads them for every row (2-2.5x slower). At 64 and 128 columns the 8-row loop above wins
// (docs/performance.md, "Attention").
inline bool tiled_fits(const at::Tensor& q, const at::Tensor& k) {
  return (q.size(1) / k.size(2)) % 4 == 0 && q.size(2) % 16 == 0 && q.size(2) > 128;
}

// The kernel for q's dtype and head size, reading the cache through Rows<scalar_t> (RowsOf maps q's dtype to it).
template <template <typename> class RowsOf>
void dispatch(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const float* ks, const float* vs,
              const at::Tensor& tables, const at::Tensor& ctx, int64_t window, double scale, at::Tensor& out,
              at::Tensor& lse) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    using Rows = RowsOf<scalar_t>;
    if (tiled_fits(q, k)) {
      decode_tiled<scalar_t, Rows>(q, k, v, ks, vs, tables, ctx, window, scale, out, lse);
      return;
    }
    switch (q.size(2)) {
#if defined(__AVX2__) && defined(__FMA__)
      case 64:
        decode_rows8<scalar_t, Rows, 64>(q, k, v, ks, vs, tables, ctx, window, scale, out, lse);
        break;
      case 128:
        decode_rows8<scalar_t, Rows, 128>(q, k, v, ks, vs, tables, ctx, window, scale, out, lse);
        break;
#else
      case 64:
        decode_kernel<scalar_t, Rows, 64>(q, k, v, ks, vs, tables, ctx, window, scale, out, lse);
        break;
      case 128:
        decode_kernel<scalar_t, Rows, 128>(q, k, v, ks, vs, tables, ctx, window, scale, out, lse);
        break;
#endif
      default:
        decode_kernel<scalar_t, Rows, 0>(q, k, v, ks, vs, tables, ctx, window, scale, out, lse);
    }
  });
}

template <typename T>
using E4m3Rows = Fp8Rows<3>;
template <typename T>
using E5m2Rows = Fp8Rows<2>;

std::tuple<at::Tensor, at::Tensor> paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                                          const at::Tensor& v_cache, const at::Tensor& block_tables,
                                                          const at::Tensor& context_lens, int64_t window,
                                                          double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && q.size(2) == k_cache.size(3), "q heads / head size mismatch");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(), "dtypes");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong, "int64 tables");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous caches");
  auto qc = q.contiguous();
  auto tables = block_tables.contiguous();
  auto ctx = context_lens.contiguous();
  auto out = at::empty_like(qc);
  auto lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  dispatch<ModelDtypeRows>(qc, k_cache, v_cache, nullptr, nullptr, tables, ctx, window, scale, out, lse);
  return {out, lse};
}

// k_cache / v_cache: the fp8 planes viewed as uint8 [blocks, bs, Hkv, D]; k_scales / v_scales float32 [blocks, Hkv];
// mantissa_bits 3 (e4m3) or 2 (e5m2).
std::tuple<at::Tensor, at::Tensor> paged_decode_attention_fp8(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k_scales,
    const at::Tensor& v_scales, const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t window,
    double scale, int64_t mantissa_bits) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && q.size(2) == k_cache.size(3), "q heads / head size mismatch");
  TORCH_CHECK(k_cache.scalar_type() == at::kByte && v_cache.scalar_type() == at::kByte, "fp8 caches as uint8");
  TORCH_CHECK(k_scales.scalar_type() == at::kFloat && v_scales.scalar_type() == at::kFloat, "float32 scales");
  TORCH_CHECK(k_scales.dim() == 2 && k_scales.size(0) == k_cache.size(0) && k_scales.size(1) == k_cache.size(2) &&
                  v_scales.sizes() == k_scales.sizes(),
              "scales must be [blocks, kv heads]");
  TORCH_CHECK(mantissa_bits == 3 || mantissa_bits == 2, "mantissa_bits: 3 (e4m3) or 2 (e5m2)");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong, "int64 tables");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous caches");
  auto qc = q.contiguous();
  auto ks = k_scales.contiguous(), vs = v_scales.contiguous();
  auto tables = block_tables.contiguous();
  auto ctx = context_lens.contiguous();
  auto out = at::empty_like(qc);
  auto lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  const float* ksp = ks.data_ptr<float>();
  const float* vsp = vs.data_ptr<float>();
  if (mantissa_bits == 3)
    dispatch<E4m3Rows>(qc, k_cache, v_cache, ksp, vsp, tables, ctx, window, scale, out, lse);
  else
    dispatch<E5m2Rows>(qc, k_cache, v_cache, ksp, vsp, tables, ctx, window, scale, out, lse);
  return {out, lse};
}

}  // namespace

namespace pdserve_kernels {  // the entry points for other kernels (ops.h)

std::tuple<at::Tensor, at::Tensor> paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                                          const at::Tensor& v_cache, const at::Tensor& block_tables,
                                                          const at::Tensor& context_lens, int64_t window,
                                                          double scale) {
  return ::paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, window, scale);
}

}  // namespace pdserve_kernels

TORCH_LIBRARY(pdserve, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
      "int window, float scale) -> (Tensor, Tensor)");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, TORCH_FN(paged_decode_attention));
  m.def(
      "paged_decode_attention_fp8(Tensor q, Tensor k_cache, Tensor v_cache, Tensor k_scales, Tensor v_scales, "
      "Tensor block_tables, Tensor context_lens, int window, float scale, int mantissa_bits) -> (Tensor, Tensor)");
  m.impl("paged_decode_attention_fp8", c10::DispatchKey::CPU, TORCH_FN(paged_decode_attention_fp8));
}
