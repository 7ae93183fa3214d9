// Exact plan search: the memory-indexed dynamic program of [Note: exact search]
// (osdp/planner/search.py). This file follows search_python() step for step, with the
// same order of updates and the same float expressions, so both return the same plan.
#include "search.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#endif
#include <limits>
#include <stdexcept>
#include <string>

namespace osdp {
namespace search {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr int64_t kMaxOptionsPerOp = 65535;  // choices are stored as uint16

[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument(msg); }

std::string join_isas() {
  std::string out;
  for (const auto& isa : available_isas()) out += (out.empty() ? "" : ", ") + isa;
  return out;
}

// The one memory test (same expression as evaluate_assignment): qy = float(y) * quantum.
inline bool fits(double qy, double act, double local, double budget) {
  return (qy + act) + local <= budget;
}

// [Note: relax kernel]
// One op, pull form: for each end state y in blocks of kLanes, scan the op's options
// in index order and keep the lexicographically least (time, peak) of
//     in[y - held_q[o]] + option o,   where (qy[y] + act) + local[o] <= budget,
// so a block's winners stay in registers and each input is read, never written.
// The candidates reach each y in the same order as in search_python's option-by-option
// updates, with the same strict comparison, so the winners are the same.
// The caller guarantees that every x a block reads is either reachable or holds
// (inf, -inf), and that qy is defined for every y of the blocks. Lanes past the last
// useful state then never win: their inputs are unreachable or they exceed the budget.
constexpr int64_t kLanes = 8;

#define OSDP_RELAX_ARGS                                                                   \
  const double *tin, const double *pin, double *tout, double *pout, uint16_t *cout,      \
      const double *qy, int64_t y0, int64_t nblocks, double act, double budget,           \
      const int64_t *held, const double *local, const double *time, const double *rel,    \
      const int64_t *ymax, int64_t nopt

void relax_op_scalar(OSDP_RELAX_ARGS) {
  (void)ymax;  // the memory test below is the same predicate
  for (int64_t k = 0; k < nblocks * kLanes; ++k) {
    const int64_t y = y0 + k;
    const double qa = qy[y] + act;
    double at = kInf, ap = -kInf, ac = 0;
    for (int64_t o = 0; o < nopt; ++o) {
      const double mem = qa + local[o];
      const double t = tin[y - held[o]] + time[o];
      const double xp = pin[y - held[o]];
      const double pk = xp > mem ? xp : mem;
      if (mem <= budget && (t < at || (t == at && pk < ap))) {
        at = t;
        ap = pk;
        ac = rel[o];
      }
    }
    tout[y] = at;
    pout[y] = ap;
    cout[k] = uint16_t(ac);
  }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define OSDP_HAVE_X86_KERNELS 1
// U blocks at a time: the (time, peak) comparison chain of one block is serial over
// the options, so independent blocks side by side keep the vector units busy.
template <int U>
__attribute__((target("avx512f"), always_inline)) inline void relax_blocks_avx512(
    OSDP_RELAX_ARGS, int64_t b0) {
  (void)nblocks;
  const __m512d vbudget = _mm512_set1_pd(budget), vact = _mm512_set1_pd(act);
  __m512d qa[U], at[U], ap[U], ac[U];
#pragma GCC unroll 8
  for (int u = 0; u < U; ++u) {
    qa[u] = _mm512_add_pd(_mm512_loadu_pd(qy + y0 + (b0 + u) * kLanes), vact);
    at[u] = _mm512_set1_pd(kInf);
    ap[u] = _mm512_set1_pd(-kInf);
    ac[u] = _mm512_setzero_pd();
  }
  for (int64_t o = 0; o < nopt; ++o) {
    const __m512d vl = _mm512_set1_pd(local[o]), vt = _mm512_set1_pd(time[o]);
    const __m512d vr = _mm512_set1_pd(rel[o]);
    const double* xt = tin + (y0 + b0 * kLanes - held[o]);
    const double* xp = pin + (y0 + b0 * kLanes - held[o]);
    // all_fit: every y of the group is <= the option's last fitting state, so the
    // memory test (monotone in y) passes everywhere and its compare is skipped
    const bool all_fit = y0 + (b0 + U) * kLanes - 1 <= ymax[o];
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) {
      const __m512d mem = _mm512_add_pd(qa[u], vl);
      const __m512d t = _mm512_add_pd(_mm512_loadu_pd(xt + u * kLanes), vt);
      const __m512d pk = _mm512_max_pd(_mm512_loadu_pd(xp + u * kLanes), mem);
      const __mmask8 fit = all_fit ? __mmask8(0xFF) : _mm512_cmp_pd_mask(mem, vbudget, _CMP_LE_OQ);
      const __mmask8 better =
          _mm512_mask_cmp_pd_mask(fit, t, at[u], _CMP_LT_OQ) |
          (_mm512_mask_cmp_pd_mask(fit, t, at[u], _CMP_EQ_OQ) & _mm512_cmp_pd_mask(pk, ap[u], _CMP_LT_OQ));
      at[u] = _mm512_mask_blend_pd(better, at[u], t);
      ap[u] = _mm512_mask_blend_pd(better, ap[u], pk);
      ac[u] = _mm512_mask_blend_pd(better, ac[u], vr);
    }
  }
#pragma GCC unroll 8
  for (int u = 0; u < U; ++u) {
    const int64_t y = y0 + (b0 + u) * kLanes;
    _mm512_storeu_pd(tout + y, at[u]);
    _mm512_storeu_pd(pout + y, ap[u]);
    const __m256i c32 = _mm512_cvttpd_epi32(ac[u]);  // choices < 65536: exact
    alignas(32) int32_t c[kLanes];
    _mm256_store_si256(reinterpret_cast<__m256i*>(c), c32);
    for (int64_t k = 0; k < kLanes; ++k) cout[(b0 + u) * kLanes + k] = uint16_t(c[k]);
  }
}

__attribute__((target("avx512f"))) void relax_op_avx512(OSDP_RELAX_ARGS) {
  int64_t b = 0;
  for (; b + 4 <= nblocks; b += 4)
    relax_blocks_avx512<4>(tin, pin, tout, pout, cout, qy, y0, nblocks, act, budget, held, local,
                           time, rel, ymax, nopt, b);
  for (; b < nblocks; ++b)
    relax_blocks_avx512<1>(tin, pin, tout, pout, cout, qy, y0, nblocks, act, budget, held, local,
                           time, rel, ymax, nopt, b);
}

// AVX2: the same with 4 lanes (half blocks), also U at a time.
template <int U>
__attribute__((target("avx2"), always_inline)) inline void relax_halves_avx2(OSDP_RELAX_ARGS,
                                                                            int64_t h0) {
  (void)nblocks;
  (void)ymax;
  const __m256d vbudget = _mm256_set1_pd(budget), vact = _mm256_set1_pd(act);
  __m256d qa[U], at[U], ap[U], ac[U];
#pragma GCC unroll 8
  for (int u = 0; u < U; ++u) {
    qa[u] = _mm256_add_pd(_mm256_loadu_pd(qy + y0 + (h0 + u) * 4), vact);
    at[u] = _mm256_set1_pd(kInf);
    ap[u] = _mm256_set1_pd(-kInf);
    ac[u] = _mm256_setzero_pd();
  }
  for (int64_t o = 0; o < nopt; ++o) {
    const __m256d vl = _mm256_set1_pd(local[o]), vt = _mm256_set1_pd(time[o]);
    const __m256d vr = _mm256_set1_pd(rel[o]);
    const double* xt = tin + (y0 + h0 * 4 - held[o]);
    const double* xp = pin + (y0 + h0 * 4 - held[o]);
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) {
      const __m256d mem = _mm256_add_pd(qa[u], vl);
      const __m256d t = _mm256_add_pd(_mm256_loadu_pd(xt + u * 4), vt);
      const __m256d pk = _mm256_max_pd(_mm256_loadu_pd(xp + u * 4), mem);
      const __m256d better = _mm256_and_pd(
          _mm256_cmp_pd(mem, vbudget, _CMP_LE_OQ),
          _mm256_or_pd(_mm256_cmp_pd(t, at[u], _CMP_LT_OQ),
                       _mm256_and_pd(_mm256_cmp_pd(t, at[u], _CMP_EQ_OQ),
                                     _mm256_cmp_pd(pk, ap[u], _CMP_LT_OQ))));
      at[u] = _mm256_blendv_pd(at[u], t, better);
      ap[u] = _mm256_blendv_pd(ap[u], pk, better);
      ac[u] = _mm256_blendv_pd(ac[u], vr, better);
    }
  }
#pragma GCC unroll 8
  for (int u = 0; u < U; ++u) {
    const int64_t y = y0 + (h0 + u) * 4;
    _mm256_storeu_pd(tout + y, at[u]);
    _mm256_storeu_pd(pout + y, ap[u]);
    alignas(32) double c[4];
    _mm256_store_pd(c, ac[u]);
    for (int64_t k = 0; k < 4; ++k) cout[(h0 + u) * 4 + k] = uint16_t(c[k]);
  }
}

__attribute__((target("avx2"))) void relax_op_avx2(OSDP_RELAX_ARGS) {
  const int64_t nhalves = 2 * nblocks;
  int64_t h = 0;
  for (; h + 4 <= nhalves; h += 4)
    relax_halves_avx2<4>(tin, pin, tout, pout, cout, qy, y0, nblocks, act, budget, held, local,
                         time, rel, ymax, nopt, h);
  for (; h < nhalves; ++h)
    relax_halves_avx2<1>(tin, pin, tout, pout, cout, qy, y0, nblocks, act, budget, held, local,
                         time, rel, ymax, nopt, h);
}
#endif

using RelaxFn = void (*)(OSDP_RELAX_ARGS);

RelaxFn pick_kernel(const std::string& isa) {
#ifdef OSDP_HAVE_X86_KERNELS
  const bool avx512 = __builtin_cpu_supports("avx512f"), avx2 = __builtin_cpu_supports("avx2");
  if (isa == "auto") return avx512 ? relax_op_avx512 : avx2 ? relax_op_avx2 : relax_op_scalar;
  if (isa == "avx512" && avx512) return relax_op_avx512;
  if (isa == "avx2" && avx2) return relax_op_avx2;
#else
  if (isa == "auto") return relax_op_scalar;
#endif
  if (isa == "scalar") return relax_op_scalar;
  fail("kernel isa '" + isa + "' is not available here (available: " + join_isas() + ")");
}

// First and last reachable (finite time) state of t[lo..hi]; lo > hi when none.
void reach_range(const double* t, int64_t lo, int64_t hi, int64_t* rlo, int64_t* rhi) {
  int64_t a = lo, b = hi;
  while (a <= hi && !(t[a] < kInf)) ++a;
  while (b >= a && !(t[b] < kInf)) --b;
  *rlo = a;
  *rhi = b;
}

// Largest state y <= B with fits(y) (-1: none). fits is monotone in y, so a guess
// from the division is corrected by stepping (a few steps at most).
int64_t max_fitting_state(const double* qy, int64_t B, double q, double act,
                          double local, double budget) {
  double g = std::floor((budget - act - local) / q);
  int64_t y = g < -1 ? -1 : (g > double(B) ? B : int64_t(g));
  while (y >= 0 && !fits(qy[y], act, local, budget)) --y;
  while (y < B && fits(qy[y + 1], act, local, budget)) ++y;
  return y;
}

// [Note: dead states]
// Per op and variant, the largest state after the op from which the rest of the plan
// can still fit (-1: none). Every later memory test only gets harder as the prefix
// grows, so the states that can still finish are a prefix [0, alive]; walking back from
// the end (every state up to B), the bound before an op is the largest x with
// x + held_q <= min(the option's last fitting state, the bound after the op) over its
// options, and a segment's carry moves the bound by itself. A state above it is on no
// feasible plan, and no state within it is reached from one above (x + held_q within
// the bound after the op means x within the bound before it), so dropping them changes
// no winner: the same plan, fewer states (a model whose memory peaks late, at the end of
// forward, has most of its high states dead early on).
std::vector<int64_t> alive_after(const ProblemView& p, int64_t B, const double* qy,
                                 const std::vector<int64_t>& kept,
                                 const std::vector<int64_t>& kept_at) {
  std::vector<int64_t> out(size_t(2 * p.num_ops), -1);
  int64_t next_in = B;  // the bound entering the next segment
  for (int64_t s = p.num_segments - 1; s >= 0; --s) {
    const bool last_seg = s + 1 == p.num_segments;
    int64_t seg_in = -1;
    for (int64_t v = 0; v < p.seg_num_variants[s]; ++v) {
      const int64_t c = last_seg ? 0 : p.seg_carry_act_q[2 * s + v];
      int64_t bound = next_in - c < 0 ? -1 : next_in - c;
      for (int64_t i = p.seg_first_op[s] + p.seg_num_ops[s] - 1; i >= p.seg_first_op[s]; --i) {
        out[size_t(2 * i + v)] = bound;
        int64_t before = -1;
        for (int64_t k = kept_at[2 * i + v]; bound >= 0 && k < kept_at[2 * i + v + 1]; ++k) {
          const int64_t o = kept[k];
          const int64_t ymax = max_fitting_state(qy, B, p.quantum_bytes, p.act_in_segment_bytes[2 * i + v],
                                                 p.opt_local_bytes[o], p.budget_bytes);
          before = std::max(before, std::min(ymax, bound) - p.opt_held_q[o]);
        }
        bound = before < 0 ? -1 : before;
      }
      seg_in = std::max(seg_in, bound);
    }
    next_in = seg_in;
  }
  return out;
}

// [Note: time bound]
// A caller that only wants a plan faster than time_bound (the batch sweep: one that
// beats the best so far) lets the DP drop the states that cannot lead to one: a state
// after op i whose time plus the least time of everything after it (each op's fastest
// option, each segment's cheaper variant, memory ignored) exceeds the bound. The ends of
// the reachable range are trimmed (the low states keep little and are slow); a plan
// faster than the bound has every prefix within it, so it and every winner on its path
// are untouched and the result is the same optimum; when the optimum is not faster the
// search reports no plan. The lower bounds are float sums in another order than the
// plan's own, so a state is dropped only past a slack of 1e-9 of the largest time any
// plan could sum to (rounding is ~1e-13 of it).
struct TimeBound {
  std::vector<double> rest;  // per op and variant: least time still to come after it
  double limit = kInf;       // drop a state when time + rest > limit
};

TimeBound time_bound_of(const ProblemView& p, const std::vector<int64_t>& kept,
                        const std::vector<int64_t>& kept_at) {
  TimeBound tb;
  if (!(p.time_bound < kInf)) return tb;
  tb.rest.assign(size_t(2 * p.num_ops), 0.0);
  double tail = 0, scale = std::fabs(p.constant_time_s);
  for (int64_t s = p.num_segments - 1; s >= 0; --s) {
    double seg_least = kInf, seg_abs = 0;
    for (int64_t v = 0; v < p.seg_num_variants[s]; ++v) {
      double within = p.seg_extra_time_s[2 * s + v], abs_sum = std::fabs(within);
      for (int64_t i = p.seg_first_op[s] + p.seg_num_ops[s] - 1; i >= p.seg_first_op[s]; --i) {
        tb.rest[size_t(2 * i + v)] = within + tail;
        double least = kInf, most = 0;
        for (int64_t k = kept_at[2 * i + v]; k < kept_at[2 * i + v + 1]; ++k) {
          least = std::min(least, p.opt_time_s[kept[k]]);
          most = std::max(most, std::fabs(p.opt_time_s[kept[k]]));
        }
        within += least;  // an op without options ends every path: +inf, nothing dropped wrongly
        abs_sum += most;
      }
      seg_least = std::min(seg_least, within);
      seg_abs = std::max(seg_abs, abs_sum);
    }
    tail += seg_least;
    scale += seg_abs;
  }
  tb.limit = p.time_bound + 1e-9 * (std::fabs(p.time_bound) + scale);
  return tb;
}

// Trim [*lo, *hi] of states whose time plus rest exceeds tb.limit (see [Note: time bound]).
void trim_slow(const TimeBound& tb, const double* t, double rest, int64_t* lo, int64_t* hi) {
  if (!(tb.limit < kInf)) return;
  while (*lo <= *hi && !(t[*lo] + rest <= tb.limit)) ++*lo;
  while (*hi >= *lo && !(t[*hi] + rest <= tb.limit)) --*hi;
}

struct Table {  // winners for states lo .. lo + size - 1
  int64_t lo = 0;
  std::vector<uint16_t> op;    // per op and variant: option - opt_begin
  std::vector<int8_t> var;     // per segment: variant
};

}  // namespace

