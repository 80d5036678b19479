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
                                             i64 vb, i64 vh, i64 vn, i64 ob, i64 oh, i64 on,
                                             int B_, int nH, int N, int nW, float scale) {
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
    T* out_bh = out + (i64)b * ob + (i64)h * oh;
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
          for (int n = 0; n < 4; ++n) out_bh[(i64)i * on + c0 + n] = from_float<T>(acc[m][n]);
        }
      }
    }
    __syncthreads();  // the next window overwrites Q, K, V and S
  }
}

// Writes rows < N of C = A B (C is [N, D] in global memory, row stride sn), times `alpha`.
template <typename T, int D>
__device__ __forceinline__ void product_out(const float* A, int ars, int aks, const float* B,
                                            int bks, int bcs, int K, int N, int NP, float alpha,
                                            T* __restrict__ dst, i64 sn) {
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
        for (int n = 0; n < 4; ++n) dst[(i64)i * sn + c0 + n] = from_float<T>(acc[m][n] * alpha);
      }
    }
  }
}

template <typename T, int D>
__device__ __forceinline__ void backward_body(
    const T* __restrict__ dout, const T* __restrict__ q, const T* __restrict__ k,
    const T* __restrict__ v, const float* __restrict__ bias, const float* __restrict__ mask,
    T* __restrict__ dq, T* __restrict__ dk, T* __restrict__ dv, float* __restrict__ dbias,
    i64 qb, i64 qh, i64 qn, i64 kb, i64 kh, i64 kn, i64 vb, i64 vh, i64 vn, i64 gb, i64 gh, i64 gn,
    i64 xb, i64 xh, i64 xn, int B_, int nH, int N, int nW, float scale) {
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
    const i64 obh = (i64)b * xb + (i64)h * xh;  // offset of this (window, head) in dq/dk/dv
    load_rows<T, D>(Q, ld, q + (i64)b * qb + (i64)h * qh, qn, N, NP);
    load_rows<T, D>(K, ld, k + (i64)b * kb + (i64)h * kh, kn, N, NP);
    load_rows<T, D>(V, ld, v + (i64)b * vb + (i64)h * vh, vn, N, NP);
    load_rows<T, D>(dO, ld, dout + (i64)b * gb + (i64)h * gh, gn, N, NP);
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
    product_out<T, D>(P, 1, ls, dO, ld, 1, NP, N, NP, 1.f, dv + obh, xn);
    product_out<T, D>(dS, ls, 1, K, ld, 1, NP, N, NP, scale, dq + obh, xn);
    product_out<T, D>(dS, 1, ls, Q, ld, 1, NP, N, NP, scale, dk + obh, xn);
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
           i64 qb, i64 qh, i64 qn, i64 kb, i64 kh, i64 kn, i64 vb, i64 vh, i64 vn, i64 ob, i64 oh, \
           i64 on, int B_, int nH, int N, int nW, float scale) {                                  \
    forward_body<T, D>(q, k, v, bias, mask, out, qb, qh, qn, kb, kh, kn, vb, vh, vn, ob, oh, on, \
                       B_, nH, N, nW, scale);                                                    \
  }

