"""TensorRT-RTX on CPU: the k3 plugins replace the ONNX functions, every MLA cache is updated by one
KV_CACHE_UPDATE layer (the graph's TensorScatter) and copied by no Concat, an engine builds for SM89
and SM120 with the prefill and decode profiles, and a missing plugin is refused with a clear message.
The cache census is shown to tell the two apart on a small hand-built graph first.

Every parse and build runs in a subprocess: some TensorRT failures abort the process."""

import importlib.util
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import onnx
import pytest
import torch
from onnx import TensorProto, helper

from k3export.artifacts import file_record
from k3export.engine.build import FUNCTION_ONLY_OPS, Limits, profile_shapes
from k3export.errors import UserError

if importlib.util.find_spec("tensorrt_rtx") is None:
    pytest.skip("tensorrt_rtx is not installed (pip install tensorrt-rtx-cu13, then "
                "python -m k3export.engine.rtx_setup)", allow_module_level=True)

# Prints, as JSON: the parsed network's summary, or the built engine's report, or the error.
SCRIPT = """
import json, sys
from dataclasses import asdict
from pathlib import Path
import k3plugins.trt
from k3export.engine import build, flavours
from k3export.errors import UserError

mode, register, export_dir = sys.argv[1], sys.argv[2] == "register", Path(sys.argv[3])
trt = flavours.load_tensorrt()
creators = k3plugins.trt.register(trt) if register else {}
try:
    if mode == "build":
        limits = build.Limits(prefill_batch=1, prefill_seq=64, decode_batch=2)
        result = asdict(build.build_engine(export_dir, sys.argv[4], trt, target=sys.argv[5], limits=limits))
    else:
        logger = trt.Logger(trt.Logger.ERROR)
        _, network, _ = build.parse(export_dir / "model.onnx", trt, logger, strict=mode == "strict")
        result = asdict(build.summarize(network, trt, creators))
except UserError as error:
    result = {"error": str(error)}
print(json.dumps(result))
"""

LOOP_LAYERS = {"LOOP_OUTPUT", "RECURRENCE", "ITERATOR", "TRIP_LIMIT"}


def run(mode: str, export_dir: Path, *args: str, register: bool = True) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, mode, "register" if register else "none",
                           str(export_dir), *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def k3_nodes(export_dir: Path) -> list[onnx.NodeProto]:
    """The k3 nodes that a plugin replaces (all of them since the MoE plugin)."""
    model = onnx.load(export_dir / "model.onnx", load_external_data=False)
    return [n for n in model.graph.node if n.domain == "k3" and n.op_type not in FUNCTION_ONLY_OPS]



def small_export(folder: Path, concat_cache: bool = False) -> Path:
    """An export folder (model.onnx, and export.json's inputs and capacity) holding one MLA cache write,
    a LatentMLA node on the written cache and a KDA node: the cache written in place by TensorScatter,
    or, with `concat_cache`, grown by a Concat as exports did before fixed-capacity caches."""
    H, C, D, V = 2, 64, 48, 32
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    specs = [("q", f32, ["batch", "seq", H, D]), ("update", f32, ["batch", 1, "seq", D]),
             ("cache_lengths", i64, ["batch"]), ("past.0.mla_latent", f32, ["batch", 1, "capacity", D]),
             *((name, f32, ["batch", "seq", H, V]) for name in ("kq", "kk", "kv", "kg")),
             ("kbeta", f32, ["batch", "seq", H]), ("past.1.kda_state", f32, ["batch", H, V, V])]
    inputs = [helper.make_tensor_value_info(n, t, [C if d == "capacity" else d for d in shape])
              for n, t, shape in specs]
    plugin = {"plugin_namespace": "k3", "plugin_version": "1"}
    if concat_cache:
        write = helper.make_node("Concat", ["past.0.mla_latent", "update"], ["present.0.mla_latent"], axis=2)
    else:
        write = helper.make_node("TensorScatter", ["past.0.mla_latent", "update", "cache_lengths"],
                                 ["present.0.mla_latent"], axis=2)
    nodes = [write,
             helper.make_node("LatentMLA", ["q", "present.0.mla_latent", "cache_lengths"], ["o"], domain="k3",
                              v_dim=V, scale=D**-0.5, **plugin),
             helper.make_node("KDA", ["kq", "kk", "kv", "kg", "kbeta", "past.1.kda_state"],
                              ["o_kda", "present.1.kda_state"], domain="k3", **plugin)]
    outputs = [helper.make_tensor_value_info(n, f32, None)
               for n in ("o", "present.0.mla_latent", "o_kda", "present.1.kda_state")]
    model = helper.make_model(helper.make_graph(nodes, "census", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 24), helper.make_opsetid("k3", 1)])
    folder.mkdir(parents=True)
    onnx.save(model, folder / "model.onnx")
    manifest = {"capacity": C, "inputs": [{"name": n, "dtype": "float32" if t == f32 else "int64",
                                           "shape": shape} for n, t, shape in specs],
                "files": {"model.onnx": file_record(folder / "model.onnx")}}
    (folder / "export.json").write_text(json.dumps(manifest))
    return folder