void validate(const ProblemView& p) {
  const int64_t S = p.num_segments, n = p.num_ops, P = p.num_options;
  if (S < 1 || n < 1)
    fail("SearchProblem needs at least one segment and one op (S=" + std::to_string(S) +
         ", n=" + std::to_string(n) + ")");
  if (!(p.quantum_bytes > 0) || !std::isfinite(p.quantum_bytes))
    fail("SearchProblem.quantum_bytes must be > 0 and finite");
  if (!std::isfinite(p.budget_bytes) || !std::isfinite(p.constant_time_s))
    fail("SearchProblem budget_bytes and constant_time_s must be finite");
  int64_t next = 0;
  for (int64_t s = 0; s < S; ++s) {
    if (p.seg_first_op[s] != next || p.seg_num_ops[s] < 1)
      fail("segments must be contiguous and cover ops 0..n-1 in order (segment " +
           std::to_string(s) + ")");
    next += p.seg_num_ops[s];
    if (p.seg_num_variants[s] != 1 && p.seg_num_variants[s] != 2)
      fail("SearchProblem.seg_num_variants must be 1 or 2");
    for (int v = 0; v < 2; ++v) {
      if (p.seg_carry_act_q[2 * s + v] < 0) fail("SearchProblem.seg_carry_act_q must be >= 0");
      if (!std::isfinite(p.seg_extra_time_s[2 * s + v]))
        fail("SearchProblem.seg_extra_time_s must be finite");
    }
  }
  if (next != n) fail("segments must be contiguous and cover ops 0..n-1 in order");
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t i = p.seg_first_op[s]; i < p.seg_first_op[s] + p.seg_num_ops[s]; ++i) {
      for (int64_t v = 0; v < p.seg_num_variants[s]; ++v) {
        const int64_t b = p.opt_begin[2 * i + v], e = p.opt_end[2 * i + v];
        if (b < 0 || e < b || e > P)
          fail("option range of op " + std::to_string(i) + " variant " + std::to_string(v) +
               " is not inside [0, " + std::to_string(P) + ")");
        if (e - b > kMaxOptionsPerOp)
          fail("an op has more than 65535 options under one variant");
        const double a = p.act_in_segment_bytes[2 * i + v];
        if (!(a >= 0) || !std::isfinite(a))
          fail("SearchProblem.act_in_segment_bytes must be >= 0 and finite");
      }
    }
  }
  for (int64_t o = 0; o < P; ++o) {
    if (p.opt_held_q[o] < 0) fail("SearchProblem.opt_held_q must be >= 0");
    if (!(p.opt_local_bytes[o] >= 0) || !std::isfinite(p.opt_local_bytes[o]))
      fail("SearchProblem.opt_local_bytes must be >= 0 and finite");
    if (!std::isfinite(p.opt_time_s[o])) fail("SearchProblem.opt_time_s must be finite");
  }
}

