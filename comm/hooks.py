"""Composable DDP communication-hook factories and their picklable states.

A factory returns a :class:`CommHook`: ``hook(state, bucket) -> Future[Tensor]`` for
``ddp.register_comm_hook(hook.state, hook)``. Every hook also implements
``reduce(state, bucket, link)``: average ``bucket.buffer()`` in place over ``link`` and return a
future of it. Wrappers (``fp16_compress``, ``nan_check``, ``multi_stream``, ``hierarchical``)
call their inner hooks' ``reduce`` with their child state, so any combination composes and the
whole tree's state is one picklable object. Process groups are never pickled: a loaded state
sets itself up again (cached groups, no new ones) on its first bucket.
"""

import logging
import math
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from . import _offload, _wire
from ._wire import Link, Traffic
from .topology import Topology, topology

__all__ = [
    "AllreduceState",
    "CastState",
    "CommHook",
    "HookState",
    "MultiStreamState",
    "NanCheckState",
    "allreduce",
    "bf16_compress",
    "fp16_compress",
    "multi_stream",
    "nan_check",
]

logger = logging.getLogger("aiak.comm")


class HookState:
    """Fields every state has; the run-time ones (leading ``_``) are not pickled."""

    __slots__ = (
        "_batch",
        "_link",
        "_names",
        "_ready",
        "_serial",
        "_syncs",
        "_tail",
        "coalesce",
        "log_every",
        "offload",
        "process_group",
        "step",
        "traffic",
    )

    def __init__(self) -> None:
        # set by the user / factories
        self.process_group: Any = None  # None: the default (world) group
        self.log_every = 0  # log this hook tree's bytes every N steps (0: never)
        # Run the hook's Python on aiak's worker thread, off DDP's autograd thread (_offload.py)?
        # None: for CUDA buckets of trees that synchronise the host (nan_check), else inline.
        self.offload: bool | None = None
        # Buckets per collective call: k > 1 holds k consecutive buckets' allreduces and issues
        # them as one coalesced call (_wire.Batch). Trees that defer launches ignore it.
        self.coalesce = 1
        # statistics
        self.step = 0
        self.traffic = Traffic()
        # run time, rebuilt by setup
        self._link: Link | None = None
        self._names: Mapping[Any, str] = {}
        self._ready = False
        self._serial = False  # buckets one after another (a hook of the tree defers launches)
        self._syncs = False  # a hook of the tree waits for the GPU on the host (nan_check)
        self._tail: torch.futures.Future | None = None  # the previous bucket's future
        self._batch: _wire.Batch | None = None  # held allreduces (coalesce > 1)

    def children(self) -> tuple["HookState", ...]:
        return ()

    def bytes_sent(self) -> dict[str, int]:
        """Bytes this rank sent in the current (last) step and in total, summed over the tree."""
        out = dict.fromkeys(("intra", "inter", "intra_total", "inter_total"), 0)
        stack: list[HookState] = [self]
        while stack:
            s = stack.pop()
            for k in out:
                out[k] += getattr(s.traffic, k)
            stack.extend(s.children())
        return out

    def _new_step(self) -> None:
        self.traffic.new_step()
        for c in self.children():
            c._new_step()

    def release(self) -> None:
        """Drop this state's run-time fields: process groups, links, pending futures, caches.

        The settings and statistics stay; the next bucket (or ``register``) sets it up again.
        ``aiak.comm.shutdown`` calls it on every state of a tree before the groups are destroyed.
        """
        self.__setstate__(self.__getstate__())

    def _slots(self) -> list[str]:
        return [n for cls in type(self).__mro__ for n in getattr(cls, "__slots__", ())]

    def __getstate__(self) -> dict[str, Any]:
        # Process groups cannot be pickled: dropped here, the world group is used after load
        # and subgroups are set up again (from the per-process cache) on the first bucket.
        skip = ("process_group",)
        return {n: getattr(self, n) for n in self._slots() if n[0] != "_" and n not in skip}

    def __setstate__(self, d: Mapping[str, Any]) -> None:
        for n in self._slots():
            if n.startswith("_") or n == "process_group":
                setattr(self, n, None)
        self._names, self._ready, self._serial, self._syncs = {}, False, False, False
        self.offload = None  # states pickled before these settings existed
        self.coalesce = 1
        for n, v in d.items():
            setattr(self, n, v)

    def __repr__(self) -> str:
        fields = ", ".join(f"{n}={getattr(self, n)!r}" for n in self._slots() if n[0] != "_")
        return f"{type(self).__name__}({fields})"


