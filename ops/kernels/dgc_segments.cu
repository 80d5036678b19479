// aiak::dgc_segments_select: DGC's selection in every segment of a bucket, a fixed number of
// launches whatever the number of segments, no host synchronisation.
// Importance = |x| as the int32 bit pattern of a non-negative fp32 (NaN ranks above +inf);
// -1 marks a lane past the end of a tile, below every threshold.
//
// Every grid covers the whole bucket: one block per tile of TILE elements of one segment (the
// counting, exact and write passes), per SAMP sample slots of one segment (the sample
// histogram) or per segment (picks, scan). A block finds its segment by binary search in a
// prefix table (`aux`, built on the host once per plan); per-segment state lives in the
// workspace, so each pass is gated on the device: a finished segment's blocks return at once.
//
// Launch sequence (ops/_dgc_segments_cuda.py):
//   init                  per-segment state; the radix histograms zeroed
//   4 x (sample_hist      histogram of one 8-bit digit of the samples matching the prefix so far
//        pick)            per segment: the digit holding the ks-th largest sample -> after the
//                         fourth, thr0 (segments sampled whole, or iters == 0, are done)
//   iters x (count        #(importance >= thr) per segment still adapting
//            decide)      one thread per segment: one step of DGC's adaptation loop
//   4 x (exact_hist       gated on a resample stop: the k-th largest importance V of the
//        pick)            segment by the same radix select; rem = how many entries == V to take
//   tile_counts           per tile: #selected (>= thr, or > V) and #(== V)
//   scan                  per segment: tile offsets (ties to the lowest index), the padding
//   write                 per tile: its selected entries in index order
// The workspace holds no state between calls: init rewrites what a call reads before writing.
// Every launch after init is a programmatic dependent launch (sm_90+): it may start while the
// kernel before still runs and waits for its end in grid_dep_wait().

#include "mta_common.cuh"

#define BLOCK 256
#define NWARP (BLOCK / WARP)
#define TILE 4096   // elements of one segment per block (16 per thread)
#define SAMP 4096   // sample slots of one segment per block of the sample histogram
#define BINS 256    // radix bins: 8-bit digits, four passes; equal to BLOCK (a bin per thread)
#define SW 16       // state words per segment
#define COLS 8      // plan columns (ops/dgc_segments.py)
#define FULL 0xffffffffu
static_assert(BINS == BLOCK, "the histogram kernels keep one bin per thread");

// Plan columns.
#define C_START 0
#define C_N 1
#define C_K 2
#define C_OUT 3
#define C_M 4
#define C_KS 5
#define C_STRIDE 6
#define C_SOFF 7

// State words of a segment (int64).
#define W_PREFIX 0   // sample select: digits found so far, their mask, the rank left to find
#define W_MASK 1
#define W_REM 2
#define W_THR 3      // threshold bits
#define W_CNT 4      // #(importance >= thr) of the current counting pass
#define W_DONE 5     // the adaptation loop has stopped
#define W_EXACT 6    // stopped by a resample: exact top-k
#define W_XPREFIX 7  // exact select: prefix (V at the end), mask, rank (at the end: #(== V) taken)
#define W_XMASK 8
#define W_XREM 9
#define W_S0 10      // sample start, reduced into [0, stride)

struct Ws {
  i64* st;    // [S][SW]
  u64* hist;  // [S][BINS]
  i64* gt;    // per tile: #selected (non-exact) or #(> V) (exact)
  i64* eq;    // per tile: #(== V)
  i64* off;   // per tile: output slots taken by the segment's tiles before it
  i64* eqb;   // per tile: #(== V) in the segment's tiles before it
};

__device__ __forceinline__ Ws carve(i64* base, int S, i64 T) {
  Ws w;
  w.st = base;
  w.hist = reinterpret_cast<u64*>(base + (i64)S * SW);
  i64* t = base + (i64)S * (SW + BINS);
  w.gt = t;
  w.eq = t + T;
  w.off = t + 2 * T;
  w.eqb = t + 3 * T;
  return w;
}

// The segment of block b: prefix[0] = 0 <= ... strictly increasing ... prefix[S] = blocks.
__device__ __forceinline__ int find_segment(const i64* __restrict__ prefix, int S, i64 b) {
  int lo = 0, hi = S;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (prefix[mid] <= b) lo = mid;
    else hi = mid;
  }
  return lo;
}

