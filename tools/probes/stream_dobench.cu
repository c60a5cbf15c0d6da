// The traffic floors of l2_prefetch.cu timed the way the benches time our ops (bench.common.do_bench_cold: triton
// do_bench, median, L2 flushed before every call, torch's stream) instead of the probes' cudaEvents around one launch:
// a shared library with C launchers that tools/probes/stream_dobench.py loads with ctypes.
// Build: nvcc -O3 -std=c++17 -arch=sm_90a -shared -Xcompiler -fPIC tools/probes/stream_dobench.cu -o /tmp/stream_dobench.so
#define PROBE_LIBRARY
#include "l2_prefetch.cu"

extern "C" {
// the quantizer-shaped stream (2 B read, 0.5625 B written per element; W rounds of 16 FMAs per 16-element block), the
// grid of l2_prefetch.cu (4 tiles per warp)
int launch_quant(const void* x, void* codes, void* scales, uint32_t n_blocks, int W, int ld, cudaStream_t stream) {
  const int tiles = (int)((n_blocks + 64 * 8 - 1) / (64 * 8));
  auto* xv = reinterpret_cast<const uint4*>(x);
  auto* c = reinterpret_cast<uint2*>(codes);
  auto* s = reinterpret_cast<uint8_t*>(scales);
  if (ld == 0) quant_stream_kernel<Ld<0>><<<(tiles + 3) / 4, 256, 0, stream>>>(xv, c, s, n_blocks, W);
  else quant_stream_kernel<Ld<3>><<<(tiles + 3) / 4, 256, 0, stream>>>(xv, c, s, n_blocks, W);
  return (int)cudaGetLastError();
}
// a bare read of n16 16-byte words (U = 4 in flight per thread, 8 CTAs of 256 per SM), ld = 0: ld.global.nc,
// 3: ld.global.nc.L1::no_allocate.L2::256B
int launch_read(const void* x, void* out, uint32_t n16, int sms, int ld, cudaStream_t stream) {
  auto* xv = reinterpret_cast<const uint4*>(x);
  auto* o = reinterpret_cast<uint32_t*>(out);
  if (ld == 0) read_kernel<0, 4><<<sms * 8, 256, 0, stream>>>(xv, o, n16);
  else read_kernel<3, 2><<<sms * 8, 256, 0, stream>>>(xv, o, n16);
  return (int)cudaGetLastError();
}
}
