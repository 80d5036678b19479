// aiak::dgc_select: DGC's selection with a fixed amount of work and no host synchronisation.
// Importance = |x| as the int32 bit pattern of a non-negative fp32 (NaN ranks above +inf);
// -1 marks a lane past the end of x, below every threshold.
//
// Launch sequence (ops/_dgc_select_cuda.py), every step reading what the previous one left in
// the workspace; a serial step runs in the last block to arrive (ticket counter), so no kernel
// is a single thread walking the data:
//   sample_hist     gather |x| at the sample positions -> compact copy; histogram of bits
//                   30..20; last block: the digit holding the ks-th largest sample
//   sample_finish   histogram of bits 19..9 within that digit, the matching samples listed;
//                   last block: second digit, bits 8..0 over the short list -> thr0; the table
//                   of every reachable threshold (by state, sorted, sorted rank)
//   count           ONE read of x in tiles of TILE (float4 loads, 4 * ROWS elements per
//                   thread): per tile the count at every threshold (registers, one write per
//                   tile and threshold) and the tile's candidates: the entries at or above the
//                   lowest threshold whose tile count fits in `cap`, stored in index order;
//                   last block: totals -> the adaptation loop -> the plan. With resample and
//                   more than NFAST thresholds, dgc_count_fast counts the loop's first NFAST
//                   states only and flags the plan when the loop needs another; the full count
//                   follows, gated on that flag.
//   exact_hist x3   gated on a resample stop: radix select (11, 11, 9 bits) of the k-th largest
//                   |x|, reading a tile's candidates when they cover the stop threshold, else x
//   exact_counts    gated: per tile, #(> V) and #(== V)
//   write           per chunk of WCHUNK tiles: prefix of the selected counts of the tiles
//                   before it, scan within the chunk, one warp per tile writes its entries in
//                   index order (from the candidates when they cover, else from x); the tail is
//                   padded here.
// The workspace is zeroed once when allocated; every counter, histogram and total is reset by
// the last block that reads it, so a call leaves it clean for the next. Every launch after the
// first is a programmatic dependent launch (sm_90+, mta_common.cuh): its blocks start while the
// kernel before still runs and wait for its end, hiding most of the gap between two steps.

#include "mta_common.cuh"

#define TILE 8192  // elements per tile: BLOCK threads x ROWS float4
#define ROWS (TILE / (4 * BLOCK))
#define BLOCK 256
#define NWARP (BLOCK / WARP)
#define MAXT 232    // thresholds at most: (20 + 1) * (20 + 2) / 2 = 231
#define NREG 12     // thresholds kept in registers by dgc_count_reg
#define NFAST 4     // thresholds dgc_count_fast counts: the largest, the loop's first states
#define FAST_BLOCKS 4  // resident blocks per SM of dgc_count_fast (64 registers a thread)
#define HBINS 2048  // radix bins (11-bit digits)
#define WCHUNK 8    // tiles per block of dgc_write, <= 32 (one warp scans them): on 25M elements
                    // (H100) with 4096-element tiles the write took 7.9 us at 16 tiles, 10.6
                    // at 32, 10.0 at 8, 14.2 at 4; 8192-element tiles keep 16 x 4096 a block
#define FULL 0xffffffffu

// Plan words (int64).
#define P_SPREFIX 0  // sample select: first digit (bits 30..20)
#define P_SREM 1     // sample select: rank still to find within it
#define P_THR0 2
#define P_EXACT 8    // 1 after a resample stop (exact top-k)
#define P_LEVEL 9    // sorted position (first of its value) of the final / stop threshold
#define P_THR 10     // final threshold bits
#define P_COUNT 11   // #(importance >= final threshold)
#define P_XPREFIX 16 // exact select: prefix bits, then V
#define P_XMASK 17
#define P_XREM 18    // rank still to find; at the end the number of entries == V to take
#define P_TICKET 24  // last-block ticket
#define P_LISTN 25   // length of the sample list of dgc_sample_finish
#define P_FULL 26    // 1 when the adaptation loop needs a threshold the fast count skipped

// The workspace, carved from one buffer; ops/dgc_select.py computes the same byte layout.
struct Ws {
  i64* plan;
  u64* hist;
  u64* totals;
  u32* thr;
  u32* sorted;
  int* rank;
  u32* samples;
  u32* list;
  u32* tile_cnt;  // [threshold][tile]: #(importance >= sorted[j]) in the tile
  u32* info;      // per tile: (candidate level << 16) | candidate count
  u32* gt;
  u32* eq;
  float* cval;    // per tile, cap entries: candidate values, in index order
  u16* cidx;      // their index within the tile
};

__device__ __forceinline__ i64 r16(i64 b) { return (b + 15) & ~(i64)15; }

__device__ __forceinline__ Ws carve(i64* base, i64 m, i64 tiles, int nthr, int cap) {
  char* p = reinterpret_cast<char*>(base);
  Ws w;
  w.plan = reinterpret_cast<i64*>(p);
  p += 256;
  w.hist = reinterpret_cast<u64*>(p);
  p += HBINS * 8;
  w.totals = reinterpret_cast<u64*>(p);
  p += 256 * 8;
  w.thr = reinterpret_cast<u32*>(p);
  p += 256 * 4;
  w.sorted = reinterpret_cast<u32*>(p);
  p += 256 * 4;
  w.rank = reinterpret_cast<int*>(p);
  p += 256 * 4;
  w.samples = reinterpret_cast<u32*>(p);
  p += r16(m * 4);
  w.list = reinterpret_cast<u32*>(p);
  p += r16(m * 4);
  w.tile_cnt = reinterpret_cast<u32*>(p);
  p += r16((i64)nthr * tiles * 4);
  w.info = reinterpret_cast<u32*>(p);
  p += r16(tiles * 4);
  w.gt = reinterpret_cast<u32*>(p);
  p += r16(tiles * 4);
  w.eq = reinterpret_cast<u32*>(p);
  p += r16(tiles * 4);
  w.cval = reinterpret_cast<float*>(p);
  p += r16(tiles * (i64)cap * 4);
  w.cidx = reinterpret_cast<u16*>(p);
  return w;
}

