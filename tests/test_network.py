"""The parsed TensorRT-RTX network evaluated on CPU (k3export.engine.network).

Each layer type the evaluator implements is checked alone against ONNX Runtime on a one-node ONNX
model of the op that the parser turns into it (the test asserts the parser did), over the modes our
graphs use; then the k3-tiny exports' whole networks against the eager model, and the same check
failing after a weight, a plugin field or a shuffle's permutation is changed."""

import gc
import importlib.util
import json
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from reference import PERTURBED, kda_inputs, scaled_copy

from k3export.check.runners.eager import EagerSide
from k3export.check.runners.network import run_network_check
from k3export.cli import main
from k3export.engine.network import (
    LAYERS,
    NetworkEvaluator,
    NotImplementedLayer,
    ParsedNetwork,
    evaluate_network,
    parse_network,
    to_numpy,
)
from k3export.onnx.functions import attach_functions

if importlib.util.find_spec("tensorrt_rtx") is None:
    pytest.skip("tensorrt_rtx is not installed (pip install tensorrt-rtx-cu13)", allow_module_level=True)

OPSET = 24
F32, I64 = TensorProto.FLOAT, TensorProto.INT64
RNG = np.random.default_rng(0)


def randn(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def one_node(folder: Path, op: str, feeds: dict[str, np.ndarray], outputs: list[str],
             constants: dict[str, np.ndarray] | None = None, domain: str = "", **attrs) -> Path:
    """model.onnx holding one `op` node: `feeds` become graph inputs, floating ones with every dim
    dynamic (so the parser keeps shape arithmetic as layers), integer ones static (the parser needs
    the length of a shape tensor); `constants` become initializers. A k3 node gets its function."""
    constants = constants or {}
    inputs = [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(a.dtype),
                                            list(a.shape) if a.dtype == np.int64 else
                                            [f"{name}_{i}" for i in range(a.ndim)])
              for name, a in feeds.items()]
    node = helper.make_node(op, [*feeds, *constants], outputs, domain=domain, **attrs)
    graph = helper.make_graph([node], op, inputs,
                              [helper.make_value_info(o, onnx.TypeProto()) for o in outputs],
                              [numpy_helper.from_array(a, name) for name, a in constants.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    if domain:
        attach_functions(model)
    typed = {v.name: v for v in onnx.shape_inference.infer_shapes(model).graph.output}
    model.graph.ClearField("output")
    model.graph.output.extend(typed[o] for o in outputs)  # the parser needs the outputs' types
    path = folder / "model.onnx"
    onnx.save(model, path)
    return path


def assert_matches_onnxruntime(path: Path, feeds: dict[str, np.ndarray], layer_type: str) -> None:
    """The network's outputs equal ONNX Runtime's (floats to float32 rounding, others exactly), and
    the parser produced a `layer_type` layer."""
    net = parse_network(path)
    types = {net.network.get_layer(i).type.name for i in range(net.network.num_layers)}
    assert layer_type in types, f"the parser made {types}, not {layer_type}"
    actual = NetworkEvaluator(net).evaluate(feeds)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    expected = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))
    assert set(actual) == set(expected)
    for name, value in expected.items():
        got = to_numpy(actual[name])
        assert (got.dtype, got.shape) == (value.dtype, value.shape), name
        if np.issubdtype(value.dtype, np.floating):
            np.testing.assert_allclose(got, value, rtol=1e-5, atol=1e-6, err_msg=name)
        else:
            np.testing.assert_array_equal(got, value, err_msg=name)


x3 = randn(2, 5, 6)
ints = np.array([[7, -3, 0], [-8, 5, 2]], np.int64)
int_divisors = np.array([[2, 2, 3], [3, -2, 1]], np.int64)
ties = np.array([[1.0, 3.0, 3.0, 0.5, 3.0, 1.0], [2.0, 2.0, 2.0, 2.0, 1.0, 1.0]], np.float32)

