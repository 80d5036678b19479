"""aiak.conformance — the numerical conformance suite (``aiak-conformance``).

Runs every registered case (an aiak op, optimizer, hook or amp mode against reference PyTorch)
on the device at hand and writes a JSON + Markdown report. The one place that imports every
aiak subpackage. See :mod:`aiak.conformance.harness` for the case contract.
"""

from aiak.conformance.harness import (
    TOLERANCE,
    Case,
    Result,
    Spec,
    all_cases,
    compare,
    register,
    rel_l2_error,
    run_case,
    tolerance,
)

__all__ = [
    "TOLERANCE",
    "Case",
    "Result",
    "Spec",
    "all_cases",
    "compare",
    "register",
    "rel_l2_error",
    "run_case",
    "tolerance",
]
