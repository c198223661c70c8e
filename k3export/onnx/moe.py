"""ONNX lowering of the routed experts: `k3.RoutedExperts` and `k3.RoutedExpertsMXFP4`, one node per
MoE layer, with their schemas, translations and model-local functions in standard ops.

The function bodies run only the experts that receive a token, each on its own tokens: a Loop over
the U used experts (found with ScatterElements + TopK, so the trip count is U, not E), each iteration
gathering the tokens that chose that expert (NonZero), gathering and casting (or dequantising, for the
packed form) that one expert's weights, running it as three Gemms on its tokens, and adding the
results, times the tokens' routing weights, into their rows of u (ScatterND, reduction add). So the
cost is tokens x k expert passes, in prefill as in decode, and the working set one expert's weights
and its tokens' [n_e, I] intermediate. The packed experts keep their checkpoint bytes in the file,
declared as int32 words (k3export/ops/mxfp4.py, "Words"; `packed_experts_as_words` rewrites the saved
file's headers); the function decodes the words to bytes with int64 arithmetic. u is float32, as in
eager; the experts run in float32.

These bodies are for ONNX Runtime and other ONNX consumers: TensorRT takes the k3plugins.moe plugin
(build refuses a graph whose k3 nodes have no registered plugin, rather than letting the parser
inline the function). They could not be inlined by TensorRT-RTX 1.7 anyway: it has no NonZero.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import torch
from onnx import TensorProto, helper
from onnx.defs import OpSchema
from onnxscript import opset18 as op
from onnxscript import values

from k3export.artifacts import write_atomic
from k3export.onnx.domain import AOT_ATTRIBUTE, DOMAIN, DOMAIN_VERSION, PLUGIN_ATTRIBUTES
from k3export.ops import mxfp4

_FLOATS = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]
_PROJECTIONS = ("w1", "w3", "w2")
# expert_offset (k3export/model/parallel.py): a node holds experts expert_offset .. of the model's,
# `experts` keeps the model's indices, and pairs routed elsewhere contribute nothing; 0 for an unsplit
# model. Version 1 with the field: full TensorRT's tensorrt.plugin registers every plugin as version
# "1", so no other version could be built there (exports of 2026-11/12 named "2", an alias that
# TensorRT-RTX's registration keeps).
PLUGIN_VERSION = "1"
OFFSET_ATTRIBUTE = "expert_offset"


def _schema(name: str, weights: list[tuple[str, str]], weight_types: list[str]) -> OpSchema:
    return OpSchema(
        name, DOMAIN, DOMAIN_VERSION,
        doc="Routed SiTU-GLU experts, only those chosen; see k3export/ops/moe.py",
        inputs=[OpSchema.FormalParameter(n, t) for n, t in
                [("z", "T"), ("experts", "tensor(int64)"), ("weights", "tensor(float)"), *weights]],
        outputs=[OpSchema.FormalParameter("u", "tensor(float)")],
        type_constraints=[("T", _FLOATS, ""), ("TW", weight_types, "")],
        attributes=[*(OpSchema.Attribute(a, OpSchema.AttrType.STRING, "TensorRT plugin lookup")
                      for a in PLUGIN_ATTRIBUTES),
                    OpSchema.Attribute(AOT_ATTRIBUTE, OpSchema.AttrType.INT, "1: TensorRT's AOT plugin form",
                                       required=False),
                    OpSchema.Attribute("situ_beta", OpSchema.AttrType.FLOAT, "SiTU gate clamp"),
                    OpSchema.Attribute("situ_linear_beta", OpSchema.AttrType.FLOAT, "SiTU linear clamp"),
                    OpSchema.Attribute(OFFSET_ATTRIBUTE, OpSchema.AttrType.INT,
                                       "model index of the first expert held (expert parallelism)",
                                       required=False)],
    )


ROUTED_EXPERTS_SCHEMA = _schema("RoutedExperts", [(w, "TW") for w in _PROJECTIONS], _FLOATS)
ROUTED_EXPERTS_MXFP4_SCHEMA = _schema(
    "RoutedExpertsMXFP4", [(f"{w}_{part}", "TW") for w in _PROJECTIONS for part in ("packed", "scale")],
    ["tensor(int32)"])  # words: k3export/ops/mxfp4.py


def _attributes(*extra: OpSchema.Attribute) -> list[OpSchema.Attribute]:
    return [*(OpSchema.Attribute(a, OpSchema.AttrType.STRING, "TensorRT plugin lookup")
              for a in PLUGIN_ATTRIBUTES),
            OpSchema.Attribute(AOT_ATTRIBUTE, OpSchema.AttrType.INT, "1: TensorRT's AOT plugin form",
                               required=False),
            *extra]


_BETAS = (OpSchema.Attribute("situ_beta", OpSchema.AttrType.FLOAT, "SiTU gate clamp"),
          OpSchema.Attribute("situ_linear_beta", OpSchema.AttrType.FLOAT, "SiTU linear clamp"))
_INT32 = "tensor(int32)"


def _grouped_schema(name: str, doc: str, inputs: list[tuple[str, str]], outputs: list[tuple[str, str]],
                    attributes: list[OpSchema.Attribute], weight_types: list[str] | None = None) -> OpSchema:
    constraints = [("T", _FLOATS, "")] + ([("TW", weight_types, "")] if weight_types else [])
    return OpSchema(name, DOMAIN, DOMAIN_VERSION, doc=doc + "; see k3export/ops/moe.py",
                    inputs=[OpSchema.FormalParameter(n, t) for n, t in inputs],
                    outputs=[OpSchema.FormalParameter(n, t) for n, t in outputs],
                    type_constraints=constraints, attributes=_attributes(*attributes))


def _weight_inputs(projections: tuple[str, ...], packed: bool) -> list[tuple[str, str]]:
    return [(f"{w}_{part}", "TW") for w in projections for part in ("packed", "scale")] if packed else \
        [(w, "TW") for w in projections]


# The routed experts as exports since 2026-12 hold them: grouped by expert in three plugin nodes (one launch
# each, no workspace: full TensorRT's AOT plugins), their intermediates graph tensors, then each token's
# slots summed in standard ops. (RoutedExperts / RoutedExpertsMXFP4 are the one-node form of earlier exports.)
ROUTED_EXPERTS_GROUP_SCHEMA = OpSchema(
    "RoutedExpertsGroup", DOMAIN, DOMAIN_VERSION,
    doc="The (token, slot) pairs grouped by local expert, stable: sorted_pairs [N k], offsets [E + 1], "
        "slots [N, k], int32; see k3export/ops/moe.py",
    inputs=[OpSchema.FormalParameter("experts", "tensor(int64)")],
    outputs=[OpSchema.FormalParameter(n, _INT32) for n in ("sorted_pairs", "offsets", "slots")],
    attributes=_attributes(OpSchema.Attribute("num_experts", OpSchema.AttrType.INT, "experts held (E)"),
                           OpSchema.Attribute(OFFSET_ATTRIBUTE, OpSchema.AttrType.INT,
                                              "model index of the first expert held (expert parallelism)")),
)


def _gate_up_schema(packed: bool) -> OpSchema:
    return _grouped_schema(
        "RoutedExpertsGateUpMXFP4" if packed else "RoutedExpertsGateUp",
        "h [N k, I] in z's dtype: SiTU-GLU of the gate and up products of each slot's expert and token",
        [("z", "T"), ("sorted_pairs", _INT32), ("offsets", _INT32), *_weight_inputs(("w1", "w3"), packed)],
        [("h", "T")], list(_BETAS), ["tensor(int32)"] if packed else _FLOATS)


def _down_schema(packed: bool) -> OpSchema:
    return _grouped_schema(
        "RoutedExpertsDownMXFP4" if packed else "RoutedExpertsDown",
        "y [N k, L] float32: the down product of each slot's expert and h",
        [("h", "T"), ("offsets", _INT32), *_weight_inputs(("w2",), packed)], [("y", "tensor(float)")], [],
        ["tensor(int32)"] if packed else _FLOATS)


ROUTED_EXPERTS_GATE_UP_SCHEMA, ROUTED_EXPERTS_GATE_UP_MXFP4_SCHEMA = (_gate_up_schema(p)
                                                                      for p in (False, True))
ROUTED_EXPERTS_DOWN_SCHEMA, ROUTED_EXPERTS_DOWN_MXFP4_SCHEMA = (_down_schema(p) for p in (False, True))
GROUPED_SCHEMAS = (ROUTED_EXPERTS_GROUP_SCHEMA, ROUTED_EXPERTS_GATE_UP_SCHEMA,
                   ROUTED_EXPERTS_GATE_UP_MXFP4_SCHEMA, ROUTED_EXPERTS_DOWN_SCHEMA,
                   ROUTED_EXPERTS_DOWN_MXFP4_SCHEMA)

_K3 = values.Opset(DOMAIN, DOMAIN_VERSION)
_GROUPED = {schema.name: values.Op(_K3, schema.name, schema) for schema in GROUPED_SCHEMAS}


def moe_translation_table(plugin_namespace: str) -> dict[Callable, Callable]:
    """The entries of onnx/ops.py's TRANSLATION_TABLE for the two routed-experts ops. Every node
    carries expert_offset (0 for an unsplit model), the field the plugin declares:
    TensorRT's parser warns at each node that lacks one."""
    plugin = {"plugin_namespace": plugin_namespace, "plugin_version": PLUGIN_VERSION}

    def grouped(z, experts, weights, gate_up_weights, down_weights, suffix: str, situ_beta: float,
                situ_linear_beta: float, expert_offset: int):
        sorted_pairs, offsets, slots = _GROUPED["RoutedExpertsGroup"](
            experts, num_experts=down_weights[0].shape[0], expert_offset=expert_offset, **plugin)
        h = _GROUPED["RoutedExpertsGateUp" + suffix](z, sorted_pairs, offsets, *gate_up_weights,
                                                    situ_beta=situ_beta, situ_linear_beta=situ_linear_beta,
                                                    **plugin)
        y = _GROUPED["RoutedExpertsDown" + suffix](h, offsets, *down_weights, **plugin)
        # u[n] = sum_j weights[n, j] y[slots[n, j]], a slot -1 (held elsewhere) adding nothing: a Where, not a
        # product, as the row it gathers instead may be one no launch wrote (an engine's memory: NaN * 0).
        slots = op.Cast(slots, to=TensorProto.INT64)
        zero = op.Constant(value_int=0)
        last = op.Constant(value_ints=[-1])
        held = op.Unsqueeze(op.GreaterOrEqual(slots, zero), last)
        rows = op.Where(held, op.Gather(y, op.Max(slots, zero), axis=0), op.Constant(value_float=0.0))
        weighted = op.Mul(rows, op.Unsqueeze(op.Cast(weights, to=TensorProto.FLOAT), last))  # [N, k, L]
        return op.ReduceSum(weighted, op.Constant(value_ints=[1]), keepdims=0)

    # Annotated so that the exporter passes the betas and the offset as attributes, not as tensors.
    def routed_experts(z, experts, weights, w1, w3, w2, situ_beta: float, situ_linear_beta: float,
                       expert_offset: int = 0):
        return grouped(z, experts, weights, (w1, w3), (w2,), "", situ_beta, situ_linear_beta, expert_offset)

    def routed_experts_mxfp4(z, experts, weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed,
                             w2_scale, situ_beta: float, situ_linear_beta: float, expert_offset: int = 0):
        return grouped(z, experts, weights, (w1_packed, w1_scale, w3_packed, w3_scale), (w2_packed, w2_scale),
                       "MXFP4", situ_beta, situ_linear_beta, expert_offset)

    return {torch.ops.k3.routed_experts.default: routed_experts,
            torch.ops.k3.routed_experts_mxfp4.default: routed_experts_mxfp4}


