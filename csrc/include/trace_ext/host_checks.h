// Host-side argument checks and arch guards shared by every op entry (SPEC section 10).
// TORCH_CHECK raises RuntimeError, TORCH_CHECK_TYPE TypeError, TORCH_CHECK_VALUE ValueError.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>

#define TRACE_EXT_STRINGIFY_(x) #x
#define TRACE_EXT_STRINGIFY(x) TRACE_EXT_STRINGIFY_(x)
#ifdef TRACE_EXT_ARCHS
#define TRACE_EXT_ARCHS_STR TRACE_EXT_STRINGIFY(TRACE_EXT_ARCHS)
#else
#define TRACE_EXT_ARCHS_STR "unknown"
#endif

namespace trace_ext {

// An on / off A/B switch read per call from the environment: "0" off, "1" on, unset (or anything else) default_on.
inline bool env_switch(const char* name, bool default_on) {
  const char* v = std::getenv(name);
  if (v != nullptr && std::strcmp(v, "0") == 0) return false;
  if (v != nullptr && std::strcmp(v, "1") == 0) return true;
  return default_on;
}

// Multiprocessors of device `dev`, cached per device (the attribute query is not free on every call).
inline int sm_count(int dev) {
  constexpr int kMaxDevices = 64;
  static int cached[kMaxDevices] = {};
  if (dev >= 0 && dev < kMaxDevices && cached[dev] > 0) return cached[dev];
  int n = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  n = n > 0 ? n : 1;
  if (dev >= 0 && dev < kMaxDevices) cached[dev] = n;
  return n;
}

// Compute-capability major of device `dev`, cached per device like sm_count (dispatch asks it on every call).
inline int cc_major(int dev) {
  constexpr int kMaxDevices = 64;
  static int cached[kMaxDevices] = {};
  if (dev >= 0 && dev < kMaxDevices && cached[dev] > 0) return cached[dev];
  int major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  if (dev >= 0 && dev < kMaxDevices) cached[dev] = major;
  return major;
}

// Multiprocessors of the current device.
inline int current_sm_count() { return sm_count(c10::cuda::current_device()); }

inline void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "trace_ext: ", name, " must be a CUDA tensor, got ", t.device());
}

inline void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* na, const char* nb) {
  TORCH_CHECK(a.device() == b.device(), "trace_ext: ", na, " is on ", a.device(), " but ", nb, " is on ", b.device());
}

inline void check_dtype(const at::Tensor& t, at::ScalarType want, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == want, "trace_ext: ", name, " must be ", want, ", got ", t.scalar_type());
}

inline void check_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.is_contiguous(), "trace_ext: ", name, " must be contiguous");
}

inline void check_shape(const at::Tensor& t, at::IntArrayRef want, const char* name) {
  TORCH_CHECK_VALUE(t.sizes() == want, "trace_ext: ", name, " must have shape ", want, ", got ", t.sizes());
}

// Raise a clear RuntimeError when this build holds no machine code for the current GPU (instead of the
// launch failing with "no kernel image"): names the GPU, the archs built and how to rebuild.
template <typename Kernel>
inline void require_kernel_image(Kernel kernel, const char* op) {
  cudaFuncAttributes attr;
  cudaError_t err = cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(kernel));
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    int dev = 0, major = 0, minor = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    TORCH_CHECK(false, "trace_ext: ", op, " has no kernel for this GPU (sm_", major, minor, "): this build targets ",
                TRACE_EXT_ARCHS_STR, " (", cudaGetErrorString(err), "); rebuild with TRACE_EXT_CUDA_ARCHS='", major, ".",
                minor, "a'");
  }
}

inline void check_launch(const char* op) {
  cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "trace_ext: ", op, " kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace trace_ext
