"""Check's one driver: the same requests to an artifact's runner and to the eager model, compared
step by step, and the verdict.

`compare_with_eager` serves every artifact: it takes the artifact's runner (k3export.check.runners,
on k3export.onnx.runner.StatefulRunner) and runs it beside `EagerRunner` (the PyTorch model), each
holding its own caches, as a serving runtime does. The requests: a prefill of a right-padded batch
of prompts of different lengths from empty caches, then greedy decode steps in which every side
takes the reference's token, so that a near-tie cannot derail the comparison. Only the valid entries
are compared (k3export.check.compare): each row's first input_lengths[b] positions, the cache rows
written so far, and the KDA states and conv tails. A request that does not fit the cache capacity is
refused before any runner runs. `run_check` is `check --onnx DIR` (and, with an engine's runner,
`check --engine`): the driver over one export folder, its replay files and report in DIR/check.

A half-precision export is held to what its dtype allows: the eager model also runs in float32
on the same weights and inputs, and at each step the outputs may differ from the eager
half-precision ones by up to twice the largest difference between eager half precision and eager
float32 in that step (never less than the dtype's fixed bound), and a greedy position is a tie
when its margin is within twice the step's largest logit spread. The spread is taken over the step
because rounding flips the router's choice on near-tied experts, a discrete change that lands in
one backend's layer 4 and the other's layer 6 and then spreads through the caches; so the eager
routers are also held to the graph's own expert choices (k3export.check.routing). With random
weights such near-ties are common and the bound is loose; with trained weights it tightens.
The prefill's inputs (caches included) and the eager outputs are saved in Polygraphy's format, so
that

    polygraphy run DIR/model.onnx --onnxrt --load-inputs DIR/check/inputs.json \\
        --load-outputs DIR/check/golden.json --atol A --rtol R

repeats the prefill comparison from the command line (the report prints the exact command).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from polygraphy.comparator import IterationResult, RunResults
from polygraphy.json import save_json
from polygraphy.logger import G_LOGGER

from k3export.artifacts import OutputDir, require, verify, write_json
from k3export.check.compare import (
    TOLERANCES,
    Tolerance,
    compare,
    half_precision_tolerance,
    nonfinite_tensors,
    top1_agreement,
    verdict,
)
from k3export.check.machine import machine
from k3export.check.routing import held_routing, routing_outputs
from k3export.check.runners.eager import EagerRunner, Float32Boundary
from k3export.check.taps import compare_taps, first_divergent
from k3export.config import K3Config
from k3export.errors import UserError
from k3export.onnx.export import GRAPH_FILE, MANIFEST_FILE, ExportGraph, TensorSpec, resolve_shape
from k3export.onnx.runner import BoundOnnxrtRunner, Signature, StatefulRunner, numpy_dtype
from k3export.options import require_request_fits
from k3export.progress import track
from k3export.weights.checkpoint import build_model

CHECK_DIR, CHECK_MANIFEST = "check", "check.json"
# Elementwise tolerances for the `polygraphy run` replay: |a - b| <= atol + rtol |b|.
POLYGRAPHY_TOLERANCES = {"float32": (1e-3, 1e-3), "float16": (0.1, 0.05), "bfloat16": (0.5, 0.1)}
Arrays = dict[str, np.ndarray]


def valid_entries(spec: TensorSpec, array: np.ndarray, lengths_after: np.ndarray,
                  input_lengths: np.ndarray) -> np.ndarray:
    """The entries of an output that mean something, flattened row by row: along "seq" each row's
    first input_lengths[b], along "capacity" the rows written so far (lengths_after[b])."""
    limits = input_lengths if "seq" in spec.shape else lengths_after if "capacity" in spec.shape else None
    if limits is None:
        return array.ravel()
    batch_axis = spec.shape.index("batch")
    axis = spec.shape.index("seq" if "seq" in spec.shape else "capacity")
    axis -= axis > batch_axis  # once the batch axis is taken
    rows = [np.take(np.take(array, b, axis=batch_axis), np.arange(n), axis=axis).ravel()
            for b, n in enumerate(limits)]
    return np.concatenate(rows)


def read_export(onnx_dir: Path) -> tuple[dict[str, Any], K3Config]:
    """export.json and config.json of an export folder whose files all match export.json."""
    manifest = verify(onnx_dir, MANIFEST_FILE)
    require(manifest, onnx_dir / MANIFEST_FILE, "graph", "dtype", "weights", "layers", "inputs", "outputs",
            "capacity")
    return manifest, K3Config.from_json(onnx_dir / "config.json")


def prompt_lengths(batch: int, prompt_len: int) -> list[int]:
    """Rows of different lengths, the first `prompt_len` long, so every check covers padding."""
    return [max(1, prompt_len * (batch - b) // batch) for b in range(batch)]


def request(signature: Signature, tokens: np.ndarray | None, cache_lengths: list[int],
            input_lengths: list[int], vocab: int, gen: torch.Generator) -> dict[str, np.ndarray]:
    """One call's feeds: `tokens` (random ones if None) or random AttnRes boundary tensors for a range."""
    batch, seq = len(cache_lengths), max(input_lengths)
    sizes = {"batch": batch, "seq": seq}
    feed = {"cache_lengths": np.array(cache_lengths, np.int64),
            "input_lengths": np.array(input_lengths, np.int64)}
    for spec in signature.feeds:
        shape = resolve_shape(spec, sizes) if spec.name not in feed else None
        if spec.name == "input_ids":
            feed[spec.name] = (torch.randint(0, vocab, shape, generator=gen).numpy() if tokens is None
                               else tokens.astype(np.int64))
        elif spec.name.startswith("attn_res."):
            feed[spec.name] = torch.randn(shape, generator=gen).numpy().astype(numpy_dtype(spec.dtype))
    return feed


