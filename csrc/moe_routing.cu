// MoE routing helpers for the grouped FP4 GEMM: permute tokens by expert (stable) and un-permute with the top-k
// weights.
//
// Design note:
//  - The T*k (token, slot) pairs, flat index i = t*k + j, are sorted by expert, stable in i, so the result is
//    deterministic and equal to the reference (torch.sort(stable=True)). Counting sort in three small kernels:
//    (1) per 256-pair chunk, per-expert counts (warp __match_any_sync + per-warp counters in shared memory),
//    (2) one CTA turns the chunk counts into expert offsets and per-chunk bases, (3) each pair gets
//    base[chunk][e] + (pairs of e in earlier warps of the chunk) + (rank among its warp's peers). Then a row
//    gather with 16-byte copies. No atomics, so the order never depends on timing.
//  - Expert ids outside [0, E) are dropped: dest_of = -1, they own no sorted row (rows past offsets[E] are zero)
//    and un-permute skips them. The Python op validates ids when asked to.
//  - Un-permute: out[t] = sum_j w[t, j] * y[dest_of[t*k + j]] in fp32, in slot order j = 0..k-1 with one rounding
//    per multiply and per add (__fmul_rn / __fadd_rn), so the reference reproduces it bit for bit.
//  - Plain CUDA (no arch-specific instructions): compiles for sm_90a and sm_100a alike.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include "trace_ext/host_checks.h"

namespace trace_ext {
namespace moe_routing {

constexpr int kChunk = 256;              // pairs per chunk (one thread each)
constexpr int kWarpsPerChunk = kChunk / 32;
constexpr int kMaxExperts = 1024;        // per-warp counters: kWarpsPerChunk * E ints of shared memory
constexpr int kScanThreads = 1024;
static_assert(kChunk % 32 == 0, "a chunk is whole warps");
static_assert(kWarpsPerChunk * kMaxExperts * 4 <= 48 * 1024, "per-warp counters must fit static shared memory");

template <typename Id>
__device__ __forceinline__ int load_expert(const Id* ids, int64_t i, int64_t n, int E) {
  if (i >= n) return -1;
  const int64_t e = static_cast<int64_t>(ids[i]);
  return (e >= 0 && e < E) ? static_cast<int>(e) : -1;
}

// Per-warp counts of each expert within this chunk; returns this pair's rank among its warp peers.
__device__ __forceinline__ int warp_counts(int e, int* s_cnt, int E) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned peers = __match_any_sync(0xffffffffu, e);
  const int rank = __popc(peers & ((1u << lane) - 1u));
  if (e >= 0 && rank == 0) s_cnt[warp * E + e] = __popc(peers);
  return rank;
}

template <typename Id>
__global__ void __launch_bounds__(kChunk) chunk_count_kernel(const Id* ids, int64_t n, int E, int* chunk_counts) {
  __shared__ int s_cnt[kWarpsPerChunk * kMaxExperts];
  for (int i = threadIdx.x; i < kWarpsPerChunk * E; i += kChunk) s_cnt[i] = 0;
  __syncthreads();
  const int64_t i = (int64_t)blockIdx.x * kChunk + threadIdx.x;
  warp_counts(load_expert(ids, i, n, E), s_cnt, E);
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += kChunk) {
    int c = 0;
#pragma unroll
    for (int w = 0; w < kWarpsPerChunk; ++w) c += s_cnt[w * E + e];
    chunk_counts[(int64_t)blockIdx.x * E + e] = c;
  }
}

