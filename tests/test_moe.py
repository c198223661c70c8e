"""The routed-experts ops against a per-token loop written here, the MXFP4 form against
dequantise-then-dense, and the model's MoE with packed experts against the same model unpacked."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from reference import rel_error
from torch import Tensor

import k3export.ops  # noqa: F401  (registers torch.ops.k3.*)
from k3export.errors import UserError
from k3export.onnx.domain import DOMAIN
from k3export.ops import mxfp4

E, I, L = 8, 64, 32
BETA, LINEAR_BETA = 4.0, 25.0


def experts_weights(dtype: torch.dtype, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w1, w3 = (torch.randn(E, I, L, generator=gen, dtype=torch.float64) * L**-0.5 for _ in range(2))
    w2 = torch.randn(E, L, I, generator=gen, dtype=torch.float64) * I**-0.5
    return w1.to(dtype), w3.to(dtype), w2.to(dtype)


def per_token_loop(z: Tensor, experts: Tensor, weights: Tensor, w1: Tensor, w3: Tensor, w2: Tensor) -> Tensor:
    """u[n] = sum_j weights[n, j] w2[e] SiTU-GLU(w1[e] z[n], w3[e] z[n]), one token and slot at a time,
    in float64, with SiTU-GLU written out from its definition."""
    z, w1, w3, w2, weights = (t.double() for t in (z, w1, w3, w2, weights))
    u = torch.zeros(z.shape, dtype=torch.float64)
    for n in range(z.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[n, j])
            a, b = w1[e] @ z[n], w3[e] @ z[n]
            h = BETA * torch.tanh(a / BETA) * torch.sigmoid(a) * LINEAR_BETA * torch.tanh(b / LINEAR_BETA)
            u[n] += weights[n, j] * (w2[e] @ h)
    return u


def routing(case: str, N: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """experts [N, k] int64 and renormalised weights [N, k] float32 for one routing pattern."""
    if case == "random":
        experts = torch.rand(N, E, generator=gen).argsort(-1)[:, :3]
    elif case == "top1":
        experts = torch.randint(0, E, (N, 1), generator=gen)
    elif case == "unused_experts":  # experts 0, 2, 3, 4, 6, 7 receive no token
        experts = torch.tensor([1, 5]).repeat(N, 1)
    elif case == "one_expert":  # every token on expert 6, k = 1
        experts = torch.full((N, 1), 6)
    elif case == "ties":  # what a router gives when every score ties: the lowest indices, equal weights
        experts = torch.arange(4).repeat(N, 1)
        return experts, torch.full((N, 4), 0.25)
    else:
        raise AssertionError(case)
    weights = torch.rand(experts.shape, generator=gen)
    return experts, weights / weights.sum(-1, keepdim=True)


@pytest.mark.parametrize("case", ["random", "top1", "unused_experts", "one_expert", "ties"])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_routed_experts_matches_per_token_loop(case, dtype, tol):
    gen = torch.Generator().manual_seed(1)
    N = 13
    z = torch.randn(N, L, generator=gen, dtype=torch.float64).to(dtype)
    experts, weights = routing(case, N, gen)
    w1, w3, w2 = experts_weights(dtype)
    u = torch.ops.k3.routed_experts(z, experts, weights, w1, w3, w2, BETA, LINEAR_BETA)
    assert u.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert u.shape == (N, L)
    assert rel_error(u, per_token_loop(z, experts, weights, w1, w3, w2)) < tol


def test_routed_experts_half_precision_accumulates_in_float32():
    """bfloat16 tokens and experts: matmuls in bfloat16, u float32 (within bf16 rounding of the loop)."""
    gen = torch.Generator().manual_seed(2)
    z = torch.randn(9, L, generator=gen).bfloat16()
    experts, weights = routing("random", 9, gen)
    w1, w3, w2 = experts_weights(torch.bfloat16)
    u = torch.ops.k3.routed_experts(z, experts, weights, w1, w3, w2, BETA, LINEAR_BETA)
    assert u.dtype == torch.float32
    assert rel_error(u, per_token_loop(z, experts, weights, w1, w3, w2)) < 2e-2


def test_a_token_routed_twice_to_one_expert_gets_both_contributions():
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(2, L, generator=gen, dtype=torch.float64)
    experts, weights = torch.tensor([[2, 2], [2, 5]]), torch.tensor([[0.25, 0.75], [0.5, 0.5]])
    w1, w3, w2 = experts_weights(torch.float64)
    u = torch.ops.k3.routed_experts(z, experts, weights, w1, w3, w2, BETA, LINEAR_BETA)
    torch.testing.assert_close(u, per_token_loop(z, experts, weights, w1, w3, w2))


def packed_experts(seed: int = 0) -> tuple[Tensor, ...]:
    """MXFP4 experts (packed, scale for w1, w3, w2) quantised from random weights."""
    return tuple(t for w in experts_weights(torch.float32, seed) for t in mxfp4.quantize(w))


def dense_reference(z: Tensor, experts: Tensor, weights: Tensor, packed: tuple[Tensor, ...]) -> Tensor:
    """Dequantise every expert, run every expert on every token, select by a combine matrix."""
    w1, w3, w2 = (mxfp4.dequantize(packed[i], packed[i + 1], z.dtype) for i in (0, 2, 4))
    combine = torch.zeros(z.shape[0], E, dtype=torch.float64).scatter_add(1, experts, weights.double())
    a, b = z @ w1.transpose(1, 2), z @ w3.transpose(1, 2)  # [E, N, I]
    h = BETA * torch.tanh(a / BETA) * torch.sigmoid(a) * LINEAR_BETA * torch.tanh(b / LINEAR_BETA)
    return ((h @ w2.transpose(1, 2)).double() * combine.T[..., None]).sum(0)


@pytest.mark.parametrize("case", ["random", "top1", "unused_experts", "one_expert"])
def test_routed_experts_mxfp4_matches_dequantise_then_dense(case):
    gen = torch.Generator().manual_seed(4)
    z = torch.randn(11, L, generator=gen)
    experts, weights = routing(case, 11, gen)
    packed = packed_experts()
    u = torch.ops.k3.routed_experts_mxfp4(z, experts, weights, *packed, BETA, LINEAR_BETA)
    assert u.dtype == torch.float32
    assert rel_error(u, dense_reference(z, experts, weights, packed)) < 1e-6


def test_routed_experts_mxfp4_dequantises_only_the_experts_used(monkeypatch):
    calls = []
    dequantize = mxfp4.dequantize

    def counting(packed: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
        calls.append(packed.shape)
        return dequantize(packed, scale, dtype)

    monkeypatch.setattr(mxfp4, "dequantize", counting)
    gen = torch.Generator().manual_seed(5)
    experts, weights = routing("unused_experts", 6, gen)
    torch.ops.k3.routed_experts_mxfp4(torch.randn(6, L, generator=gen), experts, weights, *packed_experts(),
                                      BETA, LINEAR_BETA)
    # Experts 1 and 5, three projections each, one expert's slice at a time, each once.
    assert sorted(calls) == sorted([(I, L // 2), (I, L // 2), (L, I // 2)] * 2)


@pytest.mark.parametrize("packed", [False, True], ids=["float", "mxfp4"])
@pytest.mark.parametrize("ranks", [2, 4])
def test_expert_slices_with_offsets_sum_to_the_whole(packed, ranks):
    """Expert parallelism's contract: rank r holds experts [rE/N, (r+1)E/N) with expert_offset rE/N and
    the router's model-wide indices; its u has only the pairs routed to its experts, and the ranks' u
    sum to the unsplit op's."""
    gen = torch.Generator().manual_seed(6)
    z = torch.randn(10, L, generator=gen, dtype=torch.float64)
    experts, weights = routing("random", 10, gen)
    if packed:
        op, stacked = torch.ops.k3.routed_experts_mxfp4, packed_experts()
    else:
        op, stacked = torch.ops.k3.routed_experts, experts_weights(torch.float64)
    whole = op(z, experts, weights, *stacked, BETA, LINEAR_BETA)
    share = E // ranks
    parts = [op(z, experts, weights, *(t[r * share:(r + 1) * share] for t in stacked), BETA, LINEAR_BETA,
                r * share) for r in range(ranks)]
    assert rel_error(sum(parts), whole) < 1e-12
    # Rank 0's part: the unsplit op with the other ranks' pairs weighted 0.
    mine = torch.where(experts < share, weights, 0.0)
    torch.testing.assert_close(parts[0], op(z, experts, mine, *stacked, BETA, LINEAR_BETA))


