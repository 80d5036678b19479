// Fused optimizer steps: Adam/AdamW, SGD (momentum, nesterov, per-tensor LARS scales) and LAMB,
// one launch over every tensor of a (device, dtype) group. Table layout and helpers:
// mta_common.cuh. Arithmetic is fp32 (bias corrections in fp64, once per thread); parameters and
// state are stored in the parameter dtype, as torch's fused optimizers do.
//
// Every kernel returns at once when *found_inf != 0 (GradScaler saw inf/NaN): nothing is written,
// so the whole update, step count included, is skipped without a host synchronisation.
//
// Common lists: 0 params, 1 grads; a `copy_to` list (the amp copy-back) holds, per tensor, a
// low-precision model parameter that receives the updated value in the same pass, or a null
// pointer (an empty tensor) for "none". State steps are float32 scalars on the device; the kernels
// read `step + 1` and a separate tiny launch (`bump_steps`, or LAMB's stage 2) increments them
// afterwards: blocks of one launch cannot order a read of the step after another block's write.

#include "mta_common.cuh"

#define BLOCK 512
// Two resident blocks per SM (<= 64 registers): 1024 threads x 4 loads of 16 B in flight per SM,
// past the ~15 KB per SM that covers the memory latency on H100 (3.35 TB/s x ~600 ns / 132 SMs).
#define MIN_BLOCKS 2
#define VEC 4  // elements per vector access: 16 bytes of fp32, 8 bytes of fp16/bf16

#define F_ADAMW 1
#define F_AMSGRAD 2
#define F_MAXIMIZE 4
#define F_BIAS_CORRECTION 8
#define F_NESTEROV 16
#define F_FIRST_STEP 32
#define F_GRAD_AVERAGING 64
#define F_NVLAMB 128

__device__ __forceinline__ bool skipped(const float* found_inf) {
  return found_inf != nullptr && *found_inf != 0.f;
}

__device__ __forceinline__ int list_code(const i64* table, int D, int T, int list, int t) {
  return (int)table[D * T + list * T + t];
}

template <typename T>
__device__ __forceinline__ T* list_ptr(const i64* table, int T_, int list, int t) {
  return reinterpret_cast<T*>(table[list * T_ + t]);
}

// The amp copy-back target: store VEC (or one) fp32 values in the target's own dtype.
__device__ __forceinline__ void store_out_vec(void* out, int code, i64 i, const float (&x)[VEC]) {
  if (code == 0) store_pack<float, VEC>(static_cast<float*>(out), i, x);
  else if (code == 1) store_pack<half_t, VEC>(static_cast<half_t*>(out), i, x);
  else store_pack<bf16_t, VEC>(static_cast<bf16_t*>(out), i, x);
}

__device__ __forceinline__ void store_out_one(void* out, int code, i64 i, float x) {
  if (code == 0) static_cast<float*>(out)[i] = x;
  else if (code == 1) static_cast<half_t*>(out)[i] = from_float<half_t>(x);
  else static_cast<bf16_t*>(out)[i] = from_float<bf16_t>(x);
}

__device__ __forceinline__ int code_size(int code) { return code == 0 ? 4 : 2; }

// ---------------------------------------------------------------------------------------------
// Adam / AdamW (torch.optim semantics). Lists: 0 p, 1 g, 2 exp_avg, 3 exp_avg_sq, 4 step,
// 5 copy_to, [6 max_exp_avg_sq when amsgrad].
// ---------------------------------------------------------------------------------------------

struct AdamScalars {
  float lr, beta1, beta2, eps, wd, step_size, bc2_sqrt, grad_scale;
  int flags;
};

__device__ __forceinline__ void adam_elem(float& p, float& g, float& m, float& v, float& vmax,
                                          const AdamScalars& s) {
  g = g / s.grad_scale;  // division, as torch's kernel does: scale is a power of two anyway
  float gg = (s.flags & F_MAXIMIZE) ? -g : g;
  if (s.wd != 0.f) {
    if (s.flags & F_ADAMW) p = p - s.lr * s.wd * p;
    else gg = gg + s.wd * p;
  }
  m = s.beta1 * m + (1.f - s.beta1) * gg;
  v = s.beta2 * v + (1.f - s.beta2) * gg * gg;
  float denom;
  if (s.flags & F_AMSGRAD) {
    vmax = fmaxf(vmax, v);
    denom = sqrtf(vmax) / s.bc2_sqrt + s.eps;
  } else {
    denom = sqrtf(v) / s.bc2_sqrt + s.eps;
  }
  p = p - s.step_size * m / denom;
}

