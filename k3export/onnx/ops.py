"""The custom translation table: each `torch.ops.k3.*` call becomes one raw node in domain k3.

The exporter inlines model-local functions (its version-conversion pass), so an onnxscript function
would not survive as one node. Instead each op is an onnxscript `Op` backed by an `OpSchema`, which
the exporter records as a plain node; `attach_functions` adds the bodies after export.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir
import onnxscript.optimizer
import torch
from onnx.defs import OpSchema
from onnxscript import opset18 as op
from onnxscript import values

import k3export.ops  # noqa: F401  (registers torch.ops.k3.*)
from k3export.onnx.collectives import collective_translation_table
from k3export.onnx.functions import AOT_ATTRIBUTE, DOMAIN, DOMAIN_VERSION, PLUGIN_ATTRIBUTES, k3_functions
from k3export.onnx.moe import moe_translation_table, packed_experts_as_words

PLUGIN_NAMESPACE = "k3"
PLUGIN_VERSION = "1"

_FLOATS = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]
_PLUGIN_ATTRS = [*(OpSchema.Attribute(name, OpSchema.AttrType.STRING, "TensorRT plugin lookup")
                   for name in PLUGIN_ATTRIBUTES),
                 OpSchema.Attribute(AOT_ATTRIBUTE, OpSchema.AttrType.INT, "1: TensorRT's AOT plugin form",
                                    required=False)]


def _inputs(*specs: tuple[str, str]) -> list[OpSchema.FormalParameter]:
    return [OpSchema.FormalParameter(name, type_str) for name, type_str in specs]


KDA_SCHEMA = OpSchema(
    "KDA", DOMAIN, DOMAIN_VERSION,
    doc="KDA recurrence; see k3export/ops/kda.py",
    inputs=_inputs(("q", "T"), ("k", "T"), ("v", "T"), ("g", "TG"), ("beta", "TG"),
                   ("initial_state", "TS")),
    outputs=_inputs(("o", "T"), ("final_state", "TS")),
    # g and beta may stay float32 under a half-precision model; the state is always float32.
    type_constraints=[("T", _FLOATS, ""), ("TG", _FLOATS, ""), ("TS", ["tensor(float)"], "")],
    attributes=_PLUGIN_ATTRS,
)

LATENT_MLA_SCHEMA = OpSchema(
    "LatentMLA", DOMAIN, DOMAIN_VERSION,
    doc="Absorbed latent attention; see k3export/ops/mla.py",
    inputs=_inputs(("q", "T"), ("kv", "TKV"), ("cache_lengths", "tensor(int64)")),
    outputs=_inputs(("o", "T")),
    type_constraints=[("T", _FLOATS, ""), ("TKV", _FLOATS, "")],
    attributes=[*_PLUGIN_ATTRS,
                OpSchema.Attribute("v_dim", OpSchema.AttrType.INT, "value width: kv[..., :v_dim]"),
                OpSchema.Attribute("scale", OpSchema.AttrType.FLOAT, "softmax scale")],
)

_K3 = values.Opset(DOMAIN, DOMAIN_VERSION)
_KDA = values.Op(_K3, "KDA", KDA_SCHEMA)
_LATENT_MLA = values.Op(_K3, "LatentMLA", LATENT_MLA_SCHEMA)
# onnxscript 0.7.2 has no opset-24 module; the exporter takes an Op on the standard schema.
_TENSOR_SCATTER = values.Op(values.Opset("", 24), "TensorScatter", onnx.defs.get_schema("TensorScatter", 24))


def _kda(q, k, v, g, beta, initial_state):
    return _KDA(q, k, v, g, beta, initial_state,
                plugin_namespace=PLUGIN_NAMESPACE, plugin_version=PLUGIN_VERSION)


# Annotated so that the exporter passes v_dim and scale as attributes, not as tensors.
def _latent_mla(q, kv, cache_lengths, v_dim: int, scale: float):
    return _LATENT_MLA(q, kv, cache_lengths, v_dim=v_dim, scale=scale,
                       plugin_namespace=PLUGIN_NAMESPACE, plugin_version=PLUGIN_VERSION)


def _tensor_scatter(past, update, write_indices):
    """The in-place cache write (opset 24): ONNX Runtime and TensorRT alias present with past."""
    return _TENSOR_SCATTER(past, update, write_indices, axis=-2, mode="linear")


def _stable_sort(self, stable: bool | None = None, dim: int = -1, descending: bool = False):
    """The router's tie rule (lowest expert index first) is a stable sort; ONNX TopK over the
    whole axis breaks ties to the lower index in both directions, which is the same order."""
    size = op.Shape(self, start=dim) if dim == -1 else op.Shape(self, start=dim, end=dim + 1)
    return op.TopK(self, size, axis=dim, largest=descending, sorted=True)


TRANSLATION_TABLE: dict[Callable, Callable] = {
    torch.ops.k3.kda.default: _kda,
    torch.ops.k3.latent_mla.default: _latent_mla,
    torch.ops.k3.tensor_scatter.default: _tensor_scatter,
    torch.ops.aten.sort.stable: _stable_sort,
    **moe_translation_table(PLUGIN_NAMESPACE),
    **collective_translation_table(),
}


def attach_functions_ir(model: ir.Model) -> ir.Model:
    """`attach_functions` for the exporter's in-memory model (no copy of the weights into a proto)."""
    opset = model.opset_imports[""]
    for proto in k3_functions({node.op_type for node in model.graph if node.domain == DOMAIN}, opset):
        function = ir.serde.deserialize_function(proto)
        model.functions[function.identifier()] = function
    model.opset_imports.setdefault(DOMAIN, DOMAIN_VERSION)
    return model


