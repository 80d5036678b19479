"""aiak-advise's instrumentation inside each training process (the worker side).

``aiak-advise`` starts the job through ``aiakrun`` with a start-up folder of its own on
PYTHONPATH; its ``sitecustomize`` calls :func:`boot`, which waits for ``import torch`` (after
aiak's own activation) and then installs the probe. The probe times, per optimizer step:

- data: time in the ``DataLoader``'s ``iter()`` and ``next()`` (``iter()`` and the first batch
  of each pass are the epoch-start wait);
- forward: time in the forward of the modules called at top level (found during warm-up with
  global module hooks, then timed with hooks on those modules only);
- backward: time in ``torch.autograd.backward``; comm: inside it, the time the backward's thread
  spends in the DDP comm hook plus the wait from the last bucket's hook to its future's result
  (the communication the backward did not hide);
- optimizer: time in ``step()`` (torch's global optimizer step hooks); a step ends when the
  first optimizer seen finishes its ``step()``.

One warm-up step runs under a dispatch mode that counts the ops of each phase (and the casts
and fp32 elements O2 would change, and window attention's score elements); the host cost of
an op with no work is calibrated at the end, so ``ops x cost`` is the host's share of a phase.
With CUDA, the compute stream is sampled at each phase boundary: an empty queue while Python
runs is the GPU waiting for the host. With CUDA each measured step also records an event at
each phase boundary, read once the GPU has passed it: the phases on the GPU's clock, where a
host blocked in a sync (``.item()``) does not move the GPU's work into the loop's "other". The
comm hooks record events too: on that clock the exposed comm is the hooks' own intervals plus
the span from the last hook's call (every gradient computed) to the backward's end (the compute
stream waiting for the communication), which NCCL, queued by the host, hides from the host.
After ``AIAK_ADVISE_WARMUP`` + ``AIAK_ADVISE_STEPS`` steps (or ``AIAK_ADVISE_SECONDS``), each
rank writes ``rank<R>.json`` to ``AIAK_ADVISE_DIR``,
stops its data-loader workers and exits with status 0; a script that ends first writes what it
has at exit. DDP models with no comm hook get torch's ``allreduce_hook`` (wrapped by the timer)
at their first forward: the buckets are then visible to the probe.

``AIAK_ADVISE_TRY=cross-epoch-loader`` (``aiak-advise --verify`` only) serves each
``DataLoader`` with workers through ``aiak.data.CrossEpochLoader``: the object the recommended
code line builds, applied here so the trial needs no change to the user's files. ``o2`` and
``swin-convert`` apply ``aiak.amp.decorate(model, optimizer)`` (with ``aiak.amp.install()``) and
``aiak.ops.swin.convert(model)`` at the model's first forward.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
import weakref
from typing import Any

from aiak.launch import _advise_work
from aiak.launch._advise_facts import (
    autocast_of,
    length,
    optimizer_facts,
    stepped_by_grad_scaler,
    window_attention_modules,
)

__all__ = ["boot", "install", "uninstall"]

_ENV_DIR = "AIAK_ADVISE_DIR"
_ENV_OWNER = "AIAK_ADVISE_OWNER"


def _int_env(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    return int(raw) if raw else default


class _Phase:
    """Which phase the main thread is in (for the op counter); nested phases restore."""

    name = "other"


class _Probe:
    def __init__(self, out_dir: str) -> None:
        import torch

        self.torch = torch
        self.out_dir = out_dir
        self.rank = int(os.environ.get("RANK", "0"))
        self.warmup = max(2, _int_env("AIAK_ADVISE_WARMUP", 5))
        self.steps = max(1, _int_env("AIAK_ADVISE_STEPS", 30))
        raw = os.environ.get("AIAK_ADVISE_SECONDS", "").strip()
        self.seconds = float(raw) if raw else 0.0
        self.trials = {t for t in os.environ.get("AIAK_ADVISE_TRY", "").split(",") if t}
        self.step = 0  # optimizer steps finished
        self.stop_at: int | None = None
        self.measure_start = 0.0
        self.mark = time.perf_counter()  # the end of the previous step
        self.cur = self._blank()
        self.records: list[dict[str, float]] = []
        self.facts: dict[str, Any] = {"loaders": [], "ddp": []}
        self.primary: int | None = None  # id of the optimizer whose step() ends a step
        self.opt_t0: float | None = None
        self.opt_ev: Any = None
        self.fwd_depth = 0
        self.fwd_t0 = 0.0
        self.fwd_ev: Any = None
        self.roots: dict[int, Any] = {}
        self.global_hooks: list[Any] = []
        self.undo: list[Any] = []  # what uninstall() calls, last first
        self.iters: Any = weakref.WeakSet()  # live data-loader iterators (to stop workers)
        self.cross_epoch: list[Any] = []
        self.counter: Any = None
        self.ops = {"data": 0, "forward": 0, "backward": 0, "optimizer": 0, "other": 0}
        self.work = {k: [0, 0] for k in self.ops}  # phase -> [elements written, multiply-adds]
        self.cuda = False
        self.samples = [0, 0]  # [boundaries sampled, of which the stream was empty]
        self.opt_samples = [0, 0]  # the same at the optimizer's start (after any sync)
        # the GPU's clock (CUDA): events at the phase boundaries of the measured steps
        self.new_event: Any = None  # () -> a timing CUDA event, once the model is on CUDA
        self.event_pool: list[Any] = []
        self.gpu_cur: list[tuple[str, Any, Any]] = []  # (phase, start, end) of this step
        self.gpu_prev_end: Any = None  # the previous step's end event
        self.gpu_pending: list[tuple[dict[str, Any], list[Any], Any, Any]] = []
        self.amp = {k: [0, 0, 0] for k in self.ops}  # phase -> precision() sums
        self.weights: set[int] = set()  # data_ptr of the primary optimizer's fp32 params
        self.primary_ref: Any = None
        self.attn_hooks: list[Any] = []
        self.attn_scores = 0  # window attention's score elements (B_ x heads x N^2), forward
        self.optimizers: Any = weakref.WeakSet()  # built while a trial needs them
        self.trials_done: dict[str, str] = {}  # trial -> "applied" or why not
        self.written = False
        self.exit = os._exit  # how a rank ends after its last measured step
        self.buckets: dict[int, int] = {}  # bucket index -> bytes (this step)
        self.last_hook_end = 0.0
        self.last_future = 0.0
        self.comm_hook = 0.0
        # (start, end) events around each comm-hook call of this backward (the GPU's clock)
        self.hook_events: list[tuple[Any, Any]] = []

    @staticmethod
    def _blank() -> dict[str, float]:
        return dict.fromkeys(
            ("data", "data_epoch_start", "forward", "backward", "comm", "optimizer"), 0.0
        )

    # -- boundaries ---------------------------------------------------------------------------

    def sample_stream(self) -> None:
        if not self.cuda:
            return
        self.samples[0] += 1
        if self.torch.cuda.current_stream().query():
            self.samples[1] += 1

    def sample_opt(self) -> None:
        """The queue at the optimizer's start: empty there in most steps means the host just
        waited for the GPU (GradScaler.step's ``.item()``) and the GPU now waits for the
        optimizer's host code."""
        if not self.cuda:
            return
        self.opt_samples[0] += 1
        if self.torch.cuda.current_stream().query():
            self.opt_samples[1] += 1

    def measuring(self) -> bool:
        return self.step >= self.warmup

    # -- the GPU's clock ----------------------------------------------------------------------

    def event(self) -> Any:
        """A timing event recorded on the current stream now; read events are used again."""
        ev = self.event_pool.pop() if self.event_pool else self.new_event()
        ev.record()
        return ev

    def gpu_mark(self) -> Any:
        """An event recorded now (measured steps on CUDA), else None."""
        if self.new_event is None or self.step < self.warmup:
            return None
        return self.event()

    def gpu_phase(self, phase: str, start: Any) -> None:
        """``phase`` ran from ``start`` to now, on the GPU's clock."""
        if start is None:
            return
        self.gpu_cur.append((phase, start, self.event()))

    def read_gpu(self, block: bool) -> None:
        """Turn the events of finished steps into each record's ``gpu`` phases; without
        ``block`` only the steps the GPU has passed (``query()`` does not synchronise)."""
        while self.gpu_pending:
            rec, phases, start, end = self.gpu_pending[0]
            if not block and not end.query():
                return
            self.gpu_pending.pop(0)
            gpu = dict.fromkeys(("data", "data_epoch_start", "forward", "backward"), 0.0)
            gpu["optimizer"] = gpu["comm"] = 0.0
            for phase, a, b in phases:
                gpu[phase] += a.elapsed_time(b) / 1e3
            gpu["step"] = start.elapsed_time(end) / 1e3
            rec["gpu"] = gpu
            # this step's events and its start (the previous step's end) are free again
            self.event_pool.extend({id(e): e for _, a, b in phases for e in (a, b)}.values())
            self.event_pool.append(start)

    # -- data ---------------------------------------------------------------------------------

    def timed_iter(self, loader: Any, make: Any) -> Any:
        t0 = time.perf_counter()
        ev = self.gpu_mark()
        _Phase.name = "data"
        inner = make()
        _Phase.name = "other"
        it = _TimedIter(self, inner, time.perf_counter() - t0, ev)
        self.iters.add(it)
        if not any(f["id"] == id(loader) for f in self.facts["loaders"]):
            self.facts["loaders"].append(
                {
                    "id": id(loader),
                    "num_workers": int(getattr(loader, "num_workers", 0)),
                    "persistent_workers": bool(getattr(loader, "persistent_workers", False)),
                    "pin_memory": bool(getattr(loader, "pin_memory", False)),
                    "batches": length(loader),
                    "map_style": not isinstance(
                        getattr(loader, "dataset", None), self.torch.utils.data.IterableDataset
                    ),
                    "cross_epoch_trial": "cross-epoch-loader" in self.trials,
                }
            )
        return it

    def add_data(self, seconds: float, epoch_start: bool, gpu_start: Any = None) -> None:
        self.cur["data"] += seconds
        if epoch_start:
            self.cur["data_epoch_start"] += seconds
        if gpu_start is not None:
            end = self.event()
            self.gpu_cur.append(("data", gpu_start, end))
            if epoch_start:
                self.gpu_cur.append(("data_epoch_start", gpu_start, end))
        self.sample_stream()

    # -- forward ------------------------------------------------------------------------------

    def fwd_pre(self, module: Any, args: Any) -> None:
        if self.fwd_depth == 0:
            if self.global_hooks:
                self.roots.setdefault(id(module), module)
                if self.trials and self.step == 0:
                    self.apply_trials(module)
            elif "autocast" not in self.facts:
                self.facts["autocast"] = autocast_of(self.torch)
            self.fwd_t0 = time.perf_counter()
            self.fwd_ev = self.gpu_mark()
            _Phase.name = "forward"
        self.fwd_depth += 1

    def fwd_post(self, module: Any, args: Any, out: Any) -> None:
        self.fwd_depth = max(0, self.fwd_depth - 1)
        if self.fwd_depth == 0:
            self.cur["forward"] += time.perf_counter() - self.fwd_t0
            self.gpu_phase("forward", self.fwd_ev)
            _Phase.name = "other"
            self.sample_stream()

    def roots_only(self) -> None:
        """After warm-up: hooks on the top-level modules only, not on every module call."""
        for h in self.global_hooks:
            h.remove()
        self.global_hooks = []
        for m in self.roots.values():
            self.undo.append(m.register_forward_pre_hook(self.fwd_pre).remove)
            self.undo.append(m.register_forward_hook(self.fwd_post).remove)
        self.facts["forward_roots"] = sorted({type(m).__name__ for m in self.roots.values()})
        todo, fused, dropout = window_attention_modules(self.roots.values())
        if todo or fused or dropout:
            self.facts["window_attention"] = {
                "modules": len(todo),
                # timm's fused_attn: the core is SDPA with the bias + mask materialised
                "sdpa": sum(bool(getattr(m, "fused_attn", False)) for m in todo),
                "fused": fused,
                "dropout": dropout,
                "scores": 0,
            }

    # -- backward and comm --------------------------------------------------------------------

    def backward(self, run: Any) -> Any:
        t0 = time.perf_counter()
        ev = self.gpu_mark()
        self.buckets.clear()
        self.last_hook_end = self.last_future = self.comm_hook = 0.0
        # hooks called outside a backward leave events nobody reads: recorded again later
        self.event_pool.extend(e for pair in self.hook_events for e in pair)
        self.hook_events = []
        _Phase.name = "backward"
        try:
            return run()
        finally:
            end = time.perf_counter()
            if ev is not None:
                self.gpu_backward(ev)
            _Phase.name = "other"
            self.cur["backward"] += end - t0
            if self.buckets:
                tail = max(0.0, min(end, self.last_future) - self.last_hook_end)
                self.cur["comm"] += self.comm_hook + tail
                self.facts["buckets"] = len(self.buckets)
                self.facts["grad_bytes"] = sum(self.buckets.values())
            self.sample_stream()

    def gpu_backward(self, start: Any) -> None:
        """The backward's interval on the GPU's clock, and inside it the exposed comm: each
        comm hook's own interval (its work on the compute stream: casts, compression), and
        from the last hook's call to the backward's end. DDP calls the hooks in bucket order,
        the last once every gradient is computed; its backward then ends with the compute
        stream waiting for every bucket's communication (the futures DDP waits for), so that
        last interval is the communication the backward's work did not cover, however the
        backend runs it (NCCL on its own stream, while the host only queues it)."""
        end = self.event()
        self.gpu_cur.append(("backward", start, end))
        if not self.hook_events:
            return
        *covered, (last, spare) = self.hook_events
        self.hook_events = []
        self.gpu_cur.extend(("comm", a, b) for a, b in covered)
        self.gpu_cur.append(("comm", last, end))
        self.event_pool.append(spare)  # recorded, never read: free to record again

    def timed_hook(self, hook: Any) -> Any:
        probe = self

        # No annotations: DDP accepts a hook whose bucket is unannotated or a GradBucket.
        # It runs on the backward's thread (on CUDA the autograd engine's device thread,
        # whose current stream is the one the gradients are computed on): its events are on
        # the compute stream.
        def advise_timed_hook(state, bucket):
            t0 = time.perf_counter()
            ev = probe.gpu_mark()
            fut = hook(state, bucket)
            if ev is not None:
                probe.hook_events.append((ev, probe.event()))
            t1 = time.perf_counter()
            buf = bucket.buffer()
            probe.buckets[bucket.index()] = buf.numel() * buf.element_size()
            probe.comm_hook += t1 - t0
            probe.last_hook_end = t1

            def done(f: Any) -> Any:
                probe.last_future = max(probe.last_future, time.perf_counter())
                return f.value()

            return fut.then(done)

        advise_timed_hook.__name__ = getattr(hook, "__name__", "hook")
        return advise_timed_hook

    # -- optimizer ----------------------------------------------------------------------------

    def opt_pre(self, opt: Any, args: Any, kwargs: Any) -> None:
        if self.primary is None:
            self.primary = id(opt)
            self.primary_ref = weakref.ref(opt)
            self.facts["optimizer"] = optimizer_facts(opt)
            self.facts["optimizer"]["grad_scaler"] = stepped_by_grad_scaler()
            self.cuda = self.facts["optimizer"]["device"] == "cuda"
            if self.cuda:
                cuda = self.torch.cuda
                self.new_event = lambda: cuda.Event(enable_timing=True)
        if id(opt) == self.primary:
            self.sample_opt()
            self.opt_t0 = time.perf_counter()
            self.opt_ev = self.gpu_mark()
        _Phase.name = "optimizer"

    def opt_post(self, opt: Any, args: Any, kwargs: Any) -> None:
        _Phase.name = "other"
        if id(opt) != self.primary or self.opt_t0 is None:
            return
        now = time.perf_counter()
        self.cur["optimizer"] += now - self.opt_t0
        self.opt_t0 = None
        self.gpu_phase("optimizer", self.opt_ev)
        self.sample_stream()
        self.end_step(now)

    def end_step(self, now: float) -> None:
        rec = self.cur
        rec["step"] = now - self.mark
        self.mark = now
        self.cur = self._blank()
        self.step += 1
        if self.step == 1:
            self.roots_only()
        if self.step > self.warmup:
            self.records.append(rec)
        if self.new_event is not None and self.step >= self.warmup:
            end = self.event()
            if self.step > self.warmup:
                self.gpu_pending.append((rec, self.gpu_cur, self.gpu_prev_end, end))
            self.gpu_prev_end = end
            self.gpu_cur = []
            self.read_gpu(block=False)
        if self.counter is not None:
            self.stop_counting()
        if self.step == self.warmup - 1:  # count the ops of the last warm-up step
            self.start_counting()
        if self.step == self.warmup:
            self.measure_start = now
            self.samples = [0, 0]
            self.opt_samples = [0, 0]
        if self.measuring():
            self.check_stop(now)

    def check_stop(self, now: float) -> None:
        done = self.step - self.warmup
        if self.stop_at is None:
            if done >= self.steps:
                self.stop_at = self.step
            elif self.seconds and self.rank == 0 and now - self.measure_start >= self.seconds:
                # Ranks agree on the last step through a file: rank 0 names a step two ahead,
                # which no other rank can have finished (DDP keeps the ranks within one step).
                self.stop_at = self.step + 2
                _write(os.path.join(self.out_dir, "stop"), str(self.stop_at))
            if self.stop_at is None and self.seconds and self.rank != 0:
                path = os.path.join(self.out_dir, "stop")
                if os.path.exists(path):
                    with open(path) as f:
                        self.stop_at = int(f.read())
        if self.stop_at is not None and self.step >= self.stop_at:
            self.finish(complete=True)

    # -- the counted step ---------------------------------------------------------------------

    def start_counting(self) -> None:
        self.ops = dict.fromkeys(self.ops, 0)
        self.work = {k: [0, 0] for k in self.ops}
        self.amp = {k: [0, 0, 0] for k in self.ops}
        opt = self.primary_ref() if self.primary_ref is not None else None
        if opt is not None:
            params = [p for g in opt.param_groups for p in g["params"]]
            ptrs = {_advise_work.storage_ptr(p) for p in params if p.dtype == self.torch.float32}
            self.weights = {x for x in ptrs if x is not None}
        self.attn_scores = 0
        for m in window_attention_modules(self.roots.values())[0]:
            self.attn_hooks.append(m.register_forward_pre_hook(self.count_scores))
        self.counter = _counter(self)
        self.counter.__enter__()

    def stop_counting(self) -> None:
        self.counter.__exit__(None, None, None)
        self.counter = None
        for h in self.attn_hooks:
            h.remove()
        self.attn_hooks = []
        if "window_attention" in self.facts:
            self.facts["window_attention"]["scores"] = self.attn_scores

    def count_scores(self, module: Any, args: Any) -> None:
        """Window attention's score matrix in one call: windows x heads x N x N elements."""
        x = args[0] if args else None
        if isinstance(x, self.torch.Tensor) and x.dim() == 3:
            self.attn_scores += int(x.shape[0]) * int(module.num_heads) * int(x.shape[1]) ** 2

    # -- trials (aiak-advise --verify of a code line) -----------------------------------------

    def apply_trials(self, module: Any) -> None:
        """At the first top-level forward: apply each trial's code line to this module (the
        model) and its optimizer, as the user would before the loop."""
        # a module without the model's optimizer (a transform called first) is not the model:
        # the next top-level forward of the first step tries again
        if "swin-convert" in self.trials and self.trials_done.get("swin-convert") != "applied":
            from aiak.ops import swin

            if window_attention_modules([module])[0]:
                swin.convert(module)
                self.trials_done["swin-convert"] = "applied"
            else:
                self.trials_done["swin-convert"] = "not applied: no window attention found"
        if "o2" in self.trials and self.trials_done.get("o2") != "applied":
            self.trials_done["o2"] = self.decorate(module)
        self.facts["trials"] = dict(self.trials_done)

    def decorate(self, module: Any) -> str:
        import aiak.amp

        torch = self.torch
        if isinstance(module, torch.nn.parallel.DistributedDataParallel):
            return "not applied: the model is wrapped in DDP before its first forward"
        held = {id(p) for p in module.parameters()}
        for opt in list(self.optimizers):
            params = [p for g in opt.param_groups for p in g["params"]]
            if params and all(id(p) in held for p in params):
                dtype = torch.float16
                if torch.is_autocast_enabled("cuda"):
                    dtype = torch.get_autocast_dtype("cuda")
                elif torch.is_autocast_enabled("cpu"):
                    dtype = torch.get_autocast_dtype("cpu")
                try:
                    aiak.amp.decorate(module, opt, dtype=dtype)
                except (RuntimeError, TypeError, ValueError) as e:  # decorate's own refusals
                    return f"not applied: {e}"
                return "applied"
        return "not applied: no optimizer holds this model's parameters at its first forward"

    # -- the end ------------------------------------------------------------------------------

    def report(self, complete: bool) -> dict[str, Any]:
        device = self.facts.get("optimizer", {}).get("device", "cpu")
        cost = _advise_work.op_cost(self.torch, device)
        rates = _advise_work.rates(self.torch)
        if self.cuda:
            rates["copy_Bps"] = _advise_work.copy_rate(self.torch)
        for f in self.facts["loaders"]:
            f.pop("id", None)
        dist = self.torch.distributed
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        return {
            "rank": self.rank,
            "world": int(os.environ.get("WORLD_SIZE", world)),
            "local_world": int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
            "backend": dist.get_backend() if world > 1 or dist.is_initialized() else None,
            "cuda": self.cuda,
            "complete": complete,
            "warmup": self.warmup,
            "steps_seen": self.step,
            "records": self.records,
            "ops": self.ops,
            "op_cost_s": cost,
            "work": self.work,
            "amp": self.amp,
            "rates": rates,
            "stream_samples": self.samples[0],
            "stream_empty": self.samples[1],
            "opt_samples": self.opt_samples[0],
            "opt_empty": self.opt_samples[1],
            "facts": self.facts,
            "trials": sorted(self.trials),
        }

    def finish(self, complete: bool) -> None:
        if self.written:
            return
        self.written = True
        if self.counter is not None:
            self.stop_counting()
        if self.gpu_pending:
            try:
                self.torch.cuda.synchronize()  # once, at the end: the last steps' events
                self.read_gpu(block=True)
            except RuntimeError:  # a CUDA error at exit: those steps keep the host's clock
                self.gpu_pending.clear()
        dist = self.torch.distributed
        distributed = dist.is_available() and dist.is_initialized()
        # every rank is here (they end at the same step): the link can be timed together
        if complete and distributed and dist.get_world_size() > 1:
            device = "cuda" if self.cuda else "cpu"
            nbytes = max(2**20, int(self.facts.get("grad_bytes", 0)))
            self.facts["link"] = _advise_work.link(self.torch, nbytes, device)
        path = os.path.join(self.out_dir, f"rank{self.rank}.json")
        _write(path, json.dumps(self.report(complete)))
        if not complete:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        self.stop_workers()
        self.exit(0)  # the measured steps are done; the rest of the script is not needed

    def stop_workers(self) -> None:
        for it in list(self.iters):
            stop = getattr(it.inner, "_shutdown_workers", None)
            if stop is not None:
                stop()
        for cel in self.cross_epoch:
            cel.close()


class _TimedIter:
    """A data-loader iterator with its ``next()`` timed; anything else goes to the inner one."""

    def __init__(self, probe: _Probe, inner: Any, start: float, gpu_start: Any = None) -> None:
        self.probe = probe
        self.inner = inner
        self.pending = start  # iter()'s own time joins the first batch's wait
        self.gpu_pending = gpu_start  # and on the GPU's clock, from iter()'s start
        self.first = True

    def __iter__(self) -> _TimedIter:
        return self

    def __next__(self) -> Any:
        t0 = time.perf_counter()
        ev = self.gpu_pending if self.gpu_pending is not None else self.probe.gpu_mark()
        _Phase.name = "data"
        try:
            return next(self.inner)
        finally:
            _Phase.name = "other"
            self.probe.add_data(time.perf_counter() - t0 + self.pending, self.first, ev)
            self.pending, self.first, self.gpu_pending = 0.0, False, None

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _write(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _counter(probe: _Probe) -> Any:
    def count(func: Any, args: Any, out: Any) -> None:
        phase = _Phase.name
        probe.ops[phase] = probe.ops.get(phase, 0) + 1
        elems, macs = _advise_work.work(func, args, out)
        probe.work[phase] = [probe.work[phase][0] + elems, probe.work[phase][1] + macs]
        casts, weights, fp32 = _advise_work.precision(func, args, out, probe.weights)
        a = probe.amp[phase]
        probe.amp[phase] = [a[0] + casts, a[1] + weights, a[2] + fp32]

    return _advise_work.counting(count)


def install(out_dir: str) -> _Probe:
    """Put the probe's hooks on torch (called once torch is imported and aiak activated)."""
    import torch
    import torch.distributed as dist
    from torch.nn.modules import module as nn_module
    from torch.optim import optimizer as torch_optimizer
    from torch.utils.data import DataLoader

    probe = _Probe(out_dir)
    _write(os.path.join(out_dir, f"pid{probe.rank}"), str(os.getpid()))
    # Processes this rank starts (spawned data-loader workers) inherit the environment: the
    # owner's pid keeps them from installing a probe that would write this rank's report.
    os.environ[_ENV_OWNER] = str(os.getpid())

    loader_iter = DataLoader.__iter__

    def __iter__(self: Any) -> Any:
        if "cross-epoch-loader" in probe.trials and self.num_workers >= 1:
            cel = getattr(self, "_aiak_advise_cel", None)
            if cel is None and not isinstance(self.dataset, torch.utils.data.IterableDataset):
                from aiak.data import CrossEpochLoader

                cel = CrossEpochLoader(self)
                self._aiak_advise_cel = cel
                probe.cross_epoch.append(cel)
            if cel is not None:
                return probe.timed_iter(self, lambda: iter(cel))
        return probe.timed_iter(self, lambda: loader_iter(self))

    DataLoader.__iter__ = __iter__
    probe.undo.append(lambda: setattr(DataLoader, "__iter__", loader_iter))

    probe.global_hooks = [
        nn_module.register_module_forward_pre_hook(probe.fwd_pre),
        nn_module.register_module_forward_hook(probe.fwd_post),
    ]
    probe.undo.append(lambda: [h.remove() for h in probe.global_hooks])
    if "o2" in probe.trials:
        _track_optimizers(probe, torch)
    probe.undo.append(torch_optimizer.register_optimizer_step_pre_hook(probe.opt_pre).remove)
    probe.undo.append(torch_optimizer.register_optimizer_step_post_hook(probe.opt_post).remove)

    autograd_backward = torch.autograd.backward

    def backward(*args: Any, **kwargs: Any) -> Any:
        return probe.backward(lambda: autograd_backward(*args, **kwargs))

    torch.autograd.backward = backward
    probe.undo.append(lambda: setattr(torch.autograd, "backward", autograd_backward))

    if dist.is_available():
        _install_ddp(probe, torch)
    atexit.register(probe.finish, False)
    probe.undo.append(lambda: atexit.unregister(probe.finish))
    return probe


def _track_optimizers(probe: _Probe, torch: Any) -> None:
    """The O2 trial: remember each optimizer built (decorate needs the model's), and make every
    GradScaler follow O2's policy for decorated optimizers (``aiak.amp.install``, the
    documented switch; undone with the probe)."""
    import aiak.amp

    base = torch.optim.Optimizer
    init = base.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        probe.optimizers.add(self)

    base.__init__ = __init__
    probe.undo.append(lambda: setattr(base, "__init__", init))
    if not aiak.amp.installed():
        aiak.amp.install()
        probe.undo.append(aiak.amp.uninstall)


def uninstall(probe: _Probe) -> None:
    """Remove every hook and patch :func:`install` made (tests; a worker just exits)."""
    if probe.counter is not None:
        probe.stop_counting()
    while probe.undo:
        probe.undo.pop()()


def _install_ddp(probe: _Probe, torch: Any) -> None:
    ddp_cls = torch.nn.parallel.DistributedDataParallel
    register = ddp_cls.register_comm_hook
    init = ddp_cls.__init__

    def register_comm_hook(self: Any, state: Any, hook: Any) -> Any:
        self._aiak_advise_hooked = True
        return register(self, state, probe.timed_hook(hook))

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        probe.facts["ddp"].append(
            {"bucket_cap_bytes": int(getattr(self, "bucket_bytes_cap", 0) or 0)}
        )
        if getattr(self, "_aiak_advise_hooked", False):
            return

        def first_forward(module: Any, args: Any) -> None:
            handle.remove()
            if not getattr(module, "_aiak_advise_hooked", False):
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                module.register_comm_hook(module.process_group, default_hooks.allreduce_hook)

        handle = self.register_forward_pre_hook(first_forward)

    ddp_cls.register_comm_hook = register_comm_hook
    ddp_cls.__init__ = __init__

    def restore() -> None:
        ddp_cls.register_comm_hook = register
        ddp_cls.__init__ = init

    probe.undo.append(restore)


def _install_from_environment() -> None:
    install(os.environ[_ENV_DIR])


def boot() -> None:
    """Install now if torch is loaded, else when it is; only in a launched worker
    (``LOCAL_RANK`` set by torch's launcher) with ``AIAK_ADVISE_DIR``: the launchers, which
    import torch too, stay unmeasured."""
    if not os.environ.get(_ENV_DIR) or "LOCAL_RANK" not in os.environ:
        return
    if os.environ.get(_ENV_OWNER, str(os.getpid())) != str(os.getpid()):
        return  # a child of a measured rank
    if "torch" in sys.modules:
        install(os.environ[_ENV_DIR])
    else:
        from aiak.launch._boot import AfterTorch

        sys.meta_path.insert(0, AfterTorch(_install_from_environment))
