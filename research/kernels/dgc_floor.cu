// Lower bounds for the stages of aiak::dgc_select (research/profile_dgc_floor.py): each kernel
// does one stage's unavoidable work and nothing else, on the same data and geometry.
//   floor_read        one read of x (float4, 8 loads a thread in flight, 8192-element tiles)
//   floor_count       the read + 4 threshold counts per element, reduced once per block
//   floor_count_warp  the read + 4 counts + the candidate bits, written per warp and tile
//                     (no block barrier): what a count without block-level steps costs
//   floor_count_cand  + the tile's candidates in index order (one block barrier a tile)
//   floor_gather      the strided sample gather alone (4 gathers a thread in flight)
//   floor_sample      the gather + compact copy + 2048-bin histogram flushed to global
//   floor_empty       a block that returns at once (a gated-off launch)
// x is read with the streaming hint (evict first), as dgc_select.cu reads it.
typedef long long i64;
typedef unsigned int u32;
typedef unsigned long long u64;
#define TILE 8192
#define BLOCK 256
#define ROWS (TILE / (4 * BLOCK))
#define FULL 0xffffffffu

__device__ __forceinline__ int abs_bits(float v) { return (int)(__float_as_uint(v) & 0x7fffffffu); }

__device__ __forceinline__ u32 warp_sum(u32 v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
  return v;
}

// Tile t's |x| bits, 4 * ROWS a thread; a warp's rows are contiguous: warp w holds the elements
// [w * 4 * 32 * ROWS, (w + 1) * 4 * 32 * ROWS) of the tile.
__device__ __forceinline__ void load_tile(const float* __restrict__ x, i64 t, int (&b)[4 * ROWS]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int q = 0; q < ROWS; ++q) {
    const float4 f =
        __ldcs(reinterpret_cast<const float4*>(x) + t * (TILE / 4) + (warp * ROWS + q) * 32 + lane);
    b[4 * q] = abs_bits(f.x);
    b[4 * q + 1] = abs_bits(f.y);
    b[4 * q + 2] = abs_bits(f.z);
    b[4 * q + 3] = abs_bits(f.w);
  }
}

// n a multiple of TILE (the script sizes x so): whole tiles, no bounds checks.
template <int MODE>  // 0: read, 1: count, 2: count + per-warp tile counts and candidate bits
__device__ void tiles_body(const float* __restrict__ x, i64 tiles, const int* __restrict__ thr,
                           u32* __restrict__ out, u32* __restrict__ tile_cnt) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int t0 = 0, t1 = 0, t2 = 0, t3 = 0;
  if (MODE) t0 = thr[0], t1 = thr[1], t2 = thr[2], t3 = thr[3];  // t0 > t1 > t2 > t3
  u32 acc = 0, c0 = 0, c1 = 0, c2 = 0, c3 = 0;
  for (i64 t = blockIdx.x; t < tiles; t += gridDim.x) {
    int b[4 * ROWS];
    load_tile(x, t, b);
    if (MODE == 0) {
#pragma unroll
      for (int e = 0; e < 4 * ROWS; ++e) acc ^= (u32)b[e];
      continue;
    }
    u32 d0 = 0, d1 = 0, d2 = 0, d3 = 0;
#pragma unroll
    for (int e = 0; e < 4 * ROWS; ++e) {
      d0 += ((u32)b[e] - (u32)t0) >> 31;
      d1 += ((u32)b[e] - (u32)t1) >> 31;
      d2 += ((u32)b[e] - (u32)t2) >> 31;
      d3 += ((u32)b[e] - (u32)t3) >> 31;
    }
    if (MODE == 1) {
      c0 += d0, c1 += d1, c2 += d2, c3 += d3;
      continue;
    }
    // per warp and tile: the four counts (two to a word) and the candidate bits at t3
    u32 p01 = (4 * ROWS - d0) | ((4 * ROWS - d1) << 16);
    u32 p23 = (4 * ROWS - d2) | ((4 * ROWS - d3) << 16);
    p01 = warp_sum(p01);
    p23 = warp_sum(p23);
    u32 sel = 0;
#pragma unroll
    for (int e = 0; e < 4 * ROWS; ++e) sel |= (u32)(b[e] >= t3) << e;
    const u32 any = __ballot_sync(FULL, sel != 0);
    const i64 slot = t * (TILE / (4 * 32 * ROWS)) + warp;
    if (lane == 0) {
      tile_cnt[2 * slot] = p01;
      tile_cnt[2 * slot + 1] = p23 + __popc(any);
    }
  }
  if (MODE == 0) {
    acc = warp_sum(acc);
    if (lane == 0) atomicAdd(out, acc);
  } else if (MODE == 1) {
    const u32 p01 = warp_sum((c0 & 0xffff) | (c1 << 16)), p23 = warp_sum((c2 & 0xffff) | (c3 << 16));
    if (lane == 0) atomicAdd(out, p01 ^ p23);
  }
}

