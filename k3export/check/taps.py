"""Taps compared: per step, each tap against its envelope, and the first divergent one.

The taps themselves (what `export --taps` adds, and the eager hooks that record them) are defined in
k3export.onnx.taps.

Localisation: each tap is compared at valid positions, per step, and the first tap in model order
(layer, then mixer, ffn, partial) whose relative error leaves its envelope is named. The envelope
is the dtype's tolerance in float32. In half precision it rests on the triangle inequality through
float32: |backend - eager| <= |eager - float32| + |backend - float32|. The first term is measured:
the step's eager half-vs-float32 spread, the largest of the taps up to and including this one
(error grows gradually along depth). The second, the backend's own rounding, is not; it is taken
as the worst eager spread of any sample of the size compared (an aligned run of w entries, w the
largest power of two not above the step's entries), over the taps up to this one and the steps up
to this one. A decode step compares one token per row, and a single token's rounding is
heavy-tailed while a prefill's many tokens average it out; its error is mostly carried in by the
caches, which hold every earlier step's rounding. So one 2-token sample of eager rounding does not
bound another 2-token sample of the backend's (k3-tiny float16, ORT over eager per token: median
0.9, 99th percentile 3, max 8 times the eager spread, the same in prefill and decode); the worst
2-token sample the prefill shows at that depth does. For the prefill the sample is the step
itself, so its envelope stays (about) twice its spread. Floor the dtype's bound, cap HALF_REL_CAP.
The envelopes depend on the run so far, so compare_taps gives each step's own and first_divergent,
which sees the run, settles them (settle_envelopes). Over the run, the earliest tap that leaves its
envelope at any step is the first divergent one.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from k3export.check.compare import HALF_REL_CAP, Tolerance, compare
from k3export.onnx.taps import SUBLAYERS, parse_tap

SMALLEST_SAMPLE = 32  # entries: the smallest sample whose eager spread is kept (a fraction of a token)


def sample_spreads(reference: np.ndarray, float32: np.ndarray) -> dict[int, float]:
    """The worst eager half-vs-float32 relative spread over aligned runs of w entries, for w the
    powers of two from the largest not above the tensor's size down to SMALLEST_SAMPLE: {w: spread},
    relative to float32 as the step's spread is. Valid entries run token by token, so a run of w
    entries is a sample of w / hidden tokens."""
    ref, f32 = reference.astype(np.float64).ravel(), float32.astype(np.float64).ravel()
    spreads: dict[int, float] = {}
    if not ref.size:
        return spreads
    width = 1 << (ref.size.bit_length() - 1)
    while width >= min(SMALLEST_SAMPLE, 1 << (ref.size.bit_length() - 1)):
        count = ref.size // width
        diff = ((ref[:count * width] - f32[:count * width]) ** 2).reshape(count, width).sum(1)
        norm = (f32[:count * width] ** 2).reshape(count, width).sum(1)  # float32 the reference, as in compare
        rel = np.sqrt(np.where(norm > 0, diff / np.where(norm > 0, norm, 1.0), diff))
        rel = rel[np.isfinite(rel)]
        spreads[width] = float(rel.max()) if rel.size else 0.0
        width //= 2
    return spreads


def half_precision_envelope(tolerance: Tolerance, spread: float, sample_spread: float) -> float:
    """The relative error accepted on a half-precision tap: the step's eager spread (the eager
    model's own distance to float32) plus the worst same-size sample spread (a bound on the
    backend's), never below the dtype's bound, never above HALF_REL_CAP."""
    return min(max(tolerance.rel, spread + sample_spread), max(tolerance.rel, HALF_REL_CAP))


def compare_taps(reference: dict[str, np.ndarray], actual: dict[str, np.ndarray],
                 float32: dict[str, np.ndarray] | None, tolerance: Tolerance) -> list[dict[str, Any]]:
    """One step's taps (valid entries, by name, in model order): relative error, cosine and the
    envelope of each. `float32`: the eager float32 model's taps, for a half-precision run; each row
    then also holds its terms ("spread", "sample_spread", and "samples" for settle_envelopes), and
    its envelope is the one this step alone gives (first_divergent settles it over the run)."""
    rows, spread, samples = [], 0.0, {}
    for name, ref in reference.items():
        bound, terms = tolerance.rel, {}
        if float32 is not None:
            spread = max(spread, compare(name, ref, float32[name], tolerance).rel)
            for width, value in sample_spreads(ref, float32[name]).items():
                samples[width] = max(samples.get(width, 0.0), value)
            # The step is itself a sample of its size.
            own = max([spread, samples[max(samples)]] if samples else [spread])
            bound = half_precision_envelope(tolerance, spread, own)
            terms = {"spread": spread, "sample_spread": own, "tolerance": tolerance.rel,
                     "samples": sorted(samples.items())}
        c = compare(name, actual[name], ref, Tolerance(bound, tolerance.margin))
        layer, sublayer = parse_tap(name)
        rows.append({"name": name, "layer": layer, "sublayer": sublayer, "rel": c.rel, "cosine": c.cosine,
                     "max_abs": c.max_abs, "bound": c.bound, "passed": c.passed, **terms})
    return rows


def settle_envelopes(steps: list[dict[str, Any]]) -> None:
    """In place, in step order: each half-precision tap's envelope from the worst eager spread of a
    sample of its step's size over the taps up to it and the steps up to its own (the caches carry
    those steps' rounding in), and its verdict again. Removes the rows' "samples"; rows without them
    (float32, or settled already) are left as they are."""
    worst: dict[str, dict[int, float]] = {}
    for step in steps:
        for tap in step["taps"]:
            samples = tap.pop("samples", None)
            if samples is None:
                continue
            seen = worst.setdefault(tap["name"], {})
            for width, value in samples:
                seen[int(width)] = max(seen.get(int(width), 0.0), value)
            width = max((int(w) for w, _ in samples), default=None)  # this step's sample size
            tap["sample_spread"] = max(tap["spread"], seen.get(width, 0.0))
            tap["bound"] = half_precision_envelope(Tolerance(tap["tolerance"], 0.0), tap["spread"],
                                                   tap["sample_spread"])
            tap["passed"] = math.isfinite(tap["rel"]) and tap["rel"] <= tap["bound"]


def first_divergent(steps: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The earliest tap in model order that leaves its envelope at any step (the earliest step for
    that tap), or None. steps: [{"step": label, "taps": compare_taps(...)}], the whole run: their
    half-precision envelopes are settled first (settle_envelopes, in place)."""
    settle_envelopes(steps)
    found = None
    for step in steps:
        for tap in step["taps"]:
            if not tap["passed"]:
                key = (tap["layer"], SUBLAYERS.index(tap["sublayer"]))
                if found is None or key < found[0]:
                    found = (key, {**tap, "step": step["step"]})
                break  # later taps of this step follow from this one
    return found[1] if found else None


