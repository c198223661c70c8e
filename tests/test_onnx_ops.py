"""ONNX lowering of the k3 ops: one custom node per call, the model-local functions, and ONNX Runtime
(which runs the functions' bodies) against the eager ops."""

from __future__ import annotations

from pathlib import Path

import onnx
import onnxruntime as ort
import pytest
import torch
from reference import kda_inputs, rel_error
from torch import Tensor

from k3export.onnx.functions import attach_functions
from k3export.onnx.ops import TRANSLATION_TABLE, export_onnx

H, K, V = 2, 16, 8  # K != V, so a transposed state cannot pass
MLA_H, MLA_D, V_DIM, SCALE = 3, 24, 16, 0.2
# float32 on both sides, different summation orders (eager prefill is chunked, ONNX a Scan).
FP32_TOL = 1e-5
# float16 q/k/v: both sides cast the same fp16 values to float32 exactly and compute in float32, so
# they differ by ~1e-6 before o is cast to fp16, where an element can land one fp16 ulp apart
# (<= 2^-10 of its value). Even if every element did, the relative error stays under 1e-3.
FP16_TOL = 1e-3
BATCH_TIME = {0: "batch", 1: "time"}


class KDAModule(torch.nn.Module):
    def forward(self, q, k, v, g, beta, initial_state):
        return torch.ops.k3.kda(q, k, v, g, beta, initial_state)


class MLAModule(torch.nn.Module):
    def forward(self, q, kv, cache_lengths):
        return torch.ops.k3.latent_mla(q, kv, cache_lengths, V_DIM, SCALE)


class CacheWriteModule(torch.nn.Module):
    """The MLA layer's cache step: write the new rows in place, then attend."""

    def forward(self, q, past, rows, cache_lengths):
        present = torch.ops.k3.tensor_scatter(past, rows, cache_lengths)
        return torch.ops.k3.latent_mla(q, present, cache_lengths, V_DIM, SCALE), present


