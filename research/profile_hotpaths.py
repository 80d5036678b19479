"""Where host and GPU time go on the paths that miss their targets (a diagnosis, not a claim).

python research/profile_hotpaths.py [launch|l2norm|dgc|data|overlap ...]
"""

from __future__ import annotations

import cProfile
import ctypes
import importlib
import io
import os
import pstats
import sys
from collections.abc import Callable
from typing import Any

import torch
from profile_host import host_us

import aiak.ops
from aiak.ops import _cuda, _driver, _host, _mta
from aiak.ops import cast_scale as cs

l2 = importlib.import_module("aiak.ops.multi_tensor_l2norm")


def show(label: str, fn: Callable[[], Any]) -> None:
    print(f"{label:48s} {host_us(fn):8.2f} us", flush=True)


def cprof(fn: Callable[[], Any], calls: int = 200, lines: int = 25) -> None:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(lines)
    print("\n".join(out.getvalue().splitlines()[: lines + 12]))


def gpu_kernels(fn: Callable[[], Any], reps: int = 5) -> None:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))


def launch() -> None:
    x = torch.randn(1 << 20, device="cuda")
    y = torch.empty_like(x)
    h = torch.empty_like(x, dtype=torch.float16)
    np = _cuda.numpy()
    fn = _cuda.get_function("cast_scale.cu", "cast_scale_f32_f16")
    args = (np.uint64(x.data_ptr()), np.uint64(h.data_ptr()), np.float32(2.0), np.int64(x.numel()))
    stream = _cuda.current_stream()
    n = x.numel()
    show("torch.mul(x, 2.0, out=y)", lambda: torch.mul(x, 2.0, out=y))
    show("y.copy_(x)", lambda: y.copy_(x))
    show("torch.empty(1)", lambda: torch.empty(1, device="cuda"))
    show("aiak.ops.cast_scale_(h, x, 2.0)", lambda: aiak.ops.cast_scale_(h, x, 2.0))
    show("  CAST_OP.eager_kernel", lambda: cs.CAST_OP.eager_kernel((h, x)))
    show("  _check", lambda: cs._check(h, x, 2.0))
    show("  _cast_cuda", lambda: cs._cast_cuda(h, x, 2.0))
    show("  use_kernel", lambda: cs.use_kernel(cs.CAP, h.device, (x.dtype, h.dtype)))
    show("  get_function", lambda: _cuda.get_function("cast_scale.cu", "cast_scale_f32_f16"))
    show("  num_sms(current_device())", lambda: _cuda.num_sms(torch.cuda.current_device()))
    show("  current_stream()", _cuda.current_stream)
    show(
        "  4 numpy args",
        lambda: (
            np.uint64(x.data_ptr()),
            np.uint64(h.data_ptr()),
            np.float32(2.0),
            np.int64(x.numel()),
        ),
    )
    show("  cupy fn(grid, block, args, stream=)", lambda: fn((528,), (512,), args, stream=stream))
    kernel = _driver.DriverKernel(fn, cs._ARGTYPES)
    show("  DriverKernel(prebuilt)", lambda: kernel(528, 512, x.data_ptr(), h.data_ptr(), 2.0, n))
    show("  _increment", lambda: aiak.ops._registry._increment((h,)))
    # the same launch through the driver API from ctypes, with argument slots kept
    lib = ctypes.CDLL("libcuda.so.1")
    cu = lib.cuLaunchKernel
    cu.restype = ctypes.c_int
    cu.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    slots = (
        ctypes.c_uint64(x.data_ptr()),
        ctypes.c_uint64(h.data_ptr()),
        ctypes.c_float(2.0),
        ctypes.c_int64(x.numel()),
    )
    params = (ctypes.c_void_p * 4)(*[ctypes.addressof(s) for s in slots])
    kern = getattr(fn, "kernel", None)
    fptr = getattr(kern, "ptr", None)
    if fptr is None:
        print(
            "no function pointer; RawKernel attrs:", [a for a in dir(fn) if not a.startswith("__")]
        )
        return
    raw = torch._C._cuda_getCurrentRawStream

    def ct() -> None:
        slots[0].value = x.data_ptr()
        slots[1].value = h.data_ptr()
        r = cu(fptr, 528, 1, 1, 512, 1, 1, 0, raw(0), params, None)
        if r:
            raise RuntimeError(r)

    show("  ctypes cuLaunchKernel (slots kept)", ct)
    torch.cuda.synchronize()
    ref = torch.empty_like(h)
    aiak.ops.cast_scale_(ref, x, 2.0)
    h.zero_()
    ct()
    torch.cuda.synchronize()
    print("ctypes launch result equal:", torch.equal(ref, h))
    cprof(lambda: aiak.ops.cast_scale_(h, x, 2.0), 2000)


