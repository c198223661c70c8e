"""Comparisons between a reference output and another backend's, and their verdicts.

Relative error is the norm of the difference over the norm of the reference, over the whole
tensor. NaN or Inf on either side fails a comparison.

Greedy tokens: where the graph's top-1 differs from the reference's, the position is a tie when the
graph's token is itself within the tolerance's margin of the reference's top-1, in the reference's
own logits (the graph picked a token the reference rates as good as its own, up to rounding), and a
mismatch otherwise, which fails the run. Ties are counted and reported, never failed: with random
weights the logits are nearly flat and near-ties are many, and how many of them flip depends on the
instruction set of the CPU that rounds them (a bfloat16 check once failed on an AVX-512 machine at
11 ties of 109 and passed under an AVX2 cap at 10, against a 10% rule). What a tie cannot hide, the
logits' relative error bound still catches.

Half precision is held to a bound that grows with the eager model's own half-vs-float32 spread, but
never past HALF_REL_CAP: past it a comparison no longer says anything (a float16 check once passed
at relative error 0.81 against a bound of 1.4, cosine 0.67, every position a tie). 0.1 is ten times
float16's fixed bound and where bfloat16's starts: a relative error of 0.1 still means cosine >=
0.995, the same direction.

Every verdict also records its headroom: each threshold statistic over its threshold (the worst
relative error over its bound, the widest disagreement's gap over the margin), so that a pass met
by a hair shows as one.
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
    ties: int  # disagreements whose graph token is within the margin of the reference's top-1
    mismatches: int  # disagreements past the margin
    widest_gap: float  # the largest reference-logit gap of a disagreement over the margin (0: none)

    def as_dict(self) -> dict:
        return asdict(self)


def top1_agreement(logits: np.ndarray, reference: np.ndarray, margin: float) -> TokenAgreement:
    """Greedy tokens over the last axis. Where they differ, the gap is how far the graph's token
    lies below the reference's top-1 in the reference's logits: within `margin` a tie, past it a
    mismatch."""
    ref = reference.reshape(-1, reference.shape[-1]).astype(np.float64)
    other = logits.reshape(-1, logits.shape[-1])
    rows, ours = np.arange(len(ref)), other.argmax(-1)
    gap = ref.max(-1) - ref[rows, ours]
    differ = ref.argmax(-1) != ours
    tie = differ & (gap <= margin)
    widest = float(gap[differ].max() / margin) if differ.any() else 0.0
    return TokenAgreement(len(ref), int((~differ).sum()), int(tie.sum()), int((differ & ~tie).sum()), widest)


def nonfinite_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the floating-point tensors that hold a NaN or an Inf, in order (tensors on the
    meta device, the parts a layer range does not hold, have no values to check)."""
    return [name for name, t in named
            if t.is_floating_point() and not t.is_meta and not torch.isfinite(t).all()]


def verdict(steps: list[dict], nonfinite_weights: list[str] = ()) -> dict:
    """A run's verdict from its steps' comparisons (each step: {"step", "outputs", "tokens"?,
    "nonfinite"?}): which outputs failed, the first NaN/Inf (step and output; or the weights that
    hold one), token mismatches and ties, the headroom of each threshold, and whether it passed (no
    failed output, no mismatch, finite weights)."""
    failed = sorted({c["name"] for s in steps for c in s["outputs"] if not c["passed"]})
    nonfinite = [{"step": s["step"], "outputs": s["nonfinite"]} for s in steps if s.get("nonfinite")]
    if nonfinite_weights:
        nonfinite.insert(0, {"step": "weights", "outputs": list(nonfinite_weights)})
    tokens = [s["tokens"] for s in steps if "tokens" in s]
    mismatches = sum(t["mismatches"] for t in tokens)
    return {"failed_outputs": failed, "first_nonfinite": nonfinite[0] if nonfinite else None,
            "token_mismatches": mismatches, "token_ties": sum(t["ties"] for t in tokens),
            "token_positions": sum(t["positions"] for t in tokens), "headroom": headroom(steps),
            "passed": not failed and mismatches == 0 and not nonfinite}


def headroom(steps: list[dict]) -> dict:
    """Each threshold statistic over its threshold (pass at <= 1): the worst output's relative error
    over its bound, and the widest disagreement's reference-logit gap over the tie margin (past 1:
    a mismatch), each with where."""
    worst = max(((s["step"], c) for s in steps for c in s["outputs"]),
                key=lambda e: e[1]["rel"] / e[1]["bound"], default=None)
    out: dict = {}
    if worst:
        label, c = worst
        out["relative_error"] = {"ratio": c["rel"] / c["bound"], "output": c["name"], "step": label,
                                 "rel": c["rel"], "bound": c["bound"]}
    widest = max(((s["step"], s["tokens"]["widest_gap"]) for s in steps if "tokens" in s),
                 key=lambda e: e[1], default=None)
    if widest:
        out["tie_gap"] = {"ratio": widest[1], "step": widest[0]}
    return out
