"""Numerical helpers shared by the tests (imported as ``from _numerics import rel_err``: the
tests' root folder is on ``sys.path`` through its conftest)."""

from __future__ import annotations

import torch


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """The relative L2 error ``||got - ref|| / ||ref||`` in float64 (the tolerance policy's
    measure); a zero ``ref`` counts as a norm of 1e-300, so a zero error stays 0."""
    got, ref = got.detach().double(), ref.detach().double()
    return float((got - ref).norm() / ref.norm().clamp_min(1e-300))


def assert_rel(got: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """``rel_err(got, ref) <= tol``, showing the first values of both when it is not."""
    err = rel_err(got, ref)
    assert err <= tol, (
        f"rel L2 error {err:.3e} > {tol:.0e}\ngot {got.ravel()[:8]}\nref {ref.ravel()[:8]}"
    )