def test_census_of_a_small_graph(tmp_path: Path) -> None:
    """The census counts a TensorScatter cache write as a KV_CACHE_UPDATE layer and no Concat, tells a
    Concat on the cache apart, and the in-place graph builds (KDA's aliased state included)."""
    in_place = run("strict", small_export(tmp_path / "in_place"))
    assert in_place["kv_cache_updates"] == ["node_of_present.0.mla_latent: past.0.mla_latent -> "
                                            "present.0.mla_latent"]
    assert in_place["cache_concats"] == []
    assert [p.split(": ")[1] for p in in_place["plugin_layers"]] == ["k3::LatentMLA v1", "k3::KDA v1"]

    copied = run("strict", small_export(tmp_path / "concat", concat_cache=True))
    assert copied["kv_cache_updates"] == []
    assert copied["cache_concats"] == ["node_of_present.0.mla_latent: past.0.mla_latent, update -> "
                                       "present.0.mla_latent"]

    report = run("build", tmp_path / "in_place", str(tmp_path / "small.engine"), "sm89")
    assert report["bytes"] > 0
    prefill, decode = report["profiles"]
    assert prefill["past.0.mla_latent"] == [[1, 1, 64, 48], [1, 1, 64, 48], [1, 1, 64, 48]]
    assert decode["q"] == [[1, 1, 2, 48], [2, 1, 2, 48], [2, 1, 2, 48]]
    assert decode["cache_lengths"] == [[1], [2], [2]]


def test_profiles_keep_the_capacity() -> None:
    shapes = {"input_ids": ["batch", "seq"], "cache_lengths": ["batch"],
              "past.3.mla_latent": ["batch", 1, "capacity", 576]}
    manifest = {"capacity": 100, "inputs": [{"name": n, "dtype": "float32", "shape": shape}
                                            for n, shape in shapes.items()]}
    # Each profile its own ranges: prefill 1 x 100 tokens, decode 8 x 1 (as kimi-k3 serves).
    prefill, decode = profile_shapes(manifest, Limits(prefill_batch=1, prefill_seq=100, decode_batch=8))
    assert prefill == {"input_ids": [[1, 1], [1, 100], [1, 100]], "cache_lengths": [[1], [1], [1]],
                       "past.3.mla_latent": [[1, 1, 100, 576], [1, 1, 100, 576], [1, 1, 100, 576]]}
    assert decode["input_ids"] == [[1, 1], [8, 1], [8, 1]]
    assert decode["past.3.mla_latent"][2] == [8, 1, 100, 576]
    with pytest.raises(UserError, match="--max-seq 101, --max-batch 4 and --decode-batch 4: .* capacity 100"):
        profile_shapes(manifest, Limits(prefill_batch=4, prefill_seq=101))
    # A prefill row holds 4 x (100 + 1 + 100 x 576) bytes, a decode row 4 x (1 + 1 + 100 x 576): 138 GB
    # of inputs fit an H200, 230 GB do not; each profile is held to it at its own shapes.
    profile_shapes(manifest, Limits(prefill_batch=600_000, prefill_seq=100, decode_batch=600_000))
    with pytest.raises(UserError, match=r"--decode-batch 1000000 \(the decode profile, batch 1000000 x seq "
                                        r"1\): .* 230.4 GB, more than"):
        profile_shapes(manifest, Limits(prefill_batch=1, prefill_seq=100, decode_batch=10**6))
    with pytest.raises(UserError, match="no \"capacity\""):
        profile_shapes({"inputs": []}, Limits())