# (id, layer type, op, feeds, constants, attributes)
CASES = [
    *[(f"elementwise-{op}", "ELEMENTWISE", op, {"a": x3, "b": randn(2, 1, 6)}, {}, {})
      for op in ("Add", "Mul", "Sub", "Div", "Max", "Min")],
    ("elementwise-Pow", "ELEMENTWISE", "Pow", {"a": np.abs(x3) + 0.1}, {"b": np.float32(2.0)}, {}),
    *[(f"elementwise-{op}-int64", "ELEMENTWISE", op, {"a": ints, "b": int_divisors}, {}, {})
      for op in ("Add", "Mul", "Sub", "Max", "Min", "Div")],
    ("elementwise-Less-int64", "ELEMENTWISE", "Less", {"a": ints, "b": int_divisors}, {}, {}),
    ("elementwise-Equal-int64", "ELEMENTWISE", "Equal", {"a": ints, "b": np.array([[7], [5]], np.int64)}, {},
     {}),
    # ONNX Mod (sign of the divisor) -> FLOOR_DIV, PROD, SUB
    ("elementwise-FLOOR_DIV-int64", "ELEMENTWISE", "Mod", {"a": ints, "b": int_divisors}, {}, {}),
    *[(f"unary-{op}", "UNARY", op, {"x": np.abs(x3) + 0.1 if op in ("Sqrt", "Log") else x3 * 2}, {}, {})
      for op in ("Sqrt", "Reciprocal", "Exp", "Log", "Abs", "Neg", "Sin", "Cos", "Erf", "Floor", "Ceil",
                 "Sign", "Round")],
    ("unary-Not", "UNARY", "Not", {"x": x3 > 0}, {}, {}),
    *[(f"activation-{op}", "ACTIVATION", op, {"x": x3 * 3}, {}, {}) for op in ("Sigmoid", "Tanh", "Relu")],
    ("activation-LeakyRelu", "ACTIVATION", "LeakyRelu", {"x": x3}, {}, {"alpha": 0.2}),
    *[(f"reduce-{op}-keep{keep}", "REDUCE", op, {"x": x3}, {"axes": np.array([-1], np.int64)},
       {"keepdims": keep})
      for op in ("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin") for keep in (0, 1)],
    ("reduce-ReduceSum-two-axes", "REDUCE", "ReduceSum", {"x": x3}, {"axes": np.array([0, 2], np.int64)}, {}),
    ("matmul-2d", "MATRIX_MULTIPLY", "MatMul", {"a": randn(5, 6), "b": randn(6, 4)}, {}, {}),
    ("matmul-3d", "MATRIX_MULTIPLY", "MatMul", {"a": x3, "b": randn(2, 6, 4)}, {}, {}),
    ("matmul-4d", "MATRIX_MULTIPLY", "MatMul", {"a": randn(2, 3, 5, 6), "b": randn(2, 3, 6, 4)}, {}, {}),
    ("matmul-weight", "MATRIX_MULTIPLY", "MatMul", {"a": x3}, {"w": randn(6, 4)}, {}),  # broadcast batch
    ("gemm-transB", "MATRIX_MULTIPLY", "Gemm", {"a": randn(5, 6), "b": randn(4, 6)}, {}, {"transB": 1}),
    ("cast-int64-int32", "CAST", "Cast", {"x": ints}, {}, {"to": TensorProto.INT32}),
    ("cast-bool-float", "CAST", "Cast", {"x": x3 > 0}, {}, {"to": F32}),
    ("cast-float-int64", "CAST", "Cast", {"x": x3 * 4}, {}, {"to": I64}),
    ("constant-add", "CONSTANT", "Add", {"a": x3}, {"b": randn(2, 5, 6)}, {}),
    ("reshape-static", "SHUFFLE", "Reshape", {"x": x3}, {"shape": np.array([0, -1, 3], np.int64)}, {}),
    ("transpose", "SHUFFLE", "Transpose", {"x": randn(2, 3, 4, 5)}, {}, {"perm": [0, 2, 3, 1]}),
    ("unsqueeze", "UNSQUEEZE", "Unsqueeze", {"x": x3}, {"axes": np.array([0, -1], np.int64)}, {}),
    ("squeeze", "SQUEEZE", "Squeeze", {"x": randn(2, 1, 6, 1)}, {"axes": np.array([1, -1], np.int64)}, {}),
    *[(f"concat-axis{axis}", "CONCATENATION", "Concat", {"a": x3, "b": x3 + 1, "c": x3 * 2}, {},
       {"axis": axis}) for axis in (0, 1, -1)],
    ("shape", "SHAPE", "Shape", {"x": x3}, {}, {}),
    ("slice-static", "SLICE", "Slice", {"x": randn(4, 10, 6)},
     {"starts": np.array([1, -8], np.int64), "ends": np.array([9, 6], np.int64),
      "axes": np.array([1, 2], np.int64), "steps": np.array([3, 1], np.int64)}, {}),
    ("slice-reverse", "SLICE", "Slice", {"x": randn(4, 10)},
     {"starts": np.array([-2], np.int64), "ends": np.array([0], np.int64), "axes": np.array([1], np.int64),
      "steps": np.array([-2], np.int64)}, {}),
    ("slice-dynamic", "SLICE", "Slice", {"x": randn(4, 10), "starts": np.array([1, 2], np.int64),
                                         "ends": np.array([3, 9], np.int64)}, {}, {}),
    ("gather-scalar", "GATHER", "Gather", {"x": randn(7, 3)}, {"i": np.array(5, np.int64)}, {}),
    ("gather", "GATHER", "Gather", {"x": randn(7, 3), "i": np.array([[0, 6], [2, 2]], np.int64)}, {}, {}),
    ("gather-axis1", "GATHER", "Gather", {"x": x3, "i": np.array([4, 0, 3], np.int64)}, {}, {"axis": 1}),
    ("gather-elements", "GATHER", "GatherElements",
     {"x": randn(3, 8), "i": np.array([[7, 0, 7], [1, 1, 2], [0, 5, 3]], np.int64)}, {}, {"axis": 1}),
    ("scatter-elements", "SCATTER", "ScatterElements",
     {"x": randn(3, 8), "i": np.array([[7, 0, 2], [1, 3, 2], [0, 5, 6]], np.int64), "u": randn(3, 3)}, {},
     {"axis": 1}),
    ("where-broadcast", "SELECT", "Where", {"c": np.array([[True], [False], [True]]), "a": randn(3, 4),
                                            "b": randn(1, 4)}, {}, {}),
    ("topk-largest-ties", "TOPK", "TopK", {"x": ties}, {"k": np.array([4], np.int64)}, {}),
    ("topk-smallest-ties", "TOPK", "TopK", {"x": ties}, {"k": np.array([3], np.int64)}, {"largest": 0}),
    ("topk-axis0", "TOPK", "TopK", {"x": x3}, {"k": np.array([2], np.int64)}, {"axis": 0}),
    *[(f"softmax-axis{axis}", "SOFTMAX", "Softmax", {"x": x3 * 3}, {}, {"axis": axis}) for axis in (-1, 1)],
    ("conv1d-depthwise", "CONVOLUTION", "Conv", {"x": randn(2, 8, 10)}, {"w": randn(8, 1, 4)}, {"group": 8}),
    ("conv2d-pads-strides-bias", "CONVOLUTION", "Conv", {"x": randn(2, 4, 9, 8)},
     {"w": randn(6, 2, 3, 2), "b": randn(6)},
     {"group": 2, "pads": [1, 0, 2, 1], "strides": [2, 1], "dilations": [1, 2]}),
    ("range", "FILL", "Range", {"start": np.array(3, np.int64), "limit": np.array(17, np.int64),
                                "delta": np.array(2, np.int64)}, {}, {}),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_layer_matches_onnxruntime(case, tmp_path: Path) -> None:
    _, layer_type, op, feeds, constants, attrs = case
    outputs = ["values", "indices"] if op == "TopK" else ["y"]
    path = one_node(tmp_path, op, feeds, outputs, constants, **attrs)
    assert_matches_onnxruntime(path, feeds, layer_type)


def test_slice_with_a_computed_end_matches_onnxruntime(tmp_path: Path) -> None:
    """Constant start, computed end: the parser clamps start and size in shape arithmetic."""
    feeds = {"x": randn(4, 10), "like": randn(7)}
    nodes = [helper.make_node("Shape", ["like"], ["end"]),
             helper.make_node("Slice", ["x", "start", "end", "axis"], ["y"])]
    constants = [numpy_helper.from_array(np.array([2], np.int64), "start"),
                 numpy_helper.from_array(np.array([1], np.int64), "axis")]
    inputs = [helper.make_tensor_value_info("x", F32, ["a", "b"]),
              helper.make_tensor_value_info("like", F32, ["c"])]
    graph = helper.make_graph(nodes, "slice", inputs, [helper.make_tensor_value_info("y", F32, None)],
                              constants)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)]), tmp_path / "m.onnx")
    assert_matches_onnxruntime(tmp_path / "m.onnx", feeds, "SLICE")


