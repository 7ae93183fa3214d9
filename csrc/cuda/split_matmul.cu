// Tiled GEMM: 128x128x32 block tile, 8 warps each owning a 64x32 warp tile.
// fp16/bf16 operands go through WMMA tensor cores (16x16x16, fp32 accumulators);
// fp32 operands take a plain FMA path on the same tiling (exact fp32, like torch's
// default with TF32 off). Operands are copied global->shared in their own layout (the
// unit-stride dimension stays contiguous, 16-byte vector loads when aligned) and read
// by WMMA as row_major or col_major accordingly, so no operand is ever transposed.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <stdexcept>
#include <string>
#include <type_traits>

#include "split_matmul.cuh"

namespace osdp {
namespace {

using namespace nvcuda;

constexpr int BM = 128, BN = 128, BK = 32, PAD = 8;
constexpr int WARP_M = 64, WARP_N = 32, THREADS = 256;  // warps laid out 2 (m) x 4 (n)
constexpr int GROUP_M = 8;

__device__ __forceinline__ float load_f32(const void* p, int dtype, long long i) {
  switch (dtype) {
    case kFloat16: return __half2float(static_cast<const __half*>(p)[i]);
    case kBFloat16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

__device__ __forceinline__ void store_f32(void* p, int dtype, long long i, float v) {
  switch (dtype) {  // round-to-nearest-even conversions
    case kFloat16: static_cast<__half*>(p)[i] = __float2half_rn(v); break;
    case kBFloat16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v); break;
    default: static_cast<float*>(p)[i] = v;
  }
}

// [Note: epilogue] everything after the K loop happens here, once per element: the
// fp32 accumulator add (main grad / addmm accumulator), bias, the store in c's dtype
// and the fused cast copy. Elements outside [M, N) are never touched, which is what
// keeps slice_dx inside its column block of dx.
__device__ __forceinline__ void epilogue(const GemmParams& p, int m, int n, float v) {
  if (m >= p.M || n >= p.N) return;
  const long long ci = m * p.c_sm + n * p.c_sn;
  if (p.accumulate) v += static_cast<const float*>(p.c)[ci];
  if (p.bias) v += load_f32(p.bias, p.bias_dtype, n * p.bias_s);
  store_f32(p.c, p.c_dtype, ci, v);
  if (p.cast) store_f32(p.cast, p.cast_dtype, m * p.cast_sm + n * p.cast_sn, v);
}

// Copy a ROWS x COLS tile (COLS contiguous in global memory, leading stride g_ld) to
// shared memory with leading dimension LDS, zero-filling outside rows_ok x cols_ok.
template <typename T, int ROWS, int COLS, int LDS>
__device__ __forceinline__ void load_tile(T* s, const T* g, long long g_ld, int rows_ok, int cols_ok,
                                          bool vec_ok) {
  constexpr int VEC = 16 / sizeof(T);
  constexpr int VPR = COLS / VEC;  // vectors per row
  for (int idx = threadIdx.x; idx < ROWS * VPR; idx += THREADS) {
    const int r = idx / VPR, c = (idx % VPR) * VEC;
    T* dst = s + r * LDS + c;
    const T* src = g + r * g_ld + c;
    if (vec_ok && r < rows_ok && c + VEC <= cols_ok) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i)
        dst[i] = (r < rows_ok && c + i < cols_ok) ? src[i] : T(0.0f);
    }
  }
}

// Shared-memory geometry of one operand: K-major tiles are [outer][BK+PAD],
// M/N-major tiles are [BK][outer+PAD]. Leading dims stay multiples of 16 bytes
// (vector stores, WMMA ldm) and break bank-conflict strides.
template <bool KMAJOR, int OUTER>
struct Smem {
  static constexpr int LD = KMAJOR ? BK + PAD : OUTER + PAD;
  static constexpr int ELEMS = KMAJOR ? OUTER * LD : BK * LD;
  __device__ static int at(int outer, int k) { return KMAJOR ? outer * LD + k : k * LD + outer; }
};

template <typename T, bool A_KMAJOR, bool B_KMAJOR>
__global__ void __launch_bounds__(THREADS) gemm_kernel(GemmParams p) {
  using SA = Smem<A_KMAJOR, BM>;
  using SB = Smem<B_KMAJOR, BN>;
  constexpr int BYTES = (SA::ELEMS + SB::ELEMS) * sizeof(T);
  static_assert(BYTES >= 8 * 256 * sizeof(float), "epilogue scratch reuses the operand tiles");
  __shared__ __align__(128) unsigned char smem[BYTES];
  T* sA = reinterpret_cast<T*>(smem);
  T* sB = sA + SA::ELEMS;  // ELEMS*sizeof(T) is a multiple of 32 bytes (WMMA alignment)

  // Grouped tile order: GROUP_M row-tiles walk the column-tiles together (L2 reuse of B).
  const int tiles_m = (p.M + BM - 1) / BM, tiles_n = (p.N + BN - 1) / BN;
  const int per_group = GROUP_M * tiles_n, pid = blockIdx.x;
  const int first_m = (pid / per_group) * GROUP_M;
  const int group_rows = min(tiles_m - first_m, GROUP_M);
  const int m0 = (first_m + (pid % per_group) % group_rows) * BM;
  const int n0 = ((pid % per_group) / group_rows) * BN;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm = (warp / 4) * WARP_M, wn = (warp % 4) * WARP_N;

  const T* A = static_cast<const T*>(p.a);
  const T* B = static_cast<const T*>(p.b);
  // 16-byte vector loads need every tile row to start 16-byte aligned.
  const long long a_ld = A_KMAJOR ? p.a_sm : p.a_sk, b_ld = B_KMAJOR ? p.b_sn : p.b_sk;
  const bool a_vec = (reinterpret_cast<uintptr_t>(A) % 16 == 0) && ((a_ld * sizeof(T)) % 16 == 0);
  const bool b_vec = (reinterpret_cast<uintptr_t>(B) % 16 == 0) && ((b_ld * sizeof(T)) % 16 == 0);

  constexpr bool TC = !std::is_same<T, float>::value;
  using LayoutA = typename std::conditional<A_KMAJOR, wmma::row_major, wmma::col_major>::type;
  using LayoutB = typename std::conditional<B_KMAJOR, wmma::col_major, wmma::row_major>::type;
  using FragT = typename std::conditional<TC, T, __half>::type;  // unused for fp32
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[WARP_M / 16][WARP_N / 16];
  float facc[16][4];  // fp32 path: rows wm + lane/8 + 4i, cols wn + lane%8 + 8j
  if constexpr (TC) {
#pragma unroll
    for (int i = 0; i < WARP_M / 16; ++i)
#pragma unroll
      for (int j = 0; j < WARP_N / 16; ++j) wmma::fill_fragment(acc[i][j], 0.0f);
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) facc[i][j] = 0.0f;
  }

