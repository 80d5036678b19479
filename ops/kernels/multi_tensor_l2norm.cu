// aiak::multi_tensor_l2norm (ops/multi_tensor_l2norm.py). Table layout and helpers:
// mta_common.cuh.

#include "mta_common.cuh"

// ---------------------------------------------------------------------------------------------
// L2 norm in one launch: block c sums the squares of chunk c; the last of a tensor's blocks to
// finish (a ticket per tensor) sums that tensor's chunk partials, and the last block of the grid
// sums the tensors'. Every sum runs in a fixed order, so the result is bitwise repeatable: the
// tickets only elect which block does the work. One launch, not two: on a ResNet-50-sized set
// the op's GPU time (~42 us) is a few launches' host time.
//
// Scratch, int64 words per (table, stream), zero when allocated (each ticket is reset by the
// block that takes it last):
//   [0]               the grid's ticket
//   [1, 1+T)          tensor t's ticket
//   [1+T, 1+2T)       tensor t's sum of squares (double)
//   [1+2T, ...)       chunk c's partial sum of squares (float)
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
mt_l2norm(const i64* __restrict__ table, int T, i64* __restrict__ scratch,
          float* __restrict__ per_tensor, float* __restrict__ total) {
  __shared__ float fsh[512 / WARP];
  __shared__ double dsh[512 / WARP];
  u64* tickets = reinterpret_cast<u64*>(scratch);
  double* tsum = reinterpret_cast<double*>(scratch + 1 + T);
  float* partials = reinterpret_cast<float*>(scratch + 1 + 2 * (i64)T);
  const i64* first = table + 3 * (i64)T;  // D = 1
  const int c = blockIdx.x;
  if (c < first[T]) {  // the grid has one block even when there are no chunks
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
    s = block_sum(s, fsh);
    if (threadIdx.x == 0) partials[c] = s;
    const int t = r.tensor;
    const i64 lo = first[t], hi = first[t + 1];
    if (last_to_arrive(tickets + 1 + t, (u64)(hi - lo))) {
      const volatile float* vp = partials;
      double v = 0.0;
      for (i64 k = lo + threadIdx.x; k < hi; k += blockDim.x) v += (double)vp[k];
      v = block_sum(v, dsh);
      if (threadIdx.x == 0) {
        tsum[t] = v;
        if (per_tensor != nullptr) per_tensor[t] = (float)sqrt(v);
      }
    }
  }
  if (last_to_arrive(tickets, gridDim.x)) {
    const volatile double* vt = tsum;
    double v = 0.0;
    for (int t = threadIdx.x; t < T; t += blockDim.x) {
      if (first[t + 1] > first[t]) {
        v += vt[t];
      } else if (per_tensor != nullptr) {
        per_tensor[t] = 0.f;  // an empty tensor has no chunk, so no block wrote its norm
      }
    }
    v = block_sum(v, dsh);
    if (threadIdx.x == 0) *total = (float)sqrt(v);
  }
}
