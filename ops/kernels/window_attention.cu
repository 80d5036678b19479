// Swin window attention, forward and backward, one kernel per direction.
//
//   S = scale * q k^T + bias[h] (+ mask[b % nW]);  P = softmax_rows(S);  out = P v
//
// q, k, v: [B_, nH, N, D] with any strides on the first three dims and the last dim contiguous
// (timm's q/k/v are views of one qkv tensor: no copy). bias [nH, N, N] and mask [nW, N, N] are
// contiguous fp32. N <= 64, D in {32, 64}. Everything for one (window, head) lives in shared
// memory as fp32; products are scalar FMAs, each thread computing a 4x4 register tile (rows and
// columns padded to a multiple of 4 with zeros so tiles need no bounds checks).
//
// Grid (G, nH): block (g, h) handles the windows b = g, g + G, ... of head h. The backward
// kernel recomputes P (nothing but q, k, v is kept from the forward) and accumulates dS over
// its windows in shared memory, then adds it to the fp32 bias gradient with one atomicAdd per
// element: G-way contention instead of B_-way.
//
// 64-bit offsets throughout; shared memory is dynamic (the host opts in above 48 KiB).

#include "mta_common.cuh"

#define WA_THREADS 128
#define WA_WARPS (WA_THREADS / WARP)

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = WARP / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// rows [0, NP) of a [N, D] slice into dst[i * ld + d]; rows N..NP-1 are zero.
template <typename T, int D>
__device__ __forceinline__ void load_rows(float* dst, int ld, const T* __restrict__ src, i64 sn,
                                          int N, int NP) {
  for (int idx = threadIdx.x; idx < NP * D; idx += blockDim.x) {
    const int i = idx / D, d = idx % D;
    dst[i * ld + d] = i < N ? to_float(src[(i64)i * sn + d]) : 0.f;
  }
}

// acc = sum_k A(r0 + m, k) * B(k, c0 + n), m, n in [0, 4); A(r, k) = A[r * ars + k * aks] and
// B(k, c) = B[k * bks + c * bcs]. Strides select the transposes the six products need.
__device__ __forceinline__ void mm4x4(const float* A, int ars, int aks, const float* B, int bks,
                                      int bcs, int K, int r0, int c0, float (&acc)[4][4]) {
#pragma unroll
  for (int m = 0; m < 4; ++m)
#pragma unroll
    for (int n = 0; n < 4; ++n) acc[m][n] = 0.f;
  for (int k = 0; k < K; ++k) {
    float a[4], b[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) a[m] = A[(r0 + m) * ars + k * aks];
#pragma unroll
    for (int n = 0; n < 4; ++n) b[n] = B[k * bks + (c0 + n) * bcs];
#pragma unroll
    for (int m = 0; m < 4; ++m)
#pragma unroll
      for (int n = 0; n < 4; ++n) acc[m][n] = fmaf(a[m], b[n], acc[m][n]);
  }
}

// S[i][j] = scale * q_i . k_j + bias + mask for i, j < N; -inf in padded columns.
template <int D>
__device__ __forceinline__ void scores(float* S, int ls, const float* Q, const float* Kt, int ld,
                                       const float* __restrict__ bias,
                                       const float* __restrict__ mask, float scale, int N, int NP) {
  const int tiles = NP / 4;
  for (int t = threadIdx.x; t < tiles * tiles; t += blockDim.x) {
    const int r0 = (t / tiles) * 4, c0 = (t % tiles) * 4;
    float acc[4][4];
    mm4x4(Q, ld, 1, Kt, 1, ld, D, r0, c0, acc);
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const int i = r0 + m;
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        const int j = c0 + n;
        float s = neg_inf();
        if (i < N && j < N) {
          s = acc[m][n] * scale + bias[i * N + j];
          if (mask != nullptr) s += mask[i * N + j];
        }
        S[i * ls + j] = s;
      }
    }
  }
}

// Row i of S (i < N) becomes softmax over its first N entries; padded entries and rows become 0.
// One warp per row. Returns nothing; the caller synchronises.
__device__ __forceinline__ void softmax_row(float* row, int N, int NP, int lane) {
  float mx = neg_inf();
  for (int j = lane; j < N; j += WARP) mx = fmaxf(mx, row[j]);
  mx = warp_max(mx);
  float sum = 0.f;
  for (int j = lane; j < N; j += WARP) {
    const float e = expf(row[j] - mx);
    row[j] = e;
    sum += e;
  }
  sum = warp_sum(sum);
  const float inv = 1.f / sum;
  for (int j = lane; j < NP; j += WARP) row[j] = j < N ? row[j] * inv : 0.f;
}

