"""aiak.data.CudaPrefetcher: nested batches, CPU pass-through, errors; on GPU identical results
and the copy on the side stream."""

from __future__ import annotations

import collections
import dataclasses
import json
import traceback
from pathlib import Path

import pytest
import torch

from aiak.data import CudaPrefetcher
from aiak.data._tree import iter_tensors, map_tensors

Pair = collections.namedtuple("Pair", ["image", "label"])


@dataclasses.dataclass(frozen=True)
class Sample:
    tokens: torch.Tensor
    name: str
    extra: dict


def _nested(i: int) -> dict:
    return {
        "pair": Pair(torch.full((2, 3), float(i)), torch.tensor(i)),
        "list": [torch.arange(i + 1), "text", 7, None],
        "sample": Sample(torch.ones(i + 2, dtype=torch.int64), f"s{i}", {"m": torch.zeros(1)}),
        "od": collections.OrderedDict(a=torch.tensor([i, i])),
    }


def _assert_same(a: object, b: object) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            _assert_same(getattr(a, f.name), getattr(b, f.name))
    else:
        assert a == b


def test_map_tensors_keeps_every_container_type_and_leaf() -> None:
    batch = _nested(3)
    out = map_tensors(lambda t, _p: t * 2, batch)
    _assert_same(out["list"][1:], ["text", 7, None])
    assert isinstance(out["pair"], Pair) and isinstance(out["sample"], Sample)
    assert isinstance(out["od"], collections.OrderedDict)
    assert torch.equal(out["pair"].image, batch["pair"].image * 2)
    assert torch.equal(out["sample"].tokens, batch["sample"].tokens * 2)
    assert batch["sample"].tokens.sum() == 5  # the input is not modified
    assert len(list(iter_tensors(batch))) == 6


def test_map_tensors_names_the_path() -> None:
    paths = []
    map_tensors(lambda t, p: paths.append(p) or t, {"a": [torch.ones(1), Pair(1, torch.ones(1))]})
    assert paths == ["['a'][0]", "['a'][1].label"]


def test_cpu_passthrough_returns_the_loader_batches_unchanged() -> None:
    batches = [_nested(i) for i in range(5)]
    pf = CudaPrefetcher(batches, device="cpu")
    assert len(pf) == 5
    for _ in range(2):  # re-iterable per epoch
        got = list(pf)
        assert len(got) == 5 and all(g is b for g, b in zip(got, batches))


def test_cpu_passthrough_applies_the_transform() -> None:
    batches = [torch.full((4,), 255, dtype=torch.uint8)]
    pf = CudaPrefetcher(batches, device="cpu", transform=lambda x: x.float() / 255)
    (out,) = list(pf)
    assert out.dtype == torch.float32 and torch.equal(out, torch.ones(4))


def test_non_tensor_batches_pass_through() -> None:
    batches = ["a", 3, None, {"k": "v"}]
    assert list(CudaPrefetcher(batches, device="cpu")) == batches


class _Boom(Exception):
    pass


class _FailingLoader:
    def __init__(self, good: int) -> None:
        self.good = good

    def __iter__(self):
        for i in range(self.good):
            yield torch.tensor([i])
        raise _Boom("batch 2 is corrupt")


def test_loader_exception_reaches_the_loop_after_the_good_batches() -> None:
    seen = []
    with pytest.raises(_Boom, match="batch 2 is corrupt") as info:
        for b in CudaPrefetcher(_FailingLoader(2), device="cpu"):
            seen.append(int(b))
    assert seen == [0, 1]
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "__iter__" in frames  # the loader's own frame is in the traceback