def last_tokens(logits: np.ndarray, input_lengths: list[int]) -> np.ndarray:
    """Each row's greedy token at its last valid position, [batch, 1]."""
    if logits.ndim == 2:  # --last-logits
        return logits.argmax(-1)[:, None]
    return np.array([[logits[b, n - 1].argmax()] for b, n in enumerate(input_lengths)])


def fitting_lengths(manifests: list[dict[str, Any]], batch: int, prompt_len: int, steps: int) -> list[int]:
    """The prompt lengths of a check of the exports of `manifests` (one, or a build's stages),
    refused (UserError) unless the longest row's prompt and decode steps fit their cache capacity
    and the graph's and the eager model's caches fit this machine's memory."""
    require_request_fits(f"--batch {batch} --prompt-len {prompt_len} --steps {steps}", manifests, batch,
                         prompt_len, steps, copies=2)
    return prompt_lengths(batch, prompt_len)


def planned(export_dir: Path, taps: bool, batch: int, prompt_len: int,
             steps: int) -> tuple[dict[str, Any], K3Config, list[int]]:
    """An export folder's manifest and config, verified, and the prompt lengths of a check that is
    known to fit its cache capacity (the prefill, then the last decode step of the longest row)."""
    manifest, config = read_export(export_dir)
    if taps:
        require_taps(manifest, export_dir)
    if manifest["weights"].get("stripped"):
        raise UserError(f"{export_dir}: exported with --no-weights, so there are no numbers to check; "
                        "it is checked structurally (onnx.checker full_check)")
    if "parallel" in manifest:
        split = manifest["parallel"]
        raise UserError(f"{export_dir}: rank {split['rank']} of {split['ranks']} of a split model (its "
                        "export.json's 'parallel'); a rank computes only its share, summed with the other "
                        "ranks': check the grid it belongs to, k3export check --build BUILD_DIR "
                        "(docs/parallel.md)")
    return manifest, config, fitting_lengths([manifest], batch, prompt_len, steps)