@pytest.fixture(scope="module")
def version9_export(tiny_export: Path, tmp_path_factory) -> Path:
    """The export with every k3 node asking for plugin_version "9" (no plugin has it)."""
    folder = tmp_path_factory.mktemp("engine") / "v9"
    shutil.copytree(tiny_export, folder)
    model = onnx.load(folder / "model.onnx", load_external_data=False)
    for node in model.graph.node:
        for attr in node.attribute:
            if node.domain == "k3" and attr.name == "plugin_version":
                attr.s = b"9"
    onnx.save(model, folder / "model.onnx")
    return folder


@pytest.fixture(scope="module")
def tiny_summary(tiny_export: Path) -> dict[str, Any]:
    """The plain export's parsed network, summarized (one process for the tests that read it)."""
    return run("strict", tiny_export)


def test_one_plugin_layer_per_custom_node(tiny_export: Path, tiny_summary: dict[str, Any]) -> None:
    manifest = json.loads((tiny_export / "export.json").read_text())
    summary = tiny_summary

    plugins = [p.split(": ", 1)[1] for p in summary["plugin_layers"]]
    mixers = [layer["mixer"] for layer in manifest["schedule"]]
    expected = []  # per layer its mixer, then a MoE layer's routed experts (grouped, gate/up, down)
    for layer in manifest["schedule"]:
        expected += {"KDA": ["k3::KDAPrepare v1", "k3::KDAChunkRecurrence v1"],
                     "MLA": ["k3::LatentMLASplits v1", "k3::LatentMLACombine v1"]}[layer["mixer"]]
        if layer["ffn"] == "moe":
            expected += [f"k3::RoutedExperts{op} v1" for op in ("Group", "GateUp", "Down")]
    assert plugins == expected
    assert summary["layer_types"]["PLUGIN_V3"] == len(k3_nodes(tiny_export))
    # A KDA function body would add a Scan's iterators, an inlined RoutedExperts function a Loop.
    assert "ITERATOR" not in summary["layer_types"], "a KDA function body was inlined"
    assert not LOOP_LAYERS & set(summary["layer_types"]), "a RoutedExperts function body was inlined"
    # Each MLA cache is written in place by one KV_CACHE_UPDATE layer and copied by no Concat.
    updates = [u.split(": ", 1)[1] for u in summary["kv_cache_updates"]]
    assert updates == [f"past.{layer['layer']}.mla_latent -> present.{layer['layer']}.mla_latent"
                       for layer in manifest["schedule"] if layer["mixer"] == "MLA"]
    assert summary["layer_types"]["KV_CACHE_UPDATE"] == mixers.count("MLA")
    assert summary["cache_concats"] == []

    # The fields the parser passed are the nodes' ONNX attributes.
    expected = [{"v_dim": onnx.helper.get_attribute_value(a_v), "scale": onnx.helper.get_attribute_value(a_s)}
                for node in k3_nodes(tiny_export) if node.op_type == "LatentMLASplits"
                for a_v in node.attribute if a_v.name == "v_dim"
                for a_s in node.attribute if a_s.name == "scale"]
    assert len(expected) == mixers.count("MLA")
    fields = summary["plugin_fields"]
    assert fields["KDAPrepare"] == fields["KDAChunkRecurrence"] == [{}] * mixers.count("KDA")
    assert [f["v_dim"] for f in fields["LatentMLASplits"]] == [e["v_dim"] for e in expected]
    assert [f["scale"] for f in fields["LatentMLASplits"]] == pytest.approx([e["scale"] for e in expected])
    assert fields["LatentMLACombine"] == [{}] * mixers.count("MLA")
    # expert_offset: 0 on an unsplit model's nodes.
    betas = [{a.name: onnx.helper.get_attribute_value(a) for a in node.attribute
              if a.name in ("situ_beta", "situ_linear_beta")}
             for node in k3_nodes(tiny_export) if node.op_type == "RoutedExpertsGateUp"]
    assert fields["RoutedExpertsGateUp"] == betas and len(betas) == expected_moe_layers(manifest)
    held = manifest_config_experts(tiny_export)
    assert fields["RoutedExpertsGroup"] == [{"num_experts": held, "expert_offset": 0}] * len(betas)
    assert fields["RoutedExpertsDown"] == [{}] * len(betas)


