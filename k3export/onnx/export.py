"""`k3export export`: the eager K3 model (or a layer range of it) as one ONNX graph.

One graph serves prefill (seq > 1) and decode (seq = 1): batch and seq are dynamic axes, the
MLA cache capacity is static (TensorRT's in-place KV_CACHE_UPDATE needs it). TensorRT builds both
from it as two optimization profiles of one engine, and the weights are written once instead of
once per graph. Inputs and outputs are flat, named tensors (export.json lists each with its dtype,
shape in named dims and meaning):

    input_ids [batch, seq] int64                    (or the AttnRes state at the range start)
    cache_lengths [batch] int64                     tokens already in each row's cache
    input_lengths [batch] int64                     valid tokens of each row (right-padded to seq)
    past.{i}.kda_state [batch, H, K, V] float32     past.{i}.{q,k,v}_conv [batch, W-1, H*K]
    past.{i}.mla_latent [batch, 1, capacity, latent]
    present.{i}.* the same after this call          present.{i}.mla_latent may share past's buffer
    logits [batch, seq, vocab]                      ([batch, vocab] with last_logits; or the
                                                     AttnRes state at the range end)

A layer range A:B starts and ends at an AttnRes boundary: `attn_res.{A}.bank` [n, batch, seq,
hidden] (the banked block outputs) and `attn_res.{A}.partial` [batch, seq, hidden] (the block in
progress); a range ending at B outputs `attn_res.{B}.*`, the next range's inputs by name.
"""

from __future__ import annotations

import json
import math
import platform
from collections import Counter
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import onnx
import torch
from torch import Tensor, nn

from k3export.artifacts import write_atomic
from k3export.config import K3Config
from k3export.errors import UserError
from k3export.model import K3ForCausalLM, KDACache, MLACache
from k3export.model.accounting import moe_cost_note
from k3export.model.cache import LayerCache
from k3export.model.k3 import last_positions
from k3export.onnx.collectives import DOMAIN as COLLECTIVE_DOMAIN
from k3export.onnx.collectives import OP_TYPE as COLLECTIVE_OP
from k3export.onnx.collectives import parallel_record
from k3export.onnx.domain import DOMAIN, ROUTED_OPS
from k3export.onnx.taps import MEANINGS as TAP_MEANINGS
from k3export.onnx.taps import SUBLAYERS as TAP_SUBLAYERS
from k3export.onnx.taps import recording, tap_name, tap_names
from k3export.options import MIN_CAPACITY

GRAPH_FILE = "model.onnx"
MANIFEST_FILE = "export.json"
# export --routing-outputs: routing.{layer}, each MoE layer's chosen experts; and on a rank's graph
# partial.{n}, the rank's partial sum that its n-th all-reduce takes (add_checking_outputs).
ROUTING_PREFIX = "routing."
PARTIAL_PREFIX = "partial."


# Named dims of the specs' shapes: "batch" and "seq" are dynamic; "capacity" is static, fixed at
# export (export.json's "capacity"). Along "seq" row b holds input_lengths[b] valid entries; along
# "capacity" a past cache holds cache_lengths[b] valid rows and a present one cache_lengths[b] +
# input_lengths[b].
DYNAMIC_AXES = {"batch": "sequences in the batch", "seq": "new tokens per row (1 for decode), right-padded"}
STATIC_AXES = ("capacity",)
DEFAULT_CAPACITY = 4096
# Opset 24 for TensorScatter, the in-place cache write.
OPSET = 24


@dataclass
class TensorSpec:
    name: str
    dtype: str
    shape: list[int | str]
    meaning: str
    aliases: str | None = None  # an input whose buffer this output may share (written in place)


def bank_rows(config: K3Config, boundary: int) -> int:
    """Rows in the AttnRes bank after layers 0 .. boundary-1: one per block started."""
    return 0 if boundary == 0 else (boundary - 1) // config.attn_res_block_size + 1


