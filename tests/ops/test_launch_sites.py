"""Every kernel's declaration against its source, and every op's launch call sites run on the
CPU through the real launcher with ``cuLaunchKernelEx`` recorded (``tests/_recorder.py``): the
parameter count and types a call site packs, and named values read back where the kernel
reads them."""

from __future__ import annotations

import importlib

import pytest
import torch
from _recorder import Recorder

import aiak.ops  # noqa: F401 (declares every kernel)
from aiak.ops import _cuda, _driver, _mta, fused_adam, fused_lamb, fused_sgd
from aiak.ops import _window_attention_cuda as wac
from aiak.ops import _window_attention_kernels as wak
from aiak.ops import cast_scale as cs
from aiak.ops import fcos3d as fcos3d_mod
from aiak.ops import window_attention as wa
from aiak.ops import window_partition as wp
from aiak.ops._dgc_select_cuda import launch_select
from aiak.ops._simota_cuda import launch_simota

# the module (aiak.ops.multi_tensor_l2norm is also the op's function)
l2norm = importlib.import_module("aiak.ops.multi_tensor_l2norm")


def _product_kernels() -> list[_driver.Kernel]:
    return [k for k in _driver.DECLARED if k.owner.startswith("aiak.ops.")]


def test_every_kernel_of_the_sources_is_declared_as_written() -> None:
    declared = {(k.source, k.name) for k in _product_kernels()}
    for path in sorted(_cuda.KERNEL_DIR.glob("*.cu")):
        names = set(_driver.source_signatures(path.name))
        assert names, path.name
        assert {(path.name, n) for n in names} <= declared, path.name
    for k in _product_kernels():
        _driver.check_signature(k)  # raises TypeError naming the kernel on a mismatch


def test_the_signature_parser_reads_types_names_and_macros() -> None:
    src = """typedef long long i64;
// extern "C" __global__ void commented_out(int a) {}
#define K(NAME, T)                                \\
  extern "C" __global__ void NAME(const T* __restrict__ x, i64 n, double r, unsigned m) {}
K(k_f32, float)
K(k_f16, half)
extern "C" __global__ void __launch_bounds__(256) plain(float s, int* out) {}
"""
    sigs = _driver.signatures(src)
    assert set(sigs) == {"k_f32", "k_f16", "plain"}
    assert sigs["k_f16"] == (("ptr", "x"), ("i64", "n"), ("f64", "r"), ("u32", "m"))
    assert sigs["plain"] == (("f32", "s"), ("ptr", "out"))
    with pytest.raises(TypeError, match="unknown kernel parameter type"):
        _driver.signatures('extern "C" __global__ void k(short x) {}')