#define WA_BACKWARD(NAME, T, D)                                                                  \
  extern "C" __global__ void __launch_bounds__(WA_THREADS)                                       \
      NAME(const T* dout, const T* q, const T* k, const T* v, const float* bias,                 \
           const float* mask, T* dq, T* dk, T* dv, float* dbias, i64 qb, i64 qh, i64 qn, i64 kb,  \
           i64 kh, i64 kn, i64 vb, i64 vh, i64 vn, i64 gb, i64 gh, i64 gn, i64 xb, i64 xh, i64 xn, \
           int B_, int nH, int N, int nW, float scale) {                                          \
    backward_body<T, D>(dout, q, k, v, bias, mask, dq, dk, dv, dbias, qb, qh, qn, kb, kh, kn, vb, \
                        vh, vn, gb, gh, gn, xb, xh, xn, B_, nH, N, nW, scale);                   \
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

// ---------------------------------------------------------------------------------------------
// Tensor-core kernels (sm_80+): mma.sync.m16n8k16 with fp32 accumulators, written as inline PTX.
//
// A block of 4 warps handles the windows b = g, g + G, g + 2G, ... of head h (grid (G, nH));
// the host makes G a multiple of nW, so every window of a block uses the same mask, and the
// block folds bias[h] + mask[g % nW] into one fp32 [64][WM_LDB] table in shared memory once.
// Rows and keys are padded to 64: the table holds -inf in key columns >= N (so padded keys get
// probability 0) and 0 in query rows >= N (padded queries stay finite; nothing of them is kept).
// q, k, v (and dout) tiles are fp16/bf16 [64][D + 8] in shared memory, zero beyond row N; the
// next window's tiles are loaded into registers while the current one computes.
//
// Warp w owns query rows 16w .. 16w + 15 and all 64 keys: S = Q K^T is an [16 x 64] fp32
// accumulator in registers (8 n-tiles x 4 floats), the row softmax runs on it with quad
// shuffles (the four lanes of a group hold one row), and the C fragments of P become the A
// fragments of P V directly (two C tiles side by side are one A tile).
//
// m16n8k16 fragments, g = lane / 4, t = lane % 4 (PTX ISA "Matrix Fragments for mma.m16n8k16"):
//   A (16x16, row): reg0 = A[g][2t, 2t+1], reg1 = A[g+8][2t, 2t+1], reg2 = A[g][2t+8, 2t+9],
//                   reg3 = A[g+8][2t+8, 2t+9]   (lower column in the low half)
//   B (16x8, col):  reg0 = B[2t, 2t+1][g], reg1 = B[2t+8, 2t+9][g]
//   C (16x8, f32):  c0, c1 = C[g][2t, 2t+1], c2, c3 = C[g+8][2t, 2t+1]
//
// Backward, per window: warp w recomputes S and P for its rows (full rows, so the softmax needs
// no saved statistics), dP = dO V^T, D_i = rowsum(P * dP), dS = P * (dP - D); dQ = scale dS K
// with dS reused from registers as the A operand; P and dS go to shared memory as fp16/bf16;
// then warp w owns key rows 16w.. for dV = P^T dO and dK = scale dS^T Q. The bias gradient of
// the block's windows accumulates in registers (each thread always holds the same 32 (i, j)
// entries) and is added to the fp32 output with one atomicAdd per element per block.
// ---------------------------------------------------------------------------------------------

#define WM_ROWS 64   // padded rows and keys
#define WM_LDB 72    // fp32 row stride of the bias + mask table (float2 reads conflict-free)
#define WM_LDP 72    // 16-bit row stride of the [64][64] P and dS tiles

struct alignas(16) WmVec { u32 w[4]; };
struct alignas(8) WmF2 { float x, y; };

// exp(x) as one ex2.approx (relative error ~2^-22; exp(-inf) = +0, which masks padded keys).
__device__ __forceinline__ float wm_exp(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x * 1.4426950408889634f));
  return r;
}

template <typename T> __device__ __forceinline__ u32 wm_pack(float lo, float hi);
template <> __device__ __forceinline__ u32 wm_pack<half_t>(float lo, float hi) {
  u32 r;  // cvt.rn.f16x2.f32 d, a, b puts a in the upper half
  asm("cvt.rn.f16x2.f32 %0, %2, %1;" : "=r"(r) : "f"(lo), "f"(hi));
  return r;
}
template <> __device__ __forceinline__ u32 wm_pack<bf16_t>(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %2, %1;" : "=r"(r) : "f"(lo), "f"(hi));
  return r;
}

template <typename T>
__device__ __forceinline__ void wm_mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1);
template <>
__device__ __forceinline__ void wm_mma<half_t>(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void wm_mma<bf16_t>(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 wm_word(const u16* p) { return *reinterpret_cast<const u32*>(p); }
__device__ __forceinline__ u32 wm_pair(const u16* lo, const u16* hi) {
  return (u32)*lo | ((u32)*hi << 16);
}

// A(m, k) = s[m * ld + k] (row-major in shared memory): 32-bit reads.
__device__ __forceinline__ void wm_a_rows(u32 (&a)[4], const u16* s, int ld, int m0, int k0,
                                          int g, int t) {
  const u16* p = s + (m0 + g) * ld + k0 + 2 * t;
  a[0] = wm_word(p);
  a[1] = wm_word(p + 8 * ld);
  a[2] = wm_word(p + 8);
  a[3] = wm_word(p + 8 * ld + 8);
}

// A(m, k) = s[k * ld + m] (the transpose of a row-major tile): pairs of 16-bit reads.
__device__ __forceinline__ void wm_a_cols(u32 (&a)[4], const u16* s, int ld, int m0, int k0,
                                          int g, int t) {
  const u16* p = s + (k0 + 2 * t) * ld + m0 + g;
  a[0] = wm_pair(p, p + ld);
  a[1] = wm_pair(p + 8, p + ld + 8);
  a[2] = wm_pair(p + 8 * ld, p + 9 * ld);
  a[3] = wm_pair(p + 8 * ld + 8, p + 9 * ld + 8);
}

// B(k, n) = s[n * ld + k]: 32-bit reads.
__device__ __forceinline__ void wm_b_rows(u32& b0, u32& b1, const u16* s, int ld, int n0, int k0,
                                          int g, int t) {
  const u16* p = s + (n0 + g) * ld + k0 + 2 * t;
  b0 = wm_word(p);
  b1 = wm_word(p + 8);
}

// B(k, n) = s[k * ld + n]: pairs of 16-bit reads.
__device__ __forceinline__ void wm_b_cols(u32& b0, u32& b1, const u16* s, int ld, int n0, int k0,
                                          int g, int t) {
  const u16* p = s + (k0 + 2 * t) * ld + n0 + g;
  b0 = wm_pair(p, p + ld);
  b1 = wm_pair(p + 8 * ld, p + 9 * ld);
}

// ldmatrix (sm_75+): one instruction loads four 8x8 b16 matrices, lane l giving the row
// address of matrix l / 8, row l % 8 (16-byte aligned: the tiles' row strides are multiples of
// 16 bytes). Register i of lane (g, t) gets matrix i's [g][2t, 2t+1], or with .trans its
// [2t, 2t+1][g]: exactly the m16n8k16 fragments, one instruction where the 32-bit and 16-bit
// reads above need four to eight. The "memory" clobber keeps them on their side of barriers.
__device__ __forceinline__ u32 wm_smem_addr(const void* p) {
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}
__device__ __forceinline__ void wm_ldsm(u32 (&r)[4], const u16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(wm_smem_addr(p))
               : "memory");
}
__device__ __forceinline__ void wm_ldsm_t(u32 (&r)[4], const u16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(wm_smem_addr(p))
               : "memory");
}