def check_coalesce(where: str, value: Any) -> int:
    """``value`` when it is a valid ``coalesce`` (an int >= 1), else a ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: coalesce must be an int >= 1, got {value!r}")
    return value


class Setup:
    """What a hook tree needs once before its first bucket: topology, candidate groups, names."""

    __slots__ = ("candidates", "mine", "names", "topo")

    def __init__(
        self, topo: Topology, candidates: list[tuple[int, ...]], mine: int, names: Mapping[Any, str]
    ) -> None:
        # ``candidates``: every group this hook may be called on across the world (identical on
        # all ranks, so collective group creation matches); ``mine`` indexes ours.
        self.topo, self.candidates, self.mine, self.names = topo, candidates, mine, names

    def below(self, candidates: list[tuple[int, ...]], mine: int) -> "Setup":
        return Setup(self.topo, candidates, mine, self.names)


class CommHook:
    """Base of every hook. Subclasses implement ``reduce`` and, if they wrap, ``setup_tree``."""

    __slots__ = ("state",)
    # True when the hook launches collectives from future callbacks. Their order could then
    # differ between ranks when several buckets are in flight, and gloo/NCCL match collectives
    # by order; so such a tree runs its buckets one after another (still overlapped with the
    # backward pass). Only the bottleneck link is busy either way.
    defers = False
    # True when the hook waits for the GPU on the host (nan_check reads a flag per bucket). On
    # DDP's autograd thread that wait stalls the launches of the next layers' backward, so such
    # trees run on aiak's worker thread by default on CUDA. Others stay inline: on 2 x H200 the
    # worker's thread hand-offs cost more than their Python (12 x Linear(4096), interleaved:
    # fp16 +0.48 ms offloaded vs +0.26 inline; nan_check +1.75 vs +2.35).
    syncs = False

    def __init__(self, state: HookState) -> None:
        self.state = state

    def deferring(self) -> bool:
        return self.defers

    def syncing(self) -> bool:
        return self.syncs

    def __getattr__(self, name: str) -> str:
        # DDP's register_comm_hook reads hook.__name__ and __qualname__, which only functions
        # have; a class attribute named so would rename the class itself.
        if name in ("__name__", "__qualname__"):
            return f"aiak_{type(self).__name__.lstrip('_').lower()}"
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __call__(
        self, state: HookState, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        if not state._ready:
            self.setup(state)
        offload = state.offload
        if offload is None:
            offload = state._syncs and bucket.buffer().is_cuda
        if offload:
            return _offload.submit(lambda b: self.run(state, b), bucket)
        return self.run(state, bucket)

    def run(self, state: HookState, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        """The hook itself, on the calling thread (``__call__`` may hand it to the worker)."""
        if not state._ready:
            self.setup(state)
        index = bucket.index()
        if index == 0:
            if state.log_every and state.step and state.step % state.log_every == 0:
                b = state.bytes_sent()
                logger.info(
                    "step %d: sent %d B intra-node, %d B inter-node",
                    state.step,
                    b["intra"],
                    b["inter"],
                )
            state._new_step()
            state.step += 1
        sub = _wire.SubBucket(bucket.buffer(), None, bucket, step=state.step - 1)
        sub.wire_ok = True  # our caller is DDP (see _wire.SubBucket)
        batch = state._batch
        if batch is not None:
            if index == 0 and len(batch):
                batch.drop("the previous step ended before its last bucket")
            sub.batch = batch
            fut = _wire.real(self.reduce(state, sub, state._link))
            # Fixed bucket indices, the same on every rank (see _wire.Batch).
            if sub.is_last() or (index + 1) % state.coalesce == 0:
                batch.flush()
            return fut
        prev = state._tail if index > 0 else None
        if not state._serial or prev is None or prev.done():
            fut = _wire.real(self.reduce(state, sub, state._link))
        else:
            fut = _wire.after(
                prev,
                _wire.resume(lambda: self.reduce(state, sub, state._link), sub.buffer()),
                sub.buffer(),
                chain=True,
            )
        state._tail = fut
        return fut

    def setup(
        self,
        state: HookState | None = None,
        process_group: Any = None,
        names: Mapping[Any, str] | None = None,
    ) -> HookState:
        """Detect the topology and create the groups this tree needs (collective; once).

        Called by :func:`aiak.comm.register` before training, or lazily on the first bucket.
        """
        state = self.state if state is None else state
        if process_group is not None and process_group is not dist.group.WORLD:
            state.process_group = process_group
        pg = state.process_group if state.process_group is not None else dist.group.WORLD
        topo = topology()
        ranks = tuple(dist.get_process_group_ranks(pg))
        state._link = topo.link(ranks, group=pg)
        state._names = names if names is not None else state._names
        self.setup_tree(state, Setup(topo, [ranks], 0, state._names))
        state._serial = self.deferring()
        state._syncs = self.syncing()
        state._tail = None
        coalesce = check_coalesce("aiak.comm", state.coalesce)
        if coalesce > 1 and state._serial:
            # Such trees launch from callbacks, at times that differ between ranks; holding
            # their allreduces could pair different buckets on different ranks.
            warnings.warn(
                f"aiak.comm: coalesce={coalesce} is ignored by {type(self).__name__.lstrip('_')}"
                " trees (they launch collectives from callbacks)",
                RuntimeWarning,
                stacklevel=2,
            )
        state._batch = _wire.Batch() if coalesce > 1 and not state._serial else None
        state._ready = True
        return state

    def setup_tree(self, state: HookState, ctx: Setup) -> None:
        """Prepare this hook for the groups in ``ctx``; wrappers recurse into their inner hook."""

    def reduce(self, state: HookState, bucket: Any, link: Link) -> torch.futures.Future:
        raise NotImplementedError

    # Codec interface used by ``hierarchical`` for its intra-node stage (identity here).
    def encode(self, state: HookState, t: torch.Tensor, length: int) -> torch.Tensor:
        if length == t.numel():
            return t
        out = t.new_zeros(length)
        out[: t.numel()] = t
        return out

    def decode_(self, state: HookState, wire: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if wire.data_ptr() != out.data_ptr():
            out.copy_(wire[: out.numel()])
        return out


def _check_hook(fn: str, name: str, hook: Any) -> None:
    if not isinstance(hook, CommHook):
        raise TypeError(f"{fn}: {name} must be an aiak.comm hook, got {type(hook).__name__}")


class _Wrapper(CommHook):
    """A hook with one inner hook: setup recurses with the same groups."""

    __slots__ = ("inner",)

    def __init__(self, state: HookState, inner: CommHook) -> None:
        super().__init__(state)
        self.inner = inner

    def setup_tree(self, state: HookState, ctx: Setup) -> None:
        self.inner.setup_tree(state.inner, ctx)

    def deferring(self) -> bool:
        return self.defers or self.inner.deferring()

    def syncing(self) -> bool:
        return self.syncs or self.inner.syncing()


# ------------------------------------------------------------------------------------------
# allreduce
# ------------------------------------------------------------------------------------------


class AllreduceState(HookState):
    __slots__ = ()


class _Allreduce(CommHook):
    __slots__ = ()

    def reduce(self, state: HookState, bucket: Any, link: Link) -> torch.futures.Future:
        batch = getattr(bucket, "batch", None)
        return _wire.all_reduce_mean(bucket.buffer(), link, state.traffic, batch)


def allreduce() -> CommHook:
    """Plain averaging allreduce (what DDP does without a hook), with byte accounting."""
    return _Allreduce(AllreduceState())


# ------------------------------------------------------------------------------------------
# fp16 / bf16 compression
# ------------------------------------------------------------------------------------------


class CastState(HookState):
    __slots__ = ("_unscale", "dtype", "inner", "scale")

    def __init__(self, dtype: torch.dtype, scale: float, inner: HookState) -> None:
        super().__init__()
        self.dtype = dtype
        self.scale = scale  # Perseus's gradient scale: x*scale before the cast, /scale after
        self.inner = inner
        # run time, like every ``_`` field: None until first use and again after unpickling
        self._unscale: dict[torch.device, torch.Tensor] | None = None

    def children(self) -> tuple[HookState, ...]:
        return (self.inner,)

    def unscale_factor(self, device: torch.device) -> torch.Tensor:
        """``1/scale`` as a one-element fp32 tensor, made once per device (see ``_Cast``)."""
        cache = self._unscale
        if cache is None:
            cache = self._unscale = {}
        t = cache.get(device)
        if t is None:
            t = cache[device] = torch.full((1,), 1.0 / self.scale, device=device)
        return t


class _Cast(_Wrapper):
    """Cast to ``dtype`` for the wire and back, with Perseus's gradient scale.

    Both directions compute in fp32 and round once: ``scale`` must lift small values before
    the cast to fp16, and ``1/scale`` must apply to the widened value, not to an fp16 product
    (which would round and flush what ``scale`` saved). Each direction is one torch kernel:
    encode ``mul(src_fp32, scale, out=wire)``; decode ``mul(wire, factor, out=dst)`` with the
    factor a one-element fp32 *tensor*, which makes the op compute in fp32.

    Why not aiak's kernels. ``aiak::cast_scale_`` does the same in one vectorised pass and
    saves GPU time (64 MB bucket on H200: encode 26 vs 32 µs, decode 39 vs 61 µs;
    benchmarks/bench_cast_scale.py), but its launch from Python costs the host 27 µs against
    8 µs for the torch op, and DDP calls hooks on its host-bound autograd thread: on 2 x H200
    the 12 x Linear(4096) step took +6.9 ms over no hook with it, +4.0 ms with torch ops, in
    one interleaved run (2026-11-23). ``aiak::multi_tensor_scale_`` keys its device tables by
    addresses, and a fresh wire buffer per bucket missed that cache on every call (1261 vs
    432 µs of host time per bucket, step +17.5 ms).
    """

    __slots__ = ()

    def encode(self, state: CastState, t: torch.Tensor, length: int) -> torch.Tensor:
        wire = torch.empty(length, dtype=state.dtype, device=t.device)
        n = t.numel()
        body = wire if length == n else wire[:n]  # each slice is host time (per bucket)
        flat = t if t.dim() == 1 else t.reshape(-1)  # bucket buffers are flat already
        if state.scale == 1.0:
            body.copy_(flat)
        else:
            torch.mul(flat, state.scale, out=body)
        if length > n:
            wire[n:].zero_()
        return wire

    def decode_(self, state: CastState, wire: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        n = out.numel()
        src = wire if wire.numel() == n else wire[:n]
        if out.dim() != 1:  # bucket buffers are flat: no view (host time per bucket)
            src = src.view(out.shape)
        if state.scale == 1.0:
            out.copy_(src)
        elif out.is_contiguous():
            torch.mul(src, state.unscale_factor(out.device), out=out)
        else:  # not produced by our hooks (buffers are flat); keep it simple and correct
            out.copy_(src).mul_(1.0 / state.scale)
        return out

    def reduce(self, state: CastState, bucket: Any, link: Link) -> torch.futures.Future:
        buf = bucket.buffer()
        if buf.dtype == state.dtype:  # already narrow (AMP O2 gradients): nothing to compress
            return self.inner.reduce(state.inner, bucket, link)
        wire = self.encode(state, buf, buf.numel())
        fut = self.inner.reduce(state.inner, _wire.rebase(bucket, wire), link)
        if state.scale == 1.0 and getattr(bucket, "wire_ok", False):
            # The averaged wire goes back to DDP as it is: DDP copies every bucket's result
            # into the gradients anyway, and that copy casts. No decode launch and no decode
            # pass (64 MB bucket on H200: 60-70 µs of GPU time); host per bucket on the H100
            # machine 45-53 µs against 66-76 µs with a scale (profile_comm_host.py).
            return fut

        def decode(_: Any) -> torch.Tensor:
            _wire.keep(wire)  # read on this callback's stream, freed when we return
            return self.decode_(state, wire, buf)

        return _wire.after(fut, decode, buf)


def _cast_hook(fn: str, dtype: torch.dtype, inner: CommHook | None, scale: float) -> CommHook:
    inner = allreduce() if inner is None else inner
    _check_hook(fn, "inner", inner)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{fn}: scale must be a number, got {type(scale).__name__}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{fn}: scale must be finite and > 0, got {scale}")
    return _Cast(CastState(dtype, float(scale), inner.state), inner)


def fp16_compress(inner: CommHook | None = None, scale: float = 1.0) -> CommHook:
    """Send gradients as fp16 through ``inner`` (default: allreduce).

    ``scale`` multiplies before the cast and divides after it (Perseus's gradient scale, 10 by
    default there) so that small gradients do not flush to zero in fp16.

    Called by DDP with ``scale=1`` (the default), the hook's future carries the averaged fp16
    wire itself: DDP copies every bucket's result into the gradients and that copy casts, so
    no decode pass is needed (the gradients stay fp32). Inside another hook, or with a scale,
    the result is decoded into the bucket's own buffer.
    """
    return _cast_hook("fp16_compress", torch.float16, inner, scale)


def bf16_compress(inner: CommHook | None = None, scale: float = 1.0) -> CommHook:
    """Send gradients as bf16 through ``inner``; fp32's range, so ``scale`` is rarely needed.

    As :func:`fp16_compress`: at ``scale=1`` DDP receives the bf16 wire and casts it back.
    """
    return _cast_hook("bf16_compress", torch.bfloat16, inner, scale)


# ------------------------------------------------------------------------------------------
# NaN / Inf check
# ------------------------------------------------------------------------------------------


class NanCheckState(HookState):
    __slots__ = ("action", "inner", "skipped")

    def __init__(self, action: str, inner: HookState) -> None:
        super().__init__()
        self.action = action
        self.inner = inner
        self.skipped = 0  # buckets whose non-finite gradients were zeroed (action="skip")

    def children(self) -> tuple[HookState, ...]:
        return (self.inner,)


class _NanCheck(_Wrapper):
    __slots__ = ("_names",)
    syncs = True  # reads a non-finite flag on the host per bucket

    def setup_tree(self, state: HookState, ctx: Setup) -> None:
        self._names = ctx.names
        super().setup_tree(state, ctx)

    def reduce(self, state: NanCheckState, bucket: Any, link: Link) -> torch.futures.Future:
        buf = bucket.buffer()
        # One host sync per bucket: the price of knowing before anything is sent.
        if not bool(torch.isfinite(buf).all()):
            names = getattr(self, "_names", None) or {}
            params = list(bucket.parameters())
            bad = []
            for i, g in enumerate(bucket.gradients()):
                if not bool(torch.isfinite(g).all()):
                    p = params[i] if i < len(params) else None
                    bad.append(
                        names.get(p, f"#{i} {tuple(g.shape)}")
                        if p is not None
                        else f"view #{i} {tuple(g.shape)}"
                    )
                    if state.action == "skip":
                        g.zero_()
            rank = dist.get_rank() if dist.is_initialized() else 0
            msg = (
                f"aiak.comm.nan_check: rank {rank}: non-finite gradients in bucket "
                f"{bucket.index()} before communication: parameters {bad}"
            )
            if state.action == "raise":
                raise FloatingPointError(msg)
            state.skipped += 1
            warnings.warn(msg + " (zeroed on this rank)", RuntimeWarning, stacklevel=2)
        return self.inner.reduce(state.inner, bucket, link)


def nan_check(inner: CommHook | None = None, action: str = "raise") -> CommHook:
    """Check gradients for NaN/Inf before ``inner`` sends them.

    ``action="raise"``: ``FloatingPointError`` naming the rank and the parameters (the peers
    then fail at their collective timeout). ``"skip"``: this rank's non-finite gradients are
    zeroed (its share of the average is 0), a warning names them, ``state.skipped`` counts.
    """
    inner = allreduce() if inner is None else inner
    _check_hook("nan_check", "inner", inner)
    if action not in ("raise", "skip"):
        raise ValueError(f"nan_check: action must be 'raise' or 'skip', got {action!r}")
    return _NanCheck(NanCheckState(action, inner.state), inner)


# ------------------------------------------------------------------------------------------
# Multi-stream: buckets round-robin over k process groups
# ------------------------------------------------------------------------------------------


class MultiStreamState(HookState):
    __slots__ = ("_links", "inner", "streams")

    def __init__(self, streams: int, inner: HookState) -> None:
        super().__init__()
        self.streams = streams
        self.inner = inner
        self._links: list[Link] | None = None

    def children(self) -> tuple[HookState, ...]:
        return (self.inner,)


class _MultiStream(_Wrapper):
    __slots__ = ()

    def setup_tree(self, state: MultiStreamState, ctx: Setup) -> None:
        # Every rank creates the copies of every candidate group, in the same order.
        for ranks in ctx.candidates:
            for c in range(1, state.streams):
                ctx.topo.group(ranks, c)
        mine = ctx.candidates[ctx.mine]
        state._links = [ctx.topo.link(mine, c) for c in range(1, state.streams)]
        super().setup_tree(state, ctx)

    def reduce(self, state: MultiStreamState, bucket: Any, link: Link) -> torch.futures.Future:
        k = bucket.index() % state.streams
        if k and state._links and state._links[k - 1].ranks == link.ranks:
            link = state._links[k - 1]
        return self.inner.reduce(state.inner, bucket, link)


def multi_stream(inner: CommHook | None = None, streams: int = 2) -> CommHook:
    """Spread buckets round-robin over ``streams`` process groups (copies of the caller's).

    Each group has its own NCCL stream or gloo connections, so buckets are in flight together.
    """
    inner = allreduce() if inner is None else inner
    _check_hook("multi_stream", "inner", inner)
    if isinstance(streams, bool) or not isinstance(streams, int):
        raise TypeError(f"multi_stream: streams must be an int, got {type(streams).__name__}")
    if not 1 <= streams <= 12:
        raise ValueError(f"multi_stream: streams must be in 1..12, got {streams}")
    return _MultiStream(MultiStreamState(streams, inner.state), inner)