@pytest.mark.parametrize(("experts", "message"), [
    (torch.tensor([[-1, 2]]), "expert indices span -1..2; expected indices >= 0"),
    (torch.tensor([[0, 1, 2]]), "expected both"),
    (torch.tensor([[0, 1]], dtype=torch.int32), "torch.int64"),
])
def test_bad_routing_is_refused(experts, message):
    w1, w3, w2 = experts_weights(torch.float32)
    with pytest.raises(UserError, match=message):
        torch.ops.k3.routed_experts(torch.zeros(1, L), experts, torch.full((1, 2), 0.5), w1, w3, w2,
                                    BETA, LINEAR_BETA)


@torch.no_grad()
def test_packed_moe_equals_the_moe_with_dequantised_experts(tiny_config):
    """The model's MoE layer after keep_packed() (routed_experts_mxfp4) against the same layer
    holding the dequantised weights (routed_experts)."""
    from k3export.model.moe import LatentMoE

    torch.manual_seed(0)
    dense = LatentMoE(tiny_config)
    for p in dense.parameters():
        p.normal_(0, 0.1)
    packed = LatentMoE(tiny_config)
    packed.load_state_dict(dense.state_dict())
    packed.experts.keep_packed()
    for name in packed.experts.PROJECTIONS:
        weight_packed, weight_scale = mxfp4.quantize(getattr(dense.experts, name))
        getattr(packed.experts, f"{name}_packed").copy_(weight_packed)
        getattr(packed.experts, f"{name}_scale").copy_(weight_scale)
        getattr(dense.experts, name).copy_(mxfp4.dequantize(weight_packed, weight_scale, torch.float32))
    x = torch.randn(2, 5, tiny_config.hidden_size)
    torch.testing.assert_close(packed(x), dense(x), rtol=0, atol=0)