__device__ __forceinline__ int abs_bits(float v) { return (int)(__float_as_uint(v) & 0x7fffffffu); }

// fp32(thr * f), an IEEE multiply: explicit PTX without .ftz keeps subnormals (CuPy compiles
// with -ftz=true). A NaN threshold keeps its bits (the reference does the same).
__device__ __forceinline__ int scale_thr(int thr, float f) {
  if (thr > 0x7f800000) return thr;
  float r;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(__int_as_float(thr)), "f"(f));
  return (int)(__float_as_uint(r) & 0x7fffffffu);
}

// Exclusive scan of one u64 per thread over the block; *total = the sum. Every thread calls it
// (it synchronises); `sh` holds NWARP + 1 words.
__device__ u64 block_scan(u64 v, u64* total, u64* sh) {
  const int lane = threadIdx.x & (WARP - 1), warp = threadIdx.x / WARP;
  u64 incl = v;
#pragma unroll
  for (int o = 1; o < WARP; o <<= 1) {
    const u64 y = __shfl_up_sync(FULL, incl, o);
    if (lane >= o) incl += y;
  }
  __syncthreads();  // `sh` may still be read by an earlier call
  if (lane == WARP - 1) sh[warp] = incl;
  __syncthreads();
  if (threadIdx.x == 0) {
    u64 s = 0;
    for (int i = 0; i < NWARP; ++i) {
      const u64 y = sh[i];
      sh[i] = s;
      s += y;
    }
    sh[NWARP] = s;
  }
  __syncthreads();
  *total = sh[NWARP];
  return sh[warp] + incl - v;
}

// Flush a block's shared histogram into segment s's global one.
__device__ __forceinline__ void flush_hist(const u32* h, u64* hist, int s) {
  __syncthreads();
  const u32 c = h[threadIdx.x];
  if (c) atomicAdd(&hist[(i64)s * BINS + threadIdx.x], (u64)c);
}

extern "C" __global__ void __launch_bounds__(BLOCK)
    dgc_seg_init(const i64* __restrict__ table, const i64* __restrict__ sample_start, i64* ws,
                 int S, i64 T, int iters) {
  grid_dep_launch();  // the next kernel's blocks may start now; they wait in grid_dep_wait
  const Ws w = carve(ws, S, T);
  w.hist[(i64)blockIdx.x * BINS + threadIdx.x] = 0;  // grid = S blocks of BINS threads
  const i64 s = (i64)blockIdx.x * BLOCK + threadIdx.x;
  if (s >= S) return;
  const i64* row = table + s * COLS;
  i64* st = w.st + s * SW;
  const i64 stride = row[C_STRIDE];
  i64 s0 = sample_start[s] % stride;
  if (s0 < 0) s0 += stride;
  st[W_PREFIX] = 0;
  st[W_MASK] = 0;
  st[W_REM] = row[C_KS];
  st[W_THR] = 0;
  st[W_CNT] = 0;
  st[W_DONE] = 1;  // set by the last sample pick
  st[W_EXACT] = 0;
  st[W_XPREFIX] = 0;
  st[W_XMASK] = 0;
  st[W_XREM] = row[C_K];
  st[W_S0] = s0;
}