// One CTA: chunk_counts[b][e] -> chunk bases (in place, absolute sorted positions) and offsets[E + 1].
__global__ void __launch_bounds__(kScanThreads) scan_kernel(int* chunk_counts, int n_chunks, int E, int* offsets) {
  __shared__ int s_tot[kMaxExperts];
  __shared__ int s_warp[kScanThreads / 32];
  for (int e = threadIdx.x; e < E; e += kScanThreads) {
    int run = 0;
    for (int b = 0; b < n_chunks; ++b) {
      const int c = chunk_counts[(int64_t)b * E + e];
      chunk_counts[(int64_t)b * E + e] = run;
      run += c;
    }
    s_tot[e] = run;
  }
  __syncthreads();
  // exclusive scan of s_tot over e (E <= kScanThreads): one value per thread
  const int e = threadIdx.x;
  const int v = e < E ? s_tot[e] : 0;
  const int lane = e & 31, warp = e >> 5;
  int inc = v;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int u = __shfl_up_sync(0xffffffffu, inc, d);
    if (lane >= d) inc += u;
  }
  if (lane == 31) s_warp[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    int w = s_warp[lane];
    int winc = w;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int u = __shfl_up_sync(0xffffffffu, winc, d);
      if (lane >= d) winc += u;
    }
    s_warp[lane] = winc - w;
  }
  __syncthreads();
  const int excl = inc - v + s_warp[warp];
  if (e < E) {
    offsets[e] = excl;
    if (e == E - 1) offsets[E] = excl + v;
  }
  __syncthreads();
  if (e < E) s_tot[e] = excl;
  __syncthreads();
  for (int ee = threadIdx.x; ee < E; ee += kScanThreads)
    for (int b = 0; b < n_chunks; ++b) chunk_counts[(int64_t)b * E + ee] += s_tot[ee];
}

template <typename Id>
__global__ void __launch_bounds__(kChunk) place_kernel(const Id* ids, int64_t n, int E, int k, const int* chunk_base,
                                                        int* src_row, int* dest_of) {
  __shared__ int s_cnt[kWarpsPerChunk * kMaxExperts];
  for (int i = threadIdx.x; i < kWarpsPerChunk * E; i += kChunk) s_cnt[i] = 0;
  __syncthreads();
  const int64_t i = (int64_t)blockIdx.x * kChunk + threadIdx.x;
  const int e = load_expert(ids, i, n, E);
  const int rank = warp_counts(e, s_cnt, E);
  __syncthreads();
  if (i >= n) return;
  if (e < 0) {
    dest_of[i] = -1;
    return;
  }
  int pos = chunk_base[(int64_t)blockIdx.x * E + e] + rank;
  const int warp = threadIdx.x >> 5;
  for (int w = 0; w < warp; ++w) pos += s_cnt[w * E + e];
  dest_of[i] = pos;
  src_row[pos] = static_cast<int>(i / k);
}

// x_sorted[r] = x[src_row[r]] for r < offsets[E]; zero rows after (dropped pairs). Row bytes % 16 == 0 -> uint4.
template <typename V>
__global__ void gather_rows_kernel(const V* x, V* out, const int* src_row, const int* offsets, int E,
                                   int64_t row_vecs) {
  const int64_t r = blockIdx.x;
  const int valid = offsets[E];
  V* dst = out + r * row_vecs;
  if (r >= valid) {
    V zero;
    memset(&zero, 0, sizeof(V));
    for (int64_t c = threadIdx.x; c < row_vecs; c += blockDim.x) dst[c] = zero;
    return;
  }
  const V* src = x + (int64_t)src_row[r] * row_vecs;
  for (int64_t c = threadIdx.x; c < row_vecs; c += blockDim.x) dst[c] = src[c];
}

template <typename T>
__device__ __forceinline__ float to_f(T v);
template <>
__device__ __forceinline__ float to_f<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float to_f<__half>(__half v) { return __half2float(v); }
template <typename T>
__device__ __forceinline__ T from_f(float v);
template <>
__device__ __forceinline__ float from_f<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }

