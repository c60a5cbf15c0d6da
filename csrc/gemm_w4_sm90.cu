// NVFP4-weight GEMM for Hopper (sm_90a): Y[M, N] = A[M, K] @ W[N, K]^T, dense and grouped (MoE), with A bf16
// (W4A16) or NVFP4 (W4A4). SPEC 7: the MMA operands are the exact bf16 products q * s_b, fp32 accumulation, and
// g_a[m] * g_w[n] is applied once in the epilogue.
//
// Design note (general tiled path, every M):
//  - mma.sync m16n8k16 bf16 -> fp32; runs for mid-size M (and K % 64 != 0). M >= 256 (rows per expert on
//    average, grouped) runs the bf16 wgmma kernel of gemm_w4_wgmma_sm90.cu;
//    CTA tile 128 (or 64) x 128 x 64, 8 warps in 2 (M) x 4 (N), 3-stage cp.async pipeline (16-byte copies of A,
//    FP4 codes and 4-byte scale words; byte copies only when K is not a multiple of 64).
//  - FP4 stays FP4 in global and shared memory; each warp dequantizes its own B (and, for W4A4, A) fragments in
//    registers. The m16n8k16 fragment of one thread holds the k pairs (2t, 2t+1) and (2t+8, 2t+9): exactly one
//    packed code byte each, so one byte -> one bf16x2 register with 6 integer ops:
//        x = b | b << 12;  r = (x & 0x00080008) << 12 | (x & 0x00070007) << 6
//    which places (sign, exponent, mantissa) of E2M1 into a bf16 whose value is q * 2^-126 (E2M1 subnormal 0.5
//    becomes the bf16 subnormal 2^-127, all exact). The block scale is pre-multiplied by 2^119 (exact in fp32 and
//    bf16: 448 * 2^119 < 2^128), so one bf16x2 multiply gives q * s * 2^-7, exact (<= 6 significant bits, normal
//    range). The 2^7 (2^14 for W4A4) is put back with an exact power-of-two multiply in the epilogue.
//  - Shared memory of the codes uses a 16-byte-chunk XOR swizzle (chunk ^= (row >> 2) & 1) so the byte loads of a
//    warp hit distinct banks; bf16 A uses the usual 8-chunk XOR swizzle for conflict-free ldmatrix.
//  - Grouped (MoE): one launch covers all experts. blockIdx.y enumerates the concatenated M tiles of all experts;
//    each CTA finds its expert from offsets[] (loaded to shared memory, one warp scan); empty experts own no tile;
//    CTAs past the last tile exit. Offsets are clamped to [0, M] so bad values never access out of bounds.
//  - Small M (decode: M <= 32 dense, <= 16 rows per expert on average grouped) with a prepared weight runs the
//    weight-stationary kernel of gemm_w4_decode_sm90.cu; everything else runs here.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <torch/library.h>

#include "trace_ext/fp4_numerics.cuh"
#include "trace_ext/gemm_w4_common.cuh"
#include "trace_ext/host_checks.h"