// One digit of the samples' radix select. Segment s's samples: the whole segment (m == n),
// x[sidx[sample_off + i]] for i < m (uniform; a position outside x reads as importance 0), or
// x[start + s0 + i * stride] while inside the segment (strided).
extern "C" __global__ void __launch_bounds__(BLOCK)
    dgc_seg_sample_hist(const float* __restrict__ x, const i64* __restrict__ sidx,
                        const i64* __restrict__ table, const i64* __restrict__ aux, i64* ws,
                        int S, i64 T, i64 N, int digit) {
  grid_dep_launch();
  grid_dep_wait();  // the kernel before has ended: its writes are visible from here on
  const Ws w = carve(ws, S, T);
  __shared__ u32 h[BINS];
  h[threadIdx.x] = 0;
  __syncthreads();
  const i64* pre = aux + (sidx ? 2 * (i64)(S + 1) : (i64)(S + 1));
  const int s = find_segment(pre, S, blockIdx.x);
  const i64* row = table + (i64)s * COLS;
  const i64* st = w.st + (i64)s * SW;
  const i64 start = row[C_START], n = row[C_N], m = row[C_M], stride = row[C_STRIDE];
  const i64 s0 = st[W_S0];
  const i64 count = m == n ? n : (sidx ? m : (n - s0 + stride - 1) / stride);
  const int prefix = (int)st[W_PREFIX], mask = (int)st[W_MASK];
  const int shift = 24 - 8 * digit;
  const i64 first = ((i64)blockIdx.x - pre[s]) * SAMP;
  const i64 last = first + SAMP < count ? first + SAMP : count;
  for (i64 i = first + threadIdx.x; i < last; i += BLOCK) {
    i64 pos;
    if (m == n) pos = start + i;
    else if (sidx) pos = sidx[row[C_SOFF] + i];
    else pos = start + s0 + i * stride;
    const int b = pos >= 0 && pos < N ? abs_bits(x[pos]) : 0;
    if ((b & mask) == prefix) atomicAdd(&h[(b >> shift) & (BINS - 1)], 1u);
  }
  flush_hist(h, w.hist, s);
}

// One block per segment: the digit holding the rank still to find (stage 0: the samples',
// stage 1: the exact select's, gated on a resample stop); the histogram is zeroed after use.
extern "C" __global__ void __launch_bounds__(BLOCK)
    dgc_seg_pick(const i64* __restrict__ table, i64* ws, int S, i64 T, int stage, int digit,
                 int iters) {
  grid_dep_launch();
  grid_dep_wait();
  const Ws w = carve(ws, S, T);
  __shared__ u64 sh[NWARP + 1];
  const int s = blockIdx.x;
  i64* st = w.st + (i64)s * SW;
  if (stage && !st[W_EXACT]) return;
  const int wp = stage ? W_XPREFIX : W_PREFIX;
  const i64 prefix = st[wp], mask = st[wp + 1], rem = st[wp + 2];
  const int shift = 24 - 8 * digit;
  const int bin = BINS - 1 - threadIdx.x;  // thread 0 holds the top bin: a scan from the top
  u64* hs = w.hist + (i64)s * BINS;
  const u64 c = hs[bin];
  hs[bin] = 0;
  u64 tot;
  const i64 above = (i64)block_scan(c, &tot, sh);
  if (above < rem && rem <= above + (i64)c) {  // exactly one thread when 1 <= rem <= total
    const i64 np = prefix | ((i64)bin << shift);
    st[wp] = np;
    st[wp + 1] = mask | ((i64)(BINS - 1) << shift);
    st[wp + 2] = rem - above;
    if (digit == 3 && stage == 0) {
      const i64* row = table + (i64)s * COLS;
      st[W_THR] = np;
      st[W_DONE] = row[C_M] == row[C_N] || iters == 0;  // no adaptation when sampled whole
    }
  }
}

// #(importance >= thr) of each segment still adapting, one tile per block.
extern "C" __global__ void __launch_bounds__(BLOCK)
    dgc_seg_count(const float* __restrict__ x, const i64* __restrict__ table,
                  const i64* __restrict__ aux, i64* ws, int S, i64 T) {
  grid_dep_launch();
  grid_dep_wait();
  const Ws w = carve(ws, S, T);
  __shared__ u64 sh[NWARP + 1];
  const int s = find_segment(aux, S, blockIdx.x);
  i64* st = w.st + (i64)s * SW;
  if (st[W_DONE]) return;
  const i64* row = table + (i64)s * COLS;
  const i64 start = row[C_START], n = row[C_N];
  const int thr = (int)st[W_THR];
  const i64 e0 = ((i64)blockIdx.x - aux[s]) * TILE;
  const i64 e1 = e0 + TILE < n ? e0 + TILE : n;
  u64 c = 0;
  for (i64 e = e0 + threadIdx.x; e < e1; e += BLOCK) c += abs_bits(x[start + e]) >= thr;
  u64 tot;
  block_scan(c, &tot, sh);
  if (threadIdx.x == 0 && tot) atomicAdd(reinterpret_cast<u64*>(st + W_CNT), tot);
}