int64_t num_buckets(const ProblemView& p) {
  // cap: the largest state any plan reaches (the per-segment max over variants)
  int64_t cap = 0;
  for (int64_t s = 0; s < p.num_segments; ++s) {
    int64_t best = 0;
    for (int64_t v = 0; v < p.seg_num_variants[s]; ++v) {
      int64_t acc = s + 1 < p.num_segments ? p.seg_carry_act_q[2 * s + v] : 0;
      for (int64_t i = p.seg_first_op[s]; i < p.seg_first_op[s] + p.seg_num_ops[s]; ++i) {
        int64_t m = 0;
        for (int64_t o = p.opt_begin[2 * i + v]; o < p.opt_end[2 * i + v]; ++o)
          m = std::max(m, p.opt_held_q[o]);
        acc += m;
      }
      best = std::max(best, acc);
    }
    cap += best;
  }
  const double q = p.quantum_bytes, budget = p.budget_bytes;
  if (!(budget >= 0)) return -1;
  const double g = std::min(std::floor(budget / q), double(cap) + 1);
  int64_t b = int64_t(g);
  while (b >= 0 && double(b) * q > budget) --b;
  while (b < cap && double(b + 1) * q <= budget) ++b;
  b = std::min(b, cap);
  if (b + 1 > p.max_buckets)
    fail(std::to_string(b + 1) + " memory buckets exceed the limit of " +
         std::to_string(p.max_buckets) + "; use a larger quantum_bytes");
  return b;
}