__device__ __forceinline__ int abs_bits(float v) { return (int)(__float_as_uint(v) & 0x7fffffffu); }

// 4 consecutive elements from e (a multiple of 4): one 16-byte load when x is aligned and the
// four are in range; b = -1 past the end.
__device__ __forceinline__ void load4(const float* __restrict__ x, i64 e, i64 n, int vec,
                                      float (&v)[4], int (&b)[4]) {
  if (vec && e + 4 <= n) {
    const Pack<float, 4> pk = reinterpret_cast<const Pack<float, 4>*>(x)[e >> 2];
#pragma unroll
    for (int r = 0; r < 4; ++r) v[r] = pk.v[r];
  } else {
#pragma unroll
    for (int r = 0; r < 4; ++r) v[r] = e + r < n ? x[e + r] : 0.f;
  }
#pragma unroll
  for (int r = 0; r < 4; ++r) b[r] = e + r < n ? abs_bits(v[r]) : -1;
}

// Four 8-bit fields -> four 16-bit fields.
__device__ __forceinline__ u64 widen(u32 x) {
  return (u64)(x & 0xffu) | ((u64)(x & 0xff00u) << 8) | ((u64)(x & 0xff0000u) << 16) |
         ((u64)(x & 0xff000000u) << 24);
}

__device__ __forceinline__ int warp_excl(int v, int* total) {
  const int lane = threadIdx.x & 31;
  int incl = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(FULL, incl, o);
    if (lane >= o) incl += y;
  }
  *total = __shfl_sync(FULL, incl, 31);
  return incl - v;
}

// Exclusive scan of one u64 per thread over the block (blockDim.x = BLOCK); *total = the sum.
// Every thread must call it (it synchronises); `sh` holds NWARP words.
__device__ u64 block_scan(u64 v, u64* total, u64* sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  u64 incl = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const u64 y = __shfl_up_sync(FULL, incl, o);
    if (lane >= o) incl += y;
  }
  if (lane == 31) sh[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    u64 s = lane < NWARP ? sh[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const u64 y = __shfl_up_sync(FULL, s, o);
      if (lane >= o) s += y;
    }
    if (lane < NWARP) sh[lane] = s;  // inclusive over warps
  }
  __syncthreads();
  const u64 ex = incl - v + (warp ? sh[warp - 1] : 0);
  *total = sh[NWARP - 1];
  __syncthreads();
  return ex;
}

// True in the block that finishes last (mta_common.cuh's ticket); every thread calls it after
// its own global writes.
__device__ __forceinline__ bool last_block(i64* plan) {
  return last_to_arrive(reinterpret_cast<u64*>(plan + P_TICKET), gridDim.x);
}

// Radix step in one block: thread t holds bins [t*PER, t*PER + PER) in c[]. Finds the digit d
// with cnt(bins > d) < rem <= cnt(bins >= d); out[0] = d, out[1] = rem - cnt(bins > d).
template <int PER>
__device__ void pick_digit(const u64 (&c)[PER], i64 rem, i64* out, u64* sh) {
  u64 s = 0;
#pragma unroll
  for (int j = 0; j < PER; ++j) s += c[j];
  if (threadIdx.x == 0) {  // defined even if the counts were inconsistent
    out[0] = 0;
    out[1] = rem;
  }
  u64 tot;
  const u64 ex = block_scan(s, &tot, sh);
  const i64 above = (i64)(tot - ex - s);  // bins of the threads after this one
  if (above < rem && above + (i64)s >= rem) {
    i64 cum = above;
    bool done = false;
#pragma unroll
    for (int j = PER - 1; j >= 0; --j) {
      if (!done && cum + (i64)c[j] >= rem) {
        out[0] = (i64)threadIdx.x * PER + j;
        out[1] = rem - cum;
        done = true;
      }
      if (!done) cum += (i64)c[j];
    }
  }
  __syncthreads();
}

// The last block's pick over the global histogram (all HBINS bins), which it zeroes.
__device__ void pick_global(u64* hist, i64 rem, i64* out, u64* sh) {
  constexpr int PER = HBINS / BLOCK;
  const volatile u64* vh = hist;
  u64 c[PER];
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    c[j] = vh[threadIdx.x * PER + j];
    hist[threadIdx.x * PER + j] = 0;
  }
  pick_digit<PER>(c, rem, out, sh);
}

__device__ void flush_hist(const u32* h, u64* hist) {
  __syncthreads();
  for (int j = threadIdx.x; j < HBINS; j += BLOCK)
    if (h[j]) atomicAdd(&hist[j], (u64)h[j]);
}

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

// ---------------------------------------------------------------------------------------------
// thr0: the ks-th largest sample, by three radix digits (11, 11, 9 bits)
// ---------------------------------------------------------------------------------------------