def run_check(onnx_dir: str | Path, steps: int = 16, seed: int = 0, batch: int = 2,
              prompt_len: int = 70, log: Any = print, taps: bool = False,
              graph_runner: Callable[[Signature, list[str]], StatefulRunner] | None = None) -> dict[str, Any]:
    """A prefill of `batch` prompts of different lengths (the longest `prompt_len`), right-padded,
    then `steps` decode steps, ONNX Runtime against eager; returns the report (see "passed"). The
    replay files and the report go to DIR/check (a folder of check's own, replaced each run).
    `taps`: also compare the export's taps (export --taps) and name the first divergent layer.
    `graph_runner(signature, extra outputs)`: the artifact's runner in place of ONNX Runtime
    (check --engine)."""
    onnx_dir = Path(onnx_dir)
    G_LOGGER.module_severity = G_LOGGER.WARNING  # Polygraphy prints every tensor's metadata at INFO
    manifest, config, lengths = planned(onnx_dir, taps, batch, prompt_len, steps)
    if manifest["dtype"] == "bfloat16" and graph_runner is None:
        raise UserError(f"{onnx_dir}: ONNX Runtime's CPU provider has no bfloat16 MatMul; check the "
                        f"bfloat16 graph as TensorRT parses it: k3export check --network {onnx_dir}")
    graph = onnx_dir / GRAPH_FILE
    out = OutputDir(onnx_dir / CHECK_DIR, CHECK_MANIFEST, "check", overwrite=None,
                    option="the check's folder")
    # The replay is `polygraphy run --onnxrt`, which cannot run bfloat16 (nor numpy hold it).
    replayable = manifest["dtype"] != "bfloat16"
    with out.staged() as stage:
        signature = Signature(manifest)
        report, session = compare_with_eager(
            manifest, config, graph,
            graph_runner or (lambda sig, extra: BoundOnnxrtRunner(graph, sig, extra_outputs=extra)),
            steps, seed, lengths, log, taps,
            on_prefill=(lambda feed, golden: _save_replay(stage, signature, feed, golden, len(lengths)))
            if replayable else None)
        report["aliased"] = dict(session.aliased)
        if replayable:
            report["polygraphy_command"] = _replay_command(onnx_dir, manifest["dtype"], report)
        save_json(report, str(stage / "report.json"), description="check report")
        write_json(stage / CHECK_MANIFEST, {"passed": report["passed"], "report": "report.json"})
    return report


def _replay_command(onnx_dir: Path, dtype: str, report: dict[str, Any]) -> str:
    """The `polygraphy run` command that replays the prefill comparison from the saved files."""
    atol, rtol = POLYGRAPHY_TOLERANCES[dtype]
    # Elementwise replay tolerance: room for the prefill's own error when it passed (half precision
    # may exceed the fixed atol), the fixed one when it failed, so the replay fails too.
    prefill = report["steps"][0]["outputs"]
    if all(c["passed"] for c in prefill):
        atol = max(atol, 2 * max(c["max_abs"] for c in prefill))
    check_dir = onnx_dir / CHECK_DIR
    return (f"polygraphy run {onnx_dir / GRAPH_FILE} --onnxrt --load-inputs {check_dir / 'inputs.json'} "
            f"--load-outputs {check_dir / 'golden.json'} --atol {atol:.3g} --rtol {rtol}")


def require_taps(manifest: dict[str, Any], folder: Path) -> None:
    if "taps" not in manifest:
        raise UserError(f"--taps: {folder / MANIFEST_FILE} lists no taps outputs; expected an export "
                        f"written with `k3export export --taps`")


def tap_step(label: str, signature: Signature, outs: list[dict[str, np.ndarray]], lengths_after: np.ndarray,
             input_lengths: np.ndarray, tolerance: Tolerance) -> dict[str, Any]:
    """One step's taps compared (k3export.check.taps.compare_taps): outs as _compare_step's."""
    valid = [{s.name: valid_entries(s, out[s.name], lengths_after, input_lengths) for s in signature.taps}
             for out in outs]
    return {"step": label, "taps": compare_taps(valid[0], valid[1], valid[2] if len(outs) > 2 else None,
                                                tolerance)}