def type_grouped_intermediates(model: ir.Model) -> None:
    """The grouped nodes' outputs have no torch value behind them, so the exporter leaves them untyped:
    declared as their schemas say (the grouping int32, h in z's dtype, y float32), as every other tensor
    is."""
    for node in model.graph:
        if node.domain != DOMAIN:
            continue
        if node.op_type == "RoutedExpertsGroup":
            for value in node.outputs:
                value.dtype = ir.DataType.INT32
        elif node.op_type.startswith("RoutedExpertsGateUp"):
            node.outputs[0].dtype = node.inputs[0].dtype
        elif node.op_type.startswith("RoutedExpertsDown"):
            node.outputs[0].dtype = ir.DataType.FLOAT

def _ints(name: str, value: list[int]) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value_ints=value)


def _int64(name: str, value: int) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value_int=value)


def _attribute_int(name: str, attribute: str) -> onnx.NodeProto:
    """A scalar int64 Constant holding the calling node's `attribute` (its default when absent)."""
    node = helper.make_node("Constant", [], [name])
    node.attribute.append(onnx.AttributeProto(name="value_int", type=onnx.AttributeProto.INT,
                                              ref_attr_name=attribute))
    return node


def _attribute_float(name: str, attribute: str) -> onnx.NodeProto:
    """A scalar float Constant holding the calling node's `attribute`."""
    node = helper.make_node("Constant", [], [name])
    node.attribute.append(onnx.AttributeProto(name="value_float", type=onnx.AttributeProto.FLOAT,
                                              ref_attr_name=attribute))
    return node


