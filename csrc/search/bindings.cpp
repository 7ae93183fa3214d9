// osdp._C: numpy in, dict out. The Python wrapper (osdp/planner/search.py) validates the
// SearchProblem first; the checks here keep the core safe when called directly.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "search.h"

namespace py = pybind11;
using osdp::search::ProblemView;
using osdp::search::Result;

namespace {

// A C-contiguous numpy array of T with the given shape (-1: any length, recorded in *len).
template <typename T>
const T* view(const py::object& obj, const char* name, std::vector<int64_t> shape,
              int64_t* len = nullptr) {
  const std::string field = std::string("SearchProblem.") + name;
  if (!py::isinstance<py::array>(obj)) throw std::invalid_argument(field + " must be a numpy array");
  if (!py::isinstance<py::array_t<T>>(obj))
    throw std::invalid_argument(field + " must have dtype " +
                                std::string(py::str(py::dtype::of<T>())) + ", got " +
                                std::string(py::str(obj.attr("dtype"))));
  auto a = py::reinterpret_borrow<py::array>(obj);
  bool ok = a.ndim() == py::ssize_t(shape.size());
  for (size_t d = 0; ok && d < shape.size(); ++d) {
    if (shape[d] < 0) {
      shape[d] = a.shape(d);
      if (len) *len = a.shape(d);
    }
    ok = a.shape(d) == shape[d];
  }
  if (!ok) {
    std::string want = "(";
    for (auto s : shape) want += (s < 0 ? std::string("?") : std::to_string(s)) + ",";
    throw std::invalid_argument(field + " has shape " + std::string(py::str(obj.attr("shape"))) +
                                ", expected " + want + ")");
  }
  if (!(a.flags() & py::array::c_style)) throw std::invalid_argument(field + " must be C-contiguous");
  return static_cast<const T*>(a.data());
}

ProblemView make_view(py::object seg_first_op, py::object seg_num_ops, py::object seg_num_variants,
                      py::object seg_carry_act_q, py::object seg_extra_time_s,
                      py::object act_in_segment_bytes, py::object opt_begin, py::object opt_end,
                      py::object opt_held_q, py::object opt_local_bytes, py::object opt_time_s,
                      double quantum_bytes, double budget_bytes, double constant_time_s,
                      int64_t max_buckets) {
  ProblemView p;
  p.seg_first_op = view<int64_t>(seg_first_op, "seg_first_op", {-1}, &p.num_segments);
  const int64_t S = p.num_segments;
  p.seg_num_ops = view<int64_t>(seg_num_ops, "seg_num_ops", {S});
  p.seg_num_variants = view<int64_t>(seg_num_variants, "seg_num_variants", {S});
  p.seg_carry_act_q = view<int64_t>(seg_carry_act_q, "seg_carry_act_q", {S, 2});
  p.seg_extra_time_s = view<double>(seg_extra_time_s, "seg_extra_time_s", {S, 2});
  p.act_in_segment_bytes = view<double>(act_in_segment_bytes, "act_in_segment_bytes", {-1, 2}, &p.num_ops);
  const int64_t n = p.num_ops;
  p.opt_begin = view<int64_t>(opt_begin, "opt_begin", {n, 2});
  p.opt_end = view<int64_t>(opt_end, "opt_end", {n, 2});
  p.opt_held_q = view<int64_t>(opt_held_q, "opt_held_q", {-1}, &p.num_options);
  const int64_t P = p.num_options;
  p.opt_local_bytes = view<double>(opt_local_bytes, "opt_local_bytes", {P});
  p.opt_time_s = view<double>(opt_time_s, "opt_time_s", {P});
  p.quantum_bytes = quantum_bytes;
  p.budget_bytes = budget_bytes;
  p.constant_time_s = constant_time_s;
  p.max_buckets = max_buckets;
  return p;
}

py::dict search(py::object seg_first_op, py::object seg_num_ops, py::object seg_num_variants,
                py::object seg_carry_act_q, py::object seg_extra_time_s,
                py::object act_in_segment_bytes, py::object opt_begin, py::object opt_end,
                py::object opt_held_q, py::object opt_local_bytes, py::object opt_time_s,
                double quantum_bytes, double budget_bytes, double constant_time_s,
                int64_t max_buckets, const std::string& isa, double time_bound) {
  ProblemView p = make_view(seg_first_op, seg_num_ops, seg_num_variants, seg_carry_act_q, seg_extra_time_s,
                            act_in_segment_bytes, opt_begin, opt_end, opt_held_q, opt_local_bytes,
                            opt_time_s, quantum_bytes, budget_bytes, constant_time_s, max_buckets);
  p.time_bound = time_bound;

  Result r;
  {
    // The arrays stay alive (owned by the caller's frame) while the GIL is released.
    py::gil_scoped_release release;
    osdp::search::validate(p);
    r = osdp::search::solve(p, isa);
  }
  py::dict out;
  out["feasible"] = r.feasible;
  out["time_s"] = r.time_s;
  out["peak_inner_bytes"] = r.peak_inner_bytes;
  out["option_index"] = py::array_t<int64_t>(py::ssize_t(r.option_index.size()), r.option_index.data());
  out["variant"] = py::array_t<int64_t>(py::ssize_t(r.variant.size()), r.variant.data());
  out["states_visited"] = r.states_visited;
  out["num_buckets"] = r.num_buckets;
  return out;
}

bool feasible(py::object seg_first_op, py::object seg_num_ops, py::object seg_num_variants,
              py::object seg_carry_act_q, py::object seg_extra_time_s, py::object act_in_segment_bytes,
              py::object opt_begin, py::object opt_end, py::object opt_held_q, py::object opt_local_bytes,
              py::object opt_time_s, double quantum_bytes, double budget_bytes, double constant_time_s,
              int64_t max_buckets) {
  const ProblemView p = make_view(seg_first_op, seg_num_ops, seg_num_variants, seg_carry_act_q,
                                  seg_extra_time_s, act_in_segment_bytes, opt_begin, opt_end, opt_held_q,
                                  opt_local_bytes, opt_time_s, quantum_bytes, budget_bytes,
                                  constant_time_s, max_buckets);
  py::gil_scoped_release release;
  osdp::search::validate(p);
  return osdp::search::feasible(p);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "OSDP native core: exact plan search (see osdp/planner/search.py)";
  m.def("search", &search, py::kw_only(), py::arg("seg_first_op"), py::arg("seg_num_ops"),
        py::arg("seg_num_variants"), py::arg("seg_carry_act_q"), py::arg("seg_extra_time_s"),
        py::arg("act_in_segment_bytes"), py::arg("opt_begin"), py::arg("opt_end"),
        py::arg("opt_held_q"), py::arg("opt_local_bytes"), py::arg("opt_time_s"),
        py::arg("quantum_bytes"), py::arg("budget_bytes"), py::arg("constant_time_s"),
        py::arg("max_buckets") = int64_t(1) << 24, py::arg("isa") = "auto",
        py::arg("time_bound") = std::numeric_limits<double>::infinity(),
        "Optimum of one SearchProblem's tables (exact; see [Note: exact search]).\n"
        "Returns a dict: feasible, time_s, peak_inner_bytes (without static_bytes),\n"
        "option_index[n], variant[S], states_visited, num_buckets.\n"
        "isa: relax kernel, 'auto' or one of available_isas() (all give the same result).\n"
        "time_bound: only a plan faster than this is wanted; none: not feasible ([Note: time bound]).");
  m.def("feasible", &feasible, py::kw_only(), py::arg("seg_first_op"), py::arg("seg_num_ops"),
        py::arg("seg_num_variants"), py::arg("seg_carry_act_q"), py::arg("seg_extra_time_s"),
        py::arg("act_in_segment_bytes"), py::arg("opt_begin"), py::arg("opt_end"),
        py::arg("opt_held_q"), py::arg("opt_local_bytes"), py::arg("opt_time_s"),
        py::arg("quantum_bytes"), py::arg("budget_bytes"), py::arg("constant_time_s"),
        py::arg("max_buckets") = int64_t(1) << 24,
        "Whether any plan of the tables fits (search's feasible, in one pass: [Note: feasibility]).");
  m.def("available_isas", &osdp::search::available_isas,
        "Relax kernels this build and CPU can run (for tests and benchmarks).");
}
