"""Comparisons between a reference output and another backend's, and their verdicts.

Relative error is the norm of the difference over the norm of the reference, over the whole
tensor. Greedy tokens are compared only where the reference's top-1 margin exceeds the numeric
tolerance: random weights produce near-ties, which are reported as ties, not failures. NaN or Inf
on either side fails a comparison.

Half precision is held to a bound that grows with the eager model's own half-vs-float32 spread,
but never past HALF_REL_CAP, and a run in which more than MAX_TIE_FRACTION of the greedy positions
disagree as ties fails: past those points a comparison no longer says anything (a float16 check
once passed at relative error 0.81 against a bound of 1.4, cosine 0.67, every position a tie).
0.1 is ten times float16's fixed bound and where bfloat16's starts: a relative error of 0.1 still
means cosine >= 0.995, the same direction; one position in ten excused as a tie still leaves nine
in ten greedy tokens compared.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Tolerance:
    rel: float  # largest relative error accepted on any output
    margin: float  # top-1 margins at or below this are ties


# float32: both sides compute in float32 with different summation orders (chunked vs scanned
# KDA, fused vs unfused matmuls). float16/bfloat16: each layer rounds its activations once more,
# at unit roundoff 4.9e-4 / 3.9e-3, and the errors accumulate over the layers and the router's
# top-k, so the bounds are a few tens of roundoffs.
TOLERANCES = {
    "float32": Tolerance(rel=1e-4, margin=1e-3),
    "float16": Tolerance(rel=2e-2, margin=0.1),
    "bfloat16": Tolerance(rel=1e-1, margin=0.5),
}
HALF_REL_CAP = 0.1
MAX_TIE_FRACTION = 0.1


def half_precision_tolerance(base: Tolerance, spread: float, logit_spread: float) -> Tolerance:
    """The bound for one step of a half-precision comparison: twice the eager half-vs-float32
    relative spread (never below the dtype's fixed bound, never above HALF_REL_CAP), and as tie
    margin twice the largest logit difference between them (never above ten times the fixed one)."""
    return Tolerance(rel=min(max(base.rel, 2 * spread), max(base.rel, HALF_REL_CAP)),
                     margin=min(max(base.margin, 2 * logit_spread), 10 * base.margin))


@dataclass
class Comparison:
    name: str
    max_abs: float
    rel: float
    cosine: float
    bound: float  # the relative error accepted
    passed: bool
    finite: bool = True  # no NaN or Inf on either side

    def as_dict(self) -> dict:
        return asdict(self)


def compare(name: str, actual: np.ndarray, reference: np.ndarray, tolerance: Tolerance) -> Comparison:
    a, r = actual.astype(np.float64).ravel(), reference.astype(np.float64).ravel()
    if a.shape != r.shape:
        return Comparison(name, float("inf"), float("inf"), 0.0, tolerance.rel, False)
    diff = a - r
    ref_norm, act_norm = np.linalg.norm(r), np.linalg.norm(a)
    rel = float(np.linalg.norm(diff) / ref_norm) if ref_norm > 0 else float(np.linalg.norm(diff))
    both = act_norm > 0 and ref_norm > 0
    cosine = float(a @ r / (act_norm * ref_norm)) if both else float(act_norm == ref_norm)
    max_abs = float(np.abs(diff).max()) if diff.size else 0.0
    finite = bool(np.isfinite(a).all() and np.isfinite(r).all())
    return Comparison(name, max_abs, rel, cosine, tolerance.rel, finite and rel <= tolerance.rel, finite)


@dataclass
class TokenAgreement:
    positions: int
    agree: int
    ties: int  # positions whose reference top-1 margin is within the tolerance

    @property
    def mismatches(self) -> int:
        return self.positions - self.agree - self.ties

    def as_dict(self) -> dict:
        return {**asdict(self), "mismatches": self.mismatches}


def top1_agreement(logits: np.ndarray, reference: np.ndarray, margin: float) -> TokenAgreement:
    """Greedy tokens over the last axis; a disagreement where the reference's top-1 margin is
    within `margin` is counted as a tie."""
    ref = reference.reshape(-1, reference.shape[-1]).astype(np.float64)
    other = logits.reshape(-1, logits.shape[-1])
    top2 = np.sort(ref, axis=-1)[:, -2:]
    tie = (top2[:, 1] - top2[:, 0]) <= margin
    same = ref.argmax(-1) == other.argmax(-1)
    return TokenAgreement(len(ref), int(same.sum()), int((~same & tie).sum()))


def nonfinite_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the floating-point tensors that hold a NaN or an Inf, in order (tensors on the
    meta device, the parts a layer range does not hold, have no values to check)."""
    return [name for name, t in named
            if t.is_floating_point() and not t.is_meta and not torch.isfinite(t).all()]


def verdict(steps: list[dict], nonfinite_weights: list[str] = ()) -> dict:
    """A run's verdict from its steps' comparisons (each step: {"step", "outputs", "tokens"?,
    "nonfinite"?}): which outputs failed, the first NaN/Inf (step and output; or the weights that
    hold one), token mismatches and ties, and whether it passed (no failed output, no mismatch, ties
    within MAX_TIE_FRACTION, finite weights)."""
    failed = sorted({c["name"] for s in steps for c in s["outputs"] if not c["passed"]})
    nonfinite = [{"step": s["step"], "outputs": s["nonfinite"]} for s in steps if s.get("nonfinite")]
    if nonfinite_weights:
        nonfinite.insert(0, {"step": "weights", "outputs": list(nonfinite_weights)})
    tokens = [s["tokens"] for s in steps if "tokens" in s]
    positions = sum(t["positions"] for t in tokens)
    ties = sum(t["ties"] for t in tokens)
    mismatches = sum(t["mismatches"] for t in tokens)
    too_many_ties = positions > 0 and ties > MAX_TIE_FRACTION * positions
    return {"failed_outputs": failed, "first_nonfinite": nonfinite[0] if nonfinite else None,
            "token_mismatches": mismatches, "token_ties": ties, "token_positions": positions,
            "too_many_ties": too_many_ties,
            "passed": not failed and mismatches == 0 and not too_many_ties and not nonfinite}
