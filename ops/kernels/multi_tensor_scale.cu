// aiak::multi_tensor_scale_ (ops/multi_tensor_scale.py). Table layout and helpers:
// mta_common.cuh.

#include "mta_common.cuh"

// ---------------------------------------------------------------------------------------------
// Scale: dst = src * scale with dtype conversion; found_inf = 1 if any src is not finite.
// ---------------------------------------------------------------------------------------------

template <typename TI, typename TO>
__device__ bool scale_range(const TI* __restrict__ src, TO* __restrict__ dst, i64 begin, i64 end,
                            float s) {
  constexpr int N = 4;  // 16 bytes of fp32 or 8 bytes of half per access
  const int B = blockDim.x;
  bool bad = false;
  i64 nvec = 0;
  if (aligned(src + begin, N * sizeof(TI)) && aligned(dst + begin, N * sizeof(TO))) {
    const TI* in = src + begin;
    TO* out = dst + begin;
    nvec = (end - begin) / N;
    i64 i = threadIdx.x;
    for (; i + B < nvec; i += 2 * B) {
      float x0[N], x1[N];
      load_pack<TI, N>(in, i, x0);
      load_pack<TI, N>(in, i + B, x1);
#pragma unroll
      for (int j = 0; j < N; ++j) {
        bad |= not_finite(x0[j]) | not_finite(x1[j]);
        x0[j] *= s;
        x1[j] *= s;
      }
      store_pack<TO, N>(out, i, x0);
      store_pack<TO, N>(out, i + B, x1);
    }
    for (; i < nvec; i += B) {
      float x0[N];
      load_pack<TI, N>(in, i, x0);
#pragma unroll
      for (int j = 0; j < N; ++j) {
        bad |= not_finite(x0[j]);
        x0[j] *= s;
      }
      store_pack<TO, N>(out, i, x0);
    }
  }
  for (i64 i = begin + nvec * N + threadIdx.x; i < end; i += B) {
    float x = to_float(src[i]);
    bad |= not_finite(x);
    dst[i] = from_float<TO>(x * s);
  }
  return bad;
}

template <typename TI>
__device__ bool scale_dispatch_out(const TI* src, void* dst, int out_code, i64 b, i64 e, float s) {
  if (out_code == 0) return scale_range(src, static_cast<float*>(dst), b, e, s);
  if (out_code == 1) return scale_range(src, static_cast<half_t*>(dst), b, e, s);
  return scale_range(src, static_cast<bf16_t*>(dst), b, e, s);
}

extern "C" __global__ void __launch_bounds__(512)
mt_scale(const i64* __restrict__ table, int T, const float* __restrict__ scale,
         float* __restrict__ found_inf) {
  ChunkRef r = chunk_ref(table, 2, T, blockIdx.x);
  const void* src = reinterpret_cast<const void*>(table[r.tensor]);
  void* dst = reinterpret_cast<void*>(table[T + r.tensor]);
  const int in_code = (int)table[2 * T + r.tensor];
  const int out_code = (int)table[3 * T + r.tensor];
  const float s = *scale;
  bool bad;
  if (in_code == 0) {
    bad = scale_dispatch_out(static_cast<const float*>(src), dst, out_code, r.begin, r.end, s);
  } else if (in_code == 1) {
    bad = scale_dispatch_out(static_cast<const half_t*>(src), dst, out_code, r.begin, r.end, s);
  } else {
    bad = scale_dispatch_out(static_cast<const bf16_t*>(src), dst, out_code, r.begin, r.end, s);
  }
  // Any thread of the block saw a non-finite value: one store; every writer stores 1.0f.
  if (__syncthreads_or(bad) && threadIdx.x == 0) *found_inf = 1.0f;
}