extern "C" __global__ void __launch_bounds__(BLOCK)
    dgc_sample_hist(const float* __restrict__ x, const i64* __restrict__ sidx, i64* base, i64 n,
                    i64 m, i64 tiles, int nthr, int cap, i64 start, i64 stride, i64 ks) {
  grid_dep_launch();  // the next kernel's blocks may start now; they wait in grid_dep_wait
  grid_dep_wait();    // the kernel before has ended: its writes are visible from here on
  const Ws w = carve(base, m, tiles, nthr, cap);
  __shared__ u32 h[HBINS];
  __shared__ u64 sh[NWARP];
  __shared__ i64 out[2];
  for (int j = threadIdx.x; j < HBINS; j += BLOCK) h[j] = 0;
  __syncthreads();
  const i64 step = (i64)gridDim.x * BLOCK;
  for (i64 i0 = (i64)blockIdx.x * BLOCK + threadIdx.x; i0 < m; i0 += 4 * step) {
    int b[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {  // four independent gathers in flight
      const i64 i = i0 + r * step;
      b[r] = i < m ? abs_bits(__ldcs(x + (sidx ? sidx[i] : start + i * stride))) : -1;
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      if (b[r] >= 0) {
        w.samples[i0 + r * step] = (u32)b[r];
        atomicAdd(&h[b[r] >> 20], 1u);
      }
    }
  }
  flush_hist(h, w.hist);
  if (!last_block(w.plan)) return;
  pick_global(w.hist, ks, out, sh);
  if (threadIdx.x == 0) {
    w.plan[P_SPREFIX] = out[0];
    w.plan[P_SREM] = out[1];
  }
}

extern "C" __global__ void __launch_bounds__(BLOCK)
    dgc_sample_finish(i64* base, i64 n, i64 m, i64 tiles, int nthr, int cap, double upper,
                      double lower, int iters, int resample) {
  grid_dep_launch();  // the next kernel's blocks may start now; they wait in grid_dep_wait
  grid_dep_wait();    // the kernel before has ended: its writes are visible from here on
  const Ws w = carve(base, m, tiles, nthr, cap);
  __shared__ u32 h[HBINS];
  __shared__ u64 sh[NWARP];
  __shared__ i64 out[2];
  __shared__ u32 thr[MAXT], sorted[MAXT];
  const int d1 = (int)w.plan[P_SPREFIX];
  const i64 rem1 = w.plan[P_SREM];
  for (int j = threadIdx.x; j < HBINS; j += BLOCK) h[j] = 0;
  __syncthreads();
  const int lane = threadIdx.x & 31;
  u64* listn = reinterpret_cast<u64*>(w.plan + P_LISTN);
  for (i64 i0 = (i64)blockIdx.x * BLOCK; i0 < m; i0 += (i64)gridDim.x * BLOCK) {
    const i64 i = i0 + threadIdx.x;  // i0 is the same for the whole block: full warps below
    const int b = i < m ? (int)w.samples[i] : -1;
    const bool match = b >= 0 && (b >> 20) == d1;
    if (match) atomicAdd(&h[(b >> 9) & (HBINS - 1)], 1u);
    const u32 mask = __ballot_sync(FULL, match);
    if (mask) {
      const int leader = __ffs(mask) - 1;
      u64 pos = 0;
      if (lane == leader) pos = atomicAdd(listn, (u64)__popc(mask));
      pos = __shfl_sync(FULL, pos, leader);
      if (match) w.list[pos + __popc(mask & ((1u << lane) - 1u))] = (u32)b;
    }
  }
  flush_hist(h, w.hist);
  if (!last_block(w.plan)) return;
  pick_global(w.hist, rem1, out, sh);
  const int d2 = (int)out[0];
  const i64 rem2 = out[1];
  const int prefix = (d1 << 11) | d2;
  const i64 len = (i64)*reinterpret_cast<volatile u64*>(listn);
  const volatile u32* vlist = w.list;
  for (int j = threadIdx.x; j < 512; j += BLOCK) h[j] = 0;
  __syncthreads();
  for (i64 i = threadIdx.x; i < len; i += BLOCK) {
    const int b = (int)vlist[i];
    if ((b >> 9) == prefix) atomicAdd(&h[b & 511], 1u);
  }
  __syncthreads();
  u64 c[2] = {h[threadIdx.x * 2], h[threadIdx.x * 2 + 1]};
  pick_digit<2>(c, rem2, out, sh);
  const u32 thr0 = ((u32)prefix << 9) | (u32)out[0];
  // every threshold the loop can reach, its sorted order and sorted rank
  for (int s = threadIdx.x; s < nthr; s += BLOCK)
    thr[s] = state_bits(thr0, s, upper, lower, iters, resample);
  __syncthreads();
  for (int s = threadIdx.x; s < nthr; s += BLOCK) {
    int less = 0, before = 0;
    for (int t = 0; t < nthr; ++t) {
      less += thr[t] < thr[s];
      before += (t < s) & (thr[t] == thr[s]);
    }
    sorted[less + before] = thr[s];
    w.thr[s] = thr[s];
    w.rank[s] = less;
  }
  __syncthreads();
  for (int s = threadIdx.x; s < nthr; s += BLOCK) w.sorted[s] = sorted[s];
  if (threadIdx.x == 0) {
    w.plan[P_THR0] = thr0;
    *listn = 0;
  }
}

// ---------------------------------------------------------------------------------------------
// The counting pass: one read of x, every threshold counted, the candidates kept, the decision
// ---------------------------------------------------------------------------------------------

// A tile's elements by warp: warp w owns the TILE / NWARP contiguous elements from w * TILE /
// NWARP, row q of it (a float4 per lane) starting at (q * 32) * 4. A warp's candidates are then
// contiguous in index order, and where they start in the tile is the candidates of the warps
// before it: one number a warp, so no block-wide scan of positions.
__device__ __forceinline__ i64 tile_elem(int q) {
  return ((i64)((threadIdx.x >> 5) * ROWS + q) * 32 + (threadIdx.x & 31)) * 4;
}

// Bit e: element e of this thread is at or above T (4 * ROWS <= 32 bits).
__device__ __forceinline__ u32 select_bits(const int (&b)[4 * ROWS], int T) {
  u32 sel = 0;
#pragma unroll
  for (int e = 0; e < 4 * ROWS; ++e) sel |= (u32)(b[e] >= T) << e;
  return sel;
}

// The warp's selected entries (`sel`) stored at cv/ci from position `before`, in index order:
// row q, then lane, then the float4's element. Per row a scan over the warp of 8-bit fields (a
// warp's row holds at most 128 elements), rows in groups of four; the rows' totals in 16-bit
// fields (a tile holds at most cap <= 1024 candidates), so no field carries.
__device__ __forceinline__ void write_candidates(const float* __restrict__ x, i64 lo, u32 sel,
                                                 u32 before, float* cv, u16* ci) {
  const int lane = threadIdx.x & 31;
  if (__ballot_sync(FULL, sel != 0) == 0) return;
  constexpr int G = ROWS / 4;
  static_assert(G == 1 || G == 2, "4 or 8 rows a tile");
  constexpr u64 ONES = 1ull + (1ull << 16) + (1ull << 32) + (1ull << 48);
  u32 mine[G], incl[G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    mine[g] = 0;
#pragma unroll
    for (int q = 0; q < 4; ++q)
      mine[g] |= (u32)__popc(sel & (0xfu << (16 * g + 4 * q))) << (8 * q);
    incl[g] = mine[g];
  }
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const u32 y = __shfl_up_sync(FULL, incl[g], o);
      if (lane >= o) incl[g] += y;
    }
  }
  // field q of base[g]: where this lane's entries of row 4g + q start; all * (ONES - 1) puts in
  // field q the rows before it in the group, carry the groups before and the warps before
  u64 base[G], carry = before;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const u64 all = widen(__shfl_sync(FULL, incl[g], 31));
    base[g] = carry * ONES + all * (ONES - 1) + widen(incl[g] - mine[g]);
    carry += (all * ONES) >> 48;  // the top field sums the four
  }
  // a loop over the set bits only: a tile's candidates (at most cap: ~64 of 8192 at ratio
  // 0.001) leave most threads none, and an unrolled store predicated off still issues; the
  // value is read again from x (signs are not kept in registers)
  for (u32 rest = sel; rest; rest &= rest - 1) {
    const int e = __ffs(rest) - 1, q = e >> 2;
    const u64 bg = q >> 2 ? base[G - 1] : base[0];  // a select: an indexed read spills
    const u32 pos = (u32)((bg >> (16 * (q & 3))) & 0xffffu) +
                    __popc(sel & ((1u << e) - 1u) & (0xfu << (4 * q)));
    const int idx = (int)tile_elem(q) + (e & 3);
    cv[pos] = x[lo + idx];
    ci[pos] = (u16)idx;
  }
}