def test_expand_is_a_slice_of_stride_zero(tmp_path: Path) -> None:
    """ONNX Expand (broadcast) becomes a SLICE whose stride is 0 along the broadcast axes."""
    feeds = {"x": randn(3, 1), "like": randn(2, 3, 4)}
    nodes = [helper.make_node("Shape", ["like"], ["shape"]),
             helper.make_node("Expand", ["x", "shape"], ["y"])]
    inputs = [helper.make_tensor_value_info("x", F32, ["a", "b"]),
              helper.make_tensor_value_info("like", F32, ["c", "d", "e"])]
    graph = helper.make_graph(nodes, "expand", inputs, [helper.make_tensor_value_info("y", F32, None)])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)]), tmp_path / "m.onnx")
    net = parse_network(tmp_path / "m.onnx")
    layer = next(net.network.get_layer(i) for i in range(net.network.num_layers)
                 if net.network.get_layer(i).type.name == "SLICE")
    assert layer.get_input(1) is None  # the start is static, the size and stride computed
    assert_matches_onnxruntime(tmp_path / "m.onnx", feeds, "SLICE")


def test_bfloat16_constant_is_read_from_the_onnx_file(tmp_path: Path) -> None:
    """TensorRT gives no buffer for bfloat16 weights: the evaluator reads the initializer (here in
    external data, as exports store it) by the constant layer's name."""
    values = torch.randn(3, 4).to(torch.bfloat16)
    weight = numpy_helper.from_array(values.view(torch.int16).numpy().view(np.uint16), "w")
    weight.data_type = TensorProto.BFLOAT16
    x = randn(3, 4)
    nodes = [helper.make_node("Cast", ["w"], ["w32"], to=F32), helper.make_node("Add", ["x", "w32"], ["y"])]
    graph = helper.make_graph(nodes, "bf16", [helper.make_tensor_value_info("x", F32, ["a", "b"])],
                              [helper.make_tensor_value_info("y", F32, None)], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    onnx.save(model, tmp_path / "model.onnx", save_as_external_data=True, size_threshold=0,
              location="model.onnx.data")
    assert_matches_onnxruntime(tmp_path / "model.onnx", {"x": x}, "CONSTANT")
    np.testing.assert_array_equal(evaluate_network(tmp_path, {"x": x})["y"], x + values.float().numpy())
    net = parse_network(tmp_path / "model.onnx")
    layer = next(net.network.get_layer(i) for i in range(net.network.num_layers)
                 if net.network.get_layer(i).get_output(0).dtype == net.trt.DataType.BF16)
    assert layer.type.name == "CONSTANT" and layer.name == "w"


def test_kv_cache_update_matches_onnxruntime(tmp_path: Path) -> None:
    """ONNX TensorScatter (opset 24, the export's in-place cache write) -> KV_CACHE_UPDATE."""
    past, update = randn(3, 1, 16, 8), randn(3, 1, 4, 8)
    feeds = {"past": past, "update": update, "write_indices": np.array([0, 5, 12], np.int64)}
    node = helper.make_node("TensorScatter", list(feeds), ["present"], axis=-2, mode="linear")
    graph = helper.make_graph(
        [node], "scatter",
        [helper.make_tensor_value_info("past", F32, ["b", 1, 16, 8]),
         helper.make_tensor_value_info("update", F32, ["b", 1, "t", 8]),
         helper.make_tensor_value_info("write_indices", I64, ["b"])],
        [helper.make_tensor_value_info("present", F32, ["b", 1, 16, 8])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    onnx.save(model, tmp_path / "model.onnx")
    assert_matches_onnxruntime(tmp_path / "model.onnx", feeds, "KV_CACHE_UPDATE")


def _k3_node(folder: Path, op: str, inputs: dict[str, np.ndarray], outputs: list[str], **attrs) -> Path:
    return one_node(folder, op, inputs, outputs, domain="k3", plugin_namespace="k3", plugin_version="1",
                    **attrs)


def test_dynamic_reshape_matches_onnxruntime(tmp_path: Path) -> None:
    """A Reshape to a computed shape: the SHUFFLE takes its dims as input 1 (a shape tensor)."""
    feeds = {"x": x3, "like": randn(5, 2, 6)}
    nodes = [helper.make_node("Shape", ["like"], ["shape"]),
             helper.make_node("Reshape", ["x", "shape"], ["y"])]
    inputs = [helper.make_tensor_value_info(n, F32, ["a", "b", "c"]) for n in feeds]
    graph = helper.make_graph(nodes, "reshape", inputs, [helper.make_tensor_value_info("y", F32, None)])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)]), tmp_path / "m.onnx")
    net = parse_network(tmp_path / "m.onnx")
    shuffle = next(net.network.get_layer(i) for i in range(net.network.num_layers)
                   if net.network.get_layer(i).type.name == "SHUFFLE")
    assert shuffle.num_inputs == 2
    assert_matches_onnxruntime(tmp_path / "m.onnx", feeds, "SHUFFLE")


