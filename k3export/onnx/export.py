"""`k3export export`: the eager K3 model (or a layer range of it) as one ONNX graph.

One graph serves prefill (seq > 1) and decode (seq = 1): batch, seq and past are dynamic axes.
TensorRT builds both from it as two optimization profiles of one engine, and the weights are
written once instead of once per graph. Inputs and outputs are flat, named tensors:

    input_ids [batch, seq] int64                    (or the AttnRes state at the range start)
    past.{i}.kda_state [batch, H, K, V] float32     past.{i}.{q,k,v}_conv [batch, W-1, H*K]
    past.{i}.mla_latent [batch, past, latent]       present.{i}.* the same after this call
    logits [batch, seq, vocab]                      (or the AttnRes state at the range end)

A layer range A:B starts and ends at an AttnRes boundary: `attn_res.{A}.bank` [n, batch, seq,
hidden] (the banked block outputs) and `attn_res.{A}.partial` [batch, seq, hidden] (the block in
progress); a range ending at B outputs `attn_res.{B}.*`, the next range's inputs by name.
"""

from __future__ import annotations

import json
import platform
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import onnx
import onnxscript
import torch
from torch import Tensor, nn

from k3export.accounting import parameter_report
from k3export.artifacts import write_atomic
from k3export.config import K3Config
from k3export.errors import UserError
from k3export.model import K3ForCausalLM, KDACache, MLACache
from k3export.model.cache import LayerCache
from k3export.onnx.ops import export_onnx

GRAPH_FILE = "model.onnx"
MANIFEST_FILE = "export.json"


@dataclass
class TensorSpec:
    name: str
    dtype: str
    shape: list[int | str]
    meaning: str


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
        return [TensorSpec(f"{prefix}.{layer}.mla_latent", _dtype_name(dtype),
                           ["batch", "past" if prefix == "past" else "past+seq", config.latent_dim],
                           "MLA latent rows [RMSNorm(c_kv) | k_r], one per token")]
    channels = lac.num_heads * lac.head_dim
    conv = [TensorSpec(f"{prefix}.{layer}.{x}_conv", _dtype_name(dtype),
                       ["batch", lac.short_conv_kernel_size - 1, channels],
                       f"last inputs of the {x} short convolution") for x in "qkv"]
    state = TensorSpec(f"{prefix}.{layer}.kda_state", "float32",
                       ["batch", lac.num_heads, lac.head_dim, lac.head_dim], "KDA recurrent state S [K, V]")
    return [state, *conv]


def graph_signature(config: K3Config, layers: range, dtype: torch.dtype) -> tuple[list[TensorSpec],
                                                                                  list[TensorSpec]]:
    D, name = config.hidden_size, _dtype_name(dtype)

    def boundary(at: int) -> list[TensorSpec]:
        return [TensorSpec(f"attn_res.{at}.bank", name, [bank_rows(config, at), "batch", "seq", D],
                           f"AttnRes bank after layer {at - 1}: the banked block outputs"),
                TensorSpec(f"attn_res.{at}.partial", name, ["batch", "seq", D],
                           f"AttnRes block in progress after layer {at - 1}")]

    if layers.start == 0:
        inputs = [TensorSpec("input_ids", "int64", ["batch", "seq"], "token ids")]
    else:
        inputs = boundary(layers.start)
    if layers.stop == config.num_hidden_layers:
        outputs = [TensorSpec("logits", name, ["batch", "seq", config.vocab_size], "next-token logits")]
    else:
        outputs = boundary(layers.stop)
    for layer in layers:
        inputs += cache_specs(config, layer, "past", dtype)
        outputs += cache_specs(config, layer, "present", dtype)
    return inputs, outputs


