// Split-matmul kernels for OSDP: one tiled GEMM with strided operands and a fused
// epilogue, used for the three per-slice ops (see split_matmul.cu). No torch here:
// callers pass raw pointers, shapes, element strides and dtype codes.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace osdp {

// Must match DTYPE_CODE in osdp_kernels/_cuda_ops.py.
enum DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// C[m, n] (+)= sum_k A[m, k] * B[k, n]; every operand addressed through element strides.
struct GemmParams {
  const void* a; long long a_sm, a_sk;
  const void* b; long long b_sk, b_sn;
  int M, N, K;
  int in_dtype;                       // dtype of A and B
  void* c; long long c_sm, c_sn; int c_dtype;
  bool accumulate;                    // c = c + A@B (c must be fp32) instead of c = A@B
  const void* bias; long long bias_s; int bias_dtype;  // optional, added per column n
  void* cast; long long cast_sm, cast_sn; int cast_dtype;  // optional copy of the result
};

// Launches on `stream`; throws std::runtime_error on bad arguments or launch failure.
void launch_gemm(const GemmParams& p, cudaStream_t stream);

}  // namespace osdp
