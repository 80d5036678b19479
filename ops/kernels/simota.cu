// SimOTA label assignment (YOLOX get_assignments; YOLOv7 build_targets has the same core),
// batched over images with padded gts. Three launches on one stream, no host synchronisation:
//   simota_prepare  one warp per (image, anchor): the candidate flag (a valid gt's box or centre
//                   region holds the anchor), the sum over classes of the BCE's background term;
//                   zeroes the anchor's match count and the image's num_fg; clears *ok where
//                   an anchor stride is negative.
//   simota_select   one block per (image, gt): IoU and cost over the image's candidates, the sum
//                   of the 10 largest IoUs (dynamic k), then the k lowest (cost, anchor index)
//                   pairs; each pick adds one to the anchor's match count (atomics). Clears
//                   *ok where a valid gt has a class outside [0, C) or a negative size (such a
//                   gt is skipped: its class row is never read); the launcher asserts on *ok.
//   simota_resolve  one thread per (image, anchor): the one gt that picked it or, picked twice
//                   or more, the valid gt of lowest cost (lowest gt index on ties); its IoU;
//                   num_fg per image (one atomic per warp).
// IoU and cost are float64 (ops/simota.py says why) and the module is compiled with
// --fmad=false: every product and sum rounds as in the PyTorch reference, only exp/log/sqrt
// may differ from the host's libm in the last bit of a double.

typedef long long i64;

#define TOPK 10
#define BLOCK 256
#define WARPS (BLOCK / 32)
#define DMAX 1.7976931348623157e308
#define NO_ANCHOR 0x7fffffff

// NaN-propagating min/max, like torch.minimum/maximum (fmin/fmax drop a NaN).
__device__ __forceinline__ double nmax(double a, double b) { return (a > b || a != a) ? a : b; }
__device__ __forceinline__ double nmin(double a, double b) { return (a < b || a != a) ? a : b; }

struct Box {
  double l, t, r, b, cx, cy, area;
};

__device__ __forceinline__ Box load_box(const float* q, int xyxy) {
  const double a0 = q[0], a1 = q[1], a2 = q[2], a3 = q[3];
  Box o;
  if (xyxy) {
    o.l = a0; o.t = a1; o.r = a2; o.b = a3;
    o.cx = (a0 + a2) * 0.5; o.cy = (a1 + a3) * 0.5;
    o.area = (a2 - a0) * (a3 - a1);
  } else {
    o.cx = a0; o.cy = a1;
    o.l = a0 - 0.5 * a2; o.r = a0 + 0.5 * a2;
    o.t = a1 - 0.5 * a3; o.b = a1 + 0.5 * a3;
    o.area = a2 * a3;
  }
  return o;
}

// YOLOX bboxes_iou; a NaN or an empty union gives 0.
__device__ __forceinline__ double box_iou(const Box& g, const Box& p) {
  const double tlx = nmax(g.l, p.l), tly = nmax(g.t, p.t);
  const double brx = nmin(g.r, p.r), bry = nmin(g.b, p.b);
  const double inter = (tlx < brx && tly < bry) ? (brx - tlx) * (bry - tly) : 0.0;
  const double uni = (g.area + p.area) - inter;
  const double iou = uni > 0.0 ? inter / uni : 0.0;
  return iou == iou ? iou : 0.0;
}

__device__ __forceinline__ bool in_center(const Box& g, double ax, double ay, double rs) {
  return (ax - (g.cx - rs)) > 0.0 && ((g.cx + rs) - ax) > 0.0 && (ay - (g.cy - rs)) > 0.0 &&
         ((g.cy + rs) - ay) > 0.0;
}

__device__ __forceinline__ bool in_box(const Box& g, double ax, double ay) {
  return (ax - g.l) > 0.0 && (g.r - ax) > 0.0 && (ay - g.t) > 0.0 && (g.b - ay) > 0.0;
}

__device__ __forceinline__ double sigmoid_d(double x) { return 1.0 / (1.0 + exp(-x)); }

// -max(log(x), -100), the clamp of torch's binary_cross_entropy; a NaN stays NaN.
__device__ __forceinline__ double neg_log_clamped(double x) {
  const double v = -log(x);
  return v > 100.0 ? 100.0 : v;
}

struct Params {
  int B, G, A, C;
  double radius;
  int center_only, penalty, xyxy;
};

