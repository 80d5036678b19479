"""The conformance harness: comparison policy, poisoning, the registry and the CLI."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from aiak.conformance import (
    Case,
    Spec,
    cli,
    compare,
    harness,
    register,
    rel_l2_error,
    run_case,
    tolerance,
)


def test_tolerance_policy_values() -> None:
    assert tolerance(torch.float32) == 1e-5
    assert tolerance(torch.float32, elementwise=True) == 1e-6
    assert tolerance("tf32") == 5e-4
    assert tolerance(torch.float16) == 5e-3
    assert tolerance(torch.bfloat16) == 2e-2
    with pytest.raises(ValueError, match="no policy for dtype"):
        tolerance(torch.int8)


def test_rel_l2_error_handles_nan_inf_and_zero_reference() -> None:
    ref = torch.tensor([1.0, 2.0, float("inf"), float("nan")])
    assert rel_l2_error(ref.clone(), ref) == 0.0
    out = ref.clone()
    out[0] = float("nan")
    assert rel_l2_error(out, ref) == math.inf  # NaN never passes where the reference is finite
    out = ref.clone()
    out[2] = -float("inf")
    assert rel_l2_error(out, ref) == math.inf
    assert rel_l2_error(torch.tensor([0.1]), torch.tensor([0.0])) == pytest.approx(0.1)
    assert rel_l2_error(torch.ones(3), torch.ones(4)) == math.inf


def test_compare_reports_missing_exact_and_tolerance() -> None:
    ref = {"x": torch.tensor([1.0, 2.0]), "flag": torch.tensor([1.0])}
    ok, errors, msg = compare(
        {"x": torch.tensor([1.0, 2.0 + 1e-7]), "flag": torch.tensor([1.0])},
        ref,
        1e-6,
        exact=("flag",),
    )
    assert ok and errors["flag"] == 0.0 and msg == ""
    ok, _, msg = compare(
        {"x": torch.tensor([1.0, 2.1]), "flag": torch.tensor([0.0])}, ref, 1e-6, exact=("flag",)
    )
    assert not ok and "flag: not exactly equal" in msg and "x: rel L2 error" in msg
    ok, _, msg = compare({"x": ref["x"]}, ref, 1e-6)
    assert not ok and "did not return ['flag']" in msg


def _case(name: str, candidate, **kw) -> Case:
    return Case(
        name=name,
        specs=lambda device: [Spec("only", torch.float32, elementwise=True)],
        make_inputs=lambda spec, device, gen: {
            "x": torch.randn(64, generator=gen),
            "out": torch.full((64,), float("nan")),
        },
        reference=lambda inp: {"y": inp["x"].double() * 2},
        candidate=candidate,
        **kw,
    )


def test_run_case_catches_unwritten_output_and_crashes() -> None:
    def forgets_last(inp):
        inp["out"][:-1] = inp["x"][:-1] * 2  # the last element stays poisoned (NaN)
        return {"y": inp["out"]}

    (r,) = run_case(_case("t.forgets", forgets_last), torch.device("cpu"), seed=1)
    assert not r.passed and r.errors["y"] == math.inf

    def crashes(inp):
        raise RuntimeError("boom")

    (r,) = run_case(_case("t.crash", crashes), torch.device("cpu"), seed=1)
    assert not r.passed and r.message == "RuntimeError: boom"

    (r,) = run_case(_case("t.good", lambda inp: {"y": inp["x"] * 2}), torch.device("cpu"), seed=1)
    assert r.passed and r.seed == 1


def _half_case(candidate_err: float, peer_err: float, dtype: torch.dtype) -> Case:
    """A case whose candidate and peer are off the reference by exactly the given relative
    errors (a constant offset along the reference vector)."""
    return Case(
        name="t.peer",
        specs=lambda device: [Spec("only", dtype)],
        make_inputs=lambda spec, device, gen: {"x": torch.randn(64, generator=gen).double()},
        reference=lambda inp: {"y": inp["x"]},
        candidate=lambda inp: {"y": inp["x"] * (1 + candidate_err)},
        peer=lambda inp: {"y": inp["x"] * (1 + peer_err)},
    )


@pytest.mark.parametrize(
    ("dtype", "candidate_err", "peer_err", "passes"),
    [
        (torch.bfloat16, 0.15, 0.10, True),  # within 2x torch's own same-dtype error
        (torch.bfloat16, 0.25, 0.10, False),  # past it
        (torch.bfloat16, 0.01, 0.0, True),  # a perfect peer leaves the policy's 2e-2
        (torch.bfloat16, 0.03, 0.0, False),
        (torch.float16, 0.009, 0.005, True),
        (torch.float32, 0.15, 0.10, False),  # fp32 specs never borrow the peer's error
    ],
)
def test_peer_bound_is_twice_torchs_same_dtype_error(
    dtype: torch.dtype, candidate_err: float, peer_err: float, passes: bool
) -> None:
    (r,) = run_case(_half_case(candidate_err, peer_err, dtype), torch.device("cpu"), seed=3)
    assert r.passed is passes, r.message
    if not passes and dtype != torch.float32 and peer_err:
        assert "2x torch's" in r.message


@pytest.mark.parametrize(
    ("dtype", "candidate_err", "floor", "passes"),
    [
        (torch.bfloat16, 0.05, 0.06, True),  # within the case's rounding floor
        (torch.bfloat16, 0.07, 0.06, False),
        (torch.bfloat16, 0.01, 0.001, True),  # a small floor leaves the policy's 2e-2
        (torch.float32, 0.05, 0.06, False),  # fp32 specs never use the floor
    ],
)
def test_rounding_floor_raises_half_precision_bounds(
    dtype: torch.dtype, candidate_err: float, floor: float, passes: bool
) -> None:
    case = dataclasses.replace(
        _half_case(candidate_err, 0.0, dtype), peer=None, floor=lambda inp: {"y": floor}
    )
    (r,) = run_case(case, torch.device("cpu"), seed=3)
    assert r.passed is passes, r.message


def test_register_rejects_duplicates_and_non_cases() -> None:
    case = _case("t.dup", lambda inp: {"y": inp["x"] * 2})
    register(case)
    try:
        with pytest.raises(ValueError, match="already registered"):
            register(_case("t.dup", lambda inp: {"y": inp["x"]}))
        with pytest.raises(TypeError, match="must be a Case"):
            register("not a case")  # type: ignore[arg-type]
    finally:
        harness._REGISTRY.pop("t.dup")


def test_every_registered_case_has_specs_on_cpu() -> None:
    cases = harness.all_cases()
    assert "ops.multi_tensor_l2norm" in {c.name for c in cases}
    for case in cases:
        if "cpu" in case.devices:
            assert list(case.specs(torch.device("cpu"))), case.name


def test_cli_runs_writes_reports_and_fails_on_a_wrong_case(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    args = [
        "--device",
        "cpu",
        "--filter",
        "multi_tensor_l2norm",
        "--filter",
        "float32",
        "--json",
        str(tmp_path / "r.json"),
        "--markdown",
        str(tmp_path / "r.md"),
        "--seed",
        "3",
    ]
    assert cli.main(args) == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["summary"]["failed"] == 0 and doc["summary"]["checks"] > 3
    assert doc["environment"]["torch"] == torch.__version__
    assert "| ops.multi_tensor_l2norm |" in (tmp_path / "r.md").read_text()

    register(_case("t.wrong", lambda inp: {"y": inp["x"] * 2.001}))
    try:
        rc = cli.main(
            [
                "--device",
                "cpu",
                "--filter",
                "t\\.wrong",
                "--json",
                str(tmp_path / "w.json"),
                "--markdown",
                str(tmp_path / "w.md"),
            ]
        )
    finally:
        harness._REGISTRY.pop("t.wrong")
    assert rc == 1
    assert json.loads((tmp_path / "w.json").read_text())["summary"]["failed"] == 1


def test_cli_list_and_bad_arguments(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["--device", "cpu", "--list", "--filter", "scale_"]) == 0
    listed = capsys.readouterr().out
    assert "ops.multi_tensor_scale_" in listed and "l2norm" not in listed
    assert cli.main(["--device", "cpu", "--filter", "(unclosed"]) == 2
    assert cli.main(["--device", "cpu", "--filter", "no-such-case"]) == 2


def test_a_broken_case_module_is_a_failed_case_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    real = importlib.import_module

    def flaky(name: str, *args, **kw):
        if name == "aiak.conformance.cases.ops_multi_tensor":
            raise SyntaxError("half-written")
        return real(name, *args, **kw)

    monkeypatch.setattr(harness.importlib, "import_module", flaky)
    try:
        cases = {c.name: c for c in harness.all_cases()}
        (r,) = run_case(cases["import.ops_multi_tensor"], torch.device("cpu"), seed=0)
        assert not r.passed and "SyntaxError: half-written" in r.message
    finally:
        harness._REGISTRY.pop("import.ops_multi_tensor", None)