// The transposed-operand fragments either way (LDM: ldmatrix.trans; else the 16-bit reads
// above). Pairs of B fragments cover n-tiles n0 and n0 + 8: b[0], b[1] for n0, b[2], b[3] for
// n0 + 8. (Q K^T and dO V^T read 32-bit words already; there ldmatrix saves less and its
// results, loaded ahead, cost the registers the alias variants do not have.)
template <bool LDM>
__device__ __forceinline__ void wm_a_cols_(u32 (&a)[4], const u16* s, int ld, int m0, int k0,
                                           int lane) {
  if (LDM) {
    const int j = lane >> 3, r = lane & 7;
    wm_ldsm_t(a, s + (k0 + r + (j >> 1) * 8) * ld + m0 + (j & 1) * 8);
  } else {
    wm_a_cols(a, s, ld, m0, k0, lane >> 2, lane & 3);
  }
}
template <bool LDM>
__device__ __forceinline__ void wm_b_cols2(u32 (&b)[4], const u16* s, int ld, int n0, int k0,
                                           int lane) {
  if (LDM) {
    const int j = lane >> 3, r = lane & 7;
    wm_ldsm_t(b, s + (k0 + r + (j & 1) * 8) * ld + n0 + (j >> 1) * 8);
  } else {
    wm_b_cols(b[0], b[1], s, ld, n0, k0, lane >> 2, lane & 3);
    wm_b_cols(b[2], b[3], s, ld, n0 + 8, k0, lane >> 2, lane & 3);
  }
}

// One [64][D] tile of a (window, head) in registers: 16-byte words, rows >= N zero.
template <int D>
struct WmTile {
  static constexpr int VPR = D / 8;                       // 16-byte words per row
  static constexpr int PER_THREAD = WM_ROWS * VPR / WA_THREADS;
  WmVec v[PER_THREAD];

  template <typename T>
  __device__ __forceinline__ void load(const T* __restrict__ src, i64 sn, int N) {
#pragma unroll
    for (int r = 0; r < PER_THREAD; ++r) {
      const int idx = threadIdx.x + r * WA_THREADS;
      const int row = idx / VPR, c = idx % VPR;
      if (row < N) {
        v[r] = *reinterpret_cast<const WmVec*>(src + (i64)row * sn + c * 8);
      } else {
        v[r].w[0] = v[r].w[1] = v[r].w[2] = v[r].w[3] = 0u;
      }
    }
  }

  __device__ __forceinline__ void store(u16* dst) const {  // row stride D + 8
#pragma unroll
    for (int r = 0; r < PER_THREAD; ++r) {
      const int idx = threadIdx.x + r * WA_THREADS;
      const int row = idx / VPR, c = idx % VPR;
      *reinterpret_cast<WmVec*>(dst + row * (D + 8) + c * 8) = v[r];
    }
  }
};

// The same tile straight from global to shared memory (cp.async.cg, sm_80+: no registers on the
// way): rows >= N are zero-filled (source size 0; the source address stays row 0's, a valid one).
// Lands after wm_cp_wait() and a barrier.
template <int D, typename T>
__device__ __forceinline__ void wm_cp_tile(u16* dst, const T* __restrict__ src, i64 sn, int N) {
  constexpr int VPR = D / 8, PER_THREAD = WM_ROWS * VPR / WA_THREADS;
#pragma unroll 1
  for (int r = 0; r < PER_THREAD; ++r) {
    const int idx = threadIdx.x + r * WA_THREADS;
    const int row = idx / VPR, c = idx % VPR;
    const T* from = src + (row < N ? (i64)row * sn : 0) + c * 8;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(
                     wm_smem_addr(dst + row * (D + 8) + c * 8)),
                 "l"(from), "r"(row < N ? 16 : 0)
                 : "memory");
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}
__device__ __forceinline__ void wm_cp_wait() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// bias[h] + mask[w] (fp32) into the [64][WM_LDB] table; -inf in key columns >= N, 0 in rows >= N.
__device__ __forceinline__ void wm_bias_table(float* bm, const float* __restrict__ bias_h,
                                              const float* __restrict__ mask_w, int N) {
  for (int idx = threadIdx.x; idx < WM_ROWS * WM_ROWS; idx += WA_THREADS) {
    const int i = idx / WM_ROWS, j = idx % WM_ROWS;
    float v = 0.f;
    if (j >= N) {
      v = neg_inf();
    } else if (i < N) {
      v = bias_h[i * N + j];
      if (mask_w != nullptr) v += mask_w[i * N + j];
    }
    bm[i * WM_LDB + j] = v;
  }
}

