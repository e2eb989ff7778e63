// CPU kernel of poss::tree_attention: flash-style attention with an online softmax over key tiles.
//
// One work unit owns a GQA group (request b, kv head h) and a range of query nodes, i.e. the rows
// of all G = Hq / Hkv query heads at once. Each K/V tile is therefore read from memory once and
// multiplied against every query of the group (the op is memory-bound on the prefix). Scores and
// the P.V update are tile GEMMs (BLAS sgemm when torch exports it, else at::mm); the softmax is
// vectorised with at::vec in fp32.
//
// Requests with a committed prefix go to the row-exact kernel instead (tree_attention_exact.cpp).
//
// Parallelism: units over (b, h, query tile). When that gives too few units for the threads, the
// key range is also split (split-K) and the partial results are merged by log-sum-exp; a key tile
// is still read by one unit only.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "poss/tree_attention.h"
#include "poss/tree_attention_args.h"
#include "poss/tree_checks.h"
#include "tree_attention_exact.h"

// Fortran BLAS exported by libtorch_cpu (MKL or OpenBLAS, LP64). Weak: a torch without it makes
// this null and the kernel falls back to at::mm on the same tiles.
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n,
                       const int* k, const float* alpha, const float* a, const int* lda,
                       const float* b, const int* ldb, const float* beta, float* c,
                       const int* ldc) __attribute__((weak));

namespace poss {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kKeyTile = 128;      // keys per tile
constexpr int64_t kMaxGroupRows = 1024;  // beyond this many rows, chains tile their queries
constexpr int64_t kChainRowTile = 256;   // rows per query tile of a long chain
constexpr double kSerialMacs = 4e6;      // below this (~0.1 ms on one core), stay single-threaded

// Row-major C[m x n] (ldc) = A[m x k] (lda) . op(B) + beta C, where op(B) = B^T for B stored
// [n x k] (ldb) when b_transposed, else B stored [k x n]. All fp32.
void gemm_rowmajor(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
                   int64_t ldb, bool b_transposed, float beta, float* c, int64_t ldc) {
  if (sgemm_ != nullptr) {
    // Column-major view: C^T (n x m) = op(B)^T (n x k) . A^T (k x m).
    const int M = static_cast<int>(n), N = static_cast<int>(m), K = static_cast<int>(k);
    const int LDA = static_cast<int>(ldb), LDB = static_cast<int>(lda), LDC = static_cast<int>(ldc);
    const float alpha = 1.0f;
    const char ta = b_transposed ? 'T' : 'N', tb = 'N';
    sgemm_(&ta, &tb, &M, &N, &K, &alpha, b, &LDA, a, &LDB, &beta, c, &LDC);
    return;
  }
  const auto opts = at::TensorOptions().dtype(at::kFloat);
  const at::Tensor A = at::from_blob(const_cast<float*>(a), {m, k}, {lda, 1}, opts);
  const at::Tensor Bm = b_transposed
                            ? at::from_blob(const_cast<float*>(b), {k, n}, {1, ldb}, opts)
                            : at::from_blob(const_cast<float*>(b), {k, n}, {ldb, 1}, opts);
  at::Tensor C = at::from_blob(c, {m, n}, {ldc, 1}, opts);
  if (beta == 0.0f) {
    at::mm_out(C, A, Bm);
  } else {
    C.add_(at::mm(A, Bm));
  }
}

// Per-request facts derived once on the host.
struct Request {
  int64_t prefix;      // prefix_len[b]
  int32_t n_real;      // real tree nodes
  bool chain;
  const uint64_t* masks;  // [n_real, kAttnMaskWords] ancestor rows; null for chains
};

// A unit of work: one GQA group, query nodes [i0, i1), key tiles [t0, t1) of that group's tile
// list (prefix tiles first, then tree tiles). `part` < 0: the unit covers all tiles and writes
// the output; else it writes partial `part` of its group to the workspace.
struct Unit {
  int64_t b, h;
  int32_t i0, i1;
  int64_t t0, t1;
  int64_t part;    // workspace slot (-1: none)
  int64_t group;   // index of (b, h, query tile), for the merge
};

struct Group {
  int64_t b, h;
  int32_t i0, i1;
  int64_t first_part, num_parts;  // workspace slots of its units (num_parts > 1 only)
};

template <typename scalar_t>
struct Kernel {
  // Inputs (q contiguous; k/v with unit stride on D).
  const scalar_t* q;
  const scalar_t* k;
  const scalar_t* v;
  int64_t ks0, ks1, ks2, vs0, vs1, vs2;
  scalar_t* out;  // [B, Hq, Nq, D] contiguous, zero-initialised
  int64_t Hq, Hkv, G, Nq, N, D;
  float scale;
  const std::vector<Request>& req;
  // Split-K workspace: [parts, rows, D] outputs and [parts, rows] states, rows = max group rows.
  float* ws_out;
  SoftmaxState* ws_state;
  int64_t ws_rows;