template <typename T, int D>
__device__ __forceinline__ void forward_body(const T* __restrict__ q, const T* __restrict__ k,
                                             const T* __restrict__ v, const float* __restrict__ bias,
                                             const float* __restrict__ mask, T* __restrict__ out,
                                             i64 qb, i64 qh, i64 qn, i64 kb, i64 kh, i64 kn,
                                             i64 vb, i64 vh, i64 vn, int B_, int nH, int N,
                                             int nW, float scale) {
  extern __shared__ float smem[];
  const int NP = (N + 3) & ~3;
  const int ld = D + 1, ls = NP + 1;
  float* Q = smem;
  float* K = Q + NP * ld;
  float* V = K + NP * ld;
  float* S = V + NP * ld;
  const int h = blockIdx.y;
  const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
  const float* bias_h = bias + (i64)h * N * N;
  for (int b = blockIdx.x; b < B_; b += gridDim.x) {
    load_rows<T, D>(Q, ld, q + (i64)b * qb + (i64)h * qh, qn, N, NP);
    load_rows<T, D>(K, ld, k + (i64)b * kb + (i64)h * kh, kn, N, NP);
    load_rows<T, D>(V, ld, v + (i64)b * vb + (i64)h * vh, vn, N, NP);
    __syncthreads();
    const float* mask_w = mask != nullptr ? mask + (i64)(b % nW) * N * N : nullptr;
    scores<D>(S, ls, Q, K, ld, bias_h, mask_w, scale, N, NP);
    __syncthreads();
    for (int i = warp; i < NP; i += WA_WARPS) {
      if (i < N) {
        softmax_row(S + i * ls, N, NP, lane);
      } else {
        for (int j = lane; j < NP; j += WARP) S[i * ls + j] = 0.f;
      }
    }
    __syncthreads();
    // out = P V
    T* out_bh = out + ((i64)b * nH + h) * N * D;
    const int rt = NP / 4, ct = D / 4;
    for (int t = threadIdx.x; t < rt * ct; t += blockDim.x) {
      const int r0 = (t / ct) * 4, c0 = (t % ct) * 4;
      float acc[4][4];
      mm4x4(S, ls, 1, V, ld, 1, NP, r0, c0, acc);
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const int i = r0 + m;
        if (i < N) {
#pragma unroll
          for (int n = 0; n < 4; ++n) out_bh[(i64)i * D + c0 + n] = from_float<T>(acc[m][n]);
        }
      }
    }
    __syncthreads();  // the next window overwrites Q, K, V and S
  }
}

// Writes rows < N of C = A B (C is [N, D] contiguous in global memory), times `alpha`.
template <typename T, int D>
__device__ __forceinline__ void product_out(const float* A, int ars, int aks, const float* B,
                                            int bks, int bcs, int K, int N, int NP, float alpha,
                                            T* __restrict__ dst) {
  const int rt = NP / 4, ct = D / 4;
  for (int t = threadIdx.x; t < rt * ct; t += blockDim.x) {
    const int r0 = (t / ct) * 4, c0 = (t % ct) * 4;
    float acc[4][4];
    mm4x4(A, ars, aks, B, bks, bcs, K, r0, c0, acc);
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const int i = r0 + m;
      if (i < N) {
#pragma unroll
        for (int n = 0; n < 4; ++n) dst[(i64)i * D + c0 + n] = from_float<T>(acc[m][n] * alpha);
      }
    }
  }
}