// s = scale * Q K^T + table for this warp's 16 rows, then the row softmax in place: on return
// s holds exp(s - rowmax) and inv[0], inv[1] the reciprocal row sums of rows g and g + 8.
// acc[8][4] = A B^T for this warp's 16 rows: A(m, k) = As[m * ld + k], B(n, k) = Bs[n * ld + k]
// over k < D (Q K^T, dO V^T).
template <typename T, int D>
__device__ __forceinline__ void wm_rows_times_rows(float (&acc)[8][4], const u16* As,
                                                   const u16* Bs, int m0, int g, int t) {
  constexpr int LD = D + 8;
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    u32 a[4];
    wm_a_rows(a, As, LD, m0, kk * 16, g, t);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      u32 b0, b1;
      wm_b_rows(b0, b1, Bs, LD, nt * 8, kk * 16, g, t);
      wm_mma<T>(acc[nt], a, b0, b1);
    }
  }
}

template <typename T, int D>
__device__ __forceinline__ void wm_scores_softmax(float (&s)[8][4], float (&inv)[2], const u16* Qs,
                                                  const u16* Ks, const float* bm, float scale,
                                                  int m0, int g, int t) {
  wm_rows_times_rows<T, D>(s, Qs, Ks, m0, g, t);
  float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const WmF2 b = *reinterpret_cast<const WmF2*>(bm + (m0 + g + r * 8) * WM_LDB + nt * 8 + 2 * t);
      s[nt][2 * r] = fmaf(s[nt][2 * r], scale, b.x);
      s[nt][2 * r + 1] = fmaf(s[nt][2 * r + 1], scale, b.y);
      mx[r] = fmaxf(mx[r], fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
    }
  }
  float sum[2] = {0.f, 0.f};
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
  }
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[nt][e] = wm_exp(s[nt][e] - mx[e >> 1]);
      sum[e >> 1] += s[nt][e];
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 1);
    sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 2);
    inv[r] = 1.f / sum[r];
  }
}

// acc[D/8][4] = A (16 x 64, the warp's rows, from registers as C fragments) x B (64 x D), with
// B(k, n) = Bs[k * ld + n].
template <typename T, int D, bool LDM = false>
__device__ __forceinline__ void wm_regs_times(float (&acc)[D / 8][4], const float (&c)[8][4],
                                              const u16* Bs, int ld, int g, int t) {
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    u32 a[4];
    a[0] = wm_pack<T>(c[2 * kk][0], c[2 * kk][1]);
    a[1] = wm_pack<T>(c[2 * kk][2], c[2 * kk][3]);
    a[2] = wm_pack<T>(c[2 * kk + 1][0], c[2 * kk + 1][1]);
    a[3] = wm_pack<T>(c[2 * kk + 1][2], c[2 * kk + 1][3]);
    if (LDM) {
#pragma unroll
      for (int nt = 0; nt < D / 8; nt += 2) {
        u32 b[4];
        wm_b_cols2<LDM>(b, Bs, ld, nt * 8, kk * 16, g * 4 + t);
        wm_mma<T>(acc[nt], a, b[0], b[1]);
        wm_mma<T>(acc[nt + 1], a, b[2], b[3]);
      }
    } else {
#pragma unroll
      for (int nt = 0; nt < D / 8; ++nt) {
        u32 b0, b1;
        wm_b_cols(b0, b1, Bs, ld, nt * 8, kk * 16, g, t);
        wm_mma<T>(acc[nt], a, b0, b1);
      }
    }
  }
}

// wm_regs_times with A already packed to 16-bit pairs (c[nt][r]: rows g + 8r of n-tile nt, as
// wm_pack would give them) and B(k, n) = Bs[k * ld + n].
template <typename T, int D, bool LDM>
__device__ __forceinline__ void wm_packed_times(float (&acc)[D / 8][4], const u32 (&c)[8][2],
                                                const u16* Bs, int ld, int lane) {
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const u32 a[4] = {c[2 * kk][0], c[2 * kk][1], c[2 * kk + 1][0], c[2 * kk + 1][1]};
#pragma unroll
    for (int nt = 0; nt < D / 8; nt += 2) {
      u32 b[4];
      wm_b_cols2<LDM>(b, Bs, ld, nt * 8, kk * 16, lane);
      wm_mma<T>(acc[nt], a, b[0], b[1]);
      wm_mma<T>(acc[nt + 1], a, b[2], b[3]);
    }
  }
}