def per_layer(steps: list[dict[str, Any]], label: str | None = None) -> list[dict[str, Any]]:
    """Per layer and sublayer: the largest relative error and smallest cosine over the steps (only
    step `label` if given)."""
    table: dict[int, dict[str, Any]] = {}
    for step in steps:
        if label is not None and step["step"] != label:
            continue
        for tap in step["taps"]:
            row = table.setdefault(tap["layer"], {"layer": tap["layer"]})
            worst = row.setdefault(tap["sublayer"], {"rel": 0.0, "cosine": 1.0, "bound": tap["bound"]})
            worst["rel"] = max(worst["rel"], tap["rel"])
            worst["cosine"] = min(worst["cosine"], tap["cosine"])
            worst["bound"] = min(worst["bound"], tap["bound"])
    return [table[i] for i in sorted(table)]


def summary_lines(taps: dict[str, Any]) -> list[str]:
    """The per-layer table (worst over the steps) and the first divergent tap, for the terminal."""
    lines = [f"taps, worst over {len(taps['steps'])} steps (relative error / cosine):",
             "layer  " + "  ".join(f"{s:>24}" for s in SUBLAYERS)]
    for row in per_layer(taps["steps"]):
        cells = [f"{row[s]['rel']:.2e} / {row[s]['cosine']:.6f}" for s in SUBLAYERS]
        lines.append(f"{row['layer']:>5}  " + "  ".join(f"{c:>24}" for c in cells))
    first = taps["first_divergent"]
    if first:
        lines.append(f"first divergent: layer {first['layer']} {first['sublayer']} ({first['name']}) at "
                     f"{first['step']}: rel {first['rel']:.2e} > bound {first['bound']:.1e}, "
                     f"cos {first['cosine']:.6f}")
    else:
        lines.append("first divergent: none (every tap within its envelope)")
    return lines
