"""The verdict rules: half-precision bounds capped, too many ties fail, NaN/Inf fail."""

import numpy as np
import torch

from k3export.check.compare import (
    HALF_REL_CAP,
    MAX_TIE_FRACTION,
    TOLERANCES,
    compare,
    half_precision_tolerance,
    nonfinite_tensors,
    verdict,
)


def test_half_precision_bound_grows_with_the_spread_but_never_past_the_cap():
    base = TOLERANCES["float16"]
    assert half_precision_tolerance(base, 0.001, 0.0).rel == base.rel
    assert half_precision_tolerance(base, 0.03, 0.0).rel == 0.06
    huge = half_precision_tolerance(base, 0.7, 100.0)
    assert huge.rel == HALF_REL_CAP and huge.margin == 10 * base.margin


def step(ties: int, positions: int, passed: bool = True, nonfinite: list[str] | None = None) -> dict:
    out = {"step": "prefill", "outputs": [{"name": "logits", "passed": passed}],
           "tokens": {"positions": positions, "ties": ties, "mismatches": 0}}
    return {**out, "nonfinite": nonfinite} if nonfinite else out


def test_a_run_mostly_excused_as_ties_fails():
    limit = int(MAX_TIE_FRACTION * 100)
    assert verdict([step(limit, 100)])["passed"]
    over = verdict([step(limit + 1, 100)])
    assert not over["passed"] and over["too_many_ties"] and over["failed_outputs"] == []


def test_nan_fails_and_names_the_first_step_and_tensor():
    ref = np.ones(4, np.float32)
    nan = ref.copy()
    nan[2] = np.nan
    assert not compare("x", ref, nan, TOLERANCES["float32"]).passed  # NaN in the reference side
    assert not compare("x", nan, ref, TOLERANCES["float32"]).finite
    steps = [step(0, 2), {**step(0, 2, False, ["present.3.kda_state"]), "step": "decode 1"}]
    assert verdict(steps)["first_nonfinite"] == {"step": "decode 1", "outputs": ["present.3.kda_state"]}
    weights = [("a", torch.ones(2)), ("b", torch.tensor([1.0, float("inf")])), ("c", torch.zeros(2))]
    assert nonfinite_tensors(weights) == ["b"]
    judged = verdict([step(0, 2)], ["b"])
    assert not judged["passed"] and judged["first_nonfinite"] == {"step": "weights", "outputs": ["b"]}