@pytest.fixture
def sites(recorder: Recorder, monkeypatch: pytest.MonkeyPatch) -> Recorder:
    """The recorder, with the op modules' kernel checks and caches out of the way."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(wac, "_sm_limits", lambda device: (228 * 1024, 65536))
    monkeypatch.setattr(wac, "_PLANS", {})
    monkeypatch.setattr(wac, "_CARVED", set())
    monkeypatch.setattr(wp, "_GATHERS", {})
    monkeypatch.setattr(cs, "_records", {})
    for module in (wac, wp, fcos3d_mod, cs):
        monkeypatch.setattr(module, "use_kernel", lambda *a, **k: True)
    return recorder


def _table(depth: int, n: int, chunks: int) -> _mta.Table:
    data = torch.zeros(8, dtype=torch.int64)
    return _mta.Table(data, depth, n, chunks, None, 0)  # type: ignore[arg-type]


def test_fused_optimizer_launches(sites: Recorder) -> None:
    import _fused_args as args

    tab = _table(6, 2, 3)
    a = args.adam(lr=0.5, weight_decay=0.25)
    fused_adam._launch(a, tab)
    s = args.sgd(lr=0.5, momentum=0.9)
    fused_sgd._launch(s, tab)
    la = args.lamb(lr=0.5, max_grad_norm=2.0)
    fused_lamb._launch(la, tab)
    names = [launch["name"] for launch in sites.launches]
    assert names == [
        "fused_adam",
        "bump_steps",
        "fused_sgd",
        "fused_lamb_stage1",
        "fused_lamb_stage2",
    ]
    adam, bump, sgd, stage1, stage2 = (launch["args"] for launch in sites.launches)
    assert (adam["table"], adam["T"], adam["D"], adam["lr"], adam["wd"]) == (
        tab.data.data_ptr(), len(a.params), 6, 0.5, 0.25,
    )  # fmt: skip
    assert adam["lr_ptr"] == 0 and bump["list"] == 4
    assert sgd["momentum"] == pytest.approx(0.9) and sgd["scales"] == 0
    assert stage1["max_grad_norm"] == 2.0 and stage1["grad_norm"] == la.grad_norms[0].data_ptr()
    assert stage2["C"] == 3 and stage2["lr"] == 0.5
    assert sites.launches[0]["dims"][:4] == (3, 1, 1, fused_adam._fused.BLOCK)


def test_l2norm_launch(sites: Recorder) -> None:
    tab = _table(1, 4, 5)
    total = l2norm._launch(tab, 4, None)
    (launch,) = sites.launches
    assert launch["name"] == "mt_l2norm" and launch["dims"][0] == 5
    assert launch["args"]["T"] == 4 and launch["args"]["per_tensor"] == 0
    assert launch["args"]["total"] == total.data_ptr()


def test_cast_scale_launch(sites: Recorder) -> None:
    src, dst = torch.randn(5000), torch.empty(5000, dtype=torch.float16)
    cs._cast_cuda(dst, src, 1e39)  # beyond float32: packs as inf, as C converts
    (launch,) = sites.launches
    assert launch["name"] == "cast_scale_f32_f16"
    a = launch["args"]
    assert (a["src"], a["dst"], a["n"], a["scale"]) == (
        src.data_ptr(), dst.data_ptr(), 5000, float("inf"),
    )  # fmt: skip


@pytest.mark.parametrize("kernel", ["mma", "scalar"])
def test_window_attention_launches(sites: Recorder, kernel: str) -> None:
    windows, heads, n, d, nw = 4, 3, 49, 32, 2
    q, k, v, dout = (torch.randn(windows, heads, n, d).half() for _ in range(4))
    k = k.transpose(0, 1).contiguous().transpose(0, 1)  # strides differ from q's
    bias, mask = torch.randn(heads, n, n), torch.zeros(nw, n, n)
    wac._attention_cuda_with(kernel, q, k, v, bias, mask, 0.17)
    wac._attention_backward_cuda_with(kernel, dout, q, k, v, bias, mask, 1)
    fwd, bwd = sites.launches
    prefix = "window_attention_" + ("mma_" if kernel == "mma" else "")
    # the mma backward: the default variant's entry point
    infix = wa.BWD_VARIANTS[wa.DEFAULT_BWD_VARIANT].infix if kernel == "mma" else ""
    assert fwd["name"] == prefix + "fwd_f16_d32"
    assert bwd["name"] == prefix + f"bwd_{infix}f16_d32"
    for launch, scale in ((fwd, 0.17), (bwd, 1.0)):
        a = launch["args"]
        assert (a["B_"], a["nH"], a["N"], a["nW"]) == (windows, heads, n, nw)
        assert (a["qb"], a["qh"], a["qn"]) == q.stride()[:3]
        assert (a["kb"], a["kh"], a["kn"]) == k.stride()[:3]
        assert a["q"] == q.data_ptr() and a["mask"] == mask.data_ptr()
        assert a["scale"] == pytest.approx(scale, rel=1e-7)
        assert launch["dims"][1] == heads and launch["dims"][3:6] == (wac._THREADS, 1, 1)
    assert bwd["args"]["dout"] == dout.data_ptr()
    if kernel == "mma":  # the variant's own dynamic shared memory
        alias = wa.BWD_VARIANTS[wa.DEFAULT_BWD_VARIANT].alias_ps
        assert bwd["dims"][6] == wak._mma_smem_bytes(d, True, alias)
    else:
        assert bwd["dims"][6] > 48 * 1024


def test_window_partition_and_merge_launches(sites: Recorder) -> None:
    x = torch.randn(2, 14, 21, 8)
    windows = wp._partition_cuda(x, 7, 3)
    wp._merge_cuda(windows, 14, 21, 3)
    part, merge = sites.launches
    for launch, flag in ((part, 0), (merge, 1)):
        a = launch["args"]
        assert (a["H"], a["W"], a["ws"], a["sh"], a["sw"], a["merge"]) == (14, 21, 7, 3, 3, flag)
        unit = int(launch["name"].rsplit("_", 1)[1])
        assert a["units"] == 32 // unit and a["total"] == x.numel() * 4 // unit
    assert part["args"]["src"] == x.data_ptr() and part["args"]["dst"] == windows.data_ptr()


def test_simota_launches(sites: Recorder) -> None:
    B, G, A, C = 2, 3, 40, 5
    args = (
        torch.rand(B, G, 4) * 50,
        torch.randint(0, C, (B, G)),
        torch.ones(B, G, dtype=torch.bool),
        torch.rand(A, 2) * 64,
        torch.full((A,), 8.0),
        torch.rand(B, A, 4) * 50,
        torch.randn(B, A, C),
        torch.randn(B, A),
    )
    launch_simota(args, (B, G, A, C), 2.5, True, False, "xyxy")
    names = [launch["name"] for launch in sites.launches]
    assert names == ["simota_prepare", "simota_select", "simota_resolve"]
    for launch in sites.launches:
        a = launch["args"]
        assert (a["B"], a["G"], a["A"], a["C"], a["radius"]) == (B, G, A, C, 2.5)
        assert (a["center_only"], a["xyxy"], a.get("penalty", 0)) == (1, 1, 0)


def test_fcos3d_launch(sites: Recorder) -> None:
    B, P, G, code = 2, 30, 3, 9
    points = torch.rand(P, 2) * 64
    strides, ranges = fcos3d_mod.point_meta([P], [8], [(-1, 1e8)])
    gts = (
        torch.rand(B, G, 4) * 64,
        torch.randint(0, 10, (B, G)),
        torch.randn(B, G, code),
        torch.randint(0, 10, (B, G)),
        torch.rand(B, G, 2) * 64,
        torch.rand(B, G) * 50,
        torch.randint(0, 9, (B, G)),
        torch.ones(B, G, dtype=torch.bool),
    )
    # labels beyond int32 and a radius that float32 would round: both must arrive exactly
    out = fcos3d_mod._fcos3d_cuda(points, strides, ranges, *gts, -(2**40), 2**33, 1.1, 2.5)
    (launch,) = sites.launches
    a = launch["args"]
    assert (a["P"], a["G"], a["code"], a["radius"], a["neg_alpha"]) == (P, G, code, 1.1, -2.5)
    assert (a["background_label"], a["attr_background_label"]) == (-(2**40), 2**33)
    assert a["points"] == points.data_ptr() and a["attr_out"] == out[5].data_ptr()


def test_dgc_select_launches(sites: Recorder) -> None:
    x = torch.randn(20000)
    args = (x, 20, 2000, 0, 10, None, 1.3, 0.7, 3, True)
    values, _ = launch_select(args)
    names = [launch["name"] for launch in sites.launches]
    assert names[0] == "dgc_sample_hist" and names[-1] == "dgc_write"
    first, last = sites.launches[0], sites.launches[-1]
    assert first["attr"] == () and last["attr"] == (6, 1)  # programmatic after the first
    assert (first["args"]["x"], first["args"]["n"], first["args"]["ks"]) == (x.data_ptr(), 20000, 2)
    assert last["args"]["values"] == values.data_ptr() and last["args"]["k"] == 20
