// dst = (dst type)(float(src) * scale): one pass, computed in fp32 and rounded once.
// Used by aiak.comm's fp16/bf16 compression (scale before the cast to fp16, 1/scale after it).
// One kernel per (src, dst) dtype pair; 8 elements per thread and step through 16- or 32-byte
// vector accesses when both pointers allow it, else element by element. 64-bit offsets.

#include "mta_common.cuh"

// CuPy appends -ftz=true to NVRTC's options whatever we pass (cupy/cupy#9576), which would
// flush fp32 subnormal products to zero: a bf16 value near its smallest normal times 1/scale
// is one. An explicit PTX multiply without .ftz keeps IEEE subnormals.
__device__ __forceinline__ float mul_ieee(float a, float b) {
  float r;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

template <typename S, typename D>
__device__ __forceinline__ void cast_scale_body(const S* __restrict__ src, D* __restrict__ dst,
                                                float scale, i64 n) {
  constexpr int N = 8;
  const i64 stride = (i64)gridDim.x * blockDim.x;
  const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  i64 nvec = 0;
  if (aligned(src, sizeof(S) * N) && aligned(dst, sizeof(D) * N)) {
    nvec = n / N;
    for (i64 v = tid; v < nvec; v += stride) {
      float x[N];
      load_pack<S, N>(src, v, x);
#pragma unroll
      for (int j = 0; j < N; ++j) x[j] = mul_ieee(x[j], scale);
      store_pack<D, N>(dst, v, x);
    }
  }
  for (i64 i = nvec * N + tid; i < n; i += stride) dst[i] = from_float<D>(mul_ieee(to_float(src[i]), scale));
}

#define CAST_SCALE(NAME, S, D)                                                        \
  extern "C" __global__ void __launch_bounds__(512)                                   \
      NAME(const S* __restrict__ src, D* __restrict__ dst, float scale, i64 n) {      \
    cast_scale_body<S, D>(src, dst, scale, n);                                         \
  }

CAST_SCALE(cast_scale_f32_f32, float, float)
CAST_SCALE(cast_scale_f32_f16, float, half_t)
CAST_SCALE(cast_scale_f32_bf16, float, bf16_t)
CAST_SCALE(cast_scale_f16_f32, half_t, float)
CAST_SCALE(cast_scale_f16_f16, half_t, half_t)
CAST_SCALE(cast_scale_f16_bf16, half_t, bf16_t)
CAST_SCALE(cast_scale_bf16_f32, bf16_t, float)
CAST_SCALE(cast_scale_bf16_f16, bf16_t, half_t)
CAST_SCALE(cast_scale_bf16_bf16, bf16_t, bf16_t)