__device__ __forceinline__ bool gt_usable(const unsigned char* valid, const i64* cls, i64 bg, int C) {
  if (!valid[bg]) return false;
  const i64 k = cls[bg];
  return k >= 0 && k < C;
}

// The cost of (gt g, anchor a) of image b: cls BCE + 3 * -log(iou + 1e-8) (+ the geometry
// penalty), NaN and +inf mapped to DMAX so that they sort after every number. Also returns
// the IoU.
__device__ __forceinline__ double pair_cost(const Box& g, i64 k, const float* centers,
                                            const float* strides, const float* pred,
                                            const float* cls_logits, const float* obj_logits,
                                            const double* bg_sum, int b, int a,
                                            const Params& P, double* iou_out) {
  const i64 ba = (i64)b * P.A + a;
  const Box p = load_box(pred + ba * 4, P.xyxy);
  const double iou = box_iou(g, p);
  *iou_out = iou;
  const double prob = sqrt(sigmoid_d((double)cls_logits[ba * P.C + k]) *
                           sigmoid_d((double)obj_logits[ba]));
  const double cls = (bg_sum[ba] - neg_log_clamped(1.0 - prob)) + neg_log_clamped(prob);
  double c = cls + 3.0 * (-log(iou + 1e-8));
  if (P.penalty) {
    const double ax = centers[2 * (i64)a], ay = centers[2 * (i64)a + 1];
    const double rs = P.radius * (double)strides[a];
    const bool rel = P.center_only ? in_center(g, ax, ay, rs)
                                   : (in_box(g, ax, ay) && in_center(g, ax, ay, rs));
    c = c + (rel ? 0.0 : (P.center_only ? 1e6 : 1e5));
  }
  return c <= DMAX ? c : DMAX;
}

extern "C" __global__ void __launch_bounds__(BLOCK) simota_prepare(
    const float* __restrict__ gt_boxes, const i64* __restrict__ gt_cls,
    const unsigned char* __restrict__ gt_valid, const float* __restrict__ centers,
    const float* __restrict__ strides, const float* __restrict__ cls_logits,
    const float* __restrict__ obj_logits, unsigned char* __restrict__ cand,
    double* __restrict__ bg_sum, int* __restrict__ count, int* __restrict__ owner,
    i64* __restrict__ num_fg, int B, int G, int A, int C, double radius, int center_only,
    int xyxy, unsigned char* __restrict__ ok) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int a = blockIdx.x * WARPS + warp;
  const int b = blockIdx.y;
  if (a >= A) return;  // uniform over the warp
  const i64 ba = (i64)b * A + a;
  if (a == 0 && lane == 0) num_fg[b] = 0;
  const double ax = centers[2 * (i64)a], ay = centers[2 * (i64)a + 1];
  const double rs = radius * (double)strides[a];
  if (b == 0 && lane == 0 && strides[a] < 0.0f) *ok = 0;  // every writer writes the same 0
  bool hit = false;
  for (int g = lane; g < G; g += 32) {
    const i64 bg = (i64)b * G + g;
    if (!gt_usable(gt_valid, gt_cls, bg, C)) continue;
    const Box box = load_box(gt_boxes + bg * 4, xyxy);
    const bool c = in_center(box, ax, ay, rs);
    hit = hit || (center_only ? c : (c || in_box(box, ax, ay)));
  }
  hit = __any_sync(0xffffffffu, hit);
  double s = 0.0;
  if (hit) {
    const double so = sigmoid_d((double)obj_logits[ba]);
    const float* row = cls_logits + ba * C;
    for (int c = lane; c < C; c += 32) s += neg_log_clamped(1.0 - sqrt(sigmoid_d((double)row[c]) * so));
    for (int off = 16; off > 0; off >>= 1) s += __shfl_down_sync(0xffffffffu, s, off);
  }
  if (lane == 0) {
    cand[ba] = hit ? 1 : 0;
    bg_sum[ba] = s;
    count[ba] = 0;
    owner[ba] = -1;
  }
}

// (v, t) of the block's largest v, lowest t on ties; every thread gets the answer.
__device__ __forceinline__ void block_argmax(double v, int t, double* sv, int* st, double* wv,
                                             int* wt) {
  for (int off = 16; off > 0; off >>= 1) {
    const double ov = __shfl_xor_sync(0xffffffffu, v, off);
    const int ot = __shfl_xor_sync(0xffffffffu, t, off);
    if (ov > v || (ov == v && ot < t)) { v = ov; t = ot; }
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) { sv[warp] = v; st[warp] = t; }
  __syncthreads();
  if (threadIdx.x == 0) {
    double bv = sv[0];
    int bt = st[0];
    for (int w = 1; w < WARPS; ++w)
      if (sv[w] > bv || (sv[w] == bv && st[w] < bt)) { bv = sv[w]; bt = st[w]; }
    *wv = bv;
    *wt = bt;
  }
  __syncthreads();
}

