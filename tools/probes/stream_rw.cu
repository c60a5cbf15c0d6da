// Floor probe for the quantize / KV-append traffic shape (H200): read 2 bytes and write 0.5625 bytes per element
// (bf16 in; 4-bit codes + one scale byte per 16 elements out) with no arithmetic, to see what share of the copy
// bandwidth a trivially simple stream of these bytes reaches at 2^26 and 2^28 elements.
// Standalone (no torch): nvcc -O3 -std=c++17 -arch=sm_90a tools/probes/stream_rw.cu -o /tmp/stream_rw
// Kernels: each lane handles U 32-byte blocks (16 elements: 2 x 16-byte loads -> one 8-byte code store + 1 scale byte)
// per iteration; blocks of a warp are consecutive (lane-contiguous 32-byte blocks, like nvfp4_quant_lean_kernel);
// grid either persistent (CTAS_PER_SM x SMs, grid stride) or one tile per warp (no loop).
// Timing: cudaEvents around one launch after a 256 MB memset (cold L2), median of 41; copy = cudaMemcpy of 1 GiB.

#include <cstdint>

#include "probe_common.h"

template <int U>
__global__ void __launch_bounds__(256) rw_kernel(const uint4* __restrict__ x, uint2* __restrict__ codes,
                                                 uint8_t* __restrict__ scales, uint32_t n_blocks) {
  const uint32_t lane = threadIdx.x % 32;
  const uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const uint32_t warps = gridDim.x * blockDim.x / 32;
  for (uint32_t b0 = warp * 32 * U + lane; b0 < n_blocks; b0 += warps * 32 * U) {
    uint4 v[U][2];
#pragma unroll
    for (int q = 0; q < U; ++q) {
      const uint32_t b = b0 + 32 * q;
      if (b < n_blocks) {
        v[q][0] = __ldcs(x + 2 * (size_t)b);
        v[q][1] = __ldcs(x + 2 * (size_t)b + 1);
      }
    }
#pragma unroll
    for (int q = 0; q < U; ++q) {
      const uint32_t b = b0 + 32 * q;
      if (b < n_blocks) {
        const uint32_t c0 = v[q][0].x ^ v[q][0].y ^ v[q][0].z ^ v[q][0].w;
        const uint32_t c1 = v[q][1].x ^ v[q][1].y ^ v[q][1].z ^ v[q][1].w;
        codes[b] = make_uint2(c0, c1);
        scales[b] = (uint8_t)(c0 ^ c1);
      }
    }
  }
}

int main(int argc, char** argv) {
  print_probe_header("stream_rw: the quantize / KV-append traffic shape (2 B read, 0.5625 B written per element) with no arithmetic", argc, argv);
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  auto time_it = [&](auto launch) { return probe_time_us([&](int) { launch(); }); };
  {
    const size_t bytes = size_t(1) << 30;
    void *a, *b;
    CK(cudaMalloc(&a, bytes));
    CK(cudaMalloc(&b, bytes));
    const float t = time_it([&] { CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice)); });
    printf("cudaMemcpy 1 GiB (%d SMs): %.1f us = %.0f GB/s (read + write)\n\n", sms, t, 2.0 * bytes / t / 1e3);
    for (size_t mb : {172, 86}) {
      const size_t n = mb << 20;
      const float t2 = time_it([&] { CK(cudaMemcpyAsync(b, a, n / 2, cudaMemcpyDeviceToDevice)); });
      printf("cudaMemcpy %zu MiB read+write: %.1f us = %.0f GB/s\n\n", mb, t2, 1.0 * n / t2 / 1e3);
    }
    CK(cudaFree(a));
    CK(cudaFree(b));
  }
  printf("| elements | U | grid | us | GB/s (2.5625 B/elem) |\n|---|---|---|---|---|\n");
  for (int lg : {26, 28}) {
    const size_t n = size_t(1) << lg;
    const uint32_t n_blocks = (uint32_t)(n / 16);
    uint4* x;
    uint2* codes;
    uint8_t* scales;
    CK(cudaMalloc(&x, n * 2));
    CK(cudaMemset(x, 0x3C, n * 2));
    CK(cudaMalloc(&codes, n / 2));
    CK(cudaMalloc(&scales, n / 16));
    const double bytes = n * 2.5625;
    auto run = [&](const char* what, auto kernel, int U, int grid) {
      const float t = time_it([&] { kernel<<<grid, 256>>>(x, codes, scales, n_blocks); });
      printf("| 2^%d | %d | %s %d | %.2f | %.0f |\n", lg, U, what, grid, t, bytes / t / 1e3);
    };
    const int tiles1 = (int)((n_blocks + 32 * 8 * 1 - 1) / (32 * 8 * 1));
    const int tiles2 = (int)((n_blocks + 32 * 8 * 2 - 1) / (32 * 8 * 2));
    const int tiles4 = (int)((n_blocks + 32 * 8 * 4 - 1) / (32 * 8 * 4));
    run("one tile per warp", rw_kernel<1>, 1, tiles1);
    run("one tile per warp", rw_kernel<2>, 2, tiles2);
    run("one tile per warp", rw_kernel<4>, 4, tiles4);
    for (int k : {4, 8, 16}) {
      run("persistent", rw_kernel<1>, 1, sms * k);
      run("persistent", rw_kernel<2>, 2, sms * k);
      run("persistent", rw_kernel<4>, 4, sms * k);
    }
    run("4 tiles per warp", rw_kernel<2>, 2, (tiles2 + 3) / 4);
    CK(cudaFree(x));
    CK(cudaFree(codes));
    CK(cudaFree(scales));
  }
  CK(cudaDeviceSynchronize());
  return 0;
}
