// Row-exact CPU tree attention: a query's output does not depend on which of its keys sit in the
// committed prefix and which in the tree, nor on how many other queries share the call.
//
// Why: a token accepted from a tree verify saw its earlier tokens as tree keys; the same token in a
// plain decode step sees them as prefix keys. The tiled kernel (tree_attention.cpp) groups keys
// into GEMM tiles and merges online-softmax states per tile, so the two see different rounding, and
// a bf16 greedy path can part from plain decoding at a near-tie. Here every query row follows one
// fixed sequence over its visible keys, taken in the order plain decoding stores the same tokens in
// (the prefix, then its ancestors and itself) and numbered c = 0, 1, ... in that order:
//   score_c = sum over d, in order, of fmadd(q_d * scale, k_cd)   (keys across SIMD lanes, never d)
//   m = max_c score_c;  p_c = exp(score_c - m)   (one vector exp routine for every key)
//   l = sum over lanes, in order, of (sum over c = lane mod 8, in order, of p_c)
//   o = sum over c, in order, of fmadd(p_c, v_c);  out = o / l
// Keys a row cannot see are left out by position, never by value. The tiled kernel
// still serves prefills (prefix 0), where both decoding modes run the same call. The score, exp
// and P.V loops run 16 lanes wide on CPUs with AVX512F, else 8 (at::vec, AVX2): the same bits
// either way (POSS_ATTENTION_LANES=8 forces 8; tests compare the two).
#include "tree_attention_exact.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "poss/tree_attention.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define POSS_EXACT_AVX512 1
#define POSS_AVX512F __attribute__((target("avx512f")))
#endif