std::vector<std::string> available_isas() {
  std::vector<std::string> out = {"scalar"};
#ifdef OSDP_HAVE_X86_KERNELS
  if (__builtin_cpu_supports("avx2")) out.push_back("avx2");
  if (__builtin_cpu_supports("avx512f")) out.push_back("avx512");
#endif
  return out;
}

// [Note: feasibility] (osdp/planner/search.py): the least state reachable after each op,
// the same memory test as the DP. Mirrors feasible() there step for step.
bool feasible(const ProblemView& p) {
  if (num_buckets(p) < 0) return false;
  const double q = p.quantum_bytes, budget = p.budget_bytes;
  int64_t least = 0;  // the least state entering the segment
  for (int64_t s = 0; s < p.num_segments; ++s) {
    int64_t after = -1;
    for (int64_t v = 0; v < p.seg_num_variants[s]; ++v) {
      int64_t y = least;
      for (int64_t i = p.seg_first_op[s]; y >= 0 && i < p.seg_first_op[s] + p.seg_num_ops[s]; ++i) {
        int64_t next = -1;
        for (int64_t o = p.opt_begin[2 * i + v]; o < p.opt_end[2 * i + v]; ++o) {
          const int64_t z = y + p.opt_held_q[o];
          if (fits(double(z) * q, p.act_in_segment_bytes[2 * i + v], p.opt_local_bytes[o], budget) &&
              (next < 0 || z < next))
            next = z;
        }
        y = next;
      }
      if (y < 0) continue;
      if (s + 1 < p.num_segments) y += p.seg_carry_act_q[2 * s + v];
      if (after < 0 || y < after) after = y;
    }
    if (after < 0) return false;
    least = after;
  }
  return true;
}

