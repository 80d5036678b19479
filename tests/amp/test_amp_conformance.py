"""The amp conformance cases pass on CPU, and they can fail: a candidate that loses its
updates (no copy-back of the masters) is caught."""

from __future__ import annotations

import pytest
import torch

from aiak.conformance.cases import amp as amp_cases
from aiak.conformance.harness import all_cases, run_case


def _case():
    return next(c for c in all_cases() if c.name == "amp.o2_training")


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0])
def test_amp_conformance_cases_pass_on_cpu(seed: int) -> None:
    results = run_case(_case(), torch.device("cpu"), seed=seed)
    labels = {r.label for r in results}
    assert len(results) == len(amp_cases._specs(torch.device("cpu"))) >= 8
    # pure half (the default) and patch_torch_functions=True, with LayerNorm in the model
    assert {"mlp-ln-bfloat16", "mlp-ln-bfloat16-patch"} <= labels
    for r in results:
        assert r.passed, f"{r.label}: {r.message}"
        assert 0 < r.errors["update"] <= r.tolerance


def test_amp_conformance_catches_lost_updates(monkeypatch: pytest.MonkeyPatch) -> None:
    # Masters update but the half model never receives them: the loss curve stays flat.
    monkeypatch.setattr("aiak.amp._amp_state.AmpState.copy_masters_to_model", lambda self: None)
    spec = next(s for s in amp_cases._specs(torch.device("cpu")) if s.label == "mlp-bfloat16")
    inputs = amp_cases._make_inputs(spec, torch.device("cpu"), torch.Generator().manual_seed(0))
    ref = amp_cases._reference(inputs)
    out = amp_cases._candidate(inputs)
    from aiak.conformance.harness import compare

    passed, errors, _ = compare(out, ref, spec.tolerance())
    assert not passed and errors["loss_drop"] > spec.tolerance()