  int64_t first_query() const { return N - Nq; }
  static int64_t prefix_tiles(int64_t prefix) { return (prefix + kKeyTile - 1) / kKeyTile; }

  // Scratch owned by one thread.
  struct Scratch {
    std::vector<float> qs, scores, kbuf, vbuf, acc;
    std::vector<SoftmaxState> state;
    Scratch(int64_t rows, int64_t D)
        : qs(rows * D), scores(rows * kKeyTile), kbuf(kKeyTile * D), vbuf(kKeyTile * D),
          acc(rows * D), state(rows) {}
  };

  // `n` cache rows (row stride `stride`) as fp32 rows with leading dimension `ld`: the cache
  // itself when it is fp32, else converted into `buf`.
  const float* rows_as_float(const scalar_t* base, int64_t stride, int64_t n, float* buf,
                             int64_t& ld) const {
    if constexpr (std::is_same_v<scalar_t, float>) {
      ld = stride;
      return base;
    }
    for (int64_t r = 0; r < n; ++r) at::vec::convert(base + r * stride, buf + r * D, D);
    ld = D;
    return buf;
  }

  void run(const Unit& u, Scratch& sc) const {
    const Request& rq = req[u.b];
    const int64_t nodes = u.i1 - u.i0, rows = G * nodes;
    const int64_t q0 = first_query();
    float* qs = sc.qs.data();
    float* acc = sc.acc.data();
    float* scores = sc.scores.data();
    SoftmaxState* st = sc.state.data();

    // Rows r = g * nodes + (i - i0): the group's heads stacked, scaled once.
    for (int64_t g = 0; g < G; ++g) {
      const scalar_t* src = q + ((u.b * Hq + u.h * G + g) * Nq + (u.i0 - q0)) * D;
      float* dst = qs + g * nodes * D;
      at::vec::convert(src, dst, nodes * D);
      at::vec::map([this](Vec x) { return x * Vec(scale); }, dst, dst, nodes * D);
    }
    std::fill(acc, acc + rows * D, 0.0f);
    std::fill(st, st + rows, SoftmaxState{kNegInf, 0.0f});

    const int64_t tp = prefix_tiles(rq.prefix);
    const scalar_t* kb = k + u.b * ks0 + u.h * ks1;
    const scalar_t* vb = v + u.b * vs0 + u.h * vs1;
    for (int64_t t = u.t0; t < u.t1; ++t) {
      int64_t slot0, kn, j0 = -1;  // j0 >= 0: a tree tile starting at tree key j0
      if (t < tp) {
        slot0 = t * kKeyTile;
        kn = std::min(kKeyTile, rq.prefix - slot0);
      } else {
        j0 = (t - tp) * kKeyTile;
        slot0 = rq.prefix + j0;
        kn = std::min<int64_t>(kKeyTile, u.i1 - j0);
      }
      int64_t ldk, ldv;
      const float* kt = rows_as_float(kb + slot0 * ks2, ks2, kn, sc.kbuf.data(), ldk);
      gemm_rowmajor(rows, kn, D, qs, D, kt, ldk, /*b_transposed=*/true, 0.0f, scores, kKeyTile);
      // A chain tile entirely at or before the tile's first query needs no mask.
      const bool masked = j0 >= 0 && !(rq.chain && j0 + kn - 1 <= u.i0);
      if (masked) apply_tree_mask(rq, u.i0, nodes, j0, kn, scores);
      softmax_tile(st, rows, kn, scores, acc);
      const float* vt = rows_as_float(vb + slot0 * vs2, vs2, kn, sc.vbuf.data(), ldv);
      gemm_rowmajor(rows, D, kn, scores, kKeyTile, vt, ldv, /*b_transposed=*/false, 1.0f, acc, D);
    }

    if (u.part < 0) {
      for (int64_t r = 0; r < rows; ++r) {
        write_row(u.b, u.h, u.i0, nodes, r, acc + r * D, 1.0f / st[r].l);
      }
    } else {
      std::copy(acc, acc + rows * D, ws_out + u.part * ws_rows * D);
      std::copy(st, st + rows, ws_state + u.part * ws_rows);
    }
  }