class RoutedExpertsModule(torch.nn.Module):
    """The op on stacked experts held as parameters (export_onnx writes a module without any as a graph
    with its weights as inputs)."""

    def __init__(self, tensors: tuple[Tensor, ...], packed: bool, expert_offset: int = 0) -> None:
        super().__init__()
        self.packed, self.expert_offset = packed, expert_offset
        for i, t in enumerate(tensors):
            setattr(self, f"t{i}", torch.nn.Parameter(t, requires_grad=False))

    def forward(self, z: Tensor, experts: Tensor, weights: Tensor) -> Tensor:
        tensors = [getattr(self, f"t{i}") for i in range(6 if self.packed else 3)]
        op = torch.ops.k3.routed_experts_mxfp4 if self.packed else torch.ops.k3.routed_experts
        return op(z, experts, weights, *tensors, BETA, LINEAR_BETA, self.expert_offset)


def onnx_tensors(packed: bool, dtype: torch.dtype) -> tuple[Tensor, ...]:
    return packed_experts() if packed else experts_weights(dtype)


@pytest.fixture(scope="module")
def onnx_models(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[bool, torch.dtype], Path]:
    """One export per form (plain, packed) and token dtype, at example shapes other than those tested."""
    from k3export.onnx.ops import export_onnx

    folder = tmp_path_factory.mktemp("moe_onnx")
    models = {}
    for packed, dtype in ((False, torch.float32), (False, torch.float16), (True, torch.float32)):
        gen = torch.Generator().manual_seed(0)
        experts, weights = routing("random", 5, gen)
        path = folder / f"moe_{packed}_{str(dtype).removeprefix('torch.')}.onnx"
        export_onnx(RoutedExpertsModule(onnx_tensors(packed, dtype), packed).eval(),
                    (torch.randn(5, L, generator=gen).to(dtype), experts, weights), path,
                    dynamic_shapes=({0: "tokens"}, {0: "tokens", 1: "top_k"}, {0: "tokens", 1: "top_k"}))
        models[packed, dtype] = path
    return models