namespace poss {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();  // keys per score vector (at::vec, 8 on AVX2)
constexpr int64_t W16 = 16;         // keys per score vector on AVX512F
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Unit {
  const ExactRequest* rq;
  int64_t h;       // kv head
  int32_t i0, i1;  // query nodes
};

// Scores of `rows` query rows (stride D) against the L keys of kt, which holds them in tiles of W
// keys transposed to [D, W] (kt: [ceil(L / W), D, W], zero past L), into out (row stride ld). A
// block of R rows x T tiles keeps R x T independent accumulators, so the fused multiply-adds of one
// lane, which depend on each other, overlap with the other lanes' (one row against one tile alone
// waits on the FMA latency at every d); a lane's arithmetic is still one fmadd per d, in order.
template <int R, int T>
void scores_block(const float* qs, int64_t D, const float* kt, int64_t t0, int64_t L, float* out, int64_t ld) {
  Vec acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = Vec(0.0f);
  const float* base = kt + t0 * D * W;
  for (int64_t d = 0; d < D; ++d) {
    Vec kv[T];
    for (int t = 0; t < T; ++t) kv[t] = Vec::loadu(base + (t * D + d) * W);
    for (int r = 0; r < R; ++r) {
      const Vec qv(qs[r * D + d]);
      for (int t = 0; t < T; ++t) acc[r][t] = at::vec::fmadd(qv, kv[t], acc[r][t]);
    }
  }
  for (int t = 0; t < T; ++t) {
    const int64_t s0 = (t0 + t) * W, kn = std::min(W, L - s0);
    for (int r = 0; r < R; ++r) acc[r][t].store(out + r * ld + s0, static_cast<int>(kn));
  }
}

// Rows of R against every tile, T tiles at a time, then the last tiles one by one.
template <int R, int T>
void scores_rows(const float* qs, int64_t D, const float* kt, int64_t L, float* out, int64_t ld) {
  const int64_t tiles = (L + W - 1) / W;
  int64_t t = 0;
  for (; t + T <= tiles; t += T) scores_block<R, T>(qs, D, kt, t, L, out, ld);
  for (; t < tiles; ++t) scores_block<R, 1>(qs, D, kt, t, L, out, ld);
}

// Every row against every tile: rows in threes (3 x 4 accumulators, 4 key vectors and a query
// broadcast fit the 16 AVX2 registers), the last one or two alone.
void scores8(const float* qs, int64_t rows, int64_t D, const float* kt, int64_t L, float* out, int64_t ld) {
  int64_t r = 0;
  for (; r + 3 <= rows; r += 3) scores_rows<3, 4>(qs + r * D, D, kt, L, out + r * ld, ld);
  for (; r < rows; ++r) scores_rows<1, 4>(qs + r * D, D, kt, L, out + r * ld, ld);
}

#ifdef __AVX2__
// dst[i * ld + c] = src[c * sd + i] for an 8 x 8 block of fp32 (rows of src become columns).
inline void transpose8x8(const float* src, int64_t sd, float* dst, int64_t ld) {
  __m256 r[8], t[8];
  for (int c = 0; c < 8; ++c) r[c] = _mm256_loadu_ps(src + c * sd);
  for (int c = 0; c < 8; c += 2) {
    t[c] = _mm256_unpacklo_ps(r[c], r[c + 1]);
    t[c + 1] = _mm256_unpackhi_ps(r[c], r[c + 1]);
  }
  for (int c = 0; c < 8; c += 4) {
    r[c] = _mm256_shuffle_ps(t[c], t[c + 2], 0x44);
    r[c + 1] = _mm256_shuffle_ps(t[c], t[c + 2], 0xEE);
    r[c + 2] = _mm256_shuffle_ps(t[c + 1], t[c + 3], 0x44);
    r[c + 3] = _mm256_shuffle_ps(t[c + 1], t[c + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    _mm256_storeu_ps(dst + c * ld, _mm256_permute2f128_ps(r[c], r[c + 4], 0x20));
    _mm256_storeu_ps(dst + (c + 4) * ld, _mm256_permute2f128_ps(r[c], r[c + 4], 0x31));
  }
}
#endif

// kt[t, d, c] = key t * width + c's element d as fp32, for the L keys at kb (row stride ks) and 0 past
// them: the keys of a tile become the lanes of a score vector. Eight keys at a time are widened
// into `widened` and turned with 8 x 8 block transposes (key by key, the strided scalar stores had
// cost more than the scores themselves).
template <typename scalar_t>
void transpose_keys(const scalar_t* kb, int64_t ks, int64_t L, int64_t D, int64_t width, float* kt,
                    std::vector<float>& widened) {
  widened.resize(8 * D);
  const int64_t tiles = (L + width - 1) / width;
  std::fill(kt + (tiles - 1) * D * width, kt + tiles * D * width, 0.0f);
  int64_t j = 0;
#ifdef __AVX2__
  if (D % 8 == 0) {
    for (; j + 8 <= L && (j % width) + 8 <= width; j += 8) {
      for (int c = 0; c < 8; ++c) at::vec::convert(kb + (j + c) * ks, widened.data() + c * D, D);
      float* dst = kt + (j / width) * D * width + j % width;
      for (int64_t d = 0; d < D; d += 8) transpose8x8(widened.data() + d, D, dst + d * width, width);
    }
  }
#endif
  for (; j < L; ++j) {
    at::vec::convert(kb + j * ks, widened.data(), D);
    float* dst = kt + (j / width) * D * width + j % width;
    for (int64_t d = 0; d < D; ++d) dst[d * width] = widened[d];
  }
}

// o_r[d0 : d0 + V * W] += sum over keys j < n, in order, of fmadd(p_r[j], v[j, d0 : d0 + V * W]) for R
// rows at once (v: row stride D). R x V accumulators: each output lane is a chain of dependent
// fused multiply-adds, one per key, and one row alone (8 chains for D = 64) waits on their latency;
// 3 rows x 4 vectors overlap 12 chains while sharing each v load. A lane's arithmetic is one fmadd
// per key in order, whichever block its row falls in.
template <int R, int V>
void pv_block(const float* const* p, int64_t n, const float* v, int64_t D, int64_t d0, float* const* o) {
  Vec acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < V; ++k) acc[r][k] = Vec::loadu(o[r] + d0 + k * W);
  for (int64_t j = 0; j < n; ++j) {
    Vec pr[R];
    for (int r = 0; r < R; ++r) pr[r] = Vec(p[r][j]);
    const float* vj = v + j * D + d0;
    for (int k = 0; k < V; ++k) {
      const Vec vv = Vec::loadu(vj + k * W);
      for (int r = 0; r < R; ++r) acc[r][k] = at::vec::fmadd(pr[r], vv, acc[r][k]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < V; ++k) acc[r][k].store(o[r] + d0 + k * W);
}

// pv_block over all of D: four vectors at a time, then one, then the lanes past the last vector.
template <int R>
void pv_rows(const float* const* p, int64_t n, const float* v, int64_t D, float* const* o) {
  int64_t d0 = 0;
  for (; d0 + 4 * W <= D; d0 += 4 * W) pv_block<R, 4>(p, n, v, D, d0, o);
  for (; d0 + W <= D; d0 += W) pv_block<R, 1>(p, n, v, D, d0, o);
  for (; d0 < D; ++d0)
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < n; ++j) o[r][d0] = std::fma(p[r][j], v[j * D + d0], o[r][d0]);
}

// The prefix part of o for every row: rows of p (row stride ld) against the first n rows of v
// (stride D), accumulated into o (stride D), three rows at a time (AVX2 registers), then one by one.
void prefix_pv8(const float* p, int64_t ld, int64_t rows, int64_t n, const float* v, int64_t D, float* o) {
  int64_t r = 0;
  for (; r + 3 <= rows; r += 3) {
    const float* pr[3] = {p + r * ld, p + (r + 1) * ld, p + (r + 2) * ld};
    float* orow[3] = {o + r * D, o + (r + 1) * D, o + (r + 2) * D};
    pv_rows<3>(pr, n, v, D, orow);
  }
  for (; r < rows; ++r) {
    const float* pr[1] = {p + r * ld};
    float* orow[1] = {o + r * D};
    pv_rows<1>(pr, n, v, D, orow);
  }
}

// The sum of p[0:n] in W lane-wise partial sums (lane c mod W, each in order of c), then over the
// lanes in order: the same bits for the same n values, whatever row or call they belong to.
float lane_sum(const float* p, int64_t n) {
  Vec acc(0.0f);
  int64_t j = 0;
  for (; j + W <= n; j += W) acc = acc + Vec::loadu(p + j);
  if (j < n) acc = acc + Vec::loadu(p + j, static_cast<int>(n - j));  // the missing lanes add +0
  alignas(64) float lanes[W];
  acc.store(lanes);
  float l = 0.0f;
  for (int64_t c = 0; c < W; ++c) l += lanes[c];
  return l;
}

// The largest of s[0:n] (exact in any order).
float row_max(const float* s, int64_t n) {
  Vec mv(kNegInf);
  int64_t j = 0;
  for (; j + W <= n; j += W) mv = at::vec::maximum(mv, Vec::loadu(s + j));
  alignas(64) float lanes[W];
  mv.store(lanes);
  float m = kNegInf;
  for (int64_t c = 0; c < W; ++c) m = std::max(m, lanes[c]);
  for (; j < n; ++j) m = std::max(m, s[j]);
  return m;
}

#ifdef POSS_EXACT_AVX512
// The score loop with 16-lane vectors, on CPUs with AVX512F. A lane's arithmetic is the 8-lane
// loop's (one fused multiply-add per d, in the same order), so both give the same bits and the
// choice is only a matter of speed.

// R query rows (stride D) against T tiles of 16 keys (kt: [T, D, 16]) into out (row stride ld, T * 16
// columns). R x T independent accumulators hide the fused multiply-add latency (one row against one
// tile waits on it at every d); each lane is still one fmadd per d, in order.
template <int R, int T>
POSS_AVX512F inline void scores16_block(const float* q, int64_t D, const float* kt, float* out, int64_t ld) {
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m512 kv[T];
    for (int t = 0; t < T; ++t) kv[t] = _mm512_loadu_ps(kt + (t * D + d) * W16);
    for (int r = 0; r < R; ++r) {
      const __m512 qv = _mm512_set1_ps(q[r * D + d]);
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_fmadd_ps(qv, kv[t], acc[r][t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) _mm512_storeu_ps(out + r * ld + t * W16, acc[r][t]);
}

// R rows against all `tiles` tiles: about twelve accumulators a block (two FMA pipes of four cycles'
// latency need eight chains in flight), then the last tiles one by one.
template <int R>
POSS_AVX512F void scores16_rows(const float* q, int64_t D, const float* kt, int64_t tiles, float* out, int64_t ld) {
  constexpr int T = (12 + R - 1) / R;
  int64_t t = 0;
  for (; t + T <= tiles; t += T) scores16_block<R, T>(q, D, kt + t * D * W16, out + t * W16, ld);
  for (; t < tiles; ++t) scores16_block<R, 1>(q, D, kt + t * D * W16, out + t * W16, ld);
}

// Scores of `rows` query rows (stride D) against all `tiles` tiles of kt ([tiles, D, 16], zero past
// the last key) into out (row stride ld >= tiles * 16): rows in fours, then the last one to three.
POSS_AVX512F void scores16(const float* qs, int64_t rows, int64_t D, const float* kt, int64_t tiles, float* out,
                           int64_t ld) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) scores16_rows<4>(qs + r * D, D, kt, tiles, out + r * ld, ld);
  const float* q = qs + r * D;
  float* o = out + r * ld;
  switch (rows - r) {
    case 3: scores16_rows<3>(q, D, kt, tiles, o, ld); break;
    case 2: scores16_rows<2>(q, D, kt, tiles, o, ld); break;
    case 1: scores16_rows<1>(q, D, kt, tiles, o, ld); break;
    default: break;
  }
}

// pv_block with 16-lane vectors, R rows x V vectors (the same fmadd per key and lane, in order).
template <int R, int V>
POSS_AVX512F inline void pv16_block(const float* const* p, int64_t n, const float* v, int64_t D, int64_t d0,
                                    float* const* o) {
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < V; ++k) acc[r][k] = _mm512_loadu_ps(o[r] + d0 + k * W16);
  for (int64_t j = 0; j < n; ++j) {
    __m512 vv[V];
    const float* vj = v + j * D + d0;
    for (int k = 0; k < V; ++k) vv[k] = _mm512_loadu_ps(vj + k * W16);
    for (int r = 0; r < R; ++r) {
      const __m512 pr = _mm512_set1_ps(p[r][j]);
      for (int k = 0; k < V; ++k) acc[r][k] = _mm512_fmadd_ps(pr, vv[k], acc[r][k]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < V; ++k) _mm512_storeu_ps(o[r] + d0 + k * W16, acc[r][k]);
}

// pv16_block over all of D (a multiple of 16): four vectors at a time, then one.
template <int R>
POSS_AVX512F void pv16_rows(const float* const* p, int64_t n, const float* v, int64_t D, float* const* o) {
  int64_t d0 = 0;
  for (; d0 + 4 * W16 <= D; d0 += 4 * W16) pv16_block<R, 4>(p, n, v, D, d0, o);
  for (; d0 + W16 <= D; d0 += W16) pv16_block<R, 1>(p, n, v, D, d0, o);
}

// GCC 12's avx512fintrin.h seeds some intrinsics' unused lanes with a self-initialised variable,
// which -Wmaybe-uninitialized reports once they are inlined here.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// at::vec's AVX2 exp_u20 (ATen/cpu/vec/vec256/vec256_float.h), operation for operation, 16 lanes
// wide: each lane gets the 8-lane routine's bits, so either width may serve a row.
POSS_AVX512F inline __m512 exp_u20_16(__m512 x) {
  const __m512 ln_flt_min = _mm512_castsi512_ps(_mm512_set1_epi32(0xc2aeac50));
  const __m512 ln_flt_max = _mm512_castsi512_ps(_mm512_set1_epi32(0x42b17218));
  const __m512 one = _mm512_set1_ps(1.f);
  const __mmask16 too_small = _mm512_cmp_ps_mask(x, ln_flt_min, _CMP_LT_OS);
  __m512 src = _mm512_max_ps(_mm512_min_ps(x, ln_flt_max), ln_flt_min);
  __m512 fx = _mm512_fmadd_ps(src, _mm512_castsi512_ps(_mm512_set1_epi32(0x3fb8aa3b)), _mm512_set1_ps(0.5f));
  fx = _mm512_roundscale_ps(fx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(fx, _mm512_castsi512_ps(_mm512_set1_epi32(0x3f317218)), src);
  __m512 y = _mm512_fmadd_ps(r, _mm512_set1_ps(0.00828929059f), _mm512_set1_ps(0.0418978221f));
  y = _mm512_fmadd_ps(r, y, _mm512_set1_ps(0.166676521f));
  y = _mm512_fmadd_ps(r, y, _mm512_set1_ps(0.499991506f));
  y = _mm512_fmadd_ps(r, y, _mm512_set1_ps(0.999999701f));
  y = _mm512_fmadd_ps(r, y, one);
  __m512i n = _mm512_cvtps_epi32(_mm512_sub_ps(fx, one));
  n = _mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(0x7f)), 23);
  const __m512 two_pow_n = _mm512_mask_blend_ps(too_small, _mm512_castsi512_ps(n), _mm512_setzero_ps());
  return _mm512_mul_ps(_mm512_mul_ps(y, two_pow_n), _mm512_set1_ps(2.f));
}

// s[0:n] = exp_u20(s[0:n] - m), 16 lanes at a time.
POSS_AVX512F void exp_shifted16(float* s, int64_t n, float m) {
  const __m512 vm = _mm512_set1_ps(m);
  for (int64_t j = 0; j < n; j += W16) {
    const __mmask16 k = n - j >= W16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (n - j)) - 1);
    _mm512_mask_storeu_ps(s + j, k, exp_u20_16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), vm)));
  }
}
#pragma GCC diagnostic pop