def manifest_config_experts(export_dir: Path) -> int:
    """The routed experts an unsplit export's MoE nodes hold: its config's num_experts."""
    return json.loads((export_dir / "config.json").read_text())["num_experts"]


def expected_moe_layers(manifest: dict[str, Any]) -> int:
    return sum(layer["ffn"] == "moe" for layer in manifest["schedule"])


@pytest.fixture(scope="module")
def packed_export(tiny_model, tmp_path_factory) -> Path:
    """`export --packed-experts` of the tiny model's published checkpoint with MXFP4 experts."""
    from k3export.cli import main
    from k3export.weights.published import write_published

    folder = tmp_path_factory.mktemp("packed")
    write_published(tiny_model, folder / "checkpoint", experts="mxfp4")
    assert main(["export", "--checkpoint", str(folder / "checkpoint"), "--packed-experts",
                 "--out", str(folder / "export")]) == 0
    return folder / "export"


def initializer_bytes(export_dir: Path) -> dict[str, int]:
    """Bytes of the export's weights by kind: the packed experts (int32 words) and everything else."""
    model = onnx.load(export_dir / "model.onnx")
    sizes = {"packed": 0, "other": 0}
    for tensor in model.graph.initializer:
        array = onnx.numpy_helper.to_array(tensor, str(export_dir))
        sizes["packed" if tensor.name.endswith(("_packed", "_scale")) else "other"] += array.nbytes
    return sizes


# Prints, as JSON, the parsed network's summary (as SCRIPT's "strict" does) and for each MoE layer the expert
# inputs of its RoutedExpertsGateUpMXFP4 (from input 3) and RoutedExpertsDownMXFP4 (from input 2) plugin
# layers: dtype, shape, and the constant layer that feeds each (its name, the weights' bytes and their
# sha256).
MOE_INPUTS_SCRIPT = """
import hashlib, json, sys
from dataclasses import asdict
import k3plugins.trt
from k3export.engine import build, flavours
trt = flavours.load_tensorrt()
creators = k3plugins.trt.register(trt)
_, network, _ = build.parse(sys.argv[1], trt, trt.Logger(trt.Logger.ERROR))
layers = [network.get_layer(i) for i in range(network.num_layers)]
producers = {l.get_output(j).name: l for l in layers for j in range(l.num_outputs)}

def constant(layer):
    if layer.type.name != "CONSTANT":
        return [layer.type.name, layer.name, 0, ""]
    layer.__class__ = trt.IConstantLayer
    data = layer.weights.tobytes()  # the constant's weights as a numpy array
    return [str(layer.weights.dtype), layer.name, len(data), hashlib.sha256(data).hexdigest()]

print(json.dumps([asdict(build.summarize(network, trt, creators)),
                  [[(t.dtype.name, list(t.shape), constant(producers[t.name]))
                    for t in (l.get_input(j) for j in range({7: 3, 4: 2}[l.num_inputs], l.num_inputs))]
                   for l in layers if l.type.name == "PLUGIN_V3" and l.num_inputs in (7, 4)]]))
"""


def checkpoint_experts(checkpoint: Path) -> dict[str, bytes]:
    """The stacked bytes of each MoE layer's packed tensors, by export name
    (`model.model.layers.{i}.block_sparse_moe.experts.{w}_{packed|scale}`), read from the published
    checkpoint's per-expert tensors (`...experts.{e}.{w}.weight_{packed|scale}`) in expert order."""
    import re

    import torch
    from safetensors.torch import load_file

    tensors = {k: v for f in sorted(checkpoint.glob("*.safetensors")) for k, v in load_file(f).items()}
    pattern = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w\d)\."
                         r"weight_(packed|scale)$")
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = pattern.search(name)
        if match:
            layer, expert, w, part = match.groups()
            key = f"model.model.layers.{layer}.block_sparse_moe.experts.{w}_{part}"
            stacks.setdefault(key, {})[int(expert)] = tensor
    return {key: torch.stack([by[e] for e in sorted(by)]).numpy().tobytes() for key, by in stacks.items()}