  void apply_tree_mask(const Request& rq, int32_t i0, int64_t nodes, int64_t j0, int64_t kn,
                       float* scores) const {
    for (int64_t n = 0; n < nodes; ++n) {
      const int32_t i = static_cast<int32_t>(i0 + n);
      const uint64_t* mrow = rq.chain ? nullptr : rq.masks + int64_t{i} * kAttnMaskWords;
      for (int64_t c = 0; c < kn; ++c) {
        if (tree_key_visible(rq.chain, mrow, i, static_cast<int32_t>(j0 + c))) continue;
        for (int64_t g = 0; g < G; ++g) scores[(g * nodes + n) * kKeyTile + c] = kNegInf;
      }
    }
  }

  // Online softmax over one tile: scores become the tile's probabilities (relative to the new
  // running max) in place, and each accumulator row is rescaled to that max.
  void softmax_tile(SoftmaxState* st, int64_t rows, int64_t kn, float* scores, float* acc) const {
    for (int64_t r = 0; r < rows; ++r) {
      float* s = scores + r * kKeyTile;
      const float tile_max = at::vec::reduce_all<float>(
          [](Vec a, Vec b) { return at::vec::maximum(a, b); }, s, kn);
      const float m = softmax_new_max(st[r], tile_max);
      if (m == kNegInf) {  // nothing visible to this row yet
        std::fill(s, s + kn, 0.0f);
        continue;
      }
      const Vec vm(m);
      Vec vsum(0.0f);
      int64_t c = 0;
      for (; c + Vec::size() <= kn; c += Vec::size()) {
        const Vec e = (Vec::loadu(s + c) - vm).exp_u20();
        e.store(s + c);
        vsum = vsum + e;
      }
      float sum = at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return a + b; }, vsum);
      for (; c < kn; ++c) {
        s[c] = std::exp(s[c] - m);
        sum += s[c];
      }
      const float corr = softmax_absorb(st[r], m, sum);
      if (corr != 1.0f) {
        float* a = acc + r * D;
        at::vec::map([corr](Vec x) { return x * Vec(corr); }, a, a, D);
      }
    }
  }

  void write_row(int64_t b, int64_t h, int32_t i0, int64_t nodes, int64_t r, const float* row,
                 float inv_l) const {
    const int64_t g = r / nodes, i = i0 + r % nodes;
    scalar_t* dst = out + ((b * Hq + h * G + g) * Nq + (i - first_query())) * D;
    float tmp[256];  // D <= 256
    at::vec::map([inv_l](Vec x) { return x * Vec(inv_l); }, tmp, row, D);
    at::vec::convert(tmp, dst, D);
  }

  void merge(const Group& grp, std::vector<float>& row) const {
    const int64_t nodes = grp.i1 - grp.i0, rows = G * nodes;
    row.resize(D);
    for (int64_t r = 0; r < rows; ++r) {
      float m = kNegInf;
      for (int64_t p = 0; p < grp.num_parts; ++p) {
        m = merge_max(m, ws_state[(grp.first_part + p) * ws_rows + r]);
      }
      std::fill(row.begin(), row.end(), 0.0f);
      float l = 0.0f;
      for (int64_t p = 0; p < grp.num_parts; ++p) {
        const SoftmaxState s = ws_state[(grp.first_part + p) * ws_rows + r];
        const float w = merge_weight(s, m);
        if (w == 0.0f) continue;
        l += w * s.l;
        const float* o = ws_out + ((grp.first_part + p) * ws_rows + r) * D;
        at::vec::map2([w](Vec acc, Vec x) { return acc + x * Vec(w); }, row.data(), row.data(),
                      o, D);
      }
      write_row(grp.b, grp.h, grp.i0, nodes, r, row.data(), 1.0f / l);
    }
  }
};