def test_kda_plugin_matches_its_onnx_function(tmp_path: Path) -> None:
    """A PLUGIN_V3 layer runs torch.ops.k3.kda; ONNX Runtime runs the node's ONNX function body."""
    for T in (1, 5):  # decode (the recurrence) and prefill (the chunked form)
        names = ("q", "k", "v", "g", "beta", "initial_state")
        feeds = {n: t.numpy() for n, t in zip(names, kda_inputs(2, T, 2, 8, 8, torch.float32, seed=T),
                                             strict=True)}
        path = _k3_node(tmp_path, "KDA", feeds, ["o", "final_state"])
        assert_matches_onnxruntime(path, feeds, "PLUGIN_V3")


def test_kda_prepare_plugin_matches_its_onnx_function(tmp_path: Path) -> None:
    """A KDAPrepare layer runs torch.ops.k3.kda_prepare (the eager chunked form's terms); ONNX Runtime runs
    the node's function (the differences and the inverse as products): a partial chunk and two."""
    for T in (5, 17):
        names = ("q", "k", "v", "g", "beta")
        feeds = {n: t.numpy() for n, t in zip(names, kda_inputs(2, T, 2, 8, 8, torch.float32, seed=T)[:5],
                                             strict=True)}
        path = _k3_node(tmp_path, "KDAPrepare", feeds, ["qg", "kt", "w", "u", "a_qk", "decay_last"])
        assert_matches_onnxruntime(path, feeds, "PLUGIN_V3")


