// InfLLM v2 decode attention over a KV cache for the XLA CPU backend (an XLA FFI custom call).
//
// Spec minicpm4_model.md §5.5 (stage 2 `..._with_kvcache`) and §5.7 (cache layout). The reference is
// ops/decode_ref.py: sparse_decode_attention (same block set, same masking, fp32 online softmax); this
// kernel reads the selected blocks straight from the cache instead of gathering copies of them.
//
// Built at first use by ops/native/__init__.py (g++ -O3 -march=native), registered as the CPU targets
// "minicpm4_infllm_decode_f32" (out), "minicpm4_infllm_attention_lse_f32" (out and each head's logsumexp
// [batch, T, num_heads], -inf for none: the non-forced picks of a prefill's stage 2, merged with its dense
// forced part) and "minicpm4_infllm_select_decode_f32" (below). Layouts (row-major, float32 / int32):
//   q        [batch, T, num_heads, head_dim]
//   k_cache  [batch, num_kv_heads, capacity, head_dim]   (slot = token position)
//   v_cache  [batch, num_kv_heads, capacity, head_dim]
//   topk     [batch, num_kv_heads, T, K]   raw block picks; -1 (or any id outside [0, capacity/block_size))
//                                          = unused; no id repeated in a row
//   pos      [batch, T]                    the query's position; -1 = inactive row (zeros out)
//   out      [batch, T, num_heads, head_dim]
// Attributes: block_size, init_blocks, window_blocks, gather_width (non-forced picks kept: the smallest
// ids, as compact_topk), scale, window_keys (> 0: only the slots pos - window_keys + 1 .. pos, as the
// windowed dense_decode_attention).
// A query at position p in block qb = p / block_size attends, over the keys at slots <= p, the blocks
// [0, init_blocks), the window (qb - window_blocks, qb] (blocks >= init_blocks), and its picks that are
// valid and not forced (the gather_width smallest). window_blocks >= capacity / block_size with K = 0 is
// dense decoding; several tokens of a sequence decoded densely (a speculative verify chunk) attend as one group
// per KV head, each row masked after its own position, reading the cache once per group (DecodeCommon).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include <sched.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Geometry {
  int64_t block_size, init_blocks, window_blocks, gather_width;
  float scale;
  int64_t window_keys;  // > 0: attend only the slots pos - window_keys + 1 .. pos (a sliding-window decode)
  // Blocks prefetched ahead in software. A decode step walks whole caches on one or two threads and gains from
  // it (the tiny model's 32K dense step, 6 layers: 11.7 ms, against 13.7 ms prefetching only the head of the
  // next block); a prefill's stage 2 keeps both cores busy on many tokens, where the hardware prefetcher alone
  // was faster (8B layout, 8K tokens: 2.36 against 2.83 us per picked block).
  int64_t prefetch_blocks = 2;
};

// exp(x) for x <= 0 (softmax weights after the max is subtracted): Cody-Waite range reduction and a
// degree-6 polynomial on [-ln2/2, ln2/2], ~2 ulp; inputs below -87 give ~1e-38 instead of 0. Written
// branch-free so that GCC vectorises the loops that call it.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// GCC vector-extension types: L float / int32 lanes (one AVX-512 register for L = 16; any ISA compiles them).
template <int L>
struct Vec {
  typedef float F __attribute__((vector_size(4 * L)));
  typedef int32_t I __attribute__((vector_size(4 * L)));
};