// REG: thresholds in registers (NC of them, the largest when NC < nthr), else by binary search
// in shared memory. With NC < nthr (dgc_count_fast, resample mode only) the sorted positions
// below j0 = nthr - NC are not counted: their tile counts and totals are not written, the
// candidate level is chosen among the counted ones, and the loop flags P_FULL when it needs
// one of the others (then the gated full count redoes everything).
template <bool REG, int NC>
__device__ void count_body(const float* __restrict__ x, i64* base, i64 n, i64 m, i64 tiles,
                           int nthr, int cap, int vec, i64 k, double upper, double lower, int iters,
                           int resample) {
  const Ws w = carve(base, m, tiles, nthr, cap);
  const int j0 = REG && NC < nthr ? nthr - NC : 0;  // lowest counted sorted position
  __shared__ int s_sorted[MAXT];
  __shared__ u32 s_hist[MAXT + 1];
  __shared__ u32 s_warp[2][NWARP][NC];  // by tile parity: one barrier a tile (REG)
  __shared__ u32 s_cnt[MAXT];
  __shared__ u32 s_wc[NWARP];  // search path: each warp's candidates
  __shared__ u64 s_tot[MAXT];
  __shared__ u64 sh[NWARP];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int j = tid; j < nthr; j += BLOCK) {
    s_sorted[j] = (int)w.sorted[j];
    s_tot[j] = 0;
  }
  __syncthreads();
  int treg[NC];
