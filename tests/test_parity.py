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
from k3export.check.driver import StepStats, valid_entries
from k3export.onnx.runner import Signature


def test_half_precision_bound_grows_with_the_spread_but_never_past_the_cap():
    base = TOLERANCES["float16"]
    assert half_precision_tolerance(base, 0.001, 0.0).rel == base.rel
    assert half_precision_tolerance(base, 0.03, 0.0).rel == 0.06
    huge = half_precision_tolerance(base, 0.7, 100.0)
    assert huge.rel == HALF_REL_CAP and huge.margin == 10 * base.margin


def test_tie_margin_is_twice_the_logit_spread_between_the_fixed_margin_and_its_cap():
    """Uncapped, the margin is twice the largest eager half-vs-float32 logit difference: neither the
    dtype's fixed margin (a spread below half of it) nor the cap (ten times it)."""
    for dtype in ("float16", "bfloat16"):
        base = TOLERANCES[dtype]
        for spread in (0.7 * base.margin, 1.0 * base.margin, 4.9 * base.margin):
            assert half_precision_tolerance(base, 0.0, spread).margin == 2 * spread
        assert half_precision_tolerance(base, 0.0, 0.4 * base.margin).margin == base.margin
        assert half_precision_tolerance(base, 0.0, 5.1 * base.margin).margin == 10 * base.margin


def test_a_gap_just_within_the_margin_is_a_tie_just_past_it_a_mismatch():
    """The graph picks the reference's second token, whose gap below the top is the margin times
    1 - 1e-6, exactly the margin, or the margin times 1 + 1e-6."""
    margin = 0.25
    for factor, tie in ((1 - 1e-6, True), (1.0, True), (1 + 1e-6, False)):
        reference = np.array([[0.0, 1.0, 1.0 - margin * factor, -2.0]])
        graph = np.array([[0.0, 1.0, 1.5, -2.0]])
        tokens = top1_agreement(graph, reference, margin)
        assert (tokens.ties, tokens.mismatches) == ((1, 0) if tie else (0, 1)), factor
        assert abs(tokens.widest_gap - factor) < 1e-9


def logits_signature(vocab: int) -> Signature:
    """A graph whose one compared output is logits [batch, seq, vocab] (float16), fed tokens."""
    scalar = [{"name": name, "dtype": "int64", "shape": ["batch"], "meaning": ""}
              for name in ("cache_lengths", "input_lengths")]
    return Signature({"inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"],
                                  "meaning": ""}, *scalar],
                      "outputs": [{"name": "logits", "dtype": "float16", "shape": ["batch", "seq", vocab],
                                   "meaning": ""}], "capacity": 16})


def test_half_precision_step_ties_within_twice_its_logit_spread_and_the_headroom_says_how_close():
    """The driver's step comparison (check/driver.py: valid entries, then StepStats) on float16 logits
    of 2 rows of 2 and 1 valid tokens, vocabulary 4 (row 1's second position is padding): the eager
    float32 logits differ from the eager float16 ones by at most 0.2 over the valid entries (and by 5
    at the padding, which must not count), so the tie margin is 0.4 (the fixed one 0.1, the cap 1.0).
    The graph equals the reference but at one position, where it swaps the reference's top token with one
    `gap` below it: at 0.38 a tie, at 0.42 a mismatch that fails the run (the logits within their
    bound either way); the headroom is gap / 0.4. A margin stuck at its cap, or at the fixed one,
    fails this."""
    reference = 20 + np.random.default_rng(0).normal(size=(2, 2, 4)).astype(np.float32)
    reference[..., 0] = 23.0  # token 0 on top everywhere, by more than 0.5
    lengths = np.array([2, 1])
    for gap, tie in ((0.38, True), (0.42, False)):
        ours = reference.copy()
        ours[0, 1, 3] = 23.0 - gap
        float32 = ours.copy()
        float32[1, 0, 2] += 0.2  # the step's largest valid half-vs-float32 logit difference
        float32[0, 0, 1] -= 0.1
        float32[1, 1, :] += 5.0  # padding: not a valid entry
        graph = ours.copy()
        graph[0, 1, [0, 3]] = [23.0 - gap, 23.0]  # the graph's top-1 there: token 3
        # As the driver's eager side hands a step's outputs over: valid entries, then the step's stats.
        signature = logits_signature(4)
        eager, actual, twin = (valid_entries(signature.outputs[0], a, lengths, lengths)
                               for a in (ours, graph, float32))
        stats = StepStats(TOLERANCES["float16"])
        stats.add("logits", actual, eager, twin)
        stats.add_tokens(actual, eager, 4)
        step = stats.judged("decode 1", signature, log=lambda line: None)
        tokens = step["tokens"]
        assert (tokens["positions"], tokens["agree"]) == (3, 2)
        assert (tokens["ties"], tokens["mismatches"]) == ((1, 0) if tie else (0, 1)), gap
        assert step["outputs"][0]["passed"], step["outputs"]
        judged = verdict([step])
        assert judged["passed"] == tie and judged["token_mismatches"] == (not tie)
        assert abs(judged["headroom"]["tie_gap"]["ratio"] - gap / 0.4) < 1e-5


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
