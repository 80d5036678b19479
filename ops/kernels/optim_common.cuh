// Device helpers shared by the fused optimizer kernels (fused_adam.cu, fused_sgd.cu,
// fused_lamb.cu). Table layout and dtype helpers: mta_common.cuh.
//
// Every kernel returns at once when *found_inf != 0 (GradScaler saw inf/NaN): nothing is written,
// so the whole update, step count included, is skipped without a host synchronisation.
//
// Common lists: 0 params, 1 grads; a `copy_to` list (the amp copy-back) holds, per tensor, a
// low-precision model parameter that receives the updated value in the same pass, or a null
// pointer (an empty tensor) for "none". State steps are float32 scalars on the device; the kernels
// read `step + 1` and a separate tiny launch (`bump_steps`, or LAMB's stage 2) increments them
// afterwards: blocks of one launch cannot order a read of the step after another block's write.
//
// The F_* flag bits and BLOCK are read by ops/_fused.py from this file: their one source.
#pragma once

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
