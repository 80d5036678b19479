"""aiak.data.normalize: one-pass uint8 -> normalised float, against the textbook formula."""

from __future__ import annotations

import collections

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aiak.data import normalize

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def textbook(x: torch.Tensor, mean=MEAN, std=STD, scale=255.0, dim=-3) -> torch.Tensor:
    shape = [1] * x.dim()
    shape[dim] = -1
    m = torch.tensor(mean, dtype=torch.float64).view(shape)
    s = torch.tensor(std, dtype=torch.float64).view(shape)
    return (x.double() / scale - m) / s


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 3),
    h=st.integers(1, 6),
    w=st.integers(1, 6),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_the_formula_for_every_uint8_value(n, h, w, dtype, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n, 3, h, w), dtype=torch.uint8, generator=g)
    x.view(-1)[0] = 255
    out = normalize(MEAN, STD, dtype=dtype)(x)
    assert out.dtype == dtype and out.shape == x.shape
    tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 1e-2, torch.bfloat16: 4e-2}
    torch.testing.assert_close(out.double(), textbook(x), rtol=tol[dtype], atol=tol[dtype])


def test_batch_structures_keep_the_rest() -> None:
    x = torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8)
    y = torch.arange(2)
    f = normalize(MEAN, STD)
    out = f((x, y))
    assert type(out) is tuple and out[1] is y
    torch.testing.assert_close(out[0].double(), textbook(x))
    assert type(f([x, y])) is list
    d = normalize(MEAN, STD, key="image")({"image": x, "label": y})
    assert d["label"] is y and d["image"].dtype == torch.float32
    Batch = collections.namedtuple("Batch", "image label")
    nt = f(Batch(x, y))
    assert type(nt) is Batch and nt.label is y
    chw = f(x[0])  # C, H, W
    torch.testing.assert_close(chw.double(), textbook(x[0]))
    nhwc = normalize(MEAN, STD, channel_dim=-1)(x.permute(0, 2, 3, 1))
    torch.testing.assert_close(nhwc.double(), textbook(x.permute(0, 2, 3, 1), dim=-1))


def test_float_input_and_scale_one() -> None:
    x = torch.rand(2, 3, 5, 5)
    out = normalize(MEAN, STD, scale=1.0)(x)
    torch.testing.assert_close(out.double(), textbook(x, scale=1.0))


def test_bad_input_names_the_argument() -> None:
    with pytest.raises(ValueError, match="std must be positive"):
        normalize(MEAN, (0.2, 0.0, 0.2))
    with pytest.raises(ValueError, match="mean has 2 channels but std has 3"):
        normalize((0.5, 0.5), STD)
    with pytest.raises(TypeError, match="mean must be a sequence"):
        normalize("abc", STD)
    with pytest.raises(TypeError, match=r"std\[1\] must be a number"):
        normalize(MEAN, (0.2, None, 0.2))
    with pytest.raises(ValueError, match="must be finite"):
        normalize(MEAN, (0.2, float("nan"), 0.2))
    with pytest.raises(ValueError, match="scale must be > 0"):
        normalize(MEAN, STD, scale=0)
    with pytest.raises(TypeError, match="dtype must be a floating"):
        normalize(MEAN, STD, dtype=torch.int32)
    f = normalize(MEAN, STD)
    with pytest.raises(ValueError, match="4 channels at dim 1"):
        f(torch.zeros(1, 4, 2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="outside a 1-d tensor"):
        f(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(TypeError, match="expected a tensor"):
        f(("not a tensor", 1))
    with pytest.raises(IndexError, match="key 0 is not a position"):
        f(())
    with pytest.raises(KeyError, match="no key 0"):
        f({"image": torch.zeros(1, 3, 1, 1)})
    with pytest.raises(TypeError, match="tensor, tuple, list or dict"):
        f(3)
    with pytest.raises(TypeError, match="cannot normalise"):
        f(torch.zeros(1, 3, 1, 1, dtype=torch.bool))


@pytest.mark.cuda
def test_on_the_gpu_matches_the_cpu() -> None:
    x = torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8)
    f = normalize(MEAN, STD)
    torch.testing.assert_close(f(x.cuda()).cpu(), f(x), rtol=1e-6, atol=1e-6)
