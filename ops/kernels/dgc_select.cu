// aiak::dgc_select: DGC's selection with a fixed amount of work and no host synchronisation.
// Importance = |x| compared as fp32 bit patterns (unsigned; NaN ranks above +inf).
//
// Launch sequence (ops/dgc_select.py):
//   gather_samples            |x| at the sample positions -> a compact fp32 buffer
//   4 x (radix_hist, pick)    thr0 = ks-th largest sample            -> plan[0]
//   count_tiles               per tile, histogram of "how many candidate thresholds <= |x|"
//   decide                    column sums, the adaptation loop on one thread -> plan[16..]
//   4 x (radix_hist, pick)    gated on plan[16] (resample stop): k-th largest |x| -> plan[8]
//   count_exact               gated: per tile, #(> V) and #(== V)
//   tile_offsets              one block: ordered offsets of every tile
//   write                     per tile, ordered compaction of the first k selected
// Plan words (int64): [0] thr0 prefix, [1] remaining, [2] mask; [8..10] the same for V;
// [16] exact, [17] first selected bin, [18] threshold bits, [19] thresholds.

#include "mta_common.cuh"

#define TILE 16384
#define BLOCK 256
#define MAXT 232

__device__ __forceinline__ u32 abs_bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

// The threshold bits of state s: resample -> (0, s); otherwise states (a, b), a-major.
__device__ u32 state_bits(u32 thr0, int s, double upper, double lower, int iters, int resample) {
  int a = 0, b = s;
  if (!resample) {
    while (b > iters - a) {
      b -= iters - a + 1;
      ++a;
    }
  }
  double t = (double)__uint_as_float(thr0);
  for (int i = 0; i < a; ++i) t = __dmul_rn(t, upper);
  for (int i = 0; i < b; ++i) t = __dmul_rn(t, lower);
  return __float_as_uint(__double2float_rn(t));
}

__device__ __forceinline__ int state_index(int a, int b, int iters, int resample) {
  if (resample) return b;
  int s = 0;
  for (int i = 0; i < a; ++i) s += iters - i + 1;
  return s + b;
}

// thr[s] for every state and sorted[] ascending; rank_lo[s] = first sorted position of thr[s].
__device__ void build_thresholds(u32 thr0, int nthr, double upper, double lower, int iters,
                                 int resample, u32* thr, u32* sorted, int* rank_lo) {
  for (int s = threadIdx.x; s < nthr; s += blockDim.x)
    thr[s] = state_bits(thr0, s, upper, lower, iters, resample);
  __syncthreads();
  for (int s = threadIdx.x; s < nthr; s += blockDim.x) {
    int less = 0, before = 0;
    for (int t = 0; t < nthr; ++t) {
      less += thr[t] < thr[s];
      before += (t < s) & (thr[t] == thr[s]);
    }
    sorted[less + before] = thr[s];
    if (rank_lo) rank_lo[s] = less;
  }
  __syncthreads();
}

extern "C" __global__ void __launch_bounds__(BLOCK)
    dgc_gather_samples(const float* __restrict__ x, const i64* __restrict__ sidx,
                       float* __restrict__ out, i64 start, i64 stride, i64 m) {
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < m; i += (i64)gridDim.x * blockDim.x) {
    const i64 j = sidx ? sidx[i] : start + i * stride;
    out[i] = __uint_as_float(abs_bits(x[j]));
  }
}

extern "C" __global__ void __launch_bounds__(BLOCK)
    dgc_radix_hist(const float* __restrict__ src, const i64* __restrict__ plan, u64* hist, i64 n,
                   int shift, int slot, int gate) {
  if (gate && plan[16] == 0) return;
  __shared__ u32 sh[256];
  sh[threadIdx.x] = 0;
  __syncthreads();
  const u32 prefix = (u32)plan[slot], mask = (u32)plan[slot + 2];
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
    const u32 b = abs_bits(src[i]);
    if ((b & mask) == prefix) atomicAdd(&sh[(b >> shift) & 255u], 1u);
  }
  __syncthreads();
  if (sh[threadIdx.x]) atomicAdd(&hist[threadIdx.x], (u64)sh[threadIdx.x]);
}

extern "C" __global__ void dgc_radix_pick(i64* plan, u64* hist, i64 k, int shift, int slot,
                                          int gate) {
  if (gate && plan[16] == 0) return;
  if (threadIdx.x == 0) {
    i64 rem = shift == 24 ? k : plan[slot + 1];
    i64 cum = 0;
    int d = 0;
    for (int j = 255; j >= 0; --j) {
      const i64 c = (i64)hist[j];
      if (cum + c >= rem) {
        d = j;
        break;
      }
      cum += c;
    }
    plan[slot] = (i64)((u32)plan[slot] | ((u32)d << shift));
    plan[slot + 1] = rem - cum;
    plan[slot + 2] = (i64)((u32)plan[slot + 2] | (255u << shift));
  }
  __syncwarp();
  for (int j = threadIdx.x; j < 256; j += blockDim.x) hist[j] = 0;
}