class ExportGraph(nn.Module):
    """The model over `layers` with flat tensors in and out, in graph_signature's order."""

    def __init__(self, model: K3ForCausalLM, layers: range) -> None:
        super().__init__()
        self.model, self.layers = model, layers

    def forward(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        model, layers = self.model, self.layers
        if layers.start == 0:
            bank, partial, rest = [], model.model.embed_tokens(inputs[0]), list(inputs[1:])
        else:
            bank = [inputs[0][j] for j in range(inputs[0].shape[0])]  # the row count is static
            partial, rest = inputs[1], list(inputs[2:])
        caches: list[LayerCache] = []
        for layer in layers:
            kind = MLACache if model.config.is_mla(layer) else KDACache
            n = len(fields(kind))
            caches.append(kind(*rest[:n]))
            rest = rest[n:]
        bank, partial, caches = model.run_layers(bank, partial, caches, layers)
        if layers.stop == model.config.num_hidden_layers:
            outputs = [model.head(bank, partial)]
        else:
            outputs = [torch.stack(bank), partial]
        return (*outputs, *(getattr(c, f.name) for c in caches for f in fields(c)))


def example_inputs(config: K3Config, layers: range, dtype: torch.dtype, batch: int, seq: int,
                   past: int, device: torch.device | str = "cpu") -> tuple[Tensor, ...]:
    """Zero inputs of the given sizes (token ids 0), for tracing and for shape checks."""
    sizes = {"batch": batch, "seq": seq, "past": past}
    tensors = []
    for spec in graph_signature(config, layers, dtype)[0]:
        shape = [sizes[d] if isinstance(d, str) else d for d in spec.shape]
        tensors.append(torch.zeros(shape, dtype=getattr(torch, spec.dtype), device=device))
    return tuple(tensors)


def dynamic_shapes(inputs: list[TensorSpec]) -> tuple[dict[int, str], ...]:
    return tuple({axis: d for axis, d in enumerate(spec.shape) if isinstance(d, str)} for spec in inputs)


def moe_cost_note(config: K3Config) -> str:
    report = parameter_report(K3Config.from_preset("kimi-k3"))
    routed = report.params["routed_experts"] / 92
    return (f"MoE layers run a dense dispatch in standard ops: every routed expert on every token, "
            f"the top-{config.num_experts_per_token} selected by a combine matrix. At the published shapes "
            f"that is {2 * routed / 1e9:.1f} GFLOP per token per MoE layer instead of "
            f"{2 * routed * 16 / 896 / 1e9:.2f} (56x), and a [tokens, 896, 3072] float32 intermediate "
            f"(11 MB per token); a grouped-GEMM MoE plugin is later work.")


def export_model(model: K3ForCausalLM, out_dir: str | Path, layers: range | None = None,
                 weights: dict[str, Any] | None = None, aot_plugins: bool = False) -> dict[str, Any]:
    """Writes model.onnx (+ model.onnx.data), config.json and export.json into out_dir.

    `weights` records where the weights came from ({"seed": N} or {"checkpoint": DIR}), so that
    `k3export check` can rebuild the same eager reference. `aot_plugins` marks the k3 nodes `aot = 1`
    for full TensorRT's AOT plugins (export_onnx). Returns the manifest."""
    out_dir = Path(out_dir)
    config, dtype = model.config, model.dtype
    layers = layers or range(config.num_hidden_layers)
    inputs, outputs = graph_signature(config, layers, dtype)
    # Example sizes above 1 and pairwise different, so no axis is specialised or confused.
    # On the weights' device: cpu, or meta for --no-weights (a range's unused parts are meta too).
    device = "cpu" if any(p.device.type != "meta" for p in model.parameters()) else "meta"
    example = example_inputs(config, layers, dtype, batch=2, seq=3, past=5, device=device)
    with torch.no_grad():
        export_onnx(ExportGraph(model, layers).eval(), example, out_dir / GRAPH_FILE,
                    dynamic_shapes=(dynamic_shapes(inputs),),  # forward(*inputs): one parameter
                    input_names=[s.name for s in inputs], output_names=[s.name for s in outputs],
                    aot_plugins=aot_plugins)
    graph = onnx.load(out_dir / GRAPH_FILE, load_external_data=False)
    config.to_json(out_dir / "config.json")
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
        "dynamic_axes": {"batch": "sequences in the batch", "seq": "new tokens (1 for decode)",
                         "past": "tokens already in the MLA cache (0 for a fresh prefill)"},
        "custom_nodes": {"KDA": sum(n.op_type == "KDA" for n in graph.graph.node),
                         "LatentMLA": sum(n.op_type == "LatentMLA" for n in graph.graph.node)},
        "aot_plugins": aot_plugins,
        "opset": next(o.version for o in graph.opset_import if o.domain in ("", "ai.onnx")),
        "moe": moe_cost_note(config),
        "versions": {"torch": torch.__version__, "onnx": onnx.__version__,
                     "onnxscript": onnxscript.__version__, "python": platform.python_version()},
    }
    write_atomic(out_dir / MANIFEST_FILE, (json.dumps(manifest, indent=2) + "\n").encode())
    return manifest