// pv16_rows for R rows starting at row r (p: row stride ld; o: stride D).
template <int R>
POSS_AVX512F void pv16_group(const float* p, int64_t ld, int64_t r, int64_t n, const float* v, int64_t D,
                             float* o) {
  const float* pr[R];
  float* orow[R];
  for (int i = 0; i < R; ++i) {
    pr[i] = p + (r + i) * ld;
    orow[i] = o + (r + i) * D;
  }
  pv16_rows<R>(pr, n, v, D, orow);
}

// prefix_pv8 with 16-lane vectors: four rows at a time (16 accumulators over D = 64), then the rest.
POSS_AVX512F void prefix_pv16(const float* p, int64_t ld, int64_t rows, int64_t n, const float* v, int64_t D,
                              float* o) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) pv16_group<4>(p, ld, r, n, v, D, o);
  switch (rows - r) {
    case 3: pv16_group<3>(p, ld, r, n, v, D, o); break;
    case 2: pv16_group<2>(p, ld, r, n, v, D, o); break;
    case 1: pv16_group<1>(p, ld, r, n, v, D, o); break;
    default: break;
  }
}

bool has_avx512f() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f");
  }();
  return yes;
}
#else
bool has_avx512f() { return false; }
#endif

// 16 on AVX512F unless POSS_ATTENTION_LANES=8 (read once: the 8-lane loops tested on such CPUs too).
int64_t lanes() {
  static const int64_t n = [] {
    const char* env = std::getenv("POSS_ATTENTION_LANES");
    return has_avx512f() && !(env != nullptr && std::strcmp(env, "8") == 0) ? W16 : W;
  }();
  return n;
}

