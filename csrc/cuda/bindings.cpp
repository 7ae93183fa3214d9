// pybind11 module osdp_kernels._cuda: the three split-matmul ops on raw device pointers
// (uintptr_t), element strides, dtype codes and a cudaStream_t passed as an integer.
// No torch dependency; osdp_kernels/_cuda_ops.py validates and passes tensor.data_ptr().
#include <pybind11/pybind11.h>

#include <cstdint>

#include "split_matmul.cuh"

namespace py = pybind11;
using osdp::GemmParams;

namespace {

void* ptr(uintptr_t p) { return reinterpret_cast<void*>(p); }
cudaStream_t stream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

// out[M, N] (fp32) += x[:, k0:k0+K] @ w[N, K].T (+ bias); cast (optional) <- out.
void addmm_slice(uintptr_t out, long long out_s0, long long out_s1, uintptr_t x, long long x_s0, long long x_s1,
                 uintptr_t w, long long w_s0, long long w_s1, int M, int N, int K, int in_dtype, uintptr_t bias,
                 long long bias_s, int bias_dtype, uintptr_t cast, long long cast_s0, long long cast_s1,
                 int cast_dtype, uintptr_t s) {
  GemmParams p{ptr(x), x_s0, x_s1, ptr(w), w_s1, w_s0, M, N, K, in_dtype,
               ptr(out), out_s0, out_s1, osdp::kFloat32, /*accumulate=*/true,
               ptr(bias), bias_s, bias_dtype, ptr(cast), cast_s0, cast_s1, cast_dtype};
  osdp::launch_gemm(p, stream(s));
}

// dx_block[M, N] = dy[M, K] @ w[K, N]   (N = ks, K = out_features).
void slice_dx(uintptr_t dx, long long dx_s0, long long dx_s1, int dx_dtype, uintptr_t dy, long long dy_s0,
              long long dy_s1, uintptr_t w, long long w_s0, long long w_s1, int M, int N, int K, int in_dtype,
              uintptr_t s) {
  GemmParams p{ptr(dy), dy_s0, dy_s1, ptr(w), w_s0, w_s1, M, N, K, in_dtype,
               ptr(dx), dx_s0, dx_s1, dx_dtype, /*accumulate=*/false,
               nullptr, 0, 0, nullptr, 0, 0, 0};
  osdp::launch_gemm(p, stream(s));
}

// out[M, N] (=|+=) dy[K, M].T @ x_slice[K, N]   (M = out_features, N = ks, K = tokens).
void slice_dw(uintptr_t out, long long out_s0, long long out_s1, int out_dtype, bool accumulate, uintptr_t dy,
              long long dy_s0, long long dy_s1, uintptr_t x, long long x_s0, long long x_s1, int M, int N, int K,
              int in_dtype, uintptr_t s) {
  GemmParams p{ptr(dy), dy_s1, dy_s0, ptr(x), x_s0, x_s1, M, N, K, in_dtype,
               ptr(out), out_s0, out_s1, out_dtype, accumulate,
               nullptr, 0, 0, nullptr, 0, 0, 0};
  osdp::launch_gemm(p, stream(s));
}

}  // namespace

PYBIND11_MODULE(_cuda, m) {
  m.doc() = "OSDP split-matmul CUDA kernels (raw pointers; see osdp_kernels/_cuda_ops.py)";
  m.def("addmm_slice", &addmm_slice);
  m.def("slice_dx", &slice_dx);
  m.def("slice_dw", &slice_dw);
  m.attr("DTYPE_CODES") = py::dict(py::arg("float32") = 0, py::arg("float16") = 1, py::arg("bfloat16") = 2);
}