// The read + 4 counts + the tile's candidates in index order, the block's only step one barrier
// a tile: each warp owns 1024 contiguous elements of the tile, publishes its four counts in
// shared memory (two buffers, alternating by tile), and after the barrier every warp sums them
// itself: the tile's counts, the candidate level (the lowest threshold whose count fits in cap)
// and where its own candidates start.
__device__ __forceinline__ u64 widen16(u32 x) {
  return (u64)(x & 0xffu) | ((u64)(x & 0xff00u) << 8) | ((u64)(x & 0xff0000u) << 16) |
         ((u64)(x & 0xff000000u) << 24);
}

extern "C" __global__ void __launch_bounds__(BLOCK, 4)
    floor_count_cand(const float* __restrict__ x, i64 tiles, const int* __restrict__ thr,
                     u32* __restrict__ tile_cnt, float* __restrict__ cval, unsigned short* cidx,
                     i64 cap) {
  constexpr int NW = BLOCK / 32;
  __shared__ u32 s_cnt[2][NW][4];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int tr[4] = {thr[0], thr[1], thr[2], thr[3]};  // t0 > t1 > t2 > t3
  int parity = 0;
  for (i64 t = blockIdx.x; t < tiles; t += gridDim.x, parity ^= 1) {
    int b[4 * ROWS];
    load_tile(x, t, b);
    u32 d[4] = {0, 0, 0, 0};
#pragma unroll
    for (int e = 0; e < 4 * ROWS; ++e) {
#pragma unroll
      for (int j = 0; j < 4; ++j) d[j] += ((u32)b[e] - (u32)tr[j]) >> 31;
    }
    const u32 p01 = warp_sum((4 * ROWS - d[0]) | ((4 * ROWS - d[1]) << 16));
    const u32 p23 = warp_sum((4 * ROWS - d[2]) | ((4 * ROWS - d[3]) << 16));
    if (lane < 4) s_cnt[parity][warp][lane] = (lane < 2 ? p01 : p23) >> (16 * (lane & 1)) & 0xffffu;
    __syncthreads();
    // every warp: the tile's counts, the level, its own offset
    u32 tot[4] = {0, 0, 0, 0};
#pragma unroll
    for (int v = 0; v < NW; ++v) {
#pragma unroll
      for (int j = 0; j < 4; ++j) tot[j] += s_cnt[parity][v][j];
    }
    int lv = 4;
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (lv == 4 && tot[3 - j] <= (u32)cap) lv = 3 - j;
    if (warp == 0 && lane < 4) tile_cnt[lane * tiles + t] = tot[lane];
    if (lv == 4) continue;
    u32 before = 0;
    for (int v = 0; v < warp; ++v) before += s_cnt[parity][v][lv];
    const int T = lv == 0 ? tr[0] : lv == 1 ? tr[1] : lv == 2 ? tr[2] : tr[3];
    u32 sel = 0;
#pragma unroll
    for (int e = 0; e < 4 * ROWS; ++e) sel |= (u32)(b[e] >= T) << e;
    if (__ballot_sync(FULL, sel != 0) == 0) continue;
    // positions in index order within the warp: row q, then lane, then r (8-bit fields per row)
    u32 mine[2], incl[2];
#pragma unroll
    for (int g = 0; g < 2; ++g) {
      mine[g] = 0;
#pragma unroll
      for (int q = 0; q < 4; ++q) mine[g] |= (u32)__popc(sel & (0xfu << (16 * g + 4 * q))) << (8 * q);
      incl[g] = mine[g];
    }
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
#pragma unroll
      for (int g = 0; g < 2; ++g) {
        const u32 y = __shfl_up_sync(FULL, incl[g], o);
        if (lane >= o) incl[g] += y;
      }
    }
    // rows' totals (lane 31) -> where each row starts, 16-bit fields
    constexpr u64 ONES = 1ull + (1ull << 16) + (1ull << 32) + (1ull << 48);
    u64 base[2], carry = before;
#pragma unroll
    for (int g = 0; g < 2; ++g) {
      const u64 all = widen16(__shfl_sync(FULL, incl[g], 31));
      base[g] = carry * ONES + all * (ONES - 1) + widen16(incl[g] - mine[g]);
      carry += (all * ONES) >> 48;
    }
    // all * (ONES - 1): field q gets the sum of fields below q (the rows before within the group)
    float* cv = cval + t * cap;
    unsigned short* ci = cidx + t * cap;
    for (u32 rest = sel; rest; rest &= rest - 1) {
      const int e = __ffs(rest) - 1, q = e >> 2;
      const u64 bg = q >> 2 ? base[1] : base[0];
      const u32 pos = (u32)((bg >> (16 * (q & 3))) & 0xffffu) +
                      __popc(sel & ((1u << e) - 1u) & (0xfu << (4 * q)));
      const int idx = warp * (4 * 32 * ROWS) + (q * 32 + lane) * 4 + (e & 3);
      if (pos < (u32)cap) {
        cv[pos] = x[t * TILE + idx];
        ci[pos] = (unsigned short)idx;
      }
    }
  }
}