template <typename T, int D>
__device__ __forceinline__ void backward_body(
    const T* __restrict__ dout, const T* __restrict__ q, const T* __restrict__ k,
    const T* __restrict__ v, const float* __restrict__ bias, const float* __restrict__ mask,
    T* __restrict__ dq, T* __restrict__ dk, T* __restrict__ dv, float* __restrict__ dbias,
    i64 qb, i64 qh, i64 qn, i64 kb, i64 kh, i64 kn, i64 vb, i64 vh, i64 vn, int B_, int nH, int N,
    int nW, float scale) {
  extern __shared__ float smem[];
  const int NP = (N + 3) & ~3;
  const int ld = D + 1, ls = NP + 1;
  float* Q = smem;
  float* K = Q + NP * ld;
  float* V = K + NP * ld;
  float* dO = V + NP * ld;
  float* P = dO + NP * ld;
  float* dS = P + NP * ls;
  float* dB = dS + NP * ls;  // [N, N]: this block's share of the bias gradient
  const int h = blockIdx.y;
  const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
  const float* bias_h = bias + (i64)h * N * N;
  for (int idx = threadIdx.x; idx < N * N; idx += blockDim.x) dB[idx] = 0.f;
  for (int b = blockIdx.x; b < B_; b += gridDim.x) {
    const i64 obh = ((i64)b * nH + h) * N * D;  // offset of this (window, head) in dout/dq/dk/dv
    load_rows<T, D>(Q, ld, q + (i64)b * qb + (i64)h * qh, qn, N, NP);
    load_rows<T, D>(K, ld, k + (i64)b * kb + (i64)h * kh, kn, N, NP);
    load_rows<T, D>(V, ld, v + (i64)b * vb + (i64)h * vh, vn, N, NP);
    load_rows<T, D>(dO, ld, dout + obh, D, N, NP);
    __syncthreads();
    const float* mask_w = mask != nullptr ? mask + (i64)(b % nW) * N * N : nullptr;
    scores<D>(P, ls, Q, K, ld, bias_h, mask_w, scale, N, NP);
    // dP = dO V^T into dS (turned into dS below)
    {
      const int tiles = NP / 4;
      for (int t = threadIdx.x; t < tiles * tiles; t += blockDim.x) {
        const int r0 = (t / tiles) * 4, c0 = (t % tiles) * 4;
        float acc[4][4];
        mm4x4(dO, ld, 1, V, 1, ld, D, r0, c0, acc);
#pragma unroll
        for (int m = 0; m < 4; ++m)
#pragma unroll
          for (int n = 0; n < 4; ++n) dS[(r0 + m) * ls + c0 + n] = acc[m][n];
      }
    }
    __syncthreads();
    // P = softmax(S); dS = P * (dP - rowsum(P * dP)); dB += dS. One warp per row.
    for (int i = warp; i < NP; i += WA_WARPS) {
      float* prow = P + i * ls;
      float* srow = dS + i * ls;
      if (i >= N) {
        for (int j = lane; j < NP; j += WARP) prow[j] = srow[j] = 0.f;
        continue;
      }
      softmax_row(prow, N, NP, lane);
      __syncwarp();
      float dot = 0.f;
      for (int j = lane; j < N; j += WARP) dot += prow[j] * srow[j];
      dot = warp_sum(dot);
      for (int j = lane; j < NP; j += WARP) {
        const float g = j < N ? prow[j] * (srow[j] - dot) : 0.f;
        srow[j] = g;
        if (j < N) dB[i * N + j] += g;
      }
    }
    __syncthreads();
    // dV = P^T dO; dQ = scale * dS K; dK = scale * dS^T Q
    product_out<T, D>(P, 1, ls, dO, ld, 1, NP, N, NP, 1.f, dv + obh);
    product_out<T, D>(dS, ls, 1, K, ld, 1, NP, N, NP, scale, dq + obh);
    product_out<T, D>(dS, 1, ls, Q, ld, 1, NP, N, NP, scale, dk + obh);
    __syncthreads();  // the next window overwrites the tiles
  }
  if (blockIdx.x < B_) {
    float* dbias_h = dbias + (i64)h * N * N;
    for (int idx = threadIdx.x; idx < N * N; idx += blockDim.x) atomicAdd(dbias_h + idx, dB[idx]);
  }
}

#define WA_FORWARD(NAME, T, D)                                                                   \
  extern "C" __global__ void __launch_bounds__(WA_THREADS)                                       \
      NAME(const T* q, const T* k, const T* v, const float* bias, const float* mask, T* out,     \
           i64 qb, i64 qh, i64 qn, i64 kb, i64 kh, i64 kn, i64 vb, i64 vh, i64 vn, int B_,        \
           int nH, int N, int nW, float scale) {                                                  \
    forward_body<T, D>(q, k, v, bias, mask, out, qb, qh, qn, kb, kh, kn, vb, vh, vn, B_, nH, N,  \
                       nW, scale);                                                               \
  }