def mla_inputs(B: int, T: int, C: int, dtype: torch.dtype, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """q [B, T, H, D], a cache kv [B, 1, C, D] of random rows (those past a row's length are
    garbage the op must not read), and per-row lengths with max(cache_lengths) + T = C."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, MLA_H, MLA_D, generator=gen)
    kv = torch.randn(B, 1, C, MLA_D, generator=gen)
    cache_lengths = torch.randint(0, C - T + 1, (B,), generator=gen)
    cache_lengths[0] = C - T
    return q.to(dtype), kv.to(dtype), cache_lengths


def export_op(op: str, dtype: torch.dtype, path: Path, aot_plugins: bool = False) -> Path:
    """One op exported at example shapes other than those tested."""
    if op == "kda":
        export_onnx(KDAModule().eval(), kda_inputs(2, 5, H, K, V, dtype), path,
                    dynamic_shapes=(*[BATCH_TIME] * 5, {0: "batch"}), aot_plugins=aot_plugins)
    else:
        export_onnx(MLAModule().eval(), mla_inputs(2, 3, 7, dtype), path,
                    dynamic_shapes=(BATCH_TIME, {0: "batch", 2: "capacity"}, {0: "batch"}),
                    aot_plugins=aot_plugins)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, torch.dtype], Path]:
    """One export per op and dtype."""
    folder = tmp_path_factory.mktemp("onnx")
    return {(op, dtype): export_op(op, dtype, folder / f"{op}_{str(dtype).removeprefix('torch.')}.onnx")
            for op in ("kda", "mla") for dtype in (torch.float32, torch.float16)}


@pytest.fixture(scope="module")
def aot_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The float32 exports with `aot_plugins=True`."""
    folder = tmp_path_factory.mktemp("onnx_aot")
    return {op: export_op(op, torch.float32, folder / f"{op}_aot.onnx", aot_plugins=True)
            for op in ("kda", "mla")}


def run_ort(path: Path, inputs: tuple[Tensor, ...]) -> list[Tensor]:
    options = ort.SessionOptions()
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    feed = {i.name: x.numpy() for i, x in zip(session.get_inputs(), inputs, strict=True)}
    return [torch.from_numpy(o) for o in session.run(None, feed)]


def node_attributes(node: onnx.NodeProto) -> dict[str, object]:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def assert_close(actual: Tensor, expected: Tensor, tol: float) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert rel_error(actual, expected) <= tol


PLUGIN = {"plugin_namespace": "k3", "plugin_version": "1"}
MLA_FIELDS = {**PLUGIN, "v_dim": V_DIM, "scale": pytest.approx(SCALE)}


@pytest.mark.parametrize(("op", "nodes"), [
    # kda as two nodes: the chunks' terms, then the recurrence over them (k3export/onnx/ops.py).
    ("kda", {"KDAPrepare": PLUGIN, "KDAChunkRecurrence": PLUGIN}),
    # latent_mla as two nodes: the splits of the cache, then their combine (k3export/onnx/ops.py).
    ("mla", {"LatentMLASplits": MLA_FIELDS, "LatentMLACombine": PLUGIN}),
])
def test_custom_nodes_and_their_functions(models, op, nodes):
    path = models[op, torch.float32]
    onnx.checker.check_model(path, full_check=True)
    model = onnx.load(path)
    custom = [n for n in model.graph.node if n.domain == "k3"]
    assert [n.op_type for n in custom] == list(nodes)
    opsets = {o.domain: o.version for o in model.opset_import}
    assert opsets["k3"] == 1
    functions = {f.name: f for f in model.functions}
    assert sorted(functions) == sorted(nodes) and {f.domain for f in model.functions} == {"k3"}
    for node in custom:
        attributes = nodes[node.op_type]
        assert node_attributes(node) == {
            name: value.encode() if isinstance(value, str) else value for name, value in attributes.items()}
        function = functions[node.op_type]
        assert set(attributes) <= set(function.attribute)
        assert {o.domain: o.version for o in function.opset_import} == {"": opsets[""]}


@pytest.mark.parametrize("op", ["kda", "mla"])
def test_aot_plugins_adds_only_the_aot_attribute(models, aot_models, op):
    """`aot = 1` on the k3 nodes (the plain export has none), declared in their functions: the file stays
    valid ONNX and ONNX Runtime's output is unchanged."""
    onnx.checker.check_model(aot_models[op], full_check=True)
    plain, marked = (onnx.load(path) for path in (models[op, torch.float32], aot_models[op]))
    plain_nodes, marked_nodes = ([n for n in m.graph.node if n.domain == "k3"] for m in (plain, marked))
    for plain_node, marked_node in zip(plain_nodes, marked_nodes, strict=True):
        assert node_attributes(marked_node) == {**node_attributes(plain_node), "aot": 1}
    assert all("aot" in f.attribute for f in marked.functions)
    inputs = kda_inputs(2, 9, H, K, V, torch.float32) if op == "kda" else mla_inputs(2, 4, 11, torch.float32)
    plain_outputs = run_ort(models[op, torch.float32], inputs)
    for marked_out, plain_out in zip(run_ort(aot_models[op], inputs), plain_outputs, strict=True):
        assert torch.equal(marked_out, plain_out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("B", "T"), [(1, 1), (3, 1), (2, 37), (2, 64), (3, 100)])
def test_kda_matches_eager(models, dtype, B, T):
    inputs = kda_inputs(B, T, H, K, V, dtype, seed=T)
    o, state = run_ort(models["kda", dtype], inputs)
    o_ref, state_ref = torch.ops.k3.kda(*inputs)
    assert_close(o, o_ref, FP32_TOL if dtype == torch.float32 else FP16_TOL)
    assert_close(state, state_ref, FP32_TOL)  # the state is float32 math on both sides


def kda_prepare_model(path: Path, dtype: torch.dtype) -> Path:
    """A graph of one KDAPrepare node with its function: ONNX Runtime runs the chunk terms it writes, which
    the exported graph's KDAChunkRecurrence function does not read (it scans the token inputs)."""
    helper, f32 = onnx.helper, onnx.TensorProto.FLOAT
    x = helper.np_dtype_to_tensor_dtype(torch.empty(0, dtype=dtype).numpy().dtype)
    inputs = [helper.make_tensor_value_info(n, t, None) for n, t in
              (("q", x), ("k", x), ("v", x), ("g", f32), ("beta", f32))]
    outputs = [helper.make_tensor_value_info(n, t, None) for n, t in
               (("qg", x), ("kt", x), ("w", x), ("u", x), ("a_qk", x), ("decay_last", f32))]
    node = helper.make_node("KDAPrepare", [i.name for i in inputs], [o.name for o in outputs], domain="k3",
                            **PLUGIN)
    model = helper.make_model(helper.make_graph([node], "kda_prepare", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 24)])
    onnx.save(attach_functions(model), path)
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kda_prepare_function_matches_its_reference(tmp_path, dtype):
    """The KDAPrepare function's chunk terms (differences exp(G_i - G_j), the inverse as products) against
    torch.ops.k3.kda_prepare's (the eager chunked form's terms), whole chunks and a partial last one."""
    path = kda_prepare_model(tmp_path / "prepare.onnx", dtype)
    for T in (1, 16, 37):
        inputs = kda_inputs(2, T, H, K, V, dtype, seed=T)[:5]
        terms = run_ort(path, inputs)
        for term, expected in zip(terms, torch.ops.k3.kda_prepare(*inputs), strict=True):
            assert_close(term, expected, FP32_TOL if term.dtype == torch.float32 else FP16_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("B", "T", "C"), [(1, 1, 1), (2, 1, 300), (2, 6, 6), (1, 5, 257), (3, 70, 90)])
