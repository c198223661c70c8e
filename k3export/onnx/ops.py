"""The custom translation table: each `torch.ops.k3.*` call becomes one raw node in domain k3.

The exporter inlines model-local functions (its version-conversion pass), so an onnxscript function
would not survive as one node. Instead each op is an onnxscript `Op` backed by an `OpSchema`, which
the exporter records as a plain node; `attach_functions` adds the bodies after export.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
import onnxscript.optimizer
import torch
from onnx.defs import OpSchema
from onnxscript import opset18 as op
from onnxscript import values
from torch.onnx._internal.exporter import _fx_passes, _registration
from torch.onnx._internal.fx.passes import type_promotion

import k3export.ops  # noqa: F401  (registers torch.ops.k3.*)
from k3export.onnx.collectives import collective_translation_table
from k3export.onnx.functions import AOT_ATTRIBUTE, DOMAIN, DOMAIN_VERSION, PLUGIN_ATTRIBUTES, k3_functions
from k3export.onnx.moe import moe_translation_table, packed_experts_as_words, type_grouped_intermediates

PLUGIN_NAMESPACE = "k3"
PLUGIN_VERSION = "1"

_FLOATS = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]
_PLUGIN_ATTRS = [*(OpSchema.Attribute(name, OpSchema.AttrType.STRING, "TensorRT plugin lookup")
                   for name in PLUGIN_ATTRIBUTES),
                 OpSchema.Attribute(AOT_ATTRIBUTE, OpSchema.AttrType.INT, "1: TensorRT's AOT plugin form",
                                    required=False)]


def _inputs(*specs: tuple[str, str]) -> list[OpSchema.FormalParameter]:
    return [OpSchema.FormalParameter(name, type_str) for name, type_str in specs]


# g and beta may stay float32 under a half-precision model; the state is always float32.
_KDA_TYPES = [("T", _FLOATS, ""), ("TG", _FLOATS, ""), ("TS", ["tensor(float)"], "")]

KDA_SCHEMA = OpSchema(
    "KDA", DOMAIN, DOMAIN_VERSION,
    doc="KDA recurrence; see k3export/ops/kda.py",
    inputs=_inputs(("q", "T"), ("k", "T"), ("v", "T"), ("g", "TG"), ("beta", "TG"),
                   ("initial_state", "TS")),
    outputs=_inputs(("o", "T"), ("final_state", "TS")),
    type_constraints=_KDA_TYPES,
    attributes=_PLUGIN_ATTRS,
)

# kda as the graph runs it: the chunks' state-free terms, then the recurrence over them (the token inputs too:
# a short call steps from them). Two nodes, so that an engine's AOT kernels run prefill as two launches: an
# AOT plugin is one launch with no workspace, and the terms are graph tensors between the two. (KDA, the
# one-node form, is what earlier exports hold.)
_KDA_TERMS = (("qg", "T"), ("kt", "T"), ("w", "T"), ("u", "T"), ("a_qk", "T"), ("decay_last", "TS"))

KDA_PREPARE_SCHEMA = OpSchema(
    "KDAPrepare", DOMAIN, DOMAIN_VERSION,
    doc="KDA's chunk terms qg, kt, w, u, a_qk (v's dtype) and decay_last (float32); see k3export/ops/kda.py",
    inputs=_inputs(("q", "T"), ("k", "T"), ("v", "T"), ("g", "TG"), ("beta", "TG")),
    outputs=_inputs(*_KDA_TERMS),
    type_constraints=_KDA_TYPES,
    attributes=_PLUGIN_ATTRS,
)

KDA_CHUNK_RECURRENCE_SCHEMA = OpSchema(
    "KDAChunkRecurrence", DOMAIN, DOMAIN_VERSION,
    doc="KDA's (o, final_state) from KDAPrepare's terms; see k3export/ops/kda.py",
    inputs=_inputs(("q", "T"), ("k", "T"), ("v", "T"), ("g", "TG"), ("beta", "TG"), *_KDA_TERMS,
                   ("initial_state", "TS")),
    outputs=_inputs(("o", "T"), ("final_state", "TS")),
    type_constraints=_KDA_TYPES,
    attributes=_PLUGIN_ATTRS,
)

# What LatentMLA and LatentMLASplits share: their inputs, types and attributes.
_MLA = {"inputs": _inputs(("q", "T"), ("kv", "TKV"), ("cache_lengths", "tensor(int64)")),
        "type_constraints": [("T", _FLOATS, ""), ("TKV", _FLOATS, "")],
        "attributes": [*_PLUGIN_ATTRS,
                       OpSchema.Attribute("v_dim", OpSchema.AttrType.INT, "value width: kv[..., :v_dim]"),
                       OpSchema.Attribute("scale", OpSchema.AttrType.FLOAT, "softmax scale")]}

LATENT_MLA_SCHEMA = OpSchema(
    "LatentMLA", DOMAIN, DOMAIN_VERSION,
    doc="Absorbed latent attention; see k3export/ops/mla.py",
    outputs=_inputs(("o", "T")),
    **_MLA,
)

# latent_mla as the graph runs it: the splits of each row's cache (float32 partial outputs and their
# log-sum-exp, a split count the kernel picks), then their combine into o. Two nodes, so that an engine's
# AOT kernels can split the cache: an AOT plugin is one launch with no workspace, and the partials are a
# graph tensor between the two launches. (LatentMLA, the one-node form, is what earlier exports hold.)
LATENT_MLA_SPLITS_SCHEMA = OpSchema(
    "LatentMLASplits", DOMAIN, DOMAIN_VERSION,
    doc="Absorbed latent attention over splits of each row's cache: o_part [S, B, T, H, v_dim] and its "
        "lse [S, B, T, H], float32; see k3export/ops/mla.py",
    outputs=_inputs(("o_part", "tensor(float)"), ("lse", "tensor(float)")),
    **_MLA,
)

LATENT_MLA_COMBINE_SCHEMA = OpSchema(
    "LatentMLACombine", DOMAIN, DOMAIN_VERSION,
    doc="The splits of LatentMLASplits combined by their lse into o [B, T, H, v_dim] in q's dtype (q gives "
        "only the dtype); see k3export/ops/mla.py",
    inputs=_inputs(("q", "T"), ("o_part", "tensor(float)"), ("lse", "tensor(float)")),
    outputs=_inputs(("o", "T")),
    type_constraints=[("T", _FLOATS, "")],
    attributes=_PLUGIN_ATTRS,
)

_K3 = values.Opset(DOMAIN, DOMAIN_VERSION)
_KDA_PREPARE = values.Op(_K3, "KDAPrepare", KDA_PREPARE_SCHEMA)
_KDA_CHUNK_RECURRENCE = values.Op(_K3, "KDAChunkRecurrence", KDA_CHUNK_RECURRENCE_SCHEMA)
_LATENT_MLA_SPLITS = values.Op(_K3, "LatentMLASplits", LATENT_MLA_SPLITS_SCHEMA)
_LATENT_MLA_COMBINE = values.Op(_K3, "LatentMLACombine", LATENT_MLA_COMBINE_SCHEMA)
# onnxscript 0.7.2 has no opset-24 module; the exporter takes an Op on the standard schema.
_TENSOR_SCATTER = values.Op(values.Opset("", 24), "TensorScatter", onnx.defs.get_schema("TensorScatter", 24))


def _kda(q, k, v, g, beta, initial_state):
    terms = _KDA_PREPARE(q, k, v, g, beta, plugin_namespace=PLUGIN_NAMESPACE, plugin_version=PLUGIN_VERSION)
    return _KDA_CHUNK_RECURRENCE(q, k, v, g, beta, *terms, initial_state, plugin_namespace=PLUGIN_NAMESPACE,
                                 plugin_version=PLUGIN_VERSION)


# Annotated so that the exporter passes v_dim and scale as attributes, not as tensors.
def _latent_mla(q, kv, cache_lengths, v_dim: int, scale: float):
    o_part, lse = _LATENT_MLA_SPLITS(q, kv, cache_lengths, v_dim=v_dim, scale=scale,
                                     plugin_namespace=PLUGIN_NAMESPACE, plugin_version=PLUGIN_VERSION)
    return _LATENT_MLA_COMBINE(q, o_part, lse, plugin_namespace=PLUGIN_NAMESPACE,
                               plugin_version=PLUGIN_VERSION)


def _tensor_scatter(past, update, write_indices):
    """The in-place cache write (opset 24): ONNX Runtime and TensorRT alias present with past."""
    return _TENSOR_SCATTER(past, update, write_indices, axis=-2, mode="linear")


def _to_dtype(self, dtype: int, non_blocking: bool = False, copy: bool = False, memory_format: str = ""):
    """`x.to(dtype)` as the capture records it, where it changes the dtype (`_drop_no_op_casts`
    removes the others, as the decomposition this export skips would)."""
    return op.Cast(self, to=dtype)


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
    torch.ops.aten.to.dtype: _to_dtype,
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


def type_partials(model: ir.Model) -> None:
    """The graph tensors between LatentMLASplits and LatentMLACombine, and between KDAPrepare and
    KDAChunkRecurrence, have no torch value behind them, so the exporter leaves them untyped: declared as
    every other tensor is (float32, and KDA's chunk terms but decay_last in v's dtype, as their schemas
    say)."""
    for node in model.graph:
        if node.domain == DOMAIN and node.op_type == "LatentMLASplits":
            for value in node.outputs:
                value.dtype = ir.DataType.FLOAT
        if node.domain == DOMAIN and node.op_type == "KDAPrepare":
            for value in node.outputs[:-1]:
                value.dtype = node.inputs[2].dtype
            node.outputs[-1].dtype = ir.DataType.FLOAT


def request_aot_plugins(model: ir.Model) -> ir.Model:
    """Marks every k3 node `aot = 1`, so that full TensorRT's ONNX parser builds the AOT form of a
    `tensorrt.plugin` plugin that has both (k3plugins.trt_aot: PTX in the engine, no Python at run
    time). TensorRT-RTX's IPluginV3 creators do not declare the field, so its parser drops it."""
    for node in model.graph:
        if node.domain == DOMAIN:
            node.attributes[AOT_ATTRIBUTE] = ir.AttrInt64(AOT_ATTRIBUTE, 1)
    return model


