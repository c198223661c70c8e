"""ONNX lowering of the routed experts: `k3.RoutedExperts` and `k3.RoutedExpertsMXFP4`, one node per
MoE layer, with their schemas, translations and model-local functions in standard ops.

The function bodies run only the experts that receive a token: a Loop over the U used experts (found
with ScatterElements + TopK, so the trip count is U, not E), each iteration gathering and casting (or
dequantising, for the packed form) that one expert's weights and running it as three Gemms on the
tokens, weighted by their routing weight for it (zero for tokens that did not choose it). Weights are
read, and dequantised, only for the experts used, and the working set is one expert's weights and a
[tokens, I] intermediate, not [E, tokens, I]: decode costs what its k experts cost, prefill
tokens x U experts (at most the dense form's tokens x E). The packed experts stay uint8 in the file.
u is float32, as in eager; the experts run in float32.

Why not gather each expert's tokens: that needs shapes that depend on the data inside the Loop, and
TensorRT-RTX 1.7 has no NonZero and fails to build a Loop holding such shapes (a TopK-gathered body
parses, then the builder stops with an internal error in makeScopeNodesContiguous). This body parses
and builds; the grouped form belongs in a RoutedExperts plugin, which the parser takes over this
function when registered.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx
import torch
from onnx import TensorProto, helper
from onnx.defs import OpSchema
from onnxscript import values

from k3export import mxfp4
from k3export.onnx.functions import AOT_ATTRIBUTE, DOMAIN, DOMAIN_VERSION, PLUGIN_ATTRIBUTES

_FLOATS = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]
_PROJECTIONS = ("w1", "w3", "w2")


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
                    OpSchema.Attribute("situ_linear_beta", OpSchema.AttrType.FLOAT, "SiTU linear clamp")],
    )


ROUTED_EXPERTS_SCHEMA = _schema("RoutedExperts", [(w, "TW") for w in _PROJECTIONS], _FLOATS)
ROUTED_EXPERTS_MXFP4_SCHEMA = _schema(
    "RoutedExpertsMXFP4", [(f"{w}_{part}", "TW") for w in _PROJECTIONS for part in ("packed", "scale")],
    ["tensor(uint8)"])

_K3 = values.Opset(DOMAIN, DOMAIN_VERSION)
_ROUTED_EXPERTS = values.Op(_K3, "RoutedExperts", ROUTED_EXPERTS_SCHEMA)
_ROUTED_EXPERTS_MXFP4 = values.Op(_K3, "RoutedExpertsMXFP4", ROUTED_EXPERTS_MXFP4_SCHEMA)


def moe_translation_table(plugin_namespace: str, plugin_version: str) -> dict[Callable, Callable]:
    """The entries of onnx/ops.py's TRANSLATION_TABLE for the two routed-experts ops."""
    plugin = {"plugin_namespace": plugin_namespace, "plugin_version": plugin_version}

    # Annotated so that the exporter passes the betas as attributes, not as tensors.
    def routed_experts(z, experts, weights, w1, w3, w2, situ_beta: float, situ_linear_beta: float):
        return _ROUTED_EXPERTS(z, experts, weights, w1, w3, w2, situ_beta=situ_beta,
                               situ_linear_beta=situ_linear_beta, **plugin)

    def routed_experts_mxfp4(z, experts, weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed,
                             w2_scale, situ_beta: float, situ_linear_beta: float):
        return _ROUTED_EXPERTS_MXFP4(z, experts, weights, w1_packed, w1_scale, w3_packed, w3_scale,
                                     w2_packed, w2_scale, situ_beta=situ_beta,
                                     situ_linear_beta=situ_linear_beta, **plugin)

    return {torch.ops.k3.routed_experts.default: routed_experts,
            torch.ops.k3.routed_experts_mxfp4.default: routed_experts_mxfp4}


def _ints(name: str, value: list[int]) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value_ints=value)


def _attribute_float(name: str, attribute: str) -> onnx.NodeProto:
    """A scalar float Constant holding the calling node's `attribute`."""
    node = helper.make_node("Constant", [], [name])
    node.attribute.append(onnx.AttributeProto(name="value_float", type=onnx.AttributeProto.FLOAT,
                                              ref_attr_name=attribute))
    return node


def _dequantize(w: str) -> list[onnx.NodeProto]:
    """Expert e's `{w}_packed` / `{w}_scale` slices -> float32 `{w}_e` [O, I], as k3export.mxfp4 decodes:
    each byte looks up its two values (low nibble first) in a [256, 2] table, each group of 32 is
    multiplied by its scale 2^(s - 127) from a [256] table."""
    return [
        helper.make_node("Gather", [f"{w}_packed", "e"], [f"{w}_packed_e"], axis=0),
        helper.make_node("Gather", [f"{w}_scale", "e"], [f"{w}_scale_e"], axis=0),
        helper.make_node("Cast", [f"{w}_packed_e"], [f"{w}_bytes"], to=TensorProto.INT32),
        helper.make_node("Gather", ["byte_values", f"{w}_bytes"], [f"{w}_pairs"], axis=0),  # [O, I/2, 2]
        helper.make_node("Reshape", [f"{w}_pairs", "groups_shape"], [f"{w}_groups"]),  # [O, I/32, 32]
        helper.make_node("Cast", [f"{w}_scale_e"], [f"{w}_scale_index"], to=TensorProto.INT32),
        helper.make_node("Gather", ["scale_values", f"{w}_scale_index"], [f"{w}_factor"], axis=0),
        helper.make_node("Unsqueeze", [f"{w}_factor", "last_axis"], [f"{w}_factor_col"]),
        helper.make_node("Mul", [f"{w}_groups", f"{w}_factor_col"], [f"{w}_scaled"]),
        helper.make_node("Reshape", [f"{w}_scaled", "matrix_shape"], [f"{w}_e"]),
    ]


