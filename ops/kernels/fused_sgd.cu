// aiak::fused_sgd_ (ops/fused_sgd.py): SGD with torch.optim's semantics, one launch over every
// tensor; LARS passes per-tensor factors (`scales`).

#include "optim_common.cuh"

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