void check_values(const at::Tensor& parents, const at::Tensor& prefix_len, int64_t S,
                  std::vector<Request>& req, std::vector<uint64_t>& masks) {
  const int64_t B = parents.size(0), N = parents.size(1);
  const auto* par = parents.data_ptr<int32_t>();
  const auto* pl = prefix_len.data_ptr<int32_t>();
  std::vector<TreeScan> info(B);
  int64_t general = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int32_t* row = par + b * N;
    const TreeScan t = check_attention_tree(row, N, b);
    TORCH_CHECK(pl[b] >= 0 && pl[b] + int64_t{t.n_real} <= S, "prefix_len[", b, "] = ", pl[b],
                " must be >= 0 and leave room for the tree's ", t.n_real,
                " real nodes in k_cache (S = ", S, ")");
    info[b] = t;
    general += !t.chain;
  }
  masks.assign(general * kAttnMaxTreeNodes * kAttnMaskWords, 0);
  req.resize(B);
  int64_t next = 0;
  for (int64_t b = 0; b < B; ++b) {
    const uint64_t* m = nullptr;
    if (!info[b].chain) {
      uint64_t* rows = masks.data() + next++ * kAttnMaxTreeNodes * kAttnMaskWords;
      build_ancestor_masks(par + b * N, info[b].n_real, rows);
      m = rows;
    }
    req[b] = Request{pl[b], info[b].n_real, info[b].chain, m};
  }
}