template <int L>
inline typename Vec<L>::F vload(const float* p) {
  typename Vec<L>::F v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <int L>
inline void vstore(float* p, typename Vec<L>::F v) {
  std::memcpy(p, &v, sizeof(v));
}

// exp_nonpositive on L lanes (the same operations, lane by lane).
template <int L>
inline typename Vec<L>::F vexp_nonpositive(typename Vec<L>::F x) {
  using F = typename Vec<L>::F;
  using I = typename Vec<L>::I;
  x = x < -87.0f ? F{} - 87.0f : x;
  const F t = x * 1.44269504088896341f + 0.5f;
  F n = __builtin_convertvector(__builtin_convertvector(t, I), F);  // truncation ...
  n = n > t ? n - 1.0f : n;                                          // ... to floor
  const F r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  F p = F{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;
  F scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// The blocks one query attends, in the order init, window, picks. Returns the count.
int64_t block_list(const int32_t* picks, int64_t k, int64_t pos, int64_t num_blocks, const Geometry& geo,
                   int32_t* out, std::vector<int32_t>& scratch) {
  const int64_t qb = pos / geo.block_size;
  const int64_t init = std::min(geo.init_blocks, num_blocks);
  int64_t n = 0;
  for (int64_t j = 0; j < init && j <= qb; ++j) out[n++] = static_cast<int32_t>(j);
  const int64_t w_lo = std::max<int64_t>({qb - geo.window_blocks + 1, init, 0});
  for (int64_t j = w_lo; j <= qb && j < num_blocks; ++j) out[n++] = static_cast<int32_t>(j);
  scratch.clear();
  for (int64_t i = 0; i < k; ++i) {
    const int64_t j = picks[i];
    const bool forced = j < geo.init_blocks || (j > qb - geo.window_blocks && j <= qb);
    if (j >= 0 && j < num_blocks && !forced) scratch.push_back(static_cast<int32_t>(j));
  }
  if (static_cast<int64_t>(scratch.size()) > geo.gather_width) {  // compact_topk keeps the smallest ids
    std::nth_element(scratch.begin(), scratch.begin() + geo.gather_width, scratch.end());
    scratch.resize(geo.gather_width);
  }
  for (int32_t j : scratch) out[n++] = j;
  return n;
}

// Scratch of one worker thread.
struct Work {
  std::vector<float> acc, m, l, s, p, qt;
  std::vector<int32_t> list, picks, order;
  std::vector<float> z, score, pooled;
  std::vector<float> qg, og;            // dense_tokens: the group's query rows and outputs, [rows, head_dim]
  std::vector<int64_t> head_pos, tokens;
  std::vector<int32_t> lists, merged;   // grouped selection: each token's block list, their sorted union
  std::vector<int64_t> list_end;        // end of token j's list in `lists`
  std::vector<uint8_t> member;          // [union block, row]: 1 = the row's token attends the block
};

// Prefetch rows [r0, r1) of a block's keys and values (base pointers kb / vb, nullptr = none): spread over a
// block's key loop instead of one burst per block, so the prefetches never queue behind each other.
inline void prefetch_rows(const float* kb, const float* vb, int64_t r0, int64_t r1, int64_t d) {
  if (kb == nullptr) return;
  for (int64_t c = r0 * d; c < r1 * d; c += 16) {
    __builtin_prefetch(kb + c);
    __builtin_prefetch(vb + c);
  }
}

// Two-operand shuffle of 16-lane vectors with constant indices into the 32 lanes of (a, b): Clang and GCC >= 12
// have __builtin_shufflevector; older GCC (e.g. 11, Ubuntu 22.04's default) only __builtin_shuffle.
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12 && !defined(MINICPM4_GCC_SHUFFLE))
#define SHUFFLE16(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE16(a, b, ...) __builtin_shuffle(a, b, Vec<16>::I{__VA_ARGS__})
#endif

// Lane j of the result = the sum of v[j]'s 16 lanes: a 16 x 16 transpose-and-add in four levels of shuffles (lanes
// k and k + 8, then k and k + 4, k and k + 2, k and k + 1), the lanes left in bit-reversed row order and put back
// by one last shuffle. Every row is summed by the same tree whatever its index, so equal rows give equal sums.
inline Vec<16>::F hsum16x16(const Vec<16>::F* v) {
  using F = Vec<16>::F;
  F a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = SHUFFLE16(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           SHUFFLE16(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    b[i] = SHUFFLE16(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           SHUFFLE16(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    c[i] = SHUFFLE16(b[2 * i], b[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           SHUFFLE16(b[2 * i], b[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  const F d = SHUFFLE16(c[0], c[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
              SHUFFLE16(c[0], c[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  return SHUFFLE16(d, d, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}

// The 16-lane partial products of q . row (D floats, D a multiple of 16), accumulated in a fixed order.
template <int D>
inline Vec<16>::F row_partials(const Vec<16>::F* qv, const float* row) {
  Vec<16>::F a = qv[0] * vload<16>(row);
#pragma GCC unroll 8
  for (int c = 1; c < D / 16; ++c) a += qv[c] * vload<16>(row + 16 * c);
  return a;
}

// Lane r of the result = q . rows[r] for the m <= 16 rows of D floats (strided by `stride` floats; lanes r >= m
// are 0 and their rows are not read): row_partials, then hsum16x16. The dot products of the small groups
// (G <= 4) and of stage 1's compressed keys, where each (row, head) had been summed by a 16-step scalar chain.
// pk / pv (nullable): the rows of another block to prefetch, row r's lines after row r's products.
template <int D>
inline Vec<16>::F dot16(const float* q, const float* rows, int64_t stride, int64_t m, const float* pk = nullptr,
                        const float* pv = nullptr) {
  using F = Vec<16>::F;
  F qv[D / 16];
#pragma GCC unroll 8
  for (int c = 0; c < D / 16; ++c) qv[c] = vload<16>(q + 16 * c);
  F acc[16];
  if (m == 16) {
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) {
      acc[r] = row_partials<D>(qv, rows + r * stride);
      if (pk != nullptr) prefetch_rows(pk, pv, r, r + 1, D);
    }
  } else {
    for (int r = 0; r < 16; ++r) {
      acc[r] = r < m ? row_partials<D>(qv, rows + r * stride) : F{};
      if (pk != nullptr) prefetch_rows(pk, pv, r, r + 1, D);
    }
  }
  return hsum16x16(acc);
}

// Scores of one block, stored [key, head], scaled: G query heads (transposed, pre-scaled: qt [D, G]) against
// n key rows, vectorised over the heads, 4 keys at a time so each q column is loaded once per 4 keys.
template <int G, int D>
inline void scores_heads_inner(const float* qt, const float* kb, int64_t n, float* s, const float* pk,
                               const float* pv) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {  // eight independent accumulator chains hide the FMA latency
    prefetch_rows(pk, pv, i, i + 8, D);
    float a[8][G] = {};
    const float* k0 = kb + i * D;
    for (int e = 0; e < D; ++e) {
      const float* qe = qt + e * G;
#pragma GCC unroll 8
      for (int r = 0; r < 8; ++r) {
        const float kr = k0[r * D + e];
#pragma omp simd
        for (int h = 0; h < G; ++h) a[r][h] += qe[h] * kr;
      }
    }
    for (int r = 0; r < 8; ++r)
#pragma omp simd
      for (int h = 0; h < G; ++h) s[(i + r) * G + h] = a[r][h];
  }
  for (; i + 4 <= n; i += 4) {
    float a0[G] = {}, a1[G] = {}, a2[G] = {}, a3[G] = {};
    const float *k0 = kb + i * D, *k1 = k0 + D, *k2 = k1 + D, *k3 = k2 + D;
    for (int e = 0; e < D; ++e) {
      const float* qe = qt + e * G;
#pragma omp simd
      for (int h = 0; h < G; ++h) {
        a0[h] += qe[h] * k0[e];
        a1[h] += qe[h] * k1[e];
        a2[h] += qe[h] * k2[e];
        a3[h] += qe[h] * k3[e];
      }
    }
    for (int h = 0; h < G; ++h) {
      s[i * G + h] = a0[h];
      s[(i + 1) * G + h] = a1[h];
      s[(i + 2) * G + h] = a2[h];
      s[(i + 3) * G + h] = a3[h];
    }
  }
  for (; i < n; ++i) {
    float a0[G] = {};
    const float* k0 = kb + i * D;
    for (int e = 0; e < D; ++e) {
#pragma omp simd
      for (int h = 0; h < G; ++h) a0[h] += qt[e * G + h] * k0[e];
    }
    for (int h = 0; h < G; ++h) s[i * G + h] = a0[h];
  }
}

// Scores of one block, stored [key, head], scaled: one dot product over head_dim per (key, head).
inline void scores_dim_inner(const float* q, int64_t g, int64_t d, const float* kb, int64_t n, float scale,
                             float* s, const float* pk, const float* pv) {
  for (int64_t i = 0; i < n; ++i) {
    prefetch_rows(pk, pv, i, i + 1, d);
    const float* kr = kb + i * d;
    for (int64_t h = 0; h < g; ++h) {
      const float* qr = q + h * d;
      float a = 0.0f;
#pragma omp simd reduction(+ : a)
      for (int64_t e = 0; e < d; ++e) a += qr[e] * kr[e];
      s[i * g + h] = a * scale;
    }
  }
}

// acc = alpha * acc + sum_i p[i] * v[i] over one head's [head_dim] row; a compile-time D keeps the row in
// registers (D = 0: the runtime d, accumulated in place).
template <int D>
inline void accumulate(float* acc, int64_t d, float alpha, const float* p, const float* vb, int64_t n) {
  if constexpr (D > 0) {
    float a[D];
#pragma omp simd
    for (int e = 0; e < D; ++e) a[e] = acc[e] * alpha;
    for (int64_t i = 0; i < n; ++i) {
      const float pi = p[i];
      const float* vr = vb + i * D;
#pragma omp simd
      for (int e = 0; e < D; ++e) a[e] += pi * vr[e];
    }
#pragma omp simd
    for (int e = 0; e < D; ++e) acc[e] = a[e];
  } else {
#pragma omp simd
    for (int64_t e = 0; e < d; ++e) acc[e] *= alpha;
    for (int64_t i = 0; i < n; ++i) {
      const float pi = p[i];
      const float* vr = vb + i * d;
#pragma omp simd
      for (int64_t e = 0; e < d; ++e) acc[e] += pi * vr[e];
    }
  }
}

// Prefetch one block's keys and values (64-byte lines) while another is computed.
inline void prefetch_block(const float* kc, const float* vc, int64_t block, int64_t bs, int64_t d) {
  const int64_t first = block * bs * d;
  for (int64_t c = 0; c < bs * d; c += 16) {
    __builtin_prefetch(kc + first + c);
    __builtin_prefetch(vc + first + c);
  }
}

// Online-softmax update of G heads over one block's scores s [n, G] (one vector over the heads per key), then
// the value products two heads at a time: both heads' [D] accumulator rows stay in registers (2 x D / 16
// vectors) while each value row is loaded once per pair.
template <int G, int D>
inline void softmax_heads_inner(float* s, int64_t n, float* m, float* l, float* acc, const float* vb) {
  static_assert(G % 2 == 0 && D % 16 == 0, "heads two at a time, value rows in 16-lane vectors");
  using F = typename Vec<G>::F;
  const F m_old = vload<G>(m);
  F mx = m_old;
  for (int64_t i = 0; i < n; ++i) {
    const F x = vload<G>(s + i * G);
    mx = x > mx ? x : mx;
  }
  float alpha[G];
  for (int h = 0; h < G; ++h) alpha[h] = m[h] == -INFINITY ? 0.0f : std::exp(m[h] - mx[h]);
  const F base = mx == -INFINITY ? F{} : mx;  // 0 while a row has seen only masked (-inf) scores
  F sum = F{};
  for (int64_t i = 0; i < n; ++i) {
    const F x = vload<G>(s + i * G);
    F e = vexp_nonpositive<G>(x - base);
    e = x == -INFINITY ? F{} : e;  // masked keys weigh exactly 0
    vstore<G>(s + i * G, e);
    sum += e;
  }
  for (int h = 0; h < G; ++h) {
    l[h] = l[h] * alpha[h] + sum[h];
    m[h] = mx[h];
  }
  using W = typename Vec<16>::F;
  constexpr int C = D / 16;
  for (int h = 0; h < G; h += 2) {
    W a0[C], a1[C];
    float* r0 = acc + h * D;
    float* r1 = r0 + D;
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      a0[c] = vload<16>(r0 + 16 * c) * alpha[h];
      a1[c] = vload<16>(r1 + 16 * c) * alpha[h + 1];
    }
    for (int64_t i = 0; i < n; ++i) {
      const float p0 = s[i * G + h], p1 = s[i * G + h + 1];
      const float* vr = vb + i * D;
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        const W v = vload<16>(vr + 16 * c);
        a0[c] += p0 * v;
        a1[c] += p1 * v;
      }
    }
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      vstore<16>(r0 + 16 * c, a0[c]);
      vstore<16>(r1 + 16 * c, a1[c]);
    }
  }
}

// f(j, m, v) for the 16-lane chunks v of x[0 .. n) (m valid lanes; the last chunk padded with `pad`), so that every
// element goes through the same vector code whatever its index: equal inputs give equal outputs (ties between
// blocks stay ties).
template <typename Fn>
inline void for_chunks(const float* x, int64_t n, Fn f, float pad = 0.0f) {
  for (int64_t j = 0; j < n; j += 16) {
    const int64_t m = std::min<int64_t>(16, n - j);
    Vec<16>::F v;
    if (m == 16) {
      v = vload<16>(x + j);
    } else {
      float buf[16];
      for (int i = 0; i < 16; ++i) buf[i] = i < m ? x[j + i] : pad;
      v = vload<16>(buf);
    }
    f(j, m, v);
  }
}

// Small groups (G <= 4, the cpu_tiny / MiniCPM4-0.5B-like layouts): scores stored head-major s[h * bs + i], 16
// keys of one head per dot16 (the 16-lane partial products of a key row summed by one transposed reduction instead
// of one scalar chain per key and head); qs [G, D] the pre-scaled query rows.
template <int G, int D>
inline void scores_keys_inner(const float* qs, const float* kb, int64_t n, float* s, int64_t bs, const float* pk,
                              const float* pv) {
  for (int64_t i = 0; i < n; i += 16) {
    const int64_t m = std::min<int64_t>(16, n - i);
#pragma GCC unroll 4
    for (int h = 0; h < G; ++h) {  // the first head's pass prefetches the next block's rows i .. i + 15
      const float* pki = h == 0 && pk != nullptr ? pk + i * D : nullptr;
      const Vec<16>::F out = dot16<D>(qs + h * D, kb + i * D, D, m, pki, pki == nullptr ? nullptr : pv + i * D);
      if (m == 16) {
        vstore<16>(s + h * bs + i, out);
      } else {
        for (int64_t r = 0; r < m; ++r) s[h * bs + i + r] = out[r];
      }
    }
  }
}

// Online-softmax update of each head over its n scores s[h * bs + i] (16 keys per vector), then the value
// products one or two heads at a time, each value row loaded once per pair (as softmax_heads_inner).
template <int G, int D>
inline void softmax_keys_inner(float* s, int64_t bs, int64_t n, float* m, float* l, float* acc, const float* vb) {
  static_assert(G == 1 || G % 2 == 0, "heads one or two at a time");
  using F = Vec<16>::F;
  float alpha[G];
  for (int h = 0; h < G; ++h) {
    float* sh = s + h * bs;
    F mv = F{} - INFINITY;
    for_chunks(sh, n, [&](int64_t, int64_t, F v) { mv = v > mv ? v : mv; }, -INFINITY);
    float mx = m[h];
    for (int i = 0; i < 16; ++i) mx = std::max(mx, mv[i]);
    alpha[h] = m[h] == -INFINITY ? 0.0f : std::exp(m[h] - mx);
    const float base = mx == -INFINITY ? 0.0f : mx;  // 0 while a row has seen only masked (-inf) scores
    F sum = F{};
    for_chunks(
        sh, n,
        [&](int64_t j, int64_t cnt, F x) {
          F e = vexp_nonpositive<16>(x - base);
          e = x == -INFINITY ? F{} : e;  // masked keys (and the padding lanes) weigh exactly 0
          sum += e;
          if (cnt == 16) {
            vstore<16>(sh + j, e);
          } else {
            for (int64_t r = 0; r < cnt; ++r) sh[j + r] = e[r];
          }
        },
        -INFINITY);
    float total = 0.0f;
    for (int i = 0; i < 16; ++i) total += sum[i];
    l[h] = l[h] * alpha[h] + total;
    m[h] = mx;
  }
  constexpr int C = D / 16;
  constexpr int P = G == 1 ? 1 : 2;
  for (int h = 0; h < G; h += P) {
    F a0[C], a1[C];
    float* r0 = acc + h * D;
    float* r1 = r0 + D;
    const float* p0 = s + h * bs;
    const float* p1 = p0 + bs;
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      a0[c] = vload<16>(r0 + 16 * c) * alpha[h];
      if constexpr (P == 2) a1[c] = vload<16>(r1 + 16 * c) * alpha[h + 1];
    }
    for (int64_t i = 0; i < n; ++i) {
      const float* vr = vb + i * D;
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        const F v = vload<16>(vr + 16 * c);
        a0[c] += p0[i] * v;
        if constexpr (P == 2) a1[c] += p1[i] * v;
      }
    }
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      vstore<16>(r0 + 16 * c, a0[c]);
      if constexpr (P == 2) vstore<16>(r1 + 16 * c, a1[c]);
    }
  }
}

// One (sequence, KV head, token): the g query heads of the group over the listed blocks. G / D are the
// group size / head_dim when known at compile time (0 = use g / d).
template <int G, int D>
void attend(const float* q, int64_t g, int64_t d, const float* kc, const float* vc, const int32_t* blocks,
            int64_t nblk, int64_t pos, const Geometry& geo, float* out, float* lse, Work& w,
            const int64_t* head_pos, const uint8_t* member) {
  const int64_t bs = geo.block_size;
  w.acc.assign(g * d, 0.0f);
  w.m.assign(g, -INFINITY);
  w.l.assign(g, 0.0f);
  w.s.resize(g * bs);
  w.p.resize(bs);
  constexpr bool kSmall = G > 0 && G <= 4 && D > 0;  // head-major scores (scores_keys_inner)
  if (G) {
    w.qt.resize(d * g);
    for (int64_t h = 0; h < g; ++h)
      for (int64_t e = 0; e < d; ++e) w.qt[kSmall ? h * d + e : e * g + h] = q[h * d + e] * geo.scale;
  }
  float* acc = w.acc.data();
  float* s = w.s.data();
  float* p = w.p.data();
  for (int64_t j = 0; j < std::min(nblk, geo.prefetch_blocks); ++j) prefetch_block(kc, vc, blocks[j], bs, d);
  const int64_t min_slot = geo.window_keys > 0 ? pos - geo.window_keys + 1 : 0;
  int64_t head_min = pos;
  if (head_pos != nullptr)
    for (int64_t h = 0; h < g; ++h) head_min = std::min(head_min, head_pos[h]);
  for (int64_t j = 0; j < nblk; ++j) {
    const int64_t first = static_cast<int64_t>(blocks[j]) * bs;
    const int64_t lo = std::max(first, min_slot);
    const int64_t n = std::min<int64_t>(first + bs, pos + 1) - lo;  // keys of the block at slots min_slot .. pos
    if (n <= 0) continue;
    const float* kb = kc + lo * d;
    const float* vb = vc + lo * d;
    const float *pk = nullptr, *pv = nullptr;  // the block prefetch_blocks ahead, fetched during the scores
    if (geo.prefetch_blocks > 0 && j + geo.prefetch_blocks < nblk) {
      pk = kc + static_cast<int64_t>(blocks[j + geo.prefetch_blocks]) * bs * d;
      pv = vc + (pk - kc);
    }
    if constexpr (kSmall) {
      scores_keys_inner<G, D>(w.qt.data(), kb, n, s, bs, pk, pv);
      prefetch_rows(pk, pv, (n + 15) / 16 * 16, bs, d);  // rows the 16-key chunks did not cover
    } else if constexpr (G > 0 && D > 0) {
      scores_heads_inner<G, D>(w.qt.data(), kb, n, s, pk, pv);
      prefetch_rows(pk, pv, n - n % 8, bs, d);  // rows the 8-key chunks did not cover
    } else {
      scores_dim_inner(q, g, d, kb, n, geo.scale, s, pk, pv);
      prefetch_rows(pk, pv, n, bs, d);
    }
    if (head_pos != nullptr && lo + n - 1 > head_min)  // rows of earlier tokens: mask the slots after theirs
      for (int64_t i = 0; i < n; ++i)
        for (int64_t h = 0; h < g; ++h)
          if (lo + i > head_pos[h]) s[kSmall ? h * bs + i : i * g + h] = -INFINITY;
    if (member != nullptr)  // rows whose token did not select this block
      for (int64_t h = 0; h < g; ++h)
        if (member[j * g + h] == 0)
          for (int64_t i = 0; i < n; ++i) s[kSmall ? h * bs + i : i * g + h] = -INFINITY;
    if constexpr (kSmall) {
      softmax_keys_inner<G, D>(s, bs, n, w.m.data(), w.l.data(), acc, vb);
    } else if constexpr (G > 0 && D > 0) {
      softmax_heads_inner<G, D>(s, n, w.m.data(), w.l.data(), acc, vb);
    } else {
      for (int64_t h = 0; h < g; ++h) {
        float mx = w.m[h];
        for (int64_t i = 0; i < n; ++i) mx = std::max(mx, s[i * g + h]);
        if (mx == -INFINITY) continue;  // every slot of the block masked for this row (head_pos)
        const float alpha = w.m[h] == -INFINITY ? 0.0f : std::exp(w.m[h] - mx);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; ++i) {
          const float x = s[i * g + h];
          p[i] = x == -INFINITY ? 0.0f : exp_nonpositive(x - mx);  // masked slots weigh exactly 0
          sum += p[i];
        }
        w.l[h] = w.l[h] * alpha + sum;
        w.m[h] = mx;
        accumulate<D>(acc + h * d, d, alpha, p, vb, n);
      }
    }
  }
  for (int64_t h = 0; h < g; ++h) {
    const float inv = w.l[h] > 0.0f ? 1.0f / w.l[h] : 0.0f;
    for (int64_t e = 0; e < d; ++e) out[h * d + e] = acc[h * d + e] * inv;
    if (lse != nullptr) lse[h] = w.l[h] > 0.0f ? w.m[h] + std::log(w.l[h]) : -INFINITY;
  }
}

// head_pos (nullable) [g]: each head's own last visible slot (<= pos), for the
// rows of several tokens attended as one group (dense_tokens); nullptr = every head sees the slots up to pos.
// member (nullable) [nblk, g]: 0 = the row does not attend that block (the grouped sparse rows of a verify chunk).
using AttendFn = void (*)(const float*, int64_t, int64_t, const float*, const float*, const int32_t*, int64_t,
                          int64_t, const Geometry&, float*, float*, Work&, const int64_t*, const uint8_t*);

// Specialisations: scores over heads for groups of 8 / 16 (the MiniCPM4-8B layout), compile-time
// head_dim 64 / 128 for the value products; anything else runs the generic loops.
AttendFn pick_attend(int64_t g, int64_t d) {
  if (d == 128) {
    if (g == 16) return attend<16, 128>;
    if (g == 8) return attend<8, 128>;
    if (g == 4) return attend<4, 128>;
    if (g == 2) return attend<2, 128>;
    if (g == 1) return attend<1, 128>;
    return attend<0, 128>;
  }
  if (d == 64) {
    if (g == 16) return attend<16, 64>;
    if (g == 8) return attend<8, 64>;
    if (g == 4) return attend<4, 64>;
    if (g == 2) return attend<2, 64>;
    if (g == 1) return attend<1, 64>;
    return attend<0, 64>;
  }
  return attend<0, 0>;
}

// ---------------------------------------------------------------------------------------------- selection
// InfLLM v2 stage 1 + pooling + top-k of one (sequence, KV head, token), the clean causal rule (spec §5.2-§5.4;
// reference minicpm4_jax/infllm/select.py: stage1_scores, pool_block_scores, topk_blocks, whose docstrings
// give each rule).

struct SelectGeometry {
  int64_t kernel_size, kernel_stride, coarse_size, coarse_stride, block_size, init_blocks, local_blocks, topk_cfg;
  int64_t variant;  // 1 = gen-1 (exact softmax over fine kernels), 2 = gen-2 (LSE from coarse kernels)
  float scale;
};

inline int64_t floor_div(int64_t a, int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

// Kernels visible at position pos (kernel j ends at st*j + ks - 1 <= pos), clipped to [0, n].
inline int64_t visible_kernels(int64_t pos, int64_t ks, int64_t st, int64_t n) {
  return std::clamp<int64_t>(floor_div(pos + 1 - ks, st) + 1, 0, n);
}

// z[h * ld + j] = scale * q_h . ck[j] for the g heads of q ([g, d]) and j < count (ck rows strided by
// row_stride floats): one pass over the rows, each row read once for all heads, a few rows prefetched ahead.
// D > 0 (head_dim 64 / 128): 16 rows at a time per head (dot16); D = 0: one dot product per (row, head).
template <int D>
void group_logits(const float* q, int64_t g, int64_t d, const float* ck, int64_t row_stride, int64_t count,
                  float scale, float* z, int64_t ld) {
  if constexpr (D > 0) {
    constexpr int64_t kAhead = 32;  // rows prefetched ahead: two chunks
    for (int64_t j = 0; j < count; j += 16) {
      const int64_t m = std::min<int64_t>(16, count - j);
      for (int64_t r = j + kAhead; r < std::min(j + kAhead + 16, count); ++r) {
        const char* next = reinterpret_cast<const char*>(ck + r * row_stride);
        for (int64_t o = 0; o < D * 4; o += 64) __builtin_prefetch(next + o);
      }
      for (int64_t h = 0; h < g; ++h) {
        const Vec<16>::F out = dot16<D>(q + h * D, ck + j * row_stride, row_stride, m) * scale;
        if (m == 16) {
          vstore<16>(z + h * ld + j, out);
        } else {
          for (int64_t i = 0; i < m; ++i) z[h * ld + j + i] = out[i];
        }
      }
    }
    return;
  }
  constexpr int64_t kAhead = 8;
  for (int64_t j = 0; j < count; ++j) {
    if (j + kAhead < count) {
      const char* next = reinterpret_cast<const char*>(ck + (j + kAhead) * row_stride);
      for (int64_t o = 0; o < d * 4; o += 64) __builtin_prefetch(next + o);
    }
    const float* c = ck + j * row_stride;
    for (int64_t h = 0; h < g; ++h) {
      const float* qh = q + h * d;
      float a = 0.0f;
#pragma omp simd reduction(+ : a)
      for (int64_t e = 0; e < d; ++e) a += qh[e] * c[e];
      z[h * ld + j] = a * scale;
    }
  }
}

// exp(x) on 16 lanes: the polynomial of vexp_nonpositive where it is valid (-87 <= x <= 88), std::exp on
// any other lane (underflow to subnormals / 0, overflow to inf, NaN), so extreme inputs give what the
// library exp gives.
inline Vec<16>::F vexp_any(Vec<16>::F x) {
  Vec<16>::F y = vexp_nonpositive<16>(x);
  const Vec<16>::I ok = (x >= -87.0f) & (x <= 88.0f);
  bool all = true;
  for (int i = 0; i < 16; ++i) all = all && ok[i];
  if (!all)
    for (int i = 0; i < 16; ++i)
      if (!ok[i]) y[i] = std::exp(x[i]);
  return y;
}

// log-sum-exp of z[0 .. count) (-inf for none or a non-positive sum).
float log_sum_exp(const float* z, int64_t count) {
  float mx = -INFINITY;
  for (int64_t j = 0; j < count; ++j) mx = std::max(mx, z[j]);
  if (count == 0) return -INFINITY;
  Vec<16>::F acc = Vec<16>::F{};
  for_chunks(z, count, [&](int64_t, int64_t m, Vec<16>::F v) {
    Vec<16>::F e = vexp_nonpositive<16>(v - mx);
    for (int64_t i = m; i < 16; ++i) e[i] = 0.0f;
    acc += e;
  });
  float sum = 0.0f;
  for (int i = 0; i < 16; ++i) sum += acc[i];
  return sum > 0.0f ? std::log(sum) + mx : -INFINITY;
}

// Writes the row's topk_idx (valid ids ascending, then -1, topk_cfg entries) and returns the valid count.
int64_t select_blocks(const float* q, int64_t g, int64_t d, const float* ck1, int64_t nc1, const float* ck2,
                      int64_t nc2, int64_t row_stride, int64_t pos, int64_t num_blocks, const SelectGeometry& sg,
                      int32_t* topk, Work& w) {
  std::fill(topk, topk + sg.topk_cfg, -1);
  if (pos < 0) return 0;
  const int64_t cnt1 = visible_kernels(pos, sg.kernel_size, sg.kernel_stride, nc1);
  const int64_t cnt2 = sg.variant == 2 ? visible_kernels(pos, sg.coarse_size, sg.coarse_stride, nc2) : 0;
  w.score.assign(nc1, 0.0f);  // invisible kernels score exactly 0
  w.z.resize(g * std::max<int64_t>(nc1, nc2));
  float* z = w.z.data();
  w.m.resize(g);  // each head's log-sum-exp
  const auto logits = d == 64 ? group_logits<64> : d == 128 ? group_logits<128> : group_logits<0>;
  if (sg.variant == 2) {  // gen-2: the LSE over the coarse kernels
    logits(q, g, d, ck2, row_stride, cnt2, sg.scale, z, cnt2);
    for (int64_t h = 0; h < g; ++h) w.m[h] = log_sum_exp(z + h * cnt2, cnt2);
  }
  logits(q, g, d, ck1, row_stride, cnt1, sg.scale, z, cnt1);
  if (sg.variant != 2)
    for (int64_t h = 0; h < g; ++h) w.m[h] = log_sum_exp(z + h * cnt1, cnt1);
  float* score = w.score.data();
  for (int64_t h = 0; h < g; ++h) {  // lse = -inf -> +inf (§5.2)
    const float lse = w.m[h];
    for_chunks(z + h * cnt1, cnt1, [&](int64_t j, int64_t m, Vec<16>::F v) {
      const Vec<16>::F e = vexp_any(v - lse);
      for (int64_t i = 0; i < m; ++i) score[j + i] += e[i];
    });
  }
  // max-pool: block b takes kernels [r*b - lo, r*b + r - 1] (every kernel overlapping it), -inf if none
  const int64_t r = sg.block_size / sg.kernel_stride, lo = (sg.kernel_size - 1) / sg.kernel_stride;
  const int64_t qb = floor_div(pos, sg.block_size);
  w.pooled.resize(num_blocks);
  for (int64_t b = 0; b < num_blocks; ++b) {
    float m = -INFINITY;
    const int64_t j1 = std::min(r * b + r - 1, nc1 - 1);
    for (int64_t j = std::max<int64_t>(r * b - lo, 0); j <= j1; ++j) m = std::max(m, w.score[j]);
    m = std::min(m, std::numeric_limits<float>::max());  // forced blocks win every tie
    const bool init = b < sg.init_blocks;
    if (sg.variant == 2) {
      if (init || (b >= qb - sg.local_blocks && b <= qb)) m = INFINITY;
    } else if (init) {
      m = INFINITY;
    } else if (b > qb - sg.local_blocks && b <= qb) {
      m = -INFINITY;
    }
    w.pooled[b] = m;
  }
  // top-k, ties to the lower block index (lax.top_k), then invalidation and ascending order
  const int64_t k = std::min(sg.topk_cfg, num_blocks);
  w.order.resize(num_blocks);
  for (int64_t b = 0; b < num_blocks; ++b) w.order[b] = static_cast<int32_t>(b);
  const float* pooled = w.pooled.data();
  // the k best under a strict total order (score descending, then index): the same set as a full sort's
  // first k, in any order (the kept ids are sorted below)
  if (k < num_blocks)
    std::nth_element(w.order.begin(), w.order.begin() + k, w.order.end(), [pooled](int32_t a, int32_t b) {
      return pooled[a] > pooled[b] || (pooled[a] == pooled[b] && a < b);
    });
  int64_t n = 0;
  for (int64_t i = 0; i < k; ++i) {
    const int32_t b = w.order[i];
    const bool late = sg.variant == 2 ? b > qb : b >= qb;
    if (!late && pooled[b] != -INFINITY) topk[n++] = b;
  }
  std::sort(topk, topk + n);
  return n;
}

// One parallel_for call: items claimed by index; the caller waits until every claimed item is finished.
struct Job {
  std::function<void(int64_t, Work&)> run;
  int64_t items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> finished{0};
  Job(std::function<void(int64_t, Work&)> r, int64_t n) : run(std::move(r)), items(n) {}
};

inline void work_on(Job& job, Work& w) {
  for (int64_t i; (i = job.next.fetch_add(1)) < job.items;) {
    job.run(i, w);
    job.finished.fetch_add(1, std::memory_order_release);
  }
}

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The latest multi-threaded call, for a lingering helper. Waking a parked pool thread took ~0.1 ms on the
// development VM, and a batch-1 decode step calls the kernel every 0.2-0.5 ms (one call per layer, the
// layer's matrix products between), so the caller worked alone for the first ~0.1 ms of each call (the
// tiny model's 32K sparse step: 0.30 ms per call, the helper starting 0.10 ms in). Instead, the pool thread
// that helped a call stays for linger_ns (MINICPM4_JAX_NATIVE_LINGER_US, default 1000; 0 = never) and takes
// the items of any call posted meanwhile, spinning on sched_yield so that any other runnable thread (XLA's
// own work) gets the core first. At most one helper lingers: batch-1 decode splits into one item per KV
// head, and the other pool threads stay free for XLA.
struct Mailbox {
  std::mutex mu;
  std::shared_ptr<Job> job;      // the call in progress (reset by its caller at the end)
  std::atomic<int64_t> seq{0};   // bumped at each post
  std::atomic<int64_t> lingering{0};
  int64_t linger_ns = 0;
};

Mailbox& mailbox() {
  static Mailbox* mb = [] {
    auto* m = new Mailbox;  // never destroyed: a lingering pool thread may still read it while the process exits
    const char* env = std::getenv("MINICPM4_JAX_NATIVE_LINGER_US");
    m->linger_ns = env != nullptr && env[0] != '\0' ? std::max<int64_t>(0, std::atoll(env)) * 1000 : 1000000;
    return m;
  }();
  return *mb;
}

// Called by a pool thread after its items: serve posted calls until none came for linger_ns.
void linger(Mailbox& mb, Work& w) {
  if (mb.linger_ns <= 0 || mb.lingering.fetch_add(1) >= 1) {
    if (mb.linger_ns > 0) mb.lingering.fetch_sub(1);
    return;
  }
  int64_t seen = -1;
  int64_t deadline = now_ns() + mb.linger_ns;
  while (true) {
    const int64_t s = mb.seq.load(std::memory_order_acquire);
    if (s != seen) {
      seen = s;
      std::shared_ptr<Job> job;
      {
        std::lock_guard<std::mutex> lock(mb.mu);
        job = mb.job;
      }
      if (job && job->next.load(std::memory_order_relaxed) < job->items) {
        work_on(*job, w);
        deadline = now_ns() + mb.linger_ns;
        continue;
      }
    }
    if (now_ns() > deadline) break;
    sched_yield();
  }
  mb.lingering.fetch_sub(1);
  // a call posted just before the decrement counted on this helper and scheduled none: serve it
  std::shared_ptr<Job> job;
  {
    std::lock_guard<std::mutex> lock(mb.mu);
    job = mb.job;
  }
  if (job) work_on(*job, w);
}

// run(item, work) for item in [0, items) on the caller and up to num_threads - 1 pool threads (a lingering
// helper counts as one). Helpers claim items until none is left; the caller works too and then waits only for
// claimed items, so a helper that starts late (a busy pool) finds nothing to do and never blocks the call, and
// a call whose helper is serving another call's items (several devices' calls at once) finishes alone.
template <typename F>
void parallel_for(ffi::ThreadPool& pool, int64_t items, int64_t cache_floats, const F& run) {
  // a call that reads little of the cache (e.g. a 4-token verify at a short context) runs on the caller:
  // waking a pool thread costs more than the work
  const bool small = cache_floats < (int64_t{1} << 18);
  const int64_t threads = small ? 1 : std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), items));
  if (threads <= 1) {
    Work w;
    for (int64_t i = 0; i < items; ++i) run(i, w);
    return;
  }
  Mailbox& mb = mailbox();
  auto job = std::make_shared<Job>(run, items);
  {
    std::lock_guard<std::mutex> lock(mb.mu);
    mb.job = job;
  }
  mb.seq.fetch_add(1, std::memory_order_release);
  const int64_t helpers = threads - 1 - std::min<int64_t>(threads - 1, mb.lingering.load());
  for (int64_t i = 0; i < helpers; ++i)
    pool.Schedule([job, &mb]() {
      Work w;
      work_on(*job, w);
      linger(mb, w);
    });
  Work w;
  work_on(*job, w);
  while (job->finished.load(std::memory_order_acquire) < items) {
  }
  std::lock_guard<std::mutex> lock(mb.mu);
  if (mb.job == job) mb.job.reset();
}

// The active tokens w.tokens (ascending) of sequence bi for KV head h, attended as one group: the g query heads of
// each token become rows of one attend call, each row masked after its own position (and, with member [nblk,
// rows], to its own token's blocks), so the listed blocks are read once for all of them. q / out: [batch, t, nq,
// d]; positions [batch, t]; max_pos: the latest active position.
void attend_token_group(const float* qp, const int32_t* pp, float* op, int64_t bi, int64_t h, int64_t t, int64_t nq,
                        int64_t g, int64_t d, const float* kc, const float* vc, const int32_t* blocks, int64_t nblk,
                        int64_t max_pos, const Geometry& geo, const uint8_t* member, Work& w) {
  const int64_t ntok = static_cast<int64_t>(w.tokens.size()), rows = ntok * g;
  w.qg.resize(rows * d);
  w.og.resize(rows * d);
  w.head_pos.resize(rows);
  for (int64_t j = 0; j < ntok; ++j) {
    const int64_t ti = w.tokens[j];
    std::memcpy(w.qg.data() + j * g * d, qp + ((bi * t + ti) * nq + h * g) * d, sizeof(float) * g * d);
    std::fill(w.head_pos.begin() + j * g, w.head_pos.begin() + (j + 1) * g, pp[bi * t + ti]);
  }
  pick_attend(rows, d)(w.qg.data(), rows, d, kc, vc, blocks, nblk, max_pos, geo, w.og.data(), nullptr, w,
                       w.head_pos.data(), member);
  for (int64_t j = 0; j < ntok; ++j)
    std::memcpy(op + ((bi * t + w.tokens[j]) * nq + h * g) * d, w.og.data() + j * g * d, sizeof(float) * g * d);
}

// Stage 2 of every (sequence, KV head, token); lse (nullable) [batch, T, num_heads] receives each head's
// logsumexp over its attended keys (-inf for none), for merging with another part of the attention.
ffi::Error DecodeCommon(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_cache,
                        ffi::Buffer<ffi::F32> v_cache, ffi::Buffer<ffi::S32> topk, ffi::Buffer<ffi::S32> positions,
                        float* op, float* lp, int64_t block_size, int64_t init_blocks, int64_t window_blocks,
                        int64_t gather_width, float scale, int64_t window_keys) {
  const auto qd = q.dimensions();
  const auto kd = k_cache.dimensions();
  const auto td = topk.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || td.size() != 4 || positions.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("minicpm4_infllm_decode_f32: expected q/k/v/topk rank 4, positions rank 2");
  const int64_t b = qd[0], t = qd[1], nq = qd[2], d = qd[3], nkv = kd[1], cap = kd[2], kk = td[3];
  if (kd[0] != b || kd[3] != d || nkv <= 0 || nq % nkv != 0 || td[0] != b || td[1] != nkv || td[2] != t ||
      block_size <= 0 || cap % block_size != 0 || gather_width < 0 || init_blocks < 0 || window_blocks < 0 ||
      window_keys < 0)
    return ffi::Error::InvalidArgument("minicpm4_infllm_decode_f32: inconsistent shapes or attributes");
  const int64_t g = nq / nkv, nb = cap / block_size;
  // the logsumexp target serves prefill stage 2 (see Geometry::prefetch_blocks)
  const Geometry geo{block_size, init_blocks, window_blocks, gather_width, scale, window_keys, lp == nullptr ? 2 : 0};
  const float* qp = q.typed_data();
  const float* kp = k_cache.typed_data();
  const float* vp = v_cache.typed_data();
  const int32_t* tp = topk.typed_data();
  const int32_t* pp = positions.typed_data();
  const int64_t items = b * nkv * t;
  const int64_t max_list = std::min(init_blocks, nb) + std::min(window_blocks, nb) + kk;
  const AttendFn attend_fn = pick_attend(g, d);

  auto run = [=](int64_t it, Work& w) {
    const int64_t ti = it % t, h = (it / t) % nkv, bi = it / (t * nkv);
    const int64_t pos = pp[bi * t + ti];
    const int64_t qoff = ((bi * t + ti) * nq + h * g) * d;
    float* lse = lp == nullptr ? nullptr : lp + (bi * t + ti) * nq + h * g;
    if (pos < 0) {
      std::memset(op + qoff, 0, sizeof(float) * g * d);
      if (lse != nullptr) std::fill(lse, lse + g, -INFINITY);
      return;
    }
    w.list.resize(max_list);
    const int64_t n = block_list(tp + ((bi * nkv + h) * t + ti) * kk, kk, pos, nb, geo, w.list.data(), w.picks);
    const int64_t kvoff = (bi * nkv + h) * cap * d;
    attend_fn(qp + qoff, g, d, kp + kvoff, vp + kvoff, w.list.data(), n, pos, geo, op + qoff, lse, w, nullptr,
              nullptr);
  };

  // Dense decoding of several tokens per sequence (a speculative verify chunk): the active tokens of one
  // (sequence, KV head) attend as one group of tokens x heads query rows, each row masked after its own
  // position, so the cache blocks are read once for all of them instead of once per token.
  // (window_blocks >= nb: every block up to a token's own is in its window, so picks add nothing; a pick after
  // the token's block has no visible slot in the per-token path either)
  const bool dense_tokens = t > 1 && window_keys == 0 && window_blocks >= nb && lp == nullptr;
  auto run_tokens = [=](int64_t it, Work& w) {
    const int64_t h = it % nkv, bi = it / nkv;
    w.tokens.clear();
    int64_t max_pos = -1;
    for (int64_t ti = 0; ti < t; ++ti) {
      const int64_t pos = pp[bi * t + ti];
      if (pos < 0) {
        std::memset(op + ((bi * t + ti) * nq + h * g) * d, 0, sizeof(float) * g * d);
      } else {
        w.tokens.push_back(ti);
        max_pos = std::max(max_pos, pos);
      }
    }
    if (w.tokens.empty()) return;
    w.list.resize(max_list);
    const int64_t n = block_list(tp, 0, max_pos, nb, geo, w.list.data(), w.picks);
    const int64_t kvoff = (bi * nkv + h) * cap * d;
    attend_token_group(qp, pp, op, bi, h, t, nq, g, d, kp + kvoff, vp + kvoff, w.list.data(), n, max_pos, geo, nullptr,
                       w);
  };

  int64_t cache_floats = 0;  // cache values the call can read: visible slots per item, K and V
  for (int64_t i = 0; i < b * t; ++i) cache_floats += 2 * nkv * d * std::max<int64_t>(0, std::min<int64_t>(pp[i] + 1, cap));
  if (dense_tokens)
    parallel_for(pool, b * nkv, cache_floats / t, run_tokens);
  else
    parallel_for(pool, items, cache_floats, run);
  return ffi::Error::Success();
}

ffi::Error DecodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_cache,
                      ffi::Buffer<ffi::F32> v_cache, ffi::Buffer<ffi::S32> topk, ffi::Buffer<ffi::S32> positions,
                      ffi::ResultBuffer<ffi::F32> out, int64_t block_size, int64_t init_blocks,
                      int64_t window_blocks, int64_t gather_width, float scale, int64_t window_keys) {
  return DecodeCommon(pool, q, k_cache, v_cache, topk, positions, out->typed_data(), nullptr, block_size,
                      init_blocks, window_blocks, gather_width, scale, window_keys);
}

ffi::Error DecodeLseImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_cache,
                         ffi::Buffer<ffi::F32> v_cache, ffi::Buffer<ffi::S32> topk, ffi::Buffer<ffi::S32> positions,
                         ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse, int64_t block_size,
                         int64_t init_blocks, int64_t window_blocks, int64_t gather_width, float scale,
                         int64_t window_keys) {
  const auto qd = q.dimensions();
  const auto ld = lse->dimensions();
  if (qd.size() != 4 || ld.size() != 3 || ld[0] != qd[0] || ld[1] != qd[1] || ld[2] != qd[2])
    return ffi::Error::InvalidArgument("minicpm4_infllm_attention_lse_f32: lse must be [batch, T, num_heads]");
  return DecodeCommon(pool, q, k_cache, v_cache, topk, positions, out->typed_data(), lse->typed_data(), block_size,
                      init_blocks, window_blocks, gather_width, scale, window_keys);
}


// Selection and attention of decode queries in one call: the row's topk_idx (also returned) feeds stage 2.
ffi::Error SelectDecodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> q_sel,
                            ffi::Buffer<ffi::F32> k_cache, ffi::Buffer<ffi::F32> v_cache, ffi::Buffer<ffi::F32> ck1,
                            ffi::Buffer<ffi::F32> ck2, ffi::Buffer<ffi::S32> positions,
                            ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::S32> topk_out,
                            int64_t block_size, int64_t kernel_size, int64_t kernel_stride, int64_t coarse_size,
                            int64_t coarse_stride, int64_t sel_init_blocks, int64_t local_blocks, int64_t topk_cfg,
                            int64_t variant, float sel_scale, int64_t init_blocks, int64_t window_blocks,
                            int64_t gather_width, float scale) {
  const auto qd = q.dimensions();
  const auto kd = k_cache.dimensions();
  const auto c1 = ck1.dimensions();
  const auto c2 = ck2.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || c1.size() != 4 || c2.size() != 4 || positions.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("minicpm4_infllm_select_decode_f32: bad ranks");
  const int64_t b = qd[0], t = qd[1], nq = qd[2], d = qd[3], nkv = kd[1], cap = kd[2];
  if (kd[0] != b || kd[3] != d || nkv <= 0 || nq % nkv != 0 || c1[0] != b || c1[2] != nkv || c1[3] != d ||
      c2[0] != b || c2[2] != nkv || c2[3] != d || block_size <= 0 || cap % block_size != 0 || kernel_stride <= 0 ||
      coarse_stride <= 0 || block_size % kernel_stride != 0 || kernel_size <= 0 || coarse_size <= 0 ||
      topk_cfg <= 0 || (variant != 1 && variant != 2) || sel_init_blocks < 0 || local_blocks < 0 ||
      init_blocks < 0 || window_blocks < 0 || gather_width < 0)
    return ffi::Error::InvalidArgument("minicpm4_infllm_select_decode_f32: inconsistent shapes or attributes");
  const int64_t g = nq / nkv, nb = cap / block_size, nc1 = c1[1], nc2 = c2[1];
  const SelectGeometry sg{kernel_size, kernel_stride, coarse_size, coarse_stride, block_size, sel_init_blocks,
                          local_blocks, topk_cfg, variant, sel_scale};
  const Geometry geo{block_size, init_blocks, window_blocks, gather_width, scale, 0};
  const float* qp = q.typed_data();
  const float* qsp = q_sel.typed_data();
  const float* kp = k_cache.typed_data();
  const float* vp = v_cache.typed_data();
  const float* c1p = ck1.typed_data();
  const float* c2p = ck2.typed_data();
  const int32_t* pp = positions.typed_data();
  float* op = out->typed_data();
  int32_t* tp = topk_out->typed_data();
  const int64_t max_list = std::min(init_blocks, nb) + std::min(window_blocks, nb) + topk_cfg;
  const AttendFn attend_fn = pick_attend(g, d);
  // Selection of token ti of sequence bi for KV head h (its topk_idx row written); returns the length of its
  // block list in w.list, or -1 for an inactive row (its output zeroed).
  auto select_token = [=](int64_t bi, int64_t h, int64_t ti, Work& w) -> int64_t {
    const int64_t pos = pp[bi * t + ti];
    const int64_t qoff = ((bi * t + ti) * nq + h * g) * d;
    int32_t* row = tp + ((bi * nkv + h) * t + ti) * topk_cfg;
    select_blocks(qsp + qoff, g, d, c1p + (bi * nc1 * nkv + h) * d, nc1, c2p + (bi * nc2 * nkv + h) * d, nc2,
                  nkv * d, pos, nb, sg, row, w);
    if (pos < 0) {
      std::memset(op + qoff, 0, sizeof(float) * g * d);
      return -1;
    }
    w.list.resize(max_list);
    return block_list(row, topk_cfg, pos, nb, geo, w.list.data(), w.picks);
  };
  auto run = [=](int64_t it, Work& w) {
    const int64_t ti = it % t, h = (it / t) % nkv, bi = it / (t * nkv);
    const int64_t n = select_token(bi, h, ti, w);
    if (n < 0) return;
    const int64_t qoff = ((bi * t + ti) * nq + h * g) * d;
    const int64_t kvoff = (bi * nkv + h) * cap * d;
    attend_fn(qp + qoff, g, d, kp + kvoff, vp + kvoff, w.list.data(), n, pp[bi * t + ti], geo, op + qoff, nullptr,
              w, nullptr, nullptr);
  };
  // Several tokens of a sequence (a speculative verify chunk): each token's selection as above, then one pass over
  // the union of their blocks for all tokens x heads rows, each row masked to its own token's blocks and slots,
  // so that a block picked by several tokens (the window, most picks) is read once instead of once per token.
  auto run_tokens = [=](int64_t it, Work& w) {
    const int64_t h = it % nkv, bi = it / nkv;
    w.tokens.clear();
    w.lists.clear();
    w.list_end.clear();
    int64_t max_pos = -1;
    for (int64_t ti = 0; ti < t; ++ti) {
      const int64_t n = select_token(bi, h, ti, w);
      if (n < 0) continue;
      w.lists.insert(w.lists.end(), w.list.begin(), w.list.begin() + n);
      w.list_end.push_back(static_cast<int64_t>(w.lists.size()));
      w.tokens.push_back(ti);
      max_pos = std::max<int64_t>(max_pos, pp[bi * t + ti]);
    }
    if (w.tokens.empty()) return;
    w.merged.assign(w.lists.begin(), w.lists.end());
    std::sort(w.merged.begin(), w.merged.end());
    w.merged.erase(std::unique(w.merged.begin(), w.merged.end()), w.merged.end());
    const int64_t ntok = static_cast<int64_t>(w.tokens.size()), rows = ntok * g;
    const int64_t nu = static_cast<int64_t>(w.merged.size());
    w.member.assign(nu * rows, 0);
    for (int64_t j = 0, start = 0; j < ntok; start = w.list_end[j++])
      for (int64_t e = start; e < w.list_end[j]; ++e) {
        const int64_t u = std::lower_bound(w.merged.begin(), w.merged.end(), w.lists[e]) - w.merged.begin();
        std::fill(w.member.begin() + u * rows + j * g, w.member.begin() + u * rows + (j + 1) * g, 1);
      }
    const int64_t kvoff = (bi * nkv + h) * cap * d;
    attend_token_group(qp, pp, op, bi, h, t, nq, g, d, kp + kvoff, vp + kvoff, w.merged.data(), nu, max_pos, geo,
                       w.member.data(), w);
  };
  int64_t cache_floats = 0;  // compressed keys and the selected blocks, K and V, per item
  for (int64_t i = 0; i < b * t; ++i)
    if (pp[i] >= 0)
      cache_floats += nkv * d * (nc1 + nc2 + 2 * block_size * std::min(max_list, pp[i] / block_size + 1));
  if (t > 1)
    parallel_for(pool, b * nkv, cache_floats, run_tokens);
  else
    parallel_for(pool, b * nkv * t, cache_floats, run);
  return ffi::Error::Success();
}

}  // namespace

