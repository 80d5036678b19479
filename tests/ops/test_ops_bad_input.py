"""aiak.ops' public calls under bad input: each raises ValueError/TypeError naming the
argument, never an AttributeError/OverflowError/RuntimeError from deep inside torch, and a
valid call after a refused one still works.

One hypothesis test per op family draws one corruption of an otherwise valid call.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import aiak.ops

BAD_FLOATS = ["0.1", None, float("nan"), float("inf"), -1.0, [1.0], torch.tensor(0.1)]


def _lists(n: int = 2) -> list[torch.Tensor]:
    return [torch.zeros(3), torch.zeros(2, 2)][:n]


def _valid(op: str) -> dict[str, object]:
    """Valid arguments of ``op`` (one record per op, fields as in its schema)."""
    steps = [torch.zeros(()), torch.zeros(())]
    if op == "fused_adam_":
        return dict(
            params=_lists(), grads=_lists(), exp_avgs=_lists(), exp_avg_sqs=_lists(),
            max_exp_avg_sqs=[], state_steps=steps, copy_to=[], lr=0.1, lr_tensor=None,
            beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, adam_w_mode=True,
            amsgrad=False, maximize=False, bias_correction=True, grad_scale=None,
            found_inf=None,
        )  # fmt: skip
    if op == "fused_sgd_":
        return dict(
            params=_lists(), grads=_lists(), momentum_buffers=_lists(), copy_to=[], lr=0.1,
            lr_tensor=None, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False,
            maximize=False, is_first_step=False, scales=None, grad_scale=None, found_inf=None,
        )  # fmt: skip
    return dict(
        params=_lists(), grads=_lists(), exp_avgs=_lists(), exp_avg_sqs=_lists(),
        updates=_lists(), state_steps=steps, copy_to=[], grad_norms=[torch.ones(())], lr=0.1,
        lr_tensor=None, beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=0.01,
        bias_correction=True, grad_averaging=True, adam_w_mode=True, use_nvlamb=False,
        max_grad_norm=1.0, grad_scale=None, found_inf=None,
    )  # fmt: skip


def _call(op: str, kw: dict[str, object]) -> None:
    fn = getattr(aiak.ops, op)
    fn(*fn.Args(**kw))


FLOAT_ARGS = {
    "fused_adam_": ["lr", "beta1", "beta2", "eps", "weight_decay"],
    "fused_sgd_": ["lr", "momentum", "dampening", "weight_decay"],
    "fused_lamb_": ["lr", "beta1", "beta2", "eps", "weight_decay"],
}
LIST_ARGS = {
    "fused_adam_": ["grads", "exp_avgs", "exp_avg_sqs", "state_steps"],
    "fused_sgd_": ["grads", "momentum_buffers"],
    "fused_lamb_": ["grads", "exp_avgs", "exp_avg_sqs", "updates", "state_steps"],
}
TENSOR_ARGS = ["lr_tensor", "grad_scale", "found_inf"]


def _corrupt_list(kind: str, ts: list[torch.Tensor]) -> object:
    if kind == "short":
        return ts[:1]
    if kind == "int":
        return [t.to(torch.int32) for t in ts]
    if kind == "sparse":
        return [ts[0].to_sparse(), *ts[1:]]
    if kind == "meta":
        return [ts[0].to("meta"), *ts[1:]]
    if kind == "shape":
        return [torch.zeros(5), *ts[1:]]
    if kind == "not a tensor":
        return [1.0, *ts[1:]]
    return "not a list"


@given(
    op=st.sampled_from(sorted(FLOAT_ARGS)),
    data=st.data(),
    kind=st.sampled_from(["float", "list", "tensor arg", "params"]),
)
@settings(max_examples=200, deadline=None)
def test_fused_ops_refuse_bad_input_naming_the_argument(op, data, kind) -> None:
    kw = _valid(op)
    if kind == "float":
        name = data.draw(st.sampled_from(FLOAT_ARGS[op]))
        kw[name] = data.draw(st.sampled_from(BAD_FLOATS))
        if name.startswith("beta"):
            kw[name] = data.draw(st.sampled_from([*BAD_FLOATS, 1.0, 1.5]))
    elif kind == "list":
        name = data.draw(st.sampled_from(LIST_ARGS[op]))
        how = ["short", "int", "sparse", "meta", "shape", "not a tensor", "not a list"]
        kw[name] = _corrupt_list(data.draw(st.sampled_from(how)), kw[name])
    elif kind == "tensor arg":
        name = data.draw(st.sampled_from(TENSOR_ARGS))
        kw[name] = data.draw(
            st.sampled_from([torch.zeros(2), torch.zeros(1, dtype=torch.int32), 0.5])
        )
    else:
        name = "params"
        how = ["int", "sparse", "not a tensor", "not a list"]
        kw[name] = _corrupt_list(data.draw(st.sampled_from(how)), kw[name])
    with pytest.raises((ValueError, TypeError), match=name.rstrip("_")):
        _call(op, kw)
    _call(op, _valid(op))  # still works


@pytest.mark.parametrize("op", sorted(FLOAT_ARGS))
def test_fused_ops_take_float64_and_empty_lists(op) -> None:
    kw = _valid(op)
    for name in ("params", *LIST_ARGS[op]):
        if name != "state_steps":
            kw[name] = [t.double() for t in kw[name]]
    if op == "fused_lamb_":
        kw["updates"] = _lists()
    _call(op, kw)
    empty = {k: ([] if isinstance(v, list) else v) for k, v in _valid(op).items()}
    _call(op, empty)


@given(
    bad=st.sampled_from(
        [
            ("tensors", "not a list"),
            ("tensors", [torch.zeros(3, dtype=torch.int64)]),
            ("tensors", [torch.zeros(3), torch.zeros(2, device="meta")]),
            ("tensors", [torch.zeros(3).to_sparse()]),
            ("tensors", [None]),
        ]
    )
)
@settings(max_examples=20, deadline=None)
def test_l2norm_refuses_bad_input(bad) -> None:
    _, value = bad
    with pytest.raises((ValueError, TypeError), match="tensors"):
        aiak.ops.multi_tensor_l2norm(value)


SCALE_BAD = [
    ("dst", lambda s, d: (s, d[:1], 2.0)),
    ("dst", lambda s, d: (s, [t.int() for t in d], 2.0)),
    ("src", lambda s, d: ([t.int() for t in s], d, 2.0)),
    ("src", lambda s, d: ([t.to_sparse() for t in s], d, 2.0)),
    ("dst", lambda s, d: (s, [torch.zeros(7), d[1]], 2.0)),
    ("scale", lambda s, d: (s, d, torch.ones(2))),
    ("scale", lambda s, d: (s, d, torch.ones(1, dtype=torch.float64))),
]


@given(case=st.sampled_from(SCALE_BAD))
@settings(max_examples=20, deadline=None)
def test_scale_refuses_bad_input(case) -> None:
    name, make = case
    src, dst, scale = make(_lists(), _lists())
    with pytest.raises((ValueError, TypeError), match=name):
        aiak.ops.multi_tensor_scale_(src, dst, scale)


CAST_BAD = [
    ("dst", lambda: ("x", torch.zeros(3), 1.0)),
    ("src", lambda: (torch.zeros(3), None, 1.0)),
    ("dst", lambda: (torch.zeros(3, dtype=torch.int32), torch.zeros(3), 1.0)),
    ("src", lambda: (torch.zeros(3), torch.zeros(6)[::2], 1.0)),
    ("dst", lambda: (torch.zeros(4), torch.zeros(3), 1.0)),
    ("scale", lambda: (torch.zeros(3), torch.zeros(3), "2")),
    ("scale", lambda: (torch.zeros(3), torch.zeros(3), None)),
    ("dst", lambda: (torch.zeros(3).to_sparse(), torch.zeros(3), 1.0)),
    ("src", lambda: (torch.zeros(3), torch.zeros(3, device="meta"), 1.0)),
]


@given(case=st.sampled_from(CAST_BAD))
@settings(max_examples=30, deadline=None)
def test_cast_scale_refuses_bad_input(case) -> None:
    name, make = case
    with pytest.raises((ValueError, TypeError), match=name):
        aiak.ops.cast_scale_(*make())