#pragma unroll
  for (int j = 0; j < NC; ++j) treg[j] = REG && j0 + j < nthr ? s_sorted[j0 + j] : 0x7fffffff;

  // Where the fast count's time goes (H100, 25M elements, research/profile_dgc_floor.py, x
  // read with the streaming hint): one read of x alone takes 33.3 us, with the four counts per
  // element 33.8, with the counts written per warp and tile 34.2; the candidates in index order
  // bring it to 36.4 and the totals, ticket and loop of the last block to 38.5-39.4 (43.1 with
  // plain loads and the tile's rows spread over the block: a block-wide scan of positions, four
  // barriers a tile). The candidates cost however they are written: storing only their
  // indices (the readers then load the values from x) took the count to 40.4 us and the write
  // kernel from 7.0 to 10.4; taking the values from registers, row by row with the signs kept,
  // to 46.7 (both with plain loads). Per tile here: one block barrier (the warps' counts), then
  // each warp works out the tile's counts, the candidate level and where its candidates start
  // by itself. A whole tile loads without bounds checks and the per-tile counts are reduced two
  // to a register.
  // Whole tiles read x with the streaming hint (ld.global.cs, evict first), and so do the sample
  // gathers: x's 100 MB then pass through L2 without pushing out the workspace, candidates and
  // code. The count takes 38.5-39.4 us against 42.0-43.0 with plain loads, the write (which
  // reads the candidates) 5.9-6.2 against 6.9-7.0, the sample gathers 11.9-12.0 against 12.4.
  // Hinting the other reads of x too (the partial tile, the write, the exact kernels) left the
  // count at 41.2.
  int parity = 0;
  for (i64 t = blockIdx.x; t < tiles; t += gridDim.x, parity ^= 1) {
    const i64 lo = t * TILE;
    int b[4 * ROWS];
    if (vec && lo + TILE <= n) {
#pragma unroll
      for (int q = 0; q < ROWS; ++q) {
        const float4 f = __ldcs(reinterpret_cast<const float4*>(x) + ((lo + tile_elem(q)) >> 2));
        b[4 * q] = abs_bits(f.x);
        b[4 * q + 1] = abs_bits(f.y);
        b[4 * q + 2] = abs_bits(f.z);
        b[4 * q + 3] = abs_bits(f.w);
      }
    } else {
#pragma unroll
      for (int q = 0; q < ROWS; ++q) {
        float v4[4];
        int b4[4];
        load4(x, lo + tile_elem(q), n, vec, v4, b4);
#pragma unroll
        for (int r = 0; r < 4; ++r) b[4 * q + r] = b4[r];
      }
    }
    float* cv = w.cval + t * cap;
    u16* ci = w.cidx + t * cap;
    if (REG) {
      static_assert(NC % 2 == 0, "counts are reduced in pairs");
      int c[NC];
#pragma unroll
      for (int j = 0; j < NC; ++j) c[j] = 0;
      // #(b < t) from the sign of b - t, which cannot overflow (b >= -1, 0 <= t < 2^31): a
      // subtract and a shift-add per compare, where a compare-and-count compiles to three
#pragma unroll
      for (int e = 0; e < 4 * ROWS; ++e) {
#pragma unroll
        for (int j = 0; j < NC; ++j) c[j] += (int)(((u32)b[e] - (u32)treg[j]) >> 31);
      }
      // a warp counts at most 32 * 4 * ROWS <= 1024 per threshold: two counts share a word
#pragma unroll
      for (int j = 0; j < NC; j += 2) {
        u32 pair = (u32)(4 * ROWS - c[j]) | ((u32)(4 * ROWS - c[j + 1]) << 16);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) pair += __shfl_xor_sync(FULL, pair, o);
        c[j] = (int)(pair & 0xffffu);
        c[j + 1] = (int)(pair >> 16);
      }
      if (lane == 0) {
#pragma unroll
        for (int j = 0; j < NC; ++j) s_warp[parity][warp][j] = (u32)c[j];
      }
      // The only barrier of the tile. The buffer it guards is written again two tiles later,
      // after the next tile's barrier, which every warp reaches only once done with this one.
      __syncthreads();
      // every warp: the tile's count at counted position `lane` (at most 21 of them), the
      // candidate level (the lowest counted position whose count fits in cap: counts fall as
      // the position rises) by one ballot, and the candidates of the warps before it
      const bool counted = lane >= j0 && lane < nthr;
      u32 s = 0;
      if (counted) {
#pragma unroll
        for (int v = 0; v < NWARP; ++v) s += s_warp[parity][v][lane - j0];
      }
      const u32 fits = __ballot_sync(FULL, counted && s <= (u32)cap);
      const int lv = fits ? __ffs(fits) - 1 : nthr;
      const u32 at_lv = __shfl_sync(FULL, s, lv & 31);
      const u32 ncand = lv < nthr ? at_lv : 0;
      if (warp == 0 && counted) {
        w.tile_cnt[(i64)lane * tiles + t] = s;
        s_tot[lane] += s;
      }
      if (tid == 0) w.info[t] = ((u32)lv << 16) | ncand;
      if (ncand > 0) {
        u32 before = 0;
        for (int v = 0; v < warp; ++v) before += s_warp[parity][v][lv - j0];
        write_candidates(x, lo, select_bits(b, s_sorted[lv]), before, cv, ci);
      }
    } else {
      for (int j = tid; j <= nthr; j += BLOCK) s_hist[j] = 0;
      __syncthreads();
      const int lowest = s_sorted[0];
#pragma unroll
      for (int e = 0; e < 4 * ROWS; ++e) {
        if (b[e] >= lowest) {
          int l = 1, hi = nthr;  // the number of thresholds <= b, in [1, nthr]
          while (l < hi) {
            const int mid = (l + hi) >> 1;
            if (s_sorted[mid] <= b[e]) l = mid + 1;
            else hi = mid;
          }
          atomicAdd(&s_hist[l], 1u);
        }
      }
      __syncthreads();
      // #(b >= sorted[j]) = sum of the bins l > j: a scan from the top bin down
      const u64 hv = tid < nthr ? s_hist[nthr - tid] : 0;
      u64 tot;
      const u64 ex = block_scan(hv, &tot, sh);
      if (tid < nthr) s_cnt[nthr - 1 - tid] = (u32)(ex + hv);
      __syncthreads();
      // candidate level: the lowest threshold whose tile count fits in cap (counts fall as j
      // rises)
      int lv = 0, hi = nthr;
      while (lv < hi) {
        const int mid = (lv + hi) >> 1;
        if (s_cnt[mid] <= (u32)cap) hi = mid;
        else lv = mid + 1;
      }
      const u32 ncand = lv < nthr ? s_cnt[lv] : 0;
      if (tid < nthr) {
        w.tile_cnt[(i64)tid * tiles + t] = s_cnt[tid];
        s_tot[tid] += s_cnt[tid];
      }
      if (tid == 0) w.info[t] = ((u32)lv << 16) | ncand;
      if (ncand > 0) {  // the same in every thread: the barrier below is reached by all
        const u32 sel = select_bits(b, s_sorted[lv]);
        u32 wc = __popc(sel);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) wc += __shfl_xor_sync(FULL, wc, o);
        if (lane == 0) s_wc[warp] = wc;
        __syncthreads();
        u32 before = 0;
        for (int v = 0; v < warp; ++v) before += s_wc[v];
        write_candidates(x, lo, sel, before, cv, ci);
      }
      __syncthreads();  // s_hist, s_cnt and s_wc are rewritten by the next tile
    }
  }
  for (int j = tid; j < nthr; j += BLOCK)
    if (s_tot[j]) atomicAdd(&w.totals[j], s_tot[j]);
  if (!last_block(w.plan)) return;
  // the adaptation loop on the totals: one thread's dependent steps, 1.8 us of the count; its
  // tables in shared memory, where a read of global memory per step cost 0.4 us more
  __shared__ int s_rank[MAXT];
  __shared__ u32 s_thr[MAXT];
  const volatile u64* vt = w.totals;
  for (int j = tid; j < nthr; j += BLOCK) {
    s_tot[j] = vt[j];
    w.totals[j] = 0;
    s_rank[j] = w.rank[j];
    s_thr[j] = w.thr[j];
  }
  __syncthreads();
  if (tid != 0) return;
  int a = 0, bb = 0, exact = 0;
  if (s_rank[0] < j0) {  // thr0 itself not counted (ties below it): the full count decides
    w.plan[P_FULL] = 1;
    return;
  }
  i64 c = (i64)s_tot[s_rank[0]];
  for (int it = 0; it < iters; ++it) {
    if ((double)c > upper * (double)k) {
      if (resample) {
        exact = 1;
        break;
      }
      ++a;
    } else if ((double)c < lower * (double)k) {
      ++bb;
    } else {
      break;
    }
    const int r = s_rank[state_index(a, bb, iters, resample)];
    if (r < j0) {  // a threshold the fast count skipped: the gated full count redoes it all
      w.plan[P_FULL] = 1;
      return;
    }
    c = (i64)s_tot[r];
  }
  w.plan[P_FULL] = 0;
  const int s = state_index(a, bb, iters, resample);
  w.plan[P_EXACT] = exact;
  w.plan[P_LEVEL] = s_rank[s];
  w.plan[P_THR] = s_thr[s];
  w.plan[P_COUNT] = (i64)s_tot[s_rank[s]];
  w.plan[P_XPREFIX] = 0;
  w.plan[P_XMASK] = 0;
  w.plan[P_XREM] = k;
}

