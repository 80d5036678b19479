// Device helpers shared by the multi-tensor kernels (inlined by ops/_cuda.py's loader, so the
// compile cache sees the whole text; nvcc finds it through -I ops/kernels).
//
// Table layout (int64 words), built once per tensor set by ops/_mta.py:
//   [0, D*T)            data pointer of tensor t in list d      at d*T + t
//   [D*T, 2*D*T)        dtype code of tensor t in list d        at D*T + d*T + t  (0 f32, 1 f16, 2 bf16)
//   [2*D*T, 2*D*T+T)    numel of tensor t
//   [.., +T+1)          first chunk of tensor t (prefix sum; entry T = number of chunks)
//   [.., +C)            chunk c -> (tensor << 32) | chunk-within-tensor
// D is the list depth, T the number of tensors, C of chunks. One block per chunk of CHUNK
// elements; offsets are 64-bit, so tensors may pass 2^31 elements.
//
// No CUDA headers: NVRTC through CuPy must compile without the CUDA include path, so half and
// bfloat16 conversions are written out (PTX cvt for half, round-to-nearest-even for bf16).
#pragma once

typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;

#define CHUNK 65536
#define WARP 32

struct half_t { u16 x; };
struct bf16_t { u16 x; };

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(half_t v) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.x));
  return f;
}
__device__ __forceinline__ float to_float(bf16_t v) { return __uint_as_float(((u32)v.x) << 16); }

template <typename T> __device__ __forceinline__ T from_float(float f);
template <> __device__ __forceinline__ float from_float<float>(float f) { return f; }
template <> __device__ __forceinline__ half_t from_float<half_t>(float f) {
  half_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.x) : "f"(f));
  return h;
}
template <> __device__ __forceinline__ bf16_t from_float<bf16_t>(float f) {
  u32 u = __float_as_uint(f);
  bf16_t b;
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep it a (quiet) NaN, sign preserved
    b.x = (u16)((u >> 16) | 0x0040u);
  } else {                                // round to nearest, ties to even
    u += 0x7fffu + ((u >> 16) & 1u);
    b.x = (u16)(u >> 16);
  }
  return b;
}

__device__ __forceinline__ bool not_finite(float v) {
  return (__float_as_uint(v) & 0x7f800000u) == 0x7f800000u;
}

// ---------------------------------------------------------------------------------------------
// Vector access: N elements of T at once, N * sizeof(T) bytes (8 or 16), when aligned.
// ---------------------------------------------------------------------------------------------

template <typename T, int N> struct alignas(sizeof(T) * N) Pack { T v[N]; };

template <typename T, int N>
__device__ __forceinline__ void load_pack(const T* p, i64 i, float (&out)[N]) {
  Pack<T, N> pk = reinterpret_cast<const Pack<T, N>*>(p)[i];
#pragma unroll
  for (int j = 0; j < N; ++j) out[j] = to_float(pk.v[j]);
}

template <typename T, int N>
__device__ __forceinline__ void store_pack(T* p, i64 i, const float (&in)[N]) {
  Pack<T, N> pk;
#pragma unroll
  for (int j = 0; j < N; ++j) pk.v[j] = from_float<T>(in[j]);
  reinterpret_cast<Pack<T, N>*>(p)[i] = pk;
}

__device__ __forceinline__ bool aligned(const void* p, int bytes) {
  return (reinterpret_cast<u64>(p) & (u64)(bytes - 1)) == 0;
}

struct ChunkRef {
  int tensor;
  i64 begin;
  i64 end;
};

__device__ __forceinline__ ChunkRef chunk_ref(const i64* table, int D, int T, int c) {
  const i64* numel = table + 2 * D * T;
  const i64* chunks = numel + 2 * T + 1;
  i64 word = chunks[c];
  ChunkRef r;
  r.tensor = (int)(word >> 32);
  r.begin = (i64)(word & 0xffffffffll) * CHUNK;
  i64 n = numel[r.tensor];
  r.end = r.begin + CHUNK < n ? r.begin + CHUNK : n;
  return r;
}

template <typename F>
__device__ __forceinline__ F warp_sum(F v) {
#pragma unroll
  for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over the block, in a fixed order (bitwise repeatable); the result is in thread 0.
// `sh` holds one F per warp; the block size is a multiple of WARP.
template <typename F>
__device__ __forceinline__ F block_sum(F v, F* sh) {
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
  v = warp_sum(v);
  __syncthreads();  // `sh` may still be read from an earlier call
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < (int)(blockDim.x / WARP) ? sh[lane] : (F)0;
    v = warp_sum(v);
  }
  return v;
}

// True in the block that is the `arrivals`-th to take `ticket` (every block of the group takes
// it once, after its own global writes); its threads then see the other blocks' global writes
// (read them through volatile or .cg loads: L1 is not coherent). That block resets the ticket
// to 0, so a workspace serves every later launch on its stream. All threads of a block call it.
__device__ bool last_to_arrive(u64* ticket, u64 arrivals) {
  __shared__ int am_last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) am_last = atomicAdd(ticket, 1ull) == arrivals - 1;
  __syncthreads();
  const bool last = am_last;
  if (last) {
    __threadfence();
    if (threadIdx.x == 0) *ticket = 0;
  }
  return last;
}

// Programmatic dependent launch (sm_90 and later): a kernel the host launches with
// Kernel(..., after_previous=True) may start while the kernel before it on the stream
// still runs. grid_dep_wait() returns once that kernel has ended and its writes are visible, so
// such a kernel calls it before it touches memory an earlier kernel writes or reads.
// grid_dep_launch() lets the next such kernel start early (its blocks wait in grid_dep_wait).
// Both do nothing for a plain launch or before sm_90.
__device__ __forceinline__ void grid_dep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void grid_dep_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
