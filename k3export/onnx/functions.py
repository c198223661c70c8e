"""Model-local ONNX functions `k3.KDA` (and its two-node form, KDAPrepare and KDAChunkRecurrence) and
`k3.LatentMLA` (and its two-node form, LatentMLASplits and LatentMLACombine): each op's decomposition in
standard ops.

ONNX Runtime inlines them at load, so an exported file runs with no extra library; TensorRT maps a
node to the plugin of the same name instead when one is registered (the node names its
plugin_namespace). Both bodies cast to float32, compute there, and cast the results back (o to v's
or q's dtype, the KDA state to its input's).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from k3export.onnx.domain import AOT_ATTRIBUTE, DOMAIN, DOMAIN_VERSION, PLUGIN_ATTRIBUTES
from k3export.onnx.moe import MOE_FUNCTIONS
from k3export.ops.kda import CHUNK_SIZE as CHUNK


def _const(name: str, value: list[int]) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value_ints=value)


def _attribute_constant(name: str, field: str, kind: int, attribute: str) -> onnx.NodeProto:
    """A scalar Constant holding the value of the calling node's `attribute`."""
    node = helper.make_node("Constant", [], [name])
    node.attribute.append(onnx.AttributeProto(name=field, type=kind, ref_attr_name=attribute))
    return node


def _kda_step() -> onnx.GraphProto:
    """One token of the recurrence on [B, H, ...] slices:
    S <- diag(exp(g)) S;  u = v - S^T k;  S <- S + beta k u^T;  o = S^T q."""
    nodes = [
        _const("last", [-1]),
        _const("second_last", [-2]),
        helper.make_node("Exp", ["g_t"], ["decay"]),
        helper.make_node("Unsqueeze", ["decay", "last"], ["decay_col"]),
        helper.make_node("Mul", ["state_in", "decay_col"], ["decayed"]),
        # k^T S and q^T S as [B, H, 1, K] @ [B, H, K, V] row-vector products.
        helper.make_node("Unsqueeze", ["k_t", "second_last"], ["k_row"]),
        helper.make_node("MatMul", ["k_row", "decayed"], ["predicted"]),
        helper.make_node("Unsqueeze", ["v_t", "second_last"], ["v_row"]),
        helper.make_node("Sub", ["v_row", "predicted"], ["u_row"]),
        helper.make_node("Unsqueeze", ["beta_t", "last"], ["beta_col"]),
        helper.make_node("Mul", ["k_t", "beta_col"], ["beta_k"]),
        helper.make_node("Unsqueeze", ["beta_k", "last"], ["beta_k_col"]),
        helper.make_node("MatMul", ["beta_k_col", "u_row"], ["update"]),
        helper.make_node("Add", ["decayed", "update"], ["state_out"]),
        helper.make_node("Unsqueeze", ["q_t", "second_last"], ["q_row"]),
        helper.make_node("MatMul", ["q_row", "state_out"], ["o_row"]),
        helper.make_node("Squeeze", ["o_row", "second_last"], ["o_t"]),
    ]

    def value(name: str) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, None)

    inputs = [value(n) for n in ("state_in", "q_t", "k_t", "v_t", "g_t", "beta_t")]
    return helper.make_graph(nodes, "kda_step", inputs, [value("state_out"), value("o_t")])


def _kda_scan(outputs: tuple[str, str]) -> list[onnx.NodeProto]:
    """The recurrence over time from q, k, v, g, beta and initial_state, a Scan, into `outputs` (o, state)."""
    to_float = [helper.make_node("Cast", [name], [f"{name}_f"], to=TensorProto.FLOAT)
                for name in ("q", "k", "v", "g", "beta", "initial_state")]
    return [
        *to_float,
        # Scanning axis 1 of the [B, T, ...] inputs and writing o along axis 1 spares the transposes.
        helper.make_node("Scan", ["initial_state_f", "q_f", "k_f", "v_f", "g_f", "beta_f"],
                         ["state_f", "o_f"], body=_kda_step(), num_scan_inputs=5,
                         scan_input_axes=[1] * 5, scan_output_axes=[1]),
        helper.make_node("CastLike", ["o_f", "v"], [outputs[0]]),
        helper.make_node("CastLike", ["state_f", "initial_state"], [outputs[1]]),
    ]