def _word_bytes(words: str, out: str) -> list[onnx.NodeProto]:
    """int32 words [n] -> their bytes [n, 4] (int64, little-endian: byte j = (word >> 8j) & 255), by
    int64 arithmetic (BitShift takes unsigned types only)."""
    return [
        helper.make_node("Cast", [words], [f"{out}_i64"], to=TensorProto.INT64),
        helper.make_node("BitwiseAnd", [f"{out}_i64", "word_mask"], [f"{out}_u32"]),  # as unsigned
        helper.make_node("Unsqueeze", [f"{out}_u32", "last_axis"], [f"{out}_col"]),
        helper.make_node("Div", [f"{out}_col", "byte_steps"], [f"{out}_shifted"]),  # [n, 4]
        helper.make_node("BitwiseAnd", [f"{out}_shifted", "byte_mask"], [out]),
    ]


def _dequantize(w: str) -> list[onnx.NodeProto]:
    """Expert e's `{w}_packed` / `{w}_scale` words -> float32 `{w}_e` [O, I], as k3export.ops.mxfp4
    decodes: the expert's bytes in order, each looking up its two values (low nibble first) in a
    [256, 2] table, each group of 32 values (in the flat expert) times its scale 2^(s - 127) from a
    [256] table; then [I, L] rows for w1 / w3 and [L, I] for w2 (L is z's width)."""
    matrix = "down_shape" if w == "w2" else "up_shape"
    return [
        helper.make_node("Gather", [f"{w}_packed", "e"], [f"{w}_packed_e"], axis=0),
        helper.make_node("Gather", [f"{w}_scale", "e"], [f"{w}_scale_e"], axis=0),
        *_word_bytes(f"{w}_packed_e", f"{w}_bytes"),
        helper.make_node("Gather", ["byte_values", f"{w}_bytes"], [f"{w}_pairs"], axis=0),  # [n, 4, 2]
        helper.make_node("Reshape", [f"{w}_pairs", "groups_shape"], [f"{w}_groups"]),  # [O*I/32, 32]
        *_word_bytes(f"{w}_scale_e", f"{w}_scale_bytes"),
        helper.make_node("Reshape", [f"{w}_scale_bytes", "flat_shape"], [f"{w}_scale_index"]),
        helper.make_node("Gather", ["scale_values", f"{w}_scale_index"], [f"{w}_factor"], axis=0),
        helper.make_node("Unsqueeze", [f"{w}_factor", "last_axis"], [f"{w}_factor_col"]),
        helper.make_node("Mul", [f"{w}_groups", f"{w}_factor_col"], [f"{w}_scaled"]),
        helper.make_node("Reshape", [f"{w}_scaled", matrix], [f"{w}_e"]),
    ]


