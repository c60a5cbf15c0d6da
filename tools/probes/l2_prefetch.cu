// Does the L2 prefetch-size qualifier of a global load (PTX .L2::128B / .L2::256B: the L2 fetches that many bytes
// around the requested sector from DRAM) speed up our cold-L2 streams? (H200; companion of stream_rw_staged.cu.)
// Standalone: nvcc -O3 -std=c++17 -arch=sm_90a tools/probes/l2_prefetch.cu -o /tmp/l2_prefetch
// Three traffic shapes, each with the load flavours below:
//   read:   a bare read of N bytes (16 B per lane, grid stride, U loads in flight per thread; one word per thread
//           written), the decode GEMMs' weight stream (33 MB: M = 1 14336 x 4096; 14 / 7 MB: Qwen3 T = 1 top-8
//           gate_up / down; 75 / 151 / 302 MB: the FP4 KV cache bytes of bench_kv's decode cases B1 S128K / B32 S8K
//           and B64 S4K / B8 Hkv8 S32K);
//   quant:  quant_stream_kernel of probe_common.h (the lean quantizer's shape: 2 B read, 0.5625 B written per element,
//           2 blocks per lane, 4 tiles per warp), with W rounds of 16 FMAs per block (W 0 / 8 ~ 9 / 17 instructions
//           per element), at 2^26 and 2^28 elements;
//   async:  a per-warp cp.async.cg ring (4 slots of 512 B per warp, 16 warps per CTA, one CTA per SM) over 33 MB,
//           the K-slab / KV decode load mechanism, with and without the qualifier on cp.async.
// Timing: cudaEvents around one launch after a 256 MB memset (L2 cold), median of 41 (probe_common.h); the anchor is
// cudaMemcpy of 1 GiB (read + write) in the same run.
#include <cstdint>

#include "probe_common.h"

// Load flavours: 0 = ld.global.nc (__ldg: what the quantizers use), 1 = .L2::128B, 2 = .L2::256B,
// 3 = .L1::no_allocate.L2::256B.
constexpr int kFlavours = 4;
const char* kFlavourNames[kFlavours] = {"ld.global.nc", "ld.global.nc.L2::128B", "ld.global.nc.L2::256B",
                                        "ld.global.nc.L1::no_allocate.L2::256B"};