def carried(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest with bfloat16 tensors declared float32, as they cross numpy."""
    def widen(specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{**s, "dtype": "float32" if s["dtype"] == "bfloat16" else s["dtype"]} for s in specs]

    return {**manifest, "inputs": widen(manifest["inputs"]), "outputs": widen(manifest["outputs"])}


def compare_with_eager(manifest: dict[str, Any], config: K3Config, graph: Path | None,
                       graph_runner: Callable[[Signature, list[str]], StatefulRunner], steps: int, seed: int,
                       lengths: list[int], log: Any, taps: bool = False,
                       on_prefill: Callable[[Arrays, Arrays], None] | None = None,
                       eager_graph: Callable[[torch.nn.Module, bool], Any] | None = None,
                       routing: list[str] | None = None,
                       on_step: Callable[[dict[str, Any]], None] | None = None,
                       ) -> tuple[dict[str, Any], StatefulRunner]:
    """The one check driver, for every backend: `graph_runner(signature, extra_outputs)` (ONNX
    Runtime, the parsed TensorRT network) against the eager model, and for half precision the eager
    float32 model, all fed the same requests: a prefill of right-padded prompts of `lengths` from
    empty caches, then `steps` greedy decode steps in which each side keeps its own caches and all
    take the eager model's token. Half precision holds the eager routers to the graph's expert
    choices (k3export.check.routing; `extra_outputs` are those tensors). Valid entries only are compared.
    Returns the report, verdict included, and the graph's runner.

    For an artifact that is not one graph (check --build: a chain of stage sessions) the caller
    gives `eager_graph(model, taps)`, the eager model run the artifact's way with flat tensors in
    and out in the manifest's order (default: ExportGraph over the manifest's layers), `routing`,
    the graph runner's routing outputs in layer order (default: read from `graph`), and
    `on_step(step)`, called with each step's report entry as it is made (to add its own columns)."""
    dtype = manifest["dtype"]
    tolerance = TOLERANCES[dtype]
    layers = range(*manifest["layers"])
    last_logits = manifest.get("last_logits", False)
    signature = Signature(carried(manifest))
    tapped = "taps" in manifest  # the graph gives them, compared or not
    log(f"eager reference: {config.num_hidden_layers} layers, {dtype}, weights {manifest['weights']}; "
        f"prompts of {lengths} tokens, cache capacity {signature.capacity}")
    models = [build_model(config, getattr(torch, dtype), manifest["weights"], layers)]
    nonfinite_weights = nonfinite_tensors(models[0].named_parameters())
    if dtype != "float32":
        models.append(build_model(config, torch.float32, manifest["weights"], layers))
    # Where the graph's expert choices are read: its own outputs (export --routing-outputs), or
    # intermediates the runner exposes.
    source = "graph outputs" if "routing_outputs" in manifest else "intermediates"
    if routing is None:
        routing = ([] if dtype == "float32" else [s["name"] for s in manifest["routing_outputs"]]
                   if source == "graph outputs" else routing_outputs(graph))
    eager_graph = eager_graph or (lambda model, tapped: ExportGraph(model, layers, last_logits, tapped))
    eager = eager_graph(models[0], tapped)
    if dtype == "bfloat16":
        eager = Float32Boundary(eager, Signature(manifest).inputs)
    eager_runners = [EagerRunner(eager, "eager", signature)]
    if dtype != "float32":
        eager_runners.append(EagerRunner(eager_graph(models[1], tapped), "eager-float32", signature))
    graph_side = graph_runner(signature, routing)
    gen = torch.Generator().manual_seed(seed)
    batch, prompt_len = len(lengths), max(lengths)
    feed = request(signature, None, [0] * batch, lengths, config.vocab_size, gen)
    # Pad with token 0, as a server would: any value works, none is read.
    if "input_ids" in feed:
        feed["input_ids"][np.arange(prompt_len) >= np.array(lengths)[:, None]] = 0
    report: dict[str, Any] = {"dtype": dtype, "tolerance": tolerance.__dict__, "prompt_lengths": lengths,
                              "capacity": signature.capacity, "held_routing": bool(routing),
                              "routing_read_from": source if routing else None, "steps": []}
    tap_steps: list[dict[str, Any]] = []
    streams: list[list[list[int]]] = [[], []]
    cache_lengths = np.zeros(batch, np.int64)
    with contextlib.ExitStack() as running:
        for runner in [graph_side, *eager_runners]:
            running.enter_context(runner)
            runner.reset(batch)
        for step in track(range(steps + 1), "check: prefill and decode steps"):
            label = "prefill" if step == 0 else f"decode {step}"
            graph_out = graph_side.infer(feed, check_inputs=False)
            choices = [graph_out[name] for name in routing]
            eager_outs, flips = [], {}
            for runner, model in zip(eager_runners, models, strict=True):
                with held_routing(model, choices) if routing else contextlib.nullcontext([]) as flipped:
                    # The float32 model takes the graph's half-precision feeds, unlike its metadata says.
                    eager_outs.append(runner.infer(feed, check_inputs=False))
                flips[runner.name] = sum(flipped)
            outs = [eager_outs[0], graph_out, *eager_outs[1:]]
            if step == 0 and on_prefill:
                on_prefill(feed, outs[0])
            input_lengths = feed["input_lengths"]
            cache_lengths = cache_lengths + input_lengths
            report["steps"].append(_compare_step(label, signature, outs, cache_lengths, input_lengths,
                                                 tolerance, log))
            if taps:
                tap_steps.append(tap_step(label, signature, outs, cache_lengths, input_lengths, tolerance))
            if routing:
                # Token-layer choices where each eager model would have picked other experts.
                report["steps"][-1]["routing_flips"] = flips
            if on_step:
                on_step(report["steps"][-1])
            tokens = None
            if "logits" in outs[0]:
                for stream, out in zip(streams, outs, strict=False):
                    stream.append(last_tokens(out["logits"], input_lengths.tolist())[:, 0].tolist())
                # Every side takes the reference's greedy token: a near-tie cannot derail the rest.
                tokens = last_tokens(outs[0]["logits"], input_lengths.tolist())
            feed = request(signature, tokens, cache_lengths.tolist(), [1] * batch, config.vocab_size, gen)
    report.update(verdict(report["steps"], nonfinite_weights))
    report["machine"] = machine()
    report["routing_flips"] = sum(s.get("routing_flips", {}).get("eager", 0) for s in report["steps"])
    report["greedy_streams_identical"] = streams[0] == streams[1]
    if taps:
        report["taps"] = {"steps": tap_steps, "first_divergent": first_divergent(tap_steps)}
    return report, graph_side