def parse_layers(text: str | None, config: K3Config) -> range:
    """'A:B' (either side may be empty) -> range(A, B) of 0-based layers."""
    L = config.num_hidden_layers
    if text is None:
        return range(L)
    try:
        start, stop = (int(p) if p else d for p, d in zip(text.split(":"), (0, L), strict=True))
    except ValueError:
        raise UserError(f"--layers {text!r}: expected A:B with 0 <= A < B <= {L}") from None
    if not 0 <= start < stop <= L:
        raise UserError(f"--layers {text!r}: expected A:B with 0 <= A < B <= {L}")
    return range(start, stop)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cache_specs(config: K3Config, layer: int, prefix: str, dtype: torch.dtype) -> list[TensorSpec]:
    """The cache tensors of one layer, in the order of its cache dataclass's fields."""
    lac = config.linear_attn_config
    if config.is_mla(layer):
        name = f"{prefix}.{layer}.mla_latent"
        aliases = f"past.{layer}.mla_latent" if prefix == "present" else None
        meaning = ("MLA latent rows [RMSNorm(c_kv) | k_r], valid up to each row's length; present is "
                   "past with this call's seq rows written at cache_lengths[b] (TensorScatter), and may "
                   "be past's buffer")
        return [TensorSpec(name, _dtype_name(dtype), ["batch", 1, "capacity", config.latent_dim], meaning,
                           aliases)]
    channels = lac.num_heads * lac.head_dim
    conv = [TensorSpec(f"{prefix}.{layer}.{x}_conv", _dtype_name(dtype),
                       ["batch", lac.short_conv_kernel_size - 1, channels],
                       f"last valid inputs of the {x} short convolution (zero for a fresh row)")
            for x in "qkv"]
    state = TensorSpec(f"{prefix}.{layer}.kda_state", "float32",
                       ["batch", lac.num_heads, lac.head_dim, lac.head_dim],
                       "KDA recurrent state S [K, V] (zero for a fresh row)")
    return [state, *conv]


LENGTH_SPECS = [
    TensorSpec("cache_lengths", "int64", ["batch"],
               "tokens already in each row's cache; 0 starts a fresh sequence, whose KDA state and conv "
               "tails the caller zeroes; the caller adds input_lengths after each call"),
    TensorSpec("input_lengths", "int64", ["batch"],
               "valid new tokens of each row (rows are right-padded to seq); padded positions change no "
               "state and their outputs are to be ignored"),
]


def graph_signature(config: K3Config, layers: range, dtype: torch.dtype, last_logits: bool = False,
                    taps: bool = False) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Inputs and outputs in graph order; `taps` appends k3export.onnx.taps' per-layer outputs last."""
    D, name = config.hidden_size, _dtype_name(dtype)

    def boundary(at: int) -> list[TensorSpec]:
        return [TensorSpec(f"attn_res.{at}.bank", name, [bank_rows(config, at), "batch", "seq", D],
                           f"AttnRes bank after layer {at - 1}: the banked block outputs"),
                TensorSpec(f"attn_res.{at}.partial", name, ["batch", "seq", D],
                           f"AttnRes block in progress after layer {at - 1}")]

    if layers.start == 0:
        inputs = [TensorSpec("input_ids", "int64", ["batch", "seq"], "token ids, right-padded")]
    else:
        inputs = boundary(layers.start)
    inputs += LENGTH_SPECS
    if layers.stop != config.num_hidden_layers:
        outputs = boundary(layers.stop)
    elif last_logits:
        outputs = [TensorSpec("logits", name, ["batch", config.vocab_size],
                              "next-token logits at each row's last valid token (input_lengths - 1; "
                              "a row with no new tokens gives position 0's, to be ignored)")]
    else:
        outputs = [TensorSpec("logits", name, ["batch", "seq", config.vocab_size], "next-token logits")]
    for layer in layers:
        inputs += cache_specs(config, layer, "past", dtype)
        outputs += cache_specs(config, layer, "present", dtype)
    if taps:
        outputs += [TensorSpec(tap_name(i, s), name, ["batch", "seq", D], TAP_MEANINGS[s].format(i=i))
                    for i in layers for s in TAP_SUBLAYERS]
    return inputs, outputs