namespace {

// The operands and attributes both stage-2 targets share (DecodeImpl, DecodeLseImpl): thread pool, q, k/v
// caches, picks and positions first; their results next; the block geometry last.
template <typename B>
auto decode_operands(B binding) {
  return std::move(binding).template Ctx<ffi::ThreadPool>()
      .template Arg<ffi::Buffer<ffi::F32>>()   // q
      .template Arg<ffi::Buffer<ffi::F32>>()   // k_cache
      .template Arg<ffi::Buffer<ffi::F32>>()   // v_cache
      .template Arg<ffi::Buffer<ffi::S32>>()   // topk
      .template Arg<ffi::Buffer<ffi::S32>>()   // positions
      .template Ret<ffi::Buffer<ffi::F32>>();  // out
}

template <typename B>
auto decode_attributes(B binding) {
  return std::move(binding).template Attr<int64_t>("block_size")
      .template Attr<int64_t>("init_blocks")
      .template Attr<int64_t>("window_blocks")
      .template Attr<int64_t>("gather_width")
      .template Attr<float>("scale")
      .template Attr<int64_t>("window_keys");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Minicpm4InfllmDecodeF32, DecodeImpl,
                              decode_attributes(decode_operands(ffi::Ffi::Bind())));

XLA_FFI_DEFINE_HANDLER_SYMBOL(Minicpm4InfllmAttentionLseF32, DecodeLseImpl,
                              decode_attributes(decode_operands(ffi::Ffi::Bind())
                                                    .Ret<ffi::Buffer<ffi::F32>>()));  // lse [batch, T, num_heads]

XLA_FFI_DEFINE_HANDLER_SYMBOL(Minicpm4InfllmSelectDecodeF32, SelectDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q_sel
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_cache
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_cache
                                  .Arg<ffi::Buffer<ffi::F32>>()  // ck1 [batch, Nc1, kv_heads, head_dim]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // ck2 [batch, Nc2, kv_heads, head_dim]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Ret<ffi::Buffer<ffi::S32>>()  // topk_idx [batch, kv_heads, T, topk_cfg]
                                  .Attr<int64_t>("block_size")
                                  .Attr<int64_t>("kernel_size")
                                  .Attr<int64_t>("kernel_stride")
                                  .Attr<int64_t>("coarse_size")
                                  .Attr<int64_t>("coarse_stride")
                                  .Attr<int64_t>("sel_init_blocks")
                                  .Attr<int64_t>("local_blocks")
                                  .Attr<int64_t>("topk_cfg")
                                  .Attr<int64_t>("variant")
                                  .Attr<float>("sel_scale")
                                  .Attr<int64_t>("init_blocks")
                                  .Attr<int64_t>("window_blocks")
                                  .Attr<int64_t>("gather_width")
                                  .Attr<float>("scale"));
