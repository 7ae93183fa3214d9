// Exact plan search core: see [Note: exact search] in osdp/planner/search.py.
// Plain C++17, no Python or torch: bindings.cpp adapts numpy arrays to ProblemView.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace osdp {
namespace search {

// Borrowed views of the flat tables of osdp.planner.search_problem.SearchProblem
// (row-major; [S, 2] and [n, 2] tables are indexed as x[2 * row + variant]).
struct ProblemView {
  int64_t num_segments = 0, num_ops = 0, num_options = 0;
  const int64_t* seg_first_op = nullptr;      // [S]
  const int64_t* seg_num_ops = nullptr;       // [S]
  const int64_t* seg_num_variants = nullptr;  // [S]
  const int64_t* seg_carry_act_q = nullptr;   // [S, 2]
  const double* seg_extra_time_s = nullptr;   // [S, 2]
  const double* act_in_segment_bytes = nullptr;  // [n, 2]
  const int64_t* opt_begin = nullptr;         // [n, 2]
  const int64_t* opt_end = nullptr;           // [n, 2]
  const int64_t* opt_held_q = nullptr;        // [P]
  const double* opt_local_bytes = nullptr;    // [P]
  const double* opt_time_s = nullptr;         // [P]
  double quantum_bytes = 1, budget_bytes = 0, constant_time_s = 0;
  int64_t max_buckets = int64_t(1) << 24;     // refuse problems with more states
  // only plans faster than this are wanted ([Note: time bound]); +inf: the optimum
  double time_bound = std::numeric_limits<double>::infinity();
};

struct Result {
  bool feasible = false;
  double time_s = 0;            // objective, constant_time_s included
  double peak_inner_bytes = 0;  // max over ops of quantum*prefix + act + local (no static)
  std::vector<int64_t> option_index;  // [n] flat option index per op
  std::vector<int64_t> variant;       // [S]
  int64_t states_visited = 0;
  int64_t num_buckets = -1;     // B
};

// Throws std::invalid_argument (ValueError in Python) on malformed tables.
void validate(const ProblemView& p);

// B, the largest state worth tracking (-1: nothing fits); mirrors num_buckets() in search.py.
int64_t num_buckets(const ProblemView& p);

// The optimum. Call validate() first. isa picks the relax kernel: "auto" (the widest the
// CPU runs) or one of available_isas(); every kernel returns the same result.
Result solve(const ProblemView& p, const std::string& isa = "auto");

// Whether any plan fits: solve(p).feasible in one pass over the options, no DP ([Note:
// feasibility] in osdp/planner/search.py). Call validate() first.
bool feasible(const ProblemView& p);

// Kernels this build and CPU can run, e.g. {"scalar", "avx2", "avx512"}.
std::vector<std::string> available_isas();

}  // namespace search
}  // namespace osdp
