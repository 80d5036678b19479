"""Bad input to the newer public APIs (aiak.data, the detection ops, window attention,
aiak.comm's dgc / downsample / overlap_step, DGCSGD): each argument, given garbage, either works
as documented or raises ``ValueError``/``TypeError`` naming it; nothing else escapes.

Two layers: the named cases (each one a report of input accepted and then silently wrong, or an
error that named nothing), then hypothesis over every argument: wrong type, NaN/inf, negative,
zero, huge, empty, strings and tensors where numbers go, mismatched shapes/devices/dtypes.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from aiak import comm
from aiak.data import (
    BalancedDistributedSampler,
    CrossEpochLoader,
    CudaPrefetcher,
    PadCollate,
    normalize,
    pad_collate,
)
from aiak.ops._args import check_bool, check_float, check_int, check_tensor
from aiak.ops.fcos3d import fcos3d_targets, point_meta
from aiak.ops.simota import simota_assign
from aiak.ops.window_attention import roll_window_partition, window_attention, window_merge_roll

ROOT = Path(__file__).resolve().parents[1]

# Values of the wrong type or range for any argument.
GARBAGE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(
        [0, -1, 10**9, 2**64, -(2**63) - 1, 10**400, float("nan"), float("inf"), 1e308]
    ),
    st.text(max_size=6),
    st.sampled_from(["no", "yes", "1", "inf", ""]),
    st.just([]),
    st.just([1]),
    st.just(["a"]),
    st.just({}),
    st.just(object()),
    st.just(torch.zeros(2)),
    st.just(torch.tensor(1.0)),
)


def works_or_names(fn: Callable[[], Any], *names: str) -> None:
    try:
        fn()
    except (ValueError, TypeError) as exc:
        assert any(n in str(exc) for n in names), (
            f"{type(exc).__name__}: {exc} names none of {names}"
        )


# -- the shared checks ----------------------------------------------------------------------


def test_checks_refuse_what_python_would_coerce() -> None:
    with pytest.raises(TypeError, match="flag must be a bool"):
        check_bool("flag", "no")
    with pytest.raises(TypeError, match="n must be an int"):
        check_int("n", True)
    with pytest.raises(TypeError, match="n must be an int"):
        check_int("n", 1.7)
    with pytest.raises(ValueError, match=r"op: n must be >= 0 and < 4, got 4"):
        check_int("n", 4, ge=0, lt=4, op="op")
    with pytest.raises(ValueError, match="x must be finite"):
        check_float("x", float("inf"))
    with pytest.raises(ValueError, match="x must not be NaN"):
        check_float("x", float("nan"), finite=False)
    with pytest.raises(ValueError, match="x is too large"):
        check_float("x", 10**400)
    with pytest.raises(TypeError, match="x must be a number"):
        check_float("x", "5")
    with pytest.raises(TypeError, match="t has dtype"):
        check_tensor("t", torch.zeros(1), dtype=torch.int64)
    with pytest.raises(ValueError, match="t must have 2 dims"):
        check_tensor("t", torch.zeros(1), ndim=2)
    assert check_float("x", float("inf"), finite=False, gt=0) == math.inf
    assert check_int("n", 2**70) == 2**70 and check_bool("b", False) is False


# -- aiak.data: the named cases -------------------------------------------------------------


def test_pad_collate_refuses_mixed_dtypes_instead_of_truncating() -> None:
    with pytest.raises(TypeError, match=r"field 0 of sample 1 has dtype torch.float32"):
        pad_collate([torch.tensor([1, 2]), torch.tensor([0.5, 1.5, 2.5])])


@pytest.mark.parametrize(
    ("samples", "match"),
    [
        ([(torch.ones(2), torch.ones(1)), (torch.ones(3),)], "sample 1 has 1 fields"),
        ([{"x": torch.ones(2), "y": 1}, {"x": torch.ones(3)}], r"missing \['y'\]"),
        ([torch.tensor(1.0), torch.ones(2)], "sample 1 has 1 dims"),
        ([(torch.ones(2),), (torch.tensor(3.0),)], "sample 1 has 0 dims"),
        ([{"x": torch.ones(2)}, (torch.ones(2),)], "sample 1 is a tuple"),
        ([(torch.ones(2), 1), (torch.ones(2), "a")], "field 1 of sample 1"),
        ([(torch.ones(2), 1), (torch.ones(2), 2**70)], "field 1 holds a number beyond int64"),
        ([{"x": torch.ones(2), "lengths": torch.ones(2)}] * 2, "'lengths'"),
        (torch.ones(2, 3), "samples must be a list"),
    ],
)
def test_pad_collate_names_the_bad_field(samples: Any, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        pad_collate(samples)


def test_pad_collate_padding_value_is_checked() -> None:
    with pytest.raises(TypeError, match="padding_value"):
        PadCollate(padding_value="x")
    with pytest.raises(TypeError, match=r"padding_value\['a'\]"):
        PadCollate(padding_value={"a": None})
    ints = [torch.tensor([1, 2]), torch.tensor([3])]
    with pytest.raises(ValueError, match="padding_value=nan cannot be stored"):
        PadCollate(padding_value=float("nan"))(ints)
    with pytest.raises(ValueError, match="padding_value=300 cannot be stored"):
        PadCollate(padding_value=300)([t.to(torch.uint8) for t in ints])
    with pytest.raises(ValueError, match=r"padding_value=0\.5 cannot be stored"):
        PadCollate(padding_value=0.5)(ints)
    out, lengths = PadCollate(padding_value=-1)(ints)  # what fits still works
    assert out.tolist() == [[1, 2], [3, -1]] and lengths.tolist() == [2, 1]
    floats = [torch.ones(2), torch.ones(1)]
    assert torch.isnan(PadCollate(padding_value=float("nan"))(floats)[0][1, 1])


def test_normalize_refuses_inf_scale_and_negative_std() -> None:
    with pytest.raises(ValueError, match="scale must be finite"):
        normalize((0.5,), (0.2,), scale=float("inf"))
    with pytest.raises(ValueError, match="std must be positive"):
        normalize((0.5, 0.5), (0.2, -0.2))
    with pytest.raises(TypeError, match="scale must be a number"):
        normalize((0.5,), (0.2,), scale="255")
    with pytest.raises(TypeError, match="mean must be a real tensor"):
        normalize(torch.ones(3, dtype=torch.complex64), (0.2, 0.2, 0.2))


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"lengths": None}, TypeError, "lengths must be a list"),
        ({"lengths": ["a"]}, TypeError, r"lengths\[0\] must be an int"),
        ({"lengths": [3, 2**70]}, ValueError, r"lengths\[1\]=.* is beyond int64"),
        ({"lengths": [3, -1]}, ValueError, r"lengths\[1\]=-1"),
        ({"lengths": [[1, 2]]}, ValueError, "1-D"),
        ({"seed": 2**64}, ValueError, "seed must be"),
        ({"seed": "0"}, TypeError, "seed must be an int"),
        ({"shuffle": "no"}, TypeError, "shuffle must be a bool"),
        ({"drop_last": "no"}, TypeError, "drop_last must be a bool"),
        ({"num_replicas": 2.0}, TypeError, "num_replicas must be an int"),
        ({"batch_size": None}, ValueError, "exactly one of batch_size and max_tokens"),
    ],
)
def test_balanced_sampler_names_the_argument(kwargs: dict, exc: type, match: str) -> None:
    args = {"lengths": [3, 1, 2, 5], "num_replicas": 2, "rank": 0, "batch_size": 1, **kwargs}
    with pytest.raises(exc, match=match):
        BalancedDistributedSampler(**args)


@pytest.mark.parametrize(("epoch", "exc"), [(1.7, TypeError), ("one", TypeError), (-1, ValueError)])
def test_sampler_set_epoch_takes_an_int(epoch: Any, exc: type) -> None:
    s = BalancedDistributedSampler([3, 1, 2, 5], 2, 0, batch_size=1)
    with pytest.raises(exc, match="epoch"):
        s.set_epoch(epoch)
    assert s.epoch == 0


class _Items(torch.utils.data.Dataset):
    def __init__(self, n: int, make: Callable[[int], Any] = torch.tensor) -> None:
        self.n, self.make = n, make

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return self.make(i)


def _loader() -> DataLoader:
    return DataLoader(_Items(4), batch_size=2, num_workers=1)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"timeout": float("nan")}, ValueError, "timeout must be finite"),
        ({"timeout": "5"}, TypeError, "timeout must be a number"),
        ({"timeout": None}, TypeError, "timeout must be a number"),
        ({"timeout": -1}, ValueError, "timeout must be >= 0"),
        ({"start_epoch": "x"}, TypeError, "start_epoch must be an int"),
        ({"start_epoch": 1.5}, TypeError, "start_epoch must be an int"),
        ({"prefetch": 0}, ValueError, "prefetch must be >= 1"),
        ({"prefetch": 2.0}, TypeError, "prefetch must be an int"),
    ],
)
def test_cross_epoch_loader_checks_before_starting_workers(
    kwargs: dict, exc: type, match: str
) -> None:
    with pytest.raises(exc, match=match):
        CrossEpochLoader(_loader(), **kwargs)


def test_cross_epoch_loader_set_epoch_takes_an_int() -> None:
    with CrossEpochLoader(_loader()) as loader:
        for bad in (1.7, "one", None):
            with pytest.raises(TypeError, match="epoch must be an int"):
                loader.set_epoch(bad)
        assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]


def test_prefetcher_over_a_spent_generator_says_so() -> None:
    batches = (torch.tensor([i]) for i in range(3))
    pf = CudaPrefetcher(batches, device="cpu")
    assert [int(b) for b in pf] == [0, 1, 2]
    with pytest.raises(TypeError, match="loader is an iterator"):
        list(pf)


def test_prefetcher_over_an_unfinished_generator_goes_on() -> None:
    pf = CudaPrefetcher(iter([torch.tensor([i]) for i in range(4)]), device="cpu")
    for b in pf:
        if int(b) == 1:
            break
    assert [int(b) for b in pf] == [2, 3]  # a stream split into passes is allowed


# The loop must end with the worker's error, not wait: run in a child with a deadline so that a
# regression fails this test instead of hanging the suite.
_HANG_SCRIPT = textwrap.dedent(
    """
    import threading, torch
    from torch.utils.data import DataLoader
    from aiak.data import CrossEpochLoader

    class Items(torch.utils.data.Dataset):
        def __len__(self):
            return 4
        def __getitem__(self, i):
            return i

    def collate(items):
        return {"batch": torch.tensor(items), "lock": threading.Lock()}  # cannot be pickled

    loader = DataLoader(Items(), batch_size=2, num_workers=1, collate_fn=collate)
    with CrossEpochLoader(loader) as ld:
        try:
            for _ in ld:
                pass
        except Exception as e:
            print("RAISED", type(e).__name__)
            print(e)
        else:
            print("NO ERROR")
    """
)


def test_unpicklable_batch_reaches_the_loop_with_the_worker_traceback() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _HANG_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,  # the child ends in ~2 s; the margin is for a loaded machine
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RAISED" in out.stdout, out.stdout + out.stderr[-3000:]
    assert "CrossEpochLoader worker 0" in out.stdout
    assert "Traceback" in out.stdout and "pickle" in out.stdout


def test_worker_error_of_a_local_exception_class_still_arrives() -> None:
    class LocalError(Exception):
        pass

    def boom(items: list) -> Any:
        raise LocalError("bad sample")

    loader = DataLoader(_Items(4), batch_size=2, num_workers=1, collate_fn=boom)
    with (
        CrossEpochLoader(loader, timeout=60) as ld,
        pytest.raises(RuntimeError, match="bad sample"),
    ):
        next(iter(ld))


# -- the detection ops ----------------------------------------------------------------------


def _simota_inputs(B: int = 2, G: int = 3, A: int = 8, C: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "gt_boxes": torch.cat(
            [torch.rand(B, G, 2, generator=g) * 32, torch.full((B, G, 2), 8.0)], -1
        ),
        "gt_classes": torch.randint(0, C, (B, G), generator=g),
        "gt_valid": torch.ones(B, G, dtype=torch.bool),
        "anchor_centers": torch.rand(A, 2, generator=g) * 32,
        "anchor_strides": torch.full((A,), 8.0),
        "pred_boxes": torch.cat(
            [torch.rand(B, A, 2, generator=g) * 32, torch.full((B, A, 2), 6.0)], -1
        ),
        "cls_logits": torch.randn(B, A, C, generator=g),
        "obj_logits": torch.randn(B, A, generator=g),
    }


@pytest.mark.parametrize("box_format", ["cxcywh", "xyxy"])
@pytest.mark.parametrize(("col", "match"), [(2, r"gt_boxes\[1, 2\]"), (3, r"gt_boxes\[1, 2\]")])
def test_simota_refuses_a_negative_gt_size(box_format: str, col: int, match: str) -> None:
    inputs = _simota_inputs()
    if box_format == "xyxy":
        b = inputs["gt_boxes"]
        inputs["gt_boxes"] = torch.cat([b[..., :2] - 4, b[..., :2] + 4], -1)
    inputs["gt_boxes"][1, 2, col] = -50.0
    with pytest.raises(ValueError, match=match):
        simota_assign(**inputs, box_format=box_format)
    inputs["gt_valid"][1, 2] = False  # padding may hold anything
    simota_assign(**inputs, box_format=box_format)


def test_simota_refuses_a_negative_stride_and_a_bad_class() -> None:
    inputs = _simota_inputs()
    inputs["anchor_strides"][5] = -8.0
    with pytest.raises(ValueError, match=r"anchor_strides\[5\]"):
        simota_assign(**inputs)
    inputs = _simota_inputs()
    inputs["gt_classes"][0, 1] = 4
    with pytest.raises(ValueError, match="gt_classes of valid gts"):
        simota_assign(**inputs)


_SIMOTA_CUDA_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, "tests")
    from test_bad_input_fuzz import _simota_inputs
    from aiak.ops.simota import simota_assign
    inputs = {k: v.cuda() for k, v in _simota_inputs().items()}
    case = sys.argv[1]
    if case == "class":
        inputs["gt_classes"][1, 2] = 99
    elif case == "size":
        inputs["gt_boxes"][0, 1, 3] = -1.0
    elif case == "stride":
        inputs["anchor_strides"][3] = -8.0
    else:
        inputs["gt_classes"][1, 2] = 99
        inputs["gt_valid"][1, 2] = False  # padding: not checked
    out = simota_assign(**inputs)
    torch.cuda.synchronize()
    print("DONE", int(out.num_fg.sum()))
    """
)


