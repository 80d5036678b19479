// aiak::fused_lamb_ (ops/fused_lamb.py): LAMB with apex FusedLAMB's math, two passes after the
// global grad norm (aiak::multi_tensor_l2norm).

#include "optim_common.cuh"

// ---------------------------------------------------------------------------------------------
// LAMB in two passes after the global grad norm (multi_tensor_l2norm.cu):
//   stage 1: clip, moments, update u (written to an fp32 workspace), per-chunk sums of p^2, u^2;
//   stage 2: per-tensor norms from those partials, trust ratio, p -= ratio * u; extra blocks
//            past the chunks do step += 1.
// Bytes per param (fp32): norm 4 + stage 1 (read p g m v, write m v u) 28 + stage 2 (read p u,
// write p) 12 = 44.
// Lists: 0 p, 1 g, 2 exp_avg, 3 exp_avg_sq, 4 update (fp32), 5 step, 6 copy_to.
// ---------------------------------------------------------------------------------------------

struct LambScalars {
  float beta1, beta2, beta3, eps, wd, bc1, bc2, grad_scale, clip;
  int flags;
};

__device__ __forceinline__ float lamb_elem(float p, float g, float& m, float& v,
                                           const LambScalars& s) {
  g = g / s.grad_scale;
  g = g / s.clip;
  if (!(s.flags & F_ADAMW)) g = g + s.wd * p;
  m = s.beta1 * m + s.beta3 * g;
  v = s.beta2 * v + (1.f - s.beta2) * g * g;
  float u = (m / s.bc1) / (sqrtf(v / s.bc2) + s.eps);
  if (s.flags & F_ADAMW) u = u + s.wd * p;
  return u;
}

template <typename T>
__device__ void lamb1_chunk(const i64* table, int T_, const ChunkRef& r, const LambScalars& s,
                            float& pp, float& uu) {
  const int t = r.tensor;
  T* p = list_ptr<T>(table, T_, 0, t);
  const T* g = list_ptr<T>(table, T_, 1, t);
  T* m = list_ptr<T>(table, T_, 2, t);
  T* v = list_ptr<T>(table, T_, 3, t);
  float* u = list_ptr<float>(table, T_, 4, t);
  const i64 b = r.begin;
  const int vb = VEC * (int)sizeof(T);
  const bool vec = aligned(p + b, vb) && aligned(g + b, vb) && aligned(m + b, vb) &&
                   aligned(v + b, vb) && aligned(u + b, VEC * 4);
  const i64 nvec = vec ? (r.end - b) / VEC : 0;
  for (i64 i = threadIdx.x; i < nvec; i += blockDim.x) {
    float xp[VEC], xg[VEC], xm[VEC], xv[VEC], xu[VEC];
    load_pack<T, VEC>(p + b, i, xp);
    load_pack<T, VEC>(g + b, i, xg);
    load_pack<T, VEC>(m + b, i, xm);
    load_pack<T, VEC>(v + b, i, xv);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      xu[j] = lamb_elem(xp[j], xg[j], xm[j], xv[j], s);
      pp += xp[j] * xp[j];
      uu += xu[j] * xu[j];
    }
    store_pack<T, VEC>(m + b, i, xm);
    store_pack<T, VEC>(v + b, i, xv);
    store_pack<float, VEC>(u + b, i, xu);
  }
  for (i64 i = b + nvec * VEC + threadIdx.x; i < r.end; i += blockDim.x) {
    float xp = to_float(p[i]), xm = to_float(m[i]), xv = to_float(v[i]);
    float xu = lamb_elem(xp, to_float(g[i]), xm, xv, s);
    pp += xp * xp;
    uu += xu * xu;
    m[i] = from_float<T>(xm);
    v[i] = from_float<T>(xv);
    u[i] = xu;
  }
}

// Sum a per-thread value over the block; the result is valid in thread 0. Fixed order.
__device__ __forceinline__ float block_sum(float x, float* smem) {
  x = warp_sum(x);
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
  __syncthreads();  // smem may still be read by a previous call
  if (lane == 0) smem[warp] = x;
  __syncthreads();
  x = 0.f;
  if (warp == 0) {
    x = lane < (int)(blockDim.x / WARP) ? smem[lane] : 0.f;
    x = warp_sum(x);
  }
  return x;
}

extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS)
fused_lamb_stage1(const i64* __restrict__ table, int T, int D, float* __restrict__ partials,
                  float beta1, float beta2, float eps, float wd, float max_grad_norm, int flags,
                  const float* __restrict__ grad_norm, const float* __restrict__ grad_scale,
                  const float* __restrict__ found_inf) {
  __shared__ float smem[BLOCK / WARP];
  if (skipped(found_inf)) return;
  const int C = gridDim.x;
  const ChunkRef r = chunk_ref(table, D, T, blockIdx.x);
  LambScalars s;
  s.beta1 = beta1;
  s.beta2 = beta2;
  s.beta3 = (flags & F_GRAD_AVERAGING) ? 1.f - beta1 : 1.f;
  s.eps = eps;
  s.wd = wd;
  s.flags = flags;
  s.grad_scale = grad_scale != nullptr ? *grad_scale : 1.f;
  // Global-norm clipping on the unscaled grads; max_grad_norm <= 0 turns it off (apex divides
  // by zero there).
  const float G = *grad_norm / s.grad_scale;
  s.clip = (max_grad_norm > 0.f && G > max_grad_norm) ? G / max_grad_norm : 1.f;
  const double step = (double)*list_ptr<float>(table, T, 5, r.tensor) + 1.0;
  s.bc1 = 1.f;
  s.bc2 = 1.f;
  if (flags & F_BIAS_CORRECTION) {
    s.bc1 = (float)(1.0 - pow((double)beta1, step));
    s.bc2 = (float)(1.0 - pow((double)beta2, step));
  }
  float pp = 0.f, uu = 0.f;
  const int code = list_code(table, D, T, 0, r.tensor);
  if (code == 0) lamb1_chunk<float>(table, T, r, s, pp, uu);
  else if (code == 1) lamb1_chunk<half_t>(table, T, r, s, pp, uu);
  else lamb1_chunk<bf16_t>(table, T, r, s, pp, uu);
  pp = block_sum(pp, smem);
  uu = block_sum(uu, smem);
  if (threadIdx.x == 0) {
    partials[blockIdx.x] = pp;
    partials[C + blockIdx.x] = uu;
  }
}

template <typename T>
__device__ void lamb2_chunk(const i64* table, int T_, int D, const ChunkRef& r, float ratio) {
  const int t = r.tensor;
  T* p = list_ptr<T>(table, T_, 0, t);
  const float* u = list_ptr<float>(table, T_, 4, t);
  void* out = list_ptr<void>(table, T_, 6, t);
  const int out_code = list_code(table, D, T_, 6, t);
  const i64 b = r.begin;
  const bool vec = aligned(p + b, VEC * (int)sizeof(T)) && aligned(u + b, VEC * 4) &&
                   (out == nullptr ||
                    aligned(static_cast<char*>(out) + b * code_size(out_code), VEC * code_size(out_code)));
  const i64 nvec = vec ? (r.end - b) / VEC : 0;
  for (i64 i = threadIdx.x; i < nvec; i += blockDim.x) {
    float xp[VEC], xu[VEC];
    load_pack<T, VEC>(p + b, i, xp);
    load_pack<float, VEC>(u + b, i, xu);
#pragma unroll
    for (int j = 0; j < VEC; ++j) xp[j] = xp[j] - ratio * xu[j];
    store_pack<T, VEC>(p + b, i, xp);
    if (out != nullptr) store_out_vec(static_cast<char*>(out) + b * code_size(out_code), out_code, i, xp);
  }
  for (i64 i = b + nvec * VEC + threadIdx.x; i < r.end; i += blockDim.x) {
    const float xp = to_float(p[i]) - ratio * u[i];
    p[i] = from_float<T>(xp);
    if (out != nullptr) store_out_one(out, out_code, i, xp);
  }
}

extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS)
fused_lamb_stage2(const i64* __restrict__ table, int T, int D, int C,
                  const float* __restrict__ partials, const float* __restrict__ lr_ptr, float lr,
                  float wd, int flags, const float* __restrict__ found_inf) {
  __shared__ double dsum[2][BLOCK / WARP];
  if (skipped(found_inf)) return;
  if ((int)blockIdx.x >= C) {
    // The blocks past the chunks advance the steps (empty tensors included): stage 1 read them
    // in the previous launch, so no block of this one reads them.
    const int t = ((int)blockIdx.x - C) * blockDim.x + threadIdx.x;
    if (t < T) *list_ptr<float>(table, T, 5, t) += 1.f;
    return;
  }
  const ChunkRef r = chunk_ref(table, D, T, blockIdx.x);
  // Per-tensor norms: every block of tensor t sums t's chunk partials in the same fixed order
  // (fp64), so all its blocks agree on the ratio. A 31M-element tensor has 477 chunks: its
  // blocks read 477 x 477 x 2 floats from L2, small next to the tensor itself.
  const i64* first = table + 2 * D * T + T;
  double sp = 0.0, su = 0.0;
  for (i64 k = first[r.tensor] + threadIdx.x; k < first[r.tensor + 1]; k += blockDim.x) {
    sp += (double)partials[k];
    su += (double)partials[C + k];
  }
  sp = warp_sum(sp);
  su = warp_sum(su);
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
  if (lane == 0) {
    dsum[0][warp] = sp;
    dsum[1][warp] = su;
  }
  __syncthreads();
  sp = 0.0;
  su = 0.0;
  for (int w = 0; w < (int)(blockDim.x / WARP); ++w) {
    sp += dsum[0][w];
    su += dsum[1][w];
  }
  const float pn = (float)sqrt(sp), un = (float)sqrt(su);
  const float rate = lr_ptr != nullptr ? *lr_ptr : lr;
  const bool adapt = ((flags & F_NVLAMB) || wd != 0.f) && pn != 0.f && un != 0.f;
  const float ratio = adapt ? rate * (pn / un) : rate;
  const int code = list_code(table, D, T, 0, r.tensor);
  if (code == 0) lamb2_chunk<float>(table, T, D, r, ratio);
  else if (code == 1) lamb2_chunk<half_t>(table, T, D, r, ratio);
  else lamb2_chunk<bf16_t>(table, T, D, r, ratio);
}

