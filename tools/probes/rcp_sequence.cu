// Is MUFU.RCP plus one FMA Newton step (rcp.approx.ftz, e = r x - 1, r - r e) __frcp_rn's result for every x with
// |x| in [2^-100, 2^100]? The reciprocal's rounding depends only on the significand (the exponent shifts it exactly in
// that range), so every one of the 2^23 significands is checked at exponents 0, +-50, +-99 and both signs.
// Background: the first version of nvfp4_quant_rowg_lean3_kernel (H200 round 45) used this sequence for 1/g and 1/t
// and its fp32 kernel disagreed with the reference at 257 x 64. Prints a markdown record (mismatch count, examples).
//   nvcc -O3 -std=c++17 -arch=sm_90a tools/probes/rcp_sequence.cu -o /tmp/rcp_sequence && /tmp/rcp_sequence
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "probe_common.h"

__device__ __forceinline__ float rcp_mufu_newton(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  const float e = __fmaf_rn(r, x, -1.0f);
  return __fmaf_rn(r, -e, r);
}

__global__ void check(int exp_shift, unsigned int* bad, unsigned int* first) {
  const unsigned int m = blockIdx.x * blockDim.x + threadIdx.x;  // significand bits
  if (m >= (1u << 23)) return;
  for (int sign = 0; sign < 2; ++sign) {
    const float x = __uint_as_float(((unsigned int)sign << 31) | ((unsigned int)(127 + exp_shift) << 23) | m);
    const float a = rcp_mufu_newton(x), b = __frcp_rn(x);
    if (__float_as_uint(a) != __float_as_uint(b)) {
      if (atomicAdd(bad, 1u) == 0u) *first = __float_as_uint(x);
    }
  }
}

int main(int argc, char** argv) {
  unsigned int *bad, *first;
  CK(cudaMallocManaged(&bad, 4));
  CK(cudaMallocManaged(&first, 4));
  print_probe_header("probe_rcp_sequence: MUFU.RCP + one FMA Newton step against __frcp_rn", argc, argv);
  std::printf("| exponent | values | mismatches | first mismatch x |\n|---|---|---|---|\n");
  unsigned int total = 0;
  for (int e : {0, 50, -50, 99, -99}) {
    *bad = 0u;
    *first = 0u;
    check<<<(1u << 23) / 256, 256>>>(e, bad, first);
    CK(cudaDeviceSynchronize());
    total += *bad;
    float fx;
    std::memcpy(&fx, first, 4);
    if (*bad) {
      std::printf("| 2^%d | %u | %u | %a |\n", e, 2u << 23, *bad, (double)fx);
    } else {
      std::printf("| 2^%d | %u | 0 | - |\n", e, 2u << 23);
    }
  }
  std::printf("\nmismatches in total: %u\n", total);
  return 0;
}