def _save_replay(stage: Path, signature: Signature, feed: dict[str, np.ndarray],
                 golden: dict[str, np.ndarray], batch: int) -> None:
    """The prefill's full inputs (empty caches included) and the eager outputs, in Polygraphy's
    format, for `polygraphy run --onnxrt` (which feeds every input itself, copying the caches)."""
    full = {**feed, **signature.empty_caches(batch)}
    save_json([OrderedDict((s.name, full[s.name]) for s in signature.inputs)], str(stage / "inputs.json"),
              description="check inputs")
    results = RunResults()
    outputs = {name: np.copy(value) for name, value in golden.items()}
    results.append(("eager", [IterationResult(outputs, runner_name="eager")]))
    results.save(str(stage / "golden.json"))


def _compare_step(label: str, signature: Signature, outs: list[dict[str, np.ndarray]],
                  lengths_after: np.ndarray, input_lengths: np.ndarray, tolerance: Tolerance,
                  log: Any) -> dict[str, Any]:
    """outs: the eager reference, the graph's runner, and for half precision the eager float32
    model; compared on their valid entries only."""
    valid = [{s.name: valid_entries(s, out[s.name], lengths_after, input_lengths) for s in signature.compared}
             for out in outs]
    reference, actual = valid[0], valid[1]
    bound, margin = tolerance, tolerance.margin
    if len(outs) > 2:
        spread = max(compare(name, ref, valid[2][name], tolerance).rel for name, ref in reference.items())
        logit_spread = 0.0
        if "logits" in reference:
            logit_spread = float(np.abs(reference["logits"].astype(np.float64) - valid[2]["logits"]).max())
        bound = half_precision_tolerance(tolerance, spread, logit_spread)
        margin = bound.margin
    comparisons = [compare(name, actual[name], ref, bound) for name, ref in reference.items()]
    step: dict[str, Any] = {"step": label, "outputs": [c.as_dict() for c in comparisons]}
    worst = max(comparisons, key=lambda c: c.rel / c.bound)
    line = f"{label:>10}: worst {worst.name} rel {worst.rel:.2e} (bound {worst.bound:.1e})"
    if "logits" in reference:
        vocab = outs[0]["logits"].shape[-1]
        logits = next(c for c in comparisons if c.name == "logits")
        tokens = top1_agreement(actual["logits"].reshape(-1, vocab), reference["logits"].reshape(-1, vocab),
                                margin)
        step["tokens"] = tokens.as_dict()
        line += (f"; logits rel {logits.rel:.2e} cos {logits.cosine:.6f}; top-1 {tokens.agree}/"
                 f"{tokens.positions} (ties {tokens.ties}, mismatches {tokens.mismatches})")
    failed = [c.name for c in comparisons if not c.passed]
    nonfinite = [c.name for c in comparisons if not c.finite]
    if nonfinite:
        step["nonfinite"] = nonfinite
        line += f"; NaN/Inf in {', '.join(nonfinite)}"
    log(line + (f"  FAILED: {', '.join(failed)}" if failed else ""))
    return step
