// Shared pieces of the standalone H200 probes in tools/probes (no torch): error check, the record header, and the
// timing rule of the benches (cudaEvents around one launch after a 256 MB memset that evicts L2, median of 41 after
// 4 warm-up calls).
#pragma once
#include <cuda_runtime.h>

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