template <typename T>
__device__ void adam_chunk(const i64* table, int T_, int D, const ChunkRef& r,
                           const AdamScalars& s, bool store_grad) {
  const int t = r.tensor;
  T* p = list_ptr<T>(table, T_, 0, t);
  T* g = list_ptr<T>(table, T_, 1, t);
  T* m = list_ptr<T>(table, T_, 2, t);
  T* v = list_ptr<T>(table, T_, 3, t);
  void* out = list_ptr<void>(table, T_, 5, t);
  const int out_code = list_code(table, D, T_, 5, t);
  const bool ams = (s.flags & F_AMSGRAD) != 0;
  T* vm = ams ? list_ptr<T>(table, T_, 6, t) : nullptr;
  const i64 b = r.begin;
  const int vb = VEC * (int)sizeof(T);
  const bool vec = aligned(p + b, vb) && aligned(g + b, vb) && aligned(m + b, vb) &&
                   aligned(v + b, vb) && (!ams || aligned(vm + b, vb)) &&
                   (out == nullptr ||
                    aligned(static_cast<char*>(out) + b * code_size(out_code), VEC * code_size(out_code)));
  const i64 nvec = vec ? (r.end - b) / VEC : 0;
  for (i64 i = threadIdx.x; i < nvec; i += blockDim.x) {
    float xp[VEC], xg[VEC], xm[VEC], xv[VEC], xw[VEC];
    load_pack<T, VEC>(p + b, i, xp);
    load_pack<T, VEC>(g + b, i, xg);
    load_pack<T, VEC>(m + b, i, xm);
    load_pack<T, VEC>(v + b, i, xv);
    if (ams) load_pack<T, VEC>(vm + b, i, xw);
#pragma unroll
    for (int j = 0; j < VEC; ++j) adam_elem(xp[j], xg[j], xm[j], xv[j], xw[j], s);
    store_pack<T, VEC>(p + b, i, xp);
    if (store_grad) store_pack<T, VEC>(g + b, i, xg);
    store_pack<T, VEC>(m + b, i, xm);
    store_pack<T, VEC>(v + b, i, xv);
    if (ams) store_pack<T, VEC>(vm + b, i, xw);
    if (out != nullptr) store_out_vec(static_cast<char*>(out) + b * code_size(out_code), out_code, i, xp);
  }
  for (i64 i = b + nvec * VEC + threadIdx.x; i < r.end; i += blockDim.x) {
    float xp = to_float(p[i]), xg = to_float(g[i]), xm = to_float(m[i]), xv = to_float(v[i]);
    float xw = ams ? to_float(vm[i]) : 0.f;
    adam_elem(xp, xg, xm, xv, xw, s);
    p[i] = from_float<T>(xp);
    if (store_grad) g[i] = from_float<T>(xg);
    m[i] = from_float<T>(xm);
    v[i] = from_float<T>(xv);
    if (ams) vm[i] = from_float<T>(xw);
    if (out != nullptr) store_out_one(out, out_code, i, xp);
  }
}

extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS)
fused_adam(const i64* __restrict__ table, int T, int D, const float* __restrict__ lr_ptr,
           float lr, float beta1, float beta2, float eps, float wd, int flags,
           const float* __restrict__ grad_scale, const float* __restrict__ found_inf) {
  if (skipped(found_inf)) return;
  const ChunkRef r = chunk_ref(table, D, T, blockIdx.x);
  AdamScalars s;
  s.lr = lr_ptr != nullptr ? *lr_ptr : lr;
  s.beta1 = beta1;
  s.beta2 = beta2;
  s.eps = eps;
  s.wd = wd;
  s.flags = flags;
  s.grad_scale = grad_scale != nullptr ? *grad_scale : 1.f;
  // Bias corrections in fp64 from the step this update makes (stored step + 1), like torch.
  const double step = (double)*list_ptr<float>(table, T, 4, r.tensor) + 1.0;
  double bc1 = 1.0, bc2 = 1.0;
  if (flags & F_BIAS_CORRECTION) {
    bc1 = 1.0 - pow((double)beta1, step);
    bc2 = 1.0 - pow((double)beta2, step);
  }
  s.step_size = (float)((double)s.lr / bc1);
  s.bc2_sqrt = (float)sqrt(bc2);
  const int code = list_code(table, D, T, 0, r.tensor);
  const bool store_grad = grad_scale != nullptr;  // torch's fused kernels leave grads unscaled
  if (code == 0) adam_chunk<float>(table, T, D, r, s, store_grad);
  else if (code == 1) adam_chunk<half_t>(table, T, D, r, s, store_grad);
  else adam_chunk<bf16_t>(table, T, D, r, s, store_grad);
}

// step += 1 for every tensor of the table's list `list`, unless the step was skipped.
extern "C" __global__ void __launch_bounds__(256)
bump_steps(const i64* __restrict__ table, int T, int list, const float* __restrict__ found_inf) {
  if (skipped(found_inf)) return;
  for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < T; t += gridDim.x * blockDim.x) {
    float* s = reinterpret_cast<float*>(table[list * T + t]);
    *s += 1.f;
  }
}

