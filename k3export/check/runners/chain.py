"""`k3export check --build DIR`: a sharded build against the eager model, through check's one driver.

The build's stages, chained as `k3export run` chains them (k3export.runtime.Pipeline: one ONNX
Runtime session a stage, each fed the stage before's outputs), are one more runner of check's
driver (k3export.check.driver.compare_with_eager, as --onnx, --network and --engine use): the
`ChainRunner` takes the request's feeds and returns every stage's outputs, the AttnRes bank and
partial block each stage sends on included. The eager side is the eager model run as the same
chain (`EagerChain`: one ExportGraph a stage over one model, each fed the one before's outputs), so
the driver compares the two chains at every stage boundary as well as the caches, logits and
(with taps) each layer's taps, with the same requests, bounds, verdict and localisation as the
other artifacts. Its extra is the stage each output belongs to: per step, each stage's worst output,
and the first divergent stage (the first in stage order whose outputs leave the bound at any step),
so a bad stage is found where it goes wrong, not where its error ends up.

A build split over ranks (`[parallel] ranks = N`) is run by k3export.check.runners.grid.GridRunner
(one worker process a rank) in place of ChainRunner, against the same unsplit eager chain; its extra
is the first divergent stage and rank, from each rank's partial sums.

In half precision (float16) the eager chain is held to the stages' own expert choices, as the driver
holds one export (k3export.check.routing): read from each stage's graph outputs routing.{layer} where
the build has them (`build RECIPE --routing-outputs`: what an engine must output to be checked), else
from the intermediates ONNX Runtime exposes (a grid needs the outputs: grid.py); the report's
"routing_read_from" says which.

With taps (`k3export build RECIPE --taps`) the per-layer table and the first divergent layer and
sublayer are those of `check --onnx --taps`, and the stage holding that layer is named.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from polygraphy.logger import G_LOGGER

from k3export.check.driver import compare_with_eager, first_request, fitting_lengths, read_export, request
from k3export.check.routing import routing_outputs
from k3export.check.runners.eager import EagerSide, carried, plan_eager
from k3export.check.runners.grid import (
    GridRunner,
    first_divergent_rank,
    grid_stages,
    held_routing_names,
    rank_lines,
    stage_output,
    verified_export,
)
from k3export.config import K3Config
from k3export.errors import UserError
from k3export.onnx.export import GRAPH_FILE
from k3export.onnx.runner import Signature, StatefulRunner
from k3export.onnx.taps import parse_tap
from k3export.options import AUTO
from k3export.runtime import Pipeline, stage_ranks
from k3export.runtime.engines import ENGINE, EnginePlace, RunnerChoice, choose_runner
from k3export.weights.checkpoint import check_weights


def _boundary_or_result(name: str) -> bool:
    return not name.startswith(("past.", "present.")) and not parse_tap(name)


def chain_manifest(build_dir: Path, stages: list[tuple[dict[str, Any], K3Config]],
                   ) -> tuple[dict[str, Any], K3Config, list[dict]]:
    """The chain of stages (each one's export.json and config) described as one export: export.json's
    fields for the whole model, its inputs the first stage's request inputs and every stage's caches,
    its outputs the last stage's (logits), every other stage's boundary outputs, every cache and (all
    stages tapped) every tap in layer order. Also the config and each stage's export.json."""
    manifests = [m for m, _ in stages]
    first = manifests[0]
    for key in ("dtype", "weights", "capacity"):
        values = {json.dumps(m[key], sort_keys=True) for m in manifests}
        if len(values) > 1:
            raise UserError(f"{build_dir}: its stages' export.json disagree on '{key}' "
                            f"({', '.join(sorted(values))}); expected one build of one recipe")
    for key, option in (("taps", "--taps"), ("routing_outputs", "--routing-outputs")):
        carrying = [i for i, m in enumerate(manifests) if key in m]
        if carrying and len(carrying) < len(manifests):
            raise UserError(f"{build_dir}: stages {carrying} carry {key} and the others do not; rebuild it "
                            f"(k3export build RECIPE --out DIR, with or without {option})")
    inputs = [s for s in first["inputs"] if not s["name"].startswith("past.")]
    inputs += [s for m in manifests for s in m["inputs"] if s["name"].startswith("past.")]
    outputs = [s for s in manifests[-1]["outputs"] if _boundary_or_result(s["name"])]
    outputs += [s for m in manifests[:-1] for s in m["outputs"] if _boundary_or_result(s["name"])]
    outputs += [s for m in manifests for s in m["outputs"] if s["name"].startswith("present.")]
    outputs += [s for m in manifests for s in m["outputs"] if parse_tap(s["name"])]
    manifest = {**first, "layers": [first["layers"][0], manifests[-1]["layers"][1]], "inputs": inputs,
                "outputs": outputs, "last_logits": manifests[-1].get("last_logits", False)}
    if "routing_outputs" in first:
        manifest["routing_outputs"] = [s for m in manifests for s in m["routing_outputs"]]
    return manifest, stages[0][1], manifests


class ChainRunner(StatefulRunner):
    """The build's stages chained in this process (k3export.runtime.Pipeline, as `k3export run`
    runs them) as one check runner; the caches are the stages' own: it takes the request's feeds and
    returns the chain's outputs in `signature`'s order, then each stage's `routing[stage]` (its
    routing choices, graph outputs or intermediates) as stage_output(stage, name)."""

    def __init__(self, exports: list[Path], signature: Signature, routing: list[list[str]],
                 engines: list[EnginePlace] | None = None) -> None:
        super().__init__(signature, "build")
        self.exports, self.per_stage, self.engines = exports, routing, engines
        self.extra_outputs = [stage_output(i, name) for i, names in enumerate(routing) for name in names]

    def activate_impl(self) -> None:
        self.pipeline = Pipeline(self.exports, extra_outputs=self.per_stage, engines=self.engines)

    def deactivate_impl(self) -> None:
        self.pipeline.close()
        del self.pipeline

    def reset(self, batch: int, rows: list[int] | None = None) -> None:
        for stage in self.pipeline.stages:
            stage.runner.reset(batch, rows)

    def call(self, feeds: dict[str, np.ndarray]) -> OrderedDict[str, np.ndarray]:
        produced: dict[str, np.ndarray] = {}
        for i, outputs in enumerate(self.pipeline.calls(feeds)):
            # A stage's non-cache outputs are its own arrays; its caches stay valid until its next call.
            produced.update(outputs)
            produced.update({stage_output(i, t): outputs[t] for t in self.per_stage[i]})
        for stage in self.pipeline.stages:
            self.aliased.update(stage.runner.aliased)
        names = [s.name for s in self.signature.outputs] + self.extra_outputs
        return OrderedDict((name, produced[name]) for name in names)


def require_build_taps(build_dir: Path, manifest: dict[str, Any]) -> None:
    if "taps" not in manifest:
        raise UserError(f"--taps: {build_dir} was built without taps (its stages' export.json list no taps "
                        f"outputs); build it with taps: k3export build RECIPE --out {build_dir} --taps "
                        "(or taps = true under the recipe's [build])")


def engine_places(choice: RunnerChoice, stages: list[int], gpus: int) -> list[list[EnginePlace]]:
    """Per stage of `stages`, per rank, where check runs its engine: one GPU each of the `gpus` in turn
    (stage by stage, rank by rank; a stage's ranks one a GPU), every output read back to the host
    (check compares them all)."""
    ranks = len(choice.engines[0])
    return [[EnginePlace(path, (k * ranks + r) % gpus) for r, path in enumerate(choice.engines[s])]
            for k, s in enumerate(stages)]


def prefix_feeds(build_dir: Path, folders: list[list[Path]], stage: int, signature: Signature, steps: int,
                 seed: int, lengths: list[int], eager: str, log: Any) -> list[dict[str, np.ndarray]]:
    """Every step's feeds of stage `stage` alone: the AttnRes boundary the eager model of the layers
    before it computes (streamed or in memory, as `eager` says) on random prompts and then random
    tokens (no artifact runs before the stage, so none of its greedy tokens are known)."""
    earlier = grid_stages(folders[:stage]) if len(folders[0]) > 1 else \
        [read_export(ranks[0]) for ranks in folders[:stage]]
    manifest, config, _ = chain_manifest(build_dir, earlier)
    dtype, prefix = manifest["dtype"], range(*manifest["layers"])
    plan = plan_eager(eager, config, dtype, manifest["weights"], [range(*m["layers"]) for m, _ in earlier])
    check_weights(config, getattr(torch, dtype), manifest["weights"], prefix)
    log(f"stage {stage}'s input: the eager model of layers {prefix.start}..{prefix.stop - 1}; {plan.line()}")
    gen = torch.Generator().manual_seed(seed)
    prefix_signature = Signature(carried(manifest))
    feeds = [first_request(prefix_signature, lengths, config.vocab_size, gen)]
    cache_lengths = np.zeros(len(lengths), np.int64)
    for _ in range(steps):
        cache_lengths = cache_lengths + feeds[-1]["input_lengths"]
        tokens = torch.randint(0, config.vocab_size, (len(lengths), 1), generator=gen).numpy()
        feeds.append(request(prefix_signature, tokens, cache_lengths.tolist(), [1] * len(lengths),
                             config.vocab_size, gen))
    side = EagerSide(config, dtype, manifest["weights"], plan.spans, manifest["capacity"], False, False, log,
                     float32_twin=False)
    boundaries = side.run(feeds, None, lambda t, outs: None)[0]
    wanted = [s.name for s in signature.feeds]
    return [{n: (boundary | feed)[n] for n in wanted}
            for boundary, feed in zip(boundaries, feeds, strict=True)]


def run_build_check(build_dir: str | Path, steps: int = 16, seed: int = 0, batch: int = 2,
                    prompt_len: int = 70, log: Any = print, taps: bool = False,
                    runner: str | None = None, stage: int | None = None, eager: str = AUTO,
                    speculate: int = 0) -> dict[str, Any]:
    """The chain of the build's stages (`stage`: that stage alone) against the eager model run
    as the same chain, through check's driver; returns the driver's report (steps, verdict, and
    with `taps` the taps and first divergent layer, its "stage" added) with "stages" (layer ranges),
    "stage_numbers" (their indices in the build), per step "stages" (each stage's worst output and
    whether all of its outputs are within the bound) and "first_divergent_stage" (None if none). A
    build split over ranks adds "ranks", per step "ranks" (grid.rank_entries), "first_divergent_rank"
    (None if none) and "ranks_differ" (replicated outputs that differ from rank 0's: a failure).
    A stage alone (not the first) takes the boundary the eager model of the layers before it computes
    (prefix_feeds), and random tokens at every step. `speculate` K: speculative decoding's requests
    (k3export.check.speculative), the chain's stages each rolling back on its own."""
    build_dir = Path(build_dir)
    G_LOGGER.module_severity = G_LOGGER.WARNING
    folders = stage_ranks(build_dir)
    if stage is not None and stage >= len(folders):
        raise UserError(f"--stage {stage}: {build_dir} has {len(folders)} stages (0..{len(folders) - 1})")
    numbers = [stage] if stage is not None else list(range(len(folders)))
    ranks = len(folders[0])
    choice = choose_runner(build_dir, runner, "check --build")
    gpus = max(1, torch.cuda.device_count())
    engines = engine_places(choice, numbers, gpus) if choice.kind == ENGINE else None
    exports = [folders[s][0] for s in numbers]
    # A grid's stages as the unsplit stages they compute together (its ranks' files verified).
    stages = grid_stages([folders[s] for s in numbers]) if ranks > 1 else [read_export(f) for f in exports]
    manifest, config, stage_manifests = chain_manifest(build_dir, stages)
    if taps:
        require_build_taps(build_dir, manifest)
    dtype = manifest["dtype"]
    if dtype == "bfloat16" and not engines:
        raise UserError(f"{build_dir}: ONNX Runtime's CPU provider has no bfloat16 MatMul, so --runner onnx "
                        "cannot run a bfloat16 build; check its engines on GPUs (--runner engine), or a "
                        "stage's graph as TensorRT parses it: k3export check --network DIR/stage-N")
    if ranks > 1 and (dtype != "float32" or engines) and "routing_outputs" not in manifest:
        what = "engines" if engines else f"{dtype} graphs"
        raise UserError(f"{build_dir}: a build split over {ranks} ranks whose ranks' export.json list none "
                        f"of check's outputs (routing_outputs, partial_outputs); the ranks' {what} give only "
                        "their outputs (an engine its built ones, an ONNX rank graph its pieces'): build it "
                        f"with them, k3export build RECIPE --out {build_dir} --routing-outputs (or "
                        "routing_outputs = true under the recipe's [build])")
    lengths = fitting_lengths(stage_manifests, batch, prompt_len, steps)
    ranges = [range(*m["layers"]) for m in stage_manifests]
    owner = {s["name"]: numbers[i] for i, m in enumerate(stage_manifests) for s in m["outputs"]}
    # Each stage's routing tensors: its outputs (build --routing-outputs), else intermediates.
    routing = [held_routing_names(m) if "routing_outputs" in m else
               routing_outputs(folder / GRAPH_FILE) if dtype != "float32" else []
               for m, folder in zip(stage_manifests, exports, strict=True)]
    log(choice.line())
    spans = [verified_export(ranks[0])[0]["layers"] for ranks in folders]
    log(f"build {build_dir}: {len(folders)} stages, layers " + ", ".join(f"{a}..{b - 1}" for a, b in spans)
        + (f"; stage {stage} checked alone" if stage is not None else "")
        + (f"; each split over {ranks} ranks, one worker process a rank" if ranks > 1 else ""))
    signature = Signature(carried(manifest))
    feeds = prefix_feeds(build_dir, folders, stage, signature, steps, seed, lengths, eager, log) \
        if stage else None
    grid = GridRunner([folders[s] for s in numbers], stage_manifests, Signature(manifest), routing, engines,
                      numbers) if ranks > 1 else None

    def on_step(index: int, step: dict[str, Any]) -> None:
        """Each stage's worst output (relative to its bound) and whether all of them passed; on a
        grid, each rank's partial sums."""
        step["stages"] = []
        for number in numbers:
            mine = [c for c in step["outputs"] if owner[c["name"]] == number]
            worst = max(mine, key=lambda c: c["rel"] / max(c["bound"], 1e-30))
            step["stages"].append({"stage": number, "passed": all(c["passed"] for c in mine),
                                   "worst": worst["name"], "rel": worst["rel"], "bound": worst["bound"]})
        log(" " * 12 + "stages: " + ", ".join(
            f"{s['stage']} rel {s['rel']:.1e} ({s['worst']}){'' if s['passed'] else ' FAILED'}"
            for s in step["stages"]))
        if grid:
            step["ranks"] = grid.entries[index]
            log(" " * 12 + "ranks' partial sums: " + ", ".join(
                f"{e['stage']}.{e['rank']} rel {e['worst']['rel']:.1e}{'' if e['passed'] else ' FAILED'}"
                for e in step["ranks"]))

    def graph_runner(signature: Signature, extra: list[str]) -> StatefulRunner:
        return grid if grid else ChainRunner(exports, signature, routing,
                                             [ranks[0] for ranks in engines] if engines else None)

    report, runner = compare_with_eager(
        manifest, config, None, graph_runner, steps, seed, lengths, log, taps,
        routing=[stage_output(i, name) for i, names in enumerate(routing) for name in names], on_step=on_step,
        stages=stage_manifests, eager=eager, feeds=feeds, speculate=speculate)
    report["aliased"] = dict(runner.aliased)
    held = {name for names in routing for name in names}
    if held:  # where the tensors held were read, by their names
        listed = {s["name"] for s in manifest.get("routing_outputs", [])}
        report["routing_read_from"] = "graph outputs" if held <= listed else "intermediates"
    report["build"] = str(build_dir)
    report["runner"] = choice.kind
    report["stage_folders"] = [str(folder) for folder in exports]
    report["stages"] = [[r.start, r.stop] for r in ranges]
    report["stage_numbers"] = numbers
    failing = [(s["stage"], step["step"]) for step in report["steps"] for s in step["stages"]
               if not s["passed"]]
    first = min(failing, key=lambda f: f[0]) if failing else None  # stage order; its earliest step
    report["first_divergent_stage"] = first[0] if first else None
    report["first_divergent_stage_step"] = first[1] if first else None
    if taps and report["taps"]["first_divergent"]:
        report["taps"]["first_divergent"]["stage"] = owner[report["taps"]["first_divergent"]["name"]]
    if grid:
        report["ranks"] = ranks
        report["partials_read_from"] = ", ".join(grid.partials_read_from)
        report["first_divergent_rank"] = first_divergent_rank(report["steps"])
        # A replicated output that differs between ranks fails the grid, whatever rank 0's says.
        report["ranks_differ"] = sorted({f"stage {e['stage']} rank {e['rank']}: {name}"
                                         for step in report["steps"] for e in step["ranks"]
                                         for name in e["differs_from_rank_0"]})
        report["passed"] = report["passed"] and not report["ranks_differ"]
    return report


def stage_lines(report: dict[str, Any]) -> list[str]:
    """For the terminal: each stage's worst output over the steps, and the first divergent stage."""
    lines, numbers = [], report["stage_numbers"]
    for i, (start, stop) in enumerate(report["stages"]):
        worst = max((s["stages"][i] for s in report["steps"]),
                    key=lambda s: s["rel"] / max(s["bound"], 1e-30))
        lines.append(f"stage {numbers[i]} (layers {start}..{stop - 1}): worst {worst['worst']} "
                     f"rel {worst['rel']:.2e} (bound {worst['bound']:.1e})")
    first = report["first_divergent_stage"]
    if first is None:
        lines.append("first divergent stage: none (every stage's outputs within the bound at every step)")
    else:
        start, stop = report["stages"][numbers.index(first)]
        step = next(s for s in report["steps"] if s["step"] == report["first_divergent_stage_step"])
        worst = step["stages"][numbers.index(first)]
        lines.append(f"first divergent stage: stage {first} (layers {start}..{stop - 1}) at {step['step']}: "
                     f"{worst['worst']} rel {worst['rel']:.2e} > bound {worst['bound']:.1e}")
    if "first_divergent_rank" in report:
        lines += rank_lines(report)
    tap = (report.get("taps") or {}).get("first_divergent")
    if tap:
        i = numbers.index(tap["stage"])
        start, stop = report["stages"][i]
        lines.append(f"layer {tap['layer']} is in stage {tap['stage']} (layers {start}..{stop - 1}: "
                     f"{report['stage_folders'][i]})")
    return lines