def request_aot_plugins(model: ir.Model) -> ir.Model:
    """Marks every k3 node `aot = 1`, so that full TensorRT's ONNX parser builds the AOT form of a
    `tensorrt.plugin` plugin that has both (k3plugins.trt_aot: PTX in the engine, no Python at run
    time). TensorRT-RTX's IPluginV3 creators do not declare the field, so its parser drops it."""
    for node in model.graph:
        if node.domain == DOMAIN:
            node.attributes[AOT_ATTRIBUTE] = ir.AttrInt64(AOT_ATTRIBUTE, 1)
    return model


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """Silences the exporter's notes that say nothing about our model: torchvision ops it skips,
    a deprecation inside torch's pytree, and dynamic axes it renames because they coincide."""
    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registration.level
    registration.setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        warnings.filterwarnings("ignore", message="# The axis name", category=UserWarning)
        try:
            yield
        finally:
            registration.setLevel(level)


def export_onnx(module: torch.nn.Module, args: tuple[Any, ...], path: str | os.PathLike, *,
                dynamic_shapes: Any = None, opset_version: int | None = None,
                input_names: list[str] | None = None, output_names: list[str] | None = None,
                aot_plugins: bool = False) -> ir.Model:
    """Exports `module` with the k3 table, attaches the functions and writes `path` with its
    weights in `<name>.data` beside it. Both files are written in a temporary folder and moved into
    place, the model last, so an interrupted run leaves no model that points at missing data.
    `aot_plugins` marks the k3 nodes for TensorRT's AOT plugins (`request_aot_plugins`).

    MXFP4 experts kept packed are written as int32 words of their bytes (k3export/mxfp4.py, "Words"),
    so that TensorRT-RTX keeps them packed, and are dequantised by the graph.
    A module whose weights are on the meta device exports without weights: each becomes a graph
    input of its shape and dtype (after the weight inputs' names, the graph's own), so the file is
    complete ONNX that checkers and shape inference accept at real shapes, with no weight bytes."""
    # A layer range holds only its own layers' weights (the rest, unused by the graph, stay meta).
    with_weights = any(p.device.type != "meta" for p in module.parameters())
    # The optimizer's constant folding would read meta weights, and would fold packed MXFP4 experts
    # (uint8 buffers) back into float weights.
    optimize = with_weights and not any(b.dtype == torch.uint8 for b in module.buffers())
    with _quiet_exporter():
        program = torch.onnx.export(module, args, dynamo=True, custom_translation_table=TRANSLATION_TABLE,
                                    dynamic_shapes=dynamic_shapes, opset_version=opset_version,
                                    input_names=input_names, output_names=output_names, verbose=False,
                                    optimize=optimize)
    model = attach_functions_ir(program.model)
    if aot_plugins:
        request_aot_plugins(model)
    if not with_weights:
        for name in list(model.graph.initializers):
            value = model.graph.initializers.pop(name)
            value.const_value = None
            model.graph.inputs.append(value)
    if not optimize:  # fold what TensorRT needs as constants (axes, shapes); the weights are inputs or uint8
        onnxscript.optimizer.optimize(model, inline=False)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data_name = f"{path.name}.data"
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        ir.save(model, Path(tmp) / path.name, external_data=data_name)
        packed_experts_as_words(Path(tmp) / path.name)  # only the headers change: the data is written once
        if (Path(tmp) / data_name).exists():
            os.replace(Path(tmp) / data_name, path.with_name(data_name))
        os.replace(Path(tmp) / path.name, path)
    return model
