"""The hook base: :class:`CommHook`, its picklable :class:`HookState`, and what wrappers share.

A factory returns a :class:`CommHook`: ``hook(state, bucket) -> Future[Tensor]`` for
``ddp.register_comm_hook(hook.state, hook)``. Every hook also implements
``reduce(state, bucket, link)``: average ``bucket.buffer()`` in place over ``link`` and return a
future of it. Wrappers (``fp16_compress``, ``nan_check``, ``multi_stream``, ``hierarchical``)
call their inner hooks' ``reduce`` with their child state, so any combination composes and the
whole tree's state is one picklable object. Process groups are never pickled: a loaded state
sets itself up again (cached groups, no new ones) on its first bucket.

Names shared with the hook modules (public inside the package): :class:`Setup`,
:class:`Wrapper`, :func:`check_hook`, :func:`check_coalesce`.
"""

import logging
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from . import _buckets, _futures, _offload, _streams
from ._collectives import Batch, Link, Traffic
from .topology import Topology, topology

__all__ = ["CommHook", "HookState", "Setup", "Wrapper", "check_coalesce", "check_hook"]

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
        # them as one coalesced call (_collectives.Batch). Trees that defer launches ignore it.
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
        self._batch: Batch | None = None  # held allreduces (coalesce > 1)

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
        # Settings a pickled state may lack take their defaults; ``d`` overrides them.
        self.offload = None
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

    def deferring(self, state: HookState) -> bool:
        """Whether this tree, as set up on ``state``, launches collectives from callbacks."""
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
        sub = _buckets.SubBucket(bucket.buffer(), None, bucket, step=state.step - 1)
        sub.wire_ok = True  # our caller is DDP (see _buckets.SubBucket)
        batch = state._batch
        if batch is not None:
            if index == 0 and len(batch):
                batch.drop("the previous step ended before its last bucket")
            sub.batch = batch
            fut = _futures.real(self.reduce(state, sub, state._link))
            # Fixed bucket indices, the same on every rank (see _collectives.Batch).
            if sub.is_last() or (index + 1) % state.coalesce == 0:
                batch.flush()
            return fut
        prev = state._tail if index > 0 else None
        if not state._serial or prev is None or prev.done():
            fut = _futures.real(self.reduce(state, sub, state._link))
        else:
            fut = _futures.after(
                prev,
                _streams.resume(lambda: self.reduce(state, sub, state._link), sub.buffer()),
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
        state._serial = self.deferring(state)
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
        state._batch = Batch() if coalesce > 1 and not state._serial else None
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


def check_hook(fn: str, name: str, hook: Any) -> None:
    if not isinstance(hook, CommHook):
        raise TypeError(f"{fn}: {name} must be an aiak.comm hook, got {type(hook).__name__}")


class Wrapper(CommHook):
    """A hook with one inner hook: setup recurses with the same groups."""

    __slots__ = ("inner",)

    def __init__(self, state: HookState, inner: CommHook) -> None:
        super().__init__(state)
        self.inner = inner

    def setup_tree(self, state: HookState, ctx: Setup) -> None:
        self.inner.setup_tree(state.inner, ctx)

    def deferring(self, state: HookState) -> bool:
        return self.defers or self.inner.deferring(state.inner)

    def syncing(self) -> bool:
        return self.syncs or self.inner.syncing()
