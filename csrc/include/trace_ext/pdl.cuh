// Programmatic dependent launch (sm_90+): a kernel launched as a programmatic dependent of the previous kernel in its
// stream (cudaLaunchAttributeProgrammaticStreamSerialization) may be scheduled before that kernel's end and memory
// flush; it calls griddep_wait() before it touches global memory, which returns once the previous grid has completed
// and its writes are visible. For a kernel launched plainly griddep_wait() returns at once.
#pragma once

#include <c10/util/Exception.h>
#include <cuda_runtime.h>

namespace trace_ext {

__device__ __forceinline__ void griddep_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }

// kernel<<<grid, threads, smem, stream>>>(args...), as a programmatic dependent of the previous work in the stream when
// `programmatic` (the kernel must call griddep_wait() before its first global access); returns the launch's status.
template <typename... KernelArgs, typename... Args>
cudaError_t launch_kernel_status(void (*kernel)(KernelArgs...), dim3 grid, unsigned int threads, int smem,
                                 cudaStream_t stream, bool programmatic, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = (size_t)smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = programmatic ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, args...);
}

// launch_kernel_status, and a launch error raises.
template <typename... KernelArgs, typename... Args>
void launch_kernel(void (*kernel)(KernelArgs...), dim3 grid, unsigned int threads, int smem, cudaStream_t stream,
                   bool programmatic, const char* what, Args... args) {
  const cudaError_t err = launch_kernel_status(kernel, grid, threads, smem, stream, programmatic, args...);
  (void)cudaGetLastError();  // the launch's status is err
  TORCH_CHECK(err == cudaSuccess, "trace_ext: ", what, " kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace trace_ext