namespace trace_ext {
namespace gemm_w4 {

constexpr int kBN = 128;            // CTA tile N
constexpr int kBK = 64;             // CTA tile K (4 NVFP4 blocks)
constexpr int kThreads = 256;       // 8 warps
constexpr int kWarpsN = 4;          // warps along N (each 32 columns)
constexpr int kWarpsM = 2;          // warps along M
constexpr int kStages = 3;          // cp.async pipeline depth
constexpr int kCodeRow = kBK / 2;   // 32 code bytes per row per k-tile
constexpr int kScaleRow = kBK / 16; // 4 scale bytes per row per k-tile
constexpr int kNT = kBN / kWarpsN / 8;  // n8 tiles per warp
static_assert(kWarpsN * kWarpsM * 32 == kThreads, "warp grid must cover the CTA");
static_assert(kNT == 4, "each warp covers 32 columns");
static_assert(kBK % 16 == 0 && kBK / 16 == 4, "a k-tile holds 4 NVFP4 blocks (one 4-byte scale word per row)");

template <int BM, bool kAFp4>
struct TileCfg {
  static constexpr int kMT = BM / kWarpsM / 16;  // m16 tiles per warp
  static constexpr int kABytes = kAFp4 ? BM * (kCodeRow + kScaleRow) : BM * kBK * 2;
  static constexpr int kWBytes = kBN * (kCodeRow + kScaleRow);
  static constexpr int kStageBytes = kABytes + kWBytes;
  static constexpr int kSmem = kStageBytes * kStages;
  static_assert(BM % (kWarpsM * 16) == 0, "BM must be a multiple of 32");
  static_assert(kStageBytes % 16 == 0, "stages must stay 16-byte aligned");
};

__device__ __forceinline__ int code_swz(int row) { return ((row >> 2) & 1) << 4; }

// Copies one k-tile of A (bf16 or FP4 codes + scales) and W (codes + scales) into a pipeline stage.
template <int BM, bool kAFp4, bool kAligned>
__device__ __forceinline__ void load_stage(const GemmParams& p, uint8_t* stage, int m_begin, int m_end,
                                           const uint8_t* wc, const uint8_t* ws, int n0, int k0) {
  using C = TileCfg<BM, kAFp4>;
  const int tid = threadIdx.x;
  const int K = p.K;
  uint8_t* sa = stage;
  uint8_t* sw = stage + C::kABytes;
  // ---- A
  if constexpr (!kAFp4) {
    const __nv_bfloat16* a = reinterpret_cast<const __nv_bfloat16*>(p.a);
    for (int idx = tid; idx < BM * 8; idx += kThreads) {
      const int row = idx >> 3, c = idx & 7;
      const int m = m_begin + row, k = k0 + c * 8;
      const bool ok = m < m_end && k < K;
      const void* src = ok ? (const void*)(a + (int64_t)m * K + k) : p.a;
      cp_async16(sa + row * 128 + ((c ^ (row & 7)) << 4), src, ok);
    }
  } else {
    const uint8_t* ac = reinterpret_cast<const uint8_t*>(p.a);
    uint8_t* sac = sa;
    uint8_t* sas = sa + BM * kCodeRow;
    constexpr int kCh = kAligned ? 16 : 8;
    constexpr int kPerRow = kCodeRow / kCh;
    for (int idx = tid; idx < BM * kPerRow; idx += kThreads) {
      const int row = idx / kPerRow, c = idx % kPerRow;
      const int m = m_begin + row, kb = k0 / 2 + c * kCh;
      const bool ok = m < m_end && kb < K / 2;
      const void* src = ok ? (const void*)(ac + (int64_t)m * (K / 2) + kb) : p.a;
      uint8_t* dst = sac + row * kCodeRow + ((c * kCh) ^ code_swz(row));
      if constexpr (kAligned) cp_async16(dst, src, ok); else cp_async8(dst, src, ok);
    }
    for (int idx = tid; idx < BM; idx += kThreads) {
      const int m = m_begin + idx;
      if constexpr (kAligned) {
        const bool ok = m < m_end;
        cp_async4(sas + idx * 4, ok ? (const void*)(p.a_scales + (int64_t)m * (K / 16) + k0 / 16) : p.a_scales, ok);
      } else {
#pragma unroll
        for (int j = 0; j < kScaleRow; ++j) {
          const int kb = k0 / 16 + j;
          sas[idx * 4 + j] = (m < m_end && kb < K / 16) ? p.a_scales[(int64_t)m * (K / 16) + kb] : 0;
        }
      }
    }
  }
  // ---- W (rows n0 .. n0 + kBN of this expert)
  {
    constexpr int kCh = kAligned ? 16 : 8;
    constexpr int kPerRow = kCodeRow / kCh;
    uint8_t* swc = sw;
    uint8_t* sws = sw + kBN * kCodeRow;
    for (int idx = tid; idx < kBN * kPerRow; idx += kThreads) {
      const int row = idx / kPerRow, c = idx % kPerRow;
      const int n = n0 + row, kb = k0 / 2 + c * kCh;
      const bool ok = n < p.N && kb < K / 2;
      const void* src = ok ? (const void*)(wc + (int64_t)n * (K / 2) + kb) : wc;
      uint8_t* dst = swc + row * kCodeRow + ((c * kCh) ^ code_swz(row));
      if constexpr (kAligned) cp_async16(dst, src, ok); else cp_async8(dst, src, ok);
    }
    for (int idx = tid; idx < kBN; idx += kThreads) {
      const int n = n0 + idx;
      if constexpr (kAligned) {
        const bool ok = n < p.N;
        cp_async4(sws + idx * 4, ok ? (const void*)(ws + (int64_t)n * (K / 16) + k0 / 16) : ws, ok);
      } else {
#pragma unroll
        for (int j = 0; j < kScaleRow; ++j) {
          const int kb = k0 / 16 + j;
          sws[idx * 4 + j] = (n < p.N && kb < K / 16) ? ws[(int64_t)n * (K / 16) + kb] : 0;
        }
      }
    }
  }
}

template <int BM, bool kAFp4, bool kAligned>
__global__ void __launch_bounds__(kThreads) gemm_w4_tiled_kernel(const GemmParams p) {
  using C = TileCfg<BM, kAFp4>;
  constexpr int kMT = C::kMT;
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ int s_tile[3];  // expert, m_begin, m_end
  __shared__ int s_off[kMaxExperts + 1];

  // ---- which expert and rows this CTA owns
  if (p.offsets != nullptr) {
    for (int i = threadIdx.x; i <= p.E; i += kThreads) s_off[i] = p.offsets[i];
    __syncthreads();
  }
  if (threadIdx.x < 32) {
    int e = 0, mb = blockIdx.y * BM, me = p.M;
    if (p.offsets != nullptr) find_group_tile(s_off, p.E, p.M, BM, blockIdx.y, &e, &mb, &me);
    if (threadIdx.x == 0) { s_tile[0] = e; s_tile[1] = mb; s_tile[2] = me; }
  }
  __syncthreads();
  const int e = s_tile[0], m_begin = s_tile[1], m_end = s_tile[2];
  if (e < 0 || m_begin >= m_end) return;

  const int n0 = blockIdx.x * kBN;
  const int K = p.K;
  const uint8_t* wc = p.w_codes + (int64_t)e * p.N * (K / 2);
  const uint8_t* ws = p.w_scales + (int64_t)e * p.N * (K / 16);
  const int KT = (K + kBK - 1) / kBK;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wm = warp / kWarpsN, wn = warp % kWarpsN;
  const int g = lane >> 2, t = lane & 3;

  float acc[kMT][kNT][4];
#pragma unroll
  for (int i = 0; i < kMT; ++i)
#pragma unroll
    for (int j = 0; j < kNT; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.f;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < KT) load_stage<BM, kAFp4, kAligned>(p, smem + s * C::kStageBytes, m_begin, m_end, wc, ws, n0, s * kBK);
    cp_async_commit();
  }