  for (int k0 = 0; k0 < p.K; k0 += BK) {
    const int m_ok = p.M - m0, n_ok = p.N - n0, k_ok = p.K - k0;
    const T* a_tile = A + m0 * p.a_sm + k0 * p.a_sk;
    const T* b_tile = B + k0 * p.b_sk + n0 * p.b_sn;
    if constexpr (A_KMAJOR) load_tile<T, BM, BK, SA::LD>(sA, a_tile, p.a_sm, m_ok, k_ok, a_vec);
    else load_tile<T, BK, BM, SA::LD>(sA, a_tile, p.a_sk, k_ok, m_ok, a_vec);
    if constexpr (B_KMAJOR) load_tile<T, BN, BK, SB::LD>(sB, b_tile, p.b_sn, n_ok, k_ok, b_vec);
    else load_tile<T, BK, BN, SB::LD>(sB, b_tile, p.b_sk, k_ok, n_ok, b_vec);
    __syncthreads();
    if constexpr (TC) {
#pragma unroll
      for (int kk = 0; kk < BK; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, FragT, LayoutA> fa[WARP_M / 16];
        wmma::fragment<wmma::matrix_b, 16, 16, 16, FragT, LayoutB> fb[WARP_N / 16];
#pragma unroll
        for (int i = 0; i < WARP_M / 16; ++i)
          wmma::load_matrix_sync(fa[i], reinterpret_cast<const FragT*>(sA) + SA::at(wm + 16 * i, kk), SA::LD);
#pragma unroll
        for (int j = 0; j < WARP_N / 16; ++j)
          wmma::load_matrix_sync(fb[j], reinterpret_cast<const FragT*>(sB) + SB::at(wn + 16 * j, kk), SB::LD);
#pragma unroll
        for (int i = 0; i < WARP_M / 16; ++i)
#pragma unroll
          for (int j = 0; j < WARP_N / 16; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
      }
    } else {
      // Two-level sum (see osdp_kernels/_common.py, [Note: fp32 two-level sum]): the
      // BK products of this tile chain into `part`, which is then added to `facc`.
      const int r = lane / 8, c = lane % 8;
      float part[16][4];
#pragma unroll
      for (int i = 0; i < 16; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) part[i][j] = 0.0f;
#pragma unroll 4
      for (int kk = 0; kk < BK; ++kk) {
        float av[16], bv[4];
#pragma unroll
        for (int i = 0; i < 16; ++i) av[i] = static_cast<float>(sA[SA::at(wm + r + 4 * i, kk)]);
#pragma unroll
        for (int j = 0; j < 4; ++j) bv[j] = static_cast<float>(sB[SB::at(wn + c + 8 * j, kk)]);
#pragma unroll
        for (int i = 0; i < 16; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) part[i][j] = fmaf(av[i], bv[j], part[i][j]);
      }
#pragma unroll
      for (int i = 0; i < 16; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) facc[i][j] += part[i][j];
    }
    __syncthreads();  // tiles are overwritten next step (and reused as scratch below)
  }

  if constexpr (TC) {
    float* scratch = reinterpret_cast<float*>(smem) + warp * 256;
#pragma unroll
    for (int i = 0; i < WARP_M / 16; ++i)
#pragma unroll
      for (int j = 0; j < WARP_N / 16; ++j) {
        wmma::store_matrix_sync(scratch, acc[i][j], 16, wmma::mem_row_major);
        __syncwarp();
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const int idx = e * 32 + lane;  // consecutive lanes -> consecutive columns
          epilogue(p, m0 + wm + 16 * i + idx / 16, n0 + wn + 16 * j + idx % 16, scratch[idx]);
        }
        __syncwarp();
      }
  } else {
    const int r = lane / 8, c = lane % 8;
#pragma unroll
    for (int i = 0; i < 16; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) epilogue(p, m0 + wm + r + 4 * i, n0 + wn + c + 8 * j, facc[i][j]);
  }
}