// s[0:n] = exp_u20(s[0:n] - m), `width` lanes at a time (the same bits at either width).
void exp_shifted(float* s, int64_t n, float m, int64_t width) {
#ifdef POSS_EXACT_AVX512
  if (width == W16) return exp_shifted16(s, n, m);
#endif
  const Vec vm(m);
  for (int64_t j = 0; j < n; j += W) {
    const int cnt = static_cast<int>(std::min(W, n - j));
    (Vec::loadu(s + j, cnt) - vm).exp_u20().store(s + j, cnt);
  }
}

template <typename scalar_t>
struct ExactKernel {
  const scalar_t* q;
  const scalar_t* k;
  const scalar_t* v;
  scalar_t* out;
  int64_t ks0, ks1, ks2, vs0, vs1, vs2;
  int64_t Hq, G, Nq, N, D;
  float scale;

  struct Scratch {
    std::vector<float> qs, kt, widened, scores, v32, acc, inv_l;
    std::vector<int64_t> n_keys;      // visible keys per row
    std::vector<int32_t> tree_slot;  // per row: the tree slot of each visible tree key, in order
  };

  void run(const Unit& u, Scratch& sc) const {
    const ExactRequest& rq = *u.rq;
    const int64_t nodes = u.i1 - u.i0, rows = G * nodes, q0 = N - Nq;
    const int64_t L = rq.prefix + u.i1;  // key slots any of these rows can see
    const int64_t width = lanes() == W16 && D % W16 == 0 ? W16 : W;
    const int64_t tiles = (L + width - 1) / width;
    const int64_t Lp = tiles * width;  // score row stride: whole tiles
    sc.qs.resize(rows * D);
    sc.scores.resize(rows * Lp);
    sc.acc.resize(rows * D);
    // Rows r = g * nodes + n: query node i0 + n of head h * G + g, scaled once.
    for (int64_t g = 0; g < G; ++g) {
      const scalar_t* src = q + ((rq.b * Hq + u.h * G + g) * Nq + (u.i0 - q0)) * D;
      float* dst = sc.qs.data() + g * nodes * D;
      at::vec::convert(src, dst, nodes * D);
      for (int64_t e = 0; e < nodes * D; ++e) dst[e] *= scale;
    }
    const scalar_t* kb = k + rq.b * ks0 + u.h * ks1;
    const scalar_t* vb = v + rq.b * vs0 + u.h * vs1;

    // Scores against all L keys, transposed once per unit so that a lane is a key.
    sc.kt.resize(tiles * D * width);
    float* kt = sc.kt.data();
    transpose_keys(kb, ks2, L, D, width, kt, sc.widened);
#ifdef POSS_EXACT_AVX512
    if (width == W16) scores16(sc.qs.data(), rows, D, kt, tiles, sc.scores.data(), Lp);
#endif
    if (width == W) scores8(sc.qs.data(), rows, D, kt, L, sc.scores.data(), Lp);

    // Each row's visible keys in the order decoding holds them: the prefix, then its visible tree
    // slots in order, whose scores move up to follow the prefix (to c <= j: in place, front to
    // back). Then max, exp and sum over those n keys alone.
    const int64_t P = rq.prefix;
    sc.inv_l.resize(rows);
    sc.n_keys.resize(rows);
    sc.tree_slot.resize(rows * u.i1);
    float* inv_l = sc.inv_l.data();
    for (int64_t r = 0; r < rows; ++r) {
      const int32_t i = static_cast<int32_t>(u.i0 + r % nodes);
      float* s = sc.scores.data() + r * Lp;
      const uint64_t* mrow = rq.chain ? nullptr : rq.masks + int64_t{i} * kAttnMaskWords;
      int32_t* slot = sc.tree_slot.data() + r * u.i1;
      int64_t c = 0;
      for (int32_t j = 0; j < u.i1; ++j) {
        if (tree_key_visible(rq.chain, mrow, i, j)) {
          s[P + c] = s[P + j];
          slot[c++] = j;
        }
      }
      const int64_t n = P + c;
      sc.n_keys[r] = n;
      exp_shifted(s, n, row_max(s, n), width);
      inv_l[r] = 1.0f / lane_sum(s, n);
    }

    // o = sum over c of p_c v_c, from V converted to fp32 once for all rows: the prefix keys, which
    // every row sees, in blocks of rows; then each row's own tree keys.
    sc.v32.resize(L * D);
    float* v32 = sc.v32.data();
    for (int64_t j = 0; j < L; ++j) at::vec::convert(vb + j * vs2, v32 + j * D, D);
    sc.acc.assign(rows * D, 0.0f);
    float* acc = sc.acc.data();
#ifdef POSS_EXACT_AVX512
    if (width == W16) {
      prefix_pv16(sc.scores.data(), Lp, rows, P, v32, D, acc);
    } else
#endif
    {
      prefix_pv8(sc.scores.data(), Lp, rows, P, v32, D, acc);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const float* p = sc.scores.data() + r * Lp + P;
      const int32_t* slot = sc.tree_slot.data() + r * u.i1;
      float* o = acc + r * D;
      for (int64_t c = 0; c < sc.n_keys[r] - P; ++c) {
        const Vec pv(p[c]);
        const float* vj = v32 + (P + slot[c]) * D;
        int64_t d = 0;
        for (; d + W <= D; d += W) at::vec::fmadd(pv, Vec::loadu(vj + d), Vec::loadu(o + d)).store(o + d);
        for (; d < D; ++d) o[d] = std::fma(p[c], vj[d], o[d]);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t g = r / nodes, i = u.i0 + r % nodes;
      float* a = acc + r * D;
      for (int64_t d = 0; d < D; ++d) a[d] *= inv_l[r];
      at::vec::convert(a, out + ((rq.b * Hq + u.h * G + g) * Nq + (i - q0)) * D, D);
    }
  }
};

}  // namespace