def _mxfp4_tables() -> list[onnx.NodeProto]:
    byte = torch.arange(256)
    codes = torch.stack([byte % 16, byte // 16], dim=-1)
    magnitude = mxfp4.E2M1_TABLE[codes % 8]
    pairs = torch.where(codes >= 8, -magnitude, magnitude)

    def int64(name: str, value: list[int]) -> onnx.NodeProto:
        return helper.make_node("Constant", [], [name],
                                value=helper.make_tensor(name, TensorProto.INT64, [len(value)], value))

    return [
        helper.make_node("Constant", [], ["byte_values"],
                         value=helper.make_tensor("byte_values", TensorProto.FLOAT, [256, 2],
                                                  pairs.flatten().tolist())),
        helper.make_node("Constant", [], ["scale_values"],
                         value=helper.make_tensor("scale_values", TensorProto.FLOAT, [256],
                                                  mxfp4.SCALE_VALUES.tolist())),
        int64("word_mask", [0xFFFFFFFF]),
        int64("byte_steps", [1, 1 << 8, 1 << 16, 1 << 24]),
        int64("byte_mask", [255]),
        _ints("groups_shape", [-1, mxfp4.GROUP]),
        _ints("last_axis", [-1]),
        _ints("minus_one", [-1]),
    ]


def _matrix_shapes(width_of: str, axis: int) -> list[onnx.NodeProto]:
    """`up_shape` [-1, L] (w1 / w3 [I, L]) and `down_shape` (w2 [L, I]) from a width read off `width_of`'s
    dimension `axis`: L (z's width) or, where only h is given, I (down_shape [-1, I])."""
    return [
        helper.make_node("Shape", [width_of], ["width"], start=axis, end=axis + 1),
        helper.make_node("Concat", ["minus_one", "width"], ["up_shape"], axis=0),
        helper.make_node("Concat", ["width", "minus_one"] if width_of == "z" else ["minus_one", "width"],
                         ["down_shape"], axis=0),
    ]


def _gate_up(out: str) -> list[onnx.NodeProto]:
    """`out` = SiTU-GLU(z_e w1_e^T, z_e w3_e^T): [beta tanh(a / beta) sigmoid(a)] * [linear_beta
    tanh(b / linear_beta)], the betas `beta` and `linear_beta`."""
    return [
        helper.make_node("Gemm", ["z_e", "w1_e"], ["a"], transB=1),
        helper.make_node("Gemm", ["z_e", "w3_e"], ["b"], transB=1),
        helper.make_node("Div", ["a", "beta"], ["a_scaled"]),
        helper.make_node("Tanh", ["a_scaled"], ["a_tanh"]),
        helper.make_node("Mul", ["a_tanh", "beta"], ["a_clamped"]),
        helper.make_node("Sigmoid", ["a"], ["a_sigmoid"]),
        helper.make_node("Mul", ["a_clamped", "a_sigmoid"], ["gate"]),
        helper.make_node("Div", ["b", "linear_beta"], ["b_scaled"]),
        helper.make_node("Tanh", ["b_scaled"], ["b_tanh"]),
        helper.make_node("Mul", ["b_tanh", "linear_beta"], ["b_clamped"]),
        helper.make_node("Mul", ["gate", "b_clamped"], [out]),
    ]


def _expert_body(packed: bool) -> onnx.GraphProto:
    """One Loop iteration: expert e = used[i] on the tokens that chose it (gathered by NonZero),
    weighted by their routing weight for e and added into their rows of u (ScatterND)."""
    nodes = [
        helper.make_node("Gather", ["used", "i"], ["e"], axis=0),
        # Each token's routing weight for e [N, 1] (0 for tokens that did not choose it; summed should a
        # token choose e twice).
        helper.make_node("Equal", ["local_experts", "e"], ["chosen"]),
        helper.make_node("Cast", ["chosen"], ["chosen_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["weights_f", "chosen_f"], ["chosen_weights"]),
        helper.make_node("ReduceSum", ["chosen_weights", "one_axis"], ["token_weights"], keepdims=1),
        # e's tokens, the rows that chose it: [n_e] for Gather, [n_e, 1] for ScatterND.
        helper.make_node("ReduceMax", ["chosen_f", "one_axis"], ["picked_f"], keepdims=0),
        helper.make_node("Cast", ["picked_f"], ["picked"], to=TensorProto.BOOL),
        helper.make_node("NonZero", ["picked"], ["rows_2d"]),  # [1, n_e]
        helper.make_node("Squeeze", ["rows_2d", "zero_axis"], ["rows"]),
        helper.make_node("Transpose", ["rows_2d"], ["row_indices"], perm=[1, 0]),
        helper.make_node("Gather", ["z_f", "rows"], ["z_e"], axis=0),
        helper.make_node("Gather", ["token_weights", "rows"], ["weights_e"], axis=0),
        *_weights_of_e(_PROJECTIONS, packed),
        *_gate_up("h"),
        helper.make_node("Gemm", ["h", "w2_e"], ["y"], transB=1),
        helper.make_node("Mul", ["y", "weights_e"], ["weighted"]),
        helper.make_node("ScatterND", ["u_in", "row_indices", "weighted"], ["u_out"], reduction="add"),
        helper.make_node("Identity", ["cond_in"], ["cond_out"]),
    ]
    return helper.make_graph(
        nodes, "routed_expert",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("u_in", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("u_out", TensorProto.FLOAT, None)])


def _function(packed: bool, opset_version: int) -> onnx.FunctionProto:
    weights = ([f"{w}_{part}" for w in _PROJECTIONS for part in ("packed", "scale")] if packed
               else list(_PROJECTIONS))
    nodes = [
        *(_mxfp4_tables() + _matrix_shapes("z", 1) if packed else []),
        helper.make_node("Cast", ["z"], ["z_f"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["weights"], ["weights_f"], to=TensorProto.FLOAT),
        _attribute_float("beta", "situ_beta"),
        _attribute_float("linear_beta", "situ_linear_beta"),
        _ints("zero_axis", [0]),
        _ints("one_axis", [1]),
        _ints("flat_shape", [-1]),
        _int64("zero_index", 0),
        _int64("one_index", 1),
        # The held experts' local indices (experts - expert_offset); pairs routed to experts held
        # elsewhere (expert parallelism) get E, a spill slot past the E held, which no expert matches.
        _attribute_int("expert_offset", OFFSET_ATTRIBUTE),
        helper.make_node("Shape", [weights[0]], ["num_experts"], start=0, end=1),
        helper.make_node("Sub", ["experts", "expert_offset"], ["shifted"]),
        helper.make_node("Less", ["shifted", "num_experts"], ["below_end"]),
        helper.make_node("GreaterOrEqual", ["shifted", "zero_index"], ["from_start"]),
        helper.make_node("And", ["below_end", "from_start"], ["held"]),
        helper.make_node("Where", ["held", "shifted", "num_experts"], ["local_experts"]),
        # The used experts: a [E + 1] presence vector (ScatterElements of ones; duplicates write the
        # same value), its first E entries, then the indices of their U ones (TopK with K = U).
        helper.make_node("Reshape", ["local_experts", "flat_shape"], ["flat_experts"]),
        helper.make_node("Add", ["num_experts", "one_index"], ["num_slots_held"]),
        helper.make_node("ConstantOfShape", ["num_slots_held"], ["absent"],
                         value=helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0])),
        helper.make_node("Shape", ["flat_experts"], ["num_slots"]),
        helper.make_node("ConstantOfShape", ["num_slots"], ["ones"],
                         value=helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])),
        helper.make_node("ScatterElements", ["absent", "flat_experts", "ones"], ["present_or_spilled"],
                         axis=0),
        helper.make_node("Slice", ["present_or_spilled", "zero_axis", "num_experts"], ["present"]),
        helper.make_node("ReduceSum", ["present"], ["num_used_f"], keepdims=1),
        helper.make_node("Cast", ["num_used_f"], ["num_used_1d"], to=TensorProto.INT64),
        helper.make_node("TopK", ["present", "num_used_1d"], ["used_values", "used"], axis=0),
        helper.make_node("Squeeze", ["num_used_1d"], ["num_used"]),
        helper.make_node("Constant", [], ["true"],
                         value=helper.make_tensor("true", TensorProto.BOOL, [], [True])),
        helper.make_node("Shape", ["z"], ["u_shape"]),
        helper.make_node("ConstantOfShape", ["u_shape"], ["u_zero"],
                         value=helper.make_tensor("zero_f", TensorProto.FLOAT, [1], [0.0])),
        helper.make_node("Loop", ["num_used", "true", "u_zero"], ["u"], body=_expert_body(packed)),
    ]
    name = "RoutedExpertsMXFP4" if packed else "RoutedExperts"
    return helper.make_function(
        DOMAIN, name, ["z", "experts", "weights", *weights], ["u"], nodes,
        [helper.make_opsetid("", opset_version)],
        attributes=[*PLUGIN_ATTRIBUTES, AOT_ATTRIBUTE, "situ_beta", "situ_linear_beta"],
        attribute_protos=[helper.make_attribute(OFFSET_ATTRIBUTE, 0)])


def routed_experts_function(opset_version: int) -> onnx.FunctionProto:
    """`k3.RoutedExperts(z, experts, weights, w1, w3, w2) -> u` (attributes situ_beta, situ_linear_beta,
    optional expert_offset)."""
    return _function(False, opset_version)


def routed_experts_mxfp4_function(opset_version: int) -> onnx.FunctionProto:
    """`k3.RoutedExpertsMXFP4(z, experts, weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed,
    w2_scale) -> u`: the same, dequantising only the experts used."""
    return _function(True, opset_version)


def _weights_of_e(projections: tuple[str, ...], packed: bool) -> list[onnx.NodeProto]:
    """Expert e's weights `{w}_e`, float32 ([O, K] each), for the projections named."""
    if packed:
        return [n for w in projections for n in _dequantize(w)]
    return [node for w in projections for node in (
        helper.make_node("Gather", [w, "e"], [f"{w}_gathered"], axis=0),
        helper.make_node("Cast", [f"{w}_gathered"], [f"{w}_e"], to=TensorProto.FLOAT))]


def _used_experts_loop(body_nodes: list[onnx.NodeProto], result: str) -> list[onnx.NodeProto]:
    """A Loop over the experts with pairs (from offsets: U trips, not E) writing `result`, float32, from
    `{result}_zero`: each iteration's `body_nodes` make `rows_e` [n_e, width] for expert e's slots
    `slot_indices` ([n_e, 1]; its slots `first`..`end`), added by ScatterND."""
    body = [
        helper.make_node("Gather", ["used", "i"], ["e"], axis=0),
        helper.make_node("Gather", ["offsets_64", "e"], ["first"], axis=0),
        helper.make_node("Add", ["e", "one_index"], ["next_e"]),
        helper.make_node("Gather", ["offsets_64", "next_e"], ["end"], axis=0),
        helper.make_node("Range", ["first", "end", "one_index"], ["slot_range"]),
        helper.make_node("Unsqueeze", ["slot_range", "one_axis"], ["slot_indices"]),
        *body_nodes,
        helper.make_node("ScatterND", ["acc_in", "slot_indices", "rows_e"], ["acc_out"]),
        helper.make_node("Identity", ["cond_in"], ["cond_out"]),
    ]
    graph = helper.make_graph(
        body, "routed_expert_slots",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc_in", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc_out", TensorProto.FLOAT, None)])
    return [
        _ints("zero_axis", [0]),
        _ints("one_axis", [1]),
        _ints("flat_shape", [-1]),
        _int64("one_index", 1),
        _ints("from_one", [1]),
        _ints("to_end", [2**62]),
        _ints("to_last", [-1]),
        helper.make_node("Cast", ["offsets"], ["offsets_64"], to=TensorProto.INT64),
        # The experts with pairs: offsets[e + 1] > offsets[e].
        helper.make_node("Slice", ["offsets_64", "from_one", "to_end"], ["ends"]),
        helper.make_node("Slice", ["offsets_64", "zero_axis", "to_last"], ["starts"]),
        helper.make_node("Greater", ["ends", "starts"], ["has_pairs"]),
        helper.make_node("NonZero", ["has_pairs"], ["used_2d"]),
        helper.make_node("Squeeze", ["used_2d", "zero_axis"], ["used"]),
        helper.make_node("Shape", ["used"], ["num_used_1d"]),
        helper.make_node("Squeeze", ["num_used_1d"], ["num_used"]),
        helper.make_node("Constant", [], ["true"],
                         value=helper.make_tensor("true", TensorProto.BOOL, [], [True])),
        helper.make_node("Loop", ["num_used", "true", f"{result}_zero"], [result], body=graph),
    ]


