"""`k3export check --engine FILE`: a TensorRT engine against the eager model, on a machine with an
NVIDIA GPU and TensorRT (full TensorRT, or TensorRT-RTX through Polygraphy's USE_TENSORRT_RTX).

NOT RUN HERE: no machine this project tests on has a GPU, and engines cannot be deserialized
without one, so this module is written thin and only its argument handling and refusals are tested.
It reuses check --onnx's driver (k3export.check.driver.run_check: prefill of right-padded prompts,
greedy decode steps, valid entries, taps, verdict) and swaps ONNX Runtime for `EngineRunner`, a
stateful wrapper of Polygraphy's TrtRunner that carries the caches from call to call.

FILE is an engine `k3export build --onnx DIR --out FILE` wrote (its record FILE.json names the
export DIR, whose export.json gives the eager reference), or a `k3export build RECIPE` folder, whose
every stage engine is checked alone against the eager model over the stage's layers (a stage not
starting at layer 0 takes random AttnRes boundary tensors, as check --onnx does for a range).
"""

from __future__ import annotations

import importlib.util
import json
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from k3export.artifacts import read_manifest
from k3export.check.driver import run_check
from k3export.errors import UserError
from k3export.onnx.export import GRAPH_FILE, MANIFEST_FILE
from k3export.onnx.runner import Signature, StatefulRunner


def engine_targets(path: str | Path) -> list[tuple[Path, Path]]:
    """(engine file, export folder) pairs: one for an engine with its record FILE.json, one per
    stage for a sharded build folder (manifest.json)."""
    path = Path(path)
    if path.is_dir():
        if not (path / "manifest.json").is_file():
            raise UserError(f"--engine {path}: a folder without manifest.json; expected an engine file or "
                            "a `k3export build RECIPE` folder")
        stages = json.loads((path / "manifest.json").read_text()).get("stages") or []
        targets = [(engine, path / s["folder"]) for s in stages
                   for engine in sorted((path / s["folder"]).glob("*.engine"))]
        if not targets:
            raise UserError(f"--engine {path}: its stages hold no engines (built with --backend onnx?); "
                            "build them with --backend tensorrt-rtx, or check the stage graphs with --build")
        return targets
    if not path.is_file():
        raise UserError(f"--engine {path}: no such file")
    record = path.with_name(f"{path.name}.json")
    try:
        export = json.loads(record.read_text())["export"]
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"--engine {path}: its record {record} is missing or names no 'export'; expected "
                        "an engine that `k3export build --onnx DIR --out FILE` wrote") from None
    return [(path, Path(export))]


def require_routing_outputs(engine: Path, export: Path) -> None:
    """Refuses a half-precision engine whose export does not output its expert choices: the check
    holds the eager routers to them, and an engine's outputs are fixed when it is built."""
    manifest = read_manifest(export, MANIFEST_FILE)
    if manifest.get("dtype", "float32") != "float32" and "routing_outputs" not in manifest:
        raise UserError(f"--engine {engine}: a {manifest['dtype']} check holds the eager model to the "
                        f"engine's own expert choices, and {export / MANIFEST_FILE} lists no routing "
                        "outputs; build the engine to check from `k3export export --routing-outputs` (its "
                        "extra outputs change nothing else the graph computes), or check a float32 engine")


def require_engine_runtime() -> None:
    """Refuses, naming what is missing, unless a GPU and TensorRT (either flavour) are present."""
    import torch

    missing = []
    if not torch.cuda.is_available():
        missing.append("an NVIDIA GPU (torch.cuda.is_available() is False)")
    flavours = [m for m in ("tensorrt", "tensorrt_rtx") if importlib.util.find_spec(m)]
    if not flavours:
        missing.append("TensorRT (neither tensorrt nor tensorrt_rtx is installed)")
    if missing:
        raise UserError("check --engine runs the engine through Polygraphy's TensorRT runner and needs "
                        f"{' and '.join(missing)}; on this machine check the network the builder receives "
                        "instead: `k3export check --network DIR` (CPU)")


class EngineRunner(StatefulRunner):
    """A TensorRT engine through Polygraphy's TrtRunner, which copies the caches in and out (numpy)."""

    def __init__(self, engine: Path, signature: Signature, weights: Path, name: str = "engine",
                 routing: list[str] | None = None) -> None:
        super().__init__(signature, name)
        self.engine = engine
        self.weights = weights  # the export's model.onnx: a weight-stripped engine is refitted from it
        self.routing = routing or []  # export --routing-outputs: engine outputs returned too

    def activate_impl(self) -> None:
        from polygraphy import config

        from k3export.engine.build import load_engine
        from k3export.engine.flavours import load_tensorrt, register_plugins
        from k3export.engine.trt_log import tensorrt_logger

        backend = "tensorrt" if importlib.util.find_spec("tensorrt") else "tensorrt-rtx"
        config.USE_TENSORRT_RTX = backend == "tensorrt-rtx"  # which module Polygraphy imports as trt
        from polygraphy.backend.trt import TrtRunner

        trt = load_tensorrt(backend)
        register_plugins(trt)  # the k3 plugins the engine was built with, as its flavour registers them
        self.runner = TrtRunner(load_engine(trt, tensorrt_logger(trt), self.engine, self.weights))
        self.runner.activate()

    def deactivate_impl(self) -> None:
        self.runner.deactivate()

    def call(self, feeds: dict[str, np.ndarray]) -> OrderedDict[str, np.ndarray]:
        outputs = self.runner.infer({**feeds, **self.caches}, check_inputs=False)
        names = [*self.routing, *(s.name for s in self.signature.outputs)]
        results = OrderedDict((name, np.array(outputs[name])) for name in names)
        self.keep_caches(results)
        return results


def run_engine_check(path: str | Path, log: Any = print, **options: Any) -> dict[str, Any]:
    """Every engine of `path` through check's driver; the report of the first that fails, or of the
    last (all passed), with "engines": each engine's verdict."""
    targets = engine_targets(path)
    for engine, export in targets:
        require_routing_outputs(engine, export)
    require_engine_runtime()
    reports = []
    for engine, export in targets:
        log(f"engine {engine} (export {export})")

        def runner(signature: Signature, extra_outputs: list[str], engine: Path = engine,
                   export: Path = export) -> StatefulRunner:
            return EngineRunner(engine, signature, export / GRAPH_FILE, routing=extra_outputs)

        reports.append(run_check(export, log=log, graph_runner=runner, **options))
        reports[-1]["engine"] = str(engine)
        if not reports[-1]["passed"]:
            break
    report = reports[-1]
    report["engines"] = [{"engine": r["engine"], "passed": r["passed"]} for r in reports]
    return report