class _PromoteFromMetadata(type_promotion._TypePromotionInterpreter):
    """torch's type promotion pass (the casts ONNX needs where torch promotes implicitly), taking
    each node's value from the metadata the capture recorded instead of running the node again
    under fake tensors: only the nodes it changes run again. The same casts, a sixth of the time."""

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op != "call_function" or "val" not in n.meta:
            return super().run_node(n)
        with self._set_current_node(n):
            if rule := type_promotion.get_type_promotion_rule(n, self.type_promotion_table):
                self._maybe_promote_node(n, rule)  # re-runs n and updates its meta if it changed
        return n.meta["val"]


def _drop_no_op_casts(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """Removes each `x.to(dtype)` where x already has the dtype (the capture records `.float()` on a
    float32 tensor). Left in, it would be a Cast that constant folding turns into an anonymous copy
    of a named weight."""
    graph = program.graph_module.graph
    for node in list(graph.nodes):
        if node.target == torch.ops.aten.to.dtype and node.args[0].meta["val"].dtype == node.args[1]:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    program.graph_module.recompile()
    return program


def _insert_type_promotion(graph_module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    for module in graph_module.modules():
        promotion = type_promotion.InsertTypePromotion(module)
        promotion.interpreter = _PromoteFromMetadata(module, type_promotion.TypePromotionTable())
        promotion.run()
    return graph_module


@contextlib.contextmanager
def _lean_preparation() -> Iterator[None]:
    """torch.onnx.export prepares the captured program in two passes that each run the whole graph
    again: `run_decompositions` retraces it (8 of k3-tiny's 21 s), and the type promotion pass
    re-runs every node under fake tensors. Our graph needs no decomposition: every op the capture
    records has a translation, in torchlib or in TRANSLATION_TABLE (the model avoids the few that
    have none, such as `Tensor.T` and `torch.promote_types`), and an op without one fails the
    translation by name rather than giving a different graph. So that step only drops the casts
    that change nothing (`_drop_no_op_casts`), and type promotion reads the captured values
    (`_PromoteFromMetadata`). Both hooks are private (alike in torch 2.11 to 2.13); the tests pin
    that they are used and that exports still match the eager model."""
    decompose, promote = _fx_passes.decompose_with_registry, _fx_passes.insert_type_promotion_nodes
    _fx_passes.decompose_with_registry = lambda program, registry: _drop_no_op_casts(program)
    _fx_passes.insert_type_promotion_nodes = _insert_type_promotion
    try:
        yield
    finally:
        _fx_passes.decompose_with_registry, _fx_passes.insert_type_promotion_nodes = decompose, promote


@contextlib.contextmanager
def _lean_tracing() -> Iterator[None]:
    """torch.export's capture without two costs our graph gets nothing from: a Python stack trace
    captured and symbolized for every node (torch.fx.config.do_not_emit_stack_traces; the exporter
    only copies it into each node's metadata, where it named this checkout's absolute paths), and
    fake tensors' dispatch cache, whose hits with symbolic sizes cost more than the op they replace
    (torch._dynamo.config.fake_tensor_cache_enabled). k3-tiny's capture: 14.6 s -> 10.6 s of CPU,
    2026-12-03 (/tmp script timing torch.export.export alone, alternating, 2 runs each)."""
    stack_traces = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        with torch._dynamo.config.patch(fake_tensor_cache_enabled=False):
            yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = stack_traces


# torchlib's registry as torch.onnx.export makes it, kept to be restored after each export.
_FROM_TORCHLIB = _registration.ONNXRegistry.__dict__["from_torchlib"]


@functools.cache
def _torchlib_registry(opset_version: int) -> _registration.ONNXRegistry:
    return _FROM_TORCHLIB.__func__(_registration.ONNXRegistry, opset_version)


def _registry_copy(opset_version: int) -> _registration.ONNXRegistry:
    """A copy of torchlib's registry, made once per process: torch.onnx.export builds it from scratch
    for every export (1.07 of a one-layer rank export's 3.9 s, 2026-12-04) and then adds our
    translations to it, so each export gets lists of its own."""
    cached = _torchlib_registry(opset_version)
    registry = _registration.ONNXRegistry()
    registry._opset_version = cached.opset_version
    registry.functions = {target: list(functions) for target, functions in cached.functions.items()}
    return registry


@contextlib.contextmanager
def _cached_registry() -> Iterator[None]:
    """torch.onnx.export's `ONNXRegistry().from_torchlib(...)` answered from `_registry_copy`. A private
    hook, like `_lean_preparation`'s; tests/test_export.py pins that exports use it and stay identical."""
    _registration.ONNXRegistry.from_torchlib = staticmethod(_registry_copy)
    try:
        yield
    finally:
        _registration.ONNXRegistry.from_torchlib = _FROM_TORCHLIB


def fold_constants(model: ir.Model) -> None:
    """What the graph needs of an optimizer, and no more: constants folded (the axes and shapes
    TensorRT needs as constants), repeated subexpressions and unused nodes removed, constants as
    initializers. Initializers are not deduplicated: every weight keeps its checkpoint name, even
    where two hold the same numbers (norm weights of ones). onnxscript's full optimizer adds
    pattern rewrites that find little in this graph and took a third of the export (191,509
    match attempts for k3-tiny)."""
    onnxscript.optimizer.fold_constants(model, onnx_shape_inference=True)
    ir.passes.Sequential(
        common_passes.CommonSubexpressionEliminationPass(),  # before lifting: equal Constant nodes merge
        common_passes.RemoveUnusedNodesPass(),
        common_passes.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common_passes.RemoveUnusedFunctionsPass(),
        common_passes.RemoveUnusedOpsetsPass(),
        common_passes.OutputFixPass(),
        common_passes.NameFixPass(),
    )(model)


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
    with _quiet_exporter(), _lean_preparation(), _lean_tracing(), _cached_registry():
        program = torch.onnx.export(module, args, dynamo=True, custom_translation_table=TRANSLATION_TABLE,
                                    dynamic_shapes=dynamic_shapes, opset_version=opset_version,
                                    input_names=input_names, verbose=False,
                                    optimize=False)
    model = program.model
    if not with_weights:
        for name in list(model.graph.initializers):
            value = model.graph.initializers.pop(name)
            value.const_value = None
            model.graph.inputs.append(value)
    fold_constants(model)  # before the k3 functions are attached: their bodies stay as written
    # Named after fold_constants' OutputFixPass has given an output that is another's tensor (a tap
    # that is also the stage's boundary) an Identity of its own; naming first would merge them.
    for value, name in zip(model.graph.outputs, output_names or [], strict=bool(output_names)):
        value.name = name
    attach_functions_ir(model)
    type_partials(model)
    type_grouped_intermediates(model)
    if aot_plugins:
        request_aot_plugins(model)
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