def _mxfp4_tables() -> list[onnx.NodeProto]:
    byte = torch.arange(256)
    codes = torch.stack([byte % 16, byte // 16], dim=-1)
    magnitude = mxfp4.E2M1_TABLE[codes % 8]
    pairs = torch.where(codes >= 8, -magnitude, magnitude)
    return [
        helper.make_node("Constant", [], ["byte_values"],
                         value=helper.make_tensor("byte_values", TensorProto.FLOAT, [256, 2],
                                                  pairs.flatten().tolist())),
        helper.make_node("Constant", [], ["scale_values"],
                         value=helper.make_tensor("scale_values", TensorProto.FLOAT, [256],
                                                  mxfp4.SCALE_VALUES.tolist())),
        _ints("groups_shape", [0, -1, mxfp4.GROUP]),
        _ints("matrix_shape", [0, -1]),
        _ints("last_axis", [-1]),
    ]


def _expert_body(packed: bool) -> onnx.GraphProto:
    """One Loop iteration: expert e = used[i] on the tokens, weighted by their routing weight for e
    (zero for those that did not choose it), added into u."""
    if packed:
        weight_nodes = [n for w in _PROJECTIONS for n in _dequantize(w)]
    else:
        weight_nodes = [node for w in _PROJECTIONS for node in (
            helper.make_node("Gather", [w, "e"], [f"{w}_gathered"], axis=0),
            helper.make_node("Cast", [f"{w}_gathered"], [f"{w}_e"], to=TensorProto.FLOAT))]
    nodes = [
        helper.make_node("Gather", ["used", "i"], ["e"], axis=0),
        # Each token's routing weight for e [N, 1] (0 for tokens that did not choose it; summed should a
        # token choose e twice).
        helper.make_node("Equal", ["experts", "e"], ["chosen"]),
        helper.make_node("Cast", ["chosen"], ["chosen_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["weights_f", "chosen_f"], ["chosen_weights"]),
        helper.make_node("ReduceSum", ["chosen_weights", "one_axis"], ["token_weights"], keepdims=1),
        *weight_nodes,
        # SiTU-GLU: [beta tanh(a / beta) sigmoid(a)] * [linear_beta tanh(b / linear_beta)].
        helper.make_node("Gemm", ["z_f", "w1_e"], ["a"], transB=1),
        helper.make_node("Gemm", ["z_f", "w3_e"], ["b"], transB=1),
        helper.make_node("Div", ["a", "beta"], ["a_scaled"]),
        helper.make_node("Tanh", ["a_scaled"], ["a_tanh"]),
        helper.make_node("Mul", ["a_tanh", "beta"], ["a_clamped"]),
        helper.make_node("Sigmoid", ["a"], ["a_sigmoid"]),
        helper.make_node("Mul", ["a_clamped", "a_sigmoid"], ["gate"]),
        helper.make_node("Div", ["b", "linear_beta"], ["b_scaled"]),
        helper.make_node("Tanh", ["b_scaled"], ["b_tanh"]),
        helper.make_node("Mul", ["b_tanh", "linear_beta"], ["b_clamped"]),
        helper.make_node("Mul", ["gate", "b_clamped"], ["h"]),
        helper.make_node("Gemm", ["h", "w2_e"], ["y"], transB=1),
        helper.make_node("Mul", ["y", "token_weights"], ["weighted"]),
        helper.make_node("Add", ["u_in", "weighted"], ["u_out"]),
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
        *(_mxfp4_tables() if packed else []),
        helper.make_node("Cast", ["z"], ["z_f"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["weights"], ["weights_f"], to=TensorProto.FLOAT),
        _attribute_float("beta", "situ_beta"),
        _attribute_float("linear_beta", "situ_linear_beta"),
        _ints("one_axis", [1]),
        _ints("flat_shape", [-1]),
        # The used experts: a [E] presence vector (ScatterElements of ones; duplicates write the same
        # value), then the indices of its U ones (TopK with K = U).
        helper.make_node("Reshape", ["experts", "flat_shape"], ["flat_experts"]),
        helper.make_node("Shape", [weights[0]], ["num_experts"], start=0, end=1),
        helper.make_node("ConstantOfShape", ["num_experts"], ["absent"],
                         value=helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0])),
        helper.make_node("Shape", ["flat_experts"], ["num_slots"]),
        helper.make_node("ConstantOfShape", ["num_slots"], ["ones"],
                         value=helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])),
        helper.make_node("ScatterElements", ["absent", "flat_experts", "ones"], ["present"], axis=0),
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
        attributes=[*PLUGIN_ATTRIBUTES, AOT_ATTRIBUTE, "situ_beta", "situ_linear_beta"])


def routed_experts_function(opset_version: int) -> onnx.FunctionProto:
    """`k3.RoutedExperts(z, experts, weights, w1, w3, w2) -> u` (attributes situ_beta, situ_linear_beta)."""
    return _function(False, opset_version)


def routed_experts_mxfp4_function(opset_version: int) -> onnx.FunctionProto:
    """`k3.RoutedExpertsMXFP4(z, experts, weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed,
    w2_scale) -> u`: the same, dequantising only the experts used."""
    return _function(True, opset_version)


MOE_FUNCTIONS = {"RoutedExperts": routed_experts_function,
                 "RoutedExpertsMXFP4": routed_experts_mxfp4_function}
