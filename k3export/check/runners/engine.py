"""`k3export check --engine FILE`: a TensorRT engine against the eager model, on a machine with an
NVIDIA GPU and TensorRT (full TensorRT, or TensorRT-RTX through Polygraphy's USE_TENSORRT_RTX).

It reuses check --onnx's driver (k3export.check.driver.run_check: prefill of right-padded prompts,
greedy decode steps, valid entries, taps, verdict) and swaps ONNX Runtime for the one engine runner
(k3export.engine.runner.EngineRunner: caches on the GPU, written in place, profile by call). Its
GPU-only lines are listed in docs/kernels.md; here its argument handling and refusals are tested, and
the runner's plan and cache logic in tests/test_engine_runner.py.

FILE is an engine `k3export build --onnx DIR --out FILE` wrote (its record FILE.json names the
export DIR, whose export.json gives the eager reference), or a `k3export build RECIPE` folder, whose
every stage engine is checked alone against the eager model over the stage's layers (a stage not
starting at layer 0 takes random AttnRes boundary tensors, as check --onnx does for a range).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from k3export.artifacts import BUILD_MANIFEST, read_manifest
from k3export.check.driver import run_check
from k3export.engine.runner import EngineRunner, binding_plan, engine_record, require_engine_runtime
from k3export.errors import UserError
from k3export.onnx.export import MANIFEST_FILE
from k3export.onnx.runner import Signature, StatefulRunner


def engine_targets(path: str | Path) -> list[tuple[Path, Path]]:
    """(engine file, export folder) pairs: one for an engine with its record FILE.json, one per
    stage for a sharded build folder (manifest.json)."""
    path = Path(path)
    if path.is_dir():
        if not (path / BUILD_MANIFEST).is_file():
            raise UserError(f"--engine {path}: a folder without manifest.json; expected an engine file or "
                            "a `k3export build RECIPE` folder")
        try:
            stages = json.loads((path / BUILD_MANIFEST).read_text()).get("stages") or []
            split = next((len(s["ranks"]) for s in stages if s.get("ranks")), None)
            # The engines its manifest records (what the runtime and the engine runner read too).
            targets = [(path / s["engine"], path / s["folder"]) for s in stages if s.get("engine")]
        except (ValueError, AttributeError, TypeError, KeyError):
            raise UserError(f"--engine {path / BUILD_MANIFEST}: not a `k3export build RECIPE` manifest (not "
                            "JSON, or stages without folders); the folder is damaged, build it "
                            "again") from None
        if split:
            raise UserError(f"--engine {path}: a build split over {split} ranks a stage; a rank's engine "
                            "computes only its share and sums it with the other ranks' through NCCL, so it "
                            "cannot run alone: check the stage's ranks together, k3export check --build "
                            f"{path} --stage I (one GPU a rank)")
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


def run_engine_check(path: str | Path, log: Any = print, **options: Any) -> dict[str, Any]:
    """Every engine of `path` through check's driver; the report of the first that fails, or of the
    last (all passed), with "engines": each engine's verdict."""
    targets = engine_targets(path)
    for engine, export in targets:  # what can be refused without a GPU is refused first
        require_routing_outputs(engine, export)
        binding_plan(export, engine_record(engine)["profiles"])
    require_engine_runtime("check --engine", instead="on this machine check the network the builder receives "
                           "instead: `k3export check --network DIR` (CPU)")
    reports = []
    for engine, export in targets:
        log(f"engine {engine} (export {export})")

        def runner(signature: Signature, extra_outputs: list[str], engine: Path = engine,
                   export: Path = export) -> StatefulRunner:
            return EngineRunner(engine, export, extra_outputs=extra_outputs, signature=signature)

        reports.append(run_check(export, log=log, graph_runner=runner, **options))
        reports[-1]["engine"] = str(engine)
        if not reports[-1]["passed"]:
            break
    report = reports[-1]
    report["engines"] = [{"engine": r["engine"], "passed": r["passed"]} for r in reports]
    return report