// (c, a) of the block's lowest (cost, anchor) pair; every thread gets the answer.
__device__ __forceinline__ void block_argmin_pair(double c, int a, double* sv, int* st, double* wv,
                                                  int* wt) {
  for (int off = 16; off > 0; off >>= 1) {
    const double oc = __shfl_xor_sync(0xffffffffu, c, off);
    const int oa = __shfl_xor_sync(0xffffffffu, a, off);
    if (oc < c || (oc == c && oa < a)) { c = oc; a = oa; }
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) { sv[warp] = c; st[warp] = a; }
  __syncthreads();
  if (threadIdx.x == 0) {
    double bc = sv[0];
    int ba = st[0];
    for (int w = 1; w < WARPS; ++w)
      if (sv[w] < bc || (sv[w] == bc && st[w] < ba)) { bc = sv[w]; ba = st[w]; }
    *wv = bc;
    *wt = ba;
  }
  __syncthreads();
}

extern "C" __global__ void __launch_bounds__(BLOCK) simota_select(
    const float* __restrict__ gt_boxes, const i64* __restrict__ gt_cls,
    const unsigned char* __restrict__ gt_valid, const float* __restrict__ centers,
    const float* __restrict__ strides, const float* __restrict__ pred,
    const float* __restrict__ cls_logits, const float* __restrict__ obj_logits,
    const unsigned char* __restrict__ cand, const double* __restrict__ bg_sum,
    int* __restrict__ count, int* __restrict__ owner, int B, int G, int A, int C, double radius,
    int center_only, int penalty, int xyxy, unsigned char* __restrict__ ok) {
  __shared__ double sv[WARPS];
  __shared__ int st[WARPS];
  __shared__ double win_v;
  __shared__ int win_t;
  const i64 bg = blockIdx.x;
  const int b = (int)(bg / G), g = (int)(bg % G);
  if (threadIdx.x == 0 && gt_valid[bg]) {
    const i64 k = gt_cls[bg];
    const float* q = gt_boxes + bg * 4;
    // xyxy: x2 < x1 or y2 < y1; cxcywh: w < 0 or h < 0 (a NaN passes, as in the reference)
    const bool bad_size = xyxy ? (q[2] < q[0] || q[3] < q[1]) : (q[2] < 0.0f || q[3] < 0.0f);
    if (k < 0 || k >= C || bad_size) *ok = 0;
  }
  if (!gt_usable(gt_valid, gt_cls, bg, C)) return;  // uniform over the block
  const Params P{B, G, A, C, radius, center_only, penalty, xyxy};
  const Box box = load_box(gt_boxes + bg * 4, xyxy);
  const i64 k = gt_cls[bg];
  const int tid = threadIdx.x;

  // Each thread keeps its 10 largest IoUs (descending) and 10 lowest (cost, anchor) pairs
  // (ascending); fixed-index insertion keeps both lists in registers.
  double ti[TOPK], tc[TOPK];
  int ta[TOPK];
#pragma unroll
  for (int j = 0; j < TOPK; ++j) { ti[j] = -1.0; tc[j] = __longlong_as_double(0x7ff0000000000000LL); ta[j] = NO_ANCHOR; }
  for (int a = tid; a < A; a += BLOCK) {
    if (!cand[(i64)b * A + a]) continue;
    double iou;
    const double c = pair_cost(box, k, centers, strides, pred, cls_logits, obj_logits, bg_sum, b,
                               a, P, &iou);
    if (iou > ti[TOPK - 1]) {
      ti[TOPK - 1] = iou;
#pragma unroll
      for (int j = TOPK - 1; j > 0; --j)
        if (ti[j] > ti[j - 1]) { const double x = ti[j]; ti[j] = ti[j - 1]; ti[j - 1] = x; }
    }
    // a grows along the loop: an equal cost already kept has the lower index and stays first
    if (c < tc[TOPK - 1]) {
      tc[TOPK - 1] = c;
      ta[TOPK - 1] = a;
#pragma unroll
      for (int j = TOPK - 1; j > 0; --j)
        if (tc[j] < tc[j - 1]) {
          const double x = tc[j]; tc[j] = tc[j - 1]; tc[j - 1] = x;
          const int y = ta[j]; ta[j] = ta[j - 1]; ta[j - 1] = y;
        }
    }
  }

  // dynamic k: the 10 largest IoUs of the image's candidates summed in descending order
  double sum = 0.0;
  for (int r = 0; r < TOPK; ++r) {
    block_argmax(ti[0], tid, sv, st, &win_v, &win_t);
    const double v = win_v;
    const int t = win_t;
    if (v < 0.0) break;  // no candidate left (the same answer in every thread)
    sum += v;
    if (tid == t) {
#pragma unroll
      for (int j = 0; j < TOPK - 1; ++j) ti[j] = ti[j + 1];
      ti[TOPK - 1] = -1.0;
    }
    __syncthreads();  // win_v is read by all before the next round writes it
  }
  int dyn_k = (int)sum;
  dyn_k = dyn_k < 1 ? 1 : dyn_k;

  // the dyn_k lowest-cost candidates, lowest anchor index first on equal cost
  for (int r = 0; r < dyn_k; ++r) {
    block_argmin_pair(tc[0], ta[0], sv, st, &win_v, &win_t);
    const int a = win_t;
    if (a == NO_ANCHOR) break;
    if (tid == 0) {
      const i64 ba = (i64)b * A + a;
      atomicAdd(count + ba, 1);
      atomicExch(owner + ba, g);  // read only where the count ends at 1: one writer
    }
    if (ta[0] == a) {
#pragma unroll
      for (int j = 0; j < TOPK - 1; ++j) { tc[j] = tc[j + 1]; ta[j] = ta[j + 1]; }
      tc[TOPK - 1] = __longlong_as_double(0x7ff0000000000000LL);
      ta[TOPK - 1] = NO_ANCHOR;
    }
    __syncthreads();
  }
}

