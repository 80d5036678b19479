// Training-mode batch norm with the residual add and ReLU that follow it in a ResNet block,
// for activations whose channels are innermost in memory (channels_last, or [M, C]):
//
//   y = act((x - mean[c]) * scale[c] + bias[c] + residual),  scale = weight * invstd
//
// x is read as an [M, C] matrix, M = N * H * W rows. A block is WARP-wide thread groups laid
// out as `gx` channel vectors (V channels each, one 16-byte access for fp16/bf16) by
// blockDim.x / gx rows; blockIdx.y picks the slice of gx * V channels, and a thread keeps its
// channels for every row it visits (so per-channel constants stay in registers).
//
// Forward: bn_stats (per-channel sums of x - x[0, c] over a block's rows -> partials; the last
// block of a slice to finish combines them into mean and invstd, and updates the running
// statistics when given) and bn_apply. Backward: bn_grad_reduce (sums of g and g * (x - mean),
// g = dy masked where y <= 0 under ReLU; the last block writes dweight, dbias and the two sums;
// with a residual it also writes g, the residual's gradient) and bn_grad_input (dx, from that g
// when it was written: two tensors read instead of dy, y and x). Statistics and sums are fp32;
// each output element is computed in fp32 and rounded once. Rows are 64-bit.
//
// Shifting by row 0 before summing keeps E[x^2] - E[x]^2 from cancelling when |mean| >> std.
// `weight`, `bias` and the running statistics share one dtype (wcode: 0 f32, 1 f16, 2 bf16);
// a null weight is 1 and a null bias 0 (affine=False).

#include "mta_common.cuh"

#define BN_THREADS 256

__device__ __forceinline__ float load_w(const void* p, int code, int i) {
  if (code == 0) return reinterpret_cast<const float*>(p)[i];
  if (code == 1) return to_float(reinterpret_cast<const half_t*>(p)[i]);
  return to_float(reinterpret_cast<const bf16_t*>(p)[i]);
}

__device__ __forceinline__ void store_w(void* p, int code, int i, float v) {
  if (code == 0) reinterpret_cast<float*>(p)[i] = v;
  else if (code == 1) reinterpret_cast<half_t*>(p)[i] = from_float<half_t>(v);
  else reinterpret_cast<bf16_t*>(p)[i] = from_float<bf16_t>(v);
}

// V elements of row r, channels [c0, c0 + V): one vector access when V > 1 (the host picks
// V > 1 only when C % V == 0 and every pointer is 16-byte aligned).
template <typename T, int V>
__device__ __forceinline__ void load_row(const T* p, i64 r, int C, int c0, float (&out)[V]) {
  if (V > 1) {
    load_pack<T, V>(p, (r * C + c0) / V, out);
  } else {
    out[0] = to_float(p[r * C + c0]);
  }
}

template <typename T, int V>
__device__ __forceinline__ void store_row(T* p, i64 r, int C, int c0, const float (&in)[V]) {
  if (V > 1) {
    store_pack<T, V>(p, (r * C + c0) / V, in);
  } else {
    p[r * C + c0] = from_float<T>(in[0]);
  }
}

// The thread's place: channel vector `cv` (first channel c0), first row, row step.
struct Place {
  int c0;
  bool active;
  i64 row;
  i64 step;
};

__device__ __forceinline__ Place place(int C, int gx, int V) {
  const int tx = threadIdx.x % gx, ty = threadIdx.x / gx, ry = blockDim.x / gx;
  Place p;
  p.c0 = (blockIdx.y * gx + tx) * V;
  p.active = ty < ry && p.c0 < C;
  p.row = (i64)blockIdx.x * ry + ty;
  p.step = (i64)gridDim.x * ry;
  return p;
}

// Sum two per-thread V-vectors over the block's rows into sh[0][k], sh[1][k] (k < gx * V),
// then write them to partial[blockIdx.x] for channels slice_c0 + k.
template <int V>
__device__ __forceinline__ void block_partials(const float (&a)[V], const float (&b)[V],
                                               float* sh, float* partial, int C, int gx) {
  const int tx = threadIdx.x % gx, ty = threadIdx.x / gx, ry = blockDim.x / gx;
  const int width = gx * V;
  // sh: [2][ry][width]
  if (ty < ry) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      sh[ty * width + tx * V + j] = a[j];
      sh[(ry + ty) * width + tx * V + j] = b[j];
    }
  }
  __syncthreads();
  const int c_base = blockIdx.y * width;
  for (int k = threadIdx.x; k < 2 * width; k += blockDim.x) {
    const int which = k / width, col = k % width;
    float s = 0.f;
    for (int r = 0; r < ry; ++r) s += sh[(which * ry + r) * width + col];
    const int c = c_base + col;
    if (c < C) partial[((i64)blockIdx.x * 2 + which) * C + c] = s;
  }
}