// acc[D/8][4] = A^T (rows m0.. of the transpose of the [64][64] tile As) x B (64 x D),
// B(k, n) = Bs[k * ld + n].
template <typename T, int D, bool LDM, int KU = 4>
__device__ __forceinline__ void wm_tile_t_times(float (&acc)[D / 8][4], const u16* As,
                                                const u16* Bs, int ld, int m0, int g, int t) {
  const int lane = g * 4 + t;
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll KU
  for (int kk = 0; kk < 4; ++kk) {
    u32 a[4];
    if (LDM) {
      wm_a_cols_<LDM>(a, As, WM_LDP, m0, kk * 16, lane);
    } else {
      wm_a_cols(a, As, WM_LDP, m0, kk * 16, g, t);
    }
    if (LDM) {
#pragma unroll
      for (int nt = 0; nt < D / 8; nt += 2) {
        u32 b[4];
        wm_b_cols2<LDM>(b, Bs, ld, nt * 8, kk * 16, lane);
        wm_mma<T>(acc[nt], a, b[0], b[1]);
        wm_mma<T>(acc[nt + 1], a, b[2], b[3]);
      }
    } else {
#pragma unroll
      for (int nt = 0; nt < D / 8; ++nt) {
        u32 b0, b1;
        wm_b_cols(b0, b1, Bs, ld, nt * 8, kk * 16, g, t);
        wm_mma<T>(acc[nt], a, b0, b1);
      }
    }
  }
}

// Rows m0 + g, m0 + g + 8 of a [64][WM_LDP] 16-bit tile from packed C fragments (P or dS).
__device__ __forceinline__ void wm_put_rows(u16* dst, const u32 (&c)[8][2], int m0, int g, int t) {
  const int r0 = m0 + g, r1 = r0 + 8;
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    const int col = nt * 8 + 2 * t;
    *reinterpret_cast<u32*>(dst + r0 * WM_LDP + col) = c[nt][0];
    *reinterpret_cast<u32*>(dst + r1 * WM_LDP + col) = c[nt][1];
  }
}

// Rows m0 + g and m0 + g + 8 (those < N) of an [N, D] output with row stride `sn` (even),
// times alpha[0 or 1].
template <typename T, int D>
__device__ __forceinline__ void wm_store(T* __restrict__ dst, i64 sn, const float (&acc)[D / 8][4],
                                         float alpha0, float alpha1, int m0, int N, int g, int t) {
  const int r0 = m0 + g, r1 = r0 + 8;
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) {
    const int col = nt * 8 + 2 * t;
    if (r0 < N)
      *reinterpret_cast<u32*>(dst + (i64)r0 * sn + col) =
          wm_pack<T>(acc[nt][0] * alpha0, acc[nt][1] * alpha0);
    if (r1 < N)
      *reinterpret_cast<u32*>(dst + (i64)r1 * sn + col) =
          wm_pack<T>(acc[nt][2] * alpha1, acc[nt][3] * alpha1);
  }
}

// LDM: V's fragments (the B operand of P V, a transposed read) through ldmatrix.trans.
template <typename T, int D, bool LDM>
__device__ __forceinline__ void mma_forward_body(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const float* __restrict__ bias, const float* __restrict__ mask, T* __restrict__ out, i64 qb,
    i64 qh, i64 qn, i64 kb, i64 kh, i64 kn, i64 vb, i64 vh, i64 vn, i64 ob, i64 oh, i64 on,
    int B_, int nH, int N, int nW, float scale) {
  extern __shared__ __attribute__((aligned(16))) u32 wm_smem[];
  constexpr int LD = D + 8;
  float* bm = reinterpret_cast<float*>(wm_smem);
  u16* Qs = reinterpret_cast<u16*>(bm + WM_ROWS * WM_LDB);
  u16* Ks = Qs + WM_ROWS * LD;
  u16* Vs = Ks + WM_ROWS * LD;
  const int h = blockIdx.y, g0 = blockIdx.x;
  const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
  const int g = lane >> 2, t = lane & 3, m0 = warp * 16;
  wm_bias_table(bm, bias + (i64)h * N * N,
                mask != nullptr ? mask + (i64)(g0 % nW) * N * N : nullptr, N);
  WmTile<D> tq, tk, tv;
  if (g0 < B_) {
    tq.load(q + (i64)g0 * qb + (i64)h * qh, qn, N);
    tk.load(k + (i64)g0 * kb + (i64)h * kh, kn, N);
    tv.load(v + (i64)g0 * vb + (i64)h * vh, vn, N);
  }
  for (int b = g0; b < B_; b += gridDim.x) {
    __syncthreads();  // the previous window is done with the tiles (and the table is written)
    tq.store(Qs);
    tk.store(Ks);
    tv.store(Vs);
    __syncthreads();
    const int nb = b + gridDim.x;
    if (nb < B_) {  // in flight while this window computes
      tq.load(q + (i64)nb * qb + (i64)h * qh, qn, N);
      tk.load(k + (i64)nb * kb + (i64)h * kh, kn, N);
      tv.load(v + (i64)nb * vb + (i64)h * vh, vn, N);
    }
    float s[8][4], inv[2];
    wm_scores_softmax<T, D>(s, inv, Qs, Ks, bm, scale, m0, g, t);
    float o[D / 8][4];
    wm_regs_times<T, D, LDM>(o, s, Vs, LD, g, t);
    wm_store<T, D>(out + (i64)b * ob + (i64)h * oh, on, o, inv[0], inv[1], m0, N, g, t);
  }
}