extern "C" __global__ void __launch_bounds__(BLOCK, 4)
    floor_read(const float* __restrict__ x, i64 tiles, const int* thr, u32* out, u32* tile_cnt) {
  tiles_body<0>(x, tiles, thr, out, tile_cnt);
}

extern "C" __global__ void __launch_bounds__(BLOCK, 4)
    floor_count(const float* __restrict__ x, i64 tiles, const int* thr, u32* out, u32* tile_cnt) {
  tiles_body<1>(x, tiles, thr, out, tile_cnt);
}

extern "C" __global__ void __launch_bounds__(BLOCK, 4)
    floor_count_warp(const float* __restrict__ x, i64 tiles, const int* thr, u32* out,
                     u32* tile_cnt) {
  tiles_body<2>(x, tiles, thr, out, tile_cnt);
}

// HIST: also the compact copy and the block's 2048-bin histogram, flushed to global.
template <bool HIST>
__device__ void gather_body(const float* __restrict__ x, i64 m, i64 stride, u32* samples,
                            u32* hist, u32* out) {
  __shared__ u32 h[2048];
  if (HIST) {
    for (int j = threadIdx.x; j < 2048; j += BLOCK) h[j] = 0;
    __syncthreads();
  }
  u32 acc = 0;
  const i64 step = (i64)gridDim.x * BLOCK;
  for (i64 i0 = (i64)blockIdx.x * BLOCK + threadIdx.x; i0 < m; i0 += 4 * step) {
    int b[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const i64 i = i0 + r * step;
      b[r] = i < m ? abs_bits(__ldcs(x + i * stride)) : -1;
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      if (b[r] < 0) continue;
      if (HIST) {
        samples[i0 + r * step] = (u32)b[r];
        atomicAdd(&h[b[r] >> 20], 1u);
      } else {
        acc ^= (u32)b[r];
      }
    }
  }
  if (HIST) {
    __syncthreads();
    for (int j = threadIdx.x; j < 2048; j += BLOCK)
      if (h[j]) atomicAdd(&hist[j], h[j]);
  } else {
    acc = warp_sum(acc);
    if ((threadIdx.x & 31) == 0) atomicAdd(out, acc);
  }
}

extern "C" __global__ void __launch_bounds__(BLOCK)
    floor_gather(const float* __restrict__ x, i64 m, i64 stride, u32* samples, u32* hist,
                 u32* out) {
  gather_body<false>(x, m, stride, samples, hist, out);
}

extern "C" __global__ void __launch_bounds__(BLOCK)
    floor_sample(const float* __restrict__ x, i64 m, i64 stride, u32* samples, u32* hist,
                 u32* out) {
  gather_body<true>(x, m, stride, samples, hist, out);
}

extern "C" __global__ void __launch_bounds__(BLOCK) floor_empty(const u32* flag) {
  if (*flag) __trap();  // never set: a gated-off launch reads its flag and returns
}