at::Tensor tree_attention_cpu(const at::Tensor& q_in, const at::Tensor& k_in,
                              const at::Tensor& v_in, const at::Tensor& prefix_len_in,
                              const at::Tensor& parents_in, double scale) {
  const auto [B, Hq, Hkv, Nq, N, S, D] =
      check_tree_attention_args(q_in, k_in, v_in, prefix_len_in, parents_in, scale);
  const at::Tensor q = q_in.contiguous();
  const at::Tensor k = k_in.stride(3) == 1 ? k_in : k_in.contiguous();
  const at::Tensor v = v_in.stride(3) == 1 ? v_in : v_in.contiguous();
  const at::Tensor parents = parents_in.contiguous(), prefix_len = prefix_len_in.contiguous();
  std::vector<Request> req;
  std::vector<uint64_t> masks;
  check_values(parents, prefix_len, S, req, masks);

  at::Tensor out = at::zeros_like(q);  // padding queries stay zero
  const int64_t G = Hq / Hkv, q0 = N - Nq;

  // Requests behind a committed prefix (decode steps, tree verifies, later turns) take the row-exact
  // path, so that decoding and speculation agree to the bit; prefills (prefix 0) take the tiles.
  std::vector<ExactRequest> exact;
  for (int64_t b = 0; b < B; ++b) {
    if (req[b].prefix > 0) exact.push_back(ExactRequest{b, req[b].prefix, req[b].n_real, req[b].chain, req[b].masks});
  }
  tree_attention_exact(q, k, v, out, exact, N, scale);

  // Groups: (b, h, query tile). Query nodes run over [q0, n_real): padding rows are skipped.
  std::vector<Group> groups;
  int64_t max_rows = 1;
  for (int64_t b = 0; b < B; ++b) {
    const int32_t lo = static_cast<int32_t>(q0), hi = req[b].n_real;
    if (hi <= lo || req[b].prefix > 0) continue;
    const int64_t nodes = hi - lo;
    int64_t tile = nodes;
    if (req[b].chain && G * nodes > kMaxGroupRows) tile = std::max<int64_t>(1, kChainRowTile / G);
    for (int64_t h = 0; h < Hkv; ++h) {
      for (int32_t i0 = lo; i0 < hi; i0 += static_cast<int32_t>(tile)) {
        const int32_t i1 = static_cast<int32_t>(std::min<int64_t>(hi, i0 + tile));
        groups.push_back(Group{b, h, i0, i1, 0, 1});
        max_rows = std::max<int64_t>(max_rows, G * (i1 - i0));
      }
    }
  }
  if (groups.empty()) return out;

  // Split-K when the groups alone cannot keep every thread busy: aim at >= 4 units per thread,
  // but keep at least two key tiles per split so the merge stays cheap.
  // Small calls (a draft level over a short prefix) run on the calling thread: waking a thread
  // pool costs more than the work, and far more when another process holds the other cores.
  double macs = 0.0;
  for (const Group& grp : groups) {
    macs += 2.0 * G * (grp.i1 - grp.i0) * (req[grp.b].prefix + grp.i1) * D;
  }
  const bool serial = macs < kSerialMacs;
  const int64_t threads = serial ? 1 : at::get_num_threads();
  const int64_t ngroups = static_cast<int64_t>(groups.size());
  std::vector<Unit> units;
  int64_t parts = 0;
  for (int64_t gi = 0; gi < ngroups; ++gi) {
    Group& grp = groups[gi];
    const Request& rq = req[grp.b];
    const int64_t tiles = Kernel<float>::prefix_tiles(rq.prefix) +
                          (grp.i1 + kKeyTile - 1) / kKeyTile;
    int64_t splits = 1;
    if (threads > 1 && ngroups < 4 * threads) {
      // Prefer a unit count that is a multiple of the thread count: parallel_for hands each
      // thread one contiguous, equal-length run of units.
      int64_t want = (4 * threads + ngroups - 1) / ngroups;
      for (int64_t s = want; s < 2 * want; ++s) {
        if (ngroups * s % threads == 0) {
          want = s;
          break;
        }
      }
      splits = std::min(want, std::max<int64_t>(1, tiles / 2));
    }
    if (splits == 1) {
      units.push_back(Unit{grp.b, grp.h, grp.i0, grp.i1, 0, tiles, -1, gi});
      continue;
    }
    grp.first_part = parts;
    grp.num_parts = splits;
    for (int64_t s = 0; s < splits; ++s) {
      units.push_back(Unit{grp.b, grp.h, grp.i0, grp.i1, tiles * s / splits,
                           tiles * (s + 1) / splits, parts++, gi});
    }
  }
  std::vector<float> ws_out(parts * max_rows * D);
  std::vector<SoftmaxState> ws_state(parts * max_rows);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "tree_attention_cpu",
                                  [&] {
    using K = Kernel<scalar_t>;
    const K kern{q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                 k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
                 out.data_ptr<scalar_t>(), Hq, Hkv, G, Nq, N, D, static_cast<float>(scale), req,
                 ws_out.data(), ws_state.data(), max_rows};
    const int64_t nunits = static_cast<int64_t>(units.size());
    at::parallel_for(0, nunits, serial ? nunits : 1, [&](int64_t begin, int64_t end) {
      typename K::Scratch sc(max_rows, D);
      for (int64_t u = begin; u < end; ++u) kern.run(units[u], sc);
    });
    // The merge is O(rows * D * splits), negligible next to the attention; on the calling thread
    // it avoids a second parallel region (each one is a barrier, costly on a contended machine).
    std::vector<float> row;
    for (int64_t gi = 0; parts > 0 && gi < ngroups; ++gi) {
      if (groups[gi].num_parts > 1) kern.merge(groups[gi], row);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(poss, CPU, m) { m.impl("tree_attention", &tree_attention_cpu); }

}  // namespace poss
