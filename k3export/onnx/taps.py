"""Taps: per-layer tensors as extra graph outputs (their comparison: k3export.check.taps).

`k3export export --taps` adds, after every other output, three tensors per layer i, each [batch,
seq, hidden] in the export's dtype (valid positions: each row's first input_lengths[b], as logits):

    taps.{i}.mixer     the sequence mixer's output (KDA or MLA attention, before the residual)
    taps.{i}.ffn       the FFN's output (dense SiTU-GLU or latent MoE, before the residual)
    taps.{i}.partial   the AttnRes block in progress after layer i; with the partials of earlier
                       layers it is the whole AttnRes state (a bank row is an earlier partial)

The eager model yields the same tensors through forward hooks (`recording`), registered only for
the call and removed after it, so the model holds no export code and a graph without taps is the
graph it always was.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

from torch import Tensor, nn

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
