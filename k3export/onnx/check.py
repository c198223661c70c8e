"""`k3export check --onnx DIR`: the exported graph in ONNX Runtime against the eager model.

Both sides run through Polygraphy runners (ONNX Runtime's, and `EagerRunner` for the PyTorch
model): a prefill from an empty cache, then greedy decode steps in which each side feeds back its
own caches and both take the reference's token, so that a near-tie cannot derail the comparison.

A half-precision export is held to what its dtype allows: the eager model also runs in float32
on the same weights and inputs, and at each step the outputs may differ from the eager
half-precision ones by up to twice the largest difference between eager half precision and eager
float32 in that step (never less than the dtype's fixed bound), and a greedy position is a tie
when its margin is within twice the step's largest logit spread. The spread is taken over the step
because rounding flips the router's choice on near-tied experts, a discrete change that lands in
one backend's layer 4 and the other's layer 6 and then spreads through the caches. With random
weights such near-ties are common and the bound is loose; with trained weights it tightens.
The prefill's inputs and the eager outputs are saved in Polygraphy's format, so that

    polygraphy run DIR/model.onnx --onnxrt --load-inputs DIR/check/inputs.json \\
        --load-outputs DIR/check/golden.json --atol A --rtol R

repeats the prefill comparison from the command line (the report prints the exact command).
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch
from polygraphy.backend.base import BaseRunner
from polygraphy.backend.onnxrt import OnnxrtRunner
from polygraphy.common import TensorMetadata
from polygraphy.comparator import Comparator, RunResults
from polygraphy.json import save_json
from polygraphy.logger import G_LOGGER

from k3export.artifacts import OutputDir, require, verify, write_json
from k3export.checkpoint import build_model
from k3export.config import K3Config
from k3export.errors import UserError
from k3export.onnx.export import GRAPH_FILE, MANIFEST_FILE, ExportGraph, TensorSpec, graph_signature
from k3export.parity import TOLERANCES, Tolerance, compare, top1_agreement

# Elementwise tolerances for the `polygraphy run` replay: |a - b| <= atol + rtol |b|.
CHECK_DIR, CHECK_MANIFEST = "check", "check.json"
POLYGRAPHY_TOLERANCES = {"float32": (1e-3, 1e-3), "float16": (0.1, 0.05), "bfloat16": (0.5, 0.1)}


class EagerRunner(BaseRunner):
    """Polygraphy's runner for the eager model, fed like the exported graph (`feeds` are its input
    specs) and casting to the model's own dtypes, so a float32 model can take a float16 graph's
    feeds."""

    def __init__(self, graph: ExportGraph, name: str, feeds: list[TensorSpec]) -> None:
        super().__init__(name=name)
        self.graph, self.feeds = graph, feeds
        self.inputs, self.outputs = graph_signature(graph.model.config, graph.layers, graph.model.dtype)

    def get_input_metadata_impl(self) -> TensorMetadata:
        meta = TensorMetadata()
        for spec in self.feeds:
            meta.add(spec.name, getattr(torch, spec.dtype),
                     [None if isinstance(d, str) else d for d in spec.shape])
        return meta

    def infer_impl(self, feed_dict: dict[str, np.ndarray]) -> OrderedDict[str, np.ndarray]:
        start = time.perf_counter()
        tensors = (torch.from_numpy(np.asarray(feed_dict[s.name])).to(getattr(torch, s.dtype))
                   for s in self.inputs)
        with torch.no_grad():
            outputs = self.graph(*tensors)
        self.inference_time = time.perf_counter() - start
        return OrderedDict((s.name, o.numpy()) for s, o in zip(self.outputs, outputs, strict=True))


def onnxrt_session(path: Path, threads: int | None = None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    # Spinning worker threads would slow the eager model running beside them in this process.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if threads:
        options.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def read_export(onnx_dir: Path) -> tuple[dict[str, Any], K3Config]:
    """export.json and config.json of an export folder whose files all match export.json."""
    manifest = verify(onnx_dir, MANIFEST_FILE)
    require(manifest, onnx_dir / MANIFEST_FILE, "graph", "dtype", "weights", "layers", "inputs", "outputs")
    return manifest, K3Config.from_json(onnx_dir / "config.json")


def _numpy_dtype(name: str) -> np.dtype:
    return torch.empty(0, dtype=getattr(torch, name)).numpy().dtype


def _feed(specs: list[TensorSpec], sizes: dict[str, int], vocab: int,
          gen: torch.Generator) -> dict[str, np.ndarray]:
    """Random token ids (or AttnRes boundary tensors, for a layer range) and empty caches."""
    feed = {}
    for spec in specs:
        shape = [sizes[d] if isinstance(d, str) else d for d in spec.shape]
        if spec.name == "input_ids":
            feed[spec.name] = torch.randint(0, vocab, shape, generator=gen).numpy()
        elif spec.name.startswith("attn_res."):
            feed[spec.name] = torch.randn(shape, generator=gen).numpy().astype(_numpy_dtype(spec.dtype))
        else:
            feed[spec.name] = np.zeros(shape, dtype=_numpy_dtype(spec.dtype))
    return feed


def run_check(onnx_dir: str | Path, steps: int = 16, seed: int = 0, batch: int = 2,
              prompt_len: int = 70, log: Any = print) -> dict[str, Any]:
    """Prefill of `prompt_len` tokens and `steps` decode steps; returns the report (see "passed").
    The replay files and the report go to DIR/check (a folder of check's own, replaced each run)."""
    onnx_dir = Path(onnx_dir)
    G_LOGGER.module_severity = G_LOGGER.WARNING  # Polygraphy prints every tensor's metadata at INFO
    manifest, config = read_export(onnx_dir)
    if manifest["weights"].get("stripped"):
        raise UserError(f"{onnx_dir}: exported with --no-weights, so there are no numbers to check; "
                        "it is checked structurally (onnx.checker full_check)")
    if manifest["dtype"] == "bfloat16":
        raise UserError(f"{onnx_dir}: a bfloat16 export cannot be fed through numpy; "
                        "it is checked structurally (see the README)")
    out = OutputDir(onnx_dir / CHECK_DIR, CHECK_MANIFEST, "check")
    with out.staged() as stage:
        report = _run_check(onnx_dir, manifest, config, stage, steps, seed, batch, prompt_len, log)
        write_json(stage / CHECK_MANIFEST, {"passed": report["passed"], "report": "report.json"})
    return report


def _run_check(onnx_dir: Path, manifest: dict[str, Any], config: K3Config, stage: Path, steps: int,
               seed: int, batch: int, prompt_len: int, log: Any) -> dict[str, Any]:
    """run_check's comparison, writing its files into `stage` (DIR/check once committed)."""
    dtype = manifest["dtype"]
    tolerance = TOLERANCES[dtype]
    layers = range(*manifest["layers"])
    inputs = [TensorSpec(**s) for s in manifest["inputs"]]
    log(f"eager reference: {config.num_hidden_layers} layers, {dtype}, weights {manifest['weights']}")
    runners: list[BaseRunner] = [
        EagerRunner(ExportGraph(build_model(config, getattr(torch, dtype), manifest["weights"], layers),
                                layers), "eager", inputs),
        OnnxrtRunner(onnxrt_session(onnx_dir / GRAPH_FILE), name="onnxrt"),
    ]
    if dtype != "float32":
        model32 = build_model(config, torch.float32, manifest["weights"], layers)
        runners.append(EagerRunner(ExportGraph(model32, layers), "eager-float32", inputs))
    gen = torch.Generator().manual_seed(seed)
    feed = _feed(inputs, {"batch": batch, "seq": prompt_len, "past": 0}, config.vocab_size, gen)

    check_dir = onnx_dir / CHECK_DIR
    results = Comparator.run(runners, data_loader=[feed], save_inputs_path=str(stage / "inputs.json"))
    golden = RunResults()
    golden.append(("eager", results["eager"]))
    golden.save(str(stage / "golden.json"))

    outs = [results[r.name][0] for r in runners]
    report: dict[str, Any] = {"dtype": dtype, "tolerance": tolerance.__dict__,
                              "steps": [_compare_step("prefill", outs, tolerance, log)]}
    streams: list[list[list[int]]] = [[], []]
    with contextlib.ExitStack() as active:
        for runner in runners:
            active.enter_context(runner)
        for step in range(steps):
            shared = _feed(inputs, {"batch": batch, "seq": 1, "past": 0}, config.vocab_size, gen)
            if "logits" in outs[0]:
                if "input_ids" in shared:
                    # Every side takes the reference's greedy token: a near-tie cannot derail the rest.
                    shared["input_ids"] = outs[0]["logits"][:, -1:].argmax(-1)
                for stream, out in zip(streams, outs, strict=False):
                    stream.append(out["logits"][:, -1].argmax(-1).tolist())
            feeds = [{**shared, **{s.name: out[s.name.replace("past.", "present.", 1)]
                                   for s in inputs if s.name.startswith("past.")}} for out in outs]
            # The float32 model feeds back its own float32 caches, unlike the graph's metadata says.
            outs = [runner.infer(f, check_inputs=runner.name != "eager-float32")
                    for runner, f in zip(runners, feeds, strict=True)]
            report["steps"].append(_compare_step(f"decode {step + 1}", outs, tolerance, log))
    failed = sorted({c["name"] for s in report["steps"] for c in s["outputs"] if not c["passed"]})
    mismatched = sum(s.get("tokens", {}).get("mismatches", 0) for s in report["steps"])
    report["failed_outputs"] = failed
    report["token_mismatches"] = mismatched
    report["greedy_streams_identical"] = streams[0] == streams[1]
    report["passed"] = not failed and mismatched == 0
    atol, rtol = POLYGRAPHY_TOLERANCES[dtype]
    # Elementwise replay tolerance: at least what the prefill comparison itself accepted.
    atol = max(atol, 2 * max(c["max_abs"] for c in report["steps"][0]["outputs"]))
    report["polygraphy_command"] = (
        f"polygraphy run {onnx_dir / GRAPH_FILE} --onnxrt --load-inputs {check_dir / 'inputs.json'} "
        f"--load-outputs {check_dir / 'golden.json'} --atol {atol:.3g} --rtol {rtol}")
    save_json(report, str(stage / "report.json"), description="check report")
    return report


def _compare_step(label: str, outs: list[dict[str, np.ndarray]], tolerance: Tolerance,
                  log: Any) -> dict[str, Any]:
    """outs: the eager reference, ONNX Runtime, and for half precision the eager float32 model."""
    reference, actual = outs[0], outs[1]
    bound, margin = tolerance, tolerance.margin
    if len(outs) > 2:
        spread = max(compare(name, ref, outs[2][name], tolerance).rel for name, ref in reference.items())
        bound = Tolerance(max(tolerance.rel, 2 * spread), tolerance.margin)
        if "logits" in reference:
            diff = np.abs(reference["logits"].astype(np.float64) - outs[2]["logits"]).max()
            margin = max(tolerance.margin, 2 * float(diff))
    comparisons = [compare(name, actual[name], ref, bound) for name, ref in reference.items()]
    step: dict[str, Any] = {"step": label, "outputs": [c.as_dict() for c in comparisons]}
    worst = max(comparisons, key=lambda c: c.rel / c.bound)
    line = f"{label:>10}: worst {worst.name} rel {worst.rel:.2e} (bound {worst.bound:.1e})"
    if "logits" in reference:
        logits = next(c for c in comparisons if c.name == "logits")
        tokens = top1_agreement(actual["logits"], reference["logits"], margin)
        step["tokens"] = tokens.as_dict()
        line += (f"; logits rel {logits.rel:.2e} cos {logits.cosine:.6f}; top-1 {tokens.agree}/"
                 f"{tokens.positions} (ties {tokens.ties}, mismatches {tokens.mismatches})")
    failed = [c.name for c in comparisons if not c.passed]
    log(line + (f"  FAILED: {', '.join(failed)}" if failed else ""))
    return step
