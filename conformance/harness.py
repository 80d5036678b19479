"""Conformance cases: registry, tolerance policy, comparison, poisoning and timing.

A *case* checks one candidate (an aiak op, optimizer, hook, amp mode) against a PyTorch
reference on fresh random inputs. It is data: ``specs(device)`` lists the variants to run
(dtype, shapes, options), ``make_inputs`` draws inputs for one variant, ``reference`` computes
the truth (float64 where it matters; it runs first and must not mutate the inputs),
``candidate`` runs the thing under test (it may mutate them), and ``baseline``
(optional) is what a user would run with stock PyTorch, timed beside the candidate by
``--bench``. Outputs are dicts of tensors; the harness compares each one under the tolerance
policy (docs/conformance.md):

    relative L2 error ||out - ref|| / ||ref|| against the float64 reference:
    fp32 <= 1e-5 (pure elementwise <= 1e-6), tf32 <= 5e-4, fp16 <= 5e-3, bf16 <= 2e-2,
    NaN never passes unless the reference has NaN at the same place.

Outputs named in ``Case.exact`` (flags, indices, counts) must match exactly.

``peer`` (optional) is stock PyTorch computing the same thing in the spec's own dtype. For fp16
and bf16 specs each output's bound is then max(policy, ``PEER_FACTOR`` x the peer's own error
against the reference) (flash-attn's rule, docs/conformance.md): after several optimizer steps a
tensor whose values cancel to near zero has a half-precision error no fixed bound covers, and
no implementation in that dtype does better than its arithmetic allows. ``floor`` (optional)
gives the same kind of per-output bound from the case's own rounding model, for fp16/bf16 specs
too: one peer error is a single sample, and a one-element output after ten half-precision steps
can land 2-4% off the truth where torch's lands 0.5% off (without ``floor``, optim.sgd fails
about one run in 5 that way).

Cases register themselves with :func:`register` when their module in
``aiak.conformance.cases`` is imported; :func:`all_cases` imports every module there.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import pkgutil
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "TOLERANCE",
    "Case",
    "Result",
    "Spec",
    "all_cases",
    "compare",
    "poison_allocator",
    "register",
    "rel_l2_error",
    "run_case",
    "time_cuda",
    "tolerance",
]

# Relative L2 error bounds against a float64 reference (docs/conformance.md, "Tolerance policy").
TOLERANCE: Mapping[str, float] = {
    "float32": 1e-5,
    "float32-elementwise": 1e-6,
    "tf32": 5e-4,
    "float16": 5e-3,
    "bfloat16": 2e-2,
    "float64": 1e-12,
}
# Half-precision outputs may be off by this multiple of stock PyTorch's same-dtype error.
PEER_FACTOR = 2.0


def tolerance(dtype: torch.dtype | str, elementwise: bool = False) -> float:
    """The policy's bound for ``dtype`` (``"tf32"`` may be passed as a string)."""
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name == "float32" and elementwise:
        name = "float32-elementwise"
    if name not in TOLERANCE:
        raise ValueError(f"tolerance: no policy for dtype {dtype!r}; known: {sorted(TOLERANCE)}")
    return TOLERANCE[name]


@dataclasses.dataclass(frozen=True)
class Spec:
    """One variant of a case: a label, the dtype that sets the tolerance, free parameters.

    ``large`` variants (> 2**31 elements and the like) run only with ``--large``; ``bench``
    variants are the ones ``--bench`` times against the baseline.
    """

    label: str
    dtype: torch.dtype = torch.float32
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    elementwise: bool = False
    large: bool = False
    bench: bool = False
    tol: float | None = None  # overrides the policy where a case states its own bound

    def tolerance(self) -> float:
        return self.tol if self.tol is not None else tolerance(self.dtype, self.elementwise)


# An output is a tensor or a list of tensors (compared as one flattened vector).
Outputs = Mapping[str, "torch.Tensor | Sequence[torch.Tensor]"]


@dataclasses.dataclass(frozen=True)
class Case:
    """A conformance case. See the module docstring for the contract of each field."""

    name: str
    specs: Callable[[torch.device], Iterable[Spec]]
    make_inputs: Callable[[Spec, torch.device, torch.Generator], Any]
    candidate: Callable[[Any], Outputs]
    reference: Callable[[Any], Outputs]
    baseline: Callable[[Any], Any] | None = None
    peer: Callable[[Any], Outputs] | None = None  # same-dtype stock PyTorch (module docstring)
    floor: Callable[[Any], Mapping[str, float]] | None = None  # rounding-model bounds (idem)
    devices: tuple[str, ...] = ("cpu", "cuda")
    exact: tuple[str, ...] = ()
    description: str = ""