template <typename T, typename W>
__global__ void unpermute_kernel(const T* y, const int* dest_of, const W* weights, T* out, int64_t rows, int k,
                                 int64_t H) {
  const int64_t t = blockIdx.y;
  const int64_t h = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (h >= H) return;
  float acc = 0.f;
  // rows: y's row count T * k; dest_of values outside [0, rows) are dropped like -1 (never read)
  for (int j = 0; j < k; ++j) {
    const int p = dest_of[t * k + j];
    if (p < 0 || p >= rows) continue;
    acc = __fadd_rn(acc, __fmul_rn(to_f(weights[t * k + j]), to_f(y[(int64_t)p * H + h])));
  }
  out[t * H + h] = from_f<T>(acc);
}

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_permute_cuda(const at::Tensor& x, const at::Tensor& topk_ids, int64_t num_experts) {
  check_cuda(x, "x");
  check_cuda(topk_ids, "topk_ids");
  check_same_device(x, topk_ids, "x", "topk_ids");
  TORCH_CHECK_TYPE(topk_ids.scalar_type() == at::kInt || topk_ids.scalar_type() == at::kLong,
                   "trace_ext: topk_ids must be int32 or int64, got ", topk_ids.scalar_type());
  TORCH_CHECK_VALUE(x.dim() == 2, "trace_ext: moe_permute: x must be [T, H], got shape ", x.sizes());
  TORCH_CHECK_VALUE(topk_ids.dim() == 2 && topk_ids.size(0) == x.size(0), "trace_ext: moe_permute: topk_ids must be [T, k] with T = ",
                    x.size(0), ", got shape ", topk_ids.sizes());
  TORCH_CHECK_VALUE(num_experts >= 1 && num_experts <= kMaxExperts, "trace_ext: moe_permute: num_experts must be in [1, ",
                    kMaxExperts, "], got ", num_experts);
  check_contiguous(x, "x");
  check_contiguous(topk_ids, "topk_ids");
  const int64_t T = x.size(0), H = x.size(1), k = topk_ids.size(1), n = T * k;
  TORCH_CHECK_VALUE(n < (int64_t(1) << 31), "trace_ext: moe_permute: T * k must fit in int32");
  const int E = (int)num_experts;
  auto iopt = x.options().dtype(at::kInt);
  at::Tensor x_sorted = at::empty({n, H}, x.options());
  at::Tensor src_row = at::zeros({n}, iopt);
  at::Tensor dest_of = at::empty({n}, iopt);
  at::Tensor offsets = at::zeros({E + 1}, iopt);
  if (n == 0) return std::make_tuple(x_sorted, src_row, dest_of, offsets);
  const c10::cuda::CUDAGuard guard(x.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int n_chunks = (int)((n + kChunk - 1) / kChunk);
  at::Tensor chunk = at::empty({(int64_t)n_chunks * E}, iopt);
  auto launch = [&](auto* ids) {
    using Id = std::remove_const_t<std::remove_pointer_t<decltype(ids)>>;
    require_kernel_image(chunk_count_kernel<Id>, "moe_permute");
    chunk_count_kernel<Id><<<n_chunks, kChunk, 0, stream>>>(ids, n, E, chunk.data_ptr<int>());
    scan_kernel<<<1, kScanThreads, 0, stream>>>(chunk.data_ptr<int>(), n_chunks, E, offsets.data_ptr<int>());
    place_kernel<Id><<<n_chunks, kChunk, 0, stream>>>(ids, n, E, (int)k, chunk.data_ptr<int>(),
                                                       src_row.data_ptr<int>(), dest_of.data_ptr<int>());
  };
  if (topk_ids.scalar_type() == at::kInt) launch(topk_ids.data_ptr<int>());
  else launch(topk_ids.data_ptr<int64_t>());
  check_launch("moe_permute");
  if (H > 0) {
    const int64_t row_bytes = H * x.element_size();
    const bool vec = row_bytes % 16 == 0 && (reinterpret_cast<uintptr_t>(x.data_ptr()) % 16) == 0;
    const int threads = 128;
    if (vec) {
      gather_rows_kernel<uint4><<<n, threads, 0, stream>>>(reinterpret_cast<const uint4*>(x.data_ptr()),
                                                           reinterpret_cast<uint4*>(x_sorted.data_ptr()),
                                                           src_row.data_ptr<int>(), offsets.data_ptr<int>(), E,
                                                           row_bytes / 16);
    } else {
      gather_rows_kernel<uint8_t><<<n, threads, 0, stream>>>(reinterpret_cast<const uint8_t*>(x.data_ptr()),
                                                             reinterpret_cast<uint8_t*>(x_sorted.data_ptr()),
                                                             src_row.data_ptr<int>(), offsets.data_ptr<int>(), E,
                                                             row_bytes);
    }
    check_launch("moe_permute (gather)");
  }
  return std::make_tuple(x_sorted, src_row, dest_of, offsets);
}

at::Tensor moe_unpermute_cuda(const at::Tensor& y, const at::Tensor& dest_of, const at::Tensor& w) {
  check_cuda(y, "y_sorted");
  check_cuda(dest_of, "dest_of");
  check_cuda(w, "topk_weights");
  check_same_device(y, dest_of, "y_sorted", "dest_of");
  check_same_device(y, w, "y_sorted", "topk_weights");
  TORCH_CHECK_TYPE(y.scalar_type() == at::kBFloat16 || y.scalar_type() == at::kHalf || y.scalar_type() == at::kFloat,
                   "trace_ext: moe_unpermute: y_sorted must be bfloat16, float16 or float32, got ", y.scalar_type());
  TORCH_CHECK_TYPE(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16,
                   "trace_ext: moe_unpermute: topk_weights must be float32 or bfloat16, got ", w.scalar_type());
  check_dtype(dest_of, at::kInt, "dest_of");
  TORCH_CHECK_VALUE(w.dim() == 2, "trace_ext: moe_unpermute: topk_weights must be [T, k], got shape ", w.sizes());
  TORCH_CHECK_VALUE(y.dim() == 2 && y.size(0) == w.numel(), "trace_ext: moe_unpermute: y_sorted must be [T*k, H] with T*k = ",
                    w.numel(), ", got shape ", y.sizes());
  check_shape(dest_of, {w.numel()}, "dest_of");
  check_contiguous(y, "y_sorted");
  check_contiguous(dest_of, "dest_of");
  check_contiguous(w, "topk_weights");
  const int64_t T = w.size(0), k = w.size(1), H = y.size(1);
  at::Tensor out = at::empty({T, H}, y.options());
  if (T == 0 || H == 0) return out;
  TORCH_CHECK_VALUE(T <= 65535 * 1024LL, "trace_ext: moe_unpermute: too many tokens");
  const c10::cuda::CUDAGuard guard(y.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int threads = 256;
  auto go = [&](auto* yp, auto* wp) {
    using Y = std::remove_const_t<std::remove_pointer_t<decltype(yp)>>;
    using W = std::remove_const_t<std::remove_pointer_t<decltype(wp)>>;
    auto kernel = unpermute_kernel<Y, W>;
    require_kernel_image(kernel, "moe_unpermute");
    // grid.y holds tokens (<= 65535 per launch); larger T is walked in slices
    for (int64_t t0 = 0; t0 < T; t0 += 65535) {
      const int64_t tn = std::min<int64_t>(65535, T - t0);
      dim3 grid((unsigned)((H + threads - 1) / threads), (unsigned)tn);
      kernel<<<grid, threads, 0, stream>>>(yp, dest_of.data_ptr<int>() + t0 * k, wp + t0 * k,
                                           reinterpret_cast<Y*>(out.data_ptr()) + t0 * H, T * k, (int)k, H);
    }
  };
  auto with_w = [&](auto* yp) {
    if (w.scalar_type() == at::kFloat) go(yp, w.data_ptr<float>());
    else go(yp, reinterpret_cast<const __nv_bfloat16*>(w.data_ptr()));
  };
  if (y.scalar_type() == at::kFloat) with_w(y.data_ptr<float>());
  else if (y.scalar_type() == at::kBFloat16) with_w(reinterpret_cast<const __nv_bfloat16*>(y.data_ptr()));
  else with_w(reinterpret_cast<const __half*>(y.data_ptr()));
  check_launch("moe_unpermute");
  return out;
}

}  // namespace
}  // namespace moe_routing
}  // namespace trace_ext

TORCH_LIBRARY_IMPL(trace_ext, CUDA, m) {
  m.impl("moe_permute", &trace_ext::moe_routing::moe_permute_cuda);
  m.impl("moe_unpermute", &trace_ext::moe_routing::moe_unpermute_cuda);
}