def test_latent_mla_plugin_matches_its_onnx_function(tmp_path: Path) -> None:
    q, kv = randn(2, 3, 4, 16), randn(2, 1, 12, 16)
    feeds = {"q": q, "kv": kv, "cache_lengths": np.array([0, 6], np.int64)}
    path = _k3_node(tmp_path, "LatentMLA", feeds, ["o"], v_dim=8, scale=0.25)
    assert_matches_onnxruntime(path, feeds, "PLUGIN_V3")


@pytest.mark.parametrize("packed", [False, True], ids=["float", "mxfp4"])
def test_routed_experts_plugin_matches_its_onnx_function(packed: bool, tmp_path: Path) -> None:
    """A PLUGIN_V3 layer runs torch.ops.k3.routed_experts(_mxfp4) (the packed constants as int32 words,
    k3export/ops/mxfp4.py "Words", viewed back to bytes); ONNX Runtime runs the node's function body (a Loop
    over the used experts)."""
    from k3export.ops import mxfp4

    gen = torch.Generator().manual_seed(7)
    E, I, L, N = 4, 32, 32, 5
    experts = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(N)])
    feeds = {"z": randn(N, L), "experts": experts.numpy(), "weights": np.full((N, 2), 0.5, np.float32)}
    dense = {"w1": torch.randn(E, I, L, generator=gen) / 6, "w3": torch.randn(E, I, L, generator=gen) / 6,
             "w2": torch.randn(E, L, I, generator=gen) / 6}
    if packed:
        constants = {f"{w}_{part}": mxfp4.to_words(t).numpy() for w, tensor in dense.items()
                     for part, t in zip(("packed", "scale"), mxfp4.quantize(tensor), strict=True)}
    else:
        constants = {w: t.numpy() for w, t in dense.items()}
    op = "RoutedExpertsMXFP4" if packed else "RoutedExperts"
    path = one_node(tmp_path, op, feeds, ["u"], constants, domain="k3", plugin_namespace="k3",
                    plugin_version="1", situ_beta=4.0, situ_linear_beta=25.0)
    assert_matches_onnxruntime(path, feeds, "PLUGIN_V3")


