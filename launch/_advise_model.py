"""aiak-advise's cost model: one step's :class:`Breakdown` (``_advise_breakdown``, the
attribution of the probe's reports) in, a ranked list of advice out.

Pure functions, tested without starting any process. docs/advise.md states every rule used
here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from aiak.launch._advise_breakdown import Breakdown, breakdown

__all__ = ["Advice", "Breakdown", "advise", "breakdown"]

# A gain under this share of the step is inside the step's run-to-run noise: not advised.
MIN_GAIN = 0.02
# Window attention's core, forward + backward, in copy-equivalent bytes per element of its
# score matrix (windows x heads x N x N), and aiak::window_attention's speed-up against it;
# benchmarks/results/window_attention.csv, H100, batch 64, Swin-T's four stages (3.7M-29.5M
# score elements, a 3.0 TB/s copy rate). timm's eager maths (matmul, + bias, + mask, softmax,
# cast, matmul): 237-1795 us, 183-194 bytes each; aiak's op x3.08 (stage 4) to x3.99 faster.
# timm's fused_attn path (SDPA with the bias + mask materialised): 175-1231 us, 125-143
# bytes; aiak's op x2.28 (stage 4) to x2.74. The smallest speed-up of each is used.
WINDOW_CORES = {"eager": (190.0, 3.08), "sdpa": (135.0, 2.28)}


@dataclasses.dataclass(frozen=True)
class Advice:
    feature: str
    aiak: bool  # an aiak feature (else a change outside aiak, said so)
    phase: str
    gain_s: float | None  # expected saving per step (None: not estimated, said why)
    why: str
    use: str  # the aiakrun flags or the code line
    not_helps: str
    flags: tuple[str, ...] = ()  # aiakrun flags that switch it on (for --verify)
    trial: str | None = None  # or the probe's trial name for a code-line feature
    changes_update: bool = False  # alters the training's maths (needs a convergence check)

    def rank_key(self, step: float) -> float:
        if self.gain_s is None:
            return 1.0  # after every estimated gain
        # A feature that changes the update counts half its gain: it must also pay for a
        # convergence check before it is used for real.
        return -(self.gain_s / step) * (0.5 if self.changes_update else 1.0)

    def as_dict(self, step: float) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["flags"] = list(self.flags)
        d["gain"] = None if self.gain_s is None else round(self.gain_s / step, 4)
        return d


# -- the cost model, per phase ----------------------------------------------------------------


def _data(b: Breakdown) -> list[Advice]:
    out: list[Advice] = []
    loaders = b.facts.get("loaders", [])
    if b.data <= 0:
        return out
    start, steady = b.data_epoch_start, b.data - b.data_epoch_start
    with_workers = [f for f in loaders if f.get("num_workers", 0) >= 1 and f.get("map_style")]
    no_workers = [f for f in loaders if f.get("num_workers", 0) == 0]
    if with_workers and not any(f.get("cross_epoch_trial") for f in with_workers):
        out.append(
            Advice(
                "CrossEpochLoader",
                True,
                "data",
                start,
                f"{_ms(start)} of each step is the wait at an epoch's start (iter() starting "
                "workers, then the first batch); CrossEpochLoader keeps its workers and a window "
                "of batches in flight across the epoch boundary, so that wait goes",
                "from aiak.data import CrossEpochLoader; loader = CrossEpochLoader(loader)  "
                "# close() it, or use it as a context manager",
                "the loading rate within an epoch (more workers or a faster dataset does)",
                trial="cross-epoch-loader",
            )
        )
    if no_workers:
        k = 4
        out.append(
            Advice(
                "DataLoader workers",
                False,
                "data",
                b.data * (1 - 1 / k),
                f"the DataLoader loads in the training process ({_ms(b.data)} per step); "
                f"{k} workers load {k} batches at once while the step computes, so the wait "
                f"falls to at most 1/{k} of it",
                f"DataLoader(..., num_workers={k}, persistent_workers=True)  (torch)",
                "a dataset slower than the step even with workers",
            )
        )
    elif steady > 0:
        n = max(f.get("num_workers", 1) for f in loaders) if loaders else 1
        out.append(
            Advice(
                "more DataLoader workers",
                False,
                "data",
                steady,
                f"{_ms(steady)} per step is waited inside the epoch with {n} worker(s): they "
                "produce batches slower than the step consumes them",
                f"DataLoader(..., num_workers={2 * n})  (torch), or a faster dataset",
                "the epoch-start wait (CrossEpochLoader does)",
            )
        )
    if b.facts.get("cuda"):
        out.append(
            Advice(
                "CudaPrefetcher",
                True,
                "data",
                None,
                "host-to-GPU copies of the batch run on the compute stream unless a side stream "
                "takes them; their time is not measured by the probe",
                "from aiak.data import CudaPrefetcher; loader = CudaPrefetcher(loader)",
                "a dataset that is slow on the host",
            )
        )
    return out


def _optimizer(b: Breakdown, on: Mapping[str, str]) -> list[Advice]:
    opt = b.facts.get("optimizer")
    if not opt or b.optimizer <= 0:
        return []
    name, module = opt.get("type", ""), opt.get("module", "")
    n, groups = max(1, int(opt.get("tensors", 1))), max(1, int(opt.get("groups", 1)))
    # torch's foreach path dispatches few ops: the op count gives it a small gain by itself
    if (
        not module.startswith("torch.optim")
        or name not in ("Adam", "AdamW", "SGD")
        or opt.get("fused") is True
    ):
        return []
    if on.get("AIAK_FUSED_OPTIMIZER") == "1" or on.get("AIAK_DGC") == "1":
        return []
    if b.facts.get("cuda"):
        return [_fused_on_gpu(b, opt, n, groups)]
    host = b.host.get("optimizer", 0.0) * b.optimizer
    gain = host * (1 - groups / n)
    return [
        Advice(
            "fused optimizer",
            True,
            "optimizer",
            gain,
            f"torch's {name} updates {n} tensors one by one: about {_ms(host)} of its "
            f"{_ms(b.optimizer)} per step is the host's cost of its ops; the fused twin "
            f"updates each of the {groups} group(s) in one multi-tensor call",
            "aiakrun --fuse-optimizer",
            "the arithmetic on the parameters and their state (its bytes); a custom optimizer",
            flags=("--fuse-optimizer",),
        )
    ]


def optimizer_passes(opt: Mapping[str, Any]) -> tuple[int, int]:
    """(torch's, the fused twin's) fp32 element reads + writes per parameter element per step.

    torch's multi-tensor (and for-loop) SGD: weight decay ``g + wd*p`` 3, momentum
    ``buf*m + g`` 2 + 3, nesterov ``g + m*buf`` 3, the update ``p - lr*d`` 3; Adam/AdamW:
    decay 3 (Adam, into the grad) or 2 (AdamW, ``p *= 1 - lr*wd``), ``lerp`` of exp_avg 3,
    exp_avg_sq ``*b2`` 2 and ``addcmul`` 3, ``sqrt``, ``/ bc2``, ``+ eps`` 2 each, ``addcdiv``
    4. The fused twin reads each tensor once and writes each it updates once: SGD p, g (buf) in,
    p (buf) out; Adam p, g, m, v in, p, m, v out."""
    wd = float(opt.get("weight_decay", 0.0)) > 0
    if opt.get("type") == "SGD":
        momentum = float(opt.get("momentum", 0.0)) > 0
        nesterov = momentum and bool(opt.get("nesterov", False))
        torch_passes = 3 + 5 * momentum + 3 * wd + 3 * nesterov
        return torch_passes, 3 + 2 * momentum
    decay = (2 if opt.get("type") == "AdamW" else 3) if wd else 0
    return 18 + decay, 7


def _fused_on_gpu(b: Breakdown, opt: Mapping[str, Any], n: int, groups: int) -> Advice:
    """The fused optimizer on CUDA: the GPU work of torch's extra passes over the state, and
    the GPU's wait for the optimizer's host code after a sync at its start."""
    name = opt.get("type", "")
    host_opt = float(b.host_s.get("optimizer", b.optimizer))
    torch_passes, fused_passes = optimizer_passes(opt)
    copy = float(b.facts.get("rates", {}).get("copy_Bps", 0.0))
    saved_bytes = (torch_passes - fused_passes) * 4 * int(opt.get("parameters", 0))
    work = saved_bytes / copy if copy > 0 else 0.0
    # how much of the optimizer's host time the GPU waits for: the steps that found the queue
    # empty at its start, or the GPU's idle share when larger (a host-bound step waits anywhere)
    q = max(b.facts.get("opt_queue_empty") or 0.0, b.gpu_idle or 0.0)
    scaler = bool(opt.get("grad_scaler")) and not opt.get("amp_scaling")
    if scaler:
        # GradScaler.step reads found_inf on the host before torch's step; the fused twin
        # takes the inf check on the device, so nothing drains the queue before the update
        waited = host_opt * q
        wait_why = (
            f"GradScaler.step's .item() drains the GPU's queue before the step ({q:.0%} of "
            f"the steps found it empty there): the GPU then waits for the {_ms(host_opt)} of "
            "the step's host code; the fused twin takes the inf check on the device, no sync"
        )
    else:
        waited = b.host.get("optimizer", 0.0) * host_opt * q * (1 - groups / n)
        wait_why = (
            f"the GPU's queue was empty at the optimizer's start in {q:.0%} of the steps: it "
            "waits for the host cost of the step's ops, which one multi-tensor call per group "
            "shortens"
        )
    gain = min(b.optimizer, work + waited)
    return Advice(
        "fused optimizer",
        True,
        "optimizer",
        gain,
        f"torch's {name} makes {torch_passes} fp32 reads + writes per parameter element "
        f"(the fused twin {fused_passes}): {saved_bytes / 1e6:.0f} MB fewer per step, "
        f"{_ms(work)} at the measured copy rate; {wait_why}",
        "aiakrun --fuse-optimizer",
        "the forward and backward; a custom optimizer",
        flags=("--fuse-optimizer",),
    )


def _powersgd_ratio(shapes: Sequence[Sequence[int]], rank: int) -> float:
    full = comp = 0
    for s in shapes:
        numel = math.prod(s) if s else 1
        full += numel
        if len(s) >= 2:
            m, k = s[0], numel // max(1, s[0])
            comp += min(numel, rank * (m + k))
        else:
            comp += numel
    return comp / full if full else 1.0


def _comm(b: Breakdown, on: Mapping[str, str]) -> list[Advice]:
    c = b.comm
    world = int(b.facts.get("world", 1))
    if c <= 0 or world < 2:
        return []
    opt = b.facts.get("optimizer") or {}
    grad_bytes = int(b.facts.get("grad_bytes", 0))
    compressed = any(
        on.get(k) == "1" for k in ("AIAK_FP16_COMPRESSION", "AIAK_POWERSGD_COMPRESSION", "AIAK_DGC")
    )
    out: list[Advice] = []
    link = b.facts.get("link")
    moved, wait = b.comm_split()
    if wait >= MIN_GAIN * b.step:
        buckets = max(1, int(b.facts.get("buckets", 1)))
        out.append(
            Advice(
                "slow-rank check",
                True,
                "comm",
                None,
                f"{_ms(wait)} of the exposed {_ms(c)} is not the link ({buckets} bucket(s) "
                f"at {_ms(float(link['latency_s']))} latency, {grad_bytes / 2**20:.2f} MiB "
                f"at {_rate(link)}): the ranks wait for each other",
                "aiakrun --perf-check-n-steps 10  (names a rank slower than the median)",
                "it finds the slow rank; it does not make it faster",
            )
        )
    c = moved  # compression and two levels shorten the bytes' part only
    # nor the step below the host's own work: where the link hides a host nearly as slow,
    # fewer bytes leave the host's time
    room = max(0.0, b.step - b.host_floor())
    if c > room:
        floor = (
            f"; at most {_ms(room)}: the host's own work is {_ms(b.host_floor())} of the "
            f"{_ms(b.step)} step"
        )
    else:
        floor = ""
    local = max(1, int(b.facts.get("local_world", 1)))
    nodes = max(1, world // local)
    if nodes > 1 and local > 1 and on.get("AIAK_HIERARCHICAL_ALLREDUCE") != "1":
        # bytes through a node's link per step, in units of the gradients: the flat ring's
        # boundary rank sends 2(N-1)/N; two levels send 2(M-1)/M (L ranks, 1/L each)
        flat = 2 * (world - 1) / world
        two = 2 * (nodes - 1) / nodes
        ratio = two / flat
        out.append(
            Advice(
                "hierarchical allreduce",
                True,
                "comm",
                min(room, c * (1 - ratio)),
                f"{nodes} nodes of {local}: a flat ring sends {flat:.2f} x the gradients through "
                f"each node's link per step; two levels send {two:.2f} x (the intra-node "
                f"reduce-scatter leaves each of the {local} ranks 1/{local} to exchange)"
                + (floor if c * (1 - ratio) > room else ""),
                "aiakrun --hierarchical-allreduce",
                "a job on one node; the intra-node links",
                flags=("--hierarchical-allreduce",),
            )
        )
    if compressed:
        return out
    mib = grad_bytes / 2**20
    if "float32" in opt.get("dtypes", ["float32"]):
        out.append(
            Advice(
                "fp16 gradient compression",
                True,
                "comm",
                min(room, c * 0.5),
                f"{_ms(c)} per step of the communication the backward does not hide moves "
                f"bytes{' (at the measured link rate)' if link else ' (assumed: no link rate)'}; "
                f"{mib:.1f} MiB of fp32 gradients go on the wire as fp16: half the bytes"
                + (floor if c * 0.5 > room else ""),
                "aiakrun --fp16-compression",
                "latency-bound exchanges of small buckets; the backward itself",
                flags=("--fp16-compression",),
            )
        )
    shapes = opt.get("shapes", [])
    if shapes:
        ratio = _powersgd_ratio(shapes, 2)
        out.append(
            Advice(
                "PowerSGD (rank 2)",
                True,
                "comm",
                min(room, c * (1 - ratio)),
                f"rank-2 factors of the weight matrices send {ratio:.3f} x the gradient bytes"
                + (floor if c * (1 - ratio) > room else ""),
                "aiakrun --powersgd --rank 2  (compression starts at --start-compress-iter, "
                "default step 1000)",
                "models of vectors and small matrices; it changes the update (error feedback)",
                flags=("--powersgd", "--rank", "2", "--start-compress-iter", "2"),
                changes_update=True,
            )
        )
    if opt.get("type") == "SGD" and on.get("AIAK_FUSED_OPTIMIZER") != "1":
        ratio = min(1.0, world * 0.001 * 12 / 8)  # allgather of 0.1% (fp32 + int64 index)
        out.append(
            Advice(
                "DGC",
                True,
                "comm",
                min(room, c * (1 - ratio)),
                f"0.1% of the gradients (value + index) allgathered over {world} ranks: "
                f"{ratio:.3f} x a dense ring's bytes"
                + (floor if c * (1 - ratio) > room else "")
                + "; its selection's host time per bucket is not counted",
                "aiakrun --dgc",
                "non-SGD optimizers; it changes the update (momentum correction)",
                flags=("--dgc",),
                changes_update=True,
            )
        )
    return out


def o2_bytes(amp: Mapping[str, Sequence[int]]) -> tuple[int, int, int]:
    """(bytes O2 saves per step, activation cast elements, fp32 elements written) from the
    counted step's ``[casts, weight casts, fp32 elements]`` per phase (forward + backward).

    A cast reads one dtype and writes the other: 6 bytes an element, gone under O2 except the
    weights' (fp32 -> half each forward, the grad back each backward), which O2 replaces by
    its own copies (half grads into the fp32 masters, masters back into the model): the same
    bytes, so they save nothing. An fp32 element written by another op (autocast's fp32-list
    ops: layer_norm, softmax, and what their fp32 outputs feed) is half under O2: 2 bytes
    fewer written and 2 fewer read by the op that reads it once."""
    f = amp.get("forward", (0, 0, 0))
    bw = amp.get("backward", (0, 0, 0))
    casts = int(f[0]) + int(bw[0])
    activation = max(0, casts - 2 * int(f[1]))
    fp32 = int(f[2]) + int(bw[2])
    return 6 * activation + 4 * fp32, activation, fp32


def _o2_from_autocast(b: Breakdown, dtype: str) -> Advice | None:
    copy = float(b.facts.get("rates", {}).get("copy_Bps", 0.0))
    saved, activation, fp32 = o2_bytes(b.facts.get("amp", {}))
    if saved <= 0:
        return None  # nothing the counted step casts or runs in fp32: O2 changes no bytes
    busy = 1.0 - (b.gpu_idle or 0.0)
    gain = min(b.compute, saved / copy * busy) if copy > 0 else None
    at = f"{_ms(saved / copy)} at the measured copy rate" if copy > 0 else "no copy rate"
    return Advice(
        "O2 mixed precision",
        True,
        "compute",
        gain,
        f"the forward runs under autocast ({dtype}) with fp32 parameters: per step it casts "
        f"{activation / 1e6:.1f}M activation elements and writes {fp32 / 1e6:.1f}M fp32 "
        f"elements (autocast's fp32-list ops and what they feed); O2 runs the model in half: "
        f"{saved / 1e6:.0f} MB fewer per step, {at}"
        + (f", x{busy:.2f} for the GPU's busy share" if busy < 1 else ""),
        "model, optimizer = aiak.amp.decorate(model, optimizer)  # before DDP; then "
        "aiak.amp.GradScaler('cuda') or aiak.amp.install() for torch's GradScaler",
        "matmuls and convolutions (autocast already runs them in half); the weight casts "
        "(O2's master copies move the same bytes); a model that needs fp32 in those ops",
        trial="o2",
    )


def _window_attention(b: Breakdown) -> Advice | None:
    wa = b.facts.get("window_attention") or {}
    if not b.facts.get("cuda") or int(wa.get("modules", 0)) <= 0:
        return None
    if (b.facts.get("trials") or {}).get("swin-convert") == "applied":
        return None
    scores = int(wa.get("scores", 0))
    copy = float(b.facts.get("rates", {}).get("copy_Bps", 0.0))
    busy = 1.0 - (b.gpu_idle or 0.0)
    n = int(wa["modules"])
    sdpa = min(n, int(wa.get("sdpa", 0))) / n  # the share of modules on timm's SDPA path
    (eb, ex), (sb, sx) = WINDOW_CORES["eager"], WINDOW_CORES["sdpa"]
    core = (1 - sdpa) * eb + sdpa * sb  # bytes per score element, as the modules run it
    saved = (1 - sdpa) * eb * (1 - 1 / ex) + sdpa * sb * (1 - 1 / sx)
    how = "eager ops" if sdpa == 0 else "SDPA, bias + mask materialised" if sdpa == 1 else "both"
    gain = None
    why = (
        f"{n} timm-style window-attention module(s) run the attention core ({how}) over "
        f"{scores / 1e6:.0f}M score elements per step; aiak::window_attention ran that core "
        f"at least x{ex} (eager core) / x{sx} (SDPA core) faster, forward + backward (H100, "
        "benchmarks/results/window_attention.csv)"
    )
    if scores > 0 and copy > 0:
        gain = min(b.compute, scores * saved / copy * busy)
        why += (
            f": {core:.0f} copy-equivalent bytes per score element, "
            f"{_ms(scores * core / copy)} at the measured copy rate"
        )
    else:
        why += "; gain not estimated: " + (
            "no score elements were counted" if scores <= 0 else "no copy rate was measured"
        )
    return Advice(
        "fused window attention",
        True,
        "compute",
        gain,
        why,
        "from aiak.ops import swin; swin.convert(model)  # before O2, DDP and torch.compile",
        "the qkv / proj / MLP matmuls and the LayerNorms; modules with attention dropout "
        "(they stay unfused)",
        trial="swin-convert",
    )


def _compute(b: Breakdown) -> list[Advice]:
    wa = _window_attention(b)
    out = [wa] if wa is not None else []
    if b.bottleneck() != "host":
        opt = b.facts.get("optimizer") or {}
        auto = str(b.facts.get("autocast") or "")
        decorated = opt.get("aiak_o2") or (b.facts.get("trials") or {}).get("o2") == "applied"
        fp32 = "float32" in opt.get("dtypes", [])
        if b.facts.get("cuda") and auto.startswith("cuda:") and not decorated and fp32:
            o2 = _o2_from_autocast(b, auto.split(":", 1)[1])
            return [*out, o2] if o2 is not None else out
        if b.facts.get("cuda") and not decorated and not auto and fp32:
            return [
                *out,
                Advice(
                    "O2 mixed precision",
                    True,
                    "compute",
                    None,
                    "fp32 parameters on the GPU: half precision runs the matrix units at "
                    "their fp16/bf16 rate; the gain depends on the model's matrix share, "
                    "which the probe does not measure",
                    "model, optimizer = aiak.amp.decorate(model, optimizer)  "
                    "# with torch.autocast and a GradScaler",
                    "host-bound or communication-bound steps",
                ),
            ]
        return out
    h = max(b.host.get("compute", 0.0), b.gpu_idle or 0.0)
    gain = b.compute * h * 0.5
    return [
        *out,
        Advice(
            "larger batch, or CUDA graphs",
            False,
            "compute",
            gain,
            f"the forward and backward are host-bound: their ops' host cost is {h:.0%} of "
            f"their {_ms(b.compute)}; twice the batch per step halves that cost per sample "
            "(on a GPU, CUDA graphs / torch.compile(mode='reduce-overhead') remove it)",
            "a larger batch_size (scale the learning rate, or torch.optim.LAMB under aiakrun), "
            "or torch.compile(model, mode='reduce-overhead') on a GPU  (outside aiak)",
            "aiak's kernels, compression and O2 make the device faster, not the host: "
            "they do not help a host-bound step",
        ),
    ]


def advise(b: Breakdown, on: Mapping[str, str] | None = None) -> list[Advice]:
    """The advice for this breakdown, best first; ``on``: the variables already set."""
    on = dict(on or {})
    found = [*_data(b), *_optimizer(b, on), *_comm(b, on), *_compute(b)]
    keep = [a for a in found if a.gain_s is None or a.gain_s >= MIN_GAIN * b.step]
    bottleneck = {"host": "compute", "link": "comm", "ranks": "comm", "loop": "other"}.get(
        b.bottleneck(), b.bottleneck()
    )
    # Estimated gains first, by size; then unestimated ones of the bottleneck's phase.
    keep = [a for a in keep if a.gain_s is not None or a.phase == bottleneck]
    return sorted(keep, key=lambda a: a.rank_key(b.step))


def not_helping(b: Breakdown) -> list[str]:
    """Families of aiak features this step does not need, with the number that says so."""
    out = []
    if b.share("comm") < MIN_GAIN:
        why = "one process" if int(b.facts.get("world", 1)) < 2 else f"{b.share('comm'):.0%}"
        out.append(f"gradient compression / hierarchical allreduce: communication is {why}")
    if b.share("data") < MIN_GAIN:
        out.append(f"data loaders / prefetcher: {b.share('data'):.0%} of the step waits for data")
    if b.share("optimizer") < MIN_GAIN:
        out.append(f"fused optimizers: the optimizer is {b.share('optimizer'):.0%} of the step")
    if not b.facts.get("cuda"):
        out.append("O2 mixed precision and aiak's CUDA kernels: this run has no GPU")
    return out


def _rate(link: Mapping[str, float]) -> str:
    per_byte = float(link["s_per_byte"])
    return "no measurable time per byte" if per_byte <= 0 else f"{1e-6 / per_byte:.0f} MB/s"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"