// nthr <= NREG: thresholds in registers, 12 compares per element. `gate`: return at once
// unless the fast count flagged P_FULL (the full count after dgc_count_fast).
extern "C" __global__ void __launch_bounds__(BLOCK, 3)
    dgc_count_reg(const float* __restrict__ x, i64* base, i64 n, i64 m, i64 tiles, int nthr,
                  int cap, int vec, i64 k, double upper, double lower, int iters, int resample,
                  int gate) {
  grid_dep_launch();  // the next kernel's blocks may start now; they wait in grid_dep_wait
  grid_dep_wait();    // the kernel before has ended: its writes are visible from here on
  if (gate && carve(base, m, tiles, nthr, cap).plan[P_FULL] == 0) return;
  count_body<true, NREG>(x, base, n, m, tiles, nthr, cap, vec, k, upper, lower, iters, resample);
}

// Resample mode, nthr > NFAST: the loop's first NFAST states (the largest thresholds) only, 4
// compares per element instead of 12. The loop almost always stops there: thr0 comes from a
// sample, and leaving the fourth state means its estimate was 1/lower^3 (2x at 0.8) too high.
extern "C" __global__ void __launch_bounds__(BLOCK, FAST_BLOCKS)
    dgc_count_fast(const float* __restrict__ x, i64* base, i64 n, i64 m, i64 tiles, int nthr,
                   int cap, int vec, i64 k, double upper, double lower, int iters, int resample) {
  grid_dep_launch();  // the next kernel's blocks may start now; they wait in grid_dep_wait
  grid_dep_wait();    // the kernel before has ended: its writes are visible from here on
  count_body<true, NFAST>(x, base, n, m, tiles, nthr, cap, vec, k, upper, lower, iters, resample);
}

// More thresholds (no resample, or more iterations): binary search in shared memory.
extern "C" __global__ void __launch_bounds__(BLOCK, 3)
    dgc_count_search(const float* __restrict__ x, i64* base, i64 n, i64 m, i64 tiles, int nthr,
                     int cap, int vec, i64 k, double upper, double lower, int iters, int resample,
                     int gate) {
  grid_dep_launch();  // the next kernel's blocks may start now; they wait in grid_dep_wait
  grid_dep_wait();    // the kernel before has ended: its writes are visible from here on
  if (gate && carve(base, m, tiles, nthr, cap).plan[P_FULL] == 0) return;
  count_body<false, NREG>(x, base, n, m, tiles, nthr, cap, vec, k, upper, lower, iters,
                          resample);
}

