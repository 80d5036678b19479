"""Realistic parameter sets and input recipes shared by conformance cases and benchmarks."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch


def _bert_large() -> list[tuple[int, ...]]:
    """BERT-large's 389 parameter shapes (334M parameters)."""
    h, ffn = 1024, 4096
    shapes: list[tuple[int, ...]] = [(30522, h), (512, h), (2, h), (h,), (h,)]
    for _ in range(24):
        for _ in range(4):  # query, key, value, attention output
            shapes += [(h, h), (h,)]
        shapes += [(h,), (h,)]  # attention LayerNorm
        shapes += [(ffn, h), (ffn,), (h, ffn), (h,)]
        shapes += [(h,), (h,)]  # output LayerNorm
    return shapes


def resnet50_shapes(shrink: int = 1) -> list[tuple[int, ...]]:
    """torchvision ResNet-50's 161 parameter shapes, in its order (25.6M parameters);
    ``shrink``: every width divided by it, the same 161 tensors."""
    s = shrink
    shapes: list[tuple[int, ...]] = [(64 // s, 3, 7, 7), (64 // s,), (64 // s,)]
    cin = 64 // s
    for width, blocks in ((64 // s, 3), (128 // s, 4), (256 // s, 6), (512 // s, 3)):
        for b in range(blocks):
            shapes += [(width, cin, 1, 1), (width,), (width,)]
            shapes += [(width, width, 3, 3), (width,), (width,)]
            shapes += [(4 * width, width, 1, 1), (4 * width,), (4 * width,)]
            if b == 0:
                shapes += [(4 * width, cin, 1, 1), (4 * width,), (4 * width,)]
            cin = 4 * width
    return [*shapes, (1000 // s, 2048 // s), (1000 // s,)]


BERT_LARGE: list[tuple[int, ...]] = _bert_large()
RESNET50: list[tuple[int, ...]] = resnet50_shapes()


def numel(shapes: list[tuple[int, ...]]) -> int:
    return sum(math.prod(s) for s in shapes)


def draw(
    shape: tuple[int, ...] | int,
    gen: torch.Generator,
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Standard normal values (never zeros: they hide unwritten outputs), made on the CPU
    generator for small sizes (reproducible from the run's ``--seed``) and on the device for
    large ones."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    n = math.prod(shape)
    if n <= 1 << 22 or torch.device(device).type == "cpu":
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(device, dtype)
    seed = int(torch.randint(0, 2**62, (1,), generator=gen))
    dev_gen = torch.Generator(device=device).manual_seed(seed)
    if dtype == torch.float32:
        return torch.randn(shape, generator=dev_gen, device=device)
    out = torch.empty(shape, dtype=dtype, device=device)
    flat = out.view(-1)
    step = 1 << 26  # fill in slices: a 2^31-element fp16 tensor must not need 8 GiB of fp32
    for i in range(0, n, step):
        m = min(step, n - i)
        flat[i : i + m] = torch.randn(m, generator=dev_gen, device=device)
    return out


def poisoned_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor shaped like ``t`` full of NaN: an element the candidate skips fails."""
    return torch.full_like(t, float("nan"), dtype=dtype or t.dtype)


def _sizes(recipe: Mapping[str, Any], gen: torch.Generator) -> list[tuple[int, ...]]:
    sizes = recipe["sizes"]
    n = recipe.get("n", 0)
    if sizes == "mixed":  # odd sizes across chunk boundaries, a 2-D one now and then
        out: list[tuple[int, ...]] = []
        for i in range(n):
            m = int(torch.randint(1, 150_000, (1,), generator=gen))
            out.append((m // 7, 7) if i % 5 == 0 and m >= 7 else (m,))
        return out
    if sizes == "tiny":
        return [(int(torch.randint(0, 40, (1,), generator=gen)),) for _ in range(n)]
    return [s if isinstance(s, tuple) else (s,) for s in sizes]


def tensor_set(
    recipe: Mapping[str, Any], dtype: torch.dtype, device: torch.device, gen: torch.Generator
) -> list[torch.Tensor]:
    """A tensor list from a recipe: ``sizes`` ("mixed", "tiny" with ``n``, or explicit shapes),
    ``unaligned`` (views at odd element offsets of one buffer), ``strided`` (every other
    element: non-dense), ``mixed_dtypes`` (cycle fp32/fp16/bf16)."""
    shapes = _sizes(recipe, gen)
    dtypes = [dtype] * len(shapes)
    if recipe.get("mixed_dtypes"):
        cycle = (torch.float32, torch.float16, torch.bfloat16)
        dtypes = [cycle[i % 3] for i in range(len(shapes))]
    if recipe.get("unaligned"):
        out = []
        for shape, dt in zip(shapes, dtypes):
            m = math.prod(shape)
            offset = 1 + int(torch.randint(0, 7, (1,), generator=gen))
            out.append(draw(m + offset, gen, device, dt)[offset:].view(shape))
        return out
    if recipe.get("strided"):
        return [draw((2 * math.prod(s),), gen, device, dt)[::2] for s, dt in zip(shapes, dtypes)]
    return [draw(s, gen, device, dt) for s, dt in zip(shapes, dtypes)]