extern "C" __global__ void __launch_bounds__(BLOCK)
    dgc_count_tiles(const float* __restrict__ x, const i64* __restrict__ plan, i64* tile_hist,
                    i64 n, double upper, double lower, int iters, int resample) {
  __shared__ u32 thr[MAXT], sorted[MAXT];
  __shared__ u32 sh[MAXT + 1];
  const int nthr = resample ? iters + 1 : (iters + 1) * (iters + 2) / 2;
  build_thresholds((u32)plan[0], nthr, upper, lower, iters, resample, thr, sorted, nullptr);
  for (int j = threadIdx.x; j <= nthr; j += blockDim.x) sh[j] = 0;
  __syncthreads();
  const i64 lo = (i64)blockIdx.x * TILE;
  const i64 hi = lo + TILE < n ? lo + TILE : n;
  for (i64 i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    const u32 b = abs_bits(x[i]);
    if (b < sorted[0]) continue;
    int l = 1, h = nthr;  // the number of thresholds <= b, in [1, nthr]
    while (l < h) {
      const int mid = (l + h) >> 1;
      if (sorted[mid] <= b) l = mid + 1;
      else h = mid;
    }
    atomicAdd(&sh[l], 1u);
  }
  __syncthreads();
  for (int j = threadIdx.x; j <= nthr; j += blockDim.x)
    tile_hist[(i64)blockIdx.x * (nthr + 1) + j] = sh[j];
}

extern "C" __global__ void __launch_bounds__(BLOCK)
    dgc_decide(i64* plan, const i64* __restrict__ tile_hist, i64* rest, i64 tiles, i64 k,
               double upper, double lower, int iters, int resample) {
  __shared__ u32 thr[MAXT], sorted[MAXT];
  __shared__ int rank_lo[MAXT];
  __shared__ i64 suffix[MAXT + 2];
  const int nthr = resample ? iters + 1 : (iters + 1) * (iters + 2) / 2;
  build_thresholds((u32)plan[0], nthr, upper, lower, iters, resample, thr, sorted, rank_lo);
  for (int j = threadIdx.x; j <= nthr; j += blockDim.x) {
    i64 s = 0;
    for (i64 t = 0; t < tiles; ++t) s += tile_hist[t * (nthr + 1) + j];
    suffix[j] = s;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  suffix[nthr + 1] = 0;
  for (int j = nthr; j >= 0; --j) suffix[j] += suffix[j + 1];
  int a = 0, b = 0, exact = 0;
  int s = 0;
  i64 c = suffix[rank_lo[0] + 1];
  for (int it = 0; it < iters; ++it) {
    if ((double)c > upper * (double)k) {
      if (resample) {
        exact = 1;
        break;
      }
      ++a;
    } else if ((double)c < lower * (double)k) {
      ++b;
    } else {
      break;
    }
    s = state_index(a, b, iters, resample);
    c = suffix[rank_lo[s] + 1];
  }
  s = state_index(a, b, iters, resample);
  plan[16] = exact;
  plan[17] = rank_lo[s] + 1;
  plan[18] = thr[s];
  plan[19] = nthr;
}

extern "C" __global__ void __launch_bounds__(BLOCK)
    dgc_count_exact(const float* __restrict__ x, const i64* __restrict__ plan, i64* rest, i64 tiles,
                    i64 n) {
  if (plan[16] == 0) return;
  __shared__ u32 gt, eq;
  if (threadIdx.x == 0) gt = eq = 0;
  __syncthreads();
  const u32 v = (u32)plan[8];
  const i64 lo = (i64)blockIdx.x * TILE;
  const i64 hi = lo + TILE < n ? lo + TILE : n;
  u32 g = 0, e = 0;
  for (i64 i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    const u32 b = abs_bits(x[i]);
    g += b > v;
    e += b == v;
  }
  atomicAdd(&gt, g);
  atomicAdd(&eq, e);
  __syncthreads();
  if (threadIdx.x == 0) {
    rest[blockIdx.x] = gt;
    rest[tiles + blockIdx.x] = eq;
  }
}

// Exclusive scan of one value per thread over a block of 1024; returns the block total.
__device__ i64 block_scan_1024(i64 v, i64* out, i64* warp_sums) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  i64 incl = v;
  for (int o = 1; o < 32; o <<= 1) {
    const i64 y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    i64 w = warp_sums[lane];
    for (int o = 1; o < 32; o <<= 1) {
      const i64 y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += y;
    }
    warp_sums[lane] = w;  // inclusive over warps
  }
  __syncthreads();
  *out = incl - v + (warp ? warp_sums[warp - 1] : 0);
  const i64 total = warp_sums[31];
  __syncthreads();
  return total;
}