int64_t cpu_exact_attention_lanes() { return lanes(); }

void tree_attention_exact(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                          const std::vector<ExactRequest>& requests, int64_t N, double scale) {
  const int64_t Hq = q.size(1), Nq = q.size(2), D = q.size(3), Hkv = k.size(1), G = Hq / Hkv;
  // Rows are independent, so any split into units gives the same bits: (request, kv head, a
  // run of query nodes) keeps every thread busy on one large tree as on many small ones.
  const int64_t threads = at::get_num_threads();
  double work = 0.0;
  for (const ExactRequest& rq : requests) {
    const int32_t lo = static_cast<int32_t>(N - Nq), hi = rq.n_real;
    if (hi > lo) work += 2.0 * G * Hkv * (hi - lo) * (rq.prefix + hi) * D;
  }
  // Threads pay from ~2e4 multiply-adds (a 20-key decode step of 9 heads) when the pool is warm, as
  // it is between a decode step's GEMMs: at 2 threads a 200-key step took 28 us against 35 on one,
  // a 6-row verify at 400 keys 99 against 138 (AVX2 EPYC). A serial call keeps each (request, kv
  // head) whole: every unit widens and transposes its keys and converts its values once.
  const bool parallel = threads > 1 && work >= 2e4;
  const int64_t pieces = parallel ? threads : 1;
  std::vector<Unit> units;
  for (const ExactRequest& rq : requests) {
    const int32_t lo = static_cast<int32_t>(N - Nq), hi = rq.n_real;
    if (hi <= lo) continue;
    const int32_t per = std::max<int32_t>(1, (hi - lo + pieces - 1) / pieces);
    for (int64_t h = 0; h < Hkv; ++h) {
      for (int32_t i0 = lo; i0 < hi; i0 += per) units.push_back(Unit{&rq, h, i0, std::min(hi, i0 + per)});
    }
  }
  const int64_t n = static_cast<int64_t>(units.size());
  if (n == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "tree_attention_exact", [&] {
    const ExactKernel<scalar_t> kern{q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                                     out.data_ptr<scalar_t>(), k.stride(0), k.stride(1), k.stride(2),
                                     v.stride(0), v.stride(1), v.stride(2), Hq, G, Nq, N, D,
                                     static_cast<float>(scale)};
    at::parallel_for(0, n, parallel ? 1 : n, [&](int64_t begin, int64_t end) {
      typename ExactKernel<scalar_t>::Scratch sc;
      for (int64_t u = begin; u < end; ++u) kern.run(units[u], sc);
    });
  });
}

}  // namespace poss