// One step of DGC's adaptation loop per segment still adapting (one thread each).
extern "C" __global__ void __launch_bounds__(BLOCK)
    dgc_seg_decide(const i64* __restrict__ table, i64* ws, int S, i64 T, double upper,
                   double lower, float up32, float low32, int resample) {
  grid_dep_launch();
  grid_dep_wait();
  const Ws w = carve(ws, S, T);
  const i64 s = (i64)blockIdx.x * BLOCK + threadIdx.x;
  if (s >= S) return;
  i64* st = w.st + s * SW;
  if (st[W_DONE]) return;
  const i64 c = st[W_CNT];
  st[W_CNT] = 0;
  const i64 k = table[s * COLS + C_K];
  int thr = (int)st[W_THR];
  if (c > k) {
    if ((double)c > (double)k * upper) {
      if (resample) {
        st[W_EXACT] = 1;
        st[W_DONE] = 1;
      } else {
        thr = scale_thr(thr, up32);
      }
    } else {
      st[W_DONE] = 1;
    }
  } else if ((double)c < lower * (double)k) {
    thr = scale_thr(thr, low32);
  } else {
    st[W_DONE] = 1;
  }
  st[W_THR] = thr;
}

// One digit of the exact k-th largest importance of each segment stopped by a resample.
extern "C" __global__ void __launch_bounds__(BLOCK)
    dgc_seg_exact_hist(const float* __restrict__ x, const i64* __restrict__ table,
                       const i64* __restrict__ aux, i64* ws, int S, i64 T, int digit) {
  grid_dep_launch();
  grid_dep_wait();
  const Ws w = carve(ws, S, T);
  __shared__ u32 h[BINS];
  const int s = find_segment(aux, S, blockIdx.x);
  const i64* st = w.st + (i64)s * SW;
  if (!st[W_EXACT]) return;
  h[threadIdx.x] = 0;
  __syncthreads();
  const i64* row = table + (i64)s * COLS;
  const i64 start = row[C_START], n = row[C_N];
  const int prefix = (int)st[W_XPREFIX], mask = (int)st[W_XMASK];
  const int shift = 24 - 8 * digit;
  const i64 e0 = ((i64)blockIdx.x - aux[s]) * TILE;
  const i64 e1 = e0 + TILE < n ? e0 + TILE : n;
  for (i64 e = e0 + threadIdx.x; e < e1; e += BLOCK) {
    const int b = abs_bits(x[start + e]);
    if ((b & mask) == prefix) atomicAdd(&h[(b >> shift) & (BINS - 1)], 1u);
  }
  flush_hist(h, w.hist, s);
}

// Per tile: #selected (>= thr; exact: > V) and #(== V) (exact only).
extern "C" __global__ void __launch_bounds__(BLOCK)
    dgc_seg_tile_counts(const float* __restrict__ x, const i64* __restrict__ table,
                        const i64* __restrict__ aux, i64* ws, int S, i64 T) {
  grid_dep_launch();
  grid_dep_wait();
  const Ws w = carve(ws, S, T);
  __shared__ u64 sh[NWARP + 1];
  const int s = find_segment(aux, S, blockIdx.x);
  const i64* st = w.st + (i64)s * SW;
  const i64* row = table + (i64)s * COLS;
  const i64 start = row[C_START], n = row[C_N];
  const bool exact = st[W_EXACT] != 0;
  const int thr = (int)st[W_THR], V = (int)st[W_XPREFIX];
  const i64 e0 = ((i64)blockIdx.x - aux[s]) * TILE;
  const i64 e1 = e0 + TILE < n ? e0 + TILE : n;
  u64 c = 0;  // low half: selected, high half: == V (at most TILE each)
  for (i64 e = e0 + threadIdx.x; e < e1; e += BLOCK) {
    const int b = abs_bits(x[start + e]);
    if (exact) c += (u64)(b > V) | ((u64)(b == V) << 32);
    else c += b >= thr;
  }
  u64 tot;
  block_scan(c, &tot, sh);
  if (threadIdx.x == 0) {
    w.gt[blockIdx.x] = (i64)(tot & 0xffffffffull);
    w.eq[blockIdx.x] = (i64)(tot >> 32);
  }
}