extern "C" __global__ void __launch_bounds__(1024)
    dgc_tile_offsets(const float* __restrict__ x, const i64* __restrict__ plan,
                     const i64* __restrict__ tile_hist, i64* rest, i64 tiles, i64 n, int nthr) {
  __shared__ i64 warp_sums[32];
  const int exact = (int)plan[16];
  const int first = (int)plan[17];
  const i64 room = plan[9];  // equal-to-V entries to take (exact mode)
  i64* gt = rest;
  i64* eq = rest + tiles;
  i64* offs = rest + 2 * tiles;
  i64* eq_before = rest + 3 * tiles;
  i64 carry = 0;
  if (exact) {
    for (i64 base = 0; base < tiles; base += 1024) {
      const i64 t = base + threadIdx.x;
      const i64 v = t < tiles ? eq[t] : 0;
      i64 ex;
      const i64 tot = block_scan_1024(v, &ex, warp_sums);
      if (t < tiles) eq_before[t] = carry + ex;
      carry += tot;
    }
    __syncthreads();
  }
  carry = 0;
  for (i64 base = 0; base < tiles; base += 1024) {
    const i64 t = base + threadIdx.x;
    i64 v = 0;
    if (t < tiles) {
      if (exact) {
        i64 take = room - eq_before[t];
        take = take < 0 ? 0 : (take > eq[t] ? eq[t] : take);
        v = gt[t] + take;
      } else {
        for (int j = first; j <= nthr; ++j) v += tile_hist[t * (nthr + 1) + j];
      }
    }
    i64 ex;
    const i64 tot = block_scan_1024(v, &ex, warp_sums);
    if (t < tiles) offs[t] = carry + ex;
    carry += tot;
  }
}

extern "C" __global__ void __launch_bounds__(BLOCK)
    dgc_write(const float* __restrict__ x, const i64* __restrict__ plan, const i64* __restrict__ rest,
              float* __restrict__ values, i64* __restrict__ indices, i64 tiles, i64 n, i64 k) {
  __shared__ u32 warp_sel[BLOCK / WARP], warp_eq[BLOCK / WARP];
  i64 offset = rest[2 * tiles + blockIdx.x];
  if (offset >= k) return;
  const int exact = (int)plan[16];
  const u32 thr = (u32)plan[18], v = (u32)plan[8];
  const i64 room = plan[9];
  i64 eq_seen = exact ? rest[3 * tiles + blockIdx.x] : 0;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const u32 lt = (1u << lane) - 1u;
  const i64 lo = (i64)blockIdx.x * TILE;
  const i64 hi = lo + TILE < n ? lo + TILE : n;
  for (i64 base = lo; base < hi && offset < k; base += BLOCK) {
    const i64 i = base + threadIdx.x;
    float xv = 0.f;
    u32 b = 0;
    const bool in = i < hi;
    if (in) {
      xv = x[i];
      b = abs_bits(xv);
    }
    // equal-to-V entries are taken in index order while room lasts (exact mode)
    const bool is_eq = in && exact && b == v;
    const u32 eq_mask = __ballot_sync(0xffffffffu, is_eq);
    if (lane == 0) warp_eq[warp] = __popc(eq_mask);
    __syncthreads();
    i64 eq_rank = eq_seen + __popc(eq_mask & lt);
    u32 eq_total = 0;
    for (int w = 0; w < BLOCK / WARP; ++w) {
      if (w < warp) eq_rank += warp_eq[w];
      eq_total += warp_eq[w];
    }
    const bool sel = in && (exact ? (b > v || (is_eq && eq_rank < room)) : b >= thr);
    const u32 sel_mask = __ballot_sync(0xffffffffu, sel);
    if (lane == 0) warp_sel[warp] = __popc(sel_mask);
    __syncthreads();
    i64 pos = offset + __popc(sel_mask & lt);
    u32 sel_total = 0;
    for (int w = 0; w < BLOCK / WARP; ++w) {
      if (w < warp) pos += warp_sel[w];
      sel_total += warp_sel[w];
    }
    if (sel && pos < k) {
      values[pos] = xv;
      indices[pos] = i;
    }
    offset += sel_total;
    eq_seen += eq_total;
    __syncthreads();
  }
}