template <int LD>
__device__ __forceinline__ uint4 ld16(const uint4* p) {
  uint4 v;
  if constexpr (LD == 0) {
    v = __ldg(p);
  } else if constexpr (LD == 1) {
    asm volatile("ld.global.nc.L2::128B.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  } else if constexpr (LD == 2) {
    asm volatile("ld.global.nc.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  } else {
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  }
  return v;
}
template <int LD>
struct Ld {
  __device__ static uint4 load(const uint4* p) { return ld16<LD>(p); }
};

template <int LD, int U>
__global__ void __launch_bounds__(256) read_kernel(const uint4* __restrict__ x, uint32_t* __restrict__ out, uint32_t n16) {
  const uint32_t stride = gridDim.x * blockDim.x;
  uint32_t acc = 0;
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += U * stride) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = i + u * stride < n16 ? ld16<LD>(x + i + u * stride) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

// cp.async ring: warp w of CTA c streams the contiguous range of 512-byte pieces [g P / G, (g + 1) P / G), g = 16 c + w,
// 4 slots per warp, each lane copying 16 B per piece and folding it back from shared memory.
template <bool PF>
__global__ void __launch_bounds__(512, 1) async_kernel(const uint8_t* __restrict__ x, uint32_t* __restrict__ out,
                                                       uint32_t pieces) {
  constexpr int kSlots = 4;
  __shared__ __align__(16) uint4 ring[16][kSlots][32];
  const uint32_t w = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint32_t g = blockIdx.x * 16 + w, G = gridDim.x * 16;
  const uint32_t lo = (uint64_t)pieces * g / G, hi = (uint64_t)pieces * (g + 1) / G;
  auto issue = [&](uint32_t j) {
    if (lo + j < hi) {
      const uint32_t s = (uint32_t)__cvta_generic_to_shared(&ring[w][j % kSlots][lane]);
      const uint8_t* src = x + (size_t)(lo + j) * 512 + lane * 16;
      if constexpr (PF) {
        asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" :: "r"(s), "l"(src));
      } else {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(s), "l"(src));
      }
    }
    asm volatile("cp.async.commit_group;");
  };
  uint32_t acc = 0;
  for (int j = 0; j < kSlots - 1; ++j) issue(j);
  for (uint32_t j = 0; lo + j < hi; ++j) {
    issue(j + kSlots - 1);
    asm volatile("cp.async.wait_group %0;" :: "n"(kSlots - 1));
    __syncwarp();
    const uint4 v = ring[w][j % kSlots][lane];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
    __syncwarp();
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

#ifndef PROBE_LIBRARY  // stream_dobench.cu includes the kernels above without this driver
int main(int argc, char** argv) {
  print_probe_header("l2_prefetch: global loads with and without the L2 prefetch-size qualifier, cold L2", argc, argv);
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  auto time_it = [&](auto launch) { return probe_time_us([&](int) { launch(); }); };
  const size_t max_bytes = size_t(1) << 30;
  uint8_t *a, *b;
  CK(cudaMalloc(&a, max_bytes));
  CK(cudaMalloc(&b, max_bytes));
  CK(cudaMemset(a, 0x3C, max_bytes));
  uint32_t* out;
  CK(cudaMalloc(&out, 64 << 20));
  const float t_copy = time_it([&] { CK(cudaMemcpyAsync(b, a, max_bytes, cudaMemcpyDeviceToDevice)); });
  const double copy_gbs = 2.0 * max_bytes / t_copy / 1e3;
  printf("cudaMemcpy 1 GiB: %.1f us = %.0f GB/s (read + write): the %% column's anchor\n\n", t_copy, copy_gbs);

  printf("## read: bare read of N bytes\n\n| MB | flavour | U | grid | us | GB/s | %% copy |\n|---|---|---|---|---|---|---|\n");
  for (size_t mb : {7, 14, 33, 75, 134, 151, 302}) {
    const size_t n = mb * 1000 * 1000 / 16 * 16;
    const uint32_t n16 = (uint32_t)(n / 16);
    auto row = [&](const char* flav, int U, int grid, auto kernel) {
      const float t = time_it([&] { kernel<<<grid, 256>>>(reinterpret_cast<const uint4*>(a), out, n16); });
      printf("| %zu | %s | %d | %d | %.2f | %.0f | %.1f |\n", mb, flav, U, grid, t, n / t / 1e3, 100.0 * n / t / 1e3 / copy_gbs);
    };
    for (int cps : {4, 8}) {
      row(kFlavourNames[0], 2, sms * cps, read_kernel<0, 2>);
      row(kFlavourNames[1], 2, sms * cps, read_kernel<1, 2>);
      row(kFlavourNames[2], 2, sms * cps, read_kernel<2, 2>);
      row(kFlavourNames[3], 2, sms * cps, read_kernel<3, 2>);
      row(kFlavourNames[0], 4, sms * cps, read_kernel<0, 4>);
      row(kFlavourNames[2], 4, sms * cps, read_kernel<2, 4>);
    }
    const float t = time_it([&] { CK(cudaMemcpyAsync(b, a, n / 2, cudaMemcpyDeviceToDevice)); });
    printf("| %zu | cudaMemcpy of N / 2 (N read + written) | - | - | %.2f | %.0f | %.1f |\n", mb, t, n / t / 1e3,
           100.0 * n / t / 1e3 / copy_gbs);
  }

  printf("\n## quant: 2 B read + 0.5625 B written per element\n\n| elements | flavour | W | us | GB/s | %% copy |\n|---|---|---|---|---|---|\n");
  for (int lg : {26, 28}) {
    const size_t n = size_t(1) << lg;
    const uint32_t n_blocks = (uint32_t)(n / 16);
    const int tiles = (int)((n_blocks + 64 * 8 - 1) / (64 * 8));
    const double bytes = n * 2.5625;
    uint2* codes = reinterpret_cast<uint2*>(b);
    uint8_t* scales = b + n / 2;
    for (int W : {0, 8}) {
      auto row = [&](int ld, auto kernel) {
        const float t = time_it([&] { kernel<<<(tiles + 3) / 4, 256>>>(reinterpret_cast<const uint4*>(a), codes, scales, n_blocks, W); });
        printf("| 2^%d | %s | %d | %.2f | %.0f | %.1f |\n", lg, kFlavourNames[ld], W, t, bytes / t / 1e3, 100.0 * bytes / t / 1e3 / copy_gbs);
      };
      row(0, quant_stream_kernel<Ld<0>>);
      row(1, quant_stream_kernel<Ld<1>>);
      row(2, quant_stream_kernel<Ld<2>>);
      row(3, quant_stream_kernel<Ld<3>>);
      row(0, quant_stream_kernel<Ld<0>>);  // again: run-to-run spread
    }
  }

  printf("\n## async: per-warp cp.async.cg ring over 33 MB\n\n| MB | cp.async | us | GB/s | %% copy |\n|---|---|---|---|---|\n");
  for (size_t mb : {14, 33}) {
    const uint32_t pieces = (uint32_t)(mb * 1000 * 1000 / 512);
    const double bytes = pieces * 512.0;
    for (int rep = 0; rep < 2; ++rep) {
      for (bool pf : {false, true}) {
        const float t = time_it([&] {
          if (pf) async_kernel<true><<<sms, 512>>>(a, out, pieces);
          else async_kernel<false><<<sms, 512>>>(a, out, pieces);
        });
        printf("| %zu | %s | %.2f | %.0f | %.1f |\n", mb, pf ? "cp.async.cg.L2::256B" : "cp.async.cg", t, bytes / t / 1e3,
               100.0 * bytes / t / 1e3 / copy_gbs);
      }
    }
  }
  CK(cudaDeviceSynchronize());
  CK(cudaFree(a));
  CK(cudaFree(b));
  CK(cudaFree(out));
  return 0;
}
#endif  // PROBE_LIBRARY