Result solve(const ProblemView& p, const std::string& isa) {
  const RelaxFn relax_op = pick_kernel(isa);
  Result r;
  const int64_t S = p.num_segments, n = p.num_ops;
  const int64_t B = num_buckets(p);
  r.num_buckets = B;
  if (B < 0) return r;
  const int64_t N = B + 1;
  const double q = p.quantum_bytes, budget = p.budget_bytes;

  // Options no other option of the same op and variant dominates (ties: lower index),
  // in index order; kept[kept_at[2i+v] .. kept_at[2i+v+1]).
  std::vector<int64_t> kept_at(2 * n + 1, 0), kept;
  int64_t hmax_all = 0;
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t i = p.seg_first_op[s]; i < p.seg_first_op[s] + p.seg_num_ops[s]; ++i) {
      for (int64_t v = 0; v < 2; ++v) {
        kept_at[2 * i + v] = int64_t(kept.size());
        if (v >= p.seg_num_variants[s]) continue;  // unused range: ignored
        const int64_t b = p.opt_begin[2 * i + v], e = p.opt_end[2 * i + v];
        for (int64_t a = b; a < e; ++a) {
          bool dominated = false;
          for (int64_t c = b; c < e && !dominated; ++c) {
            if (c == a) continue;
            const int64_t ha = p.opt_held_q[a], hc = p.opt_held_q[c];
            const double la = p.opt_local_bytes[a], lc = p.opt_local_bytes[c];
            const double ta = p.opt_time_s[a], tc = p.opt_time_s[c];
            const bool weak = hc <= ha && lc <= la && tc <= ta;
            const bool strict = hc < ha || lc < la || tc < ta;
            dominated = weak && (strict || c < a);
          }
          if (!dominated) {
            kept.push_back(a);
            if (p.opt_held_q[a] <= B) hmax_all = std::max(hmax_all, p.opt_held_q[a]);
          }
        }
      }
    }
  }
  kept_at[2 * n] = int64_t(kept.size());

  // State arrays are padded so that relax_op reads and writes whole blocks without
  // bounds checks: x = y - held_q >= -pad_lo, y < N + pad_hi.
  const int64_t pad_lo = hmax_all + kLanes, pad_hi = 2 * kLanes, total = pad_lo + N + pad_hi;
  struct States {
    std::vector<double> t_store, p_store;
    double* t;
    double* p;
    explicit States(int64_t total, int64_t pad)
        : t_store(size_t(total), kInf), p_store(size_t(total), -kInf),
          t(t_store.data() + pad), p(p_store.data() + pad) {}
  };
  States in(total, pad_lo), seg(total, pad_lo), a(total, pad_lo), b(total, pad_lo);
  States* bufs[2] = {&a, &b};
  std::vector<double> qy_store(size_t(total), 0.0);
  double* qy = qy_store.data() + pad_lo;
  for (int64_t y = 0; y < N + pad_hi; ++y) qy[y] = double(y) * q;  // as in search_python
  std::vector<int8_t> seg_v(N);
  const std::vector<int64_t> live_hi = alive_after(p, B, qy, kept, kept_at);
  const TimeBound tb = time_bound_of(p, kept, kept_at);
  std::vector<Table> op_tab(2 * n), seg_tab(S);
  // per op: the kept options that fit somewhere in the reachable range
  std::vector<int64_t> f_held, f_ymax;
  std::vector<double> f_local, f_time, f_rel;
  in.t[0] = p.constant_time_s;
  int64_t lo = 0, hi = 0;

  for (int64_t s = 0; s < S; ++s) {
    const int64_t first = p.seg_first_op[s], count = p.seg_num_ops[s];
    const bool last_seg = s + 1 == S;
    int64_t slo = N, shi = -1;  // range of seg that is initialized
    for (int64_t v = 0; v < p.seg_num_variants[s]; ++v) {
      States* cur = &in;
      int64_t clo = lo, chi = hi;
      int which = 0;
      bool alive = true;
      for (int64_t i = first; i < first + count; ++i) {
        r.states_visited += chi - clo + 1;
        const double act = p.act_in_segment_bytes[2 * i + v];
        const int64_t base = p.opt_begin[2 * i + v];
        f_held.clear();
        f_ymax.clear();
        f_local.clear();
        f_time.clear();
        f_rel.clear();
        int64_t hmin = std::numeric_limits<int64_t>::max(), hmax = -1;
        for (int64_t k = kept_at[2 * i + v]; k < kept_at[2 * i + v + 1]; ++k) {
          const int64_t o = kept[k], h = p.opt_held_q[o];
          if (h > B - clo) continue;  // above B from every reachable state
          const int64_t ymax = max_fitting_state(qy, B, q, act, p.opt_local_bytes[o], budget);
          if (clo + h > ymax) continue;
          f_held.push_back(h);
          f_ymax.push_back(ymax);
          f_local.push_back(p.opt_local_bytes[o]);
          f_time.push_back(p.opt_time_s[o]);
          f_rel.push_back(double(o - base));
          hmin = std::min(hmin, h);
          hmax = std::max(hmax, h);
        }
        if (f_held.empty()) {
          alive = false;
          break;
        }
        // [Note: dead states]: nothing above live_hi[2i+v] can still finish
        const int64_t rlo = clo + hmin, rhi = std::min(std::min(chi + hmax, B), live_hi[2 * i + v]);
        if (rlo > rhi) {
          alive = false;
          break;
        }
        const int64_t nblocks = (rhi - rlo + kLanes) / kLanes;
        // [Note: relax kernel] inputs outside [clo, chi] that the blocks read: unreachable
        std::fill(cur->t + (rlo - hmax), cur->t + clo, kInf);
        std::fill(cur->p + (rlo - hmax), cur->p + clo, -kInf);
        const int64_t xend = rlo + nblocks * kLanes - hmin;  // one past the last x read
        if (xend > chi + 1) {
          std::fill(cur->t + chi + 1, cur->t + xend, kInf);
          std::fill(cur->p + chi + 1, cur->p + xend, -kInf);
        }
        States* nxt = bufs[which];
        Table& tab = op_tab[2 * i + v];
        tab.lo = rlo;
        tab.op.resize(size_t(nblocks * kLanes));
        relax_op(cur->t, cur->p, nxt->t, nxt->p, tab.op.data(), qy, rlo, nblocks, act, budget,
                 f_held.data(), f_local.data(), f_time.data(), f_rel.data(), f_ymax.data(),
                 int64_t(f_held.size()));
        reach_range(nxt->t, rlo, rhi, &clo, &chi);
        if (!tb.rest.empty()) trim_slow(tb, nxt->t, tb.rest[2 * i + v], &clo, &chi);
        if (clo > chi) {
          alive = false;
          break;
        }
        cur = nxt;
        which ^= 1;
      }
      if (!alive) continue;
      // segment end: carried activations (none after the last segment) and extra time
      const int64_t c = last_seg ? 0 : p.seg_carry_act_q[2 * s + v];
      const int64_t ylo = clo + c, yhi = std::min(chi + c, B);
      if (ylo > yhi) continue;
      const int64_t nlo = std::min(slo, ylo), nhi = std::max(shi, yhi);
      for (int64_t y = nlo; y <= nhi; ++y) {
        if (y >= slo && y <= shi) continue;  // already initialized
        seg.t[y] = kInf;
        seg.p[y] = -kInf;
        seg_v[y] = -1;
      }
      slo = nlo;
      shi = nhi;
      const double extra = p.seg_extra_time_s[2 * s + v];
      for (int64_t y = ylo; y <= yhi; ++y) {
        const double t = cur->t[y - c] + extra, pk = cur->p[y - c];
        if (t < seg.t[y] || (t == seg.t[y] && pk < seg.p[y])) {
          seg.t[y] = t;
          seg.p[y] = pk;
          seg_v[y] = int8_t(v);
        }
      }
    }
    if (slo > shi) return r;
    reach_range(seg.t, slo, shi, &lo, &hi);
    if (lo > hi) return r;
    seg_tab[s].lo = lo;
    seg_tab[s].var.assign(seg_v.begin() + lo, seg_v.begin() + hi + 1);
    std::swap(in, seg);
  }

  // best end state: least time, then least peak, then the lowest state
  int64_t y = lo;
  for (int64_t x = lo + 1; x <= hi; ++x)
    if (in.t[x] < in.t[y] || (in.t[x] == in.t[y] && in.p[x] < in.p[y])) y = x;
  if (!(in.t[y] < p.time_bound)) return r;  // [Note: time bound]: none faster
  r.feasible = true;
  r.time_s = in.t[y];
  r.peak_inner_bytes = in.p[y];
  r.option_index.assign(n, -1);
  r.variant.assign(S, -1);
  for (int64_t s = S - 1; s >= 0; --s) {
    const int64_t v = seg_tab[s].var[y - seg_tab[s].lo];
    r.variant[s] = v;
    if (s + 1 < S) y -= p.seg_carry_act_q[2 * s + v];
    for (int64_t i = p.seg_first_op[s] + p.seg_num_ops[s] - 1; i >= p.seg_first_op[s]; --i) {
      const Table& tab = op_tab[2 * i + v];
      const int64_t o = p.opt_begin[2 * i + v] + tab.op[y - tab.lo];
      r.option_index[i] = o;
      y -= p.opt_held_q[o];
    }
  }
  if (y != 0) throw std::logic_error("osdp search: backtracking did not end in the empty prefix");
  return r;
}

}  // namespace search
}  // namespace osdp