def test_loop_matches_onnxruntime(tmp_path: Path) -> None:
    """ONNX Loop (as the inlined RoutedExperts function has it: a trip count, a condition carried
    through Identity, a loop-carried sum) -> TRIP_LIMIT COUNT and WHILE, RECURRENCE, LOOP_OUTPUT."""
    body = helper.make_graph(
        [helper.make_node("Gather", ["x", "i"], ["row"], axis=0),
         helper.make_node("Mul", ["row", "row"], ["square"]),
         helper.make_node("Add", ["s_in", "square"], ["s_out"]),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "body", [helper.make_tensor_value_info("i", I64, []),
                 helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
                 helper.make_tensor_value_info("s_in", F32, None)],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("s_out", F32, None)])
    true = helper.make_tensor("t", TensorProto.BOOL, [], [True])
    nodes = [helper.make_node("Constant", [], ["true"], value=true),
             helper.make_node("Loop", ["count", "true", "s0"], ["s"], body=body)]
    inputs = [helper.make_tensor_value_info("count", I64, []),
              helper.make_tensor_value_info("x", F32, ["n", 4]),
              helper.make_tensor_value_info("s0", F32, [4])]
    graph = helper.make_graph(nodes, "loop", inputs, [helper.make_tensor_value_info("s", F32, [4])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)]), tmp_path / "m.onnx")
    net = parse_network(tmp_path / "m.onnx")
    types = {net.network.get_layer(i).type.name for i in range(net.network.num_layers)}
    assert {"TRIP_LIMIT", "RECURRENCE", "LOOP_OUTPUT", "IDENTITY"} <= types
    for count in (3, 1):
        feeds = {"count": np.array(count, np.int64), "x": randn(5, 4), "s0": randn(4)}
        assert_matches_onnxruntime(tmp_path / "m.onnx", feeds, "LOOP_OUTPUT")


def test_every_implemented_layer_type_is_tested() -> None:
    # IDENTITY: in the loop; DIST_COLLECTIVE: two ranks' networks together under torchrun
    # (tests/test_parallel_export.py).
    tested = {c[1] for c in CASES} | {"KV_CACHE_UPDATE", "PLUGIN_V3", "IDENTITY", "DIST_COLLECTIVE"}
    assert tested == set(LAYERS)