template <typename T>
void launch_typed(const GemmParams& p, cudaStream_t stream) {
  const bool a_k = p.a_sk == 1, b_k = p.b_sk == 1;
  if (!a_k && p.a_sm != 1) throw std::invalid_argument("A needs a unit stride along m or k");
  if (!b_k && p.b_sn != 1) throw std::invalid_argument("B needs a unit stride along k or n");
  const long long tiles = (long long)((p.M + BM - 1) / BM) * ((p.N + BN - 1) / BN);
  if (tiles > 0x7fffffffLL) throw std::invalid_argument("problem too large for a 1-D grid");
  dim3 grid((unsigned)tiles), block(THREADS);
  if (a_k && b_k) gemm_kernel<T, true, true><<<grid, block, 0, stream>>>(p);
  else if (a_k) gemm_kernel<T, true, false><<<grid, block, 0, stream>>>(p);
  else if (b_k) gemm_kernel<T, false, true><<<grid, block, 0, stream>>>(p);
  else gemm_kernel<T, false, false><<<grid, block, 0, stream>>>(p);
}

}  // namespace

void launch_gemm(const GemmParams& p, cudaStream_t stream) {
  if (p.M < 0 || p.N < 0 || p.K < 0) throw std::invalid_argument("negative shape");
  if (p.accumulate && p.c_dtype != kFloat32) throw std::invalid_argument("accumulate needs an fp32 output");
  if (p.M == 0 || p.N == 0) return;
  switch (p.in_dtype) {
    case kFloat32: launch_typed<float>(p, stream); break;
    case kFloat16: launch_typed<__half>(p, stream); break;
    case kBFloat16: launch_typed<__nv_bfloat16>(p, stream); break;
    default: throw std::invalid_argument("unknown input dtype code " + std::to_string(p.in_dtype));
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string("split-matmul launch failed: ") + cudaGetErrorString(err));
}

}  // namespace osdp
