// Does staging the input in shared memory (bulk copies, a ring of stages per CTA) beat register loads for a
// quantize-shaped stream WITH per-element work? (H200; companion of stream_rw.cu.)
// Standalone: nvcc -O3 -std=c++17 -arch=sm_90a tools/probes/stream_rw_staged.cu -o /tmp/stream_rw_staged
// Both kernels read 2 B and write 0.5625 B per element (bf16 -> 8 code bytes + 1 scale byte per 16), doing W rounds
// of 16 FMAs per 16-element block on the unpacked values (a stand-in for the quantizer's arithmetic):
//   reg:    quant_stream_kernel (probe_common.h), nvfp4_quant_lean_kernel's shape: 256 threads, __launch_bounds__(256,
//           4) (64 registers), 2 blocks per lane loaded, then computed, grid 4 tiles per warp;
//   staged: persistent CTAs (CPS per SM), 256 threads, a ring of S stages of 16 KB (512 blocks) filled by one bulk
//           copy each (cp.async.bulk + mbarrier), each thread computing 2 blocks of a stage from shared memory, one
//           __syncthreads per stage before the slot is refilled.

#include <cuda_bf16.h>
#include <cstdint>

#include "probe_common.h"

// Load flavours of the register kernel: 0 = __ldcs (ld.global.cs, streaming), 1 = __ldg (ld.global.nc, what the
// quantize and KV-append kernels use), 2 = ld.global.nc.L1::no_allocate, 3 = plain ld.global.
template <int LD>
__device__ __forceinline__ uint4 ld16(const uint4* p) {
  if constexpr (LD == 0) return __ldcs(p);
  if constexpr (LD == 1) return __ldg(p);
  if constexpr (LD == 2) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
  }
  return *p;
}
template <int LD>
struct Ld {
  __device__ static uint4 load(const uint4* p) { return ld16<LD>(p); }
};

constexpr int kStageBlocks = 512, kStageBytes = kStageBlocks * 32;

template <int S>
__global__ void __launch_bounds__(256) staged_kernel(const uint8_t* __restrict__ x, uint2* __restrict__ codes,
                                                     uint8_t* __restrict__ scales, uint32_t n_blocks, int W) {
  extern __shared__ __align__(128) uint8_t ring[];
  __shared__ __align__(8) uint64_t full[S];
  const uint32_t n_stages = (n_blocks + kStageBlocks - 1) / kStageBlocks;
  // CTA c owns stages [c * n / C, (c + 1) * n / C)
  const uint32_t st0 = (uint64_t)n_stages * blockIdx.x / gridDim.x, st1 = (uint64_t)n_stages * (blockIdx.x + 1) / gridDim.x;
  const uint32_t ring_s = (uint32_t)__cvta_generic_to_shared(ring);
  const uint32_t full_s = (uint32_t)__cvta_generic_to_shared(full);
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(full_s + 8 * s));
    asm volatile("fence.mbarrier_init.release.cluster;");
  }
  __syncthreads();
  auto issue = [&](uint32_t st) {  // thread 0: stage st into slot (st - st0) % S
    if (st < st1) {
      const uint32_t slot = (st - st0) % S;
      const uint32_t blocks = min(kStageBlocks, n_blocks - st * kStageBlocks);
      const uint32_t bytes = blocks * 32;
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(full_s + 8 * slot), "r"(bytes) : "memory");
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   :: "r"(ring_s + slot * kStageBytes), "l"(x + (size_t)st * kStageBytes), "r"(bytes), "r"(full_s + 8 * slot)
                   : "memory");
    }
  };
  if (threadIdx.x == 0)
    for (int k = 0; k < S; ++k) issue(st0 + k);
  for (uint32_t st = st0; st < st1; ++st) {
    const uint32_t slot = (st - st0) % S, parity = ((st - st0) / S) & 1;
    asm volatile("{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}"
                 :: "r"(full_s + 8 * slot), "r"(parity) : "memory");
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const uint32_t i = threadIdx.x + 256 * q;
      const uint32_t b = st * kStageBlocks + i;
      if (b < n_blocks) {
        const uint4* p = reinterpret_cast<const uint4*>(ring + slot * kStageBytes + 32 * i);
        const uint2 c = work_block(p[0], p[1], W);
        codes[b] = c;
        scales[b] = (uint8_t)(c.y >> 23);
      }
    }
    __syncthreads();  // every thread is done with the slot
    if (threadIdx.x == 0) issue(st + S);
  }
}

