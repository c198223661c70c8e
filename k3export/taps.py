"""Taps: per-layer tensors as extra graph outputs, and the localisation they allow.

`k3export export --taps` adds, after every other output, three tensors per layer i, each [batch,
seq, hidden] in the export's dtype (valid positions: each row's first input_lengths[b], as logits):

    taps.{i}.mixer     the sequence mixer's output (KDA or MLA attention, before the residual)
    taps.{i}.ffn       the FFN's output (dense SiTU-GLU or latent MoE, before the residual)
    taps.{i}.partial   the AttnRes block in progress after layer i; with the partials of earlier
                       layers it is the whole AttnRes state (a bank row is an earlier partial)

The eager model yields the same tensors through forward hooks (`recording`), registered only for
the call and removed after it, so the model holds no export code and a graph without taps is the
graph it always was.

Localisation: each tap is compared at valid positions, per step, and the first tap in model order
(layer, then mixer, ffn, partial) whose relative error leaves its envelope is named. The envelope
is the dtype's tolerance in float32; in half precision, half_precision_tolerance of the largest
eager half-vs-float32 spread of the taps up to and including this one (error grows gradually along
depth, so a tap is held to what the eager model's own rounding reached by then, capped at
HALF_REL_CAP). Over the run, the earliest such tap of any step is the first divergent one.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
from torch import Tensor, nn

from k3export.parity import Tolerance, compare, half_precision_tolerance

SUBLAYERS = ("mixer", "ffn", "partial")
PREFIX = "taps."
MEANINGS = {
    "mixer": "layer {i}'s sequence mixer output (KDA or MLA, before the residual)",
    "ffn": "layer {i}'s FFN output (dense or latent MoE, before the residual)",
    "partial": "AttnRes block in progress after layer {i} (with earlier layers' partials: the AttnRes state)",
}
_NAME = re.compile(r"taps\.(\d+)\.(mixer|ffn|partial)$")


def tap_name(layer: int, sublayer: str) -> str:
    return f"{PREFIX}{layer}.{sublayer}"


def tap_names(layers: range) -> list[str]:
    """Every tap of `layers`, in model order (the graph's output order)."""
    return [tap_name(i, s) for i in layers for s in SUBLAYERS]


def parse_tap(name: str) -> tuple[int, str] | None:
    """(layer, sublayer) of a tap name, None for any other tensor."""
    match = _NAME.match(name)
    return (int(match.group(1)), match.group(2)) if match else None


@contextlib.contextmanager
def recording(model: nn.Module, layers: range) -> Iterator[dict[str, Tensor]]:
    """Forward hooks on `layers` of a K3ForCausalLM for the duration of the block: the yielded dict
    fills with every tap of the calls made inside it (the last call's values)."""
    taps: dict[str, Tensor] = {}

    def keep(name: str, pick: Any) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            taps[name] = pick(output)
        return hook

    handles = []
    for i in layers:
        layer = model.model.layers[i]
        # self_attn returns (output, cache); the decoder layer (bank, partial, cache).
        handles.append(layer.self_attn.register_forward_hook(keep(tap_name(i, "mixer"), lambda o: o[0])))
        handles.append(layer.ffn.register_forward_hook(keep(tap_name(i, "ffn"), lambda o: o)))
        handles.append(layer.register_forward_hook(keep(tap_name(i, "partial"), lambda o: o[1])))
    try:
        yield taps
    finally:
        for handle in handles:
            handle.remove()


def compare_taps(reference: dict[str, np.ndarray], actual: dict[str, np.ndarray],
                 float32: dict[str, np.ndarray] | None, tolerance: Tolerance) -> list[dict[str, Any]]:
    """One step's taps (valid entries, by name, in model order): relative error, cosine and the
    envelope of each. `float32`: the eager float32 model's taps, for a half-precision run."""
    rows, spread = [], 0.0
    for name, ref in reference.items():
        bound = tolerance
        if float32 is not None:
            spread = max(spread, compare(name, ref, float32[name], tolerance).rel)
            bound = half_precision_tolerance(tolerance, spread, 0.0)
        c = compare(name, actual[name], ref, bound)
        layer, sublayer = parse_tap(name)
        rows.append({"name": name, "layer": layer, "sublayer": sublayer, "rel": c.rel, "cosine": c.cosine,
                     "max_abs": c.max_abs, "bound": c.bound, "passed": c.passed})
    return rows


def first_divergent(steps: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The earliest tap in model order that leaves its envelope at any step (the earliest step for
    that tap), or None. steps: [{"step": label, "taps": compare_taps(...)}]."""
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