@pytest.mark.cuda
@pytest.mark.parametrize("kernels", ["1", "0"])
@pytest.mark.parametrize("case", ["class", "size", "stride", "padding"])
def test_simota_bad_values_are_a_device_side_error_on_cuda(case: str, kernels: str) -> None:
    # A device-side assert leaves the CUDA context unusable: each case runs in its own process.
    env = dict(os.environ, AIAK_DISABLE_KERNELS="0" if kernels == "1" else "1")
    out = subprocess.run(
        [sys.executable, "-c", _SIMOTA_CUDA_SCRIPT, case],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    if case == "padding":
        assert out.returncode == 0 and "DONE" in out.stdout, out.stderr[-3000:]
        return
    assert out.returncode != 0 and "DONE" not in out.stdout, out.stdout
    assert "device-side assert" in out.stderr or "simota_assign" in out.stderr, out.stderr[-3000:]


def test_fcos3d_refuses_nan_centerness_alpha() -> None:
    P, B, G = 6, 1, 2
    strides, ranges = point_meta([4, 2], [8, 16], [(-1, 64), (64, 1e8)])
    tensors = (
        torch.rand(P, 2) * 32, strides, ranges, torch.tensor([[[0.0, 0, 16, 16]] * G]),
        torch.zeros(B, G, dtype=torch.int64), torch.rand(B, G, 7),
        torch.zeros(B, G, dtype=torch.int64), torch.rand(B, G, 2) * 16, torch.rand(B, G),
        torch.zeros(B, G, dtype=torch.int64), torch.ones(B, G, dtype=torch.bool),
    )  # fmt: skip
    for alpha, exc in ((float("nan"), ValueError), (-1.0, ValueError), ("2.5", TypeError)):
        with pytest.raises(exc, match="centerness_alpha"):
            fcos3d_targets(
                *tensors, background_label=3, attr_background_label=2, centerness_alpha=alpha
            )
    out = fcos3d_targets(*tensors, background_label=3, attr_background_label=2)
    assert torch.isfinite(out.centerness).all()


@pytest.mark.parametrize(
    ("args", "exc", "match"),
    [
        (
            ([4], [8], [(100, 1)]),
            ValueError,
            r"regress_ranges\[0\] = \(100.0, 1.0\) has low > high",
        ),
        (([4, -1], [8, 16], [(0, 64), (64, 128)]), ValueError, r"num_points_per_level\[1\]"),
        (([4], [8], ["ab"]), TypeError, r"regress_ranges\[0\] must be a list"),
        (([4], [8], [(0, 1, 2)]), ValueError, r"regress_ranges\[0\] must be a \(low, high\)"),
        (([4], [0], [(0, 64)]), ValueError, r"strides\[0\] must be > 0"),
        (([4], ["8"], [(0, 64)]), TypeError, r"strides\[0\] must be a number"),
        (([4.0], [8], [(0, 64)]), TypeError, r"num_points_per_level\[0\] must be an int"),
        ((4, [8], [(0, 64)]), TypeError, "num_points_per_level must be a list"),
        (([4], [8], [(0, float("nan"))]), ValueError, r"regress_ranges\[0\]\[1\] must not be NaN"),
        (([4, 4], [8], [(0, 64)]), ValueError, "one entry per level"),
    ],
)
def test_point_meta_names_the_argument(args: tuple, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        point_meta(*args)


# -- aiak.comm ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "exc", "match"),
    [
        (lambda: comm.downsample(n=10**9), ValueError, "n must be >= 1 and <= 1024"),
        (lambda: comm.dgc(compress_upper_bound=math.inf), ValueError, "compress_upper_bound"),
        (lambda: comm.dgc(warmup_epochs=-7), ValueError, "warmup_epochs must be >= -1"),
        (lambda: comm.dgc(fp16_values="no"), TypeError, "fp16_values must be a bool"),
        (lambda: comm.dgc(compress_ratio="0.1"), TypeError, "compress_ratio must be a number"),
        (lambda: comm.dgc(momentum=None), TypeError, "momentum must be a number"),
        (lambda: comm.dgc(compress_lower_bound="x"), TypeError, "compress_lower_bound"),
        (lambda: comm.dgc(warmup_coeff="x"), TypeError, "warmup_coeff must be a number"),
        (
            lambda: comm.dgc(warmup_coeff=[0.5, "x"], warmup_epochs=2),
            TypeError,
            r"warmup_coeff\[1\]",
        ),
        (lambda: comm.dgc(clip_grad_func_params=5), TypeError, "clip_grad_func_params must be"),
        (
            lambda: comm.dgc(clip_grad_func_params={"max_norm": 1}),
            ValueError,
            "given without clip_grad_func",
        ),
        (
            lambda: comm.dgc(clip_grad_func="norm", clip_grad_func_params=5),
            TypeError,
            "clip_grad_func_params must be a dict",
        ),
        (
            lambda: comm.dgc(
                clip_grad_func="norm", clip_grad_func_params={"max_norm": 1, "norm_type": "banana"}
            ),
            ValueError,
            "norm_type",
        ),
        (
            lambda: comm.dgc(clip_grad_func="norm", clip_grad_func_params={"max_nrom": 1}),
            ValueError,
            r"needs clip_grad_func_params \['max_norm'\]",
        ),
        (
            lambda: comm.dgc(clip_grad_func="value", clip_grad_func_params={"clip_value": "1"}),
            TypeError,
            "clip_value",
        ),
        (
            lambda: comm.dgc(
                clip_grad_func=lambda g, *, limit: g, clip_grad_func_params={"lim": 1}
            ),
            TypeError,
            "do not fit",
        ),
        (lambda: comm.DGCSGD([torch.zeros(1)], lr=math.inf), ValueError, "lr must be finite"),
        (
            lambda: comm.DGCSGD([torch.zeros(1)], lr=0.1, weight_decay=math.inf),
            ValueError,
            "weight_decay must be finite",
        ),
        (lambda: comm.DGCSGD([torch.zeros(1)], lr="0.1"), TypeError, "lr must be a number"),
        (lambda: comm.DGCSGD([torch.zeros(1)], lr=0.1, nesterov="no"), TypeError, "nesterov"),
        (
            lambda: comm.DGCSGD([{"params": [torch.zeros(1)], "lr": math.nan}], lr=0.1),
            ValueError,
            "lr must be finite",
        ),
    ],
)
def test_comm_named_cases(make: Callable[[], Any], exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        make()


def test_dgcsgd_refuses_a_bad_group_added_later_and_keeps_its_groups() -> None:
    opt = comm.DGCSGD([torch.zeros(1)], lr=0.1)
    with pytest.raises(ValueError, match="momentum must be >= 0 and < 1"):
        opt.add_param_group({"params": [torch.zeros(2)], "momentum": 1.5})
    assert len(opt.param_groups) == 1


_OVERLAP_SCRIPT = textwrap.dedent(
    """
    import socket, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from aiak import comm
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        cases = [
            ("norm", None), ("norm", {"clip_value": 1}), ("value", {}), ("norm", {"max_norm": -1}),
            ("banana", None), ("norm", 5), (lambda ps, *, limit: None, {"lim": 1}),
        ]
        for func, params in cases:
            model = torch.nn.Linear(3, 2)
            ddp = DDP(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            try:
                comm.overlap_step(ddp, opt, clip_grad_func=func, clip_grad_func_params=params)
                print("ACCEPTED", func, params)
            except (ValueError, TypeError) as e:
                print("REFUSED", type(e).__name__, e)
            del ddp, opt, model
        model = torch.nn.Linear(3, 2)
        ddp = DDP(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        comm.overlap_step(ddp, opt, "norm", {"max_norm": 1.0, "norm_type": "inf"})
        ddp(torch.ones(4, 3)).sum().backward()
        print("STEPPED")
        del ddp, opt, model
    finally:
        dist.destroy_process_group()
    """
)


def test_overlap_step_checks_its_clipping_when_built() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _OVERLAP_SCRIPT],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    refused = [line for line in lines if line.startswith("REFUSED")]
    assert len(refused) == 7, out.stdout
    assert all("clip_grad_func" in line for line in refused), out.stdout
    assert "needs clip_grad_func_params ['max_norm']" in refused[0]
    assert lines[-1] == "STEPPED"


# -- window attention -----------------------------------------------------------------------


@pytest.mark.parametrize("scale", [math.nan, math.inf, -math.inf])
def test_window_attention_refuses_a_non_finite_scale(scale: float) -> None:
    q = torch.randn(2, 1, 4, 8)
    with pytest.raises(ValueError, match="scale must be finite"):
        window_attention(q, q, q, torch.zeros(1, 4, 4), scale=scale)


def test_window_merge_roll_names_h_and_w() -> None:
    w = torch.zeros(4, 4, 3)
    for H, exc in ((-4, ValueError), (0, ValueError), (4.0, TypeError), ("4", TypeError)):
        with pytest.raises(exc, match="window_merge_roll: H"):
            window_merge_roll(w, H, 4)


# -- hypothesis over every argument ---------------------------------------------------------

SAMPLER = {"lengths": [3, 1, 2, 5, 4], "num_replicas": 2, "rank": 1, "batch_size": 2}


def _sampler(**kw: Any) -> Any:
    return list(BalancedDistributedSampler(**{**SAMPLER, **kw}))


FACTORIES: dict[str, tuple[Callable[[Any], Any], str | tuple[str, ...]]] = {
    **{
        f"sampler.{k}": (lambda v, k=k: _sampler(**{k: v}), k)
        for k in (
            "lengths",
            "num_replicas",
            "rank",
            "batch_size",
            "shuffle",
            "seed",
            "drop_last",
            "group_steps",
        )
    },
    "sampler.max_tokens": (lambda v: _sampler(batch_size=None, max_tokens=v), "max_tokens"),
    "sampler.set_epoch": (
        lambda v: BalancedDistributedSampler(**SAMPLER).set_epoch(v),
        "epoch",
    ),
    "PadCollate.padding_value": (
        lambda v: PadCollate(padding_value=v)([torch.ones(2), torch.ones(1)]),
        "padding_value",
    ),
    "PadCollate.padding_value.int": (
        lambda v: PadCollate(padding_value=v)(
            [torch.ones(2, dtype=torch.int8), torch.ones(1, dtype=torch.int8)]
        ),
        "padding_value",
    ),
    "PadCollate.pad_to_multiple_of": (
        lambda v: PadCollate(pad_to_multiple_of=v)([torch.ones(2)]),
        "pad_to_multiple_of",
    ),
    "pad_collate.samples": (lambda v: pad_collate(v), "pad_collate"),
    "pad_collate.field": (lambda v: pad_collate([(torch.ones(2), 1), (torch.ones(1), v)]), "field"),
    "normalize.mean": (lambda v: normalize(v, (0.2,)), "mean"),
    "normalize.std": (lambda v: normalize((0.5,), v), "std"),
    "normalize.scale": (lambda v: normalize((0.5,), (0.2,), scale=v), "scale"),
    "normalize.dtype": (lambda v: normalize((0.5,), (0.2,), dtype=v), "dtype"),
    "normalize.channel_dim": (lambda v: normalize((0.5,), (0.2,), channel_dim=v), "channel_dim"),
    "CudaPrefetcher.depth": (lambda v: CudaPrefetcher([], device="cpu", depth=v), "depth"),
    "CudaPrefetcher.device": (lambda v: CudaPrefetcher([], device=v), "device"),
    # built only: what the loader's own iterator raises reaches the loop unchanged (documented)
    "CudaPrefetcher.loader": (lambda v: CudaPrefetcher(v, device="cpu"), "loader"),
    "point_meta.num_points_per_level": (
        lambda v: point_meta(v, [8], [(0, 64)]),
        "num_points_per_level",
    ),
    "point_meta.strides": (lambda v: point_meta([2], v, [(0, 64)]), "strides"),
    "point_meta.regress_ranges": (lambda v: point_meta([2], [8], v), "regress_ranges"),
    "point_meta.range_end": (lambda v: point_meta([2], [8], [(0, v)]), "regress_ranges"),
    "downsample.n": (lambda v: comm.downsample(n=v), "n must"),
    "downsample.momentum": (lambda v: comm.downsample(momentum=v), "momentum"),
    **{
        f"dgc.{k}": (lambda v, k=k: comm.dgc(**{k: v}), k)
        for k in (
            "compress_ratio",
            "sample_ratio",
            "strided_sample",
            "compress_upper_bound",
            "compress_lower_bound",
            "max_adaptation_iters",
            "resample",
            "fp16_values",
            "int32_indices",
            "warmup_epochs",
            "warmup_coeff",
            "momentum",
            "nesterov",
            "momentum_masking",
            "clip_grad_func",
        )
    },
    "dgc.clip_grad_func_params": (
        lambda v: comm.dgc(clip_grad_func="norm", clip_grad_func_params=v),
        "clip_grad_func_params",
    ),
    "dgc.max_norm": (
        lambda v: comm.dgc(clip_grad_func="norm", clip_grad_func_params={"max_norm": v}),
        "max_norm",
    ),
    "dgc.norm_type": (
        lambda v: comm.dgc(
            clip_grad_func="norm", clip_grad_func_params={"max_norm": 1.0, "norm_type": v}
        ),
        "norm_type",
    ),
    "dgc.clip_value": (
        lambda v: comm.dgc(clip_grad_func="value", clip_grad_func_params={"clip_value": v}),
        "clip_value",
    ),
    **{
        f"DGCSGD.{k}": (lambda v, k=k: comm.DGCSGD([torch.zeros(1)], **{"lr": 0.1, k: v}), k)
        for k in ("lr", "momentum", "weight_decay", "nesterov")
    },
    "window_attention.scale": (
        lambda v: window_attention(*[torch.ones(2, 1, 4, 8)] * 3, torch.zeros(1, 4, 4), scale=v),
        "scale",
    ),
    "window_attention.mask": (
        lambda v: window_attention(*[torch.ones(2, 1, 4, 8)] * 3, torch.zeros(1, 4, 4), mask=v),
        "mask",
    ),
    "window_attention.bias": (
        lambda v: window_attention(*[torch.ones(2, 1, 4, 8)] * 3, v),
        "bias",
    ),
    "roll_window_partition.window": (
        lambda v: roll_window_partition(torch.zeros(1, 4, 4, 3), v, 0),
        ("window", "H = 4"),
    ),
    "roll_window_partition.shift": (
        lambda v: roll_window_partition(torch.zeros(1, 4, 4, 3), 2, v),
        "shift",
    ),
    "window_merge_roll.shift": (
        lambda v: window_merge_roll(torch.zeros(4, 4, 3), 4, 4, v),
        "shift",
    ),
    "window_merge_roll.H": (
        lambda v: window_merge_roll(torch.zeros(4, 4, 3), v, 4),
        ("H", "windows"),
    ),
    # a huge W passes its own check and then does not fit the windows given
    "window_merge_roll.W": (
        lambda v: window_merge_roll(torch.zeros(4, 4, 3), 4, v),
        ("W", "windows"),
    ),
}


@pytest.mark.parametrize("where", sorted(FACTORIES))
@settings(max_examples=25, deadline=None)
@given(value=GARBAGE)
def test_every_argument_with_garbage_names_itself(where: str, value: Any) -> None:
    fn, names = FACTORIES[where]
    works_or_names(lambda: fn(value), *((names,) if isinstance(names, str) else names))


LOADER_ARGS = ("prefetch", "start_epoch", "timeout")


@pytest.mark.parametrize("name", LOADER_ARGS)
@settings(max_examples=10, deadline=None)
@given(value=GARBAGE)
def test_cross_epoch_loader_arguments_with_garbage(name: str, value: Any) -> None:
    def build() -> None:
        CrossEpochLoader(_loader(), **{name: value}).close()  # workers joined at once

    works_or_names(build, name)


SIMOTA_TENSORS = tuple(_simota_inputs())
SIMOTA_SCALARS = ("center_radius", "center_only", "geometry_penalty", "box_format")


@pytest.mark.parametrize("name", SIMOTA_SCALARS)
@settings(max_examples=20, deadline=None)
@given(value=GARBAGE)
def test_simota_options_with_garbage(name: str, value: Any) -> None:
    works_or_names(lambda: simota_assign(**_simota_inputs(), **{name: value}), name)


DTYPES = st.sampled_from(
    [torch.float32, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool,
     torch.uint8]
)  # fmt: skip


def _reshaped(t: torch.Tensor, how: str) -> torch.Tensor:
    if how == "empty":
        return t[:0]
    if how == "drop_last_dim":
        return t[..., :1]
    if how == "extra_dim":
        return t[None]
    if how == "meta":
        return t.to("meta")
    if how == "flat":
        return t.reshape(-1)
    return t


TENSOR_CHANGES = st.tuples(
    st.sampled_from(["keep", "empty", "drop_last_dim", "extra_dim", "meta", "flat"]), DTYPES
)


@pytest.mark.parametrize("name", sorted(_simota_inputs()))
@settings(max_examples=20, deadline=None)
@given(change=TENSOR_CHANGES, garbage=GARBAGE, use_garbage=st.booleans())
def test_simota_tensors_mismatched(
    name: str, change: tuple, garbage: Any, use_garbage: bool
) -> None:
    inputs = _simota_inputs()
    how, dtype = change
    inputs[name] = garbage if use_garbage else _reshaped(inputs[name], how).to(dtype)
    # a mismatch is named by the argument that disagrees with the ones checked before it
    works_or_names(lambda: simota_assign(**inputs), *SIMOTA_TENSORS)


def _fcos3d_inputs(P: int = 6, B: int = 2, G: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    strides, ranges = point_meta([4, P - 4], [8, 16], [(-1, 64), (64, 1e8)])
    xy = torch.rand(B, G, 2, generator=g) * 32
    return {
        "points": torch.rand(P, 2, generator=g) * 32,
        "point_strides": strides,
        "regress_ranges": ranges,
        "gt_bboxes": torch.cat([xy - 4, xy + 4], -1),
        "gt_labels": torch.zeros(B, G, dtype=torch.int64),
        "gt_bboxes_3d": torch.rand(B, G, 7, generator=g),
        "gt_labels_3d": torch.zeros(B, G, dtype=torch.int64),
        "centers2d": xy,
        "depths": torch.rand(B, G, generator=g),
        "attr_labels": torch.zeros(B, G, dtype=torch.int64),
        "gt_valid": torch.ones(B, G, dtype=torch.bool),
    }


FCOS3D_TENSORS = tuple(_fcos3d_inputs())


@pytest.mark.parametrize("name", FCOS3D_TENSORS)
@settings(max_examples=15, deadline=None)
@given(change=TENSOR_CHANGES, garbage=GARBAGE, use_garbage=st.booleans())
def test_fcos3d_tensors_mismatched(
    name: str, change: tuple, garbage: Any, use_garbage: bool
) -> None:
    inputs = _fcos3d_inputs()
    how, dtype = change
    inputs[name] = garbage if use_garbage else _reshaped(inputs[name], how).to(dtype)
    labels = {"background_label": 3, "attr_background_label": 2}
    # a mismatch is named by the argument that disagrees with the ones checked before it
    works_or_names(lambda: fcos3d_targets(**inputs, **labels), *FCOS3D_TENSORS)


FCOS3D_SCALARS = (
    "background_label",
    "attr_background_label",
    "center_sample_radius",
    "centerness_alpha",
)


@pytest.mark.parametrize("name", FCOS3D_SCALARS)
@settings(max_examples=20, deadline=None)
@given(value=GARBAGE)
def test_fcos3d_options_with_garbage(name: str, value: Any) -> None:
    kwargs: dict[str, Any] = {"background_label": 3, "attr_background_label": 2, name: value}
    works_or_names(lambda: fcos3d_targets(**_fcos3d_inputs(), **kwargs), name)