int main(int argc, char** argv) {
  print_probe_header("stream_rw_staged: register loads vs shared-memory bulk-copy stages, with per-element work", argc, argv);
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  auto time_it = [&](auto launch) { return probe_time_us([&](int) { launch(); }); };
  printf("| elements | kernel | W | us | GB/s (2.5625 B/elem) | codes equal |\n|---|---|---|---|---|---|\n");
  for (int lg : {26, 28}) {
    const size_t n = size_t(1) << lg;
    const uint32_t n_blocks = (uint32_t)(n / 16);
    uint8_t* x;
    uint2 *codes, *codes2;
    uint8_t* scales;
    CK(cudaMalloc(&x, n * 2));
    {
      std::vector<uint16_t> h(n);
      uint32_t s = 12345;
      for (size_t i = 0; i < n; ++i) { s = s * 1664525u + 1013904223u; h[i] = (uint16_t)(0x3C00 + ((s >> 16) & 0x3FF) - 0x200) ^ ((s >> 31) << 15); }
      CK(cudaMemcpy(x, h.data(), n * 2, cudaMemcpyHostToDevice));
    }
    CK(cudaMalloc(&codes, n / 2));
    CK(cudaMalloc(&codes2, n / 2));
    CK(cudaMalloc(&scales, n / 16));
    const double bytes = n * 2.5625;
    for (int W : {0, 2, 4, 8, 12}) {
      const int tiles = (int)((n_blocks + 64 * 8 - 1) / (64 * 8));
      const char* ld_names[4] = {"ld.global.cs", "ld.global.nc (__ldg)", "ld.global.nc.L1::no_allocate", "ld.global"};
      auto reg = [&](auto kernel, int ld) {
        const float t = time_it([&] { kernel<<<(tiles + 3) / 4, 256>>>(reinterpret_cast<const uint4*>(x), codes, scales, n_blocks, W); });
        printf("| 2^%d | reg (4 tiles per warp), %s | %d | %.2f | %.0f | - |\n", lg, ld_names[ld], W, t, bytes / t / 1e3);
      };
      reg(quant_stream_kernel<Ld<0>>, 0);
      if (W == 0 || W == 8) {
        reg(quant_stream_kernel<Ld<1>>, 1);
        reg(quant_stream_kernel<Ld<2>>, 2);
        reg(quant_stream_kernel<Ld<3>>, 3);
        reg(quant_stream_kernel<Ld<0>>, 0);
      }
      auto staged = [&](const char* name, auto kernel, int S, int cps) {
        CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, S * kStageBytes));
        const float t2 = time_it([&] { kernel<<<sms * cps, 256, S * kStageBytes>>>(x, codes2, scales, n_blocks, W); });
        std::vector<uint2> h1(n_blocks), h2(n_blocks);
        CK(cudaMemcpy(h1.data(), codes, n / 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(h2.data(), codes2, n / 2, cudaMemcpyDeviceToHost));
        bool eq = std::equal(h1.begin(), h1.end(), h2.begin(), [](uint2 a, uint2 b) { return a.x == b.x && a.y == b.y; });
        printf("| 2^%d | %s S=%d, %d CTAs/SM | %d | %.2f | %.0f | %d |\n", lg, name, S, cps, W, t2, bytes / t2 / 1e3, eq);
      };
      staged("staged", staged_kernel<3>, 3, 3);
      staged("staged", staged_kernel<4>, 4, 3);
      staged("staged", staged_kernel<4>, 4, 2);
      staged("staged", staged_kernel<6>, 6, 2);
    }
    CK(cudaFree(x));
    CK(cudaFree(codes));
    CK(cudaFree(codes2));
    CK(cudaFree(scales));
  }
  CK(cudaDeviceSynchronize());
  return 0;
}