// In the last block of a slice: the two sums of each of its channels over the gridDim.x
// partial rows, threads split `per` ways per channel. Calls fin(c, sum_a, sum_b) once per
// channel of the slice.
template <typename F>
__device__ __forceinline__ void combine(const float* partial, float* sh, int C, int width, F fin) {
  const int c_base = blockIdx.y * width;
  const int per = blockDim.x / width > 0 ? blockDim.x / width : 1;
  // each thread: channel col = t % width, part = t / width (of `per`)
  for (int t0 = 0; t0 < width * per; t0 += blockDim.x) {
    const int t = t0 + threadIdx.x;
    const int col = t % width, part = t / width;
    float sa = 0.f, sb = 0.f;
    const int c = c_base + col;
    if (t < width * per && c < C) {
      for (int r = part; r < (int)gridDim.x; r += per) {
        sa += __ldcg(partial + ((i64)r * 2) * C + c);
        sb += __ldcg(partial + ((i64)r * 2 + 1) * C + c);
      }
    }
    if (per > 1) {
      // blockDim.x == width * per here (one pass): reduce the `per` parts through shared memory
      __syncthreads();
      sh[threadIdx.x] = sa;
      sh[blockDim.x + threadIdx.x] = sb;
      __syncthreads();
      if (part == 0 && c < C) {
        for (int q = 1; q < per; ++q) {
          sa += sh[q * width + col];
          sb += sh[blockDim.x + q * width + col];
        }
        fin(c, sa, sb);
      }
    } else if (t < width && c < C) {
      fin(c, sa, sb);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------------------------

template <typename T, int V>
__device__ void bn_stats_body(const T* __restrict__ x, float* __restrict__ partial,
                              u64* __restrict__ tickets, float* __restrict__ mean,
                              float* __restrict__ invstd, void* running_mean, void* running_var,
                              int rcode, float momentum, float eps, i64 M, int C, int gx) {
  __shared__ float sh[2 * BN_THREADS * V];
  const Place p = place(C, gx, V);
  float shift[V], s[V], q[V];
#pragma unroll
  for (int j = 0; j < V; ++j) shift[j] = s[j] = q[j] = 0.f;
  if (p.active) {
    load_row<T, V>(x, 0, C, p.c0, shift);
    i64 r = p.row;
    // two rows per trip: two loads in flight per thread before their sums
    for (; r + p.step < M; r += 2 * p.step) {
      float u[V], w[V];
      load_row<T, V>(x, r, C, p.c0, u);
      load_row<T, V>(x, r + p.step, C, p.c0, w);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float d = u[j] - shift[j], e = w[j] - shift[j];
        s[j] += d + e;
        q[j] += d * d + e * e;
      }
    }
    if (r < M) {
      float u[V];
      load_row<T, V>(x, r, C, p.c0, u);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float d = u[j] - shift[j];
        s[j] += d;
        q[j] += d * d;
      }
    }
  }
  block_partials<V>(s, q, sh, partial, C, gx);
  if (!last_to_arrive(tickets + blockIdx.y, gridDim.x)) return;
  const float inv_m = 1.f / (float)M;
  combine(partial, sh, C, gx * V, [&](int c, float sd, float qd) {
    const float m_d = sd * inv_m;
    const float var = fmaxf(qd * inv_m - m_d * m_d, 0.f);
    const float mu = to_float(x[c]) + m_d;
    mean[c] = mu;
    invstd[c] = 1.f / sqrtf(var + eps);
    if (running_mean != nullptr) {
      store_w(running_mean, rcode, c,
              (1.f - momentum) * load_w(running_mean, rcode, c) + momentum * mu);
    }
    if (running_var != nullptr) {
      const float unbiased = M > 1 ? var * ((float)M / (float)(M - 1)) : var;
      store_w(running_var, rcode, c,
              (1.f - momentum) * load_w(running_var, rcode, c) + momentum * unbiased);
    }
  });
}

template <typename T, int V>
__device__ void bn_apply_body(const T* __restrict__ x, const T* __restrict__ res,
                              T* __restrict__ y, const float* __restrict__ mean,
                              const float* __restrict__ invstd, const void* weight,
                              const void* bias, int wcode, int relu, i64 M, int C, int gx) {
  const Place p = place(C, gx, V);
  if (!p.active) return;
  float mu[V], scale[V], shift[V];
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int c = p.c0 + j;
    const float w = weight != nullptr ? load_w(weight, wcode, c) : 1.f;
    mu[j] = mean[c];
    scale[j] = w * invstd[c];
    shift[j] = bias != nullptr ? load_w(bias, wcode, c) : 0.f;
  }
  for (i64 r = p.row; r < M; r += p.step) {
    float u[V];
    load_row<T, V>(x, r, C, p.c0, u);
#pragma unroll
    for (int j = 0; j < V; ++j) u[j] = fmaf(u[j] - mu[j], scale[j], shift[j]);
    if (res != nullptr) {
      float a[V];
      load_row<T, V>(res, r, C, p.c0, a);
#pragma unroll
      for (int j = 0; j < V; ++j) u[j] += a[j];
    }
    if (relu) {
#pragma unroll
      for (int j = 0; j < V; ++j) u[j] = u[j] > 0.f || u[j] != u[j] ? u[j] : 0.f;  // NaN stays
    }
    store_row<T, V>(y, r, C, p.c0, u);
  }
}

