// aiak::multi_tensor_l2norm (ops/multi_tensor_l2norm.py). Table layout and helpers:
// mta_common.cuh.

#include "mta_common.cuh"

// ---------------------------------------------------------------------------------------------
// L2 norm: partial sums of squares per chunk, then one block reduces per tensor and overall.
// Two passes in a fixed order: the result is deterministic (no atomics).
// ---------------------------------------------------------------------------------------------

template <typename T>
__device__ float sumsq_range(const T* __restrict__ p, i64 begin, i64 end) {
  constexpr int N = 16 / sizeof(T);  // 16-byte loads
  const int B = blockDim.x;
  float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
  i64 nvec = 0;
  if (aligned(p + begin, 16)) {
    const T* base = p + begin;
    nvec = (end - begin) / N;
    i64 i = threadIdx.x;
    // Four independent 16-byte loads in flight per thread: enough bytes in flight per SM to
    // approach the memory bandwidth with 512-thread blocks.
    for (; i + 3 * B < nvec; i += 4 * B) {
      float x0[N], x1[N], x2[N], x3[N];
      load_pack<T, N>(base, i, x0);
      load_pack<T, N>(base, i + B, x1);
      load_pack<T, N>(base, i + 2 * B, x2);
      load_pack<T, N>(base, i + 3 * B, x3);
#pragma unroll
      for (int j = 0; j < N; ++j) {
        a0 += x0[j] * x0[j];
        a1 += x1[j] * x1[j];
        a2 += x2[j] * x2[j];
        a3 += x3[j] * x3[j];
      }
    }
    for (; i < nvec; i += B) {
      float x0[N];
      load_pack<T, N>(base, i, x0);
#pragma unroll
      for (int j = 0; j < N; ++j) a0 += x0[j] * x0[j];
    }
  }
  for (i64 i = begin + nvec * N + threadIdx.x; i < end; i += B) {
    float x = to_float(p[i]);
    a0 += x * x;
  }
  return (a0 + a1) + (a2 + a3);
}

extern "C" __global__ void __launch_bounds__(512)
mt_l2norm_partial(const i64* __restrict__ table, int T, float* __restrict__ partials) {
  __shared__ float warp_sums[512 / WARP];
  const int c = blockIdx.x;
  ChunkRef r = chunk_ref(table, 1, T, c);
  const void* p = reinterpret_cast<const void*>(table[r.tensor]);
  const int code = (int)table[T + r.tensor];
  float s;
  if (code == 0) {
    s = sumsq_range(static_cast<const float*>(p), r.begin, r.end);
  } else if (code == 1) {
    s = sumsq_range(static_cast<const half_t*>(p), r.begin, r.end);
  } else {
    s = sumsq_range(static_cast<const bf16_t*>(p), r.begin, r.end);
  }
  s = warp_sum(s);
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
  if (lane == 0) warp_sums[warp] = s;
  __syncthreads();
  if (warp == 0) {
    s = lane < (int)(blockDim.x / WARP) ? warp_sums[lane] : 0.f;
    s = warp_sum(s);
    if (lane == 0) partials[c] = s;
  }
}

// One block of 1024 threads: warp w sums the chunk partials of tensors w, w+32, ... in float64.
extern "C" __global__ void __launch_bounds__(1024)
mt_l2norm_finalize(const i64* __restrict__ table, int T, const float* __restrict__ partials,
                   float* __restrict__ per_tensor, float* __restrict__ total) {
  __shared__ double warp_totals[1024 / WARP];
  const i64* first = table + 2 * T + T;  // D = 1
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
  const int nwarps = blockDim.x / WARP;
  double acc = 0.0;
  for (int t = warp; t < T; t += nwarps) {
    double s = 0.0;
    for (i64 k = first[t] + lane; k < first[t + 1]; k += WARP) s += (double)partials[k];
    s = warp_sum(s);
    if (lane == 0) {
      if (per_tensor != nullptr) per_tensor[t] = (float)sqrt(s);
      acc += s;
    }
  }
  if (lane == 0) warp_totals[warp] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    double s = 0.0;
    for (int w = 0; w < nwarps; ++w) s += warp_totals[w];
    *total = (float)sqrt(s);
  }
}
