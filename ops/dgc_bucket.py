"""DGC's sparsification of one bucket's many tensors in a fixed number of torch launches.

A DDP bucket is one flat buffer holding many gradients. :class:`BucketPlan` is built once per
bucket layout and compress ratio: it holds each compressed segment's sampling plan and the
device tables (segment keys and lengths, sample positions, output offsets) that let
:meth:`BucketPlan.select_multi` run every segment's sample, threshold, adaptation and
compaction as torch ops over the whole bucket: no Python loop over tensors, no host
synchronisation, and a launch count that depends on ``iters`` but not on the number of
tensors; :meth:`BucketPlan.select_graphed` replays them as one CUDA graph. On the CPU,
:meth:`BucketPlan.select_reference` loops over the segments (no launches to save there, and
its loop stops early); both give the same indices.

The rules are those of DGC's reference code (docs/dgc.md, "Sampling and threshold"):

* the sample ratio is floored at 0.01; a segment of ``n <= ceil(2 / ratio)`` elements, or any
  segment when the sample ratio is 1, is sampled whole; otherwise the stride is odd,
  ``ceil(n / want / 32) * 32 + 1`` lowered by 8 until ``n // stride >= want`` samples, with
  ``want = max(ceil(n * sample_ratio), ceil(2 / ratio))``;
* ``k = ceil(n * ratio)`` selected, ``k_s = ceil(num_samples * ratio)``: the first threshold is
  the ``k_s``-th largest sampled importance ``|x|``;
* a segment sampled whole is not adapted; otherwise the adaptation loop multiplies the fp32
  threshold by ``upper`` or ``lower`` (fp32, rounded at every step) and, with ``resample``, takes
  the exact top-k when the count passes ``upper * k``;
* the first ``k`` indices (ascending) at or above the final threshold are kept; the exact top-k
  breaks ties to the lowest index. Fewer than ``k``: padded with index ``-1``.

Importances are compared as the int32 bit patterns of ``|x|`` (exact, NaN above +inf). Each
element's key is ``segment << 32 | bits``; a table of every segment's thresholds followed by a
sentinel, sorted, turns one ``searchsorted`` into each element's segment and level
(``pos // (J + 1)``, ``pos % (J + 1)``), and one ``index_add_`` of ones into every segment's
counts at all ``J`` thresholds at once. With ``resample`` the loop's thresholds form one chain
(only ``lower`` steps before a stop), so one counting pass decides the loop; the exact top-k is
a radix select in three such passes (11, 10 and 10 bits). Without ``resample`` the path (and
its rounding) depends on the counts: one counting pass per adaptation step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["BucketPlan", "sample_plan"]

_NONE = 1 << 31  # a threshold no importance reaches (|x| bits are < 2^31)
_SENTINEL = (1 << 32) - 1  # above every threshold and importance of its segment
_RADIX = ((20, 11), (10, 10), (0, 10))  # (shift, width) of the exact top-k's three passes
_LANES = 32  # copies of the count bins (one per lane of a warp)


def sample_plan(n: int, ratio: float, sample_ratio: float) -> tuple[int, int, int, int]:
    """``(k, num_samples, k_s, stride)`` of a tensor of ``n`` elements (the module's rules)."""
    sr = min(max(sample_ratio, 0.01), 1.0)
    k = min(n, max(1, math.ceil(n * ratio)))
    stride, m = 1, n
    if sr < 1.0 and n > math.ceil(2 / ratio):
        want = max(math.ceil(n * sr), math.ceil(2 / ratio))
        stride = math.ceil(n / want / 32) * 32 + 1
        m = n // stride
        while m < want:
            stride -= 8
            m = n // stride
    ks = min(m, max(1, math.ceil(m * ratio)))
    return k, m, ks, stride


class BucketPlan:
    """Tables of one bucket layout: ``segments`` are ``(offset, numel)`` of the compressed
    tensors, ascending and disjoint, inside a buffer of ``length`` elements."""

    def __init__(
        self,
        segments: Sequence[tuple[int, int]],
        length: int,
        ratio: float,
        sample_ratio: float,
        strided: bool,
        device: torch.device,
    ) -> None:
        # the whole buffer as segments: the compressed ones, and fillers (never selected)
        # for what lies between them, so every element has a segment
        bounds: list[tuple[int, int, bool]] = []
        at = 0
        for off, n in segments:
            if off < at or n < 1 or off + n > length:
                raise ValueError(f"BucketPlan: segment ({off}, {n}) overlaps or leaves the buffer")
            if off > at:
                bounds.append((at, off - at, False))
            bounds.append((off, n, True))
            at = off + n
        if at < length:
            bounds.append((at, length - at, False))
        self.length = length
        self.nseg = len(bounds)
        sparse = [i for i, b in enumerate(bounds) if b[2]]
        plans = [sample_plan(bounds[i][1], ratio, sample_ratio) for i in sparse]
        self.k = [p[0] for p in plans]
        self.total = sum(self.k)  # values (and indices) this bucket sends
        self.strided = strided
        self.segments = [(bounds[i][0], bounds[i][1]) for i in sparse]
        self.plans = plans
        self.strides = [p[3] for p in plans]
        self.nsamples = [p[1] for p in plans]
        base, rand_n, picks, total = [], [], [], 0
        for i, (_, m, ks, stride) in zip(sparse, plans):
            off, n, _ = bounds[i]
            if strided or m == n:
                base.append(torch.arange(off, off + m * stride, stride))
                rand_n.append(torch.zeros(m, dtype=torch.float64))
            else:  # uniform samples: off + floor(u * n)
                base.append(torch.full((m,), off))
                rand_n.append(torch.full((m,), float(n), dtype=torch.float64))
            total += m
            picks.append(total - ks)  # the k_s-th largest in the sorted samples
        whole_seg = [p[1] == bounds[i][1] for i, p in zip(sparse, plans)]
        seg = torch.repeat_interleave(
            torch.arange(len(sparse)), torch.tensor(self.nsamples, dtype=torch.int64)
        )

        def dev(values: list | torch.Tensor, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.as_tensor(values, dtype=dtype).to(device)

        self.seg_len = dev([b[1] for b in bounds])
        self.seg_key = dev([i << 32 for i in range(self.nseg)])
        self.seg_start = dev([b[0] for b in bounds])
        self.sparse = dev(sparse)
        self.sample_base = dev(torch.cat(base) if base else torch.zeros(0))
        self.sample_seg = dev(seg)
        self.sample_seg_key = self.sample_seg << 32
        self.sample_rand_n = dev(torch.cat(rand_n) if rand_n else torch.zeros(0), torch.float64)
        self.picks = dev(picks)
        self.stride_f = dev(self.strides, torch.float64)
        self.kf = dev(self.k, torch.float64)
        self.kk = dev(self.k)
        self.adapt = dev([not w for w in whole_seg], torch.bool)
        out_base = [0] * self.nseg
        acc = 0
        for i, k in zip(sparse, self.k):
            out_base[i] = acc
            acc += k
        self.out_base = dev(out_base)
        self.device = device
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}

    # -- counting -----------------------------------------------------------------------------
    def _levels(self, keys: torch.Tensor, thr: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Each element's position in the sorted table of ``thr`` ([nseg, J] bits) + sentinels:
        segment ``pos // (J + 1)``, thresholds at or below it ``pos % (J + 1)``."""
        j = thr.shape[1]
        sent = torch.full((self.nseg, 1), _SENTINEL, dtype=torch.int64, device=self.device)
        table = torch.cat([thr, sent], 1).add_(self.seg_key[:, None]).reshape(-1)
        # int32 positions: half the bytes of every pass that reads them (tables < 2^31 / 32)
        return torch.searchsorted(table, keys, right=True, out_int32=True), j

    def _counts(self, keys: torch.Tensor, thr: torch.Tensor, ordered: bool) -> torch.Tensor:
        """[nseg, J]: elements of each segment at or above each of its ``J`` thresholds
        (``ordered``: each row ascending already; else sorted here and counted back)."""
        sthr, order = (thr, None) if ordered else thr.sort(dim=1)
        pos, j = self._levels(keys, sthr)
        # The elements of a segment hit its J + 1 bins, one cache line: spread over _LANES
        # copies (element i into copy i % _LANES, a whole table apart) so that the atomic
        # adds of a warp land on different lines instead of queueing on one.
        nb = self.nseg * (j + 1)
        lane = torch.arange(pos.numel(), dtype=torch.int32, device=self.device)
        lane.bitwise_and_(_LANES - 1)
        ones = torch.ones(1, dtype=torch.int64, device=self.device).expand(pos.numel())
        hist = torch.zeros(_LANES * nb, dtype=torch.int64, device=self.device)
        hist.index_add_(0, lane.mul_(nb).add_(pos), ones)
        hist = hist.view(_LANES, nb).sum(0)
        suffix = hist.view(self.nseg, j + 1).flip(1).cumsum(1).flip(1)[:, 1:]
        return suffix if order is None else torch.empty_like(suffix).scatter_(1, order, suffix)

    def _full(self, sparse_thr: torch.Tensor) -> torch.Tensor:
        """[S, J] thresholds of the compressed segments -> [nseg, J], fillers unreachable."""
        out = torch.full(
            (self.nseg, sparse_thr.shape[1]), _NONE, dtype=torch.int64, device=self.device
        )
        return out.index_copy_(0, self.sparse, sparse_thr)

    # -- one step -----------------------------------------------------------------------------
    def sample_uniforms(self, gen: torch.Generator) -> torch.Tensor:
        """The step's random draws (CPU ``gen``), on the device: one per segment (its stride's
        start) when strided, else one per sample."""
        n = len(self.strides) if self.strided else self.sample_base.numel()
        u = torch.rand(n, generator=gen, dtype=torch.float64)
        if self.device.type == "cuda":  # pinned (cached by torch): the copy does not block
            u = u.pin_memory()
        return u.to(self.device, non_blocking=True)

    def select(
        self,
        x: torch.Tensor,
        u: torch.Tensor,
        upper: float,
        lower: float,
        iters: int,
        resample: bool,
    ) -> torch.Tensor:
        """Indices (into the buffer ``x``, fp32, ``length`` elements) of every segment's
        selection, ``self.total`` of them, segment after segment, ascending, padded with -1.
        ``u``: :meth:`sample_uniforms`. On CUDA :meth:`select_multi` (a fixed number of
        launches), elsewhere :meth:`select_reference` (a loop over the segments: without
        launches to save, the loop and its early stops cost less); the same results."""
        fn = self.select_multi if x.is_cuda else self.select_reference
        return fn(x, u, upper, lower, iters, resample)

    def select_reference(
        self,
        x: torch.Tensor,
        u: torch.Tensor,
        upper: float,
        lower: float,
        iters: int,
        resample: bool,
    ) -> torch.Tensor:
        """:meth:`select` segment by segment, as DGC's reference code runs it (the loop
        counts, and stops, on the host)."""
        out = torch.full((self.total,), -1, dtype=torch.int64, device=x.device)
        up = torch.tensor(upper, dtype=torch.float32)
        low = torch.tensor(lower, dtype=torch.float32)
        uc = u.cpu()
        at = first = 0
        for j, ((off, n), (k, m, ks, stride)) in enumerate(zip(self.segments, self.plans)):
            bits = x[off : off + n].abs().view(torch.int32)
            if self.strided or m == n:
                start = int(float(uc[j]) * stride) if self.strided else 0
                samples = bits[start : start + (m - 1) * stride + 1 : stride]
            else:
                samples = bits[(uc[first : first + m] * n).long()]
            first += m  # uniform draws: one per sample of every segment, whole ones too
            thr = int(torch.topk(samples, ks).values[-1])
            c = int((bits >= thr).sum())
            exact = False
            for _ in range(iters if m < n else 0):  # no adaptation when sampled whole
                if c > upper * k:
                    if resample:
                        exact = True
                        break
                    factor = up
                elif c < lower * k:
                    factor = low
                else:
                    break
                t = torch.tensor([thr], dtype=torch.int32).view(torch.float32) * factor
                thr = int(t.view(torch.int32))
                c = int((bits >= thr).sum())
            if exact:  # the exact top-k, ties to the lowest index
                kth = int(torch.topk(bits, k).values[-1])
                equal = bits == kth
                sel = (bits > kth) | (
                    equal & (torch.cumsum(equal, 0) <= k - int((bits > kth).sum()))
                )
            else:
                sel = bits >= thr
            idx = torch.nonzero(sel).reshape(-1)[:k]
            out[at : at + idx.numel()] = idx + off
            at += k
        return out

    def select_multi(
        self,
        x: torch.Tensor,
        u: torch.Tensor,
        upper: float,
        lower: float,
        iters: int,
        resample: bool,
    ) -> torch.Tensor:
        """:meth:`select` over the whole bucket in a fixed number of torch calls, no host
        synchronisation (the module docstring)."""
        dev = self.device
        bits = x.abs().view(torch.int32).long()
        keys = bits + torch.repeat_interleave(self.seg_key, self.seg_len, output_size=self.length)
        # first threshold: the k_s-th largest sample of each segment (one sort of all samples)
        if self.strided:
            starts = (u * self.stride_f).long()
            pos = self.sample_base + starts[self.sample_seg]
        else:
            pos = self.sample_base + (u * self.sample_rand_n).long()
        skeys = (bits[pos] + self.sample_seg_key).sort().values
        thr0 = skeys[self.picks].bitwise_and_(0xFFFFFFFF)
        # fp32 factors: the threshold is an fp32 number scaled in fp32, as in DGC's code
        up = torch.full((), upper, dtype=torch.float32, device=dev)
        low = torch.full((), lower, dtype=torch.float32, device=dev)
        k, upk, lowk = self.kk, self.kf * upper, self.kf * lower

        def f32(b: torch.Tensor) -> torch.Tensor:
            return b.int().view(torch.float32)

        def b64(f: torch.Tensor) -> torch.Tensor:
            return f.view(torch.int32).long()

        exact = None
        if resample or iters == 0:
            chain = [f32(thr0)]
            for _ in range(iters):
                chain.append(chain[-1] * low)
            chain.reverse()  # ascending (fp32 steps down never rise): the last one first
            thr_all = b64(torch.stack(chain, 1))  # [S, iters + 1]
            c = self._counts(keys, self._full(thr_all), True)[self.sparse].double().flip(1)
            thr_all = thr_all.flip(1)
            # the loop walks down the chain while the count is below lower * k: it stops at
            # the first step whose count is not (or runs out at ``iters``)
            stop = c[:, :iters] >= lowk[:, None]
            found = stop.any(1)
            first = stop.int().argmax(1) if iters else torch.zeros_like(k)
            b = torch.where(found & self.adapt, first, torch.where(self.adapt, iters, 0))
            thr = thr_all.gather(1, b[:, None])[:, 0]
            cb = c.gather(1, b[:, None])[:, 0]
            if resample and iters > 0:
                exact = self.adapt & found & (cb > upk)
        else:
            t = f32(thr0)
            active = self.adapt.clone()
            for _ in range(iters):
                c = self._counts(keys, self._full(b64(t)[:, None]), True)[self.sparse, 0].double()
                hi, lo = c > upk, c < lowk
                active &= hi | lo
                t = torch.where(active & hi, t * up, torch.where(active & lo, t * low, t))
            thr = b64(t)
        # the band [b, a) is taken in index order up to `room`; everything >= a is taken
        a = torch.full_like(thr, _NONE)
        room = k
        if exact is not None:
            kth, above = self._kth_largest(keys, k)
            thr = torch.where(exact, kth, thr)
            a = torch.where(exact, kth + 1, a)
            room = torch.where(exact, k - above, k)
        pos, _ = self._levels(keys, self._full(torch.stack([thr, a], 1)))
        seg, lvl = pos // 3, pos % 3
        band = lvl == 1
        room_all = torch.zeros(self.nseg, dtype=torch.int64, device=dev)
        room_all.index_copy_(0, self.sparse, room)
        keep = (lvl == 2) | (band & (self._rank(band, seg) <= room_all[seg]))
        slot = self.out_base[seg] + self._rank(keep, seg) - 1
        slot = torch.where(keep, slot, self.total)
        out = torch.full((self.total + 1,), -1, dtype=torch.int64, device=dev)
        out.scatter_(0, slot, torch.arange(self.length, device=dev))
        return out[: self.total]

    def select_graphed(
        self,
        x: torch.Tensor,
        u: torch.Tensor,
        upper: float,
        lower: float,
        iters: int,
        resample: bool,
    ) -> torch.Tensor:
        """:meth:`select_multi` on CUDA as one graph replay: its ~190 torch calls are captured once
        per (``x``'s address, settings) and replayed on the current stream, so a step costs
        one launch and one copy of ``u`` instead of ~190 launches of host time. ``x`` must
        keep its address (the hook's flat memory does). The result is the graph's output
        buffer, rewritten by the next replay: read it (stream-ordered) before that."""
        key = (x.data_ptr(), x.numel(), upper, lower, iters, resample)
        got = self._graphs.get(key)
        if got is None:
            u_in = u.clone()
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # lazy initialisation happens outside the capture
                self.select_multi(x, u_in, upper, lower, iters, resample)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: DDP's other threads (and NCCL's) may call CUDA meanwhile
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                out = self.select_multi(x, u_in, upper, lower, iters, resample)
            got = self._graphs[key] = (graph, u_in, out)
        graph, u_in, out = got
        u_in.copy_(u, non_blocking=True)
        graph.replay()
        return out

    def _rank(self, mask: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
        """1-based rank of each element among the ``mask`` elements of its segment."""
        cs = torch.cumsum(mask, 0)
        before = torch.cat([cs.new_zeros(1), cs])[self.seg_start]
        return cs - before[seg]

    def _kth_largest(
        self, keys: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per compressed segment: the bits of its k-th largest importance and how many
        importances lie above it (a radix select, one counting pass per digit)."""
        prefix = torch.zeros_like(k)
        above = k
        for shift, width in _RADIX:
            steps = torch.arange(0, (1 << width) + 1, device=self.device) << shift
            c = self._counts(keys, self._full(prefix[:, None] + steps), True)[self.sparse]
            j = (c[:, : 1 << width] >= k[:, None]).sum(1) - 1
            prefix = prefix + (j << shift)
            above = c.gather(1, (j + 1)[:, None])[:, 0]
        return prefix, above