def kda_function(opset_version: int) -> onnx.FunctionProto:
    """`k3.KDA(q, k, v, g, beta, initial_state) -> (o, final_state)` as a Scan over time. The one-node form
    of earlier exports; exports now hold KDAPrepare and KDAChunkRecurrence."""
    return helper.make_function(
        DOMAIN, "KDA", ["q", "k", "v", "g", "beta", "initial_state"], ["o", "final_state"],
        _kda_scan(("o", "final_state")), [helper.make_opsetid("", opset_version)],
        attributes=[*PLUGIN_ATTRIBUTES, AOT_ATTRIBUTE])


def _kda_chunked(name: str) -> list[onnx.NodeProto]:
    """`name` [B, T, H, X] (float32) as chunks `name`_c [B, N, H, C, X], T zero-padded to N * C."""
    return [
        helper.make_node("Pad", [name, "pads"], [f"{name}_padded"]),
        helper.make_node("Shape", [f"{name}_padded"], [f"{name}_shape"]),
        helper.make_node("Slice", [f"{name}_shape", "zero_1d", "axis_1"], [f"{name}_B"]),
        helper.make_node("Slice", [f"{name}_shape", "axis_2", "axis_4"], [f"{name}_HX"]),
        helper.make_node("Concat", [f"{name}_B", "minus_one", "chunk", f"{name}_HX"], [f"{name}_chunks"],
                         axis=0),
        helper.make_node("Reshape", [f"{name}_padded", f"{name}_chunks"], [f"{name}_r"]),
        helper.make_node("Transpose", [f"{name}_r"], [f"{name}_c"], perm=[0, 1, 3, 2, 4]),
    ]


def _kda_tokens(name: str, output: str) -> list[onnx.NodeProto]:
    """Chunks `name` [B, N, H, C, X] back as token rows `output` [B, T, H, X] in v's dtype."""
    return [
        helper.make_node("Transpose", [name], [f"{name}_t"], perm=[0, 1, 3, 2, 4]),
        helper.make_node("Shape", [f"{name}_t"], [f"{name}_shape"]),
        helper.make_node("Slice", [f"{name}_shape", "zero_1d", "axis_1"], [f"{name}_B"]),
        helper.make_node("Slice", [f"{name}_shape", "axis_3", "axis_5"], [f"{name}_HX"]),
        helper.make_node("Concat", [f"{name}_B", "minus_one", f"{name}_HX"], [f"{name}_rows"], axis=0),
        helper.make_node("Reshape", [f"{name}_t", f"{name}_rows"], [f"{name}_padded"]),
        helper.make_node("Slice", [f"{name}_padded", "zero_1d", "T", "axis_1"], [f"{name}_f"]),
        helper.make_node("CastLike", [f"{name}_f", "v"], [output]),
    ]


def _float_const(name: str, value: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value, name))