@dataclasses.dataclass
class Result:
    case: str
    label: str
    device: str
    dtype: str
    passed: bool
    errors: dict[str, float]
    tolerance: float
    seed: int
    message: str = ""
    candidate_ms: float | None = None
    baseline_ms: float | None = None

    @property
    def speedup(self) -> float | None:
        if self.candidate_ms and self.baseline_ms:
            return self.baseline_ms / self.candidate_ms
        return None

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["speedup"] = self.speedup
        return d


_REGISTRY: dict[str, Case] = {}


def register(case: Case) -> Case:
    """Add ``case`` to the registry; a second case with the same name is an error."""
    if not isinstance(case, Case):
        raise TypeError(f"register: case must be a Case, got {type(case).__name__}")
    if case.name in _REGISTRY and _REGISTRY[case.name] is not case:
        raise ValueError(f"register: a case named {case.name!r} is already registered")
    _REGISTRY[case.name] = case
    return case


def all_cases() -> list[Case]:
    """Every registered case, after importing every module of ``aiak.conformance.cases``.

    A feature adds its cases by adding a module there; nothing else needs editing.
    """
    from aiak.conformance import cases

    for info in pkgutil.iter_modules(cases.__path__):
        if info.name.startswith("_"):
            continue
        module = f"{cases.__name__}.{info.name}"
        try:
            importlib.import_module(module)
        except Exception as exc:  # a broken module is a failed case, not a dead suite
            _REGISTRY.setdefault(f"import.{info.name}", _import_failure(module, exc))
    return [_REGISTRY[k] for k in sorted(_REGISTRY)]


def _import_failure(module: str, exc: Exception) -> Case:
    message = f"importing {module} failed: {type(exc).__name__}: {exc}"

    def fail(_inputs: Any) -> Outputs:
        raise RuntimeError(message)

    return Case(
        name=f"import.{module.rsplit('.', 1)[-1]}",
        specs=lambda device: [Spec("import")],
        make_inputs=lambda spec, device, gen: None,
        candidate=fail,
        reference=fail,
        description=message,
    )


# --------------------------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------------------------