// One block per segment: each tile's first output slot and (exact) #(== V) before it; the
// entries == V taken are the first rem in index order; slots past the selected ones padded.
extern "C" __global__ void __launch_bounds__(BLOCK)
    dgc_seg_scan(const i64* __restrict__ table, const i64* __restrict__ aux, i64* ws, int S,
                 i64 T, float* values, i64* indices) {
  grid_dep_launch();
  grid_dep_wait();
  const Ws w = carve(ws, S, T);
  __shared__ u64 sh[NWARP + 1];
  const int s = blockIdx.x;
  const i64* st = w.st + (i64)s * SW;
  const i64* row = table + (i64)s * COLS;
  const bool exact = st[W_EXACT] != 0;
  const i64 rem = st[W_XREM], k = row[C_K], out = row[C_OUT];
  const i64 t0 = aux[s], t1 = aux[s + 1];
  u64 carry = 0, tot;
  if (exact) {
    for (i64 b = t0; b < t1; b += BLOCK) {
      const i64 t = b + threadIdx.x;
      const u64 ex = block_scan(t < t1 ? (u64)w.eq[t] : 0, &tot, sh);
      if (t < t1) w.eqb[t] = (i64)(carry + ex);
      carry += tot;
    }
    carry = 0;
  }
  for (i64 b = t0; b < t1; b += BLOCK) {
    const i64 t = b + threadIdx.x;
    i64 sel = 0;
    if (t < t1) {
      sel = w.gt[t];
      if (exact) {  // this thread wrote eqb[t] above
        i64 take = rem - w.eqb[t];
        take = take < 0 ? 0 : (take > w.eq[t] ? w.eq[t] : take);
        sel += take;
      }
    }
    const u64 ex = block_scan((u64)sel, &tot, sh);
    if (t < t1) w.off[t] = (i64)(carry + ex);
    carry += tot;
  }
  const i64 total = (i64)carry < k ? (i64)carry : k;
  for (i64 p = total + threadIdx.x; p < k; p += BLOCK) {
    values[out + p] = 0.f;
    indices[out + p] = -1;
  }
}

// One block per tile: its selected entries at their output slots, in index order.
extern "C" __global__ void __launch_bounds__(BLOCK)
    dgc_seg_write(const float* __restrict__ x, const i64* __restrict__ table,
                  const i64* __restrict__ aux, i64* ws, int S, i64 T, float* values,
                  i64* indices) {
  grid_dep_launch();
  grid_dep_wait();
  const Ws w = carve(ws, S, T);
  __shared__ u64 sh[NWARP + 1];
  const int s = find_segment(aux, S, blockIdx.x);
  const i64* st = w.st + (i64)s * SW;
  const i64* row = table + (i64)s * COLS;
  const i64 k = row[C_K];
  i64 off = w.off[blockIdx.x];
  if (off >= k) return;
  const i64 start = row[C_START], n = row[C_N], out = row[C_OUT];
  const bool exact = st[W_EXACT] != 0;
  const int thr = (int)st[W_THR], V = (int)st[W_XPREFIX];
  const i64 rem = st[W_XREM];
  i64 eqseen = exact ? w.eqb[blockIdx.x] : 0;
  const i64 e0 = ((i64)blockIdx.x - aux[s]) * TILE;
  const i64 e1 = e0 + TILE < n ? e0 + TILE : n;
  u64 tot;
  for (i64 c0 = e0; c0 < e1; c0 += BLOCK) {
    const i64 e = c0 + threadIdx.x;
    const float v = e < e1 ? x[start + e] : 0.f;
    const int b = e < e1 ? abs_bits(v) : -1;
    bool sel;
    if (exact) {
      const bool eqf = b == V;
      const i64 rank = eqseen + (i64)block_scan(eqf, &tot, sh);
      sel = b > V || (eqf && rank < rem);
      eqseen += (i64)tot;
    } else {
      sel = b >= thr;
    }
    const i64 pos = off + (i64)block_scan(sel, &tot, sh);
    if (sel && pos < k) {
      values[out + pos] = v;
      indices[out + pos] = start + e;
    }
    off += (i64)tot;
    if (off >= k) break;
  }
}