#define WA_BACKWARD(NAME, T, D)                                                                  \
  extern "C" __global__ void __launch_bounds__(WA_THREADS)                                       \
      NAME(const T* dout, const T* q, const T* k, const T* v, const float* bias,                 \
           const float* mask, T* dq, T* dk, T* dv, float* dbias, i64 qb, i64 qh, i64 qn, i64 kb,  \
           i64 kh, i64 kn, i64 vb, i64 vh, i64 vn, int B_, int nH, int N, int nW, float scale) {  \
    backward_body<T, D>(dout, q, k, v, bias, mask, dq, dk, dv, dbias, qb, qh, qn, kb, kh, kn, vb, \
                        vh, vn, B_, nH, N, nW, scale);                                           \
  }

WA_FORWARD(window_attention_fwd_f16_d32, half_t, 32)
WA_FORWARD(window_attention_fwd_f16_d64, half_t, 64)
WA_FORWARD(window_attention_fwd_bf16_d32, bf16_t, 32)
WA_FORWARD(window_attention_fwd_bf16_d64, bf16_t, 64)
WA_BACKWARD(window_attention_bwd_f16_d32, half_t, 32)
WA_BACKWARD(window_attention_bwd_f16_d64, half_t, 64)
WA_BACKWARD(window_attention_bwd_bf16_d32, bf16_t, 32)
WA_BACKWARD(window_attention_bwd_bf16_d64, bf16_t, 64)

// ---------------------------------------------------------------------------------------------
// roll + window partition and its inverse: one gather. Token rows of `unit`-sized words (the
// host picks the widest of 16/8/4/2/1 bytes dividing the row and both pointers' alignment).
//   partition: dst[(b*nWh + wh)*nWw + ww][r*ws + c] = src[b][(wh*ws + r + sh) % H][(ww*ws + c + sw) % W]
//   merge:     dst[b][i][j] = src at the window position of ((i - sh) mod H, (j - sw) mod W)
// ---------------------------------------------------------------------------------------------

struct alignas(16) U16B { u32 w[4]; };
struct alignas(8) U8B { u32 w[2]; };

template <typename U>
__device__ __forceinline__ void window_gather(const U* __restrict__ src, U* __restrict__ dst,
                                              int H, int W, int ws, int sh, int sw, i64 units,
                                              i64 total, int merge) {
  const int nWw = W / ws;
  const int area = ws * ws;
  const i64 stride = (i64)gridDim.x * blockDim.x;
  for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += stride) {
    const i64 token = idx / units;
    const i64 u = idx - token * units;
    i64 img_tok, win_tok;  // token index in image layout and in window layout
    if (!merge) {
      win_tok = token;
      const i64 wi = token / area;
      const int pos = (int)(token - wi * area);
      const i64 b = wi / ((H / ws) * nWw);
      const int wrem = (int)(wi - b * (H / ws) * nWw);
      const int wh = wrem / nWw, ww = wrem % nWw;
      const int i = (wh * ws + pos / ws + sh) % H;
      const int j = (ww * ws + pos % ws + sw) % W;
      img_tok = (b * H + i) * W + j;
      dst[win_tok * units + u] = src[img_tok * units + u];
    } else {
      img_tok = token;
      const i64 b = token / ((i64)H * W);
      const int rem = (int)(token - b * H * W);
      const int i = (rem / W - sh + H) % H;
      const int j = (rem % W - sw + W) % W;
      win_tok = ((b * (H / ws) + i / ws) * nWw + j / ws) * area + (i % ws) * ws + (j % ws);
      dst[img_tok * units + u] = src[win_tok * units + u];
    }
  }
}

#define WIN_GATHER(NAME, U)                                                                      \
  extern "C" __global__ void __launch_bounds__(256)                                              \
      NAME(const U* src, U* dst, int H, int W, int ws, int sh, int sw, i64 units, i64 total,      \
           int merge) {                                                                          \
    window_gather<U>(src, dst, H, W, ws, sh, sw, units, total, merge);                           \
  }

WIN_GATHER(window_gather_16, U16B)
WIN_GATHER(window_gather_8, U8B)
WIN_GATHER(window_gather_4, u32)
WIN_GATHER(window_gather_2, u16)
WIN_GATHER(window_gather_1, unsigned char)