def rank_module(packed: bool) -> RoutedExpertsModule:
    """Experts 4 .. 7 of 8, as rank 1 of 2 holds them (expert_offset 4)."""
    return RoutedExpertsModule(tuple(t[E // 2:] for t in onnx_tensors(packed, torch.float32)), packed, E // 2)


@pytest.fixture(scope="module")
def rank_onnx_models(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Path]:
    """The op on a rank's half of the experts, plain and packed."""
    from k3export.onnx.ops import export_onnx

    folder = tmp_path_factory.mktemp("moe_rank_onnx")
    gen = torch.Generator().manual_seed(0)
    experts, weights = routing("random", 5, gen)
    models = {}
    for packed in (False, True):
        models[packed] = folder / f"moe_rank_{packed}.onnx"
        export_onnx(rank_module(packed).eval(), (torch.randn(5, L, generator=gen), experts, weights),
                    models[packed],
                    dynamic_shapes=({0: "tokens"}, {0: "tokens", 1: "top_k"}, {0: "tokens", 1: "top_k"}))
    return models


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize(("case", "N"), [("random", 7), ("unused_experts", 9), ("top1", 1)])
def test_onnx_function_of_a_rank_of_experts_matches_eager(rank_onnx_models, packed, case, N):
    """A rank's node (expert_offset 4) runs only the pairs routed to experts 4 .. 7."""
    import onnxruntime as ort

    model = onnx.load(rank_onnx_models[packed])
    onnx.checker.check_model(model, full_check=True)
    node = next(n for n in model.graph.node if n.op_type == "RoutedExpertsGroup")  # the offset's one node
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attributes["expert_offset"] == E // 2 and attributes["plugin_version"] == b"1"
    gen = torch.Generator().manual_seed(N)
    z = torch.randn(N, L, generator=gen)
    experts, weights = routing(case, N, gen)
    session = ort.InferenceSession(rank_onnx_models[packed], providers=["CPUExecutionProvider"])
    (u,) = session.run(None, {"z": z.numpy(), "experts": experts.numpy(), "weights": weights.numpy()})
    expected = rank_module(packed)(z, experts, weights)
    if not (experts >= E // 2).any():
        assert not expected.any() and not u.any()
    else:
        assert rel_error(torch.from_numpy(u), expected) < 1e-6


@pytest.mark.parametrize("packed", [False, True])
def test_grouped_nodes_and_their_functions(onnx_models, packed):
    """The op as three plugin nodes (the pairs grouped by expert, gate/up, down: each one AOT launch in full
    TensorRT), their intermediates graph tensors, then the slots' weighted sum in standard ops."""
    path = onnx_models[packed, torch.float32]
    onnx.checker.check_model(path, full_check=True)
    model = onnx.load(path)
    form = "MXFP4" if packed else ""
    plugin = {"plugin_namespace": b"k3", "plugin_version": b"1"}
    expected = {"RoutedExpertsGroup": {**plugin, "num_experts": E, "expert_offset": 0},
                "RoutedExpertsGateUp" + form: {**plugin, "situ_beta": BETA, "situ_linear_beta": LINEAR_BETA},
                "RoutedExpertsDown" + form: plugin}
    nodes = [n for n in model.graph.node if n.domain == "k3"]
    assert [n.op_type for n in nodes] == list(expected)
    for node in nodes:
        assert {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute} == expected[node.op_type]
    group, gate_up, down = nodes
    assert list(gate_up.input[1:3]) == list(group.output[:2]) and down.input[:2] == [gate_up.output[0],
                                                                                      group.output[1]]
    types = {v.name: v.type.tensor_type.elem_type for v in model.graph.value_info}
    intermediates = [*group.output, *gate_up.output, *down.output]
    assert [types[n] for n in intermediates] == [onnx.TensorProto.INT32] * 3 + [onnx.TensorProto.FLOAT] * 2
    assert sorted((f.domain, f.name) for f in model.functions) == sorted(("k3", n) for n in expected)
    # The packed experts stay packed in the file, as int32 words: no float copy of them anywhere.
    stored = {t.name: t for t in model.graph.initializer}
    weights = [*gate_up.input[3:], *down.input[2:]]
    expected = onnx.TensorProto.INT32 if packed else onnx.TensorProto.FLOAT
    assert [stored[n].data_type for n in weights] == [expected] * (6 if packed else 3)
    assert all(np.prod(t.dims) <= 1 for n, t in stored.items() if n not in weights)  # the sum's constants


def decode_words(words: np.ndarray, rows: int) -> np.ndarray:
    """int32 words [E, n] -> bytes [E, rows, 4n / rows], written out: byte 4j + b of an expert is
    bits 8b .. 8b + 7 of its word j (little-endian), the words taken as unsigned."""
    unsigned = words.astype(np.int64) % (1 << 32)
    out = np.zeros((words.shape[0], 4 * words.shape[1]), dtype=np.int64)
    for b in range(4):
        out[:, b::4] = (unsigned >> (8 * b)) % 256
    return out.reshape(words.shape[0], rows, -1).astype(np.uint8)


def test_packed_experts_are_stored_as_words_of_their_bytes(onnx_models):
    """Each packed tensor is int32 [E, O*n/4] whose words hold the checkpoint's bytes in order."""
    model = onnx.load(onnx_models[True, torch.float32])
    gate_up, down = (next(n for n in model.graph.node if n.op_type == f"RoutedExperts{op}MXFP4")
                     for op in ("GateUp", "Down"))
    names = [*gate_up.input[3:], *down.input[2:]]
    stored = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    for name, expected in zip(names, packed_experts(), strict=True):
        words = stored[name]
        assert words.dtype == np.int32 and words.shape == (E, expected[0].numel() // 4)
        np.testing.assert_array_equal(decode_words(words, expected.shape[1]), expected.numpy())
    # [E, O*I/8] codes and [E, O*I/128] scales: w1 / w3 [I, L], w2 [L, I].
    assert [stored[n].shape for n in names] == [(E, I * L // 8), (E, I * L // 128)] * 3


def test_packed_experts_without_weights_are_word_inputs(tmp_path):
    """Exported without weights (meta), the packed experts are graph inputs: declared as int32 words
    of their shapes too, and the file passes the full check."""
    from k3export.onnx.moe import packed_experts_as_words
    from k3export.onnx.ops import export_onnx

    module = RoutedExpertsModule(tuple(t.to("meta") for t in packed_experts()), True).eval()
    gen = torch.Generator().manual_seed(0)
    experts, weights = routing("random", 5, gen)
    path = tmp_path / "meta.onnx"
    export_onnx(module, (torch.randn(5, L, generator=gen).to("meta"), experts.to("meta"), weights.to("meta")),
                path, dynamic_shapes=({0: "tokens"}, {0: "tokens", 1: "top_k"}, {0: "tokens", 1: "top_k"}))
    model = onnx.load(path)
    words = {i.name: (i.type.tensor_type.elem_type, [d.dim_value for d in i.type.tensor_type.shape.dim])
             for i in model.graph.input if i.name.startswith("t")}
    assert list(words.values()) == [(onnx.TensorProto.INT32, [E, I * L // 8]),
                                    (onnx.TensorProto.INT32, [E, I * L // 128])] * 3
    assert all(np.prod(t.dims) <= 1 for t in model.graph.initializer)  # only the slots' sum's constants
    onnx.checker.check_model(path, full_check=True)
    assert packed_experts_as_words(path) == []  # already words


@pytest.mark.parametrize(("packed", "dtype"), [(False, torch.float32), (False, torch.float16),
                                               (True, torch.float32)])
@pytest.mark.parametrize(("case", "N"), [("random", 1), ("random", 17), ("top1", 6), ("unused_experts", 9),
                                         ("one_expert", 4), ("ties", 3)])
def test_onnx_function_matches_eager(onnx_models, packed, dtype, case, N):
    """ONNX Runtime runs the function body (a Loop over the used experts) against the eager op."""
    import onnxruntime as ort

    gen = torch.Generator().manual_seed(N)
    z = torch.randn(N, L, generator=gen).to(dtype)
    experts, weights = routing(case, N, gen)
    session = ort.InferenceSession(onnx_models[packed, dtype], providers=["CPUExecutionProvider"])
    (u,) = session.run(None, {"z": z.numpy(), "experts": experts.numpy(), "weights": weights.numpy()})
    expected = RoutedExpertsModule(onnx_tensors(packed, dtype), packed)(z, experts, weights)
    # float16: eager runs the matmuls in float16, the function in float32.
    assert rel_error(torch.from_numpy(u), expected) < (1e-6 if dtype == torch.float32 else 5e-3)


PARSE_SCRIPT = """
import json, sys
import k3plugins.trt
from k3export.engine import build, flavours
trt = flavours.load_tensorrt()
k3plugins.trt.register(trt)
_, network, _ = build.parse(sys.argv[1], trt, trt.Logger(trt.Logger.ERROR))
print(json.dumps([network.get_layer(i).type.name for i in range(network.num_layers)]))
"""


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_rtx") is None, reason="tensorrt_rtx is not installed")
@pytest.mark.parametrize("kind", ["no_weights", "no_weights_packed"])
def test_exports_that_keep_weights_out_of_folding_parse_in_tensorrt_rtx(kind, tiny_config, tmp_path):
    """`export --no-weights` (weights as graph inputs) and `export --packed-experts` (experts as int32
    words) skip the exporter's constant folding; the shape arithmetic is folded afterwards, so
    TensorRT-RTX's parser (which wants axes and shapes as build-time constants) takes them: the plugins
    of each mixer and MoE layer (k3plugins.moe's three), no Loop (layers 2..3: each mixer kind with its
    MoE). Both at once (layers 0..2: the dense layer and two MoE layers) give MXFP4 nodes whose
    experts are int32 word inputs. Parsed in a
    subprocess: some TensorRT failures abort the process. (`--packed-experts` alone, from a checkpoint:
    test_engine.py::test_packed_experts_stay_packed parses and builds it.)"""
    from k3export.cli import main

    config = tiny_config
    if kind == "no_weights":  # layers 2..3: a KDA and an MLA layer, each with its MoE
        layers = range(2, 4)
        options = ["--preset", "k3-tiny", "--no-weights", "--layers", "2:4"]
    else:
        layers = range(3)
        options = ["--preset", "k3-tiny", "--no-weights", "--packed-experts", "--layers", "0:3"]
    assert main(["export", "--out", str(tmp_path / "out"), *options]) == 0
    path = tmp_path / "out" / "model.onnx"
    model = onnx.load(path, load_external_data=False)
    initializers = {t.name: t.data_type for t in model.graph.initializer}
    inputs = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
    if kind == "no_weights":
        weights = [name for name in inputs if name.startswith("model.")]
        assert weights and not any(name.startswith("model.") for name in initializers)
    else:
        packed = [name for name in inputs if name.endswith(("_packed", "_scale"))]
        assert len(packed) == 6 * sum(not config.is_dense(i) for i in layers)
        assert all(inputs[name] == onnx.TensorProto.INT32 for name in packed)  # words
        mxfp4_nodes = [n for n in model.graph.node if n.op_type == "RoutedExpertsGateUpMXFP4"]
        assert len(mxfp4_nodes) == len(packed) // 6
    proc = subprocess.run([sys.executable, "-c", PARSE_SCRIPT, str(path)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    parsed = json.loads(proc.stdout.strip().splitlines()[-1])
    # Every k3 node a plugin (none inlined as its function), and each mixer and MoE layer has them.
    k3_nodes = [n.op_type for n in model.graph.node if n.domain == DOMAIN]
    assert parsed.count("PLUGIN_V3") == len(k3_nodes)
    moe_layers = sum(not config.is_dense(i) for i in layers)
    assert sum(op.startswith("RoutedExperts") for op in k3_nodes) >= moe_layers
    kda_layers = sum(not config.is_mla(i) for i in layers)
    assert k3_nodes.count("KDAPrepare") == k3_nodes.count("KDAChunkRecurrence") == kda_layers
    assert sum(op == "LatentMLACombine" for op in k3_nodes) == sum(config.is_mla(i) for i in layers)
    assert "TRIP_LIMIT" not in parsed and "ITERATOR" not in parsed
