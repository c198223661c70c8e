"""The verdict rules: half-precision bounds capped, ties judged by the graph's own token, NaN/Inf fail."""

import numpy as np
import torch

from k3export.check.compare import (
    HALF_REL_CAP,
    TOLERANCES,
    compare,
    half_precision_tolerance,
    nonfinite_tensors,
    top1_agreement,
    verdict,
)


def test_half_precision_bound_grows_with_the_spread_but_never_past_the_cap():
    base = TOLERANCES["float16"]
    assert half_precision_tolerance(base, 0.001, 0.0).rel == base.rel
    assert half_precision_tolerance(base, 0.03, 0.0).rel == 0.06
    huge = half_precision_tolerance(base, 0.7, 100.0)
    assert huge.rel == HALF_REL_CAP and huge.margin == 10 * base.margin


def step(ties: int, positions: int, passed: bool = True, nonfinite: list[str] | None = None,
         mismatches: int = 0) -> dict:
    out = {"step": "prefill", "outputs": [{"name": "logits", "passed": passed, "rel": 0.01, "bound": 0.02}],
           "tokens": {"positions": positions, "ties": ties, "mismatches": mismatches, "widest_gap": 0.5}}
    return {**out, "nonfinite": nonfinite} if nonfinite else out


def test_a_tie_is_judged_by_the_graphs_own_token():
    """Row 0: the reference's top-2 gap is 0.05 (a near-tie) and the graph picks its second token:
    a tie. Row 1: the same near-tie at the top, but the graph picks token 3, 2.0 below the top in
    the reference's logits: a mismatch, though the old rule (the reference's top-2 gap alone)
    excused it. Row 2: agreement."""
    reference = np.array([[1.0, 0.95, 0.0, -1.0], [1.0, 0.95, 0.0, -1.0], [0.0, 2.0, 0.0, 0.0]])
    graph = np.array([[0.9, 1.0, 0.0, -1.0], [0.9, 0.9, 0.0, 1.5], [0.0, 2.0, 0.1, 0.0]])
    tokens = top1_agreement(graph, reference, margin=0.1)
    assert (tokens.positions, tokens.agree, tokens.ties, tokens.mismatches) == (3, 1, 1, 1)
    assert tokens.widest_gap == np.float64(2.0) / 0.1
    assert top1_agreement(graph[:1], reference[:1], margin=0.1).widest_gap == (1.0 - 0.95) / 0.1


def test_ties_never_fail_a_run_a_mismatch_does():
    """Random weights make nearly flat logits: a run whose positions are mostly ties is judged by its
    bounds alone; one mismatch fails it. Each threshold's headroom is recorded."""
    mostly_ties = verdict([step(60, 100)])
    assert mostly_ties["passed"] and mostly_ties["token_ties"] == 60
    assert mostly_ties["headroom"]["relative_error"]["ratio"] == 0.01 / 0.02
    assert mostly_ties["headroom"]["tie_gap"]["ratio"] == 0.5
    one = verdict([step(0, 100), {**step(0, 1, mismatches=1), "step": "decode 1"}])
    assert not one["passed"] and one["token_mismatches"] == 1 and one["failed_outputs"] == []


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