// ---------------------------------------------------------------------------------------------
// Exact top-k after a resample stop (every kernel returns at once otherwise)
// ---------------------------------------------------------------------------------------------

// A tile's candidates hold every entry >= the stop threshold when their level is at or below it.
__device__ __forceinline__ bool covered(u32 info, int level) { return (int)(info >> 16) <= level; }

extern "C" __global__ void __launch_bounds__(BLOCK)
    dgc_exact_hist(const float* __restrict__ x, i64* base, i64 n, i64 m, i64 tiles, int nthr,
                   int cap, int vec, int pass) {
  grid_dep_launch();  // the next kernel's blocks may start now; they wait in grid_dep_wait
  grid_dep_wait();    // the kernel before has ended: its writes are visible from here on
  const Ws w = carve(base, m, tiles, nthr, cap);
  if (w.plan[P_EXACT] == 0) return;
  __shared__ u32 h[HBINS];
  __shared__ u64 sh[NWARP];
  __shared__ i64 out[2];
  const int shift = pass == 0 ? 20 : (pass == 1 ? 9 : 0);
  const int dmask = pass == 2 ? 511 : 2047;
  const int prefix = (int)w.plan[P_XPREFIX], mask = (int)w.plan[P_XMASK];
  const int level = (int)w.plan[P_LEVEL];
  for (int j = threadIdx.x; j < HBINS; j += BLOCK) h[j] = 0;
  __syncthreads();
  // Entries below the stop threshold that a covering tile did not keep are all below V: the
  // counts of the digits at and above V's are exact.
  for (i64 t = blockIdx.x; t < tiles; t += gridDim.x) {
    const u32 info = w.info[t];
    if (covered(info, level)) {
      const int nc = (int)(info & 0xffffu);
      for (int i = threadIdx.x; i < nc; i += BLOCK) {
        const int b = abs_bits(w.cval[t * cap + i]);
        if ((b & mask) == prefix) atomicAdd(&h[(b >> shift) & dmask], 1u);
      }
    } else {
#pragma unroll
      for (int q = 0; q < ROWS; ++q) {
        float v4[4];
        int b4[4];
        load4(x, t * TILE + ((i64)q * BLOCK + threadIdx.x) * 4, n, vec, v4, b4);
#pragma unroll
        for (int r = 0; r < 4; ++r)
          if (b4[r] >= 0 && (b4[r] & mask) == prefix) atomicAdd(&h[(b4[r] >> shift) & dmask], 1u);
      }
    }
  }
  flush_hist(h, w.hist);
  if (!last_block(w.plan)) return;
  pick_global(w.hist, w.plan[P_XREM], out, sh);
  if (threadIdx.x == 0) {
    w.plan[P_XPREFIX] = prefix | ((int)out[0] << shift);
    w.plan[P_XMASK] = mask | (dmask << shift);
    w.plan[P_XREM] = out[1];
  }
}