// LDM: fragments through ldmatrix. ALIAS: P and dS share one [64][WM_LDP] tile (8.4 KiB less
// shared memory: one barrier more per window, dS kept in registers through dV) and the tiles
// of the next window are not prefetched into registers (32 registers less); the two together
// fit four blocks per SM at 128 registers (WM_BACKWARD_V's MINB) where the prefetching,
// separate-tile kernel fits three. CP (with ALIAS): the tiles come by cp.async, each into its
// own tile as soon as every warp is done with it: V after the barrier that follows P (dP is
// done), dO after dV, K after dQ, all three in flight while the window finishes; only Q (read
// by dK, last) is loaded at the top of the next window. The maths and its rounding are the
// same in every variant.
template <typename T, int D, bool LDM, bool ALIAS, bool CP>
__device__ __forceinline__ void mma_backward_body(
    const T* __restrict__ dout, const T* __restrict__ q, const T* __restrict__ k,
    const T* __restrict__ v, const float* __restrict__ bias, const float* __restrict__ mask,
    T* __restrict__ dq, T* __restrict__ dk, T* __restrict__ dv, float* __restrict__ dbias,
    i64 qb, i64 qh, i64 qn, i64 kb, i64 kh, i64 kn, i64 vb, i64 vh, i64 vn, i64 gb, i64 gh, i64 gn,
    i64 xb, i64 xh, i64 xn, int B_, int nH, int N, int nW, float scale) {
  extern __shared__ __attribute__((aligned(16))) u32 wm_smem[];
  constexpr int LD = D + 8;
  constexpr bool PREFETCH = !ALIAS;
  static_assert(ALIAS || !CP, "the cp.async loads follow the alias variant's barriers");
  float* bm = reinterpret_cast<float*>(wm_smem);
  u16* Qs = reinterpret_cast<u16*>(bm + WM_ROWS * WM_LDB);
  u16* Ks = Qs + WM_ROWS * LD;
  u16* Vs = Ks + WM_ROWS * LD;
  u16* dOs = Vs + WM_ROWS * LD;
  u16* Ps = dOs + WM_ROWS * LD;                         // [64][WM_LDP]: P, row-major
  u16* dSs = ALIAS ? Ps : Ps + WM_ROWS * WM_LDP;        // [64][WM_LDP]: dS, row-major
  const int h = blockIdx.y, g0 = blockIdx.x;
  const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
  const int g = lane >> 2, t = lane & 3, m0 = warp * 16;
  wm_bias_table(bm, bias + (i64)h * N * N,
                mask != nullptr ? mask + (i64)(g0 % nW) * N * N : nullptr, N);
  float db[8][4];  // this thread's entries of the bias gradient, summed over the block's windows
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) db[nt][0] = db[nt][1] = db[nt][2] = db[nt][3] = 0.f;
  WmTile<D> tq, tk, tv, td;
  if (PREFETCH && g0 < B_) {
    tq.load(q + (i64)g0 * qb + (i64)h * qh, qn, N);
    tk.load(k + (i64)g0 * kb + (i64)h * kh, kn, N);
    tv.load(v + (i64)g0 * vb + (i64)h * vh, vn, N);
    td.load(dout + (i64)g0 * gb + (i64)h * gh, gn, N);
  }
  if (CP && g0 < B_) {
    wm_cp_tile<D>(Ks, k + (i64)g0 * kb + (i64)h * kh, kn, N);
    wm_cp_tile<D>(Vs, v + (i64)g0 * vb + (i64)h * vh, vn, N);
    wm_cp_tile<D>(dOs, dout + (i64)g0 * gb + (i64)h * gh, gn, N);
  }
  for (int b = g0; b < B_; b += gridDim.x) {
    __syncthreads();  // the previous window is done with every tile
    const int nb = b + gridDim.x;
    if (CP) {
      wm_cp_tile<D>(Qs, q + (i64)b * qb + (i64)h * qh, qn, N);
      wm_cp_wait();
    } else {
      if (!PREFETCH) {
        tq.load(q + (i64)b * qb + (i64)h * qh, qn, N);
        tk.load(k + (i64)b * kb + (i64)h * kh, kn, N);
        tv.load(v + (i64)b * vb + (i64)h * vh, vn, N);
        td.load(dout + (i64)b * gb + (i64)h * gh, gn, N);
      }
      tq.store(Qs);
      tk.store(Ks);
      tv.store(Vs);
      td.store(dOs);
    }
    __syncthreads();
    if (PREFETCH && nb < B_) {
      tq.load(q + (i64)nb * qb + (i64)h * qh, qn, N);
      tk.load(k + (i64)nb * kb + (i64)h * kh, kn, N);
      tv.load(v + (i64)nb * vb + (i64)h * vh, vn, N);
      td.load(dout + (i64)nb * gb + (i64)h * gh, gn, N);
    }
    const i64 obh = (i64)b * xb + (i64)h * xh;  // this (window, head) in dq, dk and dv
    float p[8][4], inv[2];
    wm_scores_softmax<T, D>(p, inv, Qs, Ks, bm, scale, m0, g, t);
    float ds[8][4];  // dP = dO V^T for the warp's rows
    wm_rows_times_rows<T, D>(ds, dOs, Vs, m0, g, t);
    // P normalised (0 in padded rows), D_i = rowsum(P * dP), dS = P (dP - D_i)
    const float keep[2] = {m0 + g < N ? inv[0] : 0.f, m0 + g + 8 < N ? inv[1] : 0.f};
    float dot[2] = {0.f, 0.f};
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        p[nt][e] *= keep[e >> 1];
        dot[e >> 1] = fmaf(p[nt][e], ds[nt][e], dot[e >> 1]);
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      dot[r] += __shfl_xor_sync(0xffffffffu, dot[r], 1);
      dot[r] += __shfl_xor_sync(0xffffffffu, dot[r], 2);
    }
    u32 dsp[8][2];  // dS packed to 16-bit pairs, as the tile and the A operand take it
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const int col = nt * 8 + 2 * t;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        ds[nt][e] = p[nt][e] * (ds[nt][e] - dot[e >> 1]);
        db[nt][e] += ds[nt][e];
      }
      const int r0 = m0 + g, r1 = r0 + 8;
      *reinterpret_cast<u32*>(Ps + r0 * WM_LDP + col) = wm_pack<T>(p[nt][0], p[nt][1]);
      *reinterpret_cast<u32*>(Ps + r1 * WM_LDP + col) = wm_pack<T>(p[nt][2], p[nt][3]);
      if (ALIAS) {
        dsp[nt][0] = wm_pack<T>(ds[nt][0], ds[nt][1]);
        dsp[nt][1] = wm_pack<T>(ds[nt][2], ds[nt][3]);
      }
      if (!ALIAS) {
        *reinterpret_cast<u32*>(dSs + r0 * WM_LDP + col) = wm_pack<T>(ds[nt][0], ds[nt][1]);
        *reinterpret_cast<u32*>(dSs + r1 * WM_LDP + col) = wm_pack<T>(ds[nt][2], ds[nt][3]);
      }
    }
    if (!ALIAS) {
      {  // dQ = scale dS K, dS straight from registers
        float acc[D / 8][4];
        wm_regs_times<T, D>(acc, ds, Ks, LD, g, t);
        wm_store<T, D>(dq + obh, xn, acc, scale, scale, m0, N, g, t);
      }
      __syncthreads();  // P and dS of every row are in shared memory
    } else {
      __syncthreads();  // P of every row is in shared memory (and every warp is done with V)
      if (CP && nb < B_) wm_cp_tile<D>(Vs, v + (i64)nb * vb + (i64)h * vh, vn, N);
    }
    {  // dV = P^T dO for key rows m0..
      float acc[D / 8][4];
      wm_tile_t_times<T, D, LDM, ALIAS || LDM ? 1 : 4>(acc, Ps, dOs, LD, m0, g, t);
      wm_store<T, D>(dv + obh, xn, acc, 1.f, 1.f, m0, N, g, t);
    }
    if (ALIAS) {
      __syncthreads();  // every warp is done with P (and dO): dS takes its tile
      if (CP && nb < B_) wm_cp_tile<D>(dOs, dout + (i64)nb * gb + (i64)h * gh, gn, N);
      wm_put_rows(dSs, dsp, m0, g, t);
      {  // dQ = scale dS K, dS straight from registers
        float acc[D / 8][4];
        wm_packed_times<T, D, LDM>(acc, dsp, Ks, LD, lane);
        wm_store<T, D>(dq + obh, xn, acc, scale, scale, m0, N, g, t);
      }
      __syncthreads();  // dS of every row is in shared memory
      if (CP && nb < B_) wm_cp_tile<D>(Ks, k + (i64)nb * kb + (i64)h * kh, kn, N);
    }
    {  // dK = scale dS^T Q
      float acc[D / 8][4];
      wm_tile_t_times<T, D, LDM, ALIAS || LDM ? 1 : 4>(acc, dSs, Qs, LD, m0, g, t);
      wm_store<T, D>(dk + obh, xn, acc, scale, scale, m0, N, g, t);
    }
  }
  if (g0 < B_) {
    float* dbias_h = dbias + (i64)h * N * N;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = m0 + g + (e >> 1) * 8, col = nt * 8 + 2 * t + (e & 1);
        if (row < N && col < N) atomicAdd(dbias_h + row * N + col, db[nt][e]);
      }
    }
  }
}

