// aiak::fused_adam_ (ops/fused_adam.py): Adam/AdamW with torch.optim's semantics, one launch over
// every tensor; then bump_steps advances the step counters. Arithmetic is fp32 (bias corrections
// in fp64, once per thread); params and state are stored in the param dtype.

#include "optim_common.cuh"

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