extern "C" __global__ void __launch_bounds__(BLOCK)
    dgc_exact_counts(const float* __restrict__ x, i64* base, i64 n, i64 m, i64 tiles, int nthr,
                     int cap, int vec) {
  grid_dep_launch();  // the next kernel's blocks may start now; they wait in grid_dep_wait
  grid_dep_wait();    // the kernel before has ended: its writes are visible from here on
  const Ws w = carve(base, m, tiles, nthr, cap);
  if (w.plan[P_EXACT] == 0) return;
  __shared__ u64 sh[NWARP];
  const int V = (int)w.plan[P_XPREFIX];
  const int level = (int)w.plan[P_LEVEL];
  for (i64 t = blockIdx.x; t < tiles; t += gridDim.x) {
    const u32 info = w.info[t];
    u64 ge = 0;  // (#> V) | (#== V) << 32
    if (covered(info, level)) {
      const int nc = (int)(info & 0xffffu);
      for (int i = threadIdx.x; i < nc; i += BLOCK) {
        const int b = abs_bits(w.cval[t * cap + i]);
        ge += (u64)(b > V) | ((u64)(b == V) << 32);
      }
    } else {
#pragma unroll
      for (int q = 0; q < ROWS; ++q) {
        float v4[4];
        int b4[4];
        load4(x, t * TILE + ((i64)q * BLOCK + threadIdx.x) * 4, n, vec, v4, b4);
#pragma unroll
        for (int r = 0; r < 4; ++r) ge += (u64)(b4[r] > V) | ((u64)(b4[r] == V) << 32);
      }
    }
    u64 tot;
    block_scan(ge, &tot, sh);
    if (threadIdx.x == 0) {
      w.gt[t] = (u32)tot;
      w.eq[t] = (u32)(tot >> 32);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The ordered write
// ---------------------------------------------------------------------------------------------

// One warp, R entries per lane in lane-major index order: the selected ones go to
// [off, off + count) while below k. eqseen counts the entries == V met before (exact mode).
template <int R>
__device__ __forceinline__ void emit(const int (&b)[R], const float (&v)[R], const i64 (&idx)[R],
                                     int exact, int thr, int V, i64 room, i64 k, i64& off,
                                     i64& eqseen, float* __restrict__ values,
                                     i64* __restrict__ indices) {
  int neq = 0;
#pragma unroll
  for (int r = 0; r < R; ++r) neq += exact && b[r] == V;
  int eqt;
  const int eqx = warp_excl(neq, &eqt);
  i64 er = eqseen + eqx;
  bool sel[R];
  int ns = 0;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const bool isq = exact && b[r] == V;
    sel[r] = exact ? (b[r] > V || (isq && er < room)) : b[r] >= thr;
    er += isq;
    ns += sel[r];
  }
  int st;
  i64 pos = off + warp_excl(ns, &st);
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (sel[r]) {
      if (pos < k) {
        values[pos] = v[r];
        indices[pos] = idx[r];
      }
      ++pos;
    }
  }
  off += st;
  eqseen += eqt;
}

extern "C" __global__ void __launch_bounds__(BLOCK)
    dgc_write(const float* __restrict__ x, i64* base, i64 n, i64 m, i64 tiles, int nthr, int cap,
              int vec, i64 k, float* __restrict__ values, i64* __restrict__ indices) {
  grid_dep_launch();  // the next kernel's blocks may start now; they wait in grid_dep_wait
  grid_dep_wait();    // the kernel before has ended: its writes are visible from here on
  const Ws w = carve(base, m, tiles, nthr, cap);
  __shared__ u64 sh[NWARP];
  __shared__ i64 s_off[WCHUNK], s_eqb[WCHUNK];
  __shared__ u32 s_sel[WCHUNK];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int exact = (int)w.plan[P_EXACT];
  const int level = (int)w.plan[P_LEVEL];
  const int thr = (int)w.plan[P_THR];
  const int V = (int)w.plan[P_XPREFIX];
  const i64 room = w.plan[P_XREM];
  const i64 count = w.plan[P_COUNT];
  const u32* sel_cnt = w.tile_cnt + (i64)level * tiles;  // non-exact: per tile #(>= thr)
  const i64 t0 = (i64)blockIdx.x * WCHUNK;
  const i64 t1 = t0 + WCHUNK < tiles ? t0 + WCHUNK : tiles;
  // the tiles before this chunk: selected entries (non-exact) or #> V and #== V (exact)
  // (4 independent loads in flight per thread: on 25M elements the last chunk's block reads
  // ~24 words a thread, each a whole L2 latency when every add waits for its load)
  u64 a1 = 0, a2 = 0;
  const u32* c1 = exact ? w.gt : sel_cnt;
  for (i64 i0 = tid; i0 < t0; i0 += 4 * BLOCK) {
    u32 g[4], e[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const i64 i = i0 + (i64)u * BLOCK;
      g[u] = i < t0 ? c1[i] : 0u;
      e[u] = exact && i < t0 ? w.eq[i] : 0u;
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      a1 += g[u];
      a2 += e[u];
    }
  }
  u64 g_before, e_before;
  block_scan(a1, &g_before, sh);
  block_scan(a2, &e_before, sh);
  if (warp == 0) {
    const i64 t = t0 + lane;
    int g = 0, e = 0;
    if (t < t1) {
      if (exact) {
        g = (int)w.gt[t];
        e = (int)w.eq[t];
      } else {
        g = (int)sel_cnt[t];
      }
    }
    int gt_tot, eq_tot;
    const int gx = warp_excl(g, &gt_tot);
    const int ex = warp_excl(e, &eq_tot);
    const i64 gb = (i64)g_before + gx, eb = (i64)e_before + ex;
    i64 off = gb, sel = g;
    if (exact) {
      off = gb + (eb < room ? eb : room);
      i64 take = room - eb;
      take = take < 0 ? 0 : (take > e ? e : take);
      sel = g + take;
    }
    if (lane < WCHUNK) {
      s_off[lane] = off;
      s_eqb[lane] = eb;
      s_sel[lane] = (u32)sel;
    }
  }
  __syncthreads();
  for (int i = warp; i < t1 - t0; i += NWARP) {
    const i64 t = t0 + i;
    i64 off = s_off[i];
    if (off >= k || s_sel[i] == 0) continue;
    i64 eqseen = s_eqb[i];
    const u32 info = w.info[t];
    if (covered(info, level)) {
      const int nc = (int)(info & 0xffffu);
      for (int g0 = 0; g0 < nc && off < k; g0 += WARP) {
        const int j = g0 + lane;
        int b[1] = {-1};
        float v[1] = {0.f};
        i64 idx[1] = {0};
        if (j < nc) {
          v[0] = w.cval[t * cap + j];
          b[0] = abs_bits(v[0]);
          idx[0] = t * TILE + w.cidx[t * cap + j];
        }
        emit<1>(b, v, idx, exact, thr, V, room, k, off, eqseen, values, indices);
      }
    } else {
      for (int it = 0; it < TILE / (4 * WARP) && off < k; ++it) {
        const i64 e0 = t * TILE + (i64)it * 4 * WARP + lane * 4;
        float v[4];
        int b[4];
        load4(x, e0, n, vec, v, b);
        const i64 idx[4] = {e0, e0 + 1, e0 + 2, e0 + 3};
        emit<4>(b, v, idx, exact, thr, V, room, k, off, eqseen, values, indices);
      }
    }
  }
  // padding: (-1, 0) after the selected entries
  const i64 total = exact ? k : (count < k ? count : k);
  for (i64 p = total + (i64)blockIdx.x * BLOCK + tid; p < k; p += (i64)gridDim.x * BLOCK) {
    values[p] = 0.f;
    indices[p] = -1;
  }
}