  for (int kt = 0; kt < KT; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    {
      const int nk = kt + kStages - 1;
      if (nk < KT)
        load_stage<BM, kAFp4, kAligned>(p, smem + (nk % kStages) * C::kStageBytes, m_begin, m_end, wc, ws, n0,
                                        nk * kBK);
      cp_async_commit();
    }
    const uint8_t* st = smem + (kt % kStages) * C::kStageBytes;
    const uint8_t* sa = st;
    const uint8_t* swc = st + C::kABytes;
    const uint8_t* sws = swc + kBN * kCodeRow;
#pragma unroll
    for (int ks = 0; ks < kBK / 16; ++ks) {
      uint32_t af[kMT][4];
#pragma unroll
      for (int i = 0; i < kMT; ++i) {
        const int r0 = wm * (BM / kWarpsM) + i * 16;
        if constexpr (!kAFp4) {
          const int row = r0 + (lane & 15);
          const int c = ks * 2 + (lane >> 4);
          ldmatrix_x4(af[i], sa + row * 128 + ((c ^ (row & 7)) << 4));
        } else {
          const uint8_t* sac = sa;
          const uint8_t* sas = sa + BM * kCodeRow;
          const int ra = r0 + g, rb = r0 + g + 8;
          const uint32_t sca = scale_bf16x2_folded(sas[ra * 4 + ks]);
          const uint32_t scb = scale_bf16x2_folded(sas[rb * 4 + ks]);
          af[i][0] = bf16x2_mul(fp4x2_to_bf16x2_biased(sac[ra * kCodeRow + ((ks * 8 + t) ^ code_swz(ra))]), sca);
          af[i][1] = bf16x2_mul(fp4x2_to_bf16x2_biased(sac[rb * kCodeRow + ((ks * 8 + t) ^ code_swz(rb))]), scb);
          af[i][2] = bf16x2_mul(fp4x2_to_bf16x2_biased(sac[ra * kCodeRow + ((ks * 8 + 4 + t) ^ code_swz(ra))]), sca);
          af[i][3] = bf16x2_mul(fp4x2_to_bf16x2_biased(sac[rb * kCodeRow + ((ks * 8 + 4 + t) ^ code_swz(rb))]), scb);
        }
      }
#pragma unroll
      for (int j = 0; j < kNT; ++j) {
        const int rn = wn * (kBN / kWarpsN) + j * 8 + g;
        const uint32_t sc = scale_bf16x2_folded(sws[rn * 4 + ks]);
        uint32_t bf[2];
        bf[0] = bf16x2_mul(fp4x2_to_bf16x2_biased(swc[rn * kCodeRow + ((ks * 8 + t) ^ code_swz(rn))]), sc);
        bf[1] = bf16x2_mul(fp4x2_to_bf16x2_biased(swc[rn * kCodeRow + ((ks * 8 + 4 + t) ^ code_swz(rn))]), sc);
#pragma unroll
        for (int i = 0; i < kMT; ++i) mma_bf16_16816(acc[i][j], af[i], bf);
      }
    }
  }
  cp_async_wait<0>();