// ---------------------------------------------------------------------------------------------
// Backward
// ---------------------------------------------------------------------------------------------

// g = dy, masked where y <= 0 under ReLU (torch's threshold_backward)
template <typename T, int V>
__device__ __forceinline__ void masked_grad(const T* dy, const T* y, int relu, i64 r, int C,
                                            int c0, float (&g)[V]) {
  load_row<T, V>(dy, r, C, c0, g);
  if (relu) {
    float o[V];
    load_row<T, V>(y, r, C, c0, o);
#pragma unroll
    for (int j = 0; j < V; ++j) g[j] = o[j] <= 0.f ? 0.f : g[j];  // NaN passes, as in torch
  }
}

template <typename T, int V>
__device__ void bn_grad_reduce_body(const T* __restrict__ dy, const T* __restrict__ y,
                                    const T* __restrict__ x, T* __restrict__ gout,
                                    const float* __restrict__ mean,
                                    const float* __restrict__ invstd,
                                    float* __restrict__ partial, u64* __restrict__ tickets,
                                    float* __restrict__ sums, void* dweight, void* dbias,
                                    int wcode, int relu, i64 M, int C, int gx) {
  __shared__ float sh[2 * BN_THREADS * V];
  const Place p = place(C, gx, V);
  float mu[V], s[V], q[V];
#pragma unroll
  for (int j = 0; j < V; ++j) mu[j] = s[j] = q[j] = 0.f;
  if (p.active) {
#pragma unroll
    for (int j = 0; j < V; ++j) mu[j] = mean[p.c0 + j];
    for (i64 r = p.row; r < M; r += p.step) {
      float g[V], u[V];
      masked_grad<T, V>(dy, y, relu, r, C, p.c0, g);
      if (gout != nullptr) store_row<T, V>(gout, r, C, p.c0, g);
      load_row<T, V>(x, r, C, p.c0, u);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        s[j] += g[j];
        q[j] += g[j] * (u[j] - mu[j]);
      }
    }
  }
  block_partials<V>(s, q, sh, partial, C, gx);
  if (!last_to_arrive(tickets + blockIdx.y, gridDim.x)) return;
  combine(partial, sh, C, gx * V, [&](int c, float sg, float sgx) {
    sums[c] = sg;
    sums[C + c] = sgx;
    if (dbias != nullptr) store_w(dbias, wcode, c, sg);
    if (dweight != nullptr) store_w(dweight, wcode, c, sgx * invstd[c]);
  });
}