def _zeros(name: str, shape: str) -> onnx.NodeProto:
    return helper.make_node("ConstantOfShape", [shape], [name],
                            value=helper.make_tensor("zero_f", TensorProto.FLOAT, [1], [0.0]))


def routed_experts_group_function(opset_version: int) -> onnx.FunctionProto:
    """`k3.RoutedExpertsGroup(experts) -> (sorted_pairs, offsets, slots)`, attributes num_experts (E) and
    expert_offset: each pair's key, its local expert or E where held elsewhere; the pairs in key order by a
    TopK over the whole axis (smallest first; ONNX breaks ties to the lower index, so the order is stable);
    offsets[g] the count of keys below g for g = 0 .. E; a pair's slot its place in that order, -1 where
    held elsewhere. (A plugin in full TensorRT, whose TopK takes k <= 3840: N k is 8,192 at 512 tokens.)"""
    nodes = [
        _ints("flat_shape", [-1]),
        _ints("one_axis", [1]),
        _int64("zero_index", 0),
        _int64("one_index", 1),
        _int64("minus_one", -1),
        _attribute_int("num_experts", "num_experts"),
        _attribute_int("expert_offset", OFFSET_ATTRIBUTE),
        helper.make_node("Reshape", ["experts", "flat_shape"], ["flat_experts"]),
        helper.make_node("Sub", ["flat_experts", "expert_offset"], ["local"]),
        helper.make_node("GreaterOrEqual", ["local", "zero_index"], ["from_start"]),
        helper.make_node("Less", ["local", "num_experts"], ["below_end"]),
        helper.make_node("And", ["from_start", "below_end"], ["held"]),
        helper.make_node("Where", ["held", "local", "num_experts"], ["key"]),
        helper.make_node("Shape", ["key"], ["num_pairs_1d"]),
        helper.make_node("TopK", ["key", "num_pairs_1d"], ["sorted_keys", "order"], axis=0, largest=0,
                         sorted=1),
        helper.make_node("Cast", ["order"], ["sorted_pairs"], to=TensorProto.INT32),
        helper.make_node("Add", ["num_experts", "one_index"], ["num_groups"]),
        helper.make_node("Range", ["zero_index", "num_groups", "one_index"], ["groups"]),
        helper.make_node("Unsqueeze", ["groups", "one_axis"], ["group_column"]),
        helper.make_node("Less", ["key", "group_column"], ["below"]),  # [E + 1, N k]
        helper.make_node("Cast", ["below"], ["below_i"], to=TensorProto.INT32),
        helper.make_node("ReduceSum", ["below_i", "one_axis"], ["offsets"], keepdims=0),
        helper.make_node("Squeeze", ["num_pairs_1d"], ["num_pairs"]),
        helper.make_node("Range", ["zero_index", "num_pairs", "one_index"], ["positions"]),
        helper.make_node("ScatterElements", ["positions", "order", "positions"], ["position_of_pair"],
                         axis=0),
        helper.make_node("Where", ["held", "position_of_pair", "minus_one"], ["flat_slots"]),
        helper.make_node("Shape", ["experts"], ["experts_shape"]),
        helper.make_node("Reshape", ["flat_slots", "experts_shape"], ["slots_64"]),
        helper.make_node("Cast", ["slots_64"], ["slots"], to=TensorProto.INT32),
    ]
    return helper.make_function(
        DOMAIN, "RoutedExpertsGroup", ["experts"], ["sorted_pairs", "offsets", "slots"], nodes,
        [helper.make_opsetid("", opset_version)],
        attributes=[*PLUGIN_ATTRIBUTES, AOT_ATTRIBUTE, "num_experts"],
        attribute_protos=[helper.make_attribute(OFFSET_ATTRIBUTE, 0)])