def kda_prepare_function(opset_version: int) -> onnx.FunctionProto:
    """`k3.KDAPrepare(q, k, v, g, beta) -> (qg, kt, w, u, a_qk, decay_last)`: each chunk of CHUNK tokens'
    state-free terms (k3export/ops/kda.py's kda_prepare), in float32: G = cumsum(g) within the chunk, the
    scores from the differences exp(G_i - G_j) (masked to j <= i before exponentiating),
    UT = (I + A)^-1 diag(beta) with A = diag(beta) A_kk strictly lower, as (I - A)(I + A^2)(I + A^4)(I + A^8)
    (A is nilpotent), W = UT (K exp(G)), U = UT V, qg = Q exp(G), kt = K exp(G_C - G),
    decay_last = exp(G_C)."""
    C = CHUNK
    causal = np.tril(np.ones((C, C), dtype=bool))
    nodes = [
        *(_const(name, value) for name, value in (
            ("zero_1d", [0]), ("axis_1", [1]), ("axis_2", [2]), ("axis_3", [3]), ("axis_4", [4]),
            ("axis_5", [5]),
            ("minus_one", [-1]), ("chunk", [C]), ("last_row", [C - 1]), ("zeros_3", [0, 0, 0]))),
        helper.make_node("Constant", [], ["axis_3_0d"],
                         value=numpy_helper.from_array(np.array(3), "axis_3_0d")),
        helper.make_node("Constant", [], ["causal"],
                         value=numpy_helper.from_array(causal[..., None], "causal")),
        _float_const("strictly_lower", np.tril(np.ones((C, C), dtype=np.float32), -1)),
        _float_const("identity", np.eye(C, dtype=np.float32)),
        _float_const("minus_inf", np.array([-np.inf], dtype=np.float32)),
        *(helper.make_node("Cast", [name], [f"{name}_f"], to=TensorProto.FLOAT)
          for name in ("q", "k", "v", "g")),
        helper.make_node("Cast", ["beta"], ["beta_3d"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["beta_3d", "axis_3"], ["beta_f"]),
        # pads: T up to a multiple of C, at the end of axis 1.
        helper.make_node("Shape", ["q"], ["q_shape"]),
        helper.make_node("Slice", ["q_shape", "axis_1", "axis_2"], ["T"]),
        helper.make_node("Mod", ["T", "chunk"], ["T_in_chunk"]),
        helper.make_node("Sub", ["chunk", "T_in_chunk"], ["to_chunk"]),
        helper.make_node("Mod", ["to_chunk", "chunk"], ["pad"]),
        helper.make_node("Concat", ["zeros_3", "zero_1d", "zero_1d", "pad", "zero_1d", "zero_1d"], ["pads"],
                         axis=0),
        *(node for name in ("q_f", "k_f", "v_f", "g_f", "beta_f") for node in _kda_chunked(name)),
        helper.make_node("CumSum", ["g_f_c", "axis_3_0d"], ["G"]),
        helper.make_node("Slice", ["G", "last_row", "chunk", "axis_3"], ["G_last"]),  # [B, N, H, 1, K]
        helper.make_node("Unsqueeze", ["G", "axis_4"], ["G_i"]),
        helper.make_node("Unsqueeze", ["G", "axis_3"], ["G_j"]),
        helper.make_node("Sub", ["G_i", "G_j"], ["G_diff"]),  # [B, N, H, i, j, K]
        helper.make_node("Where", ["causal", "G_diff", "minus_inf"], ["G_causal"]),
        helper.make_node("Exp", ["G_causal"], ["decays"]),
        helper.make_node("Unsqueeze", ["k_f_c", "axis_3"], ["k_j"]),
        helper.make_node("Mul", ["decays", "k_j"], ["decayed_k"]),
        helper.make_node("Unsqueeze", ["q_f_c", "axis_4"], ["q_i"]),
        helper.make_node("Unsqueeze", ["k_f_c", "axis_4"], ["k_i"]),
        helper.make_node("Mul", ["q_i", "decayed_k"], ["qk_terms"]),
        helper.make_node("ReduceSum", ["qk_terms", "axis_5"], ["A_qk"], keepdims=0),
        helper.make_node("Mul", ["k_i", "decayed_k"], ["kk_terms"]),
        helper.make_node("ReduceSum", ["kk_terms", "axis_5"], ["A_kk_causal"], keepdims=0),
        helper.make_node("Mul", ["A_kk_causal", "strictly_lower"], ["A_kk"]),
        helper.make_node("Mul", ["A_kk", "beta_f_c"], ["A"]),
        helper.make_node("Sub", ["identity", "A"], ["inverse_0"]),
        helper.make_node("Identity", ["A"], ["power_0"]),
    ]
    for i in range(1, C.bit_length() - 1):  # inverse_i = inverse_(i-1) (I + A^(2^i))
        nodes += [helper.make_node("MatMul", [f"power_{i - 1}", f"power_{i - 1}"], [f"power_{i}"]),
                  helper.make_node("MatMul", [f"inverse_{i - 1}", f"power_{i}"], [f"inverse_term_{i}"]),
                  helper.make_node("Add", [f"inverse_{i - 1}", f"inverse_term_{i}"], [f"inverse_{i}"])]
    nodes += [
        helper.make_node("Transpose", ["beta_f_c"], ["beta_row"], perm=[0, 1, 2, 4, 3]),
        helper.make_node("Mul", [f"inverse_{C.bit_length() - 2}", "beta_row"], ["UT"]),
        helper.make_node("Exp", ["G"], ["decay"]),
        helper.make_node("Mul", ["q_f_c", "decay"], ["qg_c"]),
        helper.make_node("Mul", ["k_f_c", "decay"], ["k_decayed"]),
        helper.make_node("MatMul", ["UT", "k_decayed"], ["w_c"]),
        helper.make_node("MatMul", ["UT", "v_f_c"], ["u_c"]),
        helper.make_node("Sub", ["G_last", "G"], ["G_tail"]),
        helper.make_node("Exp", ["G_tail"], ["tail"]),
        helper.make_node("Mul", ["k_f_c", "tail"], ["kt_c"]),
        helper.make_node("Exp", ["G_last"], ["decay_last_5d"]),
        helper.make_node("Squeeze", ["decay_last_5d", "axis_3"], ["decay_last"]),
        *(node for name, output in (("qg_c", "qg"), ("kt_c", "kt"), ("w_c", "w"), ("u_c", "u"),
                                    ("A_qk", "a_qk"))
          for node in _kda_tokens(name, output)),
    ]
    return helper.make_function(
        DOMAIN, "KDAPrepare", ["q", "k", "v", "g", "beta"], ["qg", "kt", "w", "u", "a_qk", "decay_last"],
        nodes,
        [helper.make_opsetid("", opset_version)], attributes=[*PLUGIN_ATTRIBUTES, AOT_ATTRIBUTE])


def kda_chunk_recurrence_function(opset_version: int) -> onnx.FunctionProto:
    """`k3.KDAChunkRecurrence(q, k, v, g, beta, qg, kt, w, u, a_qk, decay_last, initial_state) ->
    (o, final_state)`: kda's result. ONNX Runtime runs it as KDA's Scan over time from the token inputs (the
    same result the chunk terms give, without a second form to keep), so it never reads the terms."""
    return helper.make_function(
        DOMAIN, "KDAChunkRecurrence",
        ["q", "k", "v", "g", "beta", "qg", "kt", "w", "u", "a_qk", "decay_last", "initial_state"],
        ["o", "final_state"], _kda_scan(("o", "final_state")), [helper.make_opsetid("", opset_version)],
        attributes=[*PLUGIN_ATTRIBUTES, AOT_ATTRIBUTE])


def _latent_mla_attention() -> list[onnx.NodeProto]:
    """The nodes shared by the LatentMLA functions: from q [B, T, H, D], kv [B, 1, C, D] and cache_lengths,
    in float32, `masked` [B, H, T, rows] (scale * q . kv, -inf where row j > cache_lengths[b] + t; rows up
    to max(cache_lengths) + T, a Slice: never the whole capacity) and the attention's output `o_f`
    [B, T, H, v_dim]."""
    return [
        helper.make_node("Cast", ["q"], ["q_f"], to=TensorProto.FLOAT),
        _const("zero_1d", [0]),
        _const("axis_1", [1]),
        _const("axis_2", [2]),
        _const("axis_3", [3]),
        _const("axes_1_3", [1, 3]),
        # rows = max(cache_lengths) + T: the longest row's cache after this call.
        helper.make_node("Shape", ["q"], ["t_1d"], start=1, end=2),
        helper.make_node("ReduceMax", ["cache_lengths", "zero_1d"], ["longest_1d"], keepdims=1),
        helper.make_node("Add", ["longest_1d", "t_1d"], ["rows_1d"]),
        helper.make_node("Slice", ["kv", "zero_1d", "rows_1d", "axis_2"], ["kv_used"]),
        helper.make_node("Cast", ["kv_used"], ["kv_f"], to=TensorProto.FLOAT),
        # scores [B, H, T, rows] = scale * q [B, H, T, D] @ kv^T [B, 1, D, rows]: one key head for all.
        helper.make_node("Transpose", ["q_f"], ["q_heads"], perm=[0, 2, 1, 3]),
        helper.make_node("Transpose", ["kv_f"], ["keys"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q_heads", "keys"], ["dots"]),
        _attribute_constant("scale_f", "value_float", onnx.AttributeProto.FLOAT, "scale"),
        helper.make_node("Mul", ["dots", "scale_f"], ["scores"]),
        # visible [B, 1, T, rows]: row j <= cache_lengths[b] + t.
        helper.make_node("Squeeze", ["t_1d"], ["t"]),
        helper.make_node("Squeeze", ["rows_1d"], ["rows"]),
        helper.make_node("Constant", [], ["zero"], value_int=0),
        helper.make_node("Constant", [], ["one"], value_int=1),
        helper.make_node("Range", ["zero", "rows", "one"], ["row_index"]),
        helper.make_node("Range", ["zero", "t", "one"], ["query_index"]),
        helper.make_node("Unsqueeze", ["cache_lengths", "axis_1"], ["lengths_2d"]),
        helper.make_node("Add", ["lengths_2d", "query_index"], ["last_visible"]),
        helper.make_node("Unsqueeze", ["last_visible", "axes_1_3"], ["last_visible_4d"]),
        helper.make_node("LessOrEqual", ["row_index", "last_visible_4d"], ["visible"]),
        helper.make_node("Constant", [], ["neg_inf"], value_float=float("-inf")),
        helper.make_node("Where", ["visible", "scores", "neg_inf"], ["masked"]),
        # Every query sees row 0 (cache_lengths >= 0), so no row of the softmax is all -inf.
        helper.make_node("Softmax", ["masked"], ["probs"], axis=-1),
        _attribute_constant("v_dim_0d", "value_int", onnx.AttributeProto.INT, "v_dim"),
        helper.make_node("Unsqueeze", ["v_dim_0d", "zero_1d"], ["v_dim_1d"]),
        helper.make_node("Slice", ["kv_f", "zero_1d", "v_dim_1d", "axis_3"], ["values"]),
        helper.make_node("MatMul", ["probs", "values"], ["o_heads"]),
        # o_f [B, T, H, v_dim], float32.
        helper.make_node("Transpose", ["o_heads"], ["o_f"], perm=[0, 2, 1, 3]),
    ]


def latent_mla_function(opset_version: int) -> onnx.FunctionProto:
    """`k3.LatentMLA(q, kv, cache_lengths) -> o` with attributes v_dim and scale: softmax attention
    of q [B, T, H, D] over the shared latent rows of the cache kv [B, 1, C, D] (this call's T rows
    already written at cache_lengths[b] ..), query t of row b seeing rows j <= cache_lengths[b] + t;
    values kv[..., :v_dim]. Only the rows up to max(cache_lengths) + T are read (a Slice), never
    the whole capacity. The one-node form of earlier exports; exports now hold LatentMLASplits and
    LatentMLACombine."""
    nodes = [*_latent_mla_attention(), helper.make_node("CastLike", ["o_f", "q"], ["o"])]
    return helper.make_function(
        DOMAIN, "LatentMLA", ["q", "kv", "cache_lengths"], ["o"], nodes,
        [helper.make_opsetid("", opset_version)],
        attributes=[*PLUGIN_ATTRIBUTES, AOT_ATTRIBUTE, "v_dim", "scale"])


def latent_mla_splits_function(opset_version: int) -> onnx.FunctionProto:
    """`k3.LatentMLASplits(q, kv, cache_lengths) -> (o_part, lse)`, attributes v_dim and scale: LatentMLA's
    float32 output as one split, o_part [1, B, T, H, v_dim], and the log-sum-exp of each query's visible
    scores, lse [1, B, T, H] (the kernels split the cache further; the combine's result is the same)."""
    nodes = [
        *_latent_mla_attention(),
        helper.make_node("Unsqueeze", ["o_f", "zero_1d"], ["o_part"]),
        # lse = m + log(sum(exp(masked - m))), m the row's largest score (finite: every query sees a row).
        helper.make_node("ReduceMax", ["masked", "axis_3"], ["score_max"], keepdims=1),
        helper.make_node("Sub", ["masked", "score_max"], ["shifted"]),
        helper.make_node("Exp", ["shifted"], ["shifted_exp"]),
        helper.make_node("ReduceSum", ["shifted_exp", "axis_3"], ["denominator"], keepdims=0),
        helper.make_node("Log", ["denominator"], ["log_denominator"]),
        helper.make_node("Squeeze", ["score_max", "axis_3"], ["score_max_3d"]),
        helper.make_node("Add", ["log_denominator", "score_max_3d"], ["lse_heads"]),
        # [B, H, T] -> [1, B, T, H]
        helper.make_node("Transpose", ["lse_heads"], ["lse_3d"], perm=[0, 2, 1]),
        helper.make_node("Unsqueeze", ["lse_3d", "zero_1d"], ["lse"]),
    ]
    return helper.make_function(
        DOMAIN, "LatentMLASplits", ["q", "kv", "cache_lengths"], ["o_part", "lse"], nodes,
        [helper.make_opsetid("", opset_version)],
        attributes=[*PLUGIN_ATTRIBUTES, AOT_ATTRIBUTE, "v_dim", "scale"])


def latent_mla_combine_function(opset_version: int) -> onnx.FunctionProto:
    """`k3.LatentMLACombine(q, o_part, lse) -> o`: the splits' outputs o_part [S, B, T, H, v_dim] weighted by
    softmax over the splits of lse [S, B, T, H], summed, in q's dtype (q gives only the dtype)."""
    nodes = [
        helper.make_node("Softmax", ["lse"], ["weights"], axis=0),
        _const("last", [-1]),
        _const("first", [0]),
        helper.make_node("Unsqueeze", ["weights", "last"], ["weights_5d"]),
        helper.make_node("Mul", ["o_part", "weights_5d"], ["weighted"]),
        helper.make_node("ReduceSum", ["weighted", "first"], ["o_f"], keepdims=0),
        helper.make_node("CastLike", ["o_f", "q"], ["o"]),
    ]
    return helper.make_function(
        DOMAIN, "LatentMLACombine", ["q", "o_part", "lse"], ["o"], nodes,
        [helper.make_opsetid("", opset_version)], attributes=[*PLUGIN_ATTRIBUTES, AOT_ATTRIBUTE])


_BUILDERS = {"KDA": kda_function, "KDAPrepare": kda_prepare_function,
             "KDAChunkRecurrence": kda_chunk_recurrence_function, "LatentMLA": latent_mla_function,
             "LatentMLASplits": latent_mla_splits_function, "LatentMLACombine": latent_mla_combine_function}


def k3_functions(op_types: Iterable[str], opset_version: int) -> list[onnx.FunctionProto]:
    """The functions for those of `op_types` that are k3 ops, at the model's standard opset (ONNX
    requires a function's opset to match its model's)."""
    builders = {**_BUILDERS, **MOE_FUNCTIONS}
    return [builders[name](opset_version) for name in sorted(set(op_types) & builders.keys())]


def attach_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """Adds the k3 functions that the graph's nodes call, and the k3 opset import; returns `model`,
    changed in place."""
    present = {f.name for f in model.functions if f.domain == DOMAIN}
    used = {n.op_type for n in model.graph.node if n.domain == DOMAIN} - present
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    model.functions.extend(k3_functions(used, opset))
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, DOMAIN_VERSION))
    return model