  // ---- epilogue: y = (acc * 2^fold) * (g_a[m] * g_w[n]), bf16
  const float fold = kAFp4 ? kUnfoldW4A4 : kUnfoldW4A16;
  const float* gw = p.g_w + (int64_t)e * p.gw_stride_e;
#pragma unroll
  for (int i = 0; i < kMT; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = m_begin + wm * (BM / kWarpsM) + i * 16 + g + h * 8;
      if (m >= m_end) continue;
      const float ga = p.g_a != nullptr ? p.g_a[m] : 1.0f;
#pragma unroll
      for (int j = 0; j < kNT; ++j) {
        const int n = n0 + wn * (kBN / kWarpsN) + j * 8 + 2 * t;
        float v[2];
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int nn = n + c < p.N ? n + c : p.N - 1;
          v[c] = __fmul_rn(__fmul_rn(acc[i][j][h * 2 + c], fold), __fmul_rn(ga, gw[(int64_t)nn * p.gw_stride_n]));
        }
        store_bf16_pair(p.y + (int64_t)m * p.N + n, v, n + 1 < p.N, n < p.N, p.N);
      }
    }
  }
}

template <int BM, bool kAFp4, bool kAligned>
void launch_tiled(const GemmParams& p, int m_tiles, cudaStream_t stream) {
  using C = TileCfg<BM, kAFp4>;
  auto kernel = gemm_w4_tiled_kernel<BM, kAFp4, kAligned>;
  static bool attr_set[kMaxDevices] = {};  // per template instance and device (the attribute is per device)
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev >= kMaxDevices || !attr_set[dev]) {
    require_kernel_image(kernel, "fp4_linear");
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem));
    if (dev < kMaxDevices) attr_set[dev] = true;
  }
  TORCH_CHECK(m_tiles <= 65535, "trace_ext: fp4_linear: M = ", p.M, " needs ", m_tiles,
              " row tiles, more than one launch holds (65535)");
  dim3 grid((p.N + kBN - 1) / kBN, m_tiles);
  kernel<<<grid, kThreads, C::kSmem, stream>>>(p);
  check_launch("fp4_linear");
}