def test_arguments_are_validated() -> None:
    with pytest.raises(TypeError, match="loader"):
        CudaPrefetcher(3)
    with pytest.raises(ValueError, match="depth"):
        CudaPrefetcher([], device="cpu", depth=0)
    with pytest.raises(TypeError, match="depth"):
        CudaPrefetcher([], device="cpu", depth=1.5)
    with pytest.raises(TypeError, match="transform"):
        CudaPrefetcher([], device="cpu", transform=3)
    with pytest.raises(ValueError, match="device"):
        CudaPrefetcher([], device="meta")
    with pytest.raises(TypeError, match="device"):
        CudaPrefetcher([], device=1.0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda"):
            CudaPrefetcher([], device="cuda")
        assert CudaPrefetcher([]).device == torch.device("cpu")


def test_len_of_an_unsized_loader_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        len(CudaPrefetcher(iter([]), device="cpu"))


# -- GPU -----------------------------------------------------------------------------------


@pytest.mark.cuda
def test_gpu_results_identical_with_and_without_prefetcher(cuda_device: torch.device) -> None:
    batches = [_nested(i) for i in range(7)]
    pf = CudaPrefetcher(batches, device=cuda_device, depth=3)
    for _ in range(2):
        got = list(pf)
        assert len(got) == 7
        for g, b in zip(got, batches):
            _assert_same(g, b)
            assert all(t.device == cuda_device for t in iter_tensors(g))


@pytest.mark.cuda
def test_gpu_training_identical_with_and_without_prefetcher(cuda_device: torch.device) -> None:
    data = [
        (torch.randint(0, 256, (16, 8), dtype=torch.uint8), torch.randn(16, 1)) for _ in range(9)
    ]

    def train(loader, transform) -> torch.Tensor:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 1).to(cuda_device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in loader:
            if transform is not None:
                x, y = transform((x.to(cuda_device), y.to(cuda_device)))
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        return model.weight.detach().cpu()

    def norm(b):
        return b[0].float() / 255, b[1]

    ref = train(data, norm)
    ours = train(CudaPrefetcher(data, device=cuda_device, transform=norm), None)
    assert torch.equal(ref, ours)


@pytest.mark.cuda
def test_gpu_unpinned_batches_are_pinned_and_pinned_ones_kept(cuda_device: torch.device) -> None:
    pinned = torch.arange(10).pin_memory()
    pageable = torch.arange(10)
    out = list(CudaPrefetcher([pinned, pageable], device=cuda_device))
    assert all(torch.equal(o.cpu(), torch.arange(10)) for o in out)


@pytest.mark.cuda
def test_gpu_resident_tensors_kept_and_foreign_device_rejected(cuda_device: torch.device) -> None:
    on_device = torch.ones(3, device=cuda_device)
    (out,) = list(CudaPrefetcher([on_device], device=cuda_device))
    assert out is on_device
    with pytest.raises(ValueError, match=r"batch\[0\] is on meta"):
        list(CudaPrefetcher([[torch.ones(1, device="meta")]], device=cuda_device))
    with pytest.raises(ValueError, match="device"):
        CudaPrefetcher([], device=torch.cuda.device_count())


@pytest.mark.cuda
def test_gpu_loader_exception_after_the_good_batches(cuda_device: torch.device) -> None:
    seen = []
    with pytest.raises(_Boom, match="corrupt"):
        for b in CudaPrefetcher(_FailingLoader(3), device=cuda_device, depth=2):
            seen.append(int(b))
    assert seen == [0, 1, 2]


@pytest.mark.cuda
def test_gpu_transform_runs_on_the_side_stream(cuda_device: torch.device) -> None:
    streams = []

    def transform(x: torch.Tensor) -> torch.Tensor:
        streams.append(torch.cuda.current_stream(cuda_device))
        return x.float() / 255

    pf = CudaPrefetcher([torch.zeros(4, dtype=torch.uint8)] * 3, cuda_device, transform)
    list(pf)
    assert len(streams) == 3
    assert all(s == pf.stream for s in streams)
    assert pf.stream != torch.cuda.current_stream(cuda_device)


@pytest.mark.cuda
def test_gpu_h2d_copies_run_on_another_stream_than_compute(
    cuda_device: torch.device, tmp_path: Path
) -> None:
    batches = [torch.randn(256, 1024).pin_memory() for _ in range(6)]
    w = torch.randn(1024, 1024, device=cuda_device)
    pf = CudaPrefetcher(batches, device=cuda_device)
    list(pf)  # warm-up: stream, allocator
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for x in pf:
            (x @ w).sum()
        torch.cuda.synchronize()
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    copies = {
        e["args"]["stream"]
        for e in events
        if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")
    }
    # No transform: every kernel is the consumer's (matmul, sum), on the compute stream.
    kernels = {e["args"]["stream"] for e in events if e.get("cat") == "kernel"}
    assert copies and kernels, (copies, kernels)
    assert copies.isdisjoint(kernels)


@pytest.mark.cuda
def test_gpu_compute_waits_for_the_copy_without_host_sync(cuda_device: torch.device) -> None:
    # The side stream is held back by a long sleep; the consumer's result must still be right,
    # which it is only if the compute stream waited on the copy's event.
    big = torch.randn(1 << 22).pin_memory()

    def slow_double(t: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU cycles on the side stream
        return t * 2

    pf = CudaPrefetcher([big], device=cuda_device, transform=slow_double)
    pf_iter = iter(pf)
    x = next(pf_iter)
    assert torch.equal(x.cpu(), big * 2)
