"""Comparisons between a reference output and another backend's, and their verdicts.

Relative error is the norm of the difference over the norm of the reference, over the whole
tensor. Greedy tokens are compared only where the reference's top-1 margin exceeds the numeric
tolerance: random weights produce near-ties, which are reported as ties, not failures.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np


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


@dataclass
class Comparison:
    name: str
    max_abs: float
    rel: float
    cosine: float
    bound: float  # the relative error accepted
    passed: bool

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
    passed = bool(np.isfinite(a).all() and rel <= tolerance.rel)
    return Comparison(name, max_abs, rel, cosine, tolerance.rel, passed)


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