def test_latent_mla_matches_eager(models, dtype, B, T, C):
    inputs = mla_inputs(B, T, C, dtype, seed=C)
    (o,) = run_ort(models["mla", dtype], inputs)
    assert_close(o, torch.ops.k3.latent_mla(*inputs, V_DIM, SCALE),
                 FP32_TOL if dtype == torch.float32 else FP16_TOL)


def test_latent_mla_reads_only_valid_rows(models):
    """Rows past cache_lengths[b] + t are invisible to query t of row b: changing them (here to
    huge values, which would dominate any softmax that saw them) changes nothing, in ONNX Runtime."""
    q, kv, cache_lengths = mla_inputs(3, 4, 40, torch.float32, seed=1)
    cache_lengths = torch.tensor([36, 0, 17])
    garbage = kv.clone()
    for b, length in enumerate(cache_lengths.tolist()):
        garbage[b, :, length + 4:] = 1e4
    (o,) = run_ort(models["mla", torch.float32], (q, kv, cache_lengths))
    (o_garbage,) = run_ort(models["mla", torch.float32], (q, garbage, cache_lengths))
    torch.testing.assert_close(o_garbage, o, rtol=0, atol=0)


def test_tensor_scatter_writes_each_row_at_its_length(tmp_path):
    """k3.tensor_scatter (ONNX TensorScatter at opset 24) then k3.LatentMLA over the written cache:
    ONNX Runtime equals eager, and the present cache is the past one with row b's new rows at
    cache_lengths[b] .. (checked by indexing, independently of the op)."""
    B, T, C = 3, 5, 32
    q, past, _ = mla_inputs(B, T, C, torch.float32, seed=3)
    rows = torch.randn(B, 1, T, MLA_D, generator=torch.Generator().manual_seed(4))
    cache_lengths = torch.tensor([27, 0, 9])
    path = tmp_path / "write.onnx"
    export_onnx(CacheWriteModule().eval(), (q, past, rows, cache_lengths), path, opset_version=24,
                dynamic_shapes=(BATCH_TIME, {0: "batch"}, {0: "batch", 2: "time"}, {0: "batch"}))
    onnx.checker.check_model(path, full_check=True)
    assert "TensorScatter" in {n.op_type for n in onnx.load(path).graph.node}
    o, present = run_ort(path, (q, past, rows, cache_lengths))
    expected = past.clone()
    for b, length in enumerate(cache_lengths.tolist()):
        expected[b, 0, length:length + T] = rows[b, 0]
    torch.testing.assert_close(present, expected, rtol=0, atol=0)
    o_eager, present_eager = CacheWriteModule()(q, past, rows, cache_lengths)
    torch.testing.assert_close(present_eager, expected, rtol=0, atol=0)
    assert_close(o, o_eager, FP32_TOL)


def test_attach_functions_follows_the_model_opset():
    """The in-memory path: export without a file, attach, check, run; at a non-default opset."""
    inputs = mla_inputs(2, 3, 7, torch.float32)
    program = torch.onnx.export(MLAModule().eval(), inputs, dynamo=True, opset_version=23,
                                custom_translation_table=TRANSLATION_TABLE)
    model = attach_functions(program.model_proto)
    onnx.checker.check_model(model, full_check=True)
    assert [o.version for o in model.functions[0].opset_import if o.domain == ""] == [23]
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (o,) = session.run(None, {name: x.numpy() for name, x in zip(("q", "kv", "cache_lengths"), inputs,
                                                                  strict=True)})
    assert_close(torch.from_numpy(o), torch.ops.k3.latent_mla(*inputs, V_DIM, SCALE), FP32_TOL)