// A variant of the forward (FWD_VARIANTS in ops/_window_attention_kernels.py). MINB: minimum
// blocks per SM (0: no register cap); at D = 32 six blocks fit by shared memory, and 80
// registers keep six resident.
#define WM_FORWARD_V(NAME, T, D, MINB, LDM)                                                      \
  extern "C" __global__ void __launch_bounds__(WA_THREADS, MINB)                                 \
      NAME(const T* q, const T* k, const T* v, const float* bias, const float* mask, T* out,     \
           i64 qb, i64 qh, i64 qn, i64 kb, i64 kh, i64 kn, i64 vb, i64 vh, i64 vn, i64 ob, i64 oh, \
           i64 on, int B_, int nH, int N, int nW, float scale) {                                  \
    mma_forward_body<T, D, LDM>(q, k, v, bias, mask, out, qb, qh, qn, kb, kh, kn, vb, vh, vn, ob, oh, \
                           on, B_, nH, N, nW, scale);                                            \
  }

// A variant of the backward: its entry points, minimum blocks per SM (__launch_bounds__: caps
// the registers at 65536 / (128 * MINB)), and the body's switches. The host declares each
// variant once (BWD_VARIANTS in ops/_window_attention_kernels.py).
#define WM_BACKWARD_V(NAME, T, D, MINB, LDM, ALIAS, CP)                                           \
  extern "C" __global__ void __launch_bounds__(WA_THREADS, MINB > 1 ? MINB : 0)                  \
      NAME(const T* dout, const T* q, const T* k, const T* v, const float* bias,                 \
           const float* mask, T* dq, T* dk, T* dv, float* dbias, i64 qb, i64 qh, i64 qn, i64 kb,  \
           i64 kh, i64 kn, i64 vb, i64 vh, i64 vn, i64 gb, i64 gh, i64 gn, i64 xb, i64 xh, i64 xn, \
           int B_, int nH, int N, int nW, float scale) {                                          \
    mma_backward_body<T, D, LDM, ALIAS, CP>(dout, q, k, v, bias, mask, dq, dk, dv, dbias, qb, qh, \
                                            qn, kb, kh, kn, vb, vh, vn, gb, gh, gn, xb, xh, xn,  \
                                            B_, nH, N, nW, scale);                               \
  }