// ---------------------------------------------------------------------------------------------
// SGD (torch.optim semantics) and LARS (a per-tensor factor `scales[t]` on the decayed grad).
// Lists: 0 p, 1 g, 2 copy_to, [3 momentum_buffer when momentum != 0].
// ---------------------------------------------------------------------------------------------

struct SgdScalars {
  float lr, momentum, dampening, wd, factor, grad_scale;
  int flags;
  bool has_momentum;
};

__device__ __forceinline__ void sgd_elem(float& p, float& g, float& buf, const SgdScalars& s) {
  g = g / s.grad_scale;
  float d = (s.flags & F_MAXIMIZE) ? -g : g;
  if (s.wd != 0.f) d = d + s.wd * p;
  d = d * s.factor;  // 1 for SGD (exact), the LARS trust ratio otherwise
  if (s.has_momentum) {
    buf = (s.flags & F_FIRST_STEP) ? d : s.momentum * buf + (1.f - s.dampening) * d;
    d = (s.flags & F_NESTEROV) ? d + s.momentum * buf : buf;
  }
  p = p - s.lr * d;
}

template <typename T>
__device__ void sgd_chunk(const i64* table, int T_, int D, const ChunkRef& r, const SgdScalars& s,
                          bool store_grad) {
  const int t = r.tensor;
  T* p = list_ptr<T>(table, T_, 0, t);
  T* g = list_ptr<T>(table, T_, 1, t);
  void* out = list_ptr<void>(table, T_, 2, t);
  const int out_code = list_code(table, D, T_, 2, t);
  T* mb = s.has_momentum ? list_ptr<T>(table, T_, 3, t) : nullptr;
  const i64 b = r.begin;
  const int vb = VEC * (int)sizeof(T);
  const bool vec = aligned(p + b, vb) && aligned(g + b, vb) && (!s.has_momentum || aligned(mb + b, vb)) &&
                   (out == nullptr ||
                    aligned(static_cast<char*>(out) + b * code_size(out_code), VEC * code_size(out_code)));
  const i64 nvec = vec ? (r.end - b) / VEC : 0;
  const bool load_buf = s.has_momentum && !(s.flags & F_FIRST_STEP);
  for (i64 i = threadIdx.x; i < nvec; i += blockDim.x) {
    float xp[VEC], xg[VEC], xb[VEC] = {0.f, 0.f, 0.f, 0.f};
    load_pack<T, VEC>(p + b, i, xp);
    load_pack<T, VEC>(g + b, i, xg);
    if (load_buf) load_pack<T, VEC>(mb + b, i, xb);
#pragma unroll
    for (int j = 0; j < VEC; ++j) sgd_elem(xp[j], xg[j], xb[j], s);
    store_pack<T, VEC>(p + b, i, xp);
    if (store_grad) store_pack<T, VEC>(g + b, i, xg);
    if (s.has_momentum) store_pack<T, VEC>(mb + b, i, xb);
    if (out != nullptr) store_out_vec(static_cast<char*>(out) + b * code_size(out_code), out_code, i, xp);
  }
  for (i64 i = b + nvec * VEC + threadIdx.x; i < r.end; i += blockDim.x) {
    float xp = to_float(p[i]), xg = to_float(g[i]);
    float xb = load_buf ? to_float(mb[i]) : 0.f;
    sgd_elem(xp, xg, xb, s);
    p[i] = from_float<T>(xp);
    if (store_grad) g[i] = from_float<T>(xg);
    if (s.has_momentum) mb[i] = from_float<T>(xb);
    if (out != nullptr) store_out_one(out, out_code, i, xp);
  }
}

extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS)
fused_sgd(const i64* __restrict__ table, int T, int D, const float* __restrict__ lr_ptr, float lr,
          float momentum, float dampening, float wd, int flags, const float* __restrict__ scales,
          const float* __restrict__ grad_scale, const float* __restrict__ found_inf) {
  if (skipped(found_inf)) return;
  const ChunkRef r = chunk_ref(table, D, T, blockIdx.x);
  SgdScalars s;
  s.lr = lr_ptr != nullptr ? *lr_ptr : lr;
  s.momentum = momentum;
  s.dampening = dampening;
  s.wd = wd;
  s.flags = flags;
  s.has_momentum = D > 3;
  s.factor = scales != nullptr ? scales[r.tensor] : 1.f;
  s.grad_scale = grad_scale != nullptr ? *grad_scale : 1.f;
  const int code = list_code(table, D, T, 0, r.tensor);
  const bool store_grad = grad_scale != nullptr;
  if (code == 0) sgd_chunk<float>(table, T, D, r, s, store_grad);
  else if (code == 1) sgd_chunk<half_t>(table, T, D, r, s, store_grad);
  else sgd_chunk<bf16_t>(table, T, D, r, s, store_grad);
}

// ---------------------------------------------------------------------------------------------
// LAMB in two passes after the global grad norm (ops/multi_tensor.cu):
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