def l2norm() -> None:
    from aiak.conformance.shapes import RESNET50

    ts = [torch.randn(s, device="cuda") for s in RESNET50]
    print(f"== ResNet-50 set, {len(ts)} tensors")
    torch.set_grad_enabled(False)
    show("aiak.ops.multi_tensor_l2norm(ts, True)", lambda: aiak.ops.multi_tensor_l2norm(ts, True))
    show("  _l2norm_cuda", lambda: l2._l2norm_cuda(ts, True))
    show("  _mta.cached", lambda: _mta.cached("multi_tensor_l2norm", [ts]))
    show("  _mta.key", lambda: _mta.key("multi_tensor_l2norm", [ts]))
    show("  _host.layout_key (python)", lambda: _host._layout_key_py([ts]))
    show("  list(map(data_ptr))", lambda: list(map(torch.Tensor.data_ptr, ts)))
    show("  tuple(map(data_ptr))", lambda: tuple(map(torch.Tensor.data_ptr, ts)))
    show("  [t.data_ptr() for t]", lambda: [t.data_ptr() for t in ts])
    show("  tuple(map(numel))", lambda: tuple(map(torch.Tensor.numel, ts)))
    show("  tuple(map(id))", lambda: tuple(map(id, ts)))
    import operator

    rg = operator.attrgetter("requires_grad")
    show("  any(map(requires_grad))", lambda: any(map(rg, ts)))
    k = _mta.key("multi_tensor_l2norm", [ts])
    show("  hash(key)", lambda: hash(k))
    show("  _mta.lookup(key)", lambda: _mta.lookup(k))
    show(
        "  3x torch.empty",
        lambda: (
            torch.empty(1, device="cuda"),
            torch.empty(161, device="cuda"),
            torch.empty(3000, device="cuda"),
        ),
    )
    torch.set_grad_enabled(True)
    show("grad mode: aiak.ops.multi_tensor_l2norm", lambda: aiak.ops.multi_tensor_l2norm(ts, True))
    torch.set_grad_enabled(False)
    tab = _mta.cached("multi_tensor_l2norm", [ts])
    show("  _l2norm_launch", lambda: l2._l2norm_launch(tab, len(ts), True))
    show("torch._foreach_norm + stack", lambda: torch.stack(torch._foreach_norm(ts)))
    bound = aiak.ops.BoundNorm()
    bound(ts)
    dev = ts[0].device
    show("BoundNorm()(ts)", lambda: bound(ts))
    show("  eager_kernel", lambda: l2.L2NORM_OP.eager_kernel((ts, False)))
    show("  use_kernel", lambda: l2.use_kernel(l2.CAP, tab.data.device, tab.dtypes))
    show("  tab.data.device", lambda: tab.data.device)
    show("  tab.wait", tab.wait)
    show("  _l2norm_launch(per=False)", lambda: l2._l2norm_launch(tab, len(ts), False))
    show("  torch.empty((), device=dev)", lambda: torch.empty((), device=dev))
    show("  tab.scratch", lambda: tab.scratch(1))
    scratch = tab.scratch(1 + 2 * len(ts) + tab.num_chunks)
    total = torch.empty((), device=dev)
    show(
        "  run_kernel mt_l2norm",
        lambda: _driver.run_kernel(
            l2._SOURCE, "mt_l2norm", tab.num_chunks, l2._BLOCK, tab.data, 161, scratch, None, total
        ),
    )
    ptrs = [t.data_ptr() for t in ts]
    same = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
    if same is not None:
        idx = list(range(len(ts)))
        show("  C++ _tensors_data_ptrs_at_indices_equal", lambda: same(ts, ptrs, idx))
    show("  python: pass()", lambda: None)
    cprof(lambda: bound(ts), 300)
    cprof(lambda: aiak.ops.multi_tensor_l2norm(ts, True), 300)
    gpu_kernels(lambda: aiak.ops.multi_tensor_l2norm(ts, True))


def dgc() -> None:
    from aiak.ops.dgc_select import dgc_select

    n = 25_000_000
    g = torch.randn(n, device="cuda")
    k, m = 25_000, 250_000

    def call():
        return dgc_select(g, k, m, 0, n // m)

    show("dgc_select 25M @0.001", call)
    show("torch.topk(|g|, k)", lambda: torch.topk(g.abs(), k, sorted=False))
    cprof(call, 100)
    gpu_kernels(call)
    gpu_kernels(lambda: torch.topk(g.abs(), k, sorted=False))


def data() -> None:
    mean = torch.tensor((0.485, 0.456, 0.406), device="cuda").view(1, 3, 1, 1) * 255
    inv = 1 / (torch.tensor((0.229, 0.224, 0.225), device="cuda").view(1, 3, 1, 1) * 255)
    u8 = torch.randint(0, 255, (256, 3, 224, 224), dtype=torch.uint8, device="cuda")
    gpu_kernels(lambda: (u8.float() - mean) * inv)
    x = torch.empty(u8.shape, device="cuda")
    gpu_kernels(lambda: x.copy_(u8))
    host = u8.cpu().pin_memory()
    gpu_kernels(lambda: u8.copy_(host, non_blocking=True))


def overlap() -> None:
    import torch.distributed as dist
    import torchvision

    from aiak import comm

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29534")
    dist.init_process_group("nccl", rank=0, world_size=1)
    x = torch.randn(32, 3, 224, 224, device="cuda")
    y = torch.randint(0, 1000, (32,), device="cuda")
    for overlap in (False, True):
        torch.manual_seed(0)
        model = torchvision.models.resnet50().cuda()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=False)
        if overlap:
            comm.overlap_step(ddp, opt, hook=comm.allreduce())
        else:
            comm.register(ddp, comm.allreduce())

        def step(ddp=ddp, opt=opt, overlap=overlap):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            if not overlap:
                opt.step()

        def bwd_only(ddp=ddp, opt=opt):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()

        print(f"== overlap={overlap}")
        show("step ms*1000", step)
        if not overlap:
            show("fwd+bwd only", bwd_only)
            show("opt.step", opt.step)
        from torch.profiler import ProfilerActivity, profile

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        ev = [e for e in prof.events() if str(e.device_type).endswith("CUDA")]
        busy = sum(e.device_time for e in ev) / 3 / 1000
        print(f"GPU kernel time per step: {busy:.2f} ms over {len(ev) / 3:.0f} kernels")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
        cprof(step, 5, 20)
    comm.shutdown()


def main() -> None:
    which = sys.argv[1:] or ["launch", "l2norm", "dgc", "data", "overlap"]
    print(torch.cuda.get_device_name(), torch.__version__)
    for name in which:
        print(f"\n######## {name}", flush=True)
        globals()[name]()


if __name__ == "__main__":
    main()