def _gate_up_function(packed: bool, opset_version: int) -> onnx.FunctionProto:
    weights = ([f"{w}_{part}" for w in ("w1", "w3") for part in ("packed", "scale")] if packed
               else ["w1", "w3"])
    body = [
        helper.make_node("Slice", ["tokens", "first_1d", "end_1d"], ["tokens_e"]),
        helper.make_node("Gather", ["z_f", "tokens_e"], ["z_e"], axis=0),
        *_weights_of_e(("w1", "w3"), packed),
        *_gate_up("rows_e"),
    ]
    # The slice bounds as 1-d tensors (Slice's starts / ends).
    body = [helper.make_node("Unsqueeze", ["first", "zero_axis"], ["first_1d"]),
            helper.make_node("Unsqueeze", ["end", "zero_axis"], ["end_1d"]), *body]
    nodes = [
        *(_mxfp4_tables() + _matrix_shapes("z", 1) if packed else []),
        helper.make_node("Cast", ["z"], ["z_f"], to=TensorProto.FLOAT),
        _attribute_float("beta", "situ_beta"),
        _attribute_float("linear_beta", "situ_linear_beta"),
        # Each slot's token: its pair // k, k = N k / N.
        helper.make_node("Shape", ["sorted_pairs"], ["num_pairs"]),
        helper.make_node("Shape", ["z"], ["num_tokens"], start=0, end=1),
        helper.make_node("Max", ["num_tokens", "one_1d"], ["tokens_or_one"]),
        helper.make_node("Div", ["num_pairs", "tokens_or_one"], ["top_k"]),
        helper.make_node("Cast", ["sorted_pairs"], ["pairs_64"], to=TensorProto.INT64),
        helper.make_node("Div", ["pairs_64", "top_k"], ["tokens"]),
        # h [N k, I], float32 until the cast to z's dtype; I from w1's rows (or its words: I = 8 words / L).
        helper.make_node("Shape", [weights[0]], ["w1_width"], start=1, end=2),
        helper.make_node("Shape", ["z"], ["hidden"], start=1, end=2),
        *([helper.make_node("Mul", ["w1_width", "eight"], ["w1_values"]),
           helper.make_node("Div", ["w1_values", "hidden"], ["intermediate"])] if packed else
          [helper.make_node("Shape", [weights[0]], ["intermediate"], start=1, end=2)]),
        helper.make_node("Concat", ["num_pairs", "intermediate"], ["h_shape"], axis=0),
        _zeros("h_f_zero", "h_shape"),
        *_used_experts_loop(body, "h_f"),
        helper.make_node("CastLike", ["h_f", "z"], ["h"]),
    ]
    nodes = [_ints("one_1d", [1]), _ints("eight", [8]), *nodes]
    name = "RoutedExpertsGateUpMXFP4" if packed else "RoutedExpertsGateUp"
    return helper.make_function(
        DOMAIN, name, ["z", "sorted_pairs", "offsets", *weights], ["h"], nodes,
        [helper.make_opsetid("", opset_version)],
        attributes=[*PLUGIN_ATTRIBUTES, AOT_ATTRIBUTE, "situ_beta", "situ_linear_beta"])


