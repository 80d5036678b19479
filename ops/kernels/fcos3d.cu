// FCOS3D point targets (mmdet3d FCOSMono3DHead._get_target_single), batched over images with
// padded gts: one thread per (image, point), one launch. Each thread scans the image's gts,
// keeps the nearest 2D centre among the gts whose centre square (radius * stride) holds the
// point and whose largest l/t/r/b distance lies in the point's regress range (the lowest gt
// index on equal distances), then writes that gt's targets. A point with no such gt is
// background and takes the targets of the image's first valid gt, as mmdet3d's argmin over
// all-INF distances does; an image without gts gives zeros.
// Compiled with --fmad=false: products and sums round as in the PyTorch reference, so labels
// and the 2D targets are bit-identical; atan2/exp may differ from the host's in the last bit.

typedef long long i64;

#define BLOCK 256
#define FAR 1e8f  // mmdet3d's INF

// NaN-propagating max, as torch.max over a dimension.
__device__ __forceinline__ float nmaxf(float a, float b) { return (a > b || a != a) ? a : b; }

extern "C" __global__ void __launch_bounds__(BLOCK) fcos3d_targets(
    const float* __restrict__ points, const float* __restrict__ point_strides,
    const float* __restrict__ regress_ranges, const float* __restrict__ gt_bboxes,
    const i64* __restrict__ gt_labels, const float* __restrict__ gt_bboxes_3d,
    const i64* __restrict__ gt_labels_3d, const float* __restrict__ centers2d,
    const float* __restrict__ depths, const i64* __restrict__ attr_labels,
    const unsigned char* __restrict__ gt_valid, i64* __restrict__ labels,
    float* __restrict__ bbox_targets, i64* __restrict__ labels_3d,
    float* __restrict__ bbox_targets_3d, float* __restrict__ centerness,
    i64* __restrict__ attr_out, int P, int G, int code, double radius, float neg_alpha,
    i64 background_label, i64 attr_background_label) {
  const int p = blockIdx.x * BLOCK + threadIdx.x;
  const int b = blockIdx.y;
  if (p >= P) return;
  const i64 bp = (i64)b * P + p;
  const float x = points[2 * (i64)p], y = points[2 * (i64)p + 1];
  const float rs = (float)((double)point_strides[p] * radius);  // mmdet3d: strides[lvl] * radius
  const float lo = regress_ranges[2 * (i64)p], hi = regress_ranges[2 * (i64)p + 1];
  int first = -1, best_g = -1;
  float best = FAR;
  for (int g = 0; g < G; ++g) {
    const i64 bg = (i64)b * G + g;
    if (!gt_valid[bg]) continue;
    if (first < 0) first = g;
    const float* box = gt_bboxes + bg * 4;
    const float cx = centers2d[2 * bg], cy = centers2d[2 * bg + 1];
    const bool inside = (x - (cx - rs)) > 0.f && (y - (cy - rs)) > 0.f &&
                        ((cx + rs) - x) > 0.f && ((cy + rs) - y) > 0.f;
    if (!inside) continue;
    const float far = nmaxf(nmaxf(nmaxf(x - box[0], y - box[1]), box[2] - x), box[3] - y);
    if (!(far >= lo && far <= hi)) continue;
    const float dx = x - cx, dy = y - cy;
    const float d = sqrtf(dx * dx + dy * dy);
    if (d < best) {
      best = d;
      best_g = g;
    }
  }
  float* bt = bbox_targets + bp * 4;
  float* bt3 = bbox_targets_3d + bp * code;
  if (first < 0) {  // no gt in this image: background, zero targets
    labels[bp] = background_label;
    labels_3d[bp] = background_label;
    attr_out[bp] = attr_background_label;
    for (int j = 0; j < 4; ++j) bt[j] = 0.f;
    for (int j = 0; j < code; ++j) bt3[j] = 0.f;
    centerness[bp] = 0.f;
    return;
  }
  const bool fg = best_g >= 0;
  const int g = fg ? best_g : first;
  const i64 bg = (i64)b * G + g;
  labels[bp] = fg ? gt_labels[bg] : background_label;
  labels_3d[bp] = fg ? gt_labels_3d[bg] : background_label;
  attr_out[bp] = fg ? attr_labels[bg] : attr_background_label;
  const float* box = gt_bboxes + bg * 4;
  bt[0] = x - box[0];
  bt[1] = y - box[1];
  bt[2] = box[2] - x;
  bt[3] = box[3] - y;
  const float dx = x - centers2d[2 * bg], dy = y - centers2d[2 * bg + 1];
  const float* b3 = gt_bboxes_3d + bg * code;
  bt3[0] = dx;
  bt3[1] = dy;
  bt3[2] = depths[bg];
  for (int j = 3; j < code; ++j) bt3[j] = b3[j];
  bt3[6] = -atan2f(b3[0], b3[2]) + b3[6];  // the local yaw (code >= 7, checked by the host)
  const float rel = sqrtf(dx * dx + dy * dy) / (1.414f * rs);
  centerness[bp] = expf(neg_alpha * rel);
}