def test_unimplemented_mode_is_an_error_naming_it(tmp_path: Path) -> None:
    path = one_node(tmp_path, "ReduceProd", {"x": x3}, ["y"], {"axes": np.array([1], np.int64)})
    with pytest.raises(NotImplementedLayer, match="REDUCE PROD is not implemented"):
        NetworkEvaluator(parse_network(path)).evaluate({"x": x3})


# ---- the k3-tiny exports' whole networks against the eager model


def test_float32_network_matches_eager(tiny_export: Path, capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """`k3export check --network`: prefill and 3 decode steps, logits within 1e-4 of eager. The
    network, its parser (which owns the weights), its builder and the constants read from it are
    freed before the eager side runs (it follows the network's every step), so that the eager side
    has the host's memory to itself: weak references to each are dead by then."""
    held, when_eager_runs = [], []

    def close(net: ParsedNetwork) -> None:
        held.extend(weakref.ref(x) for x in (net.network, *net.keep_alive[1:], *net.constants.values()))
        closing(net)

    closing = ParsedNetwork.close
    monkeypatch.setattr(ParsedNetwork, "close", close)
    run = EagerSide.run

    def eager_run(side: EagerSide, *args: Any) -> Any:
        gc.collect()
        when_eager_runs.append([ref() for ref in held])
        return run(side, *args)

    monkeypatch.setattr(EagerSide, "run", eager_run)
    assert main(["check", "--network", str(tiny_export), "--steps", "3", "--json"]) == 0
    assert len(when_eager_runs) == 1 and len(held) > 100  # network, builder, parser, the constants
    assert not any(when_eager_runs[0])
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and len(report["steps"]) == 4
    for step in report["steps"]:
        logits = next(c for c in step["outputs"] if c["name"] == "logits")
        assert logits["rel"] < 1e-4
    assert report["greedy_streams_identical"]
    assert report["network"]["layers"] > 1000


def test_float32_network_fails_with_a_scaled_weight(tiny_export: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    scaled = scaled_copy(tiny_export, tmp_path / "scaled", PERTURBED, 1.5)
    assert main(["check", "--network", str(scaled), "--steps", "0"]) == 1
    verdict = capsys.readouterr().out.strip().splitlines()[-1]
    assert verdict.startswith("FAILED: ") and "present.0.kda_state" in verdict and "logits" in verdict


def _layers(net, layer_type: str) -> list:
    found = []
    for i in range(net.network.num_layers):
        layer = net.network.get_layer(i)
        if layer.type.name == layer_type:
            found.append(layer)
    return found


def test_network_altered_after_parsing_fails(tiny_export: Path) -> None:
    """The evaluator runs what the parser produced: change a plugin's field, or swap the axes of a
    shuffle's permutation, in the parsed network and the check fails."""
    net = parse_network(tiny_export / "model.onnx")
    mla = _layers(net, "PLUGIN_V3")
    for layer in mla:
        layer.__class__ = net.trt.IPluginV3Layer
    plugin = next(p for p in (layer.plugin.get_capability_interface(net.trt.PluginCapabilityType.CORE)
                              for layer in mla) if p.plugin_name == "LatentMLASplits")
    plugin.fields["scale"] *= 2
    report = run_network_check(tiny_export, steps=0, log=lambda line: None, net=net)
    assert not report["passed"] and "logits" in report["failed_outputs"]

    net = parse_network(tiny_export / "model.onnx")
    # A square weight matrix's shuffle: transposing it keeps every shape, only the values move.
    for layer in _layers(net, "SHUFFLE"):
        layer.__class__ = net.trt.IShuffleLayer
        shape = tuple(layer.get_input(0).shape)
        if len(shape) == 2 and shape[0] == shape[1] > 1 and tuple(layer.first_transpose)[:2] == (0, 1):
            layer.first_transpose = (1, 0)
            break
    else:
        pytest.fail("no shuffle of a square matrix in the network")
    report = run_network_check(tiny_export, steps=0, log=lambda line: None, net=net)
    assert not report["passed"] and "logits" in report["failed_outputs"]
