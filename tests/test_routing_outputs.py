"""`export --routing-outputs`: each MoE layer's expert choices as graph outputs routing.{layer}, so
that a half-precision engine, whose outputs are fixed when it is built, can be checked against the
eager model held to its own choices. The outputs are read by check in place of the intermediate
tensors it otherwise exposes at load; they change nothing else the graph computes (compared with
the same export less them), and a perturbed export still fails."""

import importlib.util
import json
import shutil
from pathlib import Path

import onnx
import pytest
from reference import PERTURBED, rerecord_file, scaled_copy

from k3export.check import driver
from k3export.check.driver import run_check
from k3export.cli import main
from k3export.config import K3Config
from k3export.onnx.export import ROUTING_PREFIX

needs_rtx = pytest.mark.skipif(importlib.util.find_spec("tensorrt_rtx") is None,
                               reason="TensorRT-RTX is not installed")


def run_network_check(*args, **kwargs) -> dict:
    from k3export.check.runners.network import run_network_check

    return run_network_check(*args, **kwargs)


CHECKS = {"onnx": run_check, "network": run_network_check}


@pytest.fixture(scope="module")
def routed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """k3-tiny exported with --routing-outputs in float16 and bfloat16."""
    root = tmp_path_factory.mktemp("routing")
    for dtype in ("float16", "bfloat16"):
        assert main(["export", "--preset", "k3-tiny", "--seed", "0", "--dtype", dtype, "--routing-outputs",
                     "--out", str(root / dtype)]) == 0
    return {dtype: root / dtype for dtype in ("float16", "bfloat16")}


def without_routing_outputs(export: Path, folder: Path) -> Path:
    """A copy of the export with the routing outputs (and their Identity nodes) taken out again."""
    shutil.copytree(export, folder)
    graph = onnx.load(folder / "model.onnx", load_external_data=False)
    kept = [o for o in graph.graph.output if not o.name.startswith(ROUTING_PREFIX)]
    del graph.graph.output[:]
    graph.graph.output.extend(kept)
    nodes = [n for n in graph.graph.node if not n.output[0].startswith(ROUTING_PREFIX)]
    del graph.graph.node[:]
    graph.graph.node.extend(nodes)
    onnx.save(graph, folder / "model.onnx")
    manifest = json.loads((folder / "export.json").read_text())
    del manifest["routing_outputs"]
    (folder / "export.json").write_text(json.dumps(manifest))
    rerecord_file(folder, "model.onnx")
    return folder


def numbers(report: dict) -> list[float]:
    return [x for s in report["steps"] for c in s["outputs"] for x in (c["rel"], c["max_abs"])]


def test_the_graph_outputs_each_moe_layers_choices(routed: dict[str, Path]) -> None:
    config = K3Config.from_preset("k3-tiny")
    manifest = json.loads((routed["float16"] / "export.json").read_text())
    moe = [i for i in range(config.num_hidden_layers) if not config.is_dense(i)]
    assert [s["name"] for s in manifest["routing_outputs"]] == [f"routing.{i}" for i in moe]
    assert all(s["dtype"] == "int64" and s["shape"][-1] == config.num_experts_per_token
               for s in manifest["routing_outputs"])
    graph = onnx.load(routed["float16"] / "model.onnx", load_external_data=False)
    outputs = [o.name for o in graph.graph.output]
    assert outputs[-len(moe):] == [f"routing.{i}" for i in moe]
    assert not any(s["name"].startswith(ROUTING_PREFIX) for s in manifest["outputs"])  # not compared


@pytest.mark.parametrize("kind", ["onnx", pytest.param("network", marks=needs_rtx)])
def test_float16_with_routing_outputs_passes_and_they_change_nothing_else(routed, kind, tmp_path,
                                                                         monkeypatch) -> None:
    """The check holds the eager routers to the graph's own outputs (the load-time exposure of
    intermediates is not called), passes, and measures exactly what it measures on the same graph
    less the routing outputs; the 1.5x perturbation fails."""
    plain = without_routing_outputs(routed["float16"], tmp_path / "plain")
    with monkeypatch.context() as patched:
        patched.setattr(driver, "routing_outputs", lambda graph: pytest.fail("read from intermediates"))
        report = CHECKS[kind](routed["float16"], steps=1, log=lambda line: None)
    assert report["passed"] and report["held_routing"], report["failed_outputs"]
    assert numbers(report) == numbers(CHECKS[kind](plain, steps=1, log=lambda line: None))
    scaled = scaled_copy(routed["float16"], tmp_path / "scaled", PERTURBED, 1.5)
    failed = CHECKS[kind](scaled, steps=0, log=lambda line: None)
    assert not failed["passed"] and "logits" in failed["failed_outputs"]


@needs_rtx
def test_bfloat16_with_routing_outputs_passes_check_network(routed, tmp_path) -> None:
    report = run_network_check(routed["bfloat16"], steps=1, log=lambda line: None)
    assert report["passed"] and report["held_routing"], report["failed_outputs"]
    scaled = scaled_copy(routed["bfloat16"], tmp_path / "scaled", PERTURBED, 1.5)
    failed = run_network_check(scaled, steps=0, log=lambda line: None)
    assert not failed["passed"] and "present.0.kda_state" in failed["failed_outputs"]


def test_engine_runner_returns_the_routing_outputs(routed) -> None:
    """check --engine on a float16 engine built from such an export: EngineRunner hands the engine's
    routing outputs to the driver (Polygraphy's ONNX Runtime runner standing in for its TrtRunner on
    the export's graph, as in test_engine_check), and the check passes held to them."""
    from test_engine_check import OnnxrtBackedEngineRunner

    made = []

    def runner(signature, routing):
        graph = routed["float16"] / "model.onnx"
        made.append(OnnxrtBackedEngineRunner(graph, signature, graph, routing=routing))
        return made[-1]

    report = run_check(routed["float16"], steps=1, log=lambda line: None, graph_runner=runner)
    assert made[0].routing == [f"routing.{i}" for i in range(1, 9)]
    assert report["passed"] and report["held_routing"], report["failed_outputs"]
