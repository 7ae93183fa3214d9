// Exact plan search: the memory-indexed dynamic program of [Note: exact search]
// (osdp/planner/search.py). This file follows search_python() step for step, with the
// same order of updates and the same float expressions, so both return the same plan.
#include "search.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

namespace osdp {
namespace search {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr int64_t kMaxOptionsPerOp = 65535;  // choices are stored as uint16

[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument(msg); }

// The one memory test (same expression as evaluate_assignment): qy = float(y) * quantum.
inline bool fits(double qy, double act, double local, double budget) {
  return (qy + act) + local <= budget;
}

// Relax one option over `len` consecutive input states: out[k] <- in[k] + option when
// that is lexicographically smaller in (time, peak). Every k here fits in memory
// (the caller clipped the range), unreachable inputs carry time = inf and never win.
// Branch-free so that the compiler vectorizes it.
void relax(const double* __restrict tin, const double* __restrict pin,
           double* __restrict tout, double* __restrict pout, uint16_t* __restrict cout,
           const double* __restrict qy, int64_t len, double act, double local, double time,
           uint16_t rel) {
  for (int64_t k = 0; k < len; ++k) {
    const double mem = (qy[k] + act) + local;
    const double t = tin[k] + time;
    const double pk = pin[k] < mem ? mem : pin[k];
    const double ot = tout[k], op = pout[k];
    const bool better = (t < ot) | ((t == ot) & (pk < op));
    tout[k] = better ? t : ot;
    pout[k] = better ? pk : op;
    cout[k] = better ? rel : cout[k];
  }
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
int64_t max_fitting_state(const std::vector<double>& qy, int64_t B, double q, double act,
                          double local, double budget) {
  double g = std::floor((budget - act - local) / q);
  int64_t y = g < -1 ? -1 : (g > double(B) ? B : int64_t(g));
  while (y >= 0 && !fits(qy[y], act, local, budget)) --y;
  while (y < B && fits(qy[y + 1], act, local, budget)) ++y;
  return y;
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

Result solve(const ProblemView& p) {
  Result r;
  const int64_t S = p.num_segments, n = p.num_ops;
  const int64_t B = num_buckets(p);
  r.num_buckets = B;
  if (B < 0) return r;
  const int64_t N = B + 1;
  const double q = p.quantum_bytes, budget = p.budget_bytes;

  std::vector<double> qy(N);
  for (int64_t y = 0; y < N; ++y) qy[y] = double(y) * q;

  // Options no other option of the same op and variant dominates (ties: lower index),
  // in index order; kept[kept_at[2i+v] .. kept_at[2i+v+1]).
  std::vector<int64_t> kept_at(2 * n + 1, 0), kept;
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
          if (!dominated) kept.push_back(a);
        }
      }
    }
  }
  kept_at[2 * n] = int64_t(kept.size());

  std::vector<double> in_t(N, kInf), in_p(N, -kInf), seg_t(N), seg_p(N);
  std::vector<double> buf_t[2] = {std::vector<double>(N), std::vector<double>(N)};
  std::vector<double> buf_p[2] = {std::vector<double>(N), std::vector<double>(N)};
  std::vector<int8_t> seg_v(N);
  std::vector<Table> op_tab(2 * n), seg_tab(S);
  in_t[0] = p.constant_time_s;
  int64_t lo = 0, hi = 0;

  for (int64_t s = 0; s < S; ++s) {
    const int64_t first = p.seg_first_op[s], count = p.seg_num_ops[s];
    const bool last_seg = s + 1 == S;
    int64_t slo = N, shi = -1;  // range of seg_* that is initialized
    for (int64_t v = 0; v < p.seg_num_variants[s]; ++v) {
      const double* ct = in_t.data();
      const double* cp = in_p.data();
      int64_t clo = lo, chi = hi;
      int which = 0;
      bool alive = true;
      for (int64_t i = first; i < first + count; ++i) {
        r.states_visited += chi - clo + 1;
        const int64_t kb = kept_at[2 * i + v], ke = kept_at[2 * i + v + 1];
        int64_t hmin = std::numeric_limits<int64_t>::max(), hmax = -1;
        for (int64_t k = kb; k < ke; ++k) {
          hmin = std::min(hmin, p.opt_held_q[kept[k]]);
          hmax = std::max(hmax, p.opt_held_q[kept[k]]);
        }
        if (kb == ke || clo + hmin > B) {
          alive = false;
          break;
        }
        const int64_t rlo = clo + hmin, rhi = std::min(chi + hmax, B);
        double* nt = buf_t[which].data();
        double* np = buf_p[which].data();
        std::fill(nt + rlo, nt + rhi + 1, kInf);
        std::fill(np + rlo, np + rhi + 1, -kInf);
        Table& tab = op_tab[2 * i + v];
        tab.lo = rlo;
        tab.op.assign(size_t(rhi - rlo + 1), 0);
        const double act = p.act_in_segment_bytes[2 * i + v];
        const int64_t base = p.opt_begin[2 * i + v];
        for (int64_t k = kb; k < ke; ++k) {
          const int64_t o = kept[k], h = p.opt_held_q[o];
          const double local = p.opt_local_bytes[o];
          const int64_t ylo = clo + h;
          const int64_t yhi = std::min({chi + h, B, max_fitting_state(qy, B, q, act, local, budget)});
          if (ylo > yhi) continue;
          relax(ct + clo, cp + clo, nt + ylo, np + ylo, tab.op.data() + (ylo - rlo), qy.data() + ylo,
                yhi - ylo + 1, act, local, p.opt_time_s[o], uint16_t(o - base));
        }
        reach_range(nt, rlo, rhi, &clo, &chi);
        if (clo > chi) {
          alive = false;
          break;
        }
        ct = nt;
        cp = np;
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
        seg_t[y] = kInf;
        seg_p[y] = -kInf;
        seg_v[y] = -1;
      }
      slo = nlo;
      shi = nhi;
      const double extra = p.seg_extra_time_s[2 * s + v];
      for (int64_t y = ylo; y <= yhi; ++y) {
        const double t = ct[y - c] + extra, pk = cp[y - c];
        if (t < seg_t[y] || (t == seg_t[y] && pk < seg_p[y])) {
          seg_t[y] = t;
          seg_p[y] = pk;
          seg_v[y] = int8_t(v);
        }
      }
    }
    if (slo > shi) return r;
    reach_range(seg_t.data(), slo, shi, &lo, &hi);
    if (lo > hi) return r;
    seg_tab[s].lo = lo;
    seg_tab[s].var.assign(seg_v.begin() + lo, seg_v.begin() + hi + 1);
    std::swap(in_t, seg_t);
    std::swap(in_p, seg_p);
  }

  // best end state: least time, then least peak, then the lowest state
  int64_t y = lo;
  for (int64_t x = lo + 1; x <= hi; ++x)
    if (in_t[x] < in_t[y] || (in_t[x] == in_t[y] && in_p[x] < in_p[y])) y = x;
  r.feasible = true;
  r.time_s = in_t[y];
  r.peak_inner_bytes = in_p[y];
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