class ExportGraph(nn.Module):
    """The model over `layers` with flat tensors in and out, in graph_signature's order. With `taps`
    the layers' taps follow, recorded by forward hooks for the call (k3export.onnx.taps)."""

    def __init__(self, model: K3ForCausalLM, layers: range, last_logits: bool = False,
                 taps: bool = False) -> None:
        super().__init__()
        self.model, self.layers, self.last_logits, self.taps = model, layers, last_logits, taps

    def forward(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        if not self.taps:
            return self._forward(*inputs)
        with recording(self.model, self.layers) as taps:
            outputs = self._forward(*inputs)
        return (*outputs, *(taps[name] for name in tap_names(self.layers)))

    def _forward(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        model, layers = self.model, self.layers
        if layers.start == 0:
            bank, partial, rest = [], model.model.embed_tokens(inputs[0]), list(inputs[1:])
        else:
            bank = [inputs[0][j] for j in range(inputs[0].shape[0])]  # the row count is static
            partial, rest = inputs[1], list(inputs[2:])
        cache_lengths, input_lengths, rest = rest[0], rest[1], rest[2:]
        caches: list[LayerCache] = []
        for layer in layers:
            kind = MLACache if model.config.is_mla(layer) else KDACache
            n = len(fields(kind))
            caches.append(kind(*rest[:n]))
            rest = rest[n:]
        bank, partial, caches = model.run_layers(bank, partial, caches, layers, cache_lengths, input_lengths)
        if layers.stop == model.config.num_hidden_layers:
            outputs = [model.head(bank, partial, last_positions(input_lengths) if self.last_logits else None)]
        else:
            outputs = [torch.stack(bank), partial]
        return (*outputs, *(getattr(c, f.name) for c in caches for f in fields(c)))


def resolve_shape(spec: TensorSpec, sizes: dict[str, int]) -> list[int]:
    """The spec's shape with its named dims replaced by `sizes` (batch, seq, capacity; a product such
    as "batch*seq" too)."""
    return [math.prod(sizes[n] for n in d.split("*")) if isinstance(d, str) else d for d in spec.shape]


def example_inputs(config: K3Config, layers: range, dtype: torch.dtype, batch: int, seq: int,
                   capacity: int, device: torch.device | str = "cpu") -> tuple[Tensor, ...]:
    """Zero inputs of the given sizes (token ids 0, lengths 0), for tracing and for shape checks."""
    sizes = {"batch": batch, "seq": seq, "capacity": capacity}
    return tuple(torch.zeros(resolve_shape(spec, sizes), dtype=getattr(torch, spec.dtype), device=device)
                 for spec in graph_signature(config, layers, dtype)[0])


def dynamic_shapes(inputs: list[TensorSpec]) -> tuple[dict[int, str], ...]:
    return tuple({axis: d for axis, d in enumerate(spec.shape) if d in DYNAMIC_AXES} for spec in inputs)


# ONNX element types of the checking outputs: expert ids, and partial sums in the model dtype or
# float32 (a MoE layer's [u | shared]).
_ELEMENT_TYPES = {"int64": onnx.TensorProto.INT64, "float32": onnx.TensorProto.FLOAT,
                  "float16": onnx.TensorProto.FLOAT16, "bfloat16": onnx.TensorProto.BFLOAT16}
_DTYPE_NAMES = {element: name for name, element in _ELEMENT_TYPES.items()}


def add_checking_outputs(path: Path, config: K3Config, layers: range) -> dict[str, list[dict[str, Any]]]:
    """Makes what check holds an artifact to graph outputs, in place in the graph file (its weights
    untouched), and returns their specs by manifest key: "routing_outputs", each MoE layer's expert
    choices `routing.{layer}` (its k3 routed-experts node's `experts` input), and for a rank's graph
    "partial_outputs", each all-reduce's input `partial.{n}` (the rank's partial sum; n: the
    DistCollective node's index in graph order, as export.json's "parallel" lists them). An engine's
    outputs are fixed when it is built, so a half-precision engine can be held to its own expert
    choices, and a rank's engine compared by its partial sums, only if its export outputs them."""
    graph = onnx.load(path, load_external_data=False)
    nodes = graph.graph.node
    routed = [n for n in nodes if n.domain == DOMAIN and n.op_type in ROUTED_OPS]
    moe_layers = [i for i in layers if not config.is_dense(i)]
    routing = [(node.input[ROUTED_OPS[node.op_type]], TensorSpec(f"{ROUTING_PREFIX}{layer}", "int64",
                                          ["batch*seq", config.num_experts_per_token],
                                          f"layer {layer}'s chosen experts per token (rows: batch-major "
                                          "positions)"))
               for node, layer in zip(routed, moe_layers, strict=True)]
    # The exporter records each intermediate's type with the graph's named dims (batch, seq, batch*seq).
    types = {v.name: v.type.tensor_type for v in graph.graph.value_info}
    sums = [n for n in nodes if n.domain == COLLECTIVE_DOMAIN and n.op_type == COLLECTIVE_OP]
    partials = [(node.input[0], TensorSpec(
        f"{PARTIAL_PREFIX}{n}", _DTYPE_NAMES[types[node.input[0]].elem_type],
        [d.dim_param or d.dim_value for d in types[node.input[0]].shape.dim],
        f"this rank's partial sum, the input of all-reduce {n} (export.json's parallel.collectives[{n}])"))
        for n, node in enumerate(sums)]
    for source, spec in routing + partials:
        nodes.append(onnx.helper.make_node("Identity", [source], [spec.name], name=f"{spec.name}.identity"))
        graph.graph.output.append(onnx.helper.make_tensor_value_info(spec.name, _ELEMENT_TYPES[spec.dtype],
                                                                     spec.shape))
    write_atomic(path, graph.SerializeToString())
    # "routing_outputs" even when empty (a dense-only range): check reads its presence as the option's.
    return {"routing_outputs": [asdict(spec) for _, spec in routing],
            **({"partial_outputs": [asdict(spec) for _, spec in partials]} if partials else {})}


def export_model(model: K3ForCausalLM, out_dir: str | Path, layers: range | None = None,
                 weights: dict[str, Any] | None = None, aot_plugins: bool = False,
                 capacity: int = DEFAULT_CAPACITY, last_logits: bool = False,
                 taps: bool = False, routing_outputs: bool = False) -> dict[str, Any]:
    """Writes model.onnx (+ model.onnx.data), config.json and export.json into out_dir.

    `weights` records where the weights came from ({"seed": N} or {"checkpoint": DIR}), so that
    `k3export check` can rebuild the same eager reference. `aot_plugins` marks the k3 nodes `aot = 1`
    for full TensorRT's AOT plugins (export_onnx). `capacity` is the MLA cache's static row count;
    `last_logits` gives logits only at each row's last valid token (a range that does not end at
    the last layer has no logits and ignores it). `taps` adds each layer's taps as outputs
    (k3export.onnx.taps; the graph is otherwise the same). `routing_outputs` adds check's outputs
    (add_checking_outputs): each MoE layer's expert choices routing.{layer}, and on a rank's graph
    each all-reduce's input partial.{n}, listed apart from "outputs" in the manifest's
    "routing_outputs" and "partial_outputs". Returns the manifest."""
    if capacity < MIN_CAPACITY:
        raise UserError(f"--capacity {capacity}: expected at least {MIN_CAPACITY} cached tokens per sequence")
    out_dir = Path(out_dir)
    config, dtype = model.config, model.dtype
    layers = layers or range(config.num_hidden_layers)
    # The exporter's modules (onnxscript, torch.onnx) load here, not with this module's names, which the
    # runtime and check read in every process they start.
    import onnxscript

    from k3export.onnx.ops import export_onnx

    inputs, outputs = graph_signature(config, layers, dtype, last_logits, taps)
    # Example sizes above 1, pairwise different and below the capacity, so no axis is specialised
    # or confused. On the weights' device: cpu, or meta for --no-weights (a range's unused parts
    # are meta too).
    device = "cpu" if any(p.device.type != "meta" for p in model.parameters()) else "meta"
    example = example_inputs(config, layers, dtype, batch=2, seq=3, capacity=capacity, device=device)
    with torch.no_grad():
        export_onnx(ExportGraph(model, layers, last_logits, taps).eval(), example, out_dir / GRAPH_FILE,
                    dynamic_shapes=(dynamic_shapes(inputs),),  # forward(*inputs): one parameter
                    opset_version=OPSET, input_names=[s.name for s in inputs],
                    output_names=[s.name for s in outputs], aot_plugins=aot_plugins)
    checking = add_checking_outputs(out_dir / GRAPH_FILE, config, layers) if routing_outputs else {}
    graph = onnx.load(out_dir / GRAPH_FILE, load_external_data=False)
    split = getattr(model, "tensor_parallel", None)  # a rank of k3export.model.parallel.split_model
    (split.config if split else config).to_json(out_dir / "config.json")
    manifest = {
        "graph": GRAPH_FILE,
        "dtype": _dtype_name(dtype),
        "weights": weights or {},
        "layers": [layers.start, layers.stop],
        "schedule": [{"layer": i, "mixer": "MLA" if config.is_mla(i) else "KDA",
                      "ffn": "dense" if config.is_dense(i) else "moe",
                      "starts_attn_res_block": i % config.attn_res_block_size == 0} for i in layers],
        "inputs": [asdict(s) for s in inputs],
        "outputs": [asdict(s) for s in outputs],
        "dynamic_axes": DYNAMIC_AXES,
        "capacity": capacity,
        "last_logits": last_logits and layers.stop == config.num_hidden_layers,
        "in_place": {s.name: s.aliases for s in outputs if s.aliases},
        "custom_nodes": dict(sorted(Counter(n.op_type for n in graph.graph.node
                                            if n.domain == DOMAIN).items())),
        "aot_plugins": aot_plugins,
        "opset": next(o.version for o in graph.opset_import if o.domain in ("", "ai.onnx")),
        "moe": moe_cost_note(config),
        "versions": {"torch": torch.__version__, "onnx": onnx.__version__,
                     "onnxscript": onnxscript.__version__, "python": platform.python_version()},
    }
    if taps:  # absent without --taps, so that such a manifest is what it always was
        manifest["taps"] = {"names": "taps.{layer}.{sublayer}", "sublayers": list(TAP_SUBLAYERS),
                            "meaning": {s: m.format(i="{layer}") for s, m in TAP_MEANINGS.items()},
                            "valid": "each row's first input_lengths[b] positions along seq"}
    manifest.update(checking)  # absent without --routing-outputs, as taps are
    if split:  # absent for an unsplit model, so that its manifest is what it always was
        manifest["parallel"] = parallel_record(split, graph, layers, dtype)
    write_atomic(out_dir / MANIFEST_FILE, (json.dumps(manifest, indent=2) + "\n").encode())
    return manifest