def rel_l2_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 over the finite part; inf when NaN/inf patterns differ.

    Where the reference is all zeros the absolute L2 error is returned instead.
    """
    out = out.detach().to("cpu", torch.float64)
    ref = ref.detach().to("cpu", torch.float64)
    if out.shape != ref.shape:
        return math.inf
    if out.numel() == 0:
        return 0.0
    ref_nan, out_nan = torch.isnan(ref), torch.isnan(out)
    if not torch.equal(ref_nan, out_nan):
        return math.inf
    ref_inf, out_inf = torch.isinf(ref), torch.isinf(out)
    if not torch.equal(ref_inf, out_inf) or not torch.equal(ref[ref_inf], out[out_inf]):
        return math.inf
    finite = ~(ref_nan | ref_inf)
    diff = torch.linalg.vector_norm(out[finite] - ref[finite]).item()
    scale = torch.linalg.vector_norm(ref[finite]).item()
    return diff / scale if scale > 0 else diff


def compare(
    outputs: Outputs,
    reference: Outputs,
    tol: float,
    exact: Iterable[str] = (),
    tols: Mapping[str, float] | None = None,
) -> tuple[bool, dict[str, float], str]:
    """Compare every reference output; returns (passed, errors, first failure message).

    ``tols``: per-output bounds that replace ``tol`` (from a peer's same-dtype error)."""
    exact = set(exact)
    errors: dict[str, float] = {}
    failures: list[str] = []
    missing = set(reference) - set(outputs)
    if missing:
        return False, {}, f"candidate did not return {sorted(missing)}"
    for key, ref in reference.items():
        out, ref = _flat(outputs[key]), _flat(ref)
        if key in exact:
            same = out.shape == ref.shape and torch.equal(
                out.detach().cpu().to(ref.dtype), ref.detach().cpu()
            )
            errors[key] = 0.0 if same else math.inf
            if not same:
                failures.append(f"{key}: not exactly equal ({_first_mismatch(out, ref)})")
            continue
        err = rel_l2_error(out, ref)
        errors[key] = err
        bound = tols.get(key, tol) if tols else tol
        if not err <= bound:  # also catches NaN
            what = (
                f"{bound:.1g}"
                if bound == tol
                else f"{bound:.3g} (the larger of {PEER_FACTOR:g}x torch's error and the "
                "case's rounding floor)"
            )
            failures.append(f"{key}: rel L2 error {err:.3g} > {what} ({_first_mismatch(out, ref)})")
    return not failures, errors, "; ".join(failures)


def _half_bounds(
    case: Case, spec: Spec, inputs: Any, ref: Outputs, tol: float
) -> dict[str, float] | None:
    """Per-output bounds from the case's same-dtype peer and its rounding floor (fp16/bf16
    specs only): the largest of the policy and each; None when the case has neither."""
    if spec.dtype not in (torch.float16, torch.bfloat16):
        return None
    if case.peer is None and case.floor is None:
        return None
    # like the reference, peer and floor must not mutate the inputs
    peer = case.peer(inputs) if case.peer is not None else {}
    floor = case.floor(inputs) if case.floor is not None else {}
    bounds = {}
    for key, r in ref.items():
        if key in case.exact:
            continue
        bound = tol
        if key in peer:
            err = rel_l2_error(_flat(peer[key]), _flat(r))
            if math.isfinite(err):
                bound = max(bound, PEER_FACTOR * err)
        if math.isfinite(floor.get(key, math.nan)):
            bound = max(bound, floor[key])
        bounds[key] = bound
    return bounds


def _flat(value: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """An output may be a list of tensors (an in-place op's ``dst``): compare it as one vector.
    Flattening here, not in the candidate, keeps it out of ``--bench`` timings."""
    if isinstance(value, torch.Tensor):
        return value
    parts = [t.detach().reshape(-1).to("cpu", torch.float64) for t in value]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def _first_mismatch(out: torch.Tensor, ref: torch.Tensor) -> str:
    out = out.detach().cpu().double()
    ref = ref.detach().cpu().double()
    if out.shape != ref.shape:
        return f"shape {tuple(out.shape)} vs reference {tuple(ref.shape)}"
    bad = ~torch.isclose(out, ref, rtol=1e-3, atol=1e-6, equal_nan=True)
    idx = bad.nonzero()
    if idx.numel() == 0:
        return "no single element off by more than 1e-3"
    first = tuple(idx[0].tolist())
    return f"first mismatch at {first}: {out[first].item():.6g} vs {ref[first].item():.6g}"


# --------------------------------------------------------------------------------------------
# Poisoning and timing
# --------------------------------------------------------------------------------------------

_POISON_SIZES = (512, 1 << 12, 1 << 16, 1 << 20, 1 << 22, 1 << 24, 1 << 26)


def poison_allocator(device: torch.device, extra_bytes: int = 0) -> None:
    """Fill blocks the caching allocator will hand out next with NaN bytes (0xFF).

    Outputs the candidate allocates with ``torch.empty`` then start as NaN, so an element the
    kernel forgets to write fails the comparison. Best effort by construction (the allocator
    may split blocks differently); in-place outputs are poisoned explicitly by ``make_inputs``.
    """
    if device.type != "cuda":
        return
    blocks = [
        torch.full((n,), 0xFF, dtype=torch.uint8, device=device)
        for n in (*_POISON_SIZES, extra_bytes)
        if n
    ]
    del blocks  # freed into the cache, still holding 0xFF


def time_cuda(fn: Callable[[], Any], warmup: int = 3, calls: int = 10, reps: int = 5) -> float:
    """Milliseconds per call of ``fn`` called back to back (median over ``reps`` runs of
    ``calls`` calls between two CUDA events): host work overlaps GPU work as in a training
    loop, so the figure is max(host time, GPU time) per call, for candidate and baseline alike.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    times.sort()
    return times[len(times) // 2]


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------


def run_case(
    case: Case,
    device: torch.device,
    *,
    seed: int | None = None,
    large: bool = False,
    bench: bool = False,
    on_result: Callable[[Result], None] | None = None,
) -> list[Result]:
    """Run every variant of ``case`` on ``device``; one :class:`Result` per variant."""
    results = []
    base_seed = seed if seed is not None else time.time_ns() % (2**31)
    for i, spec in enumerate(case.specs(device)):
        if spec.large and not large:
            continue
        s = base_seed + i
        result = _run_spec(case, spec, device, s, bench)
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


def _run_spec(case: Case, spec: Spec, device: torch.device, seed: int, bench: bool) -> Result:
    dtype = str(spec.dtype).removeprefix("torch.")
    tol = spec.tolerance()
    result = Result(case.name, spec.label, str(device), dtype, False, {}, tol, seed)
    try:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        inputs = case.make_inputs(spec, device, gen)
        # The reference runs first and must not mutate the inputs; the candidate may (in-place
        # ops, optimizer steps) and its in-place outputs were poisoned by make_inputs.
        ref = case.reference(inputs)
        tols = _half_bounds(case, spec, inputs, ref, tol)
        poison_allocator(device)
        outputs = case.candidate(inputs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        result.passed, result.errors, result.message = compare(outputs, ref, tol, case.exact, tols)
        if bench and spec.bench and device.type == "cuda" and case.baseline is not None:
            result.candidate_ms = time_cuda(lambda: case.candidate(inputs))
            result.baseline_ms = time_cuda(lambda: case.baseline(inputs))
    except Exception as exc:  # a crash is a failed case, reported, not an aborted suite
        result.passed = False
        result.message = f"{type(exc).__name__}: {exc}"
    return result