def _down_function(packed: bool, opset_version: int) -> onnx.FunctionProto:
    weights = ["w2_packed", "w2_scale"] if packed else ["w2"]
    body = [
        helper.make_node("Unsqueeze", ["first", "zero_axis"], ["first_1d"]),
        helper.make_node("Unsqueeze", ["end", "zero_axis"], ["end_1d"]),
        helper.make_node("Slice", ["h_f", "first_1d", "end_1d"], ["h_e"]),
        *_weights_of_e(("w2",), packed),
        helper.make_node("Gemm", ["h_e", "w2_e"], ["rows_e"], transB=1),
    ]
    nodes = [
        _ints("eight", [8]),
        *(_mxfp4_tables() + _matrix_shapes("h", 1) if packed else []),
        helper.make_node("Cast", ["h"], ["h_f"], to=TensorProto.FLOAT),
        # y [N k, L]; L from w2's rows (or its words: L = 8 words / I).
        helper.make_node("Shape", ["h"], ["num_pairs"], start=0, end=1),
        *([helper.make_node("Shape", ["w2_packed"], ["w2_width"], start=1, end=2),
           helper.make_node("Shape", ["h"], ["h_width"], start=1, end=2),
           helper.make_node("Mul", ["w2_width", "eight"], ["w2_values"]),
           helper.make_node("Div", ["w2_values", "h_width"], ["hidden"])] if packed else
          [helper.make_node("Shape", ["w2"], ["hidden"], start=1, end=2)]),
        helper.make_node("Concat", ["num_pairs", "hidden"], ["y_shape"], axis=0),
        _zeros("y_zero", "y_shape"),
        *_used_experts_loop(body, "y"),
    ]
    name = "RoutedExpertsDownMXFP4" if packed else "RoutedExpertsDown"
    return helper.make_function(
        DOMAIN, name, ["h", "offsets", *weights], ["y"], nodes, [helper.make_opsetid("", opset_version)],
        attributes=[*PLUGIN_ATTRIBUTES, AOT_ATTRIBUTE])