def test_packed_experts_stay_packed(packed_export: Path, tmp_path: Path) -> None:
    """One RoutedExpertsMXFP4 plugin layer per MoE layer (8 in k3-tiny) and no Loop; the plugin reads
    the packed codes and scales as the export declares them, int32 words (k3export/ops/mxfp4.py, "Words":
    [E, O*I/8], [E, O*I/128]), never dequantised in the network and not widened by the parser (which
    widens UINT8 initializers to INT32, one byte per int32): each constant layer feeding the plugin
    holds exactly the checkpoint's bytes of its experts, so the network holds the packed experts at
    their packed size (4.25 bits per weight). The engine's bytes are printed with the weights'."""
    import hashlib

    manifest = json.loads((packed_export / "export.json").read_text())
    proc = subprocess.run([sys.executable, "-c", MOE_INPUTS_SCRIPT, str(packed_export / "model.onnx")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary, layers = json.loads(proc.stdout.strip().splitlines()[-1])
    moe = [p for p in summary["plugin_layers"] if p.endswith("k3::RoutedExpertsGateUpMXFP4 v1")]
    assert len(moe) == expected_moe_layers(manifest) == 8
    assert not LOOP_LAYERS & set(summary["layer_types"]), "a RoutedExperts function body was inlined"
    fields = {"situ_beta": 4.0, "situ_linear_beta": 25.0}
    assert summary["plugin_fields"]["RoutedExpertsGateUpMXFP4"] == [fields] * 8

    E, I, L = 8, 32, 32  # k3-tiny: num_experts, moe_intermediate_size, routed_expert_hidden_size
    word_shapes = [[E, I * L // 8], [E, I * L // 128]] * 3
    expected = checkpoint_experts(packed_export.parent / "checkpoint")
    assert len(layers) == 2 * 8 and len(expected) == 8 * 6
    constant_bytes = 0
    for gate_up, down in zip(layers[::2], layers[1::2], strict=True):
        assert [shape for _, shape, _ in gate_up + down] == word_shapes
    for inputs in layers:
        assert {dtype for dtype, _, _ in inputs} == {"INT32"}
        for _, _, (kind, name, size, sha) in inputs:
            assert kind == "int32", f"{name}: fed by {kind}, not a constant of int32 words"
            assert size == len(expected[name]) and sha == hashlib.sha256(expected[name]).hexdigest(), name
            constant_bytes += size
    weights = initializer_bytes(packed_export)
    assert constant_bytes == weights["packed"] == sum(map(len, expected.values())) == 104_448

    report = run("build", packed_export, str(tmp_path / "packed.sm89.engine"), "sm89")
    print(f"engine {report['bytes']} B; weights {weights['other'] + weights['packed']} B, of which the "
          f"packed experts {weights['packed']} B, held by the network's constants at that size")
    assert report["bytes"] > 0


def test_engine_builds_with_two_profiles(tmp_path: Path) -> None:
    """Built for SM89 (the other targets TensorRT-RTX takes are accepted alike: test_flavours), from
    k3-tiny's 3-layer cut (test_parallel_grid.short_config: every layer kind; the build of the whole
    model, 10 s against 3, is test_shards.py::test_tensorrt_rtx_build's)."""
    from test_parallel_grid import short_config

    from k3export.cli import main

    short_config().to_json(tmp_path / "config.json")
    export = tmp_path / "export"
    assert main(["export", "--config", str(tmp_path / "config.json"), "--seed", "0", "--out", str(export),
                 "--quiet"]) == 0
    out = tmp_path / "build" / "tiny.sm89.engine"
    out.parent.mkdir()
    report = run("build", export, str(out), "sm89")

    assert out.stat().st_size == report["bytes"] > 0
    assert [p.name for p in out.parent.iterdir()] == [out.name], "a temporary file was left behind"
    prefill, decode = report["profiles"]
    # [min, opt, max] of input_ids [batch, seq]: prefill batch 1 x seq 1..64, decode batch 1..2 x 1.
    assert prefill["input_ids"] == [[1, 1], [1, 64], [1, 64]]
    assert decode["input_ids"] == [[1, 1], [2, 1], [2, 1]]
    assert decode["cache_lengths"] == decode["input_lengths"] == [[1], [2], [2]]
    capacity = json.loads((export / "export.json").read_text())["capacity"]
    latent = next(name for name in decode if name.endswith("mla_latent"))
    assert [shape[:3] for shape in decode[latent]] == [[1, 1, capacity], [2, 1, capacity], [2, 1, capacity]]
    assert len(report["network"]["plugin_layers"]) == len(k3_nodes(export))
    # No GPU: each profile's device memory is the estimate, at least its inputs at their largest shapes.
    assert report["backend"] == "tensorrt-rtx"
    dtypes = {s["name"]: s["dtype"] for s in json.loads((export / "export.json").read_text())["inputs"]}
    for memory, shapes in zip(report["device_memory"], report["profiles"], strict=True):
        inputs = sum(math.prod(shape[2]) * getattr(torch, dtypes[name]).itemsize
                     for name, shape in shapes.items())
        assert memory["source"].startswith("estimate") and memory["bytes"] >= inputs > 0
    assert [m["profile"] for m in report["device_memory"]] == ["prefill", "decode"]


def test_aot_attribute_is_ignored(tiny_summary: dict[str, Any], aot_export: Path) -> None:
    """`aot = 1` (export --aot-plugins) is for full TensorRT's tensorrt.plugin plugins; the IPluginV3
    creators do not declare it, so TensorRT-RTX's parser makes the same plugin layers with the same
    fields as of the plain export (whose stages build: test_shards.py::test_tensorrt_rtx_build)."""
    summary, plain = run("strict", aot_export), tiny_summary
    assert summary["plugin_layers"] == plain["plugin_layers"]
    assert len(summary["plugin_layers"]) == len(k3_nodes(aot_export))
    assert summary["plugin_fields"] == plain["plugin_fields"]
    assert summary["layer_types"] == plain["layer_types"]


def assert_parser_inlines(export_dir: Path, register: bool = True) -> None:
    """Parsed without the check, the export fails only inside an inlined function."""
    error = run("lenient", export_dir, register=register)["error"]
    assert "operator: NonZero" in error and "RoutedExperts" not in error and "KDA" not in error


def test_wrong_plugin_version_is_refused(version9_export: Path) -> None:
    error = run("strict", version9_export)["error"]
    assert "asks for plugin k3::KDAPrepare version '9', which is not registered" in error
    assert ("registered k3 plugins: k3::KDA v1, k3::KDAChunkRecurrence v1, k3::KDAPrepare v1, "
            "k3::LatentMLA v1, k3::LatentMLACombine v1, "
            "k3::LatentMLASplits v1, k3::RoutedExperts v1, "
            "k3::RoutedExperts v2, k3::RoutedExpertsDown v1, k3::RoutedExpertsDownMXFP4 v1, "
            "k3::RoutedExpertsGateUp v1, k3::RoutedExpertsGateUpMXFP4 v1, k3::RoutedExpertsGroup v1, "
            "k3::RoutedExpertsMXFP4 v1, k3::RoutedExpertsMXFP4 v2") in error

    # What the check guards against: the parser inlines the functions without a word, and stops only
    # inside a RoutedExperts body (NonZero, which it lacks), naming neither the node nor its plugin.
    assert_parser_inlines(version9_export)


def test_unregistered_plugin_is_refused(tiny_export: Path) -> None:
    error = run("strict", tiny_export, register=False)["error"]
    assert "asks for plugin k3::KDAPrepare version '1', which is not registered" in error
    assert "(registered k3 plugins: none)" in error

    assert_parser_inlines(tiny_export, register=False)