// dx = w * invstd * (g - sum_g / M - (x - mean) * invstd^2 * sum_gx / M); dres = g. Written
// as a * g + b * (x - mean) + k: x - mean before any product, so a large mean does not cancel.
template <typename T, int V>
__device__ void bn_grad_input_body(const T* __restrict__ dy, const T* __restrict__ y,
                                   const T* __restrict__ x, T* __restrict__ dx,
                                   T* __restrict__ dres, const float* __restrict__ mean,
                                   const float* __restrict__ invstd, const void* weight,
                                   int wcode, const float* __restrict__ sums, int relu, i64 M,
                                   int C, int gx) {
  const Place p = place(C, gx, V);
  if (!p.active) return;
  float a[V], b[V], k[V], mu[V];
  const float inv_m = 1.f / (float)M;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int c = p.c0 + j;
    const float w = weight != nullptr ? load_w(weight, wcode, c) : 1.f;
    const float is = invstd[c];
    a[j] = w * is;
    b[j] = -a[j] * is * is * sums[C + c] * inv_m;
    k[j] = -a[j] * sums[c] * inv_m;
    mu[j] = mean[c];
  }
  for (i64 r = p.row; r < M; r += p.step) {
    float g[V], u[V];
    masked_grad<T, V>(dy, y, relu, r, C, p.c0, g);
    load_row<T, V>(x, r, C, p.c0, u);
    if (dres != nullptr) store_row<T, V>(dres, r, C, p.c0, g);
#pragma unroll
    for (int j = 0; j < V; ++j) u[j] = fmaf(a[j], g[j], fmaf(b[j], u[j] - mu[j], k[j]));
    store_row<T, V>(dx, r, C, p.c0, u);
  }
}

// ---------------------------------------------------------------------------------------------
// Entry points: one set per (dtype, vector width)
// ---------------------------------------------------------------------------------------------

#define BN_KERNELS(STATS, APPLY, REDUCE, INPUT, T, V)                                                                    \
  extern "C" __global__ void __launch_bounds__(256) STATS(                       \
      const T* x, float* partial, u64* tickets, float* mean, float* invstd, void* running_mean,  \
      void* running_var, int rcode, float momentum, float eps, i64 M, int C, int gx) {           \
    bn_stats_body<T, V>(x, partial, tickets, mean, invstd, running_mean, running_var, rcode,     \
                        momentum, eps, M, C, gx);                                                \
  }                                                                                              \
  extern "C" __global__ void __launch_bounds__(256) APPLY(                       \
      const T* x, const T* res, T* y, const float* mean, const float* invstd,                    \
      const void* weight, const void* bias, int wcode, int relu, i64 M, int C, int gx) {         \
    bn_apply_body<T, V>(x, res, y, mean, invstd, weight, bias, wcode, relu, M, C, gx);           \
  }                                                                                              \
  extern "C" __global__ void __launch_bounds__(256) REDUCE(                 \
      const T* dy, const T* y, const T* x, T* gout, const float* mean, const float* invstd,      \
      float* partial, u64* tickets, float* sums, void* dweight, void* dbias, int wcode,          \
      int relu, i64 M, int C, int gx) {                                                          \
    bn_grad_reduce_body<T, V>(dy, y, x, gout, mean, invstd, partial, tickets, sums, dweight,     \
                              dbias, wcode, relu, M, C, gx);                                     \
  }                                                                                              \
  extern "C" __global__ void __launch_bounds__(256) INPUT(                  \
      const T* dy, const T* y, const T* x, T* dx, T* dres, const float* mean,                    \
      const float* invstd, const void* weight, int wcode, const float* sums, int relu, i64 M,    \
      int C, int gx) {                                                                           \
    bn_grad_input_body<T, V>(dy, y, x, dx, dres, mean, invstd, weight, wcode, sums, relu, M, C,  \
                             gx);                                                                \
  }

BN_KERNELS(bn_stats_f32_v4, bn_apply_f32_v4, bn_grad_reduce_f32_v4, bn_grad_input_f32_v4, float, 4)
BN_KERNELS(bn_stats_f32_v1, bn_apply_f32_v1, bn_grad_reduce_f32_v1, bn_grad_input_f32_v1, float, 1)
BN_KERNELS(bn_stats_f16_v8, bn_apply_f16_v8, bn_grad_reduce_f16_v8, bn_grad_input_f16_v8, half_t, 8)
BN_KERNELS(bn_stats_f16_v1, bn_apply_f16_v1, bn_grad_reduce_f16_v1, bn_grad_input_f16_v1, half_t, 1)
BN_KERNELS(bn_stats_bf16_v8, bn_apply_bf16_v8, bn_grad_reduce_bf16_v8, bn_grad_input_bf16_v8, bf16_t, 8)
BN_KERNELS(bn_stats_bf16_v1, bn_apply_bf16_v1, bn_grad_reduce_bf16_v1, bn_grad_input_bf16_v1, bf16_t, 1)