extern "C" __global__ void __launch_bounds__(BLOCK) simota_resolve(
    const float* __restrict__ gt_boxes, const i64* __restrict__ gt_cls,
    const unsigned char* __restrict__ gt_valid, const float* __restrict__ centers,
    const float* __restrict__ strides, const float* __restrict__ pred,
    const float* __restrict__ cls_logits, const float* __restrict__ obj_logits,
    const double* __restrict__ bg_sum, const int* __restrict__ count,
    const int* __restrict__ owner, unsigned char* __restrict__ fg_mask,
    i64* __restrict__ matched_gt, float* __restrict__ matched_iou, i64* __restrict__ num_fg,
    int B, int G, int A, int C, double radius, int center_only, int penalty, int xyxy) {
  const int a = blockIdx.x * BLOCK + threadIdx.x;
  const int b = blockIdx.y;
  const bool inside = a < A;  // no early return: the whole warp takes part in the ballot
  const i64 ba = (i64)b * A + a;
  const int cnt = inside ? count[ba] : 0;
  int m = -1;
  double iou = 0.0;
  if (cnt == 1) {
    m = owner[ba];
  } else if (cnt > 1) {
    const Params P{B, G, A, C, radius, center_only, penalty, xyxy};
    double best = 0.0;
    for (int g = 0; g < G; ++g) {
      const i64 bg = (i64)b * G + g;
      if (!gt_usable(gt_valid, gt_cls, bg, C)) continue;
      const Box box = load_box(gt_boxes + bg * 4, xyxy);
      double unused;
      const double c = pair_cost(box, gt_cls[bg], centers, strides, pred, cls_logits,
                                 obj_logits, bg_sum, b, a, P, &unused);
      if (m < 0 || c < best) { best = c; m = g; }
    }
  }
  if (m >= 0) {
    const Box box = load_box(gt_boxes + ((i64)b * G + m) * 4, xyxy);
    iou = box_iou(box, load_box(pred + ba * 4, xyxy));
  }
  if (inside) {
    fg_mask[ba] = cnt > 0 ? 1 : 0;
    matched_gt[ba] = m;
    matched_iou[ba] = (float)iou;
  }
  const unsigned fg = __ballot_sync(0xffffffffu, cnt > 0);
  if ((threadIdx.x & 31) == 0 && fg != 0)
    atomicAdd((unsigned long long*)(num_fg + b), (unsigned long long)__popc(fg));
}