// forward "base": 32/16-bit fragment reads
WM_FORWARD_V(window_attention_mma_fwd_f16_d32, half_t, 32, 6, false)
WM_FORWARD_V(window_attention_mma_fwd_f16_d64, half_t, 64, 0, false)
WM_FORWARD_V(window_attention_mma_fwd_bf16_d32, bf16_t, 32, 6, false)
WM_FORWARD_V(window_attention_mma_fwd_bf16_d64, bf16_t, 64, 0, false)
// forward "ldm": V's fragments by ldmatrix.trans
WM_FORWARD_V(window_attention_mma_fwd_ldm_f16_d32, half_t, 32, 5, true)
WM_FORWARD_V(window_attention_mma_fwd_ldm_f16_d64, half_t, 64, 0, true)
WM_FORWARD_V(window_attention_mma_fwd_ldm_bf16_d32, bf16_t, 32, 5, true)
WM_FORWARD_V(window_attention_mma_fwd_ldm_bf16_d64, bf16_t, 64, 0, true)
// "base": prefetch in registers, P and dS apart, 32/16-bit fragment reads
WM_BACKWARD_V(window_attention_mma_bwd_f16_d32, half_t, 32, 1, false, false, false)
WM_BACKWARD_V(window_attention_mma_bwd_f16_d64, half_t, 64, 1, false, false, false)
WM_BACKWARD_V(window_attention_mma_bwd_bf16_d32, bf16_t, 32, 1, false, false, false)
WM_BACKWARD_V(window_attention_mma_bwd_bf16_d64, bf16_t, 64, 1, false, false, false)
// "alias_ldm_cp": P/dS one tile, ldmatrix fragments, the tiles by cp.async, three of them
// during the window before (LDM, ALIAS and CP on; base has them all off)
WM_BACKWARD_V(window_attention_mma_bwd_alias_ldm_cp_f16_d32, half_t, 32, 4, true, true, true)
WM_BACKWARD_V(window_attention_mma_bwd_alias_ldm_cp_f16_d64, half_t, 64, 3, true, true, true)
WM_BACKWARD_V(window_attention_mma_bwd_alias_ldm_cp_bf16_d32, bf16_t, 32, 4, true, true, true)
WM_BACKWARD_V(window_attention_mma_bwd_alias_ldm_cp_bf16_d64, bf16_t, 64, 3, true, true, true)