# The nodes holding packed experts, and the index of their first packed input (the rest follow).
PACKED_INPUTS = {"RoutedExpertsMXFP4": 3, "RoutedExpertsGateUpMXFP4": 3, "RoutedExpertsDownMXFP4": 2}


def packed_experts_as_words(path: str | Path) -> list[str]:
    """Declares the six expert tensors of every k3.RoutedExpertsMXFP4 node in the saved ONNX file
    `path` as int32 words (k3export/ops/mxfp4.py, "Words"): uint8 [E, O, n] initializers (or, from an
    export without weights, graph inputs) become int32 [E, O*n/4]. Only the headers in `path` change:
    external data keeps its bytes, offsets and lengths, inline raw data its bytes. Returns the names
    rewritten; tensors already int32 are left as they are."""
    path = Path(path)
    model = onnx.load(path, load_external_data=False)
    graph = model.graph
    names = {name for node in graph.node if node.domain == DOMAIN and node.op_type in PACKED_INPUTS
             for name in node.input[PACKED_INPUTS[node.op_type]:]}
    initializers = {t.name: t for t in graph.initializer}
    typed = {v.name: v for v in (*graph.input, *graph.value_info)}
    rewritten = []

    def words_dims(name: str, dims: list[int]) -> list[int]:
        if len(dims) != 3 or any(not isinstance(d, int) or d <= 0 for d in dims) or (dims[1] * dims[2]) % 4:
            raise ValueError(f"{path}: {name} is uint8 {dims}; expected [E, O, n] with O*n a multiple of 4")
        return [dims[0], dims[1] * dims[2] // 4]

    for name in sorted(names):
        tensor = initializers.get(name)
        if tensor is not None and tensor.data_type == TensorProto.UINT8:
            dims = words_dims(name, list(tensor.dims))
            if tensor.int32_data:  # uint8 values held one per int32 field entry: as raw bytes
                tensor.raw_data = np.asarray(tensor.int32_data, dtype=np.uint8).tobytes()
                del tensor.int32_data[:]
            tensor.data_type = TensorProto.INT32
            del tensor.dims[:]
            tensor.dims.extend(dims)
            rewritten.append(name)
        value = typed.get(name)
        if value is not None and value.type.tensor_type.elem_type == TensorProto.UINT8:
            shape = value.type.tensor_type.shape
            dims = words_dims(name, [d.dim_value if d.HasField("dim_value") else None for d in shape.dim])
            value.type.tensor_type.elem_type = TensorProto.INT32
            del shape.dim[:]
            for d in dims:
                shape.dim.add().dim_value = d
            if name not in rewritten:
                rewritten.append(name)
    if rewritten:
        write_atomic(path, model.SerializeToString())
    return rewritten


MOE_FUNCTIONS = {
    "RoutedExperts": routed_experts_function, "RoutedExpertsMXFP4": routed_experts_mxfp4_function,
    "RoutedExpertsGroup": routed_experts_group_function,
    "RoutedExpertsGateUp": functools.partial(_gate_up_function, False),
    "RoutedExpertsGateUpMXFP4": functools.partial(_gate_up_function, True),
    "RoutedExpertsDown": functools.partial(_down_function, False),
    "RoutedExpertsDownMXFP4": functools.partial(_down_function, True)}
