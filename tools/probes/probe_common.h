// Shared pieces of the standalone H200 probes in tools/probes (no torch): error check, the record header, the
// timing rule of the benches (cudaEvents around one launch after a 256 MB memset that evicts L2, median of 41 after
// 4 warm-up calls), and a stand-in for the quantizers' per-block work (work_block).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <vector>

#define CK(x)                                                                      \
  do {                                                                             \
    cudaError_t e = (x);                                                           \
    if (e != cudaSuccess) {                                                        \
      printf("CUDA %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__);     \
      exit(1);                                                                     \
    }                                                                              \
  } while (0)

// "| gpu | capability | CUDA runtime / driver | commit | date | command |" (commit: $TRACE_EXT_COMMIT)
inline void print_probe_header(const char* title, int argc, char** argv) {
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  int rt = 0, drv = 0;
  CK(cudaRuntimeGetVersion(&rt));
  CK(cudaDriverGetVersion(&drv));
  char date[64];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  const char* commit = std::getenv("TRACE_EXT_COMMIT");
  printf("# %s\n\n| gpu: %s | capability: [%d, %d] | SMs: %d | CUDA runtime: %d.%d | driver: %d.%d | commit: %s | date: %s | "
         "command: tools/probes/run_all.sh (%s) |\n\n",
         title, prop.name, prop.major, prop.minor, prop.multiProcessorCount, rt / 1000, rt % 1000 / 10, drv / 1000,
         drv % 1000 / 10, commit ? commit : "?", date, argc > 0 ? argv[0] : "?");
}

// Median time in microseconds of launch(r) (r = call index), L2 evicted before every call.
template <class Launch>
float probe_time_us(Launch&& launch) {
  static void* flush = nullptr;
  static cudaEvent_t e0, e1;
  if (flush == nullptr) {
    CK(cudaMalloc(&flush, 256 << 20));
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
  }
  std::vector<float> ms;
  for (int r = 0; r < 45; ++r) {
    CK(cudaMemsetAsync(flush, r, 256 << 20));
    CK(cudaEventRecord(e0));
    launch(r);
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float t;
    CK(cudaEventElapsedTime(&t, e0, e1));
    if (r >= 4) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2] * 1e3f;
}

#ifdef __CUDACC__
// Stand-in for the quantizer's per-block arithmetic (stream_rw_staged.cu, l2_prefetch.cu): a bf16 block of 16 elements
// (two 16-byte vectors) unpacked, its amax, W rounds of 16 FMAs, 16 4-bit integers packed (~9 instructions per element
// at W = 0, each round adds one).
__device__ __forceinline__ uint2 work_block(uint4 a, uint4 b, int W) {
  const uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
  float f[16];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
  }
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(f[i]));
  const float r = 6.0f / fmaxf(amax, 1e-30f);
  for (int k = 0; k < W; ++k)
#pragma unroll
    for (int i = 0; i < 16; ++i) f[i] = fmaf(f[i], r, 0.5f);
  uint32_t c0 = 0, c1 = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) c0 |= ((uint32_t)__float2int_rz(f[i]) & 0xF) << (4 * i);
#pragma unroll
  for (int i = 0; i < 8; ++i) c1 |= ((uint32_t)__float2int_rz(f[8 + i]) & 0xF) << (4 * i);
  return make_uint2(c0, c1 ^ __float_as_uint(amax));
}

// The lean quantizer's traffic shape (stream_rw_staged.cu, l2_prefetch.cu): 256 threads, <= 64 registers, each lane
// 2 blocks of 16 bf16 per step (lane-contiguous 32-byte blocks, as nvfp4_quant_lean_kernel), work_block on each, 8 code
// bytes + 1 scale byte out. Load::load reads one 16-byte vector (the probes' load flavours).
template <class Load>
__global__ void __launch_bounds__(256, 4) quant_stream_kernel(const uint4* __restrict__ x, uint2* __restrict__ codes,
                                                              uint8_t* __restrict__ scales, uint32_t n_blocks, int W) {
  const uint32_t lane = threadIdx.x % 32;
  const uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const uint32_t warps = gridDim.x * blockDim.x / 32;
  for (uint32_t b0 = warp * 64 + lane; b0 < n_blocks; b0 += warps * 64) {
    uint4 v[2][2];
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const uint32_t b = b0 + 32 * q;
      if (b < n_blocks) {
        v[q][0] = Load::load(x + 2 * (size_t)b);
        v[q][1] = Load::load(x + 2 * (size_t)b + 1);
      }
    }
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const uint32_t b = b0 + 32 * q;
      if (b < n_blocks) {
        const uint2 c = work_block(v[q][0], v[q][1], W);
        codes[b] = c;
        scales[b] = (uint8_t)(c.y >> 23);
      }
    }
  }
}
#endif