template <bool kAFp4, bool kAligned>
void dispatch_tiled_bm(const GemmParams& p, int64_t rows_hint, cudaStream_t stream) {
  // Grouped: the M-tile count is bounded by ceil(M / BM) + E (each expert adds at most one partial tile).
  auto tiles = [&](int bm) {
    return (int)((p.M + bm - 1) / bm + (p.offsets != nullptr ? p.E : 0));
  };
  if (rows_hint <= 64) launch_tiled<64, kAFp4, kAligned>(p, tiles(64), stream);
  else launch_tiled<128, kAFp4, kAligned>(p, tiles(128), stream);
}

void run_tiled(const GemmParams& p, int64_t rows_hint, cudaStream_t stream) {
  const bool aligned = p.K % kBK == 0;
  if (p.a_scales != nullptr) {
    if (aligned) dispatch_tiled_bm<true, true>(p, rows_hint, stream);
    else dispatch_tiled_bm<true, false>(p, rows_hint, stream);
  } else {
    if (aligned) dispatch_tiled_bm<false, true>(p, rows_hint, stream);
    else dispatch_tiled_bm<false, false>(p, rows_hint, stream);
  }
}

}  // namespace gemm_w4
}  // namespace trace_ext

// ---- host entries -------------------------------------------------------------------------------------------
namespace trace_ext {
namespace gemm_w4 {
namespace {

void require_sm90(const at::Tensor& t, const char* op) {
  static int cached_cc[kMaxDevices] = {};  // major * 10 + minor per device, 0 = not queried yet
  const int dev = t.device().index();
  if (dev >= 0 && dev < kMaxDevices && cached_cc[dev] == 90) return;
  int major = 0, minor = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  if (dev >= 0 && dev < kMaxDevices) cached_cc[dev] = major * 10 + minor;
  TORCH_CHECK(major == 9 && minor == 0, "trace_ext: ", op,
              " is implemented for sm_90a (Hopper) only; this GPU is sm_", major, minor,
              ", for which no NVFP4 GEMM kernel is built (missing build target: an sm_", major, minor,
              "a NVFP4 GEMM). Use backend='reference' here.");
}

struct Problem {
  GemmParams p{};
  at::Tensor y;
  std::vector<at::Tensor> keep;  // 16-byte-aligned copies of operands that arrived as offset views
  bool empty = false;
};

// The kernels copy 16-byte chunks: a contiguous view that starts mid-allocation is copied once (values unchanged).
const at::Tensor& aligned16(const at::Tensor& t, Problem& pr) {
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0) return t;
  pr.keep.push_back(t.clone());
  return pr.keep.back();
}

Problem make_problem(const char* op, const at::Tensor& a, const std::optional<at::Tensor>& a_scales,
                     const std::optional<at::Tensor>& g_a, const at::Tensor& w_codes, const at::Tensor& w_scales,
                     const at::Tensor& g_w, const std::optional<at::Tensor>& w_packed,
                     const std::optional<at::Tensor>& offsets) {
  const bool grouped = offsets.has_value();
  const bool w4a4 = a_scales.has_value();
  check_cuda(a, "a");
  check_cuda(w_codes, "w_codes");
  check_cuda(w_scales, "w_scales");
  check_cuda(g_w, "g_w");
  check_same_device(a, w_codes, "a", "w_codes");
  check_same_device(a, w_scales, "a", "w_scales");
  check_same_device(a, g_w, "a", "g_w");
  check_dtype(w_codes, at::kByte, "w_codes");
  check_dtype(w_scales, at::kByte, "w_scales");
  check_dtype(g_w, at::kFloat, "g_w");
  const int64_t wdim = grouped ? 3 : 2;
  TORCH_CHECK_VALUE(w_codes.dim() == wdim, "trace_ext: ", op, ": w_codes must be ", grouped ? "[E, N, K/2]" : "[N, K/2]",
                    ", got shape ", w_codes.sizes());
  const int64_t E = grouped ? w_codes.size(0) : 1;
  const int64_t N = w_codes.size(-2);
  const int64_t K = 2 * w_codes.size(-1);
  TORCH_CHECK_VALUE(K % 16 == 0, "trace_ext: ", op, ": K = 2 * w_codes.shape[-1] = ", K,
                    " must be a multiple of the 16-element NVFP4 block");
  if (grouped) check_shape(w_scales, {E, N, K / 16}, "w_scales");
  else check_shape(w_scales, {N, K / 16}, "w_scales");
  TORCH_CHECK_VALUE(E >= 1 && E <= kMaxExperts, "trace_ext: ", op, ": the number of experts must be in [1, ",
                    kMaxExperts, "], got ", E);
  TORCH_CHECK_VALUE(a.dim() == 2, "trace_ext: ", op, ": a must be 2-D [M, K], got shape ", a.sizes());
  const int64_t M = a.size(0);
  if (w4a4) {
    check_dtype(a, at::kByte, "a (W4A4 codes)");
    check_shape(a, {M, K / 2}, "a (W4A4 codes)");
    TORCH_CHECK_VALUE(g_a.has_value(), "trace_ext: ", op, ": W4A4 needs g_a (one float32 per row of a)");
    const at::Tensor& as = *a_scales;
    const at::Tensor& ga = *g_a;
    check_cuda(as, "a_scales");
    check_cuda(ga, "g_a");
    check_same_device(a, as, "a", "a_scales");
    check_same_device(a, ga, "a", "g_a");
    check_dtype(as, at::kByte, "a_scales");
    check_dtype(ga, at::kFloat, "g_a");
    check_shape(as, {M, K / 16}, "a_scales");
    check_shape(ga, {M}, "g_a");
    check_contiguous(as, "a_scales");
    check_contiguous(ga, "g_a");
  } else {
    TORCH_CHECK_VALUE(!g_a.has_value(), "trace_ext: ", op, ": g_a is only used with NVFP4 activations (a_scales)");
    check_dtype(a, at::kBFloat16, "a");
    check_shape(a, {M, K}, "a");
  }
  check_contiguous(a, "a");
  check_contiguous(w_codes, "w_codes");
  check_contiguous(w_scales, "w_scales");
  check_contiguous(g_w, "g_w");
  int64_t gse = 0, gsn = 0;
  if (grouped) {
    TORCH_CHECK_VALUE(g_w.numel() == E || g_w.numel() == E * N, "trace_ext: ", op,
                      ": g_w must have E = ", E, " (per expert) or E * N elements, got shape ", g_w.sizes());
    gse = g_w.numel() == E ? 1 : N;
    gsn = g_w.numel() == E ? 0 : 1;
  } else {
    TORCH_CHECK_VALUE(g_w.numel() == 1 || g_w.numel() == N, "trace_ext: ", op,
                      ": g_w must have 1 (per matrix) or N elements, got shape ", g_w.sizes());
    gsn = g_w.numel() == 1 ? 0 : 1;
  }
  if (grouped) {
    const at::Tensor& off = *offsets;
    check_cuda(off, "offsets");
    check_same_device(a, off, "a", "offsets");
    check_dtype(off, at::kInt, "offsets");
    check_shape(off, {E + 1}, "offsets");
    check_contiguous(off, "offsets");
  }
  if (w_packed.has_value()) {
    check_cuda(*w_packed, "w_packed");
    check_same_device(a, *w_packed, "a", "w_packed");
    check_dtype(*w_packed, at::kByte, "w_packed");
    check_contiguous(*w_packed, "w_packed");
    TORCH_CHECK_VALUE(w_packed->numel() == E * N * (K / 2 + K / 16), "trace_ext: ", op,
                      ": w_packed does not match these weights (expected ", E * N * (K / 2 + K / 16),
                      " bytes from prepare_fp4_weight, got ", w_packed->numel(), ")");
  }
  TORCH_CHECK_VALUE(M < (int64_t(1) << 31) && N < (int64_t(1) << 31) && K < (int64_t(1) << 31), "trace_ext: ", op,
                    ": dimensions must fit in int32");

  Problem pr;
  pr.y = at::empty({M, N}, a.options().dtype(at::kBFloat16));
  if (M == 0 || N == 0) {
    pr.empty = true;
    return pr;
  }
  if (K == 0) {
    pr.y.zero_();
    pr.empty = true;
    return pr;
  }
  require_sm90(a, op);
  pr.keep.reserve(5);
  GemmParams& p = pr.p;
  p.a = aligned16(a, pr).data_ptr();
  p.a_scales = w4a4 ? aligned16(*a_scales, pr).data_ptr<uint8_t>() : nullptr;
  p.g_a = w4a4 ? g_a->data_ptr<float>() : nullptr;
  p.w_codes = aligned16(w_codes, pr).data_ptr<uint8_t>();
  p.w_scales = aligned16(w_scales, pr).data_ptr<uint8_t>();
  p.w_packed = w_packed.has_value() ? aligned16(*w_packed, pr).data_ptr<uint8_t>() : nullptr;
  p.g_w = g_w.data_ptr<float>();
  p.gw_stride_e = gse;
  p.gw_stride_n = gsn;
  p.offsets = grouped ? offsets->data_ptr<int>() : nullptr;
  p.y = reinterpret_cast<__nv_bfloat16*>(pr.y.data_ptr());
  p.M = (int)M;
  p.N = (int)N;
  p.K = (int)K;
  p.E = (int)E;
  return pr;
}

void run(Problem& pr, const at::Tensor& a, int64_t rows_hint) {
  const c10::cuda::CUDAGuard guard(a.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int max_rows = pr.p.offsets != nullptr ? kDecodeMaxRowsGrouped : kDecodeMaxRows;
  if (decode_supported(pr.p) && rows_hint <= max_rows) run_decode(pr.p, rows_hint, a, stream);
  else if (wgmma_supported(pr.p) && rows_hint >= kWgmmaMinRows) run_wgmma(pr.p, stream);
  else run_tiled(pr.p, rows_hint, stream);
}

at::Tensor fp4_linear_cuda(const at::Tensor& a, const std::optional<at::Tensor>& a_scales,
                           const std::optional<at::Tensor>& g_a, const at::Tensor& w_codes,
                           const at::Tensor& w_scales, const at::Tensor& g_w,
                           const std::optional<at::Tensor>& w_packed) {
  Problem pr = make_problem("fp4_linear", a, a_scales, g_a, w_codes, w_scales, g_w, w_packed, std::nullopt);
  if (!pr.empty) run(pr, a, pr.p.M);
  return pr.y;
}

at::Tensor fp4_grouped_linear_cuda(const at::Tensor& a, const std::optional<at::Tensor>& a_scales,
                                   const std::optional<at::Tensor>& g_a, const at::Tensor& w_codes,
                                   const at::Tensor& w_scales, const at::Tensor& g_w, const at::Tensor& offsets,
                                   const std::optional<at::Tensor>& w_packed) {
  Problem pr = make_problem("fp4_grouped_linear", a, a_scales, g_a, w_codes, w_scales, g_w, w_packed, offsets);
  // rows per expert on average decides the path (no device sync: the kernels handle any distribution)
  if (!pr.empty) run(pr, a, (pr.p.M + pr.p.E - 1) / pr.p.E);
  return pr.y;
}

}  // namespace
}  // namespace gemm_w4
}  // namespace trace_ext

TORCH_LIBRARY_IMPL(trace_ext, CUDA, m) {
  m.impl("fp4_linear", &trace_ext::gemm_w4::fp4_linear_cuda);
  m.impl("fp4_grouped_linear", &trace_ext::gemm_w4::fp4_grouped_linear_cuda);
}
